"""TLSF (two-level segregated fit) allocator over a byte range: O(1) malloc and free.

Why TLSF and not a buddy allocator: RL payloads range from a few KiB to GiBs and are rarely powers
of two; a buddy allocator rounds every request up to the next power of two (up to 50% internal
waste, 25% on average for uniform sizes), while TLSF's good-fit search wastes at most
1/``SL_COUNT`` of a request (here 1/16 = 6.25%) plus the granule, and coalesces freed neighbours
immediately so external fragmentation stays low (measured in ``tests/test_allocator.py``).

Layout of the index:
- first level ``fl`` = floor(log2(size)), second level ``sl`` = the next ``SL_LOG2`` bits of the
  size, so each power-of-two range is split into 16 classes;
- one bitmap of non-empty first levels and one bitmap of non-empty second levels per first level,
  so finding a non-empty class at least as large as the request is a couple of bit tricks;
- free blocks are indexed by start (class lists, neighbour lookup) and by end (neighbour lookup),
  so freeing coalesces with both physical neighbours in O(1).

The allocator only manages offsets; it never touches the memory. It is not thread-safe: the master
owns it from its event-loop thread.
"""

from __future__ import annotations

import msgspec

SL_LOG2 = 4
SL_COUNT = 1 << SL_LOG2
DEFAULT_GRANULE = 256


class AllocatorStats(msgspec.Struct, frozen=True):
    capacity: int
    used: int  # bytes in allocated blocks (rounded up to the granule)
    free: int
    free_blocks: int
    largest_free: int
    allocations: int

    @property
    def external_fragmentation(self) -> float:
        """1 - largest free block / total free: 0 when all free space is one block."""
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free


def _mapping(size: int) -> tuple[int, int]:
    fl = size.bit_length() - 1
    if fl < SL_LOG2:
        return 0, size  # tiny sizes never occur with a granule >= 16, kept for completeness
    sl = (size >> (fl - SL_LOG2)) & (SL_COUNT - 1)
    return fl, sl


class TlsfAllocator:
    """Offsets in ``[0, capacity)``; every block a multiple of ``granule`` bytes, aligned to it."""

    def __init__(self, capacity: int, granule: int = DEFAULT_GRANULE) -> None:
        if granule <= 0 or granule & (granule - 1):
            raise ValueError(f"granule must be a power of two, got {granule}")
        if capacity < granule:
            raise ValueError(f"capacity {capacity} smaller than one granule {granule}")
        self.granule = granule
        self.capacity = capacity - capacity % granule
        self._fl_bitmap = 0
        self._sl_bitmaps: dict[int, int] = {}
        # (fl, sl) -> dict used as an ordered set of block starts (O(1) insert/remove/pop)
        self._classes: dict[tuple[int, int], dict[int, None]] = {}
        self._free_by_start: dict[int, int] = {}  # start -> size
        self._free_by_end: dict[int, int] = {}  # end -> start
        self._allocated: dict[int, int] = {}  # start -> size
        self._used = 0
        self._insert_free(0, self.capacity)

    @classmethod
    def with_blocks(
        cls, capacity: int, granule: int, blocks: list[tuple[int, int]]
    ) -> TlsfAllocator:
        """An allocator whose allocated blocks are ``(start, size)`` (granule-aligned, inside
        the range, not overlapping; sizes rounded up to the granule), the rest free: the state
        of a file reopened with its index (``disk_index.py``)."""
        alloc = cls(capacity, granule)
        alloc._remove_free(0, alloc.capacity)
        pos = 0
        for start, nbytes in sorted(blocks):
            size = alloc.round_up(nbytes)
            if start % granule or start < pos or start + size > alloc.capacity:
                raise ValueError(f"block {start}+{size} misaligned, overlapping or outside")
            if start > pos:
                alloc._insert_free(pos, start - pos)
            alloc._allocated[start] = size
            alloc._used += size
            pos = start + size
        if pos < alloc.capacity:
            alloc._insert_free(pos, alloc.capacity - pos)
        return alloc

    # -- free-block index ---------------------------------------------------------------------
    def _insert_free(self, start: int, size: int) -> None:
        fl, sl = _mapping(size)
        bucket = self._classes.get((fl, sl))
        if bucket is None:
            bucket = self._classes[(fl, sl)] = {}
        bucket[start] = None
        self._sl_bitmaps[fl] = self._sl_bitmaps.get(fl, 0) | (1 << sl)
        self._fl_bitmap |= 1 << fl
        self._free_by_start[start] = size
        self._free_by_end[start + size] = start

    def _remove_free(self, start: int, size: int) -> None:
        fl, sl = _mapping(size)
        bucket = self._classes[(fl, sl)]
        del bucket[start]
        if not bucket:
            del self._classes[(fl, sl)]
            bits = self._sl_bitmaps[fl] & ~(1 << sl)
            if bits:
                self._sl_bitmaps[fl] = bits
            else:
                del self._sl_bitmaps[fl]
                self._fl_bitmap &= ~(1 << fl)
        del self._free_by_start[start]
        del self._free_by_end[start + size]

    def _find_class(self, size: int) -> tuple[int, int] | None:
        """Smallest non-empty class whose every block is >= size (good fit, O(1))."""
        # Round the request up to the next class boundary so any block of the found class fits.
        fl = size.bit_length() - 1
        if fl >= SL_LOG2:
            size = size + (1 << (fl - SL_LOG2)) - 1
        fl, sl = _mapping(size)
        sl_map = self._sl_bitmaps.get(fl, 0) & (~0 << sl)
        if not sl_map:
            fl_map = self._fl_bitmap & (~0 << (fl + 1))
            if not fl_map:
                return None
            fl = (fl_map & -fl_map).bit_length() - 1
            sl_map = self._sl_bitmaps[fl]
        sl = (sl_map & -sl_map).bit_length() - 1
        return fl, sl

    def _find_block(self, size: int) -> int | None:
        found = self._find_class(size)
        if found is not None:
            return next(iter(self._classes[found]))
        # Slow path near exhaustion: a block in the request's own class may still be big enough
        # (good fit skips that class so that the fast path never has to look at sizes).
        bucket = self._classes.get(_mapping(size), {})
        return next((s for s in bucket if self._free_by_start[s] >= size), None)

    # -- public API ---------------------------------------------------------------------------
    def round_up(self, nbytes: int) -> int:
        return max(self.granule, -(-nbytes // self.granule) * self.granule)

    def malloc(self, nbytes: int) -> int | None:
        """Return the offset of a block of at least ``nbytes``, or None when nothing fits."""
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes}")
        size = self.round_up(nbytes)
        start = self._find_block(size)
        if start is None:
            return None
        block = self._free_by_start[start]
        self._remove_free(start, block)
        if block > size:
            self._insert_free(start + size, block - size)
        self._allocated[start] = size
        self._used += size
        return start

    def free(self, start: int) -> None:
        size = self._allocated.pop(start, None)
        if size is None:
            raise KeyError(f"offset {start} is not an allocated block")
        self._used -= size
        # Coalesce with the physical neighbours so free space stays in as few blocks as possible.
        prev_start = self._free_by_end.get(start)
        if prev_start is not None:
            prev_size = self._free_by_start[prev_start]
            self._remove_free(prev_start, prev_size)
            start, size = prev_start, size + prev_size
        next_size = self._free_by_start.get(start + size)
        if next_size is not None:
            self._remove_free(start + size, next_size)
            size += next_size
        self._insert_free(start, size)

    def span_if_freed(self, start: int) -> int:
        """Size of the free block that freeing the allocated block at ``start`` would create."""
        size = self._allocated[start]
        prev_start = self._free_by_end.get(start)
        prev_size = 0 if prev_start is None else self._free_by_start[prev_start]
        return prev_size + size + self._free_by_start.get(start + size, 0)

    def block_size(self, start: int) -> int:
        return self._allocated[start]

    @property
    def used(self) -> int:
        return self._used

    @property
    def largest_free(self) -> int:
        if not self._fl_bitmap:
            return 0
        fl = self._fl_bitmap.bit_length() - 1
        sl = self._sl_bitmaps[fl].bit_length() - 1
        return max(self._free_by_start[s] for s in self._classes[(fl, sl)])

    def can_fit(self, nbytes: int) -> bool:
        return self._find_block(self.round_up(nbytes)) is not None

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            capacity=self.capacity,
            used=self._used,
            free=self.capacity - self._used,
            free_blocks=len(self._free_by_start),
            largest_free=self.largest_free,
            allocations=len(self._allocated),
        )

    def check(self) -> None:
        """Verify the invariants (tests): blocks tile the range exactly, free blocks coalesced."""
        spans = sorted(
            [(s, n, False) for s, n in self._allocated.items()]
            + [(s, n, True) for s, n in self._free_by_start.items()]
        )
        pos = 0
        prev_free = False
        for start, size, is_free in spans:
            assert start == pos, f"gap or overlap at {pos} (next block at {start})"
            assert not (is_free and prev_free), f"uncoalesced free blocks at {start}"
            pos, prev_free = start + size, is_free
        assert pos == self.capacity, f"blocks end at {pos}, capacity {self.capacity}"
        assert self._used == sum(self._allocated.values())
