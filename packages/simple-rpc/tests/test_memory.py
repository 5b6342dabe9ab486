"""Memory held for a connection follows the bytes that arrived, not what a header declares."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import stalled_peers
from conftest import PING, RAW, Ping, assert_closed_by_server, make_server, until
from simple_rpc import CallerError, Client, encode_frame

KIB = 1024


def test_stalled_peers_declaring_large_frames_leave_rss_flat():
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("stalled_peers.py"))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    result = json.loads(out)
    declared = stalled_peers.PEERS * stalled_peers.DECLARED  # 384 MiB
    assert result["buffered"] == stalled_peers.PEERS * (12 + stalled_peers.ARRIVED)
    assert result["buffered_after"] == 0
    # Before the fix every stalled header committed its declared 48 MiB at once.
    assert result["stalled"] - result["before"] < 16 << 20, (result, declared)
    assert result["after"] - result["before"] < 16 << 20, (result, declared)


async def test_a_server_wide_budget_refuses_the_connection_that_would_exceed_it(received, caplog):
    """Six peers stall with 150 KiB of a 200 KiB frame each (900 KiB of a 1 MiB budget): the
    seventh's bytes would exceed the budget, so that connection is refused and closed; the
    others and a good client go on, and what the stalled peers held comes back as they leave."""
    caplog.set_level(logging.WARNING, logger="simple_rpc")
    left = asyncio.Event()
    server = make_server(
        max_frame_size=256 * KIB, max_buffered=1024 * KIB, on_disconnect=lambda peer: left.set()
    )
    address = await server.start("127.0.0.1", 0)
    host, port = address.rsplit(":", 1)
    start = encode_frame(RAW.request_head, 9, bytes(200 * KIB))[: 12 + 150 * KIB]
    good = Client(address)
    try:
        assert (await good.call(PING, Ping(1))).n == 2
        stalled = [await asyncio.open_connection(host, int(port)) for _ in range(6)]
        for _, writer in stalled:
            writer.write(start)
        await until(lambda: server.buffered == 6 * len(start), received)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(start)
        await assert_closed_by_server(reader)  # refused
        assert server.buffered == 6 * len(start)
        assert (await good.call(PING, Ping(2))).n == 3
        for _, stalled_writer in stalled[:3]:
            stalled_writer.close()
        await until(lambda: server.buffered == 3 * len(start), left)
        # Room again for a whole large frame.
        assert await good.call(RAW, bytes(200 * KIB), timeout=10.0) == bytes(200 * KIB)
        for _, stalled_writer in stalled[3:]:
            stalled_writer.close()
        await until(lambda: server.buffered == 0, left)
    finally:
        await good.close()
        await server.close()
        writer.close()
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1
    assert "over the budget of 1048576" in refusals[0]


def test_the_budget_must_hold_one_whole_frame():
    with pytest.raises(CallerError, match="max_buffered"):
        make_server(max_frame_size=1024 * KIB, max_buffered=1024 * KIB)
