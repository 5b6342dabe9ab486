"""How local clients find their master: a small JSON file per master name, plus a lock file.

``$REFSTORE_DIR`` (default ``/tmp/refstore``) holds, for master name ``N``:

- ``N.lock``: the running master holds an exclusive ``flock`` on it for its whole life, so "is a
  master running?" is answered by the kernel (a crashed master's lock is released with its process);
- ``N.json``: address, pid, pool descriptor and size, epoch, start time, and the epochs of previous
  masters of that name (so a client holding an old ref learns "master restarted", and since when).
- ``N.spawn``: serialises clients that start a master on first use (only one of them starts it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

import msgspec

DEFAULT_NAME = "default"
MAX_PAST_EPOCHS = 32


class MasterInfo(msgspec.Struct, frozen=True):
    name: str
    address: str  # RPC address clients connect to
    node: str  # address other nodes use (may equal address)
    pid: int
    pool_fd: int
    pool_size: int
    epoch: str
    started_at: float
    past_epochs: list[tuple[str, float]] = []  # (epoch, noticed gone at)


def directory() -> Path:
    path = Path(os.environ.get("REFSTORE_DIR", "/tmp/refstore"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def info_path(name: str) -> Path:
    return directory() / f"{name}.json"


def read_info(name: str) -> MasterInfo | None:
    try:
        return msgspec.json.decode(info_path(name).read_bytes(), type=MasterInfo)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def write_info(info: MasterInfo) -> None:
    path = info_path(info.name)
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(info))
    os.replace(tmp, path)  # atomic: readers see the old or the new file, never half of one


def remove_info(name: str, epoch: str) -> None:
    info = read_info(name)
    if info is not None and info.epoch == epoch:
        with contextlib.suppress(FileNotFoundError):
            info_path(name).unlink()


class MasterLock:
    """The exclusive lock a running master holds on ``N.lock``."""

    def __init__(self, name: str) -> None:
        self.path = directory() / f"{name}.lock"
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def master_running(name: str) -> bool:
    """True while some process holds the master lock of ``name``."""
    lock = MasterLock(name)
    if lock.try_acquire():
        lock.release()
        return False
    return True


def past_epochs_for_new_master(name: str) -> list[tuple[str, float]]:
    """For a starting master: the previous master's epoch (it died or stopped) plus history."""
    old = read_info(name)
    if old is None:
        return []
    return [*old.past_epochs, (old.epoch, time.time())][-MAX_PAST_EPOCHS:]


@contextlib.contextmanager
def spawn_lock(name: str):
    """Blocks until this process is the only one deciding whether to start master ``name``."""
    fd = os.open(directory() / f"{name}.spawn", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
