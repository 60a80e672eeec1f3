"""Planner benchmarks: solve time, and planned plans against the fixed presets at equal memory.

    python -m bench.planner                       # dense small and moe small (several minutes)
    python -m bench.planner --models dense --size tiny --repeats 2   # quick

1. Solve time of the MILP for 128 layers x 32 candidates (random costs), median of runs;
   goal under 1 s.
2. Per model: profile (cached), budget = ``full``'s measured peak plus ``--gap`` (default
   25%) of the way to ``none``'s; the planner's plan for it, then one ``actplan bench`` run
   with the plan next to every preset and offload row (interleaved timing, memory meter,
   parity). Goal: the plan's step-time ratio beats every fixed row whose measured peak
   fits the same budget. Also the prediction error of peak and step time, and a Pareto
   plot with the measured rows on it.

Writes ``bench/results/planner_<model>_<size>.{json,md,png}`` and ``planner_solve_time.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from actplan.bench import DEFAULT_POLICIES, run_bench
from actplan.budget import ParetoPoint, get_profile, pareto_points, write_pareto_plot
from actplan.models import build_model
from actplan.planner import Candidate, PlanProblem, minimum_peak, solve
from actplan.profile import config_for

RESULTS = Path("bench/results")


def solve_time(layers: int = 128, candidates: int = 32, runs: int = 5) -> dict[str, Any]:
    rng = random.Random(0)
    mib = 2**20
    problem = PlanProblem(
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
    lowest, _ = minimum_peak(problem)
    seconds = {}
    for share in (0.05, 0.25, 0.5):
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            solve(problem, lowest * (1 + share))
            samples.append(time.perf_counter() - start)
        seconds[f"budget min+{share:.0%}"] = statistics.median(samples)
    worst = max(seconds.values())
    return {
        "layers": layers,
        "candidates": candidates,
        "median_seconds": seconds,
        "goal": "solve time under 1 s for 128 layers x 32 candidates",
        "met": worst < 1.0,
    }


def stretched_solve_time(problem: PlanProblem, gap: float, layers: int = 128) -> dict[str, Any]:
    """Solve time of this model's measured candidates repeated over ``layers`` layers."""
    n = len(problem.layers)
    big = replace(
        problem,
        layers=tuple(problem.layers[i % n] for i in range(layers)),
        layer_grad_bytes=tuple(problem.layer_grad_bytes[i % n] for i in range(layers)),
    )
    lowest, _ = minimum_peak(big)
    top = big.peak([[c.name for c in cs].index("none") for cs in big.layers])
    start = time.perf_counter()
    solve(big, lowest + gap * (top - lowest))
    return {
        "layers": layers,
        "candidates_per_layer": sorted({len(cs) for cs in big.layers}),
        "seconds": time.perf_counter() - start,
    }


def run_model(name: str, size: str, gap: float, repeats: int, cache_dir: Path | None) -> dict[str, Any]:
    bundle = build_model(name, size)
    device = torch.device("cpu")
    print(f"profiling {name} {size} ...", file=sys.stderr, flush=True)
    profile, cached = get_profile(
        bundle,
        name,
        device,
        cache_dir=cache_dir,
        repeats=repeats,
        progress=lambda s: print("  " + s, file=sys.stderr),
    )
    budget = profile.full_peak_bytes + gap * (profile.none_peak_bytes - profile.full_peak_bytes)
    start = time.perf_counter()
    solution = solve(profile.problem(), budget)
    solve_seconds = time.perf_counter() - start
    stretched = stretched_solve_time(profile.problem(), gap)
    config = config_for(profile, solution.choices)
    plan_path = RESULTS / f"planner_{name}_{size}.yaml"
    config.dump(plan_path)
    print(f"bench with the plan ({plan_path}) ...", file=sys.stderr, flush=True)
    result = run_bench(
        name,
        size,
        DEFAULT_POLICIES,
        (plan_path,),
        repeats=repeats,
        warmup=1,
        overhead_repeats=0,
        device="cpu",
        reference=True,
        command=f"python -m bench.planner --models {name} --size {size}",
    )
    plan_row = result.row(plan_path.stem)
    rows = []
    for row in result.rows:
        rows.append(
            {
                "name": row.name,
                "peak_bytes": row.peak_bytes,
                "activation_bytes": row.activation_bytes,
                "ratio_to_none": row.ratio_to_none,
                "ratio_spread": row.ratio_spread,
                "fits_budget": row.peak_bytes <= budget,
                "parity_ok": row.parity_ok,
            }
        )
    fitting = [r for r in rows if r["fits_budget"] and r["name"] != plan_row.name]
    beats = all(plan_row.ratio_to_none < r["ratio_to_none"] for r in fitting)
    predicted_ratio = solution.predicted_seconds / profile.base_seconds
    points = pareto_points(profile)
    measured_points = [
        ParetoPoint(r["name"] + " (measured)", "measured", r["peak_bytes"], r["ratio_to_none"]) for r in rows
    ]
    png = RESULTS / f"planner_{name}_{size}.png"
    write_pareto_plot(
        points + measured_points,
        png,
        f"{bundle.description} (CPU)",
        {
            "predicted_peak_bytes": solution.predicted_peak_bytes,
            "predicted_ratio": predicted_ratio,
            "budget_bytes": budget,
            "measured_peak_bytes": plan_row.peak_bytes,
            "measured_ratio": plan_row.ratio_to_none,
        },
    )
    return {
        "model": bundle.description,
        "profile_from_cache": cached,
        "profile_seconds": profile.seconds_spent,
        "budget_bytes": budget,
        "budget_rule": f"full peak + {gap:.0%} of (none peak - full peak), both measured by the profile",
        "plan": config.to_dict(),
        "plan_candidates": list(solution.names),
        "predicted_peak_bytes": solution.predicted_peak_bytes,
        "predicted_ratio": predicted_ratio,
        "measured_peak_bytes": plan_row.peak_bytes,
        "measured_ratio": plan_row.ratio_to_none,
        "peak_error": (solution.predicted_peak_bytes - plan_row.peak_bytes) / plan_row.peak_bytes,
        "ratio_error": (predicted_ratio - plan_row.ratio_to_none) / plan_row.ratio_to_none,
        "plan_parity_ok": plan_row.parity_ok,
        "rows": rows,
        "goal": "the plan's step-time ratio beats every fixed row whose measured peak fits the budget",
        "met": beats and plan_row.peak_bytes <= budget,
        "plot": str(png),
        "solve_seconds": solve_seconds,
        "stretched_to_128_layers": stretched,
    }


def to_markdown(name: str, size: str, out: dict[str, Any]) -> str:
    mib = 2**20
    stretched = out["stretched_to_128_layers"]
    lines = [
        f"# Planner on {out['model']}",
        "",
        f"- command: `python -m bench.planner --models {name} --size {size}`; torch {torch.__version__}, CPU",
        f"- budget: {out['budget_bytes'] / mib:.1f} MiB ({out['budget_rule']})",
        f"- plan: {', '.join(out['plan_candidates'])}",
        f"- predicted peak {out['predicted_peak_bytes'] / mib:.1f} MiB, measured "
        f"{out['measured_peak_bytes'] / mib:.1f} MiB (error {out['peak_error']:+.1%}); predicted step-time "
        f"ratio {out['predicted_ratio']:.3f}, measured {out['measured_ratio']:.3f} "
        f"(error {out['ratio_error']:+.1%})",
        f"- {'met' if out['met'] else 'NOT met'}: {out['goal']}",
        f"- solve time {out['solve_seconds']:.3f} s; these candidates repeated over "
        f"{stretched['layers']} layers: {stretched['seconds']:.3f} s",
        "",
        "| row | peak (MiB) | fits budget | step time / none | parity |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(out["rows"], key=lambda r: r["peak_bytes"]):
        lines.append(
            f"| {r['name']} | {r['peak_bytes'] / mib:.1f} | {'yes' if r['fits_budget'] else 'no'} | "
            f"{r['ratio_to_none']:.3f} ± {r['ratio_spread']:.3f} | {'ok' if r['parity_ok'] else 'FAILED'} |"
        )
    lines += ["", f"![Pareto plot]({Path(out['plot']).name})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--size", default="small")
    parser.add_argument("--gap", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    timing = solve_time()
    (RESULTS / "planner_solve_time.json").write_text(json.dumps(timing, indent=2) + "\n")
    print(f"solve time (128 x 32): {timing['median_seconds']} -> {'met' if timing['met'] else 'NOT met'}")
    ok = True
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        out = run_model(
            name, args.size, args.gap, args.repeats, Path(args.cache_dir) if args.cache_dir else None
        )
        (RESULTS / f"planner_{name}_{args.size}.json").write_text(json.dumps(out, indent=2) + "\n")
        report = to_markdown(name, args.size, out)
        (RESULTS / f"planner_{name}_{args.size}.md").write_text(report)
        print(report)
        ok = ok and out["plan_parity_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
