"""Step timing: ``interleaved_timing`` runs several callables in rotating rounds so drift hits
them alike, ``TimingStats`` summarises each one's samples and ``ratio`` pairs two by round;
``unstolen``, ``paired_differences`` and ``median_spread`` read samples taken on a busy
machine (a run far slower than its own median lost its CPU to another job).
Imports only torch and the standard library.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of already sorted values."""
    position = q * (len(sorted_values) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * (position - lower)


def _relative_spread(q25: float, q75: float, median: float) -> float:
    iqr = q75 - q25
    if median == 0:
        return 0.0 if iqr == 0 else math.inf
    return iqr / abs(median)


@dataclass(frozen=True)
class TimingStats:
    """Per-run wall times in seconds, in round order, with order statistics.

    ``spread`` is the interquartile range relative to the median (0.05 = 5 %).
    """

    samples: list[float]
    median: float
    q25: float
    q75: float
    min: float
    max: float
    spread: float

    @classmethod
    def from_samples(cls, samples: Iterable[float]) -> TimingStats:
        values = list(samples)
        if not values:
            raise ValueError("TimingStats needs at least one sample; run with repeats >= 1")
        ordered = sorted(values)
        median, q25, q75 = (_quantile(ordered, q) for q in (0.5, 0.25, 0.75))
        return cls(
            samples=values,
            median=median,
            q25=q25,
            q75=q75,
            min=ordered[0],
            max=ordered[-1],
            spread=_relative_spread(q25, q75, median),
        )


@dataclass(frozen=True)
class RatioStats:
    """Per-round ratios ``a / b`` of two paired timings, with their median and quartiles."""

    samples: list[float]
    median: float
    q25: float
    q75: float
    spread: float


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def interleaved_timing(
    runs: Mapping[str, Callable[[], None]],
    *,
    repeats: int,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    max_repeats: int | None = None,
    settled: Callable[[Mapping[str, list[float]]], bool] | None = None,
) -> dict[str, TimingStats]:
    """Time every callable in ``runs`` in interleaved rounds so drift hits all of them alike.

    ``warmup`` untimed rounds come first, then ``repeats`` timed rounds; each round runs every
    callable once, the order rotated by one each round (A B C, B C A, C A B, ...). Sample ``i``
    of every result comes from round ``i``, so results can be paired with :func:`ratio`.
    With ``settled``, timing is adaptive: after ``repeats`` rounds, further rounds run until
    ``settled(samples)`` is true or ``max_repeats`` rounds are done.
    ``progress(name)`` is called after every run, warm-up included. On CUDA each run is
    bracketed by ``torch.cuda.synchronize()``.
    """
    if not runs:
        raise ValueError("interleaved_timing needs at least one callable in `runs`")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    last = repeats if max_repeats is None else max_repeats
    if last < repeats:
        raise ValueError(f"max_repeats ({max_repeats}) must be at least repeats ({repeats})")
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + last):
        timed = round_index - warmup
        if timed >= repeats and (settled is None or settled(samples)):
            break
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize = _cuda_in_use()
            if synchronize:
                torch.cuda.synchronize()
            start = time.perf_counter()
            runs[name]()
            if synchronize:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                samples[name].append(elapsed)
            if progress is not None:
                progress(name)
    return {name: TimingStats.from_samples(samples[name]) for name in names}


def ratio(stats_a: TimingStats, stats_b: TimingStats) -> RatioStats:
    """Ratio of ``stats_a`` to ``stats_b`` (e.g. checkpointed / baseline), paired by round."""
    if len(stats_a.samples) != len(stats_b.samples):
        raise ValueError(
            f"cannot pair timings of {len(stats_a.samples)} and {len(stats_b.samples)} rounds; "
            "take both from the same interleaved_timing call"
        )
    if any(b <= 0 for b in stats_b.samples):
        raise ValueError(
            f"the denominator timing has a non-positive sample ({min(stats_b.samples)} s), so it cannot "
            "be a ratio base; time a run that takes measurable time (a larger step, or more work per "
            "round) and pass its TimingStats second"
        )
    per_round = [a / b for a, b in zip(stats_a.samples, stats_b.samples, strict=True)]
    ordered = sorted(per_round)
    median, q25, q75 = (_quantile(ordered, q) for q in (0.5, 0.25, 0.75))
    return RatioStats(
        samples=per_round, median=median, q25=q25, q75=q75, spread=_relative_spread(q25, q75, median)
    )


# A run slower than this many times its own median did not spend that time on its work: its
# CPU went to another job (a scheduler time slice, another process's burst).
STOLEN_FACTOR = 1.5


def unstolen(samples: Sequence[float], factor: float = STOLEN_FACTOR) -> list[bool]:
    """Per sample, whether it is at most ``factor`` times the samples' median (one that is
    slower lost its CPU to something else; fewer than 3 samples have no such judge)."""
    if len(samples) < 3:
        return [True] * len(samples)
    limit = factor * statistics.median(samples)
    return [s <= limit for s in samples]


def paired_differences(
    own: Sequence[float], reference: Sequence[float], factor: float = STOLEN_FACTOR
) -> list[float]:
    """Round by round, ``own - reference``, leaving out the rounds where either run was
    stolen (``unstolen``); every round when fewer than 3 would remain."""
    if len(own) != len(reference):
        raise ValueError(f"cannot pair {len(own)} samples with {len(reference)}; time them together")
    steady = zip(own, reference, unstolen(own, factor), unstolen(reference, factor), strict=True)
    kept = [a - b for a, b, ok_a, ok_b in steady if ok_a and ok_b]
    return kept if len(kept) >= 3 else [a - b for a, b in zip(own, reference, strict=True)]


def median_spread(values: Sequence[float]) -> float:
    """The interquartile range over the square root of the count: how loose a median of
    ``values`` is (about its standard error); infinite with fewer than 2 values."""
    if len(values) < 2:
        return math.inf
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return (quartiles[2] - quartiles[0]) / math.sqrt(len(values))
