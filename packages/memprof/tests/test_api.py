from __future__ import annotations

import os
import signal
import threading

import memprof
import pytest
from conftest import open_fds, writer_threads
from memprof.snapfile import SnapshotFormatError


def test_start_twice_is_an_error(profiler):
    profiler.start()
    with pytest.raises(RuntimeError, match="already running"):
        profiler.start()


def test_stop_is_idempotent():
    memprof.stop()
    memprof.start()
    memprof.stop()
    memprof.stop()
    assert not memprof.is_running()


def test_bad_arguments():
    with pytest.raises(ValueError, match="mean"):
        memprof.start(mean=0)
    with pytest.raises(ValueError, match="interval"):
        memprof.start(interval=0)
    assert not memprof.is_running()


def test_native_without_jemalloc_is_a_clear_error():
    if memprof.native.find_jemalloc() and "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("this test process runs under jemalloc")
    with pytest.raises(memprof.NativeModeUnavailable, match="jemalloc"):
        memprof.start(native=True)
    assert not memprof.is_running()


def test_start_with_threads_already_running(profiler):
    started = threading.Event()
    done = [threading.Event() for _ in range(4)]
    held: list[list[bytes]] = []

    def worker(finished: threading.Event) -> None:
        mine: list[bytes] = []
        held.append(mine)
        after_start = 0
        while after_start < 3000:  # runs before start() too: hooks arrive mid-flight
            mine.append(os.urandom(1000))
            if len(mine) > 2000:
                mine.clear()
            if started.is_set():
                after_start += 1
        finished.set()

    threads = [threading.Thread(target=worker, args=(d,)) for d in done]
    for t in threads:
        t.start()
    profiler.start(mean=8 * 1024, seed=1)
    started.set()
    for d in done:
        assert d.wait(60)
    snap = memprof.snapshot()
    for t in threads:
        t.join()
    tids = {snap.stack(r.stack_id).thread_id for r in snap.records}
    assert len(tids) >= 2  # samples carry the allocating thread
    assert any(s.site.function.endswith(".worker") for s in snap.sites())


def test_writer_signal_and_cleanup(tmp_path, profiler):
    fds = open_fds()
    assert writer_threads() == 0
    profiler.start(out_dir=tmp_path, interval=3600, keep=2, mean=16 * 1024)
    assert writer_threads() == 1
    keep = [bytearray(100_000) for _ in range(100)]
    os.kill(os.getpid(), signal.SIGUSR2)
    assert memprof.wait_written(1, timeout=30)
    for _ in range(3):
        assert memprof.flush(30)
    files = sorted(tmp_path.glob("memprof-*.mprof"))
    assert len(files) == 2  # keep=2: older ones pruned
    snap = memprof.Snapshot.load(files[-1])
    assert snap.pid == os.getpid()
    assert snap.total_bytes > 0.5 * 100_000 * len(keep)
    memprof.stop()  # writes the final snapshot and joins the writer
    assert writer_threads() == 0
    assert open_fds() == fds
    assert not list(tmp_path.glob("*.tmp"))
    # the signal is back to its previous disposition
    assert signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None)


def test_snapshot_format_errors(tmp_path, profiler):
    profiler.start()
    data = memprof._core.snapshot_bytes()
    memprof.Snapshot.from_bytes(data)
    with pytest.raises(SnapshotFormatError, match="magic"):
        memprof.Snapshot.from_bytes(b"nope" * 20)
    with pytest.raises(SnapshotFormatError, match="incomplete"):
        memprof.Snapshot.from_bytes(data[:-3])
    bad_version = data[:8] + (99).to_bytes(4, "little") + data[12:]
    with pytest.raises(SnapshotFormatError, match="version 99"):
        memprof.Snapshot.from_bytes(bad_version)


def test_fork_child_keeps_profiling(tmp_path, profiler):
    profiler.start(out_dir=tmp_path, interval=3600, mean=8 * 1024)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            junk = [bytearray(500) for _ in range(100)]
            del junk

    t = threading.Thread(target=churn)
    t.start()  # a thread allocating (and sampling) while we fork
    try:
        pid = os.fork()
        if pid == 0:  # child: locks usable, sampling on, its own writer
            code = 1
            try:
                keep = [bytearray(10_000) for _ in range(500)]
                ok = memprof.flush(30) and memprof.snapshot().total_bytes > 0
                info = memprof.writer_info()
                code = 0 if ok and f"memprof-{os.getpid()}-" in info["last_path"] and keep else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        stop.set()
        t.join()
    assert os.waitstatus_to_exitcode(status) == 0
    assert list(tmp_path.glob(f"memprof-{pid}-*.mprof"))
    keep = [bytearray(10_000) for _ in range(500)]  # the parent samples on as before
    assert memprof.snapshot().total_bytes > 0.5 * 10_000 * len(keep)


def test_write_failure_is_reported(tmp_path, profiler, caplog):
    out = tmp_path / "snaps"
    profiler.start(out_dir=out, interval=3600)
    assert memprof.flush(30)
    out.rename(tmp_path / "moved")  # the directory vanishes under the writer
    with caplog.at_level("WARNING", logger="memprof"):
        assert not memprof.flush(30)
    info = memprof.writer_info()
    assert info["errors"] >= 1
    assert "No such file" in info["last_error"]
    assert "snapshot write" in caplog.text
    out.mkdir()  # the next write succeeds again
    assert memprof.flush(30)


def test_stop_and_restart_under_tracemalloc(profiler):
    import tracemalloc

    profiler.start(mean=16 * 1024)
    tracemalloc.start()  # hooks on top of ours
    try:
        memprof.stop()  # cannot unhook: parks its hooks as pass-throughs
        memprof.start(mean=16 * 1024)  # reuses them instead of hooking on top of tracemalloc
        keep = [bytearray(20_000) for _ in range(500)]
        est = sum(
            s.est_bytes for s in memprof.snapshot().sites() if s.site.function.startswith("test_")
        )
        assert 0.7 * 20_000 * len(keep) < est < 1.3 * 20_000 * len(keep)
        assert tracemalloc.get_traced_memory()[0] >= 20_000 * len(keep)
    finally:
        tracemalloc.stop()
