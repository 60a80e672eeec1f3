"""The bench's rows: one way of checkpointing each, installed on its own copy of the model,
checked for parity against ``none``, metered once and timed interleaved with the others.

Shared by ``actplan bench`` (``evaluate.bench``) and the harness scripts under ``bench/``.
May import torch, the install layer, the config, ``measure`` and the models; not the CLI.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from actplan._engine.offload import quiet_empty_offload
from actplan._install.apply import apply, held_by_unit, offload_engine
from actplan._install.baselines import torch_checkpoint
from actplan.config import ConfigError, RecomputeConfig
from actplan.measure import (
    GradCensus,
    MemoryMeter,
    RooflineClock,
    StepCapture,
    TimingStats,
    capture_step,
    compare_steps,
    interleaved_timing,
    ratio,
)
from actplan.models import ModelBundle, train_step

ROOFLINE_GPU = "h100"
"""The accelerator the bench's predicted ratios are for (``measure.RooflineClock``)."""


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
    # The metered step priced by a roofline clock (eager rows; None for compiled ones): FLOPs,
    # bytes read and written by its ops, and the estimated step time on ``roofline_gpu``
    # against ``none``'s (offload copies charged at the host link, overlapped with compute).
    flops: int | None = None
    bytes_moved: int | None = None
    predicted_ratio: float | None = None
    roofline_gpu: str | None = None


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
    peak_bytes: int = 0
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
    quiet_offload: bool = False,
    parity_context: Callable[[], AbstractContextManager[Any]] | None = None,
) -> Contender:
    """Copy the model, install ``install`` on it, run the parity step and one metered step.

    ``compiled``: the installer compiled the model with ``backend="aot_eager"``. The metered
    step then runs the compiled graphs (``MemoryMeter(run_compiled=True)``); without it the
    meter would measure, and leave behind, the eager code instead.

    ``quiet_offload``: silence the offload engine's "moved nothing" warning for this row (a
    row the bench chose itself, not one the user configured).

    ``parity_context``: makes the context the parity step runs in (the GPU suite's
    deterministic algorithms); the metered step runs outside it.
    """
    model = copy.deepcopy(bundle.model).to(device)
    description = install(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    contender = Contender(name, description, model, optimizer, quiet_offload=quiet_offload)
    # Step 0 builds the optimizer state (and compiles), so step 1 is metered with it resident.
    with parity_context() if parity_context is not None else contextlib.nullcontext():
        contender.capture = contender_step(contender, batch, seed=0, capture=True)
    _metered_step(contender, batch, compiled)
    return contender


def _metered_step(contender: Contender, batch: dict[str, torch.Tensor], compiled: bool) -> None:
    """Step 1 under the memory meter (and the offload engine's counters, when it offloads)."""
    model = contender.model
    engine = offload_engine(model)
    if engine is not None:
        engine.reset_stats()
    # A plain dispatch mode would make torch.compile run the eager code: no clock on compiled rows.
    clock = None if compiled else RooflineClock(ROOFLINE_GPU)
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


def policy_rows(contenders: list[Contender], timings: dict[str, TimingStats]) -> list[PolicyRow]:
    """One row per contender: parity against the row named ``none``, memory, time ratio."""
    none = next(c for c in contenders if c.name == "none")
    rows = [_policy_row(contender, none.capture, timings) for contender in contenders]
    none_seconds = predicted_seconds(none)
    for contender, row in zip(contenders, rows, strict=True):
        seconds = predicted_seconds(contender)
        if seconds is not None and none_seconds:
            row.predicted_ratio = seconds / none_seconds
    return rows


def predicted_seconds(contender: Contender) -> float | None:
    """The roofline clock's step time for ``contender``: its compute and what the compute
    waits for, an offloading row's copies included (timed on the clock's copy streams at the
    host link, as an estimate's are)."""
    return None if contender.clock is None else contender.clock.seconds


def _policy_row(contender: Contender, baseline: StepCapture, timings: dict[str, TimingStats]) -> PolicyRow:
    parity = compare_steps(
        baseline, contender.capture, grad_atol=contender.grad_atol, loss_atol=contender.loss_atol
    )
    stats = timings[contender.name]
    rel = ratio(stats, timings["none"])
    host_peak, offloaded, reloaded = contender.moved or (None, None, None)
    return PolicyRow(
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
        flops=None if contender.clock is None else contender.clock.flops,
        bytes_moved=None if contender.clock is None else contender.clock.bytes_moved,
        roofline_gpu=None if contender.clock is None else contender.clock.accelerator.name,
    )


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
