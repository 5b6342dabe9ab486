"""Request outcomes shared by every layer: status, abort origin and reason codes, the Completion."""

from __future__ import annotations

import enum

import msgspec


class TransferStatus(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    ABORTED = "aborted"


class AbortOrigin(enum.Enum):
    """Which side decided the abort first (who to look at when debugging)."""

    LOCAL = "local"  # this engine's caller (abort(), close()) or this engine's own validation
    PEER = "peer"  # the other engine aborted, or sent something this engine rejected
    TIMEOUT = "timeout"  # the request's deadline passed on this engine
    TRANSPORT = "transport"  # the connection failed


class AbortCode(enum.IntEnum):
    """Machine-readable reason, carried in ABORT frames (u8 on the wire)."""

    CALLER_ABORT = 1  # someone called abort()
    TIMEOUT = 2  # a deadline passed
    CONNECTION_LOST = 3  # the TCP connection died (peer killed, reset)
    BAD_BLOCK = 4  # a block falls outside the receiver's registered writable regions
    UNKNOWN_REQUEST = 5  # data for a request id the receiver does not expect
    PROTOCOL_ERROR = 6  # malformed frame
    ENGINE_CLOSED = 7  # the engine was closed with the request still open
    CONNECT_FAILED = 8  # could not reach the peer's data address


class Completion(msgspec.Struct, frozen=True):
    """The one final outcome of a request on one engine (one per request and side)."""

    request_id: str
    role: str  # "send" or "recv"
    status: TransferStatus
    origin: AbortOrigin | None = None
    code: AbortCode | None = None
    reason: str = ""
    nbytes: int = 0  # payload bytes moved for this request on this side
    peer: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE
