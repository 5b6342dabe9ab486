from __future__ import annotations

import queue
import threading

from kvt.access import CpuLayerEvents
from kvt.backend import IovCursor, iter_windows
from kvt.timers import TimerScheduler


def test_timers_fire_in_deadline_order_and_cancel() -> None:
    timers = TimerScheduler(name="kvt-test-timers")
    fired: queue.SimpleQueue[str] = queue.SimpleQueue()
    timers.call_later(0.06, lambda: fired.put("late"))
    cancelled = timers.call_later(0.03, lambda: fired.put("cancelled"))
    timers.call_later(0.01, lambda: fired.put("early"))
    cancelled.cancel()
    assert fired.get(timeout=5) == "early"
    assert fired.get(timeout=5) == "late"
    timers.close()
    timers.close()
    assert fired.empty()
    assert not any(t.name == "kvt-test-timers" for t in threading.enumerate())


def test_timer_callback_errors_do_not_kill_the_thread() -> None:
    timers = TimerScheduler(name="kvt-test-timers2")
    fired: queue.SimpleQueue[int] = queue.SimpleQueue()
    timers.call_later(0.0, lambda: 1 / 0)
    timers.call_later(0.01, lambda: fired.put(1))
    assert fired.get(timeout=5) == 1
    timers.close()


def test_cpu_layer_events() -> None:
    events = CpuLayerEvents(3)
    seen: list[int] = []
    events.when_ready(1, lambda: seen.append(1))
    events.when_ready(1, lambda: seen.append(11))
    events.mark_ready(0)
    assert seen == []
    events.mark_ready(1)
    assert seen == [1, 11]
    events.when_ready(0, lambda: seen.append(0))  # already ready: runs at once
    assert seen == [1, 11, 0]
    events.reset()
    assert not events.is_ready(0)


def test_iov_cursor_resumes_partial_io() -> None:
    data = bytearray(range(100))
    views = [memoryview(data)[i : i + 10] for i in range(0, 100, 10)]
    cursor = IovCursor(views)
    window = cursor.window(max_count=3, max_bytes=1000)
    assert [bytes(v) for v in window] == [bytes(data[0:10]), bytes(data[10:20]), bytes(data[20:30])]
    cursor.advance(15)  # a partial send/recv stops in the middle of a buffer
    window = cursor.window(max_count=2, max_bytes=12)
    assert [bytes(v) for v in window] == [bytes(data[15:20])]  # only a first buffer is cut
    cursor.advance(85)
    assert cursor.done
    joined = b"".join(bytes(v) for w in iter_windows(views, 4, 25) for v in w)
    assert joined == bytes(data)


def test_region_addresses_match_the_views() -> None:
    """What paths that hand addresses to the kernel or a NIC use must name the same bytes."""
    import numpy as np
    from ipcblock import make_blocks
    from kvt import RegionTable

    table = RegionTable()
    a, b = np.zeros(4096, np.uint8), np.zeros(8192, np.uint8)
    ra, rb = table.register(a), table.register(b)
    blocks = make_blocks([0, 100, 4000], [8000, 0, 96], 96, src_region=ra.region_id,
                         dst_region=rb.region_id)  # fmt: skip
    blocks["src_region"][1] = rb.region_id
    for side in ("src", "dst"):
        views = table.views(blocks, side)
        expected = [np.frombuffer(v, np.uint8).ctypes.data for v in views]
        assert table.addresses(blocks, side).tolist() == expected
