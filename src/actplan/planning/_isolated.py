"""One layer run alone: its inputs captured from a real forward (``capture_layer_inputs``),
then, per candidate, metered and timed in isolation (``IsolatedLayer``) until the timing
settles (``SETTLED_SHARE``) or its rounds run out (``rounds_cap``: then it is reported
loose, with its spread), or, with a ``RooflineClock``, clocked once: on a named
accelerator's estimate (fake tensors have no time of their own).

Private to the profiler. Imports torch, ``apply`` and the install helpers, the
meters, the markers, ``actplan._storage`` and the profile records.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from actplan._install.apply import apply, find_layers, offload_engine
from actplan._storage import owned_storages, storage_key
from actplan._torch_internals import tree_leaves, tree_map
from actplan.config import RecomputeConfig
from actplan.markers import routing_markers
from actplan.measure import MemoryMeter, OpCounter, RooflineClock, copy_module, interleaved_timing
from actplan.measure._timing import median_spread, paired_differences, unstolen
from actplan.planning._records import SETTLED_SHARE, CandidateProfile


def _type_key(module: nn.Module, args: tuple, kwargs: dict) -> str:
    shapes = [
        (list(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
        for t in tree_leaves((args, kwargs))
    ]
    params = [list(p.shape) for p in module.parameters()]
    return f"{type(module).__name__}:{hashlib.sha256(json.dumps([shapes, params]).encode()).hexdigest()[:12]}"


def capture_layer_inputs(model: nn.Module, batch: dict) -> list[tuple[str, tuple, dict]]:
    """Per layer, its type key and a copy of the inputs of one forward. Inputs that are the
    model's parameters or buffers (a RoPE table), or one tensor handed to several layers (the
    RoPE cos/sin or a mask the model computes once), stay themselves: they are not the
    layer's activations, and the model holds them once whatever the layers do."""
    captured: list[tuple[str, tuple, dict] | None] = [None] * len(find_layers(model))
    owned = owned_storages(model)
    seen: dict[int, set[int]] = {}  # storage -> layers it was handed to
    originals: dict[int, torch.Tensor] = {}  # id of a copy -> the tensor it copies

    def copy_input(t: Any, index: int) -> Any:
        if not isinstance(t, torch.Tensor) or storage_key(t) in owned:
            return t
        seen.setdefault(storage_key(t), set()).add(index)
        copied = _Activation(t.detach().clone())
        originals[id(copied)] = t.detach()
        return copied

    handles = []
    for index, (_, layer) in enumerate(find_layers(model)):

        def hook(module, args, kwargs, index=index):
            if captured[index] is None:
                copied = tree_map(functools.partial(copy_input, index=index), (args, kwargs))
                captured[index] = (_type_key(module, args, kwargs), *copied)

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            torch.manual_seed(0)
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, c in enumerate(captured) if c is None]
    if missing:
        raise RuntimeError(
            f"layers {missing} did not run in a forward pass; a profile needs every layer to run"
        )
    shared = {storage for storage, layers in seen.items() if len(layers) > 1}

    def settle(item: Any) -> Any:
        if isinstance(item, _Activation):
            original = originals[id(item)]
            if storage_key(original) in shared:
                return original
        return item

    return [(key, *tree_map(settle, (args, kwargs))) for key, args, kwargs in captured]  # type: ignore[misc]


class _Activation:
    """A captured activation input: copied afresh for every isolated run (a pytree leaf)."""

    __slots__ = ("_leaf", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._leaf: torch.Tensor | None = None

    def leaf(self) -> torch.Tensor:
        """A leaf that requires grad, with its gradient buffer already allocated."""
        if self._leaf is None:
            self._leaf = self.tensor.clone().requires_grad_(True)
            self._leaf.grad = torch.zeros_like(self._leaf)
        return self._leaf


class IsolatedLayer:
    """One layer type's representative, run alone on captured inputs under a candidate."""

    def __init__(
        self,
        layer: nn.Module,
        args: tuple,
        kwargs: dict,
        min_bytes: int,
        clock: RooflineClock | None = None,
    ) -> None:
        self.layer = layer
        # Times from this clock (one run each: an estimate has no noise) instead of the timer.
        self.clock = clock
        self._clocked: dict[tuple[str, tuple[str, ...], bool], float] = {}  # by candidate key
        self.device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        # Prepared layers by candidate, and whether they have run a whole step.
        self._ready: dict[tuple[str, tuple[str, ...], bool], tuple[nn.Module, bool]] = {}
        self.args, self.kwargs = args, kwargs
        self.min_bytes = min_bytes
        # The gradient arriving from the next layer: fixed, so every candidate sees the same.
        out = self._plain_output()
        gen = torch.Generator(device="cpu").manual_seed(0)

        def grad_for(t: torch.Tensor) -> torch.Tensor:
            local = t.to_local() if isinstance(t, DTensor) else t  # a layer that returns a DTensor
            grad = torch.randn(local.shape, generator=gen, dtype=t.dtype).to(t.device)
            if isinstance(t, DTensor):
                return DTensor.from_local(grad, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
            return grad

        self.grads = [
            grad_for(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # In a model, the gradient arriving at the layer's output is a new tensor, alive during
        # the layer's backward; alone, it exists before the metered window. (The gradient made
        # for the input is counted alone too: autograd makes it before accumulating it.)
        local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in self.grads]
        self.boundary_grad_bytes = sum(g.numel() * g.element_size() for g in local_grads)

    def _inputs(self) -> tuple[tuple, dict]:
        # Fresh non-leaf copies of the activations, made inside the measured window, so the
        # layer's own saved set decides whether they stay alive; the leaves they come from
        # (and their gradients) exist before it. Parameters and buffers pass as they are.
        def fresh(item):
            if not isinstance(item, _Activation):
                return item
            if item.tensor.is_floating_point():
                return item.leaf() * 1.0
            return item.tensor.clone()

        return tree_map(fresh, (self.args, self.kwargs))

    def _plain_output(self):
        args, kwargs = self._inputs()
        torch.manual_seed(0)
        return self.layer(*args, **kwargs)

    def prepared(self, candidate: CandidateProfile) -> nn.Module:
        layer = copy_module(self.layer)
        config: dict[str, Any] = candidate.config_choice()
        if candidate.offload:
            config["offload"] = {"layer_input": True, "layers": "all", "min_bytes": self.min_bytes}
            if candidate.kept_units:
                config["offload"]["units"] = "kept"
        apply(layer, RecomputeConfig.from_dict(config, source=f"candidate {candidate.name}"))
        engine = offload_engine(layer)
        if engine is not None:
            # The parent model's parameters and buffers passed in (a RoPE table) stay put.
            passed = [t for t in tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)]
            engine.attach(layer, also_skip=passed)
        for p in layer.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)  # accumulate in place: grads are a fixed cost
        return layer

    def step(
        self, layer: nn.Module, meter: MemoryMeter | None = None, backward: bool = True
    ) -> dict[str, int]:
        torch.manual_seed(0)
        args, kwargs = self._inputs()
        out = layer(*args, **kwargs)
        del args, kwargs
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        figures = {}
        if meter is not None:
            live = meter.mark("forward_end").live_bytes
            out_storages = {
                storage_key(t): t.untyped_storage().nbytes()
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor)
            }
            figures["retained"] = live - sum(out_storages.values())
            figures["live_forward_end"] = live
        if backward:
            torch.autograd.backward(outputs, self.grads)
        return figures

    def _warm(self, candidate: CandidateProfile, backward: bool = True) -> nn.Module:
        """The candidate's prepared layer after an untimed, unmetered forward (its learning
        call; later metered figures are the same whether that forward had its backward or
        not) and, with ``backward``, a whole step. Kept for later measurements until
        ``forget``."""
        identity = candidate.key
        if identity not in self._ready:
            layer = self.prepared(candidate)
            self.step(layer, backward=backward)
            self._ready[identity] = (layer, backward)
        layer, stepped = self._ready[identity]
        if backward and not stepped:
            self.step(layer)
            self._ready[identity] = (layer, True)
        return layer

    def forget(self, candidates: Iterable[CandidateProfile]) -> None:
        for c in candidates:
            self._ready.pop(c.key, None)

    def measure_memory(self, candidate: CandidateProfile) -> None:
        layer = self._warm(candidate, backward=False)  # lazily created state must not count
        engine = offload_engine(layer)
        if engine is not None:
            engine.reset_stats()
        clock = self.clock
        if clock is not None:
            clock.reset()
        # With a clock, the same step is its time too (``_clock_time`` takes it): on fake
        # tensors a step's ops are the same whether metered, clocked or both.
        with MemoryMeter(layer) as meter, clock if clock is not None else contextlib.nullcontext():
            figures = self.step(layer, meter)
        if clock is not None:
            self._clocked[candidate.key] = clock.seconds
        identity = candidate.key
        self._ready[identity] = (layer, True)  # the metered step was a whole step
        report = meter.report()
        candidate.retained_bytes = max(figures["retained"], 0)
        candidate.transient_bytes = (
            max(report.peak_live_bytes - figures["live_forward_end"], 0) + self.boundary_grad_bytes
        )
        candidate.offloaded_bytes = engine.stats.bytes_offloaded if engine is not None else 0

    def measure_retained(self, candidate: CandidateProfile) -> None:
        """Only ``retained_bytes``: a forward to learn the layout, then a metered forward (no
        backward: the graph is dropped). Enough to rank the sets the greedy chain tries."""
        layer = self._warm(candidate, backward=False)
        with MemoryMeter(layer) as meter:
            figures = self.step(layer, meter, backward=False)
        candidate.retained_bytes = max(figures["retained"], 0)

    def interval_totals(
        self,
        intervals: Mapping[Any, tuple[Any, ...]],
        units: list[str],
        now: Callable[[], float],
        context: Any = None,
    ) -> dict[str, float]:
        """Per unit, how far ``now()`` advances inside its marker intervals over one forward of
        the plain layer (after its warm-up), ``context`` entered around it: seconds with a
        timer or a clock, ops with an op counter."""
        layer = self._warm(CandidateProfile("none", "none", [], offload=False))
        opens: dict[str, list[tuple[str, str]]] = {}
        closes: dict[str, list[tuple[str, str]]] = {}
        for unit, spans in intervals.items():
            name = getattr(unit, "value", unit)
            for span in spans:
                opens.setdefault(span.start, []).append((name, span.end))
                closes.setdefault(span.end, []).append((name, span.start))
        started: dict[tuple[str, str], float] = {}
        spent = dict.fromkeys(units, 0.0)

        def sink(marker: str) -> None:
            reading = now()
            for name, start in closes.get(marker, ()):
                begun = started.pop((name, start), None)
                if begun is not None and name in spent:
                    spent[name] += reading - begun
            for name, _ in opens.get(marker, ()):
                started[(name, marker)] = reading

        with routing_markers(sink), context if context is not None else contextlib.nullcontext():
            self.step(layer, backward=False)
        return spent

    def unit_seconds(self, intervals: Mapping[Any, tuple[Any, ...]], units: list[str]) -> dict[str, float]:
        """Per unit, the forward time of its marker intervals in the plain layer (median of 3
        forwards after the warm-up; one on the clock): what the replay no longer reruns when
        it is kept."""
        clock = self.clock
        if clock is not None:  # from zero, so its readings do not depend on what it clocked before
            clock.reset()
            return self.interval_totals(intervals, units, lambda: clock.seconds, clock)

        def now() -> float:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter()

        rounds = [self.interval_totals(intervals, units, now) for _ in range(3)]
        return {unit: statistics.median(r[unit] for r in rounds) for unit in units}

    def unit_ops(self, intervals: Mapping[Any, tuple[Any, ...]], units: list[str]) -> dict[str, int]:
        """Per unit, how many ops its marker intervals run in one forward of the plain layer."""
        counter = OpCounter()
        totals = self.interval_totals(intervals, units, lambda: sum(counter.counts.values()), counter)
        return {unit: int(count) for unit, count in totals.items()}

    def measure_time(self, candidates: list[CandidateProfile], repeats: int) -> None:
        """Each candidate's ``extra_seconds`` over ``none`` (which must be among them): the
        median of per-round differences, rounds where either run lost its CPU left out
        (``paired_differences``), with its ``extra_seconds_spread`` and whether it settled.
        Every candidate: at least 3 rounds (fewer if ``repeats`` says so), more, up to
        ``repeats``, while some difference is still loose (``_settled``); then ``none`` and
        the candidates still loose only, up to ``rounds_cap(repeats)`` rounds in all."""
        layers = {c.name: self._warm(c) for c in candidates}
        if self.clock is not None:
            self._clock_time(candidates, layers)
            return
        runs = {name: (lambda layer=layer: self.step(layer)) for name, layer in layers.items()}
        timings = interleaved_timing(
            runs,
            repeats=min(3, repeats),
            max_repeats=repeats,
            warmup=0,  # each layer has run its warm-up step in `_warm`
            settled=_settled,
        )
        reference = list(timings["none"].samples)
        pairs = {name: (list(t.samples), list(reference)) for name, t in timings.items() if name != "none"}
        _until_settled(runs, reference, pairs, rounds_cap(repeats))
        limit = SETTLED_SHARE * steady_median(reference)
        for c in candidates:
            if c.name == "none":
                c.layer_seconds = steady_median(reference)
                c.extra_seconds, c.extra_seconds_spread, c.timing_settled = 0.0, 0.0, True
                continue
            own, ref = pairs[c.name]
            c.layer_seconds = steady_median(own)
            paired = paired_differences(own, ref)
            # More recompute is never cheaper: a negative difference is timer noise.
            c.extra_seconds = max(statistics.median(paired), 0.0)
            c.extra_seconds_spread = median_spread(paired)
            c.timing_settled = c.extra_seconds_spread <= limit

    def _clock_time(self, candidates: list[CandidateProfile], layers: dict[str, nn.Module]) -> None:
        """Each candidate's step on the clock: its estimate, and its difference to ``none``'s
        (exact: no spread, settled)."""
        clock = self.clock
        for c in candidates:
            clocked = self._clocked.get(c.key)  # its metered step's (``measure_memory``)
            if clocked is None:
                clock.reset()
                with clock:
                    self.step(layers[c.name])
                clocked = clock.seconds
            c.layer_seconds = clocked
        reference = next(c for c in candidates if c.name == "none").layer_seconds
        for c in candidates:
            c.extra_seconds = max(c.layer_seconds - reference, 0.0) if c.name != "none" else 0.0


# Timing stops once every candidate's difference to `none` is known to `SETTLED_SHARE` of
# `none`'s own time (the paired differences' interquartile range over the square root of
# the rounds, `median_spread`). Past `repeats` rounds, only `none` and the loose candidates
# go on, up to this many times `repeats` rounds in all; a difference still looser than
# that is reported as not settled.
ROUNDS_PER_REPEAT = 3


def rounds_cap(repeats: int) -> int:
    """The most timed rounds a measurement runs while it has not settled."""
    return ROUNDS_PER_REPEAT * max(repeats, 1)


def steady_median(samples: list[float]) -> float:
    """The median of the samples whose CPU was not stolen (``unstolen``)."""
    return statistics.median(s for s, ok in zip(samples, unstolen(samples), strict=True) if ok)


def tight(samples: list[float]) -> bool:
    """The median of ``samples``, stolen runs left out, is known to ``SETTLED_SHARE`` of itself."""
    steady = [s for s, ok in zip(samples, unstolen(samples), strict=True) if ok]
    return median_spread(steady) <= SETTLED_SHARE * statistics.median(steady)


def _until_settled(
    runs: Mapping[str, Any],
    reference: list[float],
    pairs: dict[str, tuple[list[float], list[float]]],
    cap: int,
) -> None:
    """Rounds of ``none`` and the candidates still loose, until none is or ``cap`` rounds are
    done in all: each round's time of a candidate appended to its ``pairs`` entry (its own
    times, ``none``'s of the same rounds), ``none``'s to ``reference``. A settled candidate
    costs no more rounds."""
    for round_index in range(len(reference), cap):
        limit = SETTLED_SHARE * steady_median(reference)
        loose = [
            name for name, (own, ref) in pairs.items() if median_spread(paired_differences(own, ref)) > limit
        ]
        if not loose:
            return
        names = ["none", *loose]
        shift = round_index % len(names)
        one = interleaved_timing(
            {name: runs[name] for name in names[shift:] + names[:shift]}, repeats=1, warmup=0
        )
        reference.append(one["none"].samples[0])
        for name in loose:
            pairs[name][0].append(one[name].samples[0])
            pairs[name][1].append(reference[-1])


def _settled(samples: Mapping[str, list[float]]) -> bool:
    """Every candidate's paired difference to ``none`` is tight against ``none``'s time."""
    reference = samples["none"]
    limit = SETTLED_SHARE * steady_median(reference)
    return all(
        median_spread(paired_differences(own, reference)) <= limit
        for name, own in samples.items()
        if name != "none"
    )
