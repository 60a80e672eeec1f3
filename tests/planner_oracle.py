"""The planner's test oracle: every choice enumerated, for problems small enough to afford it.

Test-only (the package's solvers are checked against it, never use it). Imports the
standard library and, for annotations, ``actplan.planning.planner``'s ``PlanProblem``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actplan.planning.planner import PlanProblem


def brute_force(problem: PlanProblem, budget_bytes: float) -> tuple[float, tuple[int, ...]] | None:
    """Enumerate every choice (small problems only): the least time under the budget, or None."""
    best: tuple[float, tuple[int, ...]] | None = None
    for choices in itertools.product(*(range(len(c)) for c in problem.layers)):
        if problem.peak(choices) <= budget_bytes and problem.host_fits(choices):
            seconds = problem.seconds(choices)
            if best is None or seconds < best[0] - 1e-12:
                best = (seconds, choices)
    return best
