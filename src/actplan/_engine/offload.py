"""Saved-tensor offload: move chosen saved activations to a host tier in forward, reload them in backward.

``OffloadEngine`` owns the host tier (a ``host_pool.HostPool``), the copy back-ends and the
per-step bookkeeping. It reaches saved tensors two ways:

* autograd's ``saved_tensors_hooks``, installed around a layer by
  ``offload_wrapper.apply_offload``: the input a checkpointed layer saves (``layer_input``)
  and, in a layer that is not checkpointed, whatever autograd saves while an offloaded
  unit's interval is open;
* the outputs a checkpointed layer's kept units hold (``scoped.ScopedRegion`` hands them
  over when the layer's forward ends, in the group ``current_group`` names).

Each wrapped layer call is a *group*. In backward, the first use of a group reloads it
and prefetches the groups that ran just before it in forward. Storages are moved once,
however many views or layers save them. On CUDA, copies run on their own streams and
every hand-off between streams is guarded by an event; elsewhere the same code runs with
synchronous copies into a separate host pool, so everything except overlap is testable
on a CPU. Imports: ``host_pool``, ``sizes``, ``_storage``; plus torch.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from actplan._engine.host_pool import HostBuffer, HostPool, StreamCopies, SyncCopies, event_done
from actplan._storage import owned_storages, storage_keys
from actplan.sizes import DEFAULT_HOST_CAP_BYTES, DEFAULT_OFFLOAD_MIN_BYTES

__all__ = ["OffloadEngine", "OffloadStats", "OffloadedTensorMutatedError", "quiet_empty_offload"]

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
        if self.source is not None and event_done(self.copy_out):
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
        self._always_skip = storage_keys(also_skip)
        self._skip_storages = set(self._always_skip)

    def _copies_for(self, device: torch.device) -> Any:
        copies = self._copies.get(device)
        if copies is None:
            copies = StreamCopies(device) if device.type == "cuda" else SyncCopies()
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
            self._skip_storages.update(owned_storages(model, parameters=False))

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
