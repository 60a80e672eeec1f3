"""The one row runner every bench drives (``actplan bench``, ``bench.peers``, ``bench.gpu``):
``none`` first, then each row on its own copy of the model, checked against ``none`` and
metered, then timed interleaved against ``none``.

- Parity: a row's first step against ``none``'s, within ``NOISE_FACTOR`` times the noise floor
  the runner measured (bit for bit when it measured none): two ``none`` runs
  (``start(noise_floor=True)``), and for compiled rows what compiling alone changes (the row
  marked ``RowSpec.floor``: one that does what ``none`` does, compiled).
- Determinism: ``parity_context`` makes the context every parity step runs in; the metered and
  timed steps run outside it.
- Memory: one metered step per row (activation bytes at the end of forward, peak, host tier for
  offload rows); a row Inductor compiled counts what autograd saves (``saved_tensors``). On
  CUDA, also the peak of a plain step by ``torch.cuda.max_memory_allocated``.
- Time: interleaved rounds after a warm-up, each row against ``none`` in the same rounds. On CUDA
  with ``memory_groups``, rows are timed in as many groups as the device holds, each group
  freed once timed.
- ``keep_going``: a row that raises is recorded (``errors``) and the run goes on.

Imports ``evaluate.contenders``, ``measure`` and the models; nothing above them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from actplan.evaluate.contenders import (
    ROOFLINE_GPU,
    Contender,
    Installer,
    PolicyRow,
    contender_row,
    cuda_step_peak,
    fresh_capture,
    prepare_contender,
    resident_bytes,
    set_timing,
    time_contenders,
)
from actplan.measure import StepCapture, TimingStats, compare_steps
from actplan.models import ModelBundle

NOISE_FACTOR = 4.0
"""A row may differ from ``none`` by this many times the noise floor measured in the same run."""
COMPILED_GRAD_SLACK = 1e-7
COMPILED_LOSS_ATOL = 1e-6
"""A compiled row's least allowances (docs/compile.md): gradients within the floor's multiple plus
``COMPILED_GRAD_SLACK``, the loss within at least ``COMPILED_LOSS_ATOL``."""


@dataclass
class RowSpec:
    """One row: its name, how it installs its checkpointing, how reports group it (``kind``:
    baseline, preset, peer, automatic-peer, compiled, plan), and whether its layers are compiled.
    ``floor``: this compiled row does what ``none`` does, compiled; its difference from ``none``
    is the compile noise floor of the rows after it. ``quiet_offload``: a row the bench chose
    itself, whose offload may move nothing."""

    name: str
    install: Installer
    kind: str = "preset"
    compiled: bool = False
    floor: bool = False
    quiet_offload: bool = False


@dataclass
class RowRunner:
    bundle: ModelBundle
    batch: dict[str, Any]
    device: torch.device
    repeats: int = 7
    warmup: int = 2
    parity_context: Callable[[], AbstractContextManager[Any]] | None = None
    saved_tensors: bool = False
    roofline_gpu: str = ROOFLINE_GPU
    memory_groups: bool = False
    keep_going: bool = False
    say: Callable[[str], None] = lambda line: None
    progress: Callable[[str], None] | None = None
    rows: list[PolicyRow] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    timings: dict[str, TimingStats] = field(default_factory=dict)
    _none: Contender | None = None
    _group: list[Contender] = field(default_factory=list)
    _contenders: dict[str, Contender] = field(default_factory=dict)
    _groups: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def baseline(self) -> StepCapture:
        if self._none is None:
            raise RuntimeError("no baseline yet: call start() first")
        return self._none.capture

    def start(self, install: Installer, noise_floor: bool = False) -> PolicyRow:
        """The ``none`` row (``install`` puts no checkpointing on the model); with
        ``noise_floor``, a second ``none`` whose difference from the first is the floor."""
        self.say("none" + (", and a second none for the noise floor" if noise_floor else ""))
        self._none = prepare_contender(
            self.bundle,
            "none",
            install,
            self.batch,
            self.device,
            parity_context=self.parity_context,
            roofline_gpu=self.roofline_gpu,
        )
        self.noise = {"loss": 0.0, "grad": 0.0}
        if noise_floor:
            again = fresh_capture(self.bundle, install, self.batch, self.device, self.parity_context)
            floor = compare_steps(self.baseline, again)
            self.noise = {"loss": floor.loss_abs_diff, "grad": floor.max_abs_grad_diff}
        row = self._row(self._none, RowSpec("none", install, "baseline"))
        self._contenders["none"] = self._none
        return row

    def tolerances(self, compiled: bool) -> tuple[float, float]:
        """(loss, gradient) a row may differ from ``none`` by, from the floors of this run."""
        loss, grad = NOISE_FACTOR * self.noise["loss"], NOISE_FACTOR * self.noise["grad"]
        if compiled:
            if "compile_grad" not in self.noise:
                raise ValueError(
                    "a compiled row needs the compile noise floor first: add a row with floor=True"
                )
            loss = max(loss, NOISE_FACTOR * self.noise["compile_loss"], COMPILED_LOSS_ATOL)
            grad = max(grad, NOISE_FACTOR * self.noise["compile_grad"]) + COMPILED_GRAD_SLACK
        return loss, grad

    def add(self, spec: RowSpec) -> PolicyRow | None:
        """Prepare one row: its parity step, metered step and (on CUDA) plain-step peak. With
        ``keep_going``, a row that raises is recorded in ``errors`` and gives None."""
        self.say(spec.name)
        if self.memory_groups and self.cuda and self._group and not self._room_for_another():
            self.flush()
        try:
            contender = prepare_contender(
                self.bundle,
                spec.name,
                spec.install,
                self.batch,
                self.device,
                compiled=spec.compiled,
                saved_tensors=self.saved_tensors,
                quiet_offload=spec.quiet_offload,
                parity_context=None if spec.compiled else self.parity_context,
                roofline_gpu=self.roofline_gpu,
            )
            if spec.floor:
                floor = compare_steps(self.baseline, contender.capture)
                self.noise.update(compile_loss=floor.loss_abs_diff, compile_grad=floor.max_abs_grad_diff)
            contender.loss_atol, contender.grad_atol = self.tolerances(spec.compiled)
            row = self._row(contender, spec)
        except Exception as err:
            if not self.keep_going:
                raise
            self.errors[spec.name] = error_text(err)
            release_cache(self.device)
            return None
        self._group.append(contender)
        self._contenders[spec.name] = contender
        return row

    def _row(self, contender: Contender, spec: RowSpec) -> PolicyRow:
        none_clock = self._none.clock if self._none is not None else None
        row = contender_row(contender, self.baseline, none_clock, kind=spec.kind, compiled=spec.compiled)
        if contender is not self._none:
            contender.capture = None  # a copy of every gradient: not kept past the check
        if self.cuda:
            row.resident_bytes = resident_bytes(contender.model, contender.optimizer)
            try:
                row.cuda_peak_bytes = cuda_step_peak(contender, self.batch, self.device)
            except torch.cuda.OutOfMemoryError as err:  # the row's parity and meter stand
                row.error = error_text(err)
                release_cache(self.device)
        self.rows.append(row)
        return row

    def contender(self, name: str) -> Contender:
        """A row's model and optimizer, while its group is alive (every row, off CUDA groups)."""
        return self._contenders[name]

    def _room_for_another(self) -> bool:
        """Room on the device for one more row's weights and optimizer state, and a step."""
        free, _ = torch.cuda.mem_get_info(self.device)
        none = self.rows[0]
        step = (none.cuda_peak_bytes or none.peak_bytes or 0) - (none.resident_bytes or 0)
        return free > (none.resident_bytes or 0) + 1.3 * step + (2 << 30)

    def flush(self) -> None:
        """Time the rows prepared since the last flush against ``none``; on CUDA with
        ``memory_groups``, free them."""
        if not self._group:
            return
        group, self._group = self._group, []
        self._groups += 1
        names = ["none", *(c.name for c in group)]
        self.say(f"timing {len(names)} rows" + (f" (group {self._groups})" if self.memory_groups else ""))
        timings = time_contenders(
            [self._none, *group], self.batch, repeats=self.repeats, warmup=self.warmup, progress=self.progress
        )
        by_name = {row.name: row for row in self.rows}
        for name in names:
            row = by_name[name]
            if name == "none" and row.step_median_s is not None:
                continue  # none's time of its first group stands; later groups only pair with it
            set_timing(row, timings[name], timings["none"])
            row.timing_group = self._groups
            self.timings[name] = timings[name]
        if self.memory_groups and self.cuda:
            for contender in group:
                self._contenders.pop(contender.name, None)
            del group, contender  # the last references: the cache can give their blocks back
            release_cache(self.device)

    def finish(self) -> list[PolicyRow]:
        """Time what is left; the rows in the order they were added."""
        self.flush()
        return self.rows

    def close(self) -> None:
        """Drop every row's model and optimizer, ``none``'s too (its baseline capture with it)."""
        self._group.clear()
        self._contenders.clear()
        self._none = None
        release_cache(self.device)


def error_text(err: BaseException) -> str:
    """The error's type and message, cut at 400 characters."""
    text = f"{type(err).__name__}: {err}"
    return text if len(text) < 400 else text[:400] + " ..."


def release_cache(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back to the device (a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
