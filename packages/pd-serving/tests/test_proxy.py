"""The proxy against stand-in OpenAI upstreams: validation, PD parameters, errors, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from hybrid_connector.contract import PullParams, decode_params, encode_params
from pd_serving.launcher import free_port
from pd_serving.proxy import Backend, Dispatch, PdProxy, ProxyConfig, serve
from pd_serving.routing import RequestKey, Router
from pd_serving.servers import Connector
from stand_ins import MODEL, FakeUpstream

Factory = Callable[..., Coroutine[Any, Any, tuple[str, PdProxy]]]


@pytest.fixture
async def upstreams() -> AsyncIterator[dict[str, FakeUpstream]]:
    p = FakeUpstream("P", kv_params={"from_p": 1, "remote_rpc_address": "p-says"})
    d = FakeUpstream("D")
    await p.start()
    await d.start()
    yield {"P": p, "D": d}
    await p.close()
    await d.close()


@pytest.fixture
async def make_proxy(upstreams: dict[str, FakeUpstream]) -> AsyncIterator[Factory]:
    runners = []

    async def factory(  # noqa: PLR0917 -- keyword use in the tests
        connector: Connector = Connector.HYBRID,
        dispatch: Dispatch = Dispatch.SEQUENTIAL,
        prefill: bool = True,
        decode_urls: list[str] | None = None,
        model_names: list[str] | None = None,
        max_retries: int = 2,
    ) -> tuple[str, PdProxy]:
        config = ProxyConfig(
            prefill=[Backend(upstreams["P"].url, rpc_address="127.0.0.1:7777", name="p0")]
            if prefill
            else [],
            decode=[
                Backend(u, name=f"d{i}") for i, u in enumerate(decode_urls or [upstreams["D"].url])
            ],
            connector=connector,
            dispatch=dispatch,
            model_names=model_names or [],  # empty: asked from the first D at startup
            max_retries=max_retries,
        )
        proxy = PdProxy(config)
        port = free_port()
        runners.append(await serve(proxy, "127.0.0.1", port))
        return f"http://127.0.0.1:{port}", proxy

    yield factory
    for runner in runners:
        await runner.cleanup()


async def _post(url: str, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as resp,
    ):
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


BAD = [
    (b"{nope", 400, "malformed JSON"),
    (b'"just a string"', 400, "JSON object"),
    (b'{"model": 3, "prompt": "hi"}', 400, "'model' must be a string"),
    (b'{"model": "other", "prompt": "hi"}', 404, "does not exist"),
    (b'{"model": "tiny"}', 400, "'prompt' is required"),
    (b'{"model": "tiny", "prompt": []}', 400, "'prompt' is required"),
    (b'{"model": "tiny", "prompt": ["a", 1]}', 400, "mixes"),
    (b'{"model": "tiny", "prompt": [1099511627776]}', 400, "token ids"),
    (b'{"model": "tiny", "prompt": [-1099511627776]}', 400, "token ids"),
    (b'{"model": "tiny", "prompt": [-1]}', 400, "token ids"),
    (b'{"model": "tiny", "prompt": [2147483648]}', 400, "token ids"),
    (b'{"model": "tiny", "prompt": [1, true]}', 400, "token ids"),
    (b'{"model": "tiny", "prompt": [[1099511627776]]}', 400, "token ids"),
    (b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', 400, "'stream'"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": -1}', 400, "non-negative integer"),
    (b'{"model": "tiny", "prompt": "hi", "n": 0}', 400, "'n' must be a positive"),
    (b'{"model": "tiny", "prompt": "hi", "kv_transfer_params": {}}', 400, "set by the proxy"),
]


@pytest.mark.parametrize(("raw", "status", "message"), BAD)
async def test_bad_requests_are_4xx_with_a_clear_message(  # noqa: PLR0917 -- parametrized
    make_proxy: Factory,
    upstreams: dict[str, FakeUpstream],
    raw: bytes,
    status: int,
    message: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, _ = await make_proxy()
    got, body = await _post(url, "/v1/completions", raw)
    assert got == status
    assert message in body["error"]["message"]
    assert "rejected" in caplog.text  # a WARNING line naming the request
    assert upstreams["P"].received == []
    assert upstreams["D"].received == []
    # The proxy still serves.
    ok, answer = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert ok == 200, answer


async def test_chat_needs_messages(make_proxy: Factory) -> None:
    url, _ = await make_proxy()
    status, body = await _post(url, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400
    assert "messages" in body["error"]["message"]


async def test_sequential_hybrid_sends_prefill_then_decode_with_transfer_params(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    url, _ = await make_proxy()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "min_tokens": 2, "stream": False}
    status, answer = await _post(url, "/v1/completions", body)
    assert status == 200
    assert answer["choices"][0]["text"] == " a b c"
    (p_req,) = upstreams["P"].received
    (d_req,) = upstreams["D"].received
    assert p_req["max_tokens"] == 1
    assert p_req["stream"] is False
    assert "min_tokens" not in p_req
    p_params = p_req["kv_transfer_params"]
    assert p_params["do_remote_decode"] is True
    d_params = d_req["kv_transfer_params"]
    assert d_params["do_remote_prefill"] is True
    assert d_params["do_remote_decode"] is False
    assert d_params["transfer_id"] == p_params["transfer_id"]
    assert d_params["remote_rpc_address"] == "127.0.0.1:7777"  # the proxy's P address wins
    # P answered nothing D could pull from (no do_remote_prefill): the proxy's own PullParams,
    # as with parallel dispatch; keys outside the contract do not travel.
    assert d_params == encode_params(
        PullParams(transfer_id=p_params["transfer_id"], remote_rpc_address="127.0.0.1:7777")
    )
    assert d_req["max_tokens"] == 3
    assert d_req["min_tokens"] == 2


def _p_answer(**fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A HybridConnector P's answered kv_transfer_params (its transfer id echoed), changed by
    ``fields``."""

    def answer(asked: dict[str, Any]) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": asked["transfer_id"],
            "remote_rpc_address": "10.9.9.9:8200",
            "remote_request_id": "cmpl-p",
            "remote_block_ids": [[3, 5]],
            "remote_num_tokens": 6,
            "remote_tp_size": 2,
            "lease_s": 30.0,
            "remote_prefill_cached_tokens": 4,  # vLLM adds it; D's usage report reads it
            "contract_version": 1,
            "not_in_the_contract": True,
            **fields,
        }

    return answer


async def test_p_answered_pull_params_go_to_d_with_the_proxys_p_address(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    upstreams["P"].kv_params = _p_answer()
    url, _ = await make_proxy()
    status, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 200
    tid = upstreams["P"].received[0]["kv_transfer_params"]["transfer_id"]
    d_params = upstreams["D"].received[0]["kv_transfer_params"]
    assert decode_params(d_params) == PullParams(
        transfer_id=tid,
        remote_rpc_address="127.0.0.1:7777",
        remote_tp_size=2,  # D pulls from each of P's ranks
        remote_request_id="cmpl-p",
        remote_block_ids=[[3, 5]],
        remote_num_tokens=6,
        lease_s=30.0,
        remote_prefill_cached_tokens=4,
    )
    assert "not_in_the_contract" not in d_params


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"remote_tp_size": "2"}, "kv_transfer_params.remote_tp_size"),
        ({"contract_version": 99}, "kv_transfer_params.contract_version"),
        ({"transfer_id": "made-up-by-p"}, "kv_transfer_params.transfer_id"),
    ],
    ids=["bad-type", "newer-version", "another-transfer"],
)
async def test_p_params_that_break_the_contract_fail_the_prefill(
    make_proxy: Factory,
    upstreams: dict[str, FakeUpstream],
    caplog: pytest.LogCaptureFixture,
    fields: dict[str, Any],
    field: str,
) -> None:
    """Checked where they enter the proxy: a typed failure naming the field and P, logged with
    the transfer; the request fails over (here: D prefills itself)."""
    upstreams["P"].kv_params = _p_answer(**fields)
    url, proxy = await make_proxy(max_retries=0)
    with caplog.at_level("WARNING", logger="pd_serving.proxy"):
        status, body = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert field in body["error"]["message"]
    assert upstreams["P"].url in body["error"]["message"]
    tid = upstreams["P"].received[0]["kv_transfer_params"]["transfer_id"]
    assert any(tid in r.getMessage() and field in r.getMessage() for r in caplog.records)
    url, proxy = await make_proxy()
    status, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 200
    assert "kv_transfer_params" not in upstreams["D"].received[-1]
    assert proxy.metrics.retries.labels("local_prefill")._value.get() == 1


async def test_a_p_without_a_configured_rpc_address_is_pulled_where_it_says(
    upstreams: dict[str, FakeUpstream],
) -> None:
    upstreams["P"].kv_params = _p_answer()
    config = ProxyConfig(
        prefill=[Backend(upstreams["P"].url, name="p0")], decode=[Backend(upstreams["D"].url)]
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    try:
        body = {"model": MODEL, "prompt": "x"}
        status, _ = await _post(f"http://127.0.0.1:{port}", "/v1/completions", body)
    finally:
        await runner.cleanup()
    assert status == 200
    d_params = upstreams["D"].received[0]["kv_transfer_params"]
    assert d_params["remote_rpc_address"] == "10.9.9.9:8200"


async def test_nixl_passes_p_params_verbatim(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    upstreams["P"].kv_params = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    url, _ = await make_proxy(connector=Connector.NIXL)
    status, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 200
    assert upstreams["P"].received[0]["kv_transfer_params"]["remote_engine_id"] is None
    assert upstreams["D"].received[0]["kv_transfer_params"] == upstreams["P"].kv_params


async def test_nixl_without_p_params_is_a_failed_prefill(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    upstreams["P"].kv_params = None
    url, _ = await make_proxy(connector=Connector.NIXL, max_retries=0)
    status, body = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert "kv_transfer_params" in body["error"]["message"]
    # With retries, the only P is out for this request: D prefills itself.
    url, proxy = await make_proxy(connector=Connector.NIXL)
    status, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 200
    assert "kv_transfer_params" not in upstreams["D"].received[-1]
    assert proxy.metrics.retries.labels("local_prefill")._value.get() == 1


def test_parallel_dispatch_needs_the_hybrid_connector(upstreams: dict[str, FakeUpstream]) -> None:
    config = ProxyConfig(
        prefill=[Backend("http://p")],
        decode=[Backend("http://d")],
        connector=Connector.NIXL,
        dispatch=Dispatch.PARALLEL,
    )
    with pytest.raises(ValueError, match="parallel"):
        PdProxy(config)


async def test_parallel_dispatch_calls_both_at_once(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    # P answers slowly; D must have been asked before P answered.
    upstreams["P"].answer_delay_s = 0.3
    url, _ = await make_proxy(dispatch=Dispatch.PARALLEL)
    task = asyncio.create_task(_post(url, "/v1/completions", {"model": MODEL, "prompt": "x"}))
    await asyncio.wait_for(upstreams["D"].started.wait(), timeout=5)
    assert not task.done()
    status, _ = await task
    assert status == 200
    d_params = upstreams["D"].received[0]["kv_transfer_params"]
    p_params = upstreams["P"].received[0]["kv_transfer_params"]
    assert d_params["transfer_id"] == p_params["transfer_id"]
    assert d_params["remote_rpc_address"] == "127.0.0.1:7777"


async def test_parallel_prefill_failure_cancels_decode(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    upstreams["P"].fail_status = 500
    upstreams["P"].answer_delay_s = 0.1
    upstreams["D"].answer_delay_s = 30.0  # D waits for KV that will never come
    url, _ = await make_proxy(dispatch=Dispatch.PARALLEL, max_retries=0)
    status, body = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert "prefill" in body["error"]["message"]
    await asyncio.wait_for(upstreams["D"].cancelled.wait(), timeout=5)


async def test_decode_4xx_is_relayed_and_5xx_becomes_502(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    url, _ = await make_proxy()
    upstreams["D"].fail_status = 400
    status, body = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 400
    assert body["error"]["message"] == "D fails"
    upstreams["D"].fail_status = 500
    status, body = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert "decode" in body["error"]["message"]


@pytest.mark.parametrize("dispatch", [Dispatch.SEQUENTIAL, Dispatch.PARALLEL])
async def test_a_rejected_decode_releases_the_prefill_blocks_at_once(
    upstreams: dict[str, FakeUpstream], dispatch: Dispatch
) -> None:
    """D answers 400 after P prefilled: the proxy sends the connector's release RPC to P."""
    from hybrid_connector.protocol import RELEASE, ReleaseRequest, ReleaseResponse
    from simple_rpc import CallContext, Server

    released: asyncio.Queue[ReleaseRequest] = asyncio.Queue()

    async def on_release(req: ReleaseRequest, _ctx: CallContext) -> ReleaseResponse:
        await released.put(req)
        return ReleaseResponse(transfer_id=req.transfer_id, released=True)

    rpc = Server()
    rpc.register(RELEASE, on_release)
    await rpc.start("127.0.0.1", 0)
    upstreams["D"].fail_status = 400
    upstreams["D"].answer_delay_s = 0.2  # P has answered by then, also in parallel mode
    proxy = PdProxy(
        ProxyConfig(
            prefill=[Backend(upstreams["P"].url, rpc_address=rpc.address)],
            decode=[Backend(upstreams["D"].url)],
            dispatch=dispatch,
        )
    )
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    try:
        status, _ = await _post(
            f"http://127.0.0.1:{port}", "/v1/completions", {"model": MODEL, "prompt": "x"}
        )
        assert status == 400
        req = await asyncio.wait_for(released.get(), timeout=5)
        tid = upstreams["P"].received[0]["kv_transfer_params"]["transfer_id"]
        assert req.transfer_id == tid
    finally:
        await runner.cleanup()
        await rpc.close()


async def test_unreachable_decode_is_a_502_and_the_proxy_survives(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy_url, proxy = await make_proxy(decode_urls=[dead], model_names=[MODEL])
    status, body = await _post(proxy_url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 502
    assert dead in body["error"]["message"]
    assert proxy.config.decode[0].inflight == 0
    async with aiohttp.ClientSession() as session, session.get(f"{proxy_url}/health") as resp:
        assert resp.status == 200


async def test_streaming_is_passed_through(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    url, _ = await make_proxy()
    body = {
        "model": MODEL,
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                texts += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(texts) == " a b c d"
    p_req = upstreams["P"].received[0]
    assert p_req["stream"] is False
    assert "stream_options" not in p_req


async def test_client_disconnect_mid_stream_closes_the_decode_call(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    upstreams["D"].tokens = [f" t{i}" for i in range(1000)]
    upstreams["D"].token_delay_s = 0.01
    url, proxy = await make_proxy()
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 1000}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{url}/v1/completions", json=body)
        await resp.content.readline()
        resp.close()
    await asyncio.wait_for(upstreams["D"].cancelled.wait(), timeout=5)
    assert proxy.config.decode[0].inflight == 0
    # Counted as the client's doing, not as a failure of D.
    assert proxy.metrics.client_disconnects._value.get() == 1
    assert proxy.metrics.upstream_errors.labels("decode")._value.get() == 0


async def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    """Before: the stream just stopped (no [DONE]), which clients read as a short answer."""
    upstreams["D"].break_after = 2
    url, proxy = await make_proxy()
    body = {"model": MODEL, "prompt": "x", "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        lines = [line.strip() async for line in resp.content if line.startswith(b"data:")]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert [e["choices"][0]["text"] for e in events[:2]] == [" a", " b"]
    assert "decode" in events[2]["error"]["message"]
    assert events[3]["choices"][0]["finish_reason"] == "error"
    assert lines[-1] == b"data: [DONE]"
    assert proxy.metrics.upstream_errors.labels("decode")._value.get() == 1
    assert proxy.metrics.client_disconnects._value.get() == 0


async def test_no_prefill_means_plain_forwarding(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    url, _ = await make_proxy(prefill=False)
    status, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 200
    assert upstreams["P"].received == []
    assert "kv_transfer_params" not in upstreams["D"].received[0]


async def test_models_health_and_metrics(make_proxy: Factory) -> None:
    url, _ = await make_proxy()
    await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
    await _post(url, "/v1/completions", b"{")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == MODEL
        async with session.get(f"{url}/health") as resp:
            health = await resp.json()
            assert health["prefill"][0]["rpc_address"] == "127.0.0.1:7777"
            assert health["models"] == [MODEL]
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
    assert 'pdserve_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'pdserve_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert "pdserve_prefill_seconds_count 1.0" in text


def test_least_loaded_prefers_idle_backends_and_rotates_ties() -> None:
    backends = [Backend(f"http://b{i}") for i in range(3)]
    router = Router([], backends)
    key = RequestKey()
    assert [router.pick_decode(key).url for _ in range(3)] == [
        "http://b0",
        "http://b1",
        "http://b2",
    ]
    backends[0].inflight = 2
    backends[1].inflight = 1
    assert router.pick_decode(key) is backends[2]
    backends[2].inflight = 5
    assert router.pick_decode(key) is backends[1]
    assert router.pick_decode(key, exclude={"http://b1"}) is backends[0]


async def test_requests_spread_over_decode_instances(make_proxy: Factory) -> None:
    d2 = FakeUpstream("D2")
    await d2.start()
    try:
        d1 = FakeUpstream("D1")
        await d1.start()
        try:
            url, _ = await make_proxy(decode_urls=[d1.url, d2.url])
            for _ in range(4):
                status, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
                assert status == 200
            assert len(d1.received) == 2
            assert len(d2.received) == 2
        finally:
            await d1.close()
    finally:
        await d2.close()


async def test_batch_and_n_are_single_pd_requests_merged_in_order(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    url, _ = await make_proxy()
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 2}  # no model: the served one
    status, answer = await _post(url, "/v1/completions", body)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert len(upstreams["P"].received) == 4
    d_prompts = sorted(r["prompt"] for r in upstreams["D"].received)
    assert d_prompts == ["a", "a", "b", "b"]
    assert all("n" not in r and r["model"] == MODEL for r in upstreams["D"].received)


@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_of_one_prompt_share_one_prefill(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream], stream: bool
) -> None:
    """The followers reach P only once the first choice's prefill answered (their prompt is in
    P's prefix cache by then); different prompts of a batch go at once."""
    upstreams["P"].answer_delay_s = 0.05
    url, _ = await make_proxy()
    body = {"prompt": "a", "n": 3, "max_tokens": 2, "temperature": 1.0, "stream": stream}
    status, _ = await _post(url, "/v1/completions", body)
    assert status == 200
    assert len(upstreams["P"].received) == 3
    # The lead's prefill ran alone, then the two followers' together (3 at once without).
    assert upstreams["P"].peak_active == 2, "a follower prefilled beside the lead"
    assert len(upstreams["D"].received) == 3

    upstreams["P"].peak_active = 0
    status, _ = await _post(url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
    assert status == 200
    assert upstreams["P"].peak_active == 2, "two prompts waited for each other"


async def test_a_client_cannot_make_a_request_wait_on_a_prefill_group(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    url, _ = await make_proxy()
    async with aiohttp.ClientSession() as session:
        headers = {"x-pdserve-prefill-group": "follow:nothing-of-ours"}
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
    assert len(upstreams["P"].received) == 1


async def test_scoring_request_goes_to_one_instance(
    make_proxy: Factory, upstreams: dict[str, FakeUpstream]
) -> None:
    url, _ = await make_proxy()
    body = {"model": MODEL, "prompt": ["a"], "max_tokens": 0, "echo": True, "logprobs": 1}
    status, answer = await _post(url, "/v1/completions", body)
    assert status == 200, answer
    assert upstreams["P"].received == []
    (d_req,) = upstreams["D"].received
    assert d_req["prompt"] == "a"
    assert "kv_transfer_params" not in d_req
