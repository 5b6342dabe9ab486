"""The data-plane boundary: backends execute IpcBlocks and report back, knowing nothing else.

The control layer hands a backend :class:`SendJob`s (records plus the source memory they name) and
implements :class:`BackendListener` to hear about incoming data, confirmations, aborts and lost
links. A backend never decides whether a request lives or dies: it asks (``begin_*``) before it
touches a request's memory and reports (``end_*``) when it has stopped, which lets the control layer
promise that no byte is read or written after a request's completion was delivered.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from kvt.protocol import Abort, DataHeader, Done, Hello

_io_thread = threading.local()


def mark_io_thread() -> None:
    """Called first by every kvt-owned I/O or timer thread (see :func:`in_io_thread`)."""
    _io_thread.active = True


def in_io_thread() -> bool:
    """True on kvt's own I/O and timer threads: completion callbacks may run right there.

    On any other thread (the caller's, inside abort() or send()) they go to the notifier thread, so
    a callback never runs re-entrantly on a thread that may hold the caller's locks.
    """
    return getattr(_io_thread, "active", False)


class Link(Protocol):
    """One connection to a peer engine (both directions)."""

    @property
    def peer(self) -> str: ...

    def send_control(self, frame: bytes) -> None:
        """Queue a small control frame (DONE, ABORT); never blocks on the network."""

    def close(self, reason: str) -> None: ...


class SendJob(Protocol):
    """One batch of records to move, with the source memory of each record."""

    request_id: str
    blocks: np.ndarray  # IPCBLOCK_DTYPE
    views: list[memoryview]  # source bytes of blocks[i]
    last: bool

    def begin_frame(self) -> bool:
        """True: go ahead and read the source memory for one frame. False: drop the rest."""

    def end_frame(self, nbytes: int) -> None:
        """The frame begun last is fully handed to the kernel (or failed); memory no longer read."""

    def fail(self, reason: str, connect_failed: bool) -> None:
        """The job will never run (its link died before it was written)."""


class RecvSink(Protocol):
    """Where the payload of one accepted DATA frame goes."""

    views: list[memoryview]  # destination bytes of each record, in record order

    def begin_chunk(self) -> bool:
        """True: write the next chunk into ``views``. False: discard the rest of the frame."""

    def end_chunk(self, nbytes: int) -> None: ...


class BackendListener(Protocol):
    """Implemented by the control layer; called on backend threads."""

    def on_hello(self, link: Link, hello: Hello) -> None: ...

    def on_data(self, link: Link, header: DataHeader) -> RecvSink | None:
        """Validate an incoming batch. None: the backend discards its payload."""

    def on_data_end(self, link: Link, header: DataHeader, sink: RecvSink | None) -> None: ...

    def on_done(self, link: Link, done: Done) -> None: ...

    def on_abort(self, link: Link, abort: Abort) -> None: ...

    def on_link_lost(self, link: Link, reason: str, connect_failed: bool) -> None:
        """The link is dead; every job still queued on it was dropped."""


class DataPlaneBackend(abc.ABC):
    """Moves bytes named by IpcBlocks between registered regions of two engines."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this backend ("host:port" for TCP)."""

    @abc.abstractmethod
    def start(self, listener: BackendListener) -> None: ...

    @abc.abstractmethod
    def link_to(self, peer_address: str) -> Link:
        """The (shared, lazily connected) link to a peer engine's data address."""

    @abc.abstractmethod
    def submit(self, link: Link, job: SendJob) -> None:
        """Queue a batch on the link; returns at once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every thread and close every socket; idempotent."""


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


def iter_windows(
    views: list[memoryview], max_count: int, max_bytes: int
) -> Iterator[list[memoryview]]:
    """Windows covering ``views`` exactly once (for I/O that never stops short)."""
    cursor = IovCursor(views)
    while not cursor.done:
        window = cursor.window(max_count, max_bytes)
        yield window
        cursor.advance(sum(v.nbytes for v in window))
