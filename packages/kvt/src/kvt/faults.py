"""Faults on purpose: a hook the data-plane backends consult before each DATA frame they write.

A backend given ``faults=`` (a :class:`FaultPlan`) asks it, for every DATA frame it is about to
write, whether to misbehave; with ``faults=None`` (the default) the cost is one ``is None`` check
per frame. What a plan can ask for (:class:`FaultKind`):

* ``DROP``: the link dies at the frame boundary, before the frame's first byte;
* ``DROP_MID``: the header and about half the payload go out, then the link dies;
* ``STALL``: the write waits (``Fault.stall_s`` seconds, or until the test calls
  :meth:`Fault.release`; closing the link also ends the wait), then goes on;
* ``CORRUPT``: the frame header goes out with one field broken (``magic``, ``type``, ``meta_len``
  or ``payload_len``); the receiver must close only that connection with a typed error
  (:class:`~kvt.errors.ProtocolViolation`) and a log line naming the peer.

A plan subclasses :class:`FaultPlan` (its :meth:`~FaultPlan.decide`); the tests' plans, scripted
("the 3rd DATA frame to peer D: drop") and seeded random ones, live with the tests
(``tests/fault_plans.py``). Every injected fault is recorded in :attr:`FaultPlan.injected`, so a
test knows which links were hit. The backends carry the faults out; this module knows no backend.
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass

from kvt.protocol import HEADER

CORRUPT_FIELDS = ("magic", "type", "meta_len", "payload_len")


class FaultKind(enum.Enum):
    DROP = "drop"
    DROP_MID = "drop-mid"
    STALL = "stall"
    CORRUPT = "corrupt"


@dataclass(frozen=True, slots=True)
class FrameInfo:
    """The DATA frame a backend is about to write, as a plan sees it."""

    engine: str  # the sending backend's name
    peer: str  # the link's peer label (e.g. "D(127.0.0.1:5000)" or "D(memory:D-3)")
    request_id: str
    nbytes: int  # payload bytes of this frame
    last: bool  # the request's last frame
    index: int = 0  # 1-based: the n-th DATA frame this plan saw from ``engine`` to ``peer``
    kind: str = "DATA"  # "DATA" (tcp), "DESC" (samehost's descriptor), "pull" (samehost's
    # receiver, before it reads), "batch" (in-memory)


class Fault:
    """One decision of a plan; a ``STALL`` can be released by the test (:meth:`release`)."""

    def __init__(
        self, kind: FaultKind, *, field: str = "magic", stall_s: float | None = None
    ) -> None:
        if kind is FaultKind.CORRUPT and field not in CORRUPT_FIELDS:
            raise ValueError(f"corrupt field must be one of {CORRUPT_FIELDS}, not {field!r}")
        self.kind, self.field, self.stall_s = kind, field, stall_s
        self._released = LinkWake()  # closed by release(): ends every hold, now and later
        self.stalled = threading.Event()  # set once a write is held by this fault

    def __repr__(self) -> str:
        extra = self.field if self.kind is FaultKind.CORRUPT else self.stall_s
        return f"Fault({self.kind.value}, {extra})"

    def release(self) -> None:
        """Let every write this STALL holds (and will hold) go on."""
        self._released.close()

    def stall(self, wake: LinkWake) -> None:
        """Hold the calling write ``stall_s`` seconds (None: until released) or until its link
        closes (``wake``)."""
        event = threading.Event()
        if not self._released.add(event):
            return
        if wake.add(event):
            self.stalled.set()
            event.wait(self.stall_s)
        wake.discard(event)
        self._released.discard(event)


class LinkWake:
    """A latch of waiters: closing it wakes every waiter, now and later. A link owns one, so
    that its closing ends the stalls its writes are held in; a Fault owns one for release()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._events: set[threading.Event] = set()

    def add(self, event: threading.Event) -> bool:
        """Wait with ``event`` (set on close); False: already closed, do not wait."""
        with self._lock:
            if not self._closed:
                self._events.add(event)
                return True
        return False

    def discard(self, event: threading.Event) -> None:
        with self._lock:
            self._events.discard(event)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            events, self._events = self._events, set()
        for event in events:
            event.set()


@dataclass(frozen=True, slots=True)
class Injected:
    frame: FrameInfo
    fault: Fault


class FaultPlan:
    """Base plan: counts frames per (engine, peer), asks :meth:`decide`, records what it did.

    Thread-safe: backends call :meth:`on_data_frame` from their writer threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self.injected: list[Injected] = []
        self.seen: collections.Counter[str] = collections.Counter()  # frames consulted, by kind

    def decide(self, frame: FrameInfo) -> Fault | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_data_frame(
        self, engine: str, peer: str, request_id: str, nbytes: int, last: bool, *, kind="DATA"
    ) -> Fault | None:
        with self._lock:
            key = (engine, peer)
            index = self._counts[key] = self._counts.get(key, 0) + 1
            self.seen[kind] += 1
            frame = FrameInfo(engine, peer, request_id, nbytes, last, index, kind)
            fault = self.decide(frame)
            if fault is not None:
                self.injected.append(Injected(frame, fault))
        return fault


def corrupt_header(head: bytes, what: str) -> bytes:
    """``head`` (a frame's 16-byte header and its metadata) with one header field broken so the
    receiver's decoder must reject it at once (never a stream that merely stalls)."""
    magic, version, ftype, meta_len, payload_len = HEADER.unpack_from(head)
    if what == "magic":
        magic = b"XK"
    elif what == "type":
        ftype = 0xEE
    elif what == "meta_len":
        meta_len = 0xFFFFFFFF  # over any receiver's metadata limit
    else:
        payload_len += 1  # no longer the sum of the records' lengths
    return HEADER.pack(magic, version, ftype, meta_len, payload_len) + head[HEADER.size :]


def first_half(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The views that carry the first half of a ``nbytes`` payload held in ``views``: what a
    DROP_MID lets through before the link dies."""
    half, cut = nbytes // 2, []
    for view in views:
        if half <= 0:
            break
        cut.append(memoryview(view)[:half])
        half -= cut[-1].nbytes
    return cut


class InjectedFault(OSError):
    """Raised inside a backend's writer to make an injected link drop look like a real one."""


__all__ = [
    "CORRUPT_FIELDS",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "FrameInfo",
    "Injected",
    "InjectedFault",
    "LinkWake",
    "corrupt_header",
    "first_half",
]
