"""asyncio Server: dispatch each request frame on its head to a registered handler."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ._util import WriteBatcher, format_address, set_nodelay
from .errors import BufferLimitExceeded, CallerError, ProtocolError
from .method import CallContext, Method, encode_value
from .wire import (
    DEFAULT_MAX_FRAME_SIZE,
    ERROR_RESP,
    HEADER_SIZE,
    BufferBudget,
    ErrorBody,
    FrameDecoder,
    encode_frame,
)

logger = logging.getLogger("simple_rpc.server")

# Bytes of incomplete frames all connections of one server may hold together.
DEFAULT_MAX_BUFFERED = 256 * 1024 * 1024

Handler = Callable[[Any, CallContext], Awaitable[Any]] | Callable[[Any, CallContext], Any]


async def _await(awaitable: Awaitable[Any], ctx: CallContext) -> Any:
    return await awaitable


class _Route:
    __slots__ = ("handler", "is_async", "method")

    def __init__(self, method: Method, handler: Handler) -> None:
        self.method = method
        self.handler = handler
        self.is_async = inspect.iscoroutinefunction(handler)


class Server:
    """Serves registered Methods on one TCP listener.

    Handlers are `async def handler(request, ctx) -> response` (each call runs as its own task,
    so a slow handler does not hold up other calls on the same connection), or plain functions
    with the same signature, which run inline on the loop (no Task: the fastest path) and must
    not block; a plain handler that cannot answer at once may return a coroutine instead, which
    then runs as a Task.
    A handler that raises answers the call with an error response (RemoteError at the caller);
    the server and the connection go on. An unknown head gets an error response too. A malformed
    frame closes only the connection it came on, with a WARNING naming the peer and the reason,
    once the frames that came before it on that connection are answered.

    What the server holds for incomplete frames follows the bytes that arrived (never a
    declared length): at most one frame per connection, and all connections together at most
    ``max_buffered`` bytes; the connection whose bytes would go over it is refused
    (BufferLimitExceeded, logged) and closed like one that sent a malformed frame.

    ``on_disconnect(peer)`` runs on the loop when a connection ends, for whatever reason (the
    peer is ``CallContext.peer`` of its calls): for state a server keeps per client. It must not
    block; what it raises is logged.
    """

    def __init__(
        self,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        name: str = "simple-rpc",
        on_disconnect: Callable[[str], None] | None = None,
    ) -> None:
        FrameDecoder(max_frame_size)  # validates the argument
        if not isinstance(max_buffered, int) or max_buffered < max_frame_size + HEADER_SIZE:
            raise CallerError(
                f"max_buffered must be an int >= max_frame_size + {HEADER_SIZE} (one whole "
                f"frame), got {max_buffered!r}"
            )
        self.max_frame_size = max_frame_size
        self._budget = BufferBudget(max_buffered)
        self.name = name
        self.on_disconnect = on_disconnect
        self._routes: dict[int, _Route] = {}
        self._server: asyncio.AbstractServer | None = None
        self._address: str | None = None
        self._connections: set[_ServerConnection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def register(self, method: Method, handler: Handler) -> None:
        if not isinstance(method, Method):
            raise CallerError(f"register() takes a Method, got {type(method).__name__}")
        if not callable(handler):
            raise CallerError(f"handler for {method.name} is not callable")
        existing = self._routes.get(method.request_head)
        if existing is not None:
            raise CallerError(
                f"head 0x{method.request_head:08x} of {method.name} is already registered "
                f"for {existing.method.name}"
            )
        self._routes[method.request_head] = _Route(method, handler)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (port 0 picks a free one); returns the address ("host:port")."""
        if self._closed:
            raise CallerError("server is closed")
        if self._server is not None:
            raise CallerError(f"server already started at {self._address}")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self), host, port, reuse_address=True
        )
        self._address = format_address(self._server.sockets[0].getsockname())
        logger.debug("%s listening on %s", self.name, self._address)
        return self._address

    @property
    def address(self) -> str:
        if self._address is None:
            raise CallerError("server not started")
        return self._address

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def buffered(self) -> int:
        """Bytes of incomplete frames held for all connections now (at most max_buffered)."""
        return self._budget.used

    async def close(self, grace: float = 1.0) -> None:
        """Stop listening, cancel running handlers, close every connection. Idempotent.

        Connections get `grace` seconds to flush what was already written, then are aborted.
        """
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        # Handlers still running, also those whose connection already dropped.
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for conn in connections:
            conn.transport.close()
        waiters = [c.closed for c in connections if not c.closed.done()]
        if waiters:
            _, late = await asyncio.wait(waiters, timeout=grace)
            for conn in connections:
                if not conn.closed.done():
                    conn.transport.abort()
            if late:
                await asyncio.wait(late)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _ServerConnection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.routes = server._routes
        self.max_frame_size = server.max_frame_size
        self.decoder = FrameDecoder(server.max_frame_size, budget=server._budget)
        self.tasks = server._tasks  # owned by the server, which cancels them on close()
        self.peer = "?"
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.closing = False
        # After a malformed frame: nothing more is read; the connection closes once the frames
        # decoded before it are answered.
        self.draining = False
        self.running = 0  # async handlers of this connection still running

    # -- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.writer = WriteBatcher(self.loop, self.transport)
        set_nodelay(transport)
        peername = transport.get_extra_info("peername")
        self.peer = format_address(peername) if peername else "?"
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.decoder.release()  # its incomplete frame goes back to the server's budget
        self.server._connections.discard(self)
        if not self.closed.done():
            self.closed.set_result(None)
        hook = self.server.on_disconnect
        if hook is not None:
            try:
                hook(self.peer)
            except Exception:
                logger.exception("%s: on_disconnect(%s) raised", self.server.name, self.peer)
        # Running handlers finish (their side effects may matter); their answers are dropped.

    def pause_writing(self) -> None:
        # The peer is not reading its answers: stop reading its requests until it catches up.
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.closing and not self.draining:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        writer = self.writer
        writer.held = True  # answers produced while dispatching this input go out in one write
        try:
            self._receive(data)
        finally:
            writer.held = False
            writer.flush()

    def _receive(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as err:
            if self.draining:  # input after pause_reading(): already reported and dispatched
                return
            logger.warning(
                "%s: closing connection from %s: %s: %s",
                self.server.name,
                self.peer,
                "refused" if isinstance(err, BufferLimitExceeded) else "malformed frame",
                err.reason,
            )
            # Read nothing more; answer what came before the bad frame, then close.
            self.draining = True
            self.transport.pause_reading()
            for head, call_id, payload in err.frames:
                self._dispatch(head, call_id, payload)
            self._close_when_answered()
            return
        for head, call_id, payload in frames:
            self._dispatch(head, call_id, payload)

    def _close_when_answered(self) -> None:
        if self.running == 0 and not self.closing:
            self.closing = True
            self.writer.flush()
            self.transport.close()  # after what is buffered is written

    def eof_received(self) -> bool | None:
        if self.draining:
            return True  # stay open until the frames before the bad one are answered
        if self.decoder.buffered:
            logger.warning(
                "%s: connection from %s ended inside a frame (%d bytes buffered)",
                self.server.name,
                self.peer,
                self.decoder.buffered,
            )
        return None  # close the transport

    # -- dispatch ------------------------------------------------------------------------
    def _dispatch(self, head: int, call_id: int, payload: memoryview) -> None:
        route = self.routes.get(head)
        if route is None:
            logger.warning(
                "%s: unknown head 0x%08x (call %d) from %s",
                self.server.name,
                head,
                call_id,
                self.peer,
            )
            self._send_error(call_id, "unknown_head", f"no method registered for head 0x{head:08x}")
            return
        method = route.method
        try:
            request = method.request.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            logger.warning(
                "%s: bad %s request (call %d) from %s: %s",
                self.server.name,
                method.name,
                call_id,
                self.peer,
                err,
            )
            self._send_error(call_id, "bad_request", f"{method.name}: {err}")
            return
        ctx = CallContext(self.peer, method, call_id, self)
        if route.is_async:
            # A Task per call: the handler gets full asyncio semantics (current_task(),
            # asyncio.timeout(), cancellation on close). Plain `def` handlers skip this cost.
            self.running += 1
            task = self.loop.create_task(self._run(route.handler, request, ctx))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        try:
            response = route.handler(request, ctx)
        except Exception as err:
            self._handler_failed(ctx, err)
            return
        if hasattr(response, "__await__"):
            # A plain handler that could not answer at once returned a coroutine: run it as
            # a Task, exactly like an async handler's body.
            self.running += 1
            task = self.loop.create_task(self._run(_await, response, ctx))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        self._respond(ctx, response)

    async def _run(self, handler: Handler, request: Any, ctx: CallContext) -> None:
        try:
            response = await handler(request, ctx)
        except Exception as err:
            self._handler_failed(ctx, err)
        else:
            # The only call in flight on this connection (this one is still counted): write at
            # once rather than one callback later (sequential callers wait for exactly this).
            self._respond(ctx, response, alone=self.running == 1)
        finally:
            self.running -= 1  # also when cancelled (the server is closing)
        if self.draining:
            self._close_when_answered()

    def _handler_failed(self, ctx: CallContext, err: Exception) -> None:
        logger.warning(
            "%s: handler of %s (call %d from %s) raised %s: %s",
            self.server.name,
            ctx.method.name,
            ctx.call_id,
            ctx.peer,
            type(err).__name__,
            err,
            exc_info=err,
        )
        self._send_error(ctx.call_id, "handler_error", f"{type(err).__name__}: {err}")

    def _respond(self, ctx: CallContext, response: Any, alone: bool = False) -> None:
        if self.closing:
            return
        method = ctx.method
        codec = method.response
        allowed = codec.check_type
        if allowed is not None and not isinstance(response, allowed):
            self._handler_failed(
                ctx,
                TypeError(
                    f"handler returned {type(response).__name__}, "
                    f"expected {getattr(codec.type, '__name__', codec.type)}"
                ),
            )
            return
        try:
            first, second = codec.frame(method.response_head, ctx.call_id, response)
        except (TypeError, ValueError, msgspec.EncodeError) as err:
            self._handler_failed(ctx, err)
            return
        size = len(first) - 8 if second is None else len(first) - 8 + memoryview(second).nbytes
        if size > self.max_frame_size:
            self._handler_failed(
                ctx, ValueError(f"response of {size} bytes is over max_frame_size")
            )
            return
        if alone and second is None:
            self.writer.write_now(first)
            return
        self.writer.write(first)
        if second is not None:
            self.writer.write(second)

    def _send_error(self, call_id: int, kind: str, message: str) -> None:
        if self.closing:
            return
        payload = encode_value(ErrorBody(kind=kind, message=message))
        self.writer.write(encode_frame(ERROR_RESP, call_id, payload))
