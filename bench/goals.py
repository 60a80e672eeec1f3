"""The project's performance goals for ``actplan bench``, stated on its JSON results.

    actplan bench --size small --json bench/results/bench_dense_small.json \
        --markdown bench/results/bench_dense_small.md
    python -m bench.goals bench/results/bench_dense_small.json    # adds the goals to both files

The library's bench measures and reports; whether the figures meet the goals set for the core
engine (on the dense model at ``GOAL_SIZE``) is this harness's call. For each JSON given, it
evaluates the goals, writes them into the JSON (``"goals"``) and rewrites the markdown report
next to it (same stem, or ``--markdown``) with a "Goals" section. Other models and sizes get
an empty list. Imports ``actplan.evaluate`` only; nothing in ``actplan`` imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from actplan.evaluate.bench import BenchResult
from actplan.evaluate.report import to_markdown

GOAL_SIZE = "small"
"""The model size the performance goals are set for; other sizes get none."""


def evaluate_goals(result: BenchResult) -> list[dict[str, Any]]:
    """The core engine's performance goals (set on the dense model at ``GOAL_SIZE``), with
    figures and verdicts; none for another model or size, where they do not apply."""
    goals = []
    if result.model_name != "dense" or result.size != GOAL_SIZE:
        return goals
    none, full, matmuls = result.row("none"), result.row("full"), result.row("matmuls")
    if full and result.floor_bytes:
        value = full.activation_bytes / result.floor_bytes
        goals.append(
            {"goal": "full: activation bytes / analytic floor <= 1.10", "value": value, "met": value <= 1.10}
        )
    if none and matmuls:
        cut = 1 - matmuls.activation_bytes / none.activation_bytes
        goals.append(
            {"goal": "matmuls: activation bytes at least 35% below none", "value": cut, "met": cut >= 0.35}
        )
        goals.append(
            {
                "goal": "matmuls: step time <= 1.10x none",
                "value": matmuls.ratio_to_none,
                "met": matmuls.ratio_to_none <= 1.10,
            }
        )
    if result.overhead_vs_torch_checkpoint:
        value = result.overhead_vs_torch_checkpoint["median"]
        pairs = result.overhead_vs_torch_checkpoint["pairs"]
        goals.append(
            {
                "goal": f"full via actplan / plain torch.utils.checkpoint <= 1.03 ({pairs} paired steps)",
                "value": value,
                "met": value <= 1.03,
            }
        )
    return goals


def goal_lines(goals: list[dict[str, Any]]) -> list[str]:
    """The report's "Goals" section (nothing when there are no goals)."""
    lines = ["", "## Goals", ""] if goals else []
    for g in goals:
        lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']} (measured {g['value']:.3f})")
    return lines


def with_goals(data: dict[str, Any], goals: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench JSON with ``"goals"`` in its place (after ``marker_cost_ns``)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key != "goals":
            out[key] = value
        if key == "marker_cost_ns":
            out["goals"] = goals
    out.setdefault("goals", goals)
    return out


def add_goals(json_path: Path, markdown_path: Path | None = None) -> list[dict[str, Any]]:
    """Evaluate the goals of one bench JSON; write them into it and into its markdown report."""
    data = json.loads(json_path.read_text())
    result = BenchResult.from_dict(data)
    goals = evaluate_goals(result)
    json_path.write_text(json.dumps(with_goals(data, goals), indent=2) + "\n")
    markdown_path = markdown_path or json_path.with_suffix(".md")
    markdown_path.write_text(to_markdown(result, sections=goal_lines(goals)))
    return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goals", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench JSON files (actplan bench --json)")
    parser.add_argument("--markdown", type=Path, help="the report to rewrite (one JSON only; default: X.md)")
    args = parser.parse_args(argv)
    if args.markdown and len(args.results) > 1:
        parser.error("--markdown names the report of one JSON; give one JSON with it")
    for path in args.results:
        goals = add_goals(path, args.markdown)
        result = BenchResult.from_dict(json.loads(path.read_text()))
        if result.model_name == "dense" and result.size != GOAL_SIZE:
            print(f"{path}: performance goals are set for --size {GOAL_SIZE}; not evaluated at {result.size}")
        for goal in goals:
            verdict = "met" if goal["met"] else "NOT met"
            print(f"{path}: {verdict}: {goal['goal']} (measured {goal['value']:.3f})")
        print(f"wrote {path} and {args.markdown or path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
