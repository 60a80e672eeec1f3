"""The real-scale results table: every shipped shape at sequence 8192 on a stated parallel
layout, estimated on fake tensors with the roofline clock for an H100.

For each shape: the peak per GPU of ``none``, ``full`` and the presets, and of the planner's
plans at three budgets across the feasible range (each plan stepped on fake tensors like a
preset, next to the planner's own prediction); the estimated step-time ratio to ``none``; and
the seconds the estimate took on this machine.

    python -m bench.realscale.table            # writes bench/results/realscale.{json,md}
    python -m bench.realscale.table --only llama3-8b

Memory is measured on fake tensors, each rank run through ``actplan.parallelize`` on a fake
process group (``actplan.planning.estimate``); times are roofline estimates, not measurements.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

from actplan.models.shape import load_shape
from actplan.planning._workers import default_workers
from actplan.planning.estimate import EstimateResult, estimate

# name -> (fsdp, tp, ep): the layout each shape is estimated on, as a team would first try it.
LAYOUTS: dict[str, tuple[int, int, int]] = {
    "llama3-8b": (8, 1, 1),
    "llama3-70b": (8, 8, 1),
    # 47 B and 30 B parameters: 16 bytes each over 8 GPUs would be 93 and 61 GB before any
    # activation, so the MoE shapes shard over 32.
    "mixtral-8x7b": (32, 1, 8),
    "qwen3-30b-a3b": (32, 1, 8),
    # 671 B parameters: 16 bytes each over 256 ranks is 39 GiB; 256 experts over 32 ranks.
    "deepseek-v3": (256, 1, 32),
}
SEQ = 8192
# The time goals (issue 32): llama3-8b in 60 s and 2 GiB of host memory per process, the
# DeepSeek-V3-like shape in 4 minutes, on a 2-core machine (the table's runs step five presets
# and three plans, in one worker process per core). llama3-70b's goal (90 s) is for FSDP 32 x TP
# 8, not this table's layout.
GOAL_SECONDS = {"llama3-8b": 60, "deepseek-v3": 240}
GOAL_RSS_BYTES = {"llama3-8b": 2 * 2**30}
GPU = "h100"
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _layout(fsdp: int, tp: int, ep: int) -> str:
    parts = [f"FSDP {fsdp}"] + [f"TP {tp}"] * (tp > 1) + [f"EP {ep}"] * (ep > 1)
    return " x ".join(parts) + f" ({fsdp * tp} GPUs)"


def render(results: dict[str, dict]) -> str:
    gib = 2**30
    lines = [
        "# Real-scale estimates",
        "",
        f"Every shipped shape at sequence {SEQ}, batch 1 per GPU, bf16, on an {GPU.upper()} "
        "(roofline clock), estimated on fake tensors by `python -m bench.realscale.table`. "
        "Every shape runs one rank through `actplan.parallelize` (FSDP2; TP with sequence "
        "parallelism; experts over the EP ranks, each FSDP-sharded over the ranks that hold it) "
        "on a fake process group with two AdamW steps: everything is measured, routing assumed "
        "balanced. 'allocated' and "
        "'reserved' are the caching-allocator model's peaks for the step's allocation trace, under "
        "torch's default settings; 'fits' is reserved plus the CUDA context and NCCL's buffers "
        "within the H100's 80 GB. Times are estimates. Plans are the planner's at three budgets "
        "of GPU memory across the feasible range; 'planner' is its prediction of requested bytes, "
        "the row the plan's own fake step.",        "",
    ]
    lines += [
        "## Goals",
        "",
        "| shape | estimate took (goal) | peak host memory of a process so far (goal) |",
        "|---|---:|---:|",
    ]
    for name, result in results.items():
        goal = GOAL_SECONDS.get(name)
        took = f"{result['seconds_taken']:.0f} s" + (
            f" ({goal} s: {'met' if result['seconds_taken'] <= goal else 'missed'})" if goal else ""
        )
        rss_goal = GOAL_RSS_BYTES.get(name)
        rss = result.get("max_rss_bytes")
        rss_text = (
            "-"
            if rss is None
            else f"{rss / 2**30:.2f} GiB"
            + (f" ({rss_goal / 2**30:.0f} GiB: {'met' if rss <= rss_goal else 'missed'})" if rss_goal else "")
        )
        lines.append(f"| {name} | {took} | {rss_text} |")
    lines.append("")
    for name, result in results.items():
        lines += [
            f"## {name}: {result['layout']}",
            "",
            f"{result['description']}. {result['parameters'] / 1e9:.2f} B parameters before "
            f"sharding; static {result['static_bytes'] / gib:.1f} GiB"
            + (f" + gathered {result['gathered_bytes'] / gib:.1f} GiB" if result["gathered_bytes"] else "")
            + f" per GPU. {result['method']}. Estimated in {result['seconds_taken']:.0f} s on "
            f"{result['machine']}.",
            "",
            "| preset / plan | activations (end of fwd) | requested | allocated | reserved | fits "
            "| est. step vs none | planner |",
            "|---|---:|---:|---:|---:|:---:|---:|---:|",
        ]
        for row in result["rows"]:
            planner = (
                "-"
                if row["predicted_peak_bytes"] is None
                else f"{row['predicted_peak_bytes'] / gib:.2f} GiB, {row['predicted_ratio']:.3f}x"
            )
            keys = ("activation_bytes", "peak_bytes", "allocated_peak_bytes", "reserved_peak_bytes")
            figures = [row[key] / gib for key in keys]
            cells = " | ".join(f"{value:.2f} GiB" for value in figures)
            lines.append(
                f"| {row['preset']} | {cells} | {'yes' if row['fits'] else 'no'} "
                f"| {row['ratio_to_none']:.3f}x | {planner} |"
            )
        lines.append("")
    return "\n".join(lines)


def run(names: list[str]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    workers = default_workers()
    machine = f"{platform.machine()}, {workers} worker process(es), torch {torch.__version__}"
    for name in names:
        fsdp, tp, ep = LAYOUTS[name]
        started = time.perf_counter()
        print(f"{name}: {_layout(fsdp, tp, ep)}", flush=True)
        result: EstimateResult = estimate(
            load_shape(name, seq=SEQ),
            gpu=GPU,
            fsdp=fsdp,
            tp=tp,
            ep=ep,
            plans=True,
            progress=lambda line: print(f"  {line}", flush=True),
            workers=workers,
        )
        data = result.to_dict()
        for row in data["rows"]:
            row.pop("plan_yaml", None)  # the plans are in the table as rows; the YAML is not kept
        # The peak resident memory so far of this process or any worker it waited for (shapes
        # run in this order, so the first shape's figure is its own).
        rss = 1024 * max(
            resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        data |= {"layout": _layout(fsdp, tp, ep), "machine": machine, "max_rss_bytes": rss}
        results[name] = data
        print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(LAYOUTS), help="one shape (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for realscale.{json,md}")
    args = parser.parse_args(argv)
    results = run(args.only or list(LAYOUTS))
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = args.out / "realscale.json"
    if args.only and earlier.is_file():  # the other shapes keep their committed results
        kept = json.loads(earlier.read_text())
        kept.update(results)
        results = {name: kept[name] for name in LAYOUTS if name in kept}
    (args.out / "realscale.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "realscale.md").write_text(render(results))
    print(f"wrote {args.out / 'realscale.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
