"""Worker-side half of HybridConnector: the I/O shell around P's and D's state machines.

vLLM calls the worker hooks from its step; they only hand work to the connector's own event-loop
thread (``LoopThread``) and drain a completion set, so no step ever waits on the network.

The decisions (what to send, when blocks go back, which pull fails) are made by the pure
machines ``producer.Producer`` and ``consumer.Consumer``; this module only translates: vLLM's
metadata, RPCs, kvt completions and timers become events, and the machines' actions become kvt
calls, RPC answers, timers and reports. Everything here runs on the loop thread, except kvt
completion callbacks, which arrive on kvt threads and are forwarded with
``call_soon_threadsafe``; the loop reports finished request ids into a lock-protected set that
``get_transfer_results`` swaps out each step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
from simple_rpc import CallContext, Client, LoopThread, Server

from hybrid_connector import common, consumer, producer, r3
from hybrid_connector.config import HybridConfig, KvsConfig
from hybrid_connector.errors import ConfigError, PeerError, TransferError
from hybrid_connector.layout import CacheGeometry, KvGroup, describe_kv_cache_groups
from hybrid_connector.mapping import plan_copy
from hybrid_connector.metadata import (
    FinalPrefill,
    HybridConnectorMetadata,
    OfferSpec,
    RecvSpec,
    ReleaseSpec,
    TransferResults,
)
from hybrid_connector.migration import MigrateOutForwarder
from hybrid_connector.protocol import (
    RELEASE,
    TRANSFER_KV,
    CacheSpec,
    ReleaseRequest,
    ReleaseResponse,
    TransferKvRequest,
    TransferKvResponse,
)
from hybrid_connector.send_done import SendDoneClient

if TYPE_CHECKING:
    import torch
    from kvt import Completion, CpuLayerEvents, CudaLayerEvents, LayerEvents, TransferEngine
    from kvt.access import DeviceEvent, EventWaiter
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from hybrid_connector.kvs_worker import KvsWorker
    from hybrid_connector.r3_worker import R3Recorder

log = logging.getLogger(__name__)

EventT = TypeVar("EventT")
ActionT = TypeVar("ActionT")


class _Results:
    """D's finished request ids reported by the loop thread, drained by vLLM's step thread, and
    the worker's event counters."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        # Requests whose receive comes in parts (a KVS load and a pull): parts still out, and
        # whether one failed; reported once, when the last part is in.
        self._parts: dict[str, int] = {}
        self._part_failed: set[str] = set()
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

    def expect(self, request_id: str, parts: int) -> None:
        """``request_id``'s receive is done after ``parts`` reports (called before any)."""
        with self._cond:
            self._parts[request_id] = parts

    def received(self, request_id: str, *, failed: bool) -> None:
        with self._cond:
            left = self._parts.get(request_id)
            if left is not None:
                if failed:
                    self._part_failed.add(request_id)
                if left > 1:
                    self._parts[request_id] = left - 1
                    return
                del self._parts[request_id]
                if request_id in self._part_failed:
                    self._part_failed.discard(request_id)
                    failed = True
            self._recving.add(request_id)
            if failed:
                self._failed.add(request_id)
            self._cond.notify_all()

    def take_loaded_in_step(self) -> list[str]:
        """vLLM's thread, after a step: the requests whose KVS load ran in it (in-step)."""
        return [] if self.kvs is None else self.kvs.take_loaded_in_step()

    def take_failed_blocks(self) -> set[int]:
        """vLLM's thread, after a step: the blocks of its in-step KVS loads that failed."""
        return set() if self.kvs is None else self.kvs.take_failed_blocks()

    def drain(self, wait_s: float = 0.0) -> TransferResults:
        """Take what finished; with ``wait_s`` > 0 first wait that long for anything to finish
        (vLLM's step never waits; tests and tools outside a step may)."""
        with self._cond:
            if wait_s > 0 and not self._recving:
                self._cond.wait(wait_s)
            out = TransferResults(self._recving, self._failed)
            self._recving, self._failed = set(), set()
        return out


class _CountersCollector:
    """Exports the worker's event counters as ``hybrid_connector_events_total{event=...}``."""

    def __init__(self, results: _Results, name: str) -> None:
        self._results = results
        self._name = name

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "hybrid_connector_events",
            "HybridConnector worker events (offers, sends, leases, pulls, bytes received)",
            labels=["connector", "event"],
        )
        for event, value in sorted(self._results.counters().items()):
            family.add_metric([self._name, event], value)
        yield family


# ---------------------------------------------------------------------------------- the shells
class _Machine(Protocol[EventT, ActionT]):
    """``producer.Producer`` or ``consumer.Consumer``: events in, actions out."""

    def handle(self, event: EventT) -> list[ActionT]: ...


class _Shell(Generic[EventT, ActionT]):
    """Feeds one pure machine (``producer.Producer``, ``consumer.Consumer``), does its actions.

    Runs on the loop thread. Events that arise while actions are carried out (a kvt refusal, a
    deadline) are queued and handed to the machine right after, in order, so the machine never
    sees an event in the middle of another one.
    """

    core: _Machine[EventT, ActionT]  # set by each shell

    def __init__(
        self, engine: TransferEngine, results: _Results, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._engine = engine
        self._results = results
        self._loop = loop
        self._inbox: collections.deque[EventT] = collections.deque()
        self._pumping = False

    def feed(self, event: EventT) -> list[ActionT]:
        """Hand ``event`` to the machine; return the actions it decided for it (already done)."""
        self._inbox.append(event)
        if self._pumping:
            return []
        self._pumping = True
        first: list[ActionT] = []
        try:
            while self._inbox:
                current = self._inbox.popleft()
                actions = self.core.handle(current)
                if current is event:
                    first = actions
                for action in actions:
                    try:
                        self._do(action)
                    except Exception:
                        log.exception("hybrid-connector: %r failed", action)
        finally:
            self._pumping = False
        return first

    def _do(self, action: ActionT) -> None:
        """The actions both machines emit; each shell matches its own first."""
        match action:
            case common.Abort(tid, reason):
                with contextlib.suppress(Exception):
                    self._engine.abort(tid, reason)
            case common.Count(name, n):
                self._results.count(name, n)
            case common.Log(level, message, args):
                # Under the machine's module name (hybrid_connector.producer, ...).
                logging.getLogger(type(self.core).__module__).log(level, message, *args)

    def _post(self, event: EventT) -> None:
        """From a kvt thread: feed ``event`` on the loop thread (nothing else happens here)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed at shutdown
            self._loop.call_soon_threadsafe(self.feed, event)


class ProducerShell(_Shell["producer.ProducerEvent", "producer.ProducerAction"]):
    """P: the transfer_kv/release RPC server, kvt sends and timers around ``producer.Producer``."""

    def __init__(
        self,
        config: HybridConfig,
        engine: TransferEngine,
        local_spec: CacheSpec,
        results: _Results,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(engine, results, loop)
        self._config = config
        self._spec = local_spec
        self.core = producer.Producer(
            local_spec, producer.ProducerSettings(config.lease_s, config.transfer_timeout_s)
        )
        # Rapid sends: a layer's batch waits on the layer's event, numbered across all groups.
        self._layer_base: list[int] = []
        total = 0
        for group in local_spec.groups:
            self._layer_base.append(total)
            total += len(group.layer_names)
        self._num_layers = total
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._pulls: dict[int, asyncio.Future[TransferKvResponse]] = {}
        self._pull_ids = itertools.count(1)
        self._server = Server(name="hybrid-connector")
        self._server.register(TRANSFER_KV, self._on_transfer_kv)
        self._server.register(RELEASE, self._on_release)
        # To the owner of P's blocks (the scheduler half, holds.py): the one way they go back.
        self._send_done: SendDoneClient | None = None
        # MIGRATE_OUT from the proxy goes on to the scheduler half (migration.py).
        self._migrate_out = MigrateOutForwarder(
            lambda: self._send_done.address if self._send_done is not None else ""
        )
        self._migrate_out.register(self._server)

    async def start(self) -> str:
        return await self._server.start(self._config.rpc_host, self._config.rpc_port)

    # -- from vLLM (via metadata) ----------------------------------------------------------
    def use_scheduler(self, address: str) -> None:
        """Where SEND_DONE goes (the metadata's ``scheduler_address``): one scheduler half for
        the worker's whole life, so the first address stays."""
        if self._send_done is None and address:
            self._send_done = SendDoneClient(
                address,
                self._spec.tp_rank,
                on_delivered=lambda: self._results.count("send_done_delivered"),
            )

    def offer(self, spec: OfferSpec) -> None:
        self.feed(producer.RequestFinished(spec))

    def final_prefill_starts(self, spec: FinalPrefill, events: LayerEvents | None) -> None:
        self.feed(producer.FinalPrefillStarts(spec, events))

    def final_prefill_ended(self, spec: FinalPrefill) -> None:
        """End of the step that completed ``spec``'s prompt: the request finished in it
        (``max_tokens=1``) and no OfferSpec will follow: offer it now."""
        offer = OfferSpec(spec.request_id, spec.transfer_id, spec.block_ids, spec.num_tokens)
        self.feed(producer.RequestFinished(offer))

    def cancel(self, transfer_id: str) -> None:
        self.feed(producer.RequestCancelled(transfer_id))

    # -- from D and the proxy (RPC handlers) -----------------------------------------------
    async def _on_transfer_kv(self, req: TransferKvRequest, ctx: CallContext) -> TransferKvResponse:
        pull = next(self._pull_ids)
        future: asyncio.Future[TransferKvResponse] = self._loop.create_future()
        self._pulls[pull] = future
        self.feed(producer.PullArrived(pull, req, ctx.peer))
        try:
            return await future
        finally:
            if self._pulls.pop(pull, None) is not None:  # never answered: D went away
                self.feed(producer.PullGone(req.transfer_id, pull))

    async def _on_release(self, req: ReleaseRequest, ctx: CallContext) -> ReleaseResponse:
        actions = self.feed(producer.ReleaseArrived(req.transfer_id, ctx.peer, req.reason))
        released = any(isinstance(a, producer.AnswerRelease) and a.released for a in actions)
        return ReleaseResponse(req.transfer_id, released=released)

    # -- the machine's decisions -----------------------------------------------------------
    def _do(self, action: producer.ProducerAction) -> None:
        match action:
            case producer.StartSend():
                self._start_send(action)
            case producer.FailPull(pull, error):
                future = self._pulls.pop(pull, None)
                if future is not None and not future.done():
                    future.set_exception(error)
            case producer.ReturnBlocks(request_id, transfer_id, outcome):
                if self._send_done is None:  # every metadata names the scheduler half
                    log.error(
                        "request %s: no scheduler address to give transfer %s's blocks back to",
                        request_id,
                        transfer_id,
                    )
                    return
                self._send_done.report(request_id, transfer_id, outcome)
                self._results.count("send_done_reports")
            case producer.ArmDeadline(tid, delay_s):
                old = self._timers.pop(tid, None)
                if old is not None:
                    old.cancel()
                self._timers[tid] = self._loop.call_later(delay_s, self._deadline_passed, tid)
            case producer.CancelDeadline(tid):
                timer = self._timers.pop(tid, None)
                if timer is not None:
                    timer.cancel()
            case producer.AnswerRelease():
                pass  # read by _on_release from feed()'s result
            case _:
                super()._do(action)

    def _deadline_passed(self, tid: str) -> None:
        self._timers.pop(tid, None)
        self.feed(producer.DeadlineReached(tid))

    def _start_send(self, action: producer.StartSend) -> None:
        """Parse the blocks, hand them to kvt (one batch, or one per layer held by the layer
        events) and answer the pull; kvt's completion comes back as ``SendCompleted``."""
        tid, req = action.transfer_id, action.request
        kvt_id = action.kvt_id or tid  # one kvt request per (P rank, D rank)
        future = self._pulls.pop(action.pull, None)
        if future is None or future.done():
            # D's call went away just before the send could start: kvt has nothing.
            self._inbox.append(producer.SendRefused(kvt_id, TransferError("pull gone"), False))
            return
        try:
            with self._engine.timed_stage("parse"):  # kvt_stage_seconds{stage="parse"}
                blocks = self._plan(action, req)
        except Exception as err:
            log.warning(
                "request %s: transfer %s for %s (D request %s) rejected: %s",
                action.request_id,
                tid,
                req.data_address,
                req.request_id,
                err,
            )
            future.set_exception(err if isinstance(err, PeerError) else PeerError(str(err)))
            self._inbox.append(producer.SendRefused(kvt_id, err, False))
            return

        def on_complete(completion: Completion) -> None:  # kvt thread
            self._post(producer.SendCompleted(kvt_id, completion))

        events = action.layer_events
        if events is not None:
            layers = blocks["tag"]
            batches = [
                (blocks[layers == layer], (events, layer)) for layer in range(self._num_layers)
            ]
        else:
            batches = [(blocks, None)]
        accepted = 0
        try:
            for index, (batch, after) in enumerate(batches):
                self._engine.send(
                    kvt_id,
                    req.data_address,
                    batch,
                    last=index == len(batches) - 1,
                    on_complete=on_complete if index == 0 else None,
                    timeout_s=self._config.transfer_timeout_s,
                    after=after,
                )
                accepted += 1
        except Exception as err:  # kvt refused (closed, bad blocks, reused id)
            future.set_exception(TransferError(f"transfer {tid}: send refused on P: {err}"))
            # Once kvt took a batch it may read the blocks until its completion.
            self._inbox.append(producer.SendRefused(kvt_id, err, kvt_has_blocks=accepted > 0))
            return
        nbytes = int(blocks["length"].sum())
        log.debug(
            "request %s: sending transfer %s to %s (%d records, %d bytes%s)",
            action.request_id,
            tid,
            req.data_address,
            blocks.size,
            nbytes,
            ", layer by layer as computed" if events is not None else "",
        )
        num_blocks = sum(len(ids) for ids in req.block_ids)
        future.set_result(TransferKvResponse(tid, num_blocks, int(blocks.size), nbytes))

    def _plan(self, action: producer.StartSend, req: TransferKvRequest) -> np.ndarray:
        """IpcBlocks of every group D asked for; each record's tag is its layer's index across
        all groups (the rapid send's layer events)."""
        plans = []
        for g, (mine, theirs) in enumerate(zip(self._spec.groups, req.layout.groups, strict=True)):
            if not req.block_ids[g]:
                continue  # D holds all of this group already (its prefix hit)
            r3.check_peer(mine, theirs)
            blocks = plan_copy(
                mine,
                theirs,
                action.src_block_ids[g],
                req.block_ids[g],
                first_block=req.first_block[g],
                num_tokens=req.num_tokens,
            )
            if self._layer_base[g]:
                blocks["tag"] += self._layer_base[g]
            plans.append(blocks)
        return plans[0] if len(plans) == 1 else np.concatenate(plans)

    async def close(self) -> None:
        await self._server.close()
        self.feed(common.ShuttingDown())
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for future in self._pulls.values():
            if not future.done():
                future.set_exception(TransferError("prefill instance shutting down"))
        self._pulls.clear()
        await self._migrate_out.close()
        # Blocks still held by the scheduler half are released by its own shutdown.
        if self._send_done is not None:
            await self._send_done.close()
            self._send_done = None


class ConsumerShell(_Shell["consumer.ConsumerEvent", "consumer.ConsumerAction"]):
    """D: kvt expects, the transfer_kv/release RPC calls to P, around ``consumer.Consumer``."""

    def __init__(
        self,
        config: HybridConfig,
        engine: TransferEngine,
        local_spec: CacheSpec,
        results: _Results,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(engine, results, loop)
        self._config = config
        self._spec = local_spec
        self.core = consumer.Consumer(local_spec)
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._clients: dict[str, Client] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- from vLLM (via metadata) ----------------------------------------------------------
    def start(self, spec: RecvSpec) -> None:
        self.feed(consumer.PullRequested(spec))

    def cancel(self, request_id: str) -> None:
        self.feed(consumer.PullCancelled(request_id))

    def release(self, spec: ReleaseSpec) -> None:
        self.feed(consumer.ReleaseRequested(spec))

    # -- the machine's decisions -----------------------------------------------------------
    def _do(self, action: consumer.ConsumerAction) -> None:
        match action:
            case consumer.StartPull(spec, kvt_id):
                self._start_pull(spec, kvt_id or spec.transfer_id)
            case consumer.StopCall(request_id, kvt_id):
                task = self._calls.pop(kvt_id or request_id, None)
                if task is not None and not task.done():
                    task.cancel()
            case consumer.CallRelease(spec):
                self._spawn(self._release(spec))
            case consumer.ReportRecv(request_id, failed):
                self._results.received(request_id, failed=failed)
            case _:
                super()._do(action)

    def _start_pull(self, spec: RecvSpec, kvt_id: str) -> None:
        """One part of a pull: kvt expects ``kvt_id``, then transfer_kv asks one P rank."""
        request_id = spec.request_id

        def on_complete(completion: Completion) -> None:  # kvt thread
            self._post(consumer.RecvCompleted(request_id, completion, kvt_id))

        try:
            self._engine.expect(
                kvt_id,
                timeout_s=self._config.transfer_timeout_s,
                on_complete=on_complete,
            )
        except Exception as err:
            self._inbox.append(consumer.ExpectRefused(request_id, err, kvt_id))
            return
        self._calls[kvt_id] = self._spawn(self._ask(spec, kvt_id))

    def _client(self, address: str) -> Client:
        client = self._clients.get(address)
        if client is None or client.closed:
            client = Client(address)
            self._clients[address] = client
        return client

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ask(self, spec: RecvSpec, kvt_id: str) -> None:
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
            self.feed(consumer.PullCallFailed(spec.request_id, err, kvt_id))

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
        self.feed(common.ShuttingDown())
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._calls.clear()
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()


# ---------------------------------------------------------------------------------- the worker
def _region_of(buffer: Any) -> Any:
    """What kvt registers for a KV buffer: host memory by address, or device memory."""
    if buffer.device == "cpu":
        return (buffer.address, buffer.nbytes)
    from kvt.access import DeviceMemory

    return DeviceMemory(buffer.address, buffer.nbytes, buffer.device)


def _start_kvs(
    config: KvsConfig,
    geometry: CacheGeometry,
    results: _Results,
    report_save: Callable[[int], None],
    *,
    tp_rank: int,
    tp_size: int,
    name: str,
) -> KvsWorker:
    import refstore

    from hybrid_connector.kvs_worker import KvsWorker

    devices = {b.device for b in geometry.buffers}
    if devices != {"cpu"}:
        raise ConfigError(f"KVS stores KV caches in host memory only, not on {sorted(devices)}")

    def report(request_id: str, failed: bool) -> None:
        results.count("kvs_loads_failed" if failed else "kvs_loads")
        results.received(request_id, failed=failed)

    def report_in_step(request_id: str, failed: bool) -> None:  # vLLM reads the step's output
        results.count("kvs_loads_failed" if failed else "kvs_loads")

    return KvsWorker(
        config,
        geometry,
        tp_rank=tp_rank,
        tp_size=tp_size,
        connect=lambda: refstore.Client(config.store, timeout=10.0),
        report_load=report,
        report_save=report_save,
        report_in_step=report_in_step,
        name=f"-{name}",
    )


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
        self._engine: TransferEngine | None = None
        self._producer: ProducerShell | None = None
        self._consumer: ConsumerShell | None = None
        self._closed = False
        self._layer_index: dict[str, int] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        # Rapid transfer_kv: readiness of this step's layers, only while a step completes the
        # prompt of some do_remote_decode request, and those requests (offered at the step's end).
        self._step_events: CpuLayerEvents | CudaLayerEvents | None = None
        self._step_prefills: list[FinalPrefill] = []
        # P: the scheduler half's SEND_DONE address, as the last metadata named it.
        self._scheduler_address = ""
        # KV cache on a GPU: per-layer CUDA events, waited on by one kvt thread (never vLLM's).
        self._kv_device = "cpu"
        self._event_waiter: EventWaiter | None = None
        self._new_device_event: Callable[[], DeviceEvent] | None = None
        self._current_stream: Callable[[], Any] = lambda: None
        self._metrics_server: Any = None  # wsgiref server from prometheus_client
        self._metrics_thread: threading.Thread | None = None
        self.rpc_address: str | None = None
        self.local_spec: CacheSpec | None = None
        self.kvs: KvsWorker | None = None
        # R3: the routing buffer and record puts (connector.py attaches it; None: off).
        self.r3: R3Recorder | None = None
        # KVS saves are reported to the scheduler half by SEND_DONE (its address: the metadata's).
        self._kvs_send_done: SendDoneClient | None = None
        self._tp_rank = 0

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_size: int,
        num_blocks: int | None = None,
        groups: list[KvGroup] | None = None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """Register vLLM's KV caches; ``groups``: vLLM's KV-cache groups (None: one attention
        group holding every layer)."""
        if groups is None:
            groups = [KvGroup("attention", tuple(kv_caches), block_size)]
        geometry = describe_kv_cache_groups(
            kv_caches, groups, num_blocks, tp_rank=tp_rank, tp_size=tp_size
        )
        # kvt reads and writes these buffers by address: keep them alive while registered.
        self._kv_caches = dict(kv_caches)
        from kvt import TransferEngine

        engine = self._engine = TransferEngine(
            host=self._config.data_host,
            port=self._config.data_port,
            name=self._name,
            default_timeout_s=self._config.transfer_timeout_s,
            transport=self._config.transport,
        )
        self._layer_index = {name: i for i, name in enumerate(geometry.layer_names)}
        region_ids = [engine.register_region(_region_of(b)) for b in geometry.buffers]
        device = geometry.buffers[0].device
        if device != "cpu":
            import functools

            import torch

            stream = functools.partial(torch.cuda.current_stream, torch.device(device))
            self._start_device_events(device, current_stream=stream)
        self.local_spec = geometry.spec(region_ids)
        self._tp_rank = tp_rank
        if self._config.kvs is not None:
            self.kvs = _start_kvs(
                self._config.kvs,
                geometry,
                self._results,
                self._kvs_save_done,
                tp_rank=tp_rank,
                tp_size=tp_size,
                name=self._name,
            )
        self._loop = LoopThread(name=f"hybrid-connector-{self._name}")
        loop = self._loop.loop
        if self._is_producer:
            self._producer = ProducerShell(
                self._config, engine, self.local_spec, self._results, loop
            )
            # Startup, not a step: binding the fixed port must fail loudly here.
            self.rpc_address = self._loop.run(self._producer.start(), timeout=30)
        if self._is_consumer:
            self._consumer = ConsumerShell(
                self._config, engine, self.local_spec, self._results, loop
            )
        registry = engine.metrics_registry
        registry.register(_CountersCollector(self._results, self._name))
        if self._config.metrics_port is not None:
            from prometheus_client import start_http_server

            self._metrics_server, self._metrics_thread = start_http_server(
                self._config.metrics_port, addr=self._config.rpc_host, registry=registry
            )
        log.info(
            "hybrid-connector %s: %s in %d region(s), %d blocks; rpc %s, data %s",
            self._name,
            ", ".join(
                f"{g.family} group of {len(g.layer_names)} layers (block {g.block_size})"
                for g in self.local_spec.groups
            ),
            len(geometry.buffers),
            geometry.groups[0].num_blocks,
            self.rpc_address,
            engine.data_address,
        )

    def _start_device_events(
        self,
        device: str,
        *,
        current_stream: Callable[[], Any],
        event_factory: Callable[[], DeviceEvent] | None = None,
    ) -> None:
        """KV in device memory: layers become ready by CUDA events recorded in save_kv_layer on
        ``current_stream()`` (``event_factory``: default ``torch.cuda.Event``; tests fake it)."""
        from kvt.access import EventWaiter

        self._kv_device = device
        self._current_stream = current_stream
        self._new_device_event = event_factory
        self._event_waiter = EventWaiter(name=f"kvt-{self._name}-layer-events")

    def _new_step_events(self) -> CpuLayerEvents | CudaLayerEvents:
        from kvt import CpuLayerEvents, CudaLayerEvents

        if self._event_waiter is None:
            return CpuLayerEvents(len(self._layer_index))
        return CudaLayerEvents(
            len(self._layer_index), event_factory=self._new_device_event, waiter=self._event_waiter
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
        # Every step, empty ones too: tests count the steps a holding P runs (it should run none).
        self._results.count("steps")
        if self.r3 is not None:
            # Now, before this step's forward pass: the first that may reuse finished requests'
            # blocks, and the first to write into blocks newly given to requests.
            self.r3.begin_step(meta)
        if self.kvs is not None and meta.kvs_loads and meta.to_recv:
            # Loaded from the store and pulled from P: done when both are.
            pulled = {recv.request_id for recv in meta.to_recv}
            for load in meta.kvs_loads:
                if load.request_id in pulled:
                    self._results.expect(load.request_id, 2)
        if self.kvs is not None:
            if self._kvs_send_done is None and meta.scheduler_address and self._loop is not None:
                self._loop.call_soon(self._kvs_use_scheduler, meta.scheduler_address)
            if meta.kvs_loads or meta.kvs_saves:
                self.kvs.handle(meta.kvs_loads, meta.kvs_saves)
        producer, consumer = self._producer, self._consumer
        # One hand-over (one wake-up of the loop thread) per step, however many items.
        batch: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        post = batch.append
        if producer is not None and meta.scheduler_address != self._scheduler_address:
            # Where P's blocks go back (every metadata names it; the first one counts).
            self._scheduler_address = meta.scheduler_address
            post((producer.use_scheduler, (meta.scheduler_address,)))
        elif meta.is_empty():
            return
        if self._loop is None:
            raise TransferError("register_kv_caches was not called before the first step")
        if meta.final_prefills and producer is not None:
            # Called before the forward pass (bind_connector_metadata): save_kv_layer marks
            # each layer ready as the pass writes it (GPU: records its CUDA event), wait_for_save
            # marks the rest.
            events = self._new_step_events()
            self._step_events = events
            self._step_prefills = list(meta.final_prefills)
            for spec in meta.final_prefills:
                post((producer.final_prefill_starts, (spec, events)))
        for offer in meta.to_offer:
            if producer is not None:
                post((producer.offer, (offer,)))
        for tid in meta.cancel_offer:
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

    def _kvs_use_scheduler(self, address: str) -> None:
        """Loop thread: where KVS save reports go (one scheduler half, the first address)."""
        if self._kvs_send_done is None:
            self._kvs_send_done = SendDoneClient(
                address,
                self._tp_rank,
                on_delivered=lambda: self._results.count("kvs_save_reports"),
            )

    def _kvs_save_done(self, save_id: int) -> None:
        """KVS thread: tell the scheduler half (on the loop thread, as P's reports)."""
        loop = self._loop
        if loop is None:
            return
        from hybrid_connector.kvs import save_report_id

        def report() -> None:
            if self._kvs_send_done is not None:
                self._kvs_send_done.report(save_report_id(save_id), "", "kvs")
            else:  # no metadata named the scheduler half yet (cannot be: a save came in one)
                log.warning("KVS: save %d done, but no scheduler address to report it", save_id)

        with contextlib.suppress(Exception):  # the loop closed: shutting down
            loop.call_soon(report)

    def layer_saved(self, layer_name: str) -> None:
        """The forward pass wrote ``layer_name``'s KV (from save_kv_layer): release its sends
        and gather it for this step's KVS saves."""
        if self.kvs is not None:
            self.kvs.layer_written(layer_name)
        events = self._step_events
        if events is not None:
            index = self._layer_index.get(layer_name)
            if index is None:
                return
            if hasattr(events, "record"):  # GPU: ready once the stream ran what is queued now
                events.record(index, self._current_stream())
            else:
                events.mark_ready(index)

    def step_done(self) -> None:
        """End of the step's forward pass (wait_for_save): every layer is written, and the
        requests whose prompt it completed are finished (offered now: ``final_prefill_ended``)."""
        if self.r3 is not None:
            self.r3.step_done()  # routing rows written before the saves and sends read blocks
        if self.kvs is not None:
            self.kvs.step_done()
        events, self._step_events = self._step_events, None
        prefills, self._step_prefills = self._step_prefills, []
        if events is None:
            return
        if hasattr(events, "record_rest"):
            events.record_rest(self._current_stream())
        else:
            for index in range(len(self._layer_index)):
                events.mark_ready(index)
        producer, loop = self._producer, self._loop
        if prefills and producer is not None and loop is not None:
            batch = [(producer.final_prefill_ended, (spec,)) for spec in prefills]

            # The blocks are final once the last layer is (GPU: its CUDA event completed, on
            # kvt's waiter thread; layers complete in stream order). CPU: at once.
            def finished() -> None:  # any thread
                with contextlib.suppress(Exception):  # the loop closed: shutting down
                    loop.call_soon(self._run_batch, batch)

            events.when_ready(len(self._layer_index) - 1, finished)

    def take_loaded_in_step(self) -> list[str]:
        """vLLM's thread, after a step: the requests whose KVS load ran in it (in-step)."""
        return [] if self.kvs is None else self.kvs.take_loaded_in_step()

    def take_failed_blocks(self) -> set[int]:
        """vLLM's thread, after a step: the blocks of its in-step KVS loads that failed."""
        return set() if self.kvs is None else self.kvs.take_failed_blocks()

    def drain(self, wait_s: float = 0.0) -> TransferResults:
        """D's (finished_recving, failed_recving) since the last drain."""
        return self._results.drain(wait_s)

    def wait_count(self, name: str, at_least: int, timeout_s: float = 30.0) -> bool:
        """Block until event counter ``name`` reaches ``at_least``; False on timeout."""
        return self._results.wait_count(name, at_least, timeout_s)

    def counters(self) -> dict[str, int]:
        """Event counts of this worker (offers, pulls_done, leases_expired, ..., r3_records)."""
        counters = self._results.counters()
        if self.r3 is not None:
            counters.update({f"r3_{name}": n for name, n in self.r3.counters.items()})
        return counters

    @property
    def metrics_registry(self) -> CollectorRegistry | None:
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
            if self.kvs is not None:  # its last saves report on the loop, so before it closes
                self.kvs.close()
                self.kvs = None
            with contextlib.suppress(Exception):
                if self._kvs_send_done is not None:
                    self._loop.run(self._kvs_send_done.close(), timeout=10)
            self._loop.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            assert self._metrics_thread is not None
            self._metrics_thread.join()
        if self._event_waiter is not None:  # recorded events complete, their layers are sent
            self._event_waiter.close()
        if self.kvs is not None:
            self.kvs.close()
        if self.r3 is not None:
            self.r3.close()
        if self._engine is not None:
            self._engine.close()
        self._kv_caches = {}
