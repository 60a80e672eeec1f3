"""What the eager engine learns while layers run, kept apart from the plan (``IntervalPlan``).

``LearntState`` is one policy's record across calls: per calling layer, the path its first call
showed (``LearntLayout``: markers, which segments route, which run only views) and what its
latest call held (``HeldReport``); which kept intervals ever ran, and which idle ones were
already warned about. It changes as layers run; the plan never does. Imports ``interval_plan``,
``units`` and ``_callsite``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from actplan._callsite import warn
from actplan._engine.interval_plan import IntervalPlan
from actplan.units import MarkerInterval

__all__ = ["HeldReport", "LearntLayout", "LearntState"]


@dataclass(frozen=True)
class LearntLayout:
    """What a layer's first call showed: its marker sequence, which segments ran routing,
    collective or device-to-host ops outside every kept interval, which ran only views, and the
    sites (``HeldOutput.site``) of the kept outputs it dropped unread while it watched every op."""

    markers: tuple[str, ...]
    kept: tuple[MarkerInterval | None, ...]  # per segment, the innermost kept interval open
    routing_segments: frozenset[int]
    inert_segments: frozenset[int]  # segments that ran nothing but views
    unread_sites: frozenset[tuple[int, int, int]] = frozenset()  # (``held.Site``)


@dataclass
class HeldReport:
    """Per kept interval (``None``: routing and collective outputs outside every kept interval),
    the bytes a call holds at the end of its forward, against what autograd keeps for the same
    ops without checkpointing: the tensors those ops save, and those of their outputs that any
    op saves (measured on a learning call, when every segment is watched)."""

    held: dict[MarkerInterval | None, int] = field(default_factory=dict)
    autograd: dict[MarkerInterval | None, int] = field(default_factory=dict)


class LearntState:
    """One policy's record of what its eager calls learnt (a policy may serve several layers)."""

    def __init__(self) -> None:
        # Keyed by the calling module: layers sharing a policy may take different paths. A layer
        # wrapped without a module shares the unkeyed entry.
        self._layouts: weakref.WeakKeyDictionary[Any, LearntLayout] = weakref.WeakKeyDictionary()
        self._unkeyed_layout: LearntLayout | None = None
        self._held: dict[str, HeldReport] = {}
        # Kept intervals that ran in any layer sharing the policy (a consumer layer may
        # legitimately skip what its source layer runs), and idle ones already warned about.
        self.ever_ran: set[MarkerInterval] = set()
        self._warned_idle: set[MarkerInterval] = set()

    def layout(self, layer: Any) -> LearntLayout | None:
        return self._unkeyed_layout if layer is None else self._layouts.get(layer)

    def learn(self, layer: Any, layout: LearntLayout) -> None:
        if layer is None:
            self._unkeyed_layout = layout
        else:
            self._layouts[layer] = layout

    def record_held(self, layer_name: str, report: HeldReport) -> None:
        self._held[layer_name] = report

    def held_reports(self) -> dict[str, HeldReport]:
        return dict(self._held)

    def warn_idle(self, plan: IntervalPlan, interval: MarkerInterval, layer_name: str, what: str) -> None:
        """Warn once per interval that a kept interval did no work (``what`` says how)."""
        if interval in self._warned_idle:
            return
        self._warned_idle.add(interval)
        warn(
            f"{layer_name}: kept {plan.describe(interval)} {what}, so keeping it saves nothing. "
            "Check that the layer emits its markers around real work, or drop the unit from 'keep'."
        )
