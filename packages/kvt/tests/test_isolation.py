"""Peers isolated from each other: a receiver that stops reading never delays transfers to others.

One sender P, two receivers. Receiver A stops reading mid-transfer: either a real engine whose
reader thread is held (its completion callback of an earlier request blocks, and completion
callbacks run on the reader), or a raw TCP peer that speaks HELLO and never reads. While A is stuck,
P moves many requests to receiver B; every one of them must complete, byte-exact, before A's
stuck request reaches its deadline. That ordering is what fails if anything on P is shared between
links (one writer, a lock held across a blocking send, the timer or notifier thread waiting on A):
B's transfers would then queue behind A until A's deadline closes A's link. The stuck request
itself ends ABORTED(TIMEOUT) on P, its link closed, its completion delivered (memory released).
The receiving side is held to the same: a sender stalled mid-frame delays no other sender, and
close() gives all stuck links one flush deadline, not one each.

Every step waits on events (completions, the hook's "held" event); the one duration is A's
deadline, which is the thing under test. Speed with A stuck vs A absent is a timing claim and lives
in benchmarks/bench_isolation.py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest
from conftest import Completions, EngineFactory, wait_until
from ipcblock import make_blocks
from kvt import AbortCode, AbortOrigin, TransferStatus
from kvt.protocol import encode_data_head, encode_hello

BLOCK = 64 << 10
STUCK_BYTES = 64 << 20  # far more than a reader that stopped lets the socket buffers take
B_REQUESTS = 64
B_BLOCKS = 16  # 1 MiB per request to B
STUCK_TIMEOUT_S = 8.0  # B's 64 MiB take about a second on a crowded box; margin for CI
# Payload paths whose link a peer can stop reading (the in-memory backend copies on one thread
# per engine pair, so there the stuck request never starts and simply times out PENDING).
PATHS = ["tcp", "samehost"]


def _b_requests(p, b, *, src, dst, rs, rd_b, stuck: Completions) -> None:
    """Move B_REQUESTS requests P -> B while A is stuck; each completes before A's deadline."""
    rng = np.random.default_rng(1)
    slots = STUCK_BYTES // BLOCK
    for i in range(B_REQUESTS):
        src_ids = rng.choice(slots, B_BLOCKS, replace=False)
        dst_ids = rng.permutation(B_BLOCKS)
        blocks = make_blocks(src_ids * BLOCK, dst_ids * BLOCK, BLOCK, src_region=rs,
                             dst_region=rd_b)  # fmt: skip
        got = Completions()
        b.expect(f"b{i}", on_complete=got)
        p.send(f"b{i}", b.data_address, blocks, last=True, on_complete=got)
        for c in (got.wait(), got.wait()):
            assert c.ok, c
        assert stuck.empty(), f"A's stuck request finished before B's request {i}"
        assert p.status("stuck", "send") in (TransferStatus.PENDING, TransferStatus.TRANSFERRING)
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert np.array_equal(
                dst[d * BLOCK : (d + 1) * BLOCK], src[s * BLOCK : (s + 1) * BLOCK]
            )


def _assert_stuck_aborted_by_deadline(p, stuck: Completions, link_a) -> None:
    c = stuck.wait(timeout=STUCK_TIMEOUT_S + 20)
    assert (c.status, c.origin, c.code) == (
        TransferStatus.ABORTED, AbortOrigin.TIMEOUT, AbortCode.TIMEOUT,
    ), c  # fmt: skip
    assert link_a.closed  # the stalled link was closed: that is what released the memory
    assert p.status("stuck", "send") is TransferStatus.ABORTED


@pytest.mark.parametrize("path", PATHS)
def test_receiver_held_mid_transfer_does_not_delay_others(no_leaks, path) -> None:
    make = EngineFactory(path)
    p, a, b = make("P", default_timeout_s=30), make("A"), make("B")
    src = np.frombuffer(np.random.default_rng(0).bytes(STUCK_BYTES), dtype=np.uint8)
    dst_a = np.zeros(STUCK_BYTES, dtype=np.uint8)
    dst_b = np.zeros(B_BLOCKS * BLOCK, dtype=np.uint8)
    rs, rd_a, rd_b = p.register_region(src), a.register_region(dst_a), b.register_region(dst_b)
    try:
        # A's reader runs its completion callbacks: hold it in the "warm" request's callback.
        held, release = threading.Event(), threading.Event()
        got_a = Completions()

        def hold_reader(completion) -> None:
            got_a(completion)
            held.set()
            release.wait(60)

        a.expect("warm", on_complete=hold_reader)
        p.send("warm", a.data_address, make_blocks(0, 0, BLOCK, src_region=rs, dst_region=rd_a),
               last=True)  # fmt: skip
        assert held.wait(10), "A never received the warm-up request"
        link_a = p.backend.link_to(a.data_address)

        a.expect("stuck", on_complete=got_a)
        stuck = Completions()
        whole = make_blocks(0, 0, STUCK_BYTES, src_region=rs, dst_region=rd_a)
        p.send("stuck", a.data_address, whole, last=True, on_complete=stuck,
               timeout_s=STUCK_TIMEOUT_S)  # fmt: skip

        _b_requests(p, b, src=src, dst=dst_b, rs=rs, rd_b=rd_b, stuck=stuck)
        _assert_stuck_aborted_by_deadline(p, stuck, link_a)
        release.set()
        assert got_a.wait().ok  # "warm" (the held callback's own completion)
        assert got_a.wait().status is TransferStatus.ABORTED  # "stuck": the link went away
    finally:
        release.set()
        for engine in (p, a, b):
            engine.close()


def test_raw_peer_that_never_reads_does_not_delay_others(no_leaks) -> None:
    """TCP: A is a raw socket that says HELLO to P and never reads what P sends."""
    make = EngineFactory("tcp")
    p, b = make("P", default_timeout_s=30), make("B")
    src = np.frombuffer(np.random.default_rng(0).bytes(STUCK_BYTES), dtype=np.uint8)
    dst_b = np.zeros(B_BLOCKS * BLOCK, dtype=np.uint8)
    rs, rd_b = p.register_region(src), b.register_region(dst_b)
    server = socket.create_server(("127.0.0.1", 0), backlog=1)
    silent_address = f"127.0.0.1:{server.getsockname()[1]}"
    try:
        stuck = Completions()
        whole = make_blocks(0, 0, STUCK_BYTES, src_region=rs, dst_region=0)
        p.send("stuck", silent_address, whole, last=True, on_complete=stuck,
               timeout_s=STUCK_TIMEOUT_S)  # fmt: skip
        link_a = p.backend.link_to(silent_address)
        conn, _ = server.accept()  # accepted only to say HELLO; never read from
        conn.sendall(encode_hello("silent", silent_address))

        _b_requests(p, b, src=src, dst=dst_b, rs=rs, rd_b=rd_b, stuck=stuck)
        _assert_stuck_aborted_by_deadline(p, stuck, link_a)
        conn.close()
    finally:
        server.close()
        p.close()
        b.close()


def test_close_with_stuck_peers_is_bounded_once_not_per_peer(no_leaks, monkeypatch) -> None:
    """close() lets every writer flush its ABORTs within one shared deadline: three peers that
    stopped reading cost one CLOSE_FLUSH_S, not three (each join gets what is left of it)."""
    from kvt import tcp

    joins: list[tuple[float, float]] = []  # (when join_writer was called, the timeout it got)
    real_join = tcp.TcpLink.join_writer

    def spy(link, timeout: float) -> None:
        joins.append((time.monotonic(), timeout))
        real_join(link, timeout)

    monkeypatch.setattr(tcp.TcpLink, "join_writer", spy)
    p = EngineFactory("tcp")("P")
    src = np.zeros(STUCK_BYTES, dtype=np.uint8)
    rs = p.register_region(src)
    servers = [socket.create_server(("127.0.0.1", 0), backlog=1) for _ in range(3)]
    conns = []
    try:
        for i, server in enumerate(servers):
            address = f"127.0.0.1:{server.getsockname()[1]}"
            blocks = make_blocks(0, 0, STUCK_BYTES, src_region=rs, dst_region=0)
            p.send(f"stuck{i}", address, blocks, last=True)
            conn, _ = server.accept()
            conn.sendall(encode_hello(f"silent{i}", address))
            conns.append(conn)
        p.close()
        assert len(joins) == 3
        deadlines = [called + timeout for called, timeout in joins]
        assert max(deadlines) - min(deadlines) < 0.05, joins  # one deadline for every link
        assert all(timeout <= tcp.CLOSE_FLUSH_S for _, timeout in joins)
    finally:
        p.close()
        for sock in (*conns, *servers):
            sock.close()


def test_sender_stalled_mid_frame_does_not_delay_other_senders(no_leaks) -> None:
    """The receiving side: a raw sender announces 1 MiB, sends 100 KiB and goes quiet (a slow
    link). D's reader of that link waits inside the frame; P's 64 requests to D still complete
    before the stalled request's deadline, which closes that link and releases D's memory."""
    make = EngineFactory("tcp")
    p, d = make("P"), make("D")
    src = np.frombuffer(np.random.default_rng(0).bytes(STUCK_BYTES), dtype=np.uint8)
    dst = np.zeros(B_BLOCKS * BLOCK, dtype=np.uint8)
    stall_dst = np.zeros(2 << 20, dtype=np.uint8)
    rs, rd, rd_stall = p.register_region(src), d.register_region(dst), d.register_region(stall_dst)
    host, port = d.data_address.rsplit(":", 1)
    slow = socket.create_connection((host, int(port)), timeout=10)
    try:
        stalled = Completions()
        d.expect("stuck", timeout_s=STUCK_TIMEOUT_S, on_complete=stalled)
        slow.sendall(encode_hello("slow", "127.0.0.1:1"))
        blocks = make_blocks(0, 0, 1 << 20, dst_region=rd_stall)
        slow.sendall(encode_data_head("stuck", blocks, True) + b"\x05" * (100 << 10))
        wait_until(lambda: d.status("stuck", "recv") is TransferStatus.TRANSFERRING)
        rng = np.random.default_rng(2)
        for i in range(B_REQUESTS):
            src_ids = rng.choice(STUCK_BYTES // BLOCK, B_BLOCKS, replace=False)
            dst_ids = rng.permutation(B_BLOCKS)
            got = Completions()
            d.expect(f"p{i}", on_complete=got)
            p.send(f"p{i}", d.data_address, make_blocks(src_ids * BLOCK, dst_ids * BLOCK, BLOCK,
                   src_region=rs, dst_region=rd), last=True, on_complete=got)  # fmt: skip
            assert got.wait().ok
            assert got.wait().ok
            assert stalled.empty(), f"the stalled request finished before P's request {i}"
            for s, t in zip(src_ids, dst_ids, strict=True):
                assert np.array_equal(
                    dst[t * BLOCK : (t + 1) * BLOCK], src[s * BLOCK : (s + 1) * BLOCK]
                )
        c = stalled.wait(timeout=STUCK_TIMEOUT_S + 20)
        assert (c.status, c.origin, c.code) == (
            TransferStatus.ABORTED, AbortOrigin.TIMEOUT, AbortCode.TIMEOUT,
        ), c  # fmt: skip
        with contextlib.suppress(ConnectionResetError):  # D closed that link: EOF or reset
            while slow.recv(1 << 16):  # (its HELLO first; a socket timeout fails the test)
                pass
    finally:
        slow.close()
        p.close()
        d.close()
