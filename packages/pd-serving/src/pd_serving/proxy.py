"""The OpenAI-compatible PD proxy: one request in, a prefill call to P and a decode call to D out.

``/v1/completions`` and ``/v1/chat/completions`` (streaming and not) go through P then D (or to D
alone when the Router gives no P); ``/v1/models`` is relayed from a D; ``/health`` describes the
deployment and each instance; ``/metrics`` is prometheus text.

Dispatch (``--dispatch``):

- ``sequential``: P answers first (max_tokens=1), then D is called with P's ``kv_transfer_params``.
  TTFT = P's whole HTTP round trip + D's queueing + transfer + first decode step.
- ``parallel`` (HybridConnector only): P and D are called at once with a proxy-chosen
  ``transfer_id``; D's connector asks P for the KV while P is still prefilling (P holds an early
  ``transfer_kv`` until the request appears). D's answer is forwarded only once P answered 200, so a
  failed prefill never leaks a half answer.

Failover: what to do after a failed call is decided by ``failover.AttemptPlan`` (pure; its
docstring has the diagram); this module is its I/O shell. A D that fails before a byte reached the
client is replaced by another D pulling the same transfer from P; a failed P by another P or a
local prefill on D; once bytes went to the client a failure ends the stream with an SSE error
event (never a silent end, never a resumed stream). Every request has a deadline
(``request_timeout_s``, lowered per request by the ``x-request-timeout-s`` header); when it
passes the upstream calls are closed (vLLM aborts), P's transfer released, the client gets 504 or
an error event. A client that goes away cancels the handler, which closes both calls and releases
the transfer on P.

Client mistakes (malformed JSON, unknown model, missing or bad fields) get a 4xx with an
OpenAI-style error body and a WARNING log line; an instance's 4xx is relayed as is.

Cache-aware routing: when instances publish KV-cache events (``Backend.kv_events``), the proxy
owns a ``PrefixIndex`` and the ``KvEventFeed`` that fills it, and the Router asks the index
(``routing.py``). A request whose prompt is text or chat messages is tokenized first by an
instance's ``/tokenize`` (the engine's own tokenizer and chat template, so the ids are the ones
its blocks were hashed over), only while the index holds anything; a tokenization that fails or
takes over ``tokenize_timeout_s`` leaves the request to the usual routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import aiohttp
import msgspec
from aiohttp import web
from hybrid_connector.contract import (
    ContractError,
    PrefillParams,
    PullParams,
    decode_params,
    encode_params,
)
from hybrid_connector.control import release_transfer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from simple_rpc import Client, RpcError

from pd_serving import openai_compat
from pd_serving.drain import DrainConfig
from pd_serving.failover import Action, AttemptPlan, Decision, Failure, Stage, Transfer
from pd_serving.health import BreakerState, FailureKind, HealthCheckConfig, HealthChecker
from pd_serving.kv_events import EventBatch
from pd_serving.kv_feed import KvEventFeed
from pd_serving.live import LiveStreams
from pd_serving.prefix_index import Applied, PrefixIndex
from pd_serving.rebalance import RebalanceConfig
from pd_serving.routed_experts import RoutedExperts
from pd_serving.routing import (
    Backend,
    NoBackend,
    RequestKey,
    Route,
    Router,
    RoutingPolicy,
    request_key,
)
from pd_serving.servers import Connector
from pd_serving.sse import SseEvents, next_events
from pd_serving.triggers import Drains, Rebalancer

log = logging.getLogger(__name__)

# Printed by `pdserve up` and `pdserve proxy` once the proxy listens; launchers wait for it.
READY_LINE = "pdserve: proxy ready on"

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# A client may lower its request's deadline (seconds, > 0); it can never raise it.
DEADLINE_HEADER = "x-request-timeout-s"
# Set only on the proxy's calls to itself (``_serve_parts``): "lead:ID" or "follow:ID". The n
# choices of one prompt share one prefill: the followers wait until the lead's P has answered
# (its KV is in P's prefix cache), so their own prefills compute only the last partial block.
PREFILL_GROUP_HEADER = "x-pdserve-prefill-group"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SSE_DONE = b"data: [DONE]"
_JSON = {"Content-Type": "application/json"}
# How the breaker hears of a failed call (health.FailureKind).
_BREAKER_KIND = {
    Failure.REFUSED: FailureKind.REFUSED,
    Failure.HTTP_5XX: FailureKind.HTTP_5XX,
    Failure.TIMEOUT: FailureKind.TIMEOUT,
    Failure.BROKE: FailureKind.BROKEN,
    Failure.BROKE_MID_STREAM: FailureKind.BROKEN,
}
# /metrics' pdserve_breaker_state values.
_BREAKER_LEVEL = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class Dispatch(enum.StrEnum):
    SEQUENTIAL = "sequential"
    PARALLEL = "parallel"


class ClientRequestError(Exception):
    """The client's request is wrong; answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


class ClientGone(Exception):
    """The client closed its connection while its answer was being streamed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client went away")
        self.response = response


class UpstreamError(Exception):
    """The request failed upstream: answered with ``status`` (or the instance's 4xx ``body``)."""

    def __init__(
        self,
        status: int,
        message: str,
        body: bytes | None = None,
        stage: str = "decode",
        error_type: str = "upstream_error",
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body
        self.stage = stage
        self.error_type = error_type


class CallFailed(Exception):
    """One call to one instance failed; the AttemptPlan decides what happens next."""

    def __init__(  # noqa: PLR0917 -- raised in a dozen places, positionally
        self,
        stage: Stage,
        backend: Backend,
        failure: Failure,
        message: str,
        status: int = 502,
        body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.backend = backend
        self.failure = failure
        self.message = message
        self.status = status
        self.body = body


@dataclass
class ProxyConfig:
    prefill: list[Backend]
    decode: list[Backend]
    connector: Connector = Connector.HYBRID
    dispatch: Dispatch = Dispatch.SEQUENTIAL
    # Model ids the proxy accepts; empty = ask the first D's /v1/models at startup.
    model_names: list[str] = field(default_factory=list)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    # Whole request, retries included; the x-request-timeout-s header may lower it.
    request_timeout_s: float = 600.0
    # One call: P's answer, or D's first streamed event; past it the call counts as failed
    # (timeout) and the request fails over. Non-streaming D calls have only the deadline (vLLM
    # sends nothing before the whole answer).
    attempt_timeout_s: float = 60.0
    # Failed calls after the first one before the client gets the error.
    max_retries: int = 2
    # The Router's policy and the active health checks (None: none); see routing.py, health.py.
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    health: HealthCheckConfig | None = field(default_factory=HealthCheckConfig)
    # Cache-aware routing: an instance's /tokenize call for a text or chat prompt; past this
    # the request is routed without its token ids.
    tokenize_timeout_s: float = 2.0
    # Blocks the prefix index keeps per instance's cache and per store (oldest out first).
    prefix_index_blocks: int = 1 << 18
    # Migrate streams off a D whose load is far above the others' (rebalance.py); None: off.
    rebalance: RebalanceConfig | None = None
    # A drain's migrations at once, retries of a refused one (drain.py).
    drain: DrainConfig = field(default_factory=DrainConfig)
    # R3 on in the D's (``pdserve up --r3``): a non-streamed answer is D's own, so the
    # ``kv_transfer_params["r3"]`` reference to its record reaches the client (vLLM sends
    # ``kv_transfer_params`` only in a whole answer, never in a stream); such an answer is not
    # moved between D's (a stream's is).
    r3: bool = False
    # R3: inline each non-streamed answer's routing record as ``choices[0].routed_experts``
    # (routed_experts.py); the ``kv_transfer_params["r3"]`` reference passes through either way.
    routed_experts: bool = False


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests",
            "Requests answered by the proxy",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "pdserve_upstream_errors",
            "Failed calls to vLLM instances",
            ["stage"],
            registry=self.registry,
        )
        self.call_failures = Counter(
            "pdserve_call_failures",
            "Failed calls per instance, by stage and how they failed",
            ["backend", "stage", "reason"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "pdserve_failovers",
            "Failed calls after which the request went on elsewhere, by stage and reason",
            ["stage", "reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pdserve_retries",
            "Further attempts: same_transfer (another D pulls P's KV), new_prefill, "
            "local_prefill (D prefills itself)",
            ["kind"],
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "pdserve_stream_errors",
            "Streams ended with an SSE error event (after bytes went to the client)",
            ["reason"],
            registry=self.registry,
        )
        self.deadline_expiries = Counter(
            "pdserve_deadline_expiries",
            "Requests whose deadline passed, by the stage they were in",
            ["stage"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "pdserve_client_disconnects",
            "Requests whose client went away before the answer was complete",
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "pdserve_prefill_seconds",
            "Round trip of the prefill (P) call",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_byte_seconds = Histogram(
            "pdserve_first_byte_seconds",
            "From the client's request to the first byte of D's answer",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.releases = Counter(
            "pdserve_prefill_releases",
            "Release calls sent to P for transfers no D will pull (label: P still held them)",
            ["released"],
            registry=self.registry,
        )
        self.breaker_transitions = Counter(
            "pdserve_breaker_transitions",
            "Circuit breaker transitions per backend",
            ["backend", "from_state", "to_state"],
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            "pdserve_breaker_state",
            "Circuit breaker state per backend: 0 closed, 1 half open, 2 open",
            ["backend", "role"],
            registry=self.registry,
        )
        self.bypasses = Counter(
            "pdserve_bypass",
            "Requests routed to D alone, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "pdserve_inflight",
            "Requests in flight per backend",
            ["backend"],
            registry=self.registry,
        )
        self.cache_routing = Counter(
            "pdserve_cache_routing",
            "Routing decisions of the prefix index per role: cached_prefix, balanced, or why "
            "the usual routing decided (overloaded, no_match, index_empty, no_tokens)",
            ["role", "reason"],
            registry=self.registry,
        )
        self.tokenize = Counter(
            "pdserve_cache_tokenize",
            "Prompts tokenized by an instance for cache-aware routing, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.index_blocks = Gauge(
            "pdserve_prefix_index_blocks",
            "Blocks the prefix index believes a backend holds: in its own cache (local) or in "
            "the store it is attached to (store)",
            ["backend", "view"],
            registry=self.registry,
        )
        self.kv_events = Counter(
            "pdserve_kv_events",
            "KV-cache events applied to the prefix index per backend: stored and removed "
            "blocks, cleared caches, blocks not placed (unknown parent)",
            ["backend", "kind"],
            registry=self.registry,
        )
        self.kv_event_resets = Counter(
            "pdserve_kv_event_resets",
            "Times a backend's view was forgotten: gap (events missed), restart (a new "
            "publisher), disconnect, decode_error",
            ["backend", "reason"],
            registry=self.registry,
        )
        self.kv_event_decode_errors = Counter(
            "pdserve_kv_event_decode_errors",
            "KV-event messages that did not decode (or apply), per backend",
            ["backend"],
            registry=self.registry,
        )
        self.kv_events_connected = Gauge(
            "pdserve_kv_events_connected",
            "1 while the proxy is connected to the backend's KV-event publisher",
            ["backend"],
            registry=self.registry,
        )


def _openai_error(status: int, message: str, error_type: str) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "code": status}}
    return web.json_response(body, status=status)


def _deadline_s(request: web.Request, configured: float) -> float:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return configured
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ClientRequestError(400, f"{DEADLINE_HEADER} must be a positive number of seconds")
    return min(value, configured)


def _validate(path: str, body: Any, model_names: list[str]) -> dict[str, Any]:
    """Checks what the proxy itself relies on; vLLM validates the rest (and its 400 is relayed).
    A request without ``model`` gets the served one, as vLLM does."""
    if not isinstance(body, dict):
        raise ClientRequestError(400, "the request body must be a JSON object")
    body = openai_compat.with_model(body, model_names)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientRequestError(400, "'model' must be a string")
    if model_names and model not in model_names:
        raise ClientRequestError(
            404,
            f"the model {model!r} does not exist; served: {', '.join(model_names)}",
            "model_not_found",
        )
    try:
        if path == COMPLETIONS:
            openai_compat.prompts(body.get("prompt"))
        openai_compat.choices_n(body)
    except openai_compat.CompatError as exc:
        raise ClientRequestError(400, str(exc)) from None
    if path == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not (
            isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
        ):
            raise ClientRequestError(400, "'messages' is required: a non-empty list of objects")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ClientRequestError(400, "'stream' must be true or false")
    # max_tokens 0 scores a prompt (with echo and logprobs): vLLM serves it on completions.
    least = 0 if path == COMPLETIONS else 1
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < least
        ):
            kind = "a non-negative" if least == 0 else "a positive"
            raise ClientRequestError(400, f"'{key}' must be {kind} integer")
    if "kv_transfer_params" in body:
        raise ClientRequestError(400, "'kv_transfer_params' is set by the proxy, not by clients")
    return body


def _answered_pull(prefill: Backend, transfer_id: str, raw: object) -> PullParams | None:
    """P's answered ``kv_transfer_params``, checked at the boundary: the PullParams D gets (P's
    TP size and what it held travel on), None when P said nothing D could pull (no connector
    params: the proxy's own are used, as with parallel dispatch). A dict that breaks the
    contract, or names another transfer, is a broken answer from P (``CallFailed``: the
    request fails over, P's transfer is released)."""
    try:
        params = decode_params(raw)
    except ContractError as err:
        message = f"prefill {prefill.url} answered transfer {transfer_id} with {err}"
        raise CallFailed(Stage.PREFILL, prefill, Failure.BROKE, message) from err
    if not isinstance(params, PullParams):
        return None
    if params.transfer_id != transfer_id:
        message = (
            f"prefill {prefill.url} answered transfer {transfer_id} with "
            f"kv_transfer_params.transfer_id {params.transfer_id!r}"
        )
        raise CallFailed(Stage.PREFILL, prefill, Failure.BROKE, message)
    return params


# What vLLM's /tokenize takes besides the prompt or messages, as the generation request has it
# (so the ids are the ones the generation computes).
_TOKENIZE_OPTIONS = {
    COMPLETIONS: ("add_special_tokens",),
    CHAT_COMPLETIONS: (
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "chat_template",
        "chat_template_kwargs",
        "tools",
        "mm_processor_kwargs",
    ),
}


def _is_token_id(value: object) -> bool:
    # The Router hashes ids as int32 (routing.prefix_hashes); vLLM's vocabularies fit.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


class PdProxy:
    """The aiohttp application of the proxy; ``start``/``close`` own its client session."""

    def __init__(self, config: ProxyConfig) -> None:
        if config.dispatch is Dispatch.PARALLEL and config.connector is not Connector.HYBRID:
            raise ValueError("parallel dispatch needs the HybridConnector (NIXL needs P's answer)")
        if not config.decode:
            raise ValueError("at least one decode instance is required")
        self.config = config
        self.metrics = _Metrics()
        sources = {b.key: b.kv_events for b in [*config.prefill, *config.decode] if b.kv_events}
        self.index: PrefixIndex | None = None
        if sources and config.routing.cache_aware:
            self.index = PrefixIndex(config.prefix_index_blocks)
        self.router = Router(
            config.prefill,
            config.decode,
            config.routing,
            on_transition=self._on_transition,
            index=self.index,
        )
        self.kv_feed: KvEventFeed | None = None
        self._kv_sources = sources
        # Served model ids that name a LoRA adapter (their blocks are keyed by it).
        self.lora_names: set[str] = set()
        self.health: HealthChecker | None = None
        self._session: aiohttp.ClientSession | None = None
        self._rpc_clients: dict[str, Client] = {}  # P's transfer_kv address -> its client
        self._background: set[asyncio.Task[None]] = set()
        # The open calls' ends (``_open``), for a call a live migration leaves early.
        self._call_ends: dict[aiohttp.ClientResponse, Callable[[], None]] = {}
        self.app = web.Application(client_max_size=16 * 1024 * 1024)
        self.app.router.add_post(COMPLETIONS, self._handle_generate)
        self.app.router.add_post(CHAT_COMPLETIONS, self._handle_generate)
        self.app.router.add_get("/v1/models", self._handle_models)
        self.app.router.add_get("/health", self._handle_health)
        self.app.router.add_get("/metrics", self._handle_metrics)
        # Live migration of streaming requests between D's (live.py).
        self.live = LiveStreams(self, CallFailed)
        self.app.router.add_post("/admin/migrate", self.live.handle_migrate)
        # What starts migrations: drains and rebalancing (triggers.py).
        self.flows: set[_Flow] = set()  # the requests under way
        # _serve_parts' groups of choices of one prompt: set once the lead's prefill is done.
        self.prefill_groups: dict[str, asyncio.Event] = {}
        self.drains = Drains(self)
        self.live.on_change = self.drains.streams_changed
        self.app.router.add_post("/admin/drain", self.drains.handle_drain)
        self.app.router.add_post("/admin/undrain", self.drains.handle_undrain)
        self.app.router.add_get("/admin/drain", self.drains.handle_status)
        self.rebalancer: Rebalancer | None = None
        if config.rebalance is not None:
            self.rebalancer = Rebalancer(self, config.rebalance)
        self.routed_experts = RoutedExperts() if config.routed_experts else None
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    # -- lifecycle -------------------------------------------------------------------------
    async def _on_startup(self, _app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.close()

    async def start(self) -> None:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.config.connect_timeout_s,
                sock_read=self.config.read_timeout_s,
            )
            self._session = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
            )
        if self.config.health is not None and self.health is None:
            self.health = HealthChecker(self.router, self._session, self.config.health)
            self.health.start()
        if self.rebalancer is not None:
            self.rebalancer.start()
        if self.index is not None and self.kv_feed is None:
            self.kv_feed = KvEventFeed(
                self.index,
                self._kv_sources,
                on_batch=self._on_kv_batch,
                on_error=self._on_kv_error,
                on_connection=self._on_kv_connection,
            )
            self.kv_feed.start()
        if not self.config.model_names:
            self.config.model_names = await self._fetch_model_names()

    # -- KV events (kv_feed's callbacks) ---------------------------------------------------
    def _on_kv_batch(self, backend: str, _batch: EventBatch, applied: Applied) -> None:
        counted = self.metrics.kv_events
        for kind, n in (
            ("stored", applied.stored),
            ("removed", applied.removed),
            ("cleared", int(applied.cleared)),
            ("unplaced", applied.unplaced),
        ):
            if n:
                counted.labels(backend, kind).inc(n)
        for reason, happened in (("gap", applied.gap), ("restart", applied.restart)):
            if happened:
                self.metrics.kv_event_resets.labels(backend, reason).inc()

    def _on_kv_error(self, backend: str, _error: Exception) -> None:
        self.metrics.kv_event_decode_errors.labels(backend).inc()
        self.metrics.kv_event_resets.labels(backend, "decode_error").inc()

    def _on_kv_connection(self, backend: str, connected: bool) -> None:
        self.metrics.kv_events_connected.labels(backend).set(int(connected))
        if not connected:
            self.metrics.kv_event_resets.labels(backend, "disconnect").inc()

    def _on_transition(self, backend: Backend, transition: Any) -> None:
        self.metrics.breaker_transitions.labels(
            backend.key, transition.old.value, transition.new.value
        ).inc()
        log.warning(
            "breaker of %s: %s -> %s (%s)",
            backend.key,
            transition.old.value,
            transition.new.value,
            transition.reason,
        )

    async def close(self) -> None:
        if self.rebalancer is not None:
            await self.rebalancer.close()
        await self.drains.close()
        if self.health is not None:
            await self.health.close()
            self.health = None
        if self.kv_feed is not None:
            await self.kv_feed.close()
            self.kv_feed = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for client in self._rpc_clients.values():
            await client.close()
        self._rpc_clients.clear()
        await self.live.close()
        if self.routed_experts is not None:
            self.routed_experts.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def open_on(self, backend: Backend) -> int:
        """The proxy's calls open on ``backend``, and its requests routed there whose call to it
        has not started yet (a prefill on P first): what a drain waits for."""
        routed = sum(
            1
            for flow in self.flows
            if flow.route is not None and not flow.decode_called and flow.route.decode is backend
        )
        return backend.inflight + routed

    async def drain_background(self) -> None:
        """Wait for the release calls in flight (tests, orderly shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _fetch_model_names(self) -> list[str]:
        backend = self.config.decode[0]
        async with self._client.get(f"{backend.url}/v1/models") as resp:
            resp.raise_for_status()
            data = await resp.json()
        models = data.get("data", [])
        # vLLM lists a LoRA adapter with its base model as "parent".
        self.lora_names = {m["id"] for m in models if m.get("parent")}
        return [m["id"] for m in models]

    @property
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    # -- simple endpoints ----------------------------------------------------------------
    async def _handle_models(self, _request: web.Request) -> web.Response:
        backend = self.config.decode[0]
        try:
            async with self._client.get(f"{backend.url}/v1/models") as resp:
                body = await resp.read()
                return web.Response(body=body, status=resp.status, content_type="application/json")
        except aiohttp.ClientError as exc:
            self.metrics.upstream_errors.labels("models").inc()
            return _openai_error(502, f"{backend.url}/v1/models failed: {exc}", "upstream_error")

    async def _handle_health(self, _request: web.Request) -> web.Response:
        decode_allowed = any(
            self.router.breaker_state(b) is not BreakerState.OPEN for b in self.config.decode
        )
        return web.json_response(
            {
                "status": "ok" if decode_allowed else "degraded",
                "connector": self.config.connector.value,
                "dispatch": self.config.dispatch.value,
                "models": self.config.model_names,
                "prefill": [self._describe(b) for b in self.config.prefill],
                "decode": [self._describe(b) for b in self.config.decode],
            }
        )

    def _describe(self, backend: Backend) -> dict[str, Any]:
        out = self.router.describe(backend)
        out["drain"] = self.drains.phase(backend.key)
        if self.index is not None and backend.kv_events is not None:
            feed = self.kv_feed
            out["prefix_index"] = {
                **self.index.describe(backend.key),
                "connected": bool(feed and feed.connected.get(backend.key)),
            }
        return out

    async def _handle_metrics(self, _request: web.Request) -> web.Response:
        for role, backends in (("prefill", self.config.prefill), ("decode", self.config.decode)):
            for backend in backends:
                level = _BREAKER_LEVEL[self.router.breaker_state(backend)]
                self.metrics.breaker_state.labels(backend.key, role).set(level)
                if self.index is not None and backend.kv_events is not None:
                    described = self.index.describe(backend.key)
                    blocks = self.metrics.index_blocks
                    blocks.labels(backend.key, "local").set(described["blocks"])
                    blocks.labels(backend.key, "store").set(described["store_blocks"])
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    # -- generation ----------------------------------------------------------------------
    async def _handle_generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        started = time.perf_counter()
        peer = request.remote
        status = 500
        try:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ClientRequestError(400, f"malformed JSON body: {exc}") from None
            body = _validate(path, body, self.config.model_names)
            timeout_s = _deadline_s(request, self.config.request_timeout_s)
            try:
                parts = openai_compat.split(path, body)
            except openai_compat.CompatError as exc:
                raise ClientRequestError(400, str(exc)) from None
            if len(parts) > 1:
                response = await self._serve_parts(request, path, parts)
            else:
                body = parts[0].body
                local = openai_compat.needs_no_decode(path, body)
                flow = _Flow(self, request, path, body, started, local_only=local)
                flow.join_prefill_group(request.headers.get(PREFILL_GROUP_HEADER, ""))
                response = await flow.run(timeout_s)
            status = response.status
            return response
        except ClientRequestError as exc:
            log.warning("%s from %s rejected (%d): %s", path, peer, exc.status, exc.message)
            status = exc.status
            return _openai_error(exc.status, exc.message, exc.error_type)
        except UpstreamError as exc:
            log.warning("%s from %s failed upstream (%d): %s", path, peer, exc.status, exc.message)
            status = exc.status
            if exc.body is not None and 400 <= exc.status < 500:
                return web.Response(
                    body=exc.body, status=exc.status, content_type="application/json"
                )
            return _openai_error(exc.status, exc.message, exc.error_type)
        except ClientGone as gone:
            self.metrics.client_disconnects.inc()
            status = 499
            log.info("%s from %s: client went away mid-stream; upstream calls closed", path, peer)
            return gone.response
        except asyncio.CancelledError:
            self.metrics.client_disconnects.inc()
            status = 499
            log.info("%s from %s: client went away; upstream calls closed", path, peer)
            raise
        finally:
            self.metrics.requests.labels(path, str(status)).inc()

    # -- a batch or n > 1: its single requests, merged (openai_compat) -----------------------
    async def _serve_parts(
        self, request: web.Request, path: str, parts: list[openai_compat.Part]
    ) -> web.StreamResponse:
        """Each single request goes through this proxy's own endpoint (so each has its own
        route, failover and deadline); the answers are merged as vLLM numbers and sums them."""
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        if not sockname:
            raise UpstreamError(500, "the proxy cannot reach its own endpoint", stage="split")
        host, port = sockname[0], sockname[1]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"
        headers = {k: v for k, v in request.headers.items() if k.lower() == DEADLINE_HEADER}
        groups: dict[int, str] = {}  # prompt index -> its choices' prefill group (n > 1)
        part_headers = []
        for part in parts:
            role = "follow" if part.prompt_index in groups else "lead"
            group = groups.setdefault(part.prompt_index, uuid.uuid4().hex)
            part_headers.append({**headers, PREFILL_GROUP_HEADER: f"{role}:{group}"})
        for group in groups.values():
            self.prefill_groups[group] = asyncio.Event()
        calls = [
            asyncio.ensure_future(self._client.post(url, json=p.body, headers=h))
            for p, h in zip(parts, part_headers, strict=True)
        ]
        try:
            responses = await asyncio.gather(*calls)
        except BaseException:
            for call in calls:
                await _cancel_post(call)
            raise
        finally:
            for group in groups.values():
                self.prefill_groups.pop(group).set()
        try:
            for resp in responses:
                if resp.status != 200:
                    body = await resp.read()
                    return web.Response(
                        body=body, status=resp.status, content_type="application/json"
                    )
            if not parts[0].body.get("stream", False):
                answers = [await resp.json(content_type=None) for resp in responses]
                merged = openai_compat.merge_answers(parts, answers)
                return web.json_response(merged)
            return await self._merge_streams(request, parts, responses)
        except aiohttp.ClientError as exc:
            raise UpstreamError(502, f"a part of the request broke off: {exc!r}") from exc
        finally:
            for resp in responses:
                resp.close()

    async def _merge_streams(
        self,
        request: web.Request,
        parts: list[openai_compat.Part],
        responses: list[aiohttp.ClientResponse],
    ) -> web.StreamResponse:
        merger = openai_compat.StreamMerger(parts)
        queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

        async def read(part_no: int, resp: aiohttp.ClientResponse) -> None:
            events = SseEvents()
            chunks = resp.content.iter_any()
            try:
                while batch := await next_events(chunks, events):
                    for event in batch:
                        await queue.put((part_no, event))
            finally:
                await queue.put((part_no, None))

        out = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        readers = [asyncio.create_task(read(i, r)) for i, r in enumerate(responses)]
        try:
            await out.prepare(request)
            open_streams, done = len(parts), set()
            while open_streams:
                part_no, event = await queue.get()
                if event is None:
                    open_streams -= 1
                    continue
                if event.rstrip() == _SSE_DONE:
                    done.add(part_no)
                    continue
                chunk = merger.chunk(part_no, _event_json(event))
                if chunk is not None:
                    await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if len(done) < len(parts):  # a part's stream ended without [DONE]: say so
                error = {"message": "a part of the request broke off", "type": "upstream_error"}
                await out.write(
                    f"data: {json.dumps({'error': {**error, 'code': 502}})}\n\n".encode()
                )
            usage = merger.usage_chunk()
            if usage is not None:
                await out.write(f"data: {json.dumps(usage)}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionResetError:
            raise ClientGone(out) from None
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        return out

    # -- cache-aware routing: the engine's token ids ----------------------------------------
    async def engine_key(self, path: str, body: dict[str, Any], key: RequestKey) -> RequestKey:
        """``key`` with what the prefix index needs: the LoRA adapter the request names, and
        for a text or chat prompt the engine's token ids (an instance's ``/tokenize``), asked
        only while the index holds something. Unchanged when they cannot be had."""
        if self.index is None:
            return key
        model = body.get("model")
        if model in self.lora_names:
            key = replace(key, lora=model)
        if key.prompt_token_ids or not key.cacheable or key.empty or not self.index.holds_any():
            return key
        backend = self._tokenizer_backend()
        if backend is None:
            return key
        if path == COMPLETIONS:
            ask: dict[str, Any] = {"model": model, "prompt": key.prompt_text}
        else:
            ask = {"model": model, "messages": body["messages"]}
        ask.update({k: body[k] for k in _TOKENIZE_OPTIONS[path] if k in body})
        try:
            async with (
                asyncio.timeout(self.config.tokenize_timeout_s),
                self._client.post(f"{backend.url}/tokenize", json=ask) as resp,
            ):
                resp.raise_for_status()
                tokens = (await resp.json(content_type=None))["tokens"]
            if not (isinstance(tokens, list) and all(_is_token_id(t) for t in tokens)):
                raise ValueError("'tokens' is not a list of token ids")
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            self.metrics.tokenize.labels("failed").inc()
            log.warning(
                "%s: tokenizing on %s for cache-aware routing failed (%r); routed without",
                path,
                backend.key,
                exc,
            )
            return key
        self.metrics.tokenize.labels("ok").inc()
        return replace(key, engine_token_ids=tuple(tokens))

    def _tokenizer_backend(self) -> Backend | None:
        """The least busy instance whose breaker is not open (every one has the tokenizer)."""
        usable = [
            b
            for b in [*self.config.decode, *self.config.prefill]
            if self.router.breaker_state(b) is not BreakerState.OPEN
        ]
        return min(usable, key=lambda b: b.inflight, default=None)

    # -- P's transfer ----------------------------------------------------------------------
    def _release_on_prefill(self, prefill: Backend, transfer_id: str, why: str) -> None:
        """Best effort, in the background: the client's answer does not wait for it."""
        if self.config.connector is not Connector.HYBRID or not prefill.rpc_address:
            return
        task = asyncio.create_task(self._release(prefill.rpc_address, transfer_id, why))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, address: str, transfer_id: str, why: str) -> None:
        client = self._rpc_clients.get(address)
        if client is None:
            client = self._rpc_clients[address] = Client(address, connect_timeout=2.0)
        try:
            released = await release_transfer(
                address,
                transfer_id,
                reason=why[:200],
                request_id="proxy",
                timeout_s=2.0,
                client=client,
            )
        except RpcError as exc:
            log.warning("release of transfer %s on %s failed: %r", transfer_id, address, exc)
            return
        self.metrics.releases.labels(str(released).lower()).inc()
        log.info("transfer %s released on %s: %s", transfer_id, address, released)

    def _prefill_body(self, path: str, body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
        p_body = dict(body)
        p_body["stream"] = False
        p_body["max_tokens"] = 1
        if path == CHAT_COMPLETIONS:
            p_body["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens"):
            p_body.pop(key, None)
        if self.config.connector is Connector.NIXL:
            p_body["kv_transfer_params"] = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
        else:
            p_body["kv_transfer_params"] = encode_params(PrefillParams(transfer_id=transfer_id))
        return p_body

    def _decode_params(
        self, prefill: Backend, transfer_id: str, p_answer: object
    ) -> dict[str, Any]:
        """D's ``kv_transfer_params``: NIXL's are P's answer as it is; HybridConnector's are the
        contract's PullParams for ``transfer_id`` on ``prefill`` (``p_answer``: P's answered
        ``kv_transfer_params``, None when P has not answered: parallel dispatch)."""
        if self.config.connector is Connector.NIXL:
            if not isinstance(p_answer, dict) or not p_answer:
                raise CallFailed(
                    Stage.PREFILL,
                    prefill,
                    Failure.BROKE,
                    f"prefill {prefill.url} returned no kv_transfer_params",
                )
            return p_answer
        answered = _answered_pull(prefill, transfer_id, p_answer)
        # The proxy's P address wins (P may advertise one D cannot reach); P's own is the
        # fallback for a P configured without one.
        address = prefill.rpc_address or (answered.remote_rpc_address if answered else "")
        if answered is None:
            return encode_params(PullParams(transfer_id=transfer_id, remote_rpc_address=address))
        return encode_params(msgspec.structs.replace(answered, remote_rpc_address=address))

    # -- one call --------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _open(
        self,
        backend: Backend,
        path: str,
        body: dict[str, Any] | bytes,
        stage: Stage,
        gate: asyncio.Task[Any] | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST to a backend; yields the 200 response. Leaving early closes the connection, which
        is what makes vLLM abort the request. With ``gate`` (parallel dispatch) the response is
        yielded only after the gate (the prefill call) succeeded; if the gate fails first, the
        call is cancelled and the gate's CallFailed raised."""
        backend.inflight += 1
        self.metrics.inflight.labels(backend.key).inc()
        self.drains.calls_changed(backend)
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                backend.inflight -= 1
                self.metrics.inflight.labels(backend.key).dec()
                self.drains.calls_changed(backend)

        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self._post(backend, path, body, stage, gate)
            self._call_ends[resp] = end
            yield resp
        finally:
            if resp is not None:
                resp.close()
                self._call_ends.pop(resp, None)
            end()

    def end_call(self, resp: aiohttp.ClientResponse) -> None:
        """A call whose answer the request left before the call's context closes (a live
        migration moved it to another D): its connection closes and it no longer counts as
        open on its backend (a drain waits for nothing there, the router sees its load go)."""
        resp.close()
        if (end := self._call_ends.pop(resp, None)) is not None:
            end()

    async def _post(
        self,
        backend: Backend,
        path: str,
        body: dict[str, Any] | bytes,
        stage: Stage,
        gate: asyncio.Task[Any] | None,
    ) -> aiohttp.ClientResponse:
        url = f"{backend.url}{path}"
        if isinstance(body, bytes):  # JSON already (a live migration's prompt of every token)
            request = self._client.post(url, data=body, headers=_JSON)
        else:
            request = self._client.post(url, json=body)
        post = asyncio.ensure_future(request)
        try:
            if gate is not None:
                await asyncio.wait({post, gate}, return_when=asyncio.FIRST_COMPLETED)
                if gate.done():
                    gate.result()  # raises the prefill's failure: the D call is cancelled below
            resp = await post
        except aiohttp.ServerTimeoutError as exc:  # sock_connect / sock_read
            raise CallFailed(
                stage, backend, Failure.TIMEOUT, f"{stage} {backend.url} timed out: {exc!r}"
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            raise CallFailed(
                stage, backend, Failure.REFUSED, f"{stage} {backend.url} failed: {exc!r}"
            ) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CallFailed(
                stage, backend, Failure.BROKE, f"{stage} {backend.url} failed: {exc!r}"
            ) from exc
        except BaseException:
            await _cancel_post(post)
            raise
        try:
            if gate is not None:
                await gate
            if resp.status != 200:
                err_body = await resp.read()
                detail = err_body[:500].decode(errors="replace")
                message = f"{stage} {backend.url} answered {resp.status}: {detail}"
                if 400 <= resp.status < 500:
                    raise CallFailed(
                        stage, backend, Failure.REJECTED, message, resp.status, err_body
                    )
                raise CallFailed(stage, backend, Failure.HTTP_5XX, message)
        except (aiohttp.ClientError, TimeoutError) as exc:
            resp.close()
            raise CallFailed(
                stage, backend, Failure.BROKE, f"{stage} {backend.url} failed: {exc!r}"
            ) from exc
        except BaseException:
            resp.close()
            raise
        return resp


class _Flow:
    """One request's I/O: makes the calls the AttemptPlan asks for and feeds it their outcomes.

    Owns the request's deadline (``asyncio.timeout``: when it passes, every call in flight is
    closed, which makes vLLM abort), the parallel prefill task (cancelled on every exit) and the
    client's stream once prepared (``out``: from then on a failure is an SSE error event)."""

    def __init__(
        self,
        proxy: PdProxy,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        started: float,
        *,
        local_only: bool = False,
    ) -> None:
        self.proxy = proxy
        # Served by one instance, no P (a scoring request: no decode to hand off to).
        self.local_only = local_only
        self.config = proxy.config
        self.metrics = proxy.metrics
        self.router = proxy.router
        self.request = request
        self.path = path
        self.body = body
        self.started = started
        self.key = request_key(body)
        self.plan = AttemptPlan(
            hybrid=self.config.connector is Connector.HYBRID, max_retries=self.config.max_retries
        )
        # The instances serving the request now: the only record of its D and P (a retry on
        # another D replaces route.decode).
        self.route: Route | None = None
        self.p_answer: object = None  # P's answered kv_transfer_params (this route's)
        self.p_task: asyncio.Task[None] | None = None
        self.decode_called = False  # the route's D got a call (else its probe is unused)
        self.out: web.StreamResponse | None = None
        self.first_event: dict[str, Any] = {}
        # n choices of one prompt (PREFILL_GROUP_HEADER): the lead sets it once its prefill is
        # done (or it needs none); a follower waits for it before it is routed.
        self.prefill_done: asyncio.Event | None = None
        self.after_prefill: asyncio.Event | None = None

    def join_prefill_group(self, header: str) -> None:
        """``lead:ID`` or ``follow:ID`` from the proxy's own split; anything else (a client's
        header, a group already over) is ignored."""
        role, _, group = header.partition(":")
        event = self.proxy.prefill_groups.get(group)
        if event is None:
            return
        if role == "lead":
            self.prefill_done = event
        elif role == "follow":
            self.after_prefill = event

    def _prefill_finished(self) -> None:
        if self.prefill_done is not None:
            self.prefill_done.set()

    async def run(self, timeout_s: float) -> web.StreamResponse:
        deadline = asyncio.timeout(timeout_s)
        self.proxy.flows.add(self)
        try:
            async with deadline:
                if self.after_prefill is not None:
                    await self.after_prefill.wait()
                self.key = await self.proxy.engine_key(self.path, self.body, self.key)
                return await self._attempts()
        except TimeoutError:
            if not deadline.expired():
                raise
            return await self._deadline_passed(timeout_s)
        except (asyncio.CancelledError, ClientGone):
            self._settle(self.plan.client_gone(), "client went away")
            raise
        finally:
            self._prefill_finished()  # a lead that failed: its followers prefill themselves
            await self._stop_prefill()
            self._unused_decode()
            self.proxy.flows.discard(self)
            if self.route is not None:  # it may have been routed to a draining D, not called
                self.proxy.drains.calls_changed(self.route.decode)

    # -- the loop --------------------------------------------------------------------------
    async def _attempts(self) -> web.StreamResponse:
        self._new_route(None)
        while True:
            try:
                return await self._attempt()
            except CallFailed as failed:
                decision = self._failed(failed)
                if decision.action is Action.RETRY_DECODE:
                    self._next_decode(failed)
                    continue
                if decision.action is Action.REROUTE:
                    await self._stop_prefill()
                    self._unused_decode()
                    self._settle(decision, failed.message)
                    self._new_route(failed)
                    continue
                self._settle(decision, failed.message)
                if decision.action is Action.RELAY:
                    raise UpstreamError(
                        failed.status, failed.message, failed.body, stage=failed.stage
                    ) from failed
                if self.out is not None:
                    return await self._end_stream_in_error(failed.message, "upstream_error", 502)
                message = failed.message
                if decision.message and decision.message not in message:
                    message = f"{message} ({decision.message})"
                raise UpstreamError(decision.status, message, stage=failed.stage) from failed

    def _failed(self, failed: CallFailed) -> Decision:
        stage, backend, failure = failed.stage, failed.backend, failed.failure
        if stage is Stage.PREFILL:
            # Parallel: P's failure cancelled D's call before it had an outcome, so D's probe
            # is given back like that of a D never called (_unused_decode).
            self.decode_called = False
        self.metrics.upstream_errors.labels("prefill" if stage is Stage.PREFILL else "decode").inc()
        self.metrics.call_failures.labels(backend.key, stage.value, failure.value).inc()
        if failure is not Failure.REJECTED:
            # A 4xx says the request is wrong, not the instance.
            why, kind = failed.message[:300], _BREAKER_KIND[failure]
            self.router.record_failure(backend, time.monotonic(), why, kind=kind)
        decision = self.plan.failed(stage, backend.key, failure)
        if decision.action in (Action.RETRY_DECODE, Action.REROUTE):
            self.metrics.failovers.labels(stage.value, failure.value).inc()
        log.warning(
            "%s %s: %s failed (%s): %s -> %s",
            self.path,
            self._transfer_id(),
            stage,
            failure,
            failed.message,
            decision.action,
        )
        return decision

    def _new_route(self, after: CallFailed | None) -> None:
        try:
            route = self.router.route(
                self.key,
                exclude_prefill=self.plan.failed_prefill,
                exclude_decode=self.plan.failed_decode,
            )
        except NoBackend as exc:
            self._no_backend(exc.role, after)
        if self.local_only and route.prefill is not None:
            self.router.record_unused(route.prefill)
            route = replace(route, prefill=None, bypass_reason="no_decode")
        self.route = route
        self.p_answer, self.decode_called = None, False
        self.plan.begin(route.prefill.key if route.prefill else None)
        if after is not None:
            self.metrics.retries.labels("new_prefill" if route.prefill else "local_prefill").inc()
        elif route.bypass_reason is not None:
            self.metrics.bypasses.labels(route.bypass_reason).inc()
        if after is None:
            for role, reason in (("decode", route.decode_cache), ("prefill", route.prefill_cache)):
                if reason is not None:
                    self.metrics.cache_routing.labels(role, reason).inc()

    def _next_decode(self, after: CallFailed) -> None:
        assert self.route is not None  # RETRY_DECODE: the route's P keeps the transfer
        try:
            decode = self.router.pick_decode(self.key, self.plan.failed_decode)
        except NoBackend as exc:
            self._no_backend(exc.role, after)
        # record_routed credits the prefix to the D that serves it.
        self.route = replace(self.route, decode=decode)
        self.decode_called = False
        self.plan.retry_decode(decode.key)
        self.metrics.retries.labels("same_transfer").inc()

    def _no_backend(self, role: str, after: CallFailed | None) -> NoReturn:
        decision = self.plan.no_backend(role)
        self._settle(decision, decision.message)
        message = decision.message if after is None else f"{after.message} ({decision.message})"
        raise UpstreamError(decision.status, message, stage=role)

    def _unused_decode(self) -> None:
        """The route's D was never called (P failed first): give back a half-open probe."""
        if self.route is not None and not self.decode_called:
            self.router.record_unused(self.route.decode)
            self.decode_called = True

    def _transfer_id(self) -> str:
        transfer = self.plan.transfer
        return f"transfer {transfer.transfer_id}" if transfer else "(local prefill)"

    def _settle(self, decision: Decision, why: str) -> None:
        """Carry out the decision's side effect on P: release the transfer no D will pull."""
        transfer, route = self.plan.transfer, self.route
        if decision.release and transfer is not None and route and route.prefill is not None:
            self.proxy._release_on_prefill(route.prefill, transfer.transfer_id, why)

    async def _stop_prefill(self) -> None:
        """Cancel a prefill call still in flight (vLLM aborts it) and reap the task."""
        task, self.p_task = self.p_task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, CallFailed):
            await task

    # -- one attempt -----------------------------------------------------------------------
    async def _attempt(self) -> web.StreamResponse:
        assert self.route is not None
        decode, prefill, transfer = self.route.decode, self.route.prefill, self.plan.transfer
        if transfer is None or prefill is None:
            self._prefill_finished()  # D prefills: nothing to wait for
            self.decode_called = True
            async with (
                self._first_token(Stage.LOCAL, decode, None) as timer,
                self.proxy._open(decode, self.path, self.body, Stage.LOCAL) as resp,
            ):
                return await self._relay(resp, decode, Stage.LOCAL, timer)
        gate = None
        if self.config.dispatch is Dispatch.SEQUENTIAL:
            if not transfer.prefill_answered:
                await self._prefill(prefill, transfer)
            d_params = self.proxy._decode_params(prefill, transfer.transfer_id, self.p_answer)
        else:
            if self.p_task is None:
                self.p_task = asyncio.create_task(self._prefill(prefill, transfer))
            d_params = self.proxy._decode_params(prefill, transfer.transfer_id, None)
            gate = self.p_task
        d_body = {**self.body, "kv_transfer_params": d_params}
        # A migratable answer asks D for token ids (and is streamed: live.py).
        d_body = self.proxy.live.decode_body(self, decode, d_body)
        self.decode_called = True
        async with (
            self._first_token(Stage.DECODE, decode, gate) as timer,
            self.proxy._open(decode, self.path, d_body, Stage.DECODE, gate=gate) as resp,
        ):
            return await self._relay(resp, decode, Stage.DECODE, timer)

    @contextlib.asynccontextmanager
    async def _first_token(
        self, stage: Stage, decode: Backend, gate: asyncio.Task[None] | None
    ) -> AsyncIterator[asyncio.Timeout]:
        """Bounds a streaming D call from its start (or, parallel, from P's answer) to its
        first event by ``attempt_timeout_s``; ``_relay`` disarms it at the first event. A
        non-streaming D sends nothing before its whole answer: only the deadline bounds it."""
        timer = asyncio.timeout(None)
        limit = self.config.attempt_timeout_s
        loop = asyncio.get_running_loop()

        def arm(_task: object = None) -> None:
            if not timer.expired():
                timer.reschedule(loop.time() + limit)

        streaming = bool(self.body.get("stream", False))
        try:
            async with timer:
                if streaming and (gate is None or gate.done()):
                    arm()
                elif streaming and gate is not None:
                    gate.add_done_callback(arm)
                yield timer
        except TimeoutError as exc:
            if not timer.expired():
                raise
            message = f"{stage} {decode.url} sent no token within {limit:g} s"
            raise CallFailed(stage, decode, Failure.TIMEOUT, message) from exc
        finally:
            if gate is not None:
                gate.remove_done_callback(arm)

    async def _prefill(self, prefill: Backend, transfer: Transfer) -> None:
        p_body = self.proxy._prefill_body(self.path, self.body, transfer.transfer_id)
        t0 = time.perf_counter()
        limit = self.config.attempt_timeout_s
        try:
            async with (
                asyncio.timeout(limit),
                self.proxy._open(prefill, self.path, p_body, Stage.PREFILL) as resp,
            ):
                try:
                    data = await resp.json(content_type=None)
                except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise CallFailed(
                        Stage.PREFILL, prefill, Failure.BROKE, f"prefill {prefill.url}: bad answer"
                    ) from exc
        except TimeoutError as exc:
            raise CallFailed(
                Stage.PREFILL,
                prefill,
                Failure.TIMEOUT,
                f"prefill {prefill.url} did not answer within {limit:g} s",
            ) from exc
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        self.router.record_success(prefill, time.monotonic())
        self.p_answer = data.get("kv_transfer_params") if isinstance(data, dict) else None
        self.plan.prefill_answered()
        self._prefill_finished()

    # -- D's answer to the client ----------------------------------------------------------
    async def _relay(
        self,
        resp: aiohttp.ClientResponse,
        backend: Backend,
        stage: Stage,
        first_token: asyncio.Timeout,
    ) -> web.StreamResponse:
        live = self.proxy.live.open(self, backend, stage, resp)
        if not self.body.get("stream", False) and live is None:
            try:
                data = await resp.read()
                json.loads(data)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise CallFailed(
                    stage, backend, Failure.BROKE, f"{stage} {backend.url} broke off: {exc!r}"
                ) from exc
            self._succeeded(backend)
            if self.proxy.routed_experts is not None:
                data = await self.proxy.routed_experts.attach(data)
            return web.Response(body=data, status=200, content_type="application/json")

        events = SseEvents()
        chunks = resp.content.iter_any()
        try:
            first = await next_events(chunks, events)
        except aiohttp.ClientError as exc:
            message = f"{stage} {backend.url} broke off before its first token: {exc!r}"
            raise CallFailed(stage, backend, Failure.BROKE, message) from exc
        if not first:
            message = f"{stage} {backend.url} closed its stream before the first token"
            raise CallFailed(stage, backend, Failure.BROKE, message)
        if _is_error_event(first[0]):  # vLLM's engine failed: a 200 carrying only an error
            detail = first[0].strip()[:300].decode(errors="replace")
            message = f"{stage} {backend.url} streamed an error before the first token: {detail}"
            raise CallFailed(stage, backend, Failure.BROKE, message)
        if live is not None:  # token ids counted (and taken out if the client did not ask)
            first = live.take_first(first)
        self.first_event = _event_json(first[0])
        if live is not None and not live.streaming:
            # Answered whole: the proxy streamed it from D (and from the D's it moved to).
            self.router.record_success(backend, time.monotonic())
            answer = await live.assemble(chunks, events, first)
            self._succeeded(None)
            self.metrics.first_byte_seconds.observe(time.perf_counter() - self.started)
            return web.json_response(answer)
        first_token.reschedule(None)  # from here on only the deadline bounds the stream
        self.router.record_success(backend, time.monotonic())
        self.metrics.first_byte_seconds.observe(time.perf_counter() - self.started)
        out = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        try:
            await out.prepare(self.request)
        except ConnectionResetError as exc:  # the client went away before its first token
            raise ClientGone(out) from exc
        self.out = out
        self.plan.sent_to_client()
        done = await self._write(first)
        upstream_error = next(filter(_is_error_event, first), None)  # after tokens: relayed
        try:
            if live is not None and not done:  # may move to another D on the way (live.py)
                done, upstream_error = await live.relay(chunks, events, done, upstream_error)
            else:
                while batch := await next_events(chunks, events):
                    upstream_error = upstream_error or next(filter(_is_error_event, batch), None)
                    done = await self._write(batch) or done
        except (aiohttp.ClientError, TimeoutError) as exc:
            if not done:
                message = f"{stage} {backend.url} broke off a stream: {exc!r}"
                raise CallFailed(stage, backend, Failure.BROKE_MID_STREAM, message) from exc
        if not done:
            message = f"{stage} {backend.url} ended its stream without [DONE]"
            raise CallFailed(stage, backend, Failure.BROKE_MID_STREAM, message)
        await out.write_eof()
        if upstream_error is not None:  # relayed to the client; D failed it all the same
            why = upstream_error.strip()[:300].decode(errors="replace")
            self.metrics.call_failures.labels(
                backend.key, stage.value, Failure.BROKE_MID_STREAM
            ).inc()
            self.router.record_failure(backend, time.monotonic(), why, kind=FailureKind.BROKEN)
        self._succeeded(None)
        return out

    def _succeeded(self, backend: Backend | None) -> None:
        if backend is not None:
            self.router.record_success(backend, time.monotonic())
            self.metrics.first_byte_seconds.observe(time.perf_counter() - self.started)
        self.plan.succeeded()
        if self.route is not None:
            self.router.record_routed(self.key, self.route)

    async def _write(self, batch: list[bytes]) -> bool:
        """Forward whole events; True when ``[DONE]`` was among them."""
        assert self.out is not None
        try:
            await self.out.write(b"".join(batch))
        except ConnectionResetError as exc:  # the client went away
            raise ClientGone(self.out) from exc
        return any(event.rstrip() == _SSE_DONE for event in batch)

    async def _end_stream_in_error(
        self, message: str, error_type: str, code: int
    ) -> web.StreamResponse:
        """Headers and tokens went out already: an OpenAI-style error event (the openai client
        raises APIError on it), a last chunk with ``finish_reason: "error"`` for clients that
        only read choices, then ``[DONE]``."""
        out = self.out
        assert out is not None
        self.metrics.stream_errors.labels(error_type).inc()
        error = {"error": {"message": message, "type": error_type, "code": code}}
        tail = (
            f"data: {json.dumps(error)}\n\n"
            f"data: {json.dumps(self._final_chunk())}\n\n"
            "data: [DONE]\n\n"
        )
        with contextlib.suppress(ConnectionResetError):
            await out.write(tail.encode())
            await out.write_eof()
        return out

    def _final_chunk(self) -> dict[str, Any]:
        first = self.first_event
        chat = self.path == CHAT_COMPLETIONS
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "error"}
        if chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return {
            "id": first.get("id", ""),
            "object": first.get("object", "chat.completion.chunk" if chat else "text_completion"),
            "created": first.get("created", int(time.time())),
            "model": first.get("model", self.body.get("model", "")),
            "choices": [choice],
        }

    async def _deadline_passed(self, timeout_s: float) -> web.StreamResponse:
        transfer = self.plan.transfer
        if transfer is not None and not transfer.prefill_answered:
            stage = Stage.PREFILL
        else:
            stage = Stage.DECODE if transfer is not None else Stage.LOCAL
        self.metrics.deadline_expiries.labels(stage.value).inc()
        self._settle(self.plan.deadline_passed(), "deadline passed")
        message = f"the request's deadline of {timeout_s:g} s passed (in {stage})"
        log.warning("%s %s: %s", self.path, self._transfer_id(), message)
        if self.out is not None:
            return await self._end_stream_in_error(message, "timeout", 504)
        raise UpstreamError(504, message, stage=stage.value, error_type="timeout")


def _is_error_event(event: bytes) -> bool:
    return "error" in _event_json(event)


def _event_json(event: bytes) -> dict[str, Any]:
    data = event.strip().removeprefix(b"data:").strip()
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


async def _cancel_post(post: asyncio.Future[aiohttp.ClientResponse]) -> None:
    """Cancel a POST in flight; if it had already produced a response, close it."""
    post.cancel()
    with contextlib.suppress(BaseException):
        (await post).close()


async def serve(proxy: PdProxy, host: str, port: int) -> web.AppRunner:
    """Start the proxy's HTTP server; the caller owns the runner (``await runner.cleanup()``)."""
    # handler_cancellation: a client disconnect cancels the handler, which closes the upstream
    # calls, so vLLM aborts the request and frees its KV blocks.
    runner = web.AppRunner(proxy.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner
