"""Failover, deadlines and cancellation: the AttemptPlan alone, then the proxy against stand-ins.

The stand-ins (``FakeUpstream``) refuse, answer 5xx, hang, die before the first token or after k
tokens; P's release RPC is a real simple_rpc server. Every proxy test ends with nothing left: no
task, no upstream connection held by the proxy's session, no call still open at a stand-in.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from hybrid_connector.protocol import RELEASE, ReleaseRequest, ReleaseResponse
from pd_serving.failover import Action, AttemptPlan, Failure, Stage
from pd_serving.launcher import free_port
from pd_serving.proxy import DEADLINE_HEADER, Backend, Dispatch, PdProxy, ProxyConfig, serve
from pd_serving.servers import Connector
from simple_rpc import CallContext, Server
from stand_ins import MODEL, FakeUpstream

# ============================================================================ the plan, pure


def _plan(hybrid: bool = True, max_retries: int = 2) -> AttemptPlan:
    ids = (f"t{i}" for i in itertools.count())
    return AttemptPlan(hybrid=hybrid, max_retries=max_retries, new_transfer_id=lambda: next(ids))


@pytest.mark.parametrize(
    "failure", [Failure.REFUSED, Failure.HTTP_5XX, Failure.TIMEOUT, Failure.BROKE]
)
def test_a_decode_failing_before_its_first_token_retries_on_another_d_same_transfer(
    failure: Failure,
) -> None:
    plan = _plan()
    transfer = plan.begin("p0")
    plan.prefill_answered()
    decision = plan.failed(Stage.DECODE, "d0", failure)
    assert decision.action is Action.RETRY_DECODE
    assert not decision.release  # D1 will pull what P holds
    assert plan.failed_decode == {"d0"}
    plan.retry_decode("d1")
    assert plan.transfer is transfer  # same transfer id, same P
    assert plan.transfer.transfer_id == "t0"


def test_nixl_decode_failure_reroutes_to_a_new_prefill() -> None:
    plan = _plan(hybrid=False)
    plan.begin("p0")
    plan.prefill_answered()
    decision = plan.failed(Stage.DECODE, "d0", Failure.HTTP_5XX)
    assert decision.action is Action.REROUTE  # NIXL's KV read is one-shot: prefill again
    assert decision.release  # (the shell sends RELEASE only with the HybridConnector)
    assert plan.begin("p0").transfer_id == "t1"


@pytest.mark.parametrize(
    ("failure", "release"),
    [
        (Failure.REFUSED, False),  # P never saw it: it holds nothing
        (Failure.HTTP_5XX, True),  # P may hold blocks: a release of nothing is harmless
        (Failure.TIMEOUT, True),  # P may have done the work
        (Failure.BROKE, True),  # e.g. a 200 with an unparseable body
    ],
)
def test_a_failed_prefill_reroutes_releasing_unless_p_never_saw_it(
    failure: Failure, release: bool
) -> None:
    plan = _plan()
    plan.begin("p0")
    decision = plan.failed(Stage.PREFILL, "p0", failure)
    assert decision.action is Action.REROUTE
    assert decision.release is release
    assert plan.failed_prefill == {"p0"}
    assert plan.failed_decode == set()
    assert plan.begin(None) is None  # no P left: D prefills itself
    assert plan.transfer is None


def test_no_retry_once_bytes_reached_the_client() -> None:
    plan = _plan()
    plan.begin("p0")
    plan.prefill_answered()
    plan.sent_to_client()
    decision = plan.failed(Stage.DECODE, "d0", Failure.BROKE_MID_STREAM)
    assert decision.action is Action.FAIL
    assert not decision.release  # D pulled the KV before it streamed
    assert plan.finished


def test_retries_are_bounded_and_the_last_failure_releases_once() -> None:
    plan = _plan(max_retries=1)
    plan.begin("p0")
    plan.prefill_answered()
    assert plan.failed(Stage.DECODE, "d0", Failure.REFUSED).action is Action.RETRY_DECODE
    plan.retry_decode("d1")
    decision = plan.failed(Stage.DECODE, "d1", Failure.HTTP_5XX)
    assert decision.action is Action.FAIL
    assert decision.status == 502
    assert decision.release  # no D will pull t0 now
    assert not plan.deadline_passed().release  # decided once per transfer


def test_a_4xx_is_relayed_and_releases_only_what_p_holds() -> None:
    plan = _plan()
    plan.begin("p0")
    plan.prefill_answered()
    decision = plan.failed(Stage.DECODE, "d0", Failure.REJECTED)
    assert decision.action is Action.RELAY
    assert decision.release
    assert plan.failed_decode == set()  # not the instance's fault
    plan = _plan()
    plan.begin("p0")
    decision = plan.failed(Stage.PREFILL, "p0", Failure.REJECTED)
    assert decision.action is Action.RELAY
    assert not decision.release  # P rejected it: it never ran it


@pytest.mark.parametrize(
    ("answered", "sent", "release"),
    [(False, False, True), (True, False, True), (True, True, False)],
)
def test_deadline_and_client_gone_release_unless_d_streamed(
    answered: bool, sent: bool, release: bool
) -> None:
    for end in ("deadline_passed", "client_gone"):
        plan = _plan()
        plan.begin("p0")  # parallel dispatch: P may still run when the request ends
        if answered:
            plan.prefill_answered()
        if sent:
            plan.sent_to_client()
        decision = getattr(plan, end)()
        assert decision.action is Action.FAIL
        assert decision.release is release
        assert decision.status == (504 if end == "deadline_passed" else 499)


def test_no_backend_is_503_before_any_failure_and_502_after() -> None:
    plan = _plan()
    assert plan.no_backend("decode").status == 503
    plan = _plan()
    plan.begin(None)
    plan.failed(Stage.LOCAL, "d0", Failure.REFUSED)
    assert plan.no_backend("decode").status == 502


# ============================================================================ the proxy


@dataclass
class Rig:
    """Stand-in P's and D's, each P with a release RPC server, and one proxy in front."""

    ps: list[FakeUpstream]
    ds: list[FakeUpstream]
    releases: list[ReleaseRequest] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    rpcs: list[Server] = field(default_factory=list)
    proxy: PdProxy | None = None
    url: str = ""
    runners: list[Any] = field(default_factory=list)

    async def start_proxy(self, **config: Any) -> PdProxy:
        prefill = [
            Backend(p.url, rpc_address=rpc.address, name=f"p{i}")
            for i, (p, rpc) in enumerate(zip(self.ps, self.rpcs, strict=True))
        ]
        decode = [Backend(d.url, name=f"d{i}") for i, d in enumerate(self.ds)]
        proxy = PdProxy(ProxyConfig(prefill=prefill, decode=decode, model_names=[MODEL], **config))
        port = free_port()
        self.runners.append(await serve(proxy, "127.0.0.1", port))
        self.proxy, self.url = proxy, f"http://127.0.0.1:{port}"
        return proxy

    async def post(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        full = {"model": MODEL, "prompt": "x", **body}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/v1/completions", json=full, headers=headers) as resp,
        ):
            if full.get("stream"):
                lines = [line.strip() async for line in resp.content if line.startswith(b"data:")]
                return resp.status, lines
            return resp.status, await resp.json(content_type=None)

    def metric(self, name: str, **labels: str) -> float:
        assert self.proxy is not None
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


def _texts(lines: list[bytes]) -> list[str]:
    out = []
    for line in lines:
        if line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        out += [c.get("text", "") for c in event.get("choices", []) if c.get("text")]
    return out


@pytest.fixture
async def rig_factory() -> AsyncIterator[Any]:
    rigs: list[Rig] = []

    async def make(n_prefill: int = 1, n_decode: int = 2) -> Rig:
        rig = Rig(
            ps=[FakeUpstream(f"P{i}", kv_params={"from_p": i}) for i in range(n_prefill)],
            ds=[FakeUpstream(f"D{i}", tokens=[f" {c}" for c in "abcdef"]) for i in range(n_decode)],
        )
        for upstream in rig.ps + rig.ds:
            await upstream.start()

        async def on_release(req: ReleaseRequest, _ctx: CallContext) -> ReleaseResponse:
            rig.releases.append(req)
            rig.released.set()
            return ReleaseResponse(transfer_id=req.transfer_id, released=True)

        for _ in rig.ps:
            rpc = Server()
            rpc.register(RELEASE, on_release)
            await rpc.start("127.0.0.1", 0)
            rig.rpcs.append(rpc)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        if rig.proxy is not None:
            if rig.proxy.health is not None:  # its probes are not the request flow's calls
                await rig.proxy.health.close()
                rig.proxy.health = None
            await rig.proxy.drain_background()
            session = rig.proxy._session
            assert session is not None
            # Every upstream connection went back to the pool or was closed: none held.
            assert not session.connector._acquired  # type: ignore[union-attr]
        for upstream in rig.ps + rig.ds:
            await asyncio.wait_for(upstream.idle.wait(), timeout=5)  # every call was closed
        for runner in rig.runners:
            await runner.cleanup()
        for upstream in rig.ps + rig.ds:
            await upstream.close()
        for rpc in rig.rpcs:
            await rpc.close()
    assert asyncio.all_tasks() == {asyncio.current_task()}


def _d_params(upstream: FakeUpstream, i: int = 0) -> dict[str, Any]:
    return upstream.received[i]["kv_transfer_params"]


DECODE_FAILURES = {
    "refuse": None,
    "5xx": {"fail_status": 500},
    "hang": {"hang": True},
    "die_before_answer": {"die_before_answer": True},
    "die_before_first_token": {"break_after": 0},
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("dispatch", list(Dispatch))
@pytest.mark.parametrize("mode", list(DECODE_FAILURES))
async def test_decode_failing_before_the_first_token_fails_over_to_another_d(
    rig_factory: Any, mode: str, dispatch: Dispatch, stream: bool
) -> None:
    """The same transfer id and P address go to D1, P is called once, nothing is released."""
    if mode == "die_before_first_token" and not stream:
        pytest.skip("break_after is a streaming failure")
    if mode == "hang" and not stream:
        pytest.skip("a hanging non-streaming D is only bounded by the deadline (see below)")
    rig: Rig = await rig_factory()
    d0, d1 = rig.ds
    if DECODE_FAILURES[mode] is None:
        await d0.refuse()
    else:
        for attr, value in DECODE_FAILURES[mode].items():
            setattr(d0, attr, value)
    await rig.start_proxy(dispatch=dispatch, attempt_timeout_s=1.0 if stream else 60)
    status, answer = await rig.post({"stream": stream})
    assert status == 200, answer
    text = "".join(_texts(answer)) if stream else answer["choices"][0]["text"]
    assert text == " a b c d e f"  # once: nothing duplicated, nothing lost
    (p_req,) = rig.ps[0].received  # P prefilled once
    tid = p_req["kv_transfer_params"]["transfer_id"]
    assert _d_params(d1)["transfer_id"] == tid
    assert _d_params(d1)["remote_rpc_address"] == rig.rpcs[0].address
    if d0.received:
        assert _d_params(d0)["transfer_id"] == tid
    assert rig.releases == []  # D1 pulled it
    reason = {"refuse": "refused", "5xx": "http_5xx", "hang": "timeout"}.get(mode, "broke")
    assert rig.metric("pdserve_failovers_total", stage="decode", reason=reason) == 1
    assert rig.metric("pdserve_retries_total", kind="same_transfer") == 1


async def test_decode_dying_after_tokens_ends_in_an_error_event_never_a_retry(
    rig_factory: Any,
) -> None:
    rig: Rig = await rig_factory()
    rig.ds[0].break_after = 3
    rig.ds[1].break_after = 3
    await rig.start_proxy()
    status, lines = await rig.post({"stream": True})
    assert status == 200
    assert _texts(lines) == [" a", " b", " c"]  # what went out, once
    error = json.loads(lines[3][6:])["error"]
    assert error["code"] == 502
    assert "broke off" in error["message"]
    final = json.loads(lines[4][6:])
    assert final["choices"][0]["finish_reason"] == "error"
    assert final["id"].startswith("cmpl-D")  # the stream's own id
    assert lines[5] == b"data: [DONE]"
    assert sum(len(d.received) for d in rig.ds) == 1  # no second D
    assert rig.releases == []  # D had pulled it
    assert rig.metric("pdserve_stream_errors_total", reason="upstream_error") == 1


async def test_the_openai_client_raises_on_the_error_event(rig_factory: Any) -> None:
    openai = pytest.importorskip("openai")
    rig: Rig = await rig_factory(n_decode=1)
    rig.ds[0].break_after = 2
    await rig.start_proxy()
    client = openai.AsyncOpenAI(base_url=f"{rig.url}/v1", api_key="none", max_retries=0)
    texts: list[str] = []

    async def read() -> None:
        stream = await client.completions.create(model=MODEL, prompt="x", stream=True)
        async for chunk in stream:
            texts.extend(c.text for c in chunk.choices)

    with pytest.raises(openai.APIError, match="broke off"):
        await read()
    assert texts == [" a", " b"]
    await client.close()


async def test_decode_dying_mid_answer_without_stream_is_a_502_not_a_200(
    rig_factory: Any,
) -> None:
    rig: Rig = await rig_factory(n_decode=1)
    rig.ds[0].die_before_answer = True
    await rig.start_proxy()
    status, body = await rig.post({})
    assert status == 502
    assert "decode" in body["error"]["message"]
    await asyncio.wait_for(rig.released.wait(), timeout=5)  # no D will pull: P lets go
    assert [r.transfer_id for r in rig.releases] == [
        rig.ps[0].received[0]["kv_transfer_params"]["transfer_id"]
    ]


@pytest.mark.parametrize("mode", ["refuse", "5xx", "hang", "die_before_answer", "bad_body"])
@pytest.mark.parametrize("dispatch", list(Dispatch))
async def test_prefill_failing_moves_to_another_p_with_a_new_transfer(
    rig_factory: Any, mode: str, dispatch: Dispatch
) -> None:
    rig: Rig = await rig_factory(n_prefill=2, n_decode=1)
    p0, p1 = rig.ps
    if mode == "refuse":
        await p0.refuse()
    elif mode == "bad_body":
        p0.bad_body = True
    else:
        setattr(
            p0,
            {"5xx": "fail_status", "hang": "hang"}.get(mode, mode),
            500 if mode == "5xx" else True,
        )
    await rig.start_proxy(dispatch=dispatch, attempt_timeout_s=1.0)
    status, lines = await rig.post({"stream": True})
    assert status == 200
    assert "".join(_texts(lines)) == " a b c d e f"
    (p1_req,) = p1.received
    tid = p1_req["kv_transfer_params"]["transfer_id"]
    d_tids = [r["kv_transfer_params"]["transfer_id"] for r in rig.ds[0].received]
    assert d_tids[-1] == tid
    if p0.received:
        assert p0.received[0]["kv_transfer_params"]["transfer_id"] != tid
    assert all(r.transfer_id != tid for r in rig.releases)
    await rig.proxy.drain_background()  # type: ignore[union-attr]
    # Only a P that never saw the call holds nothing; any other may hold P0's transfer.
    abandoned = [r["kv_transfer_params"]["transfer_id"] for r in p0.received]
    assert [r.transfer_id for r in rig.releases] == ([] if mode == "refuse" else abandoned)
    assert rig.metric("pdserve_retries_total", kind="new_prefill") == 1


async def test_no_healthy_prefill_left_means_a_local_prefill_on_d(rig_factory: Any) -> None:
    rig: Rig = await rig_factory(n_prefill=1, n_decode=1)
    rig.ps[0].fail_status = 503
    await rig.start_proxy()
    status, body = await rig.post({})
    assert status == 200
    assert body["choices"][0]["text"] == " a b c d e f"
    assert "kv_transfer_params" not in rig.ds[0].received[-1]  # D prefills itself
    assert rig.metric("pdserve_retries_total", kind="local_prefill") == 1
    assert rig.metric("pdserve_failovers_total", stage="prefill", reason="http_5xx") == 1


async def test_every_decode_failing_is_one_502_and_one_release(rig_factory: Any) -> None:
    rig: Rig = await rig_factory(n_decode=2)
    for d in rig.ds:
        d.fail_status = 500
    await rig.start_proxy()
    status, body = await rig.post({})
    assert status == 502
    assert "no healthy decode instance left" in body["error"]["message"]
    await rig.proxy.drain_background()  # type: ignore[union-attr]
    tid = rig.ps[0].received[0]["kv_transfer_params"]["transfer_id"]
    assert [r.transfer_id for r in rig.releases] == [tid]
    assert [_d_params(d)["transfer_id"] for d in rig.ds] == [tid, tid]


async def test_nixl_decode_failure_prefills_again(rig_factory: Any) -> None:
    rig: Rig = await rig_factory(n_decode=2)
    rig.ps[0].kv_params = {"do_remote_prefill": True, "remote_block_ids": [1]}
    rig.ds[0].fail_status = 500
    await rig.start_proxy(connector=Connector.NIXL)
    status, _ = await rig.post({})
    assert status == 200
    assert len(rig.ps[0].received) == 2  # NIXL's read is one-shot: a second prefill
    assert rig.releases == []  # NIXL frees on its own timeout: no RPC


@pytest.mark.parametrize("stage", ["prefill", "decode"])
@pytest.mark.parametrize("dispatch", list(Dispatch))
async def test_a_request_never_outlives_its_deadline(
    rig_factory: Any, stage: str, dispatch: Dispatch
) -> None:
    rig: Rig = await rig_factory(n_decode=1)
    (rig.ps[0] if stage == "prefill" else rig.ds[0]).hang = True
    await rig.start_proxy(dispatch=dispatch, request_timeout_s=30)
    t0 = time.monotonic()
    status, body = await rig.post({}, headers={DEADLINE_HEADER: "0.3"})  # lowers 30 s to 0.3
    elapsed = time.monotonic() - t0
    assert status == 504
    assert body["error"]["type"] == "timeout"
    assert elapsed < 5  # the deadline, not the 30 s or the 60 s attempt timeout
    await asyncio.wait_for(rig.ds[0].idle.wait(), timeout=5)  # D's call was closed
    await asyncio.wait_for(rig.ps[0].idle.wait(), timeout=5)  # P's call was closed
    await rig.proxy.drain_background()  # type: ignore[union-attr]
    tid = rig.ps[0].received[0]["kv_transfer_params"]["transfer_id"]
    assert [r.transfer_id for r in rig.releases] == [tid]
    assert rig.metric("pdserve_deadline_expiries_total", stage=stage) == 1


async def test_a_deadline_mid_stream_is_an_error_event(rig_factory: Any) -> None:
    rig: Rig = await rig_factory(n_decode=1)
    rig.ds[0].tokens = [f" t{i}" for i in range(1000)]
    rig.ds[0].token_delay_s = 0.05  # 50 s in all
    await rig.start_proxy(request_timeout_s=1.0)
    status, lines = await rig.post({"stream": True, "max_tokens": 1000})
    assert status == 200
    assert 0 < len(_texts(lines)) < 1000
    error = json.loads(lines[-3][6:])["error"]
    assert error["type"] == "timeout"
    assert error["code"] == 504
    assert lines[-1] == b"data: [DONE]"
    assert rig.releases == []  # D streamed: it pulled the KV


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "nan"])
async def test_a_bad_deadline_header_is_a_400(rig_factory: Any, bad: str) -> None:
    rig: Rig = await rig_factory(n_decode=1)
    await rig.start_proxy()
    status, body = await rig.post({}, headers={DEADLINE_HEADER: bad})
    assert status == 400
    assert DEADLINE_HEADER in body["error"]["message"]


@pytest.mark.parametrize(
    ("dispatch", "waiting_on"),
    [
        (Dispatch.SEQUENTIAL, "prefill"),
        (Dispatch.SEQUENTIAL, "decode"),
        (Dispatch.PARALLEL, "both"),
    ],
)
async def test_a_client_disconnect_closes_both_calls_and_releases_the_transfer(
    rig_factory: Any, dispatch: Dispatch, waiting_on: str
) -> None:
    rig: Rig = await rig_factory(n_decode=1)
    p, d = rig.ps[0], rig.ds[0]
    if waiting_on in ("prefill", "both"):
        p.hang = True
    if waiting_on in ("decode", "both"):
        d.hang = True
    await rig.start_proxy(dispatch=dispatch)
    body = {"model": MODEL, "prompt": "x", "stream": True}
    async with aiohttp.ClientSession() as session:
        post = asyncio.create_task(session.post(f"{rig.url}/v1/completions", json=body))
        waited = p if waiting_on == "prefill" else d
        await asyncio.wait_for(waited.started.wait(), timeout=5)
        post.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await post
    await asyncio.wait_for(p.idle.wait(), timeout=5)
    await asyncio.wait_for(d.idle.wait(), timeout=5)
    if waiting_on == "prefill":
        assert d.received == []
    await asyncio.wait_for(rig.released.wait(), timeout=5)
    assert [r.transfer_id for r in rig.releases] == [
        p.received[0]["kv_transfer_params"]["transfer_id"]
    ]
    assert rig.metric("pdserve_client_disconnects_total") == 1


async def test_every_call_feeds_the_router(rig_factory: Any) -> None:
    rig: Rig = await rig_factory(n_decode=2)
    rig.ds[0].fail_status = 500
    proxy = await rig.start_proxy(health=None)  # only the request flow's calls
    events: list[tuple[str, str, float]] = []
    proxy.router.record_success = lambda b, now: events.append(("ok", b.key, now))  # type: ignore[method-assign]
    proxy.router.record_failure = lambda b, now, why, **_: events.append(("fail", b.key, now))  # type: ignore[method-assign]
    before = time.monotonic()
    status, _ = await rig.post({"stream": True})
    assert status == 200
    assert [e[:2] for e in events] == [("ok", "p0"), ("fail", "d0"), ("ok", "d1")]
    assert all(before <= e[2] <= time.monotonic() for e in events)  # time.monotonic clock


async def test_metrics_and_health_show_failovers(rig_factory: Any) -> None:
    rig: Rig = await rig_factory(n_decode=2)
    await rig.ds[0].refuse()
    await rig.start_proxy()
    assert (await rig.post({}))[0] == 200
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{rig.url}/metrics") as resp:
            text = await resp.text()
        async with session.get(f"{rig.url}/health") as resp:
            health = await resp.json()
    assert 'pdserve_failovers_total{reason="refused",stage="decode"} 1.0' in text
    assert 'pdserve_retries_total{kind="same_transfer"} 1.0' in text
    assert 'pdserve_call_failures_total{backend="d0",reason="refused",stage="decode"} 1.0' in text
    assert [d["name"] for d in health["decode"]] == ["d0", "d1"]


def test_the_cli_sets_deadline_and_retries() -> None:
    from pd_serving.cli import _failover_settings, build_parser

    args = build_parser().parse_args(
        ["proxy", "--decode", "http://d", "--request-timeout-s", "5", "--max-retries", "0"]
    )
    assert _failover_settings(args) == {
        "request_timeout_s": 5.0,
        "attempt_timeout_s": 60.0,
        "max_retries": 0,
    }


async def test_our_client_raises_on_the_error_event_with_what_came_before(
    rig_factory: Any,
) -> None:
    from pd_serving.client import StreamError, complete

    rig: Rig = await rig_factory(n_decode=1)
    rig.ds[0].break_after = 2
    await rig.start_proxy()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(StreamError, match="broke off") as caught:
            await complete(session, rig.url, MODEL, "x", max_tokens=6)
    assert caught.value.status == 502
    assert caught.value.partial.text == " a b"
    assert caught.value.partial.finish_reason == "error"


async def test_a_chat_stream_broken_mid_way_ends_with_a_chat_error_chunk(rig_factory: Any) -> None:
    rig: Rig = await rig_factory(n_decode=1)
    rig.ds[0].break_after = 1
    await rig.start_proxy()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{rig.url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        lines = [line.strip() async for line in resp.content if line.startswith(b"data:")]
    assert "error" in json.loads(lines[1][6:])
    final = json.loads(lines[2][6:])
    assert final["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "finish_reason": "error",
        "delta": {},
    }
    assert lines[3] == b"data: [DONE]"


async def test_a_decode_never_called_gives_its_probe_back(rig_factory: Any) -> None:
    """Sequential: P fails before D is called; D's half-open probe must not stay taken."""
    rig: Rig = await rig_factory(n_decode=1)
    rig.ps[0].fail_status = 500
    proxy = await rig.start_proxy(health=None, max_retries=0)
    unused: list[str] = []
    proxy.router.record_unused = lambda b: unused.append(b.key)  # type: ignore[method-assign]
    status, _ = await rig.post({})
    assert status == 502
    assert unused == ["d0"]
    assert rig.ds[0].received == []


async def _stream_recording_outcomes(rig: Rig) -> tuple[int, Any, list[tuple[str, str]]]:
    """A streaming request; with the Router's outcomes in order: ("ok"|"fail", backend)."""
    proxy = await rig.start_proxy(health=None)
    events: list[tuple[str, str]] = []
    proxy.router.record_success = lambda b, now: events.append(("ok", b.key))  # type: ignore[method-assign]
    proxy.router.record_failure = lambda b, now, why, **_: events.append(("fail", b.key))  # type: ignore[method-assign]
    status, lines = await rig.post({"stream": True})
    return status, lines, events


async def test_a_decode_streaming_an_error_first_fails_over_to_another_d(rig_factory: Any) -> None:
    """vLLM's engine failing: a 200 whose first event is an error. Nothing reached the client,
    so it is a failed call: D1 pulls the same transfer, d0 is recorded as failed."""
    rig: Rig = await rig_factory(n_decode=2)
    rig.ds[0].error_after = 0
    status, lines, events = await _stream_recording_outcomes(rig)
    assert status == 200
    assert "".join(_texts(lines)) == " a b c d e f"
    assert all(b'"error"' not in line for line in lines)
    assert events == [("ok", "p0"), ("fail", "d0"), ("ok", "d1")]
    tid = rig.ps[0].received[0]["kv_transfer_params"]["transfer_id"]
    assert _d_params(rig.ds[1])["transfer_id"] == tid
    assert rig.releases == []
    assert rig.metric("pdserve_failovers_total", stage="decode", reason="broke") == 1


async def test_a_decode_streaming_an_error_after_tokens_is_recorded_as_failed(
    rig_factory: Any,
) -> None:
    rig: Rig = await rig_factory(n_decode=1)
    rig.ds[0].error_after = 2
    status, lines, events = await _stream_recording_outcomes(rig)
    assert status == 200
    assert _texts(lines) == [" a", " b"]
    assert "engine error" in json.loads(lines[2][6:])["error"]["message"]  # relayed as is
    assert lines[-1] == b"data: [DONE]"
    assert events[-1] == ("fail", "d0")


async def test_after_a_decode_retry_the_router_credits_the_d_that_served(
    rig_factory: Any,
) -> None:
    """The prompt's prefix is in D1's cache, not in the failed D0's."""
    rig: Rig = await rig_factory(n_decode=2)
    rig.ds[0].fail_status = 500
    proxy = await rig.start_proxy(health=None)
    credited: list[str] = []
    proxy.router.record_routed = lambda key, route: credited.append(route.decode.key)  # type: ignore[method-assign]
    status, _ = await rig.post({})
    assert status == 200
    assert credited == ["d1"]


@pytest.mark.parametrize("max_retries", [0, 1], ids=["fail", "reroute"])
async def test_a_decode_call_cancelled_by_a_failed_prefill_gives_its_probe_back(
    rig_factory: Any, max_retries: int
) -> None:
    """Parallel: D's call is cancelled when P fails, with no outcome for D: its half-open
    probe must not stay taken."""
    rig: Rig = await rig_factory(n_prefill=2, n_decode=1)
    rig.ps[0].fail_status = 500
    rig.ps[1].fail_status = 500
    proxy = await rig.start_proxy(health=None, dispatch=Dispatch.PARALLEL, max_retries=max_retries)
    unused: list[str] = []
    proxy.router.record_unused = lambda b: unused.append(b.key)  # type: ignore[method-assign]
    status, _ = await rig.post({})
    assert status == 502
    assert unused == ["d0"] * (max_retries + 1)  # once per route whose P failed
