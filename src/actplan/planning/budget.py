"""Plan under a memory budget, end to end: profile (cached), solve, write the config, run it.

``plan_under_budget`` is what ``actplan plan`` runs: it reuses or makes the model's
profile (``cache.get_profile``), solves for the fastest plan whose predicted peak fits the
budget, writes it as a config file (headed by what it was made for and every layer's
choice), runs it next to ``none`` and reports predicted against measured peak memory and
step time. ``pareto_points`` gives memory against step time for the
presets and the planner's plans over a sweep of budgets (``plot.write_pareto_plot`` draws it;
its point, ``ParetoPoint``, is defined in ``plot`` and re-exported here).

Imports torch, ``apply``, the config, the meters, the models' step and the planning
modules; none of them imports this one.
"""

from __future__ import annotations

import copy
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from actplan._install.apply import apply, plan_for
from actplan._install.plan import Plan
from actplan.config import PRESETS, RecomputeConfig
from actplan.measure import AllocatorSettings, MemoryMeter, interleaved_timing, ratio, settings_from_env
from actplan.models import ModelBundle, train_step
from actplan.planning._records import ModelProfile
from actplan.planning._reserved import fit_reserved
from actplan.planning.cache import get_profile
from actplan.planning.choose import config_for, made_for, picked
from actplan.planning.planner import (
    BudgetError,
    PlanProblem,
    Solution,
    front_table,
    none_peak,
    pareto_front,
    parse_budget,
    solve,
)
from actplan.planning.plot import ParetoPoint, write_pareto_plot
from actplan.progress import ProgressCallback, ProgressTracker
from actplan.sizes import DEFAULT_OFFLOAD_MIN_BYTES, human_bytes


@dataclass
class MeasuredRun:
    peak_bytes: int
    step_seconds: float
    ratio_to_none: float
    ratio_spread: float
    loss_identical: bool


def measure_config(
    bundle: ModelBundle,
    config: RecomputeConfig,
    device: torch.device,
    *,
    repeats: int = 5,
    warmup: int = 1,
    progress: ProgressCallback | None = None,
) -> MeasuredRun:
    """Peak bytes of one AdamW step under ``config`` (memory meter) and its step time against
    ``none``, interleaved; ``progress`` receives a ``ProgressEvent`` per step run."""
    tracker = ProgressTracker(progress, total=3 + 2 * (warmup + repeats), prefix="running the plan: ")
    batch = bundle.batch(0, device)
    runs = {}
    losses = {}
    peak = 0
    for name, chosen in (("none", RecomputeConfig.from_preset("none")), ("plan", config)):
        model = copy.deepcopy(bundle.model).to(device)
        apply(model, chosen)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

        def step(model=model, optimizer=optimizer) -> float:
            return train_step(model, batch, optimizer, seed=0).item()

        # Same initial weights: the first step's losses must agree bit for bit.
        losses[name] = step()
        tracker.step(f"first step {name}")
        if name == "plan":
            with MemoryMeter(model, optimizer) as meter:
                step()
            peak = meter.report().peak_bytes
            tracker.step("metered step")
        runs[name] = step
    timings = interleaved_timing(
        runs, repeats=repeats, warmup=warmup, progress=lambda name: tracker.step(f"timing {name}")
    )
    rel = ratio(timings["plan"], timings["none"])
    return MeasuredRun(
        peak_bytes=peak,
        step_seconds=timings["plan"].median,
        ratio_to_none=rel.median,
        ratio_spread=rel.spread,
        loss_identical=losses["plan"] == losses["none"],
    )


def preset_choices(profile: ModelProfile, preset: str) -> list[int] | None:
    """Each layer's candidate index for ``preset``; None if some layer type lacks it."""
    choices = []
    for index in range(len(profile.layer_type_of)):
        names = [c.name for c in profile.type_of(index).candidates]
        if preset not in names:
            return None
        choices.append(names.index(preset))
    return choices


def pareto_points(profile: ModelProfile, front: list[Solution] | None = None) -> list[ParetoPoint]:
    """Predicted (peak, step-time ratio) of every preset and of every plan on the planner's
    front (``planner.pareto_front``; pass ``front`` when it is already known)."""
    problem = profile.problem()
    points = []
    for preset in PRESETS:
        choices = preset_choices(profile, preset)
        if choices is not None:
            points.append(
                ParetoPoint(
                    preset, "preset", problem.peak(choices), problem.seconds(choices) / profile.base_seconds
                )
            )
    for solution in front if front is not None else pareto_front(problem):
        points.append(
            ParetoPoint(
                f"peak {solution.predicted_peak_bytes / 2**20:.1f} MiB",
                "plan",
                solution.predicted_peak_bytes,
                solution.predicted_seconds / profile.base_seconds,
            )
        )
    return points


def teaching_error(
    problem: PlanProblem, err: BudgetError, rows: int = 12, sweep_command: str = "actplan plan --sweep"
) -> BudgetError:
    """``err`` with the trade-off appended: up to ``rows`` points of the front, spread over it;
    ``sweep_command`` is the command that lists every point."""
    front = pareto_front(problem)
    if len(front) > rows:
        front = [front[round(i * (len(front) - 1) / (rows - 1))] for i in range(rows)]
    table = front_table(front, problem.base_seconds, none_peak(problem))
    return BudgetError(
        f"{err}\n\nWhat each budget buys (predicted; `{sweep_command}` lists every point):\n{table}"
    )


@dataclass
class BudgetPlanResult:
    model: str
    budget_bytes: float
    from_cache: bool
    solution: dict[str, Any]
    config_path: str | None
    config: dict[str, Any]
    layers: list[dict[str, Any]]
    measured: dict[str, Any] | None
    prediction_error: dict[str, float] | None
    pareto: list[dict[str, Any]] = field(default_factory=list)
    plot_path: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_under_budget(
    bundle: ModelBundle,
    spec: str,
    budget: str | int | float,
    device: torch.device,
    *,
    out: str | Path | None = "plan.yaml",
    plot: str | Path | None = None,
    run: bool = True,
    cache_dir: Path | None = None,
    refresh: bool = False,
    repeats: int = 5,
    min_bytes: int = DEFAULT_OFFLOAD_MIN_BYTES,
    bandwidth: float | None = None,
    progress: ProgressCallback | None = None,
    sweep_command: str | None = None,
    budget_of: str | None = None,
    allocator: AllocatorSettings | None = None,
    host_budget_bytes: float | None = None,
) -> BudgetPlanResult:
    """Profile (or reuse the cache), solve for ``budget``, write the plan, run and check it.

    The written plan's ``made_for`` block records ``spec``, the model's layers, batch shape,
    dtype, ``device``, the budget and the actplan version; a YAML file also lists every layer's
    choice in comments. ``sweep_command``: the command a budget no plan fits points to (default:
    ``actplan plan`` with ``--model spec``, ``--size`` and ``--sweep``).

    ``budget_of`` is what the budget bounds: ``"reserved"`` (the default on CUDA: what the
    caching allocator reserves, modelled from the plan's own allocation trace under
    ``allocator``, else the environment's ``PYTORCH_ALLOC_CONF``; see ``_reserved``) or
    ``"requested"`` (the default elsewhere: the bytes tensors request). ``host_budget_bytes``
    bounds what the plan offloads to pinned host memory (default: no bound)."""
    profile, from_cache = get_profile(
        bundle,
        spec,
        device,
        cache_dir=cache_dir,
        refresh=refresh,
        repeats=repeats,
        min_bytes=min_bytes,
        bandwidth=bandwidth,
        progress=progress,
    )
    if sweep_command is None:
        size = "" if ":" in spec else f" --size {bundle.size}"
        sweep_command = f"actplan plan --model {shlex.quote(spec)}{size} --sweep"
    budget_bytes, solution, notes = _solve_for(profile, budget, sweep_command, host_budget_bytes)
    budget_of = budget_of or ("reserved" if device.type == "cuda" else "requested")
    reserved = None
    if budget_of == "reserved":
        settings = allocator or settings_from_env()
        fit = fit_reserved(bundle, profile, budget_bytes, solution, device, settings, host_budget_bytes)
        solution, reserved = fit.solution, fit.report.peak_reserved_bytes
        notes += [
            f"the budget bounds the caching allocator's reserved peak ({settings.describe()}), "
            f"modelled from the plan's allocation trace: {human_bytes(reserved)}",
            *fit.notes,
        ]
    elif budget_of != "requested":
        raise ValueError(f"budget_of {budget_of!r}: choose 'reserved' or 'requested'")
    header = {**made_for(bundle, spec, device, budget, budget_bytes), "budget_of": budget_of}
    config = _write_plan(bundle, profile, solution, out, header)
    predicted_ratio = solution.predicted_seconds / profile.base_seconds
    measured = error = None
    if run:
        measured, error = _run_and_compare(
            bundle, config, device, repeats, progress, solution, predicted_ratio
        )
    points = pareto_points(profile)
    plan_result = BudgetPlanResult(
        model=profile.model,
        budget_bytes=budget_bytes,
        from_cache=from_cache,
        solution={
            "predicted_peak_bytes": solution.predicted_peak_bytes,
            "predicted_seconds": solution.predicted_seconds,
            "predicted_ratio": predicted_ratio,
            "candidates": list(solution.names),
            "modelled_reserved_peak_bytes": reserved,
        },
        config_path=str(out) if out is not None else None,
        config=config.to_dict(),
        layers=_layer_rows(profile, solution),
        measured=measured,
        prediction_error=error,
        pareto=[asdict(p) for p in points],
        notes=notes,
    )
    if plot is not None:
        requested = {
            "predicted_peak_bytes": solution.predicted_peak_bytes,
            "predicted_ratio": predicted_ratio,
            "budget_bytes": budget_bytes,
        }
        if measured is not None:
            requested["measured_peak_bytes"] = measured["peak_bytes"]
            requested["measured_ratio"] = measured["ratio_to_none"]
        write_pareto_plot(points, plot, f"{profile.model} on {profile.device}", requested)
        plan_result.plot_path = str(plot)
    return plan_result


def _solve_for(
    profile: ModelProfile, budget: str, sweep_command: str, host_budget_bytes: float | None = None
) -> tuple[float, Solution, list[str]]:
    """The budget in bytes, the fastest plan under it (and within ``host_budget_bytes`` of
    pinned host memory; a ``BudgetError`` showing the trade-off when none fits) and notes on
    the budget."""
    budget_bytes = parse_budget(budget, profile.none_peak_bytes)
    problem = profile.problem(host_budget_bytes)
    try:
        solution = solve(problem, budget_bytes)
    except BudgetError as err:
        raise teaching_error(problem, err, sweep_command=sweep_command) from None
    notes = []
    top = none_peak(problem)
    if top is not None and budget_bytes >= top:
        notes.append(
            f"the budget {human_bytes(budget_bytes)} is at or above the predicted peak without "
            f"checkpointing ({human_bytes(top)}): nothing needs recomputing or offloading"
        )
    return budget_bytes, solution, notes


def _write_plan(
    bundle: ModelBundle,
    profile: ModelProfile,
    solution: Solution,
    out: str | Path | None,
    header: dict[str, Any],
) -> RecomputeConfig:
    """The config of ``solution`` with its ``made_for`` ``header``, checked against the
    candidates, written to ``out`` if given (a YAML file with every layer's choice in comments)."""
    config = config_for(profile, solution.choices, header)
    plan = _check_resolution(bundle, profile, solution, config)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        config.dump(out, comment=_plan_comment(config, plan, solution, profile))
    return config


def _plan_comment(config: RecomputeConfig, plan: Plan, solution: Solution, profile: ModelProfile) -> str:
    """The written plan's leading comment: what it was made for, the prediction, every layer."""
    made = config.made_for
    budget = (
        f", budget {made.budget} ({human_bytes(made.budget_bytes)})" if made and made.budget_bytes else ""
    )
    model = f"{made.describe()} on {made.device}" if made is not None else profile.model
    lines = [
        f"Made by actplan plan for {model}{budget}.",
        f"Predicted peak {human_bytes(solution.predicted_peak_bytes)}, step time "
        f"{solution.predicted_seconds / profile.base_seconds:.3f}x no checkpointing.",
        "Each layer's choice (applying this plan to a model with other layers is an error; see made_for):",
    ]
    return "\n".join([*lines, *(f"  {line}" for line in plan.layer_lines())])


def _layer_rows(profile: ModelProfile, solution: Solution) -> list[dict[str, Any]]:
    """Per layer, the chosen candidate and what it retains and offloads."""
    return [
        {
            "index": i,
            "candidate": c.name,
            "retained_bytes": c.retained_bytes,
            "offloaded_bytes": c.offloaded_bytes,
        }
        for i, c in enumerate(picked(profile, solution.choices))
    ]


def _run_and_compare(
    bundle: ModelBundle,
    config: RecomputeConfig,
    device: torch.device,
    repeats: int,
    progress: ProgressCallback | None,
    solution: Solution,
    predicted_ratio: float,
) -> tuple[dict[str, Any], dict[str, float]]:
    """The plan run next to ``none``, and the prediction's relative error in peak and time."""
    result = measure_config(bundle, config, device, repeats=repeats, progress=progress)
    error = {
        "peak": (solution.predicted_peak_bytes - result.peak_bytes) / result.peak_bytes,
        "time_ratio": (predicted_ratio - result.ratio_to_none) / result.ratio_to_none,
    }
    return asdict(result), error


def _check_resolution(
    bundle: ModelBundle, profile: ModelProfile, solution: Solution, config: RecomputeConfig
) -> Plan:
    """The written config must install exactly the candidates the solver chose; returns its plan."""
    plan = plan_for(bundle.model, config)
    for layer, candidate in zip(plan.layers, picked(profile, solution.choices), strict=True):
        kept = [u.value for u in layer.kept_units]
        if (
            layer.mode != candidate.mode
            or kept != list(candidate.kept_units)
            or layer.offload_input != candidate.offload
        ):
            raise RuntimeError(
                f"internal error: the planned config gives layer {layer.index} {layer.mode} {kept} "
                f"(offload {layer.offload_input}) instead of candidate {candidate.name}; please report it"
            )
    return plan


def sweep(profile: ModelProfile, front: list[Solution] | None = None) -> list[dict[str, Any]]:
    """Every plan on the predicted front of ``profile`` (or the given ``front``), least peak
    first: peak, step-time ratio, share of the no-checkpoint peak and the candidate per
    layer. Nothing is run."""
    problem = profile.problem()
    top = none_peak(problem)
    return [
        {
            "predicted_peak_bytes": s.predicted_peak_bytes,
            "share_of_none_peak": s.predicted_peak_bytes / top if top else None,
            "predicted_ratio": s.predicted_seconds / profile.base_seconds,
            "candidates": list(s.names),
        }
        for s in (front if front is not None else pareto_front(problem))
    ]


__all__ = [
    "BudgetPlanResult",
    "MeasuredRun",
    "ParetoPoint",
    "measure_config",
    "pareto_points",
    "plan_under_budget",
    "sweep",
    "teaching_error",
]
