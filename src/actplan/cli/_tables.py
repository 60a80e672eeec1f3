"""The command line's rich tables: bench rows, held bytes per kept unit, profiles, plans, the
predicted front, verify steps and the per-layer plan. Builds tables only, prints nothing.

Imports rich, ``actplan.sizes`` and the result types it is handed (by attribute only).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from actplan._install.plan import format_indices
from actplan.evaluate.bench import BenchResult
from actplan.evaluate.report import recomputed_gflop
from actplan.sizes import mib


def bench_table(result: BenchResult) -> Table:
    """Every row's exactness, memory and time, in 100 columns; offload and per-rank memory,
    when a row has them, are ``bench_extra_table``'s."""
    none = result.row("none")
    none_step = f"{none.step_median_s:.3f} s" if none else "-"
    gpu = next((r.roofline_gpu for r in result.rows if r.roofline_gpu), "gpu")
    table = Table(
        title=f"actplan bench — {result.model} — {result.device}, torch {result.torch_version}",
        caption=f"exact: loss, every gradient and the grad census bit for bit as `none`; analytic "
        f"activation floor {mib(result.floor_bytes)} MiB; `none`'s step {none_step}; {result.warmup} "
        f"warm-up + {result.repeats} interleaved rounds; +GFLOP: FLOPs recomputed per step; est. "
        f"{gpu}: the step priced by a roofline clock (an estimate)",
    )
    for column in (
        "policy",
        "exact",
        "act. MiB",
        "× none",
        "peak MiB",
        "time × none",
        "+GFLOP",
        f"est. {gpu}",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right", no_wrap=True)
    for r in result.rows:
        table.add_row(
            r.name,
            _exactness(r),
            mib(r.activation_bytes),
            f"{r.activation_bytes / none.activation_bytes:.2f}" if none else "-",
            mib(r.peak_bytes),
            f"{r.ratio_to_none:.3f} ± {r.ratio_spread:.3f}",
            recomputed_gflop(r, none),
            "-" if r.predicted_ratio is None else f"{r.predicted_ratio:.3f}",
        )
    return table


def _exactness(row) -> str:
    """``yes`` when the loss, every gradient and the census match bit for bit; else what differs."""
    if not row.loss_identical:
        return "[red]NO: loss[/]"
    if not row.census_match:
        return "[red]NO: census[/]"
    if row.max_abs_grad_diff:
        return f"[yellow]Δ{row.max_abs_grad_diff:.1e}[/]"
    return "[green]yes[/]"


def bench_extra_table(result: BenchResult) -> Table | None:
    """What some rows have beyond ``bench_table``'s columns: each expert-parallel rank's
    activations and peak, and offload's host tier; ``None`` when no row has either."""
    expert_parallel = any(r.per_rank_memory for r in result.rows)
    offloading = any(r.offloaded_bytes is not None for r in result.rows)
    if not expert_parallel and not offloading:
        return None
    table = Table(title="per rank and host tier")
    table.add_column("policy", no_wrap=True)
    if expert_parallel:
        table.add_column("per-rank act./peak MiB", justify="right", no_wrap=True)
    if offloading:
        table.add_column("host peak MiB", justify="right", no_wrap=True)
        table.add_column("moved out/in MiB", justify="right", no_wrap=True)
    for r in result.rows:
        cells = [" | ".join(f"{mib(a)}/{mib(p)}" for a, p in r.per_rank_memory)] if expert_parallel else []
        if offloading:
            cells += (
                ["-", "-"]
                if r.offloaded_bytes is None
                else [mib(r.host_peak_bytes), f"{mib(r.offloaded_bytes)}/{mib(r.reloaded_bytes)}"]
            )
        table.add_row(r.name, *cells)
    return table


def held_table(held: dict[str, dict[str, dict[str, int]]], title: str) -> Table:
    """Per row (policy or layer) and kept unit: bytes held against what autograd keeps."""
    table = Table(
        title=title,
        caption="autograd keeps: what the same ops hold without checkpointing (the tensors they save "
        "and those of their outputs any op saves); routing: routing and collective outputs",
    )
    for column in ("", "unit", "held KiB", "autograd keeps KiB", "ratio"):
        table.add_column(column, justify="left" if column in ("", "unit") else "right", no_wrap=True)
    for name, units in held.items():
        for unit, sizes in sorted(units.items()):
            kept, autograd = sizes["held"], sizes["autograd"]
            share = f"{kept / autograd:.2f}" if autograd else ("0" if not kept else "-")
            table.add_row(name, unit, f"{kept / 1024:.1f}", f"{autograd / 1024:.1f}", share)
    return table


def profile_table(profile) -> Table:
    table = Table(
        title=f"profile of {profile.model} on {profile.device}",
        caption="MiB per layer: retained to backward, transient at the layer's peak, offloaded to the host; "
        "extra: ms the candidate adds to a step",
    )
    table.add_column("layers")
    table.add_column("candidate", overflow="fold")  # a long unit list folds, whole, over lines
    for column in ("retained", "transient", "offloaded", "extra ms"):
        table.add_column(column, justify="right")
    for layer_type in profile.layer_types:
        where = f"{layer_type.class_name} {format_indices(layer_type.layer_indices)}"
        for position, c in enumerate(layer_type.candidates):
            table.add_row(
                where if position == 0 else "",
                c.name,
                mib(c.retained_bytes),
                mib(c.transient_bytes),
                mib(c.offloaded_bytes) if c.offload else "-",
                f"{c.extra_seconds * 1e3:.2f}",
            )
    return table


def plan_table(result) -> Table:
    """``actplan plan``: predicted peak and time, and the measured ones when the plan ran."""
    solution = result.solution
    reserved = solution.get("modelled_reserved_peak_bytes")
    bound = "reserved" if reserved is not None else "requested"
    table = Table(title=f"plan for {result.model} under {mib(result.budget_bytes)} MiB ({bound})")
    for column in ("", "peak MiB", "step time / none"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row("predicted", mib(solution["predicted_peak_bytes"]), f"{solution['predicted_ratio']:.3f}")
    if reserved is not None:
        table.add_row("reserved (modelled)", mib(reserved), "")
    if result.measured is not None:
        measured, error = result.measured, result.prediction_error
        table.add_row(
            "measured",
            mib(measured["peak_bytes"]),
            f"{measured['ratio_to_none']:.3f} ± {measured['ratio_spread']:.3f}",
        )
        table.add_row("prediction error", f"{error['peak']:+.1%}", f"{error['time_ratio']:+.1%}")
    return table


def sweep_table(model: str, front: list[dict[str, Any]], summary) -> Table:
    """``actplan plan --sweep``: one row per point of the predicted front; ``summary`` names a
    point's candidates."""
    table = Table(title=f"every plan worth having for {model} (predicted, fastest at each peak)")
    for column in ("peak MiB", "of none", "step time / none"):
        table.add_column(column, justify="right")
    table.add_column("plan (layers: candidate)", overflow="fold")
    for point in front:
        share = point["share_of_none_peak"]
        table.add_row(
            mib(point["predicted_peak_bytes"]),
            f"{share:.0%}" if share is not None else "-",
            f"{point['predicted_ratio']:.3f}",
            summary(point["candidates"]),
        )
    return table


def verify_table(config: str, report) -> Table:
    table = Table(title=f"verify {config} on {report.model}")
    for column in ("step", "loss (no checkpointing)", "loss (plan)", "max |Δgrad|", "grad census", "routing"):
        table.add_column(column, justify="right")
    for s in report.steps:
        routing = "-" if not s.routing_decisions else ("match" if s.routing_match else "[red]DIFFERS[/]")
        table.add_row(
            str(s.step),
            f"{s.loss_baseline:.8g}",
            f"{s.loss_plan:.8g}" + ("" if s.loss_identical else " [red]≠[/]"),
            f"{s.max_abs_grad_diff:.1e}",
            "match" if s.census_match else "[red]MISMATCH[/]",
            routing,
        )
    return table


def layer_plan_table(plan, title: str, caption: str) -> Table:
    """``actplan explain``: one row per layer of the plan."""
    table = Table(title=title, caption=caption)
    for column in ("layer", "module", "class", "mode", "kept units", "routing saved", "offloaded", "from"):
        table.add_column(column)
    for layer in plan.layers:
        kept = ", ".join(u.value for u in layer.kept_units) if layer.mode == "selective" else "-"
        routing = "-" if layer.mode == "none" else ("yes" if layer.routing_saved else "no")
        table.add_row(
            str(layer.index),
            layer.name,
            layer.class_name,
            layer.mode,
            kept or "(none)",
            routing,
            layer.describe_offload() or "-",
            layer.source,
        )
    return table
