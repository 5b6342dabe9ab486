from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import refstore.putget
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


class FakeClock:
    """Monotonic and wall time that stand still until the test moves them (``advance``), for the
    masters that run on it and the clients of this process (``clock`` fixture)."""

    def __init__(self) -> None:
        self.now = time.monotonic()
        self.wall = time.time()
        self.masters: list[MasterThread] = []

    def monotonic(self) -> float:
        return self.now

    def monotonic_ns(self) -> int:
        return int(self.now * 1e9)

    def time(self) -> float:
        return self.wall

    def advance(self, seconds: float) -> None:
        """Move time on, and let every master on this clock free what is due by then."""
        self.now += seconds
        self.wall += seconds
        for master in self.masters:
            master.check_deadlines()

    def catch_up(self, seconds: float) -> None:
        """Move to ``seconds`` past the real clock: for leases written by another process (which
        reads the real clock)."""
        self.advance(max(0.0, time.monotonic() - self.now) + seconds)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """A fake clock for this process's clients; the ``master`` fixture runs on it too."""
    fake = FakeClock()
    monkeypatch.setattr(refstore.putget, "monotonic_ns", fake.monotonic_ns)
    return fake


@pytest.fixture
def master(no_leaks, request):
    """The master "test" (64 MiB); on the fake clock if the test uses ``clock``."""
    fake = request.getfixturevalue("clock") if "clock" in request.fixturenames else None
    kwargs = {} if fake is None else {"clock": fake.monotonic, "wall_clock": fake.time}
    with MasterThread("test", "64M", **kwargs) as m:
        if fake is not None:
            fake.masters.append(m)
        yield m


@pytest.fixture
def client(master):
    c = Client("test", timeout=5.0)
    yield c
    c.close()


@pytest.fixture
def disconnects(master, monkeypatch) -> threading.Semaphore:
    """Released once for every client disconnect the master has handled (its state told), so a
    test waits for that event instead of sleeping."""
    handled = threading.Semaphore(0)
    state = master.master.state
    owner_gone = state.owner_gone

    def counted(peer: str) -> None:
        owner_gone(peer)
        handled.release()

    monkeypatch.setattr(state, "owner_gone", counted)
    return handled
