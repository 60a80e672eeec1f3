"""What a learning call of the eager engine sees, and the layout and report it leaves behind.

A layer's first checkpointed call (and any call that leaves the path learnt before) watches
every segment. ``LearningProbe`` lives only while such a call runs. It notes which segments ran
an op other than a view, and per kept interval the storages autograd saved while it was open and
the storages its kept ops produced. At the end of the forward it builds the ``LearntLayout``
later calls follow, and the per-interval comparison with autograd that reports print.

``held_report`` (any call) sums the bytes held per kept interval.

Imports ``held`` (the records), ``learnt``, ``units``.
"""

from __future__ import annotations

from collections.abc import Iterable

from actplan._engine.held import HeldOutput
from actplan._engine.learnt import HeldReport, LearntLayout
from actplan.units import MarkerInterval


class LearningProbe:
    """One learning call's observations. ``busy``: segments where an op other than a view ran
    (made part-way through a call, it starts from the segments watched so far: counting one of
    those busy only means it is never skipped)."""

    def __init__(self, busy: Iterable[int] = ()) -> None:
        self.busy: set[int] = set(busy)
        # Per kept interval (None: routing): storages autograd saved while it was open, and
        # storages its kept ops produced, both with their sizes.
        self.saved_in: dict[MarkerInterval | None, dict[int, int]] = {}
        self.produced: dict[MarkerInterval | None, dict[int, int]] = {}
        self.unread: set[tuple[int, int, int]] = set()  # sites of kept outputs dropped unread

    def produced_by(self, held: HeldOutput) -> None:
        self.produced.setdefault(held.interval, {})[held.storage] = held.nbytes

    def forget_produced(self, held: HeldOutput) -> None:
        # Dropped unread: nothing saved it, and its storage's address may come back for another.
        self.produced.get(held.interval, {}).pop(held.storage, None)
        if held.site is not None:
            self.unread.add(held.site)

    def layout(
        self,
        markers: list[str],
        segment_kept: list[MarkerInterval | None],
        routing_segments: set[int],
        watched: Iterable[int],
        before: LearntLayout | None,
        left_path_at: int,
    ) -> LearntLayout:
        """The layout later calls follow. Inert segments: watched here and ran only views, or
        known inert before this call left the path learnt before. Unread sites: only this
        call's (what an earlier call dropped may be read on the path this one took)."""
        inert = {s for s in watched if s not in self.busy}
        if before is not None:
            inert |= {s for s in before.inert_segments if s <= left_path_at}
        return LearntLayout(
            markers=tuple(markers),
            kept=tuple(segment_kept),
            routing_segments=frozenset(routing_segments),
            inert_segments=frozenset(inert),
            unread_sites=frozenset(self.unread),
        )

    def autograd_bytes(self, packed: set[int]) -> dict[MarkerInterval | None, int]:
        """Per kept interval, what autograd keeps for the same ops without checkpointing: the
        tensors saved while it was open and those of its outputs any op saved. Routing outputs
        are compared with what autograd keeps of them, not with everything saved outside kept
        intervals."""
        found = {}
        for interval in set(self.saved_in) | set(self.produced):
            kept = dict(self.saved_in.get(interval, {})) if interval is not None else {}
            kept.update((s, n) for s, n in self.produced.get(interval, {}).items() if s in packed)
            found[interval] = sum(kept.values())
        return found


def held_report(
    held: Iterable[HeldOutput], probe: LearningProbe | None, packed: set[int], before: HeldReport | None
) -> HeldReport:
    """Bytes held per kept interval (each storage once), with autograd's figure: measured when
    this call learnt, else carried from the call that did (``before``)."""
    report = HeldReport()
    seen: set[int] = set()
    for output in held:
        if output.storage not in seen:
            seen.add(output.storage)
            report.held[output.interval] = report.held.get(output.interval, 0) + output.nbytes
    if probe is not None:
        report.autograd = probe.autograd_bytes(packed)
    elif before is not None:
        report.autograd = dict(before.autograd)
    return report
