"""The chaos suite's judge: each way a streamed answer can end is classified right (no vLLM: a
stand-in server answers each prompt its own way), and the report counts and percentiles."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from pd_serving.launcher import free_port

from .load import FaultWindow, Outcome, SteadyLoad, percentile, report, stream_once

EXPECTED = [5, 6, 7]


def _event(ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": "x", "token_ids": ids, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body["prompt"]
    if mode == "status":
        return web.json_response({"error": {"message": "no D"}}, status=503)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(_event([5]))
    if mode == "hang":
        await asyncio.sleep(30)
    if mode == "cut":  # the connection closes mid-stream, nothing said
        request.transport.close()
        return out
    if mode == "error_event":
        await out.write(b'data: {"error": {"message": "decode died", "type": "upstream"}}\n\n')
        await out.write(_event([], "error"))
    else:
        await out.write(_event([6, 8 if mode == "mismatch" else 7], "length"))
    if mode != "no_done":
        await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


@pytest.fixture
async def stand_in() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", _answer)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("ok", "completed"),
        ("status", "http_error"),
        ("error_event", "error_event"),
        ("mismatch", "mismatch"),
        ("no_done", "silent"),
        ("cut", "silent"),
        ("hang", "hang"),
    ],
)
async def test_each_ending_is_judged(stand_in: str, mode: str, kind: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        out = await stream_once(
            session, stand_in, "m", mode, EXPECTED, max_tokens=3, deadline_s=1.0
        )
    assert out.kind == kind, out
    if kind == "completed":
        assert out.ttft_s is not None
        assert out.tokens == 3


async def test_an_unreachable_proxy_is_a_violation() -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        out = await stream_once(
            session, f"http://127.0.0.1:{free_port()}", "m", "ok", EXPECTED, max_tokens=3,
            deadline_s=1.0,
        )  # fmt: skip
    assert out.kind == "unreachable"


async def test_steady_load_runs_until_stopped(stand_in: str) -> None:
    load = SteadyLoad(stand_in, "m", ["ok", "error_event"], [EXPECTED, EXPECTED], clients=3)
    async with load:
        assert await load.wait_for(lambda outs: len(outs) >= 12, within_s=30)
    kinds = {o.kind for o in load.outcomes}
    assert kinds == {"completed", "error_event"}
    assert {o.client for o in load.outcomes} == {0, 1, 2}


def test_report_counts_and_fault_windows() -> None:
    def outcome(kind: str, start: float, ttft: float) -> Outcome:
        return Outcome(0, 0, start, start + 1, kind, ttft_s=ttft)

    outcomes = [
        outcome("completed", 0, 0.1),
        outcome("completed", 10, 2.0),  # during the fault
        outcome("http_error", 11, 0.0),
        outcome("silent", 30, 0.1),
    ]
    summary = report(outcomes, [FaultWindow("kill", 9.5, 12)], failed_over=3)
    assert summary["requests"] == 4
    assert summary["completed"] == 2
    assert summary["errors"] == 1
    assert summary["violations"] == 1
    assert summary["failed_over"] == 3
    assert summary["ttft_p99_ms_during_faults"] == 2000.0
    assert summary["ttft_p99_ms_outside_faults"] == 100.0
    assert summary["per_fault"]["kill"]["requests"] == 2
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile([], 99) is None
