"""P, D and the proxy in three network namespaces, as three hosts would be: 1P1D HybridConnector
over kvt TCP answers token for token like a single instance, and D's prompt KV came over the
network from P (vLLM's ``prompt_tokens_by_source``), not from a recompute."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from e2e.helpers import prompt_tokens_by_source, wait_idle
from pd_serving.client import complete, exact_length_prompt, load_tokenizer
from pd_serving.servers import CPU_BLOCK_SIZE, Role

from .cluster import HostedCluster, reference_answers
from .conftest import needs_chaos_session

B = CPU_BLOCK_SIZE
PROMPT_LENGTHS = (1, B - 1, B, B + 1, 300, 5 * B + 60)
MAX_TOKENS = 16


@needs_chaos_session
@pytest.mark.timeout(900)
async def test_1p1d_across_three_namespaces_is_token_identical(
    netns_lab, tiny_model: Path, tmp_path: Path
) -> None:
    lab = netns_lab(["p0", "d0", "proxy"])
    cluster = HostedCluster(lab, tiny_model, tmp_path / "logs", prefill=1, decode=1)
    try:
        await asyncio.to_thread(cluster.start)
        proxy_url = await asyncio.to_thread(cluster.start_proxy)
        (prefill,) = cluster.by_role(Role.PREFILL)
        (decode,) = cluster.by_role(Role.DECODE)
        tokenizer = load_tokenizer(tiny_model)
        prompts = [exact_length_prompt(tokenizer, n, seed=900 + n) for n in PROMPT_LENGTHS]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{proxy_url}/health") as resp:
                health = await resp.json()
            # P advertises the address D reaches it on: its host's, not loopback.
            assert (
                health["prefill"][0]["rpc_address"]
                == f"{lab['p0'].address}:{prefill.server.rpc_port}"
            )
            expected = await reference_answers(
                session, cluster.single.url, cluster.model_name, prompts, MAX_TOKENS
            )
            got = await asyncio.gather(
                *(
                    complete(session, proxy_url, cluster.model_name, p, max_tokens=MAX_TOKENS)
                    for p in prompts
                )
            )
            for n, want, answer in zip(PROMPT_LENGTHS, expected, got, strict=True):
                assert answer.token_ids == want, (n, answer.text)
                assert answer.finish_reason == "length", n
            sources = await prompt_tokens_by_source(session, decode.url)
            # The prompts' KV came from P over the network, not from a recompute on D.
            total = sum(PROMPT_LENGTHS)
            assert sources.get("external_kv_transfer", 0) > total / 2, json.dumps(sources)
            assert sources.get("local_compute", 0) < total / 2, json.dumps(sources)

            async def nudge() -> None:
                body = {"model": cluster.model_name, "prompt": "idle?", "max_tokens": 1}
                async with session.post(f"{prefill.url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()

            readings = await wait_idle(session, [prefill.url, decode.url], before_each=nudge)
            for url, gauges in readings.items():
                assert all(v == 0.0 for v in gauges.values()), (url, gauges)
    finally:
        await asyncio.to_thread(cluster.stop)
    assert cluster.survivors() == []
