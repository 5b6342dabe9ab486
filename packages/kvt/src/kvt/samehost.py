"""The "samehost" payload path: the receiver pulls each frame's bytes with ``process_vm_readv``.

Linux cross-memory attach copies straight from the sender's memory into the receiver's: one copy,
no socket, no staging buffer. The TCP link stays the control channel (:mod:`kvt.paths`):

    sender (writer thread)                     receiver (reader thread)
    begin_frame; DESC(seq, records, source  ->  on_batch -> sink; per chunk of RECV_CHUNK bytes:
    addresses); frame outstanding              begin_chunk, process_vm_readv (<= IOV_MAX iovecs
                                               a call, partial reads resumed), check the sender's
                                               epoch word, end_chunk; end_batch
    end_frame(n) when the ACK arrives     <-   PATH ACK(seq, n, status)

With two read threads (``KVT_SAMEHOST_READ_THREADS=2``) each chunk is halved: the reader thread
reads the front half while a helper thread of the path reads the back half; the chunk ends (and
its epoch check runs) only after both.

**What holds for the sender's memory.** The receiver only ever *reads* it. While the link is up
the sender's ``end_frame`` runs on the ACK, which the receiver sends after its last read of the
frame, so nothing reads a request's memory after its completion. If the link dies mid-read, the
sender ends its outstanding frames (``end_frame(0)``: the request completes ABORTED(TRANSPORT))
once both link threads stopped, but first it clears its per-link *epoch word*; the receiver reads
that word after every chunk and keeps the chunk only if it still shows the link's epoch. So a read
still in flight when the sender gives up (at most one chunk) may see memory the sender's caller
already reuses, but it is discarded: the receiver reads on in the stream (a closing sender's
ABORT, else EOF) and its request ends ABORTED, never DONE with those bytes. A sender killed
outright (``kill -9``) makes the read fail with ESRCH (or, after
a pid reuse, the epoch check fails): ABORTED(TRANSPORT) as well.

**Errors** are typed aborts naming request and peer, never a dead server: EFAULT (the sender's
addresses are not mapped in its process) aborts that request on both ends (BAD_BLOCK, the link
stays); ESRCH (peer gone) and EPERM (no longer allowed to read it) close the link.

**Permissions.** ``process_vm_readv`` needs ptrace access to the peer: same uid and, with Yama
``ptrace_scope`` 1, the peer's consent, which the provider gives when the process's first
TcpBackend whose transport allows samehost ("auto" or "samehost") is made:
``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` (skipped without Yama; it lets any same-uid process
ptrace this one; a "tcp" or "rdma" engine never grants it); or CAP_SYS_PTRACE
(root in most containers has it; Docker's default seccomp profile allows the call from 4.8
kernels on). In separate pid namespaces the peer's pid is not ours: the probe read fails and
"auto" stays on tcp. The probe (HELLO blob: a 16-byte cookie's address) is read by each end
before it votes for samehost, so the choice never rests on guesses. The HELLO's pid is the
peer's claim: before any read of it, the end proves that pid holds the peer's socket of this
very connection (its inode in /proc/net/tcp{,6} among /proc/<pid>/fd's links; see
:func:`owns_connection`), so a local client cannot make it read another process.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import os
import queue
import secrets
import struct
import sys
import threading

import numpy as np

from kvt.backend import Batch, SendJob
from kvt.control import Abort, AbortTarget
from kvt.errors import ProtocolViolation
from kvt.faults import InjectedFault
from kvt.outcome import AbortCode
from kvt.paths import (
    IOV_MAX,
    RECV_CHUNK,
    LinkIO,
    PathCandidate,
    PathProvider,
    PayloadPath,
    frame_cuts,
)
from kvt.protocol import DataDescriptor, DataHeader, Hello, PathMessage, encode_desc, encode_path

log = logging.getLogger(__name__)

ACK = 1  # PATH kind: receiver -> sender, frame ``seq`` read (``nbytes``) or refused/failed
ACK_OK, ACK_FAILED = 0, 1  # ACK status; a failed frame's body is the reason (utf-8)
_BLOB = struct.Struct("<Q16sQQ")  # probe address, cookie, epoch word address, epoch
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_EPOCH_WORDS = 256  # per block of the epoch-word pool
READ_THREADS_ENV = "KVT_SAMEHOST_READ_THREADS"
DEFAULT_READ_THREADS = 1


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None, "cross-memory attach is Linux only"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError) as exc:
        return None, f"libc has no process_vm_readv ({exc})"
    readv.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
        ctypes.c_ulong,
    ]  # fmt: skip
    readv.restype = ctypes.c_ssize_t  # ctypes releases the GIL for the whole copy
    return libc, None


_libc, _UNAVAILABLE = _load_libc()
_ptracer_lock = threading.Lock()
_ptracer_done = False


def allow_ptrace_reads() -> None:
    """Let same-uid peers read this process under Yama (``ptrace_scope`` 1); once per process.

    Without Yama the call is refused harmlessly; scope 2 or 3 needs CAP_SYS_PTRACE regardless.
    """
    global _ptracer_done
    with _ptracer_lock:
        if _ptracer_done or _libc is None or not os.path.exists("/proc/sys/kernel/yama"):
            _ptracer_done = True
            return
        _ptracer_done = True
        if _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
            log.info("kvt: prctl(PR_SET_PTRACER) failed: %s", os.strerror(ctypes.get_errno()))


class CmaError(OSError):
    """A ``process_vm_readv`` call failed (errno set)."""


def read_remote(pid: int, local_iov: np.ndarray, remote_iov: np.ndarray) -> int:
    """One ``process_vm_readv`` over (n, 2) uint64 iovec arrays (address, length); n <= IOV_MAX.

    Returns the bytes read (may be short); raises :class:`CmaError` when nothing could be read.
    """
    assert _libc is not None
    n = _libc.process_vm_readv(
        pid, local_iov.ctypes.data, len(local_iov), remote_iov.ctypes.data, len(remote_iov), 0
    )
    if n < 0:
        code = ctypes.get_errno()
        raise CmaError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
    return n


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _hint(exc: OSError) -> str:
    if exc.errno == errno.EPERM:
        return (
            " (ptrace access denied: needs the same uid and Yama ptrace_scope <= 1, or "
            "CAP_SYS_PTRACE; containers: --cap-add SYS_PTRACE or a shared pid namespace)"
        )
    if exc.errno == errno.ESRCH:
        return " (no such process here: exited, or in another pid namespace)"
    return ""


class ReadPlan:
    """One frame's reads: records cut into segments that never cross a chunk boundary of the
    frame's byte stream, as (n, 2) uint64 iovec arrays (address, length) for each side.

    Built vectorised (no Python loop per record); zero-length records are dropped. Chunk k is
    segments ``bounds[k]:bounds[k + 1]``; ``seg_end`` is where each segment ends in the stream.
    """

    __slots__ = ("bounds", "local_iov", "remote_iov", "seg_end")

    def __init__(
        self, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, chunk: int
    ) -> None:
        keep = lengths > 0
        local, remote, lengths = local[keep], remote[keep], lengths[keep].astype(np.uint64)
        if lengths.size == 0:
            self.local_iov = np.zeros((0, 2), np.uint64)
            self.remote_iov = np.zeros((0, 2), np.uint64)
            self.seg_end = np.zeros(0, np.uint64)
            self.bounds = np.zeros(1, np.int64)
            return
        ends = np.cumsum(lengths, dtype=np.uint64)
        starts = ends - lengths
        total = int(ends[-1])
        cuts = np.arange(chunk, total, chunk, dtype=np.uint64)
        inside = np.searchsorted(ends, cuts, side="right")  # the record each cut falls in
        split = starts[inside] != cuts  # cuts strictly inside a record (not at its start)
        self.local_iov = np.empty((starts.size + int(split.sum()), 2), np.uint64)
        self.remote_iov = np.empty_like(self.local_iov)
        if split.any():  # segments: records cut at the chunk boundaries (sorted inserts)
            at = inside[split] + 1
            seg_start = np.insert(starts, at, cuts[split])
            record = np.insert(np.arange(starts.size), at, inside[split])
            delta = seg_start - starts[record]
            self.local_iov[:, 0] = local[record] + delta
            self.remote_iov[:, 0] = remote[record] + delta
        else:  # the usual case (block-sized records): one segment per record
            seg_start = starts
            self.local_iov[:, 0] = local
            self.remote_iov[:, 0] = remote
        self.seg_end = np.append(seg_start[1:], np.uint64(total))
        self.local_iov[:, 1] = self.remote_iov[:, 1] = self.seg_end - seg_start
        n_chunks = (total + chunk - 1) // chunk
        self.bounds = np.searchsorted(seg_start // np.uint64(chunk), np.arange(n_chunks + 1))

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    def read_chunk(self, pid: int, k: int) -> int:
        """Read chunk ``k`` fully (see :meth:`read_segments`); returns the bytes read."""
        return self.read_segments(pid, int(self.bounds[k]), int(self.bounds[k + 1]))

    def split(self, k: int) -> tuple[int, int, int]:
        """Chunk ``k`` as segments ``a:m`` and ``m:b``, cut where its bytes are about halved
        (``m == b`` when the chunk has a single segment)."""
        a, b = int(self.bounds[k]), int(self.bounds[k + 1])
        if b - a < 2:
            return a, b, b
        start = int(self.seg_end[a - 1]) if a else 0
        half = np.uint64(start + (int(self.seg_end[b - 1]) - start) // 2)
        m = a + int(np.searchsorted(self.seg_end[a:b], half, side="left")) + 1
        return a, min(m, b - 1), b

    def read_segments(self, pid: int, a: int, b: int) -> int:
        """Read segments ``a:b`` fully (<= IOV_MAX iovecs a call, partial reads resumed).

        A call that stops short (the kernel stops at the first unreadable page) is resumed at the
        first byte not read; a partly read segment's rows are trimmed in place (so two threads
        may read disjoint ranges of one plan). Returns the bytes read; raises
        :class:`CmaError` when a call reads nothing.
        """
        local_iov, remote_iov, seg_end = self.local_iov, self.remote_iov, self.seg_end
        start = int(seg_end[a - 1]) if a else 0  # stream offset where segment a starts
        pos, i = start, a
        while i < b:
            j = min(b, i + IOV_MAX)
            n = read_remote(pid, local_iov[i:j], remote_iov[i:j])
            if n <= 0:
                raise CmaError(errno.EFAULT, f"process_vm_readv from pid {pid} made no progress")
            pos += n
            i = a + int(np.searchsorted(seg_end[a:b], pos, side="right"))
            if i < b:
                done = pos - (int(seg_end[i]) - int(local_iov[i, 1]))  # read of (trimmed) row i
                if done:
                    for iov in (local_iov, remote_iov):
                        iov[i, 0] += np.uint64(done)
                        iov[i, 1] -= np.uint64(done)
        return pos - start


class _ReadHelper:
    """A second reader thread for one samehost path: reads the back half of each chunk while the
    link's reader thread reads the front half (``process_vm_readv`` runs without the GIL).

    Owned by the path: started on its first frame, joined by :meth:`close` (the path's close(),
    after both link threads stopped, so no read is handed over any more). :meth:`wait` is called
    for every :meth:`start`, even when the reader's own half failed, so no byte of a chunk is
    written after its ``end_chunk``.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def start(self, plan: ReadPlan, pid: int, a: int, b: int) -> None:
        self._jobs.put((plan, pid, a, b))

    def wait(self) -> int:
        """Bytes the helper read of its half; re-raises what its read raised."""
        result = self._results.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def _main(self) -> None:
        while (job := self._jobs.get()) is not None:
            plan, pid, a, b = job
            try:
                self._results.put(plan.read_segments(pid, a, b))
            except BaseException as exc:  # handed to the reader thread, which raises it
                self._results.put(exc)

    def close(self) -> None:
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


class _EpochPool:
    """8-byte words in this process that a receiver reads to see whether a link still lives.

    Each link's sender side owns one word, set to a random 64-bit epoch while the link lives and
    to 0 before its outstanding frames end. Words are reused (a new epoch), never freed until
    the provider is; a stale reader then sees a different epoch, never its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: list[ctypes.Array] = []
        self._free: list[tuple[int, int]] = []

    def take(self) -> tuple[ctypes.Array, int, int, int]:
        with self._lock:
            if not self._free:
                self._blocks.append((ctypes.c_uint64 * _EPOCH_WORDS)())
                block_index = len(self._blocks) - 1
                self._free = [(block_index, i) for i in range(_EPOCH_WORDS)] + self._free
            block_index, slot = self._free.pop()
            block = self._blocks[block_index]
        epoch = secrets.randbits(64) | 1
        block[slot] = epoch
        return block, slot, ctypes.addressof(block) + 8 * slot, epoch

    def give_back(self, block: ctypes.Array, slot: int) -> None:
        block[slot] = 0
        with self._lock:
            self._free.append((self._blocks.index(block), slot))


def read_threads_setting(read_threads: int | None) -> int:
    """Threads that read one link's frames: the argument, else env ``KVT_SAMEHOST_READ_THREADS``,
    else :data:`DEFAULT_READ_THREADS`; 1 or 2."""
    value = read_threads or int(os.environ.get(READ_THREADS_ENV) or DEFAULT_READ_THREADS)
    if value not in (1, 2):
        raise ValueError(f"samehost read threads must be 1 or 2, got {value}")
    return value


class SamehostProvider(PathProvider):
    """Offers samehost on every link where ``process_vm_readv`` exists; see the module doc.

    ``read_threads`` (see :func:`read_threads_setting`): 2 splits each chunk between the link's
    reader thread and a helper thread of the path.
    """

    name = "samehost"

    def __init__(self, *, read_threads: int | None = None) -> None:
        self.read_threads = read_threads_setting(read_threads)
        # Peers read these 16 bytes (their address is in HELLO) before they vote for samehost.
        self.cookie = secrets.token_bytes(16)
        self._probe = ctypes.create_string_buffer(self.cookie, 16)
        self.probe_address = ctypes.addressof(self._probe)
        self.epochs = _EpochPool()

    def unavailable(self) -> str | None:
        return _UNAVAILABLE

    def may_be_chosen(self) -> None:
        allow_ptrace_reads()  # not before: a tcp-only engine gives no process ptrace access

    def candidate(self, link: LinkIO) -> PathCandidate:
        return _SamehostCandidate(self, link)


class _SamehostCandidate(PathCandidate):
    def __init__(self, provider: SamehostProvider, link: LinkIO) -> None:
        self.provider, self.link = provider, link
        self.word, self.slot, address, self.epoch = provider.epochs.take()
        self.blob = _BLOB.pack(provider.probe_address, provider.cookie, address, self.epoch)
        self._taken = True

    def check(self, peer: Hello) -> str | None:
        local_boot = self.link.local_boot_id
        if not local_boot or peer.boot_id != local_boot:
            return f"samehost: another host (boot id {peer.boot_id!r}, ours {local_boot!r})"
        blob = peer.offer("samehost") or b""
        if len(blob) != _BLOB.size:
            return f"samehost: malformed offer of {len(blob)} bytes"
        probe, cookie, word, epoch = _BLOB.unpack(blob)
        # The pid is the peer's word: read nothing of it before it is proven to hold this link.
        ends = self.link.socket_ends
        if ends is None or not owns_connection(peer.pid, *ends):
            return f"samehost: pid {peer.pid} does not own the connection"
        try:
            got = _read_word_bytes(peer.pid, probe, 16)
            live = int.from_bytes(_read_word_bytes(peer.pid, word, 8), "little")
        except OSError as exc:
            return f"samehost: probe read of pid {peer.pid} failed: {_errno_name(exc)}{_hint(exc)}"
        if got != cookie or live != epoch:
            return (
                f"samehost: probe read of pid {peer.pid} saw other bytes (another pid namespace?)"
            )
        return None

    def open(self, peer: Hello) -> PayloadPath:
        _, _, word, epoch = _BLOB.unpack(peer.offer("samehost") or b"")
        self._taken = False  # the path owns the epoch word from here on
        return SamehostPath(self.link, self, peer.pid, word, epoch)

    def discard(self) -> None:
        if self._taken:
            self._taken = False
            self.provider.epochs.give_back(self.word, self.slot)


def _proc_net_forms(host: str, port: int) -> dict[str, str]:
    """How /proc/net/tcp and tcp6 print the end (host, port): file name -> "ADDR:PORT" (hex of
    the address's native-order u32 words, as the kernel prints them)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return {}
    v4 = ip if ip.version == 4 else ip.ipv4_mapped
    v6 = ipaddress.IPv6Address(f"::ffff:{v4}") if v4 is not None else ip
    forms = {"tcp6": v6.packed}
    if v4 is not None:
        forms["tcp"] = v4.packed
    words = {
        name: "".join(
            f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4)
        )
        for name, raw in forms.items()
    }
    return {name: f"{addr}:{port:04X}" for name, addr in words.items()}


def owns_connection(pid: int, ours: tuple, theirs: tuple) -> bool:
    """Whether process ``pid`` holds the peer's end of the TCP connection whose ends are ``ours``
    (our sockname) and ``theirs`` (our peername): the socket inode of the end listed in
    /proc/net/tcp{,6} as local ``theirs``, remote ``ours`` is one of /proc/<pid>/fd's links.

    Costs one read of each table and a readlink per fd of ``pid`` (link setup only).
    """
    if pid <= 0:
        return False
    local, remote = _proc_net_forms(*theirs[:2]), _proc_net_forms(*ours[:2])
    inodes = set()
    for table in ("tcp", "tcp6"):
        if table not in local or table not in remote:
            continue
        needle = f" {local[table]} {remote[table]} "
        try:
            with open(f"/proc/net/{table}") as f:
                text = f.read()
        except OSError:
            continue
        at = text.find(needle)
        while at >= 0:
            line = text[text.rfind("\n", 0, at) + 1 : text.find("\n", at)].split()
            if len(line) > 9 and line[9] != "0":
                inodes.add(f"socket:[{line[9]}]")
            at = text.find(needle, at + 1)
    if not inodes:
        return False
    try:
        with os.scandir(f"/proc/{pid}/fd") as fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) in inodes:
                        return True
                except OSError:  # closed meanwhile
                    continue
    except OSError:  # no such process here, or not ours to look at
        return False
    return False


def _read_word_bytes(pid: int, address: int, nbytes: int) -> bytes:
    buf = ctypes.create_string_buffer(nbytes)
    local = np.array([[ctypes.addressof(buf), nbytes]], np.uint64)
    remote = np.array([[address, nbytes]], np.uint64)
    if read_remote(pid, local, remote) != nbytes:
        raise CmaError(errno.EFAULT, "short probe read")
    return buf.raw


class _PeerGone(Exception):
    """The peer's epoch word no longer shows the link's epoch (it gave up the link)."""


class SamehostPath(PayloadPath):
    """One link's samehost path (both directions): see the module docstring."""

    name = "samehost"

    def __init__(
        self, link: LinkIO, candidate: _SamehostCandidate, peer_pid: int, peer_word: int,
        peer_epoch: int,
    ) -> None:  # fmt: skip
        super().__init__(link)
        self._candidate = candidate
        self.peer_pid, self._peer_word, self._peer_epoch = peer_pid, peer_word, peer_epoch
        self._epoch_buf = ctypes.c_uint64(0)
        self._epoch_local = np.array([[ctypes.addressof(self._epoch_buf), 8]], np.uint64)
        self._epoch_remote = np.array([[peer_word, 8]], np.uint64)
        self._lock = threading.Lock()
        self._seq = 0
        self._outstanding: dict[int, tuple[SendJob, int]] = {}  # seq -> (job, frame bytes)
        self._read_threads = candidate.provider.read_threads
        self._helper: _ReadHelper | None = None  # reader thread only; joined by close()

    # ------------------------------------------------------------ sender (writer thread)
    def send_job(self, job: SendJob) -> None:
        blocks, addresses = job.blocks, job.addresses
        for start, end, nbytes in frame_cuts(blocks["length"].tolist()):
            if not job.begin_frame():
                return
            with self._lock:
                self._seq += 1
                seq = self._seq
                self._outstanding[seq] = job, nbytes  # ended by its ACK, or by close()
            ext = np.ascontiguousarray(addresses[start:end], dtype="<u8").tobytes()
            last = job.last and end == len(blocks)
            desc = encode_desc(job.request_id, blocks[start:end], last, seq, ext)
            try:
                self.link.write([desc])
            except BaseException:
                self._end(seq, 0)
                raise

    def on_message(self, message: PathMessage) -> None:
        if message.kind != ACK:
            raise ProtocolViolation(f"samehost: unknown PATH kind {message.kind}")
        with self._lock:
            entry = self._outstanding.get(message.seq)
            if entry is None:
                raise ProtocolViolation(f"samehost: ACK for frame {message.seq} not outstanding")
            job, size = entry
            if message.nbytes > size:  # left outstanding: close() ends it
                raise ProtocolViolation(
                    f"samehost: ACK claims {message.nbytes} bytes of frame {message.seq} "
                    f"of request {job.request_id!r}, which holds {size}"
                )
            del self._outstanding[message.seq]
        if message.status == ACK_FAILED:
            reason = message.body.decode(errors="replace")
            abort = Abort(job.request_id, AbortCode.BAD_BLOCK, AbortTarget.SENDER, reason)
            job.end_frame(0)
            self.link.listener.on_control(self.link, abort)  # as if the receiver had aborted
        else:
            job.end_frame(message.nbytes)

    def _end(self, seq: int, nbytes: int | None) -> SendJob | None:
        with self._lock:
            job, _ = self._outstanding.pop(seq, (None, 0))
        if job is not None and nbytes is not None:
            job.end_frame(nbytes)
        return job

    def close(self, reason: str) -> None:
        """Both link threads stopped: clear our epoch word FIRST (a peer still reading discards
        what it reads from here on), then end the frames no ACK will come for."""
        with self._lock:
            outstanding, self._outstanding = self._outstanding, {}
        self._candidate.provider.epochs.give_back(self._candidate.word, self._candidate.slot)
        for job, _ in outstanding.values():
            job.end_frame(0)
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    # ------------------------------------------------------------ receiver (reader thread)
    def receive(self, frame: DataHeader | DataDescriptor) -> None:
        if not isinstance(frame, DataDescriptor):
            raise ProtocolViolation("DATA frame with payload on a samehost link")
        n = len(frame.blocks)
        if len(frame.ext) != 8 * n:
            raise ProtocolViolation(f"samehost DESC with {len(frame.ext)} address bytes for {n}")
        link = self.link
        sink = link.listener.on_batch(link, Batch(frame.request_id, frame.blocks, frame.last))
        if sink is None:
            link.post(encode_path(ACK, ACK_OK, frame.seq, 0))
            return
        # kvt.faults (tests): a held or failed pull, or a link cut after it; one check when unset.
        cut_after = link.faults is not None and link.pull_fault(
            frame.request_id, frame.nbytes, frame.last
        )
        remote = np.frombuffer(frame.ext, dtype="<u8").astype(np.uint64)
        plan = ReadPlan(sink.addresses, remote, frame.blocks["length"], RECV_CHUNK)
        read = 0
        try:
            for k in range(plan.chunks):
                if not sink.begin_chunk():
                    break
                got = 0
                try:
                    got = self._read_chunk(plan, k)
                    self._check_peer_alive()
                except BaseException:
                    got = 0  # not one byte of a failed chunk counts
                    raise
                finally:
                    sink.end_chunk(got)
                read += got
        except _PeerGone:
            # The sender ended this link (its socket is closed or closing): keep what is already
            # in the stream, e.g. the ABORT a closing engine sends first, so the request ends
            # with the sender's own reason; EOF follows and fails the link. No ACK, no end_batch:
            # the frame's bytes are never reported written.
            log.info(
                "kvt: samehost peer %s gave up the link while request %r was being read",
                link.peer, frame.request_id,
            )  # fmt: skip
            return
        except CmaError as exc:
            self._read_failed(frame, exc)
            return
        if cut_after:
            raise InjectedFault(f"injected drop-mid after the pull of {frame.request_id!r}")
        link.post(encode_path(ACK, ACK_OK, frame.seq, read))
        sink.end_batch()

    def _read_chunk(self, plan: ReadPlan, k: int) -> int:
        """Chunk ``k`` of ``plan``, halved between this thread and the helper (2 read threads)."""
        if self._read_threads == 1:
            return plan.read_chunk(self.peer_pid, k)
        a, m, b = plan.split(k)
        if m == b:
            return plan.read_segments(self.peer_pid, a, b)
        if self._helper is None:
            self._helper = _ReadHelper(f"kvt-samehost-read-{self.peer_pid}")
        self._helper.start(plan, self.peer_pid, m, b)
        try:
            got = plan.read_segments(self.peer_pid, a, m)
        finally:
            helped = self._helper.wait()  # always: the chunk ends only after both halves
        return got + helped

    def _check_peer_alive(self) -> None:
        if read_remote(self.peer_pid, self._epoch_local, self._epoch_remote) != 8:
            raise _PeerGone
        if self._epoch_buf.value != self._peer_epoch:
            raise _PeerGone

    def _peer_alive(self) -> bool:
        try:
            self._check_peer_alive()
        except (OSError, _PeerGone):
            return False
        return True

    def _read_failed(self, frame: DataDescriptor, exc: OSError) -> None:
        link = self.link
        what = (
            f"samehost read of request {frame.request_id!r} from peer {link.peer} "
            f"(pid {self.peer_pid}) failed: {_errno_name(exc)}{_hint(exc)}"
        )
        if exc.errno == errno.EFAULT and self._peer_alive():
            # The sender named memory it does not have: that request only, the link stays.
            log.warning("kvt: %s", what)
            abort = Abort(frame.request_id, AbortCode.BAD_BLOCK, AbortTarget.RECEIVER, what)
            link.listener.on_control(link, abort)
            link.post(encode_path(ACK, ACK_FAILED, frame.seq, 0, what.encode()))
            return
        log.warning("kvt: %s; closing the link", what)
        link.close(what)
