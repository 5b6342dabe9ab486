"""Live migration of decoding requests between decode instances: the proxy's I/O shell.

``POST /admin/migrate?instance=NAME[&to=NAME][&limit=N]`` moves the requests that D ``NAME``
decodes to another D (``to``, or the Router's pick), each while its client's stream goes on: no
token lost, repeated or reordered, greedy output token for token as if never moved, and no
prompt recomputed (the new D pulls the KV from the old one). The answer lists each request and
how its migration ended (``moved``, with ``recomputed`` when the old D failed on the way and the
new one recomputed; ``refused`` with the reason; ``failed``).

What each request does is decided by ``migration.Migration`` (its docstring has the diagram);
this module carries it out. ``LiveStream.relay`` is the rest of a client's stream once its first
event went out (``proxy._Flow._relay`` hands it over): it forwards the current D's events,
withholds that D's end while a migration is asked, calls the next D with the prompt and every
token so far (``/v1/completions`` with token ids, ``max_tokens`` lowered by what was generated,
``kv_transfer_params`` pulling the old D's KV with ``remote_num_tokens``), and relays its events
rewritten as the same stream (the first event's id and creation time; usage counted from the
client's prompt; logprobs' text offsets running on; the new prompt's token ids not echoed; its
first text mended when the move cut a multi-byte character, ``_TextMend``). A migrated request
can move again. Before the stop it pre-copies (``LiveStreams.precopy``):
PRECOPY to the old D, then a one-token warm-up on the next D pulling the offered full blocks into
its prefix cache, so the stop's call pulls only the blocks after them.

The D's are asked for token ids (``return_token_ids``; taken out of the events again when the
client did not ask for them): the proxy knows every token the client has, so when the old D
fails mid-migration (its stream breaks, its transfer address cannot be reached) the new D
recomputes from the prompt and those tokens, without a pull, and the stream goes on from there.
A non-streaming request is streamed from its D's (with usage) and answered whole at its end
(``LiveStream.assemble``): it migrates as a stream does, and its client gets one answer.

Migrates: ``/v1/completions`` with HybridConnector, on a D whose transfer address the proxy
knows (``--decode URL@RPC``), served through a transfer (a PD request, or one migrated in; a D
that prefilled the prompt itself, or one that recomputed a request, is not migrated), without
``echo``, ``prompt_logprobs``, ``n`` > 1 or ``best_of``. Token for token for greedy requests; a
seeded sampler starts again from its seed on the new D, presence and frequency penalties count
the earlier tokens as prompt there, and a stop string cut by the move is not seen.

Imports nothing of ``proxy`` (it imports this module): the proxy hands in its flow objects and
its ``CallFailed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web
from hybrid_connector.contract import PullParams, encode_params
from hybrid_connector.control import migrate_out, precopy
from hybrid_connector.migration import MIGRATION_ID_PREFIX, MigrateOutResponse, PrecopyResponse
from prometheus_client import Counter
from simple_rpc import Client, RpcError, TransportError

from pd_serving.failover import Failure, Stage
from pd_serving.migration import Action, Decision, Migration
from pd_serving.routing import Backend, NoBackend
from pd_serving.sse import SseEvents, next_events

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
# vLLM's default max_tokens for /v1/completions when the body has none.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# MIGRATE_OUT: the instance answers after its next step; a stalled one is refused after this.
MIGRATE_OUT_TIMEOUT_S = 60.0
# The client's last token events kept to mend a later D's first text (``_TextMend``).
TEXT_MEND_EVENTS = 16
_DONE = b"data: [DONE]"
_NULL_FINISH = re.compile(rb'"finish_reason"\s*:\s*null')


class LiveStreams:
    """The proxy's migratable answers, by the key of the D serving each, and the admin
    endpoint that migrates them. ``proxy`` is the ``PdProxy``; ``call_failed`` builds its
    exception for a failed call (``CallFailed(stage, backend, failure, message)``), which a
    stream raises as the proxy's own relay does."""

    def __init__(self, proxy: Any, call_failed: Callable[..., Exception]) -> None:
        self.proxy = proxy
        self.call_failed = call_failed
        # False: the next D recomputes the context instead of pulling the KV (the benchmark's
        # competitor; the old D's hold is released at the switch).
        self.pull_kv = True
        # Pre-copy before the stop (with pull_kv): the full blocks move while the old D decodes
        # on, so the stop copies only the last ones. False: a plain stop-and-copy.
        self.precopy = True
        self.streams: dict[str, set[LiveStream]] = {}
        # Called with a D's key when a stream registers there or leaves it (the drains).
        self.on_change: Callable[[str], None] | None = None
        self._rpc_clients: dict[str, Client] = {}
        self.migrations = Counter(
            "pdserve_migrations",
            "Live migrations of decoding requests, by outcome (moved; recomputed: the old D "
            "failed and the new one recomputed from the client's tokens; refused; failed)",
            ["outcome"],
            registry=proxy.metrics.registry,
        )
        self.precopies = Counter(
            "pdserve_migration_precopies",
            "Pre-copies before a live migration's stop, by outcome (warmed: the new D pulled "
            "the full blocks; refused: the old D offered none; warm_failed: the new D failed)",
            ["outcome"],
            registry=proxy.metrics.registry,
        )

    def migratable(self, flow: Any, backend: Backend, stage: Stage) -> bool:
        """Whether ``flow``'s answer from ``backend`` can migrate (see the module)."""
        body = flow.body
        return (
            flow.path == COMPLETIONS
            and stage is Stage.DECODE
            and flow.plan.transfer is not None
            and bool(backend.rpc_address)
            and not body.get("echo")
            and body.get("prompt_logprobs") is None
            and body.get("best_of") in (None, 1)
            and body.get("n") in (None, 1)
            # A non-streaming answer is streamed from the D's and answered whole; one that
            # carries D's R3 reference (or routed-expert records) stays as the D answers it.
            and (
                bool(body.get("stream"))
                or not (self.proxy.config.r3 or self.proxy.config.routed_experts)
            )
        )

    def decode_body(self, flow: Any, backend: Backend, body: dict[str, Any]) -> dict[str, Any]:
        """D's body for ``flow``'s call to ``backend``: a migratable answer asks for token ids
        (the client's tokens, should a D recompute them), and a non-streaming one is streamed
        (with usage) so that it can be stopped and continued."""
        if not self.migratable(flow, backend, Stage.DECODE):
            return body
        body = {**body, "return_token_ids": True}
        if not body.get("stream"):
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def open(
        self, flow: Any, backend: Backend, stage: Stage, resp: aiohttp.ClientResponse
    ) -> LiveStream | None:
        """The answer of ``flow`` from ``backend`` (``resp``), if it can migrate."""
        transfer = flow.plan.transfer
        if transfer is None or not self.migratable(flow, backend, stage):
            return None
        return LiveStream(self, flow, backend, transfer.transfer_id, resp)

    def register(self, stream: LiveStream) -> None:
        self.streams.setdefault(stream.backend.key, set()).add(stream)
        if self.on_change is not None:
            self.on_change(stream.backend.key)

    def unregister(self, stream: LiveStream) -> None:
        streams = self.streams.get(stream.backend.key)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self.streams[stream.backend.key]
        if self.on_change is not None:
            self.on_change(stream.backend.key)

    def client(self, address: str) -> Client:
        client = self._rpc_clients.get(address)
        if client is None:
            client = self._rpc_clients[address] = Client(address, connect_timeout=2.0)
        return client

    async def close(self) -> None:
        for client in self._rpc_clients.values():
            await client.close()
        self._rpc_clients.clear()

    def decode_backend(self, name: str) -> Backend | None:
        for backend in self.proxy.config.decode:
            if name in (backend.key, backend.name, backend.url):
                return backend
        return None

    # -- the admin endpoint ------------------------------------------------------------------
    async def handle_migrate(self, request: web.Request) -> web.Response:
        name = request.query.get("instance", "")
        source = self.decode_backend(name)
        if source is None:
            return _error(404, f"no decode instance {name!r}")
        target: Backend | None = None
        if to := request.query.get("to"):
            target = self.decode_backend(to)
            if target is None or target is source:
                return _error(400, f"'to' must name another decode instance, not {to!r}")
        try:
            limit = int(request.query.get("limit", "0"))
        except ValueError:
            return _error(400, "'limit' must be an integer")
        streams = sorted(self.streams.get(source.key, ()), key=lambda s: s.transfer_id)
        if limit > 0:
            streams = streams[:limit]
        started = []
        for stream in streams:
            dest = target
            if dest is None:
                try:
                    dest = self.proxy.router.pick_decode(stream.flow.key, {source.key})
                except NoBackend:
                    return _error(503, "no other healthy decode instance to migrate to")
            started.append(stream.migrate(dest))
        outcomes = await asyncio.gather(*started)
        log.info("admin: migrate %d streams off %s: %s", len(outcomes), source.key, outcomes)
        return web.json_response({"instance": source.key, "requests": outcomes})


class LiveStream:
    """The rest of one client's answer, from the D serving it now, through its migrations: the
    client's stream, or for a non-streaming client the stream the proxy asked its D's for,
    answered whole at its end (``assemble``)."""

    def __init__(
        self,
        streams: LiveStreams,
        flow: Any,
        backend: Backend,
        transfer_id: str,
        resp: aiohttp.ClientResponse,
    ) -> None:
        self.streams = streams
        self.flow = flow  # proxy._Flow: body, first_event, _write, proxy, router, config
        self.backend = backend  # the D streaming now
        self.transfer_id = transfer_id  # what its request's kv_transfer_params name there
        self.plan = Migration(backend.key)
        self.streaming = bool(flow.body.get("stream"))
        # How a D's failure reads to the proxy: bytes went to a streaming client, none to one
        # answered whole (the proxy may then try again from the start).
        self._broke = Failure.BROKE_MID_STREAM if self.streaming else Failure.BROKE
        # The proxy asked the D's for token ids the client did not: taken out of its events.
        self.strip_ids = self.streaming and not flow.body.get("return_token_ids")
        self.prompt_tokens: int | None = None  # the client's prompt, counted by the first answer
        self.generated = 0  # tokens generated before the current D's request
        self.moved = False  # the stream comes from a later D (its events are rewritten)
        self.answer: MigrateOutResponse | None = None
        self.migration_id = ""
        self.precopy_id = ""  # the pre-copy's transfer id on the old D (when pre-copying)
        # Every output token id the client has (or, answered whole, the proxy collected), and
        # the client's prompt's (its first D's first event has them, unparsed until needed).
        self.output_ids: list[int] = []
        self._prompt_ids: list[int] | None = None
        self._prompt_raw = b""
        self.recomputed = False  # a D recomputed it: no transfer id, it cannot move again
        self._resp = resp  # the current D's answer (closed to cut it where the client has it)
        self._cut: Decision | None = None  # a RECOMPUTE decided while D1's answer was open
        self._last_logprobs = b""  # the last event sent with logprobs (the text offsets)
        self._offset_base = 0  # added to a later D's text offsets
        # The client's last token events (a first D's raw, a later D's (text, tokens)), and the
        # mend of the next D's first text when the switch cut a character (``_TextMend``).
        self._recent: deque[bytes | tuple[str, int]] = deque(maxlen=TEXT_MEND_EVENTS)
        self._mend: _TextMend | None = None
        self._assembler: _Assembler | None = None if self.streaming else _Assembler(flow.body)
        self._target: Backend | None = None
        self._decided: asyncio.Future[Decision] | None = None  # D1's answer, as a decision
        self._outcome: asyncio.Future[dict[str, Any]] | None = None  # for the admin endpoint
        self._ask: asyncio.Task[None] | None = None
        # When each stage of the asked migration happened (time.monotonic()), for its answer.
        self._stages: dict[str, float] = {}
        self._precopied_tokens = 0
        # The pre-copied tokens as JSON: the stop's call serializes only the tokens after them.
        self._prompt_json: _PromptJson | None = None

    # -- asked by the admin endpoint ---------------------------------------------------------
    def migrate(
        self, target: Backend, precopy: bool | None = None
    ) -> asyncio.Future[dict[str, Any]]:
        """Start moving this stream to ``target`` (``precopy``: pre-copy its full blocks first;
        None: as ``LiveStreams.precopy`` says); the future says how it ended."""
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[dict[str, Any]] = loop.create_future()
        if precopy is None:
            precopy = self.streams.precopy
        if self.recomputed:
            decision = Decision(Action.REFUSE, message="recomputed: no KV transfer to move by")
        else:
            decision = self.plan.requested(target.key, precopy and self.streams.pull_kv)
        if decision.action not in (Action.ASK_D1, Action.ASK_PRECOPY):
            self.streams.migrations.labels("refused").inc()
            refused = self._outcome_of("refused", decision.message, target)
            outcome.set_result({**refused, "stages_ms": {}, "precopied_tokens": 0})
            return outcome
        self._target, self._outcome = target, outcome
        self._stages = {"asked": time.monotonic()}
        self._precopied_tokens = 0
        self._decided = loop.create_future()
        self.migration_id = f"{MIGRATION_ID_PREFIX}{uuid.uuid4().hex}"
        if decision.action is Action.ASK_PRECOPY:
            self.precopy_id = f"{MIGRATION_ID_PREFIX}pre-{uuid.uuid4().hex}"
            work = self._precopy_then_stop(self.backend, self.transfer_id, target)
        else:
            work = self._ask_d1(self.backend, self.transfer_id)
        self._ask = asyncio.create_task(work)
        return outcome

    async def _precopy_then_stop(self, source: Backend, transfer_id: str, target: Backend) -> None:
        """PRECOPY to D1, the warm-up on the target, then the stop (``_ask_d1``), as the plan
        decides at each answer."""
        assert source.rpc_address is not None
        try:
            answer = await precopy(
                source.rpc_address,
                transfer_id,
                self.precopy_id,
                reason="pdserve admin: migrate",
                timeout_s=MIGRATE_OUT_TIMEOUT_S,
                client=self.streams.client(source.rpc_address),
            )
        except TransportError as exc:  # D1 unreachable: it may be gone
            self._mark("precopy_answered")
            self._decide(self.plan.d1_unreachable(f"PRECOPY: {exc!r}"))
            return
        except RpcError as exc:  # an older connector, an undecodable answer
            answer = PrecopyResponse(transfer_id, offered=False, reason=f"PRECOPY: {exc!r}")
        self._mark("precopy_answered")
        if answer.offered:
            decision = self.plan.precopy_offered()
        else:
            self.streams.precopies.labels("refused").inc()
            decision = self.plan.precopy_refused(answer.reason)
        if decision.action is Action.WARM:
            started = time.monotonic()
            self._prompt_json = _PromptJson(answer.token_ids)
            try:
                await self._warm_up(target, source, answer)
            except Exception as exc:  # the proxy's CallFailed, aiohttp's errors, the timeout
                message = getattr(exc, "message", None) or repr(exc)
                log.warning(
                    "transfer %s: warm-up on %s failed, the request stays on %s: %s",
                    transfer_id,
                    target.key,
                    source.key,
                    message,
                )
                self.flow.router.record_failure(target, time.monotonic(), message[:300])
                self.streams.precopies.labels("warm_failed").inc()
                decision = self.plan.warm_failed(f"the warm-up on {target.key} failed: {message}")
                self._carry(decision)
                self._finish("refused", decision.message)
                return
            self._mark("warmed")
            self._precopied_tokens = len(answer.token_ids)
            self.streams.precopies.labels("warmed").inc()
            log.info(
                "transfer %s: %d tokens pre-copied from %s to %s in %.0f ms",
                transfer_id,
                len(answer.token_ids),
                source.key,
                target.key,
                (time.monotonic() - started) * 1000,
            )
            decision = self.plan.warmed()
        self._carry(decision)
        if decision.action is Action.ASK_D1:
            await self._ask_d1(source, transfer_id)

    async def _warm_up(self, target: Backend, source: Backend, answer: PrecopyResponse) -> None:
        """One token on the target from the pre-copied tokens, pulling their KV from the old D:
        they stay in its prefix cache for the stop's call. Its prompt ends with the token after
        them (when the old D named it), so that the one token the target computes lies past the
        cached blocks, and those hold the old D's KV alone. Its answer is dropped."""
        body = dict(self.flow.body)  # the client's (its cache_salt and model: the same hashes)
        for key in ("stream_options", "min_tokens", "logprobs", "n", "best_of", "suffix"):
            body.pop(key, None)
        body.pop("prompt", None)
        body.update(max_tokens=1, stream=False, echo=False, return_token_ids=False)
        body["kv_transfer_params"] = encode_params(
            PullParams(
                transfer_id=self.precopy_id,
                remote_rpc_address=source.rpc_address or answer.remote_rpc_address,
                remote_tp_size=answer.remote_tp_size,
                remote_num_tokens=len(answer.token_ids),
            )
        )
        assert self._prompt_json is not None
        prompt = [*answer.token_ids, *answer.next_token_ids[:1]]
        payload = _json_body(body, self._prompt_json.encode(prompt))
        async with self.flow.proxy._open(target, COMPLETIONS, payload, Stage.DECODE) as resp:
            async with asyncio.timeout(self.flow.config.attempt_timeout_s):
                await resp.read()

    async def _ask_d1(self, source: Backend, transfer_id: str) -> None:
        assert source.rpc_address is not None
        self._mark("stop_asked")
        try:
            answer = await migrate_out(
                source.rpc_address,
                transfer_id,
                self.migration_id,
                reason="pdserve admin: migrate",
                timeout_s=MIGRATE_OUT_TIMEOUT_S,
                client=self.streams.client(source.rpc_address),
            )
        except TransportError as exc:  # D1 unreachable: it may be gone
            self._mark("d1_answered")
            log.warning(
                "transfer %s: %s unreachable for MIGRATE_OUT: %r", transfer_id, source.key, exc
            )
            self._decide(self.plan.d1_unreachable(f"MIGRATE_OUT: {exc!r}"))
            return
        except RpcError as exc:  # an answer that does not decode, an older connector
            answer = MigrateOutResponse(transfer_id, stopped=False, reason=f"MIGRATE_OUT: {exc!r}")
        self._mark("d1_answered")
        if answer.stopped:
            self.answer = answer
            if self.prompt_tokens is None:
                self.prompt_tokens = len(answer.prompt_token_ids)
            decision = self.plan.d1_stopped()
        else:
            decision = self.plan.d1_refused(answer.reason)
            self._finish("refused", answer.reason)
        log.info(
            "transfer %s on %s: migration to %s %s",
            transfer_id,
            source.key,
            self._target.key if self._target else "?",
            f"stopped after {len(answer.output_token_ids)} tokens"
            if answer.stopped
            else f"refused: {answer.reason}",
        )
        self._decide(decision)

    def _decide(self, decision: Decision) -> None:
        """D1's answer (or its absence) as a decision, for a relay holding D1's end. A RECOMPUTE
        cuts D1's answer: the relay reads no further and takes the decision instead."""
        self._carry(decision)
        if decision.action is Action.RECOMPUTE:
            self._cut = decision
            self._resp.close()  # the relay's read ends; D1 (if alive) aborts the request
        elif decision.action is Action.END_ON_D1 and decision.release:
            self._finish("refused", decision.message)
        if self._decided is not None and not self._decided.done():
            self._decided.set_result(decision)

    # -- the stream --------------------------------------------------------------------------
    def take_first(self, first: list[bytes]) -> list[bytes]:
        """The first D's first events, as the client gets them (the proxy writes them): their
        token ids counted, the prompt's kept unparsed."""
        event = first[0]
        if self._prompt_raw == b"" and (found := _prompt_token_ids(event)) is not None:
            self._prompt_raw = event[found[0] : found[1]]
            if self.strip_ids:
                event = event[: found[0]] + b"null" + event[found[1] :]
        return [self._out(e) for e in [event, *first[1:]]]

    async def relay(
        self,
        chunks: AsyncIterator[bytes],
        events: Any,
        done: bool,
        upstream_error: bytes | None,
    ) -> tuple[bool, bytes | None]:
        """Forward the stream to its end, across migrations; (``[DONE]`` seen, an error event
        the upstream sent). Raises the proxy's ``CallFailed`` as its plain relay does."""
        self.streams.register(self)
        leg = contextlib.AsyncExitStack()  # the current D's call (the first one: the flow's)
        first: list[bytes] = []  # a later D's first events
        try:
            while True:
                switch, done, upstream_error = await self._relay_leg(
                    chunks, events, first, done, upstream_error
                )
                if switch is None:
                    return done, upstream_error
                next_leg = contextlib.AsyncExitStack()
                try:
                    chunks, events, first = await self._switch(switch, next_leg)
                except BaseException:
                    await next_leg.aclose()
                    raise
                await leg.aclose()
                leg, done, upstream_error = next_leg, False, None
        except _LegFailed as failed:
            self._finish("failed", failed.message)
            raise self.streams.call_failed(
                Stage.DECODE, failed.backend, failed.failure, failed.message
            ) from failed.__cause__
        except BaseException:  # the client went away (or the handler was cancelled)
            self._carry(self.plan.client_gone())
            raise
        finally:
            self.streams.unregister(self)
            if self._ask is not None and not self._ask.done():
                self._ask.cancel()
            self._finish("failed", "the stream ended first")  # no-op once decided
            await leg.aclose()

    async def assemble(
        self, chunks: AsyncIterator[bytes], events: Any, first: list[bytes]
    ) -> dict[str, Any]:
        """A non-streaming client's answer: the stream of its D's (``first``: the first D's
        first events, through ``take_first``), across migrations, as the one answer the client
        asked for."""
        assert self._assembler is not None
        upstream_error = next(filter(_is_error_event, first), None)
        done = self._assembler.add(first)  # nothing goes to the client before the end
        if not done:
            done, upstream_error = await self.relay(chunks, events, done, upstream_error)
        if not done:
            message = f"decode {self.backend.url} ended its stream without [DONE]"
            raise self.streams.call_failed(Stage.DECODE, self.backend, Failure.BROKE, message)
        if upstream_error is not None:
            why = upstream_error.strip()[:300].decode(errors="replace")
            raise self.streams.call_failed(Stage.DECODE, self.backend, Failure.BROKE, why)
        return self._assembler.answer()

    async def _relay_leg(
        self,
        chunks: AsyncIterator[bytes],
        events: Any,
        first: list[bytes],
        done: bool,
        upstream_error: bytes | None,
    ) -> tuple[Decision | None, bool, bytes | None]:
        """One D's stream to its end (``first``: its events already read): (the CALL or
        RECOMPUTE decision when the request moves on, [DONE] seen, an error event). The finish
        chunk of a D the request leaves goes on without its end, and what follows it (usage,
        [DONE]) is dropped."""
        switch: Decision | None = None
        try:
            while batch := first or await next_events(chunks, events):
                first = []
                if switch is not None:
                    continue
                upstream_error = upstream_error or next(filter(_is_error_event, batch), None)
                out: list[bytes] = []
                for raw in batch:
                    if switch is not None:
                        continue
                    event = self._out(raw)
                    if (reason := _finish_reason(event)) is not None:
                        self._mark("d1_end")
                        decision = self.plan.d1_ended(self._complete(reason))
                        if decision.release_precopy or decision.release:
                            # It ended on D1 while pre-copying, or as D1 stopped it.
                            self._carry(decision)
                            self._finish("refused", decision.message)
                        if decision.action is Action.HOLD:
                            assert self._decided is not None
                            decision = await self._decided
                        if decision.action in (Action.CALL, Action.RECOMPUTE):
                            switch = decision
                            out.append(_unfinished(event))
                            continue
                    out.append(event)
                done = await self._write(out) or done
        except (aiohttp.ClientError, TimeoutError) as exc:
            if switch is not None or done:
                return switch, done, upstream_error
            return self._broke_off(repr(exc)), done, upstream_error
        if switch is None and not done:
            return self._broke_off("ended without [DONE]"), done, upstream_error
        return switch, done, upstream_error

    def _broke_off(self, why: str) -> Decision:
        """D1's stream ended before its end: the cut asked, a recompute, or its failure."""
        if self._cut is not None:
            return self._cut
        decision = self.plan.d1_failed(why)
        self._carry(decision)
        if decision.action is Action.RECOMPUTE:
            log.warning("transfer %s: %s; %s recomputes", self.transfer_id, why, decision.target)
            return decision
        message = f"decode {self.backend.url} broke off a stream: {why}"
        raise _LegFailed(self.backend, self._broke, message)

    async def _write(self, out: list[bytes]) -> bool:
        """Events to the client (or, answered whole, to its answer); True at ``[DONE]``."""
        if self._assembler is not None:
            return self._assembler.add(out)
        return bool(await self.flow._write(out))

    def _complete(self, reason: str) -> bool:
        """An end with ``reason`` answers the request whole (a stop, or the client's whole
        max_tokens), so that a recompute would have nothing left to generate."""
        if reason != "length":
            return True
        limit = self.flow.body.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
        return limit is not None and len(self.output_ids) >= limit

    async def _switch(
        self, decision: Decision, stack: contextlib.AsyncExitStack
    ) -> tuple[AsyncIterator[bytes], Any, list[bytes]]:
        """Call the next D (prompt + tokens, pulling the old D's KV, or recomputing them) until
        one streams (the plan may send the request back to the old D, or on to another one
        that recomputes): its stream and its first events."""
        source = self.backend
        if decision.action is Action.RECOMPUTE and self._ask is not None and not self._ask.done():
            self._ask.cancel()  # a warm-up or an RPC to the old D: it no longer matters
        while True:
            if decision.action is Action.RECOMPUTE and not decision.target:
                decision = self._recompute_target()
            if decision.action is Action.FAIL:
                self._carry(decision)
                raise _LegFailed(source, self._broke, decision.message)
            target = self._backend(decision.target)
            recompute = decision.action is Action.RECOMPUTE
            self._mark("d2_called")
            if recompute:
                generated, payload = len(self.output_ids), self._recompute_body()
            else:
                generated, payload = self._next_body(source)
            events = SseEvents()
            try:
                resp = await stack.enter_async_context(
                    self.flow.proxy._open(target, COMPLETIONS, payload, Stage.DECODE)
                )
                self._mark("d2_answered")
                chunks = resp.content.iter_any()
                async with asyncio.timeout(self.flow.config.attempt_timeout_s):
                    first = await next_events(chunks, events)
                self._mark("d2_first_event")
                # Its first event echoes the new prompt's ids (every token so far): dropped
                # unparsed, the client has them already.
                first = [_without_prompt_token_ids(e) for e in first]
                if not first or _is_error_event(first[0]):
                    message = f"decode {target.url} sent no token of the migrated request"
                    raise _LegFailed(target, Failure.BROKE, message)
            except Exception as exc:  # the proxy's CallFailed, aiohttp's errors, the timeout
                message = getattr(exc, "message", None) or repr(exc)
                log.warning("transfer %s: %s failed: %s", self.migration_id, target.key, message)
                self.flow.router.record_failure(target, time.monotonic(), message[:300])
                await stack.aclose()
                decision = self.plan.called_failed(message)
                self._carry(decision)
                if decision.action in (Action.CALL, Action.RECOMPUTE):
                    continue
                raise _LegFailed(target, self._broke, message) from exc
            self.plan.called_first_token()
            self._offset_base = _next_text_offset(self._last_logprobs)
            self._mend = _TextMend.after(self._recent)
            self.generated = generated
            self.moved = True
            self.streams.unregister(self)
            # The old D's call is over: it no longer counts as open there (a drain of it
            # waits for nothing more of this request).
            self.flow.proxy.end_call(self._resp)
            self.backend, self._resp, self._cut = target, resp, None
            self.plan = Migration(target.key)
            if recompute:  # a request without a transfer: it cannot move again
                self.recomputed, self.transfer_id = True, ""
            else:
                self.transfer_id = self.migration_id
                self.streams.register(self)
            self._finish("recomputed" if recompute else "moved", "", target)
            log.info(
                "transfer %s: %s from %s to %s after %d tokens",
                self.migration_id,
                "recomputed" if recompute else "moved",
                source.key,
                target.key,
                self.generated,
            )
            return chunks, events, first

    def _recompute_target(self) -> Decision:
        """A D for a recompute that named none: the router's pick of those not failed."""
        try:
            target = self.flow.router.pick_decode(self.flow.key, set(self.plan.failed))
        except NoBackend:
            return self.plan.no_target(
                f"no decode instance left to recompute on ({self.plan.reason or 'all failed'})"
            )
        return self.plan.recompute_on(target.key)

    def _next_body(self, source: Backend) -> tuple[int, dict[str, Any] | bytes]:
        """(the tokens generated so far, the client's body for the next D: every token so far
        as the prompt, the rest of its budget, a pull of the old D's KV for all but the last
        token)."""
        answer = self.answer
        assert answer is not None
        tokens = [*answer.prompt_token_ids, *answer.output_token_ids]
        generated = len(tokens) - (self.prompt_tokens or len(answer.prompt_token_ids))
        body = self._body_with_prompt(tokens, generated)
        if not self.streams.pull_kv:
            self.flow.proxy._release_on_prefill(source, self.migration_id, "recomputed elsewhere")
            return generated, body
        body["kv_transfer_params"] = encode_params(
            PullParams(
                transfer_id=self.migration_id,
                remote_rpc_address=source.rpc_address or answer.remote_rpc_address,
                remote_tp_size=answer.remote_tp_size,
                remote_num_tokens=answer.num_tokens,
            )
        )
        if self._prompt_json is None:
            return generated, body
        return generated, _json_body(body, self._prompt_json.encode(body.pop("prompt")))

    def _recompute_body(self) -> dict[str, Any]:
        """The client's body for a D that recomputes: the prompt and the tokens the client has,
        no pull (the old D may be gone)."""
        prompt = self.prompt_ids()
        if prompt is None:
            raise _LegFailed(self.backend, self._broke, "the client's prompt ids are unknown")
        return self._body_with_prompt([*prompt, *self.output_ids], len(self.output_ids))

    def _body_with_prompt(self, tokens: list[int], generated: int) -> dict[str, Any]:
        """The body the client's D got (token ids asked, streamed), with ``tokens`` as its
        prompt and its budget lowered by the tokens generated so far."""
        body = self.streams.decode_body(self.flow, self.backend, dict(self.flow.body))
        body.pop("kv_transfer_params", None)
        body["prompt"] = tokens
        limit = body.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
        if limit is not None:
            body["max_tokens"] = max(1, limit - generated)
        if body.get("min_tokens"):
            body["min_tokens"] = max(0, body["min_tokens"] - generated)
        return body

    def prompt_ids(self) -> list[int] | None:
        """The client's prompt's token ids (the first D's first event, or D1's answer)."""
        if self._prompt_ids is None:
            if self.answer is not None and not self.moved:
                self._prompt_ids = list(self.answer.prompt_token_ids)
            elif self._prompt_raw:
                self._prompt_ids = json.loads(self._prompt_raw)
        if self._prompt_ids is not None and self.prompt_tokens is None:
            self.prompt_tokens = len(self._prompt_ids)
        return self._prompt_ids

    def _out(self, event: bytes) -> bytes:
        """An event as the client gets it (the first D's as it is, a later one's rewritten), its
        token ids counted (and taken out when the client did not ask for them)."""
        if self.moved:
            return self._rewrite(event)
        found = _token_ids(event)
        if found is None:
            return event
        start, end = found
        if end - start > 2:  # not "[]"
            self.output_ids.extend(int(t) for t in event[start + 1 : end - 1].split(b","))
            self._recent.append(event)
            if b'"logprobs":{' in event or b'"logprobs": {' in event:
                self._last_logprobs = event
        if self.strip_ids:
            event = event[:start] + b"null" + event[end:]
        return event

    def _rewrite(self, event: bytes) -> bytes:
        """An event of a later D as part of the client's stream."""
        if event.rstrip() == _DONE:
            return event
        data = _event(event)
        if not data:
            return event
        first = self.flow.first_event
        for key in ("id", "created"):
            if key in first and key in data:
                data[key] = first[key]
        logprobs_seen = False
        for choice in data.get("choices") or []:
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
            ids = choice.get("token_ids") or []
            self.output_ids.extend(ids)
            text = choice.get("text")
            if text and self._mend is not None:
                choice["text"] = text = self._mend.text(text, self.migration_id)
                self._mend = None
            if ids:
                self._recent.append((text or "", len(ids)))
            if self.strip_ids and "token_ids" in choice:
                choice["token_ids"] = None
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("text_offset"):
                base = self._offset_base
                logprobs["text_offset"] = [o + base for o in logprobs["text_offset"]]
                logprobs_seen = True
        usage = data.get("usage")
        if isinstance(usage, dict):
            prompt_tokens = self.prompt_tokens
            if prompt_tokens is None and (prompt := self.prompt_ids()) is not None:
                prompt_tokens = len(prompt)
            if prompt_tokens is not None:
                completion = int(usage.get("completion_tokens") or 0) + self.generated
                usage["prompt_tokens"] = prompt_tokens
                usage["completion_tokens"] = completion
                usage["total_tokens"] = prompt_tokens + completion
                usage.pop("prompt_tokens_details", None)
        out = f"data: {json.dumps(data)}\n\n".encode()
        if logprobs_seen:
            self._last_logprobs = out
        return out

    # -- internals ---------------------------------------------------------------------------
    def _backend(self, key: str) -> Backend:
        if self._target is not None and self._target.key == key:
            return self._target
        found = self.streams.decode_backend(key)
        assert found is not None, key
        return found

    def _carry(self, decision: Decision) -> None:
        """A decision's side effect: RELEASE of the migration's transfers on the old D; once
        per decision, by whoever got it from the plan."""
        if decision.release and self.migration_id:
            self.flow.proxy._release_on_prefill(self.backend, self.migration_id, decision.message)
        if decision.release_precopy and self.precopy_id:
            # Before the switch: self.backend is still the D that holds the pre-copy.
            why = decision.message or "pre-copy over"
            self.flow.proxy._release_on_prefill(self.backend, self.precopy_id, why)
        if decision.action in (Action.FAIL, Action.FREE):
            self._finish("failed", decision.message)

    def _mark(self, stage: str) -> None:
        """The asked migration reached ``stage`` now (the first time counts)."""
        if self._outcome is not None and not self._outcome.done():
            self._stages.setdefault(stage, time.monotonic())

    def _finish(self, outcome: str, reason: str, target: Backend | None = None) -> None:
        """The asked migration ended (the admin endpoint's answer); once. ``recomputed``: moved,
        the new D recomputing the context (the old one failed)."""
        if self._outcome is not None and not self._outcome.done():
            self.streams.migrations.labels(outcome).inc()
            moved = "moved" if outcome == "recomputed" else outcome
            result = self._outcome_of(moved, reason, target or self._target)
            result["recomputed"] = outcome == "recomputed"
            self._outcome.set_result(result)

    def _outcome_of(self, outcome: str, reason: str, target: Backend | None) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "outcome": outcome,
            "to": target.key if target else "",
            "reason": reason,
            "tokens_before": self.generated,  # moved: the tokens the client had before the move
            # Each stage reached, in ms after the ask (time.monotonic() of the ask: "asked_at").
            "stages_ms": {k: (t - asked) * 1000 for k, t in self._stages.items()}
            if (asked := self._stages.get("asked")) is not None
            else {},
            "asked_at": self._stages.get("asked", 0.0),
            "precopied_tokens": self._precopied_tokens,
        }


class _TextMend:
    """The first text a later D sends, as the unmoved stream would have sent it.

    vLLM detokenizes a request's output with a decode stream primed with its prompt. When the
    switch cut a character (a multi-byte UTF-8 character split over tokens, as Chinese text
    or an emoji often is), the old D had not sent its first bytes yet, and the new D's prompt
    ends in them. A decode stream primed with a prompt whose text ends in an incomplete
    character starts with no prefix, so the new D's first text is the whole text of its
    context: the client's prompt, every character the client has, then the new one. What the
    client lacks is what follows the last text it got: the text after the last place it
    occurs in that first text. A cut between characters needs no mend (the new D's first
    text is then its own new text), nor one the old D's last event shows as clean: that event
    had text and one token.
    """

    def __init__(self, tail: str) -> None:
        self.tail = tail  # the end of the text the client has

    @classmethod
    def after(cls, recent: deque[bytes | tuple[str, int]]) -> _TextMend | None:
        """The mend for the next D, from the client's last token events; None when the cut
        is known to be clean or the client has no text to find."""
        seen: list[tuple[str, int]] = []
        for event in recent:
            if isinstance(event, tuple):
                seen.append(event)
                continue
            for choice in _event(event).get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids:
                    seen.append((choice.get("text") or "", len(ids)))
        if not seen:
            return None
        last_text, last_tokens = seen[-1]
        tail = "".join(text for text, _ in seen)
        if (last_text and last_tokens == 1) or not tail:
            return None
        return cls(tail)

    def text(self, first: str, transfer_id: str) -> str:
        """The new D's first text as the client gets it."""
        # The last place that leaves it some text: the new D sent text, so it completed a
        # character. (Text repeating with a period shorter than the mended part could lose
        # whole periods here; the tail of up to TEXT_MEND_EVENTS events makes that rare.)
        at = first.rfind(self.tail, 0, len(first) - 1)
        if at < 0:  # its own new text: the cut was clean after all
            return first
        mended = first[at + len(self.tail) :]
        log.info(
            "transfer %s: the cut split a character; the new decode's first text %d -> %d chars",
            transfer_id,
            len(first),
            len(mended),
        )
        return mended


class _Assembler:
    """A non-streaming client's answer, from the stream its D's sent (token ids, usage): the
    answer vLLM would have given without a stream, its choice's text, token ids and logprobs
    joined (the stream's text offsets already run on across D's)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.token_ids_asked = bool(body.get("return_token_ids"))
        self.logprobs_asked = body.get("logprobs") is not None
        self.head: dict[str, Any] = {}
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.logprobs: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.system_fingerprint: Any = None

    def add(self, events: list[bytes]) -> bool:
        """The client's next events; True at ``[DONE]``."""
        done = False
        for event in events:
            if event.rstrip() == _DONE:
                done = True
                continue
            data = _event(event)
            if not data or "error" in data:
                continue
            if not self.head:
                self.head = {k: data.get(k) for k in ("id", "created", "model")}
            if data.get("usage"):
                self.usage = data["usage"]
            if data.get("system_fingerprint") is not None:
                self.system_fingerprint = data["system_fingerprint"]
            for choice in data.get("choices") or []:
                self.text.append(choice.get("text") or "")
                self.token_ids.extend(choice.get("token_ids") or [])
                if self.prompt_token_ids is None and choice.get("prompt_token_ids"):
                    self.prompt_token_ids = choice["prompt_token_ids"]
                if isinstance(logprobs := choice.get("logprobs"), dict):
                    for key, values in self.logprobs.items():
                        values.extend(logprobs.get(key) or [])
                if choice.get("finish_reason") is not None:
                    self.finish_reason = choice["finish_reason"]
                    self.stop_reason = choice.get("stop_reason")
        return done

    def answer(self) -> dict[str, Any]:
        usage = dict(self.usage or {})
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion = len(self.token_ids) or int(usage.get("completion_tokens") or 0)
        choice = {
            "index": 0,
            "text": "".join(self.text),
            "logprobs": self.logprobs if self.logprobs_asked else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "token_ids": self.token_ids if self.token_ids_asked else None,
            "prompt_logprobs": None,
            "prompt_token_ids": self.prompt_token_ids if self.token_ids_asked else None,
            "routed_experts": None,
        }
        return {
            "id": self.head.get("id"),
            "object": "text_completion",
            "created": self.head.get("created"),
            "model": self.head.get("model"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": self.system_fingerprint,
            # vLLM's whole answer's usage: its stream's keys (details included) and counts.
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": usage.get("prompt_tokens_details"),
                "completion_tokens_details": usage.get("completion_tokens_details"),
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


class _LegFailed(Exception):
    """A D of the stream failed (``LiveStream.relay`` raises it as the proxy's CallFailed)."""

    def __init__(self, backend: Backend, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.failure = failure
        self.message = message


def _event(event: bytes) -> dict[str, Any]:
    data = event.strip().removeprefix(b"data:").strip()
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


class _PromptJson:
    """A prompt's token ids as JSON, kept so that a prompt starting with them is serialized by
    its new tokens alone (at the stop: the tokens decoded since the pre-copy)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self._open = json.dumps(self.tokens)[:-1].encode()  # "[1, 2, 3": no closing bracket

    def encode(self, tokens: list[int]) -> bytes:
        """``json.dumps(tokens)``, as bytes."""
        n = len(self.tokens)
        if not n or len(tokens) < n or tokens[:n] != self.tokens:
            return json.dumps(tokens).encode()
        if len(tokens) == n:
            return self._open + b"]"
        return self._open + b", " + json.dumps(tokens[n:])[1:].encode()


def _json_body(body: dict[str, Any], prompt: bytes) -> bytes:
    """``body`` (without its prompt) as JSON with ``prompt``, JSON already, as its prompt."""
    rest = json.dumps(body).encode() if body else b"{}"
    return b'{"prompt": ' + prompt + (b", " + rest[1:] if len(rest) > 2 else b"}")


def _without_prompt_token_ids(event: bytes) -> bytes:
    """``event`` with its ``prompt_token_ids`` list as null, found without parsing it (a list
    of a whole context's ids is most of the event). The key can not occur inside a JSON
    string: a quote there is escaped."""
    key = event.find(b'"prompt_token_ids":')
    if key < 0:
        return event
    start = key + len(b'"prompt_token_ids":')
    while event[start : start + 1] == b" ":
        start += 1
    if event[start : start + 1] != b"[":
        return event
    end = event.find(b"]", start)
    if end < 0:
        return event
    return event[:start] + b"null" + event[end + 1 :]


_TOKEN_IDS = re.compile(rb'"token_ids"\s*:\s*(\[[^\]]*\]|null)')
_PROMPT_TOKEN_IDS = re.compile(rb'"prompt_token_ids"\s*:\s*(\[[^\]]*\])')


def _token_ids(event: bytes) -> tuple[int, int] | None:
    """Where an event's output ``token_ids`` list (or null) is, found without parsing it. The
    key can not occur inside a JSON string (a quote there is escaped), nor match the prompt's."""
    found = _TOKEN_IDS.search(event)
    return None if found is None else found.span(1)


def _prompt_token_ids(event: bytes) -> tuple[int, int] | None:
    """Where an event's ``prompt_token_ids`` list is (a first event's), unparsed."""
    found = _PROMPT_TOKEN_IDS.search(event)
    return None if found is None else found.span(1)


def _next_text_offset(event: bytes) -> int:
    """The text offset after the last token of ``event`` (the last one the client got with
    logprobs): where a later D's offsets, which start at 0, go on from."""
    if not event:
        return 0
    for choice in _event(event).get("choices") or []:
        logprobs = choice.get("logprobs") or {}
        offsets, tokens = logprobs.get("text_offset") or [], logprobs.get("tokens") or []
        if offsets and tokens:
            return int(offsets[-1]) + len(tokens[-1])
    return 0


def _is_error_event(event: bytes) -> bool:
    return b'"error"' in event and "error" in _event(event)


def _finish_reason(event: bytes) -> str | None:
    # Parsed only when some choice's finish_reason is not null: most events are tokens.
    if event.count(b'"finish_reason"') == len(_NULL_FINISH.findall(event)):
        return None
    for choice in _event(event).get("choices") or []:
        if isinstance(choice, dict) and choice.get("finish_reason") is not None:
            return str(choice["finish_reason"])
    return None


def _unfinished(event: bytes) -> bytes:
    """The last chunk of a D the request leaves, without its end: its text and token ids go on
    to the client, the stream does not end."""
    data = _event(event)
    for choice in data.get("choices") or []:
        choice["finish_reason"] = None
        choice.pop("stop_reason", None)
    data.pop("usage", None)
    return f"data: {json.dumps(data)}\n\n".encode()


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)
