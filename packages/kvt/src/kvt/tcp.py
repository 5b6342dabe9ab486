"""TCP data plane: blocking sockets in dedicated threads (the fast path on this box, see README).

Per link (one TCP connection to a peer engine, used in both directions):
* a reader thread owns every read and the handshake: it writes HELLO, reads the peer's, sends
  its VERDICT and, once the peer's VERDICT is in, picks the link's payload path
  (:mod:`kvt.paths`: tcp, samehost, rdma). Headers and metadata go through the sans-I/O
  :class:`~kvt.protocol.FrameDecoder`; a DATA or DESC frame goes to the payload path, which
  reports it as a neutral :class:`~kvt.backend.Batch` and moves its bytes;
* a writer thread owns every other write: it waits for the handshake, then hands each job to the
  payload path (tcp: DATA frames with ``sendmsg`` straight from the registered source memory) and
  writes the control layer's messages (DONE, ABORT) as small frames between them.

An outbound link's writer connects first (so ``link_to`` never blocks); its reader starts once
connected. A link that fails tells the listener once, drops its queued jobs and closes its socket;
its payload path is closed once both threads have stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
from typing import Any

from kvt.backend import BackendListener, DataPlaneBackend, IovCursor, MemoryInfo, SendJob, drain
from kvt.control import Abort, ControlMessage, Done
from kvt.errors import ProtocolViolation
from kvt.faults import (
    FaultKind,
    FaultPlan,
    InjectedFault,
    LinkWake,
    corrupt_header,
    first_half,
)
from kvt.paths import (
    IOV_MAX,
    MAX_FRAME_PAYLOAD,
    PREFERENCE,
    RECV_CHUNK,
    PathCandidate,
    PathProvider,
    PayloadPath,
    TcpPathProvider,
    choose_path,
    local_boot_id,
    transport_setting,
)
from kvt.protocol import (
    DATA_META,
    DESC_META,
    HEADER,
    HEADER_SIZE,
    DataDescriptor,
    DataHeader,
    FrameDecoder,
    FrameType,
    Hello,
    PathMessage,
    Verdict,
    encode_control,
    encode_hello,
    encode_verdict,
)
from kvt.rdma import RdmaPathProvider
from kvt.samehost import SamehostProvider

log = logging.getLogger(__name__)

__all__ = ["IOV_MAX", "MAX_FRAME_PAYLOAD", "RECV_CHUNK", "TcpBackend", "TcpLink"]

_SEND_WINDOW_BYTES = 1 << 62  # sendmsg: no byte cap per call, only IOV_MAX
_ACCEPT_BACKOFF_S = 0.05  # accept() failed (e.g. out of fds): wait this long before retrying
CLOSE_FLUSH_S = 2.0  # close(): how long the writers may flush queued ABORTs, all links together
_DRAIN = bytearray(1024 * 1024)
_FLUSH = object()  # writer: send what is queued before this, then half-close


def _parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}, expected host:port")
    return host.strip("[]"), int(port)


class TcpLink:
    """One connection; see the module docstring for its two threads.

    The socket I/O of the link and of its payload path goes through four methods, the place for
    fault hooks: :meth:`write` (writer thread), :meth:`_send_nowait` (small frames, any thread),
    :meth:`_recv_exact` and :meth:`recv_into` (reader thread).
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        backend: TcpBackend,
        *,
        sock: socket.socket | None = None,
        connect_to: str | None = None,
    ) -> None:
        self.backend = backend
        self.link_id = next(self._ids)
        self._sock = sock
        self._connect_to = connect_to
        self._peer_label = connect_to or self._sock_peer(sock)
        self.peer_name: str | None = None
        self.peer_hello: Hello | None = None
        self.decoder = FrameDecoder(max_meta=backend.max_meta)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Whoever writes to the socket holds _write_lock: the writer thread for every queued item,
        # the reader for the handshake, or post()'s fast path (see there). _leftover is a small
        # frame's unsent tail, which the writer sends before anything else.
        self._write_lock = threading.Lock()
        self._leftover = b""
        # The handshake: candidates offered in our HELLO, then the chosen path; _ready (set once
        # the path is chosen, or the link failed) releases the writer.
        self._candidates: dict[str, PathCandidate] = {}
        self._verdict: dict[str, str | None] = {}
        self._payload: PayloadPath | None = None
        self._chosen: PathCandidate | None = None
        self._ready = False
        self._ready_event = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._lost_reported = False
        self._failure: tuple[str, bool] = ("link closed", False)  # (reason, connect_failed)
        self._threads_alive = 0
        self._threads: list[threading.Thread] = []
        self._handshake_started = time.monotonic()
        self._wake = LinkWake()  # ends injected stalls (kvt.faults) when the link closes

    @staticmethod
    def _sock_peer(sock: socket.socket | None) -> str:
        try:
            host, port = sock.getpeername()[:2]  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return "?"
        return f"{host}:{port}"

    @property
    def peer(self) -> str:
        return f"{self.peer_name}({self._peer_label})" if self.peer_name else self._peer_label

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def faults(self) -> FaultPlan | None:
        """The backend's fault plan (kvt.faults), for paths that pull (see :meth:`pull_fault`)."""
        return self.backend.faults

    @property
    def path(self) -> str:
        """The payload path the handshake chose ("tcp" until then)."""
        return self._payload.name if self._payload is not None else "tcp"

    @property
    def local_boot_id(self) -> str:
        return self.backend.boot_id

    @property
    def socket_ends(self) -> tuple[tuple, tuple] | None:
        try:
            return self._sock.getsockname(), self._sock.getpeername()  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return None

    @property
    def listener(self) -> BackendListener:
        assert self.backend.listener is not None
        return self.backend.listener

    @property
    def handshake_done(self) -> bool:
        """The handshake chose a path: frames can go out (logs of a stalled request say it)."""
        return self._ready

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Test and tool helper: True once the handshake chose a path (False if the link died)."""
        self._ready_event.wait(timeout)
        return self._ready

    def start(self) -> None:
        name = f"kvt-{self.backend.name}-L{self.link_id}"
        self._spawn(self._writer_main, f"{name}-w")
        if self._connect_to is None:  # inbound: connected already; outbound: the writer starts it
            self._spawn(self._reader_main, f"{name}-r")

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        # Started under the lock: close() may join any thread it finds in _threads (a link made on
        # the timer thread, e.g. to re-send an ABORT, can race with close() on the caller's).
        with self._lock:
            self._threads_alive += 1
            self._threads.append(thread)
            thread.start()

    def _thread_exit(self) -> None:
        with self._lock:
            self._threads_alive -= 1
            last = self._threads_alive == 0
        if not last:
            return
        # Both threads stopped: nothing reads, writes or acks any more; the path lets go.
        try:
            if self._payload is not None:
                self._payload.close(self._failure[0])
            for candidate in self._candidates.values():
                if candidate is not self._chosen:
                    candidate.discard()
        finally:
            if self._sock is not None:
                self._sock.close()

    # ---------------------------------------------------------------- queueing
    def send_control(self, message: ControlMessage) -> None:
        """Queue a control frame, or write it at once if the socket is idle (see :meth:`post`)."""
        self.post(encode_control(message))

    def post(self, frame: bytes) -> None:
        """Queue a small frame, or write it at once if the socket is idle (saves a thread hop).

        The fast path never blocks: it only takes an uncontended lock and does one non-blocking
        send; whatever the kernel does not take goes to the writer. It may overtake DATA frames
        queued earlier, which is harmless: DONE travels on links that carry no DATA from us, and
        an ABORT that overtakes its request's data only makes the peer discard that data. Before
        the handshake chose a path, frames wait in the queue (they follow VERDICT).
        """
        if self._ready and not self._closed and self._write_lock.acquire(blocking=False):
            try:
                if not self._leftover and self._sock is not None:
                    try:
                        sent = self._send_nowait(frame)
                    except OSError:  # would block, or the link is failing: the writer handles it
                        sent = 0
                    if sent == len(frame):
                        return
                    self._leftover = frame[sent:]
                    frame = b""  # the writer sends the leftover first; this wakes it up
            finally:
                self._write_lock.release()
        self._queue.put(frame)

    def submit(self, job: SendJob) -> None:
        # Under the lock: a job is either queued before the writer's final drain or dropped here.
        with self._lock:
            if not self._closed:
                self._queue.put(job)
                return
        self._drop_job(job)

    def close(self, reason: str) -> None:
        """Stop the link now: the threads wake (socket shutdown) and exit."""
        self._fail(reason)

    def flush_and_stop_writing(self) -> None:
        """Graceful close, step 1: the writer sends what is queued (ABORTs), then half-closes."""
        self._queue.put(_FLUSH)

    def join_writer(self, timeout: float) -> None:
        threads = self._started_threads()
        if threads and threads[0] is not threading.current_thread():
            threads[0].join(timeout)

    def join(self, timeout: float | None = None) -> None:
        for thread in self._started_threads():
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _started_threads(self) -> list[threading.Thread]:
        # Under the lock _spawn appends and starts in: read without it, a thread another thread
        # is still starting (a link made on an I/O thread to tell a peer, racing with close())
        # shows up before it started, and joining it raises.
        with self._lock:
            return list(self._threads)

    def _report_lost(self, reason: str, *, connect_failed: bool) -> None:
        with self._lock:
            if self._lost_reported:
                return
            self._lost_reported = True
        self.backend.forget(self)
        listener = self.backend.listener
        if listener is not None:
            listener.on_link_lost(self, reason, connect_failed)

    def _fail(self, reason: str, *, connect_failed: bool = False) -> None:
        with self._lock:
            already = self._closed
            self._closed = True
            if not already:
                self._failure = (reason, connect_failed)
        if not already:
            self._queue.put(None)
            self._ready_event.set()  # a writer waiting for the handshake wakes and exits
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._wake.close()  # after the shutdown: a write woken from a stall must fail
        self._report_lost(reason, connect_failed=connect_failed)

    # ---------------------------------------------------------------- socket I/O (fault hooks)
    def write(self, buffers: list) -> None:
        """Writer thread (or the reader during the handshake), under _write_lock: every byte of
        ``buffers`` in order, ``sendmsg`` over at most IOV_MAX buffers a call, partial sends
        resumed mid-buffer."""
        if self.backend.faults is not None:
            buffers = self._inject(buffers)
        self._write_all(buffers)

    def _write_all(self, buffers: list) -> None:
        sock = self._sock
        assert sock is not None
        cursor = IovCursor([memoryview(b) for b in buffers])
        while not cursor.done:
            window = cursor.window(IOV_MAX, _SEND_WINDOW_BYTES)
            cursor.advance(sock.sendmsg(window))

    def _inject(self, buffers: list) -> list:
        """kvt.faults at the socket: a DATA or DESC frame about to be written is dropped (before
        it, or once the header and half the payload are out), held, or sent with a broken
        header. Every path's frames pass here (tcp's DATA, samehost's DESC)."""
        head = bytes(buffers[0][: HEADER_SIZE + DESC_META.size])
        if len(head) < HEADER_SIZE:
            return buffers
        ftype = head[3]
        if ftype not in (FrameType.DATA, FrameType.DESC):
            return buffers
        meta = DATA_META if ftype == FrameType.DATA else DESC_META
        rid_len, flags = meta.unpack_from(head, HEADER_SIZE)[:2]
        start = HEADER_SIZE + meta.size
        request_id = bytes(buffers[0][start : start + rid_len]).decode(errors="replace")
        payload = HEADER.unpack_from(head)[4]
        fault, what = self._consult(request_id, payload, bool(flags & 1), FrameType(ftype).name)
        if fault is None or fault.kind is FaultKind.STALL:
            return buffers
        if fault.kind is FaultKind.CORRUPT:
            return [corrupt_header(bytes(buffers[0]), fault.field), *buffers[1:]]
        if fault.kind is FaultKind.DROP_MID:
            self._write_all([buffers[0], *first_half(buffers[1:], payload)])
        raise InjectedFault(what)

    def _consult(self, request_id: str, nbytes: int, last: bool, kind: str):
        """Ask the fault plan about one frame or pull; a STALL is served here. Returns the fault
        (None: go on as normal) and a description for the logs."""
        plan = self.backend.faults
        assert plan is not None
        fault = plan.on_data_frame(self.backend.name, self.peer, request_id, nbytes, last,
                                   kind=kind)  # fmt: skip
        if fault is None:
            return None, ""
        what = f"injected {fault.kind.value} at a {kind} of {request_id!r}"
        if fault.kind is FaultKind.STALL:
            fault.stall(self._wake)
            if self._closed:
                raise InjectedFault(f"{what}: the link closed while the I/O was held")
        return fault, what

    def pull_fault(self, request_id: str, nbytes: int, last: bool) -> bool:
        """kvt.faults for paths whose receiver pulls the payload (samehost), called before the
        pull: holds it (STALL), or fails the link (DROP, CORRUPT: as a malformed descriptor).
        True: drop the link once the bytes are read, before the sender hears (DROP_MID)."""
        if self.backend.faults is None:
            return False
        fault, what = self._consult(request_id, nbytes, last, "pull")
        if fault is None:
            return False
        if fault.kind is FaultKind.CORRUPT:
            raise ProtocolViolation(f"{what}: descriptor rejected")
        if fault.kind is FaultKind.DROP:
            raise InjectedFault(what)
        return fault.kind is FaultKind.DROP_MID

    def _send_nowait(self, frame: bytes) -> int:
        """post()'s fast path: one non-blocking send; returns the bytes the kernel took."""
        return self._sock.send(frame, socket.MSG_DONTWAIT)  # type: ignore[union-attr]

    def _recv_exact(self, view: memoryview) -> bool:
        """Reader: fill ``view`` (a header or metadata); False on a clean EOF before it."""
        sock = self._sock
        assert sock is not None
        got = 0
        while got < view.nbytes:
            n = sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
            if n == 0:
                if got:
                    raise OSError("connection closed in the middle of a frame")
                return False
            got += n
        return True

    def recv_into(self, window: list[memoryview], want: int) -> int:
        """Reader: ``want`` payload bytes straight into ``window`` (``recvmsg_into``)."""
        sock = self._sock
        assert sock is not None
        cursor = IovCursor(window)
        got = 0
        while got < want:
            n = sock.recvmsg_into(cursor.window(IOV_MAX, want - got), 0, socket.MSG_WAITALL)[0]
            if n == 0:
                raise OSError("connection closed in the middle of a frame")
            got += n
            cursor.advance(n)
        return got

    def discard(self, nbytes: int) -> None:
        """Reader: read and drop the rest of a payload (rejected or aborted mid-frame)."""
        sock = self._sock
        assert sock is not None
        while nbytes:
            n = sock.recv_into(_DRAIN, min(nbytes, len(_DRAIN)))
            if n == 0:
                raise OSError("connection closed in the middle of a frame")
            nbytes -= n
            self.decoder.payload_consumed(n)

    # ---------------------------------------------------------------- writer
    def _writer_main(self) -> None:
        self.listener.io_thread_started()
        try:
            if self._sock is None and not self._connect():
                return
            self._ready_event.wait()  # the reader runs the handshake
            if not self._ready:
                return  # the link failed first (its reason is reported already)
            payload = self._payload
            assert payload is not None
            while (item := self._queue.get()) is not None:
                with self._write_lock:
                    if self._leftover:
                        self.write([self._leftover])
                        self._leftover = b""
                    if isinstance(item, bytes):
                        if item:
                            self.write([item])
                    elif item is _FLUSH:
                        self._sock.shutdown(socket.SHUT_WR)  # type: ignore[union-attr]
                        break
                    else:
                        payload.send_job(item)
        except OSError as exc:
            if not self._closed:
                # str(exc): a log record that keeps the exception would keep its traceback, and
                # through it the job in this frame and the region memory its views point at.
                log.warning("kvt link to %s failed while sending: %s", self.peer, str(exc))
            self._fail(f"send failed: {exc}")
        except Exception as exc:  # a path's bug must not leave the link half-alive
            log.error("kvt writer for %s crashed: %s", self.peer, str(exc), exc_info=False)
            self._fail(f"writer crashed: {exc!r}")
        finally:
            try:
                self._drain_queue()
            finally:
                self._thread_exit()

    def _connect(self) -> bool:
        assert self._connect_to is not None
        try:
            host, port = _parse_address(self._connect_to)
            sock = socket.create_connection((host, port), timeout=self.backend.connect_timeout_s)
        except (OSError, ValueError) as exc:
            log.warning("kvt cannot connect to %s: %s", self._connect_to, exc)
            self._fail(f"connect to {self._connect_to} failed: {exc}", connect_failed=True)
            return False
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sock = sock
            closed = self._closed
        if closed:  # close() raced with the connect: it could not shut this socket down
            sock.shutdown(socket.SHUT_RDWR)
            return False
        self._spawn(self._reader_main, f"kvt-{self.backend.name}-L{self.link_id}-r")
        return True

    def _drain_queue(self) -> None:
        for item in drain(self._queue):
            if item is not None and item is not _FLUSH and not isinstance(item, bytes):
                self._drop_job(item)

    def _drop_job(self, job: SendJob) -> None:
        reason, connect_failed = self._failure
        job.fail(f"link to {self.peer} is closed: {reason}", connect_failed)

    # ---------------------------------------------------------------- reader
    def _reader_main(self) -> None:
        listener = self.listener
        listener.io_thread_started()
        decoder = self.decoder
        reason = "connection closed by peer"
        connect_failed = False
        try:
            # The handshake has a deadline: a peer that connects and never speaks must not hold
            # this link (its threads, or the requests queued on it) forever. _choose clears it.
            self._sock.settimeout(self.backend.handshake_timeout_s)  # type: ignore[union-attr]
            self._handshake_started = time.monotonic()
            self._send_hello()
            while True:
                need = decoder.next_read_size()
                buf = bytearray(need)
                if not self._recv_exact(memoryview(buf)):
                    break
                for event in decoder.feed(buf):
                    if isinstance(event, DataHeader | DataDescriptor):
                        if self._payload is None:
                            raise ProtocolViolation("data frame before the handshake finished")
                        self._payload.receive(event)
                    elif isinstance(event, Done | Abort):
                        listener.on_control(self, event)
                    elif isinstance(event, PathMessage):
                        if self._payload is None:
                            raise ProtocolViolation("PATH frame before the handshake finished")
                        self._payload.on_message(event)
                    elif isinstance(event, Hello):
                        self._on_hello(event)
                    elif isinstance(event, Verdict):
                        self._on_verdict(event)
        except ProtocolViolation as exc:
            reason = f"protocol violation: {exc}"
            log.warning("kvt closing link from %s: %s", self.peer, reason)
        except TimeoutError:
            timeout_s = self.backend.handshake_timeout_s
            reason = f"no handshake from {self.peer} within {timeout_s:g}s"
            connect_failed = True
            log.warning("kvt %s: closing link: %s", self.backend.name, reason)
        except OSError as exc:
            reason = f"receive failed: {exc}"
        except Exception as exc:  # a bug must not leave the link half-alive
            log.exception("kvt reader for %s crashed", self.peer)
            reason = f"reader crashed: {exc!r}"
        finally:
            try:
                if self._closed:
                    reason, connect_failed = "closed", False
                self._fail(reason, connect_failed=connect_failed)
            finally:
                self._thread_exit()

    # ---------------------------------------------------------------- handshake (reader thread)
    def _send_hello(self) -> None:
        backend = self.backend
        offers = []
        for provider in backend.providers:
            if provider.unavailable() is None:
                candidate = provider.candidate(self)
                self._candidates[provider.name] = candidate
                offers.append((provider.name, candidate.blob))
        hello = encode_hello(
            backend.name, backend.address, boot_id=backend.boot_id, pid=os.getpid(),
            transport=backend.transport, offers=offers,
        )  # fmt: skip
        with self._write_lock:
            self.write([hello])

    def _on_hello(self, hello: Hello) -> None:
        if self.peer_hello is not None:
            raise ProtocolViolation("second HELLO")
        self.peer_hello = hello
        self.peer_name = hello.name
        self._peer_label = hello.data_address or self._peer_label
        log.debug("kvt %s: link from %s", self.backend.name, self.peer)
        if not hello.extended:  # a plain HELLO (an older peer, or a tool): tcp, no VERDICTs
            plain = f"{hello.name} sent a plain HELLO (tcp only)"
            self._verdict = {name: None if name == "tcp" else plain for name in PREFERENCE}
            self._choose(dict(self._verdict), peer_mode="auto")
            return
        results = []
        for name in PREFERENCE:
            why = self._check(name, hello)
            self._verdict[name] = why
            if name in self._candidates or hello.offer(name) is not None:
                results.append((name, why is None, why or ""))
        with self._write_lock:
            self.write([encode_verdict(results)])

    def _check(self, name: str, peer: Hello) -> str | None:
        """None if this end can use path ``name`` to ``peer``, else why not."""
        candidate = self._candidates.get(name)
        if candidate is None:
            provider = next((p for p in self.backend.providers if p.name == name), None)
            why = provider.unavailable() if provider is not None else None
            return f"{name} not offered by {self.backend.name}" + (f": {why}" if why else "")
        if peer.offer(name) is None:
            return f"{name} not offered by {peer.name}"
        try:
            return candidate.check(peer)
        except Exception as exc:  # a failing probe is a reason, never a dead reader
            return f"{name} check failed: {exc!r}"

    def _on_verdict(self, verdict: Verdict) -> None:
        if self.peer_hello is None or not self.peer_hello.extended or self._ready:
            raise ProtocolViolation("VERDICT out of order")
        peer_verdict = verdict.as_dict()
        self._choose(peer_verdict, peer_mode=self.peer_hello.transport)

    def _choose(self, peer_verdict: dict[str, str | None], *, peer_mode: str) -> None:
        local = self._verdict or {"tcp": None}
        name, why = choose_path(self.backend.transport, peer_mode, local, peer_verdict)
        if name is not None:
            candidate = self._candidates.get(name)
            try:
                if candidate is None:
                    raise OSError(f"{name} not offered by this end")
                payload = candidate.open(self.peer_hello)  # type: ignore[arg-type]
            except Exception as exc:
                name, why = None, f"opening the {name} path failed: {exc!r}"
        if name is None:
            reason = f"no payload path to {self.peer}: {why}"
            log.warning("kvt %s: %s", self.backend.name, reason)
            self._fail(reason, connect_failed=True)
            return
        self._sock.settimeout(None)  # type: ignore[union-attr]  # handshake done: no deadline
        with self._lock:
            self._chosen = candidate
            self._payload = payload
            self._ready = not self._closed
        self._ready_event.set()
        took_s = time.monotonic() - self._handshake_started
        log.info("kvt %s: link %s uses the %s path (handshake %.3fs)", self.backend.name,
                 self.peer, name, took_s)  # fmt: skip


def default_providers() -> list[PathProvider]:
    """The payload paths a TcpBackend offers, best first (each checks its own availability;
    rdma opens its device, through pyverbs, only on first use)."""
    return [RdmaPathProvider(), SamehostProvider(), TcpPathProvider()]


class TcpBackend(DataPlaneBackend):
    """Listener + links. ``link_to`` shares one outbound link per peer address."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "kvt",
        connect_timeout_s: float = 5.0,
        handshake_timeout_s: float = 30.0,
        max_meta: int = 8 * 1024 * 1024,
        faults: FaultPlan | None = None,
        transport: str | None = None,
        providers: list[PathProvider] | None = None,
        boot_id: str | None = None,
    ) -> None:
        """``transport``: "auto" (default; env ``KVT_TRANSPORT``), "tcp", "samehost" or "rdma"
        (forced: a link that cannot use it fails). ``providers``: the payload paths offered
        (default :func:`default_providers`). ``boot_id``: override this host's boot id
        (tests: a peer "on another host"). ``connect_timeout_s`` bounds the TCP connect;
        ``handshake_timeout_s`` bounds each wait for the peer's handshake bytes, so a peer that
        connects and never speaks is dropped, while a peer slowed down by a loaded host (a
        vLLM worker starved of CPU for seconds) still gets through."""
        self.name = name
        self.faults = faults  # kvt.faults: misbehave on purpose (tests); None costs one check
        self.connect_timeout_s = connect_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.max_meta = max_meta
        self.transport = transport_setting(transport)
        self.providers = default_providers() if providers is None else list(providers)
        for provider in self.providers:
            if self.transport in ("auto", provider.name):
                provider.may_be_chosen()
        self.boot_id = local_boot_id() if boot_id is None else boot_id
        self.listener: BackendListener | None = None
        self._lock = threading.Lock()
        self._outbound: dict[str, TcpLink] = {}
        self._links: set[TcpLink] = set()
        self._retired: list[TcpLink] = []
        self._closed = False
        self._stopping = threading.Event()  # set by close(): the acceptor stops retrying
        self._server = socket.create_server((host, port), backlog=128)
        bound_host, bound_port = self._server.getsockname()[:2]
        self._address = f"{bound_host}:{bound_port}"
        self._acceptor: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self._address

    def start(self, listener: BackendListener) -> None:
        self.listener = listener
        self._acceptor = threading.Thread(
            target=self._accept_main, name=f"kvt-{self.name}-accept", daemon=True
        )
        self._acceptor.start()

    def _accept_main(self) -> None:
        failing = False
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return  # listener shut down by close()
                # Out of fds (EMFILE), a connection reset before accept, ...: passing trouble.
                # Back off (close() cuts the wait short) rather than end accepting for good.
                level = logging.DEBUG if failing else logging.WARNING
                log.log(level, "kvt %s: accept failed (%s); retrying in %gs", self.name,
                        str(exc), _ACCEPT_BACKOFF_S)  # fmt: skip
                failing = True
                self._stopping.wait(_ACCEPT_BACKOFF_S)
                continue
            failing = False
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = TcpLink(self, sock=sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._links.add(link)
            link.start()

    def link_to(self, peer_address: str) -> TcpLink:
        with self._lock:
            link = self._outbound.get(peer_address)
            if link is not None and not link.closed:
                return link
            if self._closed:
                raise OSError("backend closed")
            link = TcpLink(self, connect_to=peer_address)
            self._outbound[peer_address] = link
            self._links.add(link)
        link.start()
        return link

    def submit(self, link: TcpLink, job: SendJob) -> None:  # type: ignore[override]
        link.submit(job)

    def links(self) -> list[TcpLink]:
        """The live links, inbound and outbound (tools and tests: ``link.path``, ``link.peer``)."""
        with self._lock:
            return [link for link in self._links if not link.closed]

    def register_memory(self, info: MemoryInfo) -> None:
        for provider in self.providers:
            provider.register_memory(info)

    def unregister_memory(self, region_id: int) -> None:
        for provider in self.providers:
            provider.unregister_memory(region_id)

    def forget(self, link: TcpLink) -> None:
        """A dead link leaves the tables (its threads finish on their own; close() joins them)."""
        with self._lock:
            self._links.discard(link)
            if link._connect_to and self._outbound.get(link._connect_to) is link:
                del self._outbound[link._connect_to]
            self._retired = [
                old for old in self._retired if any(t.is_alive() for t in old._threads)
            ]
            self._retired.append(link)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links)
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join()
        self._server.close()
        for link in links:
            link.flush_and_stop_writing()
        # Bounded: peers that stopped reading cannot hold us, and one deadline for all links
        # keeps close() at 2 s however many peers are stuck (not 2 s per stuck peer).
        deadline = time.monotonic() + CLOSE_FLUSH_S
        for link in links:
            link.join_writer(timeout=max(0.0, deadline - time.monotonic()))
        for link in links:
            link.close("engine closed")
        with self._lock:
            everything = set(links) | set(self._retired) | self._links
        for link in everything:
            link.join()
        for provider in self.providers:
            provider.close()
