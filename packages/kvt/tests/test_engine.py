"""Two real engines in one process: semantics of the control layer, on every backend.

The fixtures ``pair`` and ``make_engine`` (conftest.py) run each test once per data plane (TCP over
loopback, and in-memory), so the control layer is held to one contract whatever carries its bytes.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import Completions, kvt_threads, wait_until
from ipcblock import PagedKVLayout, make_blocks, parse_blocks, stacked_layer_offsets
from kvt import (
    AbortCode,
    AbortOrigin,
    CpuLayerEvents,
    EngineClosedError,
    InvalidBlocksError,
    InvalidRegionError,
    RequestStateError,
    TransferEngine,
    TransferStatus,
)
from kvt.control import Abort, AbortTarget

BLOCK = 64 << 10


def scattered(n, src_region, dst_region, seed=0):
    rng = np.random.default_rng(seed)
    src_ids, dst_ids = rng.permutation(64)[:n], rng.permutation(64)[:n]
    return make_blocks(src_ids * BLOCK, dst_ids * BLOCK, BLOCK, src_region=src_region,
                       dst_region=dst_region), src_ids, dst_ids  # fmt: skip


def started(p, d, request_id, blocks) -> tuple[Completions, Completions]:
    """A request whose first (not last) batch landed on D: (sender's, receiver's) completions."""
    got_send, got_recv = Completions(), Completions()
    d.expect(request_id, on_complete=got_recv)
    p.send(request_id, d.data_address, blocks, last=False, on_complete=got_send)
    wait_until(lambda: d.status(request_id, "recv") is not TransferStatus.PENDING)
    return got_send, got_recv


def assert_copied(src, dst, src_ids, dst_ids) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        np.testing.assert_array_equal(
            dst[d * BLOCK : (d + 1) * BLOCK], src[s * BLOCK : (s + 1) * BLOCK]
        )


def test_multi_batch_per_layer_with_layer_events(pair) -> None:
    """Per-layer sends gated by compute events; the last batch waits for the earlier ones."""
    p, d, src, dst, rs, rd = pair
    layout = PagedKVLayout.cpu(stacked_layer_offsets(4, 16 * 1024), 16, 2, 16, 8, 2)  # 1 MiB/layer
    events = CpuLayerEvents(4)
    src_ids, dst_ids = [3, 4, 5, 9], [0, 1, 2, 12]
    got_recv, got_send = Completions(), Completions()
    d.expect("req", on_complete=got_recv)
    for layer in range(4):
        blocks = parse_blocks(layout, layout, src_ids, dst_ids, [layer], rs, rd)
        p.send("req", d.data_address, blocks, last=(layer == 3), on_complete=got_send,
               after=(events, layer))  # fmt: skip
    # Layers finish out of order; the last batch (layer 3) is ready first but must go last.
    for layer in (3, 1, 0):
        events.mark_ready(layer)
    assert got_send.empty()  # layer 2 is still computing, so the request cannot be done
    events.mark_ready(2)
    send_done, recv_done = got_send.wait(), got_recv.wait()
    assert send_done.ok
    assert recv_done.ok
    block = layout.block_nbytes
    assert recv_done.nbytes == 4 * 4 * block
    for layer in range(4):
        base = layer * 16 * block
        for s, dd in zip(src_ids, dst_ids, strict=True):
            np.testing.assert_array_equal(
                dst[base + dd * block : base + (dd + 1) * block],
                src[base + s * block : base + (s + 1) * block],
            )
    # Four callbacks registered on the sender, one completion each; exactly one on the receiver.
    assert [got_send.wait().ok for _ in range(3)] == [True] * 3
    assert got_recv.empty()


def test_abort_from_sender_propagates(pair) -> None:
    p, d, _, _, rs, rd = pair
    blocks, _, _ = scattered(8, rs, rd)
    got_recv, got_send = Completions(), Completions()
    d.expect("a", on_complete=got_recv)
    p.send("a", d.data_address, blocks, last=False, on_complete=got_send)
    p.abort("a", "user cancelled")
    p.abort("a", "again")  # idempotent
    mine = got_send.wait()
    assert (mine.status, mine.origin, mine.code) == (
        TransferStatus.ABORTED, AbortOrigin.LOCAL, AbortCode.CALLER_ABORT,
    )  # fmt: skip
    theirs = got_recv.wait()
    assert (theirs.status, theirs.origin) == (TransferStatus.ABORTED, AbortOrigin.PEER)
    assert "user cancelled" in theirs.reason
    # A late send() of the aborted request is not an error: it completes ABORTED at once.
    late = Completions()
    p.send("a", d.data_address, blocks, last=True, on_complete=late)
    assert late.wait().origin is AbortOrigin.LOCAL


def test_abort_before_the_first_send_reaches_the_receiver(pair) -> None:
    """abort() before send(): that first send tells the receiver, which must not wait out its
    own timeout (20 s here) and report TIMEOUT instead of ABORTED(PEER)."""
    p, d, _, _, rs, rd = pair
    blocks, _, _ = scattered(4, rs, rd)
    got_recv, got_send = Completions(), Completions()
    d.expect("early", on_complete=got_recv)
    p.abort("early", "router gave up")
    p.send("early", d.data_address, blocks, last=True, on_complete=got_send)
    mine = got_send.wait()
    assert (mine.status, mine.origin) == (TransferStatus.ABORTED, AbortOrigin.LOCAL)
    # A later request on the same link is the barrier (no clock involved): the link carries the
    # abort before the probe's data, so once the probe is done, D has handled the abort.
    probe, probe_blocks = Completions(), scattered(1, rs, rd, seed=1)[0]
    d.expect("probe", on_complete=probe)
    p.send("probe", d.data_address, probe_blocks, last=True, on_complete=probe)
    assert probe.wait().ok
    assert probe.wait().ok
    assert not got_recv.empty(), "the receiver never heard of the abort"
    theirs = got_recv.wait()
    assert (theirs.status, theirs.origin, theirs.code) == (
        TransferStatus.ABORTED, AbortOrigin.PEER, AbortCode.CALLER_ABORT,
    )  # fmt: skip
    assert "router gave up" in theirs.reason
    assert theirs.nbytes == 0


def test_abort_from_receiver_propagates_before_and_after_data(pair) -> None:
    p, d, _, dst, rs, rd = pair
    blocks, _, _ = scattered(4, rs, rd)
    # 1) receiver aborts after data started: the sender learns on the same link.
    got_send, got_recv = started(p, d, "b1", blocks)
    d.abort("b1", "decode instance gave up")
    assert got_recv.wait().origin is AbortOrigin.LOCAL
    theirs = got_send.wait()
    assert (theirs.origin, theirs.code) == (AbortOrigin.PEER, AbortCode.CALLER_ABORT)
    # 2) receiver aborts before any data, knowing the sender's address: told at once.
    got_recv, got_send = Completions(), Completions()
    d.expect("b2", on_complete=got_recv, peer_data_address=p.data_address)
    d.abort("b2", "early")
    assert got_recv.wait().origin is AbortOrigin.LOCAL
    # The sender had not started b2; its first send() completes ABORTED(PEER) without sending.
    late = Completions()
    wait_until(lambda: p.status("b2") is not None)
    p.send("b2", d.data_address, blocks, last=True, on_complete=late)
    assert late.wait().origin is AbortOrigin.PEER
    # 3) receiver aborts without the address: the sender learns when its data arrives.
    got_recv, got_send = Completions(), Completions()
    d.expect("b3", on_complete=got_recv)
    d.abort("b3", "early, no address")
    p.send("b3", d.data_address, blocks, last=True, on_complete=got_send)
    assert got_send.wait().origin is AbortOrigin.PEER
    assert dst.any()  # b1's first batch landed before its abort
    assert got_recv.wait().origin is AbortOrigin.LOCAL


def test_timeouts_on_both_sides(pair) -> None:
    p, d, _, _, rs, rd = pair
    blocks, _, _ = scattered(2, rs, rd)
    got = Completions()
    d.expect("t1", timeout_s=0.2, on_complete=got)
    c = got.wait()
    assert (c.origin, c.code) == (AbortOrigin.TIMEOUT, AbortCode.TIMEOUT)
    # Sender waits for a DONE that never comes (last batch never sent): times out, tells the peer.
    got_recv, got_send = Completions(), Completions()
    d.expect("t2", on_complete=got_recv)
    p.send("t2", d.data_address, blocks, last=False, on_complete=got_send, timeout_s=0.3)
    assert got_send.wait().origin is AbortOrigin.TIMEOUT
    theirs = got_recv.wait()
    assert (theirs.origin, theirs.code) == (AbortOrigin.PEER, AbortCode.TIMEOUT)


def test_unknown_request_id(pair, caplog) -> None:
    p, d, _, dst, rs, rd = pair
    blocks, _, _ = scattered(2, rs, rd)
    got = Completions()
    with caplog.at_level(logging.WARNING, logger="kvt"):
        p.send("nobody-expects-me", d.data_address, blocks, last=True, on_complete=got)
        c = got.wait()
    assert (c.origin, c.code) == (AbortOrigin.PEER, AbortCode.UNKNOWN_REQUEST)
    assert any("nobody-expects-me" in r.message and "P(" in r.message for r in caplog.records)
    assert not dst.any()  # nothing was written
    # A request expected too late completes ABORTED at once instead of hanging.
    late = Completions()
    d.expect("nobody-expects-me", on_complete=late)
    assert late.wait().code is AbortCode.UNKNOWN_REQUEST


def test_caller_errors(pair) -> None:
    p, d, src, _, rs, rd = pair
    with pytest.raises(InvalidBlocksError):
        p.send("x", d.data_address, make_blocks(len(src) - 10, 0, 11, src_region=rs), last=True)
    with pytest.raises(InvalidBlocksError):
        p.send("x", d.data_address, make_blocks(0, 0, 1, src_region=99), last=True)
    with pytest.raises(InvalidBlocksError):
        p.send("x", d.data_address, np.zeros(3, np.int64), last=True)
    with pytest.raises(InvalidRegionError):
        p.register_region(np.zeros((4, 4))[:, 1])
    with pytest.raises(InvalidRegionError):
        p.register_region(object())
    blocks, _, _ = scattered(1, rs, rd)
    got = Completions()
    d.expect("y", on_complete=got)
    with pytest.raises(RequestStateError):
        d.expect("y")
    p.send("y", d.data_address, blocks, last=True, on_complete=got)
    with pytest.raises(RequestStateError):
        p.send("y", d.data_address, blocks, last=True)
    assert got.wait().ok
    assert got.wait().ok


def test_exactly_once_under_races(pair) -> None:
    """abort, timeout and success race on many requests; each side completes each request once."""
    p, d, _, _, rs, rd = pair
    n = 200
    counts: dict[tuple[str, str], int] = {}
    lock = threading.Lock()
    all_done = threading.Semaphore(0)

    def count(c) -> None:
        with lock:
            counts[(c.role, c.request_id)] = counts.get((c.role, c.request_id), 0) + 1
        all_done.release()

    blocks, _, _ = scattered(2, rs, rd)
    rng = np.random.default_rng(7)
    timeouts = rng.uniform(0.0005, 0.02, n)
    for i in range(n):
        d.expect(f"r{i}", timeout_s=float(timeouts[i]), on_complete=count)
    start = threading.Barrier(3)

    def sender() -> None:
        start.wait()
        for i in range(n):
            p.send(f"r{i}", d.data_address, blocks, last=True, on_complete=count,
                   timeout_s=float(timeouts[i]))  # fmt: skip

    def aborter(engine: TransferEngine) -> None:
        start.wait()
        for i in rng.permutation(n):
            engine.abort(f"r{i}", "race")

    threads = [threading.Thread(target=sender), threading.Thread(target=aborter, args=(d,)),
               threading.Thread(target=aborter, args=(p,))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(2 * n):
        assert all_done.acquire(timeout=20)
    assert not all_done.acquire(timeout=0.3)  # and nothing more arrives
    assert len(counts) == 2 * n
    assert set(counts.values()) == {1}


def test_metrics_registry_per_engine(pair) -> None:
    p, d, _, _, rs, rd = pair
    blocks, _, _ = scattered(4, rs, rd)
    got = Completions()
    d.expect("m", on_complete=got)
    p.send("m", d.data_address, blocks, last=True, on_complete=got)
    got.wait()
    got.wait()
    assert p.metrics_registry is not d.metrics_registry
    sent = p.metrics_registry.get_sample_value("kvt_bytes_total", {"direction": "sent"})
    received = d.metrics_registry.get_sample_value("kvt_bytes_total", {"direction": "received"})
    assert sent == received == 4 * BLOCK
    assert (
        d.metrics_registry.get_sample_value(
            "kvt_requests_total", {"role": "recv", "status": "done"}
        )
        == 1
    )
    text = p.metrics_text().decode()
    path = p.backend.link_to(d.data_address).path
    assert f'kvt_stage_seconds_count{{path="{path}",stage="queue"}}' in text
    assert f'kvt_stage_seconds_count{{path="{path}",stage="notify"}}' in text
    assert f'kvt_stage_seconds_count{{path="{path}",stage="wire"}}' in text
    assert 'stage="recv_chunk"' in d.metrics_text().decode()


def test_close_aborts_open_requests_and_tells_peer(make_engine) -> None:
    p, d = make_engine("P"), make_engine("D")
    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    rs, rd = p.register_region(src), d.register_region(dst)
    got_send, got_recv = started(p, d, "c", make_blocks(0, 0, 4096, src_region=rs, dst_region=rd))
    p.close()
    p.close()  # idempotent
    c = got_send.wait()
    assert (c.origin, c.code) == (AbortOrigin.LOCAL, AbortCode.ENGINE_CLOSED)
    theirs = got_recv.wait()
    assert theirs.origin is AbortOrigin.PEER
    assert theirs.code is AbortCode.ENGINE_CLOSED
    with pytest.raises(EngineClosedError):
        p.send("c2", d.data_address, make_blocks(0, 0, 1), last=True)
    d.close()
    assert kvt_threads() == []


def test_lost_link_aborts_the_requests_on_it_on_both_sides(pair) -> None:
    p, d, _, _, rs, rd = pair
    blocks, _, _ = scattered(2, rs, rd)
    got_send, got_recv = started(p, d, "cut", blocks)
    p.backend.link_to(d.data_address).close("cable cut")
    for c in (got_send.wait(), got_recv.wait()):
        assert (c.origin, c.code) == (AbortOrigin.TRANSPORT, AbortCode.CONNECTION_LOST)
    # The next request gets a fresh link.
    got = Completions()
    d.expect("after", on_complete=got)
    p.send("after", d.data_address, blocks, last=True, on_complete=got)
    assert got.wait().ok
    assert got.wait().ok


def test_a_second_sender_cannot_join_a_bound_request(pair, make_engine, caplog) -> None:
    """Once a receiving request is bound to its first sender's link, another link's batches and
    ABORTs for that id are refused there; the bound request goes on and ends DONE alone."""
    p, d, _, dst, rs, rd = pair
    first, _, _ = scattered(1, rs, rd, seed=1)
    got_send, got_recv = started(p, d, "bound", first)
    with make_engine("P2") as p2:
        theirs = np.full(BLOCK, 7, np.uint8)
        r2 = p2.register_region(theirs)
        # An ABORT from the stranger, then a batch on the same link: its refusal comes after.
        message = Abort("bound", AbortCode.CALLER_ABORT, AbortTarget.RECEIVER, "not mine")
        p2.backend.link_to(d.data_address).send_control(message)
        got_p2 = Completions()
        intruder = make_blocks(0, 63 * BLOCK, BLOCK, src_region=r2, dst_region=rd)
        with caplog.at_level(logging.WARNING, logger="kvt.engine"):
            p2.send("bound", d.data_address, intruder, last=True, on_complete=got_p2)
            refused = got_p2.wait()
        assert (refused.origin, refused.code) == (AbortOrigin.PEER, AbortCode.PROTOCOL_ERROR)
        assert "refused" in caplog.text
        assert "ignored" in caplog.text
    assert d.status("bound", "recv") is TransferStatus.TRANSFERRING
    last, _, _ = scattered(1, rs, rd, seed=2)
    p.send("bound", d.data_address, last, last=True)
    mine, done = got_send.wait(), got_recv.wait()
    assert mine.ok
    assert done.ok
    assert done.nbytes == 2 * BLOCK
    assert not (dst[63 * BLOCK :] == 7).all()  # the intruder's block was never written


def test_connect_failure_aborts_transport(make_engine) -> None:
    with make_engine("P") as p:
        rs = p.register_region(np.ones(4096, np.uint8))
        got = Completions()
        blocks = make_blocks(0, 0, 16, src_region=rs)
        p.send("z", make_engine.unreachable, blocks, last=True, on_complete=got)
        c = got.wait()
        assert (c.origin, c.code) == (AbortOrigin.TRANSPORT, AbortCode.CONNECT_FAILED)


def test_region_kinds(make_engine) -> None:
    with make_engine("R") as e:
        arr = np.zeros((8, 8), np.float32)
        region = e.regions.get(e.register_region(arr))
        assert region.nbytes == 256
        assert region.writable
        buf = bytearray(100)
        assert e.regions.get(e.register_region(memoryview(buf))).nbytes == 100
        ro = e.regions.get(e.register_region(b"read only"))
        assert not ro.writable
        with pytest.raises(InvalidRegionError):
            e.register_region(b"x", writable=True)
        raw = e.regions.get(e.register_region((arr.ctypes.data, arr.nbytes)))
        raw.view[:4] = b"\x01\x02\x03\x04"
        assert arr.reshape(-1).view(np.uint8)[:4].tolist() == [1, 2, 3, 4]
        rid = e.register_region(np.zeros(4, np.uint8))
        e.unregister_region(rid)
        with pytest.raises(InvalidRegionError):
            e.unregister_region(rid)


def test_torch_cpu_tensor_region(no_leaks) -> None:
    torch = pytest.importorskip("torch")
    with TransferEngine(name="T") as e:
        tensor = torch.zeros(16, dtype=torch.float16)
        region = e.regions.get(e.register_region(tensor))
        assert region.nbytes == 32
        region.view[:2] = b"\x00\x3c"  # 1.0 in fp16
        assert tensor[0].item() == 1.0
        with pytest.raises(InvalidRegionError):
            e.register_region(torch.zeros(4, 4).t())


def test_torch_not_imported_for_numpy_regions() -> None:
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, kvt\n"
        "e = kvt.TransferEngine(name='N'); e.register_region(np.zeros(8, np.uint8)); e.close()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_port_in_use_leaves_nothing_behind(no_leaks) -> None:
    with TransferEngine(name="first") as first:
        port = int(first.data_address.rsplit(":", 1)[1])
        with pytest.raises(OSError):
            TransferEngine(port=port, name="second")


def test_control_layer_imports_no_backend() -> None:
    """The engine is given its data plane: no control-layer module imports one (the layering in
    docs/architecture.md)."""
    import ast

    import kvt

    backends = {"kvt.tcp", "kvt.protocol", "kvt.memory"}
    package = Path(kvt.__file__).parent
    for module in ("engine.py", "control.py", "timers.py", "access.py", "backend.py"):
        tree = ast.parse((package / module).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module)
        assert not imported & backends, f"{module} imports {imported & backends}"
