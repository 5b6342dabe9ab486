"""Staging: device memory over paths that move host bytes (TCP, same host), through pinned memory.

A batch whose blocks lie in a device region (``Region.device`` "cuda:N") has no host bytes for a
socket or ``process_vm_readv`` to read. The engine stages it instead::

    sender:   layer event -> lease pool space -> D2H copy (copy stream) -> copy event waited on
              kvt's staging thread -> batch handed to the backend as staging views -> lease back
              when the batch's frames ended (or the request finished)
    receiver: batch arrives -> lease pool space (the link waits while the pool is full) -> the
              backend writes staging -> H2D copy -> copy event waited -> lease back; DONE only
              after the last batch's copy completed

Per layer this is a pipeline: layer 0 is on the wire while later layers are still computing or
copying. The pool is one pinned buffer of fixed size: a batch waits for space (FIFO, bounded by its
request's deadline) instead of allocating more.

The seam to the device is :class:`DeviceCopier` (pinned host memory, and queued copies that
return an event). :class:`CudaCopier` is the real one; :class:`ThreadCopier` copies host memory on
its own thread and signals an event, so every ordering and lifetime rule here is tested on CPU
(numpy arrays registered as :class:`~kvt.access.DeviceMemory` stand in for device memory).
"""

from __future__ import annotations

import collections
import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvt.access import EventWaiter

DEFAULT_STAGING_BYTES = 256 << 20  # pinned host memory per engine, taken at the first device region
_ALIGN = 256  # lease starts (DMA-friendly)
# The pool as MemoryInfo.region_id for DataPlaneBackend.register_memory: beyond the u16 region ids,
# so no IpcBlock can name it; only the engine's own staged jobs and sinks point into it.
STAGING_REGION_ID = 0x10000


class CopyEvent(Protocol):
    def synchronize(self) -> None:
        """Block until the copies queued before this event are complete."""


class DeviceCopier(Protocol):
    """Moves bytes between device memory and pinned host memory, asynchronously."""

    def host_buffer(self, nbytes: int) -> tuple[int, Any]:
        """Pinned host memory for the staging pool: (address, owner that keeps it alive)."""

    def copy(self, device: str, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> CopyEvent:
        """Queue ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]`` (uint64 addresses; one side on
        ``device``, the other in :meth:`host_buffer`) on a copy stream; never waits for them.
        The returned event completes once every one of them has."""

    def close(self) -> None: ...


def coalesce(
    dst: np.ndarray, src: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive copies that continue each other on both sides (fewer copy launches)."""
    dst, src, lengths = (np.asarray(a, dtype=np.uint64) for a in (dst, src, lengths))
    if len(lengths) < 2:
        return dst, src, lengths
    joins = (dst[1:] == dst[:-1] + lengths[:-1]) & (src[1:] == src[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    run_lengths = np.add.reduceat(lengths, starts).astype(np.uint64)
    return dst[starts], src[starts], run_lengths


# ---------------------------------------------------------------------------------- the pool
class Lease:
    """``nbytes`` of pool memory at ``address``; :meth:`release` gives it back (idempotent)."""

    __slots__ = ("_released", "address", "nbytes", "offset", "pool")

    def __init__(self, pool: StagingPool, offset: int, nbytes: int) -> None:
        self.pool, self.offset, self.nbytes = pool, offset, nbytes
        self.address = pool.address + offset
        self._released = False

    def addresses(self, lengths: np.ndarray) -> np.ndarray:
        """uint64 address of each record's bytes, packed in record order from the lease start."""
        lengths = np.asarray(lengths, dtype=np.uint64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
        return starts + np.uint64(self.address)

    def views(self, lengths: np.ndarray) -> list[memoryview]:
        """A host view per record (same packing as :meth:`addresses`)."""
        base = self.pool.view[self.offset : self.offset + self.nbytes]
        ends = np.cumsum(np.asarray(lengths, dtype=np.int64)).tolist()
        return [base[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]

    def release(self) -> None:
        self.pool._release(self)


class Ticket:
    """A waiting request for pool space; :meth:`cancel` gives up (its callback gets None)."""

    __slots__ = ("nbytes", "on_grant", "pool")

    def __init__(self, pool: StagingPool, nbytes: int, on_grant: Callable[[Lease | None], None]):
        self.pool, self.nbytes, self.on_grant = pool, nbytes, on_grant

    def cancel(self) -> None:
        self.pool._cancel(self)


class StagingPool:
    """Fixed host memory handed out as leases, first fit; waiters are served strictly in order.

    ``request`` never blocks: ``on_grant(lease)`` runs at once (caller's thread) when there is
    room and nobody is waiting, otherwise later on the thread whose release made room.
    ``on_grant(None)``: never (cancelled, or the pool closed). Callbacks run without the lock.
    """

    def __init__(self, address: int, nbytes: int, owner: Any) -> None:
        self.address, self.capacity, self._owner = address, nbytes, owner
        self.view = memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, coalesced
        self._leases: set[Lease] = set()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def leased(self) -> int:
        """Leases not yet released (0 once every batch let go: the leak check)."""
        return len(self._leases)

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def request(self, nbytes: int, on_grant: Callable[[Lease | None], None]) -> Ticket:
        if not 0 < nbytes <= self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a staging pool of {self.capacity}")
        ticket = Ticket(self, nbytes, on_grant)
        with self._lock:
            lease = None
            if not self._closed:
                lease = self._take(nbytes) if not self._waiting else None
                if lease is None:
                    self._waiting.append(ticket)
                    return ticket
        on_grant(lease)  # None when closed
        return ticket

    def _take(self, nbytes: int) -> Lease | None:
        """Under the lock: first fit."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                lease = Lease(self, offset, size)
                self._leases.add(lease)
                return lease
        return None

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            self._leases.discard(lease)
            self._free.append((lease.offset, lease.nbytes))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for offset, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == offset:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((offset, size))
            self._free = merged
            granted = self._grant_in_order()
        for ticket, new in granted:
            ticket.on_grant(new)

    def _cancel(self, ticket: Ticket) -> None:
        with self._lock:
            try:
                self._waiting.remove(ticket)
            except ValueError:
                return  # granted already (its owner releases the lease) or cancelled
        ticket.on_grant(None)
        self._release_waiters_behind()

    def _release_waiters_behind(self) -> None:
        # A cancelled head of the line may have been what the others waited behind.
        with self._lock:
            granted = self._grant_in_order()
        for ticket, new in granted:
            ticket.on_grant(new)

    def _grant_in_order(self) -> list[tuple[Ticket, Lease]]:
        """Under the lock: leases for the head of the line while they fit (nobody overtakes)."""
        granted: list[tuple[Ticket, Lease]] = []
        while self._waiting and not self._closed:
            new = self._take(self._waiting[0].nbytes)
            if new is None:
                break
            granted.append((self._waiting.popleft(), new))
        return granted

    def close(self) -> None:
        """Refuse new requests and wake every waiter with None; leases stay valid until released
        (the memory lives as long as this pool object)."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        for ticket in waiting:
            ticket.on_grant(None)


class Stager:
    """An engine's staging: the pool, the copier, and the kvt thread that waits for copy events."""

    def __init__(self, copier: DeviceCopier, nbytes: int, name: str) -> None:
        address, owner = copier.host_buffer(nbytes)
        self.copier = copier
        self.pool = StagingPool(address, nbytes, owner)
        self._waiter = EventWaiter(name=f"kvt-{name}-staging")
        self._lock = threading.Lock()
        self._closed = False

    def copy(
        self,
        device: str,
        dst: np.ndarray,
        src: np.ndarray,
        lengths: np.ndarray,
        then: Callable[[], None],
    ) -> bool:
        """Queue the copies; ``then()`` runs on the staging thread once they completed. False:
        closed, nothing queued (``then`` never runs)."""
        with self._lock:  # held only while the copies are queued (never waits for them)
            if self._closed:
                return False
            event = self.copier.copy(device, *coalesce(dst, src, lengths))
            self._waiter.after(event, then)
        return True

    def close(self) -> None:
        """Wake pool waiters, wait for the queued copies (their ``then`` runs), stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.pool.close()
        self._waiter.close()
        self.copier.close()


# ---------------------------------------------------------------------------------- copiers
class _FlagEvent:
    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._done.wait()


class ThreadCopier:
    """A :class:`DeviceCopier` over host memory: copies run in order on its own thread, each batch
    signalling its event when done, like a copy stream. The CPU stand-in for :class:`CudaCopier`
    (tests, ``gpu_check.py --dry-run``). :meth:`hold` stops the "stream" before the next batch
    until :meth:`resume` (a test's slow device)."""

    def __init__(self, name: str = "kvt-thread-copier") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._running = threading.Event()
        self._running.set()
        self.submitted = 0  # copy batches handed to the "stream"
        self.batches = 0  # copy batches completed
        self.bytes = 0
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def host_buffer(self, nbytes: int) -> tuple[int, Any]:
        buffer = np.zeros(nbytes, dtype=np.uint8)
        return int(buffer.ctypes.data), buffer

    def copy(self, device: str, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray):
        event = _FlagEvent()
        self.submitted += 1
        self._queue.put((dst.tolist(), src.tolist(), lengths.tolist(), event))
        return event

    def hold(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def _main(self) -> None:
        while (item := self._queue.get()) is not None:
            self._running.wait()
            dst, src, lengths, event = item
            for d, s, n in zip(dst, src, lengths, strict=True):
                ctypes.memmove(d, s, n)
            self.batches += 1
            self.bytes += sum(lengths)
            event._done.set()

    def close(self) -> None:
        self._running.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()


class _CudaArray:
    """``__cuda_array_interface__`` over raw device bytes, so torch can wrap them zero-copy."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


class CudaCopier:
    """A :class:`DeviceCopier` on CUDA: pinned host memory from torch, copies queued on one
    copy stream per device (coalesced runs, ``non_blocking``), one ``torch.cuda.Event`` per
    batch. Never run in CI (no GPU); ``benchmarks/gpu_check.py`` exercises it on a GPU."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopier needs CUDA")
        self._torch = torch
        self._streams: dict[str, Any] = {}
        self._host: Any = None
        self._host_range = (0, 0)

    def host_buffer(self, nbytes: int) -> tuple[int, Any]:
        torch = self._torch
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        address = int(self._host.data_ptr())
        self._host_range = (address, address + nbytes)
        return address, self._host

    def copy(self, device: str, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray):
        torch = self._torch
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        lo, hi = self._host_range
        to_host = bool(len(dst)) and lo <= int(dst[0]) < hi
        dev_addr, host_addr = (src, dst) if to_host else (dst, src)
        base = int(dev_addr.min()) if len(dev_addr) else 0
        span = int((dev_addr + lengths).max()) - base if len(dev_addr) else 0
        with torch.cuda.device(device), torch.cuda.stream(stream):
            dev = torch.as_tensor(_CudaArray(base, max(span, 1)), device=device)
            host = self._host
            for d, h, n in zip(
                (dev_addr - base).tolist(), (host_addr - lo).tolist(), lengths.tolist(), strict=True
            ):
                if to_host:
                    host[h : h + n].copy_(dev[d : d + n], non_blocking=True)
                else:
                    dev[d : d + n].copy_(host[h : h + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
        self._streams.clear()


__all__ = [
    "DEFAULT_STAGING_BYTES",
    "STAGING_REGION_ID",
    "CudaCopier",
    "DeviceCopier",
    "Lease",
    "Stager",
    "StagingPool",
    "ThreadCopier",
    "coalesce",
]
