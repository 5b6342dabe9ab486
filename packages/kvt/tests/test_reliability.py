"""Faults on purpose (kvt.faults): link drops, stalled writes, corrupt headers, racing aborts.

Each test runs on every backend that takes a fault plan. The scripted tests pin one race each;
the soak at the end (soak.py here, CI-sized; benchmarks/bench_reliability.py runs the full
10,000) mixes them at random and checks the rule of agreement from the README's "Faults on
purpose"; the abort storm aborts every request from both sides at once (crossed aborts).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import Completions
from fault_plans import FaultRates, Rule, ScriptedFaults
from ipcblock import make_blocks
from kvt import AbortCode, AbortOrigin, TransferStatus
from kvt.backend import DataPlaneBackend
from kvt.engine import Engine
from kvt.faults import CORRUPT_FIELDS, Fault, FaultKind
from kvt.outcome import Completion
from soak import SOAK_TRANSPORTS, crossed_two_answers, disagreement, new_engine, soak

BLOCK = 64 << 10


@pytest.fixture(params=SOAK_TRANSPORTS)
def transport(request, no_leaks) -> str:
    return request.param


@pytest.fixture
def engines(transport):
    """make(name, plan=None) -> engine on ``transport``; every engine made is closed after."""
    made = []

    def make(name, plan=None, **kwargs):
        engine = new_engine(transport, name, plan, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def regions(p, d, nbytes=1 << 20):
    src = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return src, dst, p.register_region(src), d.register_region(dst)


def both(p, d, request_id, batches, **send_kwargs):
    """expect() on d, then send every batch from p (the last one last=True)."""
    got_send, got_recv = Completions(), Completions()
    d.expect(request_id, on_complete=got_recv)
    for i, blocks in enumerate(batches):
        p.send(request_id, d.data_address, blocks, last=i == len(batches) - 1,
               on_complete=got_send if i == 0 else None, **send_kwargs)  # fmt: skip
    return got_send, got_recv


def test_sender_abort_while_the_last_frame_is_being_written_agrees(engines) -> None:
    """The defect of the README's old "Deviations and limits": abort() while the last frame was on
    its way left the receiver DONE (every byte arrived) and the sender ABORTED(LOCAL)."""
    stall = Fault(FaultKind.STALL)  # held until released
    p, d = engines("P", ScriptedFaults(Rule(stall, last=True))), engines("D")
    src, dst, rs, rd = regions(p, d)
    blocks = make_blocks([0, BLOCK], [4 * BLOCK, 0], BLOCK, src_region=rs, dst_region=rd)
    got_send, got_recv = both(p, d, "late", [blocks])
    assert stall.stalled.wait(10)
    p.abort("late", "too late: the last frame has begun")
    stall.release()
    mine, theirs = got_send.wait(), got_recv.wait()
    assert theirs.ok
    assert mine.ok, f"receiver DONE, sender {mine.status} {mine.origin}: they disagree"
    np.testing.assert_array_equal(dst[4 * BLOCK : 5 * BLOCK], src[:BLOCK])


def test_sender_abort_after_the_last_byte_left_agrees(engines) -> None:
    """abort() between the last byte leaving and the receiver's DONE arriving: DONE on both."""
    p, d = engines("P"), engines("D")
    mine = between_done_and_its_arrival(p, d, lambda: p.abort("r", "after the last byte"))
    assert mine.ok, f"receiver DONE, sender {mine.status} {mine.origin}: they disagree"


def between_done_and_its_arrival(p, d, action):
    """One request whose receiver runs ``action`` when it is DONE, before its DONE is sent (so
    after the sender's last byte left); returns the sender's completion."""
    _, _, rs, rd = regions(p, d)
    got_send, got_recv = Completions(), Completions()

    def receiver_done(c) -> None:
        got_recv(c)
        action()

    d.expect("r", on_complete=receiver_done)
    p.send("r", d.data_address, make_blocks(0, 0, BLOCK, src_region=rs, dst_region=rd),
           last=True, on_complete=got_send)  # fmt: skip
    assert got_recv.wait().ok
    return got_send.wait()


def test_link_lost_after_the_last_byte_left_asks_for_the_verdict(engines) -> None:
    """The link dies between the receiver's DONE and its arrival: the sender asks on a fresh
    link and hears DONE, instead of DONE on one side and ABORTED(TRANSPORT) on the other."""
    p, d = engines("P"), engines("D")
    cut = lambda: p.backend.link_to(d.data_address).close("cable cut after the last byte")  # noqa: E731
    mine = between_done_and_its_arrival(p, d, cut)
    assert mine.ok, f"receiver DONE, sender {mine.status} {mine.origin}: they disagree"
    assert mine.nbytes == BLOCK


def test_sender_abort_while_an_earlier_frame_is_written_aborts_both(engines) -> None:
    """An abort that comes before the last frame begins still aborts both sides (LOCAL, PEER)."""
    stall = Fault(FaultKind.STALL)
    p, d = engines("P", ScriptedFaults(Rule(stall, nth=1))), engines("D")
    _, _, rs, rd = regions(p, d)
    first = make_blocks(0, 0, BLOCK, src_region=rs, dst_region=rd)
    second = make_blocks(BLOCK, BLOCK, BLOCK, src_region=rs, dst_region=rd)
    got_send, got_recv = both(p, d, "early", [first, second])
    assert stall.stalled.wait(10)
    p.abort("early", "before the last frame")
    stall.release()
    mine, theirs = got_send.wait(), got_recv.wait()
    assert (mine.status, mine.origin) == (TransferStatus.ABORTED, AbortOrigin.LOCAL)
    assert (theirs.status, theirs.origin) == (TransferStatus.ABORTED, AbortOrigin.PEER)
    assert "before the last frame" in theirs.reason


@pytest.mark.parametrize("kind", [FaultKind.DROP, FaultKind.DROP_MID])
def test_dropped_link_aborts_both_sides_transport(engines, kind) -> None:
    p, d = engines("P", ScriptedFaults(Rule(Fault(kind), nth=2))), engines("D")
    src, dst, rs, rd = regions(p, d)
    batches = [make_blocks(i * BLOCK, i * BLOCK, BLOCK, src_region=rs, dst_region=rd)
               for i in range(3)]  # fmt: skip
    got_send, got_recv = both(p, d, "cut", batches)
    for c in (got_send.wait(), got_recv.wait()):
        assert (c.status, c.origin, c.code) == (
            TransferStatus.ABORTED, AbortOrigin.TRANSPORT, AbortCode.CONNECTION_LOST,
        )  # fmt: skip
    # The next request gets a fresh link and is byte-exact.
    got_send, got_recv = both(p, d, "after", batches)
    assert got_send.wait().ok
    assert got_recv.wait().ok
    np.testing.assert_array_equal(dst[: 3 * BLOCK], src[: 3 * BLOCK])


def test_link_dropped_before_the_receiver_saw_anything_tells_it(engines) -> None:
    """Nothing of the request reached the receiver, so losing the link aborts nothing there: the
    sender tells it on a fresh link instead of letting it hold its blocks for its deadline."""
    p, d = engines("P", ScriptedFaults(Rule(Fault(FaultKind.DROP), nth=1))), engines("D")
    _, _, rs, rd = regions(p, d)
    batches = [make_blocks(i * BLOCK, i * BLOCK, BLOCK, src_region=rs, dst_region=rd)
               for i in range(2)]  # fmt: skip
    got_send, got_recv = both(p, d, "unseen", batches)  # the first batch's frame is dropped
    mine = got_send.wait()
    theirs = got_recv.wait(timeout=10)  # the receiver's own deadline is 60 s
    for c in (mine, theirs):
        assert (c.status, c.origin, c.code) == (
            TransferStatus.ABORTED, AbortOrigin.TRANSPORT, AbortCode.CONNECTION_LOST,
        )  # fmt: skip
    assert theirs.nbytes == 0


@pytest.mark.parametrize("field", CORRUPT_FIELDS)
def test_corrupt_header_closes_only_that_connection(engines, field, caplog) -> None:
    """The receiver closes only the connection the bad frame came on: a typed error
    (ProtocolViolation), a log line naming the peer; the sender's requests on it end
    ABORTED(TRANSPORT); another sender's transfer to the same receiver is untouched."""
    bad = engines("Pbad", ScriptedFaults(Rule(Fault(FaultKind.CORRUPT, field=field), nth=2)))
    good, d = engines("Pgood"), engines("D")
    src = np.random.default_rng(5).integers(0, 256, 4 * BLOCK, dtype=np.uint8)
    dst = np.zeros(8 * BLOCK, dtype=np.uint8)
    rb, rg, rd = bad.register_region(src), good.register_region(src), d.register_region(dst)
    # The good sender's request is half done when the bad frame arrives, and finishes after.
    good_send, good_recv = Completions(), Completions()
    d.expect("good", on_complete=good_recv)
    good.send("good", d.data_address, make_blocks(0, 4 * BLOCK, BLOCK, src_region=rg,
              dst_region=rd), last=False, on_complete=good_send)  # fmt: skip
    batches = [make_blocks(i * BLOCK, i * BLOCK, BLOCK, src_region=rb, dst_region=rd)
               for i in range(2)]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvt"):
        got_send, got_recv = both(bad, d, "bad", batches, timeout_s=30)
        mine = got_send.wait()
        theirs = got_recv.wait()
    assert (mine.status, mine.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
    assert (theirs.status, theirs.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
    assert "protocol violation" in theirs.reason
    assert any(
        "protocol violation" in r.getMessage() and "Pbad" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    good.send("good", d.data_address, make_blocks(BLOCK, 5 * BLOCK, BLOCK, src_region=rg,
              dst_region=rd), last=True)  # fmt: skip
    assert good_send.wait().ok
    assert good_recv.wait().ok
    np.testing.assert_array_equal(dst[4 * BLOCK : 6 * BLOCK], src[: 2 * BLOCK])


def test_stall_past_the_deadline_closes_the_link_and_frees_the_memory(engines) -> None:
    """A write held forever: the sender's deadline closes the link, which ends the stall."""
    stall = Fault(FaultKind.STALL)
    p, d = engines("P", ScriptedFaults(Rule(stall))), engines("D")
    _, _, rs, rd = regions(p, d)
    got_send, got_recv = both(p, d, "stuck", [make_blocks(0, 0, BLOCK, src_region=rs,
                              dst_region=rd)], timeout_s=0.3)  # fmt: skip
    mine = got_send.wait()
    assert (mine.status, mine.origin) == (TransferStatus.ABORTED, AbortOrigin.TIMEOUT)
    theirs = got_recv.wait(30)
    assert theirs.status is TransferStatus.ABORTED


def test_soak_ci_sized(transport, no_leaks) -> None:
    """Random aborts from both sides at random moments, random link drops, stalls and corrupt
    headers: every request completes once per side, the sides agree, DONE ones are byte-exact."""
    rates = FaultRates(drop=0.005, drop_mid=0.005, corrupt=0.005, stall=0.02)  # ~10 of each
    report = soak(transport, transfers=1000, seed=14, rates=rates)
    assert report.violations == [], "\n".join(report.violations[:20])
    assert report.done > report.transfers // 5  # each link fault takes a wave's requests on it
    kinds = {kind.partition("@")[0] for kind in report.faults}
    assert kinds == {"drop", "drop-mid", "stall", "corrupt"}, report.faults
    assert report.local_aborts > 0
    # The faults hit the frames of the transport under test (samehost: descriptors and pulls).
    expected = {"memory": {"batch"}, "tcp": {"DATA"}, "samehost": {"DESC", "pull"}}[transport]
    assert set(report.frames) == expected, report.frames


def test_abort_storm_crossed_aborts_name_one_first_aborter(transport, no_leaks) -> None:
    """Every request aborted from both sides within about a millisecond: each pair of
    completions names the same side as the first aborter (never LOCAL on both)."""
    report = soak(transport, transfers=320, seed=7, storm=True)
    assert report.violations == [], "\n".join(report.violations[:20])
    assert report.crossed >= 5, report.outcomes
    assert report.two_answers == 0, report.outcomes


def test_two_sides_claiming_the_first_abort_break_the_rule() -> None:
    for send_origin, recv_origin in [
        (AbortOrigin.LOCAL, AbortOrigin.LOCAL),
        (AbortOrigin.LOCAL, AbortOrigin.TIMEOUT),
        (AbortOrigin.TIMEOUT, AbortOrigin.LOCAL),
    ]:
        send = _aborted("send", send_origin, AbortCode.CALLER_ABORT)
        recv = _aborted("recv", recv_origin, AbortCode.CALLER_ABORT)
        assert crossed_two_answers(send, recv)
        assert disagreement(send, recv, {"send", "recv"}, link_hit=False) is not None
    send = _aborted("send", AbortOrigin.PEER, AbortCode.CALLER_ABORT)
    recv = _aborted("recv", AbortOrigin.LOCAL, AbortCode.CALLER_ABORT)
    assert not crossed_two_answers(send, recv)
    assert disagreement(send, recv, {"send", "recv"}, link_hit=False) is None


class _FakeLink:
    def __init__(self, name: str) -> None:
        self.peer, self.path, self.sent = name, "fake", []

    def send_control(self, message) -> None:
        self.sent.append(message)

    def close(self, reason: str) -> None:
        pass


class _NewLinkEachCall(DataPlaneBackend):
    """A backend whose links die between calls: every link_to returns a fresh link."""

    def __init__(self) -> None:
        self.links: list[_FakeLink] = []
        self.jobs: list[tuple[_FakeLink, object]] = []

    address = "fake:P"

    def start(self, listener) -> None:
        self.listener = listener

    def link_to(self, peer_address: str) -> _FakeLink:
        self.links.append(_FakeLink(f"link{len(self.links)}"))
        return self.links[-1]

    def submit(self, link, job) -> None:
        self.jobs.append((link, job))

    def close(self) -> None:
        pass


def test_a_request_never_continues_on_a_second_link(no_leaks) -> None:
    """Found by the soak: the link carrying batch 1 died, and batch 2 (last) was sent before the
    loss was reported; it went out on a fresh link and the receiver reported DONE with batch 1's
    bytes missing. A request whose link changed under it is lost (TRANSPORT) instead."""
    backend = _NewLinkEachCall()
    engine = Engine(backend, name="P")
    try:
        src = np.ones(2 * BLOCK, dtype=np.uint8)
        rs = engine.register_region(src)
        got = Completions()
        engine.send("r", "fake:D", make_blocks(0, 0, BLOCK, src_region=rs), on_complete=got)
        engine.send("r", "fake:D", make_blocks(BLOCK, BLOCK, BLOCK, src_region=rs), last=True)
        second_link_jobs = [job for link, job in backend.jobs if link is backend.links[-1]]
        assert not second_link_jobs or not second_link_jobs[0].begin_frame(), (
            "the last batch went out on a second link"
        )
        first = backend.jobs[0][1]
        first.fail("link0 is closed", False)  # what the dead link's drain does
        engine.on_link_lost(backend.links[0], "link0 died", False)
        c = got.wait()
        assert (c.status, c.origin) == (TransferStatus.ABORTED, AbortOrigin.TRANSPORT)
    finally:
        engine.close()


def _aborted(role: str, origin: AbortOrigin, code: AbortCode) -> Completion:
    return Completion("r", role, TransferStatus.ABORTED, origin, code, "test")


@pytest.mark.parametrize("code", [AbortCode.BAD_BLOCK, AbortCode.UNKNOWN_REQUEST])
def test_a_refused_input_is_peer_on_both_sides_and_keeps_the_rule(code) -> None:
    """The receiver refuses its peer's bad input (PEER) and tells the sender (PEER): allowed."""
    send, recv = _aborted("send", AbortOrigin.PEER, code), _aborted("recv", AbortOrigin.PEER, code)
    assert disagreement(send, recv, aborted=set(), link_hit=False) is None


def test_peer_on_both_sides_for_any_other_reason_breaks_the_rule() -> None:
    for send_code, recv_code in [
        (AbortCode.CALLER_ABORT, AbortCode.CALLER_ABORT),
        (AbortCode.BAD_BLOCK, AbortCode.UNKNOWN_REQUEST),
    ]:
        send = _aborted("send", AbortOrigin.PEER, send_code)
        recv = _aborted("recv", AbortOrigin.PEER, recv_code)
        assert disagreement(send, recv, aborted=set(), link_hit=False) is not None
