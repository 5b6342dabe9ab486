"""Control layer: the Engine, its request tables, timeouts, notifications.

Each request, on each side, is a :class:`kvt.lifecycle.Lifecycle`: a pure state machine (its
diagram, its states and the rule that decides who aborted first are in :mod:`kvt.lifecycle`).
The engine is its I/O shell: it keeps the tables (open requests by id, tombstones of finished
ones), the lock and the threads; it feeds each lifecycle what happened under the engine lock
and carries out the actions that come back outside it (control frames to the peer, the
verdict, a fresh link to ask on, the completion, deadlines, closing a stalled link, logs).

Exactly one completion per request and side: a lifecycle decides its outcome once, and the
engine delivers it when the lifecycle says ``Complete``, which it says only once the backend has
stopped touching the request's memory, so callers may free or reuse the blocks as soon as their
callback runs. Callbacks run on a kvt thread, never under a lock: right on the I/O or timer
thread that completed the request, or on the notifier thread when the completion was decided on
a caller's thread (abort(), close(), a late send()).

The engine is given its data plane (a :class:`~kvt.backend.DataPlaneBackend`) and talks to it
only through the neutral interface of :mod:`kvt.backend`: it hands over send jobs, answers
arriving batches with the memory to write, and sends its peer the control messages of
:mod:`kvt.control`. ``kvt.TransferEngine`` is this engine with a TCP backend by default.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvt.access import HostSpans, LayerEvents, RegionTable
from kvt.backend import Batch, DataPlaneBackend, Link, MemoryInfo
from kvt.control import (
    MAX_REQUEST_ID,
    Abort,
    AbortTarget,
    ControlMessage,
    Done,
    in_io_thread,
    mark_io_thread,
)
from kvt.errors import EngineClosedError, InvalidBlocksError, RequestStateError
from kvt.lifecycle import (
    WAITING,
    Action,
    ArmDeadline,
    AskVerdict,
    CallerAbort,
    CloseLink,
    Complete,
    DeadlinePassed,
    EngineClosing,
    Event,
    FrameEnded,
    LastBatchSubmitted,
    LastBatchWritten,
    Lifecycle,
    LinkLost,
    Log,
    PeerAbort,
    PeerDone,
    Phase,
    Refused,
    RequestKey,
    SendFrame,
    SendVerdict,
    Side,
    VerdictAskFailed,
)
from kvt.metrics import CALLER_STAGES, NO_PATH, EngineMetrics, EngineStats
from kvt.outcome import AbortCode, AbortOrigin, Completion, TransferStatus
from kvt.staging import (
    DEFAULT_STAGING_BYTES,
    STAGING_REGION_ID,
    DeviceCopier,
    Lease,
    Stager,
    Ticket,
)
from kvt.timers import TimerHandle, TimerScheduler

log = logging.getLogger(__name__)

CompletionCallback = Callable[[Completion], None]
SEND, RECV = Side.SEND.value, Side.RECV.value  # the role strings of Completion and the API
_TOMBSTONES = 65536  # finished request ids remembered (late frames, abort-before-start)


@dataclass(eq=False)
class _Request:
    """An open request: its lifecycle, and what the engine keeps around it (callbacks, the
    deadline's timer, the sender's batches waiting for their layer and its staging space)."""

    lifecycle: Lifecycle
    created: float
    callbacks: list[CompletionCallback] = field(default_factory=list)
    timer: TimerHandle | None = None
    batches_waiting: int = 0  # sender: batches waiting for their layer event (or staging copy)
    parked_last: Any = None  # sender: the last batch, held until earlier batches are queued
    staging: _Staging | None = None  # device batches: pool space held or waited for

    @property
    def request_id(self) -> str:
        return self.lifecycle.key.request_id

    @property
    def link(self) -> Link | None:
        return self.lifecycle.link


@dataclass(eq=False)
class _Staging:
    """A request's staging-pool leases and tickets: all handed back when it completes."""

    leases: list[Lease] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)

    def release_all(self, _completion: Completion | None = None) -> None:
        # Runs first among the completion callbacks: the backend and the copier are done with the
        # request (delivery waits for both), so nothing reads or writes this memory any more.
        for ticket in self.tickets:
            ticket.cancel()
        for lease in self.leases:
            lease.release()


class _SendJob:
    """One send() batch as the backend sees it (see kvt.backend.SendJob)."""

    __slots__ = (
        "_host",
        "_views",
        "blocks",
        "compute_wait",
        "engine",
        "frame_start",
        "last",
        "link",
        "req",
        "request_id",
        "submitted",
        "unsent",
    )

    def __init__(self, engine: Engine, req: _Request, blocks: np.ndarray, host, last, link):  # noqa: PLR0917
        # host: the checked HostSpans of host memory, None for device memory (read by address)
        self.engine, self.req, self.blocks, self.last = engine, req, blocks, last
        self.link: Link = link
        self._host: HostSpans | None = host
        self._views: list[memoryview] | None = None
        self.request_id = req.request_id
        self.submitted = time.monotonic()
        self.frame_start = 0.0
        self.compute_wait: float | None = None  # seconds its layer event took, not observed yet
        self.unsent = int(blocks["length"].sum())  # payload bytes not yet handed over

    @property
    def views(self) -> list[memoryview]:
        # Sliced on first use: address-based paths (samehost, rdma) never pay for them.
        if self._views is None:
            self._views = self._host.views if self._host is not None else []
        return self._views

    @views.setter
    def views(self, views: list[memoryview]) -> None:
        self._views = views

    @property
    def addresses(self) -> np.ndarray:
        if self._host is not None:
            return self._host.addresses
        return self.engine.regions.addresses(self.blocks, "src")

    def begin_frame(self) -> bool:
        self.frame_start = time.monotonic()
        self._observe_compute_wait()
        return self.engine._begin_io(self.req, queued_since=self.submitted, last=self.last)

    def end_frame(self, nbytes: int) -> None:
        if nbytes:
            self.engine.metrics.observe(
                "wire", _path(self.req.link), time.monotonic() - self.frame_start
            )
        self.engine._end_io(self.req, nbytes, "sent", job=self)

    def fail(self, reason: str, connect_failed: bool) -> None:
        self._observe_compute_wait()
        code = AbortCode.CONNECT_FAILED if connect_failed else AbortCode.CONNECTION_LOST
        self.engine._link_lost(self.req, self.link, code, reason)

    def _observe_compute_wait(self) -> None:
        # Observed when the backend first takes the job, not when the event fired: only then has
        # a new link's handshake surely picked the path that labels it.
        if self.compute_wait is not None:
            self.engine.metrics.observe("compute_wait", _path(self.req.link), self.compute_wait)
            self.compute_wait = None


class _RecvSink:
    """Where one accepted batch goes, as the backend sees it (see kvt.backend.RecvSink)."""

    __slots__ = ("_host", "_views", "blocks", "chunk_start", "engine", "last", "link", "req")

    def __init__(self, engine: Engine, req: _Request, link: Link, batch: Batch, host):
        # host: the checked HostSpans of host memory, None for device memory (written by address)
        self.engine, self.req, self.link = engine, req, link
        self._host: HostSpans | None = host
        self._views: list[memoryview] | None = None
        self.blocks, self.last = batch.blocks, batch.last
        self.chunk_start = 0.0

    @property
    def views(self) -> list[memoryview]:
        # Sliced on first use: address-based paths (samehost, rdma) never pay for them.
        if self._views is None:
            self._views = self._host.views if self._host is not None else []
        return self._views

    @property
    def addresses(self) -> np.ndarray:
        if self._host is not None:
            return self._host.addresses
        return self.engine.regions.addresses(self.blocks, "dst")

    def begin_chunk(self) -> bool:
        self.chunk_start = time.monotonic()
        return self.engine._begin_io(self.req, queued_since=None)

    def end_chunk(self, nbytes: int) -> None:
        if nbytes:
            self.engine.metrics.observe(
                "recv_chunk", self.link.path, time.monotonic() - self.chunk_start
            )
        self.engine._end_io(self.req, nbytes, "received")

    def end_batch(self) -> None:
        if self.last:
            self.engine._last_batch_written(self.req, self.link)


class _StagedSendJob(_SendJob):
    """A send batch from device memory: the backend reads its staging copy (see kvt.staging)."""

    __slots__ = ("device", "device_addresses", "lease", "nbytes", "sent")

    def __init__(self, engine: Engine, req: _Request, blocks, last: bool, device: str, link):  # noqa: PLR0917
        super().__init__(engine, req, blocks, None, last, link)
        self.device = device
        self.device_addresses = engine.regions.addresses(blocks, "src")
        self.nbytes = int(blocks["length"].sum())
        self.lease: Lease | None = None
        self.sent = 0

    def staged(self, lease: Lease) -> None:
        self.lease = lease
        self.views = lease.views(self.blocks["length"])

    @property
    def addresses(self) -> np.ndarray:
        assert self.lease is not None
        return self.lease.addresses(self.blocks["length"])

    def begin_frame(self) -> bool:
        if super().begin_frame():
            return True
        self._release()  # request finished: the rest is dropped
        return False

    def end_frame(self, nbytes: int) -> None:
        self.sent += nbytes
        if self.sent >= self.nbytes:
            self._release()  # every byte handed over: the staging copy is not read again
        super().end_frame(nbytes)

    def fail(self, reason: str, connect_failed: bool) -> None:
        self._release()
        super().fail(reason, connect_failed)

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()


class _StagedRecvSink(_RecvSink):
    """A received batch for device memory: the backend writes staging, then an H2D copy."""

    __slots__ = ("device", "discarded", "lease")

    def __init__(self, engine, req, link, batch: Batch, lease: Lease, device: str):  # noqa: PLR0917
        super().__init__(engine, req, link, batch, None)
        self._views = lease.views(batch.blocks["length"])
        self.lease, self.device, self.discarded = lease, device, False

    @property
    def addresses(self) -> np.ndarray:
        return self.lease.addresses(self.blocks["length"])

    def begin_chunk(self) -> bool:
        if super().begin_chunk():
            return True
        self.discarded = True
        return False

    def end_batch(self) -> None:
        engine, req = self.engine, self.req
        # The copy counts as I/O on the request: its completion waits until the copy let go.
        if self.discarded or not engine._begin_io(req, queued_since=None):
            self.lease.release()
            return
        lengths = self.blocks["length"]
        dst = engine.regions.addresses(self.blocks, "dst")
        stager = engine._stager
        if stager is None or not stager.copy(
            self.device, dst, self.lease.addresses(lengths), lengths, self._copied
        ):
            self.lease.release()
            engine._end_io(req, 0, "received")

    def _copied(self) -> None:  # staging thread: the bytes are in device memory
        self.lease.release()
        self.engine._end_io(self.req, 0, "received")
        if self.last:  # DONE only now: a same-stream copy of every earlier batch finished too
            self.engine._last_batch_written(self.req, self.link)


class Engine:
    """One engine per process side: regions, its data-plane backend, requests, metrics.

    ``backend`` is the data plane this engine drives; the engine owns it (starts and closes it).
    See the package README for the API walk-through; all public methods are thread-safe and
    never block on the network.
    """

    def __init__(
        self,
        backend: DataPlaneBackend,
        *,
        name: str = "kvt",
        default_timeout_s: float = 60.0,
        device_copier: DeviceCopier | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        self.name = name
        self.default_timeout_s = default_timeout_s
        self.metrics = EngineMetrics(name)
        self.regions = RegionTable()
        self._lock = threading.Lock()
        self._send: dict[str, _Request] = {}
        self._recv: dict[str, _Request] = {}
        # Finished requests, by side and id: what late frames, late ABORTs and a late expect()
        # or send() of the same id are answered with.
        self._tombstones: collections.OrderedDict[RequestKey, Lifecycle] = collections.OrderedDict()
        # Send ids abort()ed before their first send(): that send() tells the receiver, and the
        # request completes with the receiver's verdict.
        self._aborted_early: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._closed = False
        self.backend = backend
        self._notify_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._notifier = threading.Thread(
            target=self._notify_main, name=f"kvt-{name}-notify", daemon=True
        )
        self._notifier.start()
        self._timers = TimerScheduler(name=f"kvt-{name}-timers")
        # Device regions over host-byte paths: staging (kvt.staging), set up at the first one.
        self._device_copier = device_copier
        self._staging_bytes = staging_bytes
        self._stager: Stager | None = None
        self._staging_lock = threading.Lock()
        self.backend.start(self)

    # ================================================================ public API
    @property
    def data_address(self) -> str:
        """The "host:port" that peers connect their data plane to."""
        return self.backend.address

    @property
    def metrics_registry(self):  # -> prometheus_client.CollectorRegistry
        """This engine's CollectorRegistry (expose it with prometheus_client's helpers)."""
        return self.metrics.registry

    def metrics_text(self) -> bytes:
        """The registry in Prometheus text format (for a /metrics handler)."""
        return self.metrics.text()

    def stats(self) -> EngineStats:
        """A typed snapshot of this engine's metrics: per (stage, path) count, sum, mean and
        p50/p99 (estimated from the histogram buckets), bytes by direction, requests by role and
        status, aborts by role and origin, active requests by role."""
        return self.metrics.snapshot()

    def observe_stage(self, stage: str, seconds: float, *, path: str = NO_PATH) -> None:
        """Record a caller-side stage (``"parse"``: layout to IpcBlocks) in kvt_stage_seconds."""
        if stage not in CALLER_STAGES:
            raise ValueError(f"stage {stage!r} is not a caller stage (one of {CALLER_STAGES})")
        self.metrics.observe(stage, path, seconds)

    @contextlib.contextmanager
    def timed_stage(self, stage: str, *, path: str = NO_PATH) -> Iterator[None]:
        """``with engine.timed_stage("parse"): blocks = plan(...)``: times the block when it
        completes (an exception records nothing: a failed step is not a step's duration)."""
        if stage not in CALLER_STAGES:
            raise ValueError(f"stage {stage!r} is not a caller stage (one of {CALLER_STAGES})")
        start = time.monotonic()
        yield
        self.metrics.observe(stage, path, time.monotonic() - start)

    def register_region(self, obj: Any, *, writable: bool | None = None) -> int:
        """Register memory kvt may read (send) or write (receive); returns the region id.

        ``obj``: a C-contiguous numpy array, a contiguous torch CPU tensor, a contiguous
        memoryview/bytearray (read-only buffers can only be sent from), or ``(address, nbytes)``.
        The caller keeps the memory valid until :meth:`unregister_region`.
        """
        self._check_open()
        region = self.regions.register(obj, writable=writable)
        if region.device != "cpu" and not self._backend_moves_device_memory:
            try:
                self._start_staging()
            except BaseException:
                self.regions.unregister(region.region_id)
                raise
        info = MemoryInfo(
            region.region_id, region.address, region.nbytes, region.writable, region.device
        )
        try:
            self.backend.register_memory(info)
        except BaseException:
            self.regions.unregister(region.region_id)
            raise
        return region.region_id

    def unregister_region(self, region_id: int) -> None:
        self.regions.unregister(region_id)
        self.backend.unregister_memory(region_id)

    def expect(
        self,
        request_id: str,
        timeout_s: float | None = None,
        on_complete: CompletionCallback | None = None,
        *,
        peer_data_address: str | None = None,
    ) -> None:
        """Receiver side: accept data for ``request_id`` (call before the peer starts sending).

        ``on_complete`` runs once: DONE when the last batch's bytes are written, else ABORTED.
        ``peer_data_address`` (optional) lets an abort reach the sender before any data arrived.
        """
        self._check_open()
        _check_request_id(request_id)
        key = RequestKey(Side.RECV, request_id)
        finished: Completion | None = None
        with self._lock:
            if request_id in self._recv:
                raise RequestStateError(f"expect({request_id!r}) called twice")
            tomb = self._tombstones.get(key)
            if tomb is not None and tomb.outcome is not None and tomb.outcome.ok:
                raise RequestStateError(f"request {request_id!r} already completed")
            if tomb is not None:  # aborted before it was expected (by the peer or abort())
                finished = tomb.outcome
            else:
                lifecycle = Lifecycle(key, peer_address=peer_data_address)
                req = _Request(lifecycle, time.monotonic())
                if on_complete is not None:
                    req.callbacks.append(on_complete)
                self._recv[request_id] = req
                self.metrics.active.labels(role=RECV).inc()
        if finished is not None:
            if on_complete is not None:
                self._notify([on_complete], finished, time.monotonic())
            return
        self._arm_timer(req, self.default_timeout_s if timeout_s is None else timeout_s)

    def send(
        self,
        request_id: str,
        peer_data_address: str,
        blocks: np.ndarray,
        last: bool = False,
        on_complete: CompletionCallback | None = None,
        *,
        after: tuple[LayerEvents, int] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Sender side: queue ``blocks`` (IPCBLOCK_DTYPE; src_region local, dst_region the peer's).

        Non-blocking; call once per batch (e.g. per layer). ``last=True`` closes the request; the
        sender's completion is DONE only once the receiver confirmed every byte. ``after=(events,
        layer)`` holds the batch until that layer's compute is ready. Raises
        :class:`InvalidBlocksError` if a block falls outside the local registered regions.
        """
        self._check_open()
        _check_request_id(request_id)
        device, host = self.regions.locate(blocks, "src")
        staged = device != "cpu" and not self._backend_moves_device_memory
        if staged:
            self._check_stageable(blocks)
        # Device memory without staging (host None): the backend reads it by address.
        key = RequestKey(Side.SEND, request_id)
        new = False
        aborted: Completion | None = None
        early_abort: str | None = None  # abort() came before this first send()
        with self._lock:
            req = self._send.get(request_id)
            if req is None:
                tomb = self._tombstones.get(key)
                if tomb is not None and tomb.outcome is not None and tomb.outcome.ok:
                    raise RequestStateError(f"request {request_id!r} already completed")
                if tomb is not None:
                    aborted = tomb.outcome  # the receiver aborted it before its first batch
                    self._aborted_early.pop(request_id, None)
                else:
                    lifecycle = Lifecycle(key, peer=peer_data_address,
                                          peer_address=peer_data_address)  # fmt: skip
                    req = _Request(lifecycle, time.monotonic())
                    self._send[request_id] = req
                    self.metrics.active.labels(role=SEND).inc()
                    new = True
                    early_abort = self._aborted_early.pop(request_id, None)
            elif req.lifecycle.last_submitted:
                raise RequestStateError(f"send({request_id!r}) after the last batch")
            elif req.lifecycle.peer_address != peer_data_address:
                raise RequestStateError(
                    f"request {request_id!r} goes to {req.lifecycle.peer_address}, "
                    f"not {peer_data_address}"
                )
            queue_it = False
            if req is not None:
                lifecycle = req.lifecycle
                aborted = lifecycle.outcome
                if aborted is None:
                    if on_complete is not None:
                        req.callbacks.append(on_complete)
                    # Waiting for a verdict (or aborted before the start): nothing more is sent.
                    queue_it = early_abort is None and lifecycle.phase not in WAITING
                if queue_it:
                    if last:
                        lifecycle.handle(LastBatchSubmitted())
                    if after is not None or staged:
                        req.batches_waiting += 1  # staged: until its staging copy is done
                    if staged and req.staging is None:
                        req.staging = _Staging()
                        req.callbacks.insert(0, req.staging.release_all)
        if aborted is not None:  # already finished: nothing to send, tell this caller too
            if on_complete is not None:
                self._notify([on_complete], aborted, time.monotonic())
            return
        assert req is not None
        if new:
            self._arm_timer(req, self.default_timeout_s if timeout_s is None else timeout_s)
        if not queue_it and early_abort is None:
            return
        try:
            link = self.backend.link_to(peer_data_address)
        except (OSError, ValueError) as exc:
            reason = str(exc)
            self._feed(req, Refused(AbortOrigin.TRANSPORT, AbortCode.CONNECT_FAILED, reason, False))
            return
        with self._lock:
            lifecycle = req.lifecycle
            if lifecycle.decided or lifecycle.phase in WAITING:
                return  # finished or aborting meanwhile: this batch never goes out
            previous = lifecycle.link
            if previous is None:
                lifecycle.link = link
        if early_abort is not None:
            self._feed(req, CallerAbort(early_abort))  # tells the receiver, waits for its verdict
            return
        if previous is not None and previous is not link:
            # The link that carried this request's earlier batches died (link_to hands out a new
            # one only then): they may be lost, so the rest must not complete it on a fresh link.
            reason = f"link to {previous.peer} lost under the request"
            code = AbortCode.CONNECTION_LOST
            self._feed(req, Refused(AbortOrigin.TRANSPORT, code, reason, False))
            return
        job: _SendJob
        if staged:  # device memory: staged once computed (the copy ends in _layer_ready)
            job = _StagedSendJob(self, req, np.asarray(blocks), last, device, link)
            go, ready = self._stage_out, self._stage_out
        else:
            job = _SendJob(self, req, np.asarray(blocks), host, last, link)
            go, ready = self._queue_job, self._layer_ready
        if after is None:
            go(link, job)
        else:
            events, layer = after
            events.when_ready(layer, lambda: ready(link, job))

    def abort(self, request_id: str, reason: str = "aborted by caller") -> None:
        """Abort on this side (either role); the peer's side completes ABORTED(PEER). Idempotent.

        An id this engine has not seen yet is remembered as aborted, so a later send()/expect()
        completes ABORTED at once; that first send() still tells its receiver (ABORT), so the
        receiver does not hold its blocks until its own timeout.
        """
        with self._lock:
            reqs = [r for r in (self._send.get(request_id), self._recv.get(request_id)) if r]
            if not reqs:
                key = RequestKey(Side.RECV, request_id)
                if key not in self._tombstones:
                    completion = Completion(
                        request_id, RECV, TransferStatus.ABORTED, AbortOrigin.LOCAL,
                        AbortCode.CALLER_ABORT, reason,
                    )  # fmt: skip
                    self._remember(Lifecycle.finished(key, completion))
                if RequestKey(Side.SEND, request_id) not in self._tombstones:
                    self._aborted_early[request_id] = reason
                    self._aborted_early.move_to_end(request_id)
                    while len(self._aborted_early) > _TOMBSTONES:
                        self._aborted_early.popitem(last=False)
        for req in reqs:
            self._feed(req, CallerAbort(reason))

    def status(self, request_id: str, role: str = SEND) -> TransferStatus | None:
        """Current state of a request on this side, None if unknown (or long forgotten)."""
        side = Side(role)
        with self._lock:
            req = (self._send if side is Side.SEND else self._recv).get(request_id)
            if req is not None:
                return req.lifecycle.status
            tomb = self._tombstones.get(RequestKey(side, request_id))
            if tomb is not None and tomb.outcome is not None:
                return tomb.outcome.status
            if side is Side.SEND and request_id in self._aborted_early:
                return TransferStatus.ABORTED
            return None

    def close(self) -> None:
        """Abort open requests (peers are told), stop all threads, close all sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            open_requests = [*self._send.values(), *self._recv.values()]
        for req in open_requests:
            self._feed(req, EngineClosing())
        if self._stager is not None:  # wakes batches waiting for pool space, waits for copies
            self._stager.close()
        self.backend.close()
        self._timers.close()
        self._notify_queue.put(None)
        self._notifier.join()
        self.regions.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================ sender internals
    def _layer_ready(self, link: Link, job: _SendJob) -> None:
        req = job.req
        now = time.monotonic()
        job.compute_wait = now - job.submitted
        job.submitted = now  # its queue stage starts when its layer is computed
        with self._lock:
            req.batches_waiting -= 1
            parked = req.parked_last
            # A parked last batch from device memory is not staged yet: it still counts itself.
            unstaged = isinstance(parked, _StagedSendJob) and parked.lease is None
            release = parked if req.batches_waiting == int(unstaged) else None
            if release is not None:
                req.parked_last = None
        self._queue_job(link, job)
        if release is None:
            return
        if unstaged:
            self._stage_out(link, release)
        else:
            self.backend.submit(link, release)

    # ================================================================ staging (device memory)
    @property
    def _backend_moves_device_memory(self) -> bool:
        """True for a data plane that reads and writes device memory itself (RDMA to GPU memory);
        every other one gets host bytes through staging."""
        return bool(getattr(self.backend, "moves_device_memory", False))

    def _start_staging(self) -> Stager:
        with self._staging_lock:  # registrations only (startup), never a transfer path
            if self._stager is not None:
                return self._stager
            copier = self._device_copier
            if copier is None:
                from kvt.staging import CudaCopier

                copier = CudaCopier()
            stager = Stager(copier, self._staging_bytes, self.name)
            # Paths that need registered memory (RDMA MRs) read and write staging by address.
            pool = stager.pool
            info = MemoryInfo(STAGING_REGION_ID, pool.address, pool.capacity, True, "cpu")
            try:
                self.backend.register_memory(info)
            except BaseException:
                stager.close()
                raise
            self._stager = stager
            return stager

    def _check_stageable(self, blocks: np.ndarray) -> None:
        nbytes = int(blocks["length"].sum())
        if nbytes == 0:
            raise InvalidBlocksError("a device batch of 0 bytes: nothing to copy")
        if self._stager is not None and nbytes > self._stager.pool.capacity:
            raise InvalidBlocksError(
                f"a device batch of {nbytes} bytes exceeds the staging pool "
                f"({self._stager.pool.capacity} bytes): send it in smaller batches"
            )

    def _stage_out(self, link: Link, job: _StagedSendJob) -> None:
        """The batch's layer is computed: lease staging (waits in line if the pool is full), copy
        device to host, and hand it to the backend once the copy completed (staging thread)."""
        req, stager = job.req, self._stager
        assert stager is not None
        assert req.staging is not None

        def granted(lease: Lease | None) -> None:  # any kvt or caller thread; never blocks
            if lease is None:
                return  # the request finished while waiting (its completion cancelled this)
            with self._lock:
                req.staging.leases.append(lease)
            job.staged(lease)
            if not self._begin_io(req, queued_since=None):  # finished meanwhile
                lease.release()
                return
            lengths = job.blocks["length"]
            if not stager.copy(
                job.device, lease.addresses(lengths), job.device_addresses, lengths, copied
            ):
                lease.release()
                self._end_io(req, 0, "sent")

        def copied() -> None:  # staging thread: the batch's bytes are in host memory
            self._end_io(req, 0, "sent")
            self._layer_ready(link, job)

        with self._lock:
            if req.lifecycle.decided or req.lifecycle.phase in WAITING:
                return
            if job.last and req.batches_waiting > 1:
                # Earlier batches are still waiting: stage this one after them, so that it does
                # not sit on pool space they need (with a small pool they would starve).
                req.parked_last = job
                return
        ticket = stager.pool.request(job.nbytes, granted)
        with self._lock:
            req.staging.tickets.append(ticket)
        if req.lifecycle.decided:  # completed between: its release_all may have missed this one
            ticket.cancel()

    def _stage_in(self, link: Link, req: _Request, batch: Batch, device: str) -> _RecvSink | None:
        """Lease staging for an arriving device batch. Waits (this link's I/O thread only) while
        the pool is full, until space frees or the request completes (e.g. its deadline)."""
        stager = self._stager
        nbytes = int(batch.blocks["length"].sum())
        reason = ""
        if stager is None:
            reason = "no staging for device memory (engine closed)"
        elif nbytes > stager.pool.capacity:
            reason = f"batch of {nbytes} bytes exceeds the staging pool ({stager.pool.capacity})"
        if reason:
            log.warning("kvt %s: request %r from peer %s: %s", self.name, req.request_id,
                        link.peer, reason)  # fmt: skip
            self._feed(req, Refused(AbortOrigin.LOCAL, AbortCode.BAD_BLOCK, reason, True))
            return None
        assert stager is not None
        got: queue.SimpleQueue[Lease | None] = queue.SimpleQueue()
        with self._lock:
            if req.lifecycle.decided:
                return None
            if req.staging is None:
                req.staging = _Staging()
                req.callbacks.insert(0, req.staging.release_all)
            staging = req.staging
        ticket = stager.pool.request(nbytes, got.put)
        with self._lock:
            staging.tickets.append(ticket)
            finished = req.lifecycle.decided
        if finished:
            ticket.cancel()
        lease = got.get()  # woken by a release, by the request's completion, or by close()
        if lease is None:
            return None
        with self._lock:
            staging.leases.append(lease)
            finished = req.lifecycle.decided
        if finished:
            lease.release()
            return None
        return _StagedRecvSink(self, req, link, batch, lease, device)

    def _queue_job(self, link: Link, job: _SendJob) -> None:
        # The last batch must leave after every other batch of the request, or the receiver would
        # report DONE early; batches still waiting for a layer event hold it back.
        if job.last:
            with self._lock:
                if job.req.batches_waiting > 0:
                    job.req.parked_last = job
                    return
        self.backend.submit(link, job)

    # ================================================================ backend listener
    def io_thread_started(self) -> None:
        mark_io_thread()

    def on_batch(self, link: Link, batch: Batch) -> _RecvSink | None:
        rid = batch.request_id
        key = RequestKey(Side.RECV, rid)
        with self._lock:
            req = self._recv.get(rid)
            lifecycle = req.lifecycle if req is not None else self._tombstones.get(key)
            if lifecycle is None:  # never expected: remember it as aborted, tell the sender
                reason = f"no expect() for request {rid!r}"
                completion = Completion(
                    rid, RECV, TransferStatus.ABORTED, AbortOrigin.PEER,
                    AbortCode.UNKNOWN_REQUEST, reason, peer=link.peer,
                )  # fmt: skip
                lifecycle = Lifecycle.finished(key, completion)
                self._remember(lifecycle)
                log.warning(
                    "kvt %s: data for unknown request %r from peer %s; rejected",
                    self.name, rid, link.peer,
                )  # fmt: skip
            finished = lifecycle.decided
            # Late data of an aborted request: tell the sender why (once), discard the bytes.
            reply = lifecycle.late_data_reply() if finished else None
            stranger = not finished and lifecycle.link not in (None, link)
            bound_peer = lifecycle.peer if stranger else None
        if finished:
            if reply is not None:
                link.send_control(reply)
            return None
        assert req is not None
        if stranger:
            # The request is bound to the link its first batch came on: bytes of the same id from
            # another link (another sender, or a confused one) would mix into its blocks. Refuse
            # them there; the bound request goes on untouched.
            reason = f"request {rid!r} is bound to peer {bound_peer}, not {link.peer}"
            log.warning("kvt %s: data for request %r from peer %s refused: bound to peer %s",
                        self.name, rid, link.peer, bound_peer)  # fmt: skip
            link.send_control(Abort(rid, AbortCode.PROTOCOL_ERROR, AbortTarget.SENDER, reason))
            return None
        try:
            device, host = self.regions.locate(batch.blocks, "dst")
            if host is None and not self._backend_moves_device_memory:
                self._bind(req, link)
                return self._stage_in(link, req, batch, device)
        except InvalidBlocksError as exc:
            reason = f"bad block from peer: {exc}"
            log.warning("kvt %s: request %r from peer %s: %s", self.name, rid, link.peer, reason)
            self._bind(req, link, always=True)
            self._feed(req, Refused(AbortOrigin.PEER, AbortCode.BAD_BLOCK, reason, True))
            return None
        self._bind(req, link)
        return _RecvSink(self, req, link, batch, host)  # host None: device memory by address

    def _bind(self, req: _Request, link: Link, *, always: bool = False) -> None:
        """A receiving request is bound to the link its first batch came on."""
        with self._lock:
            lifecycle = req.lifecycle
            if lifecycle.link is None or always:
                lifecycle.link = link
                lifecycle.peer = lifecycle.peer or link.peer

    def _last_batch_written(self, req: _Request, link: Link) -> None:
        self._feed(req, LastBatchWritten())

    def on_control(self, link: Link, message: ControlMessage) -> None:
        if isinstance(message, Done):
            self._on_done(link, message)
        else:
            self._on_abort(link, message)

    def _on_done(self, link: Link, done: Done) -> None:
        with self._lock:
            req = self._send.get(done.request_id)
        if req is None:
            log.debug("kvt %s: DONE for finished request %r", self.name, done.request_id)
            return
        self._feed(req, PeerDone(done.nbytes))

    def _on_abort(self, link: Link, abort: Abort) -> None:
        side = Side.SEND if abort.target is AbortTarget.SENDER else Side.RECV
        table = self._send if side is Side.SEND else self._recv
        key = RequestKey(side, abort.request_id)
        event = PeerAbort(abort.code, abort.reason, link.peer, abort.confirms)
        with self._lock:
            req = table.get(abort.request_id)
            lifecycle = req.lifecycle if req is not None else self._tombstones.get(key)
            stranger = (
                req is not None
                and side is Side.RECV
                and lifecycle.link not in (None, link)
                and lifecycle.peer != link.peer
            )
            if stranger:
                actions: list[Action] = []
            elif lifecycle is None:  # not seen yet: a later expect() or send() completes at once
                lifecycle = Lifecycle(key, peer=link.peer)
                actions = lifecycle.handle(event)
                self._remember(lifecycle)
            else:
                actions = lifecycle.handle(event)
                if req is not None:
                    self._retire_if_complete(req, actions)
        if stranger:
            # Only the bound sender may abort a receiving request: a fresh link of that same peer
            # is fine (it re-tells an abort, or asks for the verdict), another peer is not. No
            # such check on the sender side: it hears the receiver's verdict on fresh links.
            log.warning("kvt %s: ABORT of request %r from peer %s ignored: bound to peer %s",
                        self.name, abort.request_id, link.peer, lifecycle.peer)  # fmt: skip
            return
        self._carry_out(req, actions, reply_link=link)

    def on_link_lost(self, link: Link, reason: str, connect_failed: bool) -> None:
        code = AbortCode.CONNECT_FAILED if connect_failed else AbortCode.CONNECTION_LOST
        with self._lock:
            victims = [
                r
                for table in (self._send, self._recv)
                for r in table.values()
                if r.lifecycle.link is link
            ]
        if victims:
            log.warning(
                "kvt %s: link %s lost (%s): aborting %d request(s)",
                self.name, link.peer, reason, len(victims),
            )  # fmt: skip
        for req in victims:
            self._link_lost(req, link, code, reason)

    def _link_lost(self, req: _Request, link: Link, code: AbortCode, reason: str) -> None:
        """``link`` died under ``req`` (ignored once the request moved to another link)."""
        with self._lock:
            if req.lifecycle.link is not link:
                return
            actions = req.lifecycle.handle(LinkLost(code, reason))
            self._retire_if_complete(req, actions)
        self._carry_out(req, actions)

    # ================================================================ the lifecycle's shell
    def _begin_io(self, req: _Request, queued_since: float | None, last: bool = False) -> bool:
        with self._lock:
            lifecycle = req.lifecycle
            first = lifecycle.phase is Phase.PENDING
            if not lifecycle.begin_io(last):
                return False
            if first and queued_since is not None:
                waited = time.monotonic() - queued_since
                self.metrics.observe("queue", _path(lifecycle.link), waited)
        return True

    def _end_io(
        self, req: _Request, nbytes: int, direction: str, job: _SendJob | None = None
    ) -> None:
        if nbytes:
            self.metrics.bytes.labels(direction=direction).inc(nbytes)
        with self._lock:
            last_left = False
            if job is not None:
                job.unsent -= nbytes  # two link threads may end frames of one job (samehost)
                last_left = job.last and job.unsent <= 0
            actions = req.lifecycle.handle(FrameEnded(nbytes, last_left))
            self._retire_if_complete(req, actions)
        if actions:
            self._carry_out(req, actions)

    def _feed(self, req: _Request, event: Event, reply_link: Link | None = None) -> None:
        """Hand ``event`` to the request's lifecycle under the lock; carry out its actions."""
        with self._lock:
            actions = req.lifecycle.handle(event)
            self._retire_if_complete(req, actions)
        self._carry_out(req, actions, reply_link)

    def _carry_out(
        self, req: _Request | None, actions: list[Action], reply_link: Link | None = None
    ) -> None:
        """Outside the lock, in order: what a lifecycle decided. ``req`` None: a tombstone."""
        for action in actions:
            match action:
                case Log(level, message, args):
                    log.log(level, "kvt %s: " + message, self.name, *args)
                case SendFrame(message, link, address):
                    if link is not None:
                        link.send_control(message)
                    elif address is not None:
                        self._send_without_link(address, message)
                case SendVerdict(message):
                    if reply_link is not None:
                        reply_link.send_control(message)
                case AskVerdict():
                    assert req is not None
                    self._ask_verdict(req, action)
                case CloseLink(link, reason):
                    link.close(reason)
                case ArmDeadline(delay_s):
                    if req is not None:
                        self._arm_timer(req, delay_s)
                case Complete(completion):
                    if req is not None:
                        self._deliver(req, completion)

    def _retire_if_complete(self, req: _Request, actions: list[Action]) -> None:
        """Under the lock: a completed request leaves the open table and is remembered."""
        if not any(isinstance(action, Complete) for action in actions):
            return
        side, request_id = req.lifecycle.key
        table = self._send if side is Side.SEND else self._recv
        if table.get(request_id) is req:
            del table[request_id]
            self.metrics.active.labels(role=side.value).dec()
        self._remember(req.lifecycle)

    def _ask_verdict(self, req: _Request, ask: AskVerdict) -> None:
        """The link died once the last batch had begun (the receiver may well be DONE, its DONE
        or, on samehost, its ACK lost with it), or while the sender's abort waited for the
        receiver's verdict: ask on a fresh link. The fresh link's loss asks again."""
        reason = ""
        fresh: Link | None = None
        if self._closed:
            reason = "engine closed"
        else:
            try:
                fresh = self.backend.link_to(ask.address)
            except (OSError, ValueError) as exc:
                reason = str(exc)
            if fresh is ask.old_link:
                fresh, reason = None, f"no fresh link to {ask.address}"
        if fresh is None:
            self._feed(req, VerdictAskFailed(reason))
            return
        with self._lock:
            lifecycle = req.lifecycle
            asking = not lifecycle.decided and lifecycle.link is None
            if asking:
                lifecycle.link = fresh
        if not asking:
            return  # decided meanwhile (its deadline, close())
        log.info("kvt %s: link to %s lost while request %r waits for the receiver: asking for "
                 "its verdict", self.name, fresh.peer, req.request_id)  # fmt: skip
        fresh.send_control(ask.message)

    def _send_without_link(self, peer_address: str, message: ControlMessage) -> None:
        """A control message for a peer no link of the request is bound to yet (best effort)."""
        if self._closed:
            return
        try:
            self.backend.link_to(peer_address).send_control(message)
        except (OSError, ValueError) as exc:
            log.info("kvt %s: could not tell %s about %r: %s", self.name, peer_address,
                     message.request_id, str(exc))  # fmt: skip

    def _remember(self, lifecycle: Lifecycle) -> None:
        key = lifecycle.key
        self._tombstones[key] = lifecycle
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _deliver(self, req: _Request, completion: Completion) -> None:
        if req.timer is not None:
            req.timer.cancel()
        now = time.monotonic()
        role = completion.role
        self.metrics.requests.labels(role=role, status=completion.status.value).inc()
        if completion.origin is not None:
            self.metrics.aborts.labels(role=role, origin=completion.origin.value).inc()
        path = _path(req.link)
        self.metrics.observe("transfer", path, now - req.created)
        self._notify(req.callbacks, completion, now, path)

    def _notify(
        self,
        callbacks: list[CompletionCallback],
        completion: Completion,
        t: float,
        path: str = NO_PATH,
    ) -> None:
        # On kvt's own threads the callbacks run at once (one thread hop less on the completion
        # path, which matters on a crowded CPU); from a caller's thread they go to the notifier.
        if in_io_thread():
            self._run_callbacks(callbacks, completion, t, path)
        else:
            self._notify_queue.put((callbacks, completion, t, path))

    def _run_callbacks(
        self, callbacks: list[CompletionCallback], completion: Completion, t: float, path: str
    ) -> None:
        self.metrics.observe("notify", path, time.monotonic() - t)
        for callback in callbacks:
            try:
                callback(completion)
            except Exception:
                log.exception("kvt %s: completion callback raised", self.name)

    def _notify_main(self) -> None:
        while (item := self._notify_queue.get()) is not None:
            self._run_callbacks(*item)

    def _arm_timer(self, req: _Request, timeout_s: float) -> None:
        if timeout_s is None or timeout_s <= 0:
            return
        handle = self._timers.call_later(timeout_s, lambda: self._on_deadline(req, timeout_s))
        with self._lock:
            if req.lifecycle.phase is not Phase.COMPLETE:
                previous, req.timer = req.timer, handle
                if previous is not None:
                    previous.cancel()
                return
        handle.cancel()

    def _on_deadline(self, req: _Request, timeout_s: float) -> None:
        self._feed(req, DeadlinePassed(f"no completion within {timeout_s:g}s"))

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"engine {self.name} is closed")


def _path(link: Link | None) -> str:
    """Metric label of the payload path a request's link uses (none before it has one)."""
    return NO_PATH if link is None else link.path


def _check_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not 0 < len(request_id.encode()) <= MAX_REQUEST_ID:
        raise RequestStateError(f"request id must be a 1..{MAX_REQUEST_ID} byte string")


__all__ = ["Engine"]
