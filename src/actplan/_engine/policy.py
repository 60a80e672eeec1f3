"""Turn a layer's kept intervals into the engine that runs it.

``IntervalPolicy`` is a layer class's plan: which declared intervals are kept, whether
routing and collective outputs are saved, which kept intervals are offloaded. It hands
out one region per checkpointed call:

* eager: a ``scoped.ScopedRegion``, which watches only the segments that save, holds
  only the outputs something after the forward reads, and never reruns a kept op;
* compiled: a ``region.TracedRegion``, whose per-op tags (kept intervals, routing and
  collectives saved; views, in-place, uninitialised and random ops replayed) reach
  AOTAutograd's partitioner, which saves what the backward graph reads.

Both follow the layer's markers with the same state machine (``region.MarkerState``).
Imports point down to ``units``, ``markers``, ``ops``, ``region``, ``held`` and ``scoped``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.checkpoint import create_selective_checkpoint_contexts

from actplan._callsite import warn
from actplan._engine.held import HeldReport, LearntLayout
from actplan._engine.ops import ROUTING_OPS, UNINITIALIZED_OPS
from actplan._engine.region import KeptTensorMutatedError, MarkerError, MarkerState, TracedRegion
from actplan._engine.scoped import ScopedRegion
from actplan.units import MarkerInterval, RecomputeIntervalMap, marker_index

__all__ = [
    "ROUTING_OPS",
    "UNINITIALIZED_OPS",
    "IntervalPolicy",
    "KeptTensorMutatedError",
    "MarkerError",
]

# The compiled engine's region (tests drive its decisions directly).
_Region = TracedRegion


class IntervalPolicy:
    """Selective-checkpoint policy for one layer.

    Args:
        interval_map: the layer class's declaration of units and intervals.
        kept_intervals: intervals whose ops are never rerun in backward; what they output is
            held when something after the forward reads it. Each must be in ``interval_map``.
        layer_name: used in errors and warnings, e.g. ``"layers.3 (DecoderLayer)"``.
        save_collectives: keep collective and routing outputs whatever the plan
            (on by default; turning it off reruns collectives in backward).
        offload_intervals: kept intervals whose held outputs move to the host tier
            between forward and recompute (eager layers); needs ``offloader``.
        offloader: an ``OffloadEngine`` (``current_group`` and ``offload``).

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
        self._opens, self._closes = marker_index(declared)
        self._warned_idle: set[MarkerInterval] = set()
        # Kept intervals that ran in any layer sharing this policy (a consumer layer
        # may legitimately skip what its source layer runs).
        self._ever_ran: set[MarkerInterval] = set()
        # Per calling layer: the marker path and routing segments its first call showed,
        # and what its latest call held (for reports).
        # Keyed by the calling module (a policy serves several layers, which may take
        # different paths); a layer wrapped without one shares the policy's entry.
        self._layouts: weakref.WeakKeyDictionary[Any, LearntLayout] = weakref.WeakKeyDictionary()
        self._unkeyed_layout: LearntLayout | None = None
        self._held: dict[str, HeldReport] = {}
        self.context_fn = functools.partial(_traced_contexts, self)

    def open_region(
        self, layer_name: str | None = None, layer: Any = None
    ) -> tuple[Callable[[], Any], Callable[[str], None]]:
        """Eager form, one per checkpointed call: a ``context_fn`` bound to a fresh
        region, and the marker sink that feeds the same region directly.
        ``layer_name`` names the calling layer in errors and reports (the policy may be
        shared); ``layer``, the calling module, keys what is learnt about its path."""
        region = ScopedRegion(self, layer_name, layer)
        return region.contexts, region.on_marker

    def marker_checker(self, layer_name: str | None = None) -> Callable[[str], None]:
        """A marker sink that only checks one call's markers against the interval map
        (unknown, unbalanced, wrongly nested: ``MarkerError``) and decides nothing; the
        boundary runs it on a fully recomputed layer's first eager call."""
        return MarkerState(self, layer_name).on_marker

    def learnt_layout(self, layer: Any) -> LearntLayout | None:
        return self._unkeyed_layout if layer is None else self._layouts.get(layer)

    def learn_layout(self, layer: Any, layout: LearntLayout) -> None:
        if layer is None:
            self._unkeyed_layout = layout
        else:
            self._layouts[layer] = layout

    def record_held(self, layer_name: str, report: HeldReport) -> None:
        self._held[layer_name] = report

    def held_reports(self) -> dict[str, HeldReport]:
        """Per layer that ran eagerly under this policy: bytes its latest forward held per kept
        interval, and bytes autograd saved while each kept interval was open."""
        return dict(self._held)

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
        warn(
            f"{layer_name}: kept {self.describe(interval)} {what}, so keeping it saves nothing. "
            "Check that the layer emits its markers around real work, or drop the unit from 'keep'."
        )


def _traced_contexts(policy: IntervalPolicy):
    region = TracedRegion(policy)
    return create_selective_checkpoint_contexts(region.decide)
