"""Errors typed by who is at fault: the local caller, the remote peer, or the transport.

RpcError
├── CallerError          the local caller passed a bad argument or used a closed object
├── PeerError            the remote side misbehaved
│   ├── ProtocolError    malformed frame / protocol violation (the connection is closed)
│   │   └── BufferLimitExceeded  incomplete frames over the receiver's buffer budget (closed)
│   └── RemoteError      the remote handler raised, rejected the request, or the head is unknown
└── TransportError       the network between us failed
    ├── ConnectionLost   the connection dropped (every pending call on it fails with this)
    │   └── ConnectError the (re)connect itself failed
    └── RpcTimeout       the per-call timeout expired (also a builtin TimeoutError)
"""

from __future__ import annotations


class RpcError(Exception):
    """Base class of every error raised by simple_rpc."""


class CallerError(RpcError):
    """The local caller is at fault: wrong request type, bad argument, object already closed."""


class PeerError(RpcError):
    """The remote peer is at fault."""


class ProtocolError(PeerError):
    """The bytes from the peer are malformed (bad length, oversized frame, wrong answer head).

    `frames` holds the well-formed frames decoded from the same input before the malformed one, so a
    receiver can still act on everything it accepted before closing the connection.
    """

    def __init__(self, reason: str, *, peer: str | None = None) -> None:
        super().__init__(reason if peer is None else f"{reason} (peer {peer})")
        self.reason = reason
        self.peer = peer
        self.frames: list = []


class BufferLimitExceeded(ProtocolError):
    """The bytes of incomplete frames would take the receiver's buffer budget (shared by all of
    a server's connections) over its limit: the receiver refuses this peer's stream and closes
    the connection, as for a malformed frame."""


class RemoteError(PeerError):
    """The remote side answered the call with an error response.

    kind: "handler_error" (the remote handler raised; `remote_message` carries its message),
          "unknown_head" (no method registered for the request head),
          "bad_request" (the request body did not decode as the method's request type).
    """

    def __init__(self, kind: str, remote_message: str, *, method: str, peer: str) -> None:
        super().__init__(f"{method} at {peer} failed remotely ({kind}): {remote_message}")
        self.kind = kind
        self.remote_message = remote_message
        self.method = method
        self.peer = peer


class TransportError(RpcError):
    """The transport failed; neither side is known to be at fault."""


class ConnectionLost(TransportError):
    """The connection dropped (or was closed locally) while the call was pending."""


class ConnectError(ConnectionLost):
    """Connecting (or reconnecting) to the server failed."""


class RpcTimeout(TransportError, TimeoutError):
    """The call did not complete within its timeout; a late response is dropped."""
