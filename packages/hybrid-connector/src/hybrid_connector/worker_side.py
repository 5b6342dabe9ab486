"""Worker-side half of HybridConnector: owns the KV regions, the RPC server/clients and kvt.

vLLM calls the worker hooks from its step; they only hand work to the connector's own event-loop
thread (``LoopThread``) and drain a completion set, so no step ever waits on the network.

Ownership: every piece of transfer state (held blocks, early pulls, in-flight pulls, timers) is
owned by the loop thread. kvt completion callbacks arrive on kvt threads and are forwarded to the
loop with ``call_soon``; the loop reports finished request ids into a lock-protected set that
``get_transfer_results`` swaps out each step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from ipcblock import parse_blocks
from simple_rpc import CallContext, Client, LoopThread, Server

from hybrid_connector.config import HybridConfig
from hybrid_connector.errors import LeaseExpired, PeerError, TransferError
from hybrid_connector.layout import check_compatible, describe_kv_caches, layout_from_spec
from hybrid_connector.metadata import (
    HybridConnectorMetadata,
    PrefillSpec,
    RecvSpec,
    ReleaseSpec,
    SendSpec,
)
from hybrid_connector.protocol import (
    RELEASE,
    TRANSFER_KV,
    LayoutSpec,
    ReleaseRequest,
    ReleaseResponse,
    TransferKvRequest,
    TransferKvResponse,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _is_done(completion: Any) -> bool:
    return bool(completion.ok)


def _describe(completion: Any) -> str:
    origin = completion.origin.name if completion.origin is not None else None
    code = completion.code.name if completion.code is not None else None
    return f"{completion.status.name} origin={origin} code={code} reason={completion.reason!r}"


class _Results:
    """Finished request ids reported by the loop thread, drained by vLLM's step thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._counters: collections.Counter[str] = collections.Counter()

    def count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counters[name] += n
            self._cond.notify_all()

    def wait_count(self, name: str, at_least: int, timeout_s: float) -> bool:
        """Block until counter ``name`` reaches ``at_least`` (tools and tests, never a step)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._counters[name] >= at_least, timeout_s)

    def counters(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counters)

    def sent(self, request_id: str) -> None:
        with self._cond:
            self._sending.add(request_id)
            self._cond.notify_all()

    def received(self, request_id: str, *, failed: bool) -> None:
        with self._cond:
            self._recving.add(request_id)
            if failed:
                self._failed.add(request_id)
            self._cond.notify_all()

    def drain(self, wait_s: float = 0.0) -> tuple[set[str], set[str], set[str]]:
        """Take what finished; with ``wait_s`` > 0 first wait that long for anything to finish
        (vLLM's step never waits; tests and tools outside a step may)."""
        with self._cond:
            if wait_s > 0 and not (self._sending or self._recving):
                self._cond.wait(wait_s)
            out = (self._sending, self._recving, self._failed)
            self._sending, self._recving, self._failed = set(), set(), set()
        return out


class _CountersCollector:
    """Exports the worker's event counters as ``hybrid_connector_events_total{event=...}``."""

    def __init__(self, results: _Results, name: str) -> None:
        self._results = results
        self._name = name

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "hybrid_connector_events",
            "HybridConnector worker events (offers, sends, leases, pulls, bytes received)",
            labels=["connector", "event"],
        )
        for event, value in sorted(self._results.counters().items()):
            family.add_metric([self._name, event], value)
        yield family


# ---------------------------------------------------------------------------------- P (producer)
@dataclass
class _Offer:
    """Blocks of one P request that vLLM keeps for us until we report the request.

    A plain offer starts when the request finished. A rapid offer starts earlier, in the step that
    completes the prompt, when a pull is already parked (rapid transfer_kv); it is reported only
    once the request has finished too (``finished``), since vLLM owns a running request's blocks.
    """

    spec: SendSpec
    timer: asyncio.TimerHandle | None = None
    sending: bool = False
    finished: bool = True
    over: bool = False  # rapid: the send completed (or failed) before the request finished


@dataclass
class _EarlyPull:
    """A transfer_kv that reached P before P finished the request (parallel dispatch)."""

    request: TransferKvRequest
    peer: str
    future: asyncio.Future[TransferKvResponse]
    timer: asyncio.TimerHandle | None = None


class Producer:
    """P's transfer_kv server and the lease of every held request. Runs on the loop thread."""

    def __init__(
        self,
        config: HybridConfig,
        engine: Any,
        local_spec: LayoutSpec,
        results: _Results,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._config = config
        self._engine = engine
        self._spec = local_spec
        self._layout = layout_from_spec(local_spec)
        self._results = results
        self._loop = loop
        self._offers: dict[str, _Offer] = {}
        self._early: dict[str, _EarlyPull] = {}
        # Transfer ids that will never be offered (request aborted on P, or released by D or the
        # proxy): pulls for them fail at once, a late offer is released at once. Each entry is
        # forgotten after one lease.
        self._cancelled: dict[str, asyncio.TimerHandle] = {}
        self._server = Server(name="hybrid-connector")
        self._server.register(TRANSFER_KV, self._on_transfer_kv)
        self._server.register(RELEASE, self._on_release)

    async def start(self) -> str:
        return await self._server.start(self._config.rpc_host, self._config.rpc_port)

    # -- from vLLM (via metadata) ------------------------------------------------------------
    def offer(self, spec: SendSpec) -> None:
        """The request finished on P (request_finished returned delay_free=True)."""
        tid = spec.transfer_id
        current = self._offers.get(tid)
        if current is not None and not current.finished:
            # The rapid send started during the prefill; its blocks go back once it is over.
            current.finished = True
            if current.over:
                self._release(tid, current)
            return
        if spec.aborted:
            self.cancel(tid)
            self._results.sent(spec.request_id)
            return
        if current is not None:
            log.warning(
                "request %s: transfer_id %s is already held for request %s; releasing the "
                "new request's blocks at once",
                spec.request_id,
                tid,
                current.spec.request_id,
            )
            self._results.sent(spec.request_id)
            return
        if tid in self._cancelled:
            # Released (by D or the proxy) before the request finished here: nobody will pull.
            self._results.count("released_by_peer")
            self._results.sent(spec.request_id)
            return
        offer = _Offer(spec)
        self._offers[tid] = offer
        self._results.count("offers")
        early = self._take_early(tid)
        if early is not None:
            self._answer(early, offer)
            return
        # No pull yet (or its caller went away): hold the blocks for one lease.
        offer.timer = self._loop.call_later(self._config.lease_s, self._lease_expired, tid)
        log.debug("request %s: holding blocks for transfer %s", spec.request_id, tid)

    def prefill_done(self, spec: PrefillSpec, events: Any) -> None:
        """Rapid transfer_kv: this step's forward pass completes the prompt of ``spec``; if a pull
        is parked for it, send every layer the moment the forward pass has written it."""
        tid = spec.transfer_id
        if tid in self._offers:
            return
        early = self._take_early(tid)
        if early is None:
            return  # no pull yet: the plain path serves it once the request finished
        offer = _Offer(
            SendSpec(spec.request_id, tid, spec.block_ids, spec.num_tokens), finished=False
        )
        self._offers[tid] = offer
        self._results.count("rapid_sends")
        self._answer(early, offer, events)

    def cancel(self, transfer_id: str, reason: str = "prefill request aborted on P") -> None:
        """No KV will be offered for ``transfer_id``: fail its parked pull, refuse later ones."""
        early = self._take_early(transfer_id)
        if early is not None:
            early.future.set_exception(TransferError(f"transfer {transfer_id}: {reason}"))
            return
        self._remember_cancelled(transfer_id)

    def _remember_cancelled(self, transfer_id: str) -> None:
        if transfer_id not in self._cancelled:
            self._cancelled[transfer_id] = self._loop.call_later(
                self._config.lease_s, self._cancelled.pop, transfer_id, None
            )

    # -- from D (RPC handlers) ---------------------------------------------------------------
    async def _on_transfer_kv(self, req: TransferKvRequest, ctx: CallContext) -> TransferKvResponse:
        tid = req.transfer_id
        try:
            check_compatible(self._spec, req.layout)
        except PeerError as err:
            offer = self._offers.get(tid)
            log.warning(
                "request %s: transfer_kv from %s for transfer %s (D request %s) rejected: %s",
                offer.spec.request_id if offer is not None else "(not finished on P yet)",
                ctx.peer,
                tid,
                req.request_id,
                err,
            )
            self._release_after_failed_pull(tid)
            raise
        offer = self._offers.get(tid)
        if offer is not None:
            if offer.sending or offer.over:
                raise PeerError(f"transfer {tid} is already being sent (duplicate transfer_kv)")
            return self._start_send(offer, req, ctx.peer)
        if tid in self._cancelled:
            raise TransferError(f"transfer {tid}: cancelled on P (aborted or released)")
        if tid in self._early:
            raise PeerError(f"transfer {tid}: duplicate transfer_kv while waiting for the request")
        # P has not finished (or not even seen) the request: hold the pull within the lease.
        self._results.count("early_pulls")
        early = _EarlyPull(req, ctx.peer, self._loop.create_future())
        early.timer = self._loop.call_later(self._config.lease_s, self._early_expired, tid)
        self._early[tid] = early
        log.debug("transfer %s: transfer_kv from %s waits for the request", tid, ctx.peer)
        try:
            return await early.future
        finally:
            # Cancelled (D's connection went away): forget the parked pull at once.
            if self._early.get(tid) is early:
                self._take_early(tid)

    async def _on_release(self, req: ReleaseRequest, ctx: CallContext) -> ReleaseResponse:
        """D (nothing to pull, or aborted) or the proxy (P's request failed): free it now."""
        tid = req.transfer_id
        offer = self._offers.get(tid)
        if offer is None or offer.sending or not offer.finished:
            early = self._take_early(tid)
            if early is not None:
                self._results.count("early_pulls_released")
                early.future.set_exception(TransferError(f"released by {ctx.peer}: {req.reason}"))
            if offer is None:
                # The request may still finish here: release its blocks as soon as it does.
                self._remember_cancelled(tid)
            return ReleaseResponse(tid, released=False)
        log.debug(
            "request %s: transfer %s released by %s (%s)",
            offer.spec.request_id,
            tid,
            ctx.peer,
            req.reason,
        )
        self._results.count("released_by_peer")
        self._release(tid, offer)
        return ReleaseResponse(tid, released=True)

    # -- internals ---------------------------------------------------------------------------
    def _take_early(self, tid: str) -> _EarlyPull | None:
        """Remove the pull parked for ``tid``; None if there is none still waiting."""
        early = self._early.pop(tid, None)
        if early is None:
            return None
        if early.timer is not None:
            early.timer.cancel()
        return None if early.future.done() else early

    def _answer(self, early: _EarlyPull, offer: _Offer, events: Any = None) -> None:
        try:
            early.future.set_result(self._start_send(offer, early.request, early.peer, events))
        except Exception as err:
            early.future.set_exception(err)

    def _release(self, tid: str, offer: _Offer) -> None:
        """The transfer is over, or will never happen: give the blocks back to vLLM, exactly
        once, and only once the request has finished on P."""
        if offer.timer is not None:
            offer.timer.cancel()
            offer.timer = None
        offer.sending = False
        offer.over = True
        if not offer.finished:
            return  # rapid: offer() reports it when the request finishes
        if self._offers.get(tid) is offer:
            del self._offers[tid]
            self._results.sent(offer.spec.request_id)

    def _start_send(
        self, offer: _Offer, req: TransferKvRequest, peer: str, events: Any = None
    ) -> TransferKvResponse:
        """Parse the blocks and hand them to kvt; the completion releases the offer.

        With ``events`` (rapid transfer_kv) each layer is its own batch that kvt holds until the
        forward pass marks that layer written.
        """
        spec = offer.spec
        tid = spec.transfer_id
        try:
            blocks = self._parse(spec, req)
        except Exception as err:
            log.warning(
                "request %s: transfer %s for %s (D request %s) rejected: %s",
                spec.request_id,
                tid,
                peer,
                req.request_id,
                err,
            )
            self._release(tid, offer)
            if isinstance(err, PeerError):
                raise
            raise PeerError(str(err)) from err
        if offer.timer is not None:
            offer.timer.cancel()
        offer.sending = True
        # Guard: whatever kvt does, the blocks come back after the transfer timeout.
        offer.timer = self._loop.call_later(
            self._config.transfer_timeout_s, self._send_timed_out, tid
        )
        call_soon = self._loop.call_soon_threadsafe

        def on_complete(completion: Any) -> None:  # kvt thread: hand over, do nothing else
            with contextlib.suppress(RuntimeError):  # loop closed at shutdown
                call_soon(self._send_done, tid, completion)

        if events is None:
            batches = [(blocks, None)]
        else:
            layers = blocks["tag"]
            batches = [
                (blocks[layers == layer], (events, layer))
                for layer in range(len(self._spec.layer_offsets))
            ]
        nbytes = int(blocks["length"].sum())
        try:
            for index, (batch, after) in enumerate(batches):
                self._engine.send(
                    tid,
                    req.data_address,
                    batch,
                    last=index == len(batches) - 1,
                    on_complete=on_complete if index == 0 else None,
                    timeout_s=self._config.transfer_timeout_s,
                    after=after,
                )
        except Exception as err:  # kvt refused the send (closed, bad blocks, reused id)
            log.warning(
                "request %s: kvt refused to send transfer %s to %s: %s; releasing its blocks",
                spec.request_id,
                tid,
                req.data_address,
                err,
            )
            with contextlib.suppress(Exception):
                self._engine.abort(tid, f"send refused on P: {err}")
            self._release(tid, offer)
            raise TransferError(f"transfer {tid}: send refused on P: {err}") from err
        log.debug(
            "request %s: sending transfer %s to %s (%d records, %d bytes%s)",
            spec.request_id,
            tid,
            req.data_address,
            blocks.size,
            nbytes,
            ", layer by layer as computed" if events is not None else "",
        )
        return TransferKvResponse(tid, len(req.block_ids), int(blocks.size), nbytes)

    def _parse(self, spec: SendSpec, req: TransferKvRequest) -> np.ndarray:
        block_size = self._spec.block_size
        needed = math.ceil(req.num_tokens / block_size)
        if not req.block_ids:
            raise PeerError("transfer_kv names no destination block")
        if req.num_tokens > spec.num_tokens:
            raise PeerError(
                f"D needs {req.num_tokens} prompt tokens but P computed {spec.num_tokens}"
            )
        if req.first_block < 0 or req.first_block + len(req.block_ids) != needed:
            raise PeerError(
                f"D sent {len(req.block_ids)} blocks after {req.first_block} cached ones for "
                f"{req.num_tokens} tokens ({needed} blocks of {block_size})"
            )
        src_ids = spec.block_ids[req.first_block : needed]
        dst_layout = layout_from_spec(req.layout)
        return parse_blocks(
            self._layout,
            dst_layout,
            np.asarray(src_ids, dtype=np.int64),
            np.asarray(req.block_ids, dtype=np.int64),
            src_region=np.asarray(self._spec.region_ids, dtype=np.int64),
            dst_region=np.asarray(req.layout.region_ids, dtype=np.int64),
        )

    def _send_done(self, tid: str, completion: Any) -> None:
        offer = self._offers.get(tid)
        if offer is None or not offer.sending:
            return  # already released (timeout guard, refusal)
        self._results.count("sends_done" if _is_done(completion) else "sends_failed")
        if not _is_done(completion):
            log.warning(
                "request %s: sending transfer %s failed (%s); releasing its blocks",
                offer.spec.request_id,
                tid,
                _describe(completion),
            )
        self._release(tid, offer)

    def _send_timed_out(self, tid: str) -> None:
        offer = self._offers.get(tid)
        if offer is None or not offer.sending:
            return
        log.warning(
            "request %s: transfer %s not confirmed within %.1fs; aborting and releasing blocks",
            offer.spec.request_id,
            tid,
            self._config.transfer_timeout_s,
        )
        offer.timer = None
        with contextlib.suppress(Exception):
            self._engine.abort(tid, "send timed out on P")
        self._release(tid, offer)

    def _lease_expired(self, tid: str) -> None:
        offer = self._offers.get(tid)
        if offer is None or offer.sending:
            return
        offer.timer = None
        self._results.count("leases_expired")
        log.warning(
            "request %s: no decode instance pulled transfer %s within the %.1fs lease; "
            "releasing its blocks",
            offer.spec.request_id,
            tid,
            self._config.lease_s,
        )
        self._release(tid, offer)

    def _early_expired(self, tid: str) -> None:
        early = self._early.get(tid)
        if early is None:
            return
        early.timer = None
        self._take_early(tid)
        self._results.count("early_pulls_expired")
        log.warning(
            "transfer %s: transfer_kv from %s (D request %s) expired: the request did not "
            "finish on P within the %.1fs lease",
            tid,
            early.peer,
            early.request.request_id,
            self._config.lease_s,
        )
        if not early.future.done():
            early.future.set_exception(LeaseExpired(f"transfer {tid} not available on P in time"))

    def _release_after_failed_pull(self, tid: str) -> None:
        """A pull for ``tid`` failed for good (one pull per transfer): free P's blocks now."""
        offer = self._offers.get(tid)
        if offer is not None and not offer.sending:
            self._release(tid, offer)

    async def close(self) -> None:
        await self._server.close()
        for tid in list(self._early):
            early = self._take_early(tid)
            if early is not None:
                early.future.set_exception(TransferError("prefill instance shutting down"))
        for offer in self._offers.values():
            if offer.timer is not None:
                offer.timer.cancel()
        self._offers.clear()
        for timer in self._cancelled.values():
            timer.cancel()
        self._cancelled.clear()


# ---------------------------------------------------------------------------------- D (consumer)
@dataclass
class _Pull:
    spec: RecvSpec
    task: asyncio.Task[None] | None = None


class Consumer:
    """D's pulls: kvt expect, then transfer_kv to P. Runs on the loop thread."""

    def __init__(
        self,
        config: HybridConfig,
        engine: Any,
        local_spec: LayoutSpec,
        results: _Results,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._config = config
        self._engine = engine
        self._spec = local_spec
        self._results = results
        self._loop = loop
        self._pulls: dict[str, _Pull] = {}
        self._clients: dict[str, Client] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def _client(self, address: str) -> Client:
        client = self._clients.get(address)
        if client is None or client.closed:
            client = Client(address)
            self._clients[address] = client
        return client

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self, spec: RecvSpec) -> None:
        if spec.request_id in self._pulls:
            log.warning(
                "request %s: pull already in flight; ignoring a second one", spec.request_id
            )
            return
        pull = _Pull(spec)
        self._pulls[spec.request_id] = pull
        call_soon = self._loop.call_soon_threadsafe

        def on_complete(completion: Any) -> None:  # kvt thread: hand over, do nothing else
            with contextlib.suppress(RuntimeError):
                call_soon(self._recv_done, spec.request_id, completion)

        try:
            self._engine.expect(
                spec.transfer_id,
                timeout_s=self._config.transfer_timeout_s,
                on_complete=on_complete,
            )
        except Exception as err:
            log.warning(
                "request %s: cannot expect transfer %s from %s: %s; recomputing locally",
                spec.request_id,
                spec.transfer_id,
                spec.remote_rpc_address,
                err,
            )
            self._pulls.pop(spec.request_id)
            self._results.received(spec.request_id, failed=True)
            return
        self._results.count("pulls_started")
        pull.task = self._spawn(self._ask(pull))

    async def _ask(self, pull: _Pull) -> None:
        spec = pull.spec
        request = TransferKvRequest(
            transfer_id=spec.transfer_id,
            request_id=spec.request_id,
            data_address=self._engine.data_address,
            layout=self._spec,
            block_ids=spec.block_ids,
            first_block=spec.first_block,
            num_tokens=spec.num_tokens,
        )
        try:
            await self._client(spec.remote_rpc_address).call(
                TRANSFER_KV, request, timeout=self._config.transfer_timeout_s
            )
        except asyncio.CancelledError:
            raise
        except Exception as err:
            # The completion (ABORTED, LOCAL) reports the failure to vLLM.
            with contextlib.suppress(Exception):
                self._engine.abort(spec.transfer_id, f"transfer_kv failed: {err}")

    def _recv_done(self, request_id: str, completion: Any) -> None:
        pull = self._pulls.pop(request_id, None)
        if pull is None:
            return
        if pull.task is not None and not pull.task.done():
            pull.task.cancel()
        ok = _is_done(completion)
        self._results.count("pulls_done" if ok else "pulls_failed")
        if ok:
            self._results.count("bytes_received", int(completion.nbytes))
        if not ok:
            spec = pull.spec
            log.warning(
                "request %s: pulling transfer %s from %s failed (%s); vLLM recomputes it",
                request_id,
                spec.transfer_id,
                spec.remote_rpc_address,
                _describe(completion),
            )
        self._results.received(request_id, failed=not ok)

    def cancel(self, request_id: str) -> None:
        pull = self._pulls.get(request_id)
        if pull is None:
            return  # already completed; its result is (or was) reported
        spec = pull.spec
        self.release(ReleaseSpec(request_id, spec.transfer_id, spec.remote_rpc_address, "aborted"))
        with contextlib.suppress(Exception):
            self._engine.abort(spec.transfer_id, "decode request aborted")

    def release(self, spec: ReleaseSpec) -> None:
        self._spawn(self._release(spec))

    async def _release(self, spec: ReleaseSpec) -> None:
        try:
            await self._client(spec.remote_rpc_address).call(
                RELEASE,
                ReleaseRequest(spec.transfer_id, spec.request_id, spec.reason),
                timeout=self._config.transfer_timeout_s,
            )
        except Exception as err:
            log.warning(
                "request %s: releasing transfer %s on %s failed: %s (P's lease frees it)",
                spec.request_id,
                spec.transfer_id,
                spec.remote_rpc_address,
                err,
            )

    async def close(self) -> None:
        for pull in list(self._pulls.values()):
            with contextlib.suppress(Exception):
                self._engine.abort(pull.spec.transfer_id, "decode instance shutting down")
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()


# ---------------------------------------------------------------------------------- the worker
class WorkerSide:
    def __init__(
        self, config: HybridConfig, *, is_producer: bool, is_consumer: bool, name: str
    ) -> None:
        self._config = config
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._name = name
        self._results = _Results()
        self._loop: LoopThread | None = None
        self._engine: Any = None
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._closed = False
        self._layer_index: dict[str, int] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        # Rapid transfer_kv: readiness of this step's layers, only while a step completes the
        # prompt of some do_remote_decode request.
        self._step_events: Any = None
        self._metrics_server: Any = None
        self._metrics_thread: threading.Thread | None = None
        self.rpc_address: str | None = None
        self.local_spec: LayoutSpec | None = None

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_size: int,
        num_blocks: int | None = None,
    ) -> None:
        geometry = describe_kv_caches(kv_caches, block_size, num_blocks)
        # kvt reads and writes these buffers by address: keep them alive while registered.
        self._kv_caches = dict(kv_caches)
        from kvt import TransferEngine

        self._engine = TransferEngine(
            host=self._config.data_host,
            port=self._config.data_port,
            name=self._name,
            default_timeout_s=self._config.transfer_timeout_s,
        )
        self._layer_index = {name: i for i, name in enumerate(geometry.layer_names)}
        region_ids = [self._engine.register_region((b.address, b.nbytes)) for b in geometry.buffers]
        self.local_spec = geometry.spec(region_ids)
        self._loop = LoopThread(name=f"hybrid-connector-{self._name}")
        loop = self._loop.loop
        if self._is_producer:
            self._producer = Producer(
                self._config, self._engine, self.local_spec, self._results, loop
            )
            # Startup, not a step: binding the fixed port must fail loudly here.
            self.rpc_address = self._loop.run(self._producer.start(), timeout=30)
        if self._is_consumer:
            self._consumer = Consumer(
                self._config, self._engine, self.local_spec, self._results, loop
            )
        registry = self._engine.metrics_registry
        registry.register(_CountersCollector(self._results, self._name))
        if self._config.metrics_port is not None:
            from prometheus_client import start_http_server

            self._metrics_server, self._metrics_thread = start_http_server(
                self._config.metrics_port, addr=self._config.rpc_host, registry=registry
            )
        log.info(
            "hybrid-connector %s: %d layers in %d region(s), %d blocks of %d tokens; "
            "rpc %s, data %s",
            self._name,
            len(geometry.layer_names),
            len(geometry.buffers),
            geometry.num_blocks,
            block_size,
            self.rpc_address,
            self._engine.data_address,
        )

    @staticmethod
    def _run_batch(batch: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
        """Loop thread: one step's work, in order; one failing item does not skip the rest."""
        for fn, args in batch:
            try:
                fn(*args)
            except Exception:
                log.exception("hybrid-connector: %s failed", getattr(fn, "__qualname__", fn))

    def handle_metadata(self, meta: HybridConnectorMetadata) -> None:
        """Queue this step's work on the loop thread; returns at once."""
        if meta.is_empty():
            return
        if self._loop is None:
            raise TransferError("register_kv_caches was not called before the first step")
        producer, consumer = self._producer, self._consumer
        # One hand-over (one wake-up of the loop thread) per step, however many items.
        batch: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        post = batch.append
        if meta.prefill_done and producer is not None:
            from kvt import CpuLayerEvents

            # Called before the forward pass (bind_connector_metadata): save_kv_layer marks
            # each layer ready as the pass writes it, wait_for_save marks the rest.
            events = CpuLayerEvents(len(self._layer_index))
            self._step_events = events
            for spec in meta.prefill_done:
                post((producer.prefill_done, (spec, events)))
        for send in meta.to_send:
            if producer is None:
                self._results.sent(send.request_id)
            else:
                post((producer.offer, (send,)))
        for tid in meta.cancel_send:
            if producer is not None:
                post((producer.cancel, (tid,)))
        for recv in meta.to_recv:
            if consumer is None:
                self._results.received(recv.request_id, failed=True)
            else:
                post((consumer.start, (recv,)))
        for request_id in meta.cancel_recv:
            if consumer is not None:
                post((consumer.cancel, (request_id,)))
        for release in meta.to_release:
            if consumer is not None:
                post((consumer.release, (release,)))
        if batch:
            self._loop.call_soon(self._run_batch, batch)

    def layer_saved(self, layer_name: str) -> None:
        """The forward pass wrote ``layer_name``'s KV (from save_kv_layer): release its sends."""
        events = self._step_events
        if events is not None:
            index = self._layer_index.get(layer_name)
            if index is not None:
                events.mark_ready(index)

    def step_done(self) -> None:
        """End of the step's forward pass (wait_for_save): every layer is written."""
        events, self._step_events = self._step_events, None
        if events is not None:
            for index in range(len(self._layer_index)):
                events.mark_ready(index)

    def drain(self, wait_s: float = 0.0) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last drain."""
        return self._results.drain(wait_s)

    def wait_count(self, name: str, at_least: int, timeout_s: float = 30.0) -> bool:
        """Block until event counter ``name`` reaches ``at_least``; False on timeout."""
        return self._results.wait_count(name, at_least, timeout_s)

    def counters(self) -> dict[str, int]:
        """Event counts of this worker (offers, pulls_done, leases_expired, ...)."""
        return self._results.counters()

    @property
    def metrics_registry(self) -> Any:
        """kvt's prometheus CollectorRegistry for this worker's transfers (None before start)."""
        return None if self._engine is None else self._engine.metrics_registry

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            with contextlib.suppress(Exception):
                if self._producer is not None:
                    self._loop.run(self._producer.close(), timeout=10)
            with contextlib.suppress(Exception):
                if self._consumer is not None:
                    self._loop.run(self._consumer.close(), timeout=10)
            self._loop.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            assert self._metrics_thread is not None
            self._metrics_thread.join()
        if self._engine is not None:
            self._engine.close()
        self._kv_caches = {}
