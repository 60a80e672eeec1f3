"""The bench's rows: one way of checkpointing each, installed on its own copy of the model,
checked for parity against ``none``, metered once and timed interleaved with the others.

Shared by ``actplan bench`` (``evaluate.bench``) and the harness scripts under ``bench/``.
May import torch, the install layer, the config, ``measure`` and the models; not the CLI.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from actplan._engine.offload import quiet_empty_offload
from actplan._install.apply import apply, held_by_unit, offload_engine
from actplan._install.baselines import torch_checkpoint
from actplan._storage import storage_key
from actplan.config import ConfigError, RecomputeConfig
from actplan.measure import (
    GradCensus,
    MemoryMeter,
    RooflineClock,
    SavedTensorMeter,
    StepCapture,
    TimingStats,
    capture_step,
    compare_steps,
    interleaved_timing,
    ratio,
)
from actplan.models import ModelBundle, loss_of, train_step

ROOFLINE_GPU = "h100"
"""The accelerator the bench's predicted ratios are for by default (``measure.RooflineClock``;
``actplan bench --gpu`` names another)."""


@dataclass
class PolicyRow:
    """One row of a bench: parity against ``none``, memory of its metered step, time against
    ``none``'s in the same interleaved rounds (``None`` until timed)."""

    name: str
    description: str
    loss: float
    loss_identical: bool
    max_abs_grad_diff: float
    census_match: bool
    parity_ok: bool
    activation_bytes: int
    # The metered step's peak; None for a row compiled by Inductor, where the meter's dispatch
    # mode cannot run inside the graphs (its activation bytes are those autograd saves).
    peak_bytes: int | None
    cuda_max_allocated_bytes: int | None
    step_median_s: float | None = None
    step_q25_s: float | None = None
    step_q75_s: float | None = None
    ratio_to_none: float | None = None
    ratio_spread: float | None = None
    # How a report groups it: baseline, preset, peer, automatic-peer, compiled, plan.
    kind: str = "preset"
    compiled: bool = False
    loss_abs_diff: float = 0.0
    worst_param: str | None = None
    # Expert-parallel runs: every rank's (activation bytes, peak bytes), rank order.
    per_rank_memory: list[tuple[int, int]] | None = None
    # Offloading rows, over the metered step: host-tier peak and bytes moved each way.
    host_peak_bytes: int | None = None
    offloaded_bytes: int | None = None
    reloaded_bytes: int | None = None
    # Selective rows: per kept unit, {"held": bytes, "autograd": bytes} (see ``held_by_unit``).
    held_by_unit: dict[str, dict[str, int]] | None = None
    # The largest differences parity allowed (0: bit-identical): compiled rows, noisy devices.
    grad_atol: float = 0.0
    loss_atol: float = 0.0
    # On CUDA: the row's parameters and optimizer state, and the peak of a plain step (no meter).
    resident_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    # Which of the runner's timing groups timed it (on CUDA, as many as device memory needs).
    timing_group: int | None = None
    # What went wrong after its parity and metered steps (the plain CUDA step ran out of memory).
    error: str | None = None
    # The metered step priced by a roofline clock (eager rows; None for compiled ones): FLOPs,
    # bytes read and written by its ops, and the estimated step time on ``roofline_gpu``
    # against ``none``'s (offload copies charged at the host link, overlapped with compute).
    flops: int | None = None
    bytes_moved: int | None = None
    predicted_ratio: float | None = None
    roofline_gpu: str | None = None

    @property
    def bit_exact(self) -> bool:
        return self.loss_identical and self.max_abs_grad_diff == 0.0 and self.census_match

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> PolicyRow:
        """A row from its JSON record (``asdict``); keys it does not know (a harness's) are left out."""
        return cls(**{k: v for k, v in record.items() if k in _ROW_FIELDS})


_ROW_FIELDS = frozenset(f.name for f in fields(PolicyRow))

Installer = Callable[[nn.Module], str]
"""Installs one way of checkpointing on a fresh copy of the model and describes it."""


def config_installer(config: RecomputeConfig) -> Installer:
    """The installer of an actplan config: ``apply``, described by the plan's summary."""
    return lambda model: apply(model, config).summary()


torch_checkpoint_installer: Installer = torch_checkpoint


def has_hf_gradient_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model with its own gradient checkpointing."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and callable(
        getattr(model, "gradient_checkpointing_enable", None)
    )


def hf_checkpoint_installer(model: nn.Module) -> str:
    """Hugging Face's own whole-layer checkpointing, switched on as the Trainer's
    ``gradient_checkpointing=True`` does, non-reentrant: ``model.gradient_checkpointing_enable()``,
    or, in transformers releases that renamed it (and deprecated the old name), the same
    method's new name ``activation_checkpointing_enable()``."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
        called = "activation_checkpointing_enable"
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        called = "gradient_checkpointing_enable"
    return f"transformers' own checkpointing: model.{called}(use_reentrant=False), no actplan"


@dataclass
class Contender:
    """One bench row: its own copy of the model and optimizer, and what one metered step saw."""

    name: str
    description: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    capture: StepCapture | None = None
    activation_bytes: int = 0
    peak_bytes: int | None = 0
    cuda_max_allocated_bytes: int | None = None
    param_bytes: int = 0
    # Offloading rows: host-tier peak, bytes moved out and back over the metered step.
    moved: tuple[int, int, int] | None = None
    # Selective rows: per kept unit, bytes held at the end of the metered forward against what
    # autograd keeps for the same ops without checkpointing (the installed plan's ``held_by_unit()``).
    held_by_unit: dict[str, dict[str, int]] | None = None
    # Parity tolerances against ``none``: 0 (bit-identical) unless the row is compiled, where
    # the caller sets them from the compile noise floor it measured.
    grad_atol: float = 0.0
    loss_atol: float = 0.0
    # The bench's own offload rows: their "moved nothing" warning is silenced (see run_bench).
    quiet_offload: bool = False
    # The metered step's roofline clock (eager rows only; see PolicyRow).
    clock: RooflineClock | None = None


def prepare_contender(
    bundle: ModelBundle,
    name: str,
    install: Installer,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    *,
    compiled: bool = False,
    saved_tensors: bool = False,
    quiet_offload: bool = False,
    parity_context: Callable[[], AbstractContextManager[Any]] | None = None,
    roofline_gpu: str = ROOFLINE_GPU,
) -> Contender:
    """Copy the model, install ``install`` on it, run the parity step and one metered step
    (an eager row's priced by a roofline clock for ``roofline_gpu``).

    ``compiled``: the installer compiled the model's layers. The metered step then runs the
    compiled graphs (``MemoryMeter(run_compiled=True)``, for ``backend="aot_eager"``); without
    it the meter would measure, and leave behind, the eager code instead. With
    ``saved_tensors`` (Inductor, whose graphs a dispatch mode cannot enter) it counts what
    autograd saves over the forward instead (``SavedTensorMeter``), and the row has no peak.

    ``quiet_offload``: silence the offload engine's "moved nothing" warning for this row (a
    row the bench chose itself, not one the user configured).

    ``parity_context``: makes the context the parity step runs in (deterministic algorithms,
    say); the metered step runs outside it.
    """
    model = copy.deepcopy(bundle.model).to(device)
    description = install(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    contender = Contender(name, description, model, optimizer, quiet_offload=quiet_offload)
    # Step 0 builds the optimizer state (and compiles), so step 1 is metered with it resident.
    with parity_context() if parity_context is not None else contextlib.nullcontext():
        contender.capture = contender_step(contender, batch, seed=0, capture=True)
    if compiled and saved_tensors:
        _saved_tensors_step(contender, batch)
    else:
        _metered_step(contender, batch, compiled, roofline_gpu)
    return contender


def _saved_tensors_step(contender: Contender, batch: dict[str, torch.Tensor]) -> None:
    """Step 1 of a row Inductor compiled: the bytes autograd saves over its forward."""
    model, optimizer = contender.model, contender.optimizer
    torch.manual_seed(1)
    with SavedTensorMeter(model) as saved:
        loss = loss_of(model(**batch))
    contender.activation_bytes = saved.saved_bytes
    contender.peak_bytes = None
    loss.backward()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _metered_step(contender: Contender, batch: dict[str, torch.Tensor], compiled: bool, gpu: str) -> None:
    """Step 1 under the memory meter (and the offload engine's counters, when it offloads)."""
    model = contender.model
    engine = offload_engine(model)
    if engine is not None:
        engine.reset_stats()
    # A plain dispatch mode would make torch.compile run the eager code: no clock on compiled rows.
    clock = None if compiled else RooflineClock(gpu)
    if engine is not None:  # its copies on the clock's copy streams, as an estimate's are
        engine.time_copies(None if clock is None else clock.copy_timer())
    with (
        MemoryMeter(model, contender.optimizer, run_compiled=compiled) as meter,
        clock if clock is not None else contextlib.nullcontext(),
    ):
        contender_step(contender, batch, seed=1, meter=meter)
    contender.clock = clock
    if engine is not None:
        engine.time_copies(None)
    report = meter.report()
    if engine is not None:
        stats = engine.snapshot()
        contender.moved = (stats.host_peak_bytes, stats.bytes_offloaded, stats.bytes_reloaded)
    contender.held_by_unit = _held_by_unit(model)
    contender.activation_bytes = report.marks["forward_end"].activation_bytes
    contender.peak_bytes = report.peak_bytes
    contender.cuda_max_allocated_bytes = report.cuda_max_allocated_bytes
    contender.param_bytes = report.param_bytes


def fresh_capture(
    bundle: ModelBundle,
    install: Installer,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    parity_context: Callable[[], AbstractContextManager[Any]] | None = None,
) -> StepCapture:
    """The parity step of ``install`` on a fresh copy of the model, without a row: loss and
    gradients from the same start as every row's first step (a second ``none``, for the noise
    floor)."""
    model = copy.deepcopy(bundle.model).to(device)
    install(model)
    captured: list[StepCapture] = []
    with parity_context() if parity_context is not None else contextlib.nullcontext():
        train_step(
            model, batch, seed=0, after_backward=lambda loss: captured.append(capture_step(model, loss))
        )
    return captured[0]


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of ``model``'s parameters and ``optimizer``'s state, each storage once."""
    tensors = [*model.parameters()]
    tensors += [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def cuda_step_peak(contender: Contender, batch: dict[str, torch.Tensor], device: torch.device) -> int:
    """Peak device bytes of one plain training step (no meter): what the allocator saw grow,
    plus the row's own parameters and optimizer state. Other rows' bytes are not counted."""
    torch.cuda.synchronize(device)
    resident = resident_bytes(contender.model, contender.optimizer)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    train_step(contender.model, batch, contender.optimizer, seed=3)
    torch.cuda.synchronize(device)
    return resident + torch.cuda.max_memory_allocated(device) - base


def _held_by_unit(model: nn.Module) -> dict[str, dict[str, int]] | None:
    """``held_by_unit`` of a row's model; None when nothing is held per unit, or when another
    tool's checkpointing wraps the layers (torchtitan's FullAC and SelectiveAC put each block in a
    ``checkpoint_wrapper``, which ``find_layers`` refuses: no actplan layer runs there)."""
    try:
        return held_by_unit(model) or None
    except ConfigError:
        return None


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
        {c.name: (lambda c=c: contender_step(c, batch, seed=2)) for c in contenders},
        repeats=repeats,
        warmup=warmup,
        progress=progress,
    )


def contender_row(
    contender: Contender,
    baseline: StepCapture,
    none_clock: RooflineClock | None,
    *,
    kind: str = "preset",
    compiled: bool = False,
) -> PolicyRow:
    """``contender``'s row, untimed: parity against ``baseline`` within the contender's
    tolerances, its memory, and its step priced against ``none``'s clock."""
    parity = compare_steps(
        baseline, contender.capture, grad_atol=contender.grad_atol, loss_atol=contender.loss_atol
    )
    host_peak, offloaded, reloaded = contender.moved or (None, None, None)
    clock = contender.clock
    predicted = None
    if clock is not None and none_clock is not None and none_clock.seconds:
        predicted = clock.seconds / none_clock.seconds
    return PolicyRow(
        name=contender.name,
        description=contender.description,
        loss=float(contender.capture.loss.float()),
        loss_identical=parity.loss_identical,
        max_abs_grad_diff=parity.max_abs_grad_diff,
        census_match=parity.census_match,
        parity_ok=parity.ok,
        activation_bytes=contender.activation_bytes,
        peak_bytes=contender.peak_bytes,
        cuda_max_allocated_bytes=contender.cuda_max_allocated_bytes,
        kind=kind,
        compiled=compiled,
        loss_abs_diff=parity.loss_abs_diff,
        worst_param=parity.worst_param,
        host_peak_bytes=host_peak,
        offloaded_bytes=offloaded,
        reloaded_bytes=reloaded,
        held_by_unit=contender.held_by_unit,
        grad_atol=contender.grad_atol,
        loss_atol=contender.loss_atol,
        flops=None if clock is None else clock.flops,
        bytes_moved=None if clock is None else clock.bytes_moved,
        predicted_ratio=predicted,
        roofline_gpu=None if clock is None else clock.accelerator.name,
    )


def set_timing(row: PolicyRow, stats: TimingStats, none: TimingStats) -> None:
    """``row``'s step time and its ratio to ``none``'s, from the same interleaved rounds."""
    rel = ratio(stats, none)
    row.step_median_s, row.step_q25_s, row.step_q75_s = stats.median, stats.q25, stats.q75
    row.ratio_to_none, row.ratio_spread = rel.median, rel.spread


def contender_step(
    contender: Contender,
    batch: dict[str, torch.Tensor],
    seed: int,
    *,
    meter: MemoryMeter | None = None,
    capture: bool = False,
) -> StepCapture | None:
    """One training step of ``contender`` (``models.train_step``): marks ``forward_end`` on
    ``meter`` when given, and returns the step's capture when ``capture`` is set."""
    captured: list[StepCapture] = []

    def keep_capture(loss: torch.Tensor) -> None:
        captured.append(_without_wrapper_prefix(capture_step(contender.model, loss)))

    train_step(
        contender.model,
        batch,
        contender.optimizer,
        seed=seed,
        # The bench's own offload rows may move nothing on a small model: not the user's mistake.
        context=quiet_empty_offload() if contender.quiet_offload else None,
        after_forward=(lambda _: meter.mark("forward_end")) if meter is not None else None,
        after_backward=keep_capture if capture else None,
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
