"""KV-cache transport: access, control and data-plane layers.

    from kvt import TransferEngine, Completion, TransferStatus, AbortOrigin, KvtError

See README.md for the walk-through, the frame format and the benchmark.
"""

from typing import Any

from kvt.access import CpuLayerEvents, CudaLayerEvents, DeviceMemory, LayerEvents, RegionTable
from kvt.backend import DataPlaneBackend
from kvt.engine import Engine
from kvt.errors import (
    CallerError,
    DeviceMemoryError,
    EngineClosedError,
    InvalidBlocksError,
    InvalidRegionError,
    KvtError,
    PeerError,
    ProtocolViolation,
    RequestStateError,
)
from kvt.memory import InMemoryBackend
from kvt.metrics import EngineStats, StageStats
from kvt.outcome import AbortCode, AbortOrigin, Completion, TransferStatus
from kvt.tcp import TcpBackend

__version__ = "0.1.0"


class TransferEngine(Engine):
    """The engine (:class:`kvt.engine.Engine`) on a TCP data plane unless given another backend.

    ``host``/``port``: where the default TCP backend listens (port 0: any free port); ignored when
    ``backend`` is given. The engine owns the backend either way and closes it in :meth:`close`.
    ``transport``: the default TCP backend's payload path, "auto" (env ``KVT_TRANSPORT``, else
    auto: samehost on one host, rdma where both ends have a device, tcp otherwise), or one of
    "tcp", "samehost", "rdma" forced (a link that cannot use it fails, its requests ABORTED
    with origin TRANSPORT and the reason; no fallback). See README "Data paths".
    ``engine_options``: further keywords of :class:`kvt.engine.Engine`, passed through.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "kvt",
        *,
        default_timeout_s: float = 60.0,
        backend: DataPlaneBackend | None = None,
        transport: str | None = None,
        **engine_options: Any,
    ) -> None:
        # The TCP backend binds its listener first: if that fails, no thread has been started yet.
        if backend is None:
            backend = TcpBackend(host, port, name=name, transport=transport)
        elif transport is not None:
            raise ValueError("transport= applies to the default TCP backend, not a given one")
        super().__init__(backend, name=name, default_timeout_s=default_timeout_s, **engine_options)


__all__ = [
    "AbortCode",
    "AbortOrigin",
    "CallerError",
    "Completion",
    "CpuLayerEvents",
    "CudaLayerEvents",
    "DataPlaneBackend",
    "DeviceMemory",
    "DeviceMemoryError",
    "Engine",
    "EngineClosedError",
    "EngineStats",
    "InMemoryBackend",
    "InvalidBlocksError",
    "InvalidRegionError",
    "KvtError",
    "LayerEvents",
    "PeerError",
    "ProtocolViolation",
    "RegionTable",
    "RequestStateError",
    "StageStats",
    "TcpBackend",
    "TransferEngine",
    "TransferStatus",
    "__version__",
]
