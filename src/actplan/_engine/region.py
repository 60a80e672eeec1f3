"""Per-call marker bookkeeping shared by both engines, and the traced (compiled) engine.

``MarkerState`` follows the ``checkpoint_record`` markers of one checkpointed call as a
small state machine: which declared intervals are open, which kept ones, and errors for
markers that are unknown, unbalanced or wrongly nested (naming the layer, the marker
and what was expected). It reads the plan (``IntervalPlan``) and notes in the policy's
``LearntState`` which kept intervals ran. ``TracedRegion`` adds per-op decisions for
``torch.utils.checkpoint``'s selective-checkpoint modes; it runs when a layer is compiled,
where AOTAutograd's partitioner then saves only what the backward graph reads. Eager
layers use ``scoped.ScopedRegion`` instead. Imports: ``ops``, ``markers``, ``units``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from actplan._engine.interval_plan import IntervalPlan
from actplan._engine.learnt import LearntState
from actplan._engine.ops import _TRAITS, Keep, keep_decision, op_traits
from actplan._torch_internals import storage_key
from actplan.markers import LAYER_END, MARKER_OP
from actplan.units import MarkerInterval

_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


def _partitioner(args: Any, kwargs: Any) -> bool:
    # The traced engine's answer to "does this cheap kept op read a held output?": it leaves
    # that to AOTAutograd's partitioner. Tagged PREFER_RECOMPUTE, the op is recomputed in
    # backward from whatever the graph saves, its MUST_SAVE inputs included, which is what the
    # eager engine reaches by holding such an op and releasing it at the end of the forward.
    return False


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


def rewrite_error(layer_name: str, func: Any, producer_op: Any) -> KeptTensorMutatedError:
    """The error for an in-place op (``func``) that changed an output of a routing op
    (``producer_op``) which that op's own backward reads, as top-k's backward reads its indices:
    found after the replay, before backward reads it."""
    return KeptTensorMutatedError(
        f"{layer_name}: in-place op {func} changes an output of {producer_op} after autograd saved it "
        f"for {producer_op}'s own backward (as top-k's backward reads its indices); backward would "
        "read the changed values. Without checkpointing, autograd refuses this backward too (a "
        "variable needed for gradient computation was modified by an inplace operation). Fix: write "
        "that update out-of-place (e.g. `ids = ids + 1` instead of `ids += 1`), or change a clone."
    )


class MarkerState:
    """Marker state for one checkpointed call of one layer."""

    def __init__(self, plan: IntervalPlan, learnt: LearntState, layer_name: str | None = None) -> None:
        self.plan = plan
        self.learnt = learnt
        self.layer_name = layer_name or plan.layer_name
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
        plan = self.plan
        if marker == LAYER_END:
            self._finish()
            return
        closes = plan.closes.get(marker, ())
        opens = plan.opens.get(marker, ())
        if not closes and not opens:
            known = ", ".join(sorted(plan.interval_map.markers))
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
                    f"{plan.describe(span)}, which is not open; expected marker {span.start!r} "
                    "before it"
                )
        for span in closes:
            opened_seq, opened_ops = self.open[span]
            for other, (other_seq, _) in self.open.items():
                if other_seq > opened_seq and other not in closes:
                    raise MarkerError(
                        f"{self.layer_name}: wrongly nested marker {marker!r}: it ends "
                        f"{plan.describe(span)} while {plan.describe(other)}, opened inside "
                        f"it, is still open; expected marker {other.end!r} first"
                    )
        for span in closes:
            _, opened_ops = self.open.pop(span)
            if span in plan.kept_intervals:
                self.kept.remove(span)
                if opened_ops == self.op_count:
                    self.learnt.warn_idle(plan, span, self.layer_name, "ran no op")
        for span in opens:
            if span in self.open:
                raise MarkerError(
                    f"{self.layer_name}: unbalanced marker {marker!r}: it starts "
                    f"{plan.describe(span)} again before that interval ended; expected marker "
                    f"{span.end!r} first"
                )
            self.open[span] = (self.marker_seq, self.op_count)
            if span in plan.kept_intervals:
                self.kept.append(span)
                self.kept_seen.add(span)
                self.learnt.ever_ran.add(span)

    def _finish(self) -> None:
        self.finished = True
        if self.open:
            span = max(self.open, key=lambda s: self.open[s][0])
            raise MarkerError(
                f"{self.layer_name}: unbalanced markers: {self.plan.describe(span)} is "
                f"still open when the forward returns; expected marker {span.end!r}"
            )
        for span in self.plan.kept_intervals - self.kept_seen - self.learnt.ever_ran:
            what = f"never ran (marker {span.start!r} was not emitted) in any layer yet"
            self.learnt.warn_idle(self.plan, span, self.layer_name, what)


class TracedRegion(MarkerState):
    """Per-op decisions for torch's selective-checkpoint modes (compiled layers).

    ``ops.keep_decision`` tags each op: held ops ``MUST_SAVE`` (a kept interval's expensive
    ops; routing, collective and device-to-host ops), the rest ``PREFER_RECOMPUTE``. Unlike
    the eager engine it never holds a cheap op for reading a held output (``_partitioner``).
    Under ``torch.compile`` these tags reach the partitioner, which saves a tagged output only
    if the backward graph reads it.
    """

    def __init__(self, plan: IntervalPlan, learnt: LearntState, layer_name: str | None = None) -> None:
        super().__init__(plan, learnt, layer_name)
        # Storages of saved outputs -> (producing op, kept interval or None if always saved).
        self.cached: dict[int, tuple[Any, MarkerInterval | None]] = {}
        # Some torch releases call the policy again during recompute (ctx.is_recompute) and
        # expect the same answers; others replay the cached decisions themselves. Both work:
        # the answers are logged per op (at trace time under compile, so it costs no step time).
        self.log: dict = defaultdict(list)
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
            kept, collectives = bool(self.kept), self.plan.save_collectives
            keep = keep_decision(traits, args, kwargs, kept, collectives, _partitioner)
            if keep is Keep.RERUN:
                decision = _RECOMPUTE
            else:
                decision = _SAVE
                self._remember(ctx, func, self.kept[-1] if self.kept else None)
        self.log[func].append(decision)
        return decision

    def _remember(self, ctx, func, interval: MarkerInterval | None) -> None:
        # torch < 2.13 gives no op_output: mutations are then caught by torch itself in backward.
        outputs = getattr(ctx, "op_output", None)
        for out in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                self.cached.setdefault(storage_key(out), (func, interval))

    def _check_mutation(self, func, mutated, args, kwargs) -> None:
        for position, name in mutated:
            target = args[position] if position < len(args) else kwargs.get(name)
            if not isinstance(target, torch.Tensor) or target.device.type == "meta":
                continue
            producer = self.cached.get(storage_key(target))
            if producer is None:
                continue
            producer_op, interval = producer
            kept = None if interval is None else self.plan.describe(interval)
            routing = self.plan.save_collectives and op_traits(producer_op).always_saved
            raise mutation_error(self.layer_name, func, producer_op, kept, routing)

    def _replay(self, func) -> CheckpointPolicy:
        index = self.replay_index[func]
        self.replay_index[func] = index + 1
        return self.log[func][index]
