from __future__ import annotations

import os
import queue
import threading
import time
from multiprocessing import resource_tracker

import numpy as np
import pytest
from kvt import Completion, TransferEngine
from kvt.memory import InMemoryBackend
from kvt.tcp import TcpBackend

# The data planes the engine suite runs on; each fixture below that builds engines runs once per
# backend. "unreachable": an address no engine of that backend listens on. "samehost": TCP links
# whose payload moves by process_vm_readv (two engines in one process still use it: the peer's
# pid is our own).
BACKENDS = {
    "tcp": {
        "new": lambda name: TcpBackend(name=name, transport="tcp"),
        "unreachable": "127.0.0.1:1",
    },
    "samehost": {
        "new": lambda name: TcpBackend(name=name, transport="samehost"),
        "unreachable": "127.0.0.1:1",
    },
    "memory": {"new": lambda name: InMemoryBackend(name=name), "unreachable": "memory:nobody"},
}


def kvt_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvt-")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(predicate, timeout: float = 10.0) -> None:
    """Test-only: wait for state the engine exposes no event for (e.g. "first batch landed")."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        pause.wait(0.005)


@pytest.fixture
def no_leaks():
    """Fails the test if kvt threads or file descriptors outlive it (engines must be closed)."""
    # multiprocessing's spawn keeps one process-wide resource-tracker pipe open; start it first.
    resource_tracker.ensure_running()
    assert kvt_threads() == [], f"threads left by an earlier test: {kvt_threads()}"
    before = open_fds()
    yield
    assert kvt_threads() == []
    assert open_fds() == before


class Completions:
    """Collects completions from callbacks; wait() blocks on a queue (no polling)."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self.all: list[Completion] = []

    def __call__(self, completion: Completion) -> None:
        self.q.put(completion)

    def wait(self, timeout: float = 10.0) -> Completion:
        c = self.q.get(timeout=timeout)
        self.all.append(c)
        return c

    def empty(self) -> bool:
        return self.q.empty()


class EngineFactory:
    """Builds engines on one backend; ``unreachable`` is an address of that backend nobody holds."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.unreachable = BACKENDS[backend]["unreachable"]

    def __call__(self, name: str, **kwargs) -> TransferEngine:
        return TransferEngine(name=name, backend=BACKENDS[self.backend]["new"](name), **kwargs)


@pytest.fixture(params=sorted(BACKENDS))
def make_engine(request, no_leaks) -> EngineFactory:
    """The engine suite's engines, once per data-plane backend (tests close what they build)."""
    return EngineFactory(request.param)


@pytest.fixture
def pair(make_engine):
    """Two engines in this process (P sends, D receives), 4 MiB regions of 64 blocks x 64 KiB."""
    p, d = make_engine("P", default_timeout_s=20), make_engine("D", default_timeout_s=20)
    src = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros(4 << 20, dtype=np.uint8)
    src_region, dst_region = p.register_region(src), d.register_region(dst)
    yield p, d, src, dst, src_region, dst_region
    p.close()
    d.close()


def pytest_configure(config) -> None:
    # A crash inside a kvt thread must fail the test, not just print a warning.
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnhandledThreadExceptionWarning")
