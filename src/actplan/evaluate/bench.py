"""``actplan bench``: every policy on one model, measured side by side in one run.

For each policy the same initial weights and batch run one metered training
step (parity against no checkpointing, activation bytes at the end of forward,
peak bytes), then all policies are timed interleaved (A B C, B C A, ...) after
a warm-up. Sits on top of the engine, the models and ``measure``.
"""

from __future__ import annotations

import copy
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from actplan._engine.offload import quiet_empty_offload
from actplan._engine.policy import IntervalPolicy
from actplan._install.apply import apply, find_layers, held_by_unit, offload_engine
from actplan.config import RecomputeConfig
from actplan.markers import checkpoint_record, routing_markers
from actplan.measure import (
    GradCensus,
    MemoryMeter,
    StepCapture,
    TimingStats,
    capture_step,
    compare_steps,
    interleaved_timing,
    ratio,
)
from actplan.models import ModelBundle, build_model, load_model, train_step
from actplan.progress import ProgressCallback, ProgressTracker
from actplan.units import MarkerInterval, RecomputeIntervalMap

OFFLOAD_VARIANTS: dict[str, dict[str, Any]] = {
    "full+offload": {"preset": "full", "offload": {"layer_input": True}},
    "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept"}},
}
"""Bench rows that add offload to a preset: the layer inputs of ``full``, the kept units of
``matmuls`` (every layer but the last, tensors of at least the default ``min_bytes``)."""

GOAL_SIZE = "small"
"""The model size the performance goals (``evaluate_goals``) are set for; other sizes get none."""

"""The offload engine's warning for a layer with nothing above ``min_bytes``: expected, not
news, for the bench's own offload rows on a small model."""

DEFAULT_POLICIES = ("none", "full", "attn", "matmuls", "megatron-selective", *OFFLOAD_VARIANTS)
TORCH_CHECKPOINT = "torch-checkpoint"
"""Reference row: plain ``torch.utils.checkpoint`` per layer, without actplan."""


@dataclass
class PolicyRow:
    name: str
    description: str
    loss: float
    loss_identical: bool
    max_abs_grad_diff: float
    census_match: bool
    parity_ok: bool
    activation_bytes: int
    peak_bytes: int
    cuda_max_allocated_bytes: int | None
    step_median_s: float
    step_q25_s: float
    step_q75_s: float
    ratio_to_none: float
    ratio_spread: float
    # Expert-parallel runs: every rank's (activation bytes, peak bytes), rank order.
    per_rank_memory: list[tuple[int, int]] | None = None
    # Offloading rows, over the metered step: host-tier peak and bytes moved each way.
    host_peak_bytes: int | None = None
    offloaded_bytes: int | None = None
    reloaded_bytes: int | None = None
    # Selective rows: per kept unit, {"held": bytes, "autograd": bytes} (see ``held_by_unit``).
    held_by_unit: dict[str, dict[str, int]] | None = None
    # Compiled rows: the largest gradient difference parity allowed (0: bit-identical).
    grad_atol: float = 0.0


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
    goals: list[dict[str, Any]] = field(default_factory=list)
    size: str = GOAL_SIZE

    def row(self, name: str) -> PolicyRow | None:
        return next((r for r in self.rows if r.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_expert_parallel(ep: int, model: str) -> int:
    if model != "moe":
        raise ValueError(f"--ep needs a model with experts; {model!r} has none (use --model moe)")
    if not dist.is_initialized() or dist.get_world_size() != ep:
        raise ValueError(
            f"--ep {ep} runs one rank per expert-parallel shard: launch with "
            f"`torchrun --nproc-per-node {ep} -m actplan bench --model moe --ep {ep}`"
        )
    return dist.get_rank()


def _gather_per_rank_memory(rows: list[PolicyRow]) -> None:
    mine = [(row.activation_bytes, row.peak_bytes) for row in rows]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for position, row in enumerate(rows):
        row.per_rank_memory = [tuple(rank_rows[position]) for rank_rows in everyone]


def checkpoint_every_layer(model: nn.Module, **checkpoint_kwargs: Any) -> None:
    """Wrap every layer in non-reentrant ``torch.utils.checkpoint``, without actplan.

    With no keyword arguments this is what most trainers do; ``checkpoint_kwargs`` (a
    ``context_fn``, ``preserve_rng_state``) make the op-level variants the peers bench uses.
    """
    for _, layer in find_layers(model):
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **checkpoint_kwargs, **kwargs)

        layer.forward = wrapped


Installer = Callable[[nn.Module], str]
"""Installs one way of checkpointing on a fresh copy of the model and describes it."""


def config_installer(config: RecomputeConfig) -> Installer:
    """The installer of an actplan config: ``apply``, described by the plan's summary."""
    return lambda model: apply(model, config).summary()


def torch_checkpoint_installer(model: nn.Module) -> str:
    checkpoint_every_layer(model)
    return "torch.utils.checkpoint(use_reentrant=False) per layer, no actplan"


@dataclass
class Contender:
    """One bench row: its own copy of the model and optimizer, and what one metered step saw."""

    name: str
    description: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    capture: StepCapture | None = None
    activation_bytes: int = 0
    peak_bytes: int = 0
    cuda_max_allocated_bytes: int | None = None
    param_bytes: int = 0
    # Offloading rows: host-tier peak, bytes moved out and back over the metered step.
    moved: tuple[int, int, int] | None = None
    # Selective rows: per kept unit, bytes held at the end of the metered forward against what
    # autograd keeps for the same ops without checkpointing (``actplan.held_by_unit``).
    held_by_unit: dict[str, dict[str, int]] | None = None
    # Parity tolerances against ``none``: 0 (bit-identical) unless the row is compiled, where
    # the caller sets them from the compile noise floor it measured.
    grad_atol: float = 0.0
    loss_atol: float = 0.0
    # The bench's own offload rows: their "moved nothing" warning is silenced (see run_bench).
    quiet_offload: bool = False


def prepare_contender(
    bundle: ModelBundle,
    name: str,
    install: Installer,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    *,
    compiled: bool = False,
    quiet_offload: bool = False,
) -> Contender:
    """Copy the model, install ``install`` on it, run the parity step and one metered step.

    ``compiled``: the installer compiled the model with ``backend="aot_eager"``. The metered
    step then runs the compiled graphs (``MemoryMeter(run_compiled=True)``); without it the
    meter would measure, and leave behind, the eager code instead.

    ``quiet_offload``: silence the offload engine's "moved nothing" warning for this row (a
    row the bench chose itself, not one the user configured).
    """
    model = copy.deepcopy(bundle.model).to(device)
    description = install(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    contender = Contender(name, description, model, optimizer, quiet_offload=quiet_offload)
    # Step 0 builds the optimizer state (and compiles), so step 1 is metered with it resident.
    contender.capture = _train_step(contender, batch, seed=0, capture=True)
    engine = offload_engine(model)
    if engine is not None:
        engine.reset_stats()
    with MemoryMeter(model, optimizer, run_compiled=compiled) as meter:
        _train_step(contender, batch, seed=1, meter=meter)
    report = meter.report()
    if engine is not None:
        stats = engine.snapshot()
        contender.moved = (stats.host_peak_bytes, stats.bytes_offloaded, stats.bytes_reloaded)
    contender.held_by_unit = held_by_unit(model) or None
    contender.activation_bytes = report.marks["forward_end"].activation_bytes
    contender.peak_bytes = report.peak_bytes
    contender.cuda_max_allocated_bytes = report.cuda_max_allocated_bytes
    contender.param_bytes = report.param_bytes
    return contender


def time_contenders(
    contenders: list[Contender],
    batch: dict[str, torch.Tensor],
    *,
    repeats: int,
    warmup: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, TimingStats]:
    """Training-step times of every contender, interleaved (see ``interleaved_timing``)."""
    return interleaved_timing(
        {c.name: (lambda c=c: _train_step(c, batch, seed=2)) for c in contenders},
        repeats=repeats,
        warmup=warmup,
        progress=progress,
    )


def policy_rows(contenders: list[Contender], timings: dict[str, TimingStats]) -> list[PolicyRow]:
    """One row per contender: parity against the row named ``none``, memory, time ratio."""
    baseline = next(c for c in contenders if c.name == "none").capture
    rows = []
    for contender in contenders:
        parity = compare_steps(
            baseline, contender.capture, grad_atol=contender.grad_atol, loss_atol=contender.loss_atol
        )
        stats = timings[contender.name]
        rel = ratio(stats, timings["none"])
        host_peak, offloaded, reloaded = contender.moved or (None, None, None)
        rows.append(
            PolicyRow(
                name=contender.name,
                description=contender.description,
                loss=float(contender.capture.loss),
                loss_identical=parity.loss_identical,
                max_abs_grad_diff=parity.max_abs_grad_diff,
                census_match=parity.census_match,
                parity_ok=parity.ok,
                activation_bytes=contender.activation_bytes,
                peak_bytes=contender.peak_bytes,
                cuda_max_allocated_bytes=contender.cuda_max_allocated_bytes,
                step_median_s=stats.median,
                step_q25_s=stats.q25,
                step_q75_s=stats.q75,
                ratio_to_none=rel.median,
                ratio_spread=rel.spread,
                host_peak_bytes=host_peak,
                offloaded_bytes=offloaded,
                reloaded_bytes=reloaded,
                held_by_unit=contender.held_by_unit,
                grad_atol=contender.grad_atol,
            )
        )
    return rows


def _train_step(
    contender: Contender,
    batch: dict[str, torch.Tensor],
    seed: int,
    *,
    meter: MemoryMeter | None = None,
    capture: bool = False,
) -> StepCapture | None:
    if contender.quiet_offload:
        with quiet_empty_offload():
            return _plain_train_step(contender, batch, seed, meter=meter, capture=capture)
    return _plain_train_step(contender, batch, seed, meter=meter, capture=capture)


def _plain_train_step(
    contender: Contender,
    batch: dict[str, torch.Tensor],
    seed: int,
    *,
    meter: MemoryMeter | None,
    capture: bool,
) -> StepCapture | None:
    captured = []
    train_step(
        contender.model,
        batch,
        contender.optimizer,
        seed=seed,
        after_forward=(lambda _: meter.mark("forward_end")) if meter is not None else None,
        after_backward=(
            (lambda loss: captured.append(_without_wrapper_prefix(capture_step(contender.model, loss))))
            if capture
            else None
        ),
    )
    return captured[0] if captured else None


_WRAPPER_PREFIX = "_checkpoint_wrapped_module."
"""What ``torch.distributed``'s ``checkpoint_wrapper`` (torchtitan's AC) inserts into parameter
names; its own state_dict hooks strip it the same way."""


def _without_wrapper_prefix(capture: StepCapture) -> StepCapture:
    """The capture with parameter names as the unwrapped model has them, so that a row whose
    layers are wrapper modules compares parameter by parameter with ``none``."""
    if not any(_WRAPPER_PREFIX in name for name in capture.grads):
        return capture

    def unwrapped(names):
        return frozenset(name.replace(_WRAPPER_PREFIX, "") for name in names)

    grads = {name.replace(_WRAPPER_PREFIX, ""): grad for name, grad in capture.grads.items()}
    census = capture.census
    census = GradCensus(unwrapped(census.nonzero), unwrapped(census.zero), unwrapped(census.none))
    return replace(capture, grads=grads, census=census)


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


DEVICE_CHOICES = "auto, cpu, cuda or cuda:<index>"


def _device(name: str) -> torch.device:
    """``--device``: ``auto`` (CUDA when there is one), ``cpu``, ``cuda`` or ``cuda:<index>``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; valid choices: {DEVICE_CHOICES}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            )
            raise ValueError(
                f"device {name!r} is not available: {why} (torch {torch.__version__}); "
                "use --device cpu, or auto (CUDA when there is one)"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r} is not available: {torch.cuda.device_count()} CUDA device(s) visible "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
    return device


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
    the all-to-alls).
    """
    dev = _device(device)
    rank = 0
    if ep > 1:
        rank = _check_expert_parallel(ep, model)
        bundle = build_model(model, size, ep_group=dist.group.WORLD)
        reference = False
    else:
        bundle = load_model(model, size)
    batch = bundle.batch(rank, dev)
    entries: list[tuple[str, Installer]] = [("none", config_installer(RecomputeConfig.from_preset("none")))]
    entries += [(p, config_installer(policy_config(p))) for p in policies if p != "none"]
    entries += [(Path(c).stem, config_installer(RecomputeConfig.from_file(c))) for c in configs]
    if reference:
        entries.append((TORCH_CHECKPOINT, torch_checkpoint_installer))
    names = [name for name, _ in entries]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"bench rows must have distinct names, but {', '.join(map(repr, repeated))} appears more than "
            "once (a config file row is named after its file stem); list each policy once and rename "
            "config files that share a name with a policy"
        )
    measure_overhead = reference and "full" in policies and overhead_repeats > 0
    total = len(entries) * (2 + warmup + repeats) + (2 * overhead_repeats if measure_overhead else 0)
    tracker = ProgressTracker(progress, total=total, prefix="bench: ")

    # The offload rows the bench adds itself may move nothing on a small model (every tensor
    # below the default min_bytes): the engine's warning for that is for users' configs only.
    own_offload_rows = {p for p in policies if p in OFFLOAD_VARIANTS}
    contenders = []
    for name, install in entries:
        contenders.append(
            prepare_contender(bundle, name, install, batch, dev, quiet_offload=name in own_offload_rows)
        )
        tracker.step(f"parity and memory {name}", units=2)
    timings = time_contenders(
        contenders,
        batch,
        repeats=repeats,
        warmup=warmup,
        progress=lambda label: tracker.step(f"timing {label}"),
    )
    rows = policy_rows(contenders, timings)
    if ep > 1:
        _gather_per_rank_memory(rows)
    overhead = None
    if measure_overhead:
        by_name = {c.name: c for c in contenders}
        focused = interleaved_timing(
            {
                name: (lambda c=by_name[name]: _train_step(c, batch, seed=2))
                for name in ("full", TORCH_CHECKPOINT)
            },
            repeats=overhead_repeats,
            warmup=0,
            progress=lambda label: tracker.step(f"overhead {label}"),
        )
        pooled = {
            name: TimingStats.from_samples(timings[name].samples + focused[name].samples)
            for name in ("full", TORCH_CHECKPOINT)
        }
        rel = ratio(pooled["full"], pooled[TORCH_CHECKPOINT])
        overhead = {
            "median": rel.median,
            "q25": rel.q25,
            "q75": rel.q75,
            "spread": rel.spread,
            "pairs": len(rel.samples),
        }
    result = BenchResult(
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
        param_bytes=contenders[0].param_bytes,
        rows=rows,
        overhead_vs_torch_checkpoint=overhead,
        marker_cost_ns=measure_marker_cost(),
        size=size,
    )
    result.goals = evaluate_goals(result)
    return result


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


def machine_summary() -> str:
    threads = torch.get_num_threads()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{platform.machine()}, {threads} torch threads, python {platform.python_version()}{gpu}"


def evaluate_goals(result: BenchResult) -> list[dict[str, Any]]:
    """The core engine's performance goals (set on the dense model at ``GOAL_SIZE``), with
    figures and verdicts; none for another model or size, where they do not apply."""
    goals = []
    if result.model_name != "dense" or result.size != GOAL_SIZE:
        return goals
    none, full, matmuls = result.row("none"), result.row("full"), result.row("matmuls")
    if full and result.floor_bytes:
        value = full.activation_bytes / result.floor_bytes
        goals.append(
            {"goal": "full: activation bytes / analytic floor <= 1.10", "value": value, "met": value <= 1.10}
        )
    if none and matmuls:
        cut = 1 - matmuls.activation_bytes / none.activation_bytes
        goals.append(
            {"goal": "matmuls: activation bytes at least 35% below none", "value": cut, "met": cut >= 0.35}
        )
        goals.append(
            {
                "goal": "matmuls: step time <= 1.10x none",
                "value": matmuls.ratio_to_none,
                "met": matmuls.ratio_to_none <= 1.10,
            }
        )
    if result.overhead_vs_torch_checkpoint:
        value = result.overhead_vs_torch_checkpoint["median"]
        pairs = result.overhead_vs_torch_checkpoint["pairs"]
        goals.append(
            {
                "goal": f"full via actplan / plain torch.utils.checkpoint <= 1.03 ({pairs} paired steps)",
                "value": value,
                "met": value <= 1.03,
            }
        )
    return goals


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def to_markdown(result: BenchResult) -> str:
    """The result as a markdown report: context, the table, goals, marker cost."""
    lines = [
        f"# actplan bench: {result.model}",
        "",
        f"- command: `{result.command}`",
        f"- device: {result.device}; torch {result.torch_version}; {result.machine}",
        f"- started: {result.started}; timing: {result.warmup} warm-up + {result.repeats} interleaved "
        "rounds, median and interquartile spread",
        f"- parameters: {mib(result.param_bytes)} MiB; analytic activation floor: "
        f"{mib(result.floor_bytes)} MiB",
        "",
        "| policy | loss identical | max abs dgrad | grad census | activations @ fwd end (MiB) "
        "| vs none | peak (MiB) | step median (s) | ratio to none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    none = result.row("none")
    for r in result.rows:
        rel = r.activation_bytes / none.activation_bytes if none else float("nan")
        lines.append(
            f"| {r.name} | {'yes' if r.loss_identical else 'NO'} | {r.max_abs_grad_diff:.1e} | "
            f"{'match' if r.census_match else 'MISMATCH'} | {mib(r.activation_bytes)} | {rel:.2f} | "
            f"{mib(r.peak_bytes)} | {r.step_median_s:.3f} | {r.ratio_to_none:.3f} ± {r.ratio_spread:.3f} |"
        )
    offloading = [r for r in result.rows if r.offloaded_bytes is not None]
    if offloading:
        lines += [
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
    lines += held_markdown(result.rows)
    if any(r.per_rank_memory for r in result.rows):
        lines += ["", "## Per-rank memory (activations @ fwd end / peak, MiB)", ""]
        for r in result.rows:
            per_rank = ", ".join(
                f"rank {i}: {mib(a)} / {mib(p)}" for i, (a, p) in enumerate(r.per_rank_memory)
            )
            lines.append(f"- {r.name}: {per_rank}")
    if result.goals:
        lines += ["", "## Goals", ""]
    for g in result.goals:
        lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']} (measured {g['value']:.3f})")
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
    return "\n".join(lines)
