"""The peers bench's CPU-side cost per checkpointed layer: actplan's presets and the peers that
save the same regions, timed interleaved on a tiny model where Python and dispatch overhead
dominate the step."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from actplan.config import RecomputeConfig
from actplan.evaluate.bench import TORCH_CHECKPOINT
from actplan.evaluate.contenders import Contender, Installer, config_installer, torch_checkpoint_installer
from actplan.evaluate.runner import RowRunner, RowSpec
from actplan.measure import interleaved_timing
from actplan.models import train_step
from bench.peers.methods import op_sac_matmuls_installer, remat_installer
from bench.peers.rows import TITAN_MODELS, actplan_installer, build_bench_model, titan_entry
from bench.peers.titan import titan_peer_entries

PRESETS = ("none", "full", "attn", "matmuls")

OVERHEAD_ROWS: tuple[tuple[str, Callable[[], Installer]], ...] = (
    ("none", lambda: config_installer(RecomputeConfig.from_preset("none"))),
    (TORCH_CHECKPOINT, lambda: torch_checkpoint_installer),
    ("full", lambda: config_installer(RecomputeConfig.from_preset("full"))),
    ("remat-full", lambda: remat_installer("full")),
    ("attn", lambda: config_installer(RecomputeConfig.from_preset("attn"))),
    ("remat-attn", lambda: remat_installer("attn")),
    ("matmuls", lambda: config_installer(RecomputeConfig.from_preset("matmuls"))),
    ("remat-matmuls", lambda: remat_installer("matmuls")),
    ("op-sac-matmuls", lambda: op_sac_matmuls_installer),
)
OVERHEAD_PAIRS = (
    ("full", TORCH_CHECKPOINT),
    ("full", "remat-full"),
    ("attn", "remat-attn"),
    ("matmuls", "remat-matmuls"),
    ("matmuls", "op-sac-matmuls"),
)
"""(actplan row, peer row) pairs whose per-layer CPU overheads are compared; these peers save the
same regions as actplan. The torchtitan row (``titan_entry``), which saves a different set, is
added to the rows and paired with ``matmuls``."""
TITAN_OVERHEAD_PAIRS = (("full", "titan-full"), ("matmuls", "titan-sac"))
"""On torchtitan's model: actplan's ``full`` against torchtitan's FullAC (the same work), and
``matmuls`` against its SelectiveAC (a different save set, as on our models)."""


def cpu_overhead(
    model: str,
    *,
    layers: int = 8,
    repeats: int = 40,
    steps: int = 4,
    progress: Callable[[str], None],
    pairs: tuple[tuple[str, str], ...] | None = None,
) -> dict[str, Any]:
    """Per checkpointed layer, the extra time of a training step over ``none`` at tiny shapes.

    Each timed sample runs ``steps`` training steps; rounds are interleaved, and a row's
    overhead is the median over rounds of (its time - none's time in the same round).
    ``pairs`` (default: every pair above and the torchtitan row) also chooses the rows: those
    the pairs name, and ``none``.
    """
    bundle = build_bench_model(model, "tiny", n_layers=layers)
    batch = bundle.make_batch(0)
    device = torch.device("cpu")
    if model in TITAN_MODELS:
        pairs = pairs or TITAN_OVERHEAD_PAIRS
        named = {"none", *(name for pair in pairs for name in pair)}
        titan_rows = [
            *((preset, actplan_installer(model, RecomputeConfig.from_preset(preset))) for preset in PRESETS),
            *titan_peer_entries(),
        ]
        rows = [(name, install) for name, install in titan_rows if name in named]
    elif pairs is None:
        titan_name, titan_install, _ = titan_entry()
        rows = [*((name, make()) for name, make in OVERHEAD_ROWS), (titan_name, titan_install)]
        pairs = (*OVERHEAD_PAIRS, ("matmuls", titan_name))
    else:
        named = {"none", *(name for pair in pairs for name in pair)}
        rows = [(name, make()) for name, make in OVERHEAD_ROWS if name in named]
    runner = RowRunner(bundle, batch, device)  # parity and one metered step each; timed below
    (_, none), *others = rows
    runner.start(none)
    for name, install in others:
        runner.add(RowSpec(name, install))
    parity = {row.name: row.parity_ok for row in runner.rows}
    contenders = [runner.contender(name) for name, _ in rows]

    def run(contender: Contender) -> None:
        for _ in range(steps):
            _step(contender, batch)

    progress(
        f"timing CPU overhead ({model} tiny, {layers} layers, {len(contenders)} rows x {repeats} rounds)"
    )
    timings = interleaved_timing(
        {c.name: (lambda c=c: run(c)) for c in contenders}, repeats=repeats, warmup=3
    )
    per_layer_us = _per_layer_us(timings, [c.name for c in contenders], layers * steps)
    compared = []
    for ours, peer in pairs:
        value = per_layer_us[ours]["median"] / per_layer_us[peer]["median"]
        compared.append({"actplan": ours, "peer": peer, "ratio": value, "met": value <= 1.0})
    return {
        "model": bundle.description,
        "layers": layers,
        "steps_per_sample": steps,
        "rounds": repeats,
        "step_median_s": {name: stats.median for name, stats in timings.items()},
        "overhead_per_layer_us": per_layer_us,
        "pairs": compared,
        "parity_ok": parity,
    }


def _per_layer_us(timings: dict[str, Any], names: list[str], layer_steps: int) -> dict[str, dict[str, float]]:
    """Per row but ``none``: median and quartiles over rounds of its extra µs per layer per step."""
    none = timings["none"].samples
    per_layer_us: dict[str, dict[str, float]] = {}
    for name in names:
        if name == "none":
            continue
        extra = sorted((t - n) / layer_steps * 1e6 for t, n in zip(timings[name].samples, none, strict=True))
        per_layer_us[name] = {
            "median": statistics.median(extra),
            "q25": extra[len(extra) // 4],
            "q75": extra[(3 * len(extra)) // 4],
        }
    return per_layer_us


def _step(contender: Contender, batch: dict[str, torch.Tensor]) -> None:
    train_step(contender.model, batch, contender.optimizer)
