"""What P's (``producer.py``) and D's (``consumer.py``) state machines share: the actions and
events both emit or take, and how a kvt completion reads in a log line. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvt import Completion


def describe(completion: Completion) -> str:
    """One log-friendly line for a kvt completion."""
    origin = completion.origin.name if completion.origin is not None else None
    code = completion.code.name if completion.code is not None else None
    return f"{completion.status.name} origin={origin} code={code} reason={completion.reason!r}"


# ============================================================================== shared actions
@dataclass(frozen=True, slots=True)
class Count:
    """Add ``n`` to event counter ``name`` (metrics, ``transfer_counters()``)."""

    name: str
    n: int = 1


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort kvt's side of ``transfer_id`` (P's send, D's receive); its completion follows."""

    transfer_id: str
    reason: str


# ============================================================================== shared events
@dataclass(frozen=True, slots=True)
class ShuttingDown:
    """The worker closes: P's parked pulls fail, D's pulls are aborted; nothing is reported."""
