"""Draining a real D (HybridConnector): the streams in flight migrate to the other D.

The session's xPyD deployment behind an in-process proxy. The other D drains first, so every
request goes to the one D; once each client has some tokens that D drains. Every stream must
end token for token as P1 answers the same prompt alone, none may fail, the D must report
drained, and no instance may hold a block afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from harness.pool import Xpyd
from pd_serving.client import complete, exact_length_prompt, greedy_body, load_tokenizer
from pd_serving.launcher import free_port
from pd_serving.proxy import PdProxy, serve
from prometheus_client.parser import text_string_to_metric_families
from stand_ins import wait_all_gone, wait_until

pytestmark = [pytest.mark.needs_vllm, pytest.mark.timeout(900)]

STREAMS = 4
PROMPT_TOKENS = 120
MAX_TOKENS = 160
DRAIN_AFTER = 30  # tokens every client has before the drain


async def _kv_usage(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:kv_cache_usage_perc"
    )


async def test_drain_moves_streams_in_flight_token_for_token(xpyd: Xpyd) -> None:
    model = xpyd.model_name
    tokenizer = load_tokenizer(xpyd.model)
    prompts = [exact_length_prompt(tokenizer, PROMPT_TOKENS, seed=7400 + i) for i in range(4)]
    config = xpyd.proxy_config(prefill_count=1)
    config.health = None
    proxy = PdProxy(config)
    source, other = config.decode[0], config.decode[1]
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    enough = asyncio.Event()
    counts = [0] * STREAMS

    async def client(session: aiohttp.ClientSession, i: int) -> list[int]:
        body = greedy_body(model, prompts[i], max_tokens=MAX_TOKENS, stream=True)
        tokens: list[int] = []
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[5:])
                assert "error" not in event, event
                for choice in event.get("choices") or []:
                    tokens += choice.get("token_ids") or []
                counts[i] = len(tokens)
                if min(counts) >= DRAIN_AFTER:
                    enough.set()
        return tokens

    async def admin(session: aiohttp.ClientSession, path: str, **query: str) -> list[dict]:
        async with session.post(f"{url}/admin/{path}", params=query) as resp:
            assert resp.status == 200, await resp.text()
            return [json.loads(line) for line in (await resp.text()).splitlines()]

    try:
        async with aiohttp.ClientSession() as session:
            references = [
                (await complete(session, xpyd.reference_url, model, p, max_tokens=MAX_TOKENS))
                for p in prompts
            ]
            await admin(session, "drain", instance=other.key)
            clients = [asyncio.create_task(client(session, i)) for i in range(STREAMS)]
            await enough.wait()
            await admin(session, "undrain", instance=other.key)
            reports = await admin(session, "drain", instance=source.key, wait="120")
            outputs = await asyncio.gather(*clients)

            async def idle() -> list[float]:
                usage = []
                for d in [*xpyd.decode_urls, xpyd.prefill_urls[0]]:
                    await complete(session, d, model, "nudge", max_tokens=1)  # fresh gauges
                    usage.append(await _kv_usage(session, d))
                return usage

            usage = await wait_until(idle, lambda u: not any(u))
        await proxy.drain_background()
    finally:
        await runner.cleanup()
    final = reports[-1]
    print("drain report:", final)
    assert final["phase"] == "drained", reports
    assert final["failed"] == 0
    assert final["moved"] + final["staying"] == STREAMS
    assert final["moved"] >= 1, final
    for got, reference in zip(outputs, references, strict=True):
        assert got == reference.token_ids, "token for token as never migrated"
    assert usage == [0.0, 0.0, 0.0], "no blocks held on either D or on P"


def _supervisor_of(pdserve_pid: int, name: str) -> int:
    """The pid of ``pd_serving.supervise`` running instance ``name`` under ``pdserve up``."""
    from e2e.helpers import descendants

    for pid in descendants(pdserve_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pd_serving.supervise" in argv and name.encode() in argv:
            return pid
    raise AssertionError(f"no supervisor of {name} under pdserve (pid {pdserve_pid})")


@pytest.mark.destroys("xpyd")  # one D of it stops for good
async def test_sigterm_to_a_d_drains_it_and_the_deployment_goes_on(xpyd: Xpyd) -> None:
    """``pdserve up``'s own proxy: SIGTERM to decode1 (its supervisor) migrates its streams to
    decode0, token for token, then decode1 stops and pdserve goes on serving."""
    assert xpyd.pdserve.pid is not None
    model = xpyd.model_name
    tokenizer = load_tokenizer(xpyd.model)
    prompts = [exact_length_prompt(tokenizer, PROMPT_TOKENS, seed=7500 + i) for i in range(4)]
    url = xpyd.proxy_url
    enough = asyncio.Event()
    counts = [0] * STREAMS
    decode0, decode1 = "decode0", "decode1"
    supervisor = _supervisor_of(xpyd.pdserve.pid, decode1)
    gone = asyncio.get_running_loop().run_in_executor(
        None, wait_all_gone, {supervisor}, float(MAX_TOKENS)
    )

    async def client(session: aiohttp.ClientSession, i: int) -> list[int]:
        body = greedy_body(model, prompts[i], max_tokens=MAX_TOKENS, stream=True)
        tokens: list[int] = []
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[5:])
                assert "error" not in event, event
                for choice in event.get("choices") or []:
                    tokens += choice.get("token_ids") or []
                counts[i] = len(tokens)
                if min(counts) >= DRAIN_AFTER:
                    enough.set()
        return tokens

    async def admin(session: aiohttp.ClientSession, path: str, **query: str) -> None:
        async with session.post(f"{url}/admin/{path}", params=query) as resp:
            assert resp.status == 200, await resp.text()

    async with aiohttp.ClientSession() as session:
        references = [
            (await complete(session, xpyd.reference_url, model, p, max_tokens=MAX_TOKENS))
            for p in prompts
        ]
        await admin(session, "drain", instance=decode0)  # every stream on decode1
        clients = [asyncio.create_task(client(session, i)) for i in range(STREAMS)]
        await enough.wait()
        await admin(session, "undrain", instance=decode0)
        os.kill(supervisor, signal.SIGTERM)
        outputs = await asyncio.gather(*clients)
        assert await gone == set(), "decode1 did not stop after its drain"
        async with session.get(f"{url}/admin/drain") as resp:
            (report,) = [d for d in (await resp.json())["drains"] if d["instance"] == decode1]
        after = await complete(session, url, model, prompts[0], max_tokens=8)
    print("SIGTERM drain report:", report)
    for got, reference in zip(outputs, references, strict=True):
        assert got == reference.token_ids, "token for token as never migrated"
    assert report["phase"] == "drained", report
    assert report["moved"] >= 1, report
    assert after.token_ids == references[0].token_ids[:8], "pdserve serves on decode0"
    assert not xpyd.pdserve.exited.done(), "pdserve stopped with decode1"
