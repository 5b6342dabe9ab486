"""A second D pulling the transfer a first D failed on (pd-serving's failover), on P's Producer.

pd-serving retries a D that failed before its first token on another D with the same transfer
id and P's address. Whether that D gets the KV depends on what the first D did on P:

- never pulled (refused, died, 5xx before its pull): P still holds the blocks under the lease;
  the second pull is sent. No second prefill.
- pulling while the second D asks: the second pull fails at once (duplicate), D2 recomputes.
- pulled (done or aborted), or released it (its request aborted): P gave the blocks back and
  keeps a tombstone for one lease, so the second pull fails at once and D2 recomputes now
  (before the tombstone, it was parked as an early pull for the whole lease, then failed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
from hybrid_connector import common, producer
from hybrid_connector.errors import PeerError, TransferError
from hybrid_connector.metadata import OfferSpec
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


class _Producer(producer.Producer):
    """P's machine, counting every give-back of its blocks (each path: exactly once)."""

    def __init__(self) -> None:
        super().__init__(SPEC, producer.ProducerSettings(lease_s=30, transfer_timeout_s=60))
        self.returned: Counter[str] = Counter()

    def handle(self, event: producer.ProducerEvent) -> list[producer.ProducerAction]:
        actions = super().handle(event)
        self.returned.update(_returned(actions))
        assert max(self.returned.values(), default=0) <= 1, f"given back twice: {self.returned}"
        return actions


@pytest.fixture
def p() -> Iterator[_Producer]:
    machine = _Producer()
    yield machine
    assert machine.returned == {P_REQ: 1}, "P's blocks go back exactly once on every path"


def _finish(p: _Producer) -> list[producer.ProducerAction]:
    return p.handle(producer.RequestFinished(OfferSpec(P_REQ, T, [[3, 5]], TOKENS)))


def _pull(p: _Producer, pull: int, d_request: str) -> list[producer.ProducerAction]:
    request = TransferKvRequest(T, d_request, "127.0.0.1:9", SPEC, [[0, 1]], [0], TOKENS)
    return p.handle(producer.PullArrived(pull, request, f"d{pull}:1"))


def _done(p: _Producer, ok: bool) -> list[producer.ProducerAction]:
    if ok:
        completion = Completion(T, "send", TransferStatus.DONE, nbytes=512)
    else:
        completion = Completion(
            T, "send", TransferStatus.ABORTED, AbortOrigin.PEER, reason="D died"
        )
    return p.handle(producer.SendCompleted(T, completion))


def _returned(actions: list[producer.ProducerAction]) -> list[str]:
    return [a.request_id for a in actions if isinstance(a, producer.ReturnBlocks)]


def _kinds(actions: list[producer.ProducerAction]) -> list[type]:
    return [type(a) for a in actions if not isinstance(a, common.Count)]


def test_a_second_d_pulls_what_p_holds_when_the_first_never_pulled(p: _Producer) -> None:
    _finish(p)  # P answered the proxy; D0 failed before its pull
    actions = _pull(p, 2, "d1-req")
    assert producer.StartSend in _kinds(actions)
    reported = _done(p, ok=True)
    assert _returned(reported) == [P_REQ]  # blocks back once, after D1's pull
    assert len(p) == 0
    assert p.tombstones() == 1
    p.handle(producer.DeadlineReached(T))  # the tombstone lasts one lease
    assert p.tombstones() == 0


def test_a_second_pull_while_the_first_is_sending_fails_at_once(p: _Producer) -> None:
    _finish(p)
    _pull(p, 1, "d0-req")
    (fail,) = [a for a in _pull(p, 2, "d1-req") if isinstance(a, producer.FailPull)]
    assert isinstance(fail.error, PeerError)  # D1 recomputes now, no wait
    assert _returned(_done(p, ok=False)) == [P_REQ]


@pytest.mark.parametrize("first_pull_ok", [True, False], ids=["first_done", "first_aborted"])
def test_a_second_pull_after_the_first_pull_ended_fails_at_once(
    p: _Producer, first_pull_ok: bool
) -> None:
    _finish(p)
    _pull(p, 1, "d0-req")
    assert _returned(_done(p, ok=first_pull_ok)) == [P_REQ]  # blocks back to vLLM
    actions = _pull(p, 2, "d1-req")
    fails = [a for a in actions if isinstance(a, producer.FailPull)]
    assert fails, f"parked instead: {actions}"
    assert isinstance(fails[0].error, TransferError)
    assert common.Count("early_pulls") not in actions
