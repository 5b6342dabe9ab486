"""One thread, one heap, one condition variable: deadlines without polling."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from kvt.control import mark_io_thread

log = logging.getLogger(__name__)


class TimerHandle:
    __slots__ = ("callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # the heap entry stays; the thread skips it when it comes up


class TimerScheduler:
    """Runs callbacks at deadlines on its own thread; sleeps on a condition until the next one."""

    def __init__(self, name: str = "kvt-timers") -> None:
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> TimerHandle:
        handle = TimerHandle(time.monotonic() + max(0.0, delay_s), callback)
        with self._cond:
            if self._closed:
                handle.cancelled = True
                return handle
            heapq.heappush(self._heap, (handle.deadline, next(self._seq), handle))
            if self._heap[0][2] is handle:
                self._cond.notify()
        return handle

    def _run(self) -> None:
        mark_io_thread()  # a kvt thread: completions decided here run their callbacks here
        while True:
            with self._cond:
                while not self._closed:
                    if self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                        continue
                    if self._heap:
                        wait = self._heap[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                if self._closed:
                    return
                handle = heapq.heappop(self._heap)[2]
            if handle.cancelled:
                continue
            try:
                handle.callback()
            except Exception:
                log.exception("timer callback failed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
