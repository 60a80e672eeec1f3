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
once) is its upper bound. Step time is ``base_seconds + sum_i extra_seconds_i``. The choice
is solved exactly as a MILP with HiGHS (``scipy.optimize.milp``), prefix sums of retained
bytes as continuous variables so the model stays linear in size.
"""

from __future__ import annotations

import itertools
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

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a plan problem needs at least one layer")
        for index, candidates in enumerate(self.layers):
            if not candidates:
                raise ValueError(f"layer {index} has no candidates")
        if self.layer_grad_bytes and len(self.layer_grad_bytes) != len(self.layers):
            raise ValueError("layer_grad_bytes needs one entry per layer")

    def _grads(self) -> tuple[float, ...]:
        return self.layer_grad_bytes or (0.0,) * len(self.layers)

    def grads_after(self) -> list[float]:
        """Per layer ``i``, gradient bytes of layers after it (already produced in backward)."""
        grads = self._grads()
        return [sum(grads[i + 1 :]) for i in range(len(grads))]

    @property
    def optimizer_phase_bytes(self) -> float:
        return self.static_bytes + self.other_grad_bytes + sum(self._grads()) + self.optimizer_step_bytes

    def peak(self, choices: Sequence[int]) -> float:
        picked = [self.layers[i][c] for i, c in enumerate(choices)]
        after = self.grads_after()
        base = self.static_bytes + self.backward_extra_bytes
        phases = [
            base + self.nonlayer_bytes + self.head_transient_bytes + sum(p.retained_bytes for p in picked)
        ]
        retained = 0.0
        for i, p in enumerate(picked):
            retained += p.retained_bytes
            prefetched = sum(q.offloaded_bytes for q in picked[max(i - self.prefetch_layers, 0) : i])
            phases.append(base + self.other_grad_bytes + retained + p.transient_bytes + prefetched + after[i])
        phases.append(self.optimizer_phase_bytes)
        return max(phases)

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


def _undominated(candidates: tuple[Candidate, ...]) -> list[int]:
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
    return kept


def _milp(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """Solve on the undominated candidates; choices index the full candidate lists."""
    keep = [_undominated(cs) for cs in problem.layers]
    reduced = replace(
        problem, layers=tuple(tuple(cs[i] for i in k) for cs, k in zip(problem.layers, keep, strict=True))
    )
    choices = _milp_reduced(reduced, budget)
    if choices is None:
        return None
    return tuple(k[c] for k, c in zip(keep, choices, strict=True))


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
    after = [a / _MIB for a in problem.grads_after()]
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
        raise RuntimeError(f"the MILP solver failed: {result.message}")
    choices = []
    start = 0
    for size in sizes:
        choices.append(int(np.argmax(result.x[start : start + size])))
        start += size
    return tuple(choices)


def minimum_peak(problem: PlanProblem) -> tuple[float, tuple[int, ...]]:
    """The smallest predicted peak any choice reaches, and that choice."""
    choices = _milp(problem, None)
    assert choices is not None
    return problem.peak(choices), choices


def solve(problem: PlanProblem, budget_bytes: float) -> Solution:
    """The fastest predicted choice whose predicted peak is at most ``budget_bytes``.

    Raises ``BudgetError`` stating the feasible minimum when no choice fits.
    """
    # A hair of slack so a budget equal to a candidate's exact peak admits it despite rounding.
    fits = problem.optimizer_phase_bytes <= budget_bytes
    choices = _milp(problem, budget_bytes * (1 + 1e-9) + 1) if fits else None
    if choices is None or problem.peak(choices) > budget_bytes * (1 + 1e-6) + 1:
        minimum, _ = minimum_peak(problem)
        raise BudgetError(
            f"no plan fits a budget of {_gib(budget_bytes)}: the smallest predicted peak is "
            f"{_gib(minimum)} ({minimum:,.0f} bytes), with parameters and optimizer state taking "
            f"{_gib(problem.static_bytes)} and the optimizer step {_gib(problem.optimizer_phase_bytes)}; "
            "raise the budget to at least the minimum, or add cheaper choices (offload)"
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
