"""TCP data plane: blocking sockets in dedicated threads (the fast path on this box, see README).

Per link (one TCP connection to a peer engine, used in both directions):
* a writer thread owns every write: DATA frames go out with ``socket.sendmsg`` straight from the
  registered source memory (up to IOV_MAX buffers per call, partial sends resumed); the control
  layer's messages (DONE, ABORT) are encoded as small frames, queued by any thread and written
  between DATA frames;
* a reader thread owns every read: headers and metadata go through the sans-I/O
  :class:`~kvt.protocol.FrameDecoder`; a DATA frame is reported as a neutral
  :class:`~kvt.backend.Batch` and its payload read with ``recvmsg_into`` straight into the
  destination region's memory (memoryview slices, no intermediate buffer).

An outbound link's writer connects first (so ``link_to`` never blocks); its reader starts once
connected. A link that fails tells the listener once, drops its queued jobs and closes its socket.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
from typing import Any

from kvt.backend import BackendListener, Batch, DataPlaneBackend, IovCursor, SendJob, drain
from kvt.control import Abort, ControlMessage, Done
from kvt.errors import ProtocolViolation
from kvt.faults import FaultKind, FaultPlan, InjectedFault, LinkWake, corrupt_header
from kvt.protocol import (
    DataHeader,
    FrameDecoder,
    Hello,
    encode_control,
    encode_data_head,
    encode_hello,
)

log = logging.getLogger(__name__)

IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
MAX_FRAME_PAYLOAD = 32 * 1024 * 1024  # a DATA frame is the unit of abort on the sending side
RECV_CHUNK = 8 * 1024 * 1024  # the unit of abort on the receiving side
_SEND_WINDOW_BYTES = 1 << 62  # sendmsg: no byte cap per call, only IOV_MAX
_DRAIN = bytearray(1024 * 1024)
_FLUSH = object()  # writer: send what is queued before this, then half-close


def _parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}, expected host:port")
    return host.strip("[]"), int(port)


class TcpLink:
    """One connection; see the module docstring for its two threads."""

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
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Whoever writes to the socket holds _write_lock: the writer thread for every queued item,
        # or send_control's fast path (see there). _leftover is a control frame's unsent tail,
        # which the writer sends before anything else.
        self._write_lock = threading.Lock()
        self._leftover = b""
        self._hello_sent = False
        self._lock = threading.Lock()
        self._closed = False
        self._lost_reported = False
        self._failure: tuple[str, bool] = ("link closed", False)  # (reason, connect_failed)
        self._threads_alive = 0
        self._threads: list[threading.Thread] = []
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
    def path(self) -> str:
        return "tcp"

    def start(self) -> None:
        name = f"kvt-{self.backend.name}-L{self.link_id}"
        self._spawn(self._writer_main, f"{name}-w")
        if self._connect_to is None:  # inbound: connected already; outbound: the writer starts it
            self._spawn(self._reader_main, f"{name}-r")

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads_alive += 1
            self._threads.append(thread)
        thread.start()

    def _thread_exit(self) -> None:
        with self._lock:
            self._threads_alive -= 1
            last = self._threads_alive == 0
        if last and self._sock is not None:
            self._sock.close()

    # ---------------------------------------------------------------- queueing
    def send_control(self, message: ControlMessage) -> None:
        """Queue a control frame, or write it at once if the socket is idle (saves a thread hop).

        The fast path never blocks: it only takes an uncontended lock and does one non-blocking
        send; whatever the kernel does not take goes to the writer. It may overtake DATA frames
        queued earlier, which is harmless: DONE travels on links that carry no DATA from us, and
        an ABORT that overtakes its request's data only makes the peer discard that data.
        """
        frame = encode_control(message)
        if self._hello_sent and not self._closed and self._write_lock.acquire(blocking=False):
            try:
                if not self._leftover and self._sock is not None:
                    try:
                        sent = self._sock.send(frame, socket.MSG_DONTWAIT)
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
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._failure = (reason, False)
        self._queue.put(None)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        self._wake.close()  # after the shutdown: a write woken from a stall must fail
        self._report_lost(reason, connect_failed=False)

    def flush_and_stop_writing(self) -> None:
        """Graceful close, step 1: the writer sends what is queued (ABORTs), then half-closes."""
        self._queue.put(_FLUSH)

    def join_writer(self, timeout: float) -> None:
        if self._threads and self._threads[0] is not threading.current_thread():
            self._threads[0].join(timeout)

    def join(self, timeout: float | None = None) -> None:
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(timeout)

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
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._wake.close()
        self._report_lost(reason, connect_failed=connect_failed)

    # ---------------------------------------------------------------- writer
    def _writer_main(self) -> None:
        self.backend.listener.io_thread_started()  # type: ignore[union-attr]
        try:
            if self._sock is None and not self._connect():
                return
            hello = encode_hello(self.backend.name, self.backend.address)
            with self._write_lock:
                self._sock.sendall(hello)  # type: ignore[union-attr]
                self._hello_sent = True
            while (item := self._queue.get()) is not None:
                with self._write_lock:
                    if self._leftover:
                        self._sock.sendall(self._leftover)  # type: ignore[union-attr]
                        self._leftover = b""
                    if isinstance(item, bytes):
                        if item:
                            self._sock.sendall(item)  # type: ignore[union-attr]
                    elif item is _FLUSH:
                        self._sock.shutdown(socket.SHUT_WR)  # type: ignore[union-attr]
                        break
                    else:
                        self._send_job(item)
        except OSError as exc:
            if not self._closed:
                log.warning("kvt link to %s failed while sending: %s", self.peer, exc)
            self._fail(f"send failed: {exc}")
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

    def _send_job(self, job: SendJob) -> None:
        blocks, views = job.blocks, job.views
        lengths = blocks["length"].tolist()
        start, n = 0, len(views)
        while True:
            # Cut the batch into frames of at most MAX_FRAME_PAYLOAD bytes (at least one record).
            end, payload = start, 0
            while end < n and (end == start or payload + lengths[end] <= MAX_FRAME_PAYLOAD):
                payload += lengths[end]
                end += 1
            if not job.begin_frame():
                return  # request finished (aborted): drop the frames not yet started
            sent = 0
            try:
                last_frame = end >= n
                head = encode_data_head(job.request_id, blocks[start:end], job.last and last_frame)
                if self.backend.faults is not None:
                    head = self._inject(job, head, views[start:end], payload, last_frame)
                self._sendmsg_all([memoryview(head), *views[start:end]])
                sent = payload
            finally:
                job.end_frame(sent)
            if last_frame:
                return
            start = end

    def _inject(self, job: SendJob, head: bytes, views: list, payload: int, last: bool) -> bytes:
        """Carry out what the fault plan says for this DATA frame; returns the header to send."""
        plan = self.backend.faults
        assert plan is not None
        fault = plan.on_data_frame(self.backend.name, self.peer, job.request_id, payload, last)
        if fault is None:
            return head
        what = f"injected {fault.kind.value} at a DATA frame of {job.request_id!r}"
        if fault.kind is FaultKind.STALL:
            fault.stall(self._wake)
            if self._closed:
                raise InjectedFault(f"{what}: the link closed while the write was held")
        elif fault.kind is FaultKind.CORRUPT:
            return corrupt_header(head, fault.field)
        elif fault.kind is FaultKind.DROP_MID:
            cut, half = [], payload // 2
            for view in views:
                if half <= 0:
                    break
                cut.append(view[:half])
                half -= cut[-1].nbytes
            self._sendmsg_all([memoryview(head), *cut])
            raise InjectedFault(what)
        else:
            raise InjectedFault(what)
        return head

    def _sendmsg_all(self, buffers: list[memoryview]) -> None:
        sock = self._sock
        assert sock is not None
        cursor = IovCursor(buffers)
        while not cursor.done:
            window = cursor.window(IOV_MAX, _SEND_WINDOW_BYTES)
            cursor.advance(sock.sendmsg(window))

    def _drain_queue(self) -> None:
        for item in drain(self._queue):
            if item is not None and item is not _FLUSH and not isinstance(item, bytes):
                self._drop_job(item)

    def _drop_job(self, job: SendJob) -> None:
        reason, connect_failed = self._failure
        job.fail(f"link to {self.peer} is closed: {reason}", connect_failed)

    # ---------------------------------------------------------------- reader
    def _reader_main(self) -> None:
        listener = self.backend.listener
        assert listener is not None
        listener.io_thread_started()
        sock = self._sock
        assert sock is not None
        decoder = FrameDecoder(max_meta=self.backend.max_meta)
        reason = "connection closed by peer"
        try:
            while True:
                need = decoder.next_read_size()
                buf = bytearray(need)
                if not self._recv_exact(sock, memoryview(buf)):
                    break
                for event in decoder.feed(buf):
                    if isinstance(event, DataHeader):
                        self._receive_payload(sock, decoder, event)
                    elif isinstance(event, Done | Abort):
                        listener.on_control(self, event)
                    elif isinstance(event, Hello):
                        self.peer_name = event.name
                        self._peer_label = event.data_address or self._peer_label
                        log.debug("kvt %s: link from %s", self.backend.name, self.peer)
        except ProtocolViolation as exc:
            reason = f"protocol violation: {exc}"
            log.warning("kvt closing link from %s: %s", self.peer, reason)
        except OSError as exc:
            reason = f"receive failed: {exc}"
        except Exception as exc:  # a bug must not leave the link half-alive
            log.exception("kvt reader for %s crashed", self.peer)
            reason = f"reader crashed: {exc!r}"
        finally:
            try:
                self._fail(reason if not self._closed else "closed")
            finally:
                self._thread_exit()

    @staticmethod
    def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
        got = 0
        while got < view.nbytes:
            n = sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
            if n == 0:
                if got:
                    raise OSError("connection closed in the middle of a frame")
                return False
            got += n
        return True

    def _receive_payload(
        self, sock: socket.socket, decoder: FrameDecoder, header: DataHeader
    ) -> None:
        listener = self.backend.listener
        assert listener is not None
        sink = listener.on_batch(self, Batch(header.request_id, header.blocks, header.last))
        remaining = header.payload_len
        if sink is not None and remaining:
            cursor = IovCursor(sink.views)
            while not cursor.done:
                window = cursor.window(IOV_MAX, RECV_CHUNK)
                want = sum(v.nbytes for v in window)
                if not sink.begin_chunk():
                    break
                got = 0
                try:
                    got = self._recvmsg_exact(sock, window, want)
                finally:
                    sink.end_chunk(got)
                cursor.advance(got)
                remaining -= got
                decoder.payload_consumed(got)
        while remaining:  # rejected or aborted mid-frame: keep the stream in sync, discard bytes
            n = sock.recv_into(_DRAIN, min(remaining, len(_DRAIN)))
            if n == 0:
                raise OSError("connection closed in the middle of a frame")
            remaining -= n
            decoder.payload_consumed(n)
        if sink is not None:
            sink.end_batch()

    @staticmethod
    def _recvmsg_exact(sock: socket.socket, window: list[memoryview], want: int) -> int:
        cursor = IovCursor(window)
        got = 0
        while got < want:
            n = sock.recvmsg_into(cursor.window(IOV_MAX, want - got), 0, socket.MSG_WAITALL)[0]
            if n == 0:
                raise OSError("connection closed in the middle of a frame")
            got += n
            cursor.advance(n)
        return got


class TcpBackend(DataPlaneBackend):
    """Listener + links. ``link_to`` shares one outbound link per peer address."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "kvt",
        connect_timeout_s: float = 5.0,
        max_meta: int = 8 * 1024 * 1024,
        faults: FaultPlan | None = None,
    ) -> None:
        self.name = name
        self.faults = faults  # kvt.faults: misbehave on purpose (tests); None costs one check
        self.connect_timeout_s = connect_timeout_s
        self.max_meta = max_meta
        self.listener: BackendListener | None = None
        self._lock = threading.Lock()
        self._outbound: dict[str, TcpLink] = {}
        self._links: set[TcpLink] = set()
        self._retired: list[TcpLink] = []
        self._closed = False
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
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # listener shut down by close()
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
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join()
        self._server.close()
        for link in links:
            link.flush_and_stop_writing()
        for link in links:
            link.join_writer(timeout=2.0)  # bounded: a peer that stopped reading cannot hold us
        for link in links:
            link.close("engine closed")
        with self._lock:
            everything = set(links) | set(self._retired) | self._links
        for link in everything:
            link.join()
