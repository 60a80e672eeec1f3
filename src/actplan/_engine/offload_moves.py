"""What offload moves and hands back: ``Moved`` (one storage on its way to the host tier and
back), ``Handle`` (what autograd keeps for one offloaded tensor, a view of a moved storage)
and ``Group`` (one wrapped layer call's moves, reloaded together). ``OffloadEngine`` in
``offload`` makes and schedules them, and reaches them as a ``Mover`` (a protocol here, so
this module does not import ``offload``). Imports ``host_pool``, ``_torch_internals``; plus torch.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Protocol

import torch

from actplan._engine.host_pool import HostBuffer, HostPool, event_done
from actplan._torch_internals import FakeTensor, tensor_version
from actplan._torch_internals import disable_current_modes as _disable_current_modes


class Mover(Protocol):
    """What a move needs of the engine that made it (``offload.OffloadEngine``)."""

    pool: HostPool
    stats: Any

    def copies_for(self, device: torch.device, fake: bool = False) -> Any: ...

    def ensure_loaded(self, group: Group) -> None: ...

__all__ = ["Group", "Handle", "Moved", "OffloadedTensorMutatedError"]


class OffloadedTensorMutatedError(RuntimeError):
    """A saved tensor was changed in place after it was offloaded (autograd would also refuse it)."""


class Moved:
    """One device storage copied to the host tier, and (after reload) back."""

    __slots__ = (
        "__weakref__",
        "copies",
        "copy_in",
        "copy_out",
        "device",
        "engine",
        "fake_mode",
        "host",
        "mutated",
        "nbytes",
        "reload_skipped",
        "reloaded",
        "source",
        "version",
    )

    def __init__(self, engine: Mover, source: torch.Tensor, nbytes: int) -> None:
        self.engine = engine
        self.nbytes = nbytes
        # A fake run (an estimate) moves fake tensors: its host buffers are fake (counted by the
        # pool, never allocated) and its copies move no values (``ShapeOnlyCopies``), each done
        # at once for memory, as a CPU copy is; a clock may still time them.
        self.fake_mode = source.fake_mode if isinstance(source, FakeTensor) else None
        fake_mode = self.fake_mode
        self.copies = engine.copies_for(source.device, fake=fake_mode is not None)
        self.host: HostBuffer | None = engine.pool.acquire(nbytes, fake_mode)
        if fake_mode is None:
            with _disable_current_modes():
                flat = torch.empty(0, dtype=torch.uint8, device=source.device).set_(source.untyped_storage())
                self.copy_out = self.copies.copy_out(flat, self.host.tensor[:nbytes])
        else:
            self.copy_out = self.copies.copy_out(source, self.host.tensor[:nbytes])
        # While the copy-out may still be running, an alias of the tensor stays here: it
        # shares the tensor's version counter, so an in-place write racing the copy is
        # seen however the copy ends and whether or not the tensor itself is still alive.
        # (The device memory itself is kept from reuse by the back-end, not by this alias.)
        self.source: torch.Tensor | None = None if event_done(self.copy_out) else source.detach()
        self.version = tensor_version(source)
        self.mutated = False
        self.device = source.device
        self.copy_in: Any = None
        self.reloaded: torch.Tensor | None = None
        self.reload_skipped = False

    def start_reload(self) -> None:
        if self.reloaded is not None or self.host is None:
            return
        stats = self.engine.stats
        if not self.release_source_if_copied():
            # The copy-out is still running, so the data never left the device: use it and skip
            # the copy-in, unless it was written in place since the save (then the host copy
            # may hold either value, and ``changed_since_save`` says so to the reader).
            self.reloaded = self.source
            self.reload_skipped = True
            self.source = None
            # The allocator must not reuse that memory before the copy-out stream is done
            # reading it, whenever the last view of it dies.
            self.copies.keep_until_done(self.reloaded, self.copy_out)
            stats.bytes_reload_skipped += self.nbytes
        else:
            # Allocated through the dispatcher on purpose: a memory meter counts reloaded bytes.
            target = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            # The copy itself is the back-end's, not the compute stream's: no mode sees it (a
            # fake run's copy runs under its fake mode alone), as with the copy-out.
            fake_mode = self.fake_mode
            with _disable_current_modes(), contextlib.nullcontext() if fake_mode is None else fake_mode:
                self.copy_in = self.copies.copy_in(self.host.tensor[: self.nbytes], target, self.copy_out)
            self.reloaded = target
            stats.bytes_reloaded += self.nbytes
        # The host buffer goes back once the last copy touching it is done.
        self.engine.pool.release(self.host, self.copy_in if self.copy_in is not None else self.copy_out)
        self.host = None

    def release_source_if_copied(self) -> bool:
        """Drop the alias once the copy-out is done, noting a write made before that; true
        when no alias is left."""
        if self.source is not None and event_done(self.copy_out):
            self.mutated = self.mutated or tensor_version(self.source) != self.version
            self.source = None
        return self.source is None

    def changed_since_save(self) -> bool:
        """Whether the storage was written in place while its value could still reach backward:
        before the copy-out finished, or (reload skipped) at any time since the save."""
        if self.mutated:
            return True
        alias = self.source if self.source is not None else self.reloaded if self.reload_skipped else None
        if alias is not None and tensor_version(alias) != self.version:
            self.mutated = True
        return self.mutated

    def __del__(self) -> None:
        host = getattr(self, "host", None)
        if host is not None:
            self.engine.pool.release(host, self.copy_out)
            self.host = None


class Handle:
    """What autograd (or the selective cache) holds instead of an offloaded tensor."""

    __slots__ = ("dtype", "group", "moved", "offset", "original", "size", "stride", "version")

    def __init__(self, moved: Moved, tensor: torch.Tensor, group: Group) -> None:
        self.moved = moved
        self.group = group
        self.dtype = tensor.dtype
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.offset = tensor.storage_offset()
        self.version = tensor_version(tensor)
        self.original = weakref.ref(tensor)

    def materialize(self) -> torch.Tensor:
        moved = self.moved
        self.group.engine.ensure_loaded(self.group)
        # Checked after the reload started: a write found only then (the copy-out finished in
        # between, or the reload used the device copy) is as wrong as one found before.
        original = self.original()
        if moved.changed_since_save() or (original is not None and tensor_version(original) != self.version):
            raise OffloadedTensorMutatedError(
                f"{self.group.name}: a tensor saved for backward (shape {list(self.size)}, {self.dtype}) "
                "was modified by an in-place operation after actplan offloaded it; backward needs "
                "its value at save time (autograd refuses this too). Make that update out-of-place, "
                "or do not offload this layer."
            )
        moved.copies.use(moved.copy_in)
        if moved.fake_mode is not None:
            # The same tensor by views (a fake reload is always the flat bytes it allocated):
            # torch's fake-tensor dispatch cache keeps the storage argument of ``set_`` alive,
            # which would hold every reloaded storage to the end of the run.
            return moved.reloaded.view(self.dtype).as_strided(self.size, self.stride, self.offset)
        with _disable_current_modes():  # an empty shell, not an allocation for any meter
            shell = torch.empty(0, dtype=self.dtype, device=moved.device)
        return shell.set_(moved.reloaded.untyped_storage(), self.offset, self.size, self.stride)


class Group:
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
        "prefetched",
        "tensors",
    )

    def __init__(self, engine: Mover, name: str, index: int, pass_id: int) -> None:
        self.engine = engine
        self.name = name
        self.index = index
        self.pass_id = pass_id
        self.moved: dict[int, Moved] = {}
        self.tensors = 0
        self.loaded = False
        self.prefetched = False  # the reloads of the layers before it have been started
        self.position = index
