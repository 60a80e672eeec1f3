"""The GPU suite's allocator stage: what the caching-allocator model predicts against what the
CUDA caching allocator really did, for the same steps.

Each case builds a model on the device and takes two AdamW steps under a preset, all inside one
memory meter with an allocation trace (``MemoryMeter(trace_allocations=True)``), from an empty
cache with the peak statistics reset. The trace replays through ``measure.replay_allocations``
under the process's allocator settings (``PYTORCH_ALLOC_CONF``); the replay's peak allocated and
reserved bytes sit next to ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``.
The cases: the dense and MoE models under ``none``, ``full`` and ``matmuls``, the dense model
in fp32 under the same three, and the dense model under FSDP2 on one rank (its all-gather and
reduce-scatter streams keep pools of their own).

What the model cannot see, named in the report rather than fitted: allocations a kernel makes
inside one op (cuBLAS and cuDNN workspaces, a fused kernel's scratch), which never pass the
dispatcher as tensors. Off CUDA the stage rehearses the code and reports the predictions only.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

import actplan
from actplan.measure import MemoryMeter, replay_allocations, settings_from_env
from actplan.models import train_step
from actplan.sizes import mib
from bench.gpu.context import Determinism, StageContext, say
from bench.gpu.models import ModelSpec, batch_on
from bench.gpu.report import StageReport

PRESETS = ("none", "full", "matmuls")
TOLERANCE = 0.05
"""The check: predicted reserved within 5% of max_memory_reserved (the issue's eager goal)."""


def _cases(ctx: StageContext) -> list[tuple[str, ModelSpec, str, bool]]:
    dense, moe = ctx.spec("dense"), ctx.spec("moe")
    fp32 = ModelSpec(dense.name, dense.preset, "fp32", dense.overrides)
    cases = [(f"{label} {preset}", spec, preset, False) for label, spec in
             (("dense", dense), ("moe", moe), ("dense fp32", fp32)) for preset in PRESETS]  # fmt: skip
    cases.append(("dense full, FSDP2 on 1 rank", dense, "full", True))
    return cases


@contextlib.contextmanager
def _one_rank_group(device: torch.device) -> Iterator[Any]:
    """A one-rank process group (NCCL on CUDA, gloo elsewhere) and its device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if not owned and dist.get_world_size() != 1:
        raise RuntimeError("the allocator stage runs on one rank; start it outside a multi-rank job")
    if owned:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh(device.type, (1,))
    finally:
        if owned:
            dist.destroy_process_group()


def _fresh(device: torch.device) -> tuple[int, int]:
    """An empty cache and reset peaks; the bytes still allocated and reserved (the baseline)."""
    gc.collect()
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def _run_case(
    ctx: StageContext, spec: ModelSpec, preset: str, fsdp: bool, mesh: Callable[[], Any] | None
) -> dict[str, Any]:
    base_allocated, base_reserved = _fresh(ctx.device)
    meter = MemoryMeter(trace_allocations=True, follow_fsdp=fsdp)
    with meter:
        bundle = spec.build(ctx.device)
        if fsdp and mesh is not None:
            actplan.parallelize(bundle.model, mesh(), preset)
        elif preset != "none":
            actplan.apply(bundle.model, preset)
        optimizer = torch.optim.AdamW(bundle.model.parameters(), lr=1e-4)
        batch = batch_on(bundle, ctx.device)
        for _ in range(2):  # the first allocates AdamW's state; the second is the steady step
            train_step(bundle.model, batch, optimizer, seed=0)
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
    settings = settings_from_env()
    predicted = replay_allocations(meter.allocation_trace(), settings)
    row: dict[str, Any] = {
        "settings": settings.describe(),
        "meter_peak_bytes": meter.report().peak_bytes,
        "predicted_allocated_bytes": predicted.peak_allocated_bytes,
        "predicted_reserved_bytes": predicted.peak_reserved_bytes,
        "measured_allocated_bytes": None,
        "measured_reserved_bytes": None,
    }
    if ctx.cuda:
        row["measured_allocated_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - base_allocated
        row["measured_reserved_bytes"] = torch.cuda.max_memory_reserved(ctx.device) - base_reserved
        # Cached free space left in segments that still hold a live block would serve this
        # case's first allocations and lower its measured reserve: recorded, so it can be seen.
        row["baseline_reserved_bytes"] = base_reserved
        row["baseline_cached_free_bytes"] = base_reserved - base_allocated
    del bundle, optimizer, batch
    return row


def _error(row: dict[str, Any], what: str) -> float | None:
    measured = row[f"measured_{what}_bytes"]
    return None if not measured else row[f"predicted_{what}_bytes"] / measured - 1


def _shown_error(error: float | None) -> str:
    return "-" if error is None else f"{error:+.1%}"


def stage_allocator(ctx: StageContext, report: StageReport) -> None:
    """Predicted against measured allocator peaks for every case of ``_cases``."""
    if not ctx.cuda:
        report.skip("max_memory_allocated and max_memory_reserved", "need CUDA: predictions only")
    # No parity step here: every step is a memory measurement, on the kernels people train with
    # (a deterministic kernel may take other workspaces).
    off = Determinism(ctx.device, wanted=False, reason="every step here is memory-measured")
    report.data["deterministic"] = off.record("nowhere")
    rows = report.data.setdefault("rows", [])
    with _one_rank_group(ctx.device) as mesh:
        for label, spec, preset, fsdp in _cases(ctx):
            say(f"  {label}")
            row = {"case": label, **_run_case(ctx, spec, preset, fsdp, lambda: mesh)}
            rows.append(row)
            for what in ("allocated", "reserved"):
                row[f"{what}_error"] = _error(row, what)
            if row["reserved_error"] is not None:
                report.check(
                    f"{label}: predicted reserved within {TOLERANCE:.0%} of max_memory_reserved",
                    abs(row["reserved_error"]) <= TOLERANCE,
                    f"{row['reserved_error']:+.1%}",
                )
            report.write()
    errors = [abs(r["reserved_error"]) for r in rows if r["reserved_error"] is not None]
    if errors:
        report.headline(f"reserved: worst error {max(errors):.1%} over {len(errors)} cases")
    report.markdown += [
        "## Caching-allocator model against the CUDA caching allocator",
        "",
        f"Allocator settings: {rows[0]['settings'] if rows else '-'}. Two AdamW steps per case, from "
        "an empty cache; the model counts tensors the dispatcher sees (kernel workspaces are not).",
        "",
        "| case | meter peak (MiB) | allocated: predicted / measured (MiB) | error "
        "| reserved: predicted / measured (MiB) | error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = [r["measured_allocated_bytes"], r["measured_reserved_bytes"]]
        shown = ["-" if m is None else mib(m) for m in measured]
        errors = [_shown_error(r[f"{what}_error"]) for what in ("allocated", "reserved")]
        report.markdown.append(
            f"| {r['case']} | {mib(r['meter_peak_bytes'])} | {mib(r['predicted_allocated_bytes'])} / "
            f"{shown[0]} | {errors[0]} | {mib(r['predicted_reserved_bytes'])} / {shown[1]} | {errors[1]} |"
        )
