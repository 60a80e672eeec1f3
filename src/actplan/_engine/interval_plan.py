"""``IntervalPlan``: what one layer class is told to do, fixed when the policy is made.

The kept and offloaded intervals, whether routing and collective outputs are saved, and the
marker index the marker state machine looks up. Immutable: what the engine learns while layers
run lives apart, in ``learnt.LearntState``. Both engines (``scoped``, ``region``) and the policy
read it. A leaf of the engine: imports ``units`` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from actplan.units import MarkerInterval, RecomputeIntervalMap, marker_index

__all__ = ["IntervalPlan"]


@dataclass(frozen=True)
class IntervalPlan:
    """One layer class's plan.

    Attributes:
        interval_map: the layer class's declaration of units and intervals.
        kept_intervals: intervals whose ops are never rerun in backward.
        offload_intervals: kept intervals whose held outputs move to the host tier.
        save_collectives: keep routing and collective outputs whatever the plan.
        layer_name: how errors name the layer when a call does not name its own.
        opens, closes: per marker, the declared intervals it opens and closes.
    """

    interval_map: RecomputeIntervalMap
    kept_intervals: frozenset[MarkerInterval]
    offload_intervals: frozenset[MarkerInterval]
    save_collectives: bool
    layer_name: str
    opens: Mapping[str, tuple[MarkerInterval, ...]]
    closes: Mapping[str, tuple[MarkerInterval, ...]]

    @classmethod
    def make(
        cls,
        interval_map: RecomputeIntervalMap,
        kept_intervals: Iterable[MarkerInterval],
        *,
        layer_name: str = "<layer>",
        save_collectives: bool = True,
        offload_intervals: Iterable[MarkerInterval] = (),
    ) -> IntervalPlan:
        """Check the choice against the declaration and index its markers."""
        kept = frozenset(kept_intervals)
        offloaded = frozenset(offload_intervals)
        if offloaded - kept:
            raise ValueError(
                f"{layer_name}: offloaded intervals {sorted(map(str, offloaded - kept))} are not kept; "
                "only kept outputs are saved, so only they can be offloaded"
            )
        declared = {span for spans in interval_map.values() for span in spans}
        undeclared = kept - declared
        if undeclared:
            raise ValueError(
                f"{layer_name}: kept intervals {sorted(map(str, undeclared))} are not declared in the "
                f"layer's RecomputeIntervalMap; declared: {sorted(map(str, declared))}"
            )
        opens, closes = marker_index(declared)
        return cls(interval_map, kept, offloaded, save_collectives, layer_name, opens, closes)

    def describe(self, interval: MarkerInterval) -> str:
        return f"interval {interval} of unit {self.interval_map.unit_of(interval).value!r}"
