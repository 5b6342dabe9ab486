"""Fault plans for the tests and the reliability benchmark: scripted and seeded random ones.

The hook they plug into (:class:`kvt.faults.FaultPlan`, consulted by the backends given
``faults=``) is kvt's; the plans are the tests' own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvt.faults import CORRUPT_FIELDS, Fault, FaultKind, FaultPlan, FrameInfo


@dataclass
class Rule:
    """Matches DATA frames; every field left None matches anything. Fires ``times`` times."""

    fault: Fault
    nth: int | None = None  # the n-th DATA frame from the engine to the peer (1-based)
    peer: str | None = None  # substring of the peer label
    engine: str | None = None
    request_id: str | None = None
    last: bool | None = None
    times: int = 1

    def matches(self, frame: FrameInfo) -> bool:
        return (
            self.times > 0
            and (self.nth is None or frame.index == self.nth)
            and (self.peer is None or self.peer in frame.peer)
            and (self.engine is None or self.engine == frame.engine)
            and (self.request_id is None or self.request_id == frame.request_id)
            and (self.last is None or self.last == frame.last)
        )


class ScriptedFaults(FaultPlan):
    """Faults at frames named in advance: ``ScriptedFaults(Rule(Fault(DROP), nth=3, peer="D"))``."""

    def __init__(self, *rules: Rule) -> None:
        super().__init__()
        self.rules = list(rules)

    def decide(self, frame: FrameInfo) -> Fault | None:
        for rule in self.rules:
            if rule.matches(frame):
                rule.times -= 1
                return rule.fault
        return None


@dataclass
class FaultRates:
    """Per-DATA-frame probability of each kind (RandomFaults)."""

    drop: float = 0.0
    drop_mid: float = 0.0
    stall: float = 0.0
    corrupt: float = 0.0
    stall_s: tuple[float, float] = (0.001, 0.01)
    corrupt_fields: tuple[str, ...] = field(default=CORRUPT_FIELDS)


class RandomFaults(FaultPlan):
    """Seeded random faults; the same seed and the same frame order give the same faults."""

    def __init__(self, rates: FaultRates, seed: int = 0) -> None:
        super().__init__()
        self.rates = rates
        self._rng = random.Random(seed)

    def decide(self, frame: FrameInfo) -> Fault | None:
        rates, x = self.rates, self._rng.random()
        for kind, rate in (
            (FaultKind.DROP, rates.drop),
            (FaultKind.DROP_MID, rates.drop_mid),
            (FaultKind.CORRUPT, rates.corrupt),
            (FaultKind.STALL, rates.stall),
        ):
            if x < rate:
                if kind is FaultKind.CORRUPT:
                    return Fault(kind, field=self._rng.choice(rates.corrupt_fields))
                if kind is FaultKind.STALL:
                    return Fault(kind, stall_s=self._rng.uniform(*rates.stall_s))
                return Fault(kind)
            x -= rate
        return None
