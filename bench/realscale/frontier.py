"""The planner's frontier at real scale: for each shape and layout below, the fastest predicted
plan at each share of ``none``'s activations, keeping or recomputing only and with offload too,
on an H100 at sequence 8192 (``actplan estimate --frontier``).

    python -m bench.realscale.frontier            # writes bench/results/frontier.{md,json} and PNGs
    python -m bench.realscale.frontier --only llama3-8b

Predicted by the planner over a profile on fake tensors with the roofline clock (copies at the
H100's host link, charged per layer): estimates, not measurements. The question each answers
(issue 33's moonshot): is there a plan holding at most 0.3x ``none``'s activations at 1.03x or
less, and if not, what is the best point and what stops it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from actplan.cli._estimate import frontier_summary, write_frontier_plot
from actplan.models.shape import load_shape
from actplan.planning._workers import default_workers
from actplan.planning.estimate import FRONTIER_KINDS, estimate

# name -> (fsdp, tp, ep)
LAYOUTS: dict[str, tuple[int, int, int]] = {
    "llama3-8b": (8, 1, 1),
    "llama3-70b": (8, 8, 1),
    "deepseek-v3": (256, 1, 32),
}
SEQ = 8192
GPU = "h100"
SHARES = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2)
MOONSHOT = (0.3, 1.03)  # activations of none's, step ratio
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _fastest(points: list[dict], share: float) -> dict | None:
    within = [p for p in points if p["share_of_none"] <= share + 1e-9]
    return min(within, key=lambda p: p["ratio"]) if within else None


def render(results: dict[str, dict]) -> str:
    lines = [
        "# The planner's frontier at real scale",
        "",
        "`python -m bench.realscale.frontier`: the fastest plan the planner predicts at each share of",
        "`none`'s activations (bytes above parameters and optimizer state), keeping or recomputing only,",
        f"and with offload too; {GPU}, sequence {SEQ}, bf16, one sequence per GPU. Estimates from a",
        "profile on fake tensors with the roofline clock; offload's copies at the H100's host link",
        "(64 GB/s each way), charged per layer. Plots beside this page.",
        "",
    ]
    for name, entry in results.items():
        fronts = entry["frontiers"]
        lines += [f"## {name}, {entry['layout']}", "", f"![{name}](frontier_{name}.png)", ""]
        lines += ["| activations ≤ | " + " | ".join(FRONTIER_KINDS) + " | host per GPU (offload) |"]
        lines += ["|---:|" + "---:|" * len(FRONTIER_KINDS) + "---:|"]
        for share in SHARES:
            best = [_fastest(fronts[kind], share) for kind in FRONTIER_KINDS]
            cells = ["-" if b is None else f"{b['ratio']:.3f}x" for b in best]
            host = "-" if best[-1] is None else f"{best[-1]['host_bytes'] / 2**30:.2f} GiB"
            lines.append(f"| {share:.0%} | " + " | ".join(cells) + f" | {host} |")
        least = {kind: min(p["share_of_none"] for p in fronts[kind]) for kind in FRONTIER_KINDS}
        lines += ["", "Least activations any plan holds: "]
        lines[-1] += ", ".join(f"{kind} {share:.0%}" for kind, share in least.items()) + "."
        lines += ["", *(f"- {line}" for line in entry["summary"]), ""]
        if entry.get("checks"):
            lines += ["Those plans stepped on fake tensors (the check of the prediction):", ""]
            lines += ["| plan | predicted | stepped | requested peak predicted / stepped | reserved | host |"]
            lines += ["|---|---:|---:|---:|---:|---:|"]
            for c in entry["checks"]:
                lines.append(
                    f"| {c['plan']} | {c['predicted_ratio']:.3f}x | {c['stepped_ratio']:.3f}x | "
                    f"{c['predicted_peak_bytes'] / 2**30:.1f} / {c['stepped_peak_bytes'] / 2**30:.1f} GiB | "
                    f"{c['reserved_peak_bytes'] / 2**30:.1f} GiB | {c['host_bytes'] / 2**30:.2f} GiB |"
                )
            lines.append("")
        share, ratio = MOONSHOT
        best = _fastest(fronts[FRONTIER_KINDS[1]], share)
        verdict = (
            "no plan holds that little"
            if best is None
            else f"the fastest plan there is predicted at {best['ratio']:.3f}x"
        )
        lines += [f"At most {share:.0%} of `none`'s activations at {ratio}x or less: {verdict}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(LAYOUTS), help="one shape (the others keep their results)")
    args = parser.parse_args()
    path = RESULTS / "frontier.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name, (fsdp, tp, ep) in LAYOUTS.items():
        if args.only and name != args.only:
            continue
        print(f"{name}: FSDP {fsdp}, TP {tp}, EP {ep}", flush=True)
        shape = load_shape(name, seq=SEQ)
        result = estimate(
            shape, ("none",), gpu=GPU, fsdp=fsdp, tp=tp, ep=ep, frontier=True,
            workers=default_workers(), progress=lambda line: print("  " + line, flush=True),
        )  # fmt: skip
        write_frontier_plot(result, str(RESULTS / f"frontier_{name}.png"))
        layout = " x ".join([f"FSDP {fsdp}"] + [f"TP {tp}"] * (tp > 1) + [f"EP {ep}"] * (ep > 1))
        checks = [
            {
                "plan": row.preset,
                "predicted_ratio": row.predicted_ratio,
                "stepped_ratio": row.ratio_to_none,
                "predicted_peak_bytes": row.predicted_peak_bytes,
                "stepped_peak_bytes": row.peak_bytes,
                "reserved_peak_bytes": row.reserved_peak_bytes,
                "host_bytes": row.moved.host_bytes if row.moved is not None else 0,
            }
            for row in result.rows
            if row.preset.startswith("frontier")
        ]
        results[name] = {
            "layout": layout,
            "checks": checks,
            # The plans by layer range; the candidate indices behind them stay out (the profile's).
            "frontiers": {
                k: [{f: x for f, x in asdict(p).items() if f != "choices"} for p in v]
                for k, v in result.frontiers.items()
            },
            "summary": frontier_summary(result),
            "seconds_taken": result.seconds_taken,
        }
        for line in results[name]["summary"]:
            print("  " + line, flush=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "frontier.md").write_text(render(results))


if __name__ == "__main__":
    main()
