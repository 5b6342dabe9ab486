"""Failover on real vLLM (HybridConnector): a D that refuses connections, the proxy moves the
transfer to the other D, which pulls the KV P still holds; no second prefill.

The session's xPyD deployment, behind an in-process proxy that knows P0 only and two D's: a dead
address first (what a killed D looks like to the proxy: connection refused) and D0.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from harness.pool import Xpyd
from harness.ports import dead_address
from pd_serving.client import complete, exact_length_prompt, load_tokenizer
from pd_serving.launcher import free_port
from pd_serving.proxy import PdProxy, serve
from prometheus_client.parser import text_string_to_metric_families
from stand_ins import wait_until

pytestmark = [pytest.mark.needs_vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12
PROMPT_TOKENS = 200


async def _samples(session: aiohttp.ClientSession, url: str) -> list[Any]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


async def _sum(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in await _samples(session, url)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_a_dead_decode_fails_over_without_a_second_prefill(xpyd: Xpyd) -> None:
    model = xpyd.model_name
    tokenizer = load_tokenizer(xpyd.model)
    prompts = [exact_length_prompt(tokenizer, PROMPT_TOKENS, seed=7100 + i) for i in range(2)]
    p_url, alive_url = xpyd.prefill_urls[0], xpyd.decode_urls[0]
    dead_url = f"http://{dead_address()}"
    config = xpyd.proxy_config(prefill_count=1, decode_urls=[dead_url, alive_url])
    config.health = None  # no active checks: the request itself must meet the dead D
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            requests = "vllm:request_success_total"
            served_before = await _sum(session, p_url, requests)
            # The reference: the same model computing it all by itself (P, without a transfer).
            reference = [
                await complete(session, p_url, model, p, max_tokens=MAX_TOKENS) for p in prompts
            ]
            p_before = await wait_until(
                lambda: _sum(session, p_url, requests),
                lambda v: v >= served_before + len(prompts),
            )
            pulled_before = await _sum(
                session,
                alive_url,
                "vllm:prompt_tokens_by_source_total",
                source="external_kv_transfer",
            )
            # Round robin over two idle D's: of two requests, at least one meets the dead D first.
            got = [await complete(session, url, model, p, max_tokens=MAX_TOKENS) for p in prompts]
            p_after = await wait_until(
                lambda: _sum(session, p_url, requests), lambda v: v >= p_before + len(prompts)
            )
            pulled = (
                await _sum(
                    session,
                    alive_url,
                    "vllm:prompt_tokens_by_source_total",
                    source="external_kv_transfer",
                )
                - pulled_before
            )

            async def p_kv_usage() -> float:
                # An idle P shows its gauges as of its last step: one tiny request makes it step.
                await complete(session, p_url, model, "nudge", max_tokens=1)
                return await _sum(session, p_url, "vllm:kv_cache_usage_perc")

            usage = await wait_until(p_kv_usage, lambda v: v == 0.0)
        failovers = proxy.metrics.registry.get_sample_value(
            "pdserve_failovers_total", {"stage": "decode", "reason": "refused"}
        )
    finally:
        await runner.cleanup()
    for ref, out in zip(reference, got, strict=True):
        assert len(ref.token_ids) == MAX_TOKENS
        assert out.token_ids == ref.token_ids  # token for token
    assert failovers is not None
    assert failovers >= 1
    assert p_after - p_before == len(prompts)  # P prefilled each request exactly once
    # D2 took each prompt's KV from P (all but the last token, which D computes), none recomputed.
    assert pulled >= len(prompts) * (PROMPT_TOKENS - 1), pulled
    assert usage == 0.0  # no blocks left on P
