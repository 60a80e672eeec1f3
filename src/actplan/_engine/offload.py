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
on a CPU. Imports: ``host_pool``, ``offload_moves``, ``sizes``, ``_storage``; plus torch.
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

from actplan._callsite import warn
from actplan._engine.host_pool import HostPool, ShapeOnlyCopies, StreamCopies, SyncCopies, TimedCopies
from actplan._engine.offload_moves import Group, Handle, Moved, OffloadedTensorMutatedError
from actplan._storage import owned_storages, storage_keys
from actplan._torch_internals import (
    OFFLOAD_PROBES,
    FakeTensor,
    StorageWeakRef,
    probe,
    storage_key_of,
    tensor_version,
    waited_collective,
)
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
        copies: makes the copy back-end for a device (default: ``StreamCopies`` on CUDA,
            ``SyncCopies`` elsewhere). A back-end has ``copy_out(source, host)`` and
            ``copy_in(host, target, after)``, each returning an event (``query()``,
            ``synchronize()``) or ``None`` when the copy is already done, plus
            ``keep_until_done(tensor, event)`` and ``use(event)``; see ``host_pool``.

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
        copies: Callable[[torch.device], Any] | None = None,
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
        self._make_copies = copies if copies is not None else _default_copies
        self._fake_copies = ShapeOnlyCopies()
        self._groups: list[weakref.ref[Group]] = []
        self._group_count = 0
        self._pass_id = 0
        self._pass_layers: set[int] = set()
        # Device storage -> (weak reference keeping its address unique, moved record).
        self._moved: dict[int, tuple[StorageWeakRef, weakref.ref[Moved], int]] = {}
        self._pending: list[Moved] = []
        self._skip_storages: set[int] = set()
        self._always_skip: set[int] = set()
        self._model: weakref.ref[nn.Module] | None = None
        self._warned_empty: set[str] = set()
        self._local = threading.local()
        probe(OFFLOAD_PROBES)  # the private torch APIs offload relies on, once per process

    # -- set-up ---------------------------------------------------------------------------

    def attach(self, model: nn.Module, also_skip: Iterable[torch.Tensor] = ()) -> None:
        """Skip ``model``'s buffers (rope tables, masks) whatever layer saves them, and the
        storages of ``also_skip`` (tensors that are not activations, such as a parent
        model's buffers when one layer runs on its own)."""
        self._model = weakref.ref(model)
        self._always_skip = storage_keys(also_skip)
        self._skip_storages = set(self._always_skip)

    def copies_for(self, device: torch.device, fake: bool = False) -> Any:
        """The copy back-end for tensors on ``device``; for an estimate's fake tensors, copies
        that move no values (timed by ``time_copies``'s timer, if one is set)."""
        if fake:
            return self._fake_copies
        copies = self._copies.get(device)
        if copies is None:
            copies = self._copies[device] = self._make_copies(device)
        timer = self._fake_copies.timer  # the one ``time_copies`` set, for both kinds
        return copies if timer is None else TimedCopies(copies, timer)

    def time_copies(self, timer: Any) -> None:
        """Time the copies with ``timer`` (``RooflineClock.copy_timer()``; ``None`` stops):
        an estimate's offload, or a measured run's prediction, then costs what its copies
        cannot hide behind the compute. Real copies still run as they do."""
        self._fake_copies.timer = timer

    # -- forward --------------------------------------------------------------------------

    def begin_group(self, name: str, layer_key: int, position: int | None = None) -> Group:
        """Open the group of one layer call; a layer seen again starts a new forward pass.

        ``position`` is the layer's index in the model (default: the order of calls); backward
        prefetches the groups at most ``prefetch`` positions before the one in use.
        """
        if layer_key in self._pass_layers or not self._pass_layers:
            self._new_pass()
        self._pass_layers.add(layer_key)
        self._release_copied_sources()
        self._group_count += 1
        group = Group(self, name, self._group_count, self._pass_id)
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

    def offload(self, tensor: torch.Tensor, group: Group) -> torch.Tensor | Handle:
        """Move ``tensor``'s storage to the host tier (once per storage); return its handle,
        or ``tensor`` itself when it is not worth or not safe to move."""
        stats = self.stats
        # A tensor-parallel collective's result moves as the plain tensor it stands for (an op
        # that saved it has already waited on it); on the fake process group it is plain anyway.
        tensor = waited_collective(tensor)
        if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
            stats.skipped_parameters += 1
            return tensor
        fake = type(tensor) is FakeTensor  # an estimate's tensor: moved as a real one would be
        if (type(tensor) is not torch.Tensor and not fake) or tensor.layout is not torch.strided:
            stats.skipped_other += 1
            return tensor
        if tensor.is_conj() or tensor.is_neg() or tensor.is_meta:
            stats.skipped_other += 1
            return tensor
        if self.pool.pin and tensor.device.type == "cpu" and not fake:
            stats.skipped_other += 1  # already in host memory
            return tensor
        storage = tensor.untyped_storage()
        key = storage_key_of(storage)
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes < self.min_bytes:
            stats.skipped_small += 1
            return tensor
        if key in self._skip_storages:
            stats.skipped_parameters += 1
            return tensor
        moved = None
        known = self._moved.get(key)
        if known is not None and not known[0].expired() and known[2] == tensor_version(tensor):
            moved = known[1]()
        if moved is None:
            moved = Moved(self, tensor, nbytes)
            self._moved[key] = (StorageWeakRef(storage), weakref.ref(moved), tensor_version(tensor))
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
        return Handle(moved, tensor, group)

    def end_group(self, group: Group, what: str) -> None:
        """Close a group; warn once per layer when it moved nothing (``what`` names the choice)."""
        if group.tensors == 0 and group.name not in self._warned_empty:
            self._warned_empty.add(group.name)
            warn(
                f"{group.name}: offload of {what} {_MOVED_NOTHING} (every candidate was "
                "a parameter or another leaf that requires grad, a module buffer, or smaller than "
                f"min_bytes={self.min_bytes:,}); lower offload.min_bytes or drop this layer from offload"
            )

    def _release_copied_sources(self) -> None:
        if self._pending:
            self._pending = [m for m in self._pending if not m.release_source_if_copied()]

    # -- backward -------------------------------------------------------------------------

    def ensure_loaded(self, group: Group) -> None:
        """Reload ``group`` (if not yet) and, on its first use, prefetch the groups of the
        ``prefetch`` layers before it in its pass.

        A group that a prefetch already loaded still prefetches on its first use, so every
        group after the first ``prefetch`` is loaded ahead of need, never on demand.
        """
        if not group.loaded:
            self._release_copied_sources()
            self._load(group)
        if group.prefetched:
            return
        group.prefetched = True
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

    def _load(self, group: Group) -> None:
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

    def saved_tensor_hooks(self, group: Group, select: Callable[[torch.Tensor], bool]):
        """Autograd hooks that offload the saved tensors ``select`` picks into ``group``."""

        def pack(tensor: torch.Tensor) -> Any:
            if not select(tensor):
                return tensor
            return self.offload(tensor, group)

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    @contextlib.contextmanager
    def running(self, group: Group) -> Iterator[None]:
        """Make ``group`` the current one in this thread while a layer call runs (its offload
        wrapper enters this), so a selective layer's policy finds it (``current_group``)."""
        self._local.group = group
        try:
            yield
        finally:
            self._local.group = None

    def current_group(self, layer_name: str) -> Group:
        """The group of the layer call running now (set by its offload wrapper)."""
        group = getattr(self._local, "group", None)
        if group is None:
            raise RuntimeError(
                f"{layer_name}: a selective layer with offloaded units ran outside its offload "
                "wrapper; install plans with actplan.apply, which wraps both"
            )
        return group


def _default_copies(device: torch.device) -> Any:
    return StreamCopies(device) if device.type == "cuda" else SyncCopies()


def _unpack(saved: Any) -> Any:
    return saved.materialize() if isinstance(saved, Handle) else saved
