"""The competitors kvt's benchmarks run in the same rounds: Mooncake TransferEngine and NIXL.

Each competitor is two spawned processes, like kvt's own pair: an initiator holding the source
region (the same reproducible bytes as kvt's, :func:`kvt.loopback.source_bytes`) and a target
holding the destination region. The initiator WRITEs every block of a
:class:`~kvt.loopback.ScatterPattern` from its source slot to its destination slot in one batch,
timed around the competitor's own "move these blocks and wait until done" call; afterwards the
target checks the bytes. The benchmark process only sends commands over pipes.

* Mooncake TransferEngine (``mooncake-transfer-engine-non-cuda``): ``initialize(..., "P2PHANDSHAKE",
  "tcp", "")`` (no metadata server), ``batch_transfer_sync_write``. Its per-peer queue is raised
  (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``,
  MEASURED.md), else batches over 2,048 blocks are rejected. This build offers only "tcp" without
  an RDMA device, so "tcp" is also its best local transport.
* NIXL (``nixl``, UCX backend, DRAM to DRAM): ``initialize_xfer("WRITE", ...)``, ``transfer``, then
  ``check_xfer_state`` until DONE (NIXL's completion is polled). ``UCX_TLS`` picks UCX's
  transports: "tcp" for the TCP benchmark; on one host UCX's own choice (cma and shared memory)
  and explicit variants are measured.

:func:`unavailable` says why a competitor cannot run (its import fails); the benchmarks then skip
it with that reason printed.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np
from kvt.loopback import ScatterPattern, source_bytes

MODULES = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}

# 32768 is the largest value 0.3.13 accepts (65536 is "invalid, using default 1024"); the default
# rejects every block of a batch of 4,096.
MOONCAKE_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "32768",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "32768",
    "GLOG_minloglevel": "2",  # its INFO lines per connection would drown the table
    "MC_LOG_LEVEL": "ERROR",
}
NIXL_ENV = {"NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}


def unavailable(system: str) -> str | None:
    """None if ``system`` ("mooncake" or "nixl") imports here, else the reason it does not."""
    try:
        importlib.import_module(MODULES[system])
    except Exception as exc:  # ImportError, or a native library that fails to load
        return (
            f"{MODULES[system]} does not import: {type(exc).__name__}: {exc} (the workspace's "
            "transfer-competitors group: `uv run --group transfer-competitors python ...`)"
        )
    return None


# ------------------------------------------------------------------ child processes
class _Mooncake:
    def __init__(self, name: str, buf: np.ndarray) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake initialize failed")
        self.base = buf.ctypes.data
        if self.engine.register_memory(self.base, buf.nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        self.buf = buf

    def describe(self) -> tuple:
        return (f"127.0.0.1:{self.engine.get_rpc_port()}", self.base)

    def connect(self, peer: tuple) -> None:
        self.session, self.peer_base = peer

    def prepare(self, pattern: ScatterPattern):
        return (
            (self.base + pattern.src_offsets).tolist(),
            (self.peer_base + pattern.dst_offsets).tolist(),
            pattern.lengths.tolist(),
        )

    def write(self, prepared) -> None:
        src, dst, lengths = prepared
        rc = self.engine.batch_transfer_sync_write(self.session, src, dst, lengths)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync_write returned {rc}")

    def close(self) -> None:
        self.engine.unregister_memory(self.base)


class _Nixl:
    def __init__(self, name: str, buf: np.ndarray) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.base = buf.ctypes.data
        self.reg = self.agent.register_memory([(self.base, buf.nbytes, 0, "")], "DRAM")
        self.buf = buf

    def describe(self) -> tuple:
        return (self.agent.get_agent_metadata(), self.base)

    def connect(self, peer: tuple) -> None:
        metadata, self.peer_base = peer
        self.peer_name = self.agent.add_remote_agent(metadata)

    def prepare(self, pattern: ScatterPattern):
        n = pattern.blocks

        def descs(base: int, offsets: np.ndarray):
            rows = np.zeros((n, 3), dtype=np.uint64)
            rows[:, 0] = base + offsets
            rows[:, 1] = pattern.lengths
            return self.agent.get_xfer_descs(rows, "DRAM")

        return descs(self.base, pattern.src_offsets), descs(self.peer_base, pattern.dst_offsets)

    def write(self, prepared) -> None:
        local, remote = prepared
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer_name)
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":  # NIXL reports completion only when asked
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self.reg)


_SYSTEMS = {"mooncake": _Mooncake, "nixl": _Nixl}


def _child_main(conn, system: str, role: str, total: int, env: dict[str, str]) -> None:
    os.environ.update(env)  # before the competitor's native library reads it
    # The target's region is touched now, so no run pays first-touch page faults.
    buf = source_bytes(total) if role == "initiator" else np.ones(total, dtype=np.uint8)
    side = _SYSTEMS[system](f"{system}-{role}-{os.getpid()}", buf)
    conn.send(side.describe())
    expected = source_bytes(total) if role == "target" else None
    prepared: dict = {}
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "connect":
                side.connect(args[0])
                conn.send("ok")
            elif cmd == "run":
                pattern: ScatterPattern = args[0]
                key = hash((pattern.src_offsets.tobytes(), pattern.dst_offsets.tobytes()))
                if key not in prepared:  # descriptor lists are built once, outside the timing
                    prepared[key] = side.prepare(pattern)
                start = time.perf_counter()
                side.write(prepared[key])
                conn.send(time.perf_counter() - start)
            elif cmd == "verify":
                conn.send(args[0].check_and_reset(buf, expected))
            elif cmd == "close":
                break
    finally:
        side.close()
        conn.close()


# ------------------------------------------------------------------ the benchmark's handle
@dataclass
class Competitor:
    """One competitor's process pair; a :class:`kvt.loopback.Contender`. Close it when done."""

    system: str  # "mooncake" or "nixl"
    label: str
    total: int
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ctx = mp.get_context("spawn")
        base = MOONCAKE_ENV if self.system == "mooncake" else NIXL_ENV
        env = {**base, **self.env}
        self._conns, self._procs = {}, {}
        try:
            for role in ("target", "initiator"):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_child_main,
                    args=(theirs, self.system, role, self.total, env),
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._conns[role], self._procs[role] = mine, proc
            info = {role: self._recv(role, 120) for role in self._conns}
            for role, peer in (("initiator", "target"), ("target", "initiator")):
                self._conns[role].send(("connect", info[peer]))
            for role in self._conns:
                self._recv(role, 60)
            self._pause()
        except BaseException:
            self.close()
            raise

    def _recv(self, role: str, timeout: float):
        conn = self._conns[role]
        if not conn.poll(timeout):
            raise RuntimeError(f"{self.label}: {role} process did not answer in {timeout:.0f} s")
        return conn.recv()

    # NIXL's progress threads spin (about one core per process, idle or not): on a small box
    # that would slow every other system measured in the same rounds. So a pair runs only while
    # it is being measured or checked, and is stopped (SIGSTOP) otherwise.
    def _pause(self) -> None:
        for proc in self._procs.values():
            os.kill(proc.pid, signal.SIGSTOP)

    def _resume(self) -> None:
        for proc in self._procs.values():
            os.kill(proc.pid, signal.SIGCONT)

    def _ask(self, role: str, message: tuple):
        self._resume()
        try:
            self._conns[role].send(message)
            return self._recv(role, 600)
        finally:
            self._pause()

    def run(self, pattern: ScatterPattern) -> float:
        return self._ask("initiator", ("run", pattern))

    def verify(self, pattern: ScatterPattern) -> bool:
        return self._ask("target", ("verify", pattern))

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._resume()
        for role, conn in self._conns.items():
            with contextlib.suppress(OSError):
                conn.send(("close",))
            proc = self._procs[role]
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self._conns, self._procs = {}, {}

    def __enter__(self) -> Competitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
