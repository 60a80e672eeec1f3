"""Turn a layer's kept intervals into the engine that runs it.

``IntervalPolicy`` is a layer class's plan: which declared intervals are kept, whether
routing and collective outputs are saved, which kept intervals are offloaded. It hands
out one region per checkpointed call:

* eager: a ``scoped.ScopedRegion``, which watches only the segments that save, holds
  only the outputs something after the forward reads, and never reruns a kept op;
* compiled: a ``region.TracedRegion``, whose per-op tags (kept intervals, routing and
  collectives saved; views, in-place, uninitialised and random ops replayed) reach
  AOTAutograd's partitioner, which saves what the backward graph reads.

Both follow the layer's markers with the same state machine (``region.MarkerState``). The
policy holds the plan (``interval_plan.IntervalPlan``, immutable) apart from what its eager calls
learn (``learnt.LearntState``).
Imports point down to ``held``, ``interval_plan``, ``learnt``, ``ops``, ``region``, ``scoped``
and ``_torch_internals``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.checkpoint import create_selective_checkpoint_contexts

from actplan._engine.held import SegmentMode
from actplan._engine.interval_plan import IntervalPlan
from actplan._engine.learnt import HeldReport, LearntState
from actplan._engine.ops import ROUTING_OPS, UNINITIALIZED_OPS
from actplan._engine.region import KeptTensorMutatedError, MarkerError, MarkerState, TracedRegion
from actplan._engine.scoped import ScopedRegion
from actplan._torch_internals import fsdp_hooks_step_aside, probe
from actplan.units import MarkerInterval, RecomputeIntervalMap

__all__ = [
    "ROUTING_OPS",
    "UNINITIALIZED_OPS",
    "IntervalPolicy",
    "KeptTensorMutatedError",
    "MarkerChecker",
    "MarkerError",
]


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
        watch_every_segment: for debugging and tests: every eager call takes the full path
            (every segment watched, the marker state machine run), never the learnt fast path.

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
        watch_every_segment: bool = False,
    ) -> None:
        offloaded = frozenset(offload_intervals)
        if offloaded and offloader is None:
            raise ValueError(f"{layer_name}: offload_intervals need an offloader (an OffloadEngine)")
        self.plan = IntervalPlan.make(
            interval_map,
            kept_intervals,
            layer_name=layer_name,
            save_collectives=save_collectives,
            offload_intervals=offloaded,
        )
        self.learnt = LearntState()
        self.offloader = offloader
        self.watch_every_segment = watch_every_segment
        self.context_fn = functools.partial(_traced_contexts, self)
        # The private torch APIs the engine relies on, checked once per process.
        probe()

    @property
    def interval_map(self) -> RecomputeIntervalMap:
        return self.plan.interval_map

    @property
    def kept_intervals(self) -> frozenset[MarkerInterval]:
        return self.plan.kept_intervals

    @property
    def offload_intervals(self) -> frozenset[MarkerInterval]:
        return self.plan.offload_intervals

    @property
    def save_collectives(self) -> bool:
        return self.plan.save_collectives

    @property
    def layer_name(self) -> str:
        return self.plan.layer_name

    def open_region(
        self, layer_name: str | None = None, layer: Any = None, observer: Any = None
    ) -> tuple[Callable[[], Any], Callable[[str], None]]:
        """Eager form, one per checkpointed call: a ``context_fn`` bound to a fresh
        region, and the marker sink that feeds the same region directly.
        ``layer_name`` names the calling layer in errors and reports (the policy may be
        shared); ``layer``, the calling module, keys what is learnt about its path;
        ``observer`` (``actplan verify``'s) is told of the placeholders the replay serves.
        A module ``fully_shard`` sharded inside ``layer`` runs its FSDP hooks outside the
        region's dispatch mode (``fsdp_hooks_step_aside``)."""
        if layer is not None:
            fsdp_hooks_step_aside(layer, SegmentMode)
        region = ScopedRegion(
            self.plan,
            self.learnt,
            layer_name,
            layer,
            offloader=self.offloader,
            watch_every_segment=self.watch_every_segment,
            observer=observer,
        )
        return region.contexts, region.on_marker

    def held_reports(self) -> dict[str, HeldReport]:
        """Per layer that ran eagerly under this policy: bytes its latest forward held per kept
        interval, and bytes autograd saved while each kept interval was open."""
        return self.learnt.held_reports()

    def __repr__(self) -> str:
        kept = ", ".join(sorted(str(s) for s in self.kept_intervals)) or "nothing"
        return f"IntervalPolicy({self.layer_name}: keep {kept})"


class MarkerChecker:
    """For a fully recomputed layer, which decides nothing by markers: a marker sink per call
    that only checks the markers against the interval map (unknown, unbalanced, wrongly
    nested: ``MarkerError``). The boundary runs one on the layer's first eager call. Needs no
    torch internals (so no probe), as whole-layer checkpointing needs none."""

    def __init__(self, interval_map: RecomputeIntervalMap, layer_name: str) -> None:
        self.plan = IntervalPlan.make(interval_map, (), layer_name=layer_name)

    def __call__(self, layer_name: str | None = None) -> Callable[[str], None]:
        return MarkerState(self.plan, LearntState(), layer_name).on_marker


def _traced_contexts(policy: IntervalPolicy):
    region = TracedRegion(policy.plan, policy.learnt)
    return create_selective_checkpoint_contexts(region.decide)
