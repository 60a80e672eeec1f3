"""The bench result as a markdown report: context, the policy table, offload, held bytes per
kept unit, per-rank memory, engine overhead and marker cost.

Reads only ``evaluate.bench``'s result types and ``actplan.sizes``; writes nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from actplan.evaluate.bench import BenchResult
from actplan.evaluate.contenders import PolicyRow
from actplan.sizes import mib


def to_markdown(result: BenchResult, *, sections: Sequence[str] = ()) -> str:
    """The result as a markdown report. ``sections``: lines of further sections (a harness's
    verdicts, say), placed after the tables and before the overhead and marker-cost notes."""
    lines = [
        *_context(result),
        *_policy_table(result),
        *_offload_table(result.rows),
        *held_markdown(result.rows),
        *_per_rank_memory(result.rows),
        *sections,
        *_overhead_and_marker_cost(result),
    ]
    return "\n".join(lines)


def _context(result: BenchResult) -> list[str]:
    return [
        f"# actplan bench: {result.model}",
        "",
        f"- command: `{result.command}`",
        f"- device: {result.device}; torch {result.torch_version}; {result.machine}",
        f"- started: {result.started}; timing: {result.warmup} warm-up + {result.repeats} interleaved "
        "rounds, median and interquartile spread",
        f"- parameters: {mib(result.param_bytes)} MiB; analytic activation floor: "
        f"{mib(result.floor_bytes)} MiB",
        "",
    ]


def _policy_table(result: BenchResult) -> list[str]:
    lines = rows_markdown(result.rows)
    if any(r.flops is not None for r in result.rows):
        lines += [
            "",
            "Recomputed GFLOP: the row's step FLOPs minus `none`'s. Est. ratio: the same step priced by "
            "a roofline clock for the named GPU (FLOPs at its peak, bytes at its HBM bandwidth, offload "
            "copies at its host link): an estimate, deterministic, beside the measured ratio.",
        ]
    return lines


def rows_markdown(rows: Sequence[PolicyRow], errors: Mapping[str, str] | None = None) -> list[str]:
    """The one rows table of every bench (``actplan bench``, the peers, the GPU suite): parity
    (``exact``: loss, every gradient and the grad census bit for bit; ``ok``: within the row's
    allowance, shown), activation bytes and their share of ``none``'s, peaks, time against ``none``.
    A kind column where rows of several kinds stand together, the allocator's peak where CUDA
    measured it, the roofline columns where rows were priced; ``errors``: rows that did not run."""
    none = next((r for r in rows if r.name == "none"), None)
    kinds = len({r.kind for r in rows} - {"baseline"}) > 1
    cuda = any(r.cuda_peak_bytes is not None for r in rows)
    priced = any(r.flops is not None for r in rows)
    head = ["row", *(["kind"] if kinds else []), "parity", "max abs dgrad (allowed)"]
    head += ["activations @ fwd end (MiB)", "vs none", "peak (MiB)"]
    head += ["peak, max_memory_allocated (MiB)"] if cuda else []
    head += ["step median (s)", "ratio to none"]
    head += ["recomputed GFLOP", "est. ratio on GPU"] if priced else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        share = f"{r.activation_bytes / none.activation_bytes:.2f}" if none and none.activation_bytes else "-"
        cells = [r.name, *([r.kind] if kinds else []), _parity_text(r)]
        cells.append(f"{r.max_abs_grad_diff:.1e}" + (f" ({r.grad_atol:.1e})" if r.grad_atol else ""))
        cells += [mib(r.activation_bytes), share, mib(r.peak_bytes) if r.peak_bytes is not None else "-"]
        cells += [mib(r.cuda_peak_bytes) if r.cuda_peak_bytes is not None else "-"] if cuda else []
        timed = r.step_median_s is not None
        cells.append(f"{r.step_median_s:.3f}" if timed else "-")
        cells.append(f"{r.ratio_to_none:.3f} ± {r.ratio_spread:.3f}" if timed else "-")
        cells += [recomputed_gflop(r, none), predicted_text(r)] if priced else []
        lines.append("| " + " | ".join(cells) + " |")
    for name, error in (errors or {}).items():
        text = " ".join(error.split()).replace("|", "\\|")  # one line; its bars are not the table's
        lines.append(f"| {name} | ERROR: {text} |" + " |" * (len(head) - 2))
    return lines


def _parity_text(row: PolicyRow) -> str:
    if row.bit_exact:
        return "exact"
    if row.parity_ok:
        return "ok"
    within = (
        ("loss", row.loss_abs_diff <= row.loss_atol),
        ("gradients", row.max_abs_grad_diff <= row.grad_atol),
    )
    wrong = [what for what, same in within if not same]
    wrong += [] if row.census_match else ["census"]
    return "FAIL: " + ", ".join(wrong or ["loss"])


def recomputed_gflop(row: PolicyRow, none: PolicyRow | None) -> str:
    if row.flops is None or none is None or none.flops is None:
        return "-"
    return f"{(row.flops - none.flops) / 1e9:.3f}"


def predicted_text(row: PolicyRow) -> str:
    return "-" if row.predicted_ratio is None else f"{row.predicted_ratio:.3f} ({row.roofline_gpu})"


def _offload_table(rows: list[PolicyRow]) -> list[str]:
    offloading = [r for r in rows if r.offloaded_bytes is not None]
    if not offloading:
        return []
    lines = [
        "",
        "## Offload (over one training step)",
        "",
        "| policy | device-tier activations @ fwd end (MiB) | host-tier peak (MiB) "
        "| moved to host (MiB) | moved back (MiB) | ratio to none |",
        "|---|---|---|---|---|---|",
    ]
    for r in offloading:
        lines.append(
            f"| {r.name} | {mib(r.activation_bytes)} | {mib(r.host_peak_bytes)} | "
            f"{mib(r.offloaded_bytes)} | {mib(r.reloaded_bytes)} | "
            f"{r.ratio_to_none:.3f} ± {r.ratio_spread:.3f} |"
        )
    return lines


def held_markdown(rows: list[PolicyRow]) -> list[str]:
    """The per-unit table: what each selective row's kept units hold against autograd."""
    selective = [r for r in rows if r.held_by_unit]
    if not selective:
        return []
    lines = [
        "",
        "## Held per kept unit (end of forward, all layers)",
        "",
        "What a kept unit holds, against what autograd keeps for the same ops without checkpointing "
        "(the tensors they save and those of their outputs any op saves); `routing` is the routing "
        "and collective outputs every plan keeps.",
        "",
        "| policy | unit | held (KiB) | autograd keeps (KiB) | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in selective:
        for unit, sizes in sorted(r.held_by_unit.items()):
            held, autograd = sizes["held"], sizes["autograd"]
            share = f"{held / autograd:.2f}" if autograd else ("0" if not held else "-")
            lines.append(f"| {r.name} | {unit} | {held / 1024:.1f} | {autograd / 1024:.1f} | {share} |")
    return lines


def _per_rank_memory(rows: list[PolicyRow]) -> list[str]:
    if not any(r.per_rank_memory for r in rows):
        return []
    lines = ["", "## Per-rank memory (activations @ fwd end / peak, MiB)", ""]
    for r in rows:
        per_rank = ", ".join(f"rank {i}: {mib(a)} / {mib(p)}" for i, (a, p) in enumerate(r.per_rank_memory))
        lines.append(f"- {r.name}: {per_rank}")
    return lines


def _overhead_and_marker_cost(result: BenchResult) -> list[str]:
    lines = []
    if result.overhead_vs_torch_checkpoint:
        o = result.overhead_vs_torch_checkpoint
        lines += [
            "",
            f"Engine overhead, `full` through actplan against plain `torch.utils.checkpoint` per layer: "
            f"median ratio {o['median']:.3f} (quartiles {o['q25']:.3f}-{o['q75']:.3f}) over {o['pairs']} "
            "paired steps.",
        ]
    lines += [
        "",
        "## Marker cost",
        "",
        f"- `checkpoint_record` outside a checkpointed layer: {result.marker_cost_ns['outside_region']:.0f} "
        "ns per call",
        f"- inside a checkpointed layer (advances the region's interval state): "
        f"{result.marker_cost_ns['inside_region']:.0f} ns per call",
        "",
    ]
    return lines
