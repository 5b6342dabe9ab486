"""The I/O shell of cache-aware routing: vLLM's KV-cache events off zmq, into the PrefixIndex.

One zmq SUB socket per instance, connected to the endpoint its vLLM publishes on
(``--kv-events-config``, ``publisher: zmq``), and a monitor socket on it; two tasks per
instance await them (no polling: each ``recv`` is an awaited future)::

    SUB  --frames-->  kv_events.decode_message --batch--> PrefixIndex.apply(instance, batch)
                          | KvEventError
                          v
                     log (naming the instance and its endpoint), PrefixIndex.forget(instance)

    monitor --HANDSHAKE_SUCCEEDED--> connected
            --DISCONNECTED---------> not connected, PrefixIndex.forget(instance)
                                     (zmq reconnects by itself; the next batch is a baseline)

A message that does not decode, or any error applying it, never ends the task: the instance's
view is forgotten (routing falls back for it) and the next message starts a new one. zmq
drops what a subscriber is too slow to take (past ``RCVHWM``) or what was published before it
connected; a drop shows as a sequence gap, which the index answers by forgetting.

``KvEventFeed`` owns its zmq context, sockets and tasks: ``start`` makes them, ``close`` (also
on ``async with``) cancels the tasks, closes every socket and terminates the context.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pd_serving.kv_events import EventBatch, KvEventError, decode_message
from pd_serving.prefix_index import Applied, PrefixIndex

log = logging.getLogger(__name__)

# Batches a subscriber queues before zmq drops (vLLM publishes one per engine step that changed
# the cache: a backlog of seconds at most).
RCVHWM = 10_000
# zmq's reconnect backoff towards an instance that went away (ms).
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED

BatchCallback = Callable[[str, EventBatch, Applied], None]
ErrorCallback = Callable[[str, Exception], None]
ConnectionCallback = Callable[[str, bool], None]


def _ignore(*_args: Any) -> None:
    return None


class KvEventFeed:
    """Feeds ``index`` from each instance's KV-event endpoint (``sources``: instance -> zmq
    endpoint to connect to, e.g. ``tcp://10.0.0.5:5557``). Callbacks (all on the event loop):
    ``on_batch`` after each applied batch, ``on_error`` after a message that did not decode or
    apply, ``on_connection`` when a connection is made or lost."""

    def __init__(
        self,
        index: PrefixIndex,
        sources: Mapping[str, str],
        *,
        on_batch: BatchCallback = _ignore,
        on_error: ErrorCallback = _ignore,
        on_connection: ConnectionCallback = _ignore,
    ) -> None:
        self.index = index
        self.sources = dict(sources)
        self.on_batch = on_batch
        self.on_error = on_error
        self.on_connection = on_connection
        self.connected: dict[str, bool] = dict.fromkeys(self.sources, False)
        self._context: zmq.asyncio.Context | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._changed: asyncio.Condition | None = None

    async def __aenter__(self) -> KvEventFeed:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Connect to every source (zmq connects in the background, and keeps reconnecting)."""
        if self._context is not None:
            return
        self._changed = asyncio.Condition()
        self._context = zmq.asyncio.Context()
        for instance, endpoint in self.sources.items():
            sub = self._context.socket(zmq.SUB)
            self._sockets.append(sub)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, RCVHWM)
            sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(_MONITORED)
            self._sockets.append(monitor)
            sub.connect(endpoint)
            self._tasks.append(
                asyncio.create_task(
                    self._receive(instance, endpoint, sub), name=f"kv-feed-{instance}"
                )
            )
            self._tasks.append(
                asyncio.create_task(
                    self._watch(instance, endpoint, monitor), name=f"kv-monitor-{instance}"
                )
            )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        if self._context is not None:
            self._context.term()
            self._context = None
        for instance in self.connected:
            self.connected[instance] = False

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds; checked after every batch and connection change (tests,
        and callers that must know the index caught up)."""
        if self._changed is None:
            raise RuntimeError("the feed is not started")
        async with self._changed:
            await self._changed.wait_for(predicate)

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _receive(self, instance: str, endpoint: str, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                batch = decode_message(frames)
                applied = self.index.apply(instance, batch)
            except KvEventError as exc:
                log.warning(
                    "KV events of %s (%s): %s; its cached prefixes are forgotten",
                    instance,
                    endpoint,
                    exc,
                )
                self._forget(instance, exc)
            except Exception as exc:  # a bug here must not stop the feed of this instance
                log.exception("KV events of %s (%s) failed to apply; forgotten", instance, endpoint)
                self._forget(instance, exc)
            else:
                if applied.gap or applied.restart:
                    log.info(
                        "KV events of %s (%s): %s at sequence %d; its view starts again",
                        instance,
                        endpoint,
                        "events missed" if applied.gap else "a new publisher",
                        batch.seq,
                    )
                self.on_batch(instance, batch, applied)
            await self._notify()

    def _forget(self, instance: str, exc: Exception) -> None:
        self.index.forget(instance)
        self.on_error(instance, exc)

    async def _watch(self, instance: str, endpoint: str, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            up = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if up == self.connected[instance]:
                continue
            self.connected[instance] = up
            if up:
                log.info("KV events of %s: connected to %s", instance, endpoint)
            else:
                log.info(
                    "KV events of %s: %s went away; its cached prefixes are forgotten",
                    instance,
                    endpoint,
                )
                self.index.forget(instance)
            self.on_connection(instance, up)
            await self._notify()
