"""Live migration through the proxy against stand-in decode instances (no vLLM).

A stand-in D streams a deterministic model (each token a function of the one before), so a
request continued from its prompt plus the tokens so far goes on exactly as it would have; its
MIGRATE_OUT stops the stream after one more token and answers with the tokens, as D1's
connector does. The client's stream must be the unmoved one, event for event in content.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hybrid_connector.contract import PullParams, decode_params
from hybrid_connector.migration import MIGRATE_OUT, MigrateOutRequest, MigrateOutResponse
from hybrid_connector.protocol import RELEASE, ReleaseRequest, ReleaseResponse
from pd_serving.launcher import free_port
from pd_serving.proxy import Backend, PdProxy, ProxyConfig, serve
from simple_rpc import CallContext, Server
from stand_ins import MODEL, FakeUpstream

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 12
PAUSE_AFTER = 4  # D1 streams this many tokens, then waits for the test


def _next(token: int) -> int:
    return (token * 7 + 3) % 1000


def _expected(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = _next(last)
        out.append(last)
    return out


@dataclass
class _Stream:
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    stop_at: int | None = None
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    proceed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class FakeDecode:
    """A D with HybridConnector as the proxy sees it: /v1/completions streaming the model, and
    a transfer_kv server answering MIGRATE_OUT and RELEASE."""

    name: str
    refuse_migration: bool = False
    hang: bool = False  # never answer generation requests
    pause_first: bool = True
    received: list[dict[str, Any]] = field(default_factory=list)
    streams: dict[str, _Stream] = field(default_factory=dict)
    releases: list[ReleaseRequest] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    called: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    rpc_address: str = ""
    _runner: web.AppRunner | None = None
    _rpc: Server | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        self._rpc = Server()
        self._rpc.register(MIGRATE_OUT, self._on_migrate_out)
        self._rpc.register(RELEASE, self._on_release)
        self.rpc_address = await self._rpc.start("127.0.0.1", 0)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._rpc is not None:
            await self._rpc.close()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.called.set()
        if self.hang:
            await asyncio.Event().wait()
        params = decode_params(body.get("kv_transfer_params"))
        assert isinstance(params, PullParams)
        stream = self.streams[params.transfer_id] = _Stream(list(body["prompt"]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        last = stream.prompt[-1]
        for i in range(body["max_tokens"]):
            if self.pause_first and len(self.received) == 1 and i == PAUSE_AFTER:
                stream.paused.set()
                await stream.proceed.wait()
            last = _next(last)
            stream.outputs.append(last)
            ends = i == body["max_tokens"] - 1 or len(stream.outputs) == stream.stop_at
            choice = {
                "index": 0,
                "text": f" t{last}",
                "token_ids": [last],
                "finish_reason": "length" if ends else None,
            }
            if i == 0 and body.get("return_token_ids"):
                choice["prompt_token_ids"] = stream.prompt
            event = {
                "id": f"cmpl-{self.name}-{len(self.received)}",
                "object": "text_completion",
                "created": 1000 + len(self.received),
                "model": MODEL,
                "choices": [choice],
            }
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if ends:
                break
        stream.ended.set()
        usage = {"prompt_tokens": len(stream.prompt), "completion_tokens": len(stream.outputs)}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _on_migrate_out(self, req: MigrateOutRequest, _ctx: CallContext):
        stream = self.streams.get(req.transfer_id)
        if stream is None or self.refuse_migration:
            return MigrateOutResponse(req.transfer_id, stopped=False, reason="not here")
        stream.stop_at = len(stream.outputs) + 1
        stream.proceed.set()
        await stream.ended.wait()
        return MigrateOutResponse(
            req.transfer_id,
            stopped=True,
            migration_id=req.migration_id,
            remote_rpc_address=self.rpc_address,
            num_tokens=len(stream.prompt) + len(stream.outputs) - 1,
            prompt_token_ids=stream.prompt,
            output_token_ids=stream.outputs,
        )

    async def _on_release(self, req: ReleaseRequest, _ctx: CallContext) -> ReleaseResponse:
        self.releases.append(req)
        self.released.set()
        return ReleaseResponse(req.transfer_id, released=True)


@dataclass
class Rig:
    p: FakeUpstream
    d1: FakeDecode
    d2: FakeDecode
    proxy: PdProxy
    url: str

    async def stream(self, **extra: Any) -> list[dict[str, Any]]:
        """The client's events (``[DONE]`` as {"done": True})."""
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        events = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    events.append({"done": True})
                elif line.startswith(b"data:"):
                    events.append(json.loads(line[5:]))
        return events

    async def migrate(self, **query: str) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/admin/migrate", params=query) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return await resp.json()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    p = FakeUpstream(
        "P",
        kv_params=lambda kv: {
            "do_remote_prefill": True,
            "transfer_id": kv["transfer_id"],
            "remote_rpc_address": "127.0.0.1:1",
        },
    )
    d1, d2 = FakeDecode("D1"), FakeDecode("D2", pause_first=False)
    for upstream in (p, d1, d2):
        await upstream.start()
    config = ProxyConfig(
        prefill=[Backend(p.url, rpc_address="127.0.0.1:1", name="p")],
        decode=[
            Backend(d1.url, rpc_address=d1.rpc_address, name="d1"),
            Backend(d2.url, rpc_address=d2.rpc_address, name="d2"),
        ],
        model_names=[MODEL],
        health=None,
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    rig = Rig(p, d1, d2, proxy, f"http://127.0.0.1:{port}")
    try:
        yield rig
        await proxy.drain_background()
        assert proxy.live.streams == {}, "every stream unregistered"
    finally:
        await runner.cleanup()
        for upstream in (p, d1, d2):
            await upstream.close()


def _tokens(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for c in e.get("choices") or [] for t in c.get("token_ids") or []]


async def _paused(rig: Rig) -> None:
    """D1 (the proxy's first pick: d1 before d2) streamed PAUSE_AFTER tokens and waits."""
    await rig.d1.called.wait()
    [stream] = rig.d1.streams.values()
    await stream.paused.wait()


async def test_a_stream_moves_to_another_d_token_for_token(rig: Rig) -> None:
    client = asyncio.create_task(rig.stream())
    await _paused(rig)
    answer = await rig.migrate(instance="d1", to="d2")
    events = await client
    [moved] = answer["requests"]
    assert moved["outcome"] == "moved", moved
    assert moved["tokens_before"] == PAUSE_AFTER + 1
    assert _tokens(events) == _expected(PROMPT, MAX_TOKENS), "none lost, repeated or reordered"
    texts = "".join(c.get("text", "") for e in events for c in e.get("choices") or [])
    assert texts == "".join(f" t{t}" for t in _expected(PROMPT, MAX_TOKENS))
    # One stream: one id, one end, the usage of the client's request.
    chunks = [e for e in events if e.get("choices")]
    assert {e["id"] for e in chunks} == {chunks[0]["id"]}
    assert {e["created"] for e in chunks} == {chunks[0]["created"]}
    assert [c["finish_reason"] for e in chunks for c in e["choices"]][-1] == "length"
    assert sum(c["finish_reason"] is not None for e in chunks for c in e["choices"]) == 1
    assert [c.get("prompt_token_ids") for e in chunks for c in e["choices"]][1:] == [None] * (
        len(chunks) - 1
    ), "the migrated prompt is not echoed"
    usages = [e["usage"] for e in events if e.get("usage")]
    assert usages == [{"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}]
    assert events[-1] == {"done": True}
    assert sum(e == {"done": True} for e in events) == 1
    # D2 got every token so far as its prompt, the rest of the budget, a pull from D1.
    [body] = rig.d2.received
    assert body["prompt"] == PROMPT + _expected(PROMPT, PAUSE_AFTER + 1)
    assert body["max_tokens"] == MAX_TOKENS - (PAUSE_AFTER + 1)
    pull = decode_params(body["kv_transfer_params"])
    assert isinstance(pull, PullParams)
    assert pull.remote_rpc_address == rig.d1.rpc_address
    assert pull.remote_num_tokens == len(body["prompt"]) - 1
    assert rig.proxy.metrics.registry.get_sample_value(
        "pdserve_migrations_total", {"outcome": "moved"}
    )


async def test_a_refused_migration_leaves_the_stream_on_d1(rig: Rig) -> None:
    rig.d1.refuse_migration = True
    client = asyncio.create_task(rig.stream())
    await _paused(rig)
    answer = await rig.migrate(instance="d1", to="d2")
    [stream] = rig.d1.streams.values()
    stream.proceed.set()
    events = await client
    assert answer["requests"][0]["outcome"] == "refused"
    assert _tokens(events) == _expected(PROMPT, MAX_TOKENS)
    assert rig.d2.received == []


async def test_a_target_that_fails_sends_the_request_back_to_d1(rig: Rig) -> None:
    await rig.d2.close()  # refuses connections
    client = asyncio.create_task(rig.stream())
    await _paused(rig)
    answer = await rig.migrate(instance="d1", to="d2")
    events = await client
    assert answer["requests"][0]["outcome"] == "moved"
    assert answer["requests"][0]["to"] == "d1"
    assert _tokens(events) == _expected(PROMPT, MAX_TOKENS)
    back = rig.d1.received[1]
    pull = decode_params(back["kv_transfer_params"])
    assert isinstance(pull, PullParams)
    assert pull.remote_rpc_address == rig.d1.rpc_address, "D1 pulls what it holds itself"


async def test_a_client_gone_mid_switch_releases_what_d1_holds(rig: Rig) -> None:
    rig.d2.hang = True
    client = asyncio.create_task(rig.stream())
    await _paused(rig)
    migration = asyncio.create_task(rig.migrate(instance="d1", to="d2"))
    await rig.d2.called.wait()
    client.cancel()
    await asyncio.gather(client, return_exceptions=True)
    await rig.d1.released.wait()
    answer = await migration
    assert answer["requests"][0]["outcome"] == "failed"
    [release] = rig.d1.releases
    assert release.transfer_id.startswith("mig-")


async def test_unknown_instances_are_refused(rig: Rig) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{rig.url}/admin/migrate?instance=nobody") as resp:
            assert resp.status == 404
        async with session.post(f"{rig.url}/admin/migrate?instance=d1&to=d1") as resp:
            assert resp.status == 400
    assert await rig.migrate(instance="d2") == {"instance": "d2", "requests": []}
