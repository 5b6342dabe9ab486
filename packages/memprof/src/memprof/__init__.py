"""memprof: an always-on sampling memory profiler.

Python allocations are sampled by allocator hooks (Poisson by bytes, mean 512 KiB); native
allocations optionally by jemalloc's sampler with the Python stack attached. Snapshots of the
live samples are written periodically, on SIGUSR2 and at exit.
"""

from __future__ import annotations

import atexit
import os
import threading

from . import _core
from .native import NativeModeUnavailable

TYPE_CHECKING = False  # (not typing.TYPE_CHECKING: importing typing costs ~1 MB of RSS)
if TYPE_CHECKING:  # imported lazily: `memprof.start()` in a worker should cost little memory
    from .snapfile import Frame, SiteDelta, SiteStat, Snapshot, SnapshotFormatError, diff

__version__ = "0.1.0"
__all__ = [
    "Frame",
    "NativeModeUnavailable",
    "SiteDelta",
    "SiteStat",
    "Snapshot",
    "SnapshotFormatError",
    "autostart_env",
    "diff",
    "flush",
    "is_running",
    "request_snapshot",
    "snapshot",
    "start",
    "stop",
    "write_snapshot",
]

DEFAULT_MEAN = 512 * 1024
SIGUSR2 = 12  # signal.SIGUSR2 on Linux, without importing the signal module
_LAZY = {"Frame", "SiteDelta", "SiteStat", "Snapshot", "SnapshotFormatError", "diff"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from . import snapfile as _snapfile

        return getattr(_snapfile, name)
    raise AttributeError(f"module 'memprof' has no attribute {name!r}")


class _Config:
    __slots__ = ("interval", "keep", "mean", "native", "out_dir", "seed", "signum")

    def __init__(
        self,
        *,
        mean: int,
        out_dir: str | None,
        interval: float,
        keep: int,
        signum: int,
        native: bool,
        seed: int,
    ) -> None:
        self.mean, self.out_dir, self.interval, self.keep = mean, out_dir, interval, keep
        self.signum, self.native, self.seed = signum, native, seed


_lock = threading.Lock()
_config: _Config | None = None
_hooks_registered = False


def start(
    *,
    mean: int = DEFAULT_MEAN,
    out_dir: str | os.PathLike[str] | None = None,
    interval: float = 60.0,
    keep: int = 5,
    signum: int | None = SIGUSR2,
    native: bool | None = False,
    seed: int = 0,
) -> None:
    """Start sampling in this process (safe with threads already running).

    mean: average bytes between samples. out_dir: where the background thread writes
    `memprof-<pid>-<seq>.mprof` every `interval` seconds (keeping the last `keep`), on
    `signum` and at exit; None = no writer (use snapshot()). native: also sample native
    allocations through jemalloc (True: required, None: if available). seed: 0 = random.
    """
    global _config, _hooks_registered
    if mean < 1:
        raise ValueError(f"mean must be >= 1 byte, got {mean}")
    if interval <= 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval}")
    if native is None:
        native = _core.native_available() is None
    elif native:
        why = _core.native_available()
        if why is not None:
            raise NativeModeUnavailable(why)
    out = os.path.abspath(os.fspath(out_dir)) if out_dir is not None else None
    if out is not None:
        os.makedirs(out, exist_ok=True)
    with _lock:
        if _config is not None:
            raise RuntimeError("memprof is already running in this process; call stop() first")
        _core.start(mean=float(mean), seed=seed, native=bool(native), native_dump_dir=out)
        cfg = _Config(
            mean=mean,
            out_dir=out,
            interval=interval,
            keep=keep,
            signum=signum or 0,
            native=bool(native),
            seed=seed,
        )
        try:
            if out is not None:
                _core.writer_start(out_dir=out, interval=interval, keep=keep, signum=cfg.signum)
        except BaseException:
            _core.stop()
            raise
        _config = cfg
        if not _hooks_registered:
            atexit.register(stop)
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _hooks_registered = True


def autostart_env(
    out_dir: str | os.PathLike[str],
    *,
    interval: float = 60.0,
    keep: int = 5,
    mean: int = DEFAULT_MEAN,
    signal: str = "SIGUSR2",
    seed: int = 0,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """``env`` (default: this process's) with what starts memprof in a Python process at its
    start-up, and in the Python processes it starts in turn: memprof's sitecustomize first on
    PYTHONPATH, and `start`'s settings (``signal``: a name, a number, or "none"). What
    `memprof run` execs its command with; for servers started by other launchers."""
    out = dict(os.environ if env is None else env)
    bootstrap = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
    out["PYTHONPATH"] = os.pathsep.join(p for p in (bootstrap, out.get("PYTHONPATH")) if p)
    out["MEMPROF_AUTOSTART"] = "1"
    out["MEMPROF_OUT"] = os.path.abspath(os.fspath(out_dir))
    out["MEMPROF_INTERVAL"] = str(interval)
    out["MEMPROF_KEEP"] = str(keep)
    out["MEMPROF_MEAN"] = str(mean)
    out["MEMPROF_SIGNAL"] = signal
    if seed:
        out["MEMPROF_SEED"] = str(seed)
    return out


def stop() -> None:
    """Write a final snapshot (if a writer runs), restore the allocators, drop the samples."""
    global _config
    with _lock:
        if _config is None:
            return
        _core.writer_stop()
        _core.stop()
        _config = None


def is_running() -> bool:
    return _config is not None


def snapshot() -> Snapshot:
    """The live samples of this process, now."""
    from .snapfile import Snapshot

    return Snapshot.from_bytes(_core.snapshot_bytes())


def write_snapshot(path: str | os.PathLike[str]) -> float:
    """Write a snapshot to `path` (tmp file, fsync, rename); returns the seconds it took."""
    return _core.write_snapshot(os.fspath(path))


def request_snapshot() -> None:
    """Ask the background writer for a snapshot now (what the signal does)."""
    _core.writer_request()


def flush(timeout: float = 30.0) -> bool:
    """Have the background writer write a snapshot now and wait for it; False on timeout."""
    info = _core.writer_info()
    _core.writer_request()
    if _core.wait_written(info["written"] + 1, timeout, info["errors"]):
        return True
    after = _core.writer_info()
    if after["errors"] > info["errors"]:
        import logging  # only here: importing logging costs ~1.4 MB of RSS in every process

        logging.getLogger("memprof").warning(
            "memprof: snapshot write to %s failed: %s", _config_out_dir(), after["last_error"]
        )
    return False


def _config_out_dir() -> str | None:
    cfg = _config
    return cfg.out_dir if cfg is not None else None


def wait_written(count: int, timeout: float = 30.0) -> bool:
    """Wait until the writer has written `count` snapshots in total (e.g. after a signal)."""
    return _core.wait_written(count, timeout)


def writer_info() -> dict:
    """running, written (count), last_path, last_write_s, errors (count), last_error."""
    return _core.writer_info()


def stats() -> dict:
    """active, native, mean, live_samples, stacks, frames."""
    return _core.stats()


def _after_fork_in_child() -> None:
    # The C atfork handler reset the locks and forgot the parent's writer thread (it does not
    # exist here). Sampling continues; give the child its own writer (files carry its pid).
    cfg = _config
    if cfg is not None and cfg.out_dir is not None:
        _core.writer_start(
            out_dir=cfg.out_dir, interval=cfg.interval, keep=cfg.keep, signum=cfg.signum
        )
