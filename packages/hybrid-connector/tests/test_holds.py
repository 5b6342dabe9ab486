"""P's scheduler half holding finished requests' blocks itself, released by SEND_DONE.

Without vLLM: a block pool that counts references like vLLM's (a block is free at ref_cnt 0
and must never go below), the scheduler half with fake requests, the SEND_DONE server and
client on real sockets, and the worker halves on real kvt: the worker offers an announced
request at the end of its step and tells the scheduler by SEND_DONE, never in
finished_sending.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hybrid_connector import send_done as send_done_module
from hybrid_connector.config import HybridConfig
from hybrid_connector.holds import MAX_EARLY, BlockHolds
from hybrid_connector.metadata import FinalPrefill, HybridConnectorMetadata
from hybrid_connector.protocol import SEND_DONE, SendDoneRequest
from hybrid_connector.scheduler_side import SchedulerSide
from hybrid_connector.send_done import SendDoneClient, SendDoneServer
from simple_rpc import Client, LoopThread
from test_worker_side import Pair, _layer_blocks, _wait


class FakeBlock:
    def __init__(self, block_id: int, *, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.is_null = is_null
        self.pool = None


class FakePool:
    """vLLM's BlockPool reference counting: ``free`` holds the blocks at ref_cnt 0."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [FakeBlock(i, is_null=i == 0) for i in range(num_blocks)]
        self.free = set(range(1, num_blocks))
        self._lock = threading.Lock()
        self.touch_thread: set[str] = set()

    def allocate(self, n: int) -> list[FakeBlock]:
        with self._lock:
            ids = sorted(self.free)[:n]
            for i in ids:
                self.free.discard(i)
                self.blocks[i].ref_cnt = 1
        return [self.blocks[i] for i in ids]

    def touch(self, blocks: Sequence[FakeBlock]) -> None:
        self.touch_thread.add(threading.current_thread().name)
        with self._lock:
            for block in blocks:
                assert not block.is_null
                if block.ref_cnt == 0:
                    self.free.discard(block.block_id)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[FakeBlock]) -> None:
        self.touch_thread.add(threading.current_thread().name)
        with self._lock:
            for block in ordered_blocks:
                if block.is_null:
                    continue
                block.ref_cnt -= 1
                assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
                if block.ref_cnt == 0:
                    self.free.add(block.block_id)


# ------------------------------------------------------------------ BlockHolds alone
def test_a_held_block_survives_vllms_free_until_send_done_and_a_drain() -> None:
    pool = FakePool(8)
    holds = BlockHolds(pool)
    blocks = pool.allocate(3)
    assert holds.hold("r", "t", [blocks]) is True
    pool.free_blocks(blocks)  # vLLM frees the request (delay_free=False)
    assert not pool.free & {b.block_id for b in blocks}, "held blocks must not be reusable"
    assert holds.send_done("r", 0) is True
    assert not pool.free & {b.block_id for b in blocks}, "only the engine thread frees (drain)"
    assert holds.drain() == 3
    assert {b.block_id for b in blocks} <= pool.free
    assert holds.send_done("r", 0) is False, "a second report is ignored"
    assert holds.drain() == 0
    assert len(holds) == 0
    assert holds.held_blocks == 0
    assert holds.released == 1


def test_every_tp_rank_must_report_before_the_blocks_go_back() -> None:
    pool = FakePool(8)
    holds = BlockHolds(pool, tp_size=2)
    blocks = pool.allocate(2)
    holds.hold("r", "t", [blocks])
    pool.free_blocks(blocks)
    assert holds.send_done("r", 1) is True
    assert holds.send_done("r", 1) is False, "one rank counts once"
    assert holds.drain() == 0
    assert holds.send_done("r", 0) is True
    assert holds.drain() == 2
    assert all(b.ref_cnt == 0 for b in blocks)


def test_send_done_before_the_hold_means_nothing_is_referenced() -> None:
    """The send can end inside the step, before vLLM finishes the request."""
    pool = FakePool(8)
    holds = BlockHolds(pool)
    blocks = pool.allocate(2)
    assert holds.send_done("r", 0) is False
    assert holds.hold("r", "t", [blocks]) is False
    assert all(b.ref_cnt == 1 for b in blocks), "nothing touched: vLLM's free is the last"
    pool.free_blocks(blocks)
    assert {b.block_id for b in blocks} <= pool.free


def test_part_of_the_ranks_early_the_rest_after_the_hold() -> None:
    pool = FakePool(8)
    holds = BlockHolds(pool, tp_size=2)
    blocks = pool.allocate(1)
    holds.send_done("r", 0)
    assert holds.hold("r", "t", [blocks]) is True
    pool.free_blocks(blocks)
    assert holds.send_done("r", 0) is False, "rank 0 already counted before the hold"
    assert holds.send_done("r", 1) is True
    assert holds.drain() == 1
    assert blocks[0].ref_cnt == 0


def test_null_blocks_and_several_groups() -> None:
    pool = FakePool(8)
    holds = BlockHolds(pool)
    state, attention = pool.allocate(1), pool.allocate(2)
    null = pool.blocks[0]
    holds.hold("r", "t", [[null, null, *state], attention])
    assert holds.held_blocks == 3
    assert null.ref_cnt == 0
    holds.send_done("r", 0)
    assert holds.drain() == 3


def test_release_all_at_shutdown_frees_once() -> None:
    pool = FakePool(8)
    holds = BlockHolds(pool)
    a, b = pool.allocate(2), pool.allocate(1)
    holds.hold("a", "ta", [a])
    holds.hold("b", "tb", [b])
    pool.free_blocks(a + b)
    assert holds.release_all() == 3
    assert all(x.ref_cnt == 0 for x in a + b)
    assert holds.send_done("a", 0) is False
    assert holds.drain() == 0
    assert holds.release_all() == 0


def test_reports_for_requests_never_held_are_bounded() -> None:
    holds = BlockHolds(FakePool(2))
    for i in range(MAX_EARLY):
        holds.send_done(f"stray-{i}", 0)
    holds.send_done("one-too-many", 0)
    assert holds.hold("one-too-many", "t", [[]]) is True, "its early report was not kept"


def test_reports_from_many_threads_free_every_block_exactly_once() -> None:
    pool = FakePool(400)
    holds = BlockHolds(pool, tp_size=2)
    requests = {f"r{i}": pool.allocate(3) for i in range(100)}
    with ThreadPoolExecutor(4) as executor:
        futures = []
        for request_id, blocks in requests.items():
            # Ranks report from other threads, some before the engine thread holds.
            futures.append(executor.submit(holds.send_done, request_id, 0))
            holds.hold(request_id, "t", [blocks])
            pool.free_blocks(blocks)
            futures.append(executor.submit(holds.send_done, request_id, 1))
            holds.drain()
        for future in futures:
            future.result()
    holds.drain()
    assert len(holds) == 0
    assert holds.held_blocks == 0
    assert all(b.ref_cnt == 0 for blocks in requests.values() for b in blocks)
    assert pool.free == set(range(1, 400))


# ------------------------------------------------------------------ the scheduler half
class FakeManager:
    def __init__(self, pool: FakePool) -> None:
        self.block_pool = pool
        self.owned: dict[str, list[FakeBlock]] = {}

    def get_blocks(self, request_id: str) -> Any:
        return SimpleNamespace(blocks=(self.owned[request_id],))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([b.block_id for b in self.owned[request_id]],)


def _p_request(request_id: str, prompt: int, *, max_tokens: int = 1) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": f"t-{request_id}"},
        max_tokens=max_tokens,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        status=SimpleNamespace(name="RUNNING"),
    )


def _scheduler(pool: FakePool) -> tuple[SchedulerSide, FakeManager, BlockHolds]:
    side = SchedulerSide(
        HybridConfig(rpc_port=8200), is_producer=True, is_consumer=False, block_size=4
    )
    manager = FakeManager(pool)
    side.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
    holds = BlockHolds(pool)
    side.use_holds(holds, "127.0.0.1:9999")
    return side, manager, holds


def _run_to_finish(side: SchedulerSide, manager: FakeManager, request: Any, status: str) -> Any:
    """vLLM's calls for a P request whose one step completes its prompt, then its finish."""
    manager.owned[request.request_id] = manager.block_pool.allocate(2)
    side.update_state_after_alloc(request, None, 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(
        SimpleNamespace(num_scheduled_tokens={request.request_id: request.num_prompt_tokens})
    )
    request.num_computed_tokens = request.num_prompt_tokens
    request.status = SimpleNamespace(name=status)
    return meta


def _held_request(pool: FakePool) -> tuple[SchedulerSide, BlockHolds, list[FakeBlock]]:
    """An announced P request that finished; vLLM freed it (delay_free=False); blocks held."""
    side, manager, holds = _scheduler(pool)
    request = _p_request("p-1", 6)
    _run_to_finish(side, manager, request, "FINISHED_LENGTH_CAPPED")
    blocks = manager.owned["p-1"]
    side.request_finished(request, ([b.block_id for b in blocks],))
    pool.free_blocks(blocks)
    return side, holds, blocks


def test_announced_request_is_freed_by_vllm_at_once_and_its_blocks_held() -> None:
    pool = FakePool(16)
    side, manager, holds = _scheduler(pool)
    request = _p_request("p-1", 6)
    meta = _run_to_finish(side, manager, request, "FINISHED_LENGTH_CAPPED")
    (spec,) = meta.final_prefills
    assert spec.scheduler_holds is True
    assert meta.scheduler_address == "127.0.0.1:9999"
    blocks = manager.owned["p-1"]
    delay, params = side.request_finished(request, ([b.block_id for b in blocks],))
    assert delay is False, "vLLM must forget the request (its engine core may then sleep)"
    assert params is not None
    assert params["transfer_id"] == "t-p-1"
    assert params["remote_block_ids"] == [[b.block_id for b in blocks]]
    pool.free_blocks(blocks)  # what vLLM does after delay_free=False
    assert all(b.ref_cnt == 1 for b in blocks)
    assert side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).to_offer == []
    # The worker's SEND_DONE, then any hook: the blocks go back.
    holds.send_done("p-1", 0)
    side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert all(b.ref_cnt == 0 for b in blocks)


@pytest.mark.parametrize("hook", ["get_num_new_matched_tokens", "update_connector_output"])
def test_every_hook_returns_released_blocks(hook: str) -> None:
    side, holds, blocks = _held_request(FakePool(16))
    holds.send_done("p-1", 0)
    if hook == "get_num_new_matched_tokens":
        side.get_num_new_matched_tokens(_p_request("p-2", 4), 0)
    else:
        side.update_connector_output(SimpleNamespace(finished_recving=None))  # type: ignore[arg-type]
    assert all(b.ref_cnt == 0 for b in blocks)


def test_aborted_announced_request_is_held_too_but_offers_nothing() -> None:
    pool = FakePool(16)
    side, manager, holds = _scheduler(pool)
    request = _p_request("p-1", 6)
    _run_to_finish(side, manager, request, "FINISHED_ABORTED")
    blocks = manager.owned["p-1"]
    delay, params = side.request_finished(request, ([b.block_id for b in blocks],))
    assert (delay, params) == (False, None)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.to_offer == [], "the worker decides (step end)"
    assert meta.cancel_offer == []
    assert holds.held_blocks == 2


def test_request_that_keeps_decoding_takes_the_old_path() -> None:
    pool = FakePool(16)
    side, manager, holds = _scheduler(pool)
    request = _p_request("p-1", 6, max_tokens=16)
    meta = _run_to_finish(side, manager, request, "FINISHED_LENGTH_CAPPED")
    assert meta.final_prefills == []
    blocks = manager.owned["p-1"]
    delay, _ = side.request_finished(request, ([b.block_id for b in blocks],))
    assert delay is True
    (send,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).to_offer
    assert send.request_id == "p-1"
    assert holds.held_blocks == 0


def test_release_holds_at_shutdown() -> None:
    side, _, blocks = _held_request(FakePool(16))
    assert side.release_holds() == 2
    assert all(b.ref_cnt == 0 for b in blocks)


# ------------------------------------------------------------------ SEND_DONE on the wire
@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, leaked


def test_send_done_rpc_uses_the_missions_heads() -> None:
    assert SEND_DONE.request_head == 0x20181218
    assert SEND_DONE.response_head == 0x81218102


def test_send_done_reaches_the_holds_and_answers_held(no_thread_leak: None) -> None:
    pool = FakePool(8)
    holds = BlockHolds(pool)
    blocks = pool.allocate(2)
    holds.hold("r", "t", [blocks])
    server = SendDoneServer(holds, host="127.0.0.1", advertise_host=None)
    loop = LoopThread(name="test-client")
    try:

        async def call(request_id: str) -> bool:
            client = Client(server.address)
            try:
                reply = await client.call(SEND_DONE, SendDoneRequest(request_id, "t", 0, "sent"))
                return reply.held
            finally:
                await client.close()

        assert loop.run(call("r"), timeout=10) is True
        assert loop.run(call("r"), timeout=10) is False
        assert loop.run(call("unknown"), timeout=10) is False
    finally:
        loop.close()
        server.close()
        server.close()  # idempotent
    assert holds.drain() == 2


def test_client_retries_then_logs_when_the_scheduler_is_gone(
    no_thread_leak: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(send_done_module, "RETRIES", 2)
    monkeypatch.setattr(send_done_module, "RETRY_FIRST_S", 0.01)
    server = SendDoneServer(BlockHolds(FakePool(2)), host="127.0.0.1", advertise_host=None)
    address = server.address
    server.close()  # nobody listens any more
    loop = LoopThread(name="test-client")
    try:

        async def report() -> None:
            delivered: list[int] = []
            client = SendDoneClient(address, tp_rank=0, on_delivered=lambda: delivered.append(1))
            client.report("r", "t", "sent")
            await asyncio.gather(*client._tasks)
            await client.close()
            assert delivered == []

        with caplog.at_level("ERROR", logger="hybrid_connector.send_done"):
            loop.run(report(), timeout=10)
    finally:
        loop.close()
    assert "could not reach the scheduler" in caplog.text
    assert "request r" in caplog.text


# ------------------------------------------------------------------ the worker halves
class HoldingPair(Pair):
    """P and D workers on real kvt, P's scheduler half represented by its SEND_DONE server."""

    def __init__(self, lease_s: float = 5.0) -> None:
        super().__init__(lease_s=lease_s)
        self.pool = FakePool(64)
        self.holds = BlockHolds(self.pool)
        self.server = SendDoneServer(self.holds, host="127.0.0.1", advertise_host=None)

    def announce(self, request_id: str, tid: str, src: list[int], num_tokens: int) -> None:
        """P's scheduler: this step completes the prompt; it holds the blocks itself."""
        self.held = self.pool.allocate(len(src))
        self.holds.hold(request_id, tid, [self.held])
        self.pool.free_blocks(self.held)  # vLLM forgot the request
        spec = FinalPrefill(request_id, tid, [src], num_tokens, scheduler_holds=True)
        self.p.handle_metadata(
            HybridConnectorMetadata(final_prefills=[spec], scheduler_address=self.server.address)
        )

    def released(self) -> bool:
        self.holds.drain()
        return all(b.ref_cnt == 0 for b in self.held)

    def close(self) -> None:
        super().close()
        self.server.close()


@pytest.fixture
def holding(no_thread_leak: None) -> Iterator[HoldingPair]:
    pair = HoldingPair()
    yield pair
    pair.close()


def _wait_released(pair: HoldingPair, reports: int) -> None:
    """The scheduler half answered ``reports`` SEND_DONEs; its next hook frees the blocks."""
    assert pair.p.wait_count("send_done_delivered", reports, timeout_s=10)
    assert pair.released()


def test_announced_request_is_offered_at_step_end_and_sent_done_not_reported(
    holding: HoldingPair,
) -> None:
    tid = str(uuid.uuid4())
    src, dst = [3, 4], [9, 10]
    holding.announce("p-req", tid, src, 6)
    for name in holding.p_kv:
        holding.p.layer_saved(name)
    holding.p.step_done()  # the request finished in this step: offered now, no OfferSpec
    assert holding.p.wait_count("offers", 1, timeout_s=10)
    holding.pull("d-req", tid, dst, num_tokens=6)
    assert _wait(holding.d)[1:] == ({"d-req"}, set())
    for got, want in zip(
        _layer_blocks(holding.d_kv, dst), _layer_blocks(holding.p_kv, src), strict=True
    ):
        assert torch.equal(got, want)
    _wait_released(holding, 1)
    assert holding.p.drain().finished_sending == set(), "vLLM no longer knows the request"


def test_rapid_send_of_a_held_request_sends_done_after_the_step(holding: HoldingPair) -> None:
    tid = str(uuid.uuid4())
    holding.pull("d-req", tid, [9, 10], num_tokens=6)
    assert _wait(holding.d, timeout=0.3) == (set(), set(), set())
    holding.announce("p-req", tid, [3, 4], 6)
    holding.p.step_done()
    assert _wait(holding.d)[1:] == ({"d-req"}, set())
    _wait_released(holding, 1)
    assert holding.p.counters()["rapid_sends"] == 1


def test_lease_expiry_of_a_held_request_sends_done() -> None:
    pair = HoldingPair(lease_s=0.2)
    try:
        pair.announce("p-req", str(uuid.uuid4()), [3], 3)
        pair.p.step_done()
        assert pair.p.wait_count("leases_expired", 1, timeout_s=10)
        _wait_released(pair, 1)
    finally:
        pair.close()


def test_release_by_the_proxy_sends_done(holding: HoldingPair) -> None:
    from hybrid_connector.control import release_transfer

    tid = str(uuid.uuid4())
    holding.announce("p-req", tid, [3], 3)
    holding.p.step_done()
    assert holding.p.wait_count("offers", 1, timeout_s=10)
    loop = LoopThread(name="test-proxy")
    try:
        assert loop.run(release_transfer(holding.rpc_address, tid), timeout=10) is True
    finally:
        loop.close()
    _wait_released(holding, 1)


def test_shutdown_of_a_worker_holding_leaves_release_to_the_scheduler(
    holding: HoldingPair,
) -> None:
    holding.announce("p-req", str(uuid.uuid4()), [3], 3)
    holding.p.step_done()
    assert holding.p.wait_count("offers", 1, timeout_s=10)
    holding.p.close()
    assert "send_done_reports" not in holding.p.counters()
    assert holding.holds.release_all() == 1
    assert holding.released()


def test_decode_gone_before_its_parked_pull_was_served_sends_done_after_the_lease() -> None:
    """D dies while its pull waits on P: the pull goes, the blocks still come back (lease)."""
    pair = HoldingPair(lease_s=0.3)
    try:
        tid = str(uuid.uuid4())
        pair.pull("d-req", tid, [9], num_tokens=3)
        assert pair.p.wait_count("early_pulls", 1, timeout_s=10)
        pair.d.close()  # D's process is gone: its transfer_kv connection closes
        pair.announce("p-req", tid, [3], 3)
        pair.p.step_done()
        _wait_released(pair, 1)
        assert pair.p.drain().finished_sending == set()
    finally:
        pair.close()


def test_decode_dying_mid_send_sends_done_once_kvt_stopped(holding: HoldingPair) -> None:
    """D's kvt goes away while P sends layer by layer: kvt's abort completes the send, then
    the blocks go back, once."""
    tid = str(uuid.uuid4())
    holding.pull("d-req", tid, [9, 10], num_tokens=6)
    assert holding.p.wait_count("early_pulls", 1, timeout_s=10)
    holding.announce("p-req", tid, [3, 4], 6)
    names = list(holding.p_kv)
    holding.p.layer_saved(names[0])  # layer 0 on the wire, the rest still computing
    holding.d.close()  # D dies: its link closes, kvt aborts P's send
    holding.p.step_done()
    assert holding.p.wait_count("sends_failed", 1, timeout_s=10)
    _wait_released(holding, 1)
    assert holding.p.counters()["send_done_reports"] == 1
