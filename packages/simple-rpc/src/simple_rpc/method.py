"""Method descriptors: a name, a request head and a response head, and the two body types.

Each package defines its own Methods, with its own heads, in its own `protocol.py`; simple_rpc
reserves only ERROR_RESP. Head ranges by convention, so that heads never collide across packages:

    0x4B56xxxx  kvt                0x4843xxxx  hybrid-connector
    0x5253xxxx  refstore           0x5352xxxx  simple-rpc's own (tests, benchmarks)
    0x20181218 / 0x81218102        hybrid-connector's SEND_DONE (the mission's heads)
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from .errors import CallerError
from .wire import CALL_ID_SIZE, ERROR_RESP, HEADER, HEADER_SIZE

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_RAW_TYPES = (bytes, bytearray, memoryview)
# One encoder serves every type (msgspec encoders are not type-specific); decoders are per type.
_ENCODER = msgspec.msgpack.Encoder()
_pack_header_into = HEADER.pack_into
_pack_header = HEADER.pack
# Raw payloads up to this size are copied behind their header into one write; larger ones are
# written as a separate buffer so they are never copied by us.
_CONCAT_RAW_BELOW = 16 * 1024


class _Codec:
    """Encodes one body type into frames and decodes payloads back (raw bytes bypass msgspec)."""

    __slots__ = ("check_type", "decode", "is_raw", "type")

    def __init__(self, body_type: Any) -> None:
        self.type = body_type
        self.is_raw = body_type is bytes
        if self.is_raw:
            self.decode = _identity
            self.check_type: tuple[type, ...] | None = _RAW_TYPES
        else:
            try:
                self.decode = msgspec.msgpack.Decoder(body_type).decode
            except TypeError as err:
                raise CallerError(f"{body_type!r} is not a type msgspec can decode: {err}") from err
            # Structs and plain classes are checked with isinstance; generic aliases
            # (list[int], ...) are left to msgspec's encoder.
            self.check_type = (body_type,) if isinstance(body_type, type) else None

    def frame(self, head: int, call_id: int, body: Any) -> tuple[bytes | bytearray, Any]:
        """The frame as (first buffer, optional second buffer to write after it)."""
        if self.is_raw:
            size = len(body) if not isinstance(body, memoryview) else body.nbytes
            header = _pack_header(head, size + CALL_ID_SIZE, call_id)
            if size < _CONCAT_RAW_BELOW:
                return header + body, None
            return header, body
        buf = bytearray(HEADER_SIZE)
        _ENCODER.encode_into(body, buf, HEADER_SIZE)
        _pack_header_into(buf, 0, head, len(buf) - 8, call_id)
        return buf, None


def _identity(payload: memoryview) -> memoryview:
    return payload


def _check_head(name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise CallerError(f"{name} must be an unsigned 32-bit int, got {value!r}")
    if value == ERROR_RESP:
        raise CallerError(f"{name} 0x{value:08x} is reserved by simple_rpc (ERROR_RESP)")


class Method(Generic[Req, Resp]):
    """One RPC method. A body type of `bytes` means a raw body: sent as given (bytes, bytearray or
    memoryview), received as a memoryview, never touched by msgspec.

        PING = Method("ping", request_head=0x53520010, response_head=0x53528010,
                      request_type=Ping, response_type=Ping)
    """

    __slots__ = ("name", "request", "request_head", "response", "response_head")

    def __init__(
        self,
        name: str,
        request_head: int,
        response_head: int,
        request_type: type[Req] | Any,
        response_type: type[Resp] | Any,
    ) -> None:
        _check_head("request_head", request_head)
        _check_head("response_head", response_head)
        if request_head == response_head:
            raise CallerError(f"method {name}: request_head and response_head must differ")
        self.name = name
        self.request_head = request_head
        self.response_head = response_head
        self.request = _Codec(request_type)
        self.response = _Codec(response_type)

    @property
    def request_type(self) -> Any:
        return self.request.type

    @property
    def response_type(self) -> Any:
        return self.response.type

    def check_request(self, request: Any) -> None:
        """Raise CallerError unless `request` is of this method's request type."""
        allowed = self.request.check_type
        if allowed is not None and not isinstance(request, allowed):
            raise CallerError(
                f"{self.name}: request must be {_type_name(self.request.type)}, "
                f"got {type(request).__name__}"
            )

    def __repr__(self) -> str:
        return (
            f"Method({self.name!r}, request_head=0x{self.request_head:08x}, "
            f"response_head=0x{self.response_head:08x})"
        )


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", repr(tp))


def encode_value(value: Any) -> bytes:
    return _ENCODER.encode(value)


class CallContext:
    """What a handler learns about the call besides its request."""

    __slots__ = ("_connection", "call_id", "method", "peer")

    def __init__(
        self, peer: str, method: Method, call_id: int, connection: Any | None = None
    ) -> None:
        self.peer = peer  # "host:port" of the caller
        self.method = method
        self.call_id = call_id
        self._connection = connection  # the server's connection (its ``closing`` flag)

    @property
    def connected(self) -> bool:
        """Whether the caller's connection is still open. A handler that awaited may find it
        gone: its answer is then dropped, and state it would keep for the caller (a hold, a
        subscription) has nobody left to end it."""
        return self._connection is None or not self._connection.closing

    def __repr__(self) -> str:
        return (
            f"CallContext(peer={self.peer!r}, method={self.method.name!r}, call_id={self.call_id})"
        )
