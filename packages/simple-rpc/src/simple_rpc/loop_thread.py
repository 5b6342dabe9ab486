"""LoopThread: one thread owning one asyncio loop; SyncClient: a thread-safe blocking Client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .client import Client
from .errors import CallerError, ConnectionLost
from .method import Method
from .wire import DEFAULT_MAX_FRAME_SIZE

T = TypeVar("T")
logger = logging.getLogger("simple_rpc.loop_thread")


def new_event_loop(use_uvloop: bool | None = None) -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed (extra `fast`) and not refused, else asyncio's."""
    if use_uvloop is not False:
        try:
            import uvloop
        except ImportError:
            if use_uvloop:
                raise CallerError("use_uvloop=True but uvloop is not installed") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """Owns one background thread running one event loop (uvloop when available).

    submit(coro) -> concurrent.futures.Future, run(coro) blocks for the result, close() cancels
    what is still running on the loop, stops it and joins the thread (idempotent).
    """

    def __init__(self, name: str = "simple-rpc-loop", *, use_uvloop: bool | None = None) -> None:
        self.name = name
        self._loop = new_event_loop(use_uvloop)
        self._close_lock = threading.Lock()
        self._closed = False
        # Coroutine functions run on the loop when it closes, before what is left is cancelled.
        self._close_hooks: list[Callable[[], Awaitable[None]]] = []
        started = threading.Event()
        # daemon: a forgotten LoopThread must not keep the interpreter alive at exit.
        self._thread = threading.Thread(target=self._main, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _main(self, started: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        finally:
            try:
                with self._close_lock:
                    hooks, self._close_hooks = self._close_hooks, []
                for hook in hooks:
                    try:
                        loop.run_until_complete(hook())
                    except Exception:
                        logger.exception("%s: close hook %r failed", self.name, hook)
                # Whatever is still scheduled is cancelled and allowed to unwind.
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop from any thread."""
        if self._closed:
            coro.close()
            raise CallerError(f"LoopThread {self.name} is closed")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError as err:  # closed between the check and the call
            coro.close()
            raise CallerError(f"LoopThread {self.name} is closed") from err

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and block for its result (TimeoutError cancels it)."""
        if self.in_loop_thread():
            coro.close()
            raise CallerError("LoopThread.run() called from its own loop thread would deadlock")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def add_close_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `await hook()` on the loop when it closes (e.g. to close a client living on it)."""
        with self._close_lock:
            if self._closed:
                raise CallerError(f"LoopThread {self.name} is closed")
            self._close_hooks.append(hook)

    def remove_close_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        with self._close_lock, contextlib.suppress(ValueError):
            self._close_hooks.remove(hook)

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run a plain callback on the loop thread, from any thread."""
        if self._closed:
            raise CallerError(f"LoopThread {self.name} is closed")
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError as err:  # closed between the check and the call
            raise CallerError(f"LoopThread {self.name} is closed") from err

    def close(self) -> None:
        """Cancel remaining tasks, stop the loop, join the thread. Idempotent."""
        if self.in_loop_thread():
            raise CallerError("LoopThread.close() called from its own loop thread")
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncClient:
    """A Client for callers outside any event loop; safe to use from many threads at once.

    Every call is handed to one loop thread (its own LoopThread unless `loop` is given), where
    the underlying Client multiplexes all of them over one connection.
    """

    def __init__(
        self,
        address: str | tuple[str, int],
        loop: LoopThread | None = None,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        connect_timeout: float | None = 10.0,
    ) -> None:
        self._client = Client(
            address, max_frame_size=max_frame_size, connect_timeout=connect_timeout
        )
        self.address = self._client.address
        self._owns_loop = loop is None
        self._loop = LoopThread(name=f"simple-rpc-client {self.address}") if loop is None else loop
        self._close_lock = threading.Lock()
        self._closed = False
        if not self._owns_loop:
            # A borrowed loop may close first: then close the client there, so no call hangs.
            self._loop.add_close_hook(self._client.close)

    @property
    def loop(self) -> LoopThread:
        return self._loop

    @property
    def connected(self) -> bool:
        """True while the connection is up (False before the first call and once the peer has
        closed it or it broke; the next call reconnects). A plain read, safe from any thread."""
        return self._client.connected

    @property
    def connections_opened(self) -> int:
        """How many connections have been opened so far (see ``Client.connections_opened``).
        A plain read, safe from any thread."""
        return self._client.connections_opened

    @property
    def connection(self) -> int:
        """The number of the connection up now (``connections_opened`` when it was opened), 0
        while none is: ``connected`` and which connection in one plain read, safe from any
        thread."""
        return self._client.connection

    def call_future(
        self, method: Method[Any, T], request: Any, timeout: float | None = None
    ) -> concurrent.futures.Future[T]:
        """Start the call and return at once; the future resolves like `Client.call`."""
        if self._closed:
            raise CallerError(f"SyncClient for {self.address} is closed")
        method.check_request(request)
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._loop.call_soon(self._start_call, result, method, request, timeout)
        return result

    def _start_call(
        self,
        result: concurrent.futures.Future,
        method: Method,
        request: Any,
        timeout: float | None,
    ) -> None:
        """On the loop thread: issue the call without a Task when the connection is up."""
        if not result.set_running_or_notify_cancel():
            return  # cancelled by the caller before it started
        settle = functools.partial(_settle, result)
        try:
            future = self._client.start_call_nowait(method, request, timeout)
        except BaseException as err:
            result.set_exception(err)
            return
        if future is None:  # not connected (or write-paused): the coroutine path handles it
            future = asyncio.ensure_future(self._client.call(method, request, timeout))
        future.add_done_callback(settle)

    def call(self, method: Method[Any, T], request: Any, timeout: float | None = None) -> T:
        """Call and block for the answer. Errors as in `Client.call`."""
        if self._loop.in_loop_thread():
            raise CallerError(
                "SyncClient.call() from its own loop thread would deadlock; use Client"
            )
        return self.call_future(method, request, timeout).result()

    def close(self) -> None:
        """Close the connection (pending calls fail with ConnectionLost) and the owned loop."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if not self._loop.closed:
            self._loop.run(self._client.close())
        if self._owns_loop:
            self._loop.close()
        else:
            self._loop.remove_close_hook(self._client.close)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settle(result: concurrent.futures.Future, future: asyncio.Future) -> None:
    """Copy an asyncio future's outcome to the caller's concurrent future."""
    if future.cancelled():
        # Only when the loop shuts down under a pending call.
        result.set_exception(ConnectionLost("the call was cancelled: its event loop is closing"))
        return
    error = future.exception()
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(future.result())
