"""One preset's step at an estimated shape and layout, as one ``EstimateRow``: through the real
code path on the fake process group (``_rank_step.rank_step``), or, for an expert-parallel
layout that path does not run, the rank's layers stepped bare with the static memory by the
stated formula (``formula_trace``). Everything a step needs travels in a ``PresetJob``, so a
worker process can run it (``_workers``). Imports install, config, measure, models and the
planning package's rank step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from torch import nn

from actplan._install.apply import apply, find_layers, offload_engine
from actplan.config import RecomputeConfig
from actplan.measure import (
    Accelerator,
    AllocatorSettings,
    FakeRun,
    MemoryMeter,
    RooflineClock,
    replay_allocations,
)
from actplan.models import build_model, loss_of
from actplan.models.shape import DTYPES, Shape
from actplan.planning._estimate_plans import default_dtype
from actplan.planning._rank_step import OffloadFigures, formula_trace, install, rank_step
from actplan.planning._training import TrainingSetup

__all__ = ["EstimateRow", "PresetJob", "RankSizes", "preset_row", "preset_step"]


@dataclass
class EstimateRow:
    """One preset's or plan's step at the estimated shape, on one GPU."""

    preset: str
    activation_bytes: int  # alive at the end of forward
    step_peak_bytes: int  # what the step allocates at its peak (activations, transients)
    peak_bytes: int  # step_peak_bytes plus the static memory: what tensors request
    flops: int
    seconds: float  # roofline estimate of forward and backward
    ratio_to_none: float | None = None
    # The caching-allocator model's replay of the same trace: blocks handed out (rounded) and
    # segments reserved at their peaks, and what the device holds outside the allocator.
    allocated_peak_bytes: int = 0
    reserved_peak_bytes: int = 0
    outside_allocator_bytes: int = 0
    fits: bool | None = None  # reserved + outside_allocator_bytes within the budget or the GPU
    # Plans only: the budget asked for, the planner's predictions and the plan itself.
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_ratio: float | None = None
    plan_yaml: str | None = None
    # Rows that offload: the host tier and the copies of the step (``seconds`` includes the
    # copy time its compute waits for).
    moved: OffloadFigures | None = None
    exposed_comm_seconds: float = 0.0  # of ``seconds``, communication the compute waits for
    collective_bytes: dict[str, int] = field(default_factory=dict)
    # Estimates from ``seconds``: tokens one GPU trains per second, and model FLOPs utilisation
    # (``none``'s FLOPs, no recompute, over the step time at the GPU's peak).
    tokens_per_s: float | None = None
    mfu: float | None = None


def _drop_grads_when_complete(model: nn.Module) -> None:
    # As FSDP's reduce-scatter frees the unsharded gradient once it is complete.
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


@dataclass(frozen=True)
class RankSizes:
    parameters: int  # on this rank
    expert_parameters: int  # of those, the routed experts'
    largest_unit: int  # parameters of the largest gathered unit
    tensors: tuple[tuple[int, bool], ...] = ()  # each parameter's (numel, is a routed expert's)


def _sizes(model: nn.Module) -> RankSizes:
    units = [layer for _, layer in find_layers(model)]
    units += [m for m in model.modules() if isinstance(m, nn.Embedding)]
    units += [m for name, m in model.named_modules() if name.endswith(("output", "lm_head"))]
    tensors = tuple((p.numel(), ".experts." in n) for n, p in model.named_parameters())
    return RankSizes(
        parameters=sum(numel for numel, _ in tensors),
        expert_parameters=sum(numel for numel, expert in tensors if expert),
        largest_unit=max(sum(p.numel() for p in unit.parameters()) for unit in units),
        tensors=tensors,
    )


def _traced_step(
    shape: Shape, preset: str | RecomputeConfig, gpu: str | Accelerator, fake: bool = True
) -> tuple[EstimateRow, RankSizes, list[tuple[int, int, int, int]]]:
    """``preset_step``, with the step's allocation trace."""
    run = FakeRun() if fake else contextlib.nullcontext()
    with default_dtype(DTYPES[shape.dtype]), run:
        bundle = build_model(shape.model, "small", **shape.model_overrides())
        model = bundle.model
        config = install(model, preset)
        if config != "none":
            apply(model, config)
        _drop_grads_when_complete(model)
        sizes = _sizes(model)
        batch = bundle.batch(0, FakeRun.device)
        clock = RooflineClock(gpu)
        engine = offload_engine(model)
        if engine is not None:
            engine.time_copies(clock.copy_timer())
        meter = MemoryMeter(model, trace_allocations=True)
        with meter, clock:
            loss = loss_of(model(**batch))
            forward_end = meter.mark("forward_end").activation_bytes
            loss.backward()
        report = meter.report()
        moved = None if engine is None else OffloadFigures.of(engine, clock)
    row = EstimateRow(
        preset=preset if isinstance(preset, str) else "plan",
        activation_bytes=forward_end,
        step_peak_bytes=report.peak_live_bytes,
        peak_bytes=0,
        flops=clock.flops,
        seconds=clock.seconds,  # the copies the compute waits for included
        moved=moved,
    )
    return row, sizes, meter.allocation_trace()


def preset_step(
    shape: Shape, preset: str | RecomputeConfig, gpu: str | Accelerator, fake: bool = True
) -> tuple[EstimateRow, RankSizes]:
    """One preset's (or config's, or baseline's) metered, clocked step of ``shape``'s bare
    layer stack; with ``fake=False`` the same step on real tensors (the tests compare the
    two). Returns the row and the rank's sizes."""
    row, sizes, _ = _traced_step(shape, preset, gpu, fake)
    return row, sizes


@dataclass(frozen=True)
class PresetJob:
    """What every preset's step of one estimate shares (sent to a worker process as it is)."""

    shape: Shape
    rank_shape: Shape  # one rank's layers (the formula path steps these bare)
    measured: bool  # through parallelize on the fake process group, or bare layers and formula
    fsdp: int
    tp: int
    ep: int
    gpu: str | Accelerator  # an Accelerator with its node size set (--gpus-per-node)
    settings: AllocatorSettings
    training: TrainingSetup
    outside: int  # bytes held outside the allocator


def preset_row(job: PresetJob, preset: str | RecomputeConfig) -> tuple[EstimateRow, RankSizes, int, int]:
    """One preset's (or config's) row, with the rank's sizes, static and gathered bytes."""
    name = preset if isinstance(preset, str) else "plan"
    if job.measured:
        ran = rank_step(
            job.shape, preset, job.fsdp, job.gpu, job.settings, tp=job.tp, training=job.training, ep=job.ep
        )
        row = EstimateRow(
            preset=name,
            activation_bytes=ran.activation_bytes,
            step_peak_bytes=ran.step_peak_bytes,
            peak_bytes=ran.peak_bytes,
            flops=ran.flops,
            seconds=ran.seconds,
            moved=ran.moved,
            exposed_comm_seconds=ran.exposed_comm_seconds,
            collective_bytes=ran.collective_bytes,
        )
        report, sizes, static, gathered = (
            ran.allocator,
            RankSizes(ran.parameters, 0, 0),
            ran.resident_bytes,
            0,
        )
    else:
        row, sizes, events = _traced_step(job.rank_shape, preset, job.gpu)
        itemsize = DTYPES[job.shape.dtype].itemsize
        static, gathered, tensors = _formula(sizes, job.fsdp, job.ep, itemsize, job.tp)
        row.peak_bytes = static + gathered + row.step_peak_bytes
        report = replay_allocations(
            formula_trace(tensors, sizes.largest_unit * itemsize, events), job.settings
        )
    row.allocated_peak_bytes = report.peak_allocated_bytes
    row.reserved_peak_bytes = report.peak_reserved_bytes
    row.outside_allocator_bytes = job.outside
    return row, sizes, static, gathered


def _formula(
    sizes: RankSizes, fsdp: int, ep: int, itemsize: int, tp: int = 1
) -> tuple[int, int, list[tuple[int, int]]]:
    """The stated formula's static and gathered bytes, and the tensors it stands for as
    ``(numel, shards)``: the rank's non-expert parameters (its TP share) over ``fsdp`` ranks,
    its experts (whole, ``experts/ep`` of them) over the ``fsdp x tp / ep`` ranks that hold
    the same ones."""
    dense_params = sizes.parameters - sizes.expert_parameters
    holders = fsdp * tp // ep
    static = 16 * dense_params // fsdp + 16 * sizes.expert_parameters // holders
    tensors = [(numel, holders if expert else fsdp) for numel, expert in sizes.tensors]
    return static, 2 * sizes.largest_unit * itemsize, tensors
