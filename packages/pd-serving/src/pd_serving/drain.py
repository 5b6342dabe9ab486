"""Draining one instance: which of its streams to migrate when, and when it is drained (pure).

A drain takes an instance out of rotation (the router sends it nothing new from the moment the
drain starts), migrates the streams it serves to other D's, a few at a time, and reports the
instance drained once no call of the proxy's is open on it. The proxy's shell (``triggers.
Drains``) feeds it what happens and carries out what it answers; no sockets, no clock of its
own (``now`` comes in), so the tests drive it event by event::

    start --> DRAINING --no call open on the instance, no migration under way--> DRAINED
                 |  ^                                                               |
                 |  '--(a call opens again: a request sent back to it)---------------'
                 '--undrain--> RESUMED <--undrain-- DRAINED       (RESUMED: the end; the
                                                                   instance is routed again)

    one stream, while DRAINING:
      seen --> WAITING --next_migrations (at most ``concurrency`` MIGRATING at once)--> MIGRATING
      MIGRATING --moved--> (gone: it streams from another D now)
      MIGRATING --refused, attempts left--> WAITING (not before now + ``retry_after_s``)
      MIGRATING --refused, no attempt left / failed--> STAYS (finishes where it is)
      WAITING --no other D to migrate to--> STAYS
      WAITING, STAYS --the stream ended (left)--> (gone)

A refusal is retried because its usual cause is passing (the request is not admitted on the
instance yet); one that keeps being refused, a failed migration and a request with nowhere to
go finish on the instance, and the drain waits for them: drained means nothing runs there any
more, not that everything moved. Calls that cannot migrate at all (chat, a prompt the D
prefilled itself, a P's prefill) count in ``calls`` and are waited for the same way; the report
names them (``in_place``).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any


class DrainPhase(enum.StrEnum):
    DRAINING = "draining"
    DRAINED = "drained"
    RESUMED = "resumed"


class StreamPhase(enum.StrEnum):
    WAITING = "waiting"  # to migrate, once a slot is free and its retry time has come
    MIGRATING = "migrating"  # a migration was started
    STAYS = "stays"  # finishes on the instance


@dataclass
class _Stream:
    phase: StreamPhase = StreamPhase.WAITING
    attempts: int = 0
    not_before: float = 0.0
    reason: str = ""


@dataclass
class DrainConfig:
    concurrency: int = 4  # migrations under way at once
    max_attempts: int = 3  # migrations tried per stream (refusals are retried)
    retry_after_s: float = 0.2  # before a refused stream is tried again

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_attempts < 1 or self.retry_after_s < 0:
            raise ValueError("drain: concurrency and max_attempts >= 1, retry_after_s >= 0")


@dataclass
class Drain:
    """The drain of instance ``instance`` (the diagram above), started at ``started``."""

    instance: str
    started: float
    config: DrainConfig = field(default_factory=DrainConfig)
    migrate: bool = True  # False: nothing migrates (every D drains: the deployment stops)
    phase: DrainPhase = DrainPhase.DRAINING
    calls: int = 0  # the proxy's calls open on the instance (and requests routed to it)
    drained_at: float | None = None
    moved: int = 0
    failed: int = 0
    refusals: int = 0
    stayed: dict[str, int] = field(default_factory=dict)  # why -> streams that stay
    _streams: dict[Hashable, _Stream] = field(default_factory=dict)

    # -- what the shell sees ------------------------------------------------------------------
    def stream_seen(self, stream: Hashable, now: float) -> None:
        """A migratable stream is on the instance (there at the start, or registered since)."""
        if self.phase is DrainPhase.RESUMED or stream in self._streams:
            return
        entry = self._streams[stream] = _Stream(not_before=now)
        if not self.migrate:
            self._stay(entry, "nothing migrates: every instance drains")

    def stream_left(self, stream: Hashable, now: float) -> None:
        """The stream ended on the instance, or moved off it (one migrating waits for its
        migration's outcome: ``migration_ended``)."""
        entry = self._streams.get(stream)
        if entry is not None and entry.phase is StreamPhase.MIGRATING:
            return
        self._streams.pop(stream, None)
        self._settle(now)

    def calls_open(self, calls: int, now: float) -> None:
        """The proxy's count of calls open on the instance changed."""
        self.calls = calls
        self._settle(now)

    def tracked(self) -> list[Hashable]:
        """The streams the drain knows on the instance."""
        return list(self._streams)

    # -- migrations ---------------------------------------------------------------------------
    def next_migrations(self, now: float) -> list[Hashable]:
        """The streams to start migrating now (each becomes MIGRATING)."""
        if self.phase is not DrainPhase.DRAINING:
            return []
        busy = sum(s.phase is StreamPhase.MIGRATING for s in self._streams.values())
        out: list[Hashable] = []
        for key, entry in self._streams.items():
            if busy + len(out) >= self.config.concurrency:
                break
            if entry.phase is StreamPhase.WAITING and entry.not_before <= now:
                entry.phase = StreamPhase.MIGRATING
                entry.attempts += 1
                out.append(key)
        return out

    def no_target(self, stream: Hashable, reason: str, now: float) -> None:
        """There is no other D to migrate ``stream`` to: it stays."""
        entry = self._streams.get(stream)
        if entry is not None:
            self._stay(entry, reason)
        self._settle(now)

    def migration_ended(self, stream: Hashable, outcome: str, reason: str, now: float) -> None:
        """A migration started by ``next_migrations`` ended: ``moved``, ``refused``, ``failed``."""
        entry = self._streams.get(stream)
        if outcome == "moved":
            self.moved += 1
            self._streams.pop(stream, None)
        elif outcome == "refused":
            self.refusals += 1
            if entry is not None and entry.phase is StreamPhase.MIGRATING:
                if entry.attempts >= self.config.max_attempts:
                    self._stay(entry, f"refused: {reason}")
                else:
                    entry.phase = StreamPhase.WAITING
                    entry.not_before = now + self.config.retry_after_s
        else:
            self.failed += 1
            if entry is not None:
                self._stay(entry, f"failed: {reason}")
        self._settle(now)

    def wake_at(self) -> float | None:
        """When a waiting stream's retry time comes (None: nothing waits on time)."""
        if self.phase is not DrainPhase.DRAINING:
            return None
        times = [s.not_before for s in self._streams.values() if s.phase is StreamPhase.WAITING]
        return min(times, default=None)

    # -- the operator --------------------------------------------------------------------------
    def undrain(self) -> None:
        """Back in rotation; migrations under way end as they end, no new one starts."""
        self.phase = DrainPhase.RESUMED

    @property
    def done(self) -> bool:
        return self.phase is not DrainPhase.DRAINING

    def report(self, now: float) -> dict[str, Any]:
        streams = self._streams.values()
        tracked = len(self._streams)
        end = self.drained_at if self.drained_at is not None else now
        return {
            "instance": self.instance,
            "phase": self.phase.value,
            "elapsed_s": round(end - self.started, 4),
            "calls": self.calls,
            "waiting": sum(s.phase is StreamPhase.WAITING for s in streams),
            "migrating": sum(s.phase is StreamPhase.MIGRATING for s in streams),
            "staying": sum(s.phase is StreamPhase.STAYS for s in streams),
            # calls open that are no migratable stream: they finish where they are
            "in_place": max(0, self.calls - tracked),
            "moved": self.moved,
            "failed": self.failed,
            "refusals": self.refusals,
            "stayed": dict(self.stayed),
        }

    # -- internals -----------------------------------------------------------------------------
    def _stay(self, entry: _Stream, reason: str) -> None:
        if entry.phase is not StreamPhase.STAYS:
            entry.phase, entry.reason = StreamPhase.STAYS, reason
            self.stayed[reason] = self.stayed.get(reason, 0) + 1

    def _settle(self, now: float) -> None:
        migrating = any(s.phase is StreamPhase.MIGRATING for s in self._streams.values())
        if self.phase is DrainPhase.DRAINING and self.calls == 0 and not migrating:
            self.phase, self.drained_at = DrainPhase.DRAINED, now
        elif self.phase is DrainPhase.DRAINED and self.calls > 0:
            self.phase, self.drained_at = DrainPhase.DRAINING, None
