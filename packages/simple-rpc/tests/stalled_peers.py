"""Run as a script: a Server, stalled peers declaring large frames, and its RSS as JSON.

Used by test_memory.py in a subprocess of its own, so that nothing else in the process moves its
resident set. The server runs on a LoopThread; the peers are plain blocking sockets in the main
thread that each send one header declaring `DECLARED` bytes, `ARRIVED` bytes of its body, and
then nothing. Every step waits on an event set from the server's loop, never on a sleep.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading

from simple_rpc import LoopThread, Server
from simple_rpc.server import _ServerConnection

DECLARED = 48 << 20
ARRIVED = 1024
PEERS = 8
WAIT_S = 30.0


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    expected = PEERS * (12 + ARRIVED)
    received = threading.Event()
    left = threading.Event()
    server = Server(on_disconnect=lambda peer: left.set() if not server.connection_count else None)

    feed = _ServerConnection.data_received

    def data_received(conn: _ServerConnection, data: bytes) -> None:
        feed(conn, data)
        if server.buffered >= expected:
            received.set()

    _ServerConnection.data_received = data_received  # type: ignore[method-assign]
    loop = LoopThread(name="stalled-peers")
    host, port = loop.run(server.start("127.0.0.1", 0)).rsplit(":", 1)
    before = rss()
    frame_start = struct.pack(">III", 0x53520001, DECLARED + 4, 1) + bytes(ARRIVED)
    peers = [socket.create_connection((host, int(port))) for _ in range(PEERS)]
    for peer in peers:
        peer.sendall(frame_start)
    assert received.wait(WAIT_S), f"the server buffered {server.buffered} of {expected} bytes"
    stalled = rss()
    stalled_buffered = server.buffered
    for peer in peers:
        peer.close()
    assert left.wait(WAIT_S), "the stalled peers' connections did not end"
    after = rss()
    after_buffered = server.buffered
    loop.run(server.close())
    loop.close()
    json.dump(
        {
            "before": before,
            "stalled": stalled,
            "after": after,
            "buffered": stalled_buffered,
            "buffered_after": after_buffered,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
