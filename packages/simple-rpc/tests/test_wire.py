from __future__ import annotations

import tracemalloc

import pytest
from simple_rpc import HEADER_SIZE, CallerError, FrameDecoder, ProtocolError, encode_frame
from simple_rpc.wire import CALL_ID_SIZE, HEADER


def test_header_layout_is_big_endian_head_length_call_id():
    frame = encode_frame(0x20181218, 7, b"xyz")
    assert HEADER_SIZE == 12
    assert (
        frame
        == bytes.fromhex("20181218") + (4 + 3).to_bytes(4, "big") + (7).to_bytes(4, "big") + b"xyz"
    )


def test_decodes_frames_in_one_chunk_and_split_byte_by_byte():
    stream = b"".join(
        encode_frame(h, i, bytes([i]) * i) for i, h in enumerate([1, 2, 0xFFFFFFFF, 4])
    )
    whole = [(f.head, f.call_id, bytes(f.payload)) for f in FrameDecoder().feed(stream)]
    assert whole == [
        (1, 0, b""),
        (2, 1, b"\x01"),
        (0xFFFFFFFF, 2, b"\x02\x02"),
        (4, 3, b"\x03" * 3),
    ]
    decoder = FrameDecoder()
    split = []
    for i in range(len(stream)):
        split += [(f.head, f.call_id, bytes(f.payload)) for f in decoder.feed(stream[i : i + 1])]
    assert split == whole
    assert decoder.buffered == 0


def test_large_frame_is_received_into_one_buffer():
    payload = bytes(range(256)) * 4096  # 1 MiB
    stream = encode_frame(9, 1, payload) + encode_frame(10, 2, b"tail")
    decoder = FrameDecoder()
    frames = []
    for start in range(0, len(stream), 65536 + 3):
        frames += decoder.feed(stream[start : start + 65536 + 3])
    assert [(f.head, f.call_id) for f in frames] == [(9, 1), (10, 2)]
    assert frames[0].payload == payload
    assert bytes(frames[1].payload) == b"tail"


def test_oversized_length_is_rejected_from_the_prefix_alone():
    decoder = FrameDecoder(max_frame_size=1024)
    good = encode_frame(1, 1, b"ok")
    bad_prefix = (5).to_bytes(4, "big") + (1025).to_bytes(4, "big")
    with pytest.raises(ProtocolError, match="over max_frame_size 1024") as info:
        decoder.feed(good + bad_prefix)  # no call id, no payload yet: rejected before buffering
    assert [bytes(f.payload) for f in info.value.frames] == [b"ok"]
    assert decoder.failed
    with pytest.raises(ProtocolError):
        decoder.feed(good)  # stays failed


def test_length_shorter_than_call_id_is_rejected():
    with pytest.raises(ProtocolError, match="shorter than its 4-byte call id"):
        FrameDecoder().feed((1).to_bytes(4, "big") + (3).to_bytes(4, "big") + b"\0\0\0")


def test_max_frame_size_is_inclusive_and_validated():
    payload = b"x" * 60
    assert len(FrameDecoder(max_frame_size=64).feed(encode_frame(1, 1, payload))) == 1
    with pytest.raises(ProtocolError):
        FrameDecoder(max_frame_size=63).feed(encode_frame(1, 1, payload))
    with pytest.raises(CallerError):
        FrameDecoder(max_frame_size=3)


def test_memory_follows_arrived_bytes_not_the_declared_length():
    """Headers declaring 48 MiB each, then 1 KiB of body and silence: the decoders hold what
    arrived (their accounting and the allocator agree), not what was declared."""
    declared, arrived, count = 48 << 20, 1024, 8
    start = HEADER.pack(1, CALL_ID_SIZE + declared, 1) + bytes(arrived)  # no 48 MiB body built
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        decoders = [FrameDecoder() for _ in range(count)]
        for decoder in decoders:
            for piece in (start[:100], start[100:]):  # header and body in separate reads
                assert decoder.feed(bytes(piece)) == []
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sum(d.buffered for d in decoders) == count * len(start)
    assert held < 4 * count * len(start) + 64 * 1024, held
