"""The planner's exact solver: dynamic programs over Pareto frontiers of partial plans, walked
from both ends of the stack and joined where they meet, pruned by lower bounds on the layers
still to come (``_bounds``) and by a target time that rises until a plan meets it.

Private to ``actplan.planning.planner``. Imports numpy, the bounds and the problem records.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from actplan.planning._bounds import Bounds, Costs

if TYPE_CHECKING:
    from actplan.planning._records import Candidate, PlanProblem

# The frontier solver gives up (and the MILP answers) past this many states in one layer;
# under a host budget that binds, past fewer: partial plans then differ in their offloaded
# totals too, a third dimension whose frontiers grow fast on deep stacks (the priced search's
# plan answers then, ``_host``; the MILP where there is no device budget).
FRONTIER_LIMIT = 400_000
HOSTED_LIMIT = 100_000
# States the beam pass keeps besides each tail's least-bytes one: it finds a plan that fits,
# the first one to beat.
THIN = 64
# Key groups whose states are tried against every other group's (dominance across tails).
BEATERS = 32
# The first target sits this share of the way from the lower bound to the beam's plan; each
# target that no plan meets is followed by one RISE times as far (three walks at most).
FIRST_TARGET, RISE = 1 / 16, 4.0


class Priced(Protocol):
    """A second lower bound on a whole plan's seconds, from a partial plan's seconds, offloaded
    total and the bytes it retains (forward) or leaves room for (backward): ``_host.Priced``."""

    def after(self, i: int, prefix: np.ndarray, score: np.ndarray, hosted: np.ndarray) -> np.ndarray: ...

    def before(self, j: int, room: np.ndarray, score: np.ndarray, hosted: np.ndarray) -> np.ndarray: ...


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


def _pareto(keys: np.ndarray, worse: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The states no other state dominates: none with no larger ``keys`` in every column, no
    larger ``worse`` and no larger ``score`` (of identical states one is kept). Returns their
    indices, ordered by key group (equal keys) and then ``worse``, and each one's group number."""
    if not len(score):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.lexsort((score, worse, *keys.T[::-1]))
    if keys.shape[1]:
        ordered = keys[order]
        group = np.cumsum(np.concatenate(([0], (ordered[1:] != ordered[:-1]).any(axis=1))))
    else:
        group = np.zeros(len(order), dtype=np.int64)
    # Per group a staircase: each state faster than every one of the group with fewer bytes.
    # Dense ranks of the scores are exact; shifting each group's below every earlier group's
    # lets one running minimum over the whole array restart at every group.
    rank = score[order]
    if group[-1] > 0:
        by_score = np.argsort(rank, kind="stable")
        dense = np.cumsum(np.concatenate(([0], np.diff(rank[by_score]) != 0)))
        rank = np.empty(len(order), dtype=np.int64)
        rank[by_score] = dense - group[by_score] * (len(order) + 1)
    kept = np.concatenate(([True], rank[1:] < np.minimum.accumulate(rank)[:-1]))
    order, group = order[kept], group[kept]
    if group[-1] > 0:
        starts, ends = _runs(group)
        beaten = _beaten_across(keys[order[starts]], group, starts, ends, worse[order], score[order])
        order, group = order[~beaten], group[~beaten]
    return order, group


def _runs(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of equal values of the sorted ``group`` starts and ends."""
    starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    return starts, np.append(starts[1:], len(group))


def _beaten_across(
    group_keys: np.ndarray,
    group: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    worse: np.ndarray,
    score: np.ndarray,
) -> np.ndarray:
    """Which states a state of another group with no larger keys beats or ties on ``worse`` and
    ``score`` (each group a staircase: rising ``worse``, falling ``score``). The groups of least
    key sum are tried as beaters, at most ``BEATERS`` of them (fewer only finds fewer)."""
    run = np.repeat(np.arange(len(starts)), ends - starts)
    beaten = np.zeros(len(group), dtype=bool)
    tried = 0
    for h in np.argsort(group_keys.sum(axis=1), kind="stable").tolist():
        # below: the groups whose keys are no smaller than h's anywhere.
        below = (group_keys[h] <= group_keys).all(axis=1)
        below[h] = False
        if not below.any():
            continue
        tried += 1
        if tried > BEATERS:
            break
        target = np.flatnonzero(below[run])
        stair_worse, stair_score = worse[starts[h] : ends[h]], score[starts[h] : ends[h]]
        at = np.searchsorted(stair_worse, worse[target], side="right") - 1
        beaten[target] |= (at >= 0) & (stair_score[np.maximum(at, 0)] <= score[target])
    return beaten


class _Forward:
    """Partial plans of layers ``0..last``, as the forward walk keeps them: per state the retained
    bytes ``prefix``, the objective ``score`` (seconds, or with no budget the largest phase so far)
    and ``keys``, the offloaded bytes of its last 1..depth layers summed (``keys[:, m-1]``: the
    last ``m``), which is all later phases see of its tail; under a host budget that binds,
    ``hosted``, its offloaded bytes over all its layers; per layer each state's parent and pick.
    """

    def __init__(self, costs: Costs, budget: float | None, priced: Priced | None = None) -> None:
        self.costs, self.budget, self.priced = costs, budget, priced
        self.last = -1
        self.prefix = np.zeros(1)
        self.score = np.full(1, -np.inf) if budget is None else np.zeros(1)
        self.keys = np.zeros((1, costs.depth))
        self.hosted = np.zeros(1)
        self.parents: list[np.ndarray] = []
        self.picks: list[np.ndarray] = []
        self.thinned = False  # whether ``thin`` ever dropped a state: the walk is exact if not

    def step(self, bounds: Bounds | None, target: float, thin: int | None = None) -> int:
        """Extend every state by every candidate of the next layer; drop what breaks the budget,
        what the bound says cannot meet ``target`` and what another state dominates. Returns how
        many states are left."""
        costs, i = self.costs, self.last + 1
        retained, transient, seconds, offloaded = costs.layer(i)
        k, n = len(retained), len(self.prefix)
        prefix = (self.prefix[:, None] + retained).ravel()
        reloaded = np.repeat(self.keys[:, -1], k) if costs.depth else 0.0
        phase = costs.fixed[i] + prefix + np.tile(transient, n) + reloaded
        potential = None
        hosted = (self.hosted[:, None] + offloaded).ravel()
        if self.budget is None:
            score = np.maximum(np.repeat(self.score, k), phase)
            kept = np.flatnonzero(hosted <= costs.host_cap)
        else:
            score = (self.score[:, None] + seconds).ravel()
            if bounds is None:
                raise RuntimeError("internal error: a walk under a budget has no bounds; please report it")
            kept = np.flatnonzero(
                (phase <= self.budget) & (prefix <= bounds.cap[i]) & (hosted <= costs.host_cap)
            )
            potential = score[kept] + bounds.after(i, prefix[kept])
            if self.priced is not None:
                potential = np.maximum(
                    potential, self.priced.after(i, prefix[kept], score[kept], hosted[kept])
                )
            fits = potential <= target
            kept, potential = kept[fits], potential[fits]
        keys = np.empty((len(kept), costs.depth))
        if costs.depth:
            keys[:, 0] = offloaded[kept % k]
            keys[:, 1:] = self.keys[kept // k, :-1] + keys[:, :1]
        survive, group = _pareto(_with_hosted(costs, keys, hosted[kept]), prefix[kept], score[kept])
        if thin is not None and potential is not None and len(survive) > thin:
            kept_before = len(survive)
            survive = _thinned(survive, group, potential, thin)
            self.thinned |= len(survive) < kept_before
        chosen = kept[survive]
        if len(chosen) > (HOSTED_LIMIT if costs.hosted else FRONTIER_LIMIT):
            raise _FrontierTooLarge(f"{len(chosen)} states at layer {i}")
        self.prefix, self.score, self.keys = prefix[chosen], score[chosen], keys[survive]
        self.hosted = hosted[chosen]
        self.parents.append(chosen // k)
        self.picks.append(chosen % k)
        self.last = i
        return len(chosen)

    def trace(self, state: int) -> list[int]:
        """The choices of layers ``0..last`` that lead to ``state``."""
        return _walk_back(self.parents, self.picks, state)[::-1]


def _with_hosted(costs: Costs, keys: np.ndarray, hosted: np.ndarray) -> np.ndarray:
    """``keys`` with the offloaded totals as one more column when a host budget binds: a
    partial plan is then dominated only by one that moved no more to the host."""
    return np.column_stack((keys, hosted)) if costs.hosted else keys


def _walk_back(parents: list[np.ndarray], picks: list[np.ndarray], state: int) -> list[int]:
    """The choices from the newest step back to the first, following ``state``'s parents."""
    choices = []
    for step_parents, step_picks in zip(reversed(parents), reversed(picks), strict=True):
        choices.append(int(step_picks[state]))
        state = int(step_parents[state])
    return choices


def _thinned(survive: np.ndarray, group: np.ndarray, potential: np.ndarray, thin: int) -> np.ndarray:
    """Of ``survive`` (``group``: theirs; each group's least bytes first), each group's
    least-bytes state and the ``thin`` others of best potential."""
    first = np.zeros(len(survive), dtype=bool)
    first[_runs(group)[0]] = True
    others = np.flatnonzero(~first)
    best = others[np.argsort(potential[survive[others]], kind="stable")[:thin]]
    return survive[np.sort(np.concatenate((np.flatnonzero(first), best)))]


class _Backward:
    """Partial plans of layers ``first..n-1``, as the backward walk keeps them: per state its
    seconds, its retained bytes, ``cap`` (the most retained bytes layers ``0..first-1`` may hold
    for every phase it fixes to fit) and ``heads``: for each phase of layers ``first..first+depth-1``,
    what those bytes plus the offloaded bytes reloaded into it from before ``first`` may come to."""

    def __init__(self, costs: Costs, budget: float, priced: Priced | None = None) -> None:
        self.costs, self.budget, self.priced = costs, budget, priced
        self.first = costs.layers
        self.cap = np.array([budget - costs.start_phase])
        self.heads = np.full((1, costs.depth), np.inf)
        self.score = np.zeros(1)
        self.retained = np.zeros(1)
        self.hosted = np.zeros(1)
        self.parents: list[np.ndarray] = []
        self.picks: list[np.ndarray] = []

    def step(self, bounds: Bounds, target: float) -> int:
        """Put every candidate of the layer before ``first`` under every state; drop what no
        prefix can complete, what the bound says cannot meet ``target`` and what is dominated."""
        costs, j = self.costs, self.first - 1
        retained, transient, seconds, offloaded = costs.layer(j)
        k, n, depth = len(retained), len(self.cap), costs.depth
        own = np.tile(self.budget - costs.fixed[j] - transient - retained, n)
        cap = (self.cap[:, None] - retained).ravel()
        heads = np.empty((n * k, depth))
        if depth:
            moved = np.tile(retained + offloaded, n)
            # The oldest head's phase now has every reload it takes: it joins the cap.
            cap = np.minimum(cap, np.repeat(self.heads[:, -1], k) - moved)
            heads[:, 0] = own
            heads[:, 1:] = np.repeat(self.heads[:, :-1], k, axis=0) - moved[:, None]
            room = np.minimum(cap, heads.min(axis=1))
        else:
            cap = room = np.minimum(cap, own)
        score = (self.score[:, None] + seconds).ravel()
        hosted = (self.hosted[:, None] + offloaded).ravel()
        kept = np.flatnonzero((room >= costs.least_prefix[j]) & (hosted <= costs.host_cap))
        potential = score[kept] + bounds.before(j, room[kept])
        if self.priced is not None:
            potential = np.maximum(potential, self.priced.before(j, room[kept], score[kept], hosted[kept]))
        kept = kept[potential <= target]
        survive, _ = _pareto(_with_hosted(costs, -heads[kept], hosted[kept]), -cap[kept], score[kept])
        chosen = kept[survive]
        if len(chosen) > (HOSTED_LIMIT if costs.hosted else FRONTIER_LIMIT):
            raise _FrontierTooLarge(f"{len(chosen)} states at layer {j}")
        self.cap, self.heads, self.score = cap[chosen], heads[chosen], score[chosen]
        self.retained = (self.retained[:, None] + retained).ravel()[chosen]
        self.hosted = hosted[chosen]
        self.parents.append(chosen // k)
        self.picks.append(chosen % k)
        self.first = j
        return len(chosen)

    def trace(self, state: int) -> list[int]:
        """The choices of layers ``first..n-1`` that ``state`` holds."""
        return _walk_back(self.parents, self.picks, state)


def _join(forward: _Forward, backward: _Backward) -> tuple[float, tuple[int, ...]] | None:
    """The fastest whole plan a forward state and a backward state that meet make (ties to the
    one that retains less), with its seconds; ``None`` when no pair fits together."""
    costs = forward.costs
    depth = costs.depth
    best: tuple[float, float, int, int] | None = None
    tails = _with_hosted(costs, forward.keys, forward.hosted)
    if tails.shape[1]:
        group = np.unique(tails, axis=0, return_inverse=True)[1].ravel()
    else:
        group = np.zeros(len(forward.prefix), dtype=np.int64)
    for g in np.unique(group):
        mine = np.flatnonzero(group == g)
        keys = forward.keys[mine[0]]
        # The backward states this head leaves room for on the host.
        open_ = np.flatnonzero(backward.hosted <= costs.host_cap - forward.hosted[mine[0]])
        if not len(open_):
            continue
        # What this tail leaves the backward state: its phases take the tail's reloads.
        room = backward.cap[open_]
        for q in range(depth):
            room = np.minimum(room, backward.heads[open_, q] - keys[depth - 1 - q])
        their_score, their_retained = backward.score[open_], backward.retained[open_]
        order = np.lexsort((their_retained, their_score, -room))
        fastest = np.minimum.accumulate(their_score[order])
        at = np.maximum.accumulate(np.where(their_score[order] <= fastest, np.arange(len(order)), 0))
        fits = np.searchsorted(-room[order], -forward.prefix[mine], side="right")
        ok = fits > 0
        if not ok.any():
            continue
        mine, pos = mine[ok], fits[ok] - 1
        total = forward.score[mine] + fastest[pos]
        partner = open_[order[at[pos]]]
        least = total.min()
        tied = np.flatnonzero(total <= least + 1e-12 * max(abs(least), 1.0))
        bytes_held = forward.prefix[mine[tied]] + backward.retained[partner[tied]]
        pick = tied[np.argmin(bytes_held)]
        candidate = (float(total[pick]), float(bytes_held.min()), int(mine[pick]), int(partner[pick]))
        if (
            best is None
            or candidate[0] < best[0] - 1e-12 * max(abs(best[0]), 1.0)
            or (candidate[0] <= best[0] + 1e-12 * max(abs(best[0]), 1.0) and candidate[1] < best[1])
        ):
            best = candidate
    if best is None:
        return None
    return best[0], tuple(forward.trace(best[2]) + backward.trace(best[3]))


def _meet(
    costs: Costs, bounds: Bounds, budget: float, target: float, priced: Priced | None = None
) -> tuple[float, tuple[int, ...]] | None:
    """Walk from both ends, always extending the smaller frontier, and join. Exact for
    ``target``: when some plan takes at most ``target`` seconds, the fastest is returned;
    otherwise whatever fitting plan the join finds (or ``None``)."""
    forward, backward = _Forward(costs, budget, priced), _Backward(costs, budget, priced)
    left, right = 1, 1
    while forward.last + 1 < backward.first:
        if left <= right:
            left = forward.step(bounds, target)
        else:
            right = backward.step(bounds, target)
        if not left or not right:
            return None
    return _join(forward, backward)


def _forward_only(
    costs: Costs, budget: float | None, bounds: Bounds | None = None, *, thin: int | None = None
) -> tuple[tuple[int, ...] | None, bool]:
    """One forward walk over every layer, and whether it was exact: with no budget, exact for
    the least peak; under a budget with ``thin``, the beam pass (it finds a plan whenever one
    exists, since every tail's least-bytes state survives; exact when it never thinned)."""
    walk = _Forward(costs, budget)
    for _ in range(costs.layers):
        if not walk.step(bounds, np.inf, thin):
            return None, True
    if budget is None:
        final = np.maximum(np.maximum(walk.score, costs.start_phase + walk.prefix), costs.optimizer_phase)
    else:
        final = walk.score
    lowest = final.min()
    tied = np.flatnonzero(final <= lowest + 1e-12 * max(abs(lowest), 1.0))
    return tuple(walk.trace(int(tied[np.argmin(walk.prefix[tied])]))), not walk.thinned


def search(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """The fastest plan under ``budget`` (or, with ``None``, the least peak), exactly, on a
    reduced problem (``reduced``); ``None`` when nothing fits.

    Under a budget: the beam pass finds a plan that fits (or shows none does; when it never had
    to thin, it was the exact walk and its plan is the answer). Then targets rise from the
    lower bound on the whole plan towards that plan's time; at each, both walks
    keep only partial plans whose seconds plus the bound on the rest meet the target, so a
    target at or above the optimum finds the optimum (a fitting plan the join finds above the
    target replaces the one to beat). The last target is the time of the best plan known, which
    the walks always meet. Raises ``_FrontierTooLarge`` past ``FRONTIER_LIMIT`` states.
    """
    costs = Costs.of(problem)
    if budget is None:
        return _forward_only(costs, None)[0]
    if costs.optimizer_phase > budget:
        return None
    bounds = Bounds(costs, budget)
    if not np.isfinite(bounds.lowest):
        return None
    choices, exact = _forward_only(costs, budget, bounds, thin=THIN)
    if choices is None or exact:
        return choices
    best = costs.seconds(choices)
    slack = 1e-9 * max(abs(best), 1.0)
    rise = max(best - bounds.lowest, 0.0) * FIRST_TARGET
    while True:
        target = min(bounds.lowest + rise, best)
        found = _meet(costs, bounds, budget, target + slack)
        if found is not None and found[0] <= target + slack:
            return found[1]
        if target >= best:
            return choices  # every plan faster than it would have met this target
        if found is not None and found[0] < best:
            best, choices = found
        rise *= RISE
