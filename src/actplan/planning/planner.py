"""Choose one candidate per layer: least predicted step time with predicted peak memory under a
budget (and, optionally, what the plan offloads under a host budget).

Pure (no torch): ``profile.py`` measures the candidates, this module solves. A
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

The choice is solved exactly by dynamic programs over Pareto frontiers of partial plans
(``planning/_frontier.py``): every phase is a prefix sum of retained bytes plus terms of one
layer, so a partial plan is dominated by one with no more retained bytes, no more offloaded
bytes in its tail and no more time. A beam pass finds a plan that fits; then walks from both
ends of the stack, joined where they meet, keep only partial plans whose seconds plus a lower
bound on the rest (``planning/_bounds.py``: the LP relaxation, and a per-layer bound that
sees every layer's own phase, calibration terms included) meet a target, which rises from the
bound on the whole plan until a plan meets it. Nothing assumes layers alike: every layer's
costs may differ (solve times: ``python -m bench.planner --solve-time-only``). The MILP
(``planning/_milp.py``: HiGHS through ``scipy.optimize.milp``, prefix sums as continuous
variables) stays as the tests' oracle and as the fallback when a frontier grows past
``FRONTIER_LIMIT`` states.

``Candidate`` and ``PlanProblem`` are defined in ``planning/_records.py`` (a leaf the solver
modules import too) and are public here. Imports ``actplan.sizes``, the records and the
private solver modules ``_frontier`` (numpy) and ``_milp`` (scipy, loaded when first solved);
the package checks the ``plan`` extra on import.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from actplan.planning import _frontier, _host, _milp
from actplan.planning._bounds import Costs
from actplan.planning._records import Candidate, PlanProblem
from actplan.sizes import human_bytes, parse_bytes

__all__ = [
    "BudgetError",
    "Candidate",
    "PlanProblem",
    "Solution",
    "front_table",
    "least_host_bytes",
    "minimum_peak",
    "none_peak",
    "pareto_front",
    "parse_budget",
    "preset_peak",
    "solve",
]


class BudgetError(ValueError):
    """A budget that cannot be read, or that no plan fits under."""


@dataclass(frozen=True)
class Solution:
    choices: tuple[int, ...]  # candidate index per layer
    names: tuple[str, ...]
    predicted_peak_bytes: float
    predicted_seconds: float
    budget_bytes: float
    # How much faster the fastest plan could at most be: 0.0 (this is it), except under a host
    # budget on a problem too deep for the exact walks (see ``_host``).
    gap_seconds: float = 0.0


def _exact(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    """The least time under ``budget`` (or, with ``None``, the least peak), exactly.

    ``_frontier.search`` on the undominated candidates (see its doc); the MILP answers where a
    frontier grows past ``FRONTIER_LIMIT``.
    """
    return _solved(problem, budget)[0]


def _solved(problem: PlanProblem, budget: float | None) -> tuple[tuple[int, ...] | None, float]:
    """``_exact``'s plan and how much faster the fastest plan could at most be: 0.0, except
    under a host budget that the fastest plan breaks, where a priced search answers
    (``_host.within_host``) when the exact walks would grow past ``HOSTED_LIMIT`` states."""
    if budget is None or problem.host_budget_bytes is None:
        return _frontier_or_milp(problem, budget), 0.0
    smaller, keep = _frontier.reduced(problem)
    if not Costs.of(smaller).hosted:  # no plan can break the host budget
        return _frontier_or_milp(problem, budget), 0.0
    found = _host.within_host(problem, budget, _exact)
    if found is None:
        return None, 0.0
    choices, gap, price = found
    if gap <= 1e-9 * max(problem.seconds(choices), 1.0):
        return choices, 0.0
    best = problem.seconds(choices) - problem.base_seconds
    try:
        closer = _host.closer(smaller, budget, price, best, best - gap)
    except _frontier._FrontierTooLarge:
        return choices, gap  # too deep to close: the priced search's plan, within the gap
    if closer is not None:
        choices = tuple(k[c] for k, c in zip(keep, closer, strict=True))
    return choices, 0.0


def _frontier_or_milp(problem: PlanProblem, budget: float | None) -> tuple[int, ...] | None:
    smaller, keep = _frontier.reduced(problem)
    try:
        choices = _frontier.search(smaller, budget)
    except _frontier._FrontierTooLarge:
        return _milp.milp(problem, budget)
    if choices is None:
        return None
    return tuple(k[c] for k, c in zip(keep, choices, strict=True))


def minimum_peak(problem: PlanProblem) -> tuple[float, tuple[int, ...]]:
    """The smallest predicted peak any choice reaches, and that choice."""
    choices = _exact(problem, None)
    if choices is None and problem.host_budget_bytes is not None:
        least = least_host_bytes(problem)
        raise BudgetError(
            f"no plan keeps within a host budget of {human_bytes(problem.host_budget_bytes)} per GPU: "
            f"the plan that offloads least moves {human_bytes(least)} to the host ({least:,.0f} bytes), "
            "the one that offloads most "
            f"{human_bytes(sum(max(c.offloaded_bytes for c in cs) for cs in problem.layers))}. Raise the "
            "host budget to at least the least, or leave it out"
        )
    if choices is None:  # every choice has a finite peak; the solver must find one
        raise RuntimeError("the planner found no plan without a budget; please report this")
    return problem.peak(choices), choices


def least_host_bytes(problem: PlanProblem) -> float:
    """The fewest bytes any plan moves to the host tier (each layer's least-offloading candidate)."""
    return float(sum(min(c.offloaded_bytes for c in cs) for cs in problem.layers))


def preset_peak(problem: PlanProblem, name: str) -> float | None:
    """The predicted peak with every layer on its candidate called ``name`` (a preset's), or
    ``None`` where some layer has no candidate of that name."""
    choices = []
    for candidates in problem.layers:
        names = [c.name for c in candidates]
        if name not in names:
            return None
        choices.append(names.index(name))
    return problem.peak(choices)


def none_peak(problem: PlanProblem) -> float | None:
    """The predicted peak with every layer on its ``none`` candidate (no checkpointing), or
    ``None`` where some layer has no candidate of that name."""
    return preset_peak(problem, "none")


def solve(problem: PlanProblem, budget_bytes: float) -> Solution:
    """The fastest predicted choice whose predicted peak is at most ``budget_bytes``.

    Raises ``BudgetError`` stating the feasible range when no choice fits.
    """
    # A hair of slack so a budget equal to a candidate's exact peak admits it despite rounding.
    fits = problem.optimizer_phase_bytes <= budget_bytes
    choices, gap = _solved(problem, budget_bytes * (1 + 1e-9) + 1) if fits else (None, 0.0)
    if (
        choices is None
        or problem.peak(choices) > budget_bytes * (1 + 1e-6) + 1
        or not problem.host_fits(choices)
    ):
        minimum, _ = minimum_peak(problem)
        top = none_peak(problem)
        feasible = f"{human_bytes(minimum)} ({minimum:,.0f} bytes)" + (
            f" up to the no-checkpoint peak {human_bytes(top)}" if top is not None else ""
        )
        host = problem.host_budget_bytes
        within = "" if host is None else f" with at most {human_bytes(host)} offloaded to the host"
        raise BudgetError(
            f"no plan fits a budget of {human_bytes(budget_bytes)}{within}: predicted peaks range from "
            f"{feasible}. Parameters and optimizer state take {human_bytes(problem.static_bytes)} and the "
            f"optimizer step {human_bytes(problem.optimizer_phase_bytes)}, whatever the plan. Raise the "
            "budget to at least the minimum, or add cheaper choices (offload)"
            + ("" if host is None else ", or raise the host budget")
        )
    return Solution(
        choices=choices,
        names=tuple(problem.layers[i][c].name for i, c in enumerate(choices)),
        predicted_peak_bytes=problem.peak(choices),
        predicted_seconds=problem.seconds(choices),
        budget_bytes=budget_bytes,
        gap_seconds=gap,
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
                human_bytes(s.predicted_peak_bytes),
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


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*$")


def parse_budget(text: str | int | float, none_peak_bytes: float | None = None) -> float:
    """``'40GiB'``, ``'1.5GB'``, ``123456`` (an int or float: bytes) or ``'55%'`` of the
    no-checkpoint peak.

    Text must carry a unit: ``'20'`` is refused rather than read as 20 bytes, since a
    budget written without one almost always meant GiB."""
    if isinstance(text, str):
        if _NUMBER.match(text):
            raise BudgetError(
                f"budget {text!r} has no unit; write e.g. '{text.strip()}GiB' or '{text.strip()}GB' "
                "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) or a share of the no-checkpoint "
                f"peak such as '{text.strip()}%'"
            )
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
        value = parse_bytes(text, round_down=True)  # '71.96GiB' means about that: whole bytes
    except ValueError as err:
        raise BudgetError(f"cannot read budget {text!r}: {err}; or write a percentage like '55%'") from None
    if value <= 0:
        raise BudgetError(f"budget {text!r} must be positive")
    return float(value)
