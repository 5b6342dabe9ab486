"""What the connector's pure cores share: P's (``producer.py``) and D's (``consumer.py``) state
machines and the owner of P's blocks (``holds.py``): the actions and events more than one of them
emits or takes, and how a kvt completion reads in a log line. Pure: no I/O.
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
    """The worker closes: P's parked pulls fail, D's pulls are aborted; nothing is reported
    (the scheduler half's owner gives P's held blocks back at its own shutdown)."""


@dataclass(frozen=True, slots=True)
class Log:
    """Write one log line: ``logging`` ``level``, ``message`` %-formatted with ``args``. Pure cores
    return what to log; their shell writes it (to the logger named after the core's module)."""

    level: int
    message: str
    args: tuple[object, ...] = ()

    def text(self) -> str:
        return self.message % self.args if self.args else self.message
