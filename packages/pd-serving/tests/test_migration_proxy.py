"""Live migration through the proxy against stand-in decode instances (no vLLM).

A stand-in D streams a deterministic model (each token a function of the one before), so a
request continued from its prompt plus the tokens so far goes on exactly as it would have; its
MIGRATE_OUT stops the stream after one more token and answers with the tokens, as D1's
connector does. The client's stream must be the unmoved one, event for event in content.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from hybrid_connector.contract import PullParams, decode_params
from pd_serving import live
from pd_serving.launcher import free_port
from pd_serving.proxy import Backend, PdProxy, ProxyConfig, serve
from stand_ins import (
    BYTE_TEXT,
    MODEL,
    PREFILL_RPC,
    FakeDecode,
    FakeUpstream,
    fake_prefill,
    model_tokens,
)

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
    d3: FakeDecode | None = None  # only the instances the proxy knows

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
        body = {k: v for k, v in body.items() if v is not None}
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

    async def complete(self, **extra: Any) -> dict[str, Any]:
        """A non-streaming client's answer."""
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, **extra}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def migrate(self, **query: str) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/admin/migrate", params=query) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return await resp.json()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async for made in _rig(2):
        yield made


@pytest.fixture
async def rig3() -> AsyncIterator[Rig]:
    """Three D's: a recompute may go to the third."""
    async for made in _rig(3):
        yield made


async def _rig(decodes: int) -> AsyncIterator[Rig]:
    p = fake_prefill()
    ds = [FakeDecode(f"d{i}", pause_after=PAUSE_AFTER) for i in range(1, decodes + 1)]
    for upstream in (p, *ds):
        await upstream.start()
    config = ProxyConfig(
        prefill=[Backend(p.url, rpc_address=PREFILL_RPC, name="p")],
        decode=[Backend(d.url, rpc_address=d.rpc_address, name=d.name) for d in ds],
        model_names=[MODEL],
        health=None,
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    rig = Rig(p, ds[0], ds[1], proxy, f"http://127.0.0.1:{port}", *ds[2:])
    try:
        yield rig
        await proxy.drain_background()
        assert proxy.live.streams == {}, "every stream unregistered"
    finally:
        await runner.cleanup()
        for upstream in (p, *ds):
            await upstream.close()


def _tokens(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for c in e.get("choices") or [] for t in c.get("token_ids") or []]


async def _paused(rig: Rig) -> tuple[FakeDecode, FakeDecode]:
    """The D the proxy picked streamed PAUSE_AFTER tokens and waits: (it, another one)."""
    source, *others = await _paused_all(rig)
    return source, others[0]


async def _paused_all(rig: Rig) -> list[FakeDecode]:
    """The D the proxy picked (streamed PAUSE_AFTER tokens, waits), then the others."""
    ds = [d for d in (rig.d1, rig.d2, rig.d3) if d is not None]
    called = [asyncio.create_task(d.called.wait()) for d in ds]
    await asyncio.wait(called, return_when=asyncio.FIRST_COMPLETED)
    for task in called:
        task.cancel()
    [source] = [d for d in ds if d.called.is_set()]
    [stream] = source.streams.values()
    await stream.paused.wait()
    return [source, *(d for d in ds if d is not source)]


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


# Prompts whose move cuts a character (UTF-8 bytes split over tokens) or falls between two;
# one whose text repeats every few characters.
CUT_INSIDE, CUT_INSIDE_REPEATING, CUT_BETWEEN = [11, 12, 13, 14, 1], [11, 12, 13, 14, 22], PROMPT


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize(
    "prompt",
    [CUT_INSIDE, CUT_INSIDE_REPEATING, CUT_BETWEEN],
    ids=["cut-inside", "cut-inside-repeating", "cut-between"],
)
async def test_a_move_that_cuts_a_character_sends_the_unmoved_text(
    rig: Rig, prompt: list[int], streamed: bool
) -> None:
    """D's detokenize as vLLM does with a byte-level tokenizer: the new D, primed with a
    context ending inside a character, first sends the whole context's text. The client gets
    the text of the unmoved stream all the same."""
    tokens = model_tokens(prompt, MAX_TOKENS)
    cut = PAUSE_AFTER + 1
    assert BYTE_TEXT.cut_inside_a_character(prompt + tokens[:cut]) == (prompt != CUT_BETWEEN)
    rig.d1.byte_text = rig.d2.byte_text = True
    ask = rig.stream(prompt=prompt) if streamed else rig.complete(prompt=prompt)
    client = asyncio.create_task(ask)
    d1, d2 = await _paused(rig)
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    got = await client
    assert answer["requests"][0]["outcome"] == "moved", answer
    choices = [c for e in got for c in e.get("choices") or []] if streamed else got["choices"]
    text = "".join(c.get("text") or "" for c in choices)
    unmoved = BYTE_TEXT.text(prompt, tokens)
    assert text == unmoved
    moved_unmended = BYTE_TEXT.text(prompt, tokens[:cut]) + BYTE_TEXT.text(
        prompt + tokens[:cut], tokens[cut:]
    )
    assert (moved_unmended != unmoved) == (prompt != CUT_BETWEEN), "the D's as vLLM's"


async def test_a_moved_stream_no_longer_counts_as_a_call_on_d1(rig: Rig) -> None:
    """Its call to D1 ends at the switch: a drain of D1 does not wait for the client's end."""
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    d2.token_delay_s = 0.1  # the client's stream runs on for a while on D2
    [old] = [b for b in rig.proxy.config.decode if b.name == d1.name]
    [new] = [b for b in rig.proxy.config.decode if b.name == d2.name]
    assert rig.proxy.open_on(old) == 1
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    assert answer["requests"][0]["outcome"] == "moved"
    assert not client.done()
    assert (rig.proxy.open_on(old), rig.proxy.open_on(new)) == (0, 1)
    events = await client
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS)
    assert rig.proxy.open_on(new) == 0


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
    assert warm_up["prompt"] == so_far[:9], "the full blocks D1 had computed, the next token"
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


def _count(rig: Rig, outcome: str) -> float:
    value = rig.proxy.metrics.registry.get_sample_value(
        "pdserve_migrations_total", {"outcome": outcome}
    )
    return value or 0.0


@pytest.mark.parametrize("when", ["precopy", "migrate_out", "after_stop"])
async def test_d1_dying_mid_migration_the_target_recomputes_the_clients_tokens(
    rig: Rig, when: str
) -> None:
    """Before the stop (PRECOPY or MIGRATE_OUT never answered, every connection dropped) or
    after it (D1 stopped the request, its stream broke before its last token): the target
    recomputes from what the client has, no pull, and the stream goes on token for token."""
    rig.d1.precopy_block = rig.d2.precopy_block = 4 * (when == "precopy")
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    if when == "after_stop":
        d1.break_at_stop = True
    else:
        d1.die_on = when
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    events = await client
    [moved] = answer["requests"]
    assert (moved["outcome"], moved["recomputed"], moved["to"]) == ("moved", True, d2.name)
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS), "none lost, repeated or reordered"
    had = model_tokens(PROMPT, PAUSE_AFTER)  # what the client had when D1 went
    [body] = d2.received
    assert body["prompt"] == PROMPT + had
    assert body["max_tokens"] == MAX_TOKENS - PAUSE_AFTER
    assert "kv_transfer_params" not in body, "no pull: D1 may be gone"
    chunks = [e for e in events if e.get("choices")]
    assert sum(c["finish_reason"] is not None for e in chunks for c in e["choices"]) == 1
    assert [e["usage"] for e in events if e.get("usage")] == [
        {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    ]
    assert _count(rig, "recomputed") == 1
    await rig.proxy.drain_background()
    if when == "after_stop":  # D1 is alive: M is released there
        assert [r.transfer_id[:4] for r in d1.releases] == ["mig-"]


async def test_d1_unreachable_for_the_stop_is_cut_and_the_target_recomputes(rig: Rig) -> None:
    """D1's transfer address refuses (D1 streams on): its stream is closed where the client
    has it, and the target recomputes from there."""
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    await d1.close_rpc()
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    events = await client
    assert answer["requests"][0]["recomputed"] is True, answer
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS)
    [stream] = d1.streams.values()
    await stream.closed.wait()  # the proxy closed D1's call: vLLM would abort the request
    [body] = d2.received
    assert body["prompt"] == PROMPT + model_tokens(PROMPT, PAUSE_AFTER)


async def test_the_target_and_d1_failing_at_the_switch_recompute_on_a_third_d(
    rig3: Rig,
) -> None:
    client = asyncio.create_task(rig3.stream())
    d1, d2, d3 = await _paused_all(rig3)
    await d2.close()  # refuses connections
    d1.fail_new = True  # taking the request back fails too
    answer = await rig3.migrate(instance=d1.name, to=d2.name)
    events = await client
    [moved] = answer["requests"]
    assert (moved["outcome"], moved["recomputed"], moved["to"]) == ("moved", True, d3.name)
    assert _tokens(events) == model_tokens(PROMPT, MAX_TOKENS)
    [body] = d3.received
    assert body["prompt"] == PROMPT + model_tokens(PROMPT, PAUSE_AFTER + 1)
    assert "kv_transfer_params" not in body
    await rig3.proxy.drain_background()
    assert [r.transfer_id[:4] for r in d1.releases] == ["mig-"], "nobody pulls M: released"


async def test_no_d_left_to_recompute_on_ends_the_stream_in_its_error(rig: Rig) -> None:
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    await d2.close()
    d1.fail_new = True
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    events = await client
    assert answer["requests"][0]["outcome"] == "failed"
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1, errors
    assert "no decode instance left" in errors[0]["message"]
    assert _tokens(events) == model_tokens(PROMPT, PAUSE_AFTER + 1), "what came, once"
    assert events[-1] == {"done": True}
    await rig.proxy.drain_background()
    assert [r.transfer_id[:4] for r in d1.releases] == ["mig-"]


@pytest.mark.parametrize("token_ids", [True, None])
async def test_a_non_streaming_request_moves_and_gets_one_answer(
    rig: Rig, token_ids: bool | None
) -> None:
    client = asyncio.create_task(rig.complete(return_token_ids=token_ids))
    d1, d2 = await _paused(rig)
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    got = await client
    assert answer["requests"][0]["outcome"] == "moved", answer
    [choice] = got["choices"]
    tokens = model_tokens(PROMPT, MAX_TOKENS)
    assert choice["text"] == "".join(f" t{t}" for t in tokens), "every token once"
    assert choice["token_ids"] == (tokens if token_ids else None)
    assert choice["prompt_token_ids"] == (PROMPT if token_ids else None)
    assert choice["finish_reason"] == "length"
    assert got["usage"] == {
        "prompt_tokens": 5,
        "total_tokens": 17,
        "completion_tokens": 12,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,  # as vLLM's whole answer has it
    }
    assert got["object"] == "text_completion"
    # The proxy streamed it from D1 (token ids and usage asked), then from D2 (pulling M).
    d1_body = d1.received[0]
    assert (d1_body["stream"], d1_body["return_token_ids"]) == (True, True)
    assert d1_body["stream_options"] == {"include_usage": True}
    [d2_body] = d2.received
    assert d2_body["prompt"] == PROMPT + tokens[: PAUSE_AFTER + 1]
    assert isinstance(decode_params(d2_body["kv_transfer_params"]), PullParams)


async def test_a_non_streaming_request_whose_d1_dies_is_recomputed_from_the_prompt(
    rig: Rig,
) -> None:
    """The client has no token yet: the target recomputes from the prompt (and the tokens
    the proxy collected), and answers once."""
    client = asyncio.create_task(rig.complete())
    d1, d2 = await _paused(rig)
    d1.die_on = "migrate_out"
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    got = await client
    assert answer["requests"][0]["recomputed"] is True, answer
    tokens = model_tokens(PROMPT, MAX_TOKENS)
    assert got["choices"][0]["text"] == "".join(f" t{t}" for t in tokens)
    assert got["usage"]["completion_tokens"] == MAX_TOKENS
    [body] = d2.received
    assert body["prompt"] == PROMPT + tokens[:PAUSE_AFTER]


async def test_token_ids_the_client_did_not_ask_for_stay_out_of_its_stream(rig: Rig) -> None:
    client = asyncio.create_task(rig.stream(return_token_ids=None))
    d1, d2 = await _paused(rig)
    answer = await rig.migrate(instance=d1.name, to=d2.name)
    events = await client
    assert answer["requests"][0]["outcome"] == "moved"
    choices = [c for e in events for c in e.get("choices") or []]
    assert {c["token_ids"] for c in choices} == {None}
    assert {c["prompt_token_ids"] for c in choices} == {None}
    texts = "".join(c["text"] for c in choices)
    assert texts == "".join(f" t{t}" for t in model_tokens(PROMPT, MAX_TOKENS))
    assert d1.received[0]["return_token_ids"] is True, "the proxy asked D1 for them"


async def test_a_recomputed_stream_is_not_migrated_again(rig: Rig) -> None:
    client = asyncio.create_task(rig.stream())
    d1, d2 = await _paused(rig)
    d1.die_on = "migrate_out"
    await rig.migrate(instance=d1.name, to=d2.name)
    assert await rig.migrate(instance=d2.name) == {"instance": d2.name, "requests": []}
    await client


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


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_output_token_ids_are_found_not_the_prompts(separators: tuple[str, str]) -> None:
    event = {
        "choices": [{"text": '"token_ids": [7]', "prompt_token_ids": [1, 2], "token_ids": [4, 5]}]
    }
    raw = f"data: {json.dumps(event, separators=separators)}\n\n".encode()
    found = live._token_ids(raw)
    assert found is not None
    assert json.loads(raw[found[0] : found[1]]) == [4, 5]
    prompt = live._prompt_token_ids(raw)
    assert prompt is not None
    assert json.loads(raw[prompt[0] : prompt[1]]) == [1, 2]


def test_a_text_offset_goes_on_after_the_last_token() -> None:
    event = {"choices": [{"logprobs": {"text_offset": [0, 3], "tokens": [" ab", "cde"]}}]}
    assert live._next_text_offset(f"data: {json.dumps(event)}\n\n".encode()) == 6
    assert live._next_text_offset(b"") == 0


def test_an_assembled_answer_joins_the_stream() -> None:
    """What the proxy answers a non-streaming client from the stream its D's sent."""
    assembler = live._Assembler({"return_token_ids": True, "logprobs": 1})

    def chunk(text: str, ids: list[int], offsets: list[int], end: str | None = None) -> bytes:
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": [-0.5] * len(ids),
            "tokens": [f"t{i}" for i in ids],
            "top_logprobs": [{f"t{i}": -0.5} for i in ids],
        }
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": end}
        choice |= {"token_ids": ids, "prompt_token_ids": [9, 9] if ids == [1] else None}
        data = {"id": "c", "created": 5, "model": MODEL, "choices": [choice]}
        return f"data: {json.dumps(data)}\n\n".encode()

    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    done = assembler.add([chunk("a", [1], [0]), chunk("bc", [2, 3], [2, 4], end="length")])
    assert not done
    assert not assembler.add([f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()])
    assert assembler.add([b"data: [DONE]\n\n"])
    answer = assembler.answer()
    [choice] = answer["choices"]
    assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == (
        "abc",
        [1, 2, 3],
        [9, 9],
    )
    assert choice["logprobs"]["text_offset"] == [0, 2, 4]
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 3
    assert (answer["id"], answer["created"], answer["object"]) == ("c", 5, "text_completion")


def test_a_text_mend_is_asked_only_where_the_cut_may_split_a_character() -> None:
    """The old D's last token event: with text and one token the cut was clean; without text
    (bytes held back), or several tokens in one event (speculative decoding), it may not be."""

    def event(text: str, ids: list[int]) -> bytes:
        choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": None}
        return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

    def mend(*events: bytes | tuple[str, int]) -> live._TextMend | None:
        return live._TextMend.after(deque(events))

    assert mend(event("ab", [1]), event("c", [2])) is None
    assert mend() is None
    assert mend(event("", [1])) is None, "no text to find"
    held = mend(event("ab", [1]), ("c", 1), event("", [3]))
    assert held is not None
    assert held.tail == "abc"
    several = mend(event("ab", [1, 2]))
    assert several is not None
    # The new D's first text: its whole context's text, then the new character.
    assert held.text("PROMPTabcé", "mig-1") == "é"
    assert held.text("é", "mig-1") == "é", "its own text: the cut was clean"
    assert held.text("abc", "mig-1") == "abc", "never mended to nothing"
