"""Errors raised by kvt, typed by who is at fault: the local caller or the remote peer.

KvtError
├── CallerError            bad argument from the local caller (also a ValueError)
│   ├── InvalidRegionError     object cannot be registered / unknown region id
│   ├── InvalidBlocksError     blocks outside registered source regions, wrong dtype
│   │   └── DeviceMemoryError      host bytes asked of a device (e.g. CUDA) region
│   ├── RequestStateError      e.g. send() after the last batch, expect() twice
│   └── EngineClosedError      the engine is closed
└── PeerError              the remote peer misbehaved
    └── ProtocolViolation      malformed frame (the connection is closed)

A failing transport (connect refused, connection lost) raises nothing: the requests on it complete
ABORTED with origin TRANSPORT (see kvt.outcome).
"""

from __future__ import annotations


class KvtError(Exception):
    """Base class of every error raised by kvt."""


class CallerError(KvtError, ValueError):
    """The local caller is at fault."""


class InvalidRegionError(CallerError):
    """The object cannot be registered as a region, or the region id is unknown."""


class InvalidBlocksError(CallerError):
    """IpcBlocks that do not fit the local registered regions, or an array of the wrong dtype."""


class DeviceMemoryError(InvalidBlocksError):
    """Host bytes were asked of a region in device memory (it has no host view; kvt.staging
    copies through pinned host memory instead)."""


class RequestStateError(CallerError):
    """The call does not fit the request's state (send after last batch, expect twice, ...)."""


class EngineClosedError(CallerError):
    """The engine was closed."""


class PeerError(KvtError):
    """The remote peer is at fault."""


class ProtocolViolation(PeerError):
    """The bytes from the peer do not form valid kvt frames. Fatal for that connection only."""
