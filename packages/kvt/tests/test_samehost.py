"""The samehost payload path and path selection: across processes, forced, refused, killed."""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import samehost_peers as peers
from conftest import Completions, kvt_threads
from ipcblock import make_blocks
from kvt import AbortCode, AbortOrigin, TransferEngine, TransferStatus
from kvt import samehost as sh
from kvt.errors import ProtocolViolation
from kvt.paths import IOV_MAX, RECV_CHUNK, TcpPathProvider, local_boot_id
from kvt.protocol import (
    FrameDecoder,
    PathMessage,
    Verdict,
    encode_data_head,
    encode_desc,
    encode_hello,
    encode_verdict,
)
from kvt.samehost import CmaError, ReadPlan
from kvt.tcp import TcpBackend

pytestmark = pytest.mark.skipif(sh.SamehostProvider().unavailable() is not None,
                                reason="no process_vm_readv on this platform")  # fmt: skip

MiB = 1 << 20


def spawn(target, *args) -> tuple[mp.Process, object]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    child.close()
    return proc, parent


def link_paths(engine: TransferEngine) -> list[str]:
    return [link.path for link in engine.backend.links()]


def check_scattered(dst: np.ndarray, nbytes: int) -> None:
    _, perm = peers.scattered(nbytes, 0, 0)
    src = peers.pattern(nbytes).reshape(-1, peers.BLOCK)
    np.testing.assert_array_equal(dst.reshape(-1, peers.BLOCK)[perm], src)


def receive_from_child(transport, env, nbytes=16 * MiB) -> tuple[tuple, list[str], np.ndarray]:
    """D here, P in a child process; returns (child's report, D's link paths at DONE, dst)."""
    with TransferEngine(name="D") as d:
        dst = np.zeros(nbytes, np.uint8)
        region = d.register_region(dst)
        got = Completions()
        paths_at_done: list[str] = []

        def on_done(c) -> None:
            paths_at_done.extend(link_paths(d))  # on D's reader thread: the link is alive
            got(c)

        d.expect("r", on_complete=on_done)
        proc, conn = spawn(peers.send_once, d.data_address, region, nbytes, (transport, env))
        report = conn.recv()
        proc.join()
        conn.close()
        assert got.wait().ok
        return report, paths_at_done, dst


def test_auto_picks_samehost_across_two_processes(no_leaks) -> None:
    report, d_paths, dst = receive_from_child(None, None)
    assert report[0] == "done"
    assert report[3] == ["samehost"]  # the sender's link
    assert d_paths == ["samehost"]  # the receiver's
    check_scattered(dst, 16 * MiB)


@pytest.mark.parametrize(("transport", "env"), [("tcp", None), (None, "tcp")])
def test_forced_tcp_across_two_processes(no_leaks, transport, env) -> None:
    report, d_paths, dst = receive_from_child(transport, env, 4 * MiB)
    assert report[0] == "done"
    assert report[3] == ["tcp"]
    assert d_paths == ["tcp"]
    check_scattered(dst, 4 * MiB)


def small_transfer(p: TransferEngine, d: TransferEngine, rid: str) -> tuple:
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    rs, rd = p.register_region(src), d.register_region(dst)
    got_p, got_d = Completions(), Completions()
    d.expect(rid, on_complete=got_d)
    p.send(rid, d.data_address, make_blocks(0, 0, 1 << 16, src_region=rs, dst_region=rd),
           last=True, on_complete=got_p)  # fmt: skip
    cp, cd = got_p.wait(), got_d.wait()
    if cp.ok:
        np.testing.assert_array_equal(dst, src)
    return cp, cd


def test_forced_samehost_to_another_host_fails_with_the_reason(no_leaks) -> None:
    other_host = TcpBackend(name="D", boot_id="another-host-boot-id")
    with (
        TransferEngine(name="P", transport="samehost") as p,
        TransferEngine(backend=other_host) as d,
    ):
        src = p.register_region(np.ones(4096, np.uint8))
        got = Completions()
        blocks = make_blocks(0, 0, 4096, src_region=src, dst_region=1)
        p.send("r", d.data_address, blocks, last=True, on_complete=got)
        c = got.wait()
        assert (c.status, c.origin, c.code) == (
            TransferStatus.ABORTED, AbortOrigin.TRANSPORT, AbortCode.CONNECT_FAILED,
        )  # fmt: skip
        assert "'samehost' is forced but unusable" in c.reason
        assert "another host" in c.reason
        assert "another-host-boot-id" in c.reason


def test_auto_to_another_host_uses_tcp(no_leaks) -> None:
    other_host = TcpBackend(name="D", boot_id="another-host-boot-id")
    with TransferEngine(name="P") as p, TransferEngine(backend=other_host) as d:
        cp, cd = small_transfer(p, d, "r")
        assert cp.ok
        assert cd.ok
        assert link_paths(p) == ["tcp"]


def refuse_probe(monkeypatch) -> None:
    def denied(pid: int, address: int, nbytes: int) -> bytes:
        raise CmaError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(sh, "_read_word_bytes", denied)


def test_probe_failure_in_auto_falls_back_to_tcp(no_leaks, monkeypatch) -> None:
    refuse_probe(monkeypatch)
    with TransferEngine(name="P") as p, TransferEngine(name="D") as d:
        cp, cd = small_transfer(p, d, "r")
        assert cp.ok
        assert cd.ok
        assert link_paths(p) == ["tcp"]


def test_probe_failure_with_forced_samehost_says_why(no_leaks, monkeypatch) -> None:
    refuse_probe(monkeypatch)
    with TransferEngine(name="P", transport="samehost") as p, TransferEngine(name="D") as d:
        cp, _ = small_transfer_no_wait_receiver(p, d)
        assert (cp.origin, cp.code) == (AbortOrigin.TRANSPORT, AbortCode.CONNECT_FAILED)
        assert "EPERM" in cp.reason
        assert "CAP_SYS_PTRACE" in cp.reason


def small_transfer_no_wait_receiver(p, d) -> tuple:
    src = p.register_region(np.ones(4096, np.uint8))
    dst = d.register_region(np.zeros(4096, np.uint8))
    got = Completions()
    p.send("r", d.data_address, make_blocks(0, 0, 4096, src_region=src, dst_region=dst),
           last=True, on_complete=got)  # fmt: skip
    return got.wait(), None


def test_bad_transport_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        TcpBackend(transport="carrier-pigeon")


class Gate:
    """Stops the receiver's reader before it reads chunk ``at`` until the test says go."""

    def __init__(self, monkeypatch, at: int) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        real = ReadPlan.read_chunk

        def read_chunk(plan, pid: int, k: int) -> int:
            if k == at and not self.reached.is_set():
                self.reached.set()
                assert self.go.wait(30)
            return real(plan, pid, k)

        monkeypatch.setattr(ReadPlan, "read_chunk", read_chunk)


def test_sender_killed_mid_read(no_leaks, monkeypatch) -> None:
    """kill -9 of the sender between two chunk reads: ABORTED(TRANSPORT) naming the request."""
    gate = Gate(monkeypatch, at=1)
    nbytes = 32 * MiB  # one frame, four 8 MiB chunks
    with TransferEngine(name="D") as d:
        dst = np.zeros(nbytes, np.uint8)
        region = d.register_region(dst)
        got = Completions()
        d.expect("victim", on_complete=got)
        proc, conn = spawn(peers.send_and_hang, d.data_address, region, nbytes)
        assert conn.recv() == "queued"
        assert gate.reached.wait(30)
        proc.kill()
        proc.join()
        conn.close()
        gate.go.set()
        c = got.wait()
        assert (c.status, c.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
        assert "victim" in c.reason
        assert "ESRCH" in c.reason
        assert c.nbytes == 8 * MiB  # the first chunk, read while the sender lived
        p_only = TransferEngine(name="P2")
        with p_only:
            cp, cd = small_transfer(p_only, d, "after")
        assert cp.ok
        assert cd.ok


def test_sender_gives_up_mid_read_receiver_discards(no_leaks, monkeypatch) -> None:
    """The sender's link dies while the receiver is between chunks: the sender's completion
    comes first, and the receiver then keeps nothing it reads: ABORTED, never DONE."""
    gate = Gate(monkeypatch, at=1)
    nbytes = 32 * MiB
    with TransferEngine(name="P", transport="samehost") as p, TransferEngine(name="D") as d:
        src = np.full(nbytes, 9, np.uint8)
        dst = np.zeros(nbytes, np.uint8)
        rs, rd = p.register_region(src), d.register_region(dst)
        got_p, got_d = Completions(), Completions()
        d.expect("r", on_complete=got_d)
        p.send("r", d.data_address, make_blocks(0, 0, nbytes, src_region=rs, dst_region=rd),
               last=True, on_complete=got_p)  # fmt: skip
        assert gate.reached.wait(30)
        (link,) = [x for x in p.backend.links() if x.path == "samehost"]
        link.close("test: link dropped mid-read")
        cp = got_p.wait()
        assert (cp.status, cp.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
        src[:] = 0xEE  # the caller reuses its memory right after its completion
        gate.go.set()
        cd = got_d.wait()
        assert (cd.status, cd.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
        assert "gave up the link" in cd.reason or "CONNECTION_LOST" in cd.reason
        assert cd.nbytes == 8 * MiB
        assert not (dst[: 8 * MiB] != 9).any()  # what it kept was read while the sender held it


def test_unmapped_source_is_a_typed_abort_on_both_ends(no_leaks, caplog) -> None:
    """EFAULT: the sender names memory it does not have; that request aborts, the link stays."""
    with TransferEngine(name="P", transport="samehost") as p, TransferEngine(name="D") as d:
        bogus = p.register_region((4096, 1 << 16))  # page 1: never mapped (mmap_min_addr)
        dst = d.register_region(np.zeros(1 << 16, np.uint8))
        got_p, got_d = Completions(), Completions()
        d.expect("bad", on_complete=got_d)
        p.send("bad", d.data_address, make_blocks(0, 0, 1 << 16, src_region=bogus,
               dst_region=dst), last=True, on_complete=got_p)  # fmt: skip
        cd, cp = got_d.wait(), got_p.wait()
        for c in (cd, cp):
            assert (c.status, c.origin, c.code) == (
                TransferStatus.ABORTED, AbortOrigin.PEER, AbortCode.BAD_BLOCK,
            )  # fmt: skip
            assert "EFAULT" in c.reason
            assert "'bad'" in c.reason
        (link,) = p.backend.links()
        cp2, cd2 = small_transfer(p, d, "good")
        assert cp2.ok
        assert cd2.ok
        assert p.backend.links() == [link]  # same link, still samehost
        assert link.path == "samehost"


# ------------------------------------------------------------------ the read plan, no engines
@pytest.mark.parametrize("halves", [False, True], ids=["one-thread", "halves-on-two-threads"])
@pytest.mark.parametrize("short_reads", [False, True])
def test_read_plan_copies_exactly_in_chunks(monkeypatch, short_reads, halves) -> None:
    """Scattered records of 0-3000 bytes plus one that spans chunks, shuffled on the source."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 3000, 3000).astype(np.uint64)
    lengths[7] = 300_000
    total = int(lengths.sum())
    dst_off = np.cumsum(lengths) - lengths
    src_off = np.zeros_like(dst_off)
    perm = rng.permutation(len(lengths))
    src_off[perm] = np.cumsum(lengths[perm]) - lengths[perm]
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, np.uint8)
    calls = []
    real = sh.read_remote

    def checked(pid, local_iov, remote_iov) -> int:
        assert len(local_iov) <= IOV_MAX
        assert len(remote_iov) == len(local_iov)
        if short_reads:  # the kernel stops early: only part of the first iovec
            cap = min(int(local_iov[0, 1]), int(rng.integers(1, 40_000)))
            one_l, one_r = local_iov[:1].copy(), remote_iov[:1].copy()
            one_l[0, 1] = one_r[0, 1] = cap
            local_iov, remote_iov = one_l, one_r
        calls.append(len(local_iov))
        return real(pid, local_iov, remote_iov)

    monkeypatch.setattr(sh, "read_remote", checked)
    chunk = (256 << 10) if short_reads else RECV_CHUNK  # RECV_CHUNK: > IOV_MAX segments a chunk
    plan = ReadPlan(dst.ctypes.data + dst_off, src.ctypes.data + src_off, lengths, chunk)
    if halves:  # what two read threads do: the back half of each chunk on another thread
        got = [read_in_halves(plan, k) for k in range(plan.chunks)]
    else:
        got = [plan.read_chunk(os.getpid(), k) for k in range(plan.chunks)]
    assert got[:-1] == [chunk] * (plan.chunks - 1)  # exact chunks of the abort granularity
    assert sum(got) == total
    expected = np.zeros(total, np.uint8)
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist(), strict=True):
        expected[d : d + n] = src[s : s + n]
    np.testing.assert_array_equal(dst, expected)
    assert len(calls) > plan.chunks  # several calls per chunk (IOV_MAX or short reads)


def read_in_halves(plan: ReadPlan, k: int) -> int:
    a, m, b = plan.split(k)
    assert a < m < b or m == b
    back: list[int] = []
    helper = threading.Thread(target=lambda: back.append(plan.read_segments(os.getpid(), m, b)))
    helper.start()
    front = plan.read_segments(os.getpid(), a, m)
    helper.join()
    return front + back[0]


def test_read_plan_splits_chunks_about_in_half() -> None:
    lengths = np.full(256, 64 << 10, np.uint64)
    addresses = np.arange(256, dtype=np.uint64) * np.uint64(64 << 10)
    plan = ReadPlan(addresses, addresses, lengths, RECV_CHUNK)
    assert [plan.split(k) for k in range(plan.chunks)] == [(0, 64, 128), (128, 192, 256)]
    one = ReadPlan(addresses[:1], addresses[:1], lengths[:1], RECV_CHUNK)
    assert one.split(0) == (0, 1, 1)  # one segment: nothing to hand to a second thread


def two_readers(name: str) -> TcpBackend:
    providers = [sh.SamehostProvider(read_threads=2), TcpPathProvider()]
    return TcpBackend(name=name, transport="samehost", providers=providers)


def test_two_read_threads_move_scattered_blocks_exactly(no_leaks) -> None:
    """KVT_SAMEHOST_READ_THREADS=2: each chunk halved between the reader and its helper thread,
    which the path owns (joined on close: no_leaks)."""
    nbytes = 24 * MiB
    with (
        TransferEngine(name="P", transport="samehost") as p,
        TransferEngine(backend=two_readers("D")) as d,
    ):
        src, dst = peers.pattern(nbytes), np.zeros(nbytes, np.uint8)
        rs, rd = p.register_region(src), d.register_region(dst)
        blocks, _ = peers.scattered(nbytes, rs, rd)
        got_p, got_d = Completions(), Completions()
        d.expect("r", on_complete=got_d)
        p.send("r", d.data_address, blocks, last=True, on_complete=got_p)
        assert got_p.wait().ok
        assert got_d.wait().ok
        assert any(t.startswith("kvt-samehost-read") for t in kvt_threads())
        check_scattered(dst, nbytes)


def test_two_read_threads_helper_efault_is_a_typed_abort(no_leaks) -> None:
    """The helper's half names unmapped memory: the same BAD_BLOCK abort as with one thread,
    raised on the reader thread only after both halves ended; the link stays."""
    with (
        TransferEngine(name="P", transport="samehost") as p,
        TransferEngine(backend=two_readers("D")) as d,
    ):
        good = p.register_region(np.ones(1 << 16, np.uint8))
        bogus = p.register_region((4096, 1 << 16))  # page 1: never mapped (mmap_min_addr)
        dst = d.register_region(np.zeros(2 << 16, np.uint8))
        blocks = np.concatenate([
            make_blocks(0, 0, 1 << 16, src_region=good, dst_region=dst),
            make_blocks(0, 1 << 16, 1 << 16, src_region=bogus, dst_region=dst),
        ])  # fmt: skip
        got_p, got_d = Completions(), Completions()
        d.expect("bad", on_complete=got_d)
        p.send("bad", d.data_address, blocks, last=True, on_complete=got_p)
        for c in (got_d.wait(), got_p.wait()):
            assert (c.status, c.code) == (TransferStatus.ABORTED, AbortCode.BAD_BLOCK)
            assert "EFAULT" in c.reason
        cp, cd = small_transfer(p, d, "good")
        assert cp.ok
        assert cd.ok


@pytest.mark.parametrize("bad", ["0", "3"])
def test_bad_read_threads_setting_is_refused(monkeypatch, bad) -> None:
    monkeypatch.setenv(sh.READ_THREADS_ENV, bad)
    with pytest.raises(ValueError, match="read threads must be 1 or 2"):
        sh.SamehostProvider()


def test_read_plan_of_nothing() -> None:
    plan = ReadPlan(np.zeros(3, np.uint64), np.zeros(3, np.uint64), np.zeros(3, np.uint64), 1024)
    assert plan.chunks == 0


def test_data_before_the_handshake_closes_only_that_link(no_leaks) -> None:
    """A peer that sends an extended HELLO and then DATA without waiting for the VERDICTs breaks
    the handshake: that connection closes, the engine keeps serving."""
    with TransferEngine(name="D") as d:
        region = d.register_region(np.zeros(4096, np.uint8))
        host, port = d.data_address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        hello = encode_hello("rude", "10.0.0.1:1", boot_id="b", pid=1, offers=[("tcp", b"")])
        blocks = make_blocks(0, 0, 8, dst_region=region)
        sock.sendall(hello + encode_data_head("early", blocks, True) + b"\x01" * 8)
        while sock.recv(65536):
            pass  # D's HELLO and VERDICT, then EOF: D closed the connection
        sock.close()
        with TransferEngine(name="P") as p:
            cp, cd = small_transfer(p, d, "after")
        assert cp.ok
        assert cd.ok


VICTIM = """
import ctypes, sys
secret = ctypes.create_string_buffer(b"VICTIM-SECRET-0123456789abcdef!!", 32)
print(ctypes.addressof(secret), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("transport", ["auto", "samehost"])
def test_peer_claiming_another_pid_never_reads_it(no_leaks, caplog, transport) -> None:
    """A local client names another process's pid (and 24 bytes it knows there) in its HELLO:
    the receiver must not read that process, since the pid does not hold the connection."""
    caplog.set_level(logging.INFO, logger="kvt")
    secret = b"VICTIM-SECRET-0123456789abcdef!!"
    with (
        subprocess.Popen([sys.executable, "-c", VICTIM], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True) as victim,
        TransferEngine(name="D", transport=transport) as d,
    ):  # fmt: skip
        address = int(victim.stdout.readline())
        dst = np.zeros(32, np.uint8)
        region = d.register_region(dst)
        got = Completions()
        d.expect("x", on_complete=got)
        host, port = d.data_address.rsplit(":", 1)
        blob = sh._BLOB.pack(
            address, secret[:16], address + 16, int.from_bytes(secret[16:24], "little")
        )
        hello = encode_hello("evil", "127.0.0.1:1", boot_id=local_boot_id(), pid=victim.pid,
                             offers=[("samehost", blob), ("tcp", b"")])  # fmt: skip
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(hello)
            decoder, events = FrameDecoder(), []
            while not any(isinstance(e, Verdict) for e in events):
                events += decoder.feed(sock.recv(65536))
            (verdict,) = [e for e in events if isinstance(e, Verdict)]
            why = verdict.as_dict()["samehost"]
            assert why == f"samehost: pid {victim.pid} does not own the connection"
            sock.sendall(encode_verdict([("samehost", True, ""), ("tcp", True, "")]))
            blocks = make_blocks(0, 0, 32, src_region=0, dst_region=region)
            sock.sendall(encode_desc("x", blocks, True, 1, np.array([address], "<u8").tobytes()))
            while sock.recv(65536):
                pass  # D closed the link: a DESC on tcp (auto) or no path at all (forced)
        victim.stdin.close()
        assert got.empty() or not got.wait().ok
    chosen = "uses the tcp path" if transport == "auto" else "does not own the connection"
    assert any(chosen in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("listen", "connect"), [("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("::", "127.0.0.1")]
)
def test_owns_connection_finds_the_holder_of_the_peer_end(listen, connect) -> None:
    family = socket.AF_INET if ":" not in listen else socket.AF_INET6
    try:
        server = socket.create_server((listen, 0), family=family, dualstack_ipv6=listen == "::")
    except OSError as exc:
        pytest.skip(f"no {listen} here: {exc}")
    with server, socket.create_connection((connect, server.getsockname()[1]), timeout=10):
        accepted, _ = server.accept()
        with accepted:
            ends = accepted.getsockname(), accepted.getpeername()
            assert sh.owns_connection(os.getpid(), *ends)
            with subprocess.Popen(
                [sys.executable, "-c", "input()"], stdin=subprocess.PIPE
            ) as other:
                assert not sh.owns_connection(other.pid, *ends)
                other.communicate(b"\n")


@pytest.mark.parametrize(("transport", "grants"), [("tcp", 0), ("auto", 1), ("samehost", 1)])
def test_ptrace_consent_only_where_samehost_can_be_chosen(monkeypatch, transport, grants) -> None:
    """PR_SET_PTRACER_ANY lets any same-uid process ptrace this one: a tcp-only engine must not
    give that away."""
    calls: list[int] = []
    monkeypatch.setattr(sh, "allow_ptrace_reads", lambda: calls.append(1))
    TcpBackend(name="B", transport=transport).close()
    assert len(calls) == grants


class FakeLink:
    """Just enough of a TcpLink for a SamehostPath's sender side."""

    peer = "fake-peer"
    faults = None

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, buffers: list) -> None:
        self.frames += [bytes(b) for b in buffers]


class FakeJob:
    request_id, last = "r", True

    def __init__(self, nbytes: int) -> None:
        self.blocks = make_blocks(0, 0, nbytes, src_region=0, dst_region=0)
        self.addresses = np.zeros(1, np.uint64)
        self.ended: list[int] = []

    def begin_frame(self) -> bool:
        return True

    def end_frame(self, nbytes: int) -> None:
        self.ended.append(nbytes)


@pytest.mark.parametrize(("acked", "ok"), [(4096, True), (1000, True), (4097, False)])
def test_ack_may_not_claim_more_than_the_frame(acked, ok) -> None:
    """The ACK's byte count comes from the peer: more than the frame held is a violation, and
    the frame stays outstanding for the link's close() to end."""
    provider = sh.SamehostProvider()
    link = FakeLink()
    candidate = provider.candidate(link)
    path = sh.SamehostPath(link, candidate, os.getpid(), 0, 0)
    job = FakeJob(4096)
    path.send_job(job)
    ack = PathMessage(sh.ACK, sh.ACK_OK, 1, acked, b"")
    if ok:
        path.on_message(ack)
        assert job.ended == [acked]
    else:
        with pytest.raises(ProtocolViolation, match=r"4097 bytes of frame 1 .*4096"):
            path.on_message(ack)
        assert job.ended == []
    path.close("test over")
    assert job.ended == ([acked] if ok else [0])


def test_frames_end_under_the_engine_lock(no_leaks, monkeypatch) -> None:
    """On samehost the writer (a failed write) and the reader (an ACK) may end frames of one job
    at once: the job's count of bytes not yet handed over changes only under the engine lock."""
    from kvt import engine as engine_module

    values: dict[int, int] = {}
    locked_at_update: list[bool] = []

    def set_unsent(job, value: int) -> None:
        if id(job) in values:  # not the first assignment (in __init__, before anyone sees it)
            locked_at_update.append(job.engine._lock.locked())
        values[id(job)] = value

    unsent = property(lambda job: values[id(job)], set_unsent)
    monkeypatch.setattr(engine_module._SendJob, "unsent", unsent)
    with TransferEngine(name="P") as p, TransferEngine(name="D") as d:
        cp, cd = small_transfer(p, d, "r")
        assert cp.ok
        assert cd.ok
        assert link_paths(p) == ["samehost"]
    assert locked_at_update
    assert all(locked_at_update)


def test_a_closing_senders_abort_reaches_a_receiver_caught_mid_pull(no_leaks) -> None:
    """P closes while D is between its descriptor and its pull: P's ABORT is already in the stream
    when D's read finds P's epoch word cleared; D must end with P's reason (PEER, ENGINE_CLOSED),
    not a lost link, and never DONE (what landed in an aborted destination is undefined)."""
    from fault_plans import Rule, ScriptedFaults
    from kvt.faults import Fault, FaultKind
    from soak import new_engine

    stall = Fault(FaultKind.STALL)
    p = new_engine("samehost", "P")
    d = new_engine("samehost", "D", ScriptedFaults(Rule(stall, engine="D")))
    try:
        src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
        rs, rd = p.register_region(src), d.register_region(dst)
        got_send, got_recv = Completions(), Completions()
        d.expect("c", on_complete=got_recv)
        p.send("c", d.data_address, make_blocks(0, 0, 1 << 20, src_region=rs, dst_region=rd),
               last=True, on_complete=got_send)  # fmt: skip
        assert stall.stalled.wait(10)  # D holds the descriptor, not yet pulled
        p.close()
        assert got_send.wait().code is AbortCode.ENGINE_CLOSED
        stall.release()
        theirs = got_recv.wait()
        assert (theirs.origin, theirs.code) == (AbortOrigin.PEER, AbortCode.ENGINE_CLOSED)
    finally:
        p.close()
        d.close()
