"""async Client: many concurrent calls multiplexed over one TCP connection by call id."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from ._util import WriteBatcher, format_address, parse_address, set_nodelay
from .errors import (
    CallerError,
    ConnectError,
    ConnectionLost,
    ProtocolError,
    RemoteError,
    RpcTimeout,
)
from .method import Method
from .wire import DEFAULT_MAX_FRAME_SIZE, ERROR_RESP, MAX_CALL_ID, ErrorBody, FrameDecoder

logger = logging.getLogger("simple_rpc.client")

Resp = TypeVar("Resp")
_decode_error_body = msgspec.msgpack.Decoder(ErrorBody).decode
_BODY_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)


class Client:
    """Calls Methods on one server over one connection, opened lazily on the first call.

    Concurrent calls share the connection: each request carries a fresh call id and the answer
    that echoes it completes that call, whatever the order. When the connection drops, every
    pending call fails at once with ConnectionLost; the next call opens a new connection.
    All methods must be called from the event loop the client is used on (see SyncClient for
    callers in plain threads).
    """

    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        connect_timeout: float | None = 10.0,
    ) -> None:
        self._host, self._port = parse_address(address)
        self.address = format_address((self._host, self._port))
        FrameDecoder(max_frame_size)  # validates the argument
        self.max_frame_size = max_frame_size
        self.connect_timeout = connect_timeout
        self._conn: _ClientConnection | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._closed = False
        self._connections_opened = 0
        # The number of the connection up now (1 for the first, then 2, ...), 0 while none is:
        # a plain attribute, so that one read tells whether the connection of some earlier
        # moment is still the one in use (kept together with ``_conn``).
        self.connection = 0

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def connections_opened(self) -> int:
        """How many connections this client has opened: it changes when the connection is
        replaced, e.g. for state the server keeps per connection (``Server(on_disconnect=)``)."""
        return self._connections_opened

    @property
    def closed(self) -> bool:
        return self._closed

    async def connect(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 (contract API)
        """Open the connection now instead of on the first call (optional)."""
        await self._ensure_connected(timeout)

    async def call(
        self,
        method: Method[Any, Resp],
        request: Any,
        timeout: float | None = None,  # noqa: ASYNC109 (per-call timeout: contract API)
    ) -> Resp:
        """Send `request` and wait for the answer (a `method.response_type` instance).

        Raises CallerError (bad request / closed client), RemoteError (handler raised, unknown
        head, request rejected), ProtocolError (malformed answer), ConnectionLost (connection
        dropped or could not be opened), RpcTimeout (no answer within `timeout` seconds; the
        time spent connecting counts).
        """
        if self._closed:
            raise CallerError(f"client for {self.address} is closed")
        method.check_request(request)
        conn = self._conn
        if conn is None:
            if timeout is None:
                conn = await self._ensure_connected(None)
            else:
                loop = asyncio.get_running_loop()
                started = loop.time()
                conn = await self._ensure_connected(timeout)
                timeout = max(0.0, timeout - (loop.time() - started))
        if conn.write_paused:
            await conn.wait_writable()
        call_id, future = conn.start_call(method, request, timeout)
        try:
            return await future
        except asyncio.CancelledError:
            conn.forget(call_id)
            raise

    def start_call_nowait(
        self, method: Method[Any, Resp], request: Any, timeout: float | None = None
    ) -> asyncio.Future[Resp] | None:
        """Issue the call now and return its future, or None when not connected (then use
        `call()`). For callers that bridge threads without creating a Task per call."""
        if self._closed:
            raise CallerError(f"client for {self.address} is closed")
        conn = self._conn
        if conn is None or conn.write_paused:
            return None
        method.check_request(request)
        return conn.start_call(method, request, timeout)[1]

    async def _ensure_connected(self, timeout: float | None) -> _ClientConnection:  # noqa: ASYNC109 (contract API)
        if self.connect_timeout is not None:
            timeout = (
                self.connect_timeout if timeout is None else min(timeout, self.connect_timeout)
            )
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout), self._connect_lock:
                # One connect attempt at a time; callers that waited reuse its result.
                if self._conn is not None:
                    return self._conn
                if self._closed:
                    raise CallerError(f"client for {self.address} is closed")
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self), self._host, self._port
                )
        except TimeoutError as err:
            raise RpcTimeout(f"connecting to {self.address} timed out after {timeout}s") from err
        except OSError as err:
            raise ConnectError(f"cannot connect to {self.address}: {err}") from err
        if self._closed:
            conn.abort("client closed while connecting")
            raise CallerError(f"client for {self.address} is closed")
        self._conn = conn
        self._connections_opened += 1
        self.connection = self._connections_opened
        return conn

    async def close(self) -> None:
        """Close the connection; pending calls fail with ConnectionLost. Idempotent."""
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        self._conn = None
        self.connection = 0
        if conn is not None:
            conn.abort("client closed")
            await conn.closed

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _ClientConnection(asyncio.Protocol):
    def __init__(self, client: Client) -> None:
        self.client = client
        self.address = client.address
        self.max_frame_size = client.max_frame_size
        self.decoder = FrameDecoder(client.max_frame_size)
        self.loop = asyncio.get_running_loop()
        # call id -> (future, method, timeout handle or None)
        self.pending: dict[int, tuple[asyncio.Future, Method, asyncio.TimerHandle | None]] = {}
        self.next_call_id = 0
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.lost_reason = "closed by the peer"
        self.write_paused = False
        self._write_waiters: list[asyncio.Future[None]] = []

    # -- issuing calls -------------------------------------------------------------------
    def start_call(
        self, method: Method, request: Any, timeout: float | None
    ) -> tuple[int, asyncio.Future]:
        pending = self.pending
        call_id = (self.next_call_id + 1) & MAX_CALL_ID
        while call_id in pending:  # only after 2**32 calls with one still pending
            call_id = (call_id + 1) & MAX_CALL_ID
        self.next_call_id = call_id
        try:
            first, second = method.request.frame(method.request_head, call_id, request)
        except (TypeError, ValueError, msgspec.EncodeError) as err:
            raise CallerError(f"{method.name}: cannot encode request: {err}") from err
        size = len(first) - 8 + (0 if second is None else memoryview(second).nbytes)
        if size > self.max_frame_size:
            raise CallerError(
                f"{method.name}: request frame of {size} bytes is over "
                f"max_frame_size {self.max_frame_size}"
            )
        future = self.loop.create_future()
        timer = None if timeout is None else self.loop.call_later(timeout, self._expire, call_id)
        # Batched: requests issued in the same loop iteration go out in one write. (Writing at
        # once when nothing is pending looks cheaper for a lone call but splits every batch:
        # after a burst of answers the first re-issued call would go out alone.)
        self.writer.write(first)
        if second is not None:
            self.writer.write(second)
        pending[call_id] = (future, method, timer)
        return call_id, future

    def forget(self, call_id: int) -> None:
        entry = self.pending.pop(call_id, None)
        if entry is not None and entry[2] is not None:
            entry[2].cancel()

    def _expire(self, call_id: int) -> None:
        entry = self.pending.pop(call_id, None)
        if entry is None:
            return
        future, method, _ = entry
        if not future.done():
            future.set_exception(
                RpcTimeout(f"{method.name} to {self.address} timed out (call {call_id})")
            )

    async def wait_writable(self) -> None:
        waiter = self.loop.create_future()
        self._write_waiters.append(waiter)
        await waiter

    def detach(self) -> None:
        """Stop new calls from using this connection (the next call opens a new one)."""
        if self.client._conn is self:
            self.client._conn = None
            self.client.connection = 0

    def abort(self, reason: str) -> None:
        self.lost_reason = reason
        self.detach()
        self.transport.abort()

    def eof_received(self) -> bool | None:
        # The server closed its side: nothing more will be answered here.
        self.detach()
        return None

    # -- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.writer = WriteBatcher(self.loop, self.transport)
        set_nodelay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.detach()
        reason = self.lost_reason if exc is None else f"{self.lost_reason}: {exc}"
        failed = self._fail_pending(
            lambda method: ConnectionLost(
                f"{method.name}: connection to {self.address} lost ({reason})"
            )
        )
        for waiter in self._write_waiters:
            if not waiter.done():
                waiter.set_exception(
                    ConnectionLost(f"connection to {self.address} lost ({reason})")
                )
        self._write_waiters.clear()
        if failed:
            logger.warning(
                "connection to %s lost (%s); failed %d pending call(s)",
                self.address,
                reason,
                failed,
            )
        if not self.closed.done():
            self.closed.set_result(None)

    def _fail_pending(self, make_error: Callable[[Method], Exception]) -> int:
        """Fail every pending call at once; returns how many there were."""
        pending = list(self.pending.values())
        self.pending.clear()
        for future, method, timer in pending:
            if timer is not None:
                timer.cancel()
            if not future.done():
                future.set_exception(make_error(method))
        return len(pending)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for waiter in self._write_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._write_waiters.clear()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as err:
            for head, call_id, payload in err.frames:
                self._deliver(head, call_id, payload)
            logger.warning(
                "closing connection to %s: malformed frame: %s", self.address, err.reason
            )
            # The server is at fault: its pending calls fail with the ProtocolError itself.
            reason = err.reason
            self._fail_pending(
                lambda method: ProtocolError(
                    f"{method.name}: malformed frame from the server: {reason}",
                    peer=self.address,
                )
            )
            self.abort(f"malformed frame from the server: {err.reason}")
            return
        for head, call_id, payload in frames:
            self._deliver(head, call_id, payload)

    def _deliver(self, head: int, call_id: int, payload: memoryview) -> None:
        entry = self.pending.pop(call_id, None)
        if entry is None:
            # Typically the answer to a call that already timed out or was cancelled.
            logger.debug(
                "dropping answer 0x%08x for call %d from %s: no such pending call",
                head,
                call_id,
                self.address,
            )
            return
        future, method, timer = entry
        if timer is not None:
            timer.cancel()
        if future.done():
            return
        if head == method.response_head:
            try:
                future.set_result(method.response.decode(payload))
            except _BODY_ERRORS as err:
                future.set_exception(
                    self._bad_answer(method, call_id, f"body does not decode: {err}")
                )
        elif head == ERROR_RESP:
            try:
                body = _decode_error_body(payload)
            except _BODY_ERRORS as err:
                future.set_exception(self._bad_answer(method, call_id, f"bad error body: {err}"))
                return
            future.set_exception(
                RemoteError(body.kind, body.message, method=method.name, peer=self.address)
            )
        else:
            future.set_exception(
                self._bad_answer(
                    method,
                    call_id,
                    f"head 0x{head:08x} is neither 0x{method.response_head:08x} nor ERROR_RESP",
                )
            )

    def _bad_answer(self, method: Method, call_id: int, what: str) -> ProtocolError:
        logger.warning(
            "bad answer to %s (call %d) from %s: %s", method.name, call_id, self.address, what
        )
        return ProtocolError(f"answer to {method.name} (call {call_id}): {what}", peer=self.address)
