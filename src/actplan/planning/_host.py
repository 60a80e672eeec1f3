"""A host budget the fastest plan breaks: a price on every byte moved to the host tier, raised
until the fastest plan at that price keeps within the budget (Lagrangian relaxation).

At a price ``p`` per byte, the fastest plan of the priced problem (each candidate's seconds
plus ``p`` times its offloaded bytes, solved exactly without a host budget) is a plan; when it
keeps within the budget ``H`` it is a candidate answer, and at every price its priced seconds
less ``p * H`` bound the constrained optimum from below. Bisection on the price keeps the
fastest plan that fits and the best bound: the answer is within their difference (the gap)
of the fastest plan under both budgets, and exact when the gap closes, as it does whenever
the budget falls where the priced plans change.

Where the priced search leaves a gap, ``closer`` closes it exactly: the frontier walks, with
each partial plan's offloaded total as one more key and the priced bound (``Priced``) beside
the plain one.

Private to ``actplan.planning.planner``. Imports numpy, the frontier solver, its bounds and
the problem records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from actplan.planning import _frontier
from actplan.planning._bounds import Bounds, Costs
from actplan.planning._records import PlanProblem

# Bisection steps on the price (each one exact solve without a host budget).
STEPS = 12
# How far the price may double looking for one at which a plan fits the host budget.
DOUBLINGS = 60

Solver = Callable[[PlanProblem, float], "tuple[int, ...] | None"]


def priced(problem: PlanProblem, price: float) -> PlanProblem:
    """``problem`` with no host budget and each candidate's seconds raised by ``price`` per
    offloaded byte."""
    layers = tuple(
        tuple(
            c
            if not c.offloaded_bytes
            else replace(c, extra_seconds=c.extra_seconds + price * c.offloaded_bytes)
            for c in cs
        )
        for cs in problem.layers
    )
    return replace(problem, layers=layers, host_budget_bytes=None)


def _first_price(problem: PlanProblem) -> float:
    """A price at which moving any candidate's bytes costs about as much as its seconds span:
    the bisection's first upper end."""
    seconds = [c.extra_seconds for cs in problem.layers for c in cs]
    moved = [c.offloaded_bytes for cs in problem.layers for c in cs if c.offloaded_bytes > 0]
    return max(max(seconds) - min(seconds), 1e-12) / min(moved)


def within_host(
    problem: PlanProblem, budget: float, fastest: Solver
) -> tuple[tuple[int, ...], float, float] | None:
    """The fastest plan found under ``budget`` that keeps within ``problem``'s host budget, how
    much faster the fastest such plan could at most be (0.0: it is the fastest) and the price
    that bounds it so; ``None`` when no plan fits both. ``fastest(problem, budget)`` solves a
    problem without a host budget exactly (``None``: nothing fits ``budget``)."""
    host = problem.host_budget_bytes
    if host is None:
        raise ValueError("within_host needs a problem with a host budget")
    free = fastest(replace(problem, host_budget_bytes=None), budget)
    if free is None:
        return None
    if problem.host_fits(free):
        return free, 0.0, 0.0
    best: tuple[float, tuple[int, ...]] | None = None
    bound = problem.seconds(free)  # the fastest plan with no host budget bounds it from below
    bound_price = 0.0

    def at(price: float) -> bool:
        """Solve at ``price``; keep the plan if it fits and the bound; whether it fit."""
        nonlocal best, bound, bound_price
        choices = fastest(priced(problem, price), budget)
        if choices is None:  # the device budget alone admits a plan, so a priced one does too
            raise RuntimeError("internal error: a priced problem has no plan; please report it")
        moved = problem.host_bytes(choices)
        seconds = problem.seconds(choices)
        if seconds + price * (moved - host) > bound:
            bound, bound_price = seconds + price * (moved - host), price
        if problem.host_fits(choices):
            if best is None or seconds < best[0]:
                best = (seconds, choices)
            return True
        return False

    low, high = 0.0, _first_price(problem)
    for _ in range(DOUBLINGS):
        if at(high):
            break
        low, high = high, high * 2
    else:
        return None  # even at a price no time saving pays, every plan moves too much
    for _ in range(STEPS):
        if best is not None and best[0] - bound <= 1e-9 * max(abs(best[0]), 1.0):
            break
        middle = (low * high) ** 0.5 if low > 0 else high / 2
        if at(middle):
            high = middle
        else:
            low = middle
    if best is None:  # the doubling stopped at a price where a plan fit: it was kept
        raise RuntimeError("internal error: the priced search kept no plan; please report it")
    return best[1], max(best[0] - bound, 0.0), bound_price


class Priced:
    """A second lower bound for the walks under a host budget ``H``, from a price ``p`` per
    offloaded byte: a whole plan's seconds are at least its priced seconds less ``p * H`` (it
    moves at most ``H``), and its priced seconds at least a partial plan's own (``score + p *
    hosted``) plus the priced problem's bound on the layers it has not chosen."""

    def __init__(self, problem: PlanProblem, budget: float, price: float) -> None:
        host = problem.host_budget_bytes
        if host is None:
            raise ValueError("a priced bound needs a host budget")
        self.price, self.host = price, host
        self.bounds = Bounds(Costs.of(priced(problem, price)), budget)

    def after(self, i: int, prefix: np.ndarray, score: np.ndarray, hosted: np.ndarray) -> np.ndarray:
        return score + self.price * (hosted - self.host) + self.bounds.after(i, prefix)

    def before(self, j: int, room: np.ndarray, score: np.ndarray, hosted: np.ndarray) -> np.ndarray:
        return score + self.price * (hosted - self.host) + self.bounds.before(j, room)


def closer(
    problem: PlanProblem, budget: float, price: float, best: float, bound: float
) -> tuple[int, ...] | None:
    """The fastest plan under ``budget`` and the host budget when it takes less than ``best``
    seconds (a plan known to fit both), ``None`` when none does: walks from both ends keep the
    states whose seconds plus the larger of the two bounds (the plain one, and ``Priced`` at
    ``price``) meet a target rising from ``bound`` (a lower bound on the answer) to ``best``.
    Exact; raises ``_frontier._FrontierTooLarge`` past ``HOSTED_LIMIT`` states."""
    costs = Costs.of(problem)
    bounds = Bounds(costs, budget)
    pricing = Priced(problem, budget, price)
    slack = 1e-9 * max(abs(best), 1.0)
    rise = max(best - bound, 0.0) * _frontier.FIRST_TARGET
    while True:
        target = min(bound + rise, best)
        found = _frontier._meet(costs, bounds, budget, target + slack, pricing)
        if found is not None and found[0] <= target + slack:
            return found[1] if found[0] < best - slack else None
        if target >= best:
            return None
        rise *= _frontier.RISE
