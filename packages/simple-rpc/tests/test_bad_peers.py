"""Bad input from peers: the offending connection is closed with a logged reason, others go on."""

from __future__ import annotations

import asyncio
import logging
import struct

import msgspec
import pytest
from conftest import (
    PING,
    RAW,
    WAIT_S,
    Ping,
    assert_closed_by_server,
    event_after,
    make_server,
    until,
)
from simple_rpc import ERROR_RESP, Client, ErrorBody, FrameDecoder, ProtocolError, encode_frame


async def read_frames(reader: asyncio.StreamReader, count: int):
    decoder, frames = FrameDecoder(), []
    while len(frames) < count:
        data = await asyncio.wait_for(reader.read(65536), WAIT_S)
        assert data, "server closed the connection"
        frames += decoder.feed(data)
    return frames


async def test_bad_clients_do_not_disturb_a_good_one(caplog):
    caplog.set_level(logging.WARNING, logger="simple_rpc")
    server = make_server(max_frame_size=1 << 20)
    address = await server.start("127.0.0.1", 0)
    host, port = address.rsplit(":", 1)
    good = Client(address)
    stop = asyncio.Event()
    answered = 0
    milestone = (0, asyncio.Event())  # set once `answered` reaches the count

    async def keep_calling() -> None:
        nonlocal answered
        while not stop.is_set():
            resp = await good.call(PING, Ping(answered), timeout=5.0)
            assert resp.n == answered + 1
            answered += 1
            if answered >= milestone[0]:
                milestone[1].set()

    caller = asyncio.ensure_future(keep_calling())
    try:
        # 1. garbage: a length shorter than the call id
        r1, w1 = await asyncio.open_connection(host, int(port))
        w1.write(b"\xde\xad\xbe\xef\x00\x00\x00\x01garbage")
        # 2. an oversized length: rejected from the 8-byte prefix, before any payload arrives
        r2, w2 = await asyncio.open_connection(host, int(port))
        w2.write(struct.pack(">II", PING.request_head, (1 << 20) + 1))
        # 3. one good request, then half a frame, then silence (the connection stays open)
        r3, w3 = await asyncio.open_connection(host, int(port))
        request = encode_frame(PING.request_head, 77, msgspec.msgpack.encode(Ping(1)))
        w3.write(request + request[:7])
        peers = [format_peer(w) for w in (w1, w2, w3)]

        await assert_closed_by_server(r1)
        await assert_closed_by_server(r2)
        (answer,) = await read_frames(r3, 1)
        assert (answer.head, answer.call_id) == (PING.response_head, 77)
        milestone = (answered + 200, asyncio.Event())  # the good client goes on while #3 hangs
        await until(milestone[1].is_set, milestone[1])
        assert not w3.is_closing()
        assert server.connection_count == 2  # the good client and the hanging one
    finally:
        stop.set()
        await caller
        await good.close()
        await server.close(grace=0.1)  # also ends the hanging connection
    await assert_closed_by_server(r3)
    for writer in (w1, w2, w3):
        writer.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(peers[0] in m and "shorter than its 4-byte call id" in m for m in warnings), warnings
    assert any(peers[1] in m and "over max_frame_size 1048576" in m for m in warnings), warnings


async def test_frames_before_garbage_in_the_same_read_are_answered_then_closed(server, caplog):
    """Valid requests that arrive in one read just before garbage are still dispatched and their
    answers (an async and a plain handler's) go out before the server closes the connection."""
    caplog.set_level(logging.WARNING, logger="simple_rpc")
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    ping = encode_frame(PING.request_head, 1, msgspec.msgpack.encode(Ping(1)))
    raw = encode_frame(RAW.request_head, 2, b"abc")
    writer.write(ping + raw + b"\xde\xad\xbe\xef\x00\x00\x00\x01garbage")
    frames = await read_frames_until_closed(reader)
    assert sorted((f.head, f.call_id) for f in frames) == [
        (PING.response_head, 1),
        (RAW.response_head, 2),
    ]
    assert bytes(next(f for f in frames if f.call_id == 2).payload) == b"cba"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    peer = format_peer(writer)
    assert any(peer in m and "shorter than its 4-byte call id" in m for m in warnings), warnings
    writer.close()


async def read_frames_until_closed(reader: asyncio.StreamReader):
    decoder, frames = FrameDecoder(), []
    while data := await asyncio.wait_for(reader.read(65536), WAIT_S):
        frames += decoder.feed(data)
    return frames


def format_peer(writer: asyncio.StreamWriter) -> str:
    host, port = writer.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


async def test_unknown_head_on_the_wire_keeps_the_connection(server):
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(encode_frame(0x12345678, 5, b"whatever"))
    writer.write(encode_frame(PING.request_head, 6, msgspec.msgpack.encode(Ping(9))))
    error, answer = await read_frames(reader, 2)
    assert (error.head, error.call_id) == (ERROR_RESP, 5)
    body = msgspec.msgpack.decode(error.payload, type=ErrorBody)
    assert body.kind == "unknown_head"
    assert (answer.head, answer.call_id) == (PING.response_head, 6)
    assert msgspec.msgpack.decode(answer.payload, type=Ping).n == 10
    writer.close()
    await writer.wait_closed()


async def test_malformed_answer_from_a_server_fails_the_client_calls(caplog):
    """A server that answers with a bad frame: pending calls fail, the next call reconnects."""
    answers = [struct.pack(">II", 1, 2), None]  # first connection: garbage; second: a good answer

    async def fake_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = await read_frames(reader, 1)
        bad = answers.pop(0)
        if bad is None:
            ping = msgspec.msgpack.decode(frames[0].payload, type=Ping)
            payload = msgspec.msgpack.encode(Ping(ping.n * 10))
            writer.write(encode_frame(PING.response_head, frames[0].call_id, payload))
        else:
            writer.write(bad)
        await reader.read()  # until the client goes away
        writer.close()

    srv = await asyncio.start_server(fake_server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with Client(f"127.0.0.1:{port}") as client:
        with pytest.raises(ProtocolError, match="shorter than its 4-byte call id"):
            await client.call(PING, Ping(1), timeout=5.0)
        assert (await client.call(PING, Ping(2), timeout=5.0)).n == 20
    srv.close()
    await srv.wait_closed()


async def test_peer_that_stops_reading_is_paused_not_buffered(server, monkeypatch):
    """Back-pressure: a peer that never reads its answers gets its requests paused; the server's
    buffer stays bounded, and once the peer reads, every answer arrives (nothing accepted lost)."""
    paused = event_after(monkeypatch, "pause_writing")
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = bytes(range(256)) * 256  # 64 KiB
    count = 400  # 25 MiB: more than the kernel buffers on both sides can absorb

    async def send_all() -> None:
        for call_id in range(count):
            writer.write(encode_frame(RAW.request_head, call_id, payload))
            await writer.drain()

    sender = asyncio.ensure_future(send_all())
    await until(paused.is_set, paused)
    (conn,) = server._connections
    assert not conn.transport.is_reading()
    assert not sender.done(), "the server read everything although its answers were not read"
    # Bounded by the answers to one read (asyncio reads up to 256 KiB at a time), not by count.
    assert conn.transport.get_write_buffer_size() < 8 * len(payload)
    frames = await read_frames(reader, count)
    await sender
    assert [f.call_id for f in frames] == list(range(count))
    assert all(f.head == RAW.response_head and f.payload == payload[::-1] for f in frames)
    writer.close()
    await writer.wait_closed()
