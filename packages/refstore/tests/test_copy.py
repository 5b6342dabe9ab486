"""The one copy of a put at every size: the native copy (GIL released, split over threads) and the
puts that use it, bit for bit, under concurrency, with nothing left behind."""

from __future__ import annotations

import contextlib
import os
import threading
import zlib

import numpy as np
import pytest
import torch
from refstore import Client, MasterThread, ObjectGone, _fastpath, checksum, codec, gather

MIB = 1 << 20
BIG = _fastpath.RELEASE_GIL_MIN  # from here a copy runs without the GIL, split when asked
SPLIT = _fastpath.SPLIT_MIN


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@contextlib.contextmanager
def copy_threads(n: int):
    previous = _fastpath.set_copy_threads(n)
    try:
        yield
    finally:
        _fastpath.set_copy_threads(previous)


@pytest.fixture
def big_client(no_leaks):
    with MasterThread("big", "400M") as master, Client("big", timeout=10.0) as client:
        yield client
        del master


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("nbytes", "misalign"),
    [(BIG - 1, 0), (BIG, 0), (2 * SPLIT + 12345, 7), (3 * SPLIT + 4097, 33), (SPLIT + 1, 1)],
)
def test_native_copy_is_exact_whatever_the_split(threads, nbytes, misalign):
    rng = np.random.default_rng(nbytes)
    source = rng.integers(0, 256, nbytes + misalign, dtype=np.uint8)[misalign:]
    pool = np.full(nbytes + 2 * 4096, 0xA5, dtype=np.uint8)
    with copy_threads(threads):
        assert _fastpath.copy_in(memoryview(pool), 4096 + misalign, source)
    assert np.array_equal(pool[4096 + misalign : 4096 + misalign + nbytes], source)
    outside = np.concatenate([pool[: 4096 + misalign], pool[4096 + misalign + nbytes :]])
    assert (outside == 0xA5).all()  # nothing written around it


def test_copy_threads_are_checked_and_the_default_is_one():
    assert _fastpath.set_copy_threads(1) == 1  # the default: one thread unless measured faster
    for bad in (0, -1, 9):
        with pytest.raises(ValueError, match="copy threads"):
            _fastpath.set_copy_threads(bad)


def test_a_lone_array_of_any_size_is_put_by_one_native_call():
    """Large lone items used to take a slower way (numpy plus a helper thread, 1.5-1.8x a memcpy
    in an actor); now every contiguous lone item is one ``put_sealed``."""
    for nbytes in (4096, 64 * MIB, 1 << 30):
        source = np.empty(nbytes, np.uint8)  # never touched: no memory used
        layout, _, total = codec.encode(source)
        assert codec.Encoded(layout, total).direct is not None
        tensor = torch.from_numpy(source)
        layout, _, total = codec.encode(tensor)
        assert codec.Encoded(layout, total).direct is not None


def _check(got, want) -> None:
    if isinstance(want, torch.Tensor):
        want = want.detach().resolve_conj().resolve_neg()
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert torch.equal(got.contiguous().view(-1).view(torch.uint8), _bytes_of(want))
    else:
        np.testing.assert_array_equal(got, want)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _large_objects():
    rng = np.random.default_rng(1)
    floats = rng.standard_normal(BIG // 4 + 1000).astype(np.float32)
    base = torch.from_numpy(rng.standard_normal((1536, 2048)).astype(np.float32))  # 12 MiB
    yield "numpy float32", floats
    yield "numpy strided", rng.integers(0, 1000, (2048, 2 * 2048), dtype=np.int32)[:, ::2]
    yield "numpy structured", np.zeros(BIG // 12 + 5, dtype=[("x", "<i4"), ("y", "<f8")])
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64):
        yield f"torch {dtype}", base.to(dtype)
    yield "torch bool", base > 0
    yield "torch transposed", base.t()
    yield "torch sliced", base[:, 1::2]
    yield "torch conj", torch.complex(base, -base).conj()
    yield "torch neg bit", torch.complex(base, base).conj().imag
    yield "torch needs grad", base.clone().requires_grad_(True)
    yield "torch float8", base.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_large_puts_of_every_kind_round_trip_bit_for_bit(big_client, threads):
    with copy_threads(threads):
        for name, obj in _large_objects():
            ref = big_client.put(obj)
            _check(big_client.get(ref), obj)
            big_client.release(ref)
            ref = big_client.put({"a": obj, "b": b"tail"})  # item by item, sealed after
            got = big_client.get(ref)
            _check(got["a"], obj)
            assert bytes(got["b"]) == b"tail", name
            big_client.release(ref)


def test_concurrent_large_puts_and_gets_keep_every_byte(big_client):
    """Copies run without the GIL: several threads putting large objects at once each get
    their own bytes back."""
    errors: list[BaseException] = []
    start = threading.Barrier(1)

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            start.wait()
            for _ in range(3):
                payload = rng.integers(0, 256, BIG + seed * 4096 + 3, dtype=np.uint8)
                tensor = torch.from_numpy(payload.view(np.uint8)[: BIG // 2 * 2].copy())
                refs = [big_client.put(payload), big_client.put(tensor)]
                got = big_client.get(refs[0])
                assert zlib.crc32(got) == zlib.crc32(payload)
                # Compared through numpy: torch's own ops would start a thread pool per thread.
                assert zlib.crc32(big_client.get(refs[1]).numpy()) == zlib.crc32(tensor.numpy())
                del got
                big_client.release(refs)
        except BaseException as err:
            errors.append(err)

    worker(99)
    start = threading.Barrier(4)
    with copy_threads(2):
        workers = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert not errors, errors


def test_a_split_copy_leaves_no_thread_behind(big_client):
    payload = np.ones(4 * SPLIT, np.uint8)
    big_client.release(big_client.put(payload))  # the client's own threads start here
    before = _os_threads()
    with copy_threads(4):
        for _ in range(3):
            big_client.release(big_client.put(payload))
    assert _os_threads() == before  # each copy joins its helpers before it returns


def test_payloads_locate_many_objects_and_copy_their_segments_out(client):
    """``payloads``: where each one-array object's bytes lie, headers checked as a get checks
    them; ``copy_out`` copies any of their segments to this process's memory in one call."""
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (64, 4096, 100_000)]
    refs = client.put_keyed([(b"k%d" % i, a) for i, a in enumerate(arrays)], ttl=None)
    refs.append(client.put(rng.standard_normal(50).astype(np.float32)))
    payloads = client.payloads(refs)
    assert list(payloads.nbytes) == [64, 4096, 100_000, 200]
    for i, array in enumerate(arrays):
        assert np.array_equal(payloads.array(i), array)
        assert checksum(payloads.array(i)) == checksum(array.tobytes())
    assert checksum(arrays[1]) != checksum(arrays[1][:-1])
    # The middle of each object, scattered backwards into one buffer.
    out = np.zeros(3 * 32, np.uint8)
    at = out.ctypes.data + np.array([64, 32, 0], np.uint64)
    payloads.copy_out(payloads.offsets[:3] + np.uint64(16), at, np.full(3, 32, np.uint64))
    assert np.array_equal(out[64:], arrays[0][16:48])
    assert np.array_equal(out[32:64], arrays[1][16:48])
    assert np.array_equal(out[:32], arrays[2][16:48])
    with pytest.raises(ValueError, match="outside"):
        payloads.copy_out(
            np.array([len(payloads.view) - 8], np.uint64),
            np.array([out.ctypes.data], np.uint64),
            np.array([16], np.uint64),
        )
    client.release(refs[3])
    with pytest.raises(ObjectGone):
        client.payloads(refs[3:])


def test_segment_copies_move_every_segment_whatever_the_order():
    """The native segment loops, both ways, above and below the size that releases the GIL."""
    rng = np.random.default_rng(4)
    for size in (4096, BIG // 1024 + 1):
        pool = bytearray(rng.integers(0, 256, 1024 * size, dtype=np.uint8).tobytes())
        order = rng.permutation(1024).astype(np.uint64)
        offsets = np.arange(1024, dtype=np.uint64) * np.uint64(size)
        out = np.zeros(1024 * size, np.uint8)
        lengths = np.full(1024, size, np.uint64)
        _fastpath.copy_out_segments(
            pool, offsets, out.ctypes.data + order * np.uint64(size), lengths
        )
        rows = np.frombuffer(bytes(pool), np.uint8).reshape(1024, size)
        assert np.array_equal(out.reshape(1024, size)[order], rows)
        back = bytearray(len(pool))
        gather(back, offsets, out.ctypes.data + order * np.uint64(size), lengths)
        assert back == pool
    with pytest.raises(TypeError, match="uint64"):
        _fastpath.copy_out_segments(
            bytearray(8), np.zeros(1, np.int64), np.zeros(1, np.uint64), np.zeros(1, np.uint64)
        )
    with pytest.raises(ValueError, match="lengths"):
        _fastpath.copy_out_segments(
            bytearray(8), np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.zeros(2, np.uint64)
        )
