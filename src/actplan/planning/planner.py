"""Choose one candidate per layer: least predicted step time with predicted peak memory under a budget.

Pure (numpy and scipy): ``profile.py`` measures the candidates, this module solves. A
candidate is one way to run a layer, with ``retained_bytes`` (what the layer leaves on the
device at the end of forward), ``transient_bytes`` (what its backward, recompute included,
needs on top while it runs) and ``extra_seconds`` (its cost over keeping everything:
recompute, plus the copy time offload cannot hide).

Memory follows the phases of a step, layers in backward order (last layer first):

* backward start: ``static + nonlayer + head_transient + sum_i retained_i`` (the loss
  head's backward runs first, with every activation alive);
* layer ``i``'s backward: ``static + other_grads + sum_{j<=i} retained_j + transient_i
  + sum_{j>i} layer_grads_j`` (later layers are freed, their gradients exist), plus the
  offloaded bytes of the ``prefetch_layers`` layers before ``i``, reloaded ahead of use
  (counted whether or not layer ``i`` itself triggers the prefetch: an upper bound);
* optimizer step: ``static + all gradients + optimizer_step_bytes``;

with ``static`` = parameters and optimizer state (the backward phases also carry
``backward_extra_bytes``, a calibration from measured runs). The predicted peak is the largest of
them; ``fixed + sum retained + max transient`` (every gradient and every activation at
once) is its upper bound. Step time is ``base_seconds + sum_i extra_seconds_i``.

The choice is solved exactly by a dynamic program over Pareto frontiers of partial plans
(``_frontier``): every phase is a prefix sum of retained bytes plus terms of one layer, so a
partial plan is dominated by one with no more retained bytes, the same offloaded tail and
no more time. A beam pass finds a good plan first; the exact pass then also drops partial
plans whose LP bound on the remaining layers cannot beat it. Solving 128 layers takes a
tenth of a second (``python -m bench.planner``). The MILP (HiGHS through
``scipy.optimize.milp``, prefix sums as continuous variables) stays as the tests' oracle and
as the fallback when a frontier grows past ``FRONTIER_LIMIT`` states.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from actplan.sizes import parse_bytes

__all__ = [
    "BudgetError",
    "Candidate",
    "PlanProblem",
    "Solution",
    "brute_force",
    "front_table",
    "minimum_peak",
    "none_peak",
    "pareto_front",
    "parse_budget",
    "solve",
]


class BudgetError(ValueError):
    """A budget that cannot be read, or that no plan fits under."""


@dataclass(frozen=True)
class Candidate:
    """One way to run a layer, with its measured costs."""

    name: str  # e.g. "full", "none", "keep attn_core+mlp_up", "full+offload"
    retained_bytes: float
    transient_bytes: float
    extra_seconds: float
    offloaded_bytes: float = 0.0


@dataclass(frozen=True)
class PlanProblem:
    """Per layer (forward order), the candidates it may take; and the memory outside the layers."""

    layers: tuple[tuple[Candidate, ...], ...]
    static_bytes: float  # parameters and optimizer state
    base_seconds: float
    nonlayer_bytes: float = 0.0  # activations outside the layers, alive when backward starts
    layer_grad_bytes: tuple[float, ...] = ()  # per layer; empty means none
    other_grad_bytes: float = 0.0  # gradients of parameters outside the layers
    optimizer_step_bytes: float = 0.0  # the optimizer step's temporaries
    # Calibration: what measured backward peaks hold beyond the model above (the loss head's
    # backward, allocator timing); added to every backward phase.
    backward_extra_bytes: float = 0.0
    head_transient_bytes: float = 0.0  # the loss head's backward, at backward start
    # Offload reloads this many earlier layers during a layer's backward (counted in its phase).
    prefetch_layers: int = 0
    # Per layer, measured: what runs during its backward, or before the layer below it starts
    # (a loss head in mid-model, as multi-token prediction has), beyond the model above.
    layer_extra_bytes: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(
                "a plan problem needs at least one layer; pass layers=[candidates of layer 0, ...] "
                "(actplan.planning.budget builds it from a profile)"
            )
        for index, candidates in enumerate(self.layers):
            if not candidates:
                raise ValueError(
                    f"layer {index} has no candidates; give every layer at least one (its 'none' "
                    "candidate, no checkpointing, always fits)"
                )
        for index, candidates in enumerate(self.layers):
            for candidate in candidates:
                for field in ("retained_bytes", "transient_bytes", "extra_seconds", "offloaded_bytes"):
                    value = getattr(candidate, field)
                    if not math.isfinite(value):
                        raise ValueError(
                            f"layer {index}, candidate {candidate.name!r}: {field} is {value}; costs must be "
                            "finite numbers (a failed measurement? profile again with --refresh)"
                        )
        if self.layer_extra_bytes and len(self.layer_extra_bytes) != len(self.layers):
            raise ValueError(
                f"layer_extra_bytes has {len(self.layer_extra_bytes)} entries for {len(self.layers)} "
                "layers; give one per layer, or none"
            )
        if self.layer_grad_bytes and len(self.layer_grad_bytes) != len(self.layers):
            raise ValueError(
                f"layer_grad_bytes has {len(self.layer_grad_bytes)} entries for {len(self.layers)} layers; "
                "give one entry per layer, or leave it empty for none"
            )

    def _grads(self) -> tuple[float, ...]:
        return self.layer_grad_bytes or (0.0,) * len(self.layers)

    def extras(self) -> tuple[float, ...]:
        """Per layer, its measured extra backward bytes (zeros when none were given)."""
        return self.layer_extra_bytes or (0.0,) * len(self.layers)

    def grads_after(self) -> list[float]:
        """Per layer ``i``, gradient bytes of layers after it (already produced in backward)."""
        grads = self._grads()
        return [sum(grads[i + 1 :]) for i in range(len(grads))]

    @property
    def optimizer_phase_bytes(self) -> float:
        return self.static_bytes + self.other_grad_bytes + sum(self._grads()) + self.optimizer_step_bytes

    def phases(self, choices: Sequence[int]) -> list[float]:
        """Predicted bytes of every phase: backward start, each layer's backward (forward
        order), the optimizer step."""
        picked = [self.layers[i][c] for i, c in enumerate(choices)]
        after = self.grads_after()
        extra = self.extras()
        base = self.static_bytes + self.backward_extra_bytes
        phases = [
            base + self.nonlayer_bytes + self.head_transient_bytes + sum(p.retained_bytes for p in picked)
        ]
        retained = 0.0
        for i, p in enumerate(picked):
            retained += p.retained_bytes
            prefetched = sum(q.offloaded_bytes for q in picked[max(i - self.prefetch_layers, 0) : i])
            phases.append(
                base + self.other_grad_bytes + retained + p.transient_bytes + prefetched + after[i] + extra[i]
            )
        phases.append(self.optimizer_phase_bytes)
        return phases

    def peak(self, choices: Sequence[int]) -> float:
        return max(self.phases(choices))

    def seconds(self, choices: Sequence[int]) -> float:
        return self.base_seconds + sum(self.layers[i][c].extra_seconds for i, c in enumerate(choices))


@dataclass(frozen=True)
class Solution:
    choices: tuple[int, ...]  # candidate index per layer
    names: tuple[str, ...]
    predicted_peak_bytes: float
    predicted_seconds: float
    budget_bytes: float


_MIB = float(2**20)


@functools.lru_cache(maxsize=256)
def _undominated(candidates: tuple[Candidate, ...]) -> tuple[int, ...]:
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


def _reduced(problem: PlanProblem) -> tuple[PlanProblem, list[tuple[int, ...]]]:
    """The problem on each layer's undominated candidates, and the map back to full indices."""
    keep = [_undominated(cs) for cs in problem.layers]
    reduced = replace(
        problem, layers=tuple(tuple(cs[i] for i in k) for cs, k in zip(problem.layers, keep, strict=True))
    )
    return reduced, keep


def _milp(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """The MILP on the undominated candidates; choices index the full candidate lists. Kept
    as the exact oracle the frontier solver is tested against (and its fallback)."""
    reduced, keep = _reduced(problem)
    choices = _milp_reduced(reduced, budget)
    if choices is None:
        return None
    return tuple(k[c] for k, c in zip(keep, choices, strict=True))


# The frontier solver gives up (and the MILP answers) past this many states in one layer.
FRONTIER_LIMIT = 400_000
# States per tail the beam pass keeps: it finds a plan that fits fast, whose time bounds
# the exact pass.
_THIN = 16


class _FrontierTooLarge(Exception):
    pass


@functools.lru_cache(maxsize=8)
def _suffix_bounds(layers: tuple[tuple[Candidate, ...], ...]) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Per layer ``i``, a lower bound on the extra seconds of layers ``i..`` as a function of
    the retained bytes they may add: the LP relaxation of that multiple-choice knapsack
    (each layer on the lower convex hull of its (retained, seconds) points, the hull's
    segments taken steepest first). Returned as ``(least retained, bytes, seconds)``: the
    bound at capacity ``c`` is ``interp(c - least, bytes, seconds)``, infinite below ``least``.
    Index ``len(layers)`` is the empty suffix."""
    hulls = []
    for candidates in layers:
        points = sorted({(c.retained_bytes, c.extra_seconds) for c in candidates})
        hull: list[tuple[float, float]] = []
        for x, y in points:
            if hull and y >= hull[-1][1]:
                continue  # more bytes for no less time: never on the lower-left hull
            while len(hull) >= 2 and (
                (hull[-1][0] - hull[-2][0]) * (y - hull[-2][1])
                <= (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
            ):
                hull.pop()
            hull.append((x, y))
        hulls.append(hull)
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


def _frontier(
    reduced: PlanProblem, budget: float | None, *, thin: int | None = None, upper: float = np.inf
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
    remaining layers add (``_suffix_bounds``, at the bytes the budget leaves them) exceed
    ``upper``, the time of a plan known to fit. ``thin`` keeps at most that many states per
    tail, spread along the staircase (its ends kept): no longer exact, but it finds a plan
    whenever one exists, since the least-bytes state of every tail survives.

    ``reduced`` holds undominated candidates only (``_reduced``); returns choices indexing
    them, ``None`` when nothing fits; raises ``_FrontierTooLarge`` past ``FRONTIER_LIMIT``
    states.
    """
    layers = reduced.layers
    depth = reduced.prefetch_layers
    minimise_peak = budget is None
    base = reduced.static_bytes + reduced.backward_extra_bytes
    after = [a + e for a, e in zip(reduced.grads_after(), reduced.extras(), strict=True)]
    start_phase = base + reduced.nonlayer_bytes + reduced.head_transient_bytes
    if not minimise_peak and reduced.optimizer_phase_bytes > budget:
        return None
    cap_start = np.inf if minimise_peak else budget - start_phase  # the bound on S_last
    # With no negative retained bytes S only grows, so every S_i is held to that bound too.
    growing = all(c.retained_bytes >= 0 for cs in layers for c in cs)
    bounds = _suffix_bounds(layers) if growing and not minimise_peak else None
    slack = 1e-9 * max(abs(upper), 1.0) if np.isfinite(upper) else 0.0

    # States: prefix bytes, objective, tail id; per layer the parent state and candidate.
    prefix = np.zeros(1)
    score = np.full(1, -np.inf) if minimise_peak else np.zeros(1)
    tail = np.zeros(1, dtype=np.int64)
    tails: dict[tuple[float, ...], int] = {(0.0,) * depth: 0}
    tail_list: list[tuple[float, ...]] = [(0.0,) * depth]
    parents: list[np.ndarray] = []
    picks: list[np.ndarray] = []
    for i, candidates in enumerate(layers):
        k = len(candidates)
        retained = np.array([c.retained_bytes for c in candidates])
        transient = np.array([c.transient_bytes for c in candidates])
        # The tail after this layer: the last `depth` offloaded figures, as ids.
        step_tail = np.empty((len(tail_list), k), dtype=np.int64)
        for t_id, t in enumerate(tuple(tail_list)):
            for c, candidate in enumerate(candidates):
                key = (*t[1:], candidate.offloaded_bytes) if depth else ()
                if key not in tails:
                    tails[key] = len(tail_list)
                    tail_list.append(key)
                step_tail[t_id, c] = tails[key]
        reloaded = np.array([sum(t) for t in tail_list])[tail]  # the tail, back for layer i
        new_prefix = (prefix[:, None] + retained[None, :]).ravel()
        phase = (
            (base + reduced.other_grad_bytes + after[i] + new_prefix)
            + np.tile(transient, len(prefix))
            + np.repeat(reloaded, k)
        )
        potential = None
        if minimise_peak:
            new_score = np.maximum(np.repeat(score, k), phase)
            ok = np.ones(len(new_prefix), dtype=bool)
        else:
            seconds = np.array([c.extra_seconds for c in candidates])
            new_score = (score[:, None] + seconds[None, :]).ravel()
            ok = phase <= budget
            if growing:
                ok &= new_prefix <= cap_start
            if bounds is not None:
                least, widths, times = bounds[i + 1]
                room = cap_start - new_prefix - least
                potential = new_score + np.interp(room, widths, times)
                ok &= (room >= 0) & (potential <= upper + slack)
        idx = np.flatnonzero(ok)
        if not len(idx):
            return None
        next_tail = step_tail[tail].ravel()
        # Per tail, the staircase: sorted by (tail, S, score), keep a state only when its score
        # is below every earlier one of the same tail.
        order = idx[np.lexsort((new_score[idx], new_prefix[idx], next_tail[idx]))]
        sorted_tail, sorted_score = next_tail[order], new_score[order]
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
        chosen = order[survive]
        if len(chosen) > FRONTIER_LIMIT:
            raise _FrontierTooLarge(f"{len(chosen)} states at layer {i}")
        prefix, score, tail = new_prefix[chosen], new_score[chosen], next_tail[chosen]
        parents.append(chosen // k)
        picks.append(chosen % k)
    if minimise_peak:
        final = np.maximum(np.maximum(score, start_phase + prefix), reduced.optimizer_phase_bytes)
    else:
        final = np.where(prefix <= cap_start, score, np.inf)
        if not np.isfinite(final).any():
            return None
    best = final.min()
    tied = np.flatnonzero(final <= best + 1e-12 * max(abs(best), 1.0))
    state = int(tied[np.argmin(prefix[tied])])
    choices = []
    for i in range(len(layers) - 1, -1, -1):
        choices.append(int(picks[i][state]))
        state = int(parents[i][state])
    choices.reverse()
    return tuple(choices)


def _exact(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """The least time under ``budget`` (or, with ``None``, the least peak), exactly.

    Under a budget: a beam pass (``_frontier`` with ``thin``: per tail the states with the
    best seconds-plus-bound) finds a plan that fits, or shows none does; then the exact
    pass drops every partial plan whose bound says it cannot beat that plan. The MILP
    answers where the frontier grows past ``FRONTIER_LIMIT``.
    """
    reduced, keep = _reduced(problem)
    try:
        choices = _frontier_search(reduced, budget)
    except _FrontierTooLarge:
        return _milp(problem, budget)
    if choices is None:
        return None
    return tuple(k[c] for k, c in zip(keep, choices, strict=True))


def _frontier_search(reduced: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    if budget is None:
        return _frontier(reduced, None)
    rough = _frontier(reduced, budget, thin=_THIN)
    if rough is None:
        return None
    return _frontier(reduced, budget, upper=reduced.seconds(rough) - reduced.base_seconds)


def _milp_reduced(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """Least time under ``budget``, or (``budget=None``) least peak. ``None``: nothing fits.

    Variables: one binary per (layer, candidate); S_i, the retained bytes of layers 0..i;
    and, when minimising the peak, P. Bytes are in MiB for HiGHS.
    """
    sizes = [len(c) for c in problem.layers]
    n, layers = sum(sizes), len(sizes)
    retained = np.array([c.retained_bytes / _MIB for cs in problem.layers for c in cs])
    transient = np.array([c.transient_bytes / _MIB for cs in problem.layers for c in cs])
    offloaded = np.array([c.offloaded_bytes / _MIB for cs in problem.layers for c in cs])
    starts = np.cumsum([0, *sizes])
    seconds = np.array([c.extra_seconds for cs in problem.layers for c in cs])
    minimise_peak = budget is None
    width = n + layers + (1 if minimise_peak else 0)
    s0, p_col = n, n + layers
    static = (problem.static_bytes + problem.backward_extra_bytes) / _MIB
    after = [(a + e) / _MIB for a, e in zip(problem.grads_after(), problem.extras(), strict=True)]
    other = problem.other_grad_bytes / _MIB
    cap = (budget or 0.0) / _MIB

    one_hot = np.zeros((layers, width))
    prefix = np.zeros((layers, width))
    phase = np.zeros((layers + 1, width))
    phase_upper = np.zeros(layers + 1)
    start = 0
    for i, size in enumerate(sizes):
        block = slice(start, start + size)
        one_hot[i, block] = 1.0
        # S_i - S_{i-1} - retained_i = 0
        prefix[i, s0 + i] = 1.0
        if i:
            prefix[i, s0 + i - 1] = -1.0
        prefix[i, block] = -retained[block]
        # Layer i's backward: S_i + transient_i <= cap - static - other - grads after i
        phase[i, s0 + i] = 1.0
        phase[i, block] = transient[block]
        # The earlier layers prefetched while this one runs: their offloaded bytes are back.
        for j in range(max(i - problem.prefetch_layers, 0), i):
            earlier = slice(starts[j], starts[j + 1])
            phase[i, earlier] = offloaded[earlier]
        phase_upper[i] = cap - static - other - after[i]
        start += size
    # Backward start: S_last <= cap - static - nonlayer
    phase[layers, s0 + layers - 1] = 1.0
    phase_upper[layers] = cap - static - (problem.nonlayer_bytes + problem.head_transient_bytes) / _MIB
    if minimise_peak:
        phase[:, p_col] = -1.0  # every phase <= P, P minimised
    constraints = [
        LinearConstraint(one_hot, 1.0, 1.0),
        LinearConstraint(prefix, 0.0, 0.0),
        LinearConstraint(phase, -np.inf, phase_upper),
    ]
    cost = np.zeros(width)
    if minimise_peak:
        cost[p_col] = 1.0
    else:
        # Ties in time go to the plan that retains less (a weight far below any time difference).
        span = max(float(retained.sum()), 1.0)
        cost[:n] = seconds + max(float(np.abs(seconds).max()), 1e-9) * 1e-7 / span * retained
    integrality = np.concatenate([np.ones(n), np.zeros(width - n)])
    bounds = Bounds(
        np.concatenate([np.zeros(n), np.full(width - n, -np.inf)]),
        np.concatenate([np.ones(n), np.full(width - n, np.inf)]),
    )
    result = milp(
        cost, constraints=constraints, integrality=integrality, bounds=bounds, options={"mip_rel_gap": 0}
    )
    if result.status == 2:  # infeasible
        return None
    if not result.success:
        raise RuntimeError(
            f"the MILP solver (scipy.optimize.milp, HiGHS) failed: {result.message} (status "
            f"{result.status}); this is a solver problem, not a budget one: upgrade scipy and retry, "
            "and please report it with the profile (actplan profile --json)"
        )
    choices = []
    start = 0
    for size in sizes:
        choices.append(int(np.argmax(result.x[start : start + size])))
        start += size
    return tuple(choices)


def minimum_peak(problem: PlanProblem) -> tuple[float, tuple[int, ...]]:
    """The smallest predicted peak any choice reaches, and that choice."""
    choices = _exact(problem, None)
    if choices is None:  # every choice has a finite peak; the solver must find one
        raise RuntimeError("the planner found no plan without a budget; please report this")
    return problem.peak(choices), choices


def none_peak(problem: PlanProblem) -> float | None:
    """The predicted peak with every layer on its ``none`` candidate (no checkpointing), or
    ``None`` where some layer has no candidate of that name."""
    choices = []
    for candidates in problem.layers:
        names = [c.name for c in candidates]
        if "none" not in names:
            return None
        choices.append(names.index("none"))
    return problem.peak(choices)


def solve(problem: PlanProblem, budget_bytes: float) -> Solution:
    """The fastest predicted choice whose predicted peak is at most ``budget_bytes``.

    Raises ``BudgetError`` stating the feasible range when no choice fits.
    """
    # A hair of slack so a budget equal to a candidate's exact peak admits it despite rounding.
    fits = problem.optimizer_phase_bytes <= budget_bytes
    choices = _exact(problem, budget_bytes * (1 + 1e-9) + 1) if fits else None
    if choices is None or problem.peak(choices) > budget_bytes * (1 + 1e-6) + 1:
        minimum, _ = minimum_peak(problem)
        top = none_peak(problem)
        feasible = f"{_gib(minimum)} ({minimum:,.0f} bytes)" + (
            f" up to the no-checkpoint peak {_gib(top)}" if top is not None else ""
        )
        raise BudgetError(
            f"no plan fits a budget of {_gib(budget_bytes)}: predicted peaks range from {feasible}. "
            f"Parameters and optimizer state take {_gib(problem.static_bytes)} and the optimizer "
            f"step {_gib(problem.optimizer_phase_bytes)}, whatever the plan. Raise the budget to at "
            "least the minimum, or add cheaper choices (offload)"
        )
    return Solution(
        choices=choices,
        names=tuple(problem.layers[i][c].name for i, c in enumerate(choices)),
        predicted_peak_bytes=problem.peak(choices),
        predicted_seconds=problem.seconds(choices),
        budget_bytes=budget_bytes,
    )


def pareto_front(problem: PlanProblem, limit: int = 1000) -> list[Solution]:
    """Every plan on the front of predicted peak against predicted time, least peak first:
    each is the fastest plan at its peak, and each is faster than every plan of a lower peak.

    Found by solving at no budget, then just under the last plan's peak, until nothing fits
    (exact: a plan the walk skips would be faster than the next one found below it). At most
    ``limit`` points; a longer front raises ``ValueError``.
    """
    front: list[Solution] = []
    lowest, _ = minimum_peak(problem)
    budget = float("inf")
    while True:
        solution = solve(problem, budget)
        if front and solution.predicted_seconds <= front[-1].predicted_seconds * (1 + 1e-12):
            front[-1] = solution  # as fast at a lower peak: it replaces the point above
        else:
            front.append(solution)
        if len(front) > limit:
            raise ValueError(f"the front has more than {limit} points; pass a larger limit")
        budget = solution.predicted_peak_bytes * (1 - 1e-6) - 2
        if budget < lowest:
            break
    front.reverse()
    return front


def front_table(front: Sequence[Solution], base_seconds: float, top_peak: float | None = None) -> str:
    """The front as plain text: peak (and its share of ``top_peak``), step time against
    ``base_seconds``, and each plan's candidates by layer range."""
    rows = [("peak", "share", "step time", "plan (layers: candidate)")]
    for s in front:
        share = f"{s.predicted_peak_bytes / top_peak:.0%}" if top_peak else "-"
        rows.append(
            (
                _gib(s.predicted_peak_bytes),
                share,
                f"{s.predicted_seconds / base_seconds:.3f}x",
                plan_summary(s.names),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(r[i].rjust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows)


def plan_summary(names: Sequence[str]) -> str:
    """``'0-1 full; 2-5 matmuls+offload'``: consecutive layers with the same candidate merged."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{span} {names[start]}")
            start = i
    return "; ".join(parts)


def brute_force(problem: PlanProblem, budget_bytes: float) -> tuple[float, tuple[int, ...]] | None:
    """Enumerate every choice (small problems only): the least time under the budget, or None."""
    best: tuple[float, tuple[int, ...]] | None = None
    for choices in itertools.product(*(range(len(c)) for c in problem.layers)):
        if problem.peak(choices) <= budget_bytes:
            seconds = problem.seconds(choices)
            if best is None or seconds < best[0] - 1e-12:
                best = (seconds, choices)
    return best


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")


def parse_budget(text: str | int | float, none_peak_bytes: float | None = None) -> float:
    """``'40GiB'``, ``'1.5GB'``, ``123456`` (bytes) or ``'55%'`` of the no-checkpoint peak."""
    if isinstance(text, str):
        match = _PERCENT.match(text)
        if match:
            percent = float(match.group(1))
            if percent <= 0:
                raise BudgetError(f"budget {text!r} must be above 0%")
            if none_peak_bytes is None:
                raise BudgetError(
                    f"budget {text!r} is a fraction of the no-checkpoint peak, which is not known "
                    "here; give the budget in bytes (e.g. '40GiB')"
                )
            return none_peak_bytes * percent / 100
    try:
        value = parse_bytes(text)
    except ValueError as err:
        raise BudgetError(f"cannot read budget {text!r}: {err}; or write a percentage like '55%'") from None
    if value <= 0:
        raise BudgetError(f"budget {text!r} must be positive")
    return float(value)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
