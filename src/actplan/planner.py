"""Choose one candidate per layer: least predicted step time with predicted peak memory under a budget.

Pure (numpy and scipy): ``profile.py`` measures the candidates, this module solves. The
model of a step is

    peak    = fixed_bytes + sum_i retained_i + max_i transient_i
    seconds = base_seconds + sum_i extra_seconds_i

where, for the candidate chosen at layer ``i``, ``retained`` is what the layer leaves on
the device at the end of forward, ``transient`` what its backward (with the recompute)
needs on top while it runs, and ``extra_seconds`` its measured cost over keeping
everything (recompute time, plus the copy time offload cannot hide). ``fixed_bytes``
holds parameters, gradients, optimizer state and the activations outside the layers.
The choice is a multiple-choice knapsack with a max term, solved exactly as a MILP with
HiGHS (``scipy.optimize.milp``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from actplan.sizes import parse_bytes

__all__ = [
    "BudgetError",
    "Candidate",
    "PlanProblem",
    "Solution",
    "brute_force",
    "minimum_peak",
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
    """Per layer (model order), the candidates it may take; and the costs outside the layers."""

    layers: tuple[tuple[Candidate, ...], ...]
    fixed_bytes: float
    base_seconds: float

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a plan problem needs at least one layer")
        for index, candidates in enumerate(self.layers):
            if not candidates:
                raise ValueError(f"layer {index} has no candidates")

    def peak(self, choices: Sequence[int]) -> float:
        picked = [self.layers[i][c] for i, c in enumerate(choices)]
        return (
            self.fixed_bytes + sum(p.retained_bytes for p in picked) + max(p.transient_bytes for p in picked)
        )

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


def _milp(problem: PlanProblem, budget: float | None, minimise_peak: bool) -> tuple[int, ...] | None:
    """Solve; ``None`` when no choice fits ``budget``. Bytes are scaled to MiB for HiGHS."""
    sizes = [len(c) for c in problem.layers]
    n = sum(sizes)
    retained = np.array([c.retained_bytes / _MIB for cs in problem.layers for c in cs])
    transient = np.array([c.transient_bytes / _MIB for cs in problem.layers for c in cs])
    seconds = np.array([c.extra_seconds for cs in problem.layers for c in cs])
    # Variables: one binary per (layer, candidate), then T >= every chosen transient.
    if minimise_peak:
        cost = np.concatenate([retained, [1.0]])
    else:
        # Ties in time go to the plan with less memory (a weight far below any time difference).
        span = max(float(retained.sum() + transient.max()), 1.0)
        scale = max(float(np.abs(seconds).max()), 1e-9) * 1e-7 / span
        cost = np.concatenate([seconds + scale * retained, [scale]])
    rows = []
    start = 0
    one_hot = np.zeros((len(sizes), n + 1))
    transient_rows = np.zeros((len(sizes), n + 1))
    for layer, size in enumerate(sizes):
        one_hot[layer, start : start + size] = 1.0
        transient_rows[layer, start : start + size] = transient[start : start + size]
        transient_rows[layer, n] = -1.0
        start += size
    rows.append(LinearConstraint(one_hot, 1.0, 1.0))
    rows.append(LinearConstraint(transient_rows, -np.inf, 0.0))
    if budget is not None:
        capacity = (budget - problem.fixed_bytes) / _MIB
        memory = np.concatenate([retained, [1.0]])
        rows.append(LinearConstraint(memory[None, :], -np.inf, capacity))
    integrality = np.concatenate([np.ones(n), [0]])
    bounds = Bounds(np.zeros(n + 1), np.concatenate([np.ones(n), [np.inf]]))
    result = milp(cost, constraints=rows, integrality=integrality, bounds=bounds, options={"mip_rel_gap": 0})
    if result.status == 2:  # infeasible
        return None
    if not result.success:
        raise RuntimeError(f"the MILP solver failed: {result.message}")
    choices = []
    start = 0
    for size in sizes:
        choices.append(int(np.argmax(result.x[start : start + size])))
        start += size
    return tuple(choices)


def minimum_peak(problem: PlanProblem) -> tuple[float, tuple[int, ...]]:
    """The smallest predicted peak any choice reaches, and that choice."""
    choices = _milp(problem, None, minimise_peak=True)
    assert choices is not None
    return problem.peak(choices), choices


def solve(problem: PlanProblem, budget_bytes: float) -> Solution:
    """The fastest predicted choice whose predicted peak is at most ``budget_bytes``.

    Raises ``BudgetError`` stating the feasible minimum when no choice fits.
    """
    # A hair of slack so a budget equal to a candidate's exact peak admits it despite rounding.
    choices = _milp(problem, budget_bytes * (1 + 1e-9) + 1, minimise_peak=False)
    if choices is None or problem.peak(choices) > budget_bytes * (1 + 1e-6) + 1:
        minimum, _ = minimum_peak(problem)
        raise BudgetError(
            f"no plan fits a budget of {_gib(budget_bytes)}: the smallest predicted peak is "
            f"{_gib(minimum)} ({minimum:,.0f} bytes), with parameters, gradients, optimizer state "
            f"and non-layer activations taking {_gib(problem.fixed_bytes)}; raise the budget to at "
            "least that, or add cheaper choices (offload)"
        )
    return Solution(
        choices=choices,
        names=tuple(problem.layers[i][c].name for i, c in enumerate(choices)),
        predicted_peak_bytes=problem.peak(choices),
        predicted_seconds=problem.seconds(choices),
        budget_bytes=budget_bytes,
    )


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
