"""Per-engine prometheus metrics on the engine's own CollectorRegistry (many per process).

:meth:`EngineMetrics.snapshot` reads the same registry back into typed figures (``engine.stats()``),
so the snapshot and the Prometheus text can never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_STAGE_BUCKETS = (
    1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# Stages kvt observes itself, and those a caller times through ``Engine.timed_stage``.
ENGINE_STAGES = ("compute_wait", "queue", "wire", "recv_chunk", "notify", "transfer")
CALLER_STAGES = ("parse",)
STAGES = (*CALLER_STAGES, *ENGINE_STAGES)
NO_PATH = "none"  # path label of what happens off any link (parse; a request that never had one)


@dataclass(frozen=True, slots=True)
class StageStats:
    """One (stage, path) histogram; p50/p99 are estimated from its buckets (see quantile)."""

    count: int
    sum_s: float
    mean_s: float
    p50_s: float
    p99_s: float


@dataclass(frozen=True, slots=True)
class EngineStats:
    """``engine.stats()``: a consistent read of the engine's metrics at one moment."""

    engine: str
    stages: dict[tuple[str, str], StageStats]  # (stage, path) -> figures; only observed pairs
    bytes: dict[str, int]  # direction ("sent", "received") -> payload bytes
    requests: dict[tuple[str, str], int]  # (role, status) -> completed requests
    aborts: dict[tuple[str, str], int]  # (role, origin) -> aborted requests
    active: dict[str, int]  # role -> requests not yet completed

    def stage(self, stage: str, path: str) -> StageStats | None:
        return self.stages.get((stage, path))


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus ``histogram_quantile``: cumulative (upper bound, count) pairs, linear within
    the bucket the rank falls in; a rank in the +Inf bucket gives the last finite bound."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower_bound
            if cumulative == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                cumulative - lower_count
            )
        lower_bound, lower_count = bound, cumulative
    return lower_bound


class EngineMetrics:
    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"engine": engine_name}
        self.bytes = Counter(
            "kvt_bytes", "Payload bytes moved", ["direction"], registry=self.registry
        )
        self.requests = Counter(
            "kvt_requests", "Requests completed, by side and final status", ["role", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.aborts = Counter(
            "kvt_aborts", "Aborted requests by side and origin", ["role", "origin"],
            registry=self.registry,
        )  # fmt: skip
        self.stage = Histogram(
            "kvt_stage_seconds",
            "Time per stage and payload path: parse (the caller turning its layout into "
            "IpcBlocks), compute_wait (send(after=...) to its layer event), queue (send() or the "
            "layer event to the request's first frame), wire (one sent frame, up to 32 MiB), "
            "recv_chunk (one received chunk, up to 8 MiB), notify (completion decided to "
            "callback run), transfer (request start to completion)",
            ["stage", "path"], buckets=_STAGE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.active = Gauge(
            "kvt_active_requests", "Requests not yet completed", ["role"], registry=self.registry
        )
        self.info = Gauge("kvt_engine_info", "Engine identity", ["engine"], registry=self.registry)
        self.info.labels(**labels).set(1)

    def observe(self, stage: str, path: str, seconds: float) -> None:
        self.stage.labels(stage=stage, path=path).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> EngineStats:
        """Typed figures read back from the registry (the same samples ``text()`` prints)."""
        stage_buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
        stage_count: dict[tuple[str, str], float] = {}
        stage_sum: dict[tuple[str, str], float] = {}
        moved: dict[str, int] = {}
        requests: dict[tuple[str, str], int] = {}
        aborts: dict[tuple[str, str], int] = {}
        active: dict[str, int] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, sample.value
                if name.startswith("kvt_stage_seconds"):
                    key = (labels["stage"], labels["path"])
                    if name.endswith("_bucket"):
                        stage_buckets.setdefault(key, []).append((float(labels["le"]), value))
                    elif name.endswith("_count"):
                        stage_count[key] = value
                    elif name.endswith("_sum"):
                        stage_sum[key] = value
                elif name == "kvt_bytes_total":
                    moved[labels["direction"]] = int(value)
                elif name == "kvt_requests_total":
                    requests[(labels["role"], labels["status"])] = int(value)
                elif name == "kvt_aborts_total":
                    aborts[(labels["role"], labels["origin"])] = int(value)
                elif name == "kvt_active_requests":
                    active[labels["role"]] = int(value)
        stages = {}
        for key, count in stage_count.items():
            if not count:
                continue
            buckets = sorted(stage_buckets.get(key, []))
            total = stage_sum.get(key, 0.0)
            stages[key] = StageStats(
                int(count), total, total / count, quantile(0.5, buckets), quantile(0.99, buckets)
            )
        return EngineStats(self.engine_name, stages, moved, requests, aborts, active)
