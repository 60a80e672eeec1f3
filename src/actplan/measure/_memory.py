"""The memory meters: ``MemoryMeter`` (live bytes of the storages a step allocates, on any
device, split into activations, gradients and optimizer state) and ``SavedTensorMeter`` (the
bytes autograd saves for backward, for compiled code). Imports ``_tracker`` and
``actplan._storage``; plus torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from actplan._storage import owned_storages, storage_key
from actplan._torch_internals import (
    FakeTensor,
    FakeTensorMode,
    is_traceable_wrapper_subclass,
    modes_below,
    storage_key_of,
    watch_fsdp_storage_resizes,
)
from actplan.measure._fake import fake_mode_of
from actplan.measure._tracker import CompiledCodeTracker, StorageTracker

DEFAULT_TIMELINE_CAP = 4096


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


def _storage_key(tensor: torch.Tensor) -> int | None:
    # Fake tensors have (meta) storages shared by their views, so they count like real ones.
    return None if tensor.is_meta and not isinstance(tensor, FakeTensor) else storage_key(tensor)


def active_fake_mode() -> FakeTensorMode | None:
    """The innermost ``FakeTensorMode`` on the dispatch stack now, or None outside one."""
    for mode in reversed(modes_below()):
        if isinstance(mode, FakeTensorMode):
            return mode
    return None


def _plain(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """The tensors that hold memory: subclasses (DTensor) by the tensors they wrap."""
    for tensor in tensors:
        subclass = type(tensor) is not torch.Tensor and not isinstance(tensor, FakeTensor)
        if subclass and is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            inner = (getattr(tensor, name) for name in names)
            yield from _plain(t for t in inner if isinstance(t, torch.Tensor))
        else:
            yield tensor


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage among ``tensors`` (subclasses by the tensors they wrap),
    by storage key."""
    sizes: dict[int, int] = {}
    for tensor in _plain(tensors):
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
    fragmentation; ``cuda_max_allocated_bytes`` is the cross-check, and with
    ``trace_allocations=True`` the window's allocations and frees, in order, replay through
    the caching-allocator model); FSDP2's unsharded parameters, which it frees and regrows by
    resizing their storages in place, unless ``follow_fsdp=True`` (then they count from each
    all-gather to each reshard, and activation figures include them); sparse tensors; and
    compiled code. By default torch.compile does not run compiled code while a dispatch mode
    is active: a compiled region runs, and is measured, as its eager equivalent,
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
        trace_allocations: bool = False,
        follow_fsdp: bool = False,
    ) -> None:
        self.model = model
        self.trace_allocations = trace_allocations
        self.follow_fsdp = follow_fsdp
        self.optimizer = optimizer
        self.timeline_cap = timeline_cap
        self.run_compiled = run_compiled
        # The latest window's tracker; it stays readable after exit for report().
        self._tracker: StorageTracker | None = None
        self._active = False
        self._marks: dict[str, MarkSample] = {}
        self._end: MarkSample | None = None
        self._param_bytes = 0
        self._grad_bytes = 0
        self._optimizer_bytes = 0
        self._resident_bytes = 0
        self._cuda_base_allocated: int | None = None
        self._cuda_max_allocated: int | None = None
        self._resizes: Any = None
        self.trace_marks: dict[str, int] = {}

    def __enter__(self) -> MemoryMeter:
        if self._active:
            raise RuntimeError("MemoryMeter is already active; a meter measures one window at a time")
        params = self._parameters()
        param_sizes = unique_storage_bytes(params)
        grad_sizes = unique_storage_bytes(p.grad for p in params if p.grad is not None)
        optimizer_sizes = unique_storage_bytes(self._optimizer_state_tensors())
        self._param_bytes = sum(param_sizes.values())
        self._grad_bytes = sum(grad_sizes.values())
        self._optimizer_bytes = sum(optimizer_sizes.values())
        self._resident_bytes = sum({**optimizer_sizes, **grad_sizes, **param_sizes}.values())
        self._marks = {}
        # With trace_allocations: where each mark fell in the allocation trace (its length then).
        self.trace_marks: dict[str, int] = {}
        self._end = None
        self._cuda_max_allocated = None
        self._cuda_base_allocated = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self._cuda_base_allocated = torch.cuda.memory_allocated()
        tracker_type = CompiledCodeTracker if self.run_compiled else StorageTracker
        # A meter with no fake model inside a fake run (``FakeRun``) counts the run's tensors.
        fake_mode = fake_mode_of(params) or active_fake_mode()
        self._tracker = tracker_type(self.timeline_cap, fake_mode, self.trace_allocations)
        follow = watch_fsdp_storage_resizes(self._tracker.resized) if self.follow_fsdp else None
        self._resizes = follow or contextlib.nullcontext()
        self._resizes.__enter__()
        self._tracker.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        tracker = self._active_tracker("__exit__")
        tracker.__exit__(*exc_info)
        self._resizes.__exit__(*exc_info)
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
            if tracker.events is not None:
                self.trace_marks[label] = len(tracker.events)
        return sample

    def live_bytes_by_op(self) -> dict[str, int]:
        """Bytes allocated in the current window and still alive, by the op that allocated each
        storage (``aten.addmm.default``, ...), largest first: what makes up the live bytes now."""
        return self._active_tracker("live_bytes_by_op").live_bytes_by_op()

    def allocation_trace(self) -> list[tuple[int, int, int, int]]:
        """The latest window's allocations and frees in order, as ``(op, id, nbytes, stream)``
        (op 1 allocates ``nbytes`` under ``id``, op 0 frees ``id``), for the caching-allocator
        model (``measure.replay_allocations``). Needs ``trace_allocations=True``."""
        if self._tracker is None or self._tracker.events is None:
            raise RuntimeError(
                "this MemoryMeter kept no allocation trace; make it with trace_allocations=True "
                "and run a window first"
            )
        with self._tracker.lock:
            return list(self._tracker.events)

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

    def _classify(self, tracker: StorageTracker) -> MarkSample:
        live = tracker.live_storages()
        grads = _plain(p.grad for p in self._parameters() if p.grad is not None)
        grad_keys = {_storage_key(g) for g in grads}
        optimizer_keys = {_storage_key(t) for t in _plain(self._optimizer_state_tensors())} - grad_keys
        grad_bytes = sum(n for key, n in live.items() if key in grad_keys)
        optimizer_bytes = sum(n for key, n in live.items() if key in optimizer_keys)
        live_bytes = sum(live.values())
        return MarkSample(
            live_bytes=live_bytes,
            activation_bytes=live_bytes - grad_bytes - optimizer_bytes,
            grad_bytes=grad_bytes,
            optimizer_bytes=optimizer_bytes,
        )

    def _active_tracker(self, what: str) -> StorageTracker:
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
            self._owned = owned_storages(self.model)
        self.storages.clear()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter) and type(tensor) is torch.Tensor and not tensor.is_meta:
            storage = tensor.untyped_storage()
            if storage_key_of(storage) not in self._owned:
                self.storages[storage_key_of(storage)] = storage.nbytes()
        return tensor

    @property
    def saved_bytes(self) -> int:
        return sum(self.storages.values())


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
