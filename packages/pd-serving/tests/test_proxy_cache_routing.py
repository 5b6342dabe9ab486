"""Cache-aware routing through the proxy: stand-in instances with stand-in KV-event publishers;
the proxy subscribes, tokenizes text prompts on an instance, routes where the prefix is, counts
its decisions, and survives a publisher that sends garbage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import zmq.asyncio
from pd_serving.launcher import free_port
from pd_serving.proxy import PdProxy, ProxyConfig, serve
from pd_serving.routing import Backend, RoutingPolicy
from stand_ins import MODEL, FakeKvPublisher, FakeUpstream, tokens_of

WAIT_S = 30
SYSTEM = "You are a helpful assistant. " * 4  # 116 characters: 29 blocks of 4


@dataclass
class Deployment:
    url: str
    proxy: PdProxy
    decode: list[FakeUpstream]
    publishers: list[FakeKvPublisher]
    session: aiohttp.ClientSession

    async def complete(self, prompt: str | list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()

    def sample(self, name: str, **labels: str) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    async def caught_up(self, predicate) -> None:
        assert self.proxy.kv_feed is not None
        await asyncio.wait_for(self.proxy.kv_feed.wait_for(predicate), WAIT_S)

    def cached(self, backend: str, text: str) -> int:
        assert self.proxy.index is not None
        return self.proxy.index.lookup(tokens_of(text), [backend])[backend].local_tokens


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    context = zmq.asyncio.Context()
    decode = [FakeUpstream(f"D{i}") for i in range(2)]
    publishers = [FakeKvPublisher(context, free_port()) for _ in decode]
    for d in decode:
        await d.start()
    config = ProxyConfig(
        prefill=[],
        decode=[
            Backend(d.url, name=f"d{i}", kv_events=pub.endpoint)
            for i, (d, pub) in enumerate(zip(decode, publishers, strict=True))
        ],
        model_names=[MODEL],
        routing=RoutingPolicy(),
        health=None,
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    try:
        for pub in publishers:
            await pub.subscribed()
        async with aiohttp.ClientSession() as session:
            yield Deployment(f"http://127.0.0.1:{port}", proxy, decode, publishers, session)
    finally:
        await runner.cleanup()
        for d in decode:
            await d.close()
        for pub in publishers:
            pub.close()
        context.term()


async def test_a_prompt_goes_where_its_prefix_is_cached(deployment: Deployment) -> None:
    dep = deployment
    # Nothing known yet: by load (round robin), and nobody is asked to tokenize.
    await dep.complete(SYSTEM + "first")
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="index_empty") == 1
    assert not dep.decode[0].tokenized
    assert not dep.decode[1].tokenized
    # d1 reports the system prompt cached (what its vLLM would after serving it).
    await dep.publishers[1].send(dep.publishers[1].stored(tokens_of(SYSTEM)))
    await dep.caught_up(lambda: dep.cached("d1", SYSTEM) == 116)
    served_before = [len(d.received) for d in dep.decode]
    for tail in ("second", "third", "fourth"):
        await dep.complete(SYSTEM + tail)
    assert [len(d.received) - n for d, n in zip(dep.decode, served_before, strict=True)] == [0, 3]
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="cached_prefix") == 3
    tokenized = dep.decode[0].tokenized + dep.decode[1].tokenized
    assert [t["prompt"] for t in tokenized] == [SYSTEM + t for t in ("second", "third", "fourth")]
    assert dep.sample("pdserve_cache_tokenize_total", outcome="ok") == 3
    # Token ids need no tokenizing; a prompt nobody holds goes by load.
    await dep.complete([*tokens_of(SYSTEM), 1, 2, 3])
    assert len(tokenized) == 3
    await dep.complete("something else entirely, long enough to span blocks")
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="no_match") == 1
    # What the index holds, in /metrics and /health.
    assert dep.sample("pdserve_kv_events_total", backend="d1", kind="stored") == 29
    assert dep.sample("pdserve_kv_events_connected", backend="d1") == 1
    async with dep.session.get(f"{dep.url}/metrics") as resp:
        text = await resp.text()
    assert 'pdserve_prefix_index_blocks{backend="d1",view="local"} 29.0' in text
    async with dep.session.get(f"{dep.url}/health") as resp:
        health = await resp.json()
    d1 = health["decode"][1]
    assert d1["kv_events"] == dep.publishers[1].endpoint
    assert d1["prefix_index"] == {"blocks": 29, "store_blocks": 0, "last_seq": 0, "connected": True}


async def test_removed_blocks_and_garbage_fall_back_and_the_proxy_serves_on(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    dep = deployment
    pub = dep.publishers[0]
    stored = pub.stored(tokens_of(SYSTEM))
    await pub.send(stored)
    await dep.caught_up(lambda: dep.cached("d0", SYSTEM) == 116)
    await dep.complete(SYSTEM + "a")
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="cached_prefix") == 1
    # vLLM evicted the first block: nothing of the prompt matches any more.
    removed = {"type": "BlockRemoved", "block_hashes": stored["block_hashes"][:1], "medium": "GPU"}
    await pub.send(removed)
    await dep.caught_up(lambda: dep.cached("d0", SYSTEM) == 0)
    await dep.complete(SYSTEM + "b")
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="no_match") == 1
    # A message that does not decode: logged with the backend, its view forgotten.
    await pub.send(pub.stored(tokens_of(SYSTEM)))
    await dep.caught_up(lambda: dep.cached("d0", SYSTEM) == 116)
    await pub.send(raw=b"\x93\xc1")
    await dep.caught_up(lambda: dep.sample("pdserve_kv_event_decode_errors_total", backend="d0"))
    assert any("KV events of d0" in r.getMessage() for r in caplog.records)
    assert dep.cached("d0", SYSTEM) == 0
    assert dep.sample("pdserve_kv_event_resets_total", backend="d0", reason="decode_error") == 1
    await dep.complete(SYSTEM + "c")
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="index_empty") == 1
    # A sequence gap (events lost) forgets too, then the next batch is a new baseline.
    await pub.send(pub.stored(tokens_of(SYSTEM)))
    pub.seq += 5
    await pub.send(pub.stored(tokens_of(SYSTEM)))
    await dep.caught_up(lambda: dep.sample("pdserve_kv_event_resets_total", backend="d0",
                                           reason="gap"))  # fmt: skip
    assert dep.cached("d0", SYSTEM) == 116


async def test_a_failed_tokenization_routes_without_token_ids(deployment: Deployment) -> None:
    dep = deployment
    for d in dep.decode:
        d.tokenize_status = 500
    await dep.publishers[0].send(dep.publishers[0].stored(tokens_of(SYSTEM)))
    await dep.caught_up(lambda: dep.cached("d0", SYSTEM) == 116)
    await dep.complete(SYSTEM + "x")
    assert dep.sample("pdserve_cache_tokenize_total", outcome="failed") == 1
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="no_tokens") == 1
    # Chat messages are tokenized as the chat request has them.
    for d in dep.decode:
        d.tokenize_status = 200
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": SYSTEM + "y"}],
        "add_generation_prompt": True,
        "max_tokens": 2,
    }
    async with dep.session.post(f"{dep.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    asked = [t for d in dep.decode for t in d.tokenized if "messages" in t]
    assert asked == [{"model": MODEL, "messages": body["messages"], "add_generation_prompt": True}]
    assert dep.sample("pdserve_cache_routing_total", role="decode", reason="cached_prefix") == 1


async def test_without_events_or_with_routing_off_no_feed_is_made() -> None:
    backends = [Backend("http://127.0.0.1:1", name="d0", kv_events="tcp://127.0.0.1:1")]
    off = PdProxy(ProxyConfig([], backends, routing=RoutingPolicy(cache_aware=False)))
    assert off.index is None
    plain = PdProxy(ProxyConfig([], [Backend("http://127.0.0.1:1", name="d0")]))
    assert plain.index is None
