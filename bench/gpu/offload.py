"""GPU check for offload: copy bandwidth, then device memory at the end of forward and step time
with and without offload.

    python -m bench.gpu.offload                       # on a CUDA machine: the full check
    python -m bench.gpu.offload --device cpu --size tiny --min-bytes 0   # smoke run anywhere

1. Copy bandwidth between pinned host memory and the device, both directions.
2. For a dense and an MoE model at a size that fills a few GiB of activations (the ``gpu``
   sizes of ``bench.gpu.models``: hidden size 4096, 4096 tokens, bf16), one
   interleaved run of ``none``, ``full``, ``full`` with the layer inputs offloaded,
   ``matmuls`` and ``matmuls`` with its kept units offloaded:
   - parity: the loss and every gradient against ``none`` within ``NOISE_FACTOR`` times the
     two-run noise floor (``none`` run twice), with deterministic algorithms on for these
     steps where torch allows it (then the floor is 0 and parity is bit-exact);
   - device bytes at the end of forward, where offload saves what it moved: on CUDA
     ``torch.cuda.memory_allocated`` right after the loss, less what was allocated before the
     step; off CUDA (and on CUDA as a cross-check) the memory meter's activation bytes at
     its ``forward_end`` mark. The whole step's peak is reported too, but it is no measure of
     offload: ``full``'s peak comes late in backward, when the layer inputs are freed already;
   - median step time, bytes moved each way.
3. Derived: how much of the layer-input copy time the overlap hides
   (``1 - exposed / copy_time``, where ``exposed`` is the median over rounds of
   ``t[full+offload] - t[full]``; goal >= 0.9 at hidden size >= 4096) and how far device
   bytes at the end of forward drop against the bytes offloaded (goal: equal within 5%).

``python -m bench.gpu.suite`` runs this as one of its stages.

Prints a table and writes JSON (default ``bench/results/gpu_offload.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import actplan
from actplan.evaluate.runner import NOISE_FACTOR
from actplan.measure import MemoryMeter, StepCapture, capture_step, compare_steps, interleaved_timing
from actplan.planning.profile import copy_bandwidth
from bench.gpu.context import DETERMINISTIC_ENV, Determinism
from bench.gpu.models import SCALES, ModelSpec, batch_on

CUT_TOLERANCE = 0.05
"""Device bytes at the end of forward must drop by the bytes offloaded within this fraction."""
HIDDEN_GOAL = 0.9
"""At least this share of the layer-input copy time hidden by the copy streams."""


def configs(min_bytes: str) -> dict[str, Any]:
    """The compared plans; ``min_bytes`` is the offload size threshold."""
    return {
        "none": "none",
        "full": "full",
        "full+offload": {"preset": "full", "offload": {"layer_input": True, "min_bytes": min_bytes}},
        "matmuls": "matmuls",
        "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept", "min_bytes": min_bytes}},
    }


def _forward_backward(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], after_forward: Callable[[], Any] | None = None
) -> torch.Tensor:
    torch.manual_seed(0)
    loss = model(**batch)["loss"]
    if after_forward is not None:
        after_forward()
    loss.backward()
    return loss


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    _forward_backward(model, batch)
    model.zero_grad(set_to_none=True)


def _capture(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> StepCapture:
    captured = capture_step(model, _forward_backward(model, batch))
    model.zero_grad(set_to_none=True)
    return captured


def _allocator_step(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> dict[str, int]:
    """One step on CUDA: bytes allocated right after the loss over those allocated before the
    step (what forward left on the device), and the step's ``max_memory_allocated``."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    at_end: list[int] = []
    _forward_backward(model, batch, lambda: at_end.append(torch.cuda.memory_allocated(device) - base))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return {"forward_end_allocated_bytes": at_end[0], "step_peak_allocated_bytes": peak}


def _metered_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """One step under the memory meter: activation bytes at the end of forward, and its peak."""
    with MemoryMeter(model) as meter:
        _forward_backward(model, batch, lambda: meter.mark("forward_end"))
    model.zero_grad(set_to_none=True)
    report = meter.report()
    return {
        "forward_end_meter_bytes": report.marks["forward_end"].activation_bytes,
        "step_peak_meter_bytes": report.peak_bytes,
    }


def _memory_row(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> dict[str, Any]:
    """Device bytes at the end of forward (the allocator's on CUDA, the meter's elsewhere), the
    step's peak, and what the offload engine moved in the step those came from."""
    engine = actplan.lowlevel.installed_plan(model).offload_engine
    if engine is not None:
        engine.reset_stats()
    row: dict[str, Any] = {}
    if device.type == "cuda":
        row.update(_allocator_step(model, batch, device))
        row.update(forward_end_source="torch.cuda.memory_allocated after the loss")
        row["forward_end_bytes"] = row["forward_end_allocated_bytes"]
        row["peak_bytes"] = row["step_peak_allocated_bytes"]
    stats = engine.snapshot() if engine is not None else None
    row.update(_metered_step(model, batch))  # on CUDA, the cross-check
    if device.type != "cuda":
        stats = engine.snapshot() if engine is not None else None
        row.update(forward_end_source="memory meter at forward_end")
        row["forward_end_bytes"] = row["forward_end_meter_bytes"]
        row["peak_bytes"] = row["step_peak_meter_bytes"]
    row.update(
        offloaded_bytes=stats.bytes_offloaded if stats else 0,
        reloaded_bytes=stats.bytes_reloaded if stats else 0,
        reload_skipped_bytes=stats.bytes_reload_skipped if stats else 0,
        host_peak_bytes=stats.host_peak_bytes if stats else 0,
        host_fallbacks=stats.host_fallbacks if stats else 0,
    )
    return row


def _parity(
    models: dict[str, torch.nn.Module], batch: dict[str, torch.Tensor], exact: Determinism
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """``none`` twice (the noise floor), then every row against it, all under ``exact``."""
    with exact():
        baseline = _capture(models["none"], batch)
        again = compare_steps(baseline, _capture(models["none"], batch))
        floor = {"loss": again.loss_abs_diff, "grad": again.max_abs_grad_diff}
        grad_atol, loss_atol = NOISE_FACTOR * floor["grad"], NOISE_FACTOR * floor["loss"]
        rows = {}
        for label, model in models.items():
            parity = compare_steps(baseline, _capture(model, batch), grad_atol=grad_atol, loss_atol=loss_atol)
            rows[label] = {
                "loss": float(baseline.loss.float()) if label == "none" else None,
                "parity_ok": parity.ok,
                "loss_identical": parity.loss_identical,
                "loss_abs_diff": parity.loss_abs_diff,
                "max_abs_grad_diff": parity.max_abs_grad_diff,
                "worst_param": parity.worst_param,
                "census_match": parity.census_match,
                "grad_atol": grad_atol,
                "loss_atol": loss_atol,
                "bit_exact": parity.loss_identical and parity.max_abs_grad_diff == 0 and parity.census_match,
            }
    return floor, rows


def run_model(
    spec: ModelSpec,
    device: torch.device,
    repeats: int,
    warmup: int,
    min_bytes: str,
    progress: Any = None,
    exact: Determinism | None = None,
) -> dict[str, Any]:
    """Every row of ``configs`` on one model: parity, device bytes at the end of forward, the
    step's peak, bytes moved, step times. ``exact``: deterministic algorithms for the parity
    steps (default: on where torch allows it)."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    exact = exact if exact is not None else Determinism(device)
    bundle = spec.build(device)
    batch = batch_on(bundle, device)
    models = {}
    for label, config in configs(min_bytes).items():
        model = copy.deepcopy(bundle.model)
        actplan.apply(model, config)
        models[label] = model
        say(f"  {spec.name}: prepared {label}")
    floor, rows = _parity(models, batch, exact)
    say(f"  {spec.name}: parity against the two-run noise floor (deterministic: {exact.on})")
    for label, model in models.items():
        rows[label].update(_memory_row(model, batch, device))
    say(f"  {spec.name}: device bytes at the end of forward")
    timings = interleaved_timing(
        {label: (lambda m=model: _step(m, batch)) for label, model in models.items()},
        repeats=repeats,
        warmup=warmup,
    )
    for label, row in rows.items():
        row["step_median_s"] = timings[label].median
        row["step_samples_s"] = timings[label].samples
        row["ratio_to_none"] = statistics.median(
            a / b for a, b in zip(timings[label].samples, timings["none"].samples, strict=True)
        )
    return {
        "model": f"{bundle.description}, {spec.dtype}",
        "hidden_size": bundle.model.config.dim,
        "dtype": spec.dtype,
        "noise_floor": floor,
        "deterministic": exact.record("the parity steps (none twice, then every row)"),
        "rows": rows,
    }


def overlap_figures(result: dict[str, Any], bandwidth: dict[str, float]) -> dict[str, Any]:
    """Exposed copy time, and the cut in device bytes at the end of forward, of offloading the
    layer inputs, against ``full``.

    The exposed time is the median over rounds of the paired difference of the two rows'
    step times (rounds are interleaved, so drift cancels). The cut is measured at the end of
    forward, where the offloaded layer inputs would otherwise all be alive; the step's peak
    comes late in backward, after ``full`` has freed them, so it does not show the cut.
    Goals: at least 90% of the copy time hidden; the cut equals the bytes offloaded within 5%.
    """
    full, offload = result["rows"]["full"], result["rows"]["full+offload"]
    copy_seconds = (
        offload["offloaded_bytes"] / bandwidth["device_to_host"]
        + offload["reloaded_bytes"] / bandwidth["host_to_device"]
    )
    paired = [a - b for a, b in zip(offload["step_samples_s"], full["step_samples_s"], strict=True)]
    exposed = max(statistics.median(paired), 0.0)
    hidden = 1.0 - exposed / copy_seconds if copy_seconds else float("nan")
    cut = full["forward_end_bytes"] - offload["forward_end_bytes"]
    moved = offload["offloaded_bytes"]
    cut_vs_moved = cut / moved if moved else float("nan")
    return {
        "copy_seconds": copy_seconds,
        "exposed_seconds": exposed,
        "hidden_fraction": hidden,
        "forward_end_source": offload["forward_end_source"],
        "forward_end_cut_bytes": cut,
        "offloaded_bytes": moved,
        "forward_end_cut_over_offloaded": cut_vs_moved,
        # Not a measure of offload (see above); reported so the two can be told apart.
        "step_peak_cut_bytes": full["peak_bytes"] - offload["peak_bytes"],
        "goals": [
            {
                "goal": f"share of copy time hidden >= {HIDDEN_GOAL:.2f}",
                "value": hidden,
                "met": hidden >= HIDDEN_GOAL,
            },
            {
                "goal": f"device bytes at the end of forward drop by the bytes offloaded, within "
                f"{CUT_TOLERANCE:.0%}",
                "value": cut_vs_moved,
                "met": abs(cut_vs_moved - 1) <= CUT_TOLERANCE,
            },
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SCALES), default="gpu")
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-bytes", default="64KiB", help="offload size threshold")
    parser.add_argument("--json", default="bench/results/gpu_offload.json")
    args = parser.parse_args(argv)
    for key, value in DETERMINISTIC_ENV.items():  # before cuBLAS initialises
        os.environ.setdefault(key, value)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    bandwidth = copy_bandwidth(device, (1 << 30) if args.size == "gpu" else (1 << 20), repeats=5)
    print(
        f"copy bandwidth: device->host {bandwidth['device_to_host'] / 1e9:.1f} GB/s, "
        f"host->device {bandwidth['host_to_device'] / 1e9:.1f} GB/s",
        flush=True,
    )
    out: dict[str, Any] = {
        "command": "python -m bench.gpu.offload " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch_version": torch.__version__,
        "machine": f"{platform.system()} {platform.machine()}",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "bandwidth_bytes_per_s": bandwidth,
        "models": {},
    }
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        result = run_model(SCALES[args.size][name], device, args.repeats, args.warmup, args.min_bytes)
        result["layer_input_offload"] = overlap_figures(result, bandwidth)
        out["models"][name] = result
        print(f"\n{result['model']}")
        print(
            f"{'config':<16} {'fwd end MiB':>11} {'peak MiB':>10} {'moved MiB':>10} {'step s':>8} "
            f"{'vs none':>8} {'parity':>6}"
        )
        for label, row in result["rows"].items():
            print(
                f"{label:<16} {row['forward_end_bytes'] / 2**20:11.1f} {row['peak_bytes'] / 2**20:10.1f} "
                f"{row['offloaded_bytes'] / 2**20:10.1f} {row['step_median_s']:8.3f} "
                f"{row['ratio_to_none']:8.3f} {'ok' if row['parity_ok'] else 'FAIL':>6}"
            )
        figures = result["layer_input_offload"]
        print(
            f"layer-input offload: copy {figures['copy_seconds'] * 1e3:.1f} ms, exposed "
            f"{figures['exposed_seconds'] * 1e3:.1f} ms, hidden {figures['hidden_fraction']:.2%}; "
            f"end-of-forward cut {figures['forward_end_cut_bytes'] / 2**20:.1f} MiB for "
            f"{figures['offloaded_bytes'] / 2**20:.1f} MiB offloaded",
            flush=True,
        )
        del result
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
