"""ManagedProcess with real child processes (small Python programs standing in for vLLM)."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from pd_serving.launcher import ChildFailed, ManagedProcess, free_port, stop_all, wait_all_ready
from stand_ins import wait_all_gone, wait_until

# What every stand-in server ends with, as vLLM's does: it answers /health on ``port`` and prints
# the ready marker.
SERVE_HEALTH = textwrap.dedent(
    """
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    print("INFO:     Application startup complete.", flush=True)
    server.serve_forever()
    """
)


def _server_script(head: str) -> str:
    return textwrap.dedent(head) + SERVE_HEALTH


# A server that, like vLLM, forks a helper (its "engine"), prints the ready marker and answers
# /health. It writes the helper's pid to a file so the test can check the helper died too.
SERVER = _server_script(
    """
    import http.server, subprocess, sys, signal
    port, pid_file, on_term = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if on_term == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if on_term == "2":  # a handler, as uvicorn's: a stopped process keeps SIGTERM pending
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(pid_file, "w").write(str(helper.pid))
    """
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _server(
    tmp_path: Path, name: str = "srv", ignore_term: bool = False, term_handler: bool = False
) -> ManagedProcess:
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    return ManagedProcess(
        name,
        [
            sys.executable,
            str(script),
            str(port),
            str(tmp_path / f"{name}.helper"),
            "2" if term_handler else str(int(ignore_term)),
        ],
        log_path=tmp_path / f"{name}.log",
        health_url=f"http://127.0.0.1:{port}/health",
    )


def test_ready_then_stop_kills_the_whole_group(tmp_path: Path) -> None:
    threads_before = set(threading.enumerate())
    proc = _server(tmp_path)
    proc.start()
    proc.ready.result(timeout=30)
    helper = int((tmp_path / "srv.helper").read_text())
    assert _alive(helper)
    assert proc.stop() is not None
    assert proc.stop() == proc.exited.result()  # idempotent
    assert wait_all_gone([helper], 10) == set()
    assert "Application startup complete." in (tmp_path / "srv.log").read_text()
    assert set(threading.enumerate()) <= threads_before


def test_ready_waits_for_the_warm_up_and_a_failed_one_is_said(tmp_path: Path, caplog) -> None:
    called, release = threading.Event(), threading.Event()

    def warm_up() -> None:
        called.set()
        assert release.wait(30)

    proc = _server(tmp_path)
    proc.warm_up = warm_up
    proc.start()
    try:
        assert called.wait(30)  # after /health answered
        assert not proc.ready.done()
        release.set()
        proc.ready.result(timeout=30)
    finally:
        proc.stop()

    def failing() -> None:
        raise OSError("connection refused")

    cold = _server(tmp_path, name="cold")
    cold.warm_up = failing
    cold.start()
    try:
        cold.ready.result(timeout=30)  # it answers /health: ready, cold
    finally:
        cold.stop()
    assert "cold: warm-up failed, its first request pays for it: connection refused" in caplog.text


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_pause_stops_the_group_resume_continues_and_stop_still_terminates(tmp_path: Path):
    proc = _server(tmp_path, term_handler=True)
    proc.start()
    proc.ready.result(timeout=30)
    helper = int((tmp_path / "srv.helper").read_text())

    async def states() -> tuple[str, str]:
        return _state(proc.pid), _state(helper)

    proc.pause()
    assert asyncio.run(wait_until(states, lambda s: s == ("T", "T"))) == ("T", "T")
    proc.resume()
    assert "T" not in asyncio.run(wait_until(states, lambda s: "T" not in s))
    proc.pause()
    # A paused group holds SIGTERM pending; stop continues it, so its handler runs (no KILL).
    assert proc.stop() == 15
    assert wait_all_gone([helper], 10) == set()


def test_a_child_that_dies_fails_readiness_at_once_with_its_last_words(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "crasher",
        [sys.executable, "-c", "import sys; print('bad model path'); sys.exit(3)"],
        log_path=tmp_path / "crasher.log",
    )
    started = time.monotonic()
    proc.start()
    with pytest.raises(ChildFailed, match="exited with code 3") as info:
        proc.ready.result(timeout=30)
    assert time.monotonic() - started < 10
    assert "bad model path" in str(info.value)
    proc.stop()


def test_wait_all_ready_raises_the_first_failure(tmp_path: Path) -> None:
    good = _server(tmp_path, "good")
    bad = ManagedProcess(
        "bad", [sys.executable, "-c", "raise SystemExit(2)"], log_path=tmp_path / "bad.log"
    )
    try:
        good.start()
        bad.start()
        with pytest.raises(ChildFailed, match="bad"):
            wait_all_ready([good, bad], timeout=60)
    finally:
        stop_all([good, bad])
    assert good.exited.done()
    assert bad.exited.done()


def test_a_child_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    proc = _server(tmp_path, "stubborn", ignore_term=True)
    proc.start()
    proc.ready.result(timeout=30)
    helper = int((tmp_path / "stubborn.helper").read_text())
    code = proc.stop(timeout=0.5)
    assert code == -9
    assert wait_all_gone([helper], 10) == set()


# A server whose helper, like the resource tracker of vLLM's processes, cleans up after its
# parent: on SIGTERM it waits for the leader to exit, then takes a moment to unlink what it
# tracks. The server is ready once its helper is (the helper says so on a pipe).
TIDY_SERVER = _server_script(
    """
    import http.server, os, subprocess, sys
    port, helper_script, done_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    helper = subprocess.Popen(
        [sys.executable, helper_script, str(os.getpid()), done_file], stdout=subprocess.PIPE
    )
    helper.stdout.readline()
    """
)
TIDY_HELPER = textwrap.dedent(
    """
    import os, select, signal, sys, time
    leader, done_file = int(sys.argv[1]), sys.argv[2]
    termed = []
    signal.signal(signal.SIGTERM, lambda *_: termed.append(1))
    watch = os.pidfd_open(leader)
    print(os.getpid(), flush=True)  # ready
    select.select([watch], [], [])  # the leader exits on its SIGTERM
    time.sleep(0.5)  # its cleanup
    open(done_file, "w").write("cleaned up" if termed else "no SIGTERM")
    """
)


def test_the_rest_of_the_group_finishes_its_shutdown_before_any_kill(tmp_path: Path) -> None:
    server, helper = tmp_path / "server.py", tmp_path / "helper.py"
    server.write_text(TIDY_SERVER)
    helper.write_text(TIDY_HELPER)
    port = free_port()
    done = tmp_path / "helper.done"
    proc = ManagedProcess(
        "tidy",
        [sys.executable, str(server), str(port), str(helper), str(done)],
        log_path=tmp_path / "tidy.log",
        health_url=f"http://127.0.0.1:{port}/health",
    )
    proc.start()
    proc.ready.result(timeout=30)
    assert proc.stop() == -15
    assert done.read_text() == "cleaned up"  # not killed with the leader


def test_not_ready_in_time_is_an_error(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "sleeper",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        log_path=tmp_path / "sleeper.log",
    )
    proc.start()
    try:
        with pytest.raises(ChildFailed, match="not ready after"):
            wait_all_ready([proc], timeout=0.5)
    finally:
        proc.stop()
    with pytest.raises(ChildFailed, match="stopped"):
        proc.ready.result(timeout=1)


# Prints the CPUs it may run on and those of a process it forks (as vLLM forks its engine core).
AFFINITY = textwrap.dedent(
    """
    import os, subprocess, sys
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    print(f"own={sorted(os.sched_getaffinity(0))} child={child}", flush=True)
    print("INFO:     Application startup complete.", flush=True)
    """
)


@pytest.mark.parametrize("cpus", [[0], None])
def test_cpus_confine_the_child_and_what_it_forks(tmp_path: Path, cpus: list[int] | None) -> None:
    script = tmp_path / "affinity.py"
    script.write_text(AFFINITY)
    proc = ManagedProcess(
        "aff", [sys.executable, str(script)], log_path=tmp_path / "aff.log", cpus=cpus
    )
    proc.start()
    try:
        proc.exited.result(timeout=30)
    finally:
        proc.stop()
    expected = sorted(cpus) if cpus is not None else sorted(os.sched_getaffinity(0))
    assert f"own={expected} child={expected}" in proc.log_tail()


def test_kill_9_then_restart_serves_again_on_the_same_port(tmp_path: Path) -> None:
    """A crash (SIGKILL to the server alone) leaves its helper in the group until ``stop`` reaps
    it; ``restart`` brings the same command back on the same port, log appended."""
    threads_before = set(threading.enumerate())
    proc = _server(tmp_path)
    proc.start()
    proc.ready.result(timeout=30)
    helper = int((tmp_path / "srv.helper").read_text())
    proc.kill()
    assert proc.exited.result(timeout=10) == -9
    assert _alive(helper)  # kill -9 of the server is not a shutdown of its group
    fresh = proc.restart()
    assert wait_all_gone([helper], 10) == set()  # the old group was reaped first
    try:
        fresh.ready.result(timeout=30)
        assert fresh.pid != proc.pid
        assert fresh.health_url == proc.health_url
        assert fresh.argv == proc.argv
        log_text = (tmp_path / "srv.log").read_text()
        assert log_text.count("Application startup complete.") == 2
    finally:
        fresh.stop()
    assert set(threading.enumerate()) <= threads_before
    with pytest.raises(RuntimeError, match="already started"):
        fresh.start()


def test_free_port_is_below_the_kernels_ephemeral_range() -> None:
    """Outside the range connect() takes source ports from, so it stays free until bound."""
    import socket
    from pathlib import Path

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


NICE = "import os\nprint(f'nice={os.nice(0)}', flush=True)\n"


def test_nice_lowers_the_childs_priority(tmp_path: Path) -> None:
    script = tmp_path / "nice.py"
    script.write_text(NICE)
    proc = ManagedProcess(
        "nice", [sys.executable, str(script)], log_path=tmp_path / "n.log", nice=7
    )
    proc.start()
    try:
        proc.exited.result(timeout=30)
    finally:
        proc.stop()
    assert f"nice={os.nice(0) + 7}" in proc.log_tail()
    assert proc.respawn().nice == 7
