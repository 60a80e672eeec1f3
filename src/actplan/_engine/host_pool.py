"""The host tier of offload: a capped pool of (pinned) host buffers reused by size class, and the
two copy back-ends (CUDA streams guarded by events, or synchronous copies on a CPU).

``offload.OffloadEngine`` owns one ``HostPool`` and one copy back-end per device. Imports only
torch and the standard library.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import torch

from actplan._callsite import warn
from actplan._torch_internals import disable_current_modes as _disable_current_modes

__all__ = [
    "HostBuffer",
    "HostPool",
    "ShapeOnlyCopies",
    "StreamCopies",
    "SyncCopies",
    "TimedCopies",
    "event_done",
    "size_class",
]

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


def event_done(event: Any) -> bool:
    return event is None or event.query()


def wait_event(event: Any) -> None:
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
        # (``Moved.__del__``) that a garbage collection runs inside ``acquire``, on the thread
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
        # Set to a list to record the bytes in use after every hand-out and return (tests compare
        # a fake run's host tier with a real one's); ``None`` records nothing.
        self.trace: list[int] | None = None
        self._fake_mode: Any = None
        self._acquires_seen = False

    def acquire(self, nbytes: int, fake_mode: Any = None) -> HostBuffer:
        """A buffer of at least ``nbytes``. ``fake_mode``: the ``FakeTensorMode`` of an estimate's
        tensors, whose host tier takes fake buffers (shapes only, same bytes counted); a pool
        serves either real or fake tensors, never both."""
        if not self._acquires_seen:
            self._fake_mode, self._acquires_seen = fake_mode, True
        elif fake_mode is not self._fake_mode:
            raise RuntimeError(
                "actplan offload: one host pool served both fake and real tensors (or two fake "
                "runs); an offload engine serves one model: apply the plan again to a model "
                "built where it runs"
            )
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
            wait_event(event)
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
            if self.trace is not None:
                self.trace.append(self._in_use_bytes)

    def _hand_out(self, buffer: HostBuffer) -> HostBuffer:
        size = buffer.tensor.numel()
        self._in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self._in_use_bytes)
        if not buffer.pooled:
            self._fallback_bytes_in_use += size
        if self.trace is not None:
            self.trace.append(self._in_use_bytes)
        return buffer

    def _evict(self, wanted: int) -> int:
        freed = 0
        for size in sorted(self._free, reverse=True):
            entries = self._free[size]
            while entries and freed < wanted:
                _, event = entries.pop()
                wait_event(event)
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

    def _allocate(self, size: int, *, pin: bool) -> torch.Tensor:
        # Host-tier memory is not device memory: keep it out of any dispatch-mode meter. A fake
        # run's buffers are fake tensors (its mode alone re-entered): counted here, never allocated.
        fake = self._fake_mode
        with _disable_current_modes(), contextlib.nullcontext() if fake is None else fake:
            return torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pin and fake is None)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)


# ---------------------------------------------------------------------------------------------
# Copies: CUDA streams and events, or synchronous copies
# ---------------------------------------------------------------------------------------------


class StreamCopies:
    """Device-to-host and host-to-device copies on their own CUDA streams.

    Every device buffer a copy touches is marked with ``record_stream`` for the copy's
    stream, so the caching allocator does not hand its memory to anyone else before the copy
    is done, even when the last tensor using it dies first (a backward that aborts after a
    prefetch, a graph freed while its copy-out runs).
    """

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
        source.record_stream(self.out_stream)
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
        target.record_stream(self.in_stream)
        return event

    def keep_until_done(self, tensor: torch.Tensor, event: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the copy-out stream's work is done."""
        tensor.record_stream(self.out_stream)

    def use(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` before it reads the reloaded tensor."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class SyncCopies:
    """Copies that complete before they return (CPU, or a device without streams)."""

    @staticmethod
    def copy_out(source: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(source)

    @staticmethod
    def copy_in(host: torch.Tensor, target: torch.Tensor, after: Any) -> None:
        target.copy_(host)

    @staticmethod
    def keep_until_done(tensor: torch.Tensor, event: Any) -> None:
        pass

    @staticmethod
    def use(event: Any) -> None:
        pass


class TimedCopies:
    """A real copy back-end whose copies a ``timer`` (a roofline clock's ``copy_timer``) also
    places on its copy streams, as ``ShapeOnlyCopies`` does for fake tensors: a measured run's
    prediction then charges the same exposed copy time an estimate does. The copies themselves
    run outside any dispatch mode (the clock would count them on its compute stream)."""

    def __init__(self, inner: Any, timer: Any) -> None:
        self.inner, self.timer = inner, timer

    def copy_out(self, source: torch.Tensor, host: torch.Tensor) -> TimedEvent:
        with _disable_current_modes():
            event = self.inner.copy_out(source, host)
        return TimedEvent(event, self.timer.copy_out(host.numel()))

    def copy_in(self, host: torch.Tensor, target: torch.Tensor, after: Any) -> TimedEvent:
        with _disable_current_modes():
            event = self.inner.copy_in(host, target, TimedEvent.real(after))
        return TimedEvent(event, self.timer.copy_in(host.numel(), TimedEvent.timed(after)))

    def keep_until_done(self, tensor: torch.Tensor, event: Any) -> None:
        self.inner.keep_until_done(tensor, TimedEvent.real(event))

    def use(self, event: Any) -> None:
        self.inner.use(TimedEvent.real(event))
        self.timer.use(TimedEvent.timed(event))


@dataclass
class TimedEvent:
    """A ``TimedCopies`` copy: the back-end's event (waited on as one) and the clock's."""

    event: Any
    done: Any

    def query(self) -> bool:
        return event_done(self.event)

    def synchronize(self) -> None:
        wait_event(self.event)

    @staticmethod
    def real(event: Any) -> Any:
        return event.event if isinstance(event, TimedEvent) else event

    @staticmethod
    def timed(event: Any) -> Any:
        return event.done if isinstance(event, TimedEvent) else None


class ShapeOnlyCopies:
    """Copies of an estimate's fake tensors: there are no values to move, so each is done at
    once; a ``timer`` (a roofline clock's ``copy_timer``) places them on its copy streams, by
    bytes, and its events tell when the compute can read a reload."""

    def __init__(self, timer: Any = None) -> None:
        self.timer = timer

    def copy_out(self, source: torch.Tensor, host: torch.Tensor) -> Any:
        return None if self.timer is None else self.timer.copy_out(host.numel())

    def copy_in(self, host: torch.Tensor, target: torch.Tensor, after: Any) -> Any:
        return None if self.timer is None else self.timer.copy_in(host.numel(), after)

    @staticmethod
    def keep_until_done(tensor: torch.Tensor, event: Any) -> None:
        pass

    def use(self, event: Any) -> None:
        if self.timer is not None:
            self.timer.use(event)
