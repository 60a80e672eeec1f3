"""Measure what each way of running a layer costs: the input of the budget planner.

``profile_model`` runs each distinct layer type (same class, parameter shapes and input
shapes) once per candidate, in isolation on inputs captured from a real forward, with the
memory meter and the interleaved timer:

* ``retained_bytes``: device bytes the layer leaves alive at the end of its forward (its
  saved tensors, its input when it saves it; not its output, which the next layer owns);
* ``transient_bytes``: what its backward, recompute included, needs on top at its peak,
  with the gradient arriving at its output (in a model, allocated during that backward);
* ``extra_seconds``: forward+backward time over the ``none`` candidate (median of paired
  rounds); offload is charged its exposed copy time from a bandwidth figure;
* ``offloaded_bytes``: what offload moved to the host tier.

Candidates: ``none``, ``full``, each preset, a greedy chain (starting from ``full``, add
the unit that saves the most time per byte kept, until every unit is kept), and, for every
checkpointed candidate, the same with its input and kept units offloaded. The chain ranks
units by the time each saves when kept alone (timed once, with the presets) over the bytes
the set it would make retains (a forward-only measurement per set tried), so each set is
timed only if it joins the chain. Timing is adaptive: at least 3 interleaved rounds, more
(up to ``repeats``) while a difference is still loose (``SETTLED_SHARE``), then rounds of
``none`` and the loose candidates only, up to 3 x ``repeats`` in all; rounds where a run
lost its CPU to another job (1.5x its median) are left out. What did not settle is reported
(``timing_settled``, each candidate's ``extra_seconds_spread``) and logged as a warning on
the ``actplan`` logger (``ModelProfile.timing_warning``). The fixed costs
(parameters, gradients, AdamW state, activations outside the layers) and the step time
without checkpointing come from whole-model steps. Results are JSON, cached by a key of
model, shapes, dtype, device, torch version, offload threshold and any forced bandwidth
(``cache``).

This module runs the whole-model steps and walks the layer types; one layer's isolated
measurement is ``_isolated``, its candidates ``_candidates``, the records ``_records``
(re-exported here). Imports torch, ``apply``, the install helpers, the meters, the
models' step and the planning package's own modules.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from actplan._install.apply import apply, find_layers
from actplan._torch_internals import tree_leaves
from actplan.integrations.hf import kv_cache_off
from actplan.measure import Accelerator, MemoryMeter, RooflineClock, copy_module, interleaved_timing
from actplan.measure._timing import median_spread, unstolen
from actplan.models import ModelBundle, loss_of, train_step
from actplan.planning._cache_key import cache_key
from actplan.planning._candidates import layer_type_steps, profile_layer_type
from actplan.planning._isolated import capture_layer_inputs, rounds_cap, steady_median, tight
from actplan.planning._records import SETTLED_SHARE, CandidateProfile, LayerTypeProfile, ModelProfile
from actplan.progress import LOGGER, ProgressCallback, ProgressTracker
from actplan.sizes import DEFAULT_OFFLOAD_MIN_BYTES

__all__ = ["ModelProfile", "copy_bandwidth", "profile_model"]


def copy_bandwidth(device: torch.device, nbytes: int = 64 * 2**20, repeats: int = 3) -> dict[str, float]:
    """Bytes per second between the device and (pinned, on CUDA) host memory, best of ``repeats``."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for label, (dst, src) in {"device_to_host": (host, dev), "host_to_device": (dev, host)}.items():
        best = float("inf")
        for _ in range(repeats + 1):
            if pin:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        out[label] = nbytes / best
    return out


def _watch_backward(model: nn.Module, meter: MemoryMeter) -> None:
    """Mark ``grad_out <i>`` on the meter when the gradient of layer ``i``'s output is
    complete: the moment its backward can start."""
    handles = []

    def on_output(module, args, output, index: int) -> None:
        handles[index].remove()
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: meter.mark(f"grad_out {index}") and None)
                break

    for index, (_, layer) in enumerate(find_layers(model)):
        handles.append(layer.register_forward_hook(functools.partial(on_output, index=index)))


def _backward_intervals(report: Any, layers: int) -> tuple[int, list[int]]:
    """From a metered step with ``forward_end`` and ``grad_out <i>`` marks: the live-bytes peak
    from forward end to the last layer's backward (the loss head's), and per layer ``i`` the
    peak from its ``grad_out`` to the next lower layer's (its backward, and whatever else runs
    before the layer below starts); layer 0's runs to the end of backward."""
    timeline = report.timeline
    starts = {label: i for i, (label, _) in enumerate(timeline)}
    begin = max(i for i, (label, _) in enumerate(timeline) if label == "forward_end")
    bounds = [starts.get(f"grad_out {i}") for i in range(layers)]
    if any(b is None for b in bounds):
        return max(live for _, live in timeline[begin:]), []

    def peak(a: int, b: int) -> int:
        return max((live for _, live in timeline[a:b]), default=0)

    head = peak(begin, bounds[-1])
    per_layer = [peak(bounds[i], bounds[i - 1] if i else len(timeline)) for i in range(layers)]
    return head, per_layer


def _say_for(say: Callable[[str], None], class_name: str, label: str) -> None:
    say(f"{class_name}: {label}")


# Progress units of the whole-model part: the none and full steps, then the timing.
_MODEL_STEPS = 3


@dataclass
class _PresetRun:
    """One metered whole-model step under ``none`` or ``full``, and its optimizer step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    report: Any  # the step's MemoryReport, with forward_end and grad_out marks
    step_report: Any  # the optimizer step's MemoryReport
    head_transient: int  # the loss head's backward beyond forward end
    interval_peaks: list[int]  # per layer, the live peak of its backward interval


def _preset_run(
    model: nn.Module,
    preset: str,
    batch: dict,
    layers: int,
    warmed_state: dict | None,
    clock: RooflineClock | None = None,
) -> tuple[_PresetRun, dict]:
    """A copy of ``model`` under ``preset``: its AdamW state made by a warm-up step (or loaded
    from ``warmed_state``), then a metered step (clocked too by ``clock``, reset first) and a
    metered optimizer step. Returns the run and the optimizer state, for the next preset."""
    plain = copy_module(model)
    apply(plain, preset)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4, foreach=False)
    if warmed_state is None:
        train_step(plain, batch, optimizer, seed=0)  # warm-up: the optimizer state comes to exist
        warmed_state = optimizer.state_dict()
    else:
        optimizer.load_state_dict(warmed_state)  # the same state, without another step
    if clock is not None:
        clock.reset()
    with MemoryMeter(plain, optimizer) as meter, clock if clock is not None else contextlib.nullcontext():
        torch.manual_seed(0)
        _watch_backward(plain, meter)
        loss = loss_of(plain(**batch))
        forward_end = meter.mark("forward_end").live_bytes
        loss.backward()
        del loss
    report = meter.report()
    head_peak, interval_peaks = _backward_intervals(report, layers)
    # The optimizer step's own temporaries, with every gradient in place.
    with MemoryMeter(plain, optimizer) as step_meter:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run = _PresetRun(
        plain, optimizer, report, step_meter.report(), max(head_peak - forward_end, 0), interval_peaks
    )
    return run, warmed_state


@dataclass
class _WholeModel:
    """The whole-model figures: the ``none`` and ``full`` runs and the step time of ``none``."""

    runs: dict[str, _PresetRun]
    base_seconds: float
    base_seconds_spread: float = 0.0  # its median's spread (0: an estimate)

    def __getitem__(self, preset: str) -> _PresetRun:
        return self.runs[preset]


def _whole_model(
    model: nn.Module,
    batch: dict,
    layers: int,
    repeats: int,
    say: Callable[[str], None],
    clock: RooflineClock | None,
) -> _WholeModel:
    """Fixed costs, step time and peaks of ``none`` and ``full``, from whole-model steps; the
    step time from ``clock`` when given."""
    runs: dict[str, _PresetRun] = {}
    warmed_state = None
    base_seconds = 0.0
    for preset in ("none", "full"):
        # With a clock, `none`'s metered step is its time: forward and backward, an estimate's
        # step, as its rows are (the optimizer step of a sharded model is not this one's).
        timed = clock if preset == "none" else None
        runs[preset], warmed_state = _preset_run(model, preset, batch, layers, warmed_state, timed)
        if timed is not None:
            base_seconds = timed.seconds
        say(f"model step {preset}")
    none = runs["none"]
    if clock is not None:
        say("model timing")
        return _WholeModel(runs, base_seconds)
    # The model has run two steps already (warm-up and metered): no warm-up round here.
    timing = interleaved_timing(
        {"none": lambda: train_step(none.model, batch, none.optimizer, seed=0)},
        repeats=min(3, repeats),
        max_repeats=rounds_cap(repeats),
        warmup=0,
        settled=lambda samples: tight(samples["none"]),
    )
    say("model timing")
    samples = timing["none"].samples
    steady = [s for s, ok in zip(samples, unstolen(samples), strict=True) if ok]
    return _WholeModel(runs, steady_median(samples), median_spread(steady) if len(steady) > 1 else 0.0)


def _layer_types(
    model: nn.Module,
    batch: dict,
    device: torch.device,
    min_bytes: int,
    repeats: int,
    bandwidth: float | None,
    tracker: ProgressTracker,
    clock: RooflineClock | None,
) -> tuple[list[str], dict[str, LayerTypeProfile], dict[str, float], bool]:
    """Each layer's type key, and each type's candidates, measured on its first layer's
    captured inputs; with the copy bandwidth and overlap that charged offload (with a
    ``clock``: its accelerator's host link, copies overlapped as on any GPU)."""
    layers = find_layers(model)
    captured = capture_layer_inputs(model, batch)
    first_of_type = {}
    for (_, layer), (type_key, _, _) in zip(layers, captured, strict=True):
        first_of_type.setdefault(type_key, layer)
    # Now the layer types are known exactly (the estimate went by class).
    tracker.total = tracker.done + sum(layer_type_steps(layer) for layer in first_of_type.values())
    if bandwidth is None and clock is not None:
        bandwidth = clock.accelerator.host_link_bytes_per_s
    bw = (
        {"device_to_host": bandwidth, "host_to_device": bandwidth}
        if bandwidth is not None
        else copy_bandwidth(device)
    )
    overlap = device.type == "cuda" or clock is not None
    types: dict[str, LayerTypeProfile] = {}
    for index, ((_, layer), (type_key, args, kwargs)) in enumerate(zip(layers, captured, strict=True)):
        if type_key in types:
            types[type_key].layer_indices.append(index)
            continue
        types[type_key] = LayerTypeProfile(type_key, type(layer).__name__, [index], [])
        say = functools.partial(_say_for, tracker.step, type(layer).__name__)
        types[type_key].candidates = _with_shared_timing(
            profile_layer_type(layer, args, kwargs, min_bytes, repeats, bw, overlap, say, clock)
        )
    return [key for key, _, _ in captured], types, bw, overlap


def _with_shared_timing(candidates: list[CandidateProfile]) -> list[CandidateProfile]:
    """An offloaded variant's time is its candidate's plus a copy charge: it takes on the
    candidate's spread and settledness too."""
    timed = {c.key[:2]: c for c in candidates if not c.offload}
    for c in candidates:
        if c.offload and c.key[:2] in timed:
            c.extra_seconds_spread = timed[c.key[:2]].extra_seconds_spread
            c.timing_settled = timed[c.key[:2]].timing_settled
    return candidates


def _timing_summary(profile: ModelProfile) -> None:
    """The profile's ``timing_settled`` and ``timing_spread`` from its candidates' and base
    time's; a warning on the ``actplan`` logger when some time did not settle."""
    shares = [0.0]
    for layer_type in profile.layer_types:
        none = layer_type.candidate("none").layer_seconds
        for c in layer_type.candidates:
            if c.extra_seconds_spread:
                shares.append(c.extra_seconds_spread / none if none > 0 else float("inf"))
    profile.timing_spread = max(shares)
    base_settled = profile.base_seconds_spread <= SETTLED_SHARE * profile.base_seconds
    profile.timing_settled = base_settled and all(
        c.timing_settled for t in profile.layer_types for c in t.candidates
    )
    warning = profile.timing_warning()
    if warning is not None:
        LOGGER.warning("%s: %s", profile.model, warning, extra={"actplan_loose_timing": True})


def _calibrate(profile: ModelProfile, whole: _WholeModel) -> None:
    """The terms the phase model takes from the measured runs: activations outside the
    layers, the loss head's backward, each layer's extra and the remaining residual."""
    layers = len(profile.layer_type_of)
    none_report, full_report = whole["none"].report, whole["full"].report
    # Activations outside the layers: what `full` leaves at the end of forward beyond its layers.
    retained_full = sum(profile.type_of(i).candidate("full").retained_bytes for i in range(layers))
    profile.nonlayer_activation_bytes = max(
        full_report.marks["forward_end"].activation_bytes - retained_full, 0
    )
    # The loss head's backward runs first, with every activation still alive.
    profile.head_transient_bytes = max(whole["none"].head_transient, whole["full"].head_transient)
    # Calibrate each layer's backward phase on the two measured runs: what their interval
    # peaks hold beyond the phase model (a loss head that runs in mid-model, as multi-token
    # prediction has, shows up in the phase of the layer above it).
    runs = (("none", none_report), ("full", full_report))
    choices_of = {
        preset: [[c.name for c in profile.type_of(i).candidates].index(preset) for i in range(layers)]
        for preset, _ in runs
    }
    if all(whole[preset].interval_peaks for preset, _ in runs):
        problem = profile.problem()
        extras = [0] * layers
        for preset, report in runs:
            static = report.peak_bytes - report.peak_live_bytes
            predicted = problem.phases(choices_of[preset])[1:-1]
            for i, measured in enumerate(whole[preset].interval_peaks):
                extras[i] = max(extras[i], int(static + measured - predicted[i]))
        profile.layer_backward_extra_bytes = extras
    # Then whatever the whole runs still peak at beyond the model goes to every phase.
    problem = profile.problem()
    residuals = [
        report.peak_bytes - replace(problem, optimizer_step_bytes=0.0).peak(choices_of[preset])
        for preset, report in runs
    ]
    profile.backward_extra_bytes = max(int(max(residuals)), 0)


def profile_model(
    bundle: ModelBundle,
    *,
    spec: str,
    device: torch.device,
    repeats: int = 5,
    min_bytes: int = DEFAULT_OFFLOAD_MIN_BYTES,
    bandwidth: float | None = None,
    progress: ProgressCallback | None = None,
    gpu: str | Accelerator | None = None,
) -> ModelProfile:
    """Measure every layer type's candidates and the model's fixed costs (see the module doc).

    ``bandwidth`` (bytes/s each way) replaces the measured copy bandwidth in offload's charge.
    ``progress`` receives a ``ProgressEvent`` as each stage completes (default: the
    ``actplan`` logger at INFO). ``gpu`` (a name in ``measure.ACCELERATORS``, or an
    ``Accelerator``) takes every time from that accelerator's roofline clock instead of timing
    this machine: the way to profile on fake tensors (``measure.FakeRun``), where memory is
    exact and time does not exist.
    """
    started = time.perf_counter()
    tracker = ProgressTracker(progress, total=_MODEL_STEPS, prefix="profiling: ")
    clock = RooflineClock(gpu) if gpu is not None else None
    gpu_name = None if clock is None else clock.accelerator.name
    key = cache_key(bundle, spec, device, min_bytes, bandwidth, gpu_name)
    model = copy_module(bundle.model).to(device)
    kv_cache_off(model)  # the copy profiles as a plan trains
    batch = bundle.batch(0, device)
    layers = find_layers(model)
    if not layers:
        raise ValueError(
            f"model {spec!r} declares no checkpointable layers; set `recompute_intervals` on its "
            "layer classes"
        )
    by_class = {type(layer): layer for _, layer in reversed(layers)}
    tracker.expect(sum(layer_type_steps(layer) for layer in by_class.values()))

    whole = _whole_model(model, batch, len(layers), repeats, tracker.step, clock)
    layer_grads = [
        sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        for _, layer in layers
    ]
    all_grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    type_of, types, bw, overlap = _layer_types(
        model, batch, device, min_bytes, repeats, bandwidth, tracker, clock
    )
    none, full = whole["none"], whole["full"]
    profile = ModelProfile(
        model=bundle.description,
        cache_key=key,
        device=str(device),
        torch_version=torch.__version__,
        param_bytes=none.report.param_bytes,
        optimizer_bytes=none.report.optimizer_bytes,
        layer_grad_bytes=layer_grads,
        other_grad_bytes=all_grads - sum(layer_grads),
        optimizer_step_bytes=none.step_report.peak_live_bytes,
        nonlayer_activation_bytes=0,
        base_seconds=whole.base_seconds,
        base_seconds_spread=whole.base_seconds_spread,
        none_peak_bytes=max(none.report.peak_bytes, none.step_report.peak_bytes),
        full_peak_bytes=max(full.report.peak_bytes, full.step_report.peak_bytes),
        bandwidth_bytes_per_s=bw,
        copies_overlap=overlap,
        min_bytes=min_bytes,
        layer_types=list(types.values()),
        layer_type_of=type_of,
        roofline_gpu=gpu_name,
    )
    _calibrate(profile, whole)
    _timing_summary(profile)
    profile.seconds_spent = time.perf_counter() - started
    return profile
