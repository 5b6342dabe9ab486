"""The object header as commit record: what the master may and may not take from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from refstore import _fastpath, codec, header

KEY = header.epoch_key("0123456789abcdef")
AT = header.CONTROL_BYTES


def _written(lease_deadline_ns: int = 0, flags: int = 0) -> tuple[memoryview, codec.Encoded]:
    view = memoryview(bytearray(1 << 16))
    encoded, _ = codec.encode_cached(np.zeros(100, np.float32), {})
    encoded.header.write(
        view, AT, 7, KEY, encoded.nbytes, lease_deadline_ns=lease_deadline_ns, flags=flags
    )
    return view, encoded


def test_a_sealed_header_reads_back_as_its_commit_record():
    view, encoded = _written(lease_deadline_ns=123, flags=header.OBJECT_PINNED)
    found = header.read_committed(view, AT, 7, KEY)
    assert found == header.Committed(
        encoded.header.hlen, encoded.nbytes, encoded.layout, 123, header.OBJECT_PINNED
    )


def test_no_commit_record_unless_sealed_whole_and_of_this_object():
    view, encoded = _written()
    end = AT + encoded.header.hlen + encoded.nbytes
    assert header.read_committed(view, AT, 7, KEY, end) is not None
    assert header.read_committed(view, AT, 7, KEY, end - 1) is None  # beyond its block
    assert header.read_committed(view, AT, 8, KEY) is None  # another oid
    assert header.read_committed(view, AT, 7, KEY ^ 1) is None  # another pool epoch
    state = AT + header.STATE_OFFSET
    view[state] = header.STATE_WRITING  # the rest may be half written: not a commit record
    assert header.read_committed(view, AT, 7, KEY) is None
    view[state] = header.STATE_FREED
    assert header.read_committed(view, AT, 7, KEY) is None
    view[state] = header.STATE_SEALED
    view[AT + header.HEADER_FIXED] = 0xC1  # never valid msgpack: a layout that does not decode
    assert header.read_committed(view, AT, 7, KEY) is None


def test_a_header_get_past_the_lease_defers_to_the_master():
    view, encoded = _written(lease_deadline_ns=1_000)
    reader = header.Reader(KEY)
    payload, layout, plan = reader.sealed(view, AT, 7, now_ns=1_000)
    assert (payload, layout, plan) == (AT + encoded.header.hlen, encoded.layout, None)
    assert reader.sealed(view, AT, 7, now_ns=1_001) is None
    header.set_lease(view, AT, 0)  # no lease: a cache entry, never past
    assert reader.sealed(view, AT, 7, now_ns=1 << 62) is not None
    assert header.last_access(view, AT) == 1 << 62  # eviction's second chance sees the read
    assert reader.sealed(view, AT, 8, now_ns=0) is None  # another object's header
    header.write_control(view, header.FLAG_MASTER_PATH)  # a fault plan: gets go to the master
    assert reader.sealed(view, AT, 7, now_ns=0) is None
    header.write_control(view, 0)
    assert reader.sealed(view, AT, 7, now_ns=0) is not None


def test_a_lone_tensor_gets_a_view_plan_and_a_bad_layout_is_no_object():
    view = memoryview(bytearray(1 << 16))
    tensor = torch.zeros((3, 5), dtype=torch.bfloat16)
    encoded, _ = codec.encode_cached(tensor, {})
    encoded.header.write(view, AT, 9, KEY, encoded.nbytes)
    reader = header.Reader(KEY)
    _, _, plan = reader.sealed(view, AT, 9, now_ns=0)
    assert plan == header.TensorPlan("bfloat16", (3, 5), (5, 1), 0, (4, 16))
    # A header whose layout claims more payload than the object holds is not taken.
    short = memoryview(bytearray(1 << 16))
    encoded.header.write(short, AT, 9, KEY, encoded.nbytes - 2)
    assert reader.sealed(short, AT, 9, now_ns=0) is None


@pytest.mark.parametrize(
    "nbytes", [0, 1, 4095, _fastpath.STREAM_MIN - 1, _fastpath.STREAM_MIN + 77]
)
@pytest.mark.parametrize("misalign", [0, 3, 31])
def test_copy_in_copies_every_byte_at_any_alignment(nbytes, misalign):
    """Large copies take the non-temporal path: head, 128-byte blocks and tail all land."""
    pool = bytearray(2 * _fastpath.STREAM_MIN + 4096)
    source = np.random.default_rng(nbytes).integers(0, 256, nbytes + misalign, dtype=np.uint8)
    assert _fastpath.copy_in(memoryview(pool), 4096 + misalign, source[misalign:])
    copied = pool[4096 + misalign : 4096 + misalign + nbytes]
    assert copied == source[misalign:].tobytes()
    again = bytearray(len(pool))
    _fastpath.copy_from(memoryview(again), 4096 + misalign, source.ctypes.data + misalign, nbytes)
    assert again == pool
    assert not any(pool[: 4096 + misalign])  # nothing written before the destination
    assert not any(pool[4096 + misalign + nbytes :])  # nor after it


def test_native_calls_refuse_what_lies_outside_the_pool():
    view = memoryview(bytearray(8192))
    source = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="outside the pool"):
        _fastpath.copy_in(view, 8190, source)
    with pytest.raises(ValueError, match="negative"):
        _fastpath.copy_in(view, -1, source)
    # Not C-contiguous, or no buffer at all: nothing copied, the caller takes the long way.
    assert not _fastpath.copy_in(view, 4096, np.zeros((4, 4), np.uint8)[:, ::2])
    assert not _fastpath.copy_in(view, 4096, torch.zeros(16, dtype=torch.uint8))
    assert not any(view)
    with pytest.raises(ValueError, match="outside the pool"):
        _fastpath.seal(view, 8192 - 32, b"x" * 64, 1, 2, 3, 0, 0)
    with pytest.raises(ValueError, match="aligned"):
        _fastpath.seal(view, 4100, b"x" * 64, 1, 2, 3, 0, 0)
    with pytest.raises(BufferError, match=r"not writable"):
        _fastpath.copy_in(memoryview(bytes(8192)), 0, source)
    with pytest.raises(ValueError, match="outside the pool"):
        _fastpath.copy_from(view, 8190, source.ctypes.data, 16)
    with pytest.raises(ValueError, match="negative"):
        _fastpath.copy_from(view, 4096, source.ctypes.data, -1)
    # Reads of headers that cannot be there are no object, never an error.
    for at in (0, 4100, 8192 - 8, 1 << 40):
        assert _fastpath.read_sealed(view, at, 1, 2, 0) is None
    with pytest.raises(ValueError, match="negative"):
        _fastpath.read_sealed(view, -8, 1, 2, 0)


def test_put_sealed_writes_payload_then_header_or_nothing():
    """A lone item's put in one native call: the payload, from a buffer or an address, then the
    header. What it cannot do (a strided source, a fault plan's master path) it leaves unwritten."""
    encoded, _ = codec.encode_cached(np.zeros(1000, np.float32), {})
    source = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    args = (encoded.nbytes, encoded.header.template, 7, KEY, 55, header.OBJECT_PINNED)
    hlen = encoded.header.hlen
    for payload in (source, source.ctypes.data):
        view = memoryview(bytearray(1 << 16))
        assert _fastpath.put_sealed(view, AT, hlen, payload, *args) is True
        assert bytes(view[AT + hlen : AT + hlen + encoded.nbytes]) == source.tobytes()
        found = header.read_committed(view, AT, 7, KEY)
        assert found == header.Committed(hlen, encoded.nbytes, encoded.layout, 55, 1)
    view = memoryview(bytearray(1 << 16))
    strided = np.zeros(2000, np.float32)[::2]
    assert _fastpath.put_sealed(view, AT, hlen, strided, *args) is False
    header.write_control(view, header.FLAG_MASTER_PATH)
    assert _fastpath.put_sealed(view, AT, hlen, source, *args) is None
    header.write_control(view, 0)
    assert not any(view[AT:])  # neither wrote a byte
    with pytest.raises(ValueError, match="not 4000"):
        _fastpath.put_sealed(view, AT, hlen, source[:-1], *args)
    with pytest.raises(ValueError, match="outside the pool"):
        _fastpath.put_sealed(view, len(view) - hlen, hlen, source, *args)
    with pytest.raises(ValueError, match="longer than the header"):
        _fastpath.put_sealed(view, AT, 64, source, *args)
    assert not any(view[AT:])
