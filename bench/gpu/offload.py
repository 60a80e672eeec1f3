"""GPU check for offload: copy bandwidth, then peak memory and step time with and without offload.

    python -m bench.gpu.offload                       # on a CUDA machine: the full check
    python -m bench.gpu.offload --device cpu --size tiny --min-bytes 0   # smoke run anywhere

1. Copy bandwidth between pinned host memory and the device, both directions.
2. For a dense and an MoE model at a size that fills a few GiB of activations (the ``gpu``
   sizes of ``bench.gpu.models``: hidden size 4096, 4096 tokens, bf16), one
   interleaved run of ``none``, ``full``, ``full`` with the layer inputs offloaded,
   ``matmuls`` and ``matmuls`` with its kept units offloaded: peak device memory
   (``torch.cuda.max_memory_allocated``, or the dispatch-level meter off CUDA), median
   step time, bytes moved each way, and the loss and gradient norm against ``none``.
3. Derived: how much of the layer-input copy time the overlap hides
   (``1 - exposed / copy_time``, where ``exposed`` is the median over rounds of
   ``t[full+offload] - t[full]``; goal >= 0.9 at hidden size >= 4096) and how far the peak
   drops against the bytes offloaded (goal: equal within 5%).

``python -m bench.gpu.suite`` runs this as one of its stages.

Prints a table and writes JSON (default ``bench/results/gpu_offload.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import actplan
from actplan.measure import MemoryMeter, interleaved_timing
from actplan.planning.profile import copy_bandwidth
from bench.gpu.models import SCALES, ModelSpec, batch_on


def configs(min_bytes: str) -> dict[str, Any]:
    """The compared plans; ``min_bytes`` is the offload size threshold."""
    return {
        "none": "none",
        "full": "full",
        "full+offload": {"preset": "full", "offload": {"layer_input": True, "min_bytes": min_bytes}},
        "matmuls": "matmuls",
        "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept", "min_bytes": min_bytes}},
    }


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    torch.manual_seed(0)
    loss = model(**batch)["loss"]
    loss.backward()
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])
    ).item()
    model.zero_grad(set_to_none=True)
    return loss.item(), norm


def _peak_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(model, batch)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with MemoryMeter(model) as meter:
        _step(model, batch)
    return meter.report().peak_bytes


def run_model(
    spec: ModelSpec,
    device: torch.device,
    repeats: int,
    warmup: int,
    min_bytes: str,
    progress: Any = None,
) -> dict[str, Any]:
    """Every row of ``configs`` on one model: loss, gradient norm, peak, bytes moved, step times."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    bundle = spec.build(device)
    batch = batch_on(bundle, device)
    models = {}
    for label, config in configs(min_bytes).items():
        model = copy.deepcopy(bundle.model)
        actplan.apply(model, config)
        models[label] = model
        say(f"  {spec.name}: prepared {label}")
    rows: dict[str, dict[str, Any]] = {}
    for label, model in models.items():
        loss, norm = _step(model, batch)  # warm-up and parity
        engine = actplan.offload_engine(model)
        if engine is not None:
            engine.reset_stats()
        peak = _peak_bytes(model, batch, device)
        stats = engine.snapshot() if engine is not None else None
        rows[label] = {
            "loss": loss,
            "grad_norm": norm,
            "peak_bytes": peak,
            "offloaded_bytes": stats.bytes_offloaded if stats else 0,
            "reloaded_bytes": stats.bytes_reloaded if stats else 0,
            "reload_skipped_bytes": stats.bytes_reload_skipped if stats else 0,
            "host_peak_bytes": stats.host_peak_bytes if stats else 0,
            "host_fallbacks": stats.host_fallbacks if stats else 0,
        }
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
        row["loss_identical"] = row["loss"] == rows["none"]["loss"]
        row["grad_norm_rel_diff"] = (
            abs(row["grad_norm"] - rows["none"]["grad_norm"]) / rows["none"]["grad_norm"]
        )
    return {
        "model": f"{bundle.description}, {spec.dtype}",
        "hidden_size": bundle.model.config.dim,
        "dtype": spec.dtype,
        "rows": rows,
    }


def overlap_figures(result: dict[str, Any], bandwidth: dict[str, float]) -> dict[str, Any]:
    """Exposed copy time and peak saving of offloading layer inputs, against ``full``.

    The exposed time is the median over rounds of the paired difference of the two rows'
    step times (rounds are interleaved, so drift cancels). Goals: at least 90% of the copy
    time hidden; the peak drops by the bytes offloaded, within 5%.
    """
    full, offload = result["rows"]["full"], result["rows"]["full+offload"]
    copy_seconds = (
        offload["offloaded_bytes"] / bandwidth["device_to_host"]
        + offload["reloaded_bytes"] / bandwidth["host_to_device"]
    )
    paired = [a - b for a, b in zip(offload["step_samples_s"], full["step_samples_s"], strict=True)]
    exposed = max(statistics.median(paired), 0.0)
    hidden = 1.0 - exposed / copy_seconds if copy_seconds else float("nan")
    cut = full["peak_bytes"] - offload["peak_bytes"]
    moved = offload["offloaded_bytes"]
    cut_vs_moved = cut / moved if moved else float("nan")
    return {
        "copy_seconds": copy_seconds,
        "exposed_seconds": exposed,
        "hidden_fraction": hidden,
        "peak_cut_bytes": cut,
        "offloaded_bytes": moved,
        "peak_cut_over_offloaded": cut_vs_moved,
        "goals": [
            {"goal": "share of copy time hidden >= 0.90", "value": hidden, "met": hidden >= 0.9},
            {
                "goal": "peak cut / bytes offloaded within 5% of 1",
                "value": cut_vs_moved,
                "met": abs(cut_vs_moved - 1) <= 0.05,
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
            f"{'config':<16} {'peak MiB':>10} {'moved MiB':>10} {'step s':>8} {'vs none':>8} {'loss same':>9}"
        )
        for label, row in result["rows"].items():
            print(
                f"{label:<16} {row['peak_bytes'] / 2**20:10.1f} {row['offloaded_bytes'] / 2**20:10.1f} "
                f"{row['step_median_s']:8.3f} {row['ratio_to_none']:8.3f} {row['loss_identical']!s:>9}"
            )
        figures = result["layer_input_offload"]
        print(
            f"layer-input offload: copy {figures['copy_seconds'] * 1e3:.1f} ms, exposed "
            f"{figures['exposed_seconds'] * 1e3:.1f} ms, hidden {figures['hidden_fraction']:.2%}; peak cut "
            f"{figures['peak_cut_bytes'] / 2**20:.1f} MiB of "
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
