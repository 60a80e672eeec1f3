"""The "keep holds what backward reads" goals, checked against the committed bench results.

    python -m bench.keep_goals        # reads bench/results/*.json, writes keep_goals.{md,json}

Runs nothing itself: it reads the ``actplan bench`` reports (``bench_<model>_<size>.json``,
tiny and small) and the peers reports (``peers_<model>_small.json``) and states, per goal,
the measured value and whether it is met. The CPU-cost goals that ``bench.engine_cost`` also
measures (``full`` / torch-checkpoint, ``matmuls`` / op-SAC) come from its report
(``engine_cost.json``: the median over several processes of the tree it calls "after") when it
has the model; the peers report's single process otherwise. Re-run the benches first (see
docs/benchmarks.md).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

RESULTS = Path("bench/results")
PRESETS = ("full", "attn", "matmuls", "megatron-selective")
UNIT_SLACK = 1.05


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["rows"]}


def _memory_goals(name: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = _rows(report)
    none = rows["none"]["activation_bytes"]
    goals = []
    for preset in PRESETS:
        row = rows.get(preset)
        if row is None:
            continue
        share = row["activation_bytes"] / none
        goals.append(
            {
                "goal": f"{name}: `{preset}` holds at most `none`, exact (loss, gradients, census)",
                "value": share,
                "met": share <= 1.0 and row["parity_ok"],
            }
        )
        for unit, sizes in sorted((row.get("held_by_unit") or {}).items()):
            if unit == "routing" or not sizes["held"]:
                continue
            ratio = sizes["held"] / sizes["autograd"] if sizes["autograd"] else float("inf")
            if ratio > UNIT_SLACK:
                goals.append(
                    {
                        "goal": f"{name}: `{preset}` unit {unit} holds at most "
                        f"{UNIT_SLACK}x what autograd keeps",
                        "value": ratio,
                        "met": False,
                    }
                )
    return goals


def _share(report: dict[str, Any], preset: str) -> float:
    rows = _rows(report)
    return rows[preset]["activation_bytes"] / rows["none"]["activation_bytes"]


def evaluate(results: Path = RESULTS) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []
    reports = {}
    for path in sorted(results.glob("bench_*.json")):
        stem = path.stem.removeprefix("bench_")
        reports[stem] = json.loads(path.read_text())
        goals += _memory_goals(stem, reports[stem])
    unit_goals = [g for g in goals if "unit" in g["goal"]]
    if not unit_goals:
        text = f"every kept unit (all rows above) holds at most {UNIT_SLACK}x what autograd keeps"
        goals.append({"goal": text, "value": None, "met": True})
    targets = [
        ("hf-llama_small", "matmuls", 0.60, "hf-llama small: `matmuls` at most 0.60x `none`"),
        ("sparse_small", "attn", 0.60, "sparse small: `attn` below 0.60x `none`"),
        ("sparse_small", "matmuls", 0.60, "sparse small: `matmuls` below 0.60x `none`"),
        ("dense_small", "megatron-selective", 0.90, "dense small: `megatron-selective` at most 0.90x `none`"),
        ("moe_small", "megatron-selective", 0.90, "moe small: `megatron-selective` at most 0.90x `none`"),
    ]
    for stem, preset, limit, text in targets:
        if stem in reports and preset in _rows(reports[stem]):
            value = _share(reports[stem], preset)
            goals.append({"goal": text, "value": value, "met": value <= limit})
    if "hf-llama_small" in reports and {"attn", "full"} <= set(_rows(reports["hf-llama_small"])):
        report = reports["hf-llama_small"]
        value = _share(report, "attn") / _share(report, "full")
        text = "hf-llama small: `attn` within 1.5x of what `full` keeps"
        goals.append({"goal": text, "value": value, "met": value <= 1.5})
    cpu_limits = {
        ("full", "torch-checkpoint"): {"dense": 1.03, "moe": 1.10},
        ("attn", "remat-attn"): {"dense": 1.2, "moe": 1.2},
        ("matmuls", "remat-matmuls"): {"dense": 1.2, "moe": 1.2},
        ("matmuls", "op-sac-matmuls"): {"dense": 0.85, "moe": 0.85},
    }
    engine_path = results / "engine_cost.json"
    engine_runs = json.loads(engine_path.read_text())["runs"] if engine_path.exists() else {}
    for model in ("dense", "moe"):
        path = results / f"peers_{model}_small.json"
        if not path.exists():
            continue
        peers = json.loads(path.read_text())
        after = engine_runs.get(model, {}).get("after") or []
        for pair in peers["cpu_overhead"]["pairs"]:
            limit = cpu_limits.get((pair["actplan"], pair["peer"]), {}).get(model)
            if limit is None:
                continue
            key = f"{pair['actplan']}/{pair['peer']}"
            if after and all(key in run for run in after):
                value = statistics.median(run[key] for run in after)
                source = f"engine_cost.json, median of {len(after)} processes"
            else:
                value, source = pair["ratio"], f"peers_{model}_small.json"
            goals.append(
                {
                    "goal": f"CPU cost per layer, {model} tiny: `{pair['actplan']}` / "
                    f"{pair['peer']} at most {limit} ({source})",
                    "value": value,
                    "met": value <= limit,
                }
            )
        if model == "moe":
            for entry in peers["at_same_peak"]:
                if entry["peer"] not in ("torch-checkpoint", "titan-sac", "titan-op-sac"):
                    continue
                best = entry.get("best") or {}
                cut = best.get("overhead_cut")
                goals.append(
                    {
                        "goal": f"moe small, at {entry['peer']}'s peak: at least 15% less overhead "
                        f"(peer {entry['peer_ratio']:.3f}, actplan {best.get('name')} "
                        f"{best.get('ratio', float('nan')):.3f}; undefined when the peer is not slower "
                        "than `none`)",
                        "value": cut,
                        "met": cut is not None and cut >= 0.15,
                    }
                )
    return goals


def to_markdown(goals: list[dict[str, Any]]) -> str:
    lines = [
        "# Keep holds what backward reads: goals against the committed results",
        "",
        "Generated by `python -m bench.keep_goals` from `bench/results/bench_*.json`, "
        "`peers_*_small.json` and `engine_cost.json`. Memory values are activation bytes at the "
        "end of forward as a share of `none` (or held / autograd for units); CPU values are "
        "per-layer overhead ratios.",
        "",
        "| goal | measured | verdict |",
        "|---|---|---|",
    ]
    for goal in goals:
        value = "-" if goal["value"] is None else f"{goal['value']:.3f}"
        lines.append(f"| {goal['goal']} | {value} | {'met' if goal['met'] else 'NOT met'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    goals = evaluate()
    (RESULTS / "keep_goals.json").write_text(json.dumps(goals, indent=2) + "\n")
    report = to_markdown(goals)
    (RESULTS / "keep_goals.md").write_text(report)
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
