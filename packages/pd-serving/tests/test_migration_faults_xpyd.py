"""Live migration's faults on real vLLM (HybridConnector): D1 failing before or after the stop,
the target and D1 both failing at the switch, the client going away mid-migration.

The session's xPyD deployment behind an in-process proxy that knows P0 and its D's in the roles
each test gives them: a D "dies" as the proxy sees it through a TCP relay in front of it that
drops every connection and stops listening (``stand_ins.TcpRelay``: the vLLM behind it lives on
and aborts what it was asked, as a dead one would hold nothing), through a transfer address that
refuses connections, or as an address nobody listens on. Each stream must end token for token
as P1 answers the same prompt alone (or, with no D left, in the stream's error event), and no
instance may hold a block afterwards, well before the transfers' lease would free them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from harness.pool import Xpyd
from harness.ports import dead_address
from pd_serving import live
from pd_serving.client import complete, exact_length_prompt, greedy_body, load_tokenizer
from pd_serving.launcher import free_port
from pd_serving.proxy import PdProxy, serve
from pd_serving.routing import Backend
from prometheus_client.parser import text_string_to_metric_families
from stand_ins import TcpRelay, wait_until

pytestmark = [pytest.mark.needs_vllm, pytest.mark.timeout(900)]

PROMPT_TOKENS = 200
MAX_TOKENS = 120
MIGRATE_AFTER = 40  # tokens the client has before it asks for the migration
# Well inside the deployment's 30 s lease: what nobody released would still be held.
IDLE_WITHIN_S = 10.0
FINISH_LENGTH = b'"finish_reason":"length"'


async def _kv_usage(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:kv_cache_usage_perc"
    )


async def _assert_idle(session: aiohttp.ClientSession, xpyd: Xpyd) -> None:
    """No blocks held on either D or on P0 (each nudged: an idle instance shows its gauges as
    of its last step)."""

    async def usage() -> list[float]:
        out = []
        for url in [*xpyd.decode_urls, xpyd.prefill_urls[0]]:
            await complete(session, url, xpyd.model_name, "nudge", max_tokens=1)
            out.append(await _kv_usage(session, url))
        return out

    held = await wait_until(usage, lambda u: not any(u), within_s=IDLE_WITHIN_S)
    assert held == [0.0, 0.0, 0.0], "no blocks held on either D or on P"


@asynccontextmanager
async def _proxy(xpyd: Xpyd, decode: list[Backend], precopy: bool) -> AsyncIterator[Any]:
    config = xpyd.proxy_config(prefill_count=1)
    config.decode = decode
    config.health = None
    proxy = PdProxy(config)
    proxy.live.precopy = precopy
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    try:
        yield proxy, f"http://127.0.0.1:{port}"
        await proxy.drain_background()
        assert proxy.live.streams == {}
    finally:
        await runner.cleanup()


def _rpc(xpyd: Xpyd, url: str) -> str:
    return next(d["rpc_address"] for d in xpyd.decode if d["url"] == url)


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    on_tokens: Callable[[], Awaitable[Any]],
) -> list[dict[str, Any]]:
    """The client's events; ``on_tokens`` runs (as a task) once it has MIGRATE_AFTER tokens."""
    body = greedy_body(model, prompt, max_tokens=MAX_TOKENS, stream=True)
    body["stream_options"] = {"include_usage": True}
    events: list[dict[str, Any]] = []
    tokens = 0
    asked: asyncio.Task[Any] | None = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[5:])
            events.append(event)
            tokens += sum(len(c.get("token_ids") or []) for c in event.get("choices") or [])
            if asked is None and tokens >= MIGRATE_AFTER:
                asked = asyncio.create_task(on_tokens())
    assert asked is not None, "the stream ended before it was asked to move"
    events.append({"answer": await asked})
    return events


async def _migrate(session: aiohttp.ClientSession, url: str, **query: str) -> dict[str, Any]:
    async with session.post(f"{url}/admin/migrate", params=query) as resp:
        assert resp.status == 200, await resp.text()
        [one] = (await resp.json())["requests"]
        return one


def _tokens(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for c in e.get("choices") or [] for t in c.get("token_ids") or []]


def _only_on(proxy: PdProxy, backend: Backend) -> None:
    """New requests go to ``backend`` alone (the others count as draining for the router)."""
    proxy.router.draining.update(b.key for b in proxy.config.decode if b is not backend)


def _route_freely(proxy: PdProxy) -> None:
    proxy.router.draining.clear()


async def _reference(session: aiohttp.ClientSession, xpyd: Xpyd, prompt: str) -> list[int]:
    ref = await complete(
        session, xpyd.reference_url, xpyd.model_name, prompt, max_tokens=MAX_TOKENS
    )
    assert len(ref.token_ids) == MAX_TOKENS
    return ref.token_ids


def _prompt(xpyd: Xpyd, seed: int) -> str:
    return exact_length_prompt(load_tokenizer(xpyd.model), PROMPT_TOKENS, seed=seed)


@pytest.mark.parametrize("when", ["unreachable", "warming", "after_stop"])
async def test_d1_failing_mid_migration_the_target_recomputes(
    xpyd: Xpyd, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unreachable``: D1's transfer address refuses while D1 streams on: D1's stream is cut
    where the client has it. ``warming``: D1 dies while the target's warm-up pulls the pre-copy.
    ``after_stop``: D1 stopped the request and holds its KV, then dies before its last token
    reaches the proxy. The target recomputes the client's tokens; the stream goes on."""
    d0, d1 = xpyd.decode_urls
    prompt = _prompt(xpyd, seed=7600 + len(when))
    relay = TcpRelay(d0.removeprefix("http://"), die_on=FINISH_LENGTH * (when == "after_stop"))
    await relay.start()
    rpc = dead_address() if when == "unreachable" else _rpc(xpyd, d0)
    source = Backend(relay.url, rpc_address=rpc, name="source")
    target = Backend(d1, rpc_address=_rpc(xpyd, d1), name="target")
    warming = asyncio.Event()
    real_warm_up = live.LiveStream._warm_up

    async def warm_up(stream: Any, *args: Any) -> None:
        warming.set()
        if when == "warming":  # the warm-up goes on only once D1 died (or is cancelled)
            await relay.died.wait()
        await real_warm_up(stream, *args)

    monkeypatch.setattr(live.LiveStream, "_warm_up", warm_up)

    try:
        async with (
            aiohttp.ClientSession() as session,
            _proxy(xpyd, [source, target], precopy=when != "after_stop") as (proxy, url),
        ):
            want = await _reference(session, xpyd, prompt)
            _only_on(proxy, source)

            async def move() -> dict[str, Any]:
                _route_freely(proxy)
                asked = asyncio.create_task(_migrate(session, url, instance="source", to="target"))
                if when == "warming":
                    await warming.wait()
                    await relay.die()
                return await asked

            events = await _stream(session, url, xpyd.model_name, prompt, move)
            answer = events.pop()["answer"]
            await proxy.drain_background()
            await _assert_idle(session, xpyd)
    finally:
        await relay.close()
    assert (answer["outcome"], answer["recomputed"], answer["to"]) == ("moved", True, "target")
    assert _tokens(events) == want, "token for token, none lost, repeated or reordered"
    finishes = [c["finish_reason"] for e in events for c in e.get("choices") or []]
    assert [f for f in finishes if f is not None] == ["length"]
    usage = [e["usage"] for e in events if e.get("usage")][-1]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (PROMPT_TOKENS, MAX_TOKENS)


@pytest.mark.parametrize("precopy", [True, False], ids=["warm_up", "after_the_stop"])
async def test_a_target_that_refuses_leaves_the_request_on_d1(xpyd: Xpyd, precopy: bool) -> None:
    """The target refuses connections: its warm-up fails and the request stays on D1 (C
    released), or, stopped and copied, D1 takes the request back, pulling M from itself."""
    d0, _ = xpyd.decode_urls
    prompt = _prompt(xpyd, seed=7650 + precopy)
    source = Backend(d0, rpc_address=_rpc(xpyd, d0), name="source")
    refusing = Backend(f"http://{dead_address()}", rpc_address=dead_address(), name="refusing")
    async with (
        aiohttp.ClientSession() as session,
        _proxy(xpyd, [source, refusing], precopy=precopy) as (proxy, url),
    ):
        want = await _reference(session, xpyd, prompt)
        _only_on(proxy, source)

        async def move() -> dict[str, Any]:
            _route_freely(proxy)
            return await _migrate(session, url, instance="source", to="refusing")

        events = await _stream(session, url, xpyd.model_name, prompt, move)
        answer = events.pop()["answer"]
        await proxy.drain_background()
        await _assert_idle(session, xpyd)
    if precopy:
        assert answer["outcome"] == "refused", answer
        assert "warm-up" in answer["reason"]
    else:
        assert (answer["outcome"], answer["to"], answer["recomputed"]) == (
            "moved",
            "source",
            False,
        )
    assert _tokens(events) == want
    assert [e for e in events if "error" in e] == []


@pytest.mark.parametrize("third", [True, False], ids=["third_d", "no_d_left"])
async def test_the_target_and_d1_failing_at_the_switch(xpyd: Xpyd, third: bool) -> None:
    """Stop-and-copy to a D that refuses connections; D1 stopped the request, finished its
    stream and died, so taking it back fails too. A third D recomputes from the client's tokens;
    without one the stream ends in its error event. D1's KV for the move is released."""
    d0, d1 = xpyd.decode_urls
    prompt = _prompt(xpyd, seed=7700 + third)
    relay = TcpRelay(d0.removeprefix("http://"), die_on=b"data: [DONE]", pass_first=True)
    await relay.start()
    source = Backend(relay.url, rpc_address=_rpc(xpyd, d0), name="source")
    refusing = Backend(f"http://{dead_address()}", rpc_address=dead_address(), name="refusing")
    decode = [source, refusing]
    if third:
        decode.append(Backend(d1, rpc_address=_rpc(xpyd, d1), name="third"))
    try:
        async with (
            aiohttp.ClientSession() as session,
            _proxy(xpyd, decode, precopy=False) as (proxy, url),
        ):
            want = await _reference(session, xpyd, prompt)
            _only_on(proxy, source)

            async def move() -> dict[str, Any]:
                _route_freely(proxy)
                return await _migrate(session, url, instance="source", to="refusing")

            events = await _stream(session, url, xpyd.model_name, prompt, move)
            answer = events.pop()["answer"]
            await proxy.drain_background()
            await _assert_idle(session, xpyd)
    finally:
        await relay.close()
    assert relay.died.is_set()
    errors = [e["error"] for e in events if "error" in e]
    if third:
        assert (answer["outcome"], answer["recomputed"], answer["to"]) == ("moved", True, "third")
        assert _tokens(events) == want
        assert errors == []
        return
    assert answer["outcome"] == "failed", answer
    assert len(errors) == 1, errors
    assert "no decode instance left" in errors[0]["message"]
    got = _tokens(events)
    assert MIGRATE_AFTER <= len(got) < MAX_TOKENS
    assert got == want[: len(got)], "what came, once, in order"


@pytest.mark.parametrize("when", ["warming", "switching"])
async def test_a_client_gone_mid_migration_frees_both_sides(
    xpyd: Xpyd, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client closes its stream while the target's warm-up pulls the pre-copy, or while
    the target is called after the stop: every call is closed, D1's held blocks released."""
    d0, d1 = xpyd.decode_urls
    prompt = _prompt(xpyd, seed=7800 + len(when))
    source = Backend(d0, rpc_address=_rpc(xpyd, d0), name="source")
    target = Backend(d1, rpc_address=_rpc(xpyd, d1), name="target")
    reached = asyncio.Event()
    name = "_warm_up" if when == "warming" else "_switch"
    real = getattr(live.LiveStream, name)

    async def signalling(stream: Any, *args: Any) -> Any:
        reached.set()
        await asyncio.sleep(0)  # the client's disconnect comes first
        return await real(stream, *args)

    monkeypatch.setattr(live.LiveStream, name, signalling)

    async with (
        aiohttp.ClientSession() as session,
        _proxy(xpyd, [source, target], precopy=True) as (proxy, url),
    ):
        _only_on(proxy, source)
        body = greedy_body(xpyd.model_name, prompt, max_tokens=MAX_TOKENS, stream=True)
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            tokens = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    event = json.loads(line[5:])
                    tokens += sum(len(c["token_ids"] or []) for c in event["choices"])
                if tokens >= MIGRATE_AFTER:
                    break
            _route_freely(proxy)
            asked = asyncio.create_task(_migrate(session, url, instance="source"))
            await reached.wait()
            resp.close()  # the client goes away
        answer = await asked

        async def open_calls() -> int:
            return proxy.open_on(source) + proxy.open_on(target)

        assert await wait_until(open_calls, lambda n: n == 0) == 0, "every call closed"
        await proxy.drain_background()
        await _assert_idle(session, xpyd)
    assert answer["outcome"] in ("failed", "refused"), answer
