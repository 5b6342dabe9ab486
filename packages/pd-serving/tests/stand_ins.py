"""Test helpers: a stand-in OpenAI upstream recording what a proxy sends it (for testing the
proxy, not vLLM), a stand-in KV-event publisher, and waiting for processes to exit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from hybrid_connector.contract import PullParams, decode_params
from hybrid_connector.migration import (
    MIGRATE_OUT,
    PRECOPY,
    MigrateOutRequest,
    MigrateOutResponse,
    PrecopyRequest,
    PrecopyResponse,
)
from hybrid_connector.protocol import RELEASE, ReleaseRequest, ReleaseResponse
from simple_rpc import CallContext, Server

MODEL = "tiny"
T = TypeVar("T")


@dataclass
class FakeUpstream:
    """Answers /v1/completions and /v1/chat/completions; streams ``tokens`` as SSE when asked.

    ``kv_params`` is returned as the answer's ``kv_transfer_params`` (what a P does; a callable
    is given the request's ``kv_transfer_params`` and returns them, to echo a transfer id). Failure
    modes (for the next ``fail_times`` generation requests, or all when None):
    ``fail_status`` answers that status; ``hang`` never answers (until the caller gives up);
    ``die_before_answer`` drops the connection without a byte; ``bad_body`` answers 200 with a
    body that is not JSON; ``break_after`` drops it after
    that many streamed tokens; ``error_after`` streams vLLM's error event (then ``[DONE]``, in
    the 200) after that many tokens, as vLLM does when its engine fails; ``token_delay_s``
    slows the stream. ``/tokenize`` answers ``tokens_of`` the prompt or the messages' contents
    (``tokenize_status`` other than 200: that status). ``refuse()`` stops listening
    (connection refused) and ``start()`` again listens on the same port. ``/health`` answers
    ``health_status``; ``/metrics`` vLLM's load gauges from ``waiting``, ``running``, ``kv_usage``.
    ``active`` counts generation requests being handled (0 once every call was closed).
    """

    name: str
    tokens: list[str] = field(default_factory=lambda: [" a", " b", " c", " d"])
    kv_params: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None
    fail_status: int | None = None
    token_delay_s: float = 0.0
    answer_delay_s: float = 0.0
    # Drop the connection after this many streamed tokens (an instance dying mid-answer).
    break_after: int | None = None
    # Stream vLLM's error event and [DONE] after this many tokens (its engine failing).
    error_after: int | None = None
    hang: bool = False
    # Answer 200 with a body that is not JSON.
    bad_body: bool = False
    die_before_answer: bool = False
    fail_times: int | None = None
    health_status: int = 200
    tokenize_status: int = 200
    tokenized: list[dict[str, Any]] = field(default_factory=list)
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    active: int = 0
    peak_active: int = 0  # the most generation requests handled at once
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    url: str = ""
    port: int = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self.port}"
        self.idle.set()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def refuse(self) -> None:
        """Stop listening: calls are refused (``start()`` listens on the same port again)."""
        await self.close()

    def _failing(self) -> bool:
        if self.fail_times is None:
            return True
        if self.fail_times > 0:
            self.fail_times -= 1
            return True
        return False

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        if self.tokenize_status != 200:
            return web.json_response({"error": "no"}, status=self.tokenize_status)
        text = body.get("prompt") or "".join(m["content"] for m in body.get("messages", []))
        return web.json_response({"tokens": tokens_of(text), "count": len(text)})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({}, status=self.health_status)

    async def _metrics(self, _request: web.Request) -> web.Response:
        text = (
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {self.kv_usage}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.started.set()
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        self.idle.clear()
        failing = self._failing()
        try:
            if self.answer_delay_s:
                await asyncio.sleep(self.answer_delay_s)
            if failing and self.hang:
                await asyncio.Event().wait()  # until the caller closes the connection
            if failing and self.die_before_answer:
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            if failing and self.bad_body:
                return web.Response(body=b"{not json", content_type="application/json")
            if failing and self.fail_status is not None:
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
                        "kv_transfer_params": self.kv_params(body.get("kv_transfer_params", {}))
                        if callable(self.kv_params)
                        else self.kv_params,
                        "served_by": self.name,
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, tok in enumerate(tokens):
                if failing and self.break_after is not None and i == self.break_after:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if failing and self.error_after is not None and i == self.error_after:
                    error = {"message": f"{self.name} engine error", "type": "InternalServerError"}
                    payload = {"error": {**error, "param": None, "code": 500}}
                    await resp.write(f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode())
                    await resp.write_eof()
                    return resp
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                event = {
                    "id": f"cmpl-{self.name}",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": tok, "finish_reason": None}],
                }
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()


def next_token(token: int) -> int:
    """The stand-in decode's model: each token a function of the one before."""
    return (token * 7 + 3) % 1000


class ByteText:
    """A byte-level tokenizer over the stand-in model's token ids (each id a byte, ids from
    256 a byte and a letter), detokenized as vLLM's detokenizer does: a ``tokenizers`` decode
    stream primed with the prompt, holding a character's first bytes back until it is whole."""

    def __init__(self, vocab_size: int = 1000) -> None:
        from tokenizers import Tokenizer, decoders, models

        char = _byte_chars()
        vocab = {
            char[i % 256] + ("" if i < 256 else chr(ord("a") + i // 256)): i
            for i in range(vocab_size)
        }
        self.tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        self.tokenizer.decoder = decoders.ByteLevel()

    def stream(self, prompt: list[int]) -> Callable[[int], str]:
        """Each next token's text (empty while a character is incomplete)."""
        from tokenizers.decoders import DecodeStream

        decode = DecodeStream(ids=prompt, skip_special_tokens=True)
        return lambda token: decode.step(self.tokenizer, token) or ""

    def text(self, prompt: list[int], tokens: list[int]) -> str:
        """The whole text a request's stream sends for ``tokens``."""
        step = self.stream(prompt)
        return "".join(step(t) for t in tokens)

    def cut_inside_a_character(self, tokens: list[int]) -> bool:
        return self.tokenizer.decode(tokens).endswith("\ufffd")


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as a printable character."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


BYTE_TEXT = ByteText()


def model_tokens(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens the stand-in decode's model generates after ``prompt``."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


@dataclass
class _Stream:
    prompt: list[int]
    max_tokens: int = 0
    outputs: list[int] = field(default_factory=list)
    stop_at: int | None = None
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    proceed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # the caller went away
    transport: Any = None


@dataclass
class FakeDecode:
    """A D with HybridConnector as the proxy sees it: ``/v1/completions`` streaming the model
    (``next_token``; prompts are token ids), and a transfer_kv server answering MIGRATE_OUT
    (the stream ends after one more token; the answer has its tokens, as D1's connector's) and
    RELEASE (recorded).

    Faults: ``fail_new`` answers 503 to generation requests; ``die_on`` ("precopy" or
    "migrate_out") makes the instance die when that RPC comes (``die``: every stream and
    connection dropped, nothing listens); ``break_at_stop`` drops a stopped stream's
    connection before its last token (D1 dying after the stop); ``close_rpc`` stops only the
    transfer server (connections refused)."""

    name: str
    refuse_migration: bool = False
    # PRECOPY offers the stream's tokens in whole blocks of this size; 0: refused.
    precopy_block: int = 0
    refuse_unstreamed: bool = False  # answer 503 to non-streaming requests (a warm-up)
    hang: bool = False  # never answer generation requests
    # A request not migrated in stops after this many tokens until ``proceed`` (or MIGRATE_OUT).
    pause_after: int | None = None
    # A first D's stream whose request body this is true of holds its second-to-last token
    # until MIGRATE_OUT stops it: a move asked mid-stream never races the stream's end.
    hold_for_migration: Callable[[dict[str, Any]], bool] | None = None
    token_delay_s: float = 0.0
    fail_new: bool = False
    die_on: str = ""
    break_at_stop: bool = False
    # Each token's text as vLLM streams it with a byte-level tokenizer (``ByteText``), a
    # character split over tokens included; else " t<id>".
    byte_text: bool = False
    # /metrics: KV usage as the running streams' tokens over this many (0: always 0).
    kv_capacity: int = 0
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
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._rpc = Server()
        self._rpc.register(MIGRATE_OUT, self._on_migrate_out)
        self._rpc.register(PRECOPY, self._on_precopy)
        self._rpc.register(RELEASE, self._on_release)
        self.rpc_address = await self._rpc.start("127.0.0.1", 0)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.close_rpc()

    async def close_rpc(self) -> None:
        if self._rpc is not None:
            await self._rpc.close()
            self._rpc = None

    async def die(self) -> None:
        """Every stream's connection dropped, then nothing listens (a killed instance)."""
        for stream in self.streams.values():
            if stream.transport is not None:
                stream.transport.abort()
        await self.close()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({})

    async def _metrics(self, _request: web.Request) -> web.Response:
        running = [s for s in self.streams.values() if not s.ended.is_set()]
        held = sum(len(s.prompt) + len(s.outputs) for s in running)
        usage = min(1.0, held / self.kv_capacity) if self.kv_capacity else 0.0
        text = (
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {len(running)}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {usage}\n'
            f'vllm:num_preemptions_total{{model_name="{MODEL}"}} 0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _dying(self) -> None:
        """In an RPC handler: the instance dies; the call is never answered."""
        asyncio.get_running_loop().create_task(self.die())
        await asyncio.Event().wait()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.called.set()
        if self.hang:
            await asyncio.Event().wait()
        if self.fail_new:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        if self.refuse_unstreamed and not body.get("stream"):
            return web.json_response({"error": {"message": "busy"}}, status=503)
        params = decode_params(body.get("kv_transfer_params"))
        # A request without a pull (a recomputing migration) cannot be migrated again.
        key = (
            params.transfer_id if isinstance(params, PullParams) else f"local-{len(self.received)}"
        )
        stream = self.streams[key] = _Stream(
            list(body["prompt"]), body["max_tokens"], transport=request.transport
        )
        try:
            return await self._stream(request, body, params, stream)
        except asyncio.CancelledError:
            stream.closed.set()
            raise

    async def _stream(
        self, request: web.Request, body: dict[str, Any], params: Any, stream: _Stream
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        last = stream.prompt[-1]
        text_of = BYTE_TEXT.stream(stream.prompt) if self.byte_text else (lambda t: f" t{t}")
        first_d = isinstance(params, PullParams) and not params.transfer_id.startswith("mig-")
        held = first_d and self.hold_for_migration is not None and self.hold_for_migration(body)
        for i in range(body["max_tokens"]):
            if i == self.pause_after and first_d:
                stream.paused.set()
                await stream.proceed.wait()
            if held and i == body["max_tokens"] - 2:
                await stream.proceed.wait()
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = next_token(last)
            stream.outputs.append(last)
            ends = i == body["max_tokens"] - 1 or len(stream.outputs) == stream.stop_at
            if ends and self.break_at_stop and stream.stop_at is not None:
                stream.ended.set()  # stopped, its KV held; the connection drops first
                assert stream.transport is not None
                stream.transport.abort()
                return resp
            # As vLLM: token ids (and the prompt's, first) when asked, else null.
            ids = body.get("return_token_ids")
            choice = {
                "index": 0,
                "text": text_of(last),
                "finish_reason": "length" if ends else None,
                "prompt_token_ids": stream.prompt if i == 0 and ids else None,
                "token_ids": [last] if ids else None,
            }
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
        if self.die_on == "migrate_out":
            await self._dying()
        if stream is None or self.refuse_migration:
            return MigrateOutResponse(req.transfer_id, stopped=False, reason="not here")
        # As D1's connector: a request that ends by itself first is not stopped.
        if stream.ended.is_set() or len(stream.outputs) + 1 >= stream.max_tokens:
            return MigrateOutResponse(req.transfer_id, stopped=False, reason="request finished")
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

    async def _on_precopy(self, req: PrecopyRequest, _ctx: CallContext) -> PrecopyResponse:
        stream = self.streams.get(req.transfer_id)
        if self.die_on == "precopy":
            await self._dying()
        if stream is None or not self.precopy_block:
            return PrecopyResponse(req.transfer_id, offered=False, reason="not here")
        tokens = stream.prompt + stream.outputs
        full = (len(tokens) - 1) // self.precopy_block * self.precopy_block
        return PrecopyResponse(
            req.transfer_id,
            offered=True,
            precopy_id=req.precopy_id,
            remote_rpc_address=self.rpc_address,
            token_ids=tokens[:full],
            next_token_ids=tokens[full : full + 1],
        )

    async def _on_release(self, req: ReleaseRequest, _ctx: CallContext) -> ReleaseResponse:
        self.releases.append(req)
        self.released.set()
        return ReleaseResponse(req.transfer_id, released=True)


def smoke_prompt(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` token ids the stand-ins' model answers (the benchmarks' smoke runs)."""
    return [3 + (seed * 31 + i) % 400 for i in range(n)]


PREFILL_RPC = "127.0.0.1:1"  # the stand-in P's pull address (a closed port)


def fake_prefill() -> FakeUpstream:
    """A stand-in P answering HybridConnector's ``kv_transfer_params`` (its pull address,
    ``PREFILL_RPC``, is never dialled: the stand-in D's do not pull)."""
    return FakeUpstream(
        "P",
        kv_params=lambda kv: {
            "do_remote_prefill": True,
            "transfer_id": kv["transfer_id"],
            "remote_rpc_address": PREFILL_RPC,
        },
    )


@contextlib.asynccontextmanager
async def fake_1p2d(**decode: Any) -> AsyncIterator[tuple[Any, list[FakeDecode]]]:
    """A stand-in P answering HybridConnector's ``kv_transfer_params`` (as the prefill
    ``Backend``) and two stand-in D's (``FakeDecode(**decode)``), started, then closed."""
    from pd_serving.routing import Backend

    prefill = fake_prefill()
    decodes = [FakeDecode(f"D{i}", **decode) for i in range(2)]
    await prefill.start()
    try:
        for d in decodes:
            await d.start()
        yield Backend(prefill.url, rpc_address=PREFILL_RPC), decodes
    finally:
        await prefill.close()
        for d in decodes:
            await d.close()


class FakeKvPublisher:
    """vLLM's side of the KV-event wire (topic, 8-byte sequence number, msgpack batch) on an
    XPUB socket: a PUB that hears subscriptions, so a test publishes once a subscriber's
    subscription arrived (what a PUB sends before that is never delivered)."""

    def __init__(self, context: zmq.asyncio.Context, port: int, block_size: int = 4) -> None:
        self.sock = context.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.block_size = block_size
        self.seq = 0
        self._hashes = 0

    async def subscribed(self, within_s: float = 30.0) -> None:
        """Until a subscriber's subscription (to every topic) arrives."""
        assert await asyncio.wait_for(self.sock.recv(), within_s) == b"\x01"

    async def send(self, *events: dict[str, Any], raw: bytes | None = None) -> None:
        payload = raw if raw is not None else msgspec.msgpack.encode([1.0, list(events), 0])
        await self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def stored(self, tokens: list[int], medium: str = "GPU") -> dict[str, Any]:
        """A BlockStored event of the full blocks of ``tokens`` (a prompt from its start)."""
        blocks = len(tokens) // self.block_size
        self._hashes += blocks
        return {
            "type": "BlockStored",
            "block_hashes": list(range(self._hashes - blocks, self._hashes)),
            "parent_block_hash": None,
            "token_ids": tokens[: blocks * self.block_size],
            "block_size": self.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }

    def close(self) -> None:
        self.sock.close(linger=0)


def tokens_of(text: str) -> list[int]:
    """The stand-ins' tokenizer: one token per character."""
    return [ord(c) % 500 for c in text]


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


async def wait_until(
    read: Callable[[], Awaitable[T]], done: Callable[[T], bool], within_s: float = 30.0
) -> T:
    """For state that has no event (vLLM shows its counters and KV usage only as metrics, a
    step after the HTTP answer): re-read with backoff (10 ms, doubling up to 1 s) until ``done``
    holds or ``within_s`` passed; returns the last reading either way."""
    deadline = time.monotonic() + within_s
    delay = 0.01
    while True:
        reading = await read()
        if done(reading) or time.monotonic() > deadline:
            return reading
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


class TcpRelay:
    """A TCP relay in front of an instance (``upstream``: host:port), for what a proxy sees of
    that instance dying while it answers: ``die()`` drops every connection and stops
    listening (then connections are refused). With ``die_on``, it dies the first time those
    bytes come from upstream: before passing them on, or, with ``pass_first``, after."""

    def __init__(self, upstream: str, die_on: bytes = b"", pass_first: bool = False) -> None:
        self.host, _, port = upstream.rpartition(":")
        self.port = int(port)
        self.die_on = die_on
        self.pass_first = pass_first
        self.url = ""
        self.died = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def die(self) -> None:
        self.died.set()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        await self.die()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.died.is_set():
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer, watch=False)),
            asyncio.ensure_future(self._pump(up_reader, writer, watch=True)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, watch: bool
    ) -> None:
        tail = b""
        while data := await reader.read(65536):
            seen = watch and bool(self.die_on) and self.die_on in tail + data
            tail = data[-len(self.die_on) :] if self.die_on else b""
            if seen and not self.pass_first:
                await self.die()
                return
            writer.write(data)
            await writer.drain()
            if seen:
                await self.die()
                return
