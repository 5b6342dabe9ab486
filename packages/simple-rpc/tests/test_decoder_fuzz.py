"""Hypothesis fuzz of the sans-I/O decoder against a straightforward reference parser.

Derandomized (a fixed sequence of examples) so CI time and outcome are deterministic; together the
two properties run 12,000 cases.
"""

from __future__ import annotations

import itertools
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simple_rpc import FrameDecoder, ProtocolError, encode_frame

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
    preallocate_at=st.sampled_from([0, 8, 64 * 1024]),
)
def test_any_bytes_any_split_match_the_reference(parts, cuts, max_frame_size, preallocate_at):
    stream = b"".join(parts)
    decoder = FrameDecoder(max_frame_size, preallocate_at=preallocate_at)
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
    got, error = feed_in_chunks(FrameDecoder(preallocate_at=32), stream, cuts)
    assert error is None
    assert got == frames
