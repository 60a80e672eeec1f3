"""Per-call marker bookkeeping shared by both engines, and the traced (compiled) engine.

``MarkerState`` follows the ``checkpoint_record`` markers of one checkpointed call as a
small state machine: which declared intervals are open, which kept ones, and errors for
markers that are unknown, unbalanced or wrongly nested (naming the layer, the marker
and what was expected). ``TracedRegion`` adds per-op decisions for
``torch.utils.checkpoint``'s selective-checkpoint modes; it runs when a layer is compiled,
where AOTAutograd's partitioner then saves only what the backward graph reads. Eager
layers use ``scoped.ScopedRegion`` instead. Imports: ``ops``, ``markers``, ``units``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from actplan._engine.ops import _TRAITS, always_replayed, always_saved, op_traits
from actplan.markers import LAYER_END, MARKER_OP
from actplan.units import MarkerInterval

if TYPE_CHECKING:
    from actplan._engine.policy import IntervalPolicy

_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE

# torch < 2.13 also calls the policy during recompute (ctx.is_recompute=True) and
# expects the same answers; newer torch replays cached decisions by index itself.
_POLICY_CALLED_ON_RECOMPUTE = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)


class MarkerError(RuntimeError):
    """Markers emitted by a layer do not match its ``RecomputeIntervalMap``."""


class KeptTensorMutatedError(RuntimeError):
    """An in-place op modified a tensor the selective policy had already saved."""


def mutation_error(
    layer_name: str, func: Any, producer_op: Any, kept: str | None, routing: bool = False
) -> KeptTensorMutatedError:
    """The error for an in-place op (``func``; ``None`` when the change is only seen in backward)
    that changed a saved output of ``producer_op``. ``kept`` describes the kept interval that
    holds it (``None``: held because it is a routing or collective output); ``routing``: the
    producer is a routing or collective op, saved whatever the plan while save_collectives is on."""
    if func is None:
        holder = "a routing or collective output" if kept is None else f"held for backward by the kept {kept}"
        head = (
            f"{layer_name}: an output of {producer_op}, {holder}, was changed in place after the "
            "forward computed it; backward would read the changed values."
        )
    elif kept is None:
        head = (
            f"{layer_name}: in-place op {func} modifies the output of {producer_op}, a routing or "
            "collective op whose outputs are always saved (so recompute never re-routes or "
            "re-communicates); backward would read a stale copy."
        )
    else:
        head = (
            f"{layer_name}: in-place op {func} modifies the output of {producer_op}, which the kept "
            f"{kept} holds for backward; backward would read a stale copy."
        )
    fixes = ["write that update out-of-place (e.g. `order = order + 1` instead of `order += 1`)"]
    if routing or kept is None:
        # Saved because it routes: not keeping the unit alone would change nothing.
        unit = "do not keep the unit it runs in" if kept is None else "do not keep that unit"
        fixes.append(
            f"for code you cannot change, set save_collectives: false and {unit} (routing ops are "
            "then recomputed, exact when they are deterministic: check with actplan verify)"
        )
    else:
        fixes.append("do not keep that unit")
    return KeptTensorMutatedError(f"{head} Fix: {'; or '.join(fixes)}.")


class MarkerState:
    """Marker state for one checkpointed call of one layer."""

    def __init__(self, policy: IntervalPolicy, layer_name: str | None = None) -> None:
        self.policy = policy
        self.layer_name = layer_name or policy.layer_name
        # interval -> (sequence number of the marker that opened it, op_count then)
        self.open: dict[MarkerInterval, tuple[int, int]] = {}
        # Open kept intervals, innermost last; and every kept interval opened so far.
        self.kept: list[MarkerInterval] = []
        self.kept_seen: set[MarkerInterval] = set()
        self.marker_seq = 0
        self.op_count = 0
        self.finished = False

    def on_marker(self, marker: str) -> None:
        """Advance the marker state machine (eager: called directly; compiled: via the op)."""
        if self.finished:
            # The replay in backward reruns the forward and its markers: decisions are
            # already made by then.
            return
        policy = self.policy
        if marker == LAYER_END:
            self._finish()
            return
        closes = policy._closes.get(marker, ())
        opens = policy._opens.get(marker, ())
        if not closes and not opens:
            known = ", ".join(sorted(policy.interval_map.markers))
            raise MarkerError(
                f"{self.layer_name}: unknown marker {marker!r}; the layer's RecomputeIntervalMap "
                f"uses markers {known}. Declare an interval that starts or ends at {marker!r}, or "
                "remove the checkpoint_record call."
            )
        self.marker_seq += 1
        for span in closes:
            if span not in self.open:
                raise MarkerError(
                    f"{self.layer_name}: unbalanced marker {marker!r}: it ends "
                    f"{policy.describe(span)}, which is not open; expected marker {span.start!r} "
                    "before it"
                )
        for span in closes:
            opened_seq, opened_ops = self.open[span]
            for other, (other_seq, _) in self.open.items():
                if other_seq > opened_seq and other not in closes:
                    raise MarkerError(
                        f"{self.layer_name}: wrongly nested marker {marker!r}: it ends "
                        f"{policy.describe(span)} while {policy.describe(other)}, opened inside "
                        f"it, is still open; expected marker {other.end!r} first"
                    )
        for span in closes:
            _, opened_ops = self.open.pop(span)
            if span in policy.kept_intervals:
                self.kept.remove(span)
                if opened_ops == self.op_count:
                    policy.warn_idle(span, self.layer_name, "ran no op")
        for span in opens:
            if span in self.open:
                raise MarkerError(
                    f"{self.layer_name}: unbalanced marker {marker!r}: it starts "
                    f"{policy.describe(span)} again before that interval ended; expected marker "
                    f"{span.end!r} first"
                )
            self.open[span] = (self.marker_seq, self.op_count)
            if span in policy.kept_intervals:
                self.kept.append(span)
                self.kept_seen.add(span)
                policy._ever_ran.add(span)

    def _finish(self) -> None:
        self.finished = True
        if self.open:
            span = max(self.open, key=lambda s: self.open[s][0])
            raise MarkerError(
                f"{self.layer_name}: unbalanced markers: {self.policy.describe(span)} is "
                f"still open when the forward returns; expected marker {span.end!r}"
            )
        for span in self.policy.kept_intervals - self.kept_seen - self.policy._ever_ran:
            self.policy.warn_idle(
                span, self.layer_name, f"never ran (marker {span.start!r} was not emitted) in any layer yet"
            )


class TracedRegion(MarkerState):
    """Per-op decisions for torch's selective-checkpoint modes (compiled layers).

    Inside a kept interval an op is ``MUST_SAVE``; routing, collective and
    device-to-host ops always are; views, in-place, uninitialised and random ops never
    are; everything else is ``PREFER_RECOMPUTE``. Under ``torch.compile`` these tags
    reach the partitioner, which saves a tagged output only if the backward graph reads it.
    """

    def __init__(self, policy: IntervalPolicy, layer_name: str | None = None) -> None:
        super().__init__(policy, layer_name)
        # Storages of saved outputs -> (producing op, kept interval or None if always saved).
        self.cached: dict[int, tuple[Any, MarkerInterval | None]] = {}
        self.log: dict | None = defaultdict(list) if _POLICY_CALLED_ON_RECOMPUTE else None
        self.replay_index: dict = defaultdict(int)

    def decide(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if ctx.is_recompute:
            return self._replay(func)
        if func is MARKER_OP:
            self.on_marker(args[0])
            decision = _RECOMPUTE
        else:
            self.op_count += 1
            traits = _TRAITS.get(id(func)) or op_traits(func)
            if traits.mutated and self.cached:
                self._check_mutation(func, traits.mutated, args, kwargs)
            if always_replayed(traits, args, kwargs):
                decision = _RECOMPUTE
            elif self.kept:
                decision = _SAVE
                self._remember(ctx, func, self.kept[-1])
            elif self.policy.save_collectives and always_saved(traits, args, kwargs):
                decision = _SAVE
                self._remember(ctx, func, None)
            else:
                decision = _RECOMPUTE
        if self.log is not None:
            self.log[func].append(decision)
        return decision

    def _remember(self, ctx, func, interval: MarkerInterval | None) -> None:
        # torch < 2.13 gives no op_output: mutations are then caught by torch itself in backward.
        outputs = getattr(ctx, "op_output", None)
        for out in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                self.cached.setdefault(out.untyped_storage()._cdata, (func, interval))

    def _check_mutation(self, func, mutated, args, kwargs) -> None:
        for position, name in mutated:
            target = args[position] if position < len(args) else kwargs.get(name)
            if not isinstance(target, torch.Tensor) or target.device.type == "meta":
                continue
            producer = self.cached.get(target.untyped_storage()._cdata)
            if producer is None:
                continue
            producer_op, interval = producer
            kept = None if interval is None else self.policy.describe(interval)
            routing = self.policy.save_collectives and op_traits(producer_op).always_saved
            raise mutation_error(self.layer_name, func, producer_op, kept, routing)

    def _replay(self, func) -> CheckpointPolicy:
        if self.log is None:
            raise RuntimeError(
                "this torch build calls the selective-checkpoint policy during recompute, which "
                f"actplan did not expect for torch {torch.__version__}; please report it"
            )
        index = self.replay_index[func]
        self.replay_index[func] = index + 1
        return self.log[func][index]
