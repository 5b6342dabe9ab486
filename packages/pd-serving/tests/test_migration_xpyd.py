"""Live migration on real vLLM (HybridConnector): a streaming request moves from one D to the
other mid-decode, its client's stream going on.

The session's xPyD deployment behind an in-process proxy (P0, both D's with their transfer
addresses). The client reads its stream and, after some tokens, asks ``POST /admin/migrate``
to move the request off the D serving it. Its greedy tokens must equal P1's answer to the same
prompt (one instance, no transfer), the new D must pull every token it needs from the old one
and compute one, and no instance may hold a block afterwards.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from harness.pool import Xpyd
from pd_serving import live
from pd_serving.client import complete, exact_length_prompt, greedy_body, load_tokenizer
from pd_serving.launcher import free_port
from pd_serving.proxy import PdProxy, serve
from prometheus_client.parser import text_string_to_metric_families
from stand_ins import wait_until

pytestmark = [pytest.mark.needs_vllm, pytest.mark.timeout(900)]

PROMPT_TOKENS = 200
MAX_TOKENS = 240
MIGRATE_AFTER = 80  # tokens the client has before it asks for the migration


async def _sum(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _by_source(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    name = "vllm:prompt_tokens_by_source_total"
    return {
        source: await _sum(session, url, name, source=source)
        for source in ("local_compute", "external_kv_transfer", "local_cache_hit")
    }


async def _stream_and_migrate(
    session: aiohttp.ClientSession,
    url: str,
    proxy: PdProxy,
    model: str,
    prompt: str,
    **extra: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The client: its events, and the admin endpoint's answer (asked after MIGRATE_AFTER)."""
    body = greedy_body(model, prompt, max_tokens=MAX_TOKENS, stream=True, **extra)
    body["stream_options"] = {"include_usage": True}
    events: list[dict[str, Any]] = []
    tokens = 0
    asked: asyncio.Task[dict[str, Any]] | None = None

    async def migrate() -> dict[str, Any]:
        [source] = list(proxy.live.streams)  # the one D streaming this request
        async with session.post(f"{url}/admin/migrate", params={"instance": source}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[5:])
            events.append(event)
            tokens += sum(len(c.get("token_ids") or []) for c in event.get("choices") or [])
            if asked is None and tokens >= MIGRATE_AFTER:
                asked = asyncio.create_task(migrate())
    assert asked is not None, "the stream ended before it was asked to move"
    return events, await asked


@pytest.mark.parametrize("precopy", [False, True], ids=["stop-and-copy", "precopy"])
async def test_a_stream_moves_between_real_decodes_token_for_token(
    xpyd: Xpyd, precopy: bool
) -> None:
    """Pre-copy: the new D's warm-up pulls the full blocks the old one had, its request after
    the stop hits them in its prefix cache and pulls only the rest; with logprobs, and the
    reference non-streaming."""
    model = xpyd.model_name
    tokenizer = load_tokenizer(xpyd.model)
    prompt = exact_length_prompt(tokenizer, PROMPT_TOKENS, seed=7300 + precopy)
    config = xpyd.proxy_config(prefill_count=1)
    config.health = None
    assert all(d.rpc_address for d in config.decode)
    proxy = PdProxy(config)
    proxy.live.precopy = precopy
    extra = {"logprobs": 1, "return_tokens_as_token_ids": True} if precopy else {}
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            reference = await complete(
                session,
                xpyd.reference_url,
                model,
                prompt,
                max_tokens=MAX_TOKENS,
                stream=not precopy,
                logprobs=1 if precopy else None,
            )
            before = {d: await _by_source(session, d) for d in xpyd.decode_urls}
            events, answer = await _stream_and_migrate(session, url, proxy, model, prompt, **extra)
            [moved] = answer["requests"]
            assert moved["outcome"] == "moved", moved
            target = moved["to"]
            generated = moved["tokens_before"]
            length = PROMPT_TOKENS + generated

            async def target_counts() -> dict[str, float]:
                return await _by_source(session, target)

            pulled_before = before[target]["external_kv_transfer"]
            hit_before = before[target]["local_cache_hit"]
            after = await wait_until(
                target_counts,
                lambda c: (
                    c["external_kv_transfer"]
                    - pulled_before
                    + (c["local_cache_hit"] - hit_before) * precopy
                    >= length - 1
                ),
            )

            async def idle() -> list[float]:
                usage = []
                for d in [*xpyd.decode_urls, xpyd.prefill_urls[0]]:
                    # An idle instance shows its gauges as of its last step: nudge it.
                    await complete(session, d, model, "nudge", max_tokens=1)
                    usage.append(await _sum(session, d, "vllm:kv_cache_usage_perc"))
                return usage

            usage = await wait_until(idle, lambda u: not any(u))
        await proxy.drain_background()
        moved_count = proxy.metrics.registry.get_sample_value(
            "pdserve_migrations_total", {"outcome": "moved"}
        )
        warmed = proxy.metrics.registry.get_sample_value(
            "pdserve_migration_precopies_total", {"outcome": "warmed"}
        )
    finally:
        await runner.cleanup()
    got = [t for e in events for c in e.get("choices") or [] for t in c.get("token_ids") or []]
    assert len(reference.token_ids) == MAX_TOKENS
    assert got == reference.token_ids, "token for token, none lost, repeated or reordered"
    text = "".join(c.get("text") or "" for e in events for c in e.get("choices") or [])
    assert text == reference.text, "the unmoved text, a character the move cut included"
    assert MIGRATE_AFTER <= generated < MAX_TOKENS
    usages = [e["usage"] for e in events if e.get("usage")]
    assert usages[-1]["prompt_tokens"] == PROMPT_TOKENS
    assert usages[-1]["completion_tokens"] == MAX_TOKENS
    finishes = [c["finish_reason"] for e in events for c in e.get("choices") or []]
    assert [f for f in finishes if f is not None] == ["length"]
    assert len({e["id"] for e in events}) == 1, "one stream"
    pulled = after["external_kv_transfer"] - pulled_before
    computed = after["local_compute"] - before[target]["local_compute"]
    assert usage == [0.0, 0.0, 0.0], "no blocks held on either D or on P"
    assert moved_count == 1
    if not precopy:
        # The new D took every token the old one had KV for and computed only the last.
        assert pulled == length - 1, after
        assert computed == 1, after
        return
    assert warmed == 1
    # The warm-up pulled the full blocks and computed its last token; the request after the
    # stop hit those blocks and pulled the rest: nothing recomputed but those two tokens.
    hit = after["local_cache_hit"] - hit_before
    assert hit > 0, after
    assert pulled + hit >= length - 1, after
    assert computed <= 2, after
    got_logprobs = [
        {int(t.rpartition(":")[2]): lp for t, lp in (top or {}).items()}
        for e in events
        for c in e.get("choices") or []
        for top in (c.get("logprobs") or {}).get("top_logprobs") or []
    ]
    assert len(got_logprobs) == MAX_TOKENS
    for got_top, want_top, token in zip(
        got_logprobs, reference.top_logprobs, reference.token_ids, strict=True
    ):
        assert got_top[token] == pytest.approx(want_top[token], abs=0.05)


async def test_a_non_streaming_request_moves_and_gets_the_unmoved_answer(
    xpyd: Xpyd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside the streamed case: a non-streaming request (logprobs and token ids asked) is
    streamed from its D by the proxy, moves after MIGRATE_AFTER tokens, and its client gets one
    answer: the fields, text, tokens, text offsets, usage and finish reason of P1's own answer
    to the same body."""
    model = xpyd.model_name
    prompt = exact_length_prompt(load_tokenizer(xpyd.model), PROMPT_TOKENS, seed=7350)
    config = xpyd.proxy_config(prefill_count=1)
    config.health = None
    proxy = PdProxy(config)
    body = greedy_body(model, prompt, max_tokens=MAX_TOKENS, stream=False, logprobs=1)
    enough = asyncio.Event()
    real_add = live._Assembler.add

    def add(assembler: live._Assembler, events: list[bytes]) -> bool:
        done = real_add(assembler, events)
        if len(assembler.token_ids) >= MIGRATE_AFTER:
            enough.set()
        return done

    monkeypatch.setattr(live._Assembler, "add", add)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{xpyd.reference_url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                want = await resp.json()

            async def client() -> dict[str, Any]:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            answer = asyncio.create_task(client())
            await enough.wait()
            [source] = list(proxy.live.streams)
            async with session.post(f"{url}/admin/migrate", params={"instance": source}) as resp:
                [moved] = (await resp.json())["requests"]
            got = await answer
        await proxy.drain_background()
    finally:
        await runner.cleanup()
    assert moved["outcome"] == "moved", moved
    assert MIGRATE_AFTER <= moved["tokens_before"] < MAX_TOKENS
    assert set(got) == set(want), "the fields of vLLM's own answer"
    [choice], [want_choice] = got["choices"], want["choices"]
    assert set(choice) == set(want_choice)
    assert choice["token_ids"] == want_choice["token_ids"], "token for token"
    assert choice["prompt_token_ids"] == want_choice["prompt_token_ids"]
    assert choice["text"] == want_choice["text"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got["usage"][key] == want["usage"][key], key
    logprobs, want_logprobs = choice["logprobs"], want_choice["logprobs"]
    assert logprobs["tokens"] == want_logprobs["tokens"]
    assert logprobs["text_offset"] == want_logprobs["text_offset"], "offsets run on across D's"
    assert logprobs["token_logprobs"] == pytest.approx(want_logprobs["token_logprobs"], abs=0.05)
    assert got["object"] == "text_completion"
