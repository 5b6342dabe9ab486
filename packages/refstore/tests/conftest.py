from __future__ import annotations

import gc
import os
import threading

import pytest
from refstore import Client, MasterThread


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="session", autouse=True)
def _warm_up(tmp_path_factory):
    """The first event loop of a process opens a pipe that lives as long as the process (a global
    of the loop implementation); open it before any test counts descriptors."""
    os.environ["REFSTORE_DIR"] = str(tmp_path_factory.mktemp("warmup"))
    with MasterThread("warmup", "1M"), Client("warmup"):
        pass
    del os.environ["REFSTORE_DIR"]


@pytest.fixture(autouse=True)
def refstore_dir(tmp_path, monkeypatch):
    """Every test gets its own discovery directory, so masters never collide."""
    path = tmp_path / "refstore"
    monkeypatch.setenv("REFSTORE_DIR", str(path))
    return path


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves threads or file descriptors behind."""
    threads = set(threading.enumerate())
    fds = _fd_count()
    yield
    gc.collect()  # views held by tracebacks of expected exceptions keep mappings (and fds) alive
    extra = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
    assert not extra, f"threads left running: {extra}"
    assert _fd_count() <= fds, f"file descriptors leaked: {_fd_count()} > {fds}"


@pytest.fixture
def master(no_leaks):
    with MasterThread("test", "64M") as m:
        yield m


@pytest.fixture
def client(master):
    c = Client("test", timeout=5.0)
    yield c
    c.close()
