"""Threads churning with many samples while snapshots are written and read continuously."""

from __future__ import annotations

import os
import sys
import threading

import memprof


def retained(keep: list, n: int) -> None:
    for i in range(n):
        keep.append(bytearray(3000 + i % 64))


def churn(rounds: int) -> None:
    for r in range(rounds):
        junk = [bytearray(200 + (i * 37 + r) % 5000) for i in range(300)]
        for j in range(0, len(junk), 3):
            junk[j] = junk[j] + b"x" * 100  # realloc-ish: new object, old one freed
        del junk
        d = {str(i): [i] * 10 for i in range(200)}
        del d


def test_churn_with_concurrent_snapshots(tmp_path, profiler):
    profiler.start(mean=4096, seed=11, out_dir=tmp_path, interval=0.001, keep=2)
    keep: list = []
    stop_reading = threading.Event()
    snapshots = []

    def reader() -> None:  # reads snapshots back to back while everything else runs
        while not stop_reading.is_set():
            memprof.snapshot()
            snapshots.append(1)

    readers = [threading.Thread(target=reader)]
    threads = [threading.Thread(target=churn, args=(200,)) for _ in range(3)]
    for t in readers + threads:
        t.start()
    retained(keep, 6000)
    for t in threads:
        t.join()
    stop_reading.set()
    readers[0].join()
    assert snapshots
    assert memprof.writer_info()["written"] > 0
    est = sum(s.est_bytes for s in memprof.snapshot().sites() if s.site.function == "retained")
    truth = sum(sys.getsizeof(b) for b in keep)
    assert 0.9 * truth < est < 1.1 * truth
    # churned memory is gone: what is live is about what we hold
    assert memprof.stats()["live_samples"] < 3 * truth / 4096
    memprof.stop()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
