"""Failover on real vLLM (1P2D, HybridConnector): a D killed before the request, the proxy moves
the transfer to the other D, which pulls the KV P still holds; no second prefill.

One deployment for the module. Run under the lock: ``flock /tmp/bench.lock uv run --frozen
--no-sync pytest packages/pd-serving/tests/test_failover_vllm.py``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pd_serving.client import complete, exact_length_prompt, load_tokenizer
from pd_serving.deploy import Deployment
from pd_serving.launcher import free_port
from pd_serving.model import default_model_dir, make_model
from pd_serving.proxy import PdProxy, serve
from pd_serving.servers import Connector, Role, VllmServer, plan_servers
from prometheus_client.parser import text_string_to_metric_families
from stand_ins import wait_until

pytestmark = [pytest.mark.needs_vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12
PROMPT_TOKENS = 200


@dataclass
class OnePTwoD:
    model: Path
    deployment: Deployment
    prefill: VllmServer
    decode: list[VllmServer]


@pytest.fixture(scope="module")
def one_p_two_d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnePTwoD]:
    model = make_model(default_model_dir("qwen2"), "qwen2")
    servers = plan_servers(
        model,
        log_dir=tmp_path_factory.mktemp("failover-logs"),
        connector=Connector.HYBRID,
        prefill=1,
        decode=2,
    )
    with Deployment(servers) as deployment:
        deployment.start(timeout=600)
        yield OnePTwoD(
            model=model,
            deployment=deployment,
            prefill=deployment.by_role(Role.PREFILL)[0],
            decode=deployment.by_role(Role.DECODE),
        )


def _kill(deployment: Deployment, server: VllmServer) -> None:
    """SIGKILL the server's whole process group (API server, engine core, worker)."""
    proc = deployment._processes[deployment.servers.index(server)]
    assert proc.pid is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.exited.result(timeout=30)


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


async def test_a_killed_decode_fails_over_without_a_second_prefill(one_p_two_d: OnePTwoD) -> None:
    rig = one_p_two_d
    model = str(rig.model)
    tokenizer = load_tokenizer(rig.model)
    prompts = [exact_length_prompt(tokenizer, PROMPT_TOKENS, seed=7100 + i) for i in range(2)]
    p_url, (dead, alive) = rig.prefill.url, rig.decode
    config = rig.deployment.proxy_config(Connector.HYBRID, model_names=[model])
    config.health = None  # no active checks: the request itself must meet the dead D
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            # The reference: the same model computing it all by itself (P, without a transfer).
            reference = [
                await complete(session, p_url, model, p, max_tokens=MAX_TOKENS) for p in prompts
            ]
            _kill(rig.deployment, dead)
            requests = "vllm:request_success_total"
            p_before = await wait_until(
                lambda: _sum(session, p_url, requests), lambda v: v >= len(prompts)
            )
            pulled_before = await _sum(
                session,
                alive.url,
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
                    alive.url,
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
