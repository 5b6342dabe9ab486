"""Rebalancing: when to migrate a stream off a D whose load is far above the others' (pure).

Fed, after every round of the health checker, each D's scraped load (vLLM's
``kv_cache_usage_perc`` and ``num_requests_waiting``) and how many migratable streams the proxy
has on it; answers one :class:`RebalanceDecision` per D that is hot (or one ``balanced`` when
none is). The shell (``triggers.Rebalancer``) migrates one stream per ``migrate`` decision and
counts every decision in ``/metrics``. ``now`` comes in; the tests use a fake clock.

A D's gap is its figure minus the mean of the other D's (those not draining, not excluded)::

    COOL --kv gap >= kv_gap  or  waiting gap >= waiting_gap--> HOT
    HOT  --kv gap < release * kv_gap  and  waiting gap < release * waiting_gap--> COOL

    HOT, each round: cooldown (a stream moved off it within cooldown_s) -> skip "cooldown"
                     no migratable stream on it -> skip "no_stream"
                     no other D cooler than it by the gap -> skip "no_target"
                     max_per_interval migrations within interval_s already -> skip "rate_limited"
                     else -> "migrate" one stream to the least-loaded other D

The two thresholds (hysteresis) keep a D near the line from flapping in and out; the cool-down
lets the move show in the next scrapes before another; the limit per interval bounds what a
burst of bad figures can do. Fewer than two D's: ``too_few``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Verdict(enum.StrEnum):
    MIGRATE = "migrate"
    BALANCED = "balanced"
    COOLDOWN = "cooldown"
    NO_STREAM = "no_stream"
    NO_TARGET = "no_target"
    RATE_LIMITED = "rate_limited"
    TOO_FEW = "too_few"


@dataclass(frozen=True)
class DecodeLoad:
    kv_usage: float = 0.0  # 0..1
    waiting: int = 0
    streams: int = 0  # migratable streams the proxy has on it


@dataclass(frozen=True)
class RebalanceConfig:
    kv_gap: float = 0.3  # KV usage above the others' mean that makes a D hot
    waiting_gap: float = 4.0  # waiting requests above the others' mean that make it hot
    release: float = 0.5  # hot until both gaps fall under this share of their thresholds
    max_per_interval: int = 2  # migrations at most within interval_s, over all D's
    interval_s: float = 10.0
    cooldown_s: float = 10.0  # per source D, after a stream moved off it

    def __post_init__(self) -> None:
        if self.kv_gap <= 0 or self.waiting_gap <= 0 or not 0 <= self.release <= 1:
            raise ValueError("rebalance: gaps > 0, 0 <= release <= 1")
        if self.max_per_interval < 1 or self.interval_s <= 0 or self.cooldown_s < 0:
            raise ValueError("rebalance: max_per_interval >= 1, interval_s > 0, cooldown_s >= 0")


@dataclass(frozen=True)
class RebalanceDecision:
    verdict: Verdict
    source: str = ""
    target: str = ""
    detail: str = ""


@dataclass
class RebalancePolicy:
    config: RebalanceConfig = field(default_factory=RebalanceConfig)
    hot: set[str] = field(default_factory=set)
    _moved_at: list[float] = field(default_factory=list)  # within the last interval
    _last_move: dict[str, float] = field(default_factory=dict)  # source -> time

    def decide(self, now: float, loads: dict[str, DecodeLoad]) -> list[RebalanceDecision]:
        """One round: ``loads`` of the D's that take requests (not draining)."""
        cfg = self.config
        self.hot &= set(loads)
        if len(loads) < 2:
            return [RebalanceDecision(Verdict.TOO_FEW)]
        self._moved_at = [t for t in self._moved_at if now - t < cfg.interval_s]
        out: list[RebalanceDecision] = []
        # Hottest first: when the limit bites, the worst D got the move.
        for key in sorted(loads, key=lambda k: self._gaps(k, loads), reverse=True):
            kv, waiting = self._gaps(key, loads)
            if key in self.hot:
                if kv < cfg.release * cfg.kv_gap and waiting < cfg.release * cfg.waiting_gap:
                    self.hot.discard(key)
                    continue
            elif kv >= cfg.kv_gap or waiting >= cfg.waiting_gap:
                self.hot.add(key)
            else:
                continue
            out.append(
                self._decide_hot(now, key, loads, f"kv gap {kv:.2f}, waiting gap {waiting:g}")
            )
        return out or [RebalanceDecision(Verdict.BALANCED)]

    def _decide_hot(
        self, now: float, key: str, loads: dict[str, DecodeLoad], detail: str
    ) -> RebalanceDecision:
        cfg = self.config
        last = self._last_move.get(key)
        if last is not None and now - last < cfg.cooldown_s:
            return RebalanceDecision(Verdict.COOLDOWN, key, detail=detail)
        if loads[key].streams == 0:
            return RebalanceDecision(Verdict.NO_STREAM, key, detail=detail)
        target = self._target(key, loads)
        if target is None:
            return RebalanceDecision(Verdict.NO_TARGET, key, detail=detail)
        if len(self._moved_at) >= cfg.max_per_interval:
            return RebalanceDecision(Verdict.RATE_LIMITED, key, target, detail)
        self._moved_at.append(now)
        self._last_move[key] = now
        return RebalanceDecision(Verdict.MIGRATE, key, target, detail)

    def _target(self, key: str, loads: dict[str, DecodeLoad]) -> str | None:
        """The least-loaded other D, if it is cooler than ``key`` by a whole threshold."""
        cfg, src = self.config, loads[key]
        best: tuple[float, str] | None = None
        for other, load in loads.items():
            if other == key or other in self.hot:
                continue
            if src.kv_usage - load.kv_usage < cfg.kv_gap and src.waiting - load.waiting < (
                cfg.waiting_gap
            ):
                continue
            score = load.kv_usage + load.waiting / cfg.waiting_gap * cfg.kv_gap
            if best is None or (score, other) < best:
                best = (score, other)
        return best[1] if best else None

    @staticmethod
    def _gaps(key: str, loads: dict[str, DecodeLoad]) -> tuple[float, float]:
        others = [load for k, load in loads.items() if k != key]
        mean_kv = sum(o.kv_usage for o in others) / len(others)
        mean_waiting = sum(o.waiting for o in others) / len(others)
        return loads[key].kv_usage - mean_kv, loads[key].waiting - mean_waiting
