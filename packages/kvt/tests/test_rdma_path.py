"""The rdma payload path without a device: path selection, the DESC/GRANT/imm protocol, limits and
failures, on two engines over the fake NIC (tests/rdma_fake.py) and on a stubbed link."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
from conftest import Completions, rdma_fake_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from ipcblock import make_blocks
from kvt import AbortCode, AbortOrigin, TransferEngine, TransferStatus
from kvt.backend import MemoryInfo
from kvt.errors import ProtocolViolation
from kvt.paths import TcpPathProvider
from kvt.protocol import DataDescriptor, FrameDecoder, PathMessage
from kvt.rdma import (
    CANCEL,
    DENY,
    GRANT,
    REGIONS,
    QpInfo,
    QueuePair,
    RdmaPath,
    RdmaPathProvider,
    WorkCompletion,
    decode_drop,
    decode_regions,
    encode_regions,
)
from kvt.rdma_plan import DeviceLimits, RemoteRegion
from kvt.tcp import TcpBackend
from rdma_fake import FakeDevice

BLOCK = 64 << 10
NO_DEVICE = "ibv_get_device_list failed: Function not implemented"


def _no_device():
    raise OSError(NO_DEVICE)


def engine(name: str, *, device=None, transport="auto", **device_args) -> TransferEngine:
    """An engine on TCP whose rdma path has a fake NIC (``device=False``: no device at all)."""
    if device is False:
        providers = [RdmaPathProvider(_no_device), TcpPathProvider()]
    else:
        providers = [RdmaPathProvider(device or FakeDevice(**device_args)), TcpPathProvider()]
    backend = TcpBackend(name=name, transport=transport, providers=providers)
    return TransferEngine(name=name, backend=backend, default_timeout_s=20)


def transfer(p, d, request_id, n_blocks=64, seed=0, *, contiguous=False):
    src = np.random.default_rng(seed).integers(0, 256, 64 * BLOCK, dtype=np.uint8)
    dst = np.zeros(64 * BLOCK, dtype=np.uint8)
    rs, rd = p.register_region(src), d.register_region(dst)
    rng = np.random.default_rng(seed + 1)
    src_ids = np.arange(n_blocks) if contiguous else rng.permutation(64)[:n_blocks]
    dst_ids = np.arange(n_blocks) if contiguous else rng.permutation(64)[:n_blocks]
    blocks = make_blocks(src_ids * BLOCK, dst_ids * BLOCK, BLOCK, src_region=rs, dst_region=rd)
    got_send, got_recv = Completions(), Completions()
    d.expect(request_id, on_complete=got_recv)
    p.send(request_id, d.data_address, blocks, last=True, on_complete=got_send)
    sent, received = got_send.wait(), got_recv.wait()
    return sent, received, src, dst, src_ids, dst_ids


def assert_copied(src, dst, src_ids, dst_ids) -> None:
    for s, t in zip(src_ids, dst_ids, strict=True):
        np.testing.assert_array_equal(
            dst[t * BLOCK : (t + 1) * BLOCK], src[s * BLOCK : (s + 1) * BLOCK]
        )


def link_path(p, d) -> str:
    link = p.backend.link_to(d.data_address)
    assert link.wait_ready(10)
    return link.path


# ================================================================ two engines, fake NIC
def test_auto_picks_rdma_when_both_ends_have_a_device_and_bytes_go_by_rdma_write(no_leaks):
    nic_p, nic_d = FakeDevice(), FakeDevice()
    p, d = engine("P", device=nic_p), engine("D", device=nic_d)
    try:
        sent, received, src, dst, src_ids, dst_ids = transfer(p, d, "r1")
        assert sent.ok
        assert received.ok
        assert received.nbytes == sent.nbytes == 64 * BLOCK
        assert_copied(src, dst, src_ids, dst_ids)
        assert link_path(p, d) == "rdma"
        assert nic_p.writes >= 1  # the payload went through the (fake) NIC, not the socket
    finally:
        p.close()
        d.close()
    assert not nic_p.registered
    assert not nic_d.registered


def test_contiguous_blocks_coalesce_into_writes_of_max_message_size(no_leaks):
    limits = DeviceLimits(max_sge=4, max_msg_size=1 << 20, sq_depth=8)
    nic_p = FakeDevice(limits)
    p, d = engine("P", device=nic_p), engine("D", limits=limits)
    try:
        sent, received, src, dst, src_ids, dst_ids = transfer(p, d, "c", contiguous=True)
        assert sent.ok
        assert received.ok
        assert_copied(src, dst, src_ids, dst_ids)
        assert nic_p.writes == 4  # 64 x 64 KiB contiguous on both sides: 4 MiB in 1 MiB writes
    finally:
        p.close()
        d.close()


def test_tiny_limits_many_requests_in_flight_stay_within_queue_depths(no_leaks):
    """2 scatter entries, 8 KiB per write, 4 work requests in the send queue (the fake NIC raises
    beyond that) and 1 receive slot: 8 requests at once still all arrive byte-exact."""
    limits = DeviceLimits(max_sge=2, max_msg_size=8 << 10, sq_depth=4)
    p = engine("P", limits=limits, recv_depth=1)
    d = engine("D", limits=limits, recv_depth=1)
    try:
        src = np.random.default_rng(3).integers(0, 256, 64 * BLOCK, dtype=np.uint8)
        dst = np.zeros(64 * BLOCK, dtype=np.uint8)
        rs, rd = p.register_region(src), d.register_region(dst)
        got = Completions()
        perm = np.random.default_rng(4).permutation(64)
        for i in range(8):
            ids = perm[8 * i : 8 * i + 8]
            blocks = make_blocks(ids * BLOCK, ids[::-1] * BLOCK, BLOCK, src_region=rs,
                                 dst_region=rd)  # fmt: skip
            d.expect(f"q{i}", on_complete=got)
            p.send(f"q{i}", d.data_address, blocks, last=True, on_complete=got)
        results = [got.wait() for _ in range(16)]
        assert all(c.ok for c in results), [c for c in results if not c.ok]
        for i in range(8):
            ids = perm[8 * i : 8 * i + 8]
            assert_copied(src, dst, ids, ids[::-1])
    finally:
        p.close()
        d.close()


def test_a_region_registered_after_the_link_is_up_is_advertised(no_leaks):
    p, d = engine("P"), engine("D")
    try:
        assert transfer(p, d, "first", n_blocks=2)[1].ok  # link up, first regions advertised
        sent, received, src, dst, src_ids, dst_ids = transfer(p, d, "second", n_blocks=3, seed=5)
        assert sent.ok
        assert received.ok
        assert_copied(src, dst, src_ids, dst_ids)
    finally:
        p.close()
        d.close()


def test_auto_without_a_device_on_one_end_stays_on_tcp(no_leaks):
    p, d = engine("P"), engine("D", device=False)
    try:
        sent, received, src, dst, src_ids, dst_ids = transfer(p, d, "t")
        assert sent.ok
        assert received.ok
        assert_copied(src, dst, src_ids, dst_ids)
        assert link_path(p, d) == "tcp"
    finally:
        p.close()
        d.close()


def test_forced_rdma_against_a_peer_without_a_device_fails_with_the_reason(no_leaks):
    p, d = engine("P", transport="rdma"), engine("D", device=False)
    try:
        sent, received = transfer_unfinished(p, d)
        assert (sent.status, sent.origin, sent.code) == (
            TransferStatus.ABORTED, AbortOrigin.TRANSPORT, AbortCode.CONNECT_FAILED,
        )  # fmt: skip
        assert "rdma" in sent.reason
        assert NO_DEVICE in sent.reason
        assert received is None or not received.ok
    finally:
        p.close()
        d.close()


class NoQueuePairs(FakeDevice):
    def create_qp(self):
        raise OSError("out of QPs")


def test_a_queue_pair_that_cannot_be_created_leaves_the_link_on_tcp_in_auto(no_leaks, caplog):
    p, d = engine("P", device=NoQueuePairs()), engine("D")
    try:
        sent, received, src, dst, src_ids, dst_ids = transfer(p, d, "noqp", n_blocks=4)
        assert sent.ok
        assert received.ok
        assert_copied(src, dst, src_ids, dst_ids)
        assert link_path(p, d) == "tcp"
        assert "rdma queue pair creation failed" in caplog.text
    finally:
        p.close()
        d.close()


def transfer_unfinished(p, d):
    src, dst = np.ones(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)
    blocks = make_blocks(0, 0, BLOCK, src_region=p.register_region(src),
                         dst_region=d.register_region(dst))  # fmt: skip
    got_send = Completions()
    d.expect("f", timeout_s=0.5)
    p.send("f", d.data_address, blocks, last=True, on_complete=got_send)
    return got_send.wait(), None


def test_receiver_abort_before_the_grant_and_late_frames_are_refused(no_leaks):
    p, d = engine("P"), engine("D")
    try:
        assert transfer(p, d, "warm", n_blocks=1)[1].ok
        src, dst = np.ones(4 * BLOCK, np.uint8), np.zeros(4 * BLOCK, np.uint8)
        rs, rd = p.register_region(src), d.register_region(dst)
        got_send, got_recv = Completions(), Completions()
        d.expect("gone", on_complete=got_recv)
        d.abort("gone", "decode node gave up")
        blocks = make_blocks(0, 0, 4 * BLOCK, src_region=rs, dst_region=rd)
        p.send("gone", d.data_address, blocks, last=True, on_complete=got_send)
        mine = got_send.wait()
        assert (mine.status, mine.origin) == (TransferStatus.ABORTED, AbortOrigin.PEER)
        assert got_recv.wait().origin is AbortOrigin.LOCAL
        assert not dst.any()  # nothing was written for the aborted request
    finally:
        p.close()
        d.close()


def test_a_stalled_nic_past_the_deadline_closes_the_link_and_writes_nothing_late(no_leaks):
    """The sender's NIC stalls; the receiver's deadline passes mid-frame: the link closes, both
    QPs go to the error state, and the writes released afterwards never reach the memory."""
    hold = threading.Event()
    p, d = engine("P", hold=hold), engine("D")
    try:
        assert link_path(p, d) == "rdma"
        src, dst = np.ones(8 * BLOCK, np.uint8), np.zeros(8 * BLOCK, np.uint8)
        blocks = make_blocks(0, 0, 8 * BLOCK, src_region=p.register_region(src),
                             dst_region=d.register_region(dst))  # fmt: skip
        got_send, got_recv = Completions(), Completions()
        d.expect("stuck", timeout_s=0.5, on_complete=got_recv)
        p.send("stuck", d.data_address, blocks, last=True, on_complete=got_send)
        mine = got_recv.wait()
        assert (mine.status, mine.origin) == (TransferStatus.ABORTED, AbortOrigin.TIMEOUT)
        hold.set()  # the NIC moves again: its QP is in the error state, the writes flush
        theirs = got_send.wait()
        assert theirs.status is TransferStatus.ABORTED
        assert not dst.any()
    finally:
        hold.set()
        p.close()
        d.close()


def test_engine_suite_backend_is_rdma(no_leaks):
    """The conftest 'rdma-fake' variant really moves payload over the rdma path."""
    p = TransferEngine(name="P", backend=rdma_fake_backend("P"))
    d = TransferEngine(name="D", backend=rdma_fake_backend("D"))
    try:
        assert transfer(p, d, "x", n_blocks=2)[0].ok
        assert link_path(p, d) == "rdma"
    finally:
        p.close()
        d.close()


# ================================================================ one path, stubbed link and QP
class StubQP(QueuePair):
    def __init__(self) -> None:
        self.info = QpInfo(b"\1" * 16, 7, 99, 5, 5)
        self.writes: list[tuple] = []
        self.recvs: list[int] = []
        self.posted = threading.Condition()
        self.state = "INIT"

    def connect(self, peer):
        self.state = "RTS"

    def start(self, on_completion, on_thread_start):
        self.on_completion = on_completion

    def post_write(self, wr_id, sges, remote_addr, rkey, *, imm, signaled):
        with self.posted:
            self.writes.append((wr_id, sges, remote_addr, rkey, imm, signaled))
            self.posted.notify_all()

    def wait_writes(self, n):
        with self.posted:
            assert self.posted.wait_for(lambda: len(self.writes) >= n, timeout=10)

    def post_recv(self, wr_id):
        self.recvs.append(wr_id)

    def shutdown(self):
        self.state = "ERR"

    def close(self):
        self.state = "CLOSED"


class StubSink:
    def __init__(self, grant=True):
        self.grant, self.calls = grant, []
        self.views, self.addresses = [], np.zeros(0, np.uint64)

    def begin_chunk(self):
        self.calls.append("begin")
        return self.grant

    def end_chunk(self, n):
        self.calls.append(("end", n))

    def end_batch(self):
        self.calls.append("batch")


class StubListener:
    def __init__(self):
        self.sinks: list = []

    def io_thread_started(self):
        pass

    def on_batch(self, link, batch):
        return self.sinks.pop(0)


class StubLink:
    peer = "stub-peer"

    def __init__(self):
        self.listener = StubListener()
        self.posted: list[PathMessage] = []
        self.written: list = []
        self.closed: str | None = None

    def post(self, frame):
        self.posted.extend(FrameDecoder().feed(frame))

    def write(self, buffers):
        self.written.extend(FrameDecoder().feed(b"".join(bytes(b) for b in buffers)))

    def close(self, reason):
        self.closed = reason


class StubJob:
    def __init__(self, blocks, alive=(True,)):
        self.request_id, self.blocks, self.last = "req", blocks, True
        self.addresses = np.full(len(blocks), 0x1000, np.uint64) + blocks["src_offset"]
        self.alive, self.calls = list(alive), []

    def begin_frame(self):
        ok = self.alive.pop(0) if self.alive else True
        self.calls.append(("begin", ok))
        return ok

    def end_frame(self, n):
        self.calls.append(("end", n))


@pytest.fixture
def path():
    provider = RdmaPathProvider(FakeDevice(DeviceLimits(2, 1 << 20, 4), recv_depth=2))
    provider.register_memory(MemoryInfo(0, 0x1000, 1 << 20, True, "cpu"))
    link, qp = StubLink(), StubQP()
    rdma = RdmaPath(link, provider, qp)
    rdma.start()
    yield rdma, link, qp
    rdma.close("test over")
    provider.close()


def msg(kind, seq=0, number=0, body=b""):
    return PathMessage(kind, 0, seq, number, body)


def test_start_posts_receives_and_advertises_writable_regions(path):
    _rdma, link, qp = path
    assert qp.recvs == [0, 1]
    (regions,) = link.posted
    assert regions.kind == REGIONS
    assert decode_regions(regions.body)[0].address == 0x1000


def test_sender_writes_only_after_the_grant_and_ends_the_frame_on_its_completion(path):
    rdma, link, qp = path
    blocks = make_blocks([0, 65536], [0, 65536], 65536, src_region=0, dst_region=3)
    job = StubJob(blocks, alive=(True, True))
    rdma.send_job(job)
    (desc,) = link.written
    assert isinstance(desc, DataDescriptor)
    assert desc.last
    assert job.calls == [("begin", True), ("end", 0)]  # liveness check only, nothing read yet
    assert qp.writes == []
    rdma.on_message(
        msg(REGIONS, number=0, body=encode_regions({3: RemoteRegion(1 << 30, 1 << 20, 77)}))
    )
    rdma.on_message(msg(GRANT, desc.seq, number=1))
    qp.wait_writes(1)
    ((wr_id, sges, remote, rkey, imm, signaled),) = qp.writes  # contiguous: one WRITE_WITH_IMM
    assert (remote, rkey, imm, signaled) == (1 << 30, 77, desc.seq, True)
    assert sges == [(0x1000, 131072, sges[0][2])]
    assert job.calls[-1] == ("begin", True)
    qp.on_completion(WorkCompletion(wr_id, False, True, "success"))
    assert job.calls[-1] == ("end", 131072)


def test_sender_cancels_a_granted_frame_whose_request_died(path):
    rdma, link, qp = path
    blocks = make_blocks(0, 0, 4096, src_region=0, dst_region=3)
    job = StubJob(blocks, alive=(True, False))
    rdma.send_job(job)
    rdma.on_message(msg(GRANT, link.written[0].seq, number=0))
    assert link.posted[-1].kind == CANCEL
    assert qp.writes == []


def test_rdma_messages_that_overtook_earlier_ones_wait_their_turn(path):
    rdma, link, qp = path
    blocks = make_blocks(0, 0, 4096, src_region=0, dst_region=3)
    rdma.send_job(StubJob(blocks))
    seq = link.written[0].seq
    rdma.on_message(msg(GRANT, seq, number=1))  # overtook the REGIONS it depends on: held
    assert qp.writes == []
    rdma.on_message(
        msg(REGIONS, number=0, body=encode_regions({3: RemoteRegion(1 << 30, 8192, 5)}))
    )
    qp.wait_writes(1)
    with pytest.raises(ProtocolViolation, match="out of order"):
        rdma.on_message(msg(DENY, seq, number=0))  # a number already handled


def test_grant_outside_the_advertised_region_fails_before_any_write(path):
    rdma, link, qp = path
    blocks = make_blocks(0, 8192, 4096, src_region=0, dst_region=3)
    job = StubJob(blocks)
    rdma.send_job(job)
    rdma.on_message(
        msg(REGIONS, number=0, body=encode_regions({3: RemoteRegion(1 << 30, 8192, 5)}))
    )
    with pytest.raises(ProtocolViolation, match="outside the peer's region 3"):
        rdma.on_message(msg(GRANT, link.written[0].seq, number=1))
    assert qp.writes == []
    assert job.calls[-1] == ("end", 0)


def test_receiver_grants_within_its_receive_slots_in_order_and_ends_on_the_imm(path):
    rdma, link, qp = path
    sinks = [StubSink(), StubSink(), StubSink()]
    link.listener.sinks = list(sinks)
    blocks = make_blocks(0, 0, 4096, src_region=9, dst_region=0)
    for seq in (11, 12, 13):
        rdma.receive(DataDescriptor("r", seq == 13, blocks, seq, 4096, b""))
    grants = [m.seq for m in link.posted if m.kind == GRANT]
    assert grants == [11, 12]  # 2 receive slots: the third waits, not begun
    assert sinks[2].calls == []
    rdma._on_completion(WorkCompletion(0, True, True, "success", imm=11))
    assert sinks[0].calls == ["begin", ("end", 4096), "batch"]
    assert [m.seq for m in link.posted if m.kind == GRANT] == [11, 12, 13]
    assert qp.recvs[-1] == 0  # the receive was posted again
    rdma.on_message(msg(CANCEL, 12, number=0))  # the sender's request died: no end_batch
    assert sinks[1].calls == ["begin", ("end", 0)]


def test_an_empty_frame_completes_after_the_frames_granted_before_it_without_a_write(path):
    rdma, link, _qp = path
    first, empty = StubSink(), StubSink()
    link.listener.sinks = [first, empty]
    blocks = make_blocks(0, 0, 4096, src_region=9, dst_region=0)
    rdma.receive(DataDescriptor("r", False, blocks, 1, 4096, b""))
    rdma.receive(DataDescriptor("r", True, blocks[:0], 2, 0, b""))
    assert empty.calls == []  # frame 1 is still being written
    rdma._on_completion(WorkCompletion(0, True, True, "success", imm=1))
    assert first.calls == ["begin", ("end", 4096), "batch"]
    assert empty.calls == ["begin", ("end", 0), "batch"]
    assert [m.seq for m in link.posted if m.kind == GRANT] == [1]  # no grant for the empty one


def test_an_empty_last_batch_over_two_engines(no_leaks):
    p, d = engine("P"), engine("D")
    try:
        src, dst = np.ones(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)
        blocks = make_blocks(0, 0, BLOCK, src_region=p.register_region(src),
                             dst_region=d.register_region(dst))  # fmt: skip
        got_send, got_recv = Completions(), Completions()
        d.expect("e", on_complete=got_recv)
        p.send("e", d.data_address, blocks, last=False)
        p.send("e", d.data_address, blocks[:0], last=True, on_complete=got_send)
        assert got_send.wait().ok
        assert got_recv.wait().nbytes == BLOCK
        assert dst.all()
    finally:
        p.close()
        d.close()


def test_receiver_denies_refused_and_aborted_frames(path):
    rdma, link, _qp = path
    aborted = StubSink(grant=False)
    link.listener.sinks = [None, aborted]
    blocks = make_blocks(0, 0, 4096, src_region=9, dst_region=0)
    rdma.receive(DataDescriptor("r", True, blocks, 1, 4096, b""))
    rdma.receive(DataDescriptor("r", True, blocks, 2, 4096, b""))
    assert [(m.kind, m.seq) for m in link.posted[1:]] == [(DENY, 1), (DENY, 2)]
    assert aborted.calls == ["begin", "batch"]


def test_an_imm_for_no_granted_frame_or_a_failed_write_fails_the_link(path):
    rdma, link, _qp = path
    rdma._on_completion(WorkCompletion(0, True, True, "success", imm=404))
    assert "no granted frame" in link.closed
    link.closed = None
    rdma._on_completion(WorkCompletion(5, False, False, "REM_ACCESS_ERR"))
    assert "REM_ACCESS_ERR" in link.closed


def test_close_stops_the_qp_then_ends_every_open_frame_with_zero(path):
    rdma, link, qp = path
    sink = StubSink()
    link.listener.sinks = [sink]
    rdma.receive(DataDescriptor("r", True, make_blocks(0, 0, 64, src_region=9, dst_region=0), 1,
                                64, b""))  # fmt: skip
    job = StubJob(make_blocks(0, 0, 64, src_region=0, dst_region=3))
    rdma.send_job(job)
    rdma.on_message(msg(REGIONS, number=0, body=encode_regions({3: RemoteRegion(1 << 30, 64, 5)})))
    rdma.on_message(msg(GRANT, link.written[0].seq, number=1))
    qp.wait_writes(1)
    rdma.close("link lost")
    assert qp.state == "CLOSED"
    assert job.calls[-1] == ("end", 0)
    assert sink.calls == ["begin", ("end", 0)]


# ================================================================ messages
def test_qp_info_round_trips_and_bad_blobs_are_violations():
    info = QpInfo(bytes(range(16)), 3, 0x123456, 0xABCDEF, 5)
    assert QpInfo.unpack(info.pack()) == info
    with pytest.raises(ProtocolViolation):
        QpInfo.unpack(b"short")


@given(st.binary(max_size=200))
def test_region_messages_decode_or_raise_protocol_violation(body):
    for decode in (decode_regions, decode_drop):
        with contextlib.suppress(ProtocolViolation):
            decode(body)


messages = st.lists(
    st.tuples(st.integers(0, 7), st.integers(0, 4), st.integers(0, 6), st.binary(max_size=48)),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(messages)
def test_any_sequence_of_peer_messages_is_handled_or_a_protocol_violation(sequence):
    """Sans-I/O check of the path's message handling: whatever the peer sends, the path answers
    with a ProtocolViolation (the link closes) or handles it; nothing else escapes."""
    provider = RdmaPathProvider(FakeDevice(DeviceLimits(2, 1 << 20, 4), recv_depth=2))
    provider.register_memory(MemoryInfo(0, 0x1000, 1 << 20, True, "cpu"))
    link, qp = StubLink(), StubQP()
    rdma = RdmaPath(link, provider, qp)
    rdma.start()
    try:
        rdma.send_job(StubJob(make_blocks(0, 0, 4096, src_region=0, dst_region=3)))
        for kind, seq, number, body in sequence:
            try:
                rdma.on_message(msg(kind, seq, number, body))
            except ProtocolViolation:
                break
    finally:
        rdma.close("fuzz over")
        provider.close()


def test_an_empty_frame_of_an_aborted_request_is_not_denied(path):
    """The sender never waits on an empty frame, so a DENY for one would be a protocol violation
    that kills the link (and every other request on it)."""
    rdma, link, _qp = path
    link.listener.sinks = [None]  # the receiver aborted the request
    rdma.receive(DataDescriptor("r", True, make_blocks(0, 0, 0, src_region=9, dst_region=0)[:0],
                                1, 0, b""))  # fmt: skip
    assert [m.kind for m in link.posted[1:]] == []


def test_an_empty_last_batch_of_an_aborted_request_leaves_the_link_up(no_leaks):
    p, d = engine("P"), engine("D")
    try:
        assert transfer(p, d, "warm", n_blocks=1)[1].ok
        link = p.backend.link_to(d.data_address)
        got_send = Completions()
        d.expect("gone", on_complete=Completions())
        d.abort("gone", "decode node gave up")
        empty = make_blocks(0, 0, BLOCK)[:0]
        p.send("gone", d.data_address, empty, last=True, on_complete=got_send)
        assert got_send.wait().status is TransferStatus.ABORTED
        sent, received = transfer(p, d, "after", n_blocks=2)[:2]
        assert sent.ok, sent
        assert received.ok, received
        assert p.backend.link_to(d.data_address) is link  # no protocol violation closed it
        assert not link.closed
    finally:
        p.close()
        d.close()


def test_a_path_that_fails_to_start_releases_its_queue_pair():
    class FailingRecvQP(StubQP):
        def post_recv(self, wr_id):
            raise OSError("ENOMEM")

    provider = RdmaPathProvider(FakeDevice())
    assert provider.unavailable() is None
    qp = FailingRecvQP()
    provider.device.create_qp = lambda: qp  # type: ignore[method-assign]
    link = StubLink()
    candidate = provider.candidate(link)
    hello = type("H", (), {"offer": lambda self, name: qp.info.pack()})()
    with pytest.raises(OSError, match="ENOMEM"):
        candidate.open(hello)
    candidate.discard()
    assert qp.state == "CLOSED"
    assert not provider._paths
    provider.close()


def test_a_freed_receive_slot_is_granted_only_after_its_receive_is_posted_again(path):
    """A GRANT sent before the receive is back lets the peer's WRITE_WITH_IMM find no receive
    (RNR): the reader thread granting between the two must not be able to get there first."""
    rdma, link, qp = path
    link.listener.sinks = [StubSink(), StubSink(), StubSink()]
    blocks = make_blocks(0, 0, 4096, src_region=9, dst_region=0)
    for seq in (11, 12):
        rdma.receive(DataDescriptor("r", False, blocks, seq, 4096, b""))
    events = []
    posts, reposts = link.post, qp.post_recv

    def post(frame):
        posts(frame)
        events.extend(f"grant {m.seq}" for m in link.posted[-1:] if m.kind == GRANT)

    def post_recv(wr_id):
        if not events:  # the reader thread gets a DESC in right now
            rdma.receive(DataDescriptor("r", True, blocks, 13, 4096, b""))
        reposts(wr_id)
        events.append("recv")

    link.post, qp.post_recv = post, post_recv
    rdma._on_completion(WorkCompletion(0, True, True, "success", imm=11))
    assert events == ["recv", "grant 13"]


def test_device_memory_with_an_rdma_device_fails_its_link_with_a_reason_not_every_link(
    no_leaks, caplog
):
    """A CUDA region (a numpy stand-in) on engines whose TCP backend has an rdma path. Before,
    the staging pool (region id 0x10000) broke REGIONS encoding and every later link failed to
    open; now the device transfer fails with a reason and host transfers still go by rdma."""
    from kvt.access import DeviceMemory
    from kvt.engine import Engine
    from kvt.staging import ThreadCopier

    def make(name):
        providers = [RdmaPathProvider(FakeDevice()), TcpPathProvider()]
        backend = TcpBackend(name=name, providers=providers)
        return Engine(backend, name=name, default_timeout_s=5, device_copier=ThreadCopier(),
                      staging_bytes=8 * BLOCK)  # fmt: skip

    p, d = make("P"), make("D")
    try:
        src = np.random.default_rng(5).integers(0, 256, 4 * BLOCK, dtype=np.uint8)
        dst = np.zeros(4 * BLOCK, dtype=np.uint8)
        rs = p.register_region(DeviceMemory(int(src.ctypes.data), src.nbytes, "cuda:0", owner=src))
        rd = d.register_region(DeviceMemory(int(dst.ctypes.data), dst.nbytes, "cuda:0", owner=dst))
        blocks = make_blocks([0, 2 * BLOCK], [BLOCK, 3 * BLOCK], BLOCK, src_region=rs,
                             dst_region=rd)  # fmt: skip
        got_send, got_recv = Completions(), Completions()
        d.expect("g", on_complete=got_recv)
        p.send("g", d.data_address, blocks, last=True, on_complete=got_send)
        sent, received = got_send.wait(), got_recv.wait()
        assert (sent.status, sent.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
        assert "region 0 is not registered with the NIC" in caplog.text
        assert received.status is TransferStatus.ABORTED
        assert not dst.any()
        host_sent, host_received = transfer(p, d, "host", n_blocks=4)[:2]
        assert host_sent.ok, host_sent
        assert host_received.ok, host_received
        assert link_path(p, d) == "rdma"
    finally:
        p.close()
        d.close()


def test_a_frame_number_the_peer_reuses_is_a_violation_and_the_first_frame_still_ends(path):
    """Before, a second DESC with a granted frame's number replaced it: the first sink was never
    ended (its request's I/O stayed open until the deadline, on close too)."""
    rdma, link, _qp = path
    first, second = StubSink(), StubSink()
    link.listener.sinks = [first, second]
    blocks = make_blocks(0, 0, 4096, src_region=9, dst_region=0)
    rdma.receive(DataDescriptor("r", False, blocks, 11, 4096, b""))
    with pytest.raises(ProtocolViolation, match="frame 11"):
        rdma.receive(DataDescriptor("r", True, blocks, 11, 4096, b""))
    assert second.calls == []
    rdma.close("protocol violation")
    assert first.calls == ["begin", ("end", 0)]


def test_a_verbs_device_that_fails_half_way_closes_its_context(monkeypatch):
    """Before, a failure after the device context opened (PD, GID query, scratch MR) left the
    context (and its async event fd) open."""
    from types import SimpleNamespace

    import kvt.rdma as rdma_module

    closed = []

    class Context:
        def __init__(self, name):
            pass

        def query_device(self):
            return SimpleNamespace(max_sge=4, max_qp_wr=64)

        def query_port(self, port):
            return SimpleNamespace(state=4, lid=1, active_mtu=5, max_msg_sz=1 << 20)

        def close(self):
            closed.append("ctx")

    def no_pd(ctx):
        raise OSError("ibv_alloc_pd failed")

    pv = SimpleNamespace(
        enums=SimpleNamespace(IBV_PORT_ACTIVE=4),
        device=SimpleNamespace(Context=Context),
        pd=SimpleNamespace(PD=no_pd),
    )
    monkeypatch.setattr(rdma_module, "load_pyverbs", lambda: pv)
    with pytest.raises(OSError, match="ibv_alloc_pd"):
        rdma_module.VerbsDevice("fake0")
    assert closed == ["ctx"]
