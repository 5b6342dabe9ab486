from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ipcblock import make_blocks
from kvt.errors import ProtocolViolation
from kvt.outcome import AbortCode
from kvt.paths import choose_path
from kvt.protocol import (
    HEADER,
    Abort,
    AbortTarget,
    DataDescriptor,
    DataHeader,
    Done,
    FrameDecoder,
    Hello,
    PathMessage,
    PayloadBytes,
    PayloadEnd,
    Verdict,
    encode_abort,
    encode_control,
    encode_data_head,
    encode_desc,
    encode_done,
    encode_hello,
    encode_path,
    encode_verdict,
)

EXT_HELLO = {"boot_id": "b00t", "pid": 4242, "transport": "samehost",
                 "offers": (("samehost", b"\x01" * 24), ("tcp", b""))}  # fmt: skip


def stream() -> tuple[bytes, np.ndarray, bytes]:
    blocks = make_blocks([0, 100], [50, 7], [3, 4], src_region=1, dst_region=2, tag=5)
    payload = b"abcdefg"
    wire = (
        encode_hello("P0", "127.0.0.1:5000")
        + encode_data_head("req-1", blocks, last=True)
        + payload
        + encode_done("req-1", 7)
        + encode_abort("req-2", AbortCode.TIMEOUT, AbortTarget.RECEIVER, "too slow")
        + encode_data_head("req-3", blocks[:0], last=False)
        + encode_hello("P1", "h:1", **EXT_HELLO)
        + encode_verdict([("samehost", False, "other host"), ("tcp", True, "")])
        + encode_desc("req-4", blocks, True, 9, b"\xaa" * 16)
        + encode_path(1, 2, 9, 7, b"why")
    )
    return wire, blocks, payload


EXTRA = [Hello, Verdict, DataDescriptor, PathMessage]


def check_events(events, blocks, payload) -> None:
    payload_seen = b"".join(e.data for e in events if isinstance(e, PayloadBytes))
    kinds = [type(e) for e in events if not isinstance(e, PayloadBytes)]
    assert kinds == [Hello, DataHeader, PayloadEnd, Done, Abort, DataHeader, PayloadEnd, *EXTRA]
    hello, data, _, done, abort, empty, _, ext, verdict, desc, path = [
        e for e in events if not isinstance(e, PayloadBytes)
    ]
    assert not hello.extended
    assert ext == Hello("P1", "h:1", True, "b00t", 4242, "samehost", EXT_HELLO["offers"])
    assert ext.offer("samehost") == b"\x01" * 24
    assert ext.offer("rdma") is None
    assert verdict.as_dict() == {"samehost": "other host", "tcp": None}
    assert (desc.request_id, desc.last, desc.seq, desc.nbytes, desc.ext) == (
        "req-4", True, 9, 7, b"\xaa" * 16,
    )  # fmt: skip
    np.testing.assert_array_equal(desc.blocks, blocks)
    assert path == PathMessage(1, 2, 9, 7, b"why")
    assert hello == Hello("P0", "127.0.0.1:5000")
    assert data.request_id == "req-1"
    assert data.last
    np.testing.assert_array_equal(data.blocks, blocks)
    assert data.payload_len == 7
    assert payload_seen == payload
    assert done == Done("req-1", 7)
    assert abort == Abort("req-2", AbortCode.TIMEOUT, AbortTarget.RECEIVER, "too slow")
    assert empty.blocks.size == 0
    assert not empty.last


def test_round_trip_in_one_feed() -> None:
    wire, blocks, payload = stream()
    check_events(FrameDecoder().feed(wire), blocks, payload)


def test_round_trip_byte_by_byte() -> None:
    wire, blocks, payload = stream()
    decoder, events = FrameDecoder(), []
    for i in range(len(wire)):
        events += decoder.feed(wire[i : i + 1])
    check_events(events, blocks, payload)


@pytest.mark.parametrize("target", list(AbortTarget))
@pytest.mark.parametrize("confirms", [False, True])
def test_abort_round_trips_its_confirmation(target, confirms) -> None:
    """The verdict that confirms the sender's own abort rides bit 7 of ABORT's target byte."""
    message = Abort("r", AbortCode.CALLER_ABORT, target, "why", confirms)
    assert FrameDecoder().feed(encode_control(message)) == [message]


def test_payload_reported_by_io_layer() -> None:
    _, blocks, _ = stream()
    head = encode_data_head("r", blocks, last=False)
    decoder = FrameDecoder()
    assert decoder.next_read_size() == 16
    events = decoder.feed(head)
    assert isinstance(events[0], DataHeader)
    assert decoder.in_payload
    assert decoder.payload_left == 7
    assert decoder.payload_consumed(5) == []
    assert decoder.payload_consumed(2) == [PayloadEnd("r")]
    assert not decoder.in_payload


def header(ftype=2, meta_len=0, payload_len=0, magic=b"KV", version=1) -> bytes:
    return HEADER.pack(magic, version, ftype, meta_len, payload_len)


@pytest.mark.parametrize(
    "raw",
    [
        header(magic=b"XX", meta_len=4),
        header(version=9, meta_len=4),
        header(ftype=77, meta_len=4),
        header(ftype=3, meta_len=12, payload_len=5),  # DONE with a payload
        header(meta_len=1 << 30),  # oversized metadata
        # DATA whose payload_len disagrees with its blocks
        header(meta_len=8 + 1 + 30, payload_len=99)
        + struct.pack("<HBBI", 1, 0, 0, 1)
        + b"r"
        + make_blocks(0, 0, 10).tobytes(),
        # DATA whose block count runs past the metadata
        header(meta_len=8 + 1, payload_len=0) + struct.pack("<HBBI", 1, 0, 0, 5) + b"r",
        # lengths that wrap around u64 when summed
        header(meta_len=8 + 1 + 60, payload_len=0)
        + struct.pack("<HBBI", 1, 0, 0, 2)
        + b"r"
        + make_blocks([0, 0], [0, 0], [2**63, 2**63]).tobytes(),
        # empty request id, unknown flag, bad abort code
        header(meta_len=8) + struct.pack("<HBBI", 0, 0, 0, 0),
        header(meta_len=9) + struct.pack("<HBBI", 1, 0x80, 0, 0) + b"r",
        header(ftype=4, meta_len=5) + struct.pack("<HBB", 1, 200, 1) + b"r",
        header(ftype=1, meta_len=4) + struct.pack("<HH", 10, 10),
        # extended HELLO: unknown extension version, an offer running past the metadata
        header(ftype=1, meta_len=7) + struct.pack("<HHBH", 0, 0, 9, 0),
        header(ftype=1, meta_len=29)
        + encode_hello("x", "y", boot_id="b", offers=[("tcp", b"abc")])[16:-2],
        # DESC: with a payload, counts that do not add up, unknown flag
        header(ftype=5, meta_len=20, payload_len=5) + struct.pack("<HBBIQI", 0, 0, 0, 0, 0, 0),
        header(ftype=5, meta_len=21) + struct.pack("<HBBIQI", 1, 0, 0, 1, 0, 0) + b"r",
        header(ftype=5, meta_len=21) + struct.pack("<HBBIQI", 1, 4, 0, 0, 0, 0) + b"r",
        # PATH too short, VERDICT with a bad flag or running short
        header(ftype=6, meta_len=3) + b"abc",
        header(ftype=7, meta_len=6) + struct.pack("<BBcBH", 1, 1, b"t", 7, 0),
        header(ftype=7, meta_len=1) + struct.pack("<B", 2),
    ],
)
def test_malformed_frames_raise_protocol_violation(raw: bytes) -> None:
    decoder = FrameDecoder(max_meta=1 << 20)
    with pytest.raises(ProtocolViolation):
        decoder.feed(raw)
    with pytest.raises(ProtocolViolation):  # poisoned afterwards
        decoder.feed(b"")


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_fuzz_random_bytes(data: bytes, step: int) -> None:
    """Arbitrary input only ever yields typed events or ProtocolViolation."""
    decoder = FrameDecoder(max_meta=4096)
    try:
        for i in range(0, len(data), step):
            decoder.feed(data[i : i + step])
    except ProtocolViolation:
        pass


@settings(max_examples=1500, deadline=None)
@given(st.integers(0, 200), st.binary(min_size=1, max_size=8))
def test_fuzz_corrupted_valid_stream(position: int, garbage: bytes) -> None:
    wire, _, _ = stream()
    pos = position % len(wire)
    corrupted = wire[:pos] + garbage + wire[pos + len(garbage) :]
    decoder = FrameDecoder(max_meta=4096)
    try:
        events = decoder.feed(corrupted)
    except ProtocolViolation:
        return
    for event in events:
        assert isinstance(
            event,
            Hello | DataHeader | Done | Abort | PayloadBytes | PayloadEnd | DataDescriptor
            | PathMessage | Verdict,
        )  # fmt: skip


HELLO_FIELDS = st.tuples(
    st.text(max_size=40), st.text(max_size=40), st.text(max_size=64), st.integers(0, 2**32 - 1),
    st.sampled_from(["auto", "tcp", "samehost", "rdma"]),
    st.lists(st.tuples(st.text(min_size=1, max_size=12), st.binary(max_size=64)), max_size=5),
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(HELLO_FIELDS)
def test_fuzz_extended_hello_round_trip(fields) -> None:
    name, address, boot, pid, mode, offers = fields
    wire = encode_hello(name, address, boot_id=boot, pid=pid, transport=mode, offers=offers)
    (hello,) = FrameDecoder().feed(wire)
    assert hello == Hello(name, address, True, boot, pid, mode, tuple(offers))


VERDICTS = st.dictionaries(
    st.sampled_from(["tcp", "samehost", "rdma"]), st.none() | st.just("no")
).map(lambda d: {**d, "tcp": None})
MODES = st.sampled_from(["auto", "tcp", "samehost", "rdma"])


@settings(max_examples=500, deadline=None)
@given(MODES, MODES, VERDICTS, VERDICTS)
def test_choose_path_is_symmetric_and_never_falls_back(mode_a, mode_b, v_a, v_b) -> None:
    """Both ends compute the same choice; a forced path is chosen or the link fails."""
    a, why_a = choose_path(mode_a, mode_b, v_a, v_b)
    b, why_b = choose_path(mode_b, mode_a, v_b, v_a)
    assert a == b
    assert (a is None) == bool(why_a) == bool(why_b)
    forced = {m for m in (mode_a, mode_b) if m != "auto"}
    if forced:
        assert a in forced or a is None
    else:
        assert a is not None  # tcp is always there
    if a is not None:
        assert v_a.get(a, "") is None
        assert v_b.get(a, "") is None


def test_choose_path_prefers_samehost_and_says_why_forced_fails() -> None:
    ok = {"tcp": None, "samehost": None}
    assert choose_path("auto", "auto", ok, ok) == ("samehost", "")
    assert choose_path("auto", "auto", ok, {"tcp": None, "samehost": "probe failed"})[0] == "tcp"
    assert choose_path("tcp", "auto", ok, ok) == ("tcp", "")
    path, why = choose_path("samehost", "auto", ok, {"tcp": None, "samehost": "other host"})
    assert path is None
    assert "samehost" in why
    assert "other host" in why


def v1_only_decoder_error(wire: bytes) -> str | None:
    """What a kvt that predates the HELLO extension says of ``wire``'s first frame (its decoder
    accepted header version 1 only and a HELLO whose lengths add up exactly)."""
    _, version, ftype, meta_len, _ = HEADER.unpack_from(wire)
    if version != 1:
        return f"unsupported version {version}"
    name_len, addr_len = struct.unpack_from("<HH", wire, 16)
    if ftype == 1 and 4 + name_len + addr_len != meta_len:
        return "HELLO lengths do not add up"
    return None


def test_an_older_kvt_rejects_the_extended_hello_by_its_version() -> None:
    """An old decoder must say why it cannot talk to a new kvt, not that the HELLO is broken."""
    plain, extended = encode_hello("P", "h:1"), encode_hello("P", "h:1", **EXT_HELLO)
    assert v1_only_decoder_error(plain) is None  # a tool's plain HELLO still reaches old ones
    assert v1_only_decoder_error(extended) == "unsupported version 2"
    (hello,) = FrameDecoder().feed(plain)
    assert not hello.extended
    (hello,) = FrameDecoder().feed(extended)
    assert hello.extended
    with pytest.raises(ProtocolViolation, match="unsupported version 3"):
        FrameDecoder().feed(header(version=3, meta_len=4))
