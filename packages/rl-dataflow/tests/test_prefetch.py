"""The trainer's prefetch: right rows in the right order for every batch, a buffer never reused
while a step still reads it, and a shutdown with a gather in flight leaks no thread, no ref and no
shared memory. Without Ray (the trainer called in this process, a refstore master on a thread)."""

from __future__ import annotations

import os
import threading
import zlib

import numpy as np
import pytest
import refstore
import refstore.ray as rsray
from harness.fds import fd_targets
from rl_dataflow import pipeline
from rl_dataflow.pipeline import Batch, PipelineConfig, Trainer
from rl_dataflow.prefetch import PrefetchClosed, Prefetcher, SlotRing

ROW = (4, 4)


# -- the slot ring: a buffer goes to the next batch only once released -------------------------
def test_ring_hands_a_slot_on_only_after_release():
    ring = SlotRing(2)
    assert ring.submit("a") == 0
    assert ring.submit("b") == 1
    assert ring.submit("c") is None  # both buffers are being read: c waits
    assert ring.submit("d") is None
    assert ring.release("b") == ("c", 1)  # FIFO: the oldest waiter gets the freed buffer
    assert ring.release("a") == ("d", 0)
    assert ring.release("c") is None
    assert ring.release("d") is None
    assert sorted(ring.free) == [0, 1]


def test_ring_forgets_a_waiter_that_is_released():
    ring = SlotRing(1)
    assert ring.submit("a") == 0
    assert ring.submit("b") is None
    assert ring.release("b") is None  # dropped before it got a buffer
    assert ring.release("a") is None
    assert list(ring.free) == [0]
    assert ring.submit("x") == 0
    with pytest.raises(ValueError, match="twice"):
        ring.submit("x")


# -- the trainer's prefetch through refstore -----------------------------------------------------
@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path))
    with refstore.MasterThread(pipeline.REFSTORE_NAME, "32M"):
        try:
            yield rsray.client(pipeline.REFSTORE_NAME)
        finally:
            rsray.close_clients()


def _config(**kw) -> PipelineConfig:
    base = {"samples": 6, "mean_len": 20, "layers": ROW[0], "topk": ROW[1], "hidden": 16}
    return PipelineConfig(micro_batch_tokens=40, verify=True, **{**base, **kw})


def _batch(client, index: int, rng) -> tuple[list[Batch], np.ndarray]:
    """A batch put into refstore and cut into two micro-batches in a shuffled order, and the rows
    the trainer must see, in its final layout (every batch's rows differ: stale ones show)."""
    lengths = rng.integers(5, 28, 6).astype(np.int64)
    rows = rng.integers(0, 1 << 20, (int(lengths.sum()), *ROW), dtype=np.int32)
    rows[:, 0, 0] = index  # each batch marks its rows
    ref = client.put({"topk": rows})
    manifest = refstore.Manifest.from_packed(
        ref, lengths, dtype=np.int32, row_shape=ROW, key="topk"
    )
    tokens = [np.zeros(int(n), np.int32) for n in lengths]
    whole = Batch(np.arange(6), np.arange(6), lengths, tokens, manifest)
    order = rng.permutation(6)
    shuffled = whole.reorder(order)
    micro = shuffled.split([(0, 3), (3, 6)])
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    expected = np.concatenate([rows[offsets[i] : offsets[i] + lengths[i]] for i in order])
    return micro, expected


@pytest.mark.parametrize("replay", ["inline", "alongside"])
def test_prefetch_delivers_each_batch_its_own_rows_in_order(store, replay):
    """Batches prefetched one and two ahead (as the overlapped schedule does): every step trains
    on exactly its batch's rows, in the micro-batches' order (the CRC chains them in order)."""
    rng = np.random.default_rng(7)
    trainer = Trainer(_config(prefetch_slots=2, replay=replay))
    seen: list[np.ndarray] = []
    try:
        batches = [_batch(store, i, rng) for i in range(8)]
        trainer.prefetch("b0", batches[0][0])
        trainer.prefetch("b1", batches[1][0])
        for i, (micro, expected) in enumerate(batches):
            if i + 2 < len(batches):
                trainer.prefetch(f"b{i + 2}", batches[i + 2][0])  # waits for b{i}'s buffer
            rows, _ = trainer.prefetcher.take(f"b{i}")
            seen.append(np.concatenate([r for r in rows if r is not None]).copy())
            result = trainer.step(micro, f"b{i}")
            assert result["r3_checksum"] == zlib.crc32(expected)
            np.testing.assert_array_equal(seen[-1], expected)
        assert store.stats().objects == 0  # every step released its batch
    finally:
        trainer.close()


def test_a_held_buffer_is_not_gathered_into(store):
    """Two buffers, three batches: the third waits until a step releases a buffer, and the rows a
    step holds are never overwritten meanwhile."""
    rng = np.random.default_rng(11)
    trainer = Trainer(_config(prefetch_slots=2))
    prefetcher = trainer.prefetcher
    held: set[int] = set()
    writes_into_held: list[int] = []
    gather = trainer._gather

    def checking_gather(micro_batches, buffer):
        slot = next(i for i, b in enumerate(prefetcher.buffers) if b is buffer)
        if slot in held:
            writes_into_held.append(slot)
        return gather(micro_batches, buffer)

    prefetcher._gather = checking_gather
    try:
        (a, a_rows), (b, b_rows), (c, c_rows) = (_batch(store, i, rng) for i in range(3))
        trainer.prefetch("a", a)
        trainer.prefetch("b", b)
        got_a, _ = prefetcher.take("a")
        got_b, _ = prefetcher.take("b")
        held.update({0, 1})
        trainer.prefetch("c", c)
        assert list(prefetcher._ring.waiting) == ["c"]  # decided in submit: no buffer for c
        np.testing.assert_array_equal(np.concatenate(got_a), a_rows)
        held.discard(0)  # the step below releases it at its end (then c may be gathered)
        assert trainer.step(a, "a")["r3_checksum"] == zlib.crc32(a_rows)
        got_c, _ = prefetcher.take("c")
        np.testing.assert_array_equal(np.concatenate(got_c), c_rows)
        np.testing.assert_array_equal(np.concatenate(got_b), b_rows)  # b's rows untouched
        assert np.shares_memory(got_c[0], prefetcher.buffers[0])  # a's buffer, reused
        assert writes_into_held == []
        trainer.step(b, "b")
        trainer.step(c, "c")
    finally:
        trainer.close()


# -- shutdown with a gather in flight ----------------------------------------------------------
def _memfd_maps() -> int:
    with open("/proc/self/maps") as maps:
        return sum("memfd:" in line for line in maps)


def _open_shm_fds() -> set[str]:
    return {t for t in fd_targets() if t.startswith(("/dev/shm/", "/memfd:"))}


def test_shutdown_with_a_gather_in_flight_leaks_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path))
    threads_before = set(threading.enumerate())
    maps_before, fds_before = _memfd_maps(), _open_shm_fds()
    shm_before = set(os.listdir("/dev/shm"))
    rng = np.random.default_rng(5)
    gather_started, let_gather_go = threading.Event(), threading.Event()
    with refstore.MasterThread(pipeline.REFSTORE_NAME, "32M"):
        client = rsray.client(pipeline.REFSTORE_NAME)
        trainer = Trainer(_config(prefetch_slots=1))
        gather = trainer._gather

        def slow_gather(micro_batches, buffer):
            gather_started.set()
            assert let_gather_go.wait(30)
            return gather(micro_batches, buffer)

        trainer.prefetcher._gather = slow_gather
        (a, _), (b, _) = _batch(client, 0, rng), _batch(client, 1, rng)
        trainer.prefetch("a", a)  # gathering (held up)
        trainer.prefetch("b", b)  # waiting for the only buffer
        assert gather_started.wait(30)
        closer = threading.Thread(target=trainer.close)
        closer.start()
        let_gather_go.set()
        closer.join(30)
        assert not closer.is_alive()
        with pytest.raises(PrefetchClosed):
            trainer.prefetch("c", b)
        assert client.stats().objects == 0  # close released both prefetched batches
        rsray.close_clients()
    assert set(threading.enumerate()) <= threads_before  # the prefetch thread is gone
    assert not any(t.name == "rl-dataflow-prefetch" for t in threading.enumerate())
    assert _memfd_maps() == maps_before
    assert _open_shm_fds() <= fds_before
    assert not (set(os.listdir("/dev/shm")) - shm_before) & _open_shm_fds()


def test_prefetcher_close_fails_waiting_batches():
    ready = threading.Event()

    def gather(batch, buffer):
        ready.wait(30)
        return [buffer[: len(batch)]]

    prefetcher = Prefetcher(gather, slots=1, slot_rows=4, row_shape=(1,), dtype=np.int32)
    prefetcher.submit("a", [1], rows=1)
    prefetcher.submit("b", [1], rows=1)  # waits for a's buffer
    ready.set()
    prefetcher.take("a")
    prefetcher.close()
    with pytest.raises(PrefetchClosed):
        prefetcher.take("b")
    assert not any(t.name == "rl-dataflow-prefetch" for t in threading.enumerate())


def test_a_prefetch_arriving_after_its_step_gathers_nothing(store):
    """A threaded actor runs calls in no set order: a step may train (and release) its batch
    before the batch's prefetch call runs. That late prefetch must not gather the released refs
    or hold a buffer: with one buffer, the next batch would wait for it forever."""
    rng = np.random.default_rng(5)
    trainer = Trainer(_config(prefetch_slots=1))
    try:
        (a, a_rows), (b, b_rows) = (_batch(store, i, rng) for i in range(2))
        assert trainer.step(a, "a")["r3_checksum"] == zlib.crc32(a_rows)
        trainer.prefetch("a", a)  # late: its step is over
        assert trainer.prefetcher.pending() == []
        trainer.prefetch("b", b)
        assert trainer.step(b, "b")["r3_checksum"] == zlib.crc32(b_rows)
        assert store.stats().objects == 0
    finally:
        trainer.close()


def test_a_failed_step_gives_its_buffer_back(store):
    """A step whose compute raises still releases its buffer and its refs."""
    rng = np.random.default_rng(6)
    trainer = Trainer(_config(prefetch_slots=1))
    try:
        (a, _), (b, b_rows) = (_batch(store, i, rng) for i in range(2))
        trainer.prefetch("a", a)
        train = trainer._train

        def failing(*args):
            raise RuntimeError("the model failed")

        trainer._train = failing
        with pytest.raises(RuntimeError, match="the model failed"):
            trainer.step(a, "a")
        trainer._train = train
        trainer.prefetch("b", b)  # takes the one buffer: a gave it back
        assert trainer.step(b, "b")["r3_checksum"] == zlib.crc32(b_rows)
        assert store.stats().objects == 0
    finally:
        trainer.close()
