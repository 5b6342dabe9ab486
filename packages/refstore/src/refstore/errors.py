"""Typed errors, grouped by who is at fault.

- ``CallerError``: the local caller passed something wrong (bad type, unknown ref, too big).
- ``ObjectGone``: the object existed but is no more; says ``reason`` (expired, evicted, released,
  master restarted) and ``since`` (wall-clock time, seconds since the epoch).
- ``MasterUnavailable``: the transport to the master failed (not running, connection lost, timeout).
- ``PoolFull``: nothing could be evicted to make room (a resource condition, not a bug).
- ``InjectedFault``: raised on purpose by ``refstore.faults``.

The master sends errors back as ``ErrorInfo`` (kind + message + since) inside the response, and the
client raises the matching class, so the type survives the RPC.
"""

from __future__ import annotations

import time

import msgspec


class RefstoreError(Exception):
    """Base of every refstore error."""


class CallerError(RefstoreError, ValueError):
    """The caller's request is invalid (bad argument, unsupported type, unknown object)."""


class UnknownObject(CallerError):
    """The master never had this object (wrong id), or the ref belongs to another pool."""


class PeerError(RefstoreError):
    """A peer (another master) misbehaved or reported a failure."""


class ObjectGone(RefstoreError):
    """The object existed but its payload is gone; ``reason`` says why and ``since`` when."""

    reason = "gone"

    def __init__(self, message: str, since: float) -> None:
        when = time.strftime("%H:%M:%S", time.localtime(since)) + f".{int(since * 1000) % 1000:03d}"
        super().__init__(f"{message} ({self.reason} since {when})")
        self.since = since


class ObjectExpired(ObjectGone):
    reason = "lease expired"


class ObjectEvicted(ObjectGone):
    reason = "evicted"


class ObjectReleased(ObjectGone):
    reason = "released"


class MasterRestarted(ObjectGone):
    """The ref was created by a master instance that is no longer running (its pool is gone)."""

    reason = "master restarted"


class PoolFull(RefstoreError, MemoryError):
    """No free block is large enough and nothing evictable would make room."""


class MasterUnavailable(RefstoreError, ConnectionError):
    """Transport-level failure talking to a master (not running, connection lost, timeout)."""


class InjectedFault(RefstoreError):
    """Raised on purpose by ``refstore.faults``."""


class ErrorInfo(msgspec.Struct, frozen=True):
    """An error as it travels in a response."""

    kind: str
    message: str
    since: float = 0.0


_GONE = {
    cls.__name__: cls for cls in (ObjectExpired, ObjectEvicted, ObjectReleased, MasterRestarted)
}
_PLAIN = {
    cls.__name__: cls
    for cls in (CallerError, UnknownObject, PoolFull, InjectedFault, PeerError, RefstoreError)
}


def to_info(exc: RefstoreError) -> ErrorInfo:
    return ErrorInfo(
        kind=type(exc).__name__,
        message=str(exc.args[0]) if exc.args else "",
        since=getattr(exc, "since", 0.0),
    )


def from_info(info: ErrorInfo) -> RefstoreError:
    gone = _GONE.get(info.kind)
    if gone is not None:
        # The message already carries "(reason since ...)" from the master: strip it.
        return gone(info.message.rsplit(" (", 1)[0], info.since)
    return _PLAIN.get(info.kind, RefstoreError)(info.message)
