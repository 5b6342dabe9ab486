"""The OpenAI-compatible PD proxy: one request in, a prefill call to P and a decode call to D out.

``/v1/completions`` and ``/v1/chat/completions`` (streaming and not) go through P then D (or to D
alone when no P is configured); ``/v1/models`` is relayed from a D; ``/health`` describes the
deployment; ``/metrics`` is prometheus text.

Dispatch (``--dispatch``):

- ``sequential``: P answers first (max_tokens=1), then D is called with P's ``kv_transfer_params``.
  TTFT = P's whole HTTP round trip + D's queueing + transfer + first decode step.
- ``parallel`` (HybridConnector only): P and D are called at once with a proxy-chosen
  ``transfer_id``; D's connector asks P for the KV while P is still prefilling (P holds an early
  ``transfer_kv`` until the request appears). D's answer is forwarded only once P answered 200, so a
  failed prefill never leaks a half answer; a P failure cancels the D call (vLLM aborts it and
  frees its blocks).

Client mistakes (malformed JSON, unknown model, missing or bad fields) get a 4xx with an
OpenAI-style error body and a WARNING log line; an upstream failure gets 502 (or the upstream's own
4xx). Client disconnects cancel the handler, which closes the upstream connections, which makes
vLLM abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from hybrid_connector.control import release_transfer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from simple_rpc import Client, RpcError

from pd_serving.health import HealthCheckConfig, HealthChecker, failure_kind
from pd_serving.routing import Backend, NoBackend, Router, RoutingPolicy, request_key
from pd_serving.servers import Connector

log = logging.getLogger(__name__)

# Printed by `pdserve up` and `pdserve proxy` once the proxy listens; launchers wait for it.
READY_LINE = "pdserve: proxy ready on"

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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
    """A P or D instance failed (connection, 5xx, or a 4xx relayed as is)."""

    def __init__(self, status: int, message: str, body: bytes | None = None, stage: str = "decode"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body
        self.stage = stage


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
    # routing-wiring: the Router's policy and the active health checks (None: none).
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    health: HealthCheckConfig | None = field(default_factory=HealthCheckConfig)


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
        self.breaker_transitions = Counter(  # routing-wiring
            "pdserve_breaker_transitions",
            "Circuit breaker transitions per backend",
            ["backend", "from_state", "to_state"],
            registry=self.registry,
        )
        self.bypasses = Counter(  # routing-wiring
            "pdserve_bypass",
            "Requests served by D alone, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "pdserve_inflight",
            "Requests in flight per backend",
            ["backend"],
            registry=self.registry,
        )


def _openai_error(status: int, message: str, error_type: str) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "code": status}}
    return web.json_response(body, status=status)


def _validate(path: str, body: Any, model_names: list[str]) -> dict[str, Any]:
    """Checks what the proxy itself relies on; vLLM validates the rest (and its 400 is relayed)."""
    if not isinstance(body, dict):
        raise ClientRequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientRequestError(400, "'model' is required (a string)")
    if model_names and model not in model_names:
        raise ClientRequestError(
            404,
            f"the model {model!r} does not exist; served: {', '.join(model_names)}",
            "model_not_found",
        )
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        single_prompt = (
            isinstance(prompt, str)
            or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))
            or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list))
        )
        if not single_prompt:
            raise ClientRequestError(
                400, "'prompt' is required: one string or one list of token ids per request"
            )
    else:
        messages = body.get("messages")
        if not (
            isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
        ):
            raise ClientRequestError(400, "'messages' is required: a non-empty list of objects")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ClientRequestError(400, "'stream' must be true or false")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ClientRequestError(400, f"'{key}' must be a positive integer")
    if body.get("n", 1) != 1:
        raise ClientRequestError(400, "'n' must be 1 (one choice per disaggregated request)")
    if "kv_transfer_params" in body:
        raise ClientRequestError(400, "'kv_transfer_params' is set by the proxy, not by clients")
    return body


class PdProxy:
    """The aiohttp application of the proxy; ``start``/``close`` own its client session."""

    def __init__(self, config: ProxyConfig) -> None:
        if config.dispatch is Dispatch.PARALLEL and config.connector is not Connector.HYBRID:
            raise ValueError("parallel dispatch needs the HybridConnector (NIXL needs P's answer)")
        if not config.decode:
            raise ValueError("at least one decode instance is required")
        self.config = config
        self.metrics = _Metrics()
        # routing-wiring
        self.router = Router(
            config.prefill, config.decode, config.routing, on_transition=self._on_transition
        )
        self.health: HealthChecker | None = None
        self._session: aiohttp.ClientSession | None = None
        self._rpc_clients: dict[str, Client] = {}  # P's transfer_kv address -> its client
        self._background: set[asyncio.Task[None]] = set()
        self.app = web.Application(client_max_size=16 * 1024 * 1024)
        self.app.router.add_post(COMPLETIONS, self._handle_generate)
        self.app.router.add_post(CHAT_COMPLETIONS, self._handle_generate)
        self.app.router.add_get("/v1/models", self._handle_models)
        self.app.router.add_get("/health", self._handle_health)
        self.app.router.add_get("/metrics", self._handle_metrics)
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
        if self.config.health is not None and self.health is None:  # routing-wiring
            self.health = HealthChecker(self.router, self._session, self.config.health)
            self.health.start()
        if not self.config.model_names:
            self.config.model_names = await self._fetch_model_names()

    def _on_transition(self, backend: Backend, transition: Any) -> None:  # routing-wiring
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
        if self.health is not None:  # routing-wiring
            await self.health.close()
            self.health = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for client in self._rpc_clients.values():
            await client.close()
        self._rpc_clients.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _fetch_model_names(self) -> list[str]:
        backend = self.config.decode[0]
        async with self._client.get(f"{backend.url}/v1/models") as resp:
            resp.raise_for_status()
            data = await resp.json()
        return [m["id"] for m in data.get("data", [])]

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
        return web.json_response(
            {
                "status": "ok",
                "connector": self.config.connector.value,
                "dispatch": self.config.dispatch.value,
                "models": self.config.model_names,
                "prefill": [self.router.describe(b) for b in self.config.prefill],
                "decode": [self.router.describe(b) for b in self.config.decode],
            }
        )

    async def _handle_metrics(self, _request: web.Request) -> web.Response:
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
            response = await self._generate(request, path, body, started)
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
            return _openai_error(exc.status, exc.message, "upstream_error")
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

    async def _generate(
        self, request: web.Request, path: str, body: dict[str, Any], started: float
    ) -> web.StreamResponse:
        key = request_key(body)  # routing-wiring
        try:
            route = self.router.route(key)
        except NoBackend as exc:
            raise UpstreamError(503, str(exc)) from None
        decode, prefill = route.decode, route.prefill
        if prefill is None:  # no disaggregation: a plain load balancer over D's
            if route.bypass_reason is not None:
                self.metrics.bypasses.labels(route.bypass_reason).inc()
            async with self._open(decode, path, body, "decode") as d_resp:
                response = await self._relay(request, d_resp, body, started)
            self.router.record_routed(key, route)
            return response

        transfer_id = uuid.uuid4().hex
        p_body = self._prefill_body(path, body, transfer_id)
        if self.config.dispatch is Dispatch.SEQUENTIAL:
            p_params = await self._prefill_call(prefill, path, p_body)
            d_body = {
                **body,
                "kv_transfer_params": self._decode_params(prefill, transfer_id, p_params),
            }
            try:
                async with self._open(decode, path, d_body, "decode") as d_resp:
                    response = await self._relay(request, d_resp, body, started)
                self.router.record_routed(key, route)
                return response
            except UpstreamError as exc:
                # D never pulled: tell P to free the blocks now rather than at its lease's end.
                self._release_on_prefill(prefill, transfer_id, exc.message)
                raise

        d_body = {**body, "kv_transfer_params": self._decode_params(prefill, transfer_id, None)}
        p_task = asyncio.create_task(self._prefill_call(prefill, path, p_body))
        try:
            async with self._open(decode, path, d_body, "decode", gate=p_task) as d_resp:
                response = await self._relay(request, d_resp, body, started)
            self.router.record_routed(key, route)
            return response
        except UpstreamError as exc:
            # D failed. A P still prefilling is cancelled below (vLLM aborts it, freeing its
            # blocks); a P that already answered holds blocks for a pull that will not come.
            finished = p_task.done() and not p_task.cancelled() and p_task.exception() is None
            if exc.stage == "decode" and finished:
                self._release_on_prefill(prefill, transfer_id, exc.message)
            raise
        finally:
            if not p_task.done():
                p_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                await p_task

    def _release_on_prefill(self, prefill: Backend, transfer_id: str, why: str) -> None:
        """Best effort, in the background: the client's error answer does not wait for it."""
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
            p_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
        return p_body

    def _decode_params(
        self, prefill: Backend, transfer_id: str, p_params: dict[str, Any] | None
    ) -> dict[str, Any]:
        if self.config.connector is Connector.NIXL:
            if not p_params:
                raise UpstreamError(
                    502, f"prefill {prefill.url} returned no kv_transfer_params", stage="prefill"
                )
            return p_params
        return {
            **(p_params or {}),
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_rpc_address": prefill.rpc_address,
        }

    async def _prefill_call(
        self, prefill: Backend, path: str, p_body: dict[str, Any]
    ) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        async with self._open(prefill, path, p_body, "prefill") as resp:
            try:
                data = await resp.json(content_type=None)
            except (aiohttp.ClientError, json.JSONDecodeError) as exc:
                self.metrics.upstream_errors.labels("prefill").inc()
                raise UpstreamError(
                    502, f"prefill {prefill.url}: bad answer: {exc}", stage="prefill"
                ) from exc
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        return params if isinstance(params, dict) else None

    @contextlib.asynccontextmanager
    async def _open(
        self,
        backend: Backend,
        path: str,
        body: dict[str, Any],
        stage: str,
        gate: asyncio.Task[Any] | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST to a backend; yields the 200 response. Leaving early closes the connection, which
        is what makes vLLM abort the request. With ``gate`` (parallel dispatch) the response is
        yielded only after the gate (the prefill call) succeeded; if the gate fails first, the
        call is cancelled."""
        backend.inflight += 1
        self.metrics.inflight.labels(backend.name or backend.url).inc()
        resp: aiohttp.ClientResponse | None = None
        try:
            try:  # routing-wiring: passive health
                resp = await self._post(backend, path, body, stage, gate)
            except UpstreamError as exc:
                if exc.status >= 500 and exc.stage == stage:
                    kind = failure_kind(exc.__cause__) if exc.__cause__ else "http_5xx"
                    self.router.record_failure(backend, time.monotonic(), exc.message, kind=kind)
                raise
            self.router.record_success(backend, time.monotonic())
            yield resp
        finally:
            if resp is not None:
                resp.close()
            backend.inflight -= 1
            self.metrics.inflight.labels(backend.name or backend.url).dec()

    async def _post(
        self,
        backend: Backend,
        path: str,
        body: dict[str, Any],
        stage: str,
        gate: asyncio.Task[Any] | None,
    ) -> aiohttp.ClientResponse:
        post = asyncio.ensure_future(self._client.post(f"{backend.url}{path}", json=body))
        try:
            if gate is not None:
                await asyncio.wait({post, gate}, return_when=asyncio.FIRST_COMPLETED)
                if gate.done():
                    gate.result()  # raises the prefill's error: the D call is cancelled below
            resp = await post
        except aiohttp.ClientError as exc:
            self.metrics.upstream_errors.labels(stage).inc()
            raise UpstreamError(502, f"{stage} {backend.url} failed: {exc!r}", stage=stage) from exc
        except BaseException:
            await _cancel_post(post)
            raise
        try:
            if gate is not None:
                await gate
            if resp.status != 200:
                err_body = await resp.read()
                self.metrics.upstream_errors.labels(stage).inc()
                detail = err_body[:500].decode(errors="replace")
                status = resp.status if 400 <= resp.status < 500 else 502
                raise UpstreamError(
                    status,
                    f"{stage} {backend.url} answered {resp.status}: {detail}",
                    err_body,
                    stage=stage,
                )
        except aiohttp.ClientError as exc:
            resp.close()
            self.metrics.upstream_errors.labels(stage).inc()
            raise UpstreamError(502, f"{stage} {backend.url} failed: {exc!r}", stage=stage) from exc
        except BaseException:
            resp.close()
            raise
        return resp

    async def _relay(
        self,
        request: web.Request,
        d_resp: aiohttp.ClientResponse,
        body: dict[str, Any],
        started: float,
    ) -> web.StreamResponse:
        decode_url = str(d_resp.url.origin())
        if not body.get("stream", False):
            try:
                data = await d_resp.read()
            except aiohttp.ClientError as exc:
                self.metrics.upstream_errors.labels("decode").inc()
                raise UpstreamError(502, f"decode {decode_url} broke off: {exc!r}") from exc
            self.metrics.first_byte_seconds.observe(time.perf_counter() - started)
            return web.Response(body=data, status=200, content_type="application/json")
        out = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await out.prepare(request)
        first = True
        try:
            async for chunk in d_resp.content.iter_any():
                if first:
                    self.metrics.first_byte_seconds.observe(time.perf_counter() - started)
                    first = False
                try:
                    await out.write(chunk)
                except ConnectionResetError as exc:  # the client went away
                    raise ClientGone(out) from exc
        except aiohttp.ClientError as exc:
            # Headers are sent: the client learns of the failure from the connection closing
            # without the stream's final "data: [DONE]".
            self.metrics.upstream_errors.labels("decode").inc()
            log.warning("decode %s broke off a stream: %r", decode_url, exc)
            out.force_close()
            return out
        await out.write_eof()
        return out


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
