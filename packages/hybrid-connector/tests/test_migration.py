"""Live migration, the connector's half, without vLLM: D1's scheduler half stops a running
request at the next step, holds its blocks under the migration id and answers with its tokens;
D2 pulls all but the last of them; every other end refuses; the RPC path on real sockets."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hybrid_connector.config import HybridConfig
from hybrid_connector.contract import PullParams, decode_params, encode_params
from hybrid_connector.control import migrate_out, precopy
from hybrid_connector.layout import KvGroup
from hybrid_connector.metadata import OfferSpec
from hybrid_connector.migration import (
    MIGRATE_OUT,
    MIGRATION_ID_PREFIX,
    PRECOPY,
    MigrateOutForwarder,
    MigrateOutRequest,
    MigrateOutResponse,
    PrecopyRequest,
    PrecopyResponse,
)
from hybrid_connector.scheduler_side import SchedulerSide
from hybrid_connector.send_done import SendDoneServer
from simple_rpc import LoopThread, Server

BLOCK = 32
D1 = "127.0.0.1:8201"
PROMPT = 70  # three blocks, the last one partial


class Pool:
    """vLLM's block pool as the owner uses it: references counted per block id."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()

    def touch(self, blocks: Any) -> None:
        self.refs.update(b.block_id for b in blocks)

    def free_blocks(self, blocks: Any) -> None:
        self.refs.subtract(b.block_id for b in blocks)


class Manager:
    def __init__(self) -> None:
        self.block_pool = Pool()
        self.block_ids: dict[str, list[int]] = {}

    def get_blocks(self, request_id: str) -> Any:
        return SimpleNamespace(blocks=([_block(i) for i in self.block_ids[request_id]],))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (self.block_ids[request_id],)


def _block(block_id: int, *, cached: bool = False) -> Any:
    return SimpleNamespace(block_id=block_id, block_hash="h" if cached else None, is_null=False)


class FakeRequest:
    """The fields of vLLM's Request the scheduler half reads (and the one it lowers)."""

    def __init__(self, request_id: str, params: dict[str, Any], prompt: int, max_tokens: int):
        self.request_id = request_id
        self.kv_transfer_params = params
        self.prompt_token_ids = list(range(100, 100 + prompt))
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = 0
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.status = SimpleNamespace(name="WAITING")

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def step(self, token: int) -> None:
        """One decode step as vLLM runs it: the last token's KV, one new token, check_stop."""
        self.num_computed_tokens = self.num_prompt_tokens + len(self.output_token_ids)
        self.output_token_ids.append(token)
        if len(self.output_token_ids) >= self.max_tokens:
            self.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")


def _side() -> tuple[SchedulerSide, Manager]:
    side = SchedulerSide(
        HybridConfig(rpc_port=8201), is_producer=True, is_consumer=True, block_size=BLOCK
    )
    manager = Manager()
    side.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
    return side, manager


def _step_meta(side: SchedulerSide) -> Any:
    return side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))  # type: ignore[arg-type]


def _pulled_in(side: SchedulerSide, manager: Manager, request: FakeRequest, blocks: list[int]):
    """D1's request as vLLM admits it: the pull of P's KV planned, done, running."""
    count, is_async = side.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
    assert is_async
    assert count is not None
    assert count > 0
    manager.block_ids[request.request_id] = blocks
    side.update_state_after_alloc(
        request,  # type: ignore[arg-type]
        SimpleNamespace(blocks=([_block(b) for b in blocks],)),  # type: ignore[arg-type]
        count,
    )
    _step_meta(side)
    side.update_connector_output(
        SimpleNamespace(finished_recving={request.request_id}, failed_recving=set())  # type: ignore[arg-type]
    )
    request.num_computed_tokens = request.num_prompt_tokens - 1
    request.status = SimpleNamespace(name="RUNNING")


def _d1_request(max_tokens: int = 64) -> FakeRequest:
    params = encode_params(PullParams(transfer_id="X", remote_rpc_address="127.0.0.1:8200"))
    return FakeRequest("d1-req", params, PROMPT, max_tokens)


def _ask(side: SchedulerSide, transfer_id: str = "X", migration_id: str = "M") -> list[Any]:
    answers: list[MigrateOutResponse] = []
    side.migrations.request(MigrateOutRequest(transfer_id, migration_id), answers.append)
    return answers


def test_a_running_request_stops_after_the_next_token_with_its_kv_held() -> None:
    side, manager = _side()
    request = _d1_request()
    _pulled_in(side, manager, request, [11, 12, 13])
    for token in (5, 6, 7):
        request.step(token)
    answers = _ask(side)
    assert answers == [], "decided on the engine-core thread, at the next step"
    _step_meta(side)
    assert request.max_tokens == 4, "one more token: vLLM stops it after this step"
    request.step(8)
    assert request.status.name == "FINISHED_LENGTH_CAPPED"
    manager.block_ids["d1-req"] = [11, 12, 13, 14]
    delay, params = side.request_finished(request, ([11, 12, 13, 14],))  # type: ignore[arg-type]
    assert delay is False, "the owner holds the blocks; vLLM forgets the request"
    assert manager.block_pool.refs == Counter({11: 1, 12: 1, 13: 1, 14: 1})
    pull = decode_params(params)
    assert isinstance(pull, PullParams)
    assert (pull.transfer_id, pull.remote_rpc_address) == ("M", "127.0.0.1:8201")
    [answer] = answers
    assert answer.stopped, answer.reason
    assert answer.migration_id == "M"
    assert answer.prompt_token_ids == request.prompt_token_ids
    assert answer.output_token_ids == [5, 6, 7, 8]
    assert answer.num_tokens == PROMPT + 3, "KV of all but the last output token"
    meta = _step_meta(side)
    assert meta.to_offer == [OfferSpec("d1-req", "M", [[11, 12, 13, 14]], PROMPT + 3)]
    # The worker's SEND_DONE after D2's pull gives the blocks back at the next hook.
    assert side.send_done("d1-req", 0, "sent")
    _step_meta(side)
    assert +manager.block_pool.refs == Counter()
    assert len(side.migrations) == 0, "nothing tracked once the request ended"


def test_a_request_ended_before_it_was_admitted_is_never_tracked() -> None:
    side, _ = _side()
    request = _d1_request()
    request.status = SimpleNamespace(name="FINISHED_ABORTED")
    side.request_finished(request, ([],))  # type: ignore[arg-type]
    assert len(side.migrations) == 0
    [answer] = _ask(side)
    assert not answer.stopped


MIGRATED = f"{MIGRATION_ID_PREFIX}M"


def test_d2_pulls_all_but_the_token_d1_never_computed() -> None:
    side, _ = _side()
    length = PROMPT + 4  # prompt + D1's four tokens
    params = encode_params(
        PullParams(transfer_id=MIGRATED, remote_rpc_address=D1, remote_num_tokens=length - 1)
    )
    request = FakeRequest("d2-req", params, length, 60)
    count, is_async = side.get_num_new_matched_tokens(request, 32)  # type: ignore[arg-type]
    assert (count, is_async) == (length - 1 - 32, True)
    blocks = [_block(1, cached=True), _block(2), _block(3)]
    side.update_state_after_alloc(request, SimpleNamespace(blocks=(blocks,)), count)  # type: ignore[arg-type]
    [recv] = _step_meta(side).to_recv
    assert (recv.transfer_id, recv.remote_rpc_address) == (MIGRATED, D1)
    assert recv.num_tokens == length - 1
    assert recv.block_ids == [[2, 3]]
    assert recv.first_block == [1]


def test_a_pd_pull_takes_the_whole_prompt_whatever_p_counted() -> None:
    """A P's count may lag its prompt (a prefix hit there): only a migration's pull stops at it."""
    side, _ = _side()
    lagging = encode_params(
        PullParams(transfer_id="Y", remote_rpc_address=D1, remote_num_tokens=PROMPT - 1)
    )
    assert side.get_num_new_matched_tokens(  # type: ignore[arg-type]
        FakeRequest("d-lag", lagging, PROMPT, 8), 0
    ) == (PROMPT, True)
    params = encode_params(
        PullParams(transfer_id="X", remote_rpc_address=D1, remote_num_tokens=PROMPT)
    )
    request = FakeRequest("d-req", params, PROMPT, 8)
    assert side.get_num_new_matched_tokens(request, 0) == (PROMPT, True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("unknown", "no running request"),
        ("twice", "under way"),
        ("empty id", "empty or in use"),
        ("waiting", "request is WAITING"),
        ("eos", "finished (FINISHED_STOPPED)"),
        ("own max_tokens", "finished (FINISHED_LENGTH_CAPPED)"),
        ("aborted", "finished (FINISHED_ABORTED)"),
        ("shut down", "shutting down"),
    ],
)
def test_every_other_end_refuses_and_holds_nothing(case: str, reason: str) -> None:
    side, manager = _side()
    request = _d1_request(max_tokens=3)
    _pulled_in(side, manager, request, [11, 12, 13])
    request.step(5)
    if case == "own max_tokens":
        request.step(6)  # the next token is its last anyway (max_tokens=3)
    if case == "waiting":
        request.status = SimpleNamespace(name="WAITING")
    answers = _ask(side, "Y" if case == "unknown" else "X", "" if case == "empty id" else "M")
    if case == "twice":
        answers = _ask(side)
    if case == "shut down":
        side.release_holds()
    _step_meta(side)
    if case == "eos":
        request.output_token_ids.append(2)
        request.status = SimpleNamespace(name="FINISHED_STOPPED")
    elif case == "own max_tokens":
        assert request.max_tokens == 3
        request.step(7)  # its own end, which the migration must not take for a stop
    elif case == "aborted":
        request.status = SimpleNamespace(name="FINISHED_ABORTED")
    if case in ("eos", "own max_tokens", "aborted"):
        delay, params = side.request_finished(request, ([11, 12, 13],))  # type: ignore[arg-type]
        assert (delay, params) == (False, None)
    [answer] = answers
    assert not answer.stopped
    assert reason in answer.reason
    assert _step_meta(side).to_offer == []
    assert +manager.block_pool.refs == Counter()
    if case in ("eos", "own max_tokens", "aborted", "shut down"):
        assert len(side.migrations) == 0


def test_a_request_stopped_for_nobody_is_answered_once_at_its_end() -> None:
    """The asker's request arrives after the request finished by itself: refused, once."""
    side, manager = _side()
    request = _d1_request(max_tokens=2)
    _pulled_in(side, manager, request, [11, 12, 13])
    request.step(5)
    request.step(6)
    side.request_finished(request, ([11, 12, 13],))  # type: ignore[arg-type]
    [answer] = _ask(side)
    assert "no running request" in answer.reason


# ------------------------------------------------------------------ the RPC path
@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, leaked


def test_the_proxy_reaches_the_scheduler_half_through_the_worker(no_thread_leak: None) -> None:
    """proxy -> worker's transfer_kv server -> scheduler half's SEND_DONE server -> the engine
    core's next step: the answer comes back the same way."""
    side, manager = _side()
    request = _d1_request()
    _pulled_in(side, manager, request, [11, 12, 13])
    request.step(5)
    asked = threading.Event()
    real_request = side.migrations.request

    def request_and_tell(*args: Any) -> None:
        real_request(*args)
        asked.set()

    side.migrations.request = request_and_tell  # type: ignore[method-assign]
    scheduler = SendDoneServer(
        side, host="127.0.0.1", advertise_host=None, migrations=side.migrations
    )
    worker_loop = LoopThread(name="test-worker")
    proxy_loop = LoopThread(name="test-proxy")
    forwarder = MigrateOutForwarder(lambda: scheduler.address)
    server = Server(name="test-worker-rpc")
    forwarder.register(server)
    try:
        address = worker_loop.run(server.start("127.0.0.1", 0), timeout=10)
        answer = proxy_loop.submit(migrate_out(address, "X", "M", reason="test"))
        assert asked.wait(10), "the call reached the scheduler half"
        _step_meta(side)  # the engine core steps: the request is told to stop
        request.step(6)
        side.request_finished(request, ([11, 12, 13],))  # type: ignore[arg-type]
        reply = answer.result(timeout=10)
        assert reply.stopped
        assert reply.output_token_ids == [5, 6]
        unknown = proxy_loop.run(migrate_out(address, "nobody", "M2"), timeout=10)
        assert not unknown.stopped
        assert "no running request" in unknown.reason
    finally:
        worker_loop.run(server.close(), timeout=10)
        worker_loop.run(forwarder.close(), timeout=10)
        worker_loop.close()
        proxy_loop.close()
        scheduler.close()
        side.release_holds()


def test_a_worker_without_its_scheduler_refuses(no_thread_leak: None) -> None:
    loop = LoopThread(name="test-worker")
    forwarder = MigrateOutForwarder(lambda: "")
    server = Server(name="test-worker-rpc")
    forwarder.register(server)
    try:
        address = loop.run(server.start("127.0.0.1", 0), timeout=10)
        reply = loop.run(migrate_out(address, "X", "M"), timeout=10)
        assert not reply.stopped
        assert "scheduler" in reply.reason
    finally:
        loop.run(server.close(), timeout=10)
        loop.run(forwarder.close(), timeout=10)
        loop.close()


def test_migrate_out_has_its_own_heads() -> None:
    assert (MIGRATE_OUT.request_head, MIGRATE_OUT.response_head) == (0x48430003, 0x48438003)
    assert (PRECOPY.request_head, PRECOPY.response_head) == (0x48430004, 0x48438004)


# ------------------------------------------------------------------ pre-copy
PRE = f"{MIGRATION_ID_PREFIX}pre-C"


def _ask_precopy(side: SchedulerSide, transfer_id: str = "X", precopy_id: str = PRE) -> list[Any]:
    answers: list[PrecopyResponse] = []
    side.migrations.request_precopy(PrecopyRequest(transfer_id, precopy_id), answers.append)
    return answers


def test_precopy_offers_the_full_blocks_and_the_request_decodes_on() -> None:
    side, manager = _side()
    request = _d1_request()
    _pulled_in(side, manager, request, [11, 12, 13])
    for token in range(30):  # 100 tokens: three full blocks, the last one computed
        request.step(token)
    manager.block_ids["d1-req"] = [11, 12, 13, 14]
    answers = _ask_precopy(side)
    assert answers == [], "decided on the engine-core thread, at the next step"
    meta = _step_meta(side)
    [answer] = answers
    assert answer.offered, answer.reason
    assert request.num_computed_tokens == 99
    # Blocks below the last computed token's (block 3 holds token 98, maybe still in flight).
    assert len(answer.token_ids) == 3 * BLOCK
    every = [*request.prompt_token_ids, *request.output_token_ids]
    assert answer.token_ids == every[:96]
    assert answer.next_token_ids == [every[96]], "the warm-up's prompt ends with it"
    assert (answer.precopy_id, answer.remote_rpc_address) == (PRE, "127.0.0.1:8201")
    assert meta.to_offer == [OfferSpec(PRE, PRE, [[11, 12, 13]], 96)]
    assert manager.block_pool.refs == Counter({11: 1, 12: 1, 13: 1})
    assert request.max_tokens == 64, "the request runs on untouched"
    # The request decodes on and finishes by itself; the pre-copy hold is its own.
    for token in range(30, 64 - 30):
        request.step(token)
    side.request_finished(request, ([11, 12, 13, 14],))  # type: ignore[arg-type]
    assert manager.block_pool.refs == Counter({11: 1, 12: 1, 13: 1})
    assert side.send_done(PRE, 0, "sent")
    assert not side.send_done(PRE, 0, "released"), "given back once"
    _step_meta(side)
    assert +manager.block_pool.refs == Counter()
    assert len(side.migrations) == 0


def test_precopy_then_stop_holds_both_and_gives_each_back_once() -> None:
    side, manager = _side()
    request = _d1_request()
    _pulled_in(side, manager, request, [11, 12, 13])
    for token in range(30):
        request.step(token)
    manager.block_ids["d1-req"] = [11, 12, 13, 14]
    offered = _ask_precopy(side)
    answers = _ask_precopy(side)  # a second one while the first waits: refused
    assert "under way" in answers[0].reason
    _step_meta(side)
    stop = _ask(side, "X", "M")
    _step_meta(side)
    request.step(99)
    side.request_finished(request, ([11, 12, 13, 14],))  # type: ignore[arg-type]
    assert offered[0].offered
    assert stop[0].stopped
    assert manager.block_pool.refs == Counter({11: 2, 12: 2, 13: 2, 14: 1})
    assert side.send_done("d1-req", 0, "sent")
    assert side.send_done(PRE, 0, "released")
    _step_meta(side)
    assert +manager.block_pool.refs == Counter()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("unknown", "no running request"),
        ("not a migration id", "must start with"),
        ("no full block", "no full block"),
        ("preempted", "request is PREEMPTED"),
        ("finished", "finished (FINISHED_STOPPED)"),
        ("shut down", "shutting down"),
    ],
)
def test_precopy_refusals_hold_nothing(case: str, reason: str) -> None:
    side, manager = _side()
    request = _d1_request()
    _pulled_in(side, manager, request, [11, 12, 13])
    if case != "no full block":  # 69 computed: two full blocks
        for token in range(5):
            request.step(token)
    answers = _ask_precopy(
        side,
        "Y" if case == "unknown" else "X",
        "C" if case == "not a migration id" else PRE,
    )
    if case == "preempted":
        request.status = SimpleNamespace(name="PREEMPTED")
    if case == "finished":
        request.status = SimpleNamespace(name="FINISHED_STOPPED")
        side.request_finished(request, ([11, 12, 13],))  # type: ignore[arg-type]
    if case == "shut down":
        side.release_holds()
    if case == "no full block":
        request.num_computed_tokens = BLOCK  # block 0 holds the last computed token
    meta = _step_meta(side)
    [answer] = answers
    assert not answer.offered
    assert reason in answer.reason
    assert meta.to_offer == []
    assert +manager.block_pool.refs == Counter()


@pytest.mark.parametrize(
    ("groups", "reason"),
    [
        ([KvGroup("attention", (), BLOCK), KvGroup("state", (), BLOCK)], "state KV-cache"),
        ([KvGroup("sliding_window", (), BLOCK)], "sliding_window KV-cache"),
        ([KvGroup("attention", (), BLOCK), KvGroup("mla", (), 64)], "different block sizes"),
    ],
)
def test_a_model_whose_full_blocks_change_refuses_precopy(groups: list, reason: str) -> None:
    side = SchedulerSide(
        HybridConfig(rpc_port=8201),
        is_producer=True,
        is_consumer=True,
        block_size=BLOCK,
        groups=groups,
    )
    side.migrations.track("X", _d1_request())  # type: ignore[arg-type]
    [answer] = _ask_precopy(side)
    assert not answer.offered
    assert reason in answer.reason


def test_an_instance_without_prefix_caching_refuses_precopy() -> None:
    """The pre-copied blocks would have no cache to land in on the new D."""
    side = SchedulerSide(
        HybridConfig(rpc_port=8201),
        is_producer=True,
        is_consumer=True,
        block_size=BLOCK,
        prefix_caching=False,
    )
    side.migrations.track("X", _d1_request())  # type: ignore[arg-type]
    [answer] = _ask_precopy(side)
    assert not answer.offered
    assert "prefix caching is off" in answer.reason


def test_precopy_reaches_the_scheduler_half_through_the_worker(no_thread_leak: None) -> None:
    side, manager = _side()
    request = _d1_request()
    _pulled_in(side, manager, request, [11, 12, 13])
    for token in range(10):
        request.step(token)
    asked = threading.Event()
    real_request = side.migrations.request_precopy

    def request_and_tell(*args: Any) -> None:
        real_request(*args)
        asked.set()

    side.migrations.request_precopy = request_and_tell  # type: ignore[method-assign]
    scheduler = SendDoneServer(
        side, host="127.0.0.1", advertise_host=None, migrations=side.migrations
    )
    worker_loop = LoopThread(name="test-worker")
    proxy_loop = LoopThread(name="test-proxy")
    forwarder = MigrateOutForwarder(lambda: scheduler.address)
    server = Server(name="test-worker-rpc")
    forwarder.register(server)
    try:
        address = worker_loop.run(server.start("127.0.0.1", 0), timeout=10)
        answer = proxy_loop.submit(precopy(address, "X", PRE, reason="test"))
        assert asked.wait(10), "the call reached the scheduler half"
        _step_meta(side)
        reply = answer.result(timeout=10)
        assert reply.offered, reply.reason
        assert len(reply.token_ids) == 2 * BLOCK
        assert side.send_done(PRE, 0, "released")
    finally:
        worker_loop.run(server.close(), timeout=10)
        worker_loop.run(forwarder.close(), timeout=10)
        worker_loop.close()
        proxy_loop.close()
        scheduler.close()
        side.release_holds()
    assert +manager.block_pool.refs == Counter()
