"""Payload paths: how a TCP link moves the payload bytes of its DATA frames.

A TCP connection is the control channel of every link: HELLO, VERDICT, DONE, ABORT, and one
descriptor per frame of data. After the handshake each link uses one *payload path*:

* ``tcp``: the payload follows its DATA frame on the socket (``sendmsg``/``recvmsg_into``);
* ``samehost`` (:mod:`kvt.samehost`): a DESC frame carries the records and the sender's source
  addresses; the receiver pulls the bytes with ``process_vm_readv`` and acks the frame;
* ``rdma`` (:mod:`kvt.rdma`, where a device exists): the sender writes into the receiver's memory.

Handshake (both ends at once, on the reader thread)::

    send HELLO(name, address, boot id, pid, transport setting, offers = [(path, blob), ...])
    peer's HELLO -> for each path both offer: candidate.check(peer) -> send VERDICT
    peer's VERDICT -> choose_path(...) (same answer on both ends) -> candidate.open() -> ready

A plain (v1) HELLO from an old peer means tcp at once, without VERDICTs. Until the link is ready
its writer holds every queued frame back, so no DATA/DESC/PATH frame crosses before both ends
agree; control frames queued meanwhile follow the handshake.

What a path sees of its link is :class:`LinkIO`: ordered writes on the writer thread, small frames
from any thread (``post``), exact reads on the reader thread. Every socket byte goes through those
methods (one place for fault hooks). A path implements :class:`PayloadPath`; a
:class:`PathProvider` per backend makes a :class:`PathCandidate` per link (its HELLO blob, its
check of the peer, and the path it opens once chosen).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator
from typing import ClassVar, Protocol

from kvt.backend import BackendListener, Batch, IovCursor, MemoryInfo, SendJob
from kvt.errors import ProtocolViolation
from kvt.protocol import (
    DataDescriptor,
    DataHeader,
    FrameDecoder,
    Hello,
    PathMessage,
    encode_data_head,
)

IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
MAX_FRAME_PAYLOAD = 32 * 1024 * 1024  # a frame is the unit of abort on the sending side
RECV_CHUNK = 8 * 1024 * 1024  # the unit of abort on the receiving side

PREFERENCE = ("rdma", "samehost", "tcp")  # what "auto" picks first, among paths both can use
TRANSPORTS = ("auto", *PREFERENCE)
TRANSPORT_ENV = "KVT_TRANSPORT"


def transport_setting(transport: str | None) -> str:
    """The transport to use: the argument, else env ``KVT_TRANSPORT``, else "auto"; checked."""
    value = (transport or os.environ.get(TRANSPORT_ENV) or "auto").strip().lower()
    if value not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {value!r}")
    return value


def local_boot_id() -> str:
    """This host's boot id (same on both ends: same kernel, so cross-memory attach can work)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class LinkIO(Protocol):
    """What a payload path may use of its link (a :class:`kvt.tcp.TcpLink`)."""

    @property
    def peer(self) -> str:
        """The peer, for logs and abort reasons."""

    @property
    def listener(self) -> BackendListener:
        """The control layer (on_batch, ...)."""

    @property
    def local_boot_id(self) -> str:
        """This end's boot id as announced in its HELLO."""

    @property
    def socket_ends(self) -> tuple[tuple, tuple] | None:
        """(our sockname, our peername) of the link's TCP socket; None if it has none."""

    @property
    def decoder(self) -> FrameDecoder:
        """The reader's decoder (a tcp payload reports its bytes consumed to it)."""

    def write(self, buffers: list) -> None:
        """Writer thread only: every byte of ``buffers`` in order (``sendmsg``, at most IOV_MAX
        buffers a call, partial sends resumed). Raises OSError when the link fails."""

    def post(self, frame: bytes) -> None:
        """Any thread: queue a small frame (e.g. an ack) after what is queued; never blocks."""

    def recv_into(self, window: list[memoryview], want: int) -> int:
        """Reader thread only: fill ``window`` (``want`` bytes) from the socket; raises OSError
        on EOF mid-frame."""

    def discard(self, nbytes: int) -> None:
        """Reader thread only: read and drop ``nbytes`` payload bytes."""

    def close(self, reason: str) -> None:
        """Fail the link now (the listener hears on_link_lost; the path's close() follows)."""


class PayloadPath(abc.ABC):
    """One link's way of moving payload. Called on the link's threads only, as noted."""

    name: ClassVar[str]

    def __init__(self, link: LinkIO) -> None:
        self.link = link

    @abc.abstractmethod
    def send_job(self, job: SendJob) -> None:
        """Writer thread: move the job, frame by frame, each between ``begin_frame()`` and
        ``end_frame(n)`` (``end_frame`` may run later, on the reader thread, when the peer acks;
        never after :meth:`close` returned). Raises OSError if the link fails."""

    @abc.abstractmethod
    def receive(self, frame: DataHeader | DataDescriptor) -> None:
        """Reader thread: a DATA frame (tcp) or DESC frame arrived: ``on_batch``, then the bytes
        between ``begin_chunk``/``end_chunk``, then ``end_batch``. A frame of the wrong kind
        for this path raises :class:`ProtocolViolation` (the link closes)."""

    def on_message(self, message: PathMessage) -> None:
        """Reader thread: a PATH frame from the peer's path of the same name."""
        raise ProtocolViolation(f"{self.name} path got an unexpected PATH frame {message.kind}")

    def close(self, reason: str) -> None:  # noqa: B027 (optional hook)
        """Once, after both link threads stopped: end outstanding frames (``end_frame(0)``),
        release what the path holds (QPs, fds)."""


class PathCandidate(abc.ABC):
    """A path a link offers in its HELLO, before the choice."""

    blob: bytes = b""  # sent in HELLO with the path's name (rdma: its QP info)

    @abc.abstractmethod
    def check(self, peer: Hello) -> str | None:
        """Can this end use the path to ``peer`` (who offers it too)? None: yes; else why not."""

    @abc.abstractmethod
    def open(self, peer: Hello) -> PayloadPath:
        """The path was chosen for this link: connect it (rdma: QP to RTS)."""

    def discard(self) -> None:  # noqa: B027 (optional hook)
        """Not chosen, or the link died before the choice: release what offering took."""


class PathProvider(abc.ABC):
    """One per backend and path name: makes that path's candidates, hears region changes."""

    name: ClassVar[str]

    def unavailable(self) -> str | None:
        """Why this end cannot offer the path at all (no device, ...), else None."""
        return None

    @abc.abstractmethod
    def candidate(self, link: LinkIO) -> PathCandidate:
        """A candidate for a new link (called before its HELLO, only if available)."""

    def may_be_chosen(self) -> None:  # noqa: B027 (optional hook)
        """The backend's transport setting lets this path be chosen ("auto" or this path's name):
        set up what the peer will need of this process (samehost: ptrace consent); once."""

    def register_memory(self, info: MemoryInfo) -> None:  # noqa: B027 (optional hook)
        """A region was registered (see DataPlaneBackend.register_memory)."""

    def unregister_memory(self, region_id: int) -> None:  # noqa: B027 (optional hook)
        """A region is gone."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """The backend closes (after every link closed)."""


def choose_path(
    local_mode: str,
    peer_mode: str,
    local_verdict: dict[str, str | None],
    peer_verdict: dict[str, str | None],
) -> tuple[str | None, str]:
    """Pure: the path both ends pick (each computes it with the roles swapped, same answer).

    ``*_verdict``: path -> None if that end can use it, else its reason. Returns (path, "") or
    (None, why the link must fail): a forced path that either end cannot use, never a fallback.
    """
    forced = sorted({m for m in (local_mode, peer_mode) if m != "auto"})
    if len(forced) > 1:
        return None, f"the two ends force different transports ({' and '.join(forced)})"
    if forced:
        path = forced[0]
        reasons = [
            f"{side}: {why}"
            for side, verdict in (("this end", local_verdict), ("peer", peer_verdict))
            if (why := verdict.get(path, "not offered")) is not None
        ]
        if reasons:
            return None, f"transport {path!r} is forced but unusable ({'; '.join(reasons)})"
        return path, ""
    for path in PREFERENCE:
        if local_verdict.get(path, "") is None and peer_verdict.get(path, "") is None:
            return path, ""
    return None, "no payload path both ends can use"


def frame_cuts(lengths: list[int]) -> Iterator[tuple[int, int, int]]:
    """(start, end, payload bytes) of each frame of a job whose records have ``lengths``: at most
    MAX_FRAME_PAYLOAD bytes a frame, at least one record (an empty job is one empty frame)."""
    start, n = 0, len(lengths)
    while True:
        end, payload = start, 0
        while end < n and (end == start or payload + lengths[end] <= MAX_FRAME_PAYLOAD):
            payload += lengths[end]
            end += 1
        yield start, end, payload
        if end >= n:
            return
        start = end


# ------------------------------------------------------------------ tcp: payload on the socket
class TcpPath(PayloadPath):
    """Payload follows its DATA frame: ``sendmsg`` straight from the source views, and
    ``recvmsg_into`` straight into the destination views, in chunks of :data:`RECV_CHUNK`."""

    name = "tcp"

    def send_job(self, job: SendJob) -> None:
        blocks, views = job.blocks, job.views
        for start, end, payload in frame_cuts(blocks["length"].tolist()):
            if not job.begin_frame():
                return  # request finished (aborted): drop the frames not yet started
            sent = 0
            try:
                last = job.last and end == len(views)
                head = encode_data_head(job.request_id, blocks[start:end], last)
                self.link.write([memoryview(head), *views[start:end]])
                sent = payload
            finally:
                job.end_frame(sent)

    def receive(self, frame: DataHeader | DataDescriptor) -> None:
        if not isinstance(frame, DataHeader):
            raise ProtocolViolation("DESC frame on a tcp link")
        link = self.link
        decoder = link.decoder
        sink = link.listener.on_batch(link, Batch(frame.request_id, frame.blocks, frame.last))
        remaining = frame.payload_len
        if sink is not None and remaining:
            cursor = IovCursor(sink.views)
            while not cursor.done:
                window = cursor.window(IOV_MAX, RECV_CHUNK)
                want = sum(v.nbytes for v in window)
                if not sink.begin_chunk():
                    break
                got = 0
                try:
                    got = link.recv_into(window, want)
                finally:
                    sink.end_chunk(got)
                cursor.advance(got)
                remaining -= got
                decoder.payload_consumed(got)
        if remaining:  # rejected or aborted mid-frame: keep the stream in sync, discard bytes
            link.discard(remaining)
        if sink is not None:
            sink.end_batch()


class _TcpCandidate(PathCandidate):
    def __init__(self, link: LinkIO) -> None:
        self.link = link

    def check(self, peer: Hello) -> str | None:
        return None

    def open(self, peer: Hello) -> PayloadPath:
        return TcpPath(self.link)


class TcpPathProvider(PathProvider):
    name = "tcp"

    def candidate(self, link: LinkIO) -> PathCandidate:
        return _TcpCandidate(link)
