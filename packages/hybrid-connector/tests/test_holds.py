"""The owner of P's blocks (``holds.py``): tables of its paths, each reference dropped exactly
once; its shell on a counting pool; the scheduler half using it; SEND_DONE on real sockets.

Without vLLM: a block pool that counts references like vLLM's (a block is free at ref_cnt 0
and must never go below), the scheduler half with fake requests, the SEND_DONE server and
client on real sockets, and the worker halves on real kvt: the worker offers an announced
request at the end of its step and gives it back by SEND_DONE (the one way back).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hybrid_connector import holds
from hybrid_connector import send_done as send_done_module
from hybrid_connector.common import Log
from hybrid_connector.config import HybridConfig
from hybrid_connector.holds import BlockHolds
from hybrid_connector.metadata import FinalPrefill, HybridConnectorMetadata
from hybrid_connector.protocol import SEND_DONE, SendDoneRequest
from hybrid_connector.scheduler_side import SchedulerSide
from hybrid_connector.send_done import SendDoneClient, SendDoneServer
from hypothesis import given, settings
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


# ------------------------------------------------------------------ the owner alone (pure)
def _refs(actions: list[holds.OwnerAction]) -> list[tuple[str, str]]:
    """(action, request) of the actions that touch the pool or the worker, in order."""
    names = {
        holds.Reference: "ref",
        holds.Unreference: "unref",
        holds.Offer: "offer",
        holds.Withdraw: "withdraw",
    }
    out = []
    for action in actions:
        name = names.get(type(action))
        if name is not None:
            out.append((name, getattr(action, "request_id", getattr(action, "transfer_id", ""))))
    return out


# Each path of a P request's blocks, as the events the owner sees (TP=2 where ranks matter),
# and the pool/worker actions in order. Every path ends with each reference dropped exactly once.
OWNER_PATHS = {
    "announced, finished, both ranks report": (
        ["announce", "finish", "done0", "done1", "drain"],
        [("ref", "r"), ("unref", "r")],
    ),
    "announced, a rank reports inside the step, the other after": (
        ["announce", "done1", "finish", "done0", "drain"],
        [("ref", "r"), ("unref", "r")],
    ),
    "announced, both ranks report inside the step: nothing referenced": (
        ["announce", "done0", "done1", "finish", "drain"],
        [],
    ),
    "announced, aborted after its step: held all the same": (
        ["announce", "abort", "done0", "done1", "drain"],
        [("ref", "r"), ("unref", "r")],
    ),
    "not announced, finished with KV: offered, held": (
        ["finish", "done0", "done1", "drain"],
        [("ref", "r"), ("offer", "r"), ("unref", "r")],
    ),
    "not announced, aborted: withdrawn, nothing held": (["abort", "drain"], [("withdraw", "t")]),
    "a rank reports twice: counted once": (
        ["finish", "done0", "done0", "drain", "done1", "drain"],
        [("ref", "r"), ("offer", "r"), ("unref", "r")],
    ),
    "a report after the blocks went back is ignored": (
        ["finish", "done0", "done1", "drain", "done0", "drain"],
        [("ref", "r"), ("offer", "r"), ("unref", "r")],
    ),
    "a stray report (never announced or held) is ignored, kept nowhere": (
        ["done0", "done1", "finish", "drain"],
        [("ref", "r"), ("offer", "r")],
    ),
    "shut down while held": (
        ["finish", "done0", "shutdown", "done1", "drain"],
        [("ref", "r"), ("offer", "r"), ("unref", "r")],
    ),
    "shut down while releasing": (
        ["finish", "done0", "done1", "shutdown", "drain"],
        [("ref", "r"), ("offer", "r"), ("unref", "r")],
    ),
    "shut down while announced: nothing referenced": (["announce", "shutdown", "finish"], []),
}

_EVENTS = {
    "announce": holds.Announce("r", "t"),
    "finish": holds.Finish("r", "t", [["b1", "b2"]], has_kv=True),
    "abort": holds.Finish("r", "t", [["b1", "b2"]], has_kv=False),
    "done0": holds.SendDone("r", 0),
    "done1": holds.SendDone("r", 1),
    "drain": holds.Drain(),
    "shutdown": holds.ShutDown(),
}


@pytest.mark.parametrize("name", list(OWNER_PATHS))
def test_owner_path(name: str) -> None:
    steps, expected = OWNER_PATHS[name]
    owner = holds.BlockOwner(tp_size=2)
    actions = [a for step in steps for a in owner.handle(_EVENTS[step])]
    assert _refs(actions) == expected
    # Exactly once: a reference taken is dropped once, by the path or by the final shut down.
    actions += owner.handle(holds.ShutDown())
    refs = [a.blocks for a in actions if isinstance(a, holds.Reference)]
    assert [a.blocks for a in actions if isinstance(a, holds.Unreference)] == refs
    assert len(refs) <= 1
    assert (len(owner), owner.held_blocks) == (0, 0)


def test_owner_answers_each_send_done() -> None:
    owner = holds.BlockOwner()
    assert holds.Acknowledge("r", held=False) in owner.handle(holds.SendDone("r", 0))
    owner.handle(holds.Finish("r", "t", [["b"]], has_kv=True))
    assert holds.Acknowledge("r", held=True) in owner.handle(holds.SendDone("r", 0))
    assert holds.Acknowledge("r", held=False) in owner.handle(holds.SendDone("r", 0))


def test_owner_logs_instead_of_logging() -> None:
    """The pure core says what to log; the shell writes it."""
    owner = holds.BlockOwner()
    owner.handle(holds.Announce("r", "t"))
    (line,) = [a for a in owner.handle(holds.Announce("r", "t")) if isinstance(a, Log)]
    assert line.level == logging.WARNING
    assert "request r" in line.text()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(sorted(_EVENTS)), max_size=12))
def test_owner_never_frees_twice_nor_leaks(steps: list[str]) -> None:
    """Any sequence of events for one request: each reference is dropped at most once, never
    before it was taken, and a final shut down leaves nothing referenced."""
    owner = holds.BlockOwner(tp_size=2)
    held = 0
    for step in [*steps, "shutdown"]:
        for action in owner.handle(_EVENTS[step]):
            if isinstance(action, holds.Reference):
                held += 1
                assert held == 1, "referenced twice"
            elif isinstance(action, holds.Unreference):
                held -= 1
                assert held == 0, "dropped a reference never taken"
    assert held == 0
    assert (len(owner), owner.held_blocks) == (0, 0)


# ------------------------------------------------------------------ BlockHolds on a pool
def _held_on(pool: FakePool, request_id: str, blocks: list[FakeBlock], tp_size: int = 1):
    """The shell holding ``blocks`` for a finished, not announced request (vLLM freed it)."""
    shell = BlockHolds(pool, tp_size)
    assert shell.finish(request_id, "t", [blocks], has_kv=True) == [holds.Offer(request_id, "t")]
    pool.free_blocks(blocks)  # vLLM frees the request (delay_free=False)
    return shell


def test_a_held_block_survives_vllms_free_until_send_done_and_a_drain() -> None:
    pool = FakePool(8)
    blocks = pool.allocate(3)
    shell = _held_on(pool, "r", blocks)
    assert not pool.free & {b.block_id for b in blocks}, "held blocks must not be reusable"
    assert shell.send_done("r", 0) is True
    assert not pool.free & {b.block_id for b in blocks}, "only the engine thread frees (drain)"
    assert shell.drain() == 3
    assert {b.block_id for b in blocks} <= pool.free
    assert shell.send_done("r", 0) is False, "a second report is ignored"
    assert shell.drain() == 0
    assert len(shell) == 0
    assert shell.held_blocks == 0
    assert shell.released == 1


def test_every_tp_rank_must_report_before_the_blocks_go_back() -> None:
    pool = FakePool(8)
    blocks = pool.allocate(2)
    shell = _held_on(pool, "r", blocks, tp_size=2)
    assert shell.send_done("r", 1) is True
    assert shell.send_done("r", 1) is False, "one rank counts once"
    assert shell.drain() == 0
    assert shell.send_done("r", 0) is True
    assert shell.drain() == 2
    assert all(b.ref_cnt == 0 for b in blocks)


def test_send_done_inside_the_step_means_nothing_is_referenced() -> None:
    """An announced request's send can end inside its step, before vLLM finishes it."""
    pool = FakePool(8)
    shell = BlockHolds(pool)
    blocks = pool.allocate(2)
    shell.announce("r", "t")
    assert shell.send_done("r", 0) is True
    assert shell.finish("r", "t", [blocks], has_kv=True) == []
    assert all(b.ref_cnt == 1 for b in blocks), "nothing touched: vLLM's free is the last"
    pool.free_blocks(blocks)
    assert {b.block_id for b in blocks} <= pool.free


def test_part_of_the_ranks_inside_the_step_the_rest_after() -> None:
    pool = FakePool(8)
    shell = BlockHolds(pool, tp_size=2)
    blocks = pool.allocate(1)
    shell.announce("r", "t")
    shell.send_done("r", 0)
    assert shell.finish("r", "t", [blocks], has_kv=True) == [], "the worker offered it already"
    pool.free_blocks(blocks)
    assert shell.send_done("r", 0) is False, "rank 0 already counted inside the step"
    assert shell.send_done("r", 1) is True
    assert shell.drain() == 1
    assert blocks[0].ref_cnt == 0


def test_null_blocks_and_several_groups() -> None:
    pool = FakePool(8)
    shell = BlockHolds(pool)
    state, attention = pool.allocate(1), pool.allocate(2)
    null = pool.blocks[0]
    shell.finish("r", "t", [[null, null, *state], attention], has_kv=True)
    assert shell.held_blocks == 3
    assert null.ref_cnt == 0
    shell.send_done("r", 0)
    assert shell.drain() == 3


def test_release_all_at_shutdown_frees_once() -> None:
    pool = FakePool(8)
    a, b = pool.allocate(2), pool.allocate(1)
    shell = _held_on(pool, "a", a)
    shell.finish("b", "tb", [b], has_kv=True)
    pool.free_blocks(b)
    assert shell.release_all() == 3
    assert all(x.ref_cnt == 0 for x in a + b)
    assert shell.send_done("a", 0) is False
    assert shell.drain() == 0
    assert shell.release_all() == 0


def test_reports_for_requests_never_held_are_kept_nowhere() -> None:
    """A stray peer's SEND_DONEs cannot grow memory: they are answered and forgotten."""
    shell = BlockHolds(FakePool(2))
    for i in range(10_000):
        assert shell.send_done(f"stray-{i}", 0) is False
    assert len(shell._owner._records) == 0


def test_reports_from_many_threads_free_every_block_exactly_once() -> None:
    pool = FakePool(400)
    shell = BlockHolds(pool, tp_size=2)
    requests = {f"r{i}": pool.allocate(3) for i in range(100)}
    with ThreadPoolExecutor(4) as executor:
        futures = []
        for request_id, blocks in requests.items():
            # Ranks report from other threads, some inside the step (before the finish).
            shell.announce(request_id, "t")
            futures.append(executor.submit(shell.send_done, request_id, 0))
            shell.finish(request_id, "t", [blocks], has_kv=True)
            pool.free_blocks(blocks)
            futures.append(executor.submit(shell.send_done, request_id, 1))
            shell.drain()
        for future in futures:
            assert future.result() is True
    shell.drain()
    assert len(shell) == 0
    assert shell.held_blocks == 0
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
    side.send_done_address = "127.0.0.1:9999"
    return side, manager, side.holds


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
    assert spec.transfer_id == "t-p-1"
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


def test_request_that_keeps_decoding_is_held_too_and_offered_next_step() -> None:
    """One way back for every P request: not announced (it keeps decoding), it is held by the
    owner all the same, offered in the next step's metadata, and given back by SEND_DONE."""
    pool = FakePool(16)
    side, manager, holds = _scheduler(pool)
    request = _p_request("p-1", 6, max_tokens=16)
    meta = _run_to_finish(side, manager, request, "FINISHED_LENGTH_CAPPED")
    assert meta.final_prefills == []
    blocks = manager.owned["p-1"]
    delay, params = side.request_finished(request, ([b.block_id for b in blocks],))
    assert delay is False
    assert params is not None
    pool.free_blocks(blocks)
    (offer,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).to_offer
    assert (offer.request_id, offer.transfer_id) == ("p-1", "t-p-1")
    assert holds.held_blocks == 2
    holds.send_done("p-1", 0)
    side.get_num_new_matched_tokens(_p_request("p-2", 4), 0)
    assert all(b.ref_cnt == 0 for b in blocks)


def test_request_aborted_before_its_prompt_completed_withdraws_its_offer() -> None:
    pool = FakePool(16)
    side, manager, holds = _scheduler(pool)
    request = _p_request("p-1", 6, max_tokens=16)
    _run_to_finish(side, manager, request, "FINISHED_ABORTED")
    blocks = manager.owned["p-1"]
    assert side.request_finished(request, ([b.block_id for b in blocks],)) == (False, None)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert (meta.to_offer, meta.cancel_offer) == ([], ["t-p-1"])
    assert holds.held_blocks == 0, "vLLM frees them itself"


def test_the_connectors_marks_stay_out_of_vllms_dict() -> None:
    """P without a transfer id from the proxy: one is made up, announced and returned, and
    neither it nor any other mark is written into the request's kv_transfer_params."""
    pool = FakePool(16)
    side, manager, _ = _scheduler(pool)
    request = _p_request("p-1", 6)
    request.kv_transfer_params = {"do_remote_decode": True}
    (spec,) = _run_to_finish(side, manager, request, "FINISHED_LENGTH_CAPPED").final_prefills
    _, params = side.request_finished(request, ([b.block_id for b in manager.owned["p-1"]],))
    assert params is not None
    assert params["transfer_id"] == spec.transfer_id != ""
    assert request.kv_transfer_params == {"do_remote_decode": True}


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
    blocks = pool.allocate(2)
    shell = _held_on(pool, "r", blocks)
    server = SendDoneServer(shell, host="127.0.0.1", advertise_host=None)
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
    assert shell.drain() == 2


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
    """P and D workers on real kvt, P's scheduler half represented by its owner of P's blocks
    (``BlockHolds`` on a counting pool) behind its SEND_DONE server."""

    def __init__(self, lease_s: float = 5.0) -> None:
        self.pool = FakePool(64)
        self.holds = BlockHolds(self.pool)
        super().__init__(lease_s=lease_s, owner=self.holds)

    def announce(self, request_id: str, tid: str, src: list[int], num_tokens: int) -> None:
        """P's scheduler: this step completes the prompt (and finishes the request, whose
        blocks the owner then holds while vLLM forgets it)."""
        self.held = self.pool.allocate(len(src))
        self.holds.announce(request_id, tid)
        spec = FinalPrefill(request_id, tid, [src], num_tokens)
        self.p.handle_metadata(
            HybridConnectorMetadata(
                final_prefills=[spec], scheduler_address=self.scheduler.server.address
            )
        )
        assert self.holds.finish(request_id, tid, [self.held], has_kv=True) == []
        self.pool.free_blocks(self.held)  # vLLM forgot the request

    def released(self) -> bool:
        self.holds.drain()
        return all(b.ref_cnt == 0 for b in self.held)


@pytest.fixture
def holding(no_thread_leak: None) -> Iterator[HoldingPair]:
    pair = HoldingPair()
    yield pair
    pair.close()


def _wait_released(pair: HoldingPair, reports: int) -> None:
    """The scheduler half answered ``reports`` SEND_DONEs; its next hook frees the blocks, once
    (the counting pool refuses a second free)."""
    assert pair.p.wait_count("send_done_delivered", reports, timeout_s=10)
    assert pair.released()
    assert pair.holds.released == reports


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
    assert _wait(holding.d) == ({"d-req"}, set())
    for got, want in zip(
        _layer_blocks(holding.d_kv, dst), _layer_blocks(holding.p_kv, src), strict=True
    ):
        assert torch.equal(got, want)
    _wait_released(holding, 1)


def test_rapid_send_of_a_held_request_sends_done_after_the_step(holding: HoldingPair) -> None:
    tid = str(uuid.uuid4())
    holding.pull("d-req", tid, [9, 10], num_tokens=6)
    assert _wait(holding.d, timeout=0.3) == (set(), set())
    holding.announce("p-req", tid, [3, 4], 6)
    holding.p.step_done()
    assert _wait(holding.d) == ({"d-req"}, set())
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
