"""The peers bench's report: the markdown page of one model's run (rows, comparisons at equal
memory, goals, plans, CPU-side overhead) and its plot of peak against step-time ratio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actplan.evaluate.contenders import PolicyRow
from actplan.evaluate.report import rows_markdown
from actplan.evaluate.runner import COMPILED_GRAD_SLACK, COMPILED_LOSS_ATOL, NOISE_FACTOR
from actplan.planning.plot import pareto_axes
from actplan.sizes import mib
from bench.peers.compare import AUTOMATIC_PEER_GAIN
from bench.peers.methods import COMPILE_BACKEND


def _fmt_best(best: dict[str, Any] | None) -> str:
    if best is None:
        return "none fits | - | -"
    cut = "-" if best["overhead_cut"] is None else f"{best['overhead_cut']:+.0%}"
    return f"{best['name']} | {best['ratio']:.3f} ± {best['spread']:.3f} | {cut}"


def to_markdown(out: dict[str, Any]) -> str:
    lines = [
        *_header(out),
        *_rows_table(out),
        *_same_memory_tables(out),
        *_automatic_table(out),
        *_goals(out),
        *_plans(out),
        *_overhead_tables(out),
    ]
    stem = out.get("stem") or f"peers_{out['model_name']}_{out['size']}"
    lines += ["", f"![Pareto plot]({stem}.png)", ""]
    return "\n".join(lines)


def _header(out: dict[str, Any]) -> list[str]:
    """The title, the command, where and when it ran, and the peers that did not run."""
    lines = [
        f"# actplan and its peers: {out['model']}",
        "",
        f"- command: `{out['command']}`",
        f"- device: {out['device']}; torch {out['torch_version']}; torch_remat {out['torch_remat_version']}; "
        f"{out['machine']}",
        f"- started: {out['started']}; timing: {out['warmup']} warm-up + {out['repeats']} interleaved "
        "rounds, median and interquartile spread of the ratio to `none`",
        f"- torchtitan: {out['torchtitan']}",
    ]
    if out.get("settings_off_default"):
        lines.append(
            "- settings off the defaults (chosen to fit this run on the machine): "
            + "; ".join(out["settings_off_default"])
        )
    if out["compile_backend"]:
        lines.append(
            f'- compiled rows: each layer compiled with `backend="{out["compile_backend"]}"`; parity '
            f"allows the loss within {COMPILED_LOSS_ATOL:g} (or {NOISE_FACTOR:g} x the compile floor's loss "
            f"difference, if more) and gradients within {NOISE_FACTOR:g} x {out['compile_grad_floor']:.1e} "
            f"(the largest gradient difference compiling alone makes, this run) + {COMPILED_GRAD_SLACK:g}"
        )
    for entry in out["skipped_peers"]:
        lines.append(f"- not run: {entry['peer']}: {entry['reason']}")
    return lines


def _rows_table(out: dict[str, Any]) -> list[str]:
    """Every row, by peak then time ratio (the benches' one table, ``evaluate.report``)."""
    rows = [PolicyRow.from_record(r) for r in out["rows"]]
    rows.sort(key=lambda r: (r.peak_bytes or 0, r.ratio_to_none or 0))
    return ["", "## Rows", "", *rows_markdown(rows)]


def _same_memory_tables(out: dict[str, Any]) -> list[str]:
    """Per peer, the fastest actplan row at its peak, then at its activation bytes."""
    lines: list[str] = []
    for title, key in (
        ("At each peer's peak", "at_same_peak"),
        ("At each peer's activation bytes (end of forward)", "at_same_activation_bytes"),
    ):
        lines += [
            "",
            f"## {title}",
            "",
            "Fastest actplan row (preset or plan, parity ok) within "
            f"{out['same_memory_tolerance']:.1%} of the peer's bytes; "
            "overhead cut = 1 - (ours - 1) / (peer - 1).",
            "",
            "| peer | peer MiB | peer ratio | actplan row | its ratio | overhead cut "
            "| recompute-only row | its ratio | overhead cut |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in out[key]:
            lines.append(
                f"| {c['peer']} | {mib(c['peer_bytes'])} | {c['peer_ratio']:.3f} ± {c['peer_spread']:.3f} | "
                f"{_fmt_best(c['best'])} | {_fmt_best(c['best_recompute_only'])} |"
            )
    return lines


def _automatic_table(out: dict[str, Any]) -> list[str]:
    """At each torch.compile budget's peak: the fastest actplan row, and the fastest compiled one."""
    lines: list[str] = []
    automatic = [c for c in out["at_same_peak"] if c.get("automatic")]
    if automatic:
        lines += [
            "",
            "## Automatic peers: torch.compile's activation_memory_budget",
            "",
            "At each budget's measured peak (within "
            f"{out['same_memory_tolerance']:.1%}): the fastest actplan row of any kind, its ratio to the "
            f"peer's (goal: at most {1 - AUTOMATIC_PEER_GAIN:.2f}), and the fastest actplan row with "
            "compiled layers.",
            "",
            "| peer | peak (MiB) | peer ratio | actplan row | its ratio | / peer | compiled actplan row "
            "| its ratio | / peer |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in automatic:
            cells = []
            for best in (c["best"], c["best_compiled"]):
                if best is None:
                    cells.append("none fits | - | -")
                else:
                    cells.append(
                        f"{best['name']} | {best['ratio']:.3f} ± {best['spread']:.3f} | "
                        f"{best['ratio_vs_peer']:.3f}"
                    )
            lines.append(
                f"| {c['peer']} | {mib(c['peer_bytes'])} | {c['peer_ratio']:.3f} ± {c['peer_spread']:.3f} | "
                f"{cells[0]} | {cells[1]} |"
            )
    return lines


def _goals(out: dict[str, Any]) -> list[str]:
    lines = ["", "## Goals", ""]
    for g in out["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3f}"
        note = ""
        if g.get("missed_by") is not None:
            note = f"; missed by {g['missed_by'] * 100:.1f} percentage points"
        elif g.get("undefined"):
            note = f"; undefined: {g['undefined']}"
        lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']} (measured {value}{note})")
    return lines


def _plans(out: dict[str, Any]) -> list[str]:
    """The plans made at the peers' peaks, and the budgets no plan fits under."""
    lines: list[str] = []
    if out["plans"] or out["budgets_without_a_plan"]:
        lines += ["", "## Plans", ""]
        for p in out["plans"]:
            lines.append(
                f"- {p['name']} (for {', '.join(p['for_peers'])}): predicted peak "
                f"{mib(p['predicted_peak_bytes'])} MiB, ratio {p['predicted_ratio']:.3f}; "
                f"layers: {', '.join(p['candidates'])}"
            )
    for reason in out["budgets_without_a_plan"]:
        lines.append(f"- no plan at {reason}")
    return lines


def _overhead_tables(out: dict[str, Any]) -> list[str]:
    """The CPU-side cost per checkpointed layer, per row and per actplan-peer pair."""
    lines: list[str] = []
    overhead = out["cpu_overhead"]
    if overhead:
        lines += [
            "",
            f"## CPU-side overhead per checkpointed layer ({overhead['model']})",
            "",
            f"{overhead['rounds']} interleaved rounds of {overhead['steps_per_sample']} training steps; "
            "per round, (row - none) / (layers x steps).",
            "",
            "| row | µs per layer per step (median) | quartiles | parity |",
            "|---|---|---|---|",
        ]
        for name, v in overhead["overhead_per_layer_us"].items():
            parity = "ok" if overhead["parity_ok"][name] else "FAILED"
            lines.append(f"| {name} | {v['median']:.0f} | {v['q25']:.0f}-{v['q75']:.0f} | {parity} |")
        lines += ["", "| actplan | peer | overhead ratio | <= 1.0 |", "|---|---|---|---|"]
        for p in overhead["pairs"]:
            lines.append(
                f"| {p['actplan']} | {p['peer']} | {p['ratio']:.2f} | {'met' if p['met'] else 'NOT met'} |"
            )
    return lines


PLOT_STYLES: dict[str, tuple[str, str, str]] = {
    "baseline": ("o", "black", "no checkpointing"),
    "peer": ("^", "tab:red", "peers"),
    "automatic-peer": ("v", "tab:orange", f"torch.compile, activation_memory_budget ({COMPILE_BACKEND})"),
    "compiled": ("D", "tab:green", "actplan, compiled layers"),
    "preset": ("s", "tab:gray", "actplan presets"),
    "plan": ("*", "tab:blue", "actplan plans at a peer's peak"),
}
"""Per row kind: the plot's marker, colour and legend label."""


def write_plot(out: dict[str, Any], path: Path) -> None:
    """Peak (x) against step-time ratio (y): the planner's predicted front, and every measured row."""
    title = f"{out['model']} (CPU, torch {out['torch_version']})"
    ylabel = "step time / no checkpointing (measured)"
    with pareto_axes(path, title, ylabel=ylabel, figsize=(8, 5), dpi=110) as ax:
        front = sorted((p for p in out["pareto"] if p["kind"] == "plan"), key=lambda p: p["peak_bytes"])
        ax.plot(
            [p["peak_bytes"] / 2**20 for p in front],
            [p["time_ratio"] for p in front],
            "-",
            drawstyle="steps-post",
            color="tab:blue",
            alpha=0.5,
            label="planner, predicted (budget sweep)",
        )
        _plot_rows(ax, out["rows"])


def _plot_rows(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Every measured row as a point in its kind's style; the peers and the baseline named."""
    seen = set()
    titan_budget = any(r["name"].startswith("titan-memory-budget") for r in rows)
    for r in rows:
        marker, color, label = PLOT_STYLES[r["kind"]]
        if titan_budget and r["kind"] == "automatic-peer":
            label = f"torchtitan's MemoryBudgetAC, blocks compiled ({COMPILE_BACKEND})"
        ax.plot(
            r["peak_bytes"] / 2**20,
            r["ratio_to_none"],
            marker,
            color=color,
            markersize=10 if r["kind"] == "plan" else 7,
            label=None if r["kind"] in seen else label,
        )
        seen.add(r["kind"])
        if r["kind"] in ("peer", "automatic-peer", "baseline"):
            ax.annotate(
                r["name"],
                (r["peak_bytes"] / 2**20, r["ratio_to_none"]),
                xytext=(5, 4),
                textcoords="offset points",
                fontsize=7,
                color=color,
            )
