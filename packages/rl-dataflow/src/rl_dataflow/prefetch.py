"""Prefetch: gather batch N+1's R3 rows into the trainer's final layout while batch N trains.

The trainer is handed the next batch (its manifests: a few bytes per sample) while it still trains
the current one; a background thread gathers the rows from shared memory into one of a few
preallocated buffers (pre-faulted once, pinned on a GPU host), micro-batch after micro-batch in the
packed final layout. The step then only waits for a gather that is normally long done.

Buffers are the danger: a buffer may be handed to the next gather only once the step that read the
previous one has released it. ``SlotRing`` is that rule as a pure state machine (fed events,
returning decisions; tested without threads); ``Prefetcher`` is the thin threaded shell.

Per batch key::

    submit --(a slot is free)--> GATHERING(slot) --gathered--> READY(slot) --release--> slot free
       \\--(all slots held)--> WAITING --(a release frees a slot, FIFO)--> GATHERING(slot)

A batch without recordings (R3 off) takes no slot: it is READY at once. ``discard`` releases a
batch that will never train (shutdown, end of a run), whatever its state.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import numpy as np

log = logging.getLogger("rl_dataflow.prefetch")


class PrefetchClosed(RuntimeError):
    """The prefetcher was closed before this batch was gathered."""


class SlotRing:
    """Which batch owns which buffer. Slots are handed out in FIFO order of submission; a slot
    goes back to the ring (or straight to the oldest waiting batch) only on ``release``."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"need at least one slot, got {slots}")
        self.free: deque[int] = deque(range(slots))
        self.waiting: deque[Hashable] = deque()
        self.owner: dict[int, Hashable] = {}  # slot -> key holding it
        self.slot_of: dict[Hashable, int] = {}

    def submit(self, key: Hashable) -> int | None:
        """A batch wants a buffer: the slot to gather it into now, or None (it waits)."""
        if key in self.slot_of or key in self.waiting:
            raise ValueError(f"batch {key!r} submitted twice")
        if self.free and not self.waiting:
            return self._give(key, self.free.popleft())
        self.waiting.append(key)
        return None

    def release(self, key: Hashable) -> tuple[Hashable, int] | None:
        """The batch is done with its buffer (or never got one): the next (key, slot) to gather,
        if a waiting batch gets the freed slot."""
        if key in self.waiting:
            self.waiting.remove(key)
            return None
        slot = self.slot_of.pop(key)
        del self.owner[slot]
        if self.waiting:
            return (nxt := self.waiting.popleft()), self._give(nxt, slot)
        self.free.append(slot)
        return None

    def _give(self, key: Hashable, slot: int) -> int:
        self.owner[slot] = key
        self.slot_of[key] = slot
        return slot


Gather = Callable[[Sequence[Any], np.ndarray | None], list[np.ndarray | None]]


class Prefetcher:
    """Gathers submitted batches on one background thread into ``slots`` reusable buffers.

    ``gather(micro_batches, buffer)`` writes every micro-batch's rows into ``buffer`` (or into
    fresh memory, for a batch bigger than a slot) and returns one rows view per micro-batch (None
    for one without recordings). ``take(key)`` waits for the batch and returns those views and the
    gather's seconds, valid until ``release(key)``; ``discard(key)`` drops a batch that will not
    train (waiting for its gather if one is running). ``close()`` ends the thread; batches not
    gathered yet fail with ``PrefetchClosed``."""

    def __init__(
        self,
        gather: Gather,
        *,
        slots: int,
        slot_rows: int,
        row_shape: tuple[int, ...],
        dtype: Any,
        pinned: bool = False,
    ) -> None:
        self._gather = gather
        self._ring = SlotRing(slots)
        self._lock = threading.Lock()  # ring, futures, batches; never held across a gather
        self._futures: dict[Hashable, Future] = {}
        self._batches: dict[Hashable, Sequence[Any]] = {}
        self._in_ring: set[Hashable] = set()
        self._closed = False
        self.buffers = [_buffer(slot_rows, row_shape, dtype, pinned) for _ in range(slots)]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rl-dataflow-prefetch")
        self._thread.start()

    @property
    def slot_rows(self) -> int:
        return len(self.buffers[0])

    def submit(self, key: Hashable, micro_batches: Sequence[Any], rows: int) -> None:
        """Start gathering ``micro_batches`` (``rows`` R3 rows in all; 0: nothing to gather). A
        key already submitted is left alone (the step and the prefetch may both submit it)."""
        with self._lock:
            if self._closed:
                raise PrefetchClosed("prefetcher closed")
            if key in self._futures:
                return
            future: Future = Future()
            self._futures[key] = future
            if rows == 0:
                future.set_result(([None] * len(micro_batches), 0.0))
                return
            self._batches[key] = micro_batches
            self._in_ring.add(key)
            slot = self._ring.submit(key)
        if slot is not None:
            self._jobs.put((key, slot))

    def submitted(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._futures

    def take(
        self, key: Hashable, timeout: float | None = None
    ) -> tuple[list[np.ndarray | None], float]:
        """The gathered rows of ``key``'s micro-batches and the gather's seconds (waits for it)."""
        with self._lock:
            future = self._futures[key]
        return future.result(timeout)

    def release(self, key: Hashable) -> None:
        """The step is done with ``key``'s rows: its buffer may be reused."""
        with self._lock:
            future = self._futures.pop(key, None)
            if future is None:
                return
            self._batches.pop(key, None)
            nxt = None
            if key in self._in_ring:
                self._in_ring.discard(key)
                nxt = self._ring.release(key)
        future.cancel()  # a batch released before its gather started never gathers
        if nxt is not None:
            self._jobs.put(nxt)

    def discard(self, key: Hashable) -> None:
        """Drop a batch that will not train: cancel its gather, or wait for the one running (its
        source rows must stay valid until it ends), then free its buffer."""
        with self._lock:
            future = self._futures.get(key)
        if future is None:
            return
        if not future.cancel():  # running or done
            with contextlib.suppress(BaseException):  # a failed gather was logged already
                future.result()
        self.release(key)

    def pending(self) -> list[Hashable]:
        with self._lock:
            return list(self._futures)

    def close(self) -> None:
        """Stop the thread (a gather in progress finishes first); fail every batch not gathered."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            futures = list(self._futures.values())
        self._jobs.put(None)
        self._thread.join()
        for future in futures:
            # A release() on another thread may cancel it between a done() check and the set.
            with contextlib.suppress(InvalidStateError):
                future.set_exception(PrefetchClosed("prefetcher closed before the gather"))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            key, slot = job
            with self._lock:
                future = self._futures.get(key)
                batch = self._batches.get(key)
            if future is None or batch is None or not future.set_running_or_notify_cancel():
                continue  # released before its turn
            if self._closed:
                future.set_exception(PrefetchClosed("prefetcher closed before the gather"))
                continue
            started = time.perf_counter()
            try:
                rows = self._gather(batch, self.buffers[slot])
            except BaseException as err:  # handed to the step that waits for this batch
                log.warning("prefetch of %r failed: %s: %s", key, type(err).__name__, err)
                future.set_exception(err)
            else:
                future.set_result((rows, time.perf_counter() - started))


def _buffer(rows: int, row_shape: tuple[int, ...], dtype: Any, pinned: bool) -> np.ndarray:
    if pinned:  # page-locked host memory: the copy to the GPU is one DMA, asynchronous
        import torch

        dt = torch.from_numpy(np.empty(0, dtype)).dtype
        return torch.empty((rows, *row_shape), dtype=dt, pin_memory=True).numpy()
    buf = np.empty((rows, *row_shape), dtype)
    buf.fill(0)  # fault every page in now, not in a step
    return buf
