"""The disk tier's bookkeeping: which keys are on disk, where, in what order. Pure logic, no I/O.

A master with a disk tier (``disk_tier.py`` is the shell) writes the keyed cache entries that
memory pressure evicts to one preallocated file, and a lookup whose run continues there reads
them back into the pool. This module decides where a record goes, which records make room for
it, and what a key's record is worth; the shell copies, writes and reads.

One record (a key's bytes on disk)::

    place(key) --> WRITING (staged: its bytes wait in memory for the writer; busy)
                     |--written(ok) ------------------------------------------> STORED
                     '--written(failed) ---------------------------------------> gone
    STORED --begin_read--> STORED, a read running (busy) --read_done(ok)------> STORED
                                                          '--read_done(bad)----> gone
    any --drop (release, evict_keys), evicted for a newer record's room (LRU),
          or replaced (a newer object of its key spilled) --------------------> gone

- **gone** means the key is unknown at once; while a write or read of its range runs (busy),
  the file range is freed only when that I/O ends, so no write ever lands in a range being
  read or written.
- **Room**: the file is one range of ``capacity`` bytes, records are blocks of ``GRANULE``
  (``TlsfAllocator``). A record that does not fit evicts records in least recently used order
  (placing and reading count as uses), skipping busy ones, with the master's refinement: if one
  of the ``EVICTION_WINDOW`` oldest alone frees enough room next to free space, it alone goes.
  A hopeless request (free + evictable bytes too few) evicts nothing and is dropped.
- **Mirror**: the pool object a lookup promoted from a record (its oid). When memory evicts that
  object again, its bytes are already on disk: nothing is written, the record is touched.
- A record on disk is ``head | payload``; the head (``encode_head``) names the key, the layout,
  the payload's length and its checksum (XXH64), and the shell compares a read's head with the
  one it wrote and the payload's checksum with the head's, so a truncated, overwritten or stale
  record is a miss, never wrong bytes.
- **Snapshot** (``encode_snapshot``): the STORED records' offsets and heads, oldest first,
  written by the shell at a clean close and read back at the next start (``restore``).

Counters: ``disk_writes`` (records written), ``disk_reads`` (records read back from the file),
``disk_errors`` (failed writes, failed or bad reads), ``disk_evictions`` (records evicted for
room), ``spill_dropped`` (evicted cache entries not written: no room, or the shell's queue full),
``disk_hits`` (keys lookups found here; the shell counts them).

The index is owned by the master's event-loop thread; nothing here is thread-safe.
"""

from __future__ import annotations

import enum
import itertools
import struct
import zlib
from collections import OrderedDict
from typing import NamedTuple

from .allocator import TlsfAllocator

GRANULE = 4096
EVICTION_WINDOW = 64
MAX_KEY_BYTES = 64
MAX_LAYOUT_BYTES = 1 << 20
HEAD = struct.Struct("<4sIIIQQ")  # magic, head length, key length, layout length, nbytes, hash
HEAD_MAGIC = b"RSd1"
HEAD_ALIGN = 64
SNAPSHOT = struct.Struct("<4sIQ")  # magic, records, capacity
SNAPSHOT_MAGIC = b"RSi1"
SNAPSHOT_RECORD = struct.Struct("<QI")  # offset, head length
_CRC = struct.Struct("<I")


class BadRecord(ValueError):
    """Bytes that are not a record head or a snapshot this module wrote."""


class RecordHead(NamedTuple):
    key: bytes
    layout: bytes  # the object's layout, msgpack (``header.encode_layout``)
    nbytes: int
    checksum: int  # XXH64 of the payload
    length: int  # bytes of the head itself (the payload follows)


def head_length(key: bytes, layout: bytes) -> int:
    raw = HEAD.size + len(key) + len(layout)
    return -(-raw // HEAD_ALIGN) * HEAD_ALIGN


def encode_head(key: bytes, layout: bytes, nbytes: int, checksum: int) -> bytes:
    length = head_length(key, layout)
    fixed = HEAD.pack(HEAD_MAGIC, length, len(key), len(layout), nbytes, checksum)
    return (fixed + key + layout).ljust(length, b"\0")


def decode_head(raw: bytes) -> RecordHead:
    """The head at the start of ``raw``; BadRecord for anything ``encode_head`` did not write."""
    if len(raw) < HEAD.size:
        raise BadRecord(f"{len(raw)} bytes, a head has at least {HEAD.size}")
    magic, length, key_len, layout_len, nbytes, checksum = HEAD.unpack_from(raw)
    if magic != HEAD_MAGIC:
        raise BadRecord(f"magic {magic!r}")
    if not 1 <= key_len <= MAX_KEY_BYTES or layout_len > MAX_LAYOUT_BYTES:
        raise BadRecord(f"key of {key_len} bytes, layout of {layout_len}")
    key = bytes(raw[HEAD.size : HEAD.size + key_len])
    layout = bytes(raw[HEAD.size + key_len : HEAD.size + key_len + layout_len])
    if length != head_length(key, layout) or len(raw) < length:
        raise BadRecord(f"head length {length} for {len(raw)} bytes")
    if any(raw[HEAD.size + key_len + layout_len : length]):
        raise BadRecord("padding not zero")
    return RecordHead(key, layout, nbytes, checksum, length)


def encode_snapshot(capacity: int, records: list[tuple[int, bytes]]) -> bytes:
    """``(offset, head)`` per record, oldest first, and a CRC32 of it all."""
    parts = [SNAPSHOT.pack(SNAPSHOT_MAGIC, len(records), capacity)]
    for offset, head in records:
        parts.append(SNAPSHOT_RECORD.pack(offset, len(head)))
        parts.append(head)
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def decode_snapshot(raw: bytes) -> tuple[int, list[tuple[int, RecordHead]]]:
    """``(capacity, [(offset, head), ...])``; BadRecord unless ``encode_snapshot`` wrote it."""
    if len(raw) < SNAPSHOT.size + _CRC.size:
        raise BadRecord(f"snapshot of {len(raw)} bytes")
    body, (crc,) = raw[: -_CRC.size], _CRC.unpack(raw[-_CRC.size :])
    if zlib.crc32(body) != crc:
        raise BadRecord("snapshot checksum mismatch")
    magic, count, capacity = SNAPSHOT.unpack_from(body)
    if magic != SNAPSHOT_MAGIC:
        raise BadRecord(f"snapshot magic {magic!r}")
    pos = SNAPSHOT.size
    records = []
    for _ in range(count):
        if pos + SNAPSHOT_RECORD.size > len(body):
            raise BadRecord("snapshot ends inside a record")
        offset, length = SNAPSHOT_RECORD.unpack_from(body, pos)
        pos += SNAPSHOT_RECORD.size
        head = decode_head(body[pos : pos + length])
        if head.length != length:
            raise BadRecord(f"record at {offset}: head of {head.length} bytes, listed {length}")
        records.append((offset, head))
        pos += length
    if pos != len(body):
        raise BadRecord(f"{len(body) - pos} bytes after the last record")
    return capacity, records


class RecordState(enum.Enum):
    WRITING = "writing"
    STORED = "stored"


class DiskRecord:
    __slots__ = (
        "busy",
        "checksum",
        "gone",
        "head",
        "key",
        "layout",
        "mirror",
        "nbytes",
        "offset",
        "span",
        "staged",
        "state",
    )

    def __init__(self, key: bytes, layout: bytes, nbytes: int, offset: int, span: int) -> None:
        self.key = key
        self.layout = layout
        self.nbytes = nbytes
        self.offset = offset  # in the file: the head, then the payload
        self.span = span  # bytes of the file range (granules)
        self.state = RecordState.WRITING
        self.busy = 0  # writes and reads of the range running
        self.gone = False  # dropped: the range is freed when ``busy`` reaches 0
        self.head = b""  # as written (known once written)
        self.checksum = 0
        self.staged: int | None = None  # the shell's staging offset while WRITING
        self.mirror = 0  # oid of the pool object promoted from it (0: none)

    @property
    def head_length(self) -> int:
        return head_length(self.key, self.layout)

    @property
    def payload_offset(self) -> int:
        return self.offset + self.head_length


class DiskIndex:
    def __init__(self, capacity: int, *, granule: int = GRANULE) -> None:
        self.allocator = TlsfAllocator(capacity, granule)
        self.capacity = self.allocator.capacity
        self._records: OrderedDict[bytes, DiskRecord] = OrderedDict()  # oldest first
        self._busy_bytes = 0  # spans with I/O running, live or gone (not evictable)
        self._stored_bytes = 0  # payload bytes of STORED records
        self.counters = dict.fromkeys(
            (
                "disk_writes",
                "disk_reads",
                "disk_hits",
                "disk_errors",
                "disk_evictions",
                "spill_dropped",
            ),
            0,
        )

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: bytes) -> bool:
        return key in self._records

    def get(self, key: bytes) -> DiskRecord | None:
        return self._records.get(key)

    @property
    def stored_keys(self) -> int:
        return sum(1 for r in self._records.values() if r.state is RecordState.STORED)

    @property
    def stored_bytes(self) -> int:
        return self._stored_bytes

    # -- busy accounting ------------------------------------------------------------------------
    def _begin_io(self, record: DiskRecord) -> None:
        if not record.busy:
            self._busy_bytes += record.span
        record.busy += 1

    def _end_io(self, record: DiskRecord) -> None:
        record.busy -= 1
        if record.busy:
            return
        self._busy_bytes -= record.span
        if record.gone:
            self.allocator.free(record.offset)

    def _forget(self, record: DiskRecord) -> None:
        """The key is unknown from now on; its range is freed now or when its I/O ends."""
        del self._records[record.key]
        if record.state is RecordState.STORED:
            self._stored_bytes -= record.nbytes
        record.gone = True
        record.mirror = 0
        if not record.busy:
            self.allocator.free(record.offset)

    # -- spilling -------------------------------------------------------------------------------
    def mirrors(self, key: bytes, oid: int) -> bool:
        """True if the key's record holds the bytes of pool object ``oid`` (it was promoted
        from it): evicting that object then writes nothing, and counts as a use of the record."""
        record = self._records.get(key)
        if record is None or not oid or record.mirror != oid:
            return False
        if record.state is not RecordState.STORED:
            return False
        self._records.move_to_end(key)
        return True

    def place(self, key: bytes, layout: bytes, nbytes: int) -> DiskRecord | None:
        """Room for a new record of ``key`` (WRITING, busy until ``written``), replacing the
        key's record if it has one; None (counted as dropped) when nothing fits."""
        old = self._records.get(key)
        if old is not None:
            if old.busy:
                self.counters["spill_dropped"] += 1  # its I/O runs: keep it, skip this one
                return None
            self._forget(old)
        need = self.allocator.round_up(head_length(key, layout) + nbytes)
        offset = self.allocator.malloc(need)
        if offset is None:
            offset = self._evict_for(need)
            if offset is None:
                self.counters["spill_dropped"] += 1
                return None
        record = DiskRecord(key, layout, nbytes, offset, self.allocator.block_size(offset))
        self._records[key] = record
        self._begin_io(record)
        return record

    def _evict_for(self, need: int) -> int | None:
        alloc = self.allocator
        if alloc.capacity - self._busy_bytes < need:  # free + evictable: hopeless, keep all
            return None
        idle = (r for r in self._records.values() if not r.busy)
        for record in itertools.islice(idle, EVICTION_WINDOW):
            if alloc.span_if_freed(record.offset) >= need:
                self._evict(record)
                return alloc.malloc(need)
        while True:
            record = next((r for r in self._records.values() if not r.busy), None)
            if record is None:
                return None  # fragmented by busy records
            self._evict(record)
            offset = alloc.malloc(need)
            if offset is not None:
                return offset

    def _evict(self, record: DiskRecord) -> None:
        self._forget(record)
        self.counters["disk_evictions"] += 1

    def written(self, record: DiskRecord, head: bytes | None) -> None:
        """The writer is done with ``record``: ``head`` as written, or None if the write
        failed."""
        record.staged = None
        self._end_io(record)
        self.counters["disk_writes" if head is not None else "disk_errors"] += 1
        if record.gone:
            return
        if head is None:
            self._forget(record)
            return
        record.head = head
        record.checksum = decode_head(head).checksum
        record.state = RecordState.STORED
        self._stored_bytes += record.nbytes

    # -- promoting ------------------------------------------------------------------------------
    def begin_read(self, key: bytes) -> DiskRecord | None:
        """The key's record if it can be read back (STORED, or WRITING with its bytes still
        staged); a use. Busy until ``read_done``."""
        record = self._records.get(key)
        if record is None:
            return None
        self._records.move_to_end(key)
        self._begin_io(record)
        return record

    def read_done(self, record: DiskRecord, ok: bool, *, from_file: bool = True) -> None:
        """A read of ``record`` ended; not ``ok`` (short, failed, not the bytes written): the
        record is forgotten."""
        self._end_io(record)
        if from_file:
            self.counters["disk_reads"] += 1
        if not ok:
            self.counters["disk_errors"] += 1
            if not record.gone:
                self._forget(record)

    def set_mirror(self, record: DiskRecord, oid: int) -> None:
        if not record.gone:
            record.mirror = oid

    def drop(self, key: bytes) -> bool:
        """Forget the key's record (release, evict_keys); False if it had none."""
        record = self._records.get(key)
        if record is None:
            return False
        self._forget(record)
        return True

    # -- restart --------------------------------------------------------------------------------
    def snapshot(self) -> list[tuple[int, bytes]]:
        """``(offset, head)`` of the STORED records, oldest first (for ``encode_snapshot``)."""
        return [(r.offset, r.head) for r in self._records.values() if r.state is RecordState.STORED]

    def restore(self, records: list[tuple[int, RecordHead]]) -> int:
        """Adopt records of an earlier run (an empty index only), oldest first; those that do
        not lie inside the file, overlap an earlier one or repeat a key are skipped. Returns
        how many were adopted."""
        if self._records:
            raise RuntimeError("restore into an index that holds records")
        for offset, head in records:
            span = self.allocator.round_up(head.length + head.nbytes)
            if offset % self.allocator.granule or offset + span > self.capacity:
                continue
            if head.key in self._records:
                continue
            record = DiskRecord(head.key, head.layout, head.nbytes, offset, span)
            record.head = encode_head(head.key, head.layout, head.nbytes, head.checksum)
            record.checksum = head.checksum
            record.state = RecordState.STORED
            self._records[head.key] = record
        end = 0
        for record in sorted(self._records.values(), key=lambda r: r.offset):
            if record.offset < end:
                del self._records[record.key]  # overlaps one before it
            else:
                end = record.offset + record.span
        blocks = [(r.offset, r.span) for r in self._records.values()]
        self.allocator = TlsfAllocator.with_blocks(self.capacity, self.allocator.granule, blocks)
        self._stored_bytes = sum(r.nbytes for r in self._records.values())
        return len(self._records)
