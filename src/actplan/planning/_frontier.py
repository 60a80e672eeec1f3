"""The planner's exact solver: a dynamic program over Pareto frontiers of partial plans, with
LP bounds on the layers still to come and a beam pass that finds a first plan to beat.

Private to ``actplan.planning.planner``, which holds the problem types (imported here for
annotations only). Imports numpy and the standard library.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from actplan.planning.planner import Candidate, PlanProblem

# The frontier solver gives up (and the MILP answers) past this many states in one layer.
FRONTIER_LIMIT = 400_000
# States per tail the beam pass keeps: it finds a plan that fits fast, whose time bounds
# the exact pass.
THIN = 16


class _FrontierTooLarge(Exception):
    """A layer's frontier grew past ``FRONTIER_LIMIT`` states; the MILP answers instead."""


@functools.lru_cache(maxsize=256)
def undominated(candidates: tuple[Candidate, ...]) -> tuple[int, ...]:
    """Indices of candidates no other candidate beats or ties on every cost (retained,
    transient, time, offloaded; the first of identical ones is kept). Dropping the rest
    never changes the optimum: swapping a dominated choice for its dominator raises no
    phase and no time."""
    keys = [(c.retained_bytes, c.transient_bytes, c.extra_seconds, c.offloaded_bytes) for c in candidates]
    kept = []
    for i, a in enumerate(keys):
        dominated = any(
            all(b[k] <= a[k] for k in range(4)) and (b != a or j < i) for j, b in enumerate(keys) if j != i
        )
        if not dominated:
            kept.append(i)
    return tuple(kept)


def reduced(problem: PlanProblem) -> tuple[PlanProblem, list[tuple[int, ...]]]:
    """The problem on each layer's undominated candidates, and the map back to full indices."""
    keep = [undominated(cs) for cs in problem.layers]
    smaller = replace(
        problem, layers=tuple(tuple(cs[i] for i in k) for cs, k in zip(problem.layers, keep, strict=True))
    )
    return smaller, keep


def _lower_hull(candidates: tuple[Candidate, ...]) -> list[tuple[float, float]]:
    """The lower-left convex hull of a layer's (retained bytes, extra seconds) points."""
    points = sorted({(c.retained_bytes, c.extra_seconds) for c in candidates})
    hull: list[tuple[float, float]] = []
    for x, y in points:
        if hull and y >= hull[-1][1]:
            continue  # more bytes for no less time: never on the lower-left hull
        while len(hull) >= 2 and (
            (hull[-1][0] - hull[-2][0]) * (y - hull[-2][1]) <= (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
        ):
            hull.pop()
        hull.append((x, y))
    return hull


@functools.lru_cache(maxsize=8)
def suffix_bounds(layers: tuple[tuple[Candidate, ...], ...]) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Per layer ``i``, a lower bound on the extra seconds of layers ``i..`` as a function of
    the retained bytes they may add: the LP relaxation of that multiple-choice knapsack
    (each layer on the lower convex hull of its (retained, seconds) points, the hull's
    segments taken steepest first). Returned as ``(least retained, bytes, seconds)``: the
    bound at capacity ``c`` is ``interp(c - least, bytes, seconds)``, infinite below ``least``.
    Index ``len(layers)`` is the empty suffix."""
    hulls = [_lower_hull(candidates) for candidates in layers]
    out: list[tuple[float, np.ndarray, np.ndarray]] = [(0.0, np.zeros(1), np.zeros(1))]
    least = seconds = 0.0
    widths: list[float] = []
    drops: list[float] = []
    for hull in reversed(hulls):
        least += hull[0][0]
        seconds += hull[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(hull):
            widths.append(x1 - x0)
            drops.append(y0 - y1)
        width, drop = np.array(widths), np.array(drops)
        order = np.argsort(-drop / np.maximum(width, 1e-300), kind="stable")
        out.append((least, np.r_[0.0, np.cumsum(width[order])], seconds - np.r_[0.0, np.cumsum(drop[order])]))
    out.reverse()
    return out


class _Walk:
    """The states of ``frontier`` as it walks the layers: per state its prefix of retained
    bytes, its objective and its tail id; per layer each state's parent and candidate."""

    def __init__(self, problem: PlanProblem, budget: float | None, upper: float) -> None:
        self.problem = problem
        self.budget = budget
        self.upper = upper
        self.depth = problem.prefetch_layers
        self.minimise_peak = budget is None
        self.base = problem.static_bytes + problem.backward_extra_bytes
        self.after = [a + e for a, e in zip(problem.grads_after(), problem.extras(), strict=True)]
        self.start_phase = self.base + problem.nonlayer_bytes + problem.head_transient_bytes
        self.cap_start = np.inf if self.minimise_peak else budget - self.start_phase  # the bound on S_last
        # With no negative retained bytes S only grows, so every S_i is held to that bound too.
        self.growing = all(c.retained_bytes >= 0 for cs in problem.layers for c in cs)
        self.bounds = suffix_bounds(problem.layers) if self.growing and not self.minimise_peak else None
        self.slack = 1e-9 * max(abs(upper), 1.0) if np.isfinite(upper) else 0.0
        self.prefix = np.zeros(1)
        self.score = np.full(1, -np.inf) if self.minimise_peak else np.zeros(1)
        self.tail = np.zeros(1, dtype=np.int64)
        self.tails: dict[tuple[float, ...], int] = {(0.0,) * self.depth: 0}
        self.tail_list: list[tuple[float, ...]] = [(0.0,) * self.depth]
        self.parents: list[np.ndarray] = []
        self.picks: list[np.ndarray] = []

    def _tail_ids(self, candidates: tuple[Candidate, ...]) -> np.ndarray:
        """Per (tail id, candidate), the id of the tail after this layer: the last ``depth``
        offloaded figures."""
        step_tail = np.empty((len(self.tail_list), len(candidates)), dtype=np.int64)
        for t_id, t in enumerate(tuple(self.tail_list)):
            for c, candidate in enumerate(candidates):
                key = (*t[1:], candidate.offloaded_bytes) if self.depth else ()
                if key not in self.tails:
                    self.tails[key] = len(self.tail_list)
                    self.tail_list.append(key)
                step_tail[t_id, c] = self.tails[key]
        return step_tail

    def _extend(
        self, i: int, candidates: tuple[Candidate, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Every state extended by every candidate of layer ``i``: the new prefixes and
        objectives, which of them the budget and the bound allow, and (under a budget, with
        bounds) their potential, seconds so far plus the bound on the rest."""
        k = len(candidates)
        retained = np.array([c.retained_bytes for c in candidates])
        transient = np.array([c.transient_bytes for c in candidates])
        reloaded = np.array([sum(t) for t in self.tail_list])[self.tail]  # the tail, back for layer i
        new_prefix = (self.prefix[:, None] + retained[None, :]).ravel()
        phase = (
            (self.base + self.problem.other_grad_bytes + self.after[i] + new_prefix)
            + np.tile(transient, len(self.prefix))
            + np.repeat(reloaded, k)
        )
        potential = None
        if self.minimise_peak:
            new_score = np.maximum(np.repeat(self.score, k), phase)
            ok = np.ones(len(new_prefix), dtype=bool)
        else:
            seconds = np.array([c.extra_seconds for c in candidates])
            new_score = (self.score[:, None] + seconds[None, :]).ravel()
            ok = phase <= self.budget
            if self.growing:
                ok &= new_prefix <= self.cap_start
            if self.bounds is not None:
                least, widths, times = self.bounds[i + 1]
                room = self.cap_start - new_prefix - least
                potential = new_score + np.interp(room, widths, times)
                ok &= (room >= 0) & (potential <= self.upper + self.slack)
        return new_prefix, new_score, ok, potential

    @staticmethod
    def _staircase(
        order: np.ndarray,
        sorted_tail: np.ndarray,
        sorted_score: np.ndarray,
        potential: np.ndarray | None,
        thin: int | None,
    ) -> np.ndarray:
        """Which of the ``order``-sorted states survive: per tail, those whose score is below
        every earlier one of the same tail (thinned to ``thin`` when given)."""
        starts = np.flatnonzero(np.r_[True, sorted_tail[1:] != sorted_tail[:-1]])
        survive = np.zeros(len(order), dtype=bool)
        for a, b in zip(starts, [*starts[1:], len(order)], strict=True):
            block = sorted_score[a:b]
            stair = np.r_[True, block[1:] < np.minimum.accumulate(block)[:-1]]
            if thin is not None and stair.sum() > thin:
                # The least-bytes state, and the others with the best potential (seconds
                # so far plus the bound on the rest), else an even spread.
                steps = np.flatnonzero(stair)
                if potential is not None:
                    ranked = steps[1:][np.argsort(potential[order[a:b][steps[1:]]], kind="stable")]
                    kept = np.r_[steps[0], ranked[: thin - 1]]
                else:
                    kept = steps[np.unique(np.linspace(0, len(steps) - 1, thin).round().astype(int))]
                stair[:] = False
                stair[kept] = True
            survive[a:b] = stair
        return survive

    def step(self, i: int, candidates: tuple[Candidate, ...], thin: int | None) -> bool:
        """Layer ``i``: extend, drop what breaks the budget, keep the staircases. ``False``
        when no state survives."""
        k = len(candidates)
        step_tail = self._tail_ids(candidates)
        new_prefix, new_score, ok, potential = self._extend(i, candidates)
        idx = np.flatnonzero(ok)
        if not len(idx):
            return False
        next_tail = step_tail[self.tail].ravel()
        # Per tail, the staircase: sorted by (tail, S, score).
        order = idx[np.lexsort((new_score[idx], new_prefix[idx], next_tail[idx]))]
        survive = self._staircase(order, next_tail[order], new_score[order], potential, thin)
        chosen = order[survive]
        if len(chosen) > FRONTIER_LIMIT:
            raise _FrontierTooLarge(f"{len(chosen)} states at layer {i}")
        self.prefix, self.score, self.tail = new_prefix[chosen], new_score[chosen], next_tail[chosen]
        self.parents.append(chosen // k)
        self.picks.append(chosen % k)
        return True

    def best(self) -> tuple[int, ...] | None:
        """The best final state's choices (ties in the objective to the least bytes), traced
        back through the parents; ``None`` when no state fits."""
        if self.minimise_peak:
            final = np.maximum(
                np.maximum(self.score, self.start_phase + self.prefix), self.problem.optimizer_phase_bytes
            )
        else:
            final = np.where(self.prefix <= self.cap_start, self.score, np.inf)
            if not np.isfinite(final).any():
                return None
        lowest = final.min()
        tied = np.flatnonzero(final <= lowest + 1e-12 * max(abs(lowest), 1.0))
        state = int(tied[np.argmin(self.prefix[tied])])
        choices = []
        for i in range(len(self.problem.layers) - 1, -1, -1):
            choices.append(int(self.picks[i][state]))
            state = int(self.parents[i][state])
        choices.reverse()
        return tuple(choices)


def frontier(
    problem: PlanProblem, budget: float | None, *, thin: int | None = None, upper: float = np.inf
) -> tuple[int, ...] | None:
    """Exact dynamic program over Pareto frontiers of partial plans, layers in forward order.

    A partial plan of layers ``0..i`` is summarised by its prefix of retained bytes ``S_i``,
    the offloaded bytes of its last ``prefetch_layers`` layers (the ``tail``: they enter the
    next layers' phases) and its objective so far: the summed extra seconds when a budget is
    given, else the largest phase seen. Every later phase is ``S_i`` plus terms that depend
    on layers ``0..i`` only through the tail, so of two partial plans with the same tail the
    one with no larger ``S_i`` and no larger objective can take every continuation the other
    can, at no larger total: the other is dropped (exact; no rounding of bytes). Each step
    extends every surviving state by each undominated candidate, drops what breaks the
    budget, and keeps per tail the states on the ``(S, objective)`` staircase. Ties in time
    go to the plan that retains less.

    Under a budget, a state is also dropped when its seconds plus a lower bound on what the
    remaining layers add (``suffix_bounds``, at the bytes the budget leaves them) exceed
    ``upper``, the time of a plan known to fit. ``thin`` keeps at most that many states per
    tail, spread along the staircase (its ends kept): no longer exact, but it finds a plan
    whenever one exists, since the least-bytes state of every tail survives.

    ``problem`` holds undominated candidates only (``reduced``); returns choices indexing
    them, ``None`` when nothing fits; raises ``_FrontierTooLarge`` past ``FRONTIER_LIMIT``
    states.
    """
    if budget is not None and problem.optimizer_phase_bytes > budget:
        return None
    walk = _Walk(problem, budget, upper)
    for i, candidates in enumerate(problem.layers):
        if not walk.step(i, candidates, thin):
            return None
    return walk.best()


def search(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """``frontier`` on a reduced problem: with no budget, one exact pass for the least peak;
    under one, a beam pass (``THIN`` states per tail) for a plan that fits, then the exact
    pass bounded by that plan's time."""
    if budget is None:
        return frontier(problem, None)
    rough = frontier(problem, budget, thin=THIN)
    if rough is None:
        return None
    return frontier(problem, budget, upper=problem.seconds(rough) - problem.base_seconds)
