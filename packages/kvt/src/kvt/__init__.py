"""KV-cache transport: access, control and data-plane layers.

    from kvt import TransferEngine, Completion, TransferStatus, AbortOrigin, KvtError

See README.md for the walk-through, the frame format and the benchmark.
"""

from kvt.access import CpuLayerEvents, CudaLayerEvents, LayerEvents, RegionTable
from kvt.backend import DataPlaneBackend
from kvt.engine import TransferEngine
from kvt.errors import (
    CallerError,
    EngineClosedError,
    InvalidBlocksError,
    InvalidRegionError,
    KvtError,
    PeerError,
    ProtocolViolation,
    RequestStateError,
    TransportError,
)
from kvt.outcome import AbortCode, AbortOrigin, Completion, TransferStatus
from kvt.tcp import TcpBackend

__version__ = "0.1.0"

__all__ = [
    "AbortCode",
    "AbortOrigin",
    "CallerError",
    "Completion",
    "CpuLayerEvents",
    "CudaLayerEvents",
    "DataPlaneBackend",
    "EngineClosedError",
    "InvalidBlocksError",
    "InvalidRegionError",
    "KvtError",
    "LayerEvents",
    "PeerError",
    "ProtocolViolation",
    "RegionTable",
    "RequestStateError",
    "TcpBackend",
    "TransferEngine",
    "TransferStatus",
    "TransportError",
    "__version__",
]
