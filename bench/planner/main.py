"""Planner benchmarks: profile time, predicted against measured peak and step time, solve time.

    python -m bench.planner        # dense, moe, mtp, sparse, hf-llama at small (about 15 min on 2 cores)
    python -m bench.planner --models dense --size tiny --repeats 2 --layers 16,64   # quick

1. Profile time: every model is profiled afresh (the cache is refreshed), and the seconds it
   took are reported. Goals: dense small <= 20 s, moe small <= 60 s.
2. Predictions: per model, five budgets spread over its feasible range (the least predicted
   peak, then 20/40/60/80% of the way to the no-checkpoint peak), the planner's plan for
   each, and one ``actplan bench`` run with every preset next to those plans (interleaved
   timing, memory meter, parity against no checkpointing). Per plan: predicted against
   measured peak (goal within 1%) and step-time ratio to ``none`` (goal within 10% on
   dense), and whether it beats every fixed row whose measured peak fits its budget.
3. Solve time against layers: each model's measured candidates repeated to 16..512 layers,
   a mixed stack of every profiled layer type, random 32-candidate layers, and three layer
   types of 24 candidates with every layer's costs jittered by up to 0.5% (as a profile
   taken per layer is: no two layers alike), each solved at five budgets. Goals: under 1 s at
   128 layers, under 5 s at 512; the jittered stack under 1 s at 128 layers.

    python -m bench.planner --solve-time-only   # part 3 alone, on the cached profiles

Writes ``bench/results/planner_<model>_<size>.{json,md,png}`` (per model),
``planner_predictions.{json,md}`` and ``planner_solve_time.{json,md,png}`` (with
``--solve-time-only``, only the last).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from actplan.evaluate.bench import DEFAULT_POLICIES, run_bench
from actplan.models import load_model
from actplan.planning.budget import ParetoPoint, pareto_points
from actplan.planning.cache import get_profile
from actplan.planning.choose import config_for
from actplan.planning.planner import Candidate, PlanProblem, minimum_peak, none_peak, plan_summary, solve
from actplan.planning.plot import write_pareto_plot
from actplan.planning.profile import ModelProfile

SHARES = (0.0, 0.2, 0.4, 0.6, 0.8)  # of the way from the least peak to the no-checkpoint peak
SOLVE_GOALS = ((128, 1.0), (512, 5.0))  # (layers, seconds): every model's stacks
JITTERED_GOAL = (128, 1.0)
PROFILE_GOALS = {("dense", "small"): 20.0, ("moe", "small"): 60.0}
PEAK_GOAL, TIME_GOAL = 0.01, 0.10


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


# ---------------------------------------------------------------------------------------------
# Solve time


def stretched(problem: PlanProblem, layers: int) -> PlanProblem:
    """``problem``'s layers repeated (in order) to ``layers`` layers."""
    n = len(problem.layers)
    grads = problem.layer_grad_bytes or (0.0,) * n
    extras = problem.extras()
    return replace(
        problem,
        layers=tuple(problem.layers[i % n] for i in range(layers)),
        layer_grad_bytes=tuple(grads[i % n] for i in range(layers)),
        layer_extra_bytes=tuple(extras[i % n] for i in range(layers)),
    )


def mixed(problems: list[PlanProblem], layers: int) -> PlanProblem:
    """One stack of every distinct layer type in ``problems``, in contiguous blocks (as a
    model with dense first layers, MoE layers and MTP depths has), on the first one's fixed
    costs."""
    types: list[tuple[tuple[Candidate, ...], float, float]] = []
    for problem in problems:
        grads = problem.layer_grad_bytes or (0.0,) * len(problem.layers)
        for candidates, grad, extra in zip(problem.layers, grads, problem.extras(), strict=True):
            if all(candidates != seen for seen, _, _ in types):
                types.append((candidates, grad, extra))
    block = -(-layers // len(types))
    picked = [types[min(i // block, len(types) - 1)] for i in range(layers)]
    return replace(
        problems[0],
        layers=tuple(c for c, _, _ in picked),
        layer_grad_bytes=tuple(g for _, g, _ in picked),
        layer_extra_bytes=tuple(e for _, _, e in picked),
    )


def random_problem(layers: int, candidates: int = 32, seed: int = 0) -> PlanProblem:
    """Random costs, no structure: the stress case."""
    rng = random.Random(seed)
    mib = 2**20
    return PlanProblem(
        layers=tuple(
            tuple(
                Candidate(f"c{c}", rng.uniform(1, 100) * mib, rng.uniform(1, 50) * mib, rng.uniform(0, 0.05))
                for c in range(candidates)
            )
            for _ in range(layers)
        ),
        static_bytes=2**30,
        base_seconds=1.0,
        layer_grad_bytes=tuple(rng.uniform(1, 20) * mib for _ in range(layers)),
    )


def jittered_problem(
    layers: int, types: int = 3, candidates: int = 24, jitter: float = 0.005, seed: int = 0
) -> PlanProblem:
    """``types`` layer types in contiguous blocks, each with ``candidates`` candidates shaped as
    a profile's are (kept sets along a chain from ``full`` to ``none``, a few others, and the
    offloaded variants of checkpointed ones), then every layer's costs, gradient bytes and
    calibration term drawn on their own within ``jitter`` of its type's: no two layers alike,
    as when the profile is taken per layer."""
    rng = random.Random(seed)
    kinds = [_layer_type(rng, candidates) for _ in range(types)]
    grads = [rng.uniform(4, 16) * 2**20 for _ in range(types)]
    block = -(-layers // types)

    def near(value: float) -> float:
        return value * (1 + rng.uniform(-jitter, jitter))

    kind_of = [min(i // block, types - 1) for i in range(layers)]
    return PlanProblem(
        layers=tuple(
            tuple(
                Candidate(
                    c.name,
                    near(c.retained_bytes),
                    near(c.transient_bytes),
                    near(c.extra_seconds),
                    near(c.offloaded_bytes),
                )
                for c in kinds[kind]
            )
            for kind in kind_of
        ),
        static_bytes=2 * 2**30,
        base_seconds=layers * 5e-3,
        nonlayer_bytes=64 * 2**20,
        layer_grad_bytes=tuple(near(grads[kind]) for kind in kind_of),
        other_grad_bytes=32 * 2**20,
        optimizer_step_bytes=32 * 2**20,
        backward_extra_bytes=8 * 2**20,
        head_transient_bytes=96 * 2**20,
        prefetch_layers=1,
        layer_extra_bytes=tuple(rng.uniform(0, 0.5) * 2**20 for _ in kind_of),
    )


def _kept_name(kept: frozenset[int], units: int) -> str:
    if not kept:
        return "full"
    return "none" if len(kept) == units else "keep " + "+".join(f"u{u}" for u in sorted(kept))


def _layer_type(rng: random.Random, candidates: int, units: int = 10) -> tuple[Candidate, ...]:
    """One layer type's candidates: ``units`` units with their own activation bytes and replay
    seconds; kept sets along the chain of best seconds per byte (``full`` .. ``none``) and random
    others, half the candidates; the offloaded variants of checkpointed sets, the rest."""
    mib = 2**20
    saved = [rng.uniform(0.5, 8) * mib for _ in range(units)]
    replay = [rng.uniform(0.05, 1.0) * 1e-3 for _ in range(units)]
    layer_seconds = 3 * sum(replay)
    layer_input, working = rng.uniform(0.5, 2) * mib, rng.uniform(2, 8) * mib
    chain = sorted(range(units), key=lambda u: -replay[u] / saved[u])
    kept_sets = [frozenset(chain[:k]) for k in range(units + 1)]
    while len(kept_sets) < candidates // 2 + 1:
        extra = frozenset(u for u in range(units) if rng.random() < 0.5)
        if extra not in kept_sets:
            kept_sets.append(extra)
    out = []
    for kept in kept_sets:
        kept_bytes = sum(saved[u] for u in kept)
        checkpointed = len(kept) < units
        overhead = 0.02 * layer_seconds if checkpointed else 0.0
        out.append(
            Candidate(
                _kept_name(kept, units),
                layer_input + kept_bytes,
                working + sum(saved) - kept_bytes,
                sum(replay[u] for u in range(units) if u not in kept) + overhead,
            )
        )
    bandwidth = 10e9
    for c in [c for c in out if c.name != "none"][: candidates - len(out)]:
        copy = c.retained_bytes / bandwidth
        exposed = max(copy - layer_seconds / 3, 0) + max(copy - 2 * layer_seconds / 3, 0)
        out.append(
            Candidate(
                c.name + "+offload",
                0.01 * mib,
                c.transient_bytes + layer_input,
                c.extra_seconds + exposed + 1e-5,
                c.retained_bytes,
            )
        )
    return tuple(out)


def time_solves(problem: PlanProblem) -> dict[str, float]:
    """Seconds to solve at five budgets spread over the feasible range."""
    lowest, _ = minimum_peak(problem)
    top = none_peak(problem)
    if top is None:  # no `none` candidate: the all-time-cheapest plan's peak bounds the range
        top = problem.peak(
            [min(range(len(cs)), key=lambda i, cs=cs: cs[i].extra_seconds) for cs in problem.layers]
        )
    seconds = []
    for share in (0.05, 0.25, 0.5, 0.75, 0.95):
        start = time.perf_counter()
        solve(problem, lowest + share * (top - lowest))
        seconds.append(time.perf_counter() - start)
    return {"max": max(seconds), "median": statistics.median(seconds)}


def solve_time_curve(problems: dict[str, PlanProblem], layer_counts: list[int]) -> dict[str, Any]:
    stacks: dict[str, Any] = {}
    builders = {name: (lambda n, p=p: stretched(p, n)) for name, p in problems.items()}
    if len(problems) > 1:
        builders["mixed"] = lambda n: mixed(list(problems.values()), n)
    builders["random-32"] = random_problem
    builders["jittered"] = jittered_problem
    for name, build in builders.items():
        rows = []
        for layers in layer_counts:
            problem = build(layers)
            rows.append(
                {
                    "layers": layers,
                    "candidates": sorted({len(c) for c in problem.layers}),
                    **time_solves(problem),
                }
            )
            print(f"  solve {name} x {layers}: {rows[-1]['max']:.3f} s", file=sys.stderr, flush=True)
        stacks[name] = rows
    real = [r for name, rows in stacks.items() if name not in ("random-32", "jittered") for r in rows]
    goals = []
    for layers, limit in SOLVE_GOALS:
        at = [r["max"] for r in real if r["layers"] == layers]
        if at:
            goals.append(
                {
                    "goal": f"solve under {limit:g} s at {layers} layers, every model's candidates",
                    "worst_seconds": max(at),
                    "met": max(at) < limit,
                }
            )
    layers, limit = JITTERED_GOAL
    at = [r["max"] for r in stacks["jittered"] if r["layers"] == layers]
    if at:
        goals.append(
            {
                "goal": f"solve under {limit:g} s at {layers} layers, 3 layer types x 24 candidates "
                "jittered 0.5% per layer",
                "worst_seconds": max(at),
                "met": max(at) < limit,
            }
        )
    return {"stacks": stacks, "goals": goals}


def solve_time_markdown(curve: dict[str, Any], command: str) -> str:
    counts = [r["layers"] for r in next(iter(curve["stacks"].values()))]
    lines = [
        "# Planner solve time against layers",
        "",
        f"- command: `{command}`; torch {torch.__version__}, CPU; the slowest of five budgets per cell",
        "- each model's measured candidates repeated to the layer count; `mixed`: every profiled layer type "
        "in contiguous blocks; `random-32`: 32 random candidates per layer (no structure); `jittered`: "
        "3 layer types of 24 candidates, every layer's costs drawn within 0.5% of its type's (no two alike)",
        "",
        "| candidates of | " + " | ".join(f"{n} layers" for n in counts) + " |",
        "|---|" + "---|" * len(counts),
    ]
    for name, rows in curve["stacks"].items():
        lines.append(f"| {name} | " + " | ".join(f"{r['max']:.3f} s" for r in rows) + " |")
    lines.append("")
    for goal in curve["goals"]:
        lines.append(
            f"- {'met' if goal['met'] else 'NOT met'}: {goal['goal']} (worst {goal['worst_seconds']:.3f} s)"
        )
    lines += ["", "![solve time](planner_solve_time.png)", ""]
    return "\n".join(lines)


def solve_time_plot(curve: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, rows in curve["stacks"].items():
        ax.plot([r["layers"] for r in rows], [r["max"] for r in rows], "o-", label=name)
    ax.axhline(1.0, color="tab:red", linestyle=":", label="goal at 128 layers (1 s)")
    ax.axhline(5.0, color="tab:purple", linestyle=":", label="goal at 512 layers (5 s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("solve time, slowest of 5 budgets (s)")
    ax.set_title("actplan planner: exact solve time (CPU)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Predictions


def run_model(
    name: str, size: str, repeats: int, cache_dir: Path | None, results: Path
) -> tuple[dict[str, Any], ModelProfile]:
    bundle = load_model(name, size)
    device = torch.device("cpu")
    print(f"profiling {name} {size} ...", file=sys.stderr, flush=True)
    profile, _ = get_profile(
        bundle,
        name,
        device,
        cache_dir=cache_dir,
        refresh=True,
        progress=lambda s: print(f"  {s}", file=sys.stderr, flush=True),
    )
    print(f"  profiled in {profile.seconds_spent:.1f} s", file=sys.stderr, flush=True)
    problem = profile.problem()
    lowest, _ = minimum_peak(problem)
    top = none_peak(problem) or profile.none_peak_bytes
    plans = []
    with tempfile.TemporaryDirectory() as scratch:
        paths: dict[tuple[int, ...], Path] = {}
        for share in SHARES:
            budget = lowest + share * (top - lowest)
            solution = solve(problem, budget)
            if solution.choices not in paths:
                paths[solution.choices] = Path(scratch) / f"plan-{len(paths) + 1}.yaml"
                config_for(profile, solution.choices).dump(paths[solution.choices])
            plans.append((share, budget, solution, paths[solution.choices]))
        print(f"bench {name} {size} with {len(paths)} plans ...", file=sys.stderr, flush=True)
        result = run_bench(
            name,
            size,
            DEFAULT_POLICIES,
            tuple(paths.values()),
            repeats=repeats,
            warmup=1,
            overhead_repeats=0,
            device="cpu",
            reference=True,
            command=f"python -m bench.planner --models {name} --size {size}",
        )
        configs = {p.stem: config_for(profile, c).to_dict() for c, p in paths.items()}
    fixed = [r for r in result.rows if not r.name.startswith("plan-")]
    rows = []
    for share, budget, solution, path in plans:
        row = result.row(path.stem)
        predicted_ratio = solution.predicted_seconds / profile.base_seconds
        fitting = [r for r in fixed if r.peak_bytes <= budget]
        rows.append(
            {
                "share": share,
                "budget_bytes": budget,
                "plan": path.stem,
                "plan_summary": plan_summary(solution.names),
                "predicted_peak_bytes": solution.predicted_peak_bytes,
                "measured_peak_bytes": row.peak_bytes,
                "peak_error": (solution.predicted_peak_bytes - row.peak_bytes) / row.peak_bytes,
                "predicted_ratio": predicted_ratio,
                "measured_ratio": row.ratio_to_none,
                "ratio_spread": row.ratio_spread,
                "ratio_error": (predicted_ratio - row.ratio_to_none) / row.ratio_to_none,
                "parity_ok": row.parity_ok,
                "fits_budget": row.peak_bytes <= budget * (1 + PEAK_GOAL),
                "fixed_rows_fitting": [r.name for r in fitting],
                "beats_fitting_rows": all(row.ratio_to_none < r.ratio_to_none for r in fitting),
            }
        )
    measured = [
        ParetoPoint(r.name + " (measured)", "measured", r.peak_bytes, r.ratio_to_none) for r in result.rows
    ]
    png = results / f"planner_{name}_{size}.png"
    write_pareto_plot(pareto_points(profile) + measured, png, f"{profile.model} (CPU)")
    out = {
        "model": profile.model,
        "spec": name,
        "size": size,
        "profile_seconds": profile.seconds_spent,
        "profile_goal_seconds": PROFILE_GOALS.get((name, size)),
        "least_peak_bytes": lowest,
        "none_peak_bytes": top,
        "plans": rows,
        "configs": configs,
        "rows": [
            {
                "name": r.name,
                "peak_bytes": r.peak_bytes,
                "ratio_to_none": r.ratio_to_none,
                "ratio_spread": r.ratio_spread,
                "parity_ok": r.parity_ok,
            }
            for r in result.rows
        ],
        "plot": str(png),
    }
    return out, profile


def model_markdown(out: dict[str, Any]) -> str:
    goal = out["profile_goal_seconds"]
    lines = [
        f"# Planner on {out['model']}",
        "",
        f"- command: `python -m bench.planner --models {out['spec']} --size {out['size']}`; "
        f"torch {torch.__version__}, CPU",
        f"- profiled in {out['profile_seconds']:.1f} s"
        + (
            f" (goal <= {goal:g} s: {'met' if out['profile_seconds'] <= goal else 'NOT met'})" if goal else ""
        ),
        f"- feasible peaks: {_mib(out['least_peak_bytes'])} to {_mib(out['none_peak_bytes'])} MiB "
        "(no checkpointing)",
        "",
        "| budget (share) | plan | predicted peak | measured peak | error | predicted ratio | measured ratio "
        "| error | parity | beats fixed rows that fit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in out["plans"]:
        lines.append(
            f"| {_mib(p['budget_bytes'])} MiB ({p['share']:.0%}) | {p['plan']} "
            f"| {_mib(p['predicted_peak_bytes'])} | {_mib(p['measured_peak_bytes'])} "
            f"| {p['peak_error']:+.2%} | {p['predicted_ratio']:.3f} "
            f"| {p['measured_ratio']:.3f} ± {p['ratio_spread']:.3f} | {p['ratio_error']:+.1%} "
            f"| {'ok' if p['parity_ok'] else 'FAILED'} "
            f"| {'yes' if p['beats_fitting_rows'] else 'no'} ({len(p['fixed_rows_fitting'])} fit) |"
        )
    lines += ["", "Plans:", ""]
    seen = set()
    for p in out["plans"]:
        if p["plan"] not in seen:
            seen.add(p["plan"])
            lines.append(f"- {p['plan']}: {p['plan_summary']}")
    lines += ["", "| row | peak (MiB) | step time / none | parity |", "|---|---|---|---|"]
    for r in sorted(out["rows"], key=lambda r: r["peak_bytes"]):
        lines.append(
            f"| {r['name']} | {_mib(r['peak_bytes'])} | {r['ratio_to_none']:.3f} ± {r['ratio_spread']:.3f} "
            f"| {'ok' if r['parity_ok'] else 'FAILED'} |"
        )
    lines += ["", f"![Pareto plot]({Path(out['plot']).name})", ""]
    return "\n".join(lines)


def predictions_markdown(models: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Planner predictions against measurements",
        "",
        f"- command: `{command}`; torch {torch.__version__}, CPU",
        "- per model, five budgets from the least predicted peak (0%) towards the no-checkpoint peak; "
        "peaks from the memory meter, step-time ratios to `none` from one interleaved run",
        "",
        "| model | profile (s) | worst peak error | worst step-time error | plans exact | plans beat the "
        "fixed rows that fit |",
        "|---|---|---|---|---|---|",
    ]
    for out in models:
        plans = out["plans"]
        peak = max(plans, key=lambda p: abs(p["peak_error"]))["peak_error"]
        ratio = max(plans, key=lambda p: abs(p["ratio_error"]))["ratio_error"]
        lines.append(
            f"| {out['spec']} {out['size']} | {out['profile_seconds']:.1f} | {peak:+.2%} | {ratio:+.1%} "
            f"| {sum(p['parity_ok'] for p in plans)}/{len(plans)} "
            f"| {sum(p['beats_fitting_rows'] for p in plans)}/{len(plans)} |"
        )
    lines.append("")
    for goal in prediction_goals(models):
        lines.append(f"- {'met' if goal['met'] else 'NOT met'}: {goal['goal']} ({goal['detail']})")
    lines.append("")
    return "\n".join(lines)


def prediction_goals(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    goals = []
    worst = max((abs(p["peak_error"]), out["spec"]) for out in models for p in out["plans"])
    goals.append(
        {
            "goal": f"predicted peak within {PEAK_GOAL:.0%} of measured, every model and budget",
            "detail": f"worst {worst[0]:.2%} on {worst[1]}",
            "met": worst[0] <= PEAK_GOAL,
        }
    )
    dense = [p for out in models if out["spec"] == "dense" for p in out["plans"]]
    if dense:
        off = max(abs(p["ratio_error"]) for p in dense)
        goals.append(
            {
                "goal": f"predicted step time within {TIME_GOAL:.0%} on dense",
                "detail": f"worst {off:.1%}",
                "met": off <= TIME_GOAL,
            }
        )
    for out in models:
        limit = out["profile_goal_seconds"]
        if limit:
            goals.append(
                {
                    "goal": f"profile {out['spec']} {out['size']} in <= {limit:g} s",
                    "detail": f"{out['profile_seconds']:.1f} s",
                    "met": out["profile_seconds"] <= limit,
                }
            )
    return goals


def cached_problem(name: str, size: str, cache_dir: Path | None) -> PlanProblem:
    """The model's plan problem from its cached profile (profiled, and cached, when missing)."""
    profile, _ = get_profile(load_model(name, size), name, torch.device("cpu"), cache_dir=cache_dir)
    return profile.problem()


def write_solve_time(
    problems: dict[str, PlanProblem], layer_counts: list[int], results: Path, command: str
) -> None:
    """Part 3: the solve-time curve, written as ``planner_solve_time.{json,md,png}``."""
    print("solve time against layers ...", file=sys.stderr, flush=True)
    curve = solve_time_curve(problems, layer_counts)
    (results / "planner_solve_time.json").write_text(json.dumps(curve, indent=2) + "\n")
    (results / "planner_solve_time.md").write_text(solve_time_markdown(curve, command))
    solve_time_plot(curve, results / "planner_solve_time.png")
    print(solve_time_markdown(curve, command))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe,mtp,sparse,hf-llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of the bench run")
    parser.add_argument(
        "--layers", default="16,32,64,128,256,512", help="layer counts of the solve-time curve"
    )
    parser.add_argument("--cache-dir", help="profile cache (default ~/.cache/actplan/profiles)")
    parser.add_argument("--out", default="bench/results", help="where the results go")
    parser.add_argument(
        "--solve-time-only",
        action="store_true",
        help="only the solve-time curve, on the cached profiles (profiling those missing; no bench runs)",
    )
    args = parser.parse_args(argv)
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    layer_counts = [int(n) for n in args.layers.split(",") if n.strip()]
    command = (
        "python -m bench.planner" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    )
    cache = Path(args.cache_dir) if args.cache_dir else None
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.solve_time_only:
        problems = {name: cached_problem(name, args.size, cache) for name in names}
        write_solve_time(problems, layer_counts, results, command)
        return 0
    models, problems = [], {}
    for name in names:
        out, profile = run_model(name, args.size, args.repeats, cache, results)
        (results / f"planner_{name}_{args.size}.json").write_text(json.dumps(out, indent=2) + "\n")
        report = model_markdown(out)
        (results / f"planner_{name}_{args.size}.md").write_text(report)
        print(report)
        models.append(out)
        problems[name] = profile.problem()
    summary = {"models": models, "goals": prediction_goals(models)}
    (results / "planner_predictions.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = predictions_markdown(models, command)
    (results / "planner_predictions.md").write_text(report)
    print(report)
    write_solve_time(problems, layer_counts, results, command)
    return 0 if all(p["parity_ok"] for out in models for p in out["plans"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
