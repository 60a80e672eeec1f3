"""Measurement for actplan: a device-independent memory meter, an interleaved step timer and
gradient-parity checks. A leaf module (torch and stdlib only) used by the benchmarks and the CLI
to prove a plan saves memory, to price its overhead, and to prove it changes no gradient.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    "GradCensus",
    "MarkSample",
    "MemoryMeter",
    "MemoryReport",
    "OpCounter",
    "ParityReport",
    "RatioStats",
    "SavedTensorMeter",
    "StepCapture",
    "TimingStats",
    "capture_step",
    "compare_steps",
    "grad_census",
    "interleaved_timing",
    "ratio",
]

# ---------------------------------------------------------------------------------------------
# Memory meter
# ---------------------------------------------------------------------------------------------

DEFAULT_TIMELINE_CAP = 4096
_FREE_LABEL = "free"
# These ops hand back a storage created outside the dispatcher (``torch.tensor(...)`` builds its
# data with dispatch disabled, then lifts it): their output is a fresh allocation even though the
# schema says it aliases the input.
_FRESH_DESPITE_ALIAS = frozenset({torch.ops.aten.lift_fresh.default})


@dataclass(frozen=True)
class MarkSample:
    """Tracked live bytes at a named point, split by what the storages hold."""

    live_bytes: int
    activation_bytes: int
    grad_bytes: int
    optimizer_bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """What a :class:`MemoryMeter` window saw.

    ``param_bytes``, ``grad_bytes`` and ``optimizer_bytes`` are resident at entry (unique
    storages). ``peak_live_bytes`` is the maximum of bytes allocated inside the window and still
    alive; ``peak_bytes`` adds the resident bytes at entry. ``end`` classifies what was still
    alive at exit (or now, while the window is open).
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    peak_live_bytes: int
    peak_bytes: int
    peak_label: str | None
    marks: dict[str, MarkSample]
    end: MarkSample
    timeline: list[tuple[str, int]]
    cuda_max_allocated_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Timeline:
    """Bounded (label, live_bytes) samples that keep peaks and marks when decimated.

    Once ``cap`` samples are stored, adjacent pairs are merged (the larger sample survives, and
    marks survive while they are under half the cap) and later changes are bucketed ``stride`` at
    a time, keeping each bucket's largest sample, so a long run costs O(cap) memory while the
    peak stays visible.
    """

    def __init__(self, cap: int) -> None:
        if cap < 2:
            raise ValueError(f"timeline cap must be at least 2, got {cap}; pass a larger timeline_cap")
        self.cap = cap
        self.samples: list[tuple[str, int, bool]] = []
        self.stride = 1
        self._bucket_count = 0
        self._bucket_best: tuple[str, int, bool] | None = None

    def record(self, label: str, live_bytes: int) -> None:
        best = self._bucket_best
        if best is None or live_bytes > best[1]:
            self._bucket_best = (label, live_bytes, False)
        self._bucket_count += 1
        if self._bucket_count >= self.stride:
            self._flush()

    def record_mark(self, label: str, live_bytes: int) -> None:
        self._flush()
        self._append((label, live_bytes, True))

    def as_list(self) -> list[tuple[str, int]]:
        pending = [self._bucket_best] if self._bucket_best is not None else []
        return [(label, live) for label, live, _ in self.samples + pending]

    def _flush(self) -> None:
        if self._bucket_best is not None:
            self._append(self._bucket_best)
        self._bucket_best = None
        self._bucket_count = 0

    def _append(self, sample: tuple[str, int, bool]) -> None:
        self.samples.append(sample)
        if len(self.samples) >= self.cap:
            self._decimate()

    def _decimate(self) -> None:
        # Marks are protected only while they are a minority, so the list always shrinks.
        protect_marks = sum(is_mark for _, _, is_mark in self.samples) < self.cap // 2
        kept: list[tuple[str, int, bool]] = []
        for first, second in zip(self.samples[::2], self.samples[1::2], strict=False):
            if protect_marks and (first[2] or second[2]):
                kept.extend(s for s in (first, second) if s[2] or s[1] >= max(first[1], second[1]))
            else:
                kept.append(first if first[1] >= second[1] else second)
        if len(self.samples) % 2:
            kept.append(self.samples[-1])
        self.samples = kept
        self.stride *= 2


class _StorageTracker(TorchDispatchMode):
    """Dispatch mode that sees every op output and tracks storages first seen in its window.

    A storage is counted once, when an op that does not alias its inputs returns it; a weak
    reference drops it again when the C++ storage is freed (storage PyObjects are preserved
    while any tensor holds the storage, so the callback fires on the real free).
    """

    def __init__(self, timeline_cap: int) -> None:
        super().__init__()
        # storage key -> [nbytes, weakref]; the weakref must live here for its
        # callback to fire, and dropping the dict disarms every callback at once.
        self.tracked: dict[int, list[Any]] = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.peak_label: str | None = None
        self.saw_cuda = False
        self.timeline = _Timeline(timeline_cap)
        # Reentrant: a garbage collection triggered while we hold the lock can free a storage
        # and run our callback on the same thread.
        self.lock = threading.RLock()
        self._op_info: dict[Any, tuple[bool, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        info = self._op_info.get(func)
        if info is None:
            # Higher-order operators (compiled graphs' RNG wrappers) have no schema: fresh outputs.
            returns = func._schema.returns if hasattr(func, "_schema") else ()
            returns_alias = any(ret.alias_info is not None for ret in returns)
            info = (returns_alias and func not in _FRESH_DESPITE_ALIAS, str(func))
            self._op_info[func] = info
        if isinstance(out, torch.Tensor):
            self._observe(out, info)
        elif isinstance(out, (tuple, list)):
            self._observe_all(out, info)
        return out

    def _observe_all(self, outputs: Iterable[Any], info: tuple[bool, str]) -> None:
        for item in outputs:
            if isinstance(item, torch.Tensor):
                self._observe(item, info)
            elif isinstance(item, (tuple, list)):
                self._observe_all(item, info)

    def _observe(self, tensor: torch.Tensor, info: tuple[bool, str]) -> None:
        if type(tensor) is not torch.Tensor:
            if isinstance(tensor, FakeTensor):
                return
            if is_traceable_wrapper_subclass(tensor):
                # e.g. DTensor: the memory lives in the inner tensors it wraps.
                inner_names, _ = tensor.__tensor_flatten__()
                self._observe_all((getattr(tensor, name) for name in inner_names), info)
                return
        if tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:
            # Sparse (and other storage-less) layouts: not counted.
            return
        key = storage._cdata
        entry = self.tracked.get(key)
        if entry is not None:
            nbytes = storage.nbytes()
            if nbytes != entry[0]:  # resize_ on a storage we track
                with self.lock:
                    self._change(nbytes - entry[0], info[1])
                    entry[0] = nbytes
            return
        returns_alias, label = info
        if returns_alias:
            # A view or in-place/out= result over a storage that predates the window.
            return
        nbytes = storage.nbytes()
        device_type = storage.device.type
        with self.lock:
            ref = weakref.ref(storage, functools.partial(self._on_free, key))
            self.tracked[key] = [nbytes, ref]
            self.saw_cuda = self.saw_cuda or device_type == "cuda"
            self._change(nbytes, label)

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        with self.lock:
            entry = self.tracked.pop(key, None)
            if entry is not None:
                self._change(-entry[0], _FREE_LABEL)

    def _change(self, delta: int, label: str) -> None:
        """Apply a change of live bytes; callers hold ``self.lock``."""
        self.live_bytes += delta
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
            self.peak_label = label
        self.timeline.record(label, self.live_bytes)

    def live_storages(self) -> dict[int, int]:
        with self.lock:
            return {key: entry[0] for key, entry in self.tracked.items()}

    def disarm(self) -> None:
        """Stop tracking frees: drops every weakref so no callback outlives the window."""
        with self.lock:
            self.tracked.clear()


class _CompiledCodeTracker(_StorageTracker):
    """A storage tracker under which torch.compile runs compiled code (see ``MemoryMeter``'s
    ``run_compiled``): dynamo switches it off while compiling and on again while the compiled
    graph runs, so it sees the aten ops that graph dispatches, and the higher-order operators
    (``run_and_save_rng_state`` of a checkpointed region) whose outputs it then counts."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _storage_key(tensor: torch.Tensor) -> int | None:
    if tensor.is_meta or isinstance(tensor, FakeTensor):
        return None
    return tensor.untyped_storage()._cdata


def _unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for tensor in tensors:
        key = _storage_key(tensor)
        if key is not None and key not in sizes:
            sizes[key] = tensor.untyped_storage().nbytes()
    return sizes


class MemoryMeter:
    """Live bytes of tensor storages allocated while the meter is active, on any device.

    Use as a context manager around a training step, entered *outside* any checkpointing or
    selective-checkpoint context (their own dispatch modes then run inside ours, and we see the
    real allocations beneath them, including those of the backward pass)::

        with MemoryMeter(model, optimizer) as meter:
            loss = model(batch).sum()
            meter.mark("forward_end")
            loss.backward()
            optimizer.step()
        report = meter.report()

    Only storages first returned by an op inside the window are tracked; views and in-place or
    ``out=`` results share a storage and never add bytes. Each ``with`` block is one window;
    entering again starts afresh.

    Blind spots: logical storage bytes, not allocator blocks (no CUDA rounding or
    fragmentation; ``cuda_max_allocated_bytes`` is the cross-check); growth by ``resize_`` of a
    storage that predates the window (FSDP2 reuses unsharded-parameter storages that way);
    sparse tensors; and compiled code. By default torch.compile does not run compiled code while
    a dispatch mode is active: a compiled region runs, and is measured, as its eager equivalent,
    and on torch 2.13 dynamo then keeps running that region eagerly after the meter has gone.
    With ``run_compiled=True`` compiled regions run compiled inside the window and the meter
    counts the storages returned by the aten ops they dispatch: every allocation of a graph
    compiled with ``backend="aot_eager"``, which runs aten ops; Inductor's generated kernels are
    not aten ops, so use ``run_compiled`` with aot_eager graphs only.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        timeline_cap: int = DEFAULT_TIMELINE_CAP,
        run_compiled: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.timeline_cap = timeline_cap
        self.run_compiled = run_compiled
        # The latest window's tracker; it stays readable after exit for report().
        self._tracker: _StorageTracker | None = None
        self._active = False
        self._marks: dict[str, MarkSample] = {}
        self._end: MarkSample | None = None
        self._param_bytes = 0
        self._grad_bytes = 0
        self._optimizer_bytes = 0
        self._resident_bytes = 0
        self._cuda_base_allocated: int | None = None
        self._cuda_max_allocated: int | None = None

    def __enter__(self) -> MemoryMeter:
        if self._active:
            raise RuntimeError("MemoryMeter is already active; a meter measures one window at a time")
        params = self._parameters()
        param_sizes = _unique_storage_bytes(params)
        grad_sizes = _unique_storage_bytes(p.grad for p in params if p.grad is not None)
        optimizer_sizes = _unique_storage_bytes(self._optimizer_state_tensors())
        self._param_bytes = sum(param_sizes.values())
        self._grad_bytes = sum(grad_sizes.values())
        self._optimizer_bytes = sum(optimizer_sizes.values())
        self._resident_bytes = sum({**optimizer_sizes, **grad_sizes, **param_sizes}.values())
        self._marks = {}
        self._end = None
        self._cuda_max_allocated = None
        self._cuda_base_allocated = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self._cuda_base_allocated = torch.cuda.memory_allocated()
        tracker_type = _CompiledCodeTracker if self.run_compiled else _StorageTracker
        self._tracker = tracker_type(self.timeline_cap)
        self._tracker.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        tracker = self._active_tracker("__exit__")
        tracker.__exit__(*exc_info)
        self._end = self._classify(tracker)
        if tracker.saw_cuda:
            # CUDA first initialised inside the window started its peak statistics there, at 0.
            base = self._cuda_base_allocated or 0
            self._cuda_max_allocated = torch.cuda.max_memory_allocated() - base
        tracker.disarm()
        self._active = False

    def mark(self, label: str) -> MarkSample:
        """Snapshot and classify live tracked bytes under ``label``. A repeated label keeps its
        latest sample in ``marks``; the timeline keeps every one."""
        tracker = self._active_tracker("mark")
        sample = self._classify(tracker)
        self._marks[label] = sample
        with tracker.lock:
            tracker.timeline.record_mark(label, sample.live_bytes)
        return sample

    @property
    def live_bytes(self) -> int:
        """Bytes allocated in the current window that are still alive."""
        return self._active_tracker("live_bytes").live_bytes

    def report(self) -> MemoryReport:
        """The latest window's figures; inside the window, a snapshot of it so far."""
        tracker = self._tracker
        if tracker is None:
            raise RuntimeError("MemoryMeter has measured nothing yet; run a step inside `with meter:` first")
        end = self._classify(tracker) if self._active else self._end
        if end is None:  # __exit__ sets it whenever a window closes
            raise RuntimeError(
                "internal error: MemoryMeter's window closed without its end figures; please report it"
            )
        return MemoryReport(
            param_bytes=self._param_bytes,
            grad_bytes=self._grad_bytes,
            optimizer_bytes=self._optimizer_bytes,
            peak_live_bytes=tracker.peak_live_bytes,
            peak_bytes=self._resident_bytes + tracker.peak_live_bytes,
            peak_label=tracker.peak_label,
            marks=dict(self._marks),
            end=end,
            timeline=tracker.timeline.as_list(),
            cuda_max_allocated_bytes=self._cuda_max_allocated,
        )

    def _parameters(self) -> list[nn.Parameter]:
        if self.model is not None:
            return list(self.model.parameters())
        if self.optimizer is not None:
            return [p for group in self.optimizer.param_groups for p in group["params"]]
        return []

    def _optimizer_state_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]

    def _classify(self, tracker: _StorageTracker) -> MarkSample:
        live = tracker.live_storages()
        grad_keys = {_storage_key(p.grad) for p in self._parameters() if p.grad is not None}
        optimizer_keys = {_storage_key(t) for t in self._optimizer_state_tensors()} - grad_keys
        grad_bytes = sum(n for key, n in live.items() if key in grad_keys)
        optimizer_bytes = sum(n for key, n in live.items() if key in optimizer_keys)
        live_bytes = sum(live.values())
        return MarkSample(
            live_bytes=live_bytes,
            activation_bytes=live_bytes - grad_bytes - optimizer_bytes,
            grad_bytes=grad_bytes,
            optimizer_bytes=optimizer_bytes,
        )

    def _active_tracker(self, what: str) -> _StorageTracker:
        if not self._active or self._tracker is None:
            raise RuntimeError(f"MemoryMeter.{what} used outside its window; use it inside `with meter:`")
        return self._tracker


class SavedTensorMeter:
    """Bytes of the distinct storages autograd saves for backward inside the window.

    For compiled code, where a dispatch-mode meter sees nothing of what the compiled graph
    allocates: a compiled region saves its activations through ``save_for_backward``, which
    saved-tensor hooks see, and those are what a plan changes. Storages of ``model``'s
    parameters and buffers (and parameters anywhere) are left out. In eager selective
    checkpointing the cached outputs bypass these hooks (torch 2.13); use ``MemoryMeter``
    there.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self.storages: dict[int, int] = {}
        self._owned: set[int] = set()
        self._hooks: Any = None

    def __enter__(self) -> SavedTensorMeter:
        if self.model is not None:
            self._owned = {
                t.untyped_storage()._cdata for t in (*self.model.parameters(), *self.model.buffers())
            }
        self.storages.clear()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter) and type(tensor) is torch.Tensor and not tensor.is_meta:
            storage = tensor.untyped_storage()
            if storage._cdata not in self._owned:
                self.storages[storage._cdata] = storage.nbytes()
        return tensor

    @property
    def saved_bytes(self) -> int:
        return sum(self.storages.values())


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class OpCounter(TorchDispatchMode):
    """Counts every op that actually executes while active, by ``OpOverload``.

    Enter it outside checkpointing: ops a selective-checkpoint cache serves in
    recompute never reach it, so the counts prove what was replayed and what was
    not. Counting at the dispatcher (not in Python) also sees ops that a replay
    reruns without rerunning the Python around them, e.g. collectives.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, func: Any) -> int:
        return self.counts[func]


# ---------------------------------------------------------------------------------------------
# Timer
# ---------------------------------------------------------------------------------------------


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of already sorted values."""
    position = q * (len(sorted_values) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * (position - lower)


def _relative_spread(q25: float, q75: float, median: float) -> float:
    iqr = q75 - q25
    if median == 0:
        return 0.0 if iqr == 0 else math.inf
    return iqr / abs(median)


@dataclass(frozen=True)
class TimingStats:
    """Per-run wall times in seconds, in round order, with order statistics.

    ``spread`` is the interquartile range relative to the median (0.05 = 5 %).
    """

    samples: list[float]
    median: float
    q25: float
    q75: float
    min: float
    max: float
    spread: float

    @classmethod
    def from_samples(cls, samples: Iterable[float]) -> TimingStats:
        values = list(samples)
        if not values:
            raise ValueError("TimingStats needs at least one sample; run with repeats >= 1")
        ordered = sorted(values)
        median, q25, q75 = (_quantile(ordered, q) for q in (0.5, 0.25, 0.75))
        return cls(
            samples=values,
            median=median,
            q25=q25,
            q75=q75,
            min=ordered[0],
            max=ordered[-1],
            spread=_relative_spread(q25, q75, median),
        )


@dataclass(frozen=True)
class RatioStats:
    """Per-round ratios ``a / b`` of two paired timings, with their median and quartiles."""

    samples: list[float]
    median: float
    q25: float
    q75: float
    spread: float


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def interleaved_timing(
    runs: Mapping[str, Callable[[], None]],
    *,
    repeats: int,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    max_repeats: int | None = None,
    settled: Callable[[Mapping[str, list[float]]], bool] | None = None,
) -> dict[str, TimingStats]:
    """Time every callable in ``runs`` in interleaved rounds so drift hits all of them alike.

    ``warmup`` untimed rounds come first, then ``repeats`` timed rounds; each round runs every
    callable once, the order rotated by one each round (A B C, B C A, C A B, ...). Sample ``i``
    of every result comes from round ``i``, so results can be paired with :func:`ratio`.
    With ``settled``, timing is adaptive: after ``repeats`` rounds, further rounds run until
    ``settled(samples)`` is true or ``max_repeats`` rounds are done.
    ``progress(name)`` is called after every run, warm-up included. On CUDA each run is
    bracketed by ``torch.cuda.synchronize()``.
    """
    if not runs:
        raise ValueError("interleaved_timing needs at least one callable in `runs`")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    last = repeats if max_repeats is None else max_repeats
    if last < repeats:
        raise ValueError(f"max_repeats ({max_repeats}) must be at least repeats ({repeats})")
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + last):
        timed = round_index - warmup
        if timed >= repeats and (settled is None or settled(samples)):
            break
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize = _cuda_in_use()
            if synchronize:
                torch.cuda.synchronize()
            start = time.perf_counter()
            runs[name]()
            if synchronize:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                samples[name].append(elapsed)
            if progress is not None:
                progress(name)
    return {name: TimingStats.from_samples(samples[name]) for name in names}


def ratio(stats_a: TimingStats, stats_b: TimingStats) -> RatioStats:
    """Ratio of ``stats_a`` to ``stats_b`` (e.g. checkpointed / baseline), paired by round."""
    if len(stats_a.samples) != len(stats_b.samples):
        raise ValueError(
            f"cannot pair timings of {len(stats_a.samples)} and {len(stats_b.samples)} rounds; "
            "take both from the same interleaved_timing call"
        )
    if any(b <= 0 for b in stats_b.samples):
        raise ValueError(
            f"the denominator timing has a non-positive sample ({min(stats_b.samples)} s), so it cannot "
            "be a ratio base; time a run that takes measurable time (a larger step, or more work per "
            "round) and pass its TimingStats second"
        )
    per_round = [a / b for a, b in zip(stats_a.samples, stats_b.samples, strict=True)]
    ordered = sorted(per_round)
    median, q25, q75 = (_quantile(ordered, q) for q in (0.5, 0.25, 0.75))
    return RatioStats(
        samples=per_round, median=median, q25=q25, q75=q75, spread=_relative_spread(q25, q75, median)
    )


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradCensus:
    """Every parameter by the state of its gradient: some non-zero, all zero, or ``None``."""

    nonzero: frozenset[str]
    zero: frozenset[str]
    none: frozenset[str]

    def category(self, name: str) -> str:
        for category in ("nonzero", "zero", "none"):
            if name in getattr(self, category):
                return category
        raise KeyError(f"parameter {name!r} is not in this census")


def _grad_category(grad: torch.Tensor | None) -> str:
    if grad is None:
        return "none"
    # NaN != 0, so a NaN gradient counts as non-zero: it is present, just wrong.
    return "nonzero" if bool((grad != 0).any()) else "zero"


def _census_of(grads: Mapping[str, torch.Tensor | None]) -> GradCensus:
    by_category: dict[str, set[str]] = {"nonzero": set(), "zero": set(), "none": set()}
    for name, grad in grads.items():
        by_category[_grad_category(grad)].add(name)
    return GradCensus(**{category: frozenset(names) for category, names in by_category.items()})


def grad_census(model: nn.Module) -> GradCensus:
    """Classify every parameter of ``model`` (frozen ones included: their grad is ``None``)."""
    return _census_of({name: param.grad for name, param in model.named_parameters()})


@dataclass(frozen=True)
class StepCapture:
    """Detached copies of one step's loss, gradients and chosen extras (e.g. router choices)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    census: GradCensus
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def capture_step(
    model: nn.Module, loss: torch.Tensor, extras: Mapping[str, torch.Tensor] | None = None
) -> StepCapture:
    """Copy the loss, every parameter's gradient and ``extras``; call after ``backward()``."""
    grads = {
        name: None if param.grad is None else param.grad.detach().clone()
        for name, param in model.named_parameters()
    }
    return StepCapture(
        loss=loss.detach().clone(),
        grads=grads,
        census=_census_of(grads),
        extras={key: value.detach().clone() for key, value in (extras or {}).items()},
    )


@dataclass(frozen=True)
class ParityReport:
    """How a candidate step differs from a baseline step; ``ok`` when nothing does."""

    loss_identical: bool
    loss_abs_diff: float
    max_abs_grad_diff: float
    worst_param: str | None
    grad_mismatches: list[str]
    census_match: bool
    census_diff: dict[str, list[str]]
    extras_match: bool
    extras_mismatches: list[str]
    grad_atol: float
    loss_atol: float
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict; non-finite floats become the strings "inf"/"nan"."""
        return {key: _json_safe(value) for key, value in asdict(self).items()}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise |a - b| in float64; equal values (inf included) and NaN-vs-NaN count
    as 0, NaN against a number as inf."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a64 = a.detach().to(torch.float64)
    b64 = b.detach().to(device=a.device, dtype=torch.float64)
    diff = (a64 - b64).abs()
    diff = torch.where(a64 == b64, torch.zeros_like(diff), diff)
    diff = torch.where(a64.isnan() & b64.isnan(), torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf)
    return float(diff.max().item())


def _tensors_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))


def compare_steps(
    baseline: StepCapture,
    candidate: StepCapture,
    *,
    grad_atol: float = 0.0,
    loss_atol: float = 0.0,
) -> ParityReport:
    """Compare two captures of the same model's step (e.g. no checkpointing vs a plan).

    With the default tolerances of 0 the loss must be identical and every gradient equal
    elementwise; pass tolerances for compiled or low-precision runs.
    """
    baseline_names, candidate_names = set(baseline.grads), set(candidate.grads)
    if baseline_names != candidate_names:
        only_baseline = sorted(baseline_names - candidate_names)[:5]
        only_candidate = sorted(candidate_names - baseline_names)[:5]
        raise ValueError(
            "the captures come from models with different parameters "
            f"(only in baseline: {only_baseline}, only in candidate: {only_candidate}); "
            "compare two steps of the same model architecture"
        )

    loss_identical = _tensors_identical(baseline.loss, candidate.loss)
    loss_abs_diff = _max_abs_diff(baseline.loss, candidate.loss)

    max_abs_grad_diff = 0.0
    worst_param: str | None = None
    grad_mismatches: list[str] = []
    for name in sorted(baseline_names):
        base_grad, cand_grad = baseline.grads[name], candidate.grads[name]
        if base_grad is None and cand_grad is None:
            continue
        if base_grad is None or cand_grad is None:
            grad_mismatches.append(name)
            continue
        diff = _max_abs_diff(base_grad, cand_grad)
        if diff > max_abs_grad_diff:
            max_abs_grad_diff, worst_param = diff, name
        if diff > grad_atol:
            grad_mismatches.append(name)

    census_diff: dict[str, list[str]] = {}
    for name in sorted(baseline_names):
        before, after = baseline.census.category(name), candidate.census.category(name)
        if before != after:
            census_diff.setdefault(f"{before}->{after}", []).append(name)

    extras_mismatches = sorted(
        key
        for key in set(baseline.extras) | set(candidate.extras)
        if key not in baseline.extras
        or key not in candidate.extras
        or not _tensors_identical(baseline.extras[key], candidate.extras[key])
    )

    loss_ok = loss_identical or loss_abs_diff <= loss_atol
    ok = loss_ok and not grad_mismatches and not census_diff and not extras_mismatches
    return ParityReport(
        loss_identical=loss_identical,
        loss_abs_diff=loss_abs_diff,
        max_abs_grad_diff=max_abs_grad_diff,
        worst_param=worst_param,
        grad_mismatches=grad_mismatches,
        census_match=not census_diff,
        census_diff=census_diff,
        extras_match=not extras_mismatches,
        extras_mismatches=extras_mismatches,
        grad_atol=grad_atol,
        loss_atol=loss_atol,
        ok=ok,
    )
