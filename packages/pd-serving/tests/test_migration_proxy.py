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
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from hybrid_connector.contract import PullParams, decode_params
from pd_serving import live
from pd_serving.launcher import free_port
from pd_serving.proxy import Backend, PdProxy, ProxyConfig, serve
from stand_ins import MODEL, FakeDecode, FakeUpstream, model_tokens

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 12
PAUSE_AFTER = 4  # D1 streams this many tokens, then waits for the test


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
    d1, d2 = (FakeDecode(f"d{i}", pause_after=PAUSE_AFTER) for i in (1, 2))
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


async def _paused(rig: Rig) -> tuple[FakeDecode, FakeDecode]:
    """The D the proxy picked streamed PAUSE_AFTER tokens and waits: (it, the other one)."""
    called = [asyncio.create_task(d.called.wait()) for d in (rig.d1, rig.d2)]
    await asyncio.wait(called, return_when=asyncio.FIRST_COMPLETED)
    for task in called:
        task.cancel()
    source, target = (rig.d1, rig.d2) if rig.d1.called.is_set() else (rig.d2, rig.d1)
    [stream] = source.streams.values()
    await stream.paused.wait()
    return source, target


async def test_a_stream_moves_to_another_d_token_for_token(rig: Rig) -> None:
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    events = await client
    [moved] = answer["requests"]
    assert moved["outcome"] == "moved", moved
    assert moved["tokens_before"] == PAUSE_AFTER + 1
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS), "none lost, repeated or reordered"
    texts = "".join(c.get("text", "") for e in events for c in e.get("choices") or [])
    assert texts == "".join(f" t{t}" for t in model_tokens(PROMPT, MAX_TOKENS))
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
    [body] = d2.received
    assert body["prompt"] == PROMPT + model_tokens(PROMPT, PAUSE_AFTER + 1)
    assert body["max_tokens"] == MAX_TOKENS - (PAUSE_AFTER + 1)
    pull = decode_params(body["kv_transfer_params"])
    assert isinstance(pull, PullParams)
    assert pull.remote_rpc_address == d1.rpc_address
    assert pull.remote_num_tokens == len(body["prompt"]) - 1
    assert rig.proxy.metrics.registry.get_sample_value(
        "pdserve_migrations_total", {"outcome": "moved"}
    )


async def test_a_refused_migration_leaves_the_stream_on_d1(rig: Rig) -> None:
    rig.d1.refuse_migration = rig.d2.refuse_migration = True
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    [stream] = d1.streams.values()
    stream.proceed.set()
    events = await client
    assert answer["requests"][0]["outcome"] == "refused"
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS)
    assert d2.received == []


async def test_a_target_that_fails_sends_the_request_back_to_d1(rig: Rig) -> None:
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    await d2.close()  # refuses connections
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    events = await client
    assert answer["requests"][0]["outcome"] == "moved"
    assert answer["requests"][0]["to"] == d1.name
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS)
    back = d1.received[1]
    pull = decode_params(back["kv_transfer_params"])
    assert isinstance(pull, PullParams)
    assert pull.remote_rpc_address == d1.rpc_address, "D1 pulls what it holds itself"


async def test_a_client_gone_mid_switch_releases_what_d1_holds(rig: Rig) -> None:
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    d2.hang = True
    migration = asyncio.create_task(rig.migrate(instance=d1.name, to=d2.name))
    await d2.called.wait()
    client.cancel()
    await asyncio.gather(client, return_exceptions=True)
    await d1.released.wait()
    answer = await migration
    assert answer["requests"][0]["outcome"] == "failed"
    [release] = d1.releases
    assert release.transfer_id.startswith("mig-")


async def test_unknown_instances_are_refused(rig: Rig) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{rig.url}/admin/migrate?instance=nobody") as resp:
            assert resp.status == 404
        async with session.post(f"{rig.url}/admin/migrate?instance=d1&to=d1") as resp:
            assert resp.status == 400
    assert await rig.migrate(instance="d2") == {"instance": "d2", "requests": []}  # none there


async def test_a_precopied_migration_warms_the_target_up_first(rig: Rig) -> None:
    rig.d1.precopy_block = rig.d2.precopy_block = 4
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    events = await client
    assert answer["requests"][0]["outcome"] == "moved", answer
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS)
    warm_up, final = d2.received
    so_far = PROMPT + model_tokens(PROMPT, PAUSE_AFTER)
    assert warm_up["prompt"] == so_far[:8], "the full blocks D1 had computed"
    assert (warm_up["max_tokens"], warm_up["stream"]) == (1, False)
    assert "stream_options" not in warm_up
    pull = decode_params(warm_up["kv_transfer_params"])
    assert isinstance(pull, PullParams)
    assert pull.transfer_id.startswith("mig-pre-")
    assert (pull.remote_rpc_address, pull.remote_num_tokens) == (d1.rpc_address, 8)
    assert final["prompt"] == PROMPT + model_tokens(PROMPT, PAUSE_AFTER + 1)
    moved = answer["requests"][0]
    assert moved["precopied_tokens"] == 8
    stages = moved["stages_ms"]
    order = ["asked", "precopy_answered", "warmed", "stop_asked", "d1_answered"]
    order += ["d2_called", "d2_answered", "d2_first_event"]
    assert set(stages) == {*order, "d1_end"}, stages
    assert [stages[k] for k in order] == sorted(stages[k] for k in order)
    assert stages["asked"] == 0
    assert stages["d1_end"] <= stages["d2_called"]
    await rig.proxy.drain_background()
    assert [r.transfer_id for r in d1.releases] == [pull.transfer_id], "C released, once"
    assert rig.proxy.metrics.registry.get_sample_value(
        "pdserve_migration_precopies_total", {"outcome": "warmed"}
    )


async def test_a_target_failing_the_warm_up_leaves_the_request_on_d1(rig: Rig) -> None:
    rig.d1.precopy_block = rig.d2.precopy_block = 4
    rig.d1.refuse_unstreamed = rig.d2.refuse_unstreamed = True
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    assert answer["requests"][0]["outcome"] == "refused", answer
    assert "warm-up" in answer["requests"][0]["reason"]
    [stream] = d1.streams.values()
    stream.proceed.set()
    events = await client
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS), "finished on D1 as if never asked"
    assert [c["finish_reason"] for e in events for c in e.get("choices") or []][-1] == "length"
    [warm_up] = d2.received
    assert warm_up["max_tokens"] == 1
    await rig.proxy.drain_background()
    [release] = d1.releases
    assert release.transfer_id.startswith("mig-pre-"), "the pre-copy hold goes back"


@pytest.mark.parametrize(
    "event",
    [
        {"id": "x", "choices": [{"text": "a", "prompt_token_ids": [1, 2, 3], "token_ids": [4]}]},
        {"choices": [{"prompt_token_ids": [], "token_ids": [4], "text": ""}]},
        {"choices": [{"prompt_token_ids": None, "token_ids": [4], "text": ""}]},
        {"choices": [{"text": '"prompt_token_ids": [9]', "token_ids": [4]}]},
        {"choices": [{"text": "b", "token_ids": [4]}], "usage": None},
    ],
)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_the_echoed_prompt_ids_go_unparsed(
    event: dict[str, Any], separators: tuple[str, str]
) -> None:
    raw = f"data: {json.dumps(event, separators=separators)}\n\n".encode()
    out = json.loads(live._without_prompt_token_ids(raw)[5:])
    want = json.loads(json.dumps(event))
    for choice in want["choices"]:
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
    assert out == want


@pytest.mark.parametrize(
    ("choices", "reason"),
    [
        ([{"text": "a", "finish_reason": None}], None),
        ([{"text": "a", "finish_reason": "length"}], "length"),
        ([{"finish_reason": None}, {"finish_reason": "stop"}], "stop"),
        ([{"text": '"finish_reason": null'}], None),
        ([{"text": "a"}], None),
    ],
)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_a_finish_reason_is_found_however_the_json_is_spaced(
    choices: list[dict[str, Any]], reason: str | None, separators: tuple[str, str]
) -> None:
    raw = f"data: {json.dumps({'choices': choices}, separators=separators)}\n\n".encode()
    assert live._finish_reason(raw) == reason


def test_a_prompt_serialized_by_its_new_tokens_is_the_whole_prompts_json() -> None:
    known = live._PromptJson([5, 6, 7])
    for tokens in ([5, 6, 7], [5, 6, 7, 8, 9], [5, 6], [1, 6, 7, 8], []):
        body = live._json_body({"model": MODEL, "max_tokens": 3}, known.encode(tokens))
        assert json.loads(body) == {"prompt": tokens, "model": MODEL, "max_tokens": 3}
    assert json.loads(live._json_body({}, known.encode([5]))) == {"prompt": [5]}
