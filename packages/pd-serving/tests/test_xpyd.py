"""2P2D on the tiny model (HybridConnector): the answers of one instance (token for token, or
apart from a near tie, as vLLM compares models), load spread over both P's and both D's, prompts
sharing a prefix on one P.

The session's xPyD deployment (``harness.pool``'s ``xpyd``: ``pdserve up --prefill 2 --decode
2``); every test makes its own in-process proxy in front of its instances, with the active health
checker on, and compares with P1 asked directly (a plain request, no transfer: one instance's
answer). Instances' request counters (``vllm:request_success_total``) say who served what.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from harness.pool import Xpyd
from pd_serving.client import complete, exact_length_prompt, load_tokenizer
from pd_serving.demo import TOP_LOGPROBS, compare
from pd_serving.health import HealthCheckConfig
from pd_serving.launcher import free_port
from pd_serving.proxy import PdProxy, serve
from pd_serving.routing import RoutingPolicy
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.needs_vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12


@pytest.fixture
async def proxy(xpyd: Xpyd) -> AsyncIterator[tuple[str, PdProxy]]:
    config = xpyd.proxy_config()
    config.routing = RoutingPolicy()  # prefix affinity on (256 chars), no bypass
    config.health = HealthCheckConfig(interval_s=0.5, timeout_s=5)
    pd_proxy = PdProxy(config)
    port = free_port()
    runner = await serve(pd_proxy, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", pd_proxy
    finally:
        await runner.cleanup()


async def _served(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:request_success"
        for s in family.samples
        if s.name == "vllm:request_success_total"
    )


async def _counts(session: aiohttp.ClientSession, urls: list[str]) -> list[float]:
    return [await _served(session, url) for url in urls]


async def _settled_counts(
    session: aiohttp.ClientSession, urls: list[str], total: float
) -> list[float]:
    """vLLM counts a request once its output is processed, which may trail the HTTP answer by a
    moment; re-read (backoff, up to 30 s) until ``total`` requests are counted."""
    delay, deadline = 0.01, time.monotonic() + 30
    while True:
        counts = await _counts(session, urls)
        if sum(counts) >= total or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def _answers(session, url: str, model: str, prompts: list[str], concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str):
        async with gate:
            return await complete(
                session, url, model, prompt, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS
            )

    return await asyncio.gather(*(one(p) for p in prompts))


async def test_2p2d_answers_as_one_instance_and_spreads_load(xpyd: Xpyd, proxy) -> None:
    url, pd_proxy = proxy
    tokenizer = load_tokenizer(xpyd.model)
    prompts = [exact_length_prompt(tokenizer, 200, seed=1000 + i) for i in range(12)]
    model = str(xpyd.model)
    async with aiohttp.ClientSession() as session:
        reference = await _answers(session, xpyd.reference_url, model, prompts, 4)
        p_before = await _counts(session, xpyd.prefill_urls)
        d_before = await _counts(session, xpyd.decode_urls)
        got = await _answers(session, url, model, prompts, 4)
        p_after = await _settled_counts(session, xpyd.prefill_urls, sum(p_before) + len(prompts))
        d_after = await _settled_counts(session, xpyd.decode_urls, sum(d_before) + len(prompts))
        await asyncio.wait_for(pd_proxy.health.round_done.wait(), 30)
        async with session.get(f"{url}/health") as resp:
            health = await resp.json()
    # Four requests at a time batch differently on one instance than over two P's and two D's,
    # and a random-weight model's greedy token can flip where two logits nearly tie: a
    # divergence counts only where each side's token is among the other's top logprobs.
    verdicts = [compare(ref, out, near_ties=True) for ref, out in zip(reference, got, strict=True)]
    print(f"answers: {verdicts}")
    assert all(len(ref.token_ids) == MAX_TOKENS for ref in reference)
    pairs = zip(reference, got, strict=True)
    assert "NO" not in verdicts, [(r.token_ids, o.token_ids) for r, o in pairs]
    p_served = [a - b for a, b in zip(p_after, p_before, strict=True)]
    d_served = [a - b for a, b in zip(d_after, d_before, strict=True)]
    print(f"P served {p_served}, D served {d_served}")
    assert sum(p_served) == len(prompts)
    assert sum(d_served) == len(prompts)
    assert min(p_served) >= 2, p_served  # distinct prefixes hash over both P's
    assert min(d_served) >= 2, d_served  # D by load: 4 in flight over two D's
    for entry in [*health["prefill"], *health["decode"]]:
        assert entry["state"] == "closed", entry
        assert set(entry["load"]) == {"waiting", "running", "kv_usage"}


async def test_shared_prefix_prompts_land_on_one_prefill(xpyd: Xpyd, proxy) -> None:
    url, _ = proxy
    tokenizer = load_tokenizer(xpyd.model)
    model = str(xpyd.model)
    system = exact_length_prompt(tokenizer, 160, seed=77)
    groups = [
        [system + exact_length_prompt(tokenizer, 48, seed=500 + i) for i in range(4)],
        [
            exact_length_prompt(tokenizer, 160, seed=78)
            + exact_length_prompt(tokenizer, 48, seed=i)
            for i in range(4)
        ],
    ]
    async with aiohttp.ClientSession() as session:
        for prompts in groups:
            reference = await _answers(session, xpyd.reference_url, model, prompts, 1)
            before = await _counts(session, xpyd.prefill_urls)
            got = await _answers(session, url, model, prompts, 1)
            after = await _settled_counts(session, xpyd.prefill_urls, sum(before) + len(prompts))
            for ref, out in zip(reference, got, strict=True):
                assert out.token_ids == ref.token_ids
            served = sorted(a - b for a, b in zip(after, before, strict=True))
            print(f"shared prefix: P served {served}")
            assert served == [0, len(prompts)], served
