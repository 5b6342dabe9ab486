"""A second D pulling the transfer a first D failed on (pd-serving's failover), on P's Producer.

pd-serving retries a D that failed before its first token on another D with the same transfer
id and P's address. Whether that D gets the KV depends on what the first D did on P:

- never pulled (refused, died, 5xx before its pull): P still holds the blocks under the lease;
  the second pull is sent. No second prefill.
- pulling while the second D asks: the second pull fails at once (duplicate), D2 recomputes.
- pulled (done or aborted), or released it (its request aborted): P gave the blocks back. The
  second pull finds no record and is parked as an early pull, for the whole lease, then fails
  with LeaseExpired, and D2 recomputes only then (``lease_s``, 30 s by default, later). The
  xfail tests below say what it should do: fail at once (a tombstone after the report, as the
  CANCELLED one after an abort), so D2 recomputes at once.
"""

from __future__ import annotations

import pytest
from hybrid_connector import state
from hybrid_connector.errors import PeerError, TransferError
from hybrid_connector.metadata import SendSpec
from hybrid_connector.protocol import CacheSpec, LayoutSpec, SegmentSpec, TransferKvRequest
from kvt import AbortOrigin, Completion, TransferStatus

LAYOUT = LayoutSpec(
    layer_names=["l0", "l1"],
    layer_offsets=[0, 4096],
    region_ids=[1, 1],
    num_blocks=16,
    block_size=4,
    segments=[SegmentSpec("kv", 0, 256, 256)],
    dtype="bfloat16",
)
SPEC = CacheSpec([LAYOUT])
T, P_REQ, TOKENS = "t-1", "p-1", 6


def _producer() -> state.Producer:
    return state.Producer(SPEC, state.ProducerSettings(lease_s=30, transfer_timeout_s=60))


def _finish(p: state.Producer) -> list[state.ProducerAction]:
    return p.handle(state.RequestFinished(SendSpec(P_REQ, T, [[3, 5]], TOKENS)))


def _pull(p: state.Producer, pull: int, d_request: str) -> list[state.ProducerAction]:
    request = TransferKvRequest(T, d_request, "127.0.0.1:9", SPEC, [[0, 1]], [0], TOKENS)
    return p.handle(state.PullArrived(pull, request, f"d{pull}:1"))


def _done(p: state.Producer, ok: bool) -> list[state.ProducerAction]:
    if ok:
        completion = Completion(T, "send", TransferStatus.DONE, nbytes=512)
    else:
        completion = Completion(
            T, "send", TransferStatus.ABORTED, AbortOrigin.PEER, reason="D died"
        )
    return p.handle(state.SendCompleted(T, completion))


def _kinds(actions: list[state.ProducerAction]) -> list[type]:
    return [type(a) for a in actions if not isinstance(a, state.Count)]


def test_a_second_d_pulls_what_p_holds_when_the_first_never_pulled() -> None:
    p = _producer()
    _finish(p)  # P answered the proxy; D0 failed before its pull
    actions = _pull(p, 2, "d1-req")
    assert state.StartSend in _kinds(actions)
    reported = _done(p, ok=True)
    assert state.ReportSent(P_REQ) in reported  # blocks back once, after D1's pull
    assert len(p) == 0


def test_a_second_pull_while_the_first_is_sending_fails_at_once() -> None:
    p = _producer()
    _finish(p)
    _pull(p, 1, "d0-req")
    (fail,) = [a for a in _pull(p, 2, "d1-req") if isinstance(a, state.FailPull)]
    assert isinstance(fail.error, PeerError)  # D1 recomputes now, no wait
    assert state.ReportSent(P_REQ) in _done(p, ok=False)


@pytest.mark.xfail(
    strict=True,
    reason="gap: after the first pull ended, a second pull is parked for the whole lease",
)
@pytest.mark.parametrize("first_pull_ok", [True, False], ids=["first_done", "first_aborted"])
def test_a_second_pull_after_the_first_pull_ended_fails_at_once(first_pull_ok: bool) -> None:
    p = _producer()
    _finish(p)
    _pull(p, 1, "d0-req")
    assert state.ReportSent(P_REQ) in _done(p, ok=first_pull_ok)  # blocks back to vLLM
    actions = _pull(p, 2, "d1-req")
    fails = [a for a in actions if isinstance(a, state.FailPull)]
    assert fails, f"parked instead: {actions}"
    assert isinstance(fails[0].error, TransferError)


def test_today_a_second_pull_after_the_first_ended_waits_for_the_lease() -> None:
    """What the xfail above describes, as it is (the lease, then LeaseExpired)."""
    p = _producer()
    _finish(p)
    _pull(p, 1, "d0-req")
    _done(p, ok=False)
    actions = _pull(p, 2, "d1-req")
    assert state.Count("early_pulls") in actions
    assert p.phase(T) is state.Phase.PARKED
    (fail,) = [a for a in p.handle(state.DeadlineReached(T)) if isinstance(a, state.FailPull)]
    assert fail.pull == 2
