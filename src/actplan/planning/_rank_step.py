"""One rank's steady training step at a real shape, as ``actplan estimate`` measures it, and
what the CUDA caching allocator would reserve for it.

``step_on_mesh`` runs the code a user trains with: the reference model built at the shape on
fake tensors, sharded by ``actplan.parallelize`` (FSDP2 with bf16 parameters and fp32
reductions, as torchtitan trains) over torch's ``fake`` process group at the layout's world
size, and stepped twice with a real optimizer (``torch.optim.AdamW`` unless the
``TrainingSetup`` names another; ``foreach``, its temporaries included), over as many
micro-batches per step as the setup accumulates, with the parameters it freezes frozen.
Everything one rank allocates is then measured, not taken from a formula: its shard of the
fp32 parameters, gradients and optimizer state, FSDP2's all-gather outputs (the prefetched
layer's included) and unsharded parameters, the unsharded gradients and their fp32
reduce-scatter inputs, the activations and every transient. The memory meter's allocation
trace (every allocation and free in order) is replayed through the caching-allocator model
(``measure.replay_allocations``), under the user's allocator settings.

Each allocation is replayed in the pool of the stream it was made on (FSDP2's all-gather and
reduce-scatter streams keep pools of their own, as on a GPU), and the meter sees inside DTensor
ops: a loss-parallel cross-entropy's temporaries and a redistribution's buffers count, while the
global-shape tensors DTensor propagates shapes with do not.

Under expert parallelism (``expert_layout_refusal`` says which layouts run) tokens travel by
all-to-all, as many as the routing assumption gives (``FakeRun``'s: balanced, or recorded).

What stays a stated assumption: the fake process group's collectives return at once, so a
buffer a collective still reads on another stream is freed when the program frees it (torch's
``record_stream`` would hold it to the collective's end).
Imports torch, ``actplan._install``, ``measure``, ``models`` and ``_torch_internals``.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from actplan._install.apply import offload_engine
from actplan._install.baselines import baseline
from actplan._install.parallel import expert_parallel_mesh, parallelize
from actplan._torch_internals import fake_process_group_store
from actplan.config import RecomputeConfig
from actplan.config._presets import OFFLOAD_VARIANTS
from actplan.measure import (
    Accelerator,
    AllocatorReport,
    AllocatorSettings,
    FakeRun,
    MemoryMeter,
    RooflineClock,
    replay_allocations,
)
from actplan.models import build_for_shape, loss_of
from actplan.models.shape import DTYPES, Shape
from actplan.planning._reserved import resident_events
from actplan.planning._training import DEFAULT_TRAINING, TrainingSetup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Routing = Literal["balanced"] | Sequence[Sequence[int]]

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "OffloadFigures",
    "RankStep",
    "check_expert_layout",
    "expert_group",
    "expert_layout_refusal",
    "fake_world",
    "formula_trace",
    "install",
    "layout_mesh",
    "loss_parallel_plan",
    "nccl_bytes",
    "rank_step",
    "splits_sequence",
    "step_on_mesh",
]

STEPS = 2  # the first step allocates the optimizer's state; the second is the steady one
MIB = 1 << 20
CUDA_CONTEXT_BYTES = 500 * MIB
"""Device memory the CUDA context holds outside torch's allocator (driver state and the
kernels loaded so far). With lazy module loading (CUDA 11.7 and later) a PyTorch process's
context is about 300 MB on a V100-class GPU (pytorch/pytorch#107667, a maintainer's
answer), and grows with the SM count: 555 MiB measured on a 188-SM Blackwell GPU
(ggml-org/llama.cpp#23604). 500 MiB stands for an H100/H200 (132 SMs) with cuBLAS, cuDNN
and NCCL's kernels loaded."""
NCCL_BUFFER_BYTES = 4 * MIB
"""``NCCL_BUFFSIZE``'s default: NCCL's staging buffer per channel, peer and direction
(NCCL user guide, environment variables)."""
NCCL_CHANNELS = 16
"""Channels NCCL opens per communicator: it picks them from the topology (up to 32); 16 is
assumed here, and ``NCCL_MAX_NCHANNELS`` bounds it on a real run."""


def nccl_bytes(groups: int) -> int:
    """NCCL's buffers outside torch's allocator for ``groups`` communicators (one per parallel
    dimension of more than one rank): two ring neighbours, both directions, per channel."""
    return groups * 2 * 2 * NCCL_CHANNELS * NCCL_BUFFER_BYTES


@dataclass(frozen=True)
class RankStep:
    """What one rank holds in a steady training step (the second), measured on fake tensors."""

    resident_bytes: int  # alive between steps: parameter shards, optimizer state (and what stays)
    activation_bytes: int  # alive at the end of the (last micro-batch's) forward, above its start
    step_peak_bytes: int  # the steady step's peak above ``resident_bytes``
    peak_bytes: int  # bytes requested at the peak of the run (what tensors hold)
    allocator: AllocatorReport  # the caching allocator's peaks for the same trace
    parameters: int  # this rank's model, before sharding
    flops: int
    seconds: float  # the steady step on the roofline clock, with the communication it waits for
    exposed_comm_seconds: float = 0.0  # of which the compute waits for communication
    collective_bytes: dict[str, int] = field(default_factory=dict)  # by kind, as this rank counts them
    moved: OffloadFigures | None = None  # the steady step's offload, when the plan offloads


@dataclass(frozen=True)
class OffloadFigures:
    """What offload moved in one step and what its host tier holds, with the copy time the
    step's compute waits for (on the roofline clock's copy streams, at the host link)."""

    host_bytes: int  # host-tier (pinned) bytes this rank holds: the pool's reserve, or its peak use
    offloaded_bytes: int
    reloaded_bytes: int
    exposed_seconds: float

    @classmethod
    def of(cls, engine, clock: RooflineClock) -> OffloadFigures:
        """``engine``'s figures since its counters were last reset, timed by ``clock``."""
        stats = engine.snapshot()
        host = max(stats.host_reserved_bytes, stats.host_peak_bytes)
        return cls(host, stats.bytes_offloaded, stats.bytes_reloaded, clock.exposed_copies_seconds)


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """torch's ``fake`` process group as the default group of ``world_size`` ranks, this
    process rank 0: collectives return at once with outputs of the right shapes. Refused when
    the process already has a default group (the estimate must not take over a real run's)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already has a torch.distributed process group; run the estimate in a "
            "process of its own (the command line does), not inside a training job"
        )
    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _peak_after(events: list[tuple[int, int, int, int]], start: int, live: int) -> int:
    """Requested bytes at their peak from event ``start`` on, ``live`` being alive there."""
    sizes: dict[int, int] = {}
    for op, ident, nbytes, _ in events[:start]:
        if op:
            sizes[ident] = nbytes
        else:
            sizes.pop(ident, None)
    peak = live
    for op, ident, nbytes, _ in events[start:]:
        if op:
            sizes[ident] = nbytes
            live += nbytes
        else:
            live -= sizes.pop(ident, 0)
        peak = max(peak, live)
    return peak


def install(model: torch.nn.Module, preset: str | RecomputeConfig) -> RecomputeConfig | str:
    """Installs a baseline (``BASELINES``: what users run today) itself and returns ``"none"``
    for actplan to install on top of it; returns the config of a named offload variant
    (``OFFLOAD_VARIANTS``), and anything else unchanged, for actplan."""
    if isinstance(preset, str) and preset in OFFLOAD_VARIANTS:
        return RecomputeConfig.from_dict(OFFLOAD_VARIANTS[preset], source=f"preset {preset!r}")
    installer = baseline(preset) if isinstance(preset, str) else None
    if installer is not None:
        installer(model)
        return "none"
    return preset


def rank_step(
    shape: Shape,
    preset: str | RecomputeConfig,
    fsdp: int,
    gpu: str | Accelerator,
    settings: AllocatorSettings | None = None,
    fake: bool = True,
    tp: int = 1,
    training: TrainingSetup = DEFAULT_TRAINING,
    ep: int = 1,
    routing: Routing = "balanced",
) -> RankStep:
    """Rank 0 of FSDP over ``fsdp`` ranks, times tensor parallelism (with sequence
    parallelism) over ``tp``, with experts over ``ep`` ranks (a divisor of ``fsdp`` x ``tp``:
    what ``parallelize`` runs), on torch's fake process group:
    ``step_on_mesh`` there. ``fake=False`` runs the same on real tensors (the tests compare them)."""
    training.check()  # before the process group starts
    check_expert_layout(shape, fsdp, tp, ep)
    with fake_world(fsdp * tp):
        mesh = layout_mesh(fsdp, tp)
        return step_on_mesh(shape, preset, mesh, gpu, settings, fake, training, ep, routing)


def expert_layout_refusal(shape: Shape, fsdp: int, tp: int, ep: int) -> str | None:
    """Why the real code path cannot run an expert-parallel layout, or ``None`` when it can."""
    if ep == 1:
        return None
    if (fsdp * tp) % ep:
        return (
            f"actplan.parallelize splits experts over a divisor of the ranks: --ep {ep} does not "
            f"divide --fsdp {fsdp}" + (f" x --tp {tp}" if tp > 1 else "")
        )
    if shape.model != "moe" or shape.hf_config is not None or shape.titan is not None:
        return f"expert parallelism runs on the MoE reference model; {shape.name} is not one"
    if shape.experts % ep:
        return f"--ep {ep} must divide experts ({shape.experts}); choose a divisor"
    if tp > 1 and shape.mla:
        return "the reference model's tensor parallelism does not split multi-head latent attention"
    return None


def check_expert_layout(shape: Shape, fsdp: int, tp: int, ep: int) -> None:
    """Refuses an expert-parallel layout the real code path cannot run, naming why."""
    if (refusal := expert_layout_refusal(shape, fsdp, tp, ep)) is not None:
        raise ValueError(refusal)


def layout_mesh(fsdp: int, tp: int) -> DeviceMesh:
    """The device mesh ``parallelize`` takes for the layout, over the default process group:
    1-D for FSDP alone, ``("dp", "tp")`` with tensor parallelism. Made outside any fake mode:
    the mesh computes its coordinates from real values."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        return init_device_mesh(FakeRun.device.type, (fsdp,))
    return init_device_mesh(FakeRun.device.type, (fsdp, tp), mesh_dim_names=("dp", "tp"))


def expert_group(mesh: DeviceMesh, ep: int) -> Any:
    """This rank's expert-parallel group of ``ep`` of ``mesh``'s ranks, as
    ``parallelize`` expects it: consecutive blocks of ranks."""
    return expert_parallel_mesh(mesh, ep)["ep"].get_group()


def step_on_mesh(
    shape: Shape,
    preset: str | RecomputeConfig,
    mesh: DeviceMesh,
    gpu: str | Accelerator,
    settings: AllocatorSettings | None = None,
    fake: bool = True,
    training: TrainingSetup = DEFAULT_TRAINING,
    ep: int = 1,
    routing: Routing = "balanced",
) -> RankStep:
    """This rank of ``mesh`` training ``shape`` (the whole model: the layout shards it) under
    ``preset`` (an actplan preset or config, or one of ``BASELINES``): see the module doc. Runs
    on fake tensors, or with ``fake=False`` on real ones (the CPU's; the tests run it so on a
    real gloo group, too). ``training`` is the optimizer, its implementation, the micro-batches
    per step and the frozen parameters (``TrainingSetup``): AdamW's ``foreach``, torch's default
    for CUDA tensors, allocates temporaries the size of the parameter shards at the step;
    ``fused`` (torchtitan's default since February 2025) none. ``ep`` above one splits a MoE
    model's experts over that many of the mesh's ranks (``expert_group``), its token
    counts following ``routing`` on fake tensors (``FakeRun``'s routing); with tensor parallelism
    too, each rank routes its own sequence shard."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    training.check()
    names = mesh.mesh_dim_names or ()
    tp = mesh["tp"].size() if "tp" in names else 1
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[shape.dtype], reduce_dtype=torch.float32)
    device = FakeRun.device.type
    # The reference model trains its head loss parallel under TP, as torchtitan does; a
    # transformers class keeps the plan actplan.parallelize gives it (logits gathered), since
    # its own loss is not written for sharded logits.
    loss_parallel = tp > 1 and shape.hf_config is None
    loss_context = contextlib.nullcontext
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as loss_context
    # Tensor parallelism cannot be applied inside a fake mode: the model is built and
    # parallelized on the meta device, then given storage.
    ep_group = None
    if ep > 1:  # under TP each rank routes its own sequence shard (sequence parallelism)
        ep_group = dist.group.WORLD if ep == mesh.size() else expert_group(mesh, ep)
    # torchtitan's model is split by torchtitan's own tensor parallelism as it is built.
    titan_tp = mesh["tp"] if tp > 1 and shape.titan is not None else None
    with torch.device("meta"):
        # fp32 parameters, cast to the compute dtype for each layer's forward by FSDP2.
        bundle = build_for_shape(shape, ep_group, titan_tp)
    model = bundle.model
    parameters = sum(p.numel() for p in model.parameters())  # a DTensor counts its whole shape
    training.apply_freeze(model)  # before sharding, as a user freezes a LoRA base
    options = {}
    if loss_parallel:
        options["tp_plan"] = None if titan_tp else loss_parallel_plan(model, tp, splits_sequence(shape, ep))
    parallelize(model, mesh, install(model, preset), mp_policy=policy, **options)
    run = FakeRun(routing=routing, materialize_meta=True) if fake else contextlib.nullcontext()
    with run, warnings.catch_warnings():
        # FSDP2 warns that the root returns a view (its hook would miss an in-place op on
        # it); the step here does none, and the warning would only puzzle a user.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        model.to_empty(device=device)
        if not fake:
            _initialise(model, shape, ep_group)
        optimizer = training.make_optimizer(model.parameters())
        batch = bundle.batch(0, device)
        resident = resident_events(model)
        meter = MemoryMeter(model, optimizer, trace_allocations=True, follow_fsdp=True)
        clock = RooflineClock(gpu)
        engine = offload_engine(model)
        if engine is not None:
            engine.time_copies(clock.copy_timer())
        with meter, _collected_between_steps():
            for step in range(STEPS):
                steady = step == STEPS - 1
                if steady and engine is not None:
                    engine.reset_stats()
                _retire_collectives(mesh)
                start = meter.mark(f"step{step}").live_bytes
                for micro in range(training.grad_accum):
                    # Each micro-batch's gradients are reduce-scattered and added to the sharded
                    # ones (FSDP2's default): what it holds at its start is the last one's.
                    _retire_collectives(mesh)
                    micro_start = meter.live_bytes
                    with clock if steady else contextlib.nullcontext(), loss_context():
                        loss = loss_of(model(**batch)) / training.grad_accum
                        _retire_collectives(mesh)
                        forward_end = meter.mark(f"forward{step}.{micro}").live_bytes
                        loss.backward()
                    del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
        report = meter.report()
        events = meter.allocation_trace()
    steady_start = meter.trace_marks[f"step{STEPS - 1}"]
    held_before = sum(nbytes for _, _, nbytes, _ in resident)
    return RankStep(
        resident_bytes=held_before + start,
        activation_bytes=forward_end - micro_start,
        step_peak_bytes=_peak_after(events, steady_start, start) - start,
        peak_bytes=held_before + report.peak_live_bytes,
        allocator=replay_allocations(resident + events, settings),
        parameters=parameters,
        flops=clock.flops,
        seconds=clock.seconds,
        exposed_comm_seconds=clock.exposed_comm_seconds,
        collective_bytes=dict(clock.collective_bytes),
        moved=None if engine is None else OffloadFigures.of(engine, clock),
    )


def _initialise(model: torch.nn.Module, shape: Shape, ep_group) -> None:
    """Real values for a model given storage by ``to_empty``: its own parameter init, and the
    buffers (RoPE's frequencies) of the same model built on the CPU. Bytes do not depend on
    values, but a MoE model's routing does, and uninitialised memory can route every token to
    the same experts, or make NaNs."""
    with torch.no_grad():
        if hasattr(model, "reset_parameters"):
            model.reset_parameters()
        built = dict(build_for_shape(shape, ep_group).model.named_buffers())
        for name, buffer in model.named_buffers():
            if isinstance(buffer, DTensor):  # torchtitan's tensor parallelism replicates its own
                buffer = buffer.to_local()
            buffer.copy_(built[name])


def _retire_collectives(mesh: DeviceMesh) -> None:
    """A barrier on each of the mesh's process groups before a figure is read: on a real
    backend (the tests' gloo ranks) a collective's buffer the program has dropped can stay
    referenced by the backend's worker thread for a moment after the collective completes, so
    a figure would depend on thread timing. The fake process group's barrier returns at once."""
    for group in mesh.get_all_groups():
        dist.barrier(group=group)


@contextlib.contextmanager
def _collected_between_steps() -> Iterator[None]:
    """Python's cyclic garbage collector off while the steps run, and run after each, as
    torchtitan trains (``gc.disable()``, a collection every few steps): what a reference cycle
    holds is then freed at the same point in every process, so the trace does not depend on
    when a collection happened to run. What is alive on entry is frozen (``gc.freeze``) for
    the while, so each collection walks only what the steps made, not all of torch's objects;
    unless the caller has frozen objects itself, whose freeze is left as it is. Garbage from
    before is frozen with the rest and collected after: it predates the meter's window, so it
    never counts."""
    enabled = gc.isenabled()
    gc.disable()
    freezing = gc.get_freeze_count() == 0
    if freezing:  # no collection first: it would walk every object torch made (tenths of a second)
        gc.freeze()
    try:
        yield
    finally:
        if freezing:
            gc.unfreeze()
        if enabled:
            gc.enable()


def splits_sequence(shape: Shape, ep: int) -> bool:
    """Whether the rank step runs sequence parallelism under TP: always, but on the MoE
    reference model with its experts whole (``ep`` 1), whose plan then routes every token on
    every TP rank."""
    return shape.model != "moe" or ep > 1


def loss_parallel_plan(model: torch.nn.Module, tp: int, sequence_parallel: bool | None = None) -> dict:
    """The model's own tensor-parallel plan (``sequence_parallel``: ``None`` for its default)
    with torchtitan's default for the output head: loss parallel, its logits left sharded by
    vocabulary for a cross-entropy under ``loss_parallel()``, not gathered on every rank."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    from actplan._install.tensor_parallel import tensor_parallel_plan

    plan = dict(tensor_parallel_plan(model, tp, sequence_parallel))
    head = plan.get("lm_head")
    if head is None:
        return plan
    (style,) = head
    # A DTensor out, for the loss-parallel cross-entropy.
    layouts = {"input_layouts": style.input_layouts[0], "output_layouts": Shard(-1)}
    plan["lm_head"] = (ColwiseParallel(**layouts, use_local_output=False),)
    return plan


def formula_trace(
    tensors: list[tuple[int, int]], largest_unit_bytes: int, step: list[tuple[int, int, int, int]]
) -> list[tuple[int, int, int, int]]:
    """The allocation trace of a layout the fake process group does not run, for the allocator
    model: the formula's static memory as the tensors it stands for, first (per parameter of
    ``tensors``, ``(numel, shards)``: fp32 shard, gradient, AdamW's two moments), then two
    gathered units of ``largest_unit_bytes``, then the measured ``step``."""
    sizes = [4 * -(-numel // shards) for numel, shards in tensors for _ in range(4)]
    sizes += [largest_unit_bytes] * 2
    return [(1, -(index + 1), nbytes, 0) for index, nbytes in enumerate(sizes)] + step
