"""In-memory data plane: engines in one process, bytes copied straight from source to destination.

A second backend next to TCP, written against :mod:`kvt.backend` alone: the control layer's test
suite runs on both, and it is the template for the next data plane. Engines find each other by
address (``"memory:<name>-<n>"``) in a process-wide directory, filled when a backend starts and
emptied when it closes; an address nobody holds fails at once (``link_to`` raises OSError).

One connection per pair of engines (shared per peer address, as in TCP), used in both
directions. It owns one thread, which carries in order everything either side puts on it:

* a send job: ``begin_frame``, the peer's ``on_batch``, then per chunk of at most
  :data:`CHUNK` bytes ``begin_chunk``, a memoryview-to-memoryview copy, ``end_chunk``; then
  ``end_frame`` and ``end_batch``. One frame per job: a copy never stalls, so the sender's abort
  granularity is the job;
* a control message: handed to the peer's ``on_control`` as it is (the backend never reads it).

Either backend closing the connection tells both listeners ``on_link_lost`` and drops the jobs still
queued (``fail``). ``close()`` lets the thread carry what is already queued (the ABORTs of the
closing engine), bounded at 2 s, then closes and joins every connection the backend is on, so no
thread of it, nor any copy into or out of its memory, outlives ``close()``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any

from kvt.backend import BackendListener, Batch, DataPlaneBackend, RecvSink, SendJob, drain
from kvt.control import ControlMessage
from kvt.errors import ProtocolViolation
from kvt.faults import FaultKind, FaultPlan, LinkWake, first_half

log = logging.getLogger(__name__)

CHUNK = 8 * 1024 * 1024  # the receiver's abort granularity, as in TCP
_JOB, _CONTROL, _CLOSE = "job", "control", "close"

# Every started backend by address, and every backend's connection tables: one lock for all, so
# two engines linking to each other at once cannot deadlock on each other's locks.
_directory: dict[str, InMemoryBackend] = {}
_directory_lock = threading.Lock()
_ids = itertools.count(1)


class _Endpoint:
    """One engine's side of a connection: the :class:`~kvt.backend.Link` that engine sees."""

    __slots__ = ("backend", "conn", "other")

    def __init__(self, conn: _Connection, backend: InMemoryBackend) -> None:
        self.conn, self.backend = conn, backend
        self.other: _Endpoint = self

    @property
    def peer(self) -> str:
        return f"{self.other.backend.name}({self.other.backend.address})"

    def send_control(self, message: ControlMessage) -> None:
        self.conn.put(self, _CONTROL, message)

    def close(self, reason: str) -> None:
        self.conn.close(reason)

    @property
    def path(self) -> str:
        return "memory"


class _Connection:
    """Two endpoints, one FIFO queue, one thread (see the module docstring)."""

    def __init__(self, initiator: InMemoryBackend, acceptor: InMemoryBackend) -> None:
        self.ends = (_Endpoint(self, initiator), _Endpoint(self, acceptor))
        self.ends[0].other, self.ends[1].other = self.ends[1], self.ends[0]
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.closed = False
        self._failure = "link closed"
        self._wake = LinkWake()  # ends injected stalls (kvt.faults) when the connection closes
        self._thread = threading.Thread(
            target=self._main, name=f"kvt-{initiator.name}-M{next(_ids)}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, origin: _Endpoint, kind: str, item: Any) -> None:
        # Under the lock: an item is either queued before the thread's final drain or dropped here.
        with self._lock:
            if not self.closed:
                self._queue.put((origin, kind, item))
                return
        if kind == _JOB:
            self._drop(item)

    def end_of(self, backend: InMemoryBackend) -> _Endpoint:
        """The endpoint ``backend`` sees (the first one if the engine linked to itself)."""
        return self.ends[0] if self.ends[0].backend is backend else self.ends[1]

    def close_after_queued(self, backend: InMemoryBackend) -> None:
        """Graceful close by ``backend``, step 1: carry what is queued, then close."""
        self.put(self.end_of(backend), _CLOSE, None)

    def close(self, reason: str) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._failure = reason
        self._queue.put(None)
        self._wake.close()
        for end in self.ends:
            end.backend.forget(self)
        for end in self.ends:
            listener = end.backend.listener
            if listener is not None:
                listener.on_link_lost(end, reason, False)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join(timeout)

    def _drop(self, job: SendJob) -> None:
        job.fail(f"in-memory link is closed: {self._failure}", False)

    # ---------------------------------------------------------------- the thread
    def _main(self) -> None:
        for end in self.ends:
            listener = end.backend.listener
            if listener is not None:
                listener.io_thread_started()
                break
        reason = "link closed"
        try:
            while (item := self._queue.get()) is not None:
                origin, kind, what = item
                if self.closed:  # closed by another thread: carry nothing more
                    self._queue.put(item)  # for the drain below (a job there is failed)
                    break
                if kind == _JOB:
                    self._carry(origin.other, what)
                elif kind == _CONTROL:
                    origin.other.backend.listener.on_control(origin.other, what)
                else:
                    reason = f"{origin.backend.name} closed the link"
                    break
        except Exception as exc:  # a bug must not leave the link half-alive
            log.exception("kvt in-memory link %s crashed", self._thread.name)
            reason = f"link crashed: {exc!r}"
        finally:
            self.close(reason)
            self._drain()

    def _carry(self, target: _Endpoint, job: SendJob) -> None:
        if not job.begin_frame():
            return  # request finished (aborted): drop the job
        blocks = job.blocks.view()
        blocks.flags.writeable = False  # the receiver reads the records, never changes them
        sink = None
        copied = 0
        try:
            views = job.views
            if target.other.backend.faults is not None:
                views = self._inject(target, job)
                if views is None:
                    return  # the connection is closed (injected drop or corrupt header)
            sink = target.backend.listener.on_batch(target, Batch(job.request_id, blocks, job.last))
            if sink is not None:
                _copy(views, sink)
            if views is not job.views:  # injected mid-payload drop: half of it went over
                self.close(f"injected drop-mid at a batch of {job.request_id!r}")
                return
            copied = sum(v.nbytes for v in views)
        finally:
            job.end_frame(copied)
        if sink is not None:
            sink.end_batch()

    def _inject(self, target: _Endpoint, job: SendJob) -> list[memoryview] | None:
        """Carry out what the sender's fault plan says for this batch (one frame here): the views
        to copy (fewer for a mid-payload drop), or None once the connection is closed."""
        sender = target.other.backend
        nbytes = sum(v.nbytes for v in job.views)
        fault = sender.faults.on_data_frame(  # type: ignore[union-attr]
            sender.name, target.other.peer, job.request_id, nbytes, job.last, kind="batch"
        )
        if fault is None:
            return job.views
        what = f"injected {fault.kind.value} at a batch of {job.request_id!r}"
        if fault.kind is FaultKind.STALL:
            fault.stall(self._wake)
            return None if self.closed else job.views
        if fault.kind is FaultKind.CORRUPT:
            # No header to break in memory: the receiver meets it as TCP's does (a typed error, a
            # log line naming the peer, only this connection closed).
            error = ProtocolViolation(f"{what}: bad {fault.field} in the frame header")
            log.warning("kvt closing in-memory link from %s: protocol violation: %s",
                        target.peer, error)  # fmt: skip
            self.close(f"protocol violation: {error}")
            return None
        if fault.kind is FaultKind.DROP:
            self.close(what)
            return None
        return first_half(job.views, nbytes)

    def _drain(self) -> None:
        for item in drain(self._queue):
            if item is not None and item[1] == _JOB:
                self._drop(item[2])


def _copy(sources: list[memoryview], sink: RecvSink) -> None:
    """Source views into the sink's views (record order), chunk by chunk."""
    targets = sink.views
    start, n = 0, len(sources)
    while start < n:
        end, size = start, 0
        while end < n and (end == start or size + sources[end].nbytes <= CHUNK):
            size += sources[end].nbytes
            end += 1
        if not sink.begin_chunk():
            return  # the receiver's request finished: write nothing more
        written = 0
        try:
            for i in range(start, end):  # a source may be shorter (an injected mid-payload drop)
                targets[i][: sources[i].nbytes] = sources[i]
            written = size
        finally:
            sink.end_chunk(written)
        start = end


class InMemoryBackend(DataPlaneBackend):
    """A data plane for engines in one process; see the module docstring."""

    def __init__(self, name: str = "kvt", *, faults: FaultPlan | None = None) -> None:
        self.name = name
        self.faults = faults  # kvt.faults: misbehave on purpose (tests); None costs one check
        self._address = f"memory:{name}-{next(_ids)}"
        self.listener: BackendListener | None = None
        self._outbound: dict[str, _Connection] = {}  # guarded by _directory_lock, as below
        self._connections: list[_Connection] = []  # every connection this backend is on
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def start(self, listener: BackendListener) -> None:
        self.listener = listener
        with _directory_lock:
            _directory[self._address] = self

    def link_to(self, peer_address: str) -> _Endpoint:
        with _directory_lock:
            if self._closed:
                raise OSError("backend closed")
            conn = self._outbound.get(peer_address)
            if conn is None or conn.closed:
                peer = _directory.get(peer_address)
                if peer is None:
                    raise OSError(f"no in-memory engine at {peer_address!r}")
                conn = _Connection(self, peer)
                self._outbound[peer_address] = conn
                for backend in {self, peer}:
                    backend._connections = [c for c in backend._connections if c.alive]
                    backend._connections.append(conn)
                conn.start()
        return conn.end_of(self)

    def submit(self, link: _Endpoint, job: SendJob) -> None:  # type: ignore[override]
        link.conn.put(link, _JOB, job)

    def forget(self, conn: _Connection) -> None:
        """A dead connection is no longer handed out (close() still joins its thread)."""
        with _directory_lock:
            for address, known in list(self._outbound.items()):
                if known is conn:
                    del self._outbound[address]

    def close(self) -> None:
        with _directory_lock:
            if self._closed:
                return
            self._closed = True
            if _directory.get(self._address) is self:
                del _directory[self._address]
            connections = list(self._connections)
        for conn in connections:
            conn.close_after_queued(self)
        for conn in connections:
            conn.join(timeout=2.0)  # bounded: a callback that blocks cannot hold us forever
        for conn in connections:
            conn.close(f"engine {self.name} closed")
        for conn in connections:
            conn.join()
