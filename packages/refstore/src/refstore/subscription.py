"""``KeySubscription``: the key events of a master (``Client.subscribe_keys``).

A subscription has its own connection to the master and one reader thread that owns it: the
thread runs an event loop of its own, subscribes, then keeps one ``key_events`` call open,
which the master answers when it has events (batched per turn of its loop), so the reader
blocks on its socket and nothing polls. ``take()`` hands over what arrived, without blocking.

Bounds, on both sides, so that a subscriber never slows or blocks the master: the master queues
at most ``state.MAX_QUEUED_KEYS`` keys per subscriber and drops a queue that would hold more
(the subscriber then gets ``KeysLost`` first, meaning "resync needed"); the reader buffers at
most ``max_buffered_keys`` keys until a ``take()`` and does the same. A lost connection (the
master went away, its state with it) ends the subscription with ``KeysLost``: subscribe again
once a master runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from simple_rpc import Client as RpcClient
from simple_rpc import RpcError

from . import protocol
from .errors import MasterUnavailable, RefstoreError, from_info
from .protocol import KeyEvent, KeysLost

log = logging.getLogger("refstore.client")

MAX_BUFFERED_KEYS = 65_536


class KeySubscription:
    """Returned subscribed (the master queues events from then on); ``close()`` it."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        max_buffered_keys: int = MAX_BUFFERED_KEYS,
        on_close: Callable[[KeySubscription], None] | None = None,
    ) -> None:
        self.address = address
        self._timeout = timeout
        self._limit = max_buffered_keys
        self._on_close = on_close
        self._lock = threading.Lock()  # the buffer and flags; never held across I/O
        self._arrived = threading.Condition(self._lock)
        self._events: list[KeyEvent] = []
        self._buffered_keys = 0
        self._lost = False
        self._alive = True
        self._closed = False
        self._subscribed = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"refstore-keys {address}", daemon=True
        )
        self._thread.start()
        self._subscribed.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    @property
    def alive(self) -> bool:
        """False once the connection is gone (closed, or the master went away)."""
        return self._alive

    def take(self) -> list[KeyEvent]:
        """The events since the last take, oldest first; never blocks. ``KeysLost()`` first if
        some were lost (a buffer overflowed, the master went away): resync."""
        with self._lock:
            events, self._events = self._events, []
            self._buffered_keys = 0
            if self._lost:
                self._lost = False
                events.insert(0, KeysLost())
        return events

    def wait(self, timeout: float | None = None) -> bool:
        """Block until there is something to take (or the subscription ended); True if so."""
        with self._arrived:
            return self._arrived.wait_for(
                lambda: self._events or self._lost or not self._alive, timeout
            )

    def close(self) -> None:
        """Close the connection and join the reader thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(task.cancel)
        self._thread.join()
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> KeySubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the reader thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._read())
        finally:
            with self._arrived:
                self._alive = False
                self._arrived.notify_all()
            self._subscribed.set()

    async def _read(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        rpc = RpcClient(self.address, connect_timeout=self._timeout)
        try:
            try:
                ack = await rpc.call(
                    protocol.SUBSCRIBE_KEYS, protocol.SubscribeKeys(), self._timeout
                )
                if ack.err is not None:
                    raise from_info(ack.err)
            except RpcError as err:
                self._error = MasterUnavailable(
                    f"refstore master at {self.address}: {type(err).__name__}: {err}"
                )
                return
            except RefstoreError as err:
                self._error = err
                return
            finally:
                self._subscribed.set()
            while True:
                resp = await rpc.call(protocol.KEY_EVENTS, protocol.NextKeyEvents(), None)
                if resp.err is not None:
                    raise from_info(resp.err)
                self._deliver(resp.events)
        except asyncio.CancelledError:
            pass  # close()
        except (RpcError, RefstoreError) as err:
            log.warning("key events from %s ended: %s: %s", self.address, type(err).__name__, err)
            with self._arrived:
                self._lost = True
                self._arrived.notify_all()
        finally:
            await rpc.close()

    def _deliver(self, events: list[KeyEvent]) -> None:
        keys = sum(len(getattr(event, "keys", ())) for event in events)
        with self._arrived:
            if self._buffered_keys + keys > self._limit:
                self._events, self._buffered_keys, self._lost = [], 0, True
            else:
                self._events.extend(events)
                self._buffered_keys += keys
            self._arrived.notify_all()
