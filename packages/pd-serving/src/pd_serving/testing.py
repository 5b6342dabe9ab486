"""Test helpers: a stand-in OpenAI upstream recording what a proxy sends it (for testing the
proxy, not vLLM), and waiting for processes to exit."""

from __future__ import annotations

import asyncio
import json
import os
import select
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "tiny"


@dataclass
class FakeUpstream:
    """Answers /v1/completions and /v1/chat/completions; streams ``tokens`` as SSE when asked.

    ``fail_status`` makes every generation answer that status; ``token_delay_s`` slows the stream;
    ``kv_params`` is returned as the answer's ``kv_transfer_params`` (what a P does).
    """

    name: str
    tokens: list[str] = field(default_factory=lambda: [" a", " b", " c", " d"])
    kv_params: dict[str, Any] | None = None
    fail_status: int | None = None
    token_delay_s: float = 0.0
    answer_delay_s: float = 0.0
    # Drop the connection after this many streamed tokens (an instance dying mid-answer).
    break_after: int | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.started.set()
        try:
            if self.answer_delay_s:
                await asyncio.sleep(self.answer_delay_s)
            if self.fail_status is not None:
                return web.json_response(
                    {"error": {"message": f"{self.name} fails", "type": "BadRequestError"}},
                    status=self.fail_status,
                )
            tokens = self.tokens[: body.get("max_tokens") or len(self.tokens)]
            if not body.get("stream"):
                return web.json_response(
                    {
                        "object": "text_completion",
                        "model": MODEL,
                        "choices": [
                            {"index": 0, "text": "".join(tokens), "finish_reason": "length"}
                        ],
                        "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)},
                        "kv_transfer_params": self.kv_params,
                        "served_by": self.name,
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, tok in enumerate(tokens):
                if self.break_after is not None and i == self.break_after:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                event = {"choices": [{"index": 0, "text": tok, "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise


def wait_all_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait (on pidfds, no polling) until every pid exited; returns the ones still alive."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout
    try:
        while fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _, _ = select.select(list(fds), [], [], remaining)
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return set(fds.values())
    finally:
        for fd in fds:
            os.close(fd)
