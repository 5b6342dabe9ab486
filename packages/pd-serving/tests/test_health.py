"""The circuit breaker (pure, fake clock) and the active health checker (against small fakes)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_serving.health import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    FailureKind,
    HealthCheckConfig,
    HealthChecker,
    InstanceLoad,
    failure_kind,
    parse_load,
)
from pd_serving.routing import Backend, Router, RoutingPolicy

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def _states(transitions) -> list[tuple[BreakerState, BreakerState]]:
    return [(t.old, t.new) for t in transitions]


# -- the breaker's every transition ------------------------------------------------------------
def test_closed_opens_after_n_consecutive_failures_only() -> None:
    b = CircuitBreaker(BreakerConfig(failures=3, cooldown_s=10))
    assert b.on_failure(0, "x", FailureKind.REFUSED) == []
    assert b.on_failure(1, "x", FailureKind.REFUSED) == []
    assert b.on_success(2) == []  # a success in between restarts the count
    assert b.consecutive_failures == 0
    assert b.on_failure(3, "x") == []
    assert b.on_failure(4, "x") == []
    assert _states(b.on_failure(5, "boom", FailureKind.REFUSED)) == [(CLOSED, OPEN)]
    assert b.state is OPEN
    assert b.last_error == "boom"
    assert b.condition == "dead"


def test_open_refuses_until_the_cooldown_then_lets_exactly_one_probe() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=10))
    b.on_failure(100, "x")
    assert not b.available(105)
    assert b.acquire(105) == (False, [])
    # Outcomes of requests in flight when it opened change nothing while it is open.
    assert b.on_success(106) == []
    assert b.on_failure(107, "late") == []
    assert b.state is OPEN
    assert b.available(110)
    allowed, transitions = b.acquire(110)
    assert allowed
    assert _states(transitions) == [(OPEN, HALF)]
    assert not b.available(111)
    assert b.acquire(111) == (False, [])  # the probe is out: nobody else
    assert b.acquire(115) == (False, [])


def test_half_open_closes_on_the_probes_success() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=10))
    b.on_failure(0, "x")
    assert b.acquire(10)[0]
    assert _states(b.on_success(11)) == [(HALF, CLOSED)]
    assert b.acquire(12) == (True, [])
    assert b.acquire(12) == (True, [])
    assert b.condition == "ok"


def test_half_open_opens_again_on_the_probes_failure_with_a_new_cooldown() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=10))
    b.on_failure(0, "x")
    assert b.acquire(10)[0]
    assert _states(b.on_failure(12, "still down", FailureKind.TIMEOUT)) == [(HALF, OPEN)]
    assert b.condition == "slow"
    assert not b.available(21)  # the cool-down counts from the failed probe
    allowed, transitions = b.acquire(22)
    assert allowed
    assert _states(transitions) == [(OPEN, HALF)]


def test_a_health_probe_after_the_cooldown_decides_without_a_request() -> None:
    # An instance restarted while no request tried it: the next health check closes it.
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=10))
    b.on_failure(0, "x")
    assert _states(b.on_success(10)) == [(OPEN, HALF), (HALF, CLOSED)]
    b.on_failure(20, "y")
    assert _states(b.on_failure(30, "z")) == [(OPEN, HALF), (HALF, OPEN)]


def test_a_probe_that_never_reports_is_given_up_after_another_cooldown() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=10))
    b.on_failure(0, "x")
    assert b.acquire(10)[0]
    assert not b.available(19)
    assert b.available(20)
    assert b.acquire(20) == (True, [])
    assert b.state is HALF


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError):
        BreakerConfig(failures=0)
    with pytest.raises(ValueError):
        BreakerConfig(cooldown_s=-1)
    with pytest.raises(ValueError):
        HealthCheckConfig(interval_s=0)


class _Model:
    """The diagram, written out independently: what the breaker must do."""

    def __init__(self, n: int, cooldown: float) -> None:
        self.n, self.cooldown = n, cooldown
        self.state, self.failures, self.opened, self.probe = CLOSED, 0, 0.0, None

    def advance(self, now: float) -> None:
        if self.state is OPEN and now >= self.opened + self.cooldown:
            self.state, self.probe = HALF, None
        if self.state is HALF and self.probe is not None and now >= self.probe + self.cooldown:
            self.probe = None

    def acquire(self, now: float) -> bool:
        self.advance(now)
        if self.state is CLOSED:
            return True
        if self.state is HALF and self.probe is None:
            self.probe = now
            return True
        return False

    def success(self, now: float) -> None:
        self.advance(now)
        if self.state is not OPEN:
            self.state, self.failures = CLOSED, 0

    def failure(self, now: float) -> None:
        self.advance(now)
        if self.state is CLOSED:
            self.failures += 1
            if self.failures >= self.n:
                self.state, self.opened = OPEN, now
        elif self.state is HALF:
            self.state, self.opened = OPEN, now


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 4),
    cooldown=st.sampled_from([0.0, 1.0, 5.0]),
    events=st.lists(
        st.tuples(st.sampled_from(["acquire", "success", "failure"]), st.floats(0, 3)),
        max_size=60,
    ),
)
def test_any_sequence_of_events_follows_the_diagram(n, cooldown, events) -> None:
    breaker, model = (
        CircuitBreaker(BreakerConfig(failures=n, cooldown_s=cooldown)),
        _Model(n, cooldown),
    )
    now = 0.0
    for event, dt in events:
        now += dt
        before = breaker.state
        if event == "acquire":
            allowed, transitions = breaker.acquire(now)
            assert allowed == model.acquire(now)
        elif event == "success":
            transitions = breaker.on_success(now)
            model.success(now)
        else:
            transitions = breaker.on_failure(now, "x")
            model.failure(now)
        assert breaker.state is model.state
        # The transitions returned chain from the old state to the new one, each on the diagram.
        chain = [before] + [t.new for t in transitions]
        assert [t.old for t in transitions] == chain[:-1]
        assert chain[-1] is breaker.state
        for t in transitions:
            assert (t.old, t.new) in {(CLOSED, OPEN), (OPEN, HALF), (HALF, CLOSED), (HALF, OPEN)}
        assert breaker.available(now) == (
            model.state is CLOSED
            or (model.state is OPEN and now >= model.opened + cooldown)
            or (model.state is HALF and (model.probe is None or now >= model.probe + cooldown))
        )


# -- load from /metrics ------------------------------------------------------------------------
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 7.0
"""


def test_parse_load_reads_vllms_gauges() -> None:
    assert parse_load(VLLM_METRICS) == InstanceLoad(waiting=2, running=3, kv_usage=0.25)
    assert parse_load("") == InstanceLoad()
    with pytest.raises(ValueError):
        parse_load("vllm:num_requests_running{engine=0 3\n")


def test_failure_kinds() -> None:
    assert failure_kind(TimeoutError()) is FailureKind.TIMEOUT
    assert failure_kind(ConnectionRefusedError()) is FailureKind.REFUSED
    assert failure_kind(aiohttp.ServerDisconnectedError()) is FailureKind.BROKEN
    assert failure_kind(ValueError()) is FailureKind.ERROR


# -- the active checker against fakes ----------------------------------------------------------
class FakeInstance:
    """/health and /metrics of a vLLM server; ``hang`` makes /health never answer."""

    def __init__(self, metrics: str = VLLM_METRICS) -> None:
        self.metrics = metrics
        self.health_status = 200
        self.hang = False
        self.released = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def close(self) -> None:
        self.released.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        if self.hang:
            await self.released.wait()
        return web.Response(status=self.health_status)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.metrics)


def _refused_url() -> str:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_checker_tells_ok_slow_and_dead_apart_and_feeds_load(session) -> None:
    ok, slow = FakeInstance(), FakeInstance()
    slow.hang = True
    await ok.start()
    await slow.start()
    try:
        backends = [Backend(ok.url, name="ok"), Backend(slow.url, name="slow")]
        dead = Backend(_refused_url(), name="dead")
        router = Router([dead], backends, RoutingPolicy(breaker_failures=2))
        checker = HealthChecker(router, session, HealthCheckConfig(interval_s=60, timeout_s=0.2))
        await checker.check_all()
        assert backends[0].load == InstanceLoad(waiting=2, running=3, kv_usage=0.25)
        assert router.describe(backends[0])["condition"] == "ok"
        assert router.describe(backends[1])["last_error_kind"] == "timeout"
        assert router.describe(backends[1])["condition"] == "slow"
        assert router.describe(dead)["last_error_kind"] == "refused"
        assert router.describe(dead)["condition"] == "dead"
        assert router.breaker_state(dead) is CLOSED  # one failure of two
        await checker.check_all()
        assert router.breaker_state(dead) is OPEN
        assert router.breaker_state(backends[1]) is OPEN
        assert router.breaker_state(backends[0]) is CLOSED
        assert router.pick_decode(_key()) is backends[0]
        assert router.pick_prefill(_key()) is None
    finally:
        await ok.close()
        await slow.close()


async def test_checker_counts_5xx_and_keeps_old_load_on_bad_metrics(session) -> None:
    inst = FakeInstance(metrics="not { prometheus")
    await inst.start()
    try:
        backend = Backend(inst.url)
        backend.load = InstanceLoad(waiting=1)
        router = Router([], [backend], RoutingPolicy(breaker_failures=1))
        checker = HealthChecker(router, session, HealthCheckConfig(timeout_s=2))
        await checker.check_all()
        assert backend.load == InstanceLoad(waiting=1)  # healthy, figures kept
        assert router.breaker_state(backend) is CLOSED
        inst.health_status = 404  # a live server without /health: alive
        await checker.check_all()
        assert router.breaker_state(backend) is CLOSED
        inst.health_status = 503  # what vLLM answers once its engine died
        await checker.check_all()
        assert router.breaker_state(backend) is OPEN
        assert router.describe(backend)["last_error_kind"] == "http_5xx"
    finally:
        await inst.close()


async def test_restarted_instance_comes_back_through_the_checker(session) -> None:
    inst = FakeInstance()
    await inst.start()
    try:
        backend = Backend(inst.url)
        clock = [0.0]
        router = Router(
            [],
            [backend],
            RoutingPolicy(breaker_failures=1, breaker_cooldown_s=5),
            clock=lambda: clock[0],
        )
        checker = HealthChecker(
            router, session, HealthCheckConfig(timeout_s=2), clock=lambda: clock[0]
        )
        router.record_failure(backend, 0.0, "connection refused", kind=FailureKind.REFUSED)
        assert router.breaker_state(backend) is OPEN
        clock[0] = 1.0
        await checker.check_all()  # within the cool-down: stays out of rotation
        assert router.breaker_state(backend) is OPEN
        clock[0] = 5.0
        await checker.check_all()
        assert router.breaker_state(backend) is CLOSED
        assert [(k, t.old, t.new) for k, t in router.transitions] == [
            (backend.key, CLOSED, OPEN),
            (backend.key, OPEN, HALF),
            (backend.key, HALF, CLOSED),
        ]
    finally:
        await inst.close()


async def test_checker_task_runs_rounds_and_close_leaves_no_task(session) -> None:
    inst = FakeInstance()
    await inst.start()
    try:
        router = Router([], [Backend(inst.url)])
        checker = HealthChecker(router, session, HealthCheckConfig(interval_s=0.01, timeout_s=2))
        checker.start()
        for _ in range(3):
            await asyncio.wait_for(checker.round_done.wait(), 10)
        assert checker.rounds >= 3
        await checker.close()
        await checker.close()  # idempotent
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not [t for t in others if t.get_name() == "pdserve-health-checker"]
    finally:
        await inst.close()


def _key():
    from pd_serving.routing import RequestKey

    return RequestKey(prompt_text="hello")
