"""simple_rpc: a 4-byte-head request/response RPC over asyncio (uvloop when installed).

    PING = Method("ping", request_head=0x53520010, response_head=0x53528010,
                  request_type=Ping, response_type=Ping)
    server = Server(); server.register(PING, on_ping); await server.start("127.0.0.1", 0)
    client = Client(server.address); pong = await client.call(PING, Ping(1), timeout=1.0)

See README.md for the wire format and the design.
"""

from .client import Client
from .errors import (
    BufferLimitExceeded,
    CallerError,
    ConnectError,
    ConnectionLost,
    PeerError,
    ProtocolError,
    RemoteError,
    RpcError,
    RpcTimeout,
    TransportError,
)
from .loop_thread import LoopThread, SyncClient, new_event_loop
from .method import CallContext, Method
from .server import Server
from .wire import (
    DEFAULT_MAX_FRAME_SIZE,
    ERROR_RESP,
    HEADER_SIZE,
    BufferBudget,
    ErrorBody,
    Frame,
    FrameDecoder,
    encode_frame,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "ERROR_RESP",
    "HEADER_SIZE",
    "BufferBudget",
    "BufferLimitExceeded",
    "CallContext",
    "CallerError",
    "Client",
    "ConnectError",
    "ConnectionLost",
    "ErrorBody",
    "Frame",
    "FrameDecoder",
    "LoopThread",
    "Method",
    "PeerError",
    "ProtocolError",
    "RemoteError",
    "RpcError",
    "RpcTimeout",
    "Server",
    "SyncClient",
    "TransportError",
    "__version__",
    "encode_frame",
    "new_event_loop",
]
