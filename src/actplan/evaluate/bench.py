"""``actplan bench``: every policy on one model, measured side by side in one run.

For each policy the same initial weights and batch run one metered training
step (parity against no checkpointing, activation bytes at the end of forward,
peak bytes), then all policies are timed interleaved (A B C, B C A, ...) after
a warm-up. The rows themselves are built in ``evaluate.contenders``; the report
is ``evaluate.report``. Sits on top of the engine, the models and ``measure``;
carries no acceptance thresholds (the project's goals are in ``bench/goals.py``).
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from actplan._engine.policy import IntervalPolicy
from actplan.config import RecomputeConfig
from actplan.config._presets import OFFLOAD_VARIANTS
from actplan.devices import resolve_device
from actplan.evaluate.contenders import (
    ROOFLINE_GPU,
    Installer,
    PolicyRow,
    config_installer,
    contender_step,
    has_hf_gradient_checkpointing,
    hf_checkpoint_installer,
    torch_checkpoint_installer,
)
from actplan.evaluate.runner import RowRunner, RowSpec
from actplan.markers import checkpoint_record, routing_markers
from actplan.measure import TimingStats, interleaved_timing, ratio
from actplan.models import ModelBundle, build_model, load_model
from actplan.progress import ProgressCallback, ProgressTracker
from actplan.units import MarkerInterval, RecomputeIntervalMap

DEFAULT_POLICIES = ("none", "full", "attn", "matmuls", "megatron-selective", *OFFLOAD_VARIANTS)
TORCH_CHECKPOINT = "torch-checkpoint"
"""Reference row: plain ``torch.utils.checkpoint`` per layer, without actplan."""
HF_CHECKPOINT = "hf-gradient-checkpointing"
"""Reference row of Hugging Face models: their own ``gradient_checkpointing_enable()``."""


@dataclass
class BenchResult:
    model_name: str
    model: str
    device: str
    torch_version: str
    machine: str
    command: str
    started: str
    repeats: int
    warmup: int
    floor_bytes: int | None
    param_bytes: int
    rows: list[PolicyRow]
    overhead_vs_torch_checkpoint: dict[str, float] | None
    marker_cost_ns: dict[str, float]
    size: str = "small"

    def row(self, name: str) -> PolicyRow | None:
        return next((r for r in self.rows if r.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """A result read back from ``to_dict``'s JSON; keys it does not know (a harness's
        additions) are left out."""
        known = {f.name for f in fields(cls)}
        rows = [PolicyRow.from_record(row) for row in data["rows"]]
        return cls(**{k: v for k, v in data.items() if k in known and k != "rows"}, rows=rows)


def _check_expert_parallel(ep: int, model: str, size: str) -> int:
    if model != "moe":
        raise ValueError(f"--ep needs a model with experts; {model!r} has none (use --model moe)")
    if not dist.is_initialized() or dist.get_world_size() != ep:
        raise ValueError(
            f"--ep {ep} runs one rank per expert-parallel shard: launch with "
            f"`torchrun --nproc-per-node {ep} -m actplan bench --model moe --size {size} --ep {ep}`"
        )
    return dist.get_rank()


def _gather_per_rank_memory(rows: list[PolicyRow]) -> None:
    mine = [(row.activation_bytes, row.peak_bytes) for row in rows]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for position, row in enumerate(rows):
        row.per_rank_memory = [tuple(rank_rows[position]) for rank_rows in everyone]


def measure_marker_cost(calls: int = 100_000) -> dict[str, float]:
    """Nanoseconds per ``checkpoint_record`` call outside a checkpointed layer, and
    inside one where the call also advances the region's interval state machine."""
    imap = RecomputeIntervalMap({"attn_core": MarkerInterval("a", "b")})
    policy = IntervalPolicy(imap, (), layer_name="marker-cost")
    out = {}
    for label in ("outside_region", "inside_region"):
        best = float("inf")
        for _ in range(3):
            sink = policy.open_region()[1] if label == "inside_region" else None
            with routing_markers(sink):
                start = time.perf_counter()
                for _ in range(calls // 2):
                    checkpoint_record("a")
                    checkpoint_record("b")
                best = min(best, time.perf_counter() - start)
        out[label] = best / calls * 1e9
    return out


def policy_config(name: str) -> RecomputeConfig:
    if name in OFFLOAD_VARIANTS:
        return RecomputeConfig.from_dict(OFFLOAD_VARIANTS[name], source=f"bench row {name!r}")
    return RecomputeConfig.parse(name)


def bench_entries(
    policies: tuple[str, ...], configs: tuple[str | Path, ...], reference: bool, hf_reference: bool = False
) -> list[tuple[str, Installer]]:
    """The bench's rows in order, named: ``none``, the policies, the config files (named after
    their stem), then the plain ``torch.utils.checkpoint`` reference and, with ``hf_reference``
    (a Hugging Face model), the model's own ``gradient_checkpointing_enable()``. Names must be
    distinct."""
    entries: list[tuple[str, Installer]] = [("none", config_installer(RecomputeConfig.from_preset("none")))]
    entries += [(p, config_installer(policy_config(p))) for p in policies if p != "none"]
    entries += [(Path(c).stem, config_installer(RecomputeConfig.from_file(c))) for c in configs]
    if reference:
        entries.append((TORCH_CHECKPOINT, torch_checkpoint_installer))
    if reference and hf_reference:
        entries.append((HF_CHECKPOINT, hf_checkpoint_installer))
    names = [name for name, _ in entries]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"bench rows must have distinct names, but {', '.join(map(repr, repeated))} appears more than "
            "once (a config file row is named after its file stem); list each policy once and rename "
            "config files that share a name with a policy"
        )
    return entries


def _load_bundle(model: str, size: str, ep: int) -> tuple[ModelBundle, int]:
    """The model (its experts split over the ranks when ``ep > 1``) and this process's rank."""
    if ep > 1:
        rank = _check_expert_parallel(ep, model, size)
        return build_model(model, size, ep_group=dist.group.WORLD), rank
    return load_model(model, size), 0


def _overhead_vs_torch_checkpoint(
    runner: RowRunner, batch: dict[str, torch.Tensor], repeats: int, tracker: ProgressTracker
) -> dict[str, float]:
    """``full`` against the plain reference row: ``repeats`` more paired rounds, pooled with the
    table's rounds, as a median ratio with quartiles."""
    pair = ("full", TORCH_CHECKPOINT)
    contenders = {name: runner.contender(name) for name in pair}
    focused = interleaved_timing(
        {
            name: (lambda c=contender: contender_step(c, batch, seed=2))
            for name, contender in contenders.items()
        },
        repeats=repeats,
        warmup=0,
        progress=lambda label: tracker.step(f"overhead {label}"),
    )
    timings = runner.timings
    pooled = {name: TimingStats.from_samples(timings[name].samples + focused[name].samples) for name in pair}
    rel = ratio(pooled["full"], pooled[TORCH_CHECKPOINT])
    return {
        "median": rel.median,
        "q25": rel.q25,
        "q75": rel.q75,
        "spread": rel.spread,
        "pairs": len(rel.samples),
    }


def run_bench(
    model: str = "dense",
    size: str = "small",
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    configs: tuple[str | Path, ...] = (),
    *,
    repeats: int = 7,
    warmup: int = 2,
    overhead_repeats: int = 12,
    device: str = "auto",
    reference: bool = True,
    ep: int = 1,
    progress: ProgressCallback | None = None,
    command: str | None = None,
    roofline_gpu: str = ROOFLINE_GPU,
) -> BenchResult:
    """Run the bench; ``progress`` receives a ``ProgressEvent`` per unit of work (default: the
    ``actplan`` logger at INFO).

    ``overhead_repeats`` extra rounds time only ``full`` against the plain
    ``torch.utils.checkpoint`` row: the two do identical work, so their ratio
    needs more pairs than the table to rise above the noise of a shared CPU.

    ``ep > 1`` runs under ``torchrun`` with that many ranks (the process group
    initialised by the caller): the model's experts are split over the ranks,
    each rank trains on its own batch, parity is checked rank by rank against
    the expert-parallel ``none`` run, and memory is reported per rank. The plain
    ``torch.utils.checkpoint`` reference row is left out there (it would replay
    the all-to-alls). A Hugging Face model also gets a reference row that switches on
    its own gradient checkpointing (``gradient_checkpointing_enable()``, non-reentrant),
    as the Trainer's ``gradient_checkpointing=True`` does; ``reference=False`` leaves
    both out. Each eager row's metered step is also priced by a roofline clock for
    ``roofline_gpu`` (``measure.ACCELERATORS``): the "est. ratio" beside the measured one.
    """
    dev = resolve_device(device)
    bundle, rank = _load_bundle(model, size, ep)
    batch = bundle.batch(rank, dev)
    reference = reference and ep == 1
    entries = bench_entries(policies, configs, reference, has_hf_gradient_checkpointing(bundle.model))
    measure_overhead = reference and "full" in policies and overhead_repeats > 0
    total = len(entries) * (2 + warmup + repeats) + (2 * overhead_repeats if measure_overhead else 0)
    tracker = ProgressTracker(progress, total=total, prefix="bench: ")
    # The offload rows the bench adds itself may move nothing on a small model (every tensor
    # below the default min_bytes): the engine's warning for that is for users' configs only.
    own_offload_rows = {p for p in policies if p in OFFLOAD_VARIANTS}
    runner = RowRunner(
        bundle,
        batch,
        dev,
        repeats=repeats,
        warmup=warmup,
        roofline_gpu=roofline_gpu,
        progress=lambda x: tracker.step(f"timing {x}"),
    )
    (_, none_install), *others = entries
    runner.start(none_install)
    tracker.step("parity and memory none", units=2)
    for name, install in others:
        runner.add(RowSpec(name, install, quiet_offload=name in own_offload_rows))
        tracker.step(f"parity and memory {name}", units=2)
    rows = runner.finish()
    if ep > 1:
        _gather_per_rank_memory(rows)
    overhead = (
        _overhead_vs_torch_checkpoint(runner, batch, overhead_repeats, tracker) if measure_overhead else None
    )
    return BenchResult(
        model_name=bundle.name,
        model=bundle.description,
        device=str(dev),
        torch_version=torch.__version__,
        machine=machine_summary(),
        command=command or " ".join(["actplan", *sys.argv[1:]]),
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        repeats=repeats,
        warmup=warmup,
        floor_bytes=bundle.activation_floor_bytes(batch),
        param_bytes=runner.contender("none").param_bytes,
        rows=rows,
        overhead_vs_torch_checkpoint=overhead,
        marker_cost_ns=measure_marker_cost(),
        size=size,
    )


def machine_summary() -> str:
    threads = torch.get_num_threads()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{platform.machine()}, {threads} torch threads, python {platform.python_version()}{gpu}"
