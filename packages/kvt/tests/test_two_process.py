"""Across processes and against hostile peers: byte-exact bulk transfer, killed and lying peers."""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import struct
import sys

import numpy as np
import peers
import pytest
from conftest import Completions, wait_until
from ipcblock import make_blocks
from kvt import AbortCode, AbortOrigin, TransferEngine, TransferStatus
from kvt.loopback import run_loopback
from kvt.protocol import (
    HEADER,
    Abort,
    AbortTarget,
    FrameDecoder,
    encode_data_head,
    encode_hello,
)


def test_256_mib_of_4096_scattered_64k_blocks_byte_exact(no_leaks) -> None:
    result = run_loopback(256 << 20, (64 << 10,), repeats=1)
    assert result.verified == {64 << 10: True}
    assert result.kvt[0].blocks == 4096


def raw_peer(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(encode_hello("evil", "10.0.0.1:1"))
    return sock


def read_frames(sock: socket.socket) -> list:
    decoder, events = FrameDecoder(), []
    while not any(isinstance(e, Abort) for e in events):
        data = sock.recv(65536)
        if not data:
            break
        events += decoder.feed(data)
    return events


def test_out_of_range_block_from_malicious_peer(no_leaks, caplog) -> None:
    with TransferEngine(name="D") as d:
        dst = np.zeros(1 << 20, np.uint8)
        region = d.register_region(dst)
        got = Completions()
        d.expect("req-evil", on_complete=got)
        sock = raw_peer(d.data_address)
        # Second block runs 1 byte past the end of the region.
        blocks = make_blocks([0, 0], [0, (1 << 20) - 99], [16, 100], dst_region=region)
        with caplog.at_level(logging.WARNING, logger="kvt"):
            sock.sendall(encode_data_head("req-evil", blocks, last=True) + b"\xff" * 116)
            c = got.wait()
        assert (c.status, c.origin, c.code) == (
            TransferStatus.ABORTED, AbortOrigin.PEER, AbortCode.BAD_BLOCK,
        )  # fmt: skip
        assert not dst.any()  # nothing written, not even the valid first block
        assert any("req-evil" in r.message and "evil" in r.message for r in caplog.records)
        aborts = [e for e in read_frames(sock) if isinstance(e, Abort)]
        assert aborts[0].request_id == "req-evil"
        assert aborts[0].code is AbortCode.BAD_BLOCK
        assert aborts[0].target is AbortTarget.SENDER
        # Same connection: unknown region, then an unknown request; the link is still in sync.
        got2 = Completions()
        d.expect("req-evil-2", on_complete=got2)
        sock.sendall(encode_data_head("req-evil-2", make_blocks(0, 0, 8, dst_region=77), True)
                     + b"\x01" * 8)  # fmt: skip
        assert got2.wait().code is AbortCode.BAD_BLOCK
        sock.sendall(encode_data_head("never-expected", make_blocks(0, 0, 8), True) + b"\x01" * 8)
        aborts = [e for e in read_frames(sock) if isinstance(e, Abort)]
        if aborts[-1].request_id != "never-expected":
            aborts += [e for e in read_frames(sock) if isinstance(e, Abort)]
        assert [(a.request_id, a.code) for a in aborts][-2:] == [
            ("req-evil-2", AbortCode.BAD_BLOCK), ("never-expected", AbortCode.UNKNOWN_REQUEST),
        ]  # fmt: skip
        # Garbage closes only that connection; the engine keeps serving others.
        sock.sendall(HEADER.pack(b"XX", 1, 2, 0, 0))
        sock.settimeout(10)
        while sock.recv(65536):
            pass  # drain until the engine closes the connection
        sock.close()
        assert_engine_still_serves(d, region)


def assert_engine_still_serves(d: TransferEngine, dst_region: int) -> None:
    with TransferEngine(name="good-P") as p:
        src = np.full(4096, 3, np.uint8)
        rs = p.register_region(src)
        got = Completions()
        d.expect("after-the-storm", on_complete=got)
        p.send("after-the-storm", d.data_address, make_blocks(0, 0, 4096, src_region=rs,
               dst_region=dst_region), last=True, on_complete=got)  # fmt: skip
        assert got.wait().ok
        assert got.wait().ok


def test_peer_dies_mid_frame(no_leaks) -> None:
    """A raw peer announces 1 MiB, sends 100 KiB and vanishes: ABORTED(TRANSPORT), no hang."""
    with TransferEngine(name="D") as d:
        region = d.register_region(np.zeros(2 << 20, np.uint8))
        got = Completions()
        d.expect("half", on_complete=got)
        sock = raw_peer(d.data_address)
        sock.sendall(encode_data_head("half", make_blocks(0, 0, 1 << 20, dst_region=region), True))
        sock.sendall(b"\x05" * (100 << 10))
        sock.close()
        c = got.wait()
        assert (c.origin, c.code) == (AbortOrigin.TRANSPORT, AbortCode.CONNECTION_LOST)
        assert_engine_still_serves(d, region)


def test_sender_process_killed_mid_transfer(no_leaks) -> None:
    ctx = mp.get_context("spawn")
    with TransferEngine(name="D") as d:
        nbytes = 8 << 20
        dst = np.zeros(nbytes, np.uint8)
        region = d.register_region(dst)
        got = Completions()
        d.expect("victim", on_complete=got)
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=peers.first_batch_then_hang, args=(child, d.data_address, region, nbytes)
        )
        proc.start()
        child.close()
        assert parent.recv() == "first batch queued"
        # Wait until the first batch is inside D (the request is TRANSFERRING), then kill -9.
        wait_until(lambda: d.status("victim", "recv") is not TransferStatus.PENDING)
        proc.kill()
        proc.join()
        parent.close()
        c = got.wait()
        assert (c.status, c.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
        assert dst[: nbytes // 2].min() == 7 or c.nbytes < nbytes // 2


def test_abort_frame_with_unknown_target_request_is_harmless(no_leaks) -> None:
    with TransferEngine(name="D") as d:
        region = d.register_region(np.zeros(4096, np.uint8))
        sock = raw_peer(d.data_address)
        meta = struct.pack("<HBB", 5, int(AbortCode.CALLER_ABORT), 2) + b"ghost" + b"why"
        sock.sendall(HEADER.pack(b"KV", 1, 4, len(meta), 0) + meta)
        sock.close()
        # The ghost abort is remembered: expecting it later completes ABORTED(PEER) at once.
        got = Completions()
        wait_until(lambda: d.status("ghost", "recv") is not None)
        d.expect("ghost", on_complete=got)
        assert got.wait().origin is AbortOrigin.PEER
        assert_engine_still_serves(d, region)


def test_demo_console_script_small(no_leaks, capsys) -> None:
    pytest.importorskip("rich", reason="kvt-demo's table needs the demo extra")
    from kvt.demo import main

    assert main(["--mib", "4", "--block-kib", "64", "16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "vs plain" in out
    assert "NO" not in out


def test_demo_without_rich_says_what_to_install(monkeypatch, capsys) -> None:
    from kvt.demo import main

    monkeypatch.setitem(sys.modules, "rich", None)  # makes "import rich..." raise ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    assert main(["--mib", "4"]) == 2
    assert "pip install 'kvt[demo]'" in capsys.readouterr().err
