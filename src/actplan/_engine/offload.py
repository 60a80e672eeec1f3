"""Saved-tensor offload: move chosen saved activations to a host tier in forward, reload them in backward.

``OffloadEngine`` owns the host tier (a ``HostPool``), the copy streams and the per-step
bookkeeping. It reaches saved tensors two ways:

* autograd's ``saved_tensors_hooks``, installed around a layer by ``apply_offload``: the
  input a checkpointed layer saves (``layer_input``) and, in a layer that is not
  checkpointed, whatever autograd saves while an offloaded unit's interval is open;
* the outputs a checkpointed layer's kept units hold (``scoped.ScopedRegion`` hands them
  over when the layer's forward ends, in the group ``current_group`` names).

Each wrapped layer call is a *group*. In backward, the first use of a group reloads it
and prefetches the groups that ran just before it in forward. Storages are moved once,
however many views or layers save them. On CUDA, copies run on their own streams and
every hand-off between streams is guarded by an event; elsewhere the same code runs with
synchronous copies into a separate host pool, so everything except overlap is testable
on a CPU. Imports: ``markers`` (for the marker sink), ``sizes``, and ``boundary`` for the
instance-forward helpers both layer wrappers share; plus torch.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from actplan._engine.boundary import InstanceForward, RuntimeOnly, inner_forward, restore_forward
from actplan.markers import routing_markers
from actplan.sizes import DEFAULT_HOST_CAP_BYTES, DEFAULT_OFFLOAD_MIN_BYTES

__all__ = [
    "HostPool",
    "OffloadEngine",
    "OffloadStats",
    "OffloadedTensorMutatedError",
    "apply_offload",
    "is_offloaded",
    "remove_offload",
]

_STATE_ATTR = "_actplan_offload"
_MOVED_NOTHING = "moved nothing in this call"


@contextlib.contextmanager
def quiet_empty_offload() -> Iterator[None]:
    """Silence the engine's "offload of ... moved nothing" warning inside the block: for
    offload that actplan itself tries (the bench's offload rows, the profiler's offloaded
    candidates), where moving nothing is a finding, not the user's mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f".*offload of .* {_MOVED_NOTHING}", category=UserWarning)
        yield


class OffloadedTensorMutatedError(RuntimeError):
    """A saved tensor was changed in place after it was offloaded (autograd would also refuse it)."""


# ---------------------------------------------------------------------------------------------
# Host tier
# ---------------------------------------------------------------------------------------------


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its pool size class: eight classes per power of two, in steps of
    at least 512 B.

    Reusing buffers by class keeps the pool's reserved bytes flat across steps while wasting
    less than an eighth of a request (or 512 B, for small ones).
    """
    if nbytes <= 512:
        return 512
    step = max((1 << (nbytes.bit_length() - 1)) >> 3, 512)
    return -(-nbytes // step) * step


@dataclass
class HostBuffer:
    """A host-tier buffer of at least ``nbytes``; ``pooled`` is false for fallback allocations."""

    tensor: torch.Tensor
    nbytes: int
    pooled: bool
    pinned: bool


def _done(event: Any) -> bool:
    return event is None or event.query()


def _wait(event: Any) -> None:
    if event is not None:
        event.synchronize()


class HostPool:
    """Host-tier buffers with a byte cap, reused by size class.

    Args:
        cap_bytes: most bytes the pool reserves. Past it, a request evicts idle buffers of
            other classes, and if that is not enough it is served by a one-off pageable
            allocation outside the pool (a *fallback*, warned about once and counted).
        pin: page-lock buffers (CUDA); a pinning failure falls back to pageable memory.

    A released buffer carries the event of the last copy that reads or writes it; it is
    reused only once that event has completed.
    """

    def __init__(self, cap_bytes: int, *, pin: bool) -> None:
        if cap_bytes <= 0:
            raise ValueError(
                f"host pool cap must be positive, got {cap_bytes} bytes; pass a cap of at least one "
                "byte (offload.host_cap in a config, e.g. '16GiB')"
            )
        self.cap_bytes = cap_bytes
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        self._lock = threading.Lock()
        # Releases wait here until someone holds the lock: a release can come from a finalizer
        # (``_Moved.__del__``) that a garbage collection runs inside ``acquire``, on the thread
        # that already holds the lock. deque.append is atomic, so it needs no lock of its own.
        self._released: deque[tuple[HostBuffer, Any]] = deque()
        self.reserved_bytes = 0
        self._in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self._fallback_bytes_in_use = 0
        self.fallbacks = 0
        self.pin_failures = 0
        self.acquires = 0
        self.reuses = 0
        self._warned: set[str] = set()

    def acquire(self, nbytes: int) -> HostBuffer:
        size = size_class(nbytes)
        with self._lock:
            try:
                return self._acquire_locked(nbytes, size)
            finally:
                # Releases queued while the lock was held (by a finalizer run during allocation).
                self._apply_releases()

    def _acquire_locked(self, nbytes: int, size: int) -> HostBuffer:
        self._apply_releases()
        self.acquires += 1
        free = self._free.get(size)
        while free:
            tensor, event = free.pop()
            _wait(event)
            self.reuses += 1
            return self._hand_out(HostBuffer(tensor, nbytes, pooled=True, pinned=self.pin))
        if self.reserved_bytes + size > self.cap_bytes:
            self._evict(self.reserved_bytes + size - self.cap_bytes)
        if self.reserved_bytes + size > self.cap_bytes:
            self.fallbacks += 1
            self._warn_once(
                "cap",
                f"actplan offload: the host pool cap ({self.cap_bytes:,} bytes) is full, so a "
                f"{nbytes:,}-byte tensor goes to a one-off pageable buffer (slower copies, host "
                "memory outside the cap). Raise offload.host_cap or offload fewer tensors.",
            )
            return self._hand_out(HostBuffer(self._allocate(size, pin=False), nbytes, False, False))
        tensor, pinned = self._allocate_pooled(size)
        self.reserved_bytes += size
        return self._hand_out(HostBuffer(tensor, nbytes, pooled=True, pinned=pinned))

    def release(self, buffer: HostBuffer, event: Any = None) -> None:
        """Return ``buffer``; it is reused after ``event`` (its last copy) completes.

        Safe to call from a finalizer, on any thread, also while this thread is inside
        ``acquire``: it never waits for the pool's lock. The release is queued and applied
        by whoever holds the lock next (this call, if the lock is free).
        """
        self._released.append((buffer, event))
        if self._lock.acquire(blocking=False):
            try:
                self._apply_releases()
            finally:
                self._lock.release()

    def trim(self) -> int:
        """Drop every idle buffer; returns the bytes given back."""
        with self._lock:
            self._apply_releases()
            return self._evict(self.reserved_bytes)

    @property
    def in_use_bytes(self) -> int:
        """Bytes handed out and not yet released (pooled and fallback buffers)."""
        self._settle()
        return self._in_use_bytes

    @property
    def fallback_bytes_in_use(self) -> int:
        """Bytes of one-off pageable buffers handed out past the cap and not yet released."""
        self._settle()
        return self._fallback_bytes_in_use

    def _settle(self) -> None:
        if self._released:
            with self._lock:
                self._apply_releases()

    def _apply_releases(self) -> None:
        # Called with the lock held.
        while self._released:
            buffer, event = self._released.popleft()
            size = buffer.tensor.numel()
            self._in_use_bytes -= size
            if not buffer.pooled:
                self._fallback_bytes_in_use -= size
            else:
                self._free[size].append((buffer.tensor, event))

    def _hand_out(self, buffer: HostBuffer) -> HostBuffer:
        size = buffer.tensor.numel()
        self._in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self._in_use_bytes)
        if not buffer.pooled:
            self._fallback_bytes_in_use += size
        return buffer

    def _evict(self, wanted: int) -> int:
        freed = 0
        for size in sorted(self._free, reverse=True):
            entries = self._free[size]
            while entries and freed < wanted:
                _, event = entries.pop()
                _wait(event)
                self.reserved_bytes -= size
                freed += size
        return freed

    def _allocate_pooled(self, size: int) -> tuple[torch.Tensor, bool]:
        if not self.pin:
            return self._allocate(size, pin=False), False
        try:
            return self._allocate(size, pin=True), True
        except RuntimeError as err:
            self.pin_failures += 1
            self._warn_once(
                "pin",
                f"actplan offload: pinning a {size:,}-byte host buffer failed ({err}); using pageable "
                "memory, so copies will not overlap compute. Lower offload.host_cap.",
            )
            return self._allocate(size, pin=False), False

    @staticmethod
    def _allocate(size: int, *, pin: bool) -> torch.Tensor:
        # Host-tier memory is not device memory: keep it out of any dispatch-mode meter.
        with _disable_current_modes():
            return torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pin)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)


# ---------------------------------------------------------------------------------------------
# Copies: CUDA streams and events, or synchronous copies
# ---------------------------------------------------------------------------------------------


class _StreamCopies:
    """Device-to-host and host-to-device copies on their own CUDA streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.out_stream = torch.cuda.Stream(device)
        self.in_stream = torch.cuda.Stream(device)

    def copy_out(self, source: torch.Tensor, host: torch.Tensor) -> Any:
        # The copy starts after everything queued so far on the compute stream produced `source`.
        self.out_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.out_stream):
            host.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.out_stream)
        return event

    def copy_in(self, host: torch.Tensor, target: torch.Tensor, after: Any) -> Any:
        # `target` was just allocated on the compute stream: start once that stream gets here,
        # and once the copy-out that filled `host` has finished.
        self.in_stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            self.in_stream.wait_event(after)
        with torch.cuda.stream(self.in_stream):
            target.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.in_stream)
        return event

    def use(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` before it reads the reloaded tensor."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class _SyncCopies:
    """Copies that complete before they return (CPU, or a device without streams)."""

    @staticmethod
    def copy_out(source: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(source)

    @staticmethod
    def copy_in(host: torch.Tensor, target: torch.Tensor, after: Any) -> None:
        target.copy_(host)

    @staticmethod
    def use(event: Any) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Moved storages, handles and groups
# ---------------------------------------------------------------------------------------------


class _Moved:
    """One device storage copied to the host tier, and (after reload) back."""

    __slots__ = (
        "__weakref__",
        "copies",
        "copy_in",
        "copy_out",
        "device",
        "engine",
        "host",
        "mutated",
        "nbytes",
        "reloaded",
        "source",
        "version",
    )

    def __init__(self, engine: OffloadEngine, source: torch.Tensor, nbytes: int) -> None:
        self.engine = engine
        self.nbytes = nbytes
        self.copies = engine._copies_for(source.device)
        self.host: HostBuffer | None = engine.pool.acquire(nbytes)
        with _disable_current_modes():
            flat = torch.empty(0, dtype=torch.uint8, device=source.device).set_(source.untyped_storage())
            self.copy_out = self.copies.copy_out(flat, self.host.tensor[:nbytes])
            # An asynchronous copy keeps the device memory alive until it completes (an
            # event-guarded free, never a resize of the user's storage); the alias shares the
            # tensor's version counter, so an in-place write racing the copy is caught.
            self.source: torch.Tensor | None = source.detach() if self.copy_out is not None else None
        self.version = source._version
        self.mutated = False
        self.device = source.device
        self.copy_in: Any = None
        self.reloaded: torch.Tensor | None = None

    def start_reload(self) -> None:
        if self.reloaded is not None or self.host is None:
            return
        stats = self.engine.stats
        if not self.release_source_if_copied():
            # The copy-out is still running, so the data never left the device: use it and skip
            # the copy-in. The allocator must not reuse that memory before the copy-out stream
            # is done reading it, whenever the last view of it dies.
            self.reloaded = self.source
            self.source = None
            self.reloaded.record_stream(self.copies.out_stream)
            stats.bytes_reload_skipped += self.nbytes
        else:
            # Allocated through the dispatcher on purpose: a memory meter counts reloaded bytes.
            target = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self.copy_in = self.copies.copy_in(self.host.tensor[: self.nbytes], target, self.copy_out)
            self.reloaded = target
            stats.bytes_reloaded += self.nbytes
        # The host buffer goes back once the last copy touching it is done.
        self.engine.pool.release(self.host, self.copy_in if self.copy_in is not None else self.copy_out)
        self.host = None

    def release_source_if_copied(self) -> bool:
        if self.source is not None and _done(self.copy_out):
            self.mutated = self.source._version != self.version
            self.source = None
        return self.source is None

    def __del__(self) -> None:
        host = getattr(self, "host", None)
        if host is not None:
            self.engine.pool.release(host, self.copy_out)
            self.host = None


class _Handle:
    """What autograd (or the selective cache) holds instead of an offloaded tensor."""

    __slots__ = ("dtype", "group", "moved", "offset", "original", "size", "stride", "version")

    def __init__(self, moved: _Moved, tensor: torch.Tensor, group: _Group) -> None:
        self.moved = moved
        self.group = group
        self.dtype = tensor.dtype
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.offset = tensor.storage_offset()
        self.version = tensor._version
        self.original = weakref.ref(tensor)

    def materialize(self) -> torch.Tensor:
        moved = self.moved
        moved.release_source_if_copied()
        original = self.original()
        if moved.mutated or (original is not None and original._version != self.version):
            raise OffloadedTensorMutatedError(
                f"{self.group.name}: a tensor saved for backward (shape {list(self.size)}, {self.dtype}) "
                "was modified by an in-place operation after actplan offloaded it; backward needs "
                "its value at save time (autograd refuses this too). Make that update out-of-place, "
                "or do not offload this layer."
            )
        self.group.engine.ensure_loaded(self.group)
        moved.copies.use(moved.copy_in)
        return torch.empty(0, dtype=self.dtype, device=moved.device).set_(
            moved.reloaded.untyped_storage(), self.offset, self.size, self.stride
        )


class _Group:
    """The offloaded storages of one layer call."""

    __slots__ = (
        "__weakref__",
        "engine",
        "index",
        "loaded",
        "moved",
        "name",
        "pass_id",
        "position",
        "tensors",
    )

    def __init__(self, engine: OffloadEngine, name: str, index: int, pass_id: int) -> None:
        self.engine = engine
        self.name = name
        self.index = index
        self.pass_id = pass_id
        self.moved: dict[int, _Moved] = {}
        self.tensors = 0
        self.loaded = False
        self.position = index


@dataclass
class OffloadStats:
    """Cumulative counters since the engine was made or ``reset_stats`` was called."""

    bytes_offloaded: int = 0  # device-to-host, each storage once
    bytes_reloaded: int = 0  # host-to-device
    bytes_reload_skipped: int = 0  # copy-out still running at reload time: the device copy was used
    storages_moved: int = 0
    tensors_offloaded: int = 0  # saved tensors replaced by a handle (views counted each)
    dedup_hits: int = 0  # saved tensors whose storage had already been moved
    skipped_small: int = 0
    skipped_parameters: int = 0  # parameters and module buffers
    skipped_other: int = 0  # subclasses, conj/neg views, non-strided, host tensors on a GPU setup
    host_peak_bytes: int = 0
    host_in_use_bytes: int = 0
    host_reserved_bytes: int = 0
    host_fallbacks: int = 0
    host_fallback_bytes_in_use: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


class OffloadEngine:
    """Moves saved tensors to a host tier in forward and back, ahead of need, in backward.

    Args:
        min_bytes: tensors whose storage is smaller are left resident (copy cost dominates).
        host_cap_bytes: cap of the host pool; past it, pageable fallback buffers.
        prefetch: how many layers ahead of use backward starts reloading (0: on first use).
        pin: page-lock host buffers; default: when CUDA is available.

    One engine serves one model (``actplan.apply`` makes it); ``stats`` reports what it moved.
    Offload runs in eager mode only.
    """

    def __init__(
        self,
        *,
        min_bytes: int = DEFAULT_OFFLOAD_MIN_BYTES,
        host_cap_bytes: int = DEFAULT_HOST_CAP_BYTES,
        prefetch: int = 1,
        pin: bool | None = None,
    ) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be 0 or more, got {min_bytes}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 or more, got {prefetch}")
        if host_cap_bytes < max(min_bytes, 1):
            raise ValueError(
                f"host cap {host_cap_bytes:,} bytes is below min_bytes {min_bytes:,}: no tensor "
                "eligible for offload could ever use the pool; raise the cap or lower min_bytes"
            )
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.pool = HostPool(host_cap_bytes, pin=torch.cuda.is_available() if pin is None else pin)
        self.stats = OffloadStats()
        self._copies: dict[torch.device, Any] = {}
        self._groups: list[weakref.ref[_Group]] = []
        self._group_count = 0
        self._pass_id = 0
        self._pass_layers: set[int] = set()
        # Device storage -> (weak reference keeping its address unique, moved record).
        self._moved: dict[int, tuple[StorageWeakRef, weakref.ref[_Moved], int]] = {}
        self._pending: list[_Moved] = []
        self._skip_storages: set[int] = set()
        self._always_skip: set[int] = set()
        self._model: weakref.ref[nn.Module] | None = None
        self._warned_empty: set[str] = set()
        self._local = threading.local()

    # -- set-up ---------------------------------------------------------------------------

    def attach(self, model: nn.Module, also_skip: Iterable[torch.Tensor] = ()) -> None:
        """Skip ``model``'s buffers (rope tables, masks) whatever layer saves them, and the
        storages of ``also_skip`` (tensors that are not activations, such as a parent
        model's buffers when one layer runs on its own)."""
        self._model = weakref.ref(model)
        self._always_skip = {t.untyped_storage()._cdata for t in also_skip}
        self._skip_storages = set(self._always_skip)

    def _copies_for(self, device: torch.device) -> Any:
        copies = self._copies.get(device)
        if copies is None:
            copies = _StreamCopies(device) if device.type == "cuda" else _SyncCopies()
            self._copies[device] = copies
        return copies

    # -- forward --------------------------------------------------------------------------

    def begin_group(self, name: str, layer_key: int, position: int | None = None) -> _Group:
        """Open the group of one layer call; a layer seen again starts a new forward pass.

        ``position`` is the layer's index in the model (default: the order of calls); backward
        prefetches the groups at most ``prefetch`` positions before the one in use.
        """
        if layer_key in self._pass_layers or not self._pass_layers:
            self._new_pass()
        self._pass_layers.add(layer_key)
        self._release_copied_sources()
        self._group_count += 1
        group = _Group(self, name, self._group_count, self._pass_id)
        group.position = self._group_count if position is None else position
        self._groups.append(weakref.ref(group))
        return group

    def _new_pass(self) -> None:
        self._pass_id += 1
        self._pass_layers.clear()
        self._groups = [ref for ref in self._groups if (g := ref()) is not None and not g.loaded]
        # Dedup is within a pass: a storage saved again in a later pass is a new activation.
        self._moved.clear()
        model = self._model() if self._model is not None else None
        self._skip_storages = set(self._always_skip)
        if model is not None:
            self._skip_storages.update(b.untyped_storage()._cdata for b in model.buffers())

    def offload(self, tensor: torch.Tensor, group: _Group) -> torch.Tensor | _Handle:
        """Move ``tensor``'s storage to the host tier (once per storage); return its handle,
        or ``tensor`` itself when it is not worth or not safe to move."""
        stats = self.stats
        if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
            stats.skipped_parameters += 1
            return tensor
        if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
            stats.skipped_other += 1
            return tensor
        if tensor.is_conj() or tensor.is_neg() or tensor.is_meta:
            stats.skipped_other += 1
            return tensor
        if self.pool.pin and tensor.device.type == "cpu":
            stats.skipped_other += 1  # already in host memory
            return tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes < self.min_bytes:
            stats.skipped_small += 1
            return tensor
        if key in self._skip_storages:
            stats.skipped_parameters += 1
            return tensor
        moved = None
        known = self._moved.get(key)
        if known is not None and not known[0].expired() and known[2] == tensor._version:
            moved = known[1]()
        if moved is None:
            moved = _Moved(self, tensor, nbytes)
            self._moved[key] = (StorageWeakRef(storage), weakref.ref(moved), tensor._version)
            stats.bytes_offloaded += nbytes
            stats.storages_moved += 1
            if moved.source is not None:
                self._pending.append(moved)
        else:
            stats.dedup_hits += 1
        if id(moved) not in group.moved:
            group.moved[id(moved)] = moved
        group.tensors += 1
        stats.tensors_offloaded += 1
        self._sync_pool_stats()
        return _Handle(moved, tensor, group)

    def end_group(self, group: _Group, what: str) -> None:
        """Close a group; warn once per layer when it moved nothing (``what`` names the choice)."""
        if group.tensors == 0 and group.name not in self._warned_empty:
            self._warned_empty.add(group.name)
            warnings.warn(
                f"{group.name}: offload of {what} {_MOVED_NOTHING} (every candidate was "
                "a parameter or another leaf that requires grad, a module buffer, or smaller than "
                f"min_bytes={self.min_bytes:,}); lower offload.min_bytes or drop this layer from offload",
                stacklevel=3,
            )

    def _release_copied_sources(self) -> None:
        if self._pending:
            self._pending = [m for m in self._pending if not m.release_source_if_copied()]

    # -- backward -------------------------------------------------------------------------

    def ensure_loaded(self, group: _Group) -> None:
        """Reload ``group`` (if not yet) and prefetch the groups of the ``prefetch`` layers
        before it in its pass."""
        if group.loaded:
            return
        self._release_copied_sources()
        self._load(group)
        # Prefetch by layer distance, so what is in flight is bounded by `prefetch` layers'
        # worth of offloaded bytes (the planner's peak model counts exactly that).
        lowest = group.position - self.prefetch
        for ref in self._groups:
            earlier = ref()
            if (
                earlier is not None
                and not earlier.loaded
                and earlier.pass_id == group.pass_id
                and lowest <= earlier.position < group.position
            ):
                self._load(earlier)

    def _load(self, group: _Group) -> None:
        group.loaded = True
        for moved in group.moved.values():
            moved.start_reload()
        self._sync_pool_stats()

    def _sync_pool_stats(self) -> None:
        pool, stats = self.pool, self.stats
        stats.host_in_use_bytes = pool.in_use_bytes
        stats.host_peak_bytes = max(stats.host_peak_bytes, pool.peak_in_use_bytes)
        stats.host_reserved_bytes = pool.reserved_bytes
        stats.host_fallbacks = pool.fallbacks
        stats.host_fallback_bytes_in_use = pool.fallback_bytes_in_use

    def reset_stats(self) -> None:
        """Zero the counters (the pool keeps its buffers); the peak restarts from bytes in use."""
        self.pool.peak_in_use_bytes = self.pool.in_use_bytes
        self.stats = OffloadStats()
        self._sync_pool_stats()

    def snapshot(self) -> OffloadStats:
        """A copy of the counters, with the pool figures brought up to date."""
        self._sync_pool_stats()
        return OffloadStats(**self.stats.to_dict())

    # -- hooks ----------------------------------------------------------------------------

    def saved_tensor_hooks(self, group: _Group, select: Callable[[torch.Tensor], bool]):
        """Autograd hooks that offload the saved tensors ``select`` picks into ``group``."""

        def pack(tensor: torch.Tensor) -> Any:
            if not select(tensor):
                return tensor
            return self.offload(tensor, group)

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def current_group(self, layer_name: str) -> _Group:
        """The group of the layer call running now (set by its offload wrapper)."""
        group = getattr(self._local, "group", None)
        if group is None:
            raise RuntimeError(
                f"{layer_name}: a selective layer with offloaded units ran outside its offload "
                "wrapper; install plans with actplan.apply, which wraps both"
            )
        return group


def _unpack(saved: Any) -> Any:
    return saved.materialize() if isinstance(saved, _Handle) else saved


# ---------------------------------------------------------------------------------------------
# The layer wrapper
# ---------------------------------------------------------------------------------------------


@dataclass
class OffloadState(RuntimeOnly):
    """What ``apply_offload`` installed on a layer (not pickled)."""

    engine: OffloadEngine
    name: str
    layer_input: bool
    # Intervals whose saved tensors move out, in a layer that is not checkpointed.
    opens: dict[str, tuple[Any, ...]]
    closes: dict[str, tuple[Any, ...]]
    what: str
    previous_forward: Callable[..., Any] | None
    position: int | None = None


class _OpenUnits:
    """Follows a non-checkpointed layer's markers: is an offloaded interval open?"""

    __slots__ = ("closes", "open", "opens")

    def __init__(self, opens: dict[str, tuple[Any, ...]], closes: dict[str, tuple[Any, ...]]) -> None:
        self.opens, self.closes = opens, closes
        self.open: set[Any] = set()

    def on_marker(self, marker: str) -> None:
        for span in self.closes.get(marker, ()):
            self.open.discard(span)
        for span in self.opens.get(marker, ()):
            self.open.add(span)


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: OffloadState = getattr(self, _STATE_ATTR)
    inner = inner_forward(self, state.previous_forward)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{state.name}: actplan offload runs in eager mode only; remove `offload` from the "
            "config of compiled layers, or do not compile them"
        )
    engine = state.engine
    group = engine.begin_group(state.name, id(self), state.position)
    engine._local.group = group
    try:
        if state.layer_input:
            inputs = {
                t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            }

            def select(tensor: torch.Tensor) -> bool:
                return tensor.untyped_storage()._cdata in inputs

            with engine.saved_tensor_hooks(group, select):
                out = inner(*args, **kwargs)
        else:
            units = _OpenUnits(state.opens, state.closes)
            with (
                engine.saved_tensor_hooks(group, lambda tensor: bool(units.open)),
                routing_markers(units.on_marker),
            ):
                out = inner(*args, **kwargs)
    finally:
        engine._local.group = None
    engine.end_group(group, state.what)
    return out


def apply_offload(
    module: nn.Module,
    engine: OffloadEngine,
    *,
    name: str,
    layer_input: bool = False,
    intervals: Iterable[Any] = (),
    what: str = "saved tensors",
    position: int | None = None,
) -> nn.Module:
    """Offload what ``module`` saves for backward through ``engine``.

    ``layer_input``: the input a checkpointed layer saves (wrap after
    ``apply_gradient_checkpointing``). ``intervals``: in a layer that is *not* checkpointed,
    the tensors autograd saves while one of these intervals is open. Kept units of a
    selectively checkpointed layer are offloaded by its policy instead. ``position``: the
    layer's index in the model, for prefetch distances. Undo with ``remove_offload``.
    """
    if is_offloaded(module):
        raise ValueError(f"{name} already has an offload wrapper; call remove_offload(module) first")
    spans = tuple(intervals)
    opens: dict[str, list[Any]] = defaultdict(list)
    closes: dict[str, list[Any]] = defaultdict(list)
    for span in spans:
        opens[span.start].append(span)
        closes[span.end].append(span)
    previous = module.__dict__.get("forward")
    module.__dict__[_STATE_ATTR] = OffloadState(
        engine=engine,
        name=name,
        layer_input=layer_input,
        opens={m: tuple(v) for m, v in opens.items()},
        closes={m: tuple(v) for m, v in closes.items()},
        what=what,
        previous_forward=previous,
        position=position,
    )
    module.forward = InstanceForward(_offloaded_forward, module, previous)
    return module


def is_offloaded(module: nn.Module) -> bool:
    # A loaded copy of a pickled offloading module holds None here: it is not wrapped.
    return module.__dict__.get(_STATE_ATTR) is not None


def remove_offload(module: nn.Module) -> bool:
    """Undo ``apply_offload``; returns whether the module was wrapped."""
    state = module.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return False
    restore_forward(module, state.previous_forward)
    return True
