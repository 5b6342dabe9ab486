"""Per-engine prometheus metrics on the engine's own CollectorRegistry (many per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_STAGE_BUCKETS = (
    1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class EngineMetrics:
    def __init__(self, engine_name: str) -> None:
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
            "Time per stage: queue (send() to its first frame), wire (one sent frame, up to "
            "32 MiB), recv_chunk (one received chunk, up to 8 MiB), notify (completion decided "
            "to callback run), transfer (request start to completion)",
            ["stage"], buckets=_STAGE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.active = Gauge(
            "kvt_active_requests", "Requests not yet completed", ["role"], registry=self.registry
        )
        self.info = Gauge("kvt_engine_info", "Engine identity", ["engine"], registry=self.registry)
        self.info.labels(**labels).set(1)

    def text(self) -> bytes:
        return generate_latest(self.registry)
