"""Turn a layer's kept intervals into a per-op selective-checkpoint policy.

``IntervalPolicy`` follows the markers a layer emits (``checkpoint_record``) as a
small state machine and answers, for every aten op of the layer's forward,
whether its output is saved or recomputed:

* an op that runs while a kept interval is open is saved (``MUST_SAVE``);
* collective outputs and routing ops (top-k, sort, counts, device-to-host
  copies) are always saved, so recompute never re-communicates or re-routes;
* view ops are always replayed: they cost nothing, and a cached view would pin
  its base tensor (say the norm output a projection reshapes) for no gain;
* in-place and ``out=`` ops, and ops returning uninitialised memory (``empty*``),
  are always replayed: the replay rebuilds the tensor they write into, while a
  cached result would alias a tensor that later ops change;
* random ops (dropout, ``rand``...) are always replayed, even inside a kept
  interval: a cached random op would not advance the generator during
  recompute, and every random op after it would draw different numbers;
* everything else is recomputed (``PREFER_RECOMPUTE``).

Markers that are unknown, unbalanced or wrongly nested raise ``MarkerError``
naming the layer, the marker and what was expected. Imports point down to
``units`` and ``markers`` only.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from actplan.markers import LAYER_END, MARKER_OP
from actplan.units import MarkerInterval, RecomputeIntervalMap

_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE

# torch < 2.13 also calls the policy during recompute (ctx.is_recompute=True) and
# expects the same answers; newer torch replays cached decisions by index itself.
_POLICY_CALLED_ON_RECOMPUTE = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def _routing_ops() -> frozenset:
    aten = torch.ops.aten
    names = [
        ("topk", "default"),
        ("sort", "default"),
        ("sort", "stable"),
        ("argsort", "default"),
        ("argsort", "stable"),
        ("nonzero", "default"),
        ("bincount", "default"),
        ("histc", "default"),
        ("_local_scalar_dense", "default"),
        ("unique_consecutive", "default"),
        ("_unique2", "default"),
    ]
    ops = set()
    for packet, overload in names:
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


ROUTING_OPS = _routing_ops()
"""Ops whose outputs are routing decisions (top-k, sorts, counts, ``.item()``)."""
UNINITIALIZED_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_TO_COPY = torch.ops.aten._to_copy.default


class _OpTraits(NamedTuple):
    """What the policy needs to know about an op, worked out once per op."""

    is_view: bool
    seeded: bool  # may draw random numbers
    dropout_position: int | None  # where its dropout_p argument sits, if it has one
    always_saved: bool  # collective or routing op
    is_to_copy: bool  # may be a device-to-host copy
    mutated: tuple[tuple[int, str], ...]  # (position, name) of arguments written in place
    uninitialized: bool  # returns uninitialised memory (empty, empty_like, ...)


# Keyed by id(): ops are process-lived singletons, and OpOverload.__hash__ runs in
# Python, which a per-op policy cannot afford several times per op.
_TRAITS: dict[int, _OpTraits] = {}


def _op_traits(func) -> _OpTraits:
    traits = _TRAITS.get(id(func))
    if traits is not None:
        return traits
    schema = getattr(func, "_schema", None)
    arguments = schema.arguments if schema is not None else ()
    seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    traits = _OpTraits(
        # _unsafe_view aliases its input but its schema does not say so.
        is_view=bool(getattr(func, "is_view", False)) or func is torch.ops.aten._unsafe_view.default,
        seeded=seeded,
        dropout_position=next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None),
        always_saved=func in ROUTING_OPS or getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES,
        is_to_copy=func is _TO_COPY,
        mutated=tuple(
            (position, argument.name)
            for position, argument in enumerate(arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ),
        uninitialized=getattr(func, "_opname", "") in UNINITIALIZED_OPS,
    )
    _TRAITS[id(func)] = traits
    return traits


def _draws_random(traits: _OpTraits, args, kwargs) -> bool:
    if not traits.seeded or traits.dropout_position is None:
        return traits.seeded
    # Attention kernels are tagged random but draw only when dropout_p > 0.
    if "dropout_p" in kwargs:
        return kwargs["dropout_p"] != 0
    position = traits.dropout_position
    return position < len(args) and args[position] != 0


def _is_device_to_host(args, kwargs) -> bool:
    device = kwargs.get("device")
    if device is None or torch.device(device).type != "cpu":
        return False
    source = args[0] if args else None
    return isinstance(source, torch.Tensor) and source.device.type != "cpu"


class MarkerError(RuntimeError):
    """Markers emitted by a layer do not match its ``RecomputeIntervalMap``."""


class KeptTensorMutatedError(RuntimeError):
    """An in-place op modified a tensor the selective policy had already saved."""


class IntervalPolicy:
    """Selective-checkpoint policy for one layer.

    Args:
        interval_map: the layer class's declaration of units and intervals.
        kept_intervals: intervals whose ops are saved; each must be in ``interval_map``.
        layer_name: used in errors and warnings, e.g. ``"layers.3 (DecoderLayer)"``.
        save_collectives: keep collective and routing outputs whatever the plan
            (on by default; turning it off reruns collectives in backward).
        offload_intervals: kept intervals whose saved outputs move to the host tier
            between forward and recompute; needs ``offloader``.
        offloader: an ``OffloadEngine`` (anything with its ``sac_contexts`` method).

    ``context_fn`` is what ``torch.utils.checkpoint`` takes; it is a stable
    ``functools.partial`` so ``torch.compile`` can trace it and guard on it (the
    compiled graph carries the marker ops). In eager mode the boundary calls
    ``open_region()`` instead, so markers reach the region without dispatching.
    """

    def __init__(
        self,
        interval_map: RecomputeIntervalMap,
        kept_intervals: Iterable[MarkerInterval],
        *,
        layer_name: str = "<layer>",
        save_collectives: bool = True,
        offload_intervals: Iterable[MarkerInterval] = (),
        offloader: Any = None,
    ) -> None:
        kept = frozenset(kept_intervals)
        offloaded = frozenset(offload_intervals)
        if offloaded - kept:
            raise ValueError(
                f"{layer_name}: offloaded intervals {sorted(map(str, offloaded - kept))} are not kept; "
                "only kept outputs are saved, so only they can be offloaded"
            )
        if offloaded and offloader is None:
            raise ValueError(f"{layer_name}: offload_intervals need an offloader (an OffloadEngine)")
        declared = {span for spans in interval_map.values() for span in spans}
        undeclared = kept - declared
        if undeclared:
            raise ValueError(
                f"{layer_name}: kept intervals {sorted(map(str, undeclared))} are not declared in the "
                f"layer's RecomputeIntervalMap; declared: {sorted(map(str, declared))}"
            )
        self.interval_map = interval_map
        self.kept_intervals = kept
        self.layer_name = layer_name
        self.save_collectives = save_collectives
        self.offload_intervals = offloaded
        self.offloader = offloader
        opens: dict[str, list[MarkerInterval]] = defaultdict(list)
        closes: dict[str, list[MarkerInterval]] = defaultdict(list)
        for span in declared:
            opens[span.start].append(span)
            closes[span.end].append(span)
        self._opens = {m: tuple(v) for m, v in opens.items()}
        self._closes = {m: tuple(v) for m, v in closes.items()}
        self._warned_idle: set[MarkerInterval] = set()
        # Kept intervals that ran in any layer sharing this policy (a consumer layer
        # may legitimately skip what its source layer runs).
        self._ever_ran: set[MarkerInterval] = set()
        self.context_fn = functools.partial(_region_contexts, self)

    def open_region(self, layer_name: str | None = None) -> tuple[functools.partial, Callable[[str], None]]:
        """Eager form, one per checkpointed call: a ``context_fn`` bound to a fresh
        region, and the marker sink that feeds the same region directly.
        ``layer_name`` names the calling layer in errors (the policy may be shared)."""
        region = _Region(self, layer_name)
        if self.offload_intervals:
            return functools.partial(_offloading_contexts, region), region.on_marker
        return functools.partial(create_selective_checkpoint_contexts, region.decide), region.on_marker

    def __repr__(self) -> str:
        kept = ", ".join(sorted(str(s) for s in self.kept_intervals)) or "nothing"
        return f"IntervalPolicy({self.layer_name}: keep {kept})"

    def describe(self, interval: MarkerInterval) -> str:
        return f"interval {interval} of unit {self.interval_map.unit_of(interval).value!r}"

    def warn_idle(self, interval: MarkerInterval, layer_name: str, what: str) -> None:
        """Warn once per interval that a kept interval did no work (``what`` says how)."""
        if interval in self._warned_idle:
            return
        self._warned_idle.add(interval)
        warnings.warn(
            f"{layer_name}: kept {self.describe(interval)} {what}, so keeping it saves nothing. "
            "Check that the layer emits its markers around real work, or drop the unit from 'keep'.",
            stacklevel=2,
        )


def _region_contexts(policy: IntervalPolicy):
    region = _Region(policy)
    return create_selective_checkpoint_contexts(region.decide)


def _offloading_contexts(region: _Region):
    region.saved_order = defaultdict(list)
    contexts = create_selective_checkpoint_contexts(region.decide)
    return region.policy.offloader.sac_contexts(contexts, region.saved_order, region.policy.offload_intervals)


class _Region:
    """Marker state and decisions for one checkpointed call of one layer."""

    __slots__ = (
        "cached",
        "finished",
        "kept",
        "kept_seen",
        "layer_name",
        "log",
        "marker_seq",
        "op_count",
        "open",
        "policy",
        "replay_index",
        "saved_order",
    )

    def __init__(self, policy: IntervalPolicy, layer_name: str | None = None) -> None:
        self.policy = policy
        self.layer_name = layer_name or policy.layer_name
        # interval -> (sequence number of the marker that opened it, op_count then)
        self.open: dict[MarkerInterval, tuple[int, int]] = {}
        # Open kept intervals, innermost last; and every kept interval opened so far.
        self.kept: list[MarkerInterval] = []
        self.kept_seen: set[MarkerInterval] = set()
        # Storages of saved outputs -> (producing op, kept interval or None if always saved).
        self.cached: dict[int, tuple[Any, MarkerInterval | None]] = {}
        self.marker_seq = 0
        self.op_count = 0
        self.finished = False
        self.log: dict | None = defaultdict(list) if _POLICY_CALLED_ON_RECOMPUTE else None
        self.replay_index: dict = defaultdict(int)
        # Offloading layers only: per op, the kept interval of each saved output, in order.
        self.saved_order: dict | None = None

    def decide(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if ctx.is_recompute:
            return self._replay(func)
        if func is MARKER_OP:
            self.on_marker(args[0])
            decision = _RECOMPUTE
        else:
            self.op_count += 1
            traits = _TRAITS.get(id(func)) or _op_traits(func)
            if traits.mutated and self.cached:
                self._check_mutation(func, traits.mutated, args, kwargs)
            if (
                traits.is_view
                or traits.mutated
                or traits.uninitialized
                or (traits.seeded and _draws_random(traits, args, kwargs))
            ):
                decision = _RECOMPUTE
            elif self.kept:
                decision = _SAVE
                self._remember(ctx, func, self.kept[-1])
            elif self.policy.save_collectives and (
                traits.always_saved or (traits.is_to_copy and _is_device_to_host(args, kwargs))
            ):
                decision = _SAVE
                self._remember(ctx, func, None)
            else:
                decision = _RECOMPUTE
        if self.log is not None:
            self.log[func].append(decision)
        return decision

    def _remember(self, ctx, func, interval: MarkerInterval | None) -> None:
        if self.saved_order is not None:
            self.saved_order[func].append(interval)
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
            if interval is None:
                raise KeptTensorMutatedError(
                    f"{self.layer_name}: in-place op {func} modifies the output of {producer_op}, a "
                    "routing or collective op whose outputs are always saved (so recompute never "
                    "re-routes or re-communicates); backward would read a stale copy. Write that "
                    "update out-of-place, e.g. `order = order + 1` instead of `order += 1`; or, for code "
                    "you cannot change, set save_collectives: false and do not keep the unit it runs in "
                    "(routing ops are then recomputed, exact when they are deterministic: check with "
                    "actplan verify)."
                )
            raise KeptTensorMutatedError(
                f"{self.layer_name}: in-place op {func} modifies the output of {producer_op}, which "
                f"the kept {self.policy.describe(interval)} saved; backward would read a stale copy. "
                "Write that update out-of-place, or do not keep that unit. (On CPU, F.rms_norm and "
                "nn.RMSNorm add their epsilon in place: keep the projections, not the norm, or write "
                "the norm with out-of-place ops.)"
            )

    def _replay(self, func) -> CheckpointPolicy:
        if self.log is None:
            raise RuntimeError(
                "this torch build calls the selective-checkpoint policy during recompute, which "
                f"actplan did not expect for torch {torch.__version__}; please report it"
            )
        index = self.replay_index[func]
        self.replay_index[func] = index + 1
        return self.log[func][index]

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
