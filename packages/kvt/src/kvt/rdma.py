"""RDMA payload path: the sender RDMA-WRITEs straight into the receiver's registered memory.

The TCP link stays the control channel (HELLO, DONE, ABORT, one DESC per frame, small PATH
messages); only payload bytes go over the RC queue pair. Per frame of a send job::

    sender (writer thread)          control channel (TCP)             receiver (reader thread)
    begin/end_frame(0): alive?
    DESC(seq, request, records) ------------------------------------>  on_batch -> sink (checks
                                                                       every record), waits for
                                                                       a receive slot, begin_chunk
    (reader) GRANT(seq) <-------------------------------------------  GRANT(seq)   [or DENY(seq)]
    begin_frame, plan_writes (rdma_plan), poster thread posts the
    WRITEs (<= sq_depth outstanding), the last one WRITE_WITH_IMM(seq) ===RDMA===> memory
    (completion thread) send completion of the last WRITE:            (completion thread) the
    end_frame(nbytes)                                                 imm's receive completion:
                                                                      end_chunk, end_batch (DONE)

A sender whose request died between DESC and GRANT answers CANCEL(seq) instead of writing (the
receiver ends the chunk with 0 and never reports the batch complete). A frame of no bytes gets no
GRANT and no write: the receiver ends it once every frame granted before it has landed.

The receiver advertises its writable regions (id, address, length, rkey) in a REGIONS message
when the link comes up and whenever one is registered (DROP when one goes); the sender plans
against that table and a record outside it is refused before any work request exists.

Threads per rdma link: the queue pair's completion thread (blocked in ``poll()`` on the
completion channel's fd, then ``get_cq_event``; no busy polling) and a poster (waits for
send-queue credits). On close the queue pair goes to the error state first (the NIC stops
touching memory), then every frame still open ends with 0 bytes, so the "no byte touched after
the callback" promise holds. A failed work completion fails the link (its requests
ABORTED(TRANSPORT)), as a lost TCP connection does.

The device sits behind :class:`RdmaDevice` / :class:`QueuePair`: :class:`VerbsDevice` implements
them with pyverbs (RC QP INIT -> RTR -> RTS); the tests use a fake NIC (memmove into the peer's
registered memory). pyverbs is imported lazily, only when a verbs device is opened.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import ctypes
import importlib.util
import itertools
import logging
import os
import queue
import random
import select
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvt.backend import Batch, MemoryInfo, RecvSink, SendJob
from kvt.errors import ProtocolViolation
from kvt.paths import LinkIO, PathCandidate, PathProvider, PayloadPath, frame_cuts
from kvt.protocol import DataDescriptor, DataHeader, Hello, PathMessage, encode_desc, encode_path
from kvt.rdma_plan import (
    DeviceLimits,
    RemoteRegion,
    RemoteRegionError,
    WritePlan,
    plan_writes,
)

log = logging.getLogger(__name__)

# Debian's python3-pyverbs installs into the system's dist-packages, which a virtualenv does not
# see; it is built for the same CPython ABI, so the package is loaded from there by path.
DEBIAN_PYVERBS = "/usr/lib/python3/dist-packages/pyverbs"

# PATH message kinds of the rdma path (PATH frames reach only the peer's path of the same name)
REGIONS, DROP, GRANT, DENY, CANCEL = 1, 2, 3, 4, 5
_REGION = struct.Struct("<HQQI")  # region id, address, length, rkey
_QP_INFO = struct.Struct("<16sHIIB")  # gid, lid, qpn, psn, path mtu (ibv_mtu enum)
_MAX_EARLY = 1 << 16  # rdma messages held for an earlier one that was overtaken
_SEQ_MASK = 0xFFFF_FFFF  # a frame's sequence number travels as the 32-bit immediate data


# ================================================================ device interface
@dataclass(frozen=True, slots=True)
class QpInfo:
    """What the peer needs to connect its RC queue pair to ours (the HELLO blob)."""

    gid: bytes
    lid: int
    qpn: int
    psn: int
    mtu: int

    def pack(self) -> bytes:
        return _QP_INFO.pack(self.gid, self.lid, self.qpn, self.psn, self.mtu)

    @classmethod
    def unpack(cls, blob: bytes) -> QpInfo:
        if len(blob) != _QP_INFO.size:
            raise ProtocolViolation(f"rdma QP info of {len(blob)} bytes, expected {_QP_INFO.size}")
        return cls(*_QP_INFO.unpack(blob))


@dataclass(frozen=True, slots=True)
class MemoryKeys:
    """A registered memory region: ``lkey`` for local scatter entries, ``rkey`` for the peer."""

    lkey: int
    rkey: int
    handle: Any = None  # the device's own object (pyverbs MR)


@dataclass(frozen=True, slots=True)
class WorkCompletion:
    wr_id: int
    is_recv: bool
    ok: bool
    status: str  # "success" or the device's words for the failure
    imm: int | None = None


CompletionHandler = Callable[[WorkCompletion], None]


class QueuePair(abc.ABC):
    """One RC queue pair with its completion queue and the thread that waits on it."""

    info: QpInfo

    @abc.abstractmethod
    def connect(self, peer: QpInfo) -> None:
        """INIT -> RTR -> RTS towards the peer's queue pair."""

    @abc.abstractmethod
    def start(self, on_completion: CompletionHandler, on_thread_start: Callable[[], None]) -> None:
        """Start the completion thread: it calls ``on_thread_start`` once, then ``on_completion``
        for every work completion (signaled sends, receives), in completion-queue order."""

    @abc.abstractmethod
    def post_write(
        self,
        wr_id: int,
        sges: list[tuple[int, int, int]],
        remote_addr: int,
        rkey: int,
        *,
        imm: int | None,
        signaled: bool,
    ) -> None:
        """Post one RDMA WRITE (WRITE_WITH_IMM when ``imm`` is given); never blocks."""

    @abc.abstractmethod
    def post_recv(self, wr_id: int) -> None:
        """Post a receive (a WRITE_WITH_IMM consumes one; it writes no byte into it)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Error state now: no more writes in or out; posted work flushes (wakes the thread)."""

    @abc.abstractmethod
    def close(self) -> None:
        """After shutdown: join the completion thread, destroy the queue pair; idempotent."""


class RdmaDevice(abc.ABC):
    """An opened RDMA device with one protection domain."""

    name: str
    limits: DeviceLimits
    recv_depth: int  # receives posted per queue pair (= frames granted at once per link)

    @abc.abstractmethod
    def register(self, address: int, nbytes: int, writable: bool) -> MemoryKeys: ...

    @abc.abstractmethod
    def deregister(self, keys: MemoryKeys) -> None: ...

    @abc.abstractmethod
    def create_qp(self) -> QueuePair: ...

    @abc.abstractmethod
    def close(self) -> None: ...


# ================================================================ path messages (sans-I/O)
def encode_regions(regions: dict[int, RemoteRegion]) -> bytes:
    """REGIONS body: id, address, length, rkey of each writable region."""
    return b"".join(_REGION.pack(rid, r.address, r.length, r.rkey) for rid, r in regions.items())


def decode_regions(body: bytes) -> dict[int, RemoteRegion]:
    if len(body) % _REGION.size:
        raise ProtocolViolation(f"rdma REGIONS body of {len(body)} bytes")
    out = {}
    for rid, address, length, rkey in _REGION.iter_unpack(body):
        try:
            out[rid] = RemoteRegion(address, length, rkey)
        except ValueError as exc:
            raise ProtocolViolation(f"rdma REGIONS: {exc}") from None
    return out


def encode_drop(region_ids: list[int]) -> bytes:
    """DROP body: the ids of regions gone."""
    return struct.pack(f"<{len(region_ids)}H", *region_ids)


def decode_drop(body: bytes) -> list[int]:
    if len(body) % 2:
        raise ProtocolViolation(f"rdma DROP body of {len(body)} bytes")
    return list(struct.unpack(f"<{len(body) // 2}H", body))


# ================================================================ the path
@dataclass(eq=False)
class _OutFrame:
    """Sender: a frame whose DESC went out; ``begun`` once granted (memory read from then on)."""

    seq: int
    job: SendJob
    blocks: np.ndarray
    addresses: np.ndarray
    lkeys: np.ndarray
    begun: bool = False
    plan: WritePlan | None = None
    windows: list[tuple[int, int]] = field(default_factory=list)


class RdmaPath(PayloadPath):
    """One link's rdma payload path; see the module docstring for the flow."""

    name = "rdma"

    def __init__(self, link: LinkIO, provider: RdmaPathProvider, qp: QueuePair) -> None:
        super().__init__(link)
        self.provider, self.qp = provider, qp
        self.limits = provider.device.limits
        self._lock = threading.Lock()
        self._credit = threading.Condition(self._lock)
        self._credits = self.limits.sq_depth
        self._closed = False
        self._seq = itertools.count(1)
        self._remote: dict[int, RemoteRegion] = {}
        self._out: dict[int, _OutFrame] = {}
        self._posts: queue.SimpleQueue[_OutFrame | None] = queue.SimpleQueue()
        # receiver: accepted frames waiting for a receive slot, and those granted
        self._waiting: collections.deque[tuple[int, RecvSink, int]] = collections.deque()
        self._granted: dict[int, tuple[RecvSink, int]] = {}
        self._slots = provider.device.recv_depth
        self._grant_lock = threading.Lock()  # grants go out in arrival order (RC keeps it)
        # post() may overtake frames queued before it, so every rdma message is numbered (in the
        # PATH frame's nbytes field) and the peer handles them in that order
        self._sent_messages = 0
        self._next_message = 0
        self._early: dict[int, PathMessage] = {}
        self._poster = threading.Thread(
            target=self._poster_main, name=f"kvt-rdma-post-{link.peer}", daemon=True
        )

    def start(self) -> None:
        for slot in range(self.provider.device.recv_depth):
            self.qp.post_recv(slot)
        self.qp.start(self._on_completion, self.link.listener.io_thread_started)
        self._poster.start()
        self.advertise(self.provider.writable_regions())

    def _send(self, kind: int, seq: int = 0, body: bytes = b"") -> None:
        """Post one rdma message; numbered, so the peer handles them in the order posted."""
        with self._lock:
            number = self._sent_messages
            self._sent_messages += 1
        self.link.post(encode_path(kind, seq=seq, nbytes=number, body=body))

    # ------------------------------------------------------------ sender
    def send_job(self, job: SendJob) -> None:
        blocks = job.blocks
        addresses = job.addresses
        lkeys = self.provider.lkeys(blocks["src_region"])
        for start, end, nbytes in frame_cuts(blocks["length"].tolist()):
            # Only a liveness check: the source memory is read once the receiver grants.
            if not job.begin_frame():
                return
            job.end_frame(0)
            seq = next(self._seq) & _SEQ_MASK
            frame = _OutFrame(seq, job, blocks[start:end], addresses[start:end], lkeys[start:end])
            with self._lock:
                if self._closed:
                    raise OSError("rdma path closed")
                if nbytes:  # an empty frame is ended by the receiver alone: no grant, no write
                    self._out[seq] = frame
            last = job.last and end >= len(blocks)
            self.link.write([encode_desc(job.request_id, frame.blocks, last, seq, b"")])

    def _on_grant(self, seq: int) -> None:
        with self._lock:
            frame = self._out.get(seq)
        if frame is None or frame.begun:
            raise ProtocolViolation(f"rdma GRANT for frame {seq}, which is not waiting")
        if not frame.job.begin_frame():  # the request died since its DESC: write nothing
            with self._lock:
                self._out.pop(seq, None)
            self._send(CANCEL, seq)
            return
        frame.begun = True
        try:
            with self._lock:
                remote = dict(self._remote)
            frame.plan = plan_writes(
                frame.blocks, frame.addresses, frame.lkeys, remote=remote, limits=self.limits,
                imm=seq,
            )  # fmt: skip
        except RemoteRegionError as exc:
            with self._lock:
                self._out.pop(seq, None)
            frame.job.end_frame(0)
            raise ProtocolViolation(f"peer granted frame {seq} outside its regions: {exc}") from exc
        frame.windows = frame.plan.windows()
        self._posts.put(frame)

    def _poster_main(self) -> None:
        self.link.listener.io_thread_started()
        try:
            while (frame := self._posts.get()) is not None:
                self._post_frame(frame)
        except Exception as exc:  # a post the device refused: the link cannot go on
            log.warning("kvt rdma: posting to %s failed: %r", self.link.peer, exc)
            self.link.close(f"rdma post failed: {exc!r}")

    def _post_frame(self, frame: _OutFrame) -> None:
        plan = frame.plan
        assert plan is not None
        last = plan.n_wr - 1
        for index, (start, end) in enumerate(frame.windows):
            with self._credit:
                while self._credits < end - start and not self._closed:
                    self._credit.wait()
                if self._closed:
                    return
                self._credits -= end - start
            for i in range(start, end):
                self.qp.post_write(
                    (frame.seq << 32) | index, plan.sges(i), int(plan.wr_remote_addr[i]),
                    int(plan.wr_rkey[i]), imm=plan.imm if i == last else None,
                    signaled=bool(plan.signaled[i]),
                )  # fmt: skip

    # ------------------------------------------------------------ receiver
    def receive(self, frame: DataHeader | DataDescriptor) -> None:
        if not isinstance(frame, DataDescriptor):
            raise ProtocolViolation("DATA frame with payload on an rdma link")
        with self._lock:  # a reused number would orphan the frame that has it (never ended)
            reused = frame.seq in self._granted or any(w[0] == frame.seq for w in self._waiting)
        if reused:
            raise ProtocolViolation(f"rdma DESC for frame {frame.seq}, which is still open")
        sink = self.link.listener.on_batch(
            self.link, Batch(frame.request_id, frame.blocks, frame.last)
        )
        if sink is None:
            if frame.nbytes:  # the sender waits on nonempty frames only (an empty one: no reply)
                self._send(DENY, frame.seq)
            return
        with self._lock:
            self._waiting.append((frame.seq, sink, frame.nbytes))
        self._grant_waiting()

    def _grant_waiting(self) -> None:
        with self._grant_lock:
            while True:
                with self._lock:
                    if self._closed or not self._waiting:
                        return
                    seq, sink, nbytes = self._waiting[0]
                    if nbytes == 0:  # no write: done once the frames granted before it are
                        if self._granted:
                            return
                    elif self._slots == 0:
                        return
                    else:
                        self._slots -= 1
                    self._waiting.popleft()
                if nbytes == 0:
                    if sink.begin_chunk():
                        sink.end_chunk(0)
                    sink.end_batch()
                    continue
                if not sink.begin_chunk():  # aborted while it waited: nothing will be written
                    sink.end_batch()
                    with self._lock:
                        self._slots += 1
                    self._send(DENY, seq)
                    continue
                with self._lock:
                    self._granted[seq] = (sink, nbytes)
                self._send(GRANT, seq)

    def _on_cancel(self, seq: int) -> None:
        with self._lock:
            entry = self._granted.pop(seq, None)
            if entry is not None:
                self._slots += 1
        if entry is None:
            raise ProtocolViolation(f"rdma CANCEL for frame {seq}, which was not granted")
        entry[0].end_chunk(0)  # no end_batch: the batch is not complete
        self._grant_waiting()

    # ------------------------------------------------------------ both
    def on_message(self, message: PathMessage) -> None:
        if message.nbytes != self._next_message:  # overtook an earlier one: hold it
            if message.nbytes < self._next_message or len(self._early) >= _MAX_EARLY:
                raise ProtocolViolation(f"rdma message {message.nbytes} out of order")
            self._early[message.nbytes] = message
            return
        while message is not None:
            self._next_message += 1
            self._handle(message)
            message = self._early.pop(self._next_message, None)

    def _handle(self, message: PathMessage) -> None:
        kind = message.kind
        if kind == GRANT:
            self._on_grant(message.seq)
        elif kind == DENY:
            with self._lock:
                frame = self._out.pop(message.seq, None)
            if frame is None or frame.begun:
                raise ProtocolViolation(f"rdma DENY for frame {message.seq}, which is not waiting")
        elif kind == CANCEL:
            self._on_cancel(message.seq)
        elif kind == REGIONS:
            regions = decode_regions(message.body)
            with self._lock:
                self._remote.update(regions)
        elif kind == DROP:
            ids = decode_drop(message.body)
            with self._lock:
                for rid in ids:
                    self._remote.pop(rid, None)
        else:
            raise ProtocolViolation(f"rdma path got PATH kind {kind}")

    def _on_completion(self, wc: WorkCompletion) -> None:
        if not wc.ok:
            if not self._closed:  # flushed work after shutdown is expected
                reason = f"rdma {'receive' if wc.is_recv else 'write'} failed: {wc.status}"
                log.warning("kvt rdma link %s: %s", self.link.peer, reason)
                self.link.close(reason)
            return
        if wc.is_recv:
            self._on_imm(wc)
            return
        seq, index = wc.wr_id >> 32, wc.wr_id & 0xFFFF_FFFF
        with self._credit:
            frame = self._out.get(seq)
            if frame is None:
                return
            start, end = frame.windows[index]
            self._credits += end - start
            self._credit.notify_all()
            done = index == len(frame.windows) - 1
            if done:
                del self._out[seq]
        if done:
            frame.job.end_frame(frame.plan.nbytes)  # type: ignore[union-attr]

    def _on_imm(self, wc: WorkCompletion) -> None:
        seq = wc.imm
        with self._lock:
            entry = self._granted.pop(seq, None) if seq is not None else None
        if entry is None:
            self.link.close(f"rdma write with immediate {seq} for no granted frame")
            return
        # The receive goes back before the slot is free: a GRANT (from any thread) that came
        # first would let the peer's WRITE_WITH_IMM find no receive (RNR).
        self.qp.post_recv(wc.wr_id)
        with self._lock:
            self._slots += 1
        sink, nbytes = entry
        sink.end_chunk(nbytes)
        sink.end_batch()
        self._grant_waiting()

    def advertise(self, regions: dict[int, RemoteRegion]) -> None:
        self._send(REGIONS, body=encode_regions(regions))

    def withdraw(self, region_id: int) -> None:
        self._send(DROP, body=encode_drop([region_id]))

    def close(self, reason: str) -> None:
        with self._credit:
            if self._closed:
                return
            self._closed = True
            self._credit.notify_all()
        self.provider.forget(self)
        self._posts.put(None)
        try:
            self.qp.shutdown()  # the NIC stops reading and writing our memory first
        finally:
            if self._poster.ident is not None:
                self._poster.join()
            self.qp.close()  # joins the completion thread: no end_* from it after this
            with self._lock:
                frames = [f for f in self._out.values() if f.begun]
                sinks = [sink for sink, _ in self._granted.values()]
                self._out.clear()
                self._granted.clear()
                self._waiting.clear()
            for frame in frames:
                frame.job.end_frame(0)
            for sink in sinks:
                sink.end_chunk(0)


# ================================================================ handshake and memory
class _RdmaCandidate(PathCandidate):
    def __init__(self, provider: RdmaPathProvider, link: LinkIO) -> None:
        self.provider, self.link = provider, link
        self.qp: QueuePair | None = None
        self.error: str | None = None
        try:
            self.qp = provider.device.create_qp()
        except Exception as exc:  # the link still comes up, on another path (or fails if forced)
            self.error = f"rdma queue pair creation failed: {exc!r}"
            log.warning("kvt rdma: %s (link to %s)", self.error, link.peer)
        self.blob = self.qp.info.pack() if self.qp is not None else b""

    def check(self, peer: Hello) -> str | None:
        if self.error is not None:
            return self.error
        blob = peer.offer("rdma")
        try:
            QpInfo.unpack(blob or b"")
        except ProtocolViolation as exc:
            return str(exc)
        return None

    def open(self, peer: Hello) -> PayloadPath:
        qp = self.qp
        if qp is None:
            raise OSError(self.error)
        qp.connect(QpInfo.unpack(peer.offer("rdma") or b""))
        path = RdmaPath(self.link, self.provider, qp)
        self.qp = None  # the path owns it now
        self.provider.adopt(path)
        try:
            path.start()
        except BaseException as exc:  # nobody else will close it: the link never adopts it
            path.close(f"rdma path failed to start: {exc!r}")
            raise
        return path

    def discard(self) -> None:
        if self.qp is not None:
            self.qp.shutdown()
            self.qp.close()
            self.qp = None


class RdmaPathProvider(PathProvider):
    """The rdma path of one backend: the device, its memory regions, the live rdma links.

    ``device``: an opened :class:`RdmaDevice`, or a factory called once, lazily (default: the
    first verbs device, :class:`VerbsDevice`). No device (or pyverbs missing) makes the path
    unavailable with the reason; the link then offers only the other paths.
    """

    name = "rdma"

    def __init__(self, device: RdmaDevice | Callable[[], RdmaDevice] | None = None) -> None:
        self._factory = device if device is not None else VerbsDevice
        self._device: RdmaDevice | None = None
        self._why: str | None = None
        self._opened = False
        self._lock = threading.Lock()
        self._keys: dict[int, tuple[MemoryInfo, MemoryKeys]] = {}
        self._paths: set[RdmaPath] = set()

    @property
    def device(self) -> RdmaDevice:
        assert self._device is not None
        return self._device

    def _open(self) -> RdmaDevice | None:
        with self._lock:
            if not self._opened:
                self._opened = True
                try:
                    factory = self._factory
                    self._device = factory if isinstance(factory, RdmaDevice) else factory()
                except Exception as exc:  # no device, no pyverbs: this end cannot offer rdma
                    self._why = str(exc) or repr(exc)
                    log.debug("kvt rdma unavailable: %s", self._why)
            return self._device

    def unavailable(self) -> str | None:
        return None if self._open() is not None else f"no RDMA device: {self._why}"

    def candidate(self, link: LinkIO) -> PathCandidate:
        return _RdmaCandidate(self, link)

    def lkeys(self, region_ids: np.ndarray) -> np.ndarray:
        """The lkey of each record's source region; OSError (the link fails with the reason,
        the writer thread lives) for a region the NIC does not know, e.g. device memory."""
        out = np.zeros(len(region_ids), dtype=np.uint32)
        with self._lock:
            keys = {rid: self._keys.get(rid) for rid in np.unique(region_ids).tolist()}
        for rid, entry in keys.items():
            if entry is None:
                raise OSError(
                    f"rdma: region {rid} is not registered with the NIC (device memory is not "
                    "sent over rdma yet; use transport='tcp' or 'samehost')"
                )
            out[region_ids == rid] = entry[1].lkey
        return out

    def writable_regions(self) -> dict[int, RemoteRegion]:
        with self._lock:
            items = list(self._keys.items())
        return {
            rid: RemoteRegion(info.address, info.nbytes, keys.rkey)
            for rid, (info, keys) in items
            if info.writable
        }

    def adopt(self, path: RdmaPath) -> None:
        with self._lock:
            self._paths.add(path)

    def forget(self, path: RdmaPath) -> None:
        with self._lock:
            self._paths.discard(path)

    def register_memory(self, info: MemoryInfo) -> None:
        if info.device != "cpu" or info.region_id > 0xFFFF:
            # Host memory named by IpcBlock region ids only. Device regions go through the
            # engine's staging pool (the id beyond u16), which this path does not address yet:
            # registering either would refuse GPU memory without peermem, and the pool's id does
            # not fit a REGIONS entry (every later link would fail to open).
            return
        device = self._open()
        if device is None:
            return
        keys = device.register(info.address, info.nbytes, info.writable)  # raising refuses it
        with self._lock:
            self._keys[info.region_id] = (info, keys)
            paths = list(self._paths)
        if info.writable:
            region = {info.region_id: RemoteRegion(info.address, info.nbytes, keys.rkey)}
            for path in paths:
                path.advertise(region)

    def unregister_memory(self, region_id: int) -> None:
        with self._lock:
            entry = self._keys.pop(region_id, None)
            paths = list(self._paths)
        if entry is None:
            return
        if entry[0].writable:
            for path in paths:
                path.withdraw(region_id)
        self.device.deregister(entry[1])

    def close(self) -> None:
        with self._lock:
            entries = list(self._keys.values())
            self._keys.clear()
            device, self._device = self._device, None
        if device is not None:
            for _, keys in entries:
                device.deregister(keys)
            device.close()


# ================================================================ pyverbs
def load_pyverbs() -> Any:
    """Import pyverbs: from the environment, else from Debian's python3-pyverbs by path."""
    try:
        import pyverbs
    except ImportError as first:
        init = os.path.join(DEBIAN_PYVERBS, "__init__.py")
        if not os.path.exists(init):
            raise ImportError(f"pyverbs not importable: {first}") from None
        spec = importlib.util.spec_from_file_location(
            "pyverbs", init, submodule_search_locations=[DEBIAN_PYVERBS]
        )
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            del sys.modules["pyverbs"]
            raise ImportError(f"pyverbs not importable from {DEBIAN_PYVERBS}: {exc!r}") from None
    import pyverbs.addr
    import pyverbs.cq
    import pyverbs.device
    import pyverbs.enums
    import pyverbs.mr
    import pyverbs.pd
    import pyverbs.qp
    import pyverbs.wr

    return pyverbs


def verbs_device_names() -> list[str]:
    """Names of the RDMA devices (raises OSError with the reason when there are none)."""
    pv = load_pyverbs()
    try:
        devices = pv.device.get_device_list()
    except Exception as exc:
        raise OSError(f"ibv_get_device_list failed: {_device_list_errno() or exc}") from None
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise OSError("ibv_get_device_list returned no device")
    return names


def _device_list_errno() -> str | None:
    """Why ibv_get_device_list fails, in errno words (pyverbs' error carries no errno)."""
    try:
        lib = ctypes.CDLL("libibverbs.so.1", use_errno=True)
        lib.ibv_get_device_list.restype = ctypes.c_void_p
        count = ctypes.c_int(0)
        devices = lib.ibv_get_device_list(ctypes.byref(count))
        if devices:
            lib.ibv_free_device_list(ctypes.c_void_p(devices))
            return None
        return os.strerror(ctypes.get_errno())
    except OSError:
        return None


_CHANNEL_LOCK = threading.Lock()  # uverbs event fds made one at a time (see _VerbsQueuePair)
_EVENT_FD_LINK = "anon_inode:[infinibandevent]"


class VerbsDevice(RdmaDevice):
    """The first (or the named) verbs device, port 1 by default; env ``KVT_RDMA_DEVICE``,
    ``KVT_RDMA_PORT``, ``KVT_RDMA_GID_INDEX`` (RoCE needs a valid GID index) override."""

    def __init__(
        self, name: str | None = None, *, port: int | None = None, gid_index: int | None = None
    ) -> None:
        pv = self.pv = load_pyverbs()
        e = pv.enums
        self.name = name or os.environ.get("KVT_RDMA_DEVICE") or verbs_device_names()[0]
        self.port = port or int(os.environ.get("KVT_RDMA_PORT", "1"))
        if gid_index is None:
            gid_index = int(os.environ.get("KVT_RDMA_GID_INDEX", "0"))
        self.gid_index = gid_index
        with _CHANNEL_LOCK:  # opening a device adds an event fd too (its async events)
            self.ctx = pv.device.Context(name=self.name)
        with contextlib.ExitStack() as undo:  # a step that fails closes what came before it
            undo.callback(self.ctx.close)
            attr = self.ctx.query_device()
            port_attr = self.ctx.query_port(self.port)
            if port_attr.state != e.IBV_PORT_ACTIVE:
                raise OSError(f"{self.name} port {self.port} is not active")
            self.pd = pv.pd.PD(self.ctx)
            undo.callback(self.pd.close)
            self.lid = port_attr.lid
            self.mtu = port_attr.active_mtu
            self.gid = _gid_bytes(self.ctx.query_gid(self.port, self.gid_index))
            self.limits = DeviceLimits(
                max_sge=max(1, min(attr.max_sge, 16)),
                max_msg_size=max(1, min(port_attr.max_msg_sz, 1 << 30)),
                sq_depth=max(2, min(attr.max_qp_wr // 2, 512)),
            )
            self.recv_depth = max(2, min(attr.max_qp_wr // 2, 64))
            # receives point here (a WRITE_WITH_IMM writes nothing; pyverbs wants an entry)
            self.scratch = pv.mr.MR(self.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
            undo.pop_all()

    def register(self, address: int, nbytes: int, writable: bool) -> MemoryKeys:
        e = self.pv.enums
        # a source region may be read-only memory: asking for write access would fail the pin
        access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE) if writable else 0
        mr = self.pv.mr.MR(self.pd, nbytes, access, address=address)
        return MemoryKeys(mr.lkey, mr.rkey, mr)

    def deregister(self, keys: MemoryKeys) -> None:
        keys.handle.close()

    def create_qp(self) -> QueuePair:
        return _VerbsQueuePair(self)

    def close(self) -> None:
        self.scratch.close()
        self.pd.close()
        self.ctx.close()


def _gid_bytes(gid: Any) -> bytes:
    """16 raw bytes of a pyverbs GID (its text form is "xxxx:xxxx:...:xxxx")."""
    text = str(gid.gid)
    return bytes.fromhex(text.replace(":", "")).ljust(16, b"\0")[:16]


def verbs_write_wr(pv: Any, wr_id: int, sges, *, remote_addr, rkey, imm, signaled) -> Any:
    """An RDMA WRITE (WITH_IMM if ``imm`` is not None) work request; ``sges`` never empty."""
    e = pv.enums
    opcode = e.IBV_WR_RDMA_WRITE if imm is None else e.IBV_WR_RDMA_WRITE_WITH_IMM
    wr = pv.wr.SendWR(
        wr_id=wr_id, opcode=opcode, num_sge=len(sges), imm_data=imm or 0,
        sg=[pv.wr.SGE(addr, length, lkey) for addr, length, lkey in sges],
        send_flags=e.IBV_SEND_SIGNALED if signaled else 0,
    )  # fmt: skip
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


def verbs_qp_init_attr(pv: Any, cq: Any, limits: DeviceLimits, recv_depth: int) -> Any:
    """An RC QP's creation attributes. ``sq_sig_all=0``: only the requests the plan marks
    signaled complete (pyverbs defaults to 1, which would end frames at their first write)."""
    cap = pv.qp.QPCap(
        max_send_wr=limits.sq_depth, max_recv_wr=recv_depth, max_send_sge=limits.max_sge,
        max_recv_sge=1,
    )  # fmt: skip
    return pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def verbs_recv_wr(pv: Any, wr_id: int, scratch: tuple[int, int, int]) -> Any:
    """A receive for a WRITE_WITH_IMM: it writes no byte, but pyverbs wants one scatter entry."""
    return pv.wr.RecvWR(wr_id=wr_id, num_sge=1, sg=[pv.wr.SGE(*scratch)])


def verbs_rts_attr(pv: Any, peer: QpInfo, *, port: int, gid_index: int, mtu: int, psn: int) -> Any:
    """QP attributes for INIT -> RTR -> RTS towards ``peer`` (RoCE and IB: global route)."""
    gid = pv.addr.GID()
    gid.gid = ":".join(peer.gid.hex()[i : i + 4] for i in range(0, 32, 4))
    route = pv.addr.GlobalRoute(dgid=gid, sgid_index=gid_index)
    attr = pv.qp.QPAttr()
    attr.path_mtu = min(mtu, peer.mtu)
    attr.dest_qp_num = peer.qpn
    attr.rq_psn = peer.psn
    attr.sq_psn = psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    attr.ah_attr = pv.addr.AHAttr(port_num=port, is_global=1, gr=route, dlid=peer.lid)
    return attr


def _wc_status(status: int) -> str:
    """ibv_wc_status_str's words for a failed work completion."""
    import pyverbs.enums

    try:
        return f"{pyverbs.enums.ibv_wc_status(status).name} ({status})"
    except ValueError:
        return f"work completion status {status}"


def _event_fds() -> set[int]:
    """This process's uverbs event fds (completion channels and async event fds)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == _EVENT_FD_LINK:
                out.add(int(name))
    return out


class _VerbsQueuePair(QueuePair):
    """An RC QP, its CQ and completion channel, and the thread that waits on the channel.

    pyverbs' ``CompChannel.get_cq_event`` blocks inside ``ibv_get_cq_event`` while holding the
    GIL (it has no ``nogil``), which would stop every Python thread until a completion came, and
    it does not expose the channel's fd. So the fd is found (the one new uverbs event fd after the
    channel is created) and the thread waits in ``poll()`` on it and on a wake-up pipe, GIL
    released; ``get_cq_event`` is only called once an event is pending and then returns at once.
    """

    def __init__(self, device: VerbsDevice) -> None:
        pv, e = device.pv, device.pv.enums
        self.device = device
        depth = device.limits.sq_depth + device.recv_depth
        with _CHANNEL_LOCK:
            before = _event_fds()
            self.channel = pv.cq.CompChannel(device.ctx)
            new = _event_fds() - before
        with contextlib.ExitStack() as undo:  # a step that fails closes what came before it
            undo.callback(self.channel.close)
            if len(new) != 1:
                raise OSError(f"cannot find the completion channel's fd (new event fds: {new})")
            self._event_fd = new.pop()
            self.cq = pv.cq.CQ(device.ctx, depth, None, self.channel, 0)
            undo.callback(self.cq.close)
            init = verbs_qp_init_attr(pv, self.cq, device.limits, device.recv_depth)
            attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT)
            attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            attr.port_num = device.port
            self.qp = pv.qp.QP(device.pd, init, attr)  # RC: returned in INIT
            undo.callback(self.qp.close)
            psn = random.getrandbits(24)
            self.info = QpInfo(device.gid, device.lid, self.qp.qp_num, psn, int(device.mtu))
            self._wake_r, self._wake_w = os.pipe()
            undo.pop_all()
        self._thread: threading.Thread | None = None
        self._closed = False

    def connect(self, peer: QpInfo) -> None:
        device = self.device
        attr = verbs_rts_attr(device.pv, peer, port=device.port, gid_index=device.gid_index,
                              mtu=int(device.mtu), psn=self.info.psn)  # fmt: skip
        self.qp.to_rts(attr)  # INIT -> RTR -> RTS

    def start(self, on_completion: CompletionHandler, on_thread_start: Callable[[], None]) -> None:
        self._thread = threading.Thread(
            target=self._main, args=(on_completion, on_thread_start),
            name=f"kvt-rdma-cq-{self.info.qpn}", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _main(self, on_completion: CompletionHandler, on_thread_start: Callable[[], None]):
        on_thread_start()
        poller = select.poll()
        poller.register(self._event_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        self.cq.req_notify()
        self._drain(on_completion)  # what completed before the CQ was armed
        while True:
            ready = {fd for fd, _ in poller.poll()}  # blocks, GIL released
            if self._wake_r in ready:
                return
            self.channel.get_cq_event(self.cq)  # pending: returns at once
            self.cq.ack_events(1)
            self.cq.req_notify()
            self._drain(on_completion)

    def _drain(self, on_completion: CompletionHandler) -> None:
        e = self.device.pv.enums
        while True:
            n, wcs = self.cq.poll(32)
            if n == 0:
                return
            for wc in wcs:
                ok = wc.status == e.IBV_WC_SUCCESS
                is_recv = bool(wc.opcode & e.IBV_WC_RECV)
                imm = int(wc.imm_data) if is_recv and ok else None
                status = "success" if ok else _wc_status(wc.status)
                on_completion(WorkCompletion(wc.wr_id, is_recv, ok, status, imm))

    def post_write(self, wr_id, sges, remote_addr, rkey, *, imm, signaled) -> None:
        wr = verbs_write_wr(self.device.pv, wr_id, sges, remote_addr=remote_addr, rkey=rkey,
                            imm=imm, signaled=signaled)  # fmt: skip
        self.qp.post_send(wr)

    def post_recv(self, wr_id: int) -> None:
        scratch = self.device.scratch
        self.qp.post_recv(verbs_recv_wr(self.device.pv, wr_id, (scratch.buf, 64, scratch.lkey)))

    def shutdown(self) -> None:
        e = self.device.pv.enums
        with contextlib.suppress(Exception):  # already in error, or being destroyed
            self.qp.modify(self.device.pv.qp.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join()
        self.qp.close()
        self.cq.close()
        self.channel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


__all__ = [
    "CANCEL",
    "DENY",
    "DROP",
    "GRANT",
    "REGIONS",
    "MemoryKeys",
    "QpInfo",
    "QueuePair",
    "RdmaDevice",
    "RdmaPath",
    "RdmaPathProvider",
    "VerbsDevice",
    "WorkCompletion",
    "load_pyverbs",
    "verbs_device_names",
]
