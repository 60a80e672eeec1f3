"""The pieces the caching-allocator model (``_allocator``) is made of: torch's size constants
(``c10/cuda/CUDACachingAllocator.cpp``), a block of a segment, a pool of free blocks ordered as
torch orders them (stream, size, address), the power-of-two rounding, and what a replay reports.
Standard library only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from actplan.measure._alloc_conf import MIB

__all__ = ["AllocatorReport", "Block", "Pool", "SimulatedOutOfMemory", "next_division", "power2_interval"]

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = MIB  # kSmallSize
SMALL_BUFFER = 2 * MIB  # kSmallBuffer
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
UNLIMITED = 1 << 64


class SimulatedOutOfMemory(RuntimeError):
    """The modelled allocator could not serve a request within the device's capacity."""

    def __init__(self, requested: int, allocated: int, reserved: int, capacity: int):
        self.requested, self.allocated = requested, allocated
        self.reserved, self.capacity = reserved, capacity
        super().__init__(
            f"out of memory: {requested} bytes requested with {allocated} allocated and {reserved} "
            f"reserved of a {capacity}-byte capacity"
        )


class Block:
    __slots__ = ("addr", "allocated", "expandable", "gc_base", "mapped", "next", "pool", "prev",
                 "requested", "size", "stream")  # fmt: skip

    def __init__(self, pool: Pool, stream: int, addr: int, size: int, expandable: bool = False):
        self.pool, self.stream, self.addr, self.size = pool, stream, addr, size
        self.allocated, self.mapped, self.expandable = False, True, expandable
        self.prev: Block | None = None
        self.next: Block | None = None
        self.requested = 0
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Pool:
    """One of the small and large pools: free mapped blocks by (stream, size, address) and, for
    expandable segments, unmapped ranges by (stream, address)."""

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.free: list[tuple[int, int, int, Block]] = []
        self.unmapped: list[tuple[int, int, Block]] = []
        self.free_block_calls = 0  # get_free_blocks_call_count, the age clock of gc

    def insert(self, block: Block) -> None:
        block.gc_base = self.free_block_calls
        bisect.insort(self.free, (block.stream, block.size, block.addr, block), key=lambda e: e[:3])

    def remove(self, block: Block) -> None:
        key = (block.stream, block.size, block.addr)
        index = bisect.bisect_left(self.free, key, key=lambda e: e[:3])
        if index == len(self.free) or self.free[index][3] is not block:
            raise RuntimeError("internal error: allocator model: a free block went missing; please report it")
        del self.free[index]

    def insert_unmapped(self, block: Block) -> None:
        bisect.insort(self.unmapped, (block.stream, block.addr, block), key=lambda e: e[:2])

    def remove_unmapped(self, block: Block) -> None:
        index = bisect.bisect_left(self.unmapped, (block.stream, block.addr), key=lambda e: e[:2])
        if index == len(self.unmapped) or self.unmapped[index][2] is not block:
            raise RuntimeError(
                "internal error: allocator model: an unmapped range went missing; please report it"
            )
        del self.unmapped[index]


@dataclass(frozen=True)
class AllocatorReport:
    """What a replay saw: torch's ``memory_stats`` names, peak and at the end."""

    peak_allocated_bytes: int  # max_memory_allocated: block sizes, after rounding
    peak_requested_bytes: int  # the bytes asked for (what the memory meter counts)
    peak_reserved_bytes: int  # max_memory_reserved: segments held from the device
    reserved_bytes: int  # at the end
    allocated_bytes: int
    segments: int
    peak_segments: int
    device_allocs: int  # cudaMalloc (or page map) calls
    retries: int  # out-of-memory retries after releasing cached blocks
    settings: str

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved at its peak but not allocated at the allocated peak: what rounding, splits,
        per-stream pools and cached segments cost."""
        return self.peak_reserved_bytes - self.peak_allocated_bytes


def power2_interval(nbytes: int) -> int:
    # roundup_power2_divisions(size): intervals start at 1 MiB (2^20) and the last covers 2^35 up.
    return min(max(nbytes.bit_length() - 1 - 20, 0), 15)


def next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


