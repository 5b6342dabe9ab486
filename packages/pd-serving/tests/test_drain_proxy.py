"""Drains and rebalancing through the proxy against stand-in decode instances (no vLLM).

The stand-in D's (``stand_ins.FakeDecode``) stream a deterministic model and answer
MIGRATE_OUT as D1's connector does; each stream pauses after a few tokens until it is migrated
or let go, so the drain meets every stream in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from pd_serving import cli
from pd_serving.drain import DrainConfig
from pd_serving.health import InstanceLoad
from pd_serving.launcher import free_port
from pd_serving.proxy import Backend, PdProxy, ProxyConfig, serve
from pd_serving.rebalance import RebalanceConfig
from stand_ins import (
    MODEL,
    PREFILL_RPC,
    FakeDecode,
    fake_prefill,
    model_tokens,
)

MAX_TOKENS = 12
PAUSE_AFTER = 4


def _prompt(i: int) -> list[int]:
    return [11 + i, 12 + i, 13 + i, 100 + i]


@dataclass
class Rig:
    d1: FakeDecode
    d2: FakeDecode
    proxy: PdProxy
    url: str

    async def stream(self, prompt: list[int]) -> list[int]:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "return_token_ids": True,
        }
        tokens: list[int] = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                    for choice in json.loads(line[5:]).get("choices") or []:
                        tokens += choice.get("token_ids") or []
        return tokens

    async def admin(self, path: str, **query: str) -> list[dict[str, Any]]:
        """The endpoint's answer, one dict per NDJSON line."""
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/admin/{path}", params=query) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return [json.loads(line) for line in (await resp.text()).splitlines()]

    async def get(self, path: str) -> Any:
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}{path}") as resp:
            return await resp.json() if path != "/metrics" else await resp.text()

    async def all_paused(self, d: FakeDecode, n: int) -> None:
        """Until ``n`` streams of ``d`` registered with the proxy (they pause on d)."""
        live = self.proxy.live
        changed = asyncio.Event()
        hook = live.on_change

        def on_change(key: str) -> None:
            hook(key)
            changed.set()

        live.on_change = on_change
        try:
            while len(live.streams.get(d.name, ())) < n:
                await changed.wait()
                changed.clear()
        finally:
            live.on_change = hook


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    p = fake_prefill()
    d1, d2 = (FakeDecode(f"d{i}", pause_after=PAUSE_AFTER) for i in (1, 2))
    for upstream in (p, d1, d2):
        await upstream.start()
    config = ProxyConfig(
        prefill=[Backend(p.url, rpc_address=PREFILL_RPC, name="p")],
        decode=[
            Backend(d1.url, rpc_address=d1.rpc_address, name="d1"),
            Backend(d2.url, rpc_address=d2.rpc_address, name="d2"),
        ],
        model_names=[MODEL],
        health=None,
        rebalance=RebalanceConfig(cooldown_s=0.0, max_per_interval=1),
        drain=DrainConfig(retry_after_s=0.01),
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    rig = Rig(d1, d2, proxy, f"http://127.0.0.1:{port}")
    try:
        yield rig
        await proxy.drain_background()
        assert proxy.live.streams == {}, "every stream unregistered"
    finally:
        await runner.cleanup()
        for upstream in (p, d1, d2):
            await upstream.close()


async def _on_d1(rig: Rig, n: int) -> list[asyncio.Task[list[int]]]:
    """``n`` streams on d1, paused (d2 drained while they were routed, then undrained)."""
    [report] = await rig.admin("drain", instance="d2")
    assert report["phase"] == "drained", "nothing on it: drained at once"
    clients = [asyncio.create_task(rig.stream(_prompt(i))) for i in range(n)]
    await rig.all_paused(rig.d1, n)
    assert not rig.d2.received, "a draining D gets no new request"
    [report] = await rig.admin("undrain", instance="d2")
    assert report["phase"] == "resumed"
    return clients


async def test_drain_moves_every_stream_token_for_token(rig: Rig) -> None:
    clients = await _on_d1(rig, 4)
    reports = await rig.admin("drain", instance="d1", wait="30", concurrency="2")
    outputs = await asyncio.gather(*clients)
    assert outputs == [model_tokens(_prompt(i), MAX_TOKENS) for i in range(4)]
    final = reports[-1]
    assert final["phase"] == "drained", reports
    assert (final["moved"], final["failed"], final["calls"]) == (4, 0, 0)
    assert max(r["migrating"] for r in reports) <= 2, "the concurrency bound"
    health = await rig.get("/health")
    assert [d["drain"] for d in health["decode"]] == ["drained", "serving"]
    metrics = await rig.get("/metrics")
    assert 'pdserve_instance_drain_state{backend="d1"} 2.0' in metrics
    assert 'pdserve_drain_migrations_total{backend="d1",outcome="moved"} 4.0' in metrics
    # drained: the next request goes to d2 only
    rig.d2.pause_after = None
    assert await rig.stream(_prompt(9)) == model_tokens(_prompt(9), MAX_TOKENS)
    [status] = (await rig.get("/admin/drain"))["drains"][-1:]
    assert status["instance"] == "d1"


async def test_without_another_d_streams_finish_in_place(rig: Rig) -> None:
    clients = await _on_d1(rig, 2)
    await rig.admin("drain", instance="d2")  # d2 drains again: nowhere to go
    [report] = await rig.admin("drain", instance="d1")
    assert report["phase"] == "draining"
    while rig.proxy.drains.drains["d1"].report(0)["staying"] < 2:
        await rig.proxy.drains.progress.wait()
    for stream in rig.d1.streams.values():
        stream.proceed.set()
    outputs = await asyncio.gather(*clients)
    assert outputs == [model_tokens(_prompt(i), MAX_TOKENS) for i in range(2)]
    final = (await rig.admin("drain", instance="d1", wait="30"))[-1]
    assert final["phase"] == "drained"
    assert final["stayed"] == {"no other decode instance to migrate to": 2}
    assert final["moved"] == 0


async def test_refused_migrations_are_retried_then_finish_in_place(rig: Rig) -> None:
    clients = await _on_d1(rig, 1)
    rig.d1.refuse_migration = True
    await rig.admin("drain", instance="d1")
    drain = rig.proxy.drains.drains["d1"]
    while drain.report(0)["staying"] < 1:
        await rig.proxy.drains.progress.wait()
    assert drain.refusals == drain.config.max_attempts
    for stream in rig.d1.streams.values():
        stream.proceed.set()
    await asyncio.gather(*clients)
    final = (await rig.admin("drain", instance="d1", wait="30"))[-1]
    assert final["phase"] == "drained"
    assert list(final["stayed"]) == ["refused: not here"]


async def test_unknown_instance_is_a_404(rig: Rig) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{rig.url}/admin/drain", params={"instance": "nope"}) as resp,
    ):
        assert resp.status == 404


async def test_rebalance_moves_a_stream_off_a_hot_d(rig: Rig) -> None:
    clients = await _on_d1(rig, 2)
    rebalancer = rig.proxy.rebalancer
    assert rebalancer is not None
    d1, d2 = rig.proxy.config.decode
    rig.proxy.router.update_load(d1, InstanceLoad(running=2, kv_usage=0.9))
    rig.proxy.router.update_load(d2, InstanceLoad(kv_usage=0.1))
    [moved] = rebalancer.step()
    assert (await moved)["outcome"] == "moved"
    assert rebalancer.step() == [], "the limit per interval"
    for stream in rig.d1.streams.values():
        stream.proceed.set()
    outputs = await asyncio.gather(*clients)
    assert outputs == [model_tokens(_prompt(i), MAX_TOKENS) for i in range(2)]
    metrics = await rig.get("/metrics")
    assert 'pdserve_rebalance_decisions_total{decision="migrate"} 1.0' in metrics
    assert 'pdserve_rebalance_decisions_total{decision="rate_limited"} 1.0' in metrics
    assert 'pdserve_rebalance_migrations_total{outcome="moved"} 1.0' in metrics


async def test_pdserve_drain_waits_and_prints(rig: Rig, capsys: pytest.CaptureFixture) -> None:
    clients = await _on_d1(rig, 2)
    args = cli.build_parser().parse_args(["drain", "d1", "--proxy", rig.url, "--timeout", "30"])
    assert await asyncio.to_thread(args.func, args) == 0
    await asyncio.gather(*clients)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("d1: drained after"), lines
    assert "moved 2" in lines[-1]
    args = cli.build_parser().parse_args(["undrain", "d1", "--proxy", rig.url])
    assert await asyncio.to_thread(args.func, args) == 0
    assert rig.proxy.router.draining == set()


async def test_sigterm_drains_before_the_proxy_stops(rig: Rig) -> None:
    """``pdserve up``'s serving loop: SIGTERM waits for the stream in flight (grace)."""
    config = ProxyConfig(
        prefill=rig.proxy.config.prefill,
        decode=[Backend(rig.d1.url, rpc_address=rig.d1.rpc_address, name="d1")],
        model_names=[MODEL],
        health=None,
    )
    proxy = PdProxy(config)
    port = free_port()
    served = asyncio.create_task(cli._run_proxy(proxy, "127.0.0.1", port, None, drain_grace_s=30.0))
    other = Rig(rig.d1, rig.d2, proxy, f"http://127.0.0.1:{port}")
    while True:  # the proxy's server is up once a connection is accepted
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.01)  # startup has no event to wait on from outside
            continue
        writer.close()
        break
    client = asyncio.create_task(other.stream(_prompt(0)))
    await other.all_paused(rig.d1, 1)
    os.kill(os.getpid(), signal.SIGTERM)
    while proxy.drains.drains.get("d1") is None:
        await proxy.drains.progress.wait()
    assert not served.done(), "the drain waits for the stream"
    for stream in rig.d1.streams.values():
        stream.proceed.set()
    assert await client == model_tokens(_prompt(0), MAX_TOKENS)
    assert await served == 0
