from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import memprof
import pytest


@pytest.fixture
def tmp_path():
    """A private directory: on this shared machine other users' pytest runs prune the shared
    basetemp (it keeps three), which deleted snapshot directories under running tests."""
    path = Path(tempfile.mkdtemp(prefix="memprof-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def profiler():
    """Start/stop around a test; fails the test if sampling is still on afterwards."""
    yield memprof
    memprof.stop()
    assert not memprof.is_running()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "memprof.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"memprof {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def writer_threads() -> int:
    """OS threads of this process named like the C snapshot writer."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # exited meanwhile
            continue
        count += name == "memprof-writer"
    return count


WORKLOADS = Path(__file__).parent / "workloads"


def run_user_sites(out: Path, *extra: str) -> tuple[str, str]:
    """Run workloads/user_sites.py under `memprof run`: (first snapshot, final snapshot)."""
    stdout = run_cli(
        "run", "--out", str(out), "--interval", "3600", "--mean", "65536", "--seed", "3",
        *extra, "--", sys.executable, str(WORKLOADS / "user_sites.py"),
    )  # fmt: skip
    first, second = stdout.split()
    return first, second
