"""The disk tier's I/O: one preallocated file, a writer thread, reader threads, a snapshot.

``disk_index.py`` decides (which records, where, which go); this module moves the bytes:

- **open** (``DiskTier.open``, at master start): ``<dir>/<name>.tier``, created if missing,
  locked (``flock``: one master per file), and reserved to its full size with
  ``posix_fallocate``, so a tier that cannot have its space fails the start with a clear
  ``CallerError`` instead of failing writes later. ``<dir>/<name>.tier.index``, the snapshot
  of a clean close, is read and deleted (a crash later leaves no stale index behind): the
  records it lists are known again, each verified when it is read.
- **spill** (on the master's loop thread, inside an eviction): the evicted object's payload is
  copied into a staging area (``spill_queue`` bytes, its own ``TlsfAllocator``) and queued for
  the writer thread, which computes the checksum (XXH64, in ``_fastpath``: about 3x zlib's
  CRC32 here), writes head and payload with ``pwrite`` and hands the record back to the loop
  (``call_soon_threadsafe``). A full staging area drops the
  spill (``spill_dropped``): the master never waits for the disk.
- **read** (``read``, a lookup's promotion): ``pread`` of the head, then of the payload
  straight into the pool block allocated for it, 256 KiB at a time, each chunk hashed while it
  is still in cache (``_fastpath.pread_xxh64``), on a reader thread; a short read, a head other
  than the one written or a payload whose checksum differs is an error string, never raised.
  A record still waiting for the writer is copied from the staging area instead
  (``copy_staged``).
- **close**: the writer drops what it has not started, the threads are joined, the snapshot is
  written (temporary file, then rename) and the file closed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import fcntl
import logging
import mmap
import os
import queue
import threading
import time
from pathlib import Path

from . import _fastpath
from .allocator import TlsfAllocator
from .disk_index import (
    BadRecord,
    DiskIndex,
    DiskRecord,
    RecordState,
    decode_snapshot,
    encode_head,
    encode_snapshot,
)
from .errors import CallerError

log = logging.getLogger("refstore.disk")

DEFAULT_SPILL_QUEUE = 128 << 20
DISK_READERS = 4
WRITER_NICE = 10
STAGING_GRANULE = 4096


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _human(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


class DiskTier:
    """Create with ``DiskTier.open`` on the loop that owns it; ``close()`` on that loop."""

    def __init__(
        self,
        path: Path,
        fd: int,
        index: DiskIndex,
        loop: asyncio.AbstractEventLoop,
        spill_queue: int,
    ) -> None:
        self.path = path
        self._fd = fd
        self.index = index
        self._loop = loop
        self._staging_map = mmap.mmap(-1, spill_queue)
        self._staging_view = memoryview(self._staging_map)
        self._staging = TlsfAllocator(spill_queue, STAGING_GRANULE)
        self._jobs: queue.SimpleQueue[DiskRecord | None] = queue.SimpleQueue()
        self._written: collections.deque[tuple[DiskRecord, int, bytes | None, str]] = (
            collections.deque()
        )
        self._pending = 0  # records queued or being written
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name=f"refstore-disk-writer-{path.name}", daemon=True
        )
        self._readers = concurrent.futures.ThreadPoolExecutor(
            DISK_READERS, thread_name_prefix=f"refstore-disk-reader-{path.name}"
        )
        self._writer.start()

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        name: str,
        size: int,
        *,
        loop: asyncio.AbstractEventLoop,
        spill_queue: int = DEFAULT_SPILL_QUEUE,
    ) -> DiskTier:
        """Open (or create) the tier file of master ``name`` in ``directory``, ``size`` bytes,
        with the records of its last clean close. Raises CallerError when the directory or
        file cannot be written, another master holds it, or the filesystem lacks the room."""
        if size < 1 << 20:
            raise CallerError(f"a disk tier needs at least 1 MiB, got {size} bytes")
        if spill_queue < STAGING_GRANULE:
            raise CallerError(f"spill_queue must be at least {STAGING_GRANULE} bytes")
        path = Path(directory) / f"{name}.tier"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise CallerError(f"disk tier {path}: cannot create it: {err}") from err
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CallerError(f"disk tier {path} is in use by another master") from None
            cls._reserve(path, fd, size)
            index = DiskIndex(size)
            cls._restore(path, index)
            return cls(path, fd, index, loop, spill_queue)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _reserve(path: Path, fd: int, size: int) -> None:
        """The whole size on disk now, so that a full disk fails here and not in a write."""
        try:
            st = os.fstat(fd)
            fs = os.fstatvfs(fd)
            free = fs.f_bavail * fs.f_frsize
            have = min(st.st_blocks * 512, size)
            if size - have > free:
                raise CallerError(
                    f"disk tier {path}: {_human(size)} requested, the filesystem has "
                    f"{_human(free + have)} for it (disk full?)"
                )
            if st.st_size > size:
                os.ftruncate(fd, size)  # a smaller tier than last time: records past it go
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            raise CallerError(f"disk tier {path}: cannot reserve {_human(size)}: {err}") from err

    @staticmethod
    def _restore(path: Path, index: DiskIndex) -> None:
        snapshot = path.with_name(path.name + ".index")
        try:
            raw = snapshot.read_bytes()
        except FileNotFoundError:
            return
        except OSError as err:
            log.warning("disk tier %s: index not read (%s): starting empty", path, err)
            return
        try:
            snapshot.unlink()  # from now on the file changes: a crash must not find it
        except OSError as err:
            raise CallerError(f"disk tier {path}: cannot remove {snapshot}: {err}") from err
        try:
            _, records = decode_snapshot(raw)
        except BadRecord as err:
            log.warning("disk tier %s: index unreadable (%s): starting empty", path, err)
            return
        kept = index.restore(records)
        log.info("disk tier %s: %d of %d records of the last run kept", path, kept, len(records))

    # -- spilling (loop thread) ---------------------------------------------------------------
    def spill(self, key: bytes, layout: bytes, payload: memoryview, oid: int) -> None:
        """Queue the bytes of an evicted keyed cache entry for the writer (copied now: the
        pool block is reused as soon as this returns); dropped if the queue is full."""
        index = self.index
        if self._stopping or index.mirrors(key, oid):
            return
        nbytes = len(payload)
        staged = self._staging.malloc(nbytes)
        if staged is None:
            index.counters["spill_dropped"] += 1
            return
        record = index.place(key, layout, nbytes)
        if record is None:
            self._staging.free(staged)
            return
        # Non-temporal stores: the staged bytes are read next by the writer, not by this thread.
        _fastpath.copy_in(self._staging_view, staged, payload)
        record.staged = staged
        self._pending += 1
        self._idle.clear()
        self._jobs.put(record)

    def _write_loop(self) -> None:
        with contextlib.suppress(OSError):  # below the loop and the clients for the CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            record = self._jobs.get()
            if record is None:
                return
            head: bytes | None = None
            why = "the master is closing"
            if not self._stopping:
                try:
                    head = self._write(record)
                except OSError as err:
                    why = str(err)
            self._written.append((record, record.staged or 0, head, why))
            with contextlib.suppress(RuntimeError):  # the loop is closing: close() drains
                self._loop.call_soon_threadsafe(self._drain_written)

    def _write(self, record: DiskRecord) -> bytes:
        assert record.staged is not None
        payload = self._staging_view[record.staged : record.staged + record.nbytes]
        try:
            checksum = _fastpath.xxh64(payload)
            head = encode_head(record.key, record.layout, record.nbytes, checksum)
            _pwrite_all(self._fd, head, record.offset)
            _pwrite_all(self._fd, payload, record.offset + len(head))
        finally:
            payload.release()
        return head

    def _drain_written(self) -> None:
        while self._written:
            record, staged, head, why = self._written.popleft()
            if head is None and not self._stopping:
                log.warning("disk tier %s: key %r not written: %s", self.path, record.key, why)
            self.index.written(record, head)
            self._staging.free(staged)
            self._pending -= 1
        if not self._pending:
            self._idle.set()

    async def flush(self) -> None:
        """Until every spill queued so far is written (or failed)."""
        await self._idle.wait()

    # -- reading (loop thread, the reads on reader threads) -----------------------------------
    def copy_staged(self, record: DiskRecord, dst: memoryview) -> None:
        """A record still waiting for the writer: its bytes from the staging area."""
        assert record.state is RecordState.WRITING
        assert record.staged is not None
        dst[:] = self._staging_view[record.staged : record.staged + record.nbytes]

    def read(self, record: DiskRecord, dst: memoryview) -> asyncio.Future[str | None]:
        """Read a STORED record's payload into ``dst`` on a reader thread: None, or why the
        bytes are not the record's (nothing raised)."""
        return self._loop.run_in_executor(self._readers, self._read_into, record, dst)

    def _read_into(self, record: DiskRecord, dst: memoryview) -> str | None:
        try:
            head = os.pread(self._fd, len(record.head), record.offset)
            if head != record.head:
                return (
                    f"short read of the head ({len(head)} of {len(record.head)} bytes)"
                    if len(head) < len(record.head)
                    else "the head on disk is not the one written"
                )
            got, checksum = _fastpath.pread_xxh64(self._fd, dst, record.offset + len(head))
            if got < len(dst):
                return f"short read ({got} of {len(dst)} payload bytes)"
            if checksum != record.checksum:
                return "payload checksum mismatch"
            return None
        except OSError as err:
            return f"read failed: {err}"
        finally:
            dst.release()

    # -- the rest -----------------------------------------------------------------------------
    def drop(self, keys: list[bytes]) -> int:
        return sum(self.index.drop(key) for key in keys)

    def stats(self) -> dict[str, int]:
        return {
            "disk_capacity": self.index.capacity,
            "disk_keys": self.index.stored_keys,
            "disk_bytes": self.index.stored_bytes,
            **self.index.counters,
        }

    def close(self) -> None:
        """Stop the threads (queued writes are dropped), write the snapshot, close the file.
        On the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._jobs.put(None)
        self._writer.join()
        self._readers.shutdown(wait=True)
        self._drain_written()
        started = time.perf_counter()
        records = self.index.snapshot()
        snapshot = self.path.with_name(self.path.name + ".index")
        temporary = snapshot.with_name(snapshot.name + ".tmp")
        try:
            temporary.write_bytes(encode_snapshot(self.index.capacity, records))
            temporary.replace(snapshot)
        except OSError as err:
            log.warning("disk tier %s: no index written (%s): next start empty", self.path, err)
        else:
            log.info(
                "disk tier %s: %d records indexed for the next start in %.3f s",
                self.path,
                len(records),
                time.perf_counter() - started,
            )
        os.close(self._fd)
        self._staging_view.release()
        try:
            self._staging_map.close()
        except BufferError:  # a view of a late spill still alive: the map goes with it
            log.debug("disk tier %s: staging area still viewed at close", self.path)
