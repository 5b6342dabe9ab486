"""Child processes with a readiness signal: vLLM API servers and `pdserve up` itself.

A child is started in its own process group (so a terminal's Ctrl-C reaches only the parent, and
stopping the child's group also stops the engine and worker processes vLLM forks), with
``PR_SET_PDEATHSIG`` so it gets SIGTERM if the parent dies without cleaning up.

Readiness is event driven: a reader thread copies the child's output into its log file and watches
for the line the server prints once it accepts connections (uvicorn's "Application startup
complete."); a waiter thread blocks in ``wait()`` so a child that dies before it is ready fails the
readiness future at once, with the tail of its log. Only after the marker is seen is ``/health``
asked (a few tries with backoff, for servers that print the marker a moment before they answer),
then the caller's warm-up, if any (a ``VllmServer``'s: one completion with logprobs).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

UVICORN_READY_MARKER = "Application startup complete."
_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 40

# Resolved in the parent: the child, between fork and exec, must not import or allocate.
try:
    _libc_prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _libc_prctl = None


def _die_with_parent() -> None:
    if _libc_prctl is not None:
        _libc_prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _child_setup(cpus: frozenset[int] | None, nice: int = 0) -> Callable[[], None]:
    """What the child runs between fork and exec: die with the parent, (``cpus``) run on those
    CPUs only, and (``nice``) at that lower CPU priority; every process it forks (vLLM's engine
    core and workers) inherits both."""
    if cpus is None and not nice:
        return _die_with_parent

    def setup() -> None:
        _die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if nice:
            os.nice(nice)

    return setup


class ChildFailed(RuntimeError):
    """A child process exited (or never became ready); the message carries the tail of its log."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORTS_BELOW_EPHEMERAL = 8192  # how far below the kernel's ephemeral range to pick from


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now, for a child to listen on later.

    Picked below the kernel's ephemeral range: a port the kernel hands out for ``bind(0)`` or as
    a connection's source port may be taken again by any process's next connect between this
    pick and the child's bind (seen: a vLLM worker failing with "address already in use" while
    other instances were busy). Falls back to the kernel's pick where no port there is free.
    """
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - _PORTS_BELOW_EPHEMERAL)
    for port in random.sample(range(first, low), min(64, low - first)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ManagedProcess:
    """One child process: started in its own process group, readiness as a future, stopped for sure.

    ``ready`` resolves when ``ready_marker`` appeared in the child's output, ``health_url`` (if
    given) answered 200 and ``warm_up`` (if given) returned; it fails with :class:`ChildFailed` if
    the child exits first. ``warm_up`` runs on the readiness thread: a failure is logged, the
    child is still ready (it answers ``/health``; its first request pays what the warm-up
    would have). ``cpus``
    confines the child and everything it forks to those CPUs (``None``: wherever the parent may
    run); ``nice`` lowers their CPU priority by that much (``os.nice``: 0 keeps the parent's).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        ready_marker: str = UVICORN_READY_MARKER,
        health_url: str | None = None,
        cwd: Path | None = None,
        cpus: Iterable[int] | None = None,
        nice: int = 0,
        warm_up: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.ready_marker = ready_marker
        self.health_url = health_url
        self.cwd = cwd
        self.cpus = None if cpus is None else frozenset(cpus)
        self.nice = nice
        self.warm_up = warm_up
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.exited: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)
        self._stop_lock = threading.Lock()
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Spawn the child; returns at once (wait on ``ready``)."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s: %s (log %s)", self.name, " ".join(self.argv), self.log_path)
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
            # Only prctl, sched_setaffinity and nice, resolved beforehand:
            preexec_fn=_child_setup(self.cpus, self.nice),  # noqa: PLW1509
        )
        for target, suffix in ((self._read_output, "out"), (self._wait_exit, "wait")):
            thread = threading.Thread(target=target, name=f"{self.name}-{suffix}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _read_output(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        with self._proc.stdout as stream, self.log_path.open("ab") as sink:
            for raw in stream:  # ends at EOF: every holder of the pipe (the whole group) exited
                sink.write(raw)
                sink.flush()
                line = raw.decode(errors="replace").rstrip()
                self._tail.append(line)
                if not self.ready.done() and self.ready_marker in line:
                    threading.Thread(
                        target=self._confirm_health, name=f"{self.name}-health", daemon=True
                    ).start()

    def _confirm_health(self) -> None:
        if self.health_url is not None:
            delay = 0.05
            deadline = time.monotonic() + 30.0
            while True:
                try:
                    with urllib.request.urlopen(self.health_url, timeout=5.0) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError) as exc:
                    if time.monotonic() > deadline or self.exited.done():
                        self._fail_ready(f"{self.health_url} did not answer: {exc}")
                        return
                # The marker is printed as the socket starts accepting; only a short race is left.
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        if self.warm_up is not None and not self.exited.done():
            started = time.monotonic()
            try:
                self.warm_up()
            except Exception as exc:  # the child serves anyway; say why it is cold
                log.warning("%s: warm-up failed, its first request pays for it: %s", self.name, exc)
            else:
                log.info("%s warmed up in %.1f s", self.name, time.monotonic() - started)
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.ready.set_result(None)
            log.info("%s ready (pid %s)", self.name, self.pid)

    def _wait_exit(self) -> None:
        assert self._proc is not None
        code = self._proc.wait()
        self.exited.set_result(code)
        self._fail_ready(f"exited with code {code} before it was ready")

    def _fail_ready(self, why: str, *, wait_for_output: bool = True) -> None:
        if self.ready.done():
            return
        if wait_for_output:
            # Wait briefly for the output reader so the tail shows the child's last words.
            for thread in self._threads[:1]:
                thread.join(timeout=2.0)
        tail = "\n".join(self._tail)
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.ready.set_exception(
                ChildFailed(f"{self.name} {why}; last lines of {self.log_path}:\n{tail}")
            )

    def log_tail(self) -> str:
        return "\n".join(self._tail)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL what is left of it after ``timeout``;
        idempotent."""
        with self._stop_lock:
            if self._stopped or self._proc is None:
                return self._proc.returncode if self._proc else None
            self._stopped = True
        proc = self._proc
        self._fail_ready("was stopped", wait_for_output=False)
        deadline = time.monotonic() + timeout
        _signal_group(proc.pid, signal.SIGTERM)
        _signal_group(proc.pid, signal.SIGCONT)  # a paused group would hold SIGTERM pending
        try:
            code = self.exited.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            log.warning(
                "%s (pid %s) ignored SIGTERM for %.0f s; killing", self.name, proc.pid, timeout
            )
            _signal_group(proc.pid, signal.SIGKILL)
            code = self.exited.result(timeout=10.0)
        else:
            # The rest of the group ends its own shutdown first: vLLM's engine core, and the
            # resource tracker that unlinks the shared memory its processes made once they
            # are gone (killed with the leader, it would leave the segments in /dev/shm).
            left = _wait_group_gone(proc.pid, max(0.0, deadline - time.monotonic()))
            if left:
                log.warning("%s: pids %s outlived its SIGTERM; killing", self.name, left)
        _signal_group(proc.pid, signal.SIGKILL)
        for thread in self._threads:
            thread.join(timeout=5.0)
        return code

    def pause(self) -> None:
        """SIGSTOP the child's whole process group: it takes no CPU until ``resume`` (a
        benchmark runs one system at a time on shared cores)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        _signal_group(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the child's process group (after ``pause``; harmless otherwise)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        _signal_group(self._proc.pid, signal.SIGCONT)

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to the child itself only (``kill -9 PID``: a crash, not a shutdown); what
        it forked is left to notice, as it would be. ``stop`` afterwards reaps the group."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, sig)

    def respawn(self) -> ManagedProcess:
        """A new, unstarted ManagedProcess with this one's command, environment, log file (the
        new output is appended), readiness check and CPUs: the restart of one instance, on the
        same ports. This one must be stopped first (``restart`` does both)."""
        return ManagedProcess(
            self.name,
            self.argv,
            log_path=self.log_path,
            env=self.env,
            ready_marker=self.ready_marker,
            health_url=self.health_url,
            cwd=self.cwd,
            cpus=self.cpus,
            nice=self.nice,
        )

    def restart(self, timeout: float = 20.0) -> ManagedProcess:
        """Stop this child (its whole group, as ``stop``) and start its ``respawn``; returns the
        new one, started (wait on its ``ready``). A process object runs once: its futures
        belong to that run."""
        self.stop(timeout)
        fresh = self.respawn()
        fresh.start()
        return fresh


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_pids(pgid: int) -> list[int]:
    """The processes of group ``pgid`` now (from /proc)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # After the command name, in parentheses: state, ppid, pgrp.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _wait_group_gone(pgid: int, timeout: float) -> list[int]:
    """Wait until every process of group ``pgid`` has exited (a pidfd each: no polling), at
    most ``timeout`` seconds; returns the pids still running."""
    fds: dict[int, int] = {}
    for pid in group_pids(pgid):
        with contextlib.suppress(ProcessLookupError):
            fds[os.pidfd_open(pid)] = pid
    try:
        deadline = time.monotonic() + timeout
        pending = set(fds)
        while pending:
            ready, _, _ = select.select(
                list(pending), [], [], max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break
            pending.difference_update(ready)
        return sorted(fds[fd] for fd in pending)
    finally:
        for fd in fds:
            os.close(fd)


def start_all(processes: Iterable[ManagedProcess]) -> list[ManagedProcess]:
    started = []
    for proc in processes:
        proc.start()
        started.append(proc)
    return started


def wait_all_ready(
    processes: Sequence[ManagedProcess],
    timeout: float,
    on_ready: Callable[[ManagedProcess], None] | None = None,
) -> None:
    """Block until every child is ready; the first failure (or the timeout) raises at once.

    ``on_ready`` is called (on this thread) for each child as it becomes ready."""
    pending = {proc.ready: proc for proc in processes}
    deadline = time.monotonic() + timeout
    while pending:
        done, _ = concurrent.futures.wait(
            pending,
            timeout=max(0.0, deadline - time.monotonic()),
            return_when=concurrent.futures.FIRST_EXCEPTION,
        )
        if not done:
            names = ", ".join(proc.name for proc in pending.values())
            raise ChildFailed(f"not ready after {timeout:.0f} s: {names}")
        for fut in done:
            proc = pending.pop(fut)
            fut.result()  # raises ChildFailed
            log.debug("%s is ready", proc.name)
            if on_ready is not None:
                on_ready(proc)


def stop_all(processes: Iterable[ManagedProcess], timeout: float = 20.0) -> None:
    """Stop every child in parallel (each one's SIGTERM grace period overlaps the others')."""
    procs = list(processes)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        list(pool.map(lambda p: p.stop(timeout), procs))


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
