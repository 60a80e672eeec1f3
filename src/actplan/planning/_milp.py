"""The planner's MILP (HiGHS through ``scipy.optimize.milp``): the exact oracle the frontier
solver is tested against, and its fallback when a frontier grows too large.

Private to ``actplan.planning.planner``. Imports numpy, the planning package's dominance
reduction (``_frontier``) and its extra check; scipy is imported when a MILP is first solved.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from actplan.planning._extra import require
from actplan.planning._frontier import reduced

if TYPE_CHECKING:
    from actplan.planning._records import PlanProblem

_MIB = float(2**20)
# The largest time coefficient is scaled up to at least this (see ``_cost``).
SECONDS_SCALE = 1e4


def milp(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """The MILP on the undominated candidates; choices index the full candidate lists. Kept
    as the exact oracle the frontier solver is tested against (and its fallback)."""
    smaller, keep = reduced(problem)
    choices = _solve(smaller, budget)
    if choices is None:
        return None
    return tuple(k[c] for k, c in zip(keep, choices, strict=True))


class _Columns:
    """The problem's costs laid out by MILP column: one binary per (layer, candidate), then
    S_i, the retained bytes of layers 0..i, then (when minimising the peak) P. Bytes in MiB."""

    def __init__(self, problem: PlanProblem, budget: float | None) -> None:
        self.sizes = [len(c) for c in problem.layers]
        self.n, self.layers = sum(self.sizes), len(self.sizes)
        candidates = [c for cs in problem.layers for c in cs]
        self.retained = np.array([c.retained_bytes / _MIB for c in candidates])
        self.transient = np.array([c.transient_bytes / _MIB for c in candidates])
        self.offloaded = np.array([c.offloaded_bytes / _MIB for c in candidates])
        self.starts = np.cumsum([0, *self.sizes])
        self.seconds = np.array([c.extra_seconds for c in candidates])
        self.minimise_peak = budget is None
        self.width = self.n + self.layers + (1 if self.minimise_peak else 0)
        self.s0, self.p_col = self.n, self.n + self.layers


def _constraints(problem: PlanProblem, budget: float | None, cols: _Columns) -> list[Any]:
    """One candidate per layer; the prefix sums; every phase under the budget (or under P); the
    offloaded bytes under the host budget, when there is one."""
    from scipy.optimize import LinearConstraint

    static = (problem.static_bytes + problem.backward_extra_bytes) / _MIB
    after = [(a + e) / _MIB for a, e in zip(problem.grads_after(), problem.extras(), strict=True)]
    other = problem.other_grad_bytes / _MIB
    cap = (budget or 0.0) / _MIB
    layers, width, s0 = cols.layers, cols.width, cols.s0

    one_hot = np.zeros((layers, width))
    prefix = np.zeros((layers, width))
    phase = np.zeros((layers + 1, width))
    phase_upper = np.zeros(layers + 1)
    start = 0
    for i, size in enumerate(cols.sizes):
        block = slice(start, start + size)
        one_hot[i, block] = 1.0
        # S_i - S_{i-1} - retained_i = 0
        prefix[i, s0 + i] = 1.0
        if i:
            prefix[i, s0 + i - 1] = -1.0
        prefix[i, block] = -cols.retained[block]
        # Layer i's backward: S_i + transient_i <= cap - static - other - grads after i
        phase[i, s0 + i] = 1.0
        phase[i, block] = cols.transient[block]
        # The earlier layers prefetched while this one runs: their offloaded bytes are back.
        for j in range(max(i - problem.prefetch_layers, 0), i):
            earlier = slice(cols.starts[j], cols.starts[j + 1])
            phase[i, earlier] = cols.offloaded[earlier]
        phase_upper[i] = cap - static - other - after[i]
        start += size
    # Backward start: S_last <= cap - static - nonlayer
    phase[layers, s0 + layers - 1] = 1.0
    phase_upper[layers] = cap - static - (problem.nonlayer_bytes + problem.head_transient_bytes) / _MIB
    if cols.minimise_peak:
        phase[:, cols.p_col] = -1.0  # every phase <= P, P minimised
    constraints = [
        LinearConstraint(one_hot, 1.0, 1.0),
        LinearConstraint(prefix, 0.0, 0.0),
        LinearConstraint(phase, -np.inf, phase_upper),
    ]
    if problem.host_budget_bytes is not None:  # everything offloaded is on the host at once
        host = np.zeros((1, width))
        host[0, : cols.n] = cols.offloaded
        constraints.append(LinearConstraint(host, -np.inf, problem.host_budget_bytes * (1 + 1e-9) / _MIB))
    return constraints


def _cost(cols: _Columns) -> np.ndarray:
    """P when minimising the peak; else the seconds, ties going to the plan that retains less
    (a weight far below any time difference), in units that make the largest at least
    ``SECONDS_SCALE``: HiGHS prunes with absolute tolerances (about 1e-6), so differences
    smaller than that in seconds would be lost."""
    cost = np.zeros(cols.width)
    if cols.minimise_peak:
        cost[cols.p_col] = 1.0
    else:
        seconds, retained = cols.seconds, cols.retained
        span = max(float(retained.sum()), 1.0)
        unit = max(float(np.abs(seconds).max()), 1e-9)
        scale = max(SECONDS_SCALE / unit, 1.0)
        cost[: cols.n] = (seconds + unit * 1e-7 / span * retained) * scale
    return cost


_QUIET = threading.Lock()


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """The process's standard output sent to the null device while HiGHS runs: some builds
    print internal trace lines from C (``disp=False`` does not reach them), which would land in
    a user's table. One solve at a time (the descriptor is the process's)."""
    with _QUIET:
        sys.stdout.flush()
        try:
            saved = os.dup(1)
        except OSError:  # no standard output to guard
            yield
            return
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 1)
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _solve(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """Least time under ``budget``, or (``budget=None``) least peak. ``None``: nothing fits."""
    require("scipy")
    from scipy.optimize import Bounds
    from scipy.optimize import milp as highs_milp

    cols = _Columns(problem, budget)
    constraints = _constraints(problem, budget, cols)
    n, width = cols.n, cols.width
    integrality = np.concatenate([np.ones(n), np.zeros(width - n)])
    bounds = Bounds(
        np.concatenate([np.zeros(n), np.full(width - n, -np.inf)]),
        np.concatenate([np.ones(n), np.full(width - n, np.inf)]),
    )
    cost = _cost(cols)
    with _quiet_stdout():
        result = highs_milp(
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
    for size in cols.sizes:
        choices.append(int(np.argmax(result.x[start : start + size])))
        start += size
    return tuple(choices)
