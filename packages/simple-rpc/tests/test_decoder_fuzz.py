"""Hypothesis fuzz of the sans-I/O decoder against a straightforward reference parser.

Derandomized (a fixed sequence of examples) so CI time and outcome are deterministic; together the
properties run 15,000 cases. The last two feed large payloads piece by piece and check that what
a decoder holds, and charges to a shared budget, is exactly the bytes that arrived.
"""

from __future__ import annotations

import itertools
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simple_rpc import BufferBudget, BufferLimitExceeded, FrameDecoder, ProtocolError, encode_frame

FUZZ = {
    "derandomize": True,
    "deadline": None,
    "database": None,
    "suppress_health_check": list(HealthCheck),
}


def reference_parse(
    stream: bytes, max_frame_size: int
) -> tuple[list[tuple[int, int, bytes]], bool]:
    """(complete frames, whether the stream is malformed as far as it goes)."""
    frames = []
    pos = 0
    while len(stream) - pos >= 8:
        head, length = struct.unpack_from(">II", stream, pos)
        if length < 4 or length > max_frame_size:
            return frames, True
        if len(stream) - pos < 8 + length:
            break
        (call_id,) = struct.unpack_from(">I", stream, pos + 8)
        frames.append((head, call_id, stream[pos + 12 : pos + 8 + length]))
        pos += 8 + length
    return frames, False


heads = st.integers(0, 0xFFFFFFFF)
valid_frame = st.builds(encode_frame, heads, heads, st.binary(max_size=80))
bad_length = st.builds(
    lambda head, length, tail: struct.pack(">II", head, length) + tail,
    heads,
    st.one_of(st.integers(0, 3), st.integers(0, 0xFFFFFFFF)),
    st.binary(max_size=16),
)
segments = st.lists(
    st.one_of(valid_frame, valid_frame, bad_length, st.binary(max_size=24)), max_size=8
)


def feed_in_chunks(decoder: FrameDecoder, stream: bytes, cuts: list[int]):
    frames, error = [], None
    bounds = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    for start, end in itertools.pairwise(bounds):
        try:
            frames += decoder.feed(stream[start:end])
        except ProtocolError as err:
            frames += err.frames
            error = err
            break
    return [(f.head, f.call_id, bytes(f.payload)) for f in frames], error


@settings(max_examples=10_000, **FUZZ)
@given(
    parts=segments,
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    max_frame_size=st.sampled_from([4, 16, 64, 1 << 20]),
    gather_at=st.sampled_from([0, 8, 64 * 1024]),
)
def test_any_bytes_any_split_match_the_reference(parts, cuts, max_frame_size, gather_at):
    stream = b"".join(parts)
    decoder = FrameDecoder(max_frame_size, gather_at=gather_at)
    frames, error = feed_in_chunks(decoder, stream, cuts)
    expected, malformed = reference_parse(stream, max_frame_size)
    assert frames == expected
    assert (error is not None) == malformed
    if error is None:
        assert decoder.buffered == len(stream) - sum(12 + len(p) for _, _, p in expected)


@settings(max_examples=2_000, **FUZZ)
@given(
    frames=st.lists(st.tuples(heads, heads, st.binary(max_size=300)), max_size=6),
    cuts=st.lists(st.integers(0, 5_000), max_size=20),
)
def test_valid_streams_round_trip_whatever_the_split(frames, cuts):
    stream = b"".join(encode_frame(*f) for f in frames)
    got, error = feed_in_chunks(FrameDecoder(gather_at=32), stream, cuts)
    assert error is None
    assert got == frames


def pieces(stream: bytes, cuts: list[int]) -> list[bytes | bytearray | memoryview]:
    """`stream` cut at `cuts`, as the three kinds of buffer a caller may feed."""
    bounds = [0, *sorted(c % (len(stream) + 1) for c in cuts), len(stream)]
    kinds = (bytes, bytearray, memoryview)
    return [
        kinds[i % 3](stream[start:end]) for i, (start, end) in enumerate(itertools.pairwise(bounds))
    ]


def held_after(stream: bytes, fed: int) -> int:
    """Bytes of a valid stream's first `fed` bytes that are not yet in a complete frame."""
    complete, _ = reference_parse(stream[:fed], 1 << 30)
    return fed - sum(12 + len(p) for _, _, p in complete)


small_or_large = st.one_of(st.binary(max_size=40), st.binary(min_size=200, max_size=3000))
large_frames = st.lists(st.tuples(heads, heads, small_or_large), max_size=5)


@settings(max_examples=1_500, **FUZZ)
@given(
    frames=large_frames,
    cuts=st.lists(st.integers(0, 20_000), max_size=40),
    gather_at=st.sampled_from([0, 8, 256]),
)
def test_chunked_arrival_holds_exactly_the_bytes_that_arrived(frames, cuts, gather_at):
    stream = b"".join(encode_frame(*f) for f in frames)
    budget = BufferBudget(1 << 30)
    decoder = FrameDecoder(gather_at=gather_at, budget=budget)
    got, fed = [], 0
    for piece in pieces(stream, cuts):
        got += [(f.head, f.call_id, bytes(f.payload)) for f in decoder.feed(piece)]
        fed += len(piece)
        assert decoder.buffered == budget.used == held_after(stream, fed)
    assert got == frames
    assert budget.used == 0


@settings(max_examples=1_500, **FUZZ)
@given(
    streams=st.lists(large_frames, min_size=2, max_size=3),
    schedule=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 700)), max_size=30),
    limit=st.integers(0, 6000),
)
def test_a_shared_budget_refuses_exactly_the_feed_that_would_exceed_it(streams, schedule, limit):
    encoded = [b"".join(encode_frame(*f) for f in frames) for frames in streams]
    budget = BufferBudget(limit)
    decoders = [FrameDecoder(gather_at=64, budget=budget) for _ in encoded]
    fed = [0] * len(encoded)
    for pick, size in schedule:
        which = pick % len(encoded)
        decoder, stream = decoders[which], encoded[which]
        if decoder.failed or fed[which] == len(stream):
            continue
        piece = stream[fed[which] : fed[which] + size]
        others = budget.used - decoder.buffered
        would_hold = held_after(stream, fed[which] + len(piece))
        try:
            decoder.feed(piece)
        except BufferLimitExceeded:
            assert others + would_hold > limit
            assert decoder.failed
            assert decoder.buffered == 0
        else:
            assert others + would_hold <= limit
            assert decoder.buffered == would_hold
        fed[which] += len(piece)
        assert budget.used == sum(d.buffered for d in decoders) <= limit
    for decoder in decoders:
        decoder.release()
    assert budget.used == 0
