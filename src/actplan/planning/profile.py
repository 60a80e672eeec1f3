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
(up to ``repeats``) while a difference is still loose (``SETTLED_SHARE``). The fixed costs
(parameters, gradients, AdamW state, activations outside the layers) and the step time
without checkpointing come from whole-model steps. Results are JSON, cached by a key of
model, shapes, dtype, device, torch version, offload threshold and any forced bandwidth.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import actplan
from actplan._engine.offload import quiet_empty_offload
from actplan._install.apply import find_layers, interval_map_of, offload_engine
from actplan._install.plan import format_indices
from actplan.config import PRESETS, RecomputeConfig
from actplan.markers import routing_markers
from actplan.measure import MemoryMeter, interleaved_timing
from actplan.models import ModelBundle, loss_of, train_step
from actplan.planning.planner import Candidate, PlanProblem
from actplan.progress import ProgressCallback, ProgressTracker
from actplan.sizes import DEFAULT_OFFLOAD_MIN_BYTES

PROFILE_FORMAT = 5  # 3: chain by unit forward time; 4: boundary grads; 5: per-layer extras


@dataclass
class CandidateProfile:
    """One way to run a layer type, and what it cost."""

    name: str
    mode: str  # none, full, selective
    kept_units: list[str]
    offload: bool  # layer input and kept units moved to the host tier
    retained_bytes: int = 0
    transient_bytes: int = 0
    layer_seconds: float = 0.0
    extra_seconds: float = 0.0
    offloaded_bytes: int = 0

    def config_choice(self) -> dict[str, Any]:
        return _choice(self.mode, tuple(self.kept_units))


@dataclass
class LayerTypeProfile:
    key: str
    class_name: str
    layer_indices: list[int]
    candidates: list[CandidateProfile]

    def candidate(self, name: str) -> CandidateProfile:
        return next(c for c in self.candidates if c.name == name)


@dataclass
class ModelProfile:
    model: str
    cache_key: str
    device: str
    torch_version: str
    param_bytes: int
    optimizer_bytes: int
    layer_grad_bytes: list[int]
    other_grad_bytes: int
    optimizer_step_bytes: int
    nonlayer_activation_bytes: int
    base_seconds: float
    none_peak_bytes: int
    full_peak_bytes: int
    bandwidth_bytes_per_s: dict[str, float]
    copies_overlap: bool
    min_bytes: int
    layer_types: list[LayerTypeProfile]
    layer_type_of: list[str]  # per layer index, its type key
    # Measured backward peaks of `none` and `full` beyond what the phase model predicts for
    # them (the loss head's backward, mostly); the planner adds it to every backward phase.
    backward_extra_bytes: int = 0
    # Per layer, what the measured runs hold during its backward (and before the layer below
    # starts) beyond the phase model: a loss head in mid-model, say. Added to its phase.
    layer_backward_extra_bytes: list[int] = field(default_factory=list)
    # What the loss head's backward (logits gradient, softmax) needs on top, measured.
    head_transient_bytes: int = 0
    # Offload's prefetch depth the plans are written with (OffloadConfig's default).
    prefetch_layers: int = 1
    seconds_spent: float = 0.0

    def type_of(self, index: int) -> LayerTypeProfile:
        key = self.layer_type_of[index]
        return next(t for t in self.layer_types if t.key == key)

    def problem(self) -> PlanProblem:
        """The planner's input: every layer's candidates with their measured costs."""
        layers = []
        for index in range(len(self.layer_type_of)):
            layers.append(
                tuple(
                    Candidate(c.name, c.retained_bytes, c.transient_bytes, c.extra_seconds, c.offloaded_bytes)
                    for c in self.type_of(index).candidates
                )
            )
        return PlanProblem(
            layers=tuple(layers),
            static_bytes=self.param_bytes + self.optimizer_bytes,
            base_seconds=self.base_seconds,
            nonlayer_bytes=self.nonlayer_activation_bytes,
            layer_grad_bytes=tuple(self.layer_grad_bytes),
            other_grad_bytes=self.other_grad_bytes,
            optimizer_step_bytes=self.optimizer_step_bytes,
            backward_extra_bytes=self.backward_extra_bytes,
            layer_extra_bytes=tuple(self.layer_backward_extra_bytes),
            head_transient_bytes=self.head_transient_bytes,
            prefetch_layers=self.prefetch_layers,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        data = json.loads(text)
        data["layer_types"] = [
            LayerTypeProfile(**{**t, "candidates": [CandidateProfile(**c) for c in t["candidates"]]})
            for t in data["layer_types"]
        ]
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# Cache


def cache_key(
    bundle: ModelBundle, spec: str, device: torch.device, min_bytes: int, bandwidth: float | None = None
) -> str:
    """A digest of everything a profile depends on: model spec, parameter and batch shapes and
    dtypes, device type, torch version, offload threshold, a forced copy bandwidth (``None``:
    measured) and this file's format."""
    batch = bundle.make_batch(0)
    described = {
        "spec": spec,
        "params": [(name, list(p.shape), str(p.dtype)) for name, p in bundle.model.named_parameters()],
        "batch": {k: (list(v.shape), str(v.dtype)) for k, v in batch.items() if isinstance(v, torch.Tensor)},
        "device": device.type,
        "torch": torch.__version__,
        "min_bytes": min_bytes,
        "format": PROFILE_FORMAT,
        **({"bandwidth": bandwidth} if bandwidth is not None else {}),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "actplan" / "profiles"


def load_cached(cache_dir: Path, key: str) -> ModelProfile | None:
    path = cache_dir / f"{key}.json"
    if not path.is_file():
        return None
    try:
        return ModelProfile.from_json(path.read_text())
    except (json.JSONDecodeError, TypeError, KeyError):
        return None  # an older or damaged file: profile again


def store(cache_dir: Path, profile: ModelProfile) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{profile.cache_key}.json"
    path.write_text(profile.to_json())
    return path


# ---------------------------------------------------------------------------------------------
# Measuring


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


def _model_step(
    model: nn.Module, batch: dict, optimizer: torch.optim.Optimizer | None, seed: int = 0
) -> None:
    train_step(model, batch, optimizer, seed=seed)


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


def _type_key(module: nn.Module, args: tuple, kwargs: dict) -> str:
    shapes = [
        (list(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
        for t in tree_leaves((args, kwargs))
    ]
    params = [list(p.shape) for p in module.parameters()]
    return f"{type(module).__name__}:{hashlib.sha256(json.dumps([shapes, params]).encode()).hexdigest()[:12]}"


def _capture_layer_inputs(model: nn.Module, batch: dict) -> list[tuple[str, tuple, dict]]:
    """Per layer, its type key and a copy of the inputs of one forward. Inputs that are the
    model's parameters or buffers (a RoPE table), or one tensor handed to several layers (the
    RoPE cos/sin or a mask the model computes once), stay themselves: they are not the
    layer's activations, and the model holds them once whatever the layers do."""
    captured: list[tuple[str, tuple, dict] | None] = [None] * len(find_layers(model))
    owned = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, set[int]] = {}  # storage -> layers it was handed to
    originals: dict[int, torch.Tensor] = {}  # id of a copy -> the tensor it copies

    def copy_input(t: Any, index: int) -> Any:
        if not isinstance(t, torch.Tensor) or t.untyped_storage()._cdata in owned:
            return t
        seen.setdefault(t.untyped_storage()._cdata, set()).add(index)
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
            if original.untyped_storage()._cdata in shared:
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


class _IsolatedLayer:
    """One layer type's representative, run alone on captured inputs under a candidate."""

    def __init__(self, layer: nn.Module, args: tuple, kwargs: dict, min_bytes: int) -> None:
        self.layer = layer
        self.device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        # Prepared layers by candidate, and whether they have run a whole step.
        self._ready: dict[tuple[str, tuple[str, ...], bool], tuple[nn.Module, bool]] = {}
        self.args, self.kwargs = args, kwargs
        self.min_bytes = min_bytes
        # The gradient arriving from the next layer: fixed, so every candidate sees the same.
        out = self._plain_output()
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.grads = [
            torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # In a model, the gradient arriving at the layer's output is a new tensor, alive during
        # the layer's backward; alone, it exists before the metered window. (The gradient made
        # for the input is counted alone too: autograd makes it before accumulating it.)
        self.boundary_grad_bytes = sum(g.numel() * g.element_size() for g in self.grads)

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
        layer = copy.deepcopy(self.layer)
        config: dict[str, Any] = candidate.config_choice()
        if candidate.offload:
            config["offload"] = {"layer_input": True, "layers": "all", "min_bytes": self.min_bytes}
            if candidate.kept_units:
                config["offload"]["units"] = "kept"
        actplan.apply(layer, RecomputeConfig.from_dict(config, source=f"candidate {candidate.name}"))
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
                t.untyped_storage()._cdata: t.untyped_storage().nbytes()
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
        identity = (candidate.mode, tuple(candidate.kept_units), candidate.offload)
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
            self._ready.pop((c.mode, tuple(c.kept_units), c.offload), None)

    def measure_memory(self, candidate: CandidateProfile) -> None:
        layer = self._warm(candidate, backward=False)  # lazily created state must not count
        engine = offload_engine(layer)
        if engine is not None:
            engine.reset_stats()
        with MemoryMeter(layer) as meter:
            figures = self.step(layer, meter)
        identity = (candidate.mode, tuple(candidate.kept_units), candidate.offload)
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

    def unit_seconds(self, intervals: Mapping[Any, tuple[Any, ...]], units: list[str]) -> dict[str, float]:
        """Per unit, the forward time of its marker intervals in the plain layer (median of 3
        forwards after the warm-up): what the replay no longer reruns when it is kept."""
        layer = self._warm(CandidateProfile("none", "none", [], offload=False))
        opens: dict[str, list[tuple[str, str]]] = {}
        closes: dict[str, list[tuple[str, str]]] = {}
        for unit, spans in intervals.items():
            name = getattr(unit, "value", unit)
            for span in spans:
                opens.setdefault(span.start, []).append((name, span.end))
                closes.setdefault(span.end, []).append((name, span.start))
        synchronize = self.device.type == "cuda"
        samples: dict[str, list[float]] = {unit: [] for unit in units}
        for _ in range(3):
            started: dict[tuple[str, str], float] = {}
            spent = dict.fromkeys(units, 0.0)

            def sink(marker: str, started=started, spent=spent) -> None:
                if synchronize:
                    torch.cuda.synchronize(self.device)
                now = time.perf_counter()
                for name, start in closes.get(marker, ()):
                    begun = started.pop((name, start), None)
                    if begun is not None and name in spent:
                        spent[name] += now - begun
                for name, _ in opens.get(marker, ()):
                    started[(name, marker)] = now

            with routing_markers(sink):
                self.step(layer, backward=False)
            for unit in units:
                samples[unit].append(spent[unit])
        return {unit: statistics.median(values) for unit, values in samples.items()}

    def measure_time(self, candidates: list[CandidateProfile], repeats: int) -> None:
        """Each candidate's ``extra_seconds`` over ``none`` (which must be among them): the
        median of per-round differences. At least 3 rounds (fewer if ``repeats`` says so),
        more, up to ``repeats``, while some difference is still unsettled (``_settled``)."""
        layers = {c.name: self._warm(c) for c in candidates}
        timings = interleaved_timing(
            {name: (lambda layer=layer: self.step(layer)) for name, layer in layers.items()},
            repeats=min(3, repeats),
            max_repeats=repeats,
            warmup=0,  # each layer has run its warm-up step in `_warm`
            settled=_settled,
        )
        reference = timings["none"]
        for c in candidates:
            own = timings[c.name]
            c.layer_seconds = own.median
            paired = sorted(a - b for a, b in zip(own.samples, reference.samples, strict=True))
            # More recompute is never cheaper: a negative difference is timer noise.
            c.extra_seconds = max(paired[len(paired) // 2], 0.0) if c.name != "none" else 0.0


# Timing stops once every candidate's difference to `none` is known to this share of
# `none`'s own time (the paired differences' interquartile range over the square root of
# the rounds).
SETTLED_SHARE = 0.05


def _spread(values: list[float]) -> float:
    """The interquartile range over the square root of the count: how loose a median is."""
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return (quartiles[2] - quartiles[0]) / math.sqrt(len(values))


def _tight(samples: list[float]) -> bool:
    return _spread(samples) <= SETTLED_SHARE * statistics.median(samples)


def _settled(samples: Mapping[str, list[float]]) -> bool:
    """Every candidate's paired difference to ``none`` is tight against ``none``'s time."""
    reference = samples["none"]
    limit = SETTLED_SHARE * statistics.median(reference)
    return all(
        _spread([a - b for a, b in zip(own, reference, strict=True)]) <= limit
        for name, own in samples.items()
        if name != "none"
    )


def _say_for(say: Callable[[str], None], class_name: str, label: str) -> None:
    say(f"{class_name}: {label}")


# Progress units of the whole-model part: the none and full steps, then the timing.
_MODEL_STEPS = 3


def layer_type_steps(layer: nn.Module) -> int:
    """Progress units of profiling one layer type: presets, one greedy step per declared
    unit, timing, offload."""
    return len(interval_map_of(layer).units) + 3


def _kept_set_name(units: list[str]) -> str:
    return "keep " + "+".join(units) if units else "full"


def _exposed_seconds(candidate: CandidateProfile, bandwidth: dict[str, float], overlap: bool) -> float:
    out = candidate.offloaded_bytes / bandwidth["device_to_host"]
    back = candidate.offloaded_bytes / bandwidth["host_to_device"]
    if not overlap:
        return out + back  # synchronous copies: all of it shows
    # Copies overlap the layer's own compute: forward about a third of it, backward the rest.
    return max(out - candidate.layer_seconds / 3, 0.0) + max(back - 2 * candidate.layer_seconds / 3, 0.0)


def profile_model(
    bundle: ModelBundle,
    *,
    spec: str,
    device: torch.device,
    repeats: int = 5,
    min_bytes: int = DEFAULT_OFFLOAD_MIN_BYTES,
    bandwidth: float | None = None,
    progress: ProgressCallback | None = None,
) -> ModelProfile:
    """Measure every layer type's candidates and the model's fixed costs (see the module doc).

    ``bandwidth`` (bytes/s each way) replaces the measured copy bandwidth in offload's charge.
    ``progress`` receives a ``ProgressEvent`` as each stage completes (default: the
    ``actplan`` logger at INFO).
    """
    started = time.perf_counter()
    tracker = ProgressTracker(progress, total=_MODEL_STEPS, prefix="profiling: ")
    say = tracker.step
    key = cache_key(bundle, spec, device, min_bytes, bandwidth)
    model = copy.deepcopy(bundle.model).to(device)
    batch = bundle.batch(0, device)
    layers = find_layers(model)
    if not layers:
        raise ValueError(
            f"model {spec!r} declares no checkpointable layers; set `recompute_intervals` on its "
            "layer classes"
        )

    by_class = {type(layer): layer for _, layer in reversed(layers)}
    tracker.expect(sum(layer_type_steps(layer) for layer in by_class.values()))

    # Whole-model figures: fixed costs, step time and peaks of none and full.
    figures = {}
    head_transients: list[int] = []
    interval_peaks: dict[str, list[int]] = {}
    warmed_state = None
    for preset in ("none", "full"):
        plain = copy.deepcopy(model)
        actplan.apply(plain, preset)
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4, foreach=False)
        if warmed_state is None:
            _model_step(plain, batch, optimizer)  # warm-up: the optimizer state comes to exist
            warmed_state = optimizer.state_dict()
        else:
            optimizer.load_state_dict(warmed_state)  # the same state, without another step
        with MemoryMeter(plain, optimizer) as meter:
            torch.manual_seed(0)
            _watch_backward(plain, meter)
            loss = loss_of(plain(**batch))
            forward_end = meter.mark("forward_end").live_bytes
            loss.backward()
            del loss
        head_peak, interval_peaks[preset] = _backward_intervals(meter.report(), len(layers))
        head_transients.append(max(head_peak - forward_end, 0))
        # The optimizer step's own temporaries, with every gradient in place.
        with MemoryMeter(plain, optimizer) as step_meter:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_report = step_meter.report()
        figures[preset] = (
            meter.report(),
            plain,
            optimizer,
            step_report.peak_live_bytes,
            step_report.peak_bytes,
        )
        say(f"model step {preset}")
    none_report, none_model, none_optimizer, optimizer_step_bytes, none_step_peak = figures["none"]
    full_report, full_step_peak = figures["full"][0], figures["full"][4]
    # The model has run two steps already (warm-up and metered): no warm-up round here.
    timing = interleaved_timing(
        {"none": lambda: _model_step(none_model, batch, none_optimizer)},
        repeats=min(3, repeats),
        max_repeats=repeats,
        warmup=0,
        settled=lambda samples: _tight(samples["none"]),
    )
    say("model timing")
    layer_grads = [
        sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        for _, layer in layers
    ]
    all_grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    captured = _capture_layer_inputs(model, batch)
    first_of_type = {}
    for (_, layer), (type_key, _, _) in zip(layers, captured, strict=True):
        first_of_type.setdefault(type_key, layer)
    # Now the layer types are known exactly (the estimate went by class).
    tracker.total = tracker.done + sum(layer_type_steps(layer) for layer in first_of_type.values())
    bw = (
        {"device_to_host": bandwidth, "host_to_device": bandwidth}
        if bandwidth is not None
        else copy_bandwidth(device)
    )
    overlap = device.type == "cuda"
    types: dict[str, LayerTypeProfile] = {}
    for index, ((_, layer), (type_key, args, kwargs)) in enumerate(zip(layers, captured, strict=True)):
        if type_key in types:
            types[type_key].layer_indices.append(index)
            continue
        types[type_key] = LayerTypeProfile(type_key, type(layer).__name__, [index], [])
        types[type_key].candidates = _profile_layer_type(
            layer,
            args,
            kwargs,
            min_bytes,
            repeats,
            bw,
            overlap,
            functools.partial(_say_for, say, type(layer).__name__),
        )
    profile = ModelProfile(
        model=bundle.description,
        cache_key=key,
        device=str(device),
        torch_version=torch.__version__,
        param_bytes=none_report.param_bytes,
        optimizer_bytes=none_report.optimizer_bytes,
        layer_grad_bytes=layer_grads,
        other_grad_bytes=all_grads - sum(layer_grads),
        optimizer_step_bytes=optimizer_step_bytes,
        nonlayer_activation_bytes=0,
        base_seconds=timing["none"].median,
        none_peak_bytes=max(none_report.peak_bytes, none_step_peak),
        full_peak_bytes=max(full_report.peak_bytes, full_step_peak),
        bandwidth_bytes_per_s=bw,
        copies_overlap=overlap,
        min_bytes=min_bytes,
        layer_types=list(types.values()),
        layer_type_of=[key for key, _, _ in captured],
    )
    # Activations outside the layers: what `full` leaves at the end of forward beyond its layers.
    retained_full = sum(profile.type_of(i).candidate("full").retained_bytes for i in range(len(layers)))
    profile.nonlayer_activation_bytes = max(
        full_report.marks["forward_end"].activation_bytes - retained_full, 0
    )
    # The loss head's backward runs first, with every activation still alive.
    profile.head_transient_bytes = max(head_transients)
    # Calibrate each layer's backward phase on the two measured runs: what their interval
    # peaks hold beyond the phase model (a loss head that runs in mid-model, as multi-token
    # prediction has, shows up in the phase of the layer above it).
    runs = (("none", none_report), ("full", full_report))
    choices_of = {
        preset: [[c.name for c in profile.type_of(i).candidates].index(preset) for i in range(len(layers))]
        for preset, _ in runs
    }
    if all(interval_peaks[preset] for preset, _ in runs):
        problem = profile.problem()
        extras = [0] * len(layers)
        for preset, report in runs:
            static = report.peak_bytes - report.peak_live_bytes
            predicted = problem.phases(choices_of[preset])[1:-1]
            for i, measured in enumerate(interval_peaks[preset]):
                extras[i] = max(extras[i], int(static + measured - predicted[i]))
        profile.layer_backward_extra_bytes = extras
    # Then whatever the whole runs still peak at beyond the model goes to every phase.
    problem = profile.problem()
    residuals = [
        report.peak_bytes - replace(problem, optimizer_step_bytes=0.0).peak(choices_of[preset])
        for preset, report in runs
    ]
    profile.backward_extra_bytes = max(int(max(residuals)), 0)
    profile.seconds_spent = time.perf_counter() - started
    return profile


def _profile_layer_type(
    layer: nn.Module,
    args: tuple,
    kwargs: dict,
    min_bytes: int,
    repeats: int,
    bandwidth: dict[str, float],
    overlap: bool,
    say: Callable[[str], None],
) -> list[CandidateProfile]:
    """The layer type's candidates; ``say`` is called ``layer_type_steps(layer)`` times."""
    isolated = _IsolatedLayer(layer, args, kwargs, min_bytes)
    declared = [u.value for u in interval_map_of(layer).units]
    measured: dict[tuple[str, tuple[str, ...]], CandidateProfile] = {}
    chosen: dict[tuple[str, tuple[str, ...]], CandidateProfile] = {}

    def measure(name: str, mode: str, kept: list[str]) -> CandidateProfile:
        identity = (mode, tuple(kept))
        if identity not in measured:
            candidate = CandidateProfile(name, mode, kept, offload=False)
            isolated.measure_memory(candidate)
            measured[identity] = candidate
        return measured[identity]

    def choose(candidate: CandidateProfile) -> CandidateProfile:
        chosen.setdefault((candidate.mode, tuple(candidate.kept_units)), candidate)
        return candidate

    choose(measure("none", "none", []))
    full = choose(measure("full", "full", []))
    for preset_name, preset in PRESETS.items():
        if preset.mode != "selective":
            continue
        if preset.kept_units is not None:
            kept = [u for u in declared if u in {k.value for k in preset.kept_units}]
        else:
            recomputed = {k.value for k in preset.recomputed_units or ()}
            kept = [u for u in declared if u not in recomputed]
        if kept:  # a preset with none of its units here is `full` with more overhead
            choose(measure(preset_name, "selective", kept))
    say("presets")

    # Greedy chain from `full`: each step adds the unit that saves the most time per byte
    # kept. Time saved is each unit's own forward time (what the replay no longer reruns),
    # timed from the markers of the plain layer; bytes are measured for each set tried, by a
    # forward-only run. Scores are evaluated lazily: a unit's score from an earlier step is
    # re-measured only when it tops the others. The chain's sets become candidates.
    saves = isolated.unit_seconds(interval_map_of(layer), declared)
    kept_now: list[str] = []
    retained_now = full.retained_bytes
    stale: dict[str, float] = {unit: math.inf for unit in declared}  # last known score
    while len(kept_now) < len(declared):
        tried: dict[tuple[str, ...], CandidateProfile] = {}  # this step's sets, measured
        while True:
            unit = max(stale, key=stale.__getitem__)
            units = [u for u in declared if u in kept_now or u == unit]
            if tuple(units) not in tried:
                probe = CandidateProfile(_kept_set_name(units), "selective", units, offload=False)
                isolated.measure_retained(probe)
                tried[tuple(units)] = probe
            stale[unit] = saves[unit] / max(tried[tuple(units)].retained_bytes - retained_now, 1)
            if stale[unit] >= max(stale.values()):
                break
        del stale[unit]
        kept_now, retained_now = units, tried.pop(tuple(units)).retained_bytes
        isolated.forget(tried.values())  # the chosen set's layer stays: measured next
        choose(measure(_kept_set_name(kept_now), "selective", kept_now))
        say(f"greedy {len(kept_now)}/{len(declared)}")
    # Every candidate timed together, so their differences come from the same rounds.
    isolated.measure_time(list(chosen.values()), repeats)
    isolated.forget(list(chosen.values()))
    say("timing")
    found = dict(chosen)

    # Offloaded variants of every checkpointed candidate.
    for candidate in list(found.values()):
        if candidate.mode == "none":
            continue
        variant = CandidateProfile(
            candidate.name + "+offload", candidate.mode, candidate.kept_units, offload=True
        )
        with quiet_empty_offload():  # moving nothing here only means the variant is dropped
            isolated.measure_memory(variant)
        isolated.forget([variant])
        if variant.offloaded_bytes == 0:
            continue  # nothing above min_bytes to move: same as the candidate itself
        variant.layer_seconds = candidate.layer_seconds
        variant.extra_seconds = candidate.extra_seconds + _exposed_seconds(variant, bandwidth, overlap)
        found[(candidate.mode + "+offload", tuple(candidate.kept_units))] = variant
    say("offload")
    return list(found.values())


# ---------------------------------------------------------------------------------------------
# From a solution back to a config


def picked(profile: ModelProfile, choices: list[int] | tuple[int, ...]) -> list[CandidateProfile]:
    return [profile.type_of(index).candidates[choice] for index, choice in enumerate(choices)]


def config_for(profile: ModelProfile, choices: list[int] | tuple[int, ...]) -> RecomputeConfig:
    """The ``RecomputeConfig`` that installs one candidate per layer: the most common choice at
    the top level, the others as overrides, offloaded layers in one offload block."""
    chosen = picked(profile, choices)
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for index, candidate in enumerate(chosen):
        groups.setdefault((candidate.mode, tuple(candidate.kept_units)), []).append(index)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    (top_mode, top_kept), _ = ordered[0]
    data: dict[str, Any] = _choice(top_mode, top_kept)
    if len(ordered) > 1:
        data["overrides"] = [
            {"layers": format_indices(indices), **_choice(mode, kept)}
            for (mode, kept), indices in ordered[1:]
        ]
    offloaded = [index for index, candidate in enumerate(chosen) if candidate.offload]
    if offloaded:
        data["offload"] = {
            "layers": format_indices(offloaded),
            "layer_input": True,
            "min_bytes": profile.min_bytes,
        }
        if any(chosen[i].kept_units for i in offloaded):
            data["offload"]["units"] = "kept"
    return RecomputeConfig.from_dict(data, source="planner")


def _choice(mode: str, kept: tuple[str, ...]) -> dict[str, Any]:
    if mode == "selective":
        return {"mode": "selective", "keep": list(kept)}
    return {"mode": mode}
