"""What the control layer shares with backends: its peer messages and its I/O-thread marker.

Two engines' control layers talk in two messages: :class:`Done` (receiver to sender: every byte of
the request is written) and :class:`Abort` (either way: give the request up; receiver to sender
also as the verdict that confirms the sender's own abort). They are the
control layer's decisions; a backend carries them to the peer engine in order with the data it
already carries on that link (TCP encodes them as frames, an in-memory backend hands the object
over) and never looks inside.

The I/O-thread marker says on which threads a completion callback may run at once: kvt's own
threads (the timer thread, and every backend thread that calls the control layer, which marks
itself through ``BackendListener.io_thread_started``), never a caller's thread.
"""

from __future__ import annotations

import enum
import threading

import msgspec

from kvt.outcome import AbortCode

MAX_REQUEST_ID = 1024  # bytes of utf-8 in a request id


class AbortTarget(enum.IntEnum):
    SENDER = 1  # abort the request on the side that sends data
    RECEIVER = 2  # abort the request on the side that receives data


class Done(msgspec.Struct, frozen=True):
    """Receiver to sender: every byte of ``request_id`` is written (``nbytes`` in all)."""

    request_id: str
    nbytes: int


class Abort(msgspec.Struct, frozen=True):
    """Give up ``request_id`` on the ``target`` side, for ``code`` (``reason`` for the logs).

    ``confirms``: the receiver's verdict on the sender's own ABORT, which reached it first (it
    completed ABORTED(PEER)): the sender completes with the origin it asked for (LOCAL, TIMEOUT;
    see :mod:`kvt.lifecycle`). False: the side that sends it aborted (or refused, or lost the
    link) on its own."""

    request_id: str
    code: AbortCode
    target: AbortTarget
    reason: str
    confirms: bool = False


ControlMessage = Done | Abort

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
