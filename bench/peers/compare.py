"""The peers bench's comparison: planner plans at each peer's measured peak, the fastest actplan
row at no more memory than each peer, and the goals those comparisons are held to."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from actplan.evaluate.bench import TORCH_CHECKPOINT
from actplan.evaluate.contenders import PolicyRow
from actplan.planning.choose import config_for
from actplan.planning.planner import BudgetError, PlanProblem, solve
from actplan.planning.profile import ModelProfile

SAME_MEMORY = 0.005
"""Rows count as "at the same memory" when within this fraction above the peer's bytes."""

AUTOMATIC_PEER_GAIN = 0.10
"""Goal: at an automatic peer's peak, actplan's best row has a step-time ratio at least 10% lower."""

OVERHEAD_CUT = 0.15
"""Goal: at the peak of whole-layer checkpointing and of torchtitan's own AC (FullAC, SelectiveAC,
MemoryBudgetAC below a budget of 1.0), actplan's best row has at least 15% less step-time
overhead, 1 - (ours - 1) / (peer - 1)."""


def overhead_cut_peer(name: str) -> str | None:
    """How the overhead-cut goal names the peer ``name``; None for a peer it does not cover.
    ``MemoryBudgetAC`` at budget 1.0 is the partitioner's default (it recomputes only what it
    finds free, and is the compile noise-floor row): no goal there."""
    if name == TORCH_CHECKPOINT:
        return "whole-layer checkpointing"
    if name == "titan-full":
        return "torchtitan's FullAC"
    if name in ("titan-sac", "titan-op-sac"):
        return "torchtitan's SelectiveAC" + (" (re-stated)" if name == "titan-op-sac" else "")
    if name.startswith("titan-memory-budget[budget="):
        budget = float(name.removeprefix("titan-memory-budget[budget=").removesuffix("]"))
        return None if budget >= 1.0 else f"torchtitan's MemoryBudgetAC (budget {budget:g}, aot_eager)"
    return None


@dataclass
class PlannedRow:
    """A planner plan at one or more peers' peaks, as the report records it."""

    name: str
    offload_allowed: bool
    budget_bytes: int
    for_peers: list[str]
    candidates: list[str]
    predicted_peak_bytes: float
    predicted_ratio: float
    config: dict[str, Any]


def _without_offload(problem: PlanProblem) -> tuple[PlanProblem, list[list[int]]]:
    """The problem with offloading candidates removed, and each kept candidate's old index."""
    kept = [[i for i, c in enumerate(cs) if c.offloaded_bytes == 0] for cs in problem.layers]
    layers = tuple(tuple(cs[i] for i in keep) for cs, keep in zip(problem.layers, kept, strict=True))
    return replace(problem, layers=layers), kept


def plan_rows(profile: ModelProfile, peers: list[PolicyRow]) -> tuple[list[PlannedRow], list[str]]:
    """Planner plans at each peer's measured peak, deduplicated by the choices they make, and
    the budgets no plan fits under (with the planner's reason).

    The budget is the peer's peak plus ``SAME_MEMORY``, the slack the comparison allows: the
    planner's peak model is calibrated to within a fraction of a percent, and without the
    slack a budget equal to whole-layer checkpointing's peak is infeasible by that margin.
    """
    full_problem = profile.problem()
    recompute_problem, index_map = _without_offload(full_problem)
    planned: dict[tuple[int, ...], PlannedRow] = {}
    infeasible: list[str] = []
    for peer in peers:
        budget = peer.peak_bytes * (1 + SAME_MEMORY)
        for offload_allowed, problem in ((True, full_problem), (False, recompute_problem)):
            try:
                solution = solve(problem, budget)
            except BudgetError as err:
                infeasible.append(f"{peer.name}{'' if offload_allowed else ', no offload'}: {err}")
                continue
            choices = solution.choices
            if not offload_allowed:
                choices = tuple(index_map[layer][c] for layer, c in enumerate(choices))
            if choices in planned:
                if peer.name not in planned[choices].for_peers:
                    planned[choices].for_peers.append(peer.name)
                continue
            suffix = "" if offload_allowed else ", no offload"
            planned[choices] = PlannedRow(
                name=_unique_name(peer.peak_bytes, suffix, {p.name for p in planned.values()}),
                offload_allowed=offload_allowed,
                budget_bytes=int(budget),
                for_peers=[peer.name],
                candidates=list(solution.names),
                predicted_peak_bytes=solution.predicted_peak_bytes,
                predicted_ratio=solution.predicted_seconds / profile.base_seconds,
                config=config_for(profile, choices).to_dict(),
            )
    return list(planned.values()), infeasible


def _unique_name(peak_bytes: float, suffix: str, taken: set[str]) -> str:
    """``plan@<peak>MiB<suffix>``, the peak with one decimal, or more where two different plans
    would otherwise share a name (peers whose peaks round alike: rows are keyed by name)."""
    for digits in (1, 3):
        name = f"plan@{peak_bytes / 2**20:.{digits}f}MiB{suffix}"
        if name not in taken:
            return name
    count = 2
    while f"{name} #{count}" in taken:
        count += 1
    return f"{name} #{count}"


def compare(rows: list[PolicyRow], kinds: dict[str, str], by: str) -> list[dict[str, Any]]:
    """Per peer: the fastest actplan row at no more memory (``by``: peak or activation bytes)."""
    out = []
    ours = [r for r in rows if kinds[r.name] in ("preset", "plan", "compiled") and r.parity_ok]
    for peer in (r for r in rows if kinds[r.name] in ("peer", "automatic-peer")):
        limit = getattr(peer, by) * (1 + SAME_MEMORY)
        fitting = [r for r in ours if getattr(r, by) <= limit]
        entry: dict[str, Any] = {
            "peer": peer.name,
            "peer_bytes": getattr(peer, by),
            "peer_ratio": peer.ratio_to_none,
        }
        entry["peer_spread"] = peer.ratio_spread
        entry["automatic"] = kinds[peer.name] == "automatic-peer"
        for label, pool in (
            ("best", fitting),
            ("best_recompute_only", [r for r in fitting if r.offloaded_bytes is None]),
            ("best_compiled", [r for r in fitting if kinds[r.name] == "compiled"]),
        ):
            if not pool:
                entry[label] = None
                continue
            best = min(pool, key=lambda r: r.ratio_to_none)
            overhead_cut = (
                1 - (best.ratio_to_none - 1) / (peer.ratio_to_none - 1) if peer.ratio_to_none > 1 else None
            )
            entry[label] = {
                "name": best.name,
                "bytes": getattr(best, by),
                "ratio": best.ratio_to_none,
                "spread": best.ratio_spread,
                "ratio_vs_peer": best.ratio_to_none / peer.ratio_to_none,
                "overhead_cut": overhead_cut,
                "at_least_as_fast": best.ratio_to_none <= peer.ratio_to_none,
            }
        out.append(entry)
    return out


def evaluate_goals(comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    goals = []
    for c in comparisons:
        best = c["best"]
        goals.append(
            {
                "goal": f"at {c['peer']}'s peak, an actplan row at least as fast",
                "value": best["ratio_vs_peer"] if best else None,
                "met": bool(best and best["at_least_as_fast"]),
            }
        )
        if c.get("automatic"):
            value = best["ratio_vs_peer"] if best else None
            goals.append(
                {
                    "goal": f"at {c['peer']}'s peak, an actplan row at least "
                    f"{AUTOMATIC_PEER_GAIN:.0%} faster (ratio to none at most "
                    f"{1 - AUTOMATIC_PEER_GAIN:.2f}x the peer's)",
                    "value": value,
                    "met": value is not None and value <= 1 - AUTOMATIC_PEER_GAIN,
                }
            )
        named = overhead_cut_peer(c["peer"])
        if named is not None:
            goals.append(_overhead_cut_goal(named, c))
    return goals


def _overhead_cut_goal(named: str, c: dict[str, Any]) -> dict[str, Any]:
    """At least ``OVERHEAD_CUT`` less step-time overhead than the peer at its peak: the value is
    the cut; ``missed_by`` how far below the target it fell (None when met, or undefined: no
    actplan row fits, or the peer is not slower than ``none``, so it has no overhead to cut)."""
    best = c["best"]
    cut = best["overhead_cut"] if best else None
    met = cut is not None and cut >= OVERHEAD_CUT
    goal: dict[str, Any] = {
        "goal": f"at {named}'s peak, at least {OVERHEAD_CUT:.0%} less step-time overhead",
        "value": cut,
        "met": met,
        "missed_by": None if met or cut is None else OVERHEAD_CUT - cut,
        "peer_ratio": c["peer_ratio"],
        "actplan_row": best["name"] if best else None,
        "actplan_ratio": best["ratio"] if best else None,
    }
    if cut is None:
        goal["undefined"] = (
            "no actplan row fits at the peer's peak"
            if best is None
            else f"the peer is not slower than none (ratio {c['peer_ratio']:.3f}), so it has no overhead "
            f"to cut; actplan's fastest row there, {best['name']}, measures {best['ratio']:.3f} "
            f"({best['ratio_vs_peer']:.3f}x the peer's)"
        )
    return goal
