"""The disk tier with a real master and a small pool (8 MiB): puts of keyed cache entries evict
to disk, lookups promote them back byte-identical; the staging area, a full queue, corrupted
and truncated records, a stalled read, the size bound, release, restarts (clean and killed) and
the errors at start. Every test checks that no thread or descriptor is left behind."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import zlib

import numpy as np
import pytest
import refstore
from refstore import CallerError, Client, MasterThread, faults
from refstore.disk_tier import DiskTier

KEYS = [b"chain-%02d" % i for i in range(16)]
MIB = 1 << 20


def _block(i: int) -> np.ndarray:
    """Just under 1 MiB each (a KV block's size), bytes that differ per key."""
    return np.random.default_rng(i).integers(0, 255, MIB - 4096 * (i % 3) - 7 * i, dtype=np.uint8)


def _crc(i: int) -> int:
    return zlib.crc32(_block(i))


@contextlib.contextmanager
def _disk_master(tmp_path, *, name: str = "disk", disk_size: str = "64M", **kwargs):
    with (
        MasterThread(name, "8M", disk=tmp_path / "tier", disk_size=disk_size, **kwargs) as m,
        Client(name, timeout=20.0) as c,
    ):
        yield m, c


def _put_one_by_one(client: Client, indexes, *, flushing: MasterThread | None = None) -> None:
    """Separate puts: a batch never evicts its own objects, later puts evict earlier ones.
    ``flushing``: wait for that master's writer after each (no record is busy at the next)."""
    for i in indexes:
        [ref] = client.put_keyed([(KEYS[i], _block(i))])
        assert ref is not None
        if flushing is not None:
            flushing.flush_disk()


def _check_bytes(client: Client, refs, first: int = 0) -> None:
    for i, ref in enumerate(refs, first):
        assert zlib.crc32(client.get(ref)) == _crc(i), f"key {KEYS[i]!r}"


@contextlib.contextmanager
def _stalled(monkeypatch, method: str):
    """Make ``DiskTier.<method>`` wait until the block ends (an event, not a sleep)."""
    go = threading.Event()
    original = getattr(DiskTier, method)

    def stalled(self, *args):
        go.wait()
        return original(self, *args)

    monkeypatch.setattr(DiskTier, method, stalled)
    try:
        yield go
    finally:
        go.set()


def test_evicted_entries_go_to_disk_and_lookups_bring_them_back(no_leaks, tmp_path):
    with _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(16))
        m.flush_disk()
        stats = c.stats()
        assert stats.keys == 8  # the pool holds 8 of them
        assert stats.evictions == 8
        assert (stats.disk_writes, stats.disk_keys, stats.spill_dropped) == (8, 8, 0)
        assert stats.disk_bytes == sum(_block(i).nbytes for i in range(8))
        assert stats.disk_capacity == 64 * MIB

        refs = c.lookup(KEYS[:6], hold_s=30.0)
        assert len(refs) == 6  # all promoted from disk
        assert all(ref.pool == c.epoch for ref in refs)
        _check_bytes(c, refs)
        assert c.counters["fast_gets"] == 6  # the promoted objects carry headers
        stats = c.stats()
        assert (stats.disk_reads, stats.disk_hits, stats.disk_errors) == (6, 6, 0)
        assert (stats.key_hits, stats.held) == (6, 6)

        again = c.lookup(KEYS[:6], hold_s=0)  # in memory now: no disk read
        assert again == refs
        assert c.stats().disk_reads == 6
        c.unhold(refs)

        # The promoted objects' bytes are still on disk: evicting them again writes nothing.
        m.flush_disk()
        before = c.stats()
        _put_one_by_one(c, range(8, 16))  # 14 and 15 are bound still; 8-13 are new objects
        m.flush_disk()
        stats = c.stats()
        # Eight evictions: 14 and 15 (the oldest, never on disk) are written, the six
        # promoted objects are mirrors of their records: nothing written for them.
        assert stats.evictions - before.evictions == 8
        assert stats.disk_writes - before.disk_writes == 2
        assert stats.disk_keys == 16
        whole = c.lookup(KEYS, hold_s=0)
        assert len(whole) >= 7  # as many as the pool holds, from the first key on
        _check_bytes(c, whole)


def test_a_lookup_while_the_writer_is_behind_reads_the_staging_area(
    no_leaks, tmp_path, monkeypatch
):
    with _stalled(monkeypatch, "_write") as go, _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(10))  # keys 0 and 1 wait for the writer
        stats = c.stats()
        assert (stats.evictions, stats.disk_writes, stats.disk_keys) == (2, 0, 0)
        refs = c.lookup(KEYS[:2], hold_s=0)
        assert len(refs) == 2
        _check_bytes(c, refs)
        stats = c.stats()
        assert (stats.disk_reads, stats.disk_hits) == (0, 2)  # copied from memory
        go.set()
        m.flush_disk()
        assert c.stats().disk_writes >= 2


def test_a_full_spill_queue_drops_entries_and_never_blocks(no_leaks, tmp_path, monkeypatch):
    with (
        _stalled(monkeypatch, "_write") as go,
        _disk_master(tmp_path, spill_queue=MIB) as (m, c),
    ):
        _put_one_by_one(c, range(11))  # three evictions: the first fills the queue
        stats = c.stats()
        assert (stats.evictions, stats.spill_dropped) == (3, 2)
        go.set()
        m.flush_disk()
        stats = c.stats()
        assert (stats.disk_writes, stats.disk_keys) == (1, 1)
        assert len(c.lookup(KEYS[:3], hold_s=0)) == 1  # the dropped ones are misses


def test_a_corrupted_record_is_a_miss_from_its_key_on_and_logged(no_leaks, tmp_path, caplog):
    with _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(12))
        m.flush_disk()
        record = m.master.disk.index.get(KEYS[2])
        with open(m.master.disk.path, "r+b") as f:
            f.seek(record.payload_offset + 1000)
            f.write(b"garbage!")
        with caplog.at_level(logging.WARNING, logger="refstore.master"):
            refs = c.lookup(KEYS[:4], hold_s=0)
        assert len(refs) == 2  # keys 0 and 1; key 2 is bad, so 3 is no part of the run
        _check_bytes(c, refs)
        assert f"key {KEYS[2]!r} a miss: payload checksum mismatch" in caplog.text
        stats = c.stats()
        assert stats.disk_errors == 1
        assert stats.disk_hits == 2
        assert KEYS[2] not in m.master.disk.index  # forgotten: the next lookup misses at once
        assert KEYS[3] in m.master.disk.index  # still good
        # Whatever the lookup allocated for keys 2 and 3 is freed.
        assert stats.objects == stats.keys


def test_a_truncated_file_is_a_miss_never_wrong_bytes(no_leaks, tmp_path, caplog, monkeypatch):
    with _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(12))
        m.flush_disk()
        index = m.master.disk.index
        cut = index.get(KEYS[1]).payload_offset + 100  # inside key 1's payload
        assert all(index.get(KEYS[i]).offset > cut for i in (2, 3))
        os.truncate(m.master.disk.path, cut)
        # The writer waits meanwhile: what the lookup evicts would grow the file again.
        with (
            _stalled(monkeypatch, "_write"),
            caplog.at_level(logging.WARNING, logger="refstore.master"),
        ):
            refs = c.lookup(KEYS[:4], hold_s=0)
        assert len(refs) == 1
        _check_bytes(c, refs)
        assert f"key {KEYS[1]!r} a miss: short read (100 of" in caplog.text
        assert f"key {KEYS[3]!r} a miss: short read of the head (0 of" in caplog.text
        assert c.stats().disk_errors == 3  # keys 1-3 were read in parallel, each failed


def test_a_read_past_the_timeout_is_a_miss_and_its_block_waits_for_it(
    no_leaks, tmp_path, monkeypatch
):
    with _disk_master(tmp_path, disk_read_timeout_s=0.2) as (m, c):
        _put_one_by_one(c, range(10))
        m.flush_disk()
        ended = threading.Semaphore(0)
        late_read = m.master._late_read

        def observed(*args):
            late_read(*args)
            ended.release()

        monkeypatch.setattr(m.master, "_late_read", observed)
        with _stalled(monkeypatch, "_read_into") as go:
            assert c.lookup(KEYS[:2], hold_s=0) == []
            stats = c.stats()
            assert stats.objects == stats.keys + 2  # the blocks being read into are kept
            go.set()
            assert ended.acquire(timeout=10)
            assert ended.acquire(timeout=10)  # both reads ended
        stats = c.stats()
        assert stats.objects == stats.keys
        assert stats.disk_errors == 0  # late, not bad: the records stay
        refs = c.lookup(KEYS[:2], hold_s=0)
        assert len(refs) == 2
        _check_bytes(c, refs)


def test_the_disk_size_bound_evicts_the_oldest_records(no_leaks, tmp_path):
    with _disk_master(tmp_path, disk_size="4M") as (m, c):
        _put_one_by_one(c, range(16), flushing=m)  # a record being written is not evicted
        stats = c.stats()
        assert stats.disk_keys == 4  # 8 spilled, 4 fit
        assert stats.disk_evictions == 4
        assert stats.disk_bytes <= 4 * MIB
        assert c.lookup(KEYS[:1], hold_s=0) == []  # key 0 was among the oldest
        refs = c.lookup(KEYS[4:8], hold_s=0)
        assert len(refs) == 4
        _check_bytes(c, refs, first=4)


def test_release_and_evict_keys_drop_the_disk_record_too(no_leaks, tmp_path):
    with _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(10))
        m.flush_disk()
        [ref] = c.lookup(KEYS[:1], hold_s=0)  # promoted, still on disk
        assert KEYS[0] in m.master.disk.index
        c.release([ref])
        assert KEYS[0] not in m.master.disk.index
        assert c.lookup(KEYS[:1], hold_s=0) == []
        assert KEYS[1] in m.master.disk.index
        faults.evict_keys(c, [KEYS[1]])  # on disk only
        assert KEYS[1] not in m.master.disk.index
        assert c.lookup(KEYS[1:2], hold_s=0) == []


def test_a_put_of_a_key_on_disk_wins_and_replaces_the_record_when_evicted(no_leaks, tmp_path):
    with _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(9))  # key 0 on disk
        m.flush_disk()
        other = np.full(1000, 7, dtype=np.uint8)
        [ref] = c.put_keyed([(KEYS[0], other)])  # not in memory: a new object binds the key
        assert c.lookup(KEYS[:1], hold_s=0) == [ref]
        _put_one_by_one(c, range(9, 16))  # evicts the new object: its bytes replace the record
        m.flush_disk()
        [again] = c.lookup(KEYS[:1], hold_s=0)
        assert bytes(c.get(again)) == other.tobytes()


def test_records_survive_a_clean_restart(no_leaks, tmp_path):
    with _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(12))
        m.flush_disk()
        assert c.stats().disk_keys == 4
    assert (tmp_path / "tier" / "disk.tier.index").exists()
    with _disk_master(tmp_path) as (m, c):
        assert not (tmp_path / "tier" / "disk.tier.index").exists()  # read, then removed
        assert c.stats().disk_keys == 4
        refs = c.lookup(KEYS[:4], hold_s=0)
        assert len(refs) == 4
        _check_bytes(c, refs)


def test_a_smaller_tier_after_a_restart_keeps_what_fits(no_leaks, tmp_path):
    with _disk_master(tmp_path) as (m, c):
        _put_one_by_one(c, range(16))
        m.flush_disk()
        records = [m.master.disk.index.get(key) for key in KEYS[:3]]
        assert records[0].offset < records[1].offset < records[2].offset
        size = records[2].offset + 4096  # key 2 crosses the end of the smaller file
    with _disk_master(tmp_path, disk_size=size) as (m, c):
        assert c.stats().disk_keys == 2
        refs = c.lookup(KEYS[:3], hold_s=0)
        assert len(refs) == 2
        _check_bytes(c, refs)


def test_a_killed_master_served_with_disk_restarts_with_an_empty_tier(no_leaks, tmp_path):
    tier = tmp_path / "tier"
    proc = refstore.start_master_process("served", "8M", disk=tier, disk_size="64M")
    try:
        with Client("served", timeout=20.0) as c:
            _put_one_by_one(c, range(10))
            assert c.stats().disk_capacity == 64 * MIB
            faults.kill_master(c)
    finally:
        proc.kill()
        proc.wait()
    assert not (tier / "served.tier.index").exists()  # no clean close, no index
    with _disk_master(tmp_path, name="served") as (_m, c):
        stats = c.stats()
        assert (stats.disk_keys, stats.disk_capacity) == (0, 64 * MIB)


def test_connect_autostart_passes_the_disk_tier(no_leaks, tmp_path):
    with refstore.connect(
        "auto", autostart=True, pool_size="8M", disk=str(tmp_path / "tier"), disk_size="16M"
    ) as c:
        try:
            assert c.stats().disk_capacity == 16 * MIB
        finally:
            c.shutdown_master()


def test_env_names_the_disk_tier(no_leaks, tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DISK", str(tmp_path / "from-env"))
    monkeypatch.setenv("REFSTORE_DISK_SIZE", "8M")
    with MasterThread("env", "8M") as m:
        assert m.master.disk is not None
        assert m.master.disk.index.capacity == 8 * MIB
    with MasterThread("env-off", "8M", disk="") as m:
        assert m.master.disk is None


def test_start_fails_clearly_on_an_unwritable_path(no_leaks, tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(CallerError, match=r"disk tier .*a-file/tier/bad\.tier: cannot create"):
        MasterThread("bad", "8M", disk=tmp_path / "a-file" / "tier")
    with MasterThread("bad", "8M"):  # nothing of the failed start is left (its lock included)
        pass


def test_start_fails_clearly_when_the_disk_has_no_room(no_leaks, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(CallerError, match="disk full"):
        MasterThread("full", "8M", disk=tmp_path / "tier", disk_size=2 * free + (1 << 30))


def test_one_tier_file_serves_one_master(no_leaks, tmp_path):
    with _disk_master(tmp_path), pytest.raises(CallerError, match="in use by another master"):
        DiskTier.open(tmp_path / "tier", "disk", 8 * MIB, loop=None)  # type: ignore[arg-type]
