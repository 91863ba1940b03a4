"""A model of PyTorch's CUDA caching allocator (default settings, one stream), fed by a CPU run's allocations.

It follows ``c10/cuda/CUDACachingAllocator.cpp``: requests round up to 512 bytes; up to 1 MiB from the small pool;
best-fit among cached blocks, else a new segment (2 MiB, 20 MiB under 10 MiB, else rounded to 2 MiB); split when the
rest is ≥ 512 B (small) or > 1 MiB (large); freed blocks merge; ``empty_cache`` releases free segments.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["AllocatorRules", "CachingAllocatorModel"]

MiB = 1 << 20

#: The address of the first segment (:meth:`CachingAllocatorModel.layout`; any value: nothing reads it)
BASE_ADDRESS = 0x7F00_0000_0000


@dataclass(frozen=True)
class AllocatorRules:
    """The caching allocator's constants (``CUDACachingAllocator.cpp``), in bytes."""

    #: every request is rounded up to a multiple of this (``kMinBlockSize``)
    min_block: int = 512
    #: requests up to this size come from the small pool (``kSmallSize``)
    small_size: int = MiB
    #: a small-pool segment (``kSmallBuffer``)
    small_buffer: int = 2 * MiB
    #: a large-pool segment for requests under :attr:`min_large_alloc` (``kLargeBuffer``)
    large_buffer: int = 20 * MiB
    #: from this size on, a segment is the request rounded to :attr:`round_large` (``kMinLargeAlloc``)
    min_large_alloc: int = 10 * MiB
    #: the rounding of large segments (``kRoundLarge``)
    round_large: int = 2 * MiB

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AllocatorRules:
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown allocator rule(s) {', '.join(unknown)}")
        values = {key: int(value) for key, value in data.items()}
        bad = [f"{key}={value}" for key, value in values.items() if value <= 0]
        if bad:
            raise ValueError(f"allocator rules must be positive byte counts: {', '.join(bad)}")
        return cls(**values)

    def round_size(self, nbytes: int) -> int:
        """The block size a request of ``nbytes`` asks for."""
        return max(self.min_block, -(-nbytes // self.min_block) * self.min_block)

    def segment_size(self, size: int) -> int:
        """The segment reserved for a rounded request of ``size`` bytes that no cached block serves."""
        if size <= self.small_size:
            return self.small_buffer
        if size < self.min_large_alloc:
            return self.large_buffer
        return -(-size // self.round_large) * self.round_large


@dataclass(eq=False, slots=True)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    #: the rounded size the allocation asked for (the block may be larger: not split)
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocatorModel:
    """The caching allocator's blocks and segments (see the module's docstring); :meth:`malloc` and :meth:`free` name
    an allocation by a key (any hashable: the storage it backs)."""

    def __init__(self, rules: AllocatorRules | None = None) -> None:
        self.rules = rules or AllocatorRules()
        self._pools: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] = ([], [])  # large, small
        self._free_blocks: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[Any, _Block] = {}
        #: segment id -> its address (an address space of its own: segments never overlap) and size
        self._segments: dict[int, tuple[int, int]] = {}
        self._next_base = BASE_ADDRESS
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        #: segments reserved so far (``num_alloc_retries`` aside, the ``segment.all.allocated`` stat); the next one's id
        self.segments_reserved = 0

    # -- requests -------------------------------------------------------------------

    def malloc(self, key: Any, nbytes: int) -> int:
        """Allocate ``nbytes`` for ``key``; returns the bytes the block counts in ``allocated``."""
        if key in self._live:
            raise KeyError(f"{key!r} is allocated already")
        rules = self.rules
        size = rules.round_size(nbytes)
        small = size <= rules.small_size
        pool = self._pools[small]
        index = bisect.bisect_left(pool, (size, -1, -1))
        if index < len(pool):
            block = self._free_blocks.pop(pool.pop(index))
        else:
            block = self._reserve(rules.segment_size(size), small)
        remaining = block.size - size
        if remaining >= rules.min_block if small else remaining > rules.small_size:
            rest = _Block(block.segment, block.offset + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._cache(rest)
        block.free = False
        block.requested = size
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.size

    def free(self, key: Any) -> int:
        """Free ``key``'s block (it stays reserved, cached for later requests); returns its size."""
        block = self._live.pop(key)
        size = block.size
        self.allocated -= size
        block.free = True
        after = block.next
        if block.prev is not None and block.prev.free:
            block = _merge(self._uncache(block.prev), block)
        if after is not None and after.free:
            block = _merge(block, self._uncache(after))
        self._cache(block)
        return size

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def size_of(self, key: Any) -> int | None:
        """The rounded size ``key`` asked for (its block may be larger: not split); None if not allocated."""
        block = self._live.get(key)
        return None if block is None else block.requested

    def segments(self) -> list[tuple[int, bool, tuple[tuple[int, bool], ...]]]:
        """Each segment, in the order reserved: its size, whether it is a small-pool segment, and
        its blocks in address order as ``(size, allocated)`` (a memory snapshot's ``segments``)."""
        return [
            (self._segments[first.segment][1], first.small, tuple((block.size, not block.free) for block in blocks))
            for first, blocks in self._chains()
        ]

    def block_of(self, key: Any) -> tuple[int, int, int, int] | None:
        """Where ``key``'s block is: its segment's id and address, its offset in the segment and its
        size (bytes); None if ``key`` is not allocated."""
        block = self._live.get(key)
        if block is None:
            return None
        return block.segment, self._segments[block.segment][0], block.offset, block.size

    def segment_bytes(self, segment: int) -> int:
        """The size of the reserved segment ``segment`` (bytes)."""
        return self._segments[segment][1]

    def layout(self) -> list[tuple[int, int, int, bool, list[tuple[int, int, Any]]]]:
        """Each reserved segment in the order reserved: its id, address, size, whether it is a small-pool segment, and
        its blocks in address order as ``(offset, size, key)`` (key None: a free block the allocator caches)."""
        keys = {id(block): key for key, block in self._live.items()}
        return [
            (
                first.segment,
                *self._segments[first.segment],
                first.small,
                [(block.offset, block.size, None if block.free else keys.get(id(block))) for block in blocks],
            )
            for first, blocks in self._chains()
        ]

    def empty_cache(self) -> None:
        """Release every segment no live block is in (``torch.cuda.empty_cache()``)."""
        for block in list(self._free_blocks.values()):
            if block.prev is None and block.next is None:
                self._uncache(block)
                self.reserved -= self._segments.pop(block.segment)[1]

    def reset_peaks(self) -> None:
        """Peaks from the current figures on (``torch.cuda.reset_peak_memory_stats()``)."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    # -- internals ------------------------------------------------------------------

    def _chains(self) -> Iterator[tuple[_Block, list[_Block]]]:
        """Each segment's first block and its blocks in address order, segments in the order reserved."""
        firsts: dict[int, _Block] = {}
        for known in (*self._live.values(), *self._free_blocks.values()):
            while known.prev is not None:
                known = known.prev
            firsts[known.segment] = known
        for segment in sorted(firsts):
            blocks: list[_Block] = []
            block: _Block | None = firsts[segment]
            while block is not None:
                blocks.append(block)
                block = block.next
            yield firsts[segment], blocks

    def _reserve(self, size: int, small: bool) -> _Block:
        segment = self.segments_reserved
        self.segments_reserved += 1
        self._segments[segment] = (self._next_base, size)
        self._next_base += -(-size // self.rules.round_large) * self.rules.round_large
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(segment, 0, size, small)

    def _cache(self, block: _Block) -> None:
        order = block.order
        self._free_blocks[order] = block
        bisect.insort(self._pools[block.small], order)

    def _uncache(self, block: _Block) -> _Block:
        order = block.order
        del self._free_blocks[order]
        pool = self._pools[block.small]
        del pool[bisect.bisect_left(pool, order)]
        return block


def _merge(left: _Block, right: _Block) -> _Block:
    """``left`` grown by its neighbour ``right``, which leaves the chain."""
    left.size += right.size
    left.next = right.next
    if right.next is not None:
        right.next.prev = left
    return left
