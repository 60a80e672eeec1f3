"""The storage tracker under ``MemoryMeter``: a dispatch mode that counts the storages first
returned inside its window and drops them again when they are freed, with a bounded timeline of
live bytes. Imports torch, the standard library and ``_torch_internals``.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from actplan._torch_internals import (
    DEVICE_QUERY,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    dtensor_shape_propagation,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
    modes_below,
    op_schema,
    storage_key_of,
)

_FREE_LABEL = "free"
_RESIZE_LABEL = "storage.resize_"
# These ops hand back a storage created outside the dispatcher (``torch.tensor(...)`` builds its
# data with dispatch disabled, then lifts it): their output is a fresh allocation even though the
# schema says it aliases the input.
_FRESH_DESPITE_ALIAS = frozenset({torch.ops.aten.lift_fresh.default})


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


_WRAPS: dict[Any, bool] = {}  # by an op's tensor types: whether a wrapper subclass is among them


def _is_wrapper_subclass(kind: type) -> bool:
    """A tensor subclass that wraps other tensors (DTensor), not a plain or fake tensor."""
    if kind is torch.Tensor or issubclass(kind, FakeTensor):
        return False
    return is_traceable_wrapper_subclass_type(kind)


class _SubclassWindow(TorchDispatchMode):
    """On the stack while a tensor subclass runs one op for ``StorageTracker``: it declines that
    op (a mode returning ``NotImplemented`` lets the dispatcher run the subclass next, with the
    mode back on the stack) and hands every op the subclass then runs to the tracker."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.declined = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.declined:
            self.declined = True
            return NotImplemented
        return self.tracker.__torch_dispatch__(func, types, args, kwargs)


class StorageTracker(TorchDispatchMode):
    """Dispatch mode that sees every op output and tracks storages first seen in its window.

    A storage is counted once, when an op that does not alias its inputs returns it; a weak
    reference drops it again when the C++ storage is freed (storage PyObjects are preserved
    while any tensor holds the storage, so the callback fires on the real free).
    """

    def __init__(
        self, timeline_cap: int, fake_mode: FakeTensorMode | None = None, trace: bool = False
    ) -> None:
        super().__init__()
        # A run on fake tensors (``FakeTensorMode``): its tensors are counted like real ones.
        # Fake tensors of any other mode (a compiler's tracing) are not allocations of the run.
        self.fake_mode = fake_mode
        # storage key -> [nbytes, weakref, allocating op, trace id, device type]; the weakref must live here
        # for its callback to fire, and dropping the dict disarms every callback at once.
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
        # With ``trace``: every allocation and free in order, as ``(op, id, nbytes, stream)``
        # (op 1 allocates, 0 frees), what the allocator model (``_allocator.replay``) replays.
        # ``stream`` numbers the device's current stream at the allocation (the caching
        # allocator keeps a pool per stream): 0 is the one current when the window opened,
        # FSDP2's all-gather and reduce-scatter streams (selected with the device module's
        # ``stream(...)``, as FSDP2 does on every device, the CPU's included) the next ones.
        self.events: list[tuple[int, int, int, int]] | None = [] if trace else None
        self._streams: dict[Any, int] = {}
        if trace:  # the streams current now are the compute streams
            for device_type in ("cpu", "cuda"):
                if device_type == "cpu" or torch.cuda.is_initialized():
                    self._streams.setdefault(self._stream_key(device_type), 0)
        self._serial = 0
        # Whether DTensor is propagating shapes now (its global-shape fake tensors are no
        # allocation), or None where torch offers no way to tell: then no subclass is entered.
        self._propagation: Any = None
        self._entered = 0
        self._propagating: Any = None

    def __enter__(self) -> StorageTracker:
        self._entered += 1
        if self._entered > 1:  # entered again while on the stack: the hook is open already
            return super().__enter__()
        self._propagation = dtensor_shape_propagation()
        self._propagating = self._propagation.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._close_propagation()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._entered == 1:
                self._close_propagation()
            else:
                self._entered -= 1

    def _close_propagation(self) -> None:
        self._entered = 0
        if self._propagation is not None:
            self._propagation.__exit__(None, None, None)
        self._propagation = self._propagating = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:
            return args[0].device
        kwargs = kwargs or {}
        if self._propagating is not None and self._propagating():
            return func(*args, **kwargs)
        if self._propagating is not None and self._may_enter_subclass(types):
            # A tensor subclass (DTensor) computes its result with ops on the tensors it wraps,
            # and a mode is off the stack while it runs: without the window, the subclass's
            # temporaries (a loss-parallel cross-entropy's, a redistribution's buffers) would
            # go unseen.
            with _SubclassWindow(self):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        info = self._op_info.get(func)
        if info is None:
            # Higher-order operators (compiled graphs' RNG wrappers) have no schema: fresh outputs.
            schema = op_schema(func)
            returns = schema.returns if schema is not None else ()
            returns_alias = any(ret.alias_info is not None for ret in returns)
            info = (returns_alias and func not in _FRESH_DESPITE_ALIAS, str(func))
            self._op_info[func] = info
        if isinstance(out, torch.Tensor):
            self._observe(out, info)
        elif isinstance(out, (tuple, list)):
            self._observe_all(out, info)
        return out

    @staticmethod
    def _may_enter_subclass(types: Iterable[type]) -> bool:
        """Whether an op on ``types`` is a wrapper subclass's (not a fake tensor's) whose own
        ops the tracker may watch: only when every mode below it hands such an op on untouched
        (a fake mode, which declines it, or one marked ``passes_subclass_ops``), so that no
        mode misses an op by the window's detour."""
        key = types if isinstance(types, tuple) else tuple(types)
        wraps = _WRAPS.get(key)
        if wraps is None:
            wraps = _WRAPS[key] = any(_is_wrapper_subclass(kind) for kind in key)
        if not wraps:
            return False
        return all(
            isinstance(mode, FakeTensorMode) or getattr(mode, "passes_subclass_ops", False)
            for mode in modes_below()
        )

    def _observe_all(self, outputs: Iterable[Any], info: tuple[bool, str]) -> None:
        for item in outputs:
            if isinstance(item, torch.Tensor):
                self._observe(item, info)
            elif isinstance(item, (tuple, list)):
                self._observe_all(item, info)

    def _observe(self, tensor: torch.Tensor, info: tuple[bool, str]) -> None:
        if type(tensor) is torch.Tensor:
            if tensor.is_meta:
                return
        elif isinstance(tensor, FakeTensor):
            if self.fake_mode is None or tensor.fake_mode is not self.fake_mode:
                return
            # Its device as a field: ``is_meta`` would ask the dispatcher (every mode's handler).
            if tensor.fake_device.type == "meta":
                return
        elif is_traceable_wrapper_subclass(tensor):
            # e.g. DTensor: the memory lives in the inner tensors it wraps.
            inner_names, _ = tensor.__tensor_flatten__()
            self._observe_all((getattr(tensor, name) for name in inner_names), info)
            return
        elif tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:
            # Sparse (and other storage-less) layouts: not counted.
            return
        key = storage_key_of(storage)
        entry = self.tracked.get(key)
        if entry is not None:
            if storage.nbytes() != entry[0]:  # resize_ on a storage we track
                self._resize(entry, storage.nbytes(), info[1])
            return
        returns_alias, label = info
        if returns_alias:
            # A view or in-place/out= result over a storage that predates the window.
            return
        self._track(key, storage, label, tensor.device.type)

    def _track(self, key: int, storage: torch.UntypedStorage, label: str, device_type: str) -> None:
        # The tensor's device: a fake tensor's storage is on the meta device.
        nbytes = storage.nbytes()
        with self.lock:
            ref = weakref.ref(storage, functools.partial(self._on_free, key))
            serial = self._allocation(nbytes, device_type) if self.events is not None else 0
            self.tracked[key] = [nbytes, ref, label, serial, device_type]
            self.saw_cuda = self.saw_cuda or storage.device.type == "cuda"
            self._change(nbytes, label)

    def _resize(self, entry: list[Any], nbytes: int, label: str) -> None:
        with self.lock:
            self._change(nbytes - entry[0], label)
            entry[0] = nbytes
            if self.events is not None:
                # A resize allocates the new size, copies, then frees the old block.
                old_id = entry[3]
                entry[3] = self._allocation(nbytes, entry[4]) if nbytes else 0
                self.events.append((0, old_id, 0, 0))

    def resized(self, tensor: torch.Tensor) -> None:
        """Follows a storage resized in place outside the dispatcher (``storage.resize_``, which
        FSDP2 uses to free and regrow unsharded parameters; see
        ``_torch_internals.watch_fsdp_storage_resizes``): regrown first in the window, it counts
        as allocated then; freed, its bytes leave the count."""
        if isinstance(tensor, FakeTensor) and tensor.fake_mode is not self.fake_mode:
            return
        storage = tensor.untyped_storage()
        key = storage_key_of(storage)
        entry = self.tracked.get(key)
        if entry is None:
            if storage.nbytes():  # a storage from before the window, freed in it: not counted
                self._track(key, storage, _RESIZE_LABEL, tensor.device.type)
        elif storage.nbytes() != entry[0]:
            self._resize(entry, storage.nbytes(), _RESIZE_LABEL)

    def _allocation(self, nbytes: int, device_type: str) -> int:
        """Records an allocation in the trace (callers hold ``self.lock`` and trace); its id."""
        self._serial += 1
        self.events.append((1, self._serial, nbytes, self._stream(device_type)))  # type: ignore[union-attr]
        return self._serial

    def _stream(self, device_type: str) -> int:
        return self._streams.setdefault(self._stream_key(device_type), len(self._streams))

    @staticmethod
    def _stream_key(device_type: str) -> Any:
        current = getattr(getattr(torch, device_type, None), "current_stream", None)
        if current is None:
            return None
        stream = current()
        # CUDA hands out a new Python object per call for the same stream: key by its id.
        return (device_type, getattr(stream, "stream_id", None) or id(stream))

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        with self.lock:
            entry = self.tracked.pop(key, None)
            if entry is not None:
                self._change(-entry[0], _FREE_LABEL)
                if self.events is not None:
                    self.events.append((0, entry[3], 0, 0))

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

    def live_bytes_by_op(self) -> dict[str, int]:
        """Live bytes grouped by the op that allocated each storage, largest first."""
        totals: dict[str, int] = {}
        with self.lock:
            for nbytes, _, label, *_ in self.tracked.values():
                totals[label] = totals.get(label, 0) + nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def disarm(self) -> None:
        """Stop tracking frees: drops every weakref so no callback outlives the window."""
        with self.lock:
            self.tracked.clear()


class CompiledCodeTracker(StorageTracker):
    """A storage tracker under which torch.compile runs compiled code (see ``MemoryMeter``'s
    ``run_compiled``): dynamo switches it off while compiling and on again while the compiled
    graph runs, so it sees the aten ops that graph dispatches, and the higher-order operators
    (``run_and_save_rng_state`` of a checkpointed region) whose outputs it then counts."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True
