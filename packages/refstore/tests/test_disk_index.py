"""The disk tier's bookkeeping (``disk_index.py``) without files: placing, LRU eviction by the
size bound, busy ranges, mirrors, the record head and the snapshot codecs (fuzzed), restore."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given, settings, stateful
from hypothesis import strategies as st
from refstore.disk_index import (
    GRANULE,
    BadRecord,
    DiskIndex,
    RecordState,
    decode_head,
    decode_snapshot,
    encode_head,
    encode_snapshot,
    head_length,
)

LAYOUT = b"\x92\x00\x90"  # any bytes: the index never decodes a layout
MIB = 1 << 20


def _stored(index: DiskIndex, key: bytes, nbytes: int = MIB - 4096) -> None:
    record = index.place(key, LAYOUT, nbytes)
    assert record is not None
    index.written(record, encode_head(key, LAYOUT, nbytes, checksum=7))


def test_a_record_is_writing_then_stored_and_counted():
    index = DiskIndex(8 * MIB)
    record = index.place(b"k", LAYOUT, 1000)
    assert record is not None
    assert record.state is RecordState.WRITING
    assert record.busy == 1
    assert (index.stored_keys, index.stored_bytes) == (0, 0)
    head = encode_head(b"k", LAYOUT, 1000, checksum=1234)
    index.written(record, head)
    assert record.state is RecordState.STORED
    assert (record.head, record.checksum, record.busy) == (head, 1234, 0)
    assert (index.stored_keys, index.stored_bytes) == (1, 1000)
    assert index.counters["disk_writes"] == 1
    assert record.span == GRANULE
    assert record.payload_offset == record.offset + head_length(b"k", LAYOUT)


def test_a_failed_write_forgets_the_key_and_frees_its_range():
    index = DiskIndex(8 * MIB)
    record = index.place(b"k", LAYOUT, 1000)
    index.written(record, None)
    assert b"k" not in index
    assert index.allocator.used == 0
    assert index.counters["disk_errors"] == 1


def test_lru_eviction_by_the_size_bound_oldest_first_uses_count():
    index = DiskIndex(4 * MIB)  # four records of 1 MiB fill it
    for key in (b"a", b"b", b"c", b"d"):
        _stored(index, key)
    assert index.begin_read(b"a") is not None  # a use: "a" is the youngest now
    index.read_done(index.get(b"a"), True)
    _stored(index, b"e")
    assert b"b" not in index
    assert [k for k in (b"a", b"c", b"d", b"e") if k in index] == [b"a", b"c", b"d", b"e"]
    assert index.counters["disk_evictions"] == 1
    index.allocator.check()


def test_one_old_record_next_to_free_space_goes_alone():
    index = DiskIndex(6 * MIB)
    for key in (b"a", b"b", b"c", b"d", b"e"):
        _stored(index, key)
    index.drop(b"d")  # 1 MiB free between "c" and "e", 1 MiB at the end
    _stored(index, b"big", 3 * MIB - 4096)  # fits once "c" or "e" goes, not "a" or "b"
    assert b"a" in index
    assert b"b" in index
    assert index.counters["disk_evictions"] == 1


def test_busy_records_are_never_evicted_and_a_hopeless_place_drops():
    index = DiskIndex(2 * MIB)
    _stored(index, b"a")
    reading = index.begin_read(b"a")
    writing = index.place(b"b", LAYOUT, MIB - 4096)
    assert writing is not None
    assert index.place(b"c", LAYOUT, MIB - 4096) is None  # both busy: nothing evicted
    assert index.counters["spill_dropped"] == 1
    assert index.counters["disk_evictions"] == 0
    index.read_done(reading, True)
    assert index.place(b"c", LAYOUT, MIB - 4096) is not None  # "a" may go now
    assert b"a" not in index
    assert index.place(b"huge", LAYOUT, 4 * MIB) is None  # larger than the file


def test_a_range_dropped_while_busy_is_freed_when_its_io_ends():
    index = DiskIndex(2 * MIB)
    _stored(index, b"a")
    record = index.begin_read(b"a")
    assert index.drop(b"a")
    assert b"a" not in index  # unknown at once
    assert index.allocator.used == MIB  # but its range is not reusable yet
    _stored(index, b"b")
    writing = index.place(b"c", LAYOUT, MIB - 4096)  # evicts "b", never takes a's range
    assert writing is not None
    assert b"b" not in index
    assert writing.offset != record.offset
    assert index.place(b"d", LAYOUT, MIB - 4096) is None  # both ranges busy
    index.read_done(record, True)
    assert index.allocator.used == MIB
    assert index.place(b"d", LAYOUT, MIB - 4096).offset == record.offset


def test_a_bad_read_forgets_the_record():
    index = DiskIndex(2 * MIB)
    _stored(index, b"a")
    record = index.begin_read(b"a")
    index.read_done(record, False)
    assert b"a" not in index
    assert index.allocator.used == 0
    assert (index.counters["disk_reads"], index.counters["disk_errors"]) == (1, 1)


def test_a_newer_spill_of_a_key_replaces_its_record_unless_busy():
    index = DiskIndex(4 * MIB)
    _stored(index, b"a", 1000)
    old = index.get(b"a")
    _stored(index, b"a", 2000)
    assert index.get(b"a") is not old
    assert (index.stored_keys, index.stored_bytes) == (1, 2000)
    reading = index.begin_read(b"a")
    assert index.place(b"a", LAYOUT, 3000) is None  # a read of it runs: keep it
    index.read_done(reading, True)
    assert index.get(b"a").nbytes == 2000


def test_a_mirror_is_a_use_and_only_for_its_object():
    index = DiskIndex(4 * MIB)
    for key in (b"a", b"b"):
        _stored(index, key)
    record = index.begin_read(b"a")
    index.read_done(record, True)
    index.set_mirror(record, 42)
    _stored(index, b"c")
    assert not index.mirrors(b"a", 41)
    assert index.mirrors(b"b", 0) is False  # 0 is no object
    assert index.mirrors(b"a", 42)
    assert list(index._records) == [b"b", b"c", b"a"]
    index.drop(b"a")
    assert not index.mirrors(b"a", 42)


def test_head_round_trip_and_rejections():
    head = encode_head(b"key", LAYOUT, 123456, 0xDEADBEEF)
    assert len(head) % 64 == 0
    got = decode_head(head + b"payload")
    assert got == (b"key", LAYOUT, 123456, 0xDEADBEEF, len(head))
    for bad in (b"", head[:20], b"XXXX" + head[4:], head[:-1], head[:-1] + b"\1"):
        with pytest.raises(BadRecord):
            decode_head(bad)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decoders_reject_garbage_with_bad_record_only(raw):
    for decode in (decode_head, decode_snapshot):
        with contextlib.suppress(BadRecord):
            decode(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.integers(0, 199))
def test_snapshot_with_a_flipped_byte_is_rejected(noise, at):
    raw = encode_snapshot(8 * MIB, [(0, encode_head(b"a", LAYOUT, 10, 1))])
    at %= len(raw)
    flipped = raw[:at] + bytes([raw[at] ^ (noise[0] | 1)]) + raw[at + 1 :]
    with pytest.raises(BadRecord):
        decode_snapshot(flipped)


def test_snapshot_restore_keeps_order_and_skips_what_cannot_be():
    index = DiskIndex(8 * MIB)
    for key in (b"a", b"b", b"c"):
        _stored(index, key)
    index.read_done(index.begin_read(b"a"), True)  # order now b, c, a
    index.place(b"writing", LAYOUT, 10)  # not written: not in the snapshot
    capacity, records = decode_snapshot(encode_snapshot(index.capacity, index.snapshot()))
    assert capacity == 8 * MIB
    assert [head.key for _, head in records] == [b"b", b"c", b"a"]

    smaller = DiskIndex(2 * MIB)  # restarted with a smaller file: "c" lies past its end
    offsets = {head.key: offset for offset, head in records}
    assert offsets == {b"a": 0, b"b": MIB, b"c": 2 * MIB}
    overlapping = (MIB + GRANULE, decode_head(encode_head(b"x", LAYOUT, 10, 1)))
    repeated = (0, decode_head(encode_head(b"b", LAYOUT, 10, 1)))
    misaligned = (MIB + 1, decode_head(encode_head(b"y", LAYOUT, 10, 1)))
    kept = smaller.restore([*records, overlapping, repeated, misaligned])
    assert kept == 2
    assert list(smaller._records) == [b"b", b"a"]  # the order of the last run
    assert smaller.get(b"b").state is RecordState.STORED
    assert smaller.stored_bytes == 2 * (MIB - 4096)
    smaller.allocator.check()
    assert smaller.allocator.used == 2 * MIB
    _stored(smaller, b"d")  # evicts "b", the oldest
    assert list(smaller._records) == [b"a", b"d"]


class IndexMachine(stateful.RuleBasedStateMachine):
    """Random places, writes, reads, drops: the ranges always tile the file and live records
    never overlap; a busy range is never handed out again before its I/O ends."""

    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex(16 * GRANULE)
        self.io: list = []  # records with I/O running (one entry per begin)

    keys = st.sampled_from([b"k%d" % i for i in range(6)])

    @stateful.rule(key=keys, granules=st.integers(0, 6))
    def place(self, key, granules):
        record = self.index.place(key, LAYOUT, max(0, granules * GRANULE - 64))
        if record is not None:
            self.io.append(("write", record))

    @stateful.rule(data=st.data(), ok=st.booleans())
    def finish_io(self, data, ok):
        if not self.io:
            return
        kind, record = self.io.pop(data.draw(st.integers(0, len(self.io) - 1)))
        if kind == "write":
            head = encode_head(record.key, LAYOUT, record.nbytes, 0)
            self.index.written(record, head if ok else None)
        else:
            self.index.read_done(record, ok)

    @stateful.rule(key=keys)
    def read(self, key):
        record = self.index.begin_read(key)
        if record is not None:
            self.io.append(("read", record))

    @stateful.rule(key=keys)
    def drop(self, key):
        self.index.drop(key)

    @stateful.invariant()
    def ranges_tile_and_never_overlap(self):
        index = self.index
        index.allocator.check()
        running = {id(r): r for _, r in self.io}
        spans = sorted(
            [(r.offset, r.span) for r in index._records.values()]
            + [(r.offset, r.span) for r in running.values() if r.gone]
        )
        for (a, a_span), (b, _) in itertools.pairwise(spans):
            assert a + a_span <= b
        assert index.allocator.used == sum(span for _, span in spans)
        assert index._busy_bytes == sum(r.span for r in running.values())
        assert index.stored_bytes == sum(
            r.nbytes for r in index._records.values() if r.state is RecordState.STORED
        )
        for record in index._records.values():
            assert record.busy == sum(1 for _, r in self.io if r is record)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
