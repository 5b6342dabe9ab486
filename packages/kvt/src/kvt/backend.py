"""The data-plane boundary: backends move the bytes IpcBlocks name and report back, nothing else.

The interface speaks the data plane's own neutral terms:
* what to write where: a :class:`SendJob` (records plus the source memory each names) goes out on a
  :class:`Link`; on the other side the control layer answers an arriving :class:`Batch` with a
  :class:`RecvSink` (the destination memory of each record) or refuses it;
* what arrived: :meth:`BackendListener.on_batch` and, for the control layer's own messages (DONE,
  ABORT, defined in :mod:`kvt.control`, carried here unread), :meth:`BackendListener.on_control`;
* a link lost: :meth:`BackendListener.on_link_lost`.

A backend never decides whether a request lives or dies: it asks (``begin_*``) before it touches a
request's memory and reports (``end_*``) when it has stopped, which lets the control layer promise
that no byte is read or written after a request's completion was delivered. Frames, handshakes and
sockets are the backend's own business (see :mod:`kvt.tcp`); the control layer is given a backend
and never imports one.
"""

from __future__ import annotations

import abc
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvt.control import ControlMessage


@dataclass(frozen=True, slots=True)
class Batch:
    """What arrived: one batch (or a part of one) of a request, before any of its bytes."""

    request_id: str
    blocks: np.ndarray  # IPCBLOCK_DTYPE, read-only; record i's bytes go to (dst_region, dst_offset)
    last: bool  # the request's last batch: once its bytes are written the request is complete


class Link(Protocol):
    """One connection to a peer engine (both directions)."""

    @property
    def peer(self) -> str:
        """The peer, for logs and completions (e.g. "D(127.0.0.1:5000)")."""

    def send_control(self, message: ControlMessage) -> None:
        """Carry a control message to the peer, after what was queued before; never blocks."""

    def close(self, reason: str) -> None:
        """Drop the connection now; the listener hears ``on_link_lost``."""

    @property
    def path(self) -> str:
        """How this link moves payload bytes: "tcp", "samehost", "rdma" or "memory" (metrics
        label; may change once, when the link's handshake picks its path)."""


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """A region as the data plane sees it: bytes at an address (for registration, e.g. RDMA)."""

    region_id: int
    address: int
    nbytes: int
    writable: bool
    device: str  # "cpu" or a torch device string such as "cuda:0"


class SendJob(Protocol):
    """One batch of records to move, with the source memory of each record."""

    request_id: str
    blocks: np.ndarray  # IPCBLOCK_DTYPE
    views: list[memoryview]  # source bytes of blocks[i]
    last: bool

    @property
    def addresses(self) -> np.ndarray:
        """uint64 address of each record's source bytes in this process (for paths that hand
        addresses to the kernel or a NIC instead of reading ``views``)."""

    def begin_frame(self) -> bool:
        """True: go ahead and read the source memory for one frame. False: drop the rest."""

    def end_frame(self, nbytes: int) -> None:
        """The frame begun last is fully handed over (or failed); memory no longer read."""

    def fail(self, reason: str, connect_failed: bool) -> None:
        """The job will never run (its link died before it was written)."""


class RecvSink(Protocol):
    """Where the bytes of one accepted :class:`Batch` go."""

    views: list[memoryview]  # destination bytes of each record, in record order

    @property
    def addresses(self) -> np.ndarray:
        """uint64 address of each record's destination bytes in this process."""

    def begin_chunk(self) -> bool:
        """True: write the next chunk into ``views``. False: discard the rest of the batch."""

    def end_chunk(self, nbytes: int) -> None: ...

    def end_batch(self) -> None:
        """Every byte of the batch has arrived (written, or discarded after a False above)."""


class BackendListener(Protocol):
    """Implemented by the control layer; called on backend threads."""

    def io_thread_started(self) -> None:
        """Called first on every backend thread that will call this listener."""

    def on_batch(self, link: Link, batch: Batch) -> RecvSink | None:
        """Validate an arriving batch. None: the backend discards its bytes."""

    def on_control(self, link: Link, message: ControlMessage) -> None:
        """The peer engine's control layer sent ``message``."""

    def on_link_lost(self, link: Link, reason: str, connect_failed: bool) -> None:
        """The link is dead; every job still queued on it was dropped."""


class DataPlaneBackend(abc.ABC):
    """Moves bytes named by IpcBlocks between registered regions of two engines.

    The engine it is given to owns it: the engine starts it and closes it.
    """

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this backend ("host:port" for TCP)."""

    @abc.abstractmethod
    def start(self, listener: BackendListener) -> None: ...

    @abc.abstractmethod
    def link_to(self, peer_address: str) -> Link:
        """The (shared, lazily connected) link to a peer engine's data address; never blocks.

        Raises OSError or ValueError if the address cannot be reached at all.
        """

    @abc.abstractmethod
    def submit(self, link: Link, job: SendJob) -> None:
        """Queue a batch on the link; returns at once."""

    def register_memory(self, info: MemoryInfo) -> None:  # noqa: B027 (optional hook)
        """A region was registered (called before any block can name it). Paths that must
        register memory with a device (RDMA memory regions) do it here; the default does nothing.
        Raising refuses the registration."""

    def unregister_memory(self, region_id: int) -> None:  # noqa: B027 (optional hook)
        """The region is gone: no block names it any more; release what register_memory took."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deliver the control messages already queued (bounded), then stop every thread and
        release every connection; idempotent."""


class IovCursor:
    """Walks a list of buffers in windows bounded by count and bytes, resuming after partial I/O."""

    __slots__ = ("_index", "_offset", "_views")

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._index = 0
        self._offset = 0
        self._skip_empty()

    @property
    def done(self) -> bool:
        return self._index >= len(self._views)

    def window(self, max_count: int, max_bytes: int) -> list[memoryview]:
        out: list[memoryview] = []
        total = 0
        i, views = self._index, self._views
        first = views[i][self._offset :] if self._offset else views[i]
        while True:
            view = first if not out else views[i]
            room = max_bytes - total
            if view.nbytes > room:
                if not out:
                    out.append(view[:room])
                break
            out.append(view)
            total += view.nbytes
            i += 1
            if i >= len(views) or len(out) >= max_count:
                break
        return out

    def advance(self, nbytes: int) -> None:
        views = self._views
        while nbytes > 0:
            left = views[self._index].nbytes - self._offset
            if nbytes < left:
                self._offset += nbytes
                return
            nbytes -= left
            self._index += 1
            self._offset = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._index < len(self._views) and self._views[self._index].nbytes == self._offset:
            self._index += 1
            self._offset = 0


def drain(pending: queue.SimpleQueue[Any]) -> Iterator[Any]:
    """What is left in a link's queue once its thread stops (the jobs in it are to be failed)."""
    while True:
        try:
            yield pending.get_nowait()
        except queue.Empty:
            return


def iter_windows(
    views: list[memoryview], max_count: int, max_bytes: int
) -> Iterator[list[memoryview]]:
    """Windows covering ``views`` exactly once (for I/O that never stops short)."""
    cursor = IovCursor(views)
    while not cursor.done:
        window = cursor.window(max_count, max_bytes)
        yield window
        cursor.advance(sum(v.nbytes for v in window))
