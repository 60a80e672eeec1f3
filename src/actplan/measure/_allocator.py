"""A model of torch's CUDA caching allocator: replays a step's allocations and frees, in order,
through the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``), so
that an estimate can say what a GPU *reserves*, which is what a run runs out of, and not only
what its tensors allocate. torch has no CPU simulator of its allocator; this is one.

The rules modelled, each as the source has it:

- ``round_size``: requests round up to 512 bytes (``kMinBlockSize``), or to the next of
  ``roundup_power2_divisions`` equal steps of their power-of-two interval;
- ``get_pool``: up to 1 MiB (``kSmallSize``) from the small pool, else the large pool; free
  blocks are reused only by the stream that allocated them (per-stream pools);
- ``get_allocation_size``: a new small segment is 2 MiB (``kSmallBuffer``); a request under
  10 MiB (``kMinLargeAlloc``) gets a 20 MiB one (``large_segment_size``); larger ones round up
  to 2 MiB (``kRoundLarge``);
- ``get_free_block``: best fit, the smallest free block of the stream that is large enough
  (ties by address), refusing oversize blocks (``max_split_size``) for smaller requests and
  oversize blocks more than ``max_non_split_rounding`` larger than an oversize request;
- ``should_split`` / ``alloc_found_block``: a block is split when what is left is at least
  512 bytes (small pool, or expandable segments) or more than 1 MiB (large pool, request under
  ``max_split_size``); the request takes the front;
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment; segments are kept, not returned;
- ``alloc_block`` and the out-of-memory path of ``malloc``: when a new segment does not fit,
  ``release_available_cached_blocks`` (oversize blocks, only with ``max_split_size``), then
  ``release_cached_blocks`` (every free unsplit segment; free pages of expandable segments),
  then one retry; a per-process memory fraction caps the reserved bytes the same way, and with
  ``garbage_collection_threshold`` ``garbage_collect_cached_blocks`` frees the oldest free
  unsplit large segments first;
- expandable segments (``try_allocate_expandable_block``, ``map_block``, ``unmap_block``): one
  growing segment per stream and pool, mapped in pages of 2 MiB (small pool) or the large
  segment size, at the lowest address that fits.

Not modelled: CUDA graph private pools, ``record_stream`` (a block freed while another stream
still uses it is returned at once here), and IPC. Addresses are given out in order, so ties
between equal free blocks go to the older one. The blocks, pools and rounding arithmetic are in
``_alloc_blocks``. Standard library only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from actplan.measure._alloc_blocks import (
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    UNLIMITED,
    AllocatorReport,
    Block,
    Pool,
    SimulatedOutOfMemory,
    next_division,
    power2_interval,
)
from actplan.measure._alloc_conf import AllocatorSettings

__all__ = ["AllocatorReport", "CachingAllocatorModel", "SimulatedOutOfMemory", "replay"]

class CachingAllocatorModel:
    """One device's caching allocator. ``capacity_bytes`` is the device memory the allocator may
    take (the GPU's, less what the CUDA context and NCCL hold outside it); ``None`` is unlimited.
    ``malloc`` returns a handle for ``free``; out of memory raises ``SimulatedOutOfMemory``."""

    def __init__(self, settings: AllocatorSettings | None = None, capacity_bytes: int | None = None):
        self.settings = settings or AllocatorSettings()
        self.capacity = capacity_bytes
        self.max_split = self.settings.max_split_size or UNLIMITED
        self.small, self.large = Pool(True), Pool(False)
        self.allowed = None
        if self.settings.memory_fraction is not None and capacity_bytes is not None:
            self.allowed = int(self.settings.memory_fraction * capacity_bytes)
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.segments = self.peak_segments = self.device_allocs = self.retries = 0
        self._next_addr = 1 << 40
        self._expandable: dict[tuple[int, bool], Block] = {}  # (stream, small) -> segment head

    # --- the request path (DeviceCachingAllocator::malloc) -----------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        size = self.round_size(nbytes)
        pool = self.small if size <= SMALL_SIZE else self.large
        block = self._get_free_block(pool, stream, size)
        if block is None:
            if self.allowed is not None and self.settings.garbage_collection_threshold:
                self._garbage_collect()
            block = (
                self._alloc_block(pool, stream, size)
                or (self._release_available(pool, stream, size) and self._alloc_block(pool, stream, size))
                or (self._release_cached() and self._retry(pool, stream, size))
            )
            if not block:
                raise SimulatedOutOfMemory(nbytes, self.allocated, self.reserved, self._limit())
        return self._alloc_found(block, size, nbytes)

    def free(self, block: Block) -> None:
        if not block.allocated:
            raise ValueError("allocator model: a block freed twice; free each malloc'd block once")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = block.pool
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour, pool)
        pool.insert(block)

    def round_size(self, nbytes: int) -> int:
        if nbytes < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.settings.roundup_power2_divisions[power2_interval(nbytes)]
        if divisions > 1 and nbytes > MIN_BLOCK * divisions:
            return next_division(nbytes, divisions)
        return -(-nbytes // MIN_BLOCK) * MIN_BLOCK

    def allocation_size(self, size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self.settings.large_segment_size
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def report(self) -> AllocatorReport:
        return AllocatorReport(
            self.peak_allocated, self.peak_requested, self.peak_reserved, self.reserved,
            self.allocated, self.segments, self.peak_segments, self.device_allocs, self.retries,
            self.settings.describe(),
        )  # fmt: skip

    # --- finding and splitting ----------------------------------------------------------------
    def _get_free_block(self, pool: Pool, stream: int, size: int) -> Block | None:
        if self.allowed is not None and self.settings.garbage_collection_threshold:
            pool.free_block_calls += 1
        free = pool.free
        index = bisect.bisect_left(free, (stream, size, 0), key=lambda e: e[:3])
        if index == len(free) or free[index][0] != stream:
            return None
        block = free[index][3]
        if block.expandable:
            # Best fit counts a block followed by unmapped space as the size it can grow to.
            def growable(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while block.expandable and index + 1 < len(free) and free[index + 1][0] == stream:
                following = free[index + 1][3]
                if growable(following) >= growable(block):
                    break
                index, block = index + 1, following
        if size < self.max_split <= block.size:
            return None
        if size >= self.max_split and block.size >= size + self.settings.max_non_split_rounding:
            return None
        del free[index]
        return block

    def _alloc_found(self, block: Block, size: int, nbytes: int) -> Block:
        pool = block.pool
        remaining = block.size - size
        if pool.is_small or self.settings.expandable_segments:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self.max_split and remaining > SMALL_SIZE
        if split:
            rest = Block(pool, block.stream, block.addr + size, remaining, block.expandable)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return block

    def _merge(self, dst: Block, src: Block | None, pool: Pool) -> int:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # --- new segments and giving them back ----------------------------------------------------
    def _limit(self) -> int:
        limits = [x for x in (self.allowed, self.capacity) if x is not None]
        return min(limits) if limits else UNLIMITED

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.device_allocs += 1

    def _alloc_block(self, pool: Pool, stream: int, size: int) -> Block | None:
        alloc_size = self.allocation_size(size)
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self.settings.expandable_segments:
            return self._allocate_expandable(pool, stream, size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        block = Block(pool, stream, self._take_addresses(alloc_size), alloc_size)
        self._reserve(alloc_size)
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        return block

    def _retry(self, pool: Pool, stream: int, size: int) -> Block | None:
        self.retries += 1
        return self._alloc_block(pool, stream, size)

    def _take_addresses(self, nbytes: int, align: int = ROUND_LARGE) -> int:
        addr = -(-self._next_addr // align) * align
        self._next_addr = addr + nbytes
        return addr

    def _release_segment(self, block: Block) -> None:
        block.pool.remove(block)
        self.reserved -= block.size
        self.segments -= 1

    def _release_available(self, pool: Pool, stream: int, size: int) -> bool:
        if self.settings.max_split_size is None:
            return False
        wanted = max(size, self.max_split)
        free = pool.free
        index = bisect.bisect_left(free, (stream, wanted, 0), key=lambda e: e[:3])
        if index < len(free) and free[index][0] == stream:
            self._release_segment(free[index][3])
            return True
        released = 0
        index -= 1
        while released < wanted and index >= 0 and free[index][0] == stream:
            block = free[index][3]
            if block.size < self.max_split:
                break
            released += block.size
            self._release_segment(block)
            index -= 1
        return released >= wanted

    def _release_cached(self) -> bool:
        for pool in (self.large, self.small):
            for *_, block in list(pool.free):
                if block.expandable:
                    self._unmap(block)
                elif not block.is_split():
                    self._release_segment(block)
        return True

    def _garbage_collect(self) -> None:
        threshold = int(self.settings.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        ages = {id(b): pool.free_block_calls - b.gc_base for *_, b in pool.free if not b.is_split()}
        while reclaimed < target and ages:
            average = sum(ages.values()) / len(ages)
            freed = False
            for *_, block in list(pool.free):
                age = ages.get(id(block))
                if age is not None and age >= average:
                    reclaimed += block.size
                    del ages[id(block)]
                    self._release_segment(block)
                    freed = True
            if not freed:
                return

    # --- expandable segments ------------------------------------------------------------------
    def _page(self, pool: Pool) -> int:
        return SMALL_BUFFER if pool.is_small else self.settings.large_segment_size

    def _allocate_expandable(self, pool: Pool, stream: int, size: int) -> Block | None:
        candidate = self._expandable_candidate(pool, stream, size)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if following is None or following.mapped:
                raise RuntimeError(
                    "internal error: allocator model: an expandable segment has no room to grow "
                    "where it found some; please report it"
                )
            if not self._map(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _expandable_candidate(self, pool: Pool, stream: int, size: int) -> Block:
        def room(b: Block | None) -> int:
            total = 0
            while b is not None and not b.allocated and total < size:
                total, b = total + b.size, b.next
            return total

        start = bisect.bisect_left(pool.unmapped, (stream, 0), key=lambda e: e[:2])
        for entry in pool.unmapped[start:]:
            if entry[0] != stream:
                break
            block = entry[2]
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            if room(block) >= size:
                return block
        # A new segment's address space: 9/8 of the device's memory, as torch reserves it.
        span = (self.capacity or (1 << 46)) * 9 // 8
        span = -(-span // self._page(pool)) * self._page(pool)
        block = Block(pool, stream, self._take_addresses(span, self._page(pool)), span, expandable=True)
        block.mapped = False
        pool.insert_unmapped(block)
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        return block

    def _map(self, block: Block, size: int) -> bool:
        page = self._page(block.pool)
        mapped = min(-(-size // page) * page, block.size)
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False
        pool = block.pool
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(pool, block.stream, block.addr + mapped, block.size - mapped, expandable=True)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            pool.insert_unmapped(rest)
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour, pool)
        pool.insert(block)
        self._reserve(mapped)
        return True

    def _unmap(self, block: Block) -> None:
        page = self._page(block.pool)
        begin = -(-block.addr // page) * page
        end = (block.addr + block.size) // page * page
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        if begin > block.addr:
            before = Block(pool, block.stream, block.addr, begin - block.addr, expandable=True)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        if block.addr + block.size > end:
            after = Block(pool, block.stream, end, block.addr + block.size - end, expandable=True)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr, block.size, block.mapped = begin, end - begin, False
        self.reserved -= end - begin
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour, pool)
        if block.is_split():
            pool.insert_unmapped(block)
        else:
            self.segments -= 1  # release_expandable_segment: nothing of it is mapped


def replay(
    events: Iterable[tuple[int, int, int, int]],
    settings: AllocatorSettings | None = None,
    capacity_bytes: int | None = None,
) -> AllocatorReport:
    """Replays ``(op, id, nbytes, stream)`` events in order (op ``1`` allocates ``nbytes`` under
    ``id``, op ``0`` frees ``id``; zero-byte requests hold nothing, as torch returns no block
    for them). Raises ``SimulatedOutOfMemory`` where the device would."""
    model = CachingAllocatorModel(settings, capacity_bytes)
    live: dict[int, Block] = {}
    for op, ident, nbytes, stream in events:
        if op:
            if nbytes:
                live[ident] = model.malloc(nbytes, stream)
        else:
            block = live.pop(ident, None)
            if block is not None:
                model.free(block)
    return model.report()
