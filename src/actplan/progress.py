"""Progress of long work (profiling, planning, the bench, verify): one event type, one tracker.

Every long entry point takes ``progress=``, a callable that receives a ``ProgressEvent``
each time a unit of work completes. Without one, events go to the ``actplan`` logger at
INFO level, so a script sees them once it configures logging
(``logging.basicConfig(level=logging.INFO)``). The CLI draws them as a bar with a
percentage and time left on a terminal, and as plain lines otherwise (CI logs, pipes).

Pure Python: no torch, so it can be used and tested anywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

LOGGER = logging.getLogger("actplan")


@dataclass(frozen=True)
class ProgressEvent:
    """One completed unit of work: which stage, how far along, and how long so far."""

    stage: str  # what just finished, e.g. "Block: greedy 3/8"
    done: int  # units of work finished so far
    total: int  # units of work expected in all (at least ``done``)
    elapsed_s: float  # since the work began

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far; ``None`` before the first unit is done."""
        if self.done == 0:
            return None
        return self.elapsed_s / self.done * (self.total - self.done)

    def __str__(self) -> str:
        left = "" if self.eta_s is None or self.done >= self.total else f", about {self.eta_s:.0f} s left"
        return (
            f"{self.stage} [{self.done}/{self.total}, {100 * self.fraction:.0f}%, "
            f"{self.elapsed_s:.1f} s{left}]"
        )


ProgressCallback = Callable[[ProgressEvent], None]


def log_progress(event: ProgressEvent) -> None:
    """The default callback: one INFO line per event on the ``actplan`` logger."""
    LOGGER.info("%s", event)


class ProgressTracker:
    """Counts units of work and reports each to a callback (``log_progress`` by default).

    ``total`` may grow as the work discovers more of itself (``expect``); ``done`` never
    passes it.
    """

    def __init__(self, callback: ProgressCallback | None, total: int, prefix: str = "") -> None:
        if total < 0:
            raise ValueError(f"a progress total cannot be negative, got {total}")
        self.callback = callback or log_progress
        self.total = total
        self.done = 0
        self.prefix = prefix
        self.started = time.perf_counter()

    def expect(self, more: int) -> None:
        """Add ``more`` units to the expected total."""
        self.total += more

    def step(self, stage: str, units: int = 1) -> None:
        """Record ``units`` finished units of work, the last of which was ``stage``."""
        self.done += units
        self.total = max(self.total, self.done)
        elapsed = time.perf_counter() - self.started
        self.callback(ProgressEvent(self.prefix + stage, self.done, self.total, elapsed))


class PlainLines:
    """A callback that writes events as plain lines, few enough for a log: the first, then
    one each time another ``share`` of the work is done or ``seconds`` have passed since the
    last line, and the last."""

    def __init__(self, write: Callable[[str], None], share: float = 0.1, seconds: float = 10.0) -> None:
        self.write = write
        self.share = share
        self.seconds = seconds
        self.next_fraction = 0.0
        self.last_written: float | None = None

    def __call__(self, event: ProgressEvent) -> None:
        due = (
            self.last_written is None
            or event.done >= event.total
            or event.fraction >= self.next_fraction
            or event.elapsed_s - self.last_written >= self.seconds
        )
        if not due:
            return
        self.write(str(event))
        self.last_written = event.elapsed_s
        self.next_fraction = event.fraction + self.share
