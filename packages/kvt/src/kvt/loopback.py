"""Two-process loopback transfer: kvt vs a plain contiguous socket (and any competitor), one run.

Not a backend: "loopback" is the TCP loopback interface this harness measures kvt's TCP data plane
over (the in-memory data plane, for engines in one process, is :mod:`kvt.memory`).

Shared by ``kvt-demo`` and ``benchmarks/bench_tcp.py``. The parent process is the sender (P);
a spawned child is the receiver (D). The pattern is a KV-like region: ``total`` bytes cut into
blocks of ``block_size``, sent from a random permutation of source blocks to a random
permutation of destination blocks (every block scattered), verified byte for byte.

Rounds: every variant (plain socket, kvt per block size, each contender) runs once per round, and
the order rotates from round to round, so neither load from other processes nor "who runs after
whom" (caches, socket buffers, the scheduler's view of each process) favours one variant. Every
round of every system is checked byte for byte (outside the timing). Each
variant reports best and median seconds, and its median per-round ratio against the plain socket
of the same round (paired: a burst of load hits both sides of a ratio).
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing as mp
import queue
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from ipcblock import make_blocks

from kvt import TransferEngine

_FILL_SEED = 1234


def source_bytes(total: int) -> np.ndarray:
    """Reproducible bytes in which every 4 KiB page differs (a misplaced block cannot pass).

    A 1 MiB random tile repeated, each 4 KiB page stamped with its index: as good as random for
    catching misplaced or torn blocks, and ten times cheaper to make than 256 MiB of random bytes.
    """
    tile = np.frombuffer(np.random.default_rng(_FILL_SEED).bytes(1 << 20), dtype=np.uint8)
    data = np.resize(tile, total)
    pages = total // 4096
    data[: pages * 4096].view(np.uint64).reshape(pages, 512)[:, 0] = np.arange(pages)
    return data


@dataclass(frozen=True, eq=False)
class ScatterPattern:
    """Record ``i`` moves ``lengths[i]`` bytes from ``src_offsets[i]`` to ``dst_offsets[i]``."""

    src_offsets: np.ndarray  # int64
    dst_offsets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def permutation(cls, total: int, block_size: int) -> ScatterPattern:
        """Every block of the region moved, random source slot to random destination slot."""
        n = total // block_size
        rng = np.random.default_rng(block_size)
        return cls(
            rng.permutation(n) * block_size,
            rng.permutation(n) * block_size,
            np.full(n, block_size, dtype=np.int64),
        )

    @classmethod
    def of_blocks(cls, blocks: np.ndarray) -> ScatterPattern:
        """The moves an IpcBlock array describes (region ids aside)."""
        return cls(
            blocks["src_offset"].astype(np.int64),
            blocks["dst_offset"].astype(np.int64),
            blocks["length"].astype(np.int64),
        )

    @property
    def blocks(self) -> int:
        return len(self.src_offsets)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def delivered(self, dst: np.ndarray, src: np.ndarray) -> bool:
        """Did every record land where the pattern says (byte for byte)?"""
        # Compare in units that divide every offset and length (the block size, typically).
        every = np.concatenate([self.lengths, self.src_offsets, self.dst_offsets])
        unit = int(np.gcd.reduce(every))
        counts = self.lengths // unit
        step = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        src_units = np.repeat(self.src_offsets // unit, counts) + step
        dst_units = np.repeat(self.dst_offsets // unit, counts) + step
        got = dst[: dst.size // unit * unit].reshape(-1, unit)[dst_units]
        want = src[: src.size // unit * unit].reshape(-1, unit)[src_units]
        return bool(np.array_equal(got, want))

    def check_and_reset(self, dst: np.ndarray, src: np.ndarray) -> bool:
        """:meth:`delivered`, then ``dst`` refilled with 1s for the next round. A benchmark child
        does both before it answers: the next run may start the moment it does."""
        ok = self.delivered(dst, src)
        dst[:] = 1
        return ok


def make_engine(name: str, transport: str | None) -> TransferEngine:
    """A TransferEngine on ``transport`` ("tcp", "samehost", ...; None: the engine's default).

    Engines without a ``transport=`` setting know only TCP; asking them for another path fails.
    """
    if transport is None:
        return TransferEngine(name=name)
    if "transport" in inspect.signature(TransferEngine).parameters:
        return TransferEngine(name=name, transport=transport)  # type: ignore[call-arg]
    if transport != "tcp":
        raise RuntimeError(f"this kvt has no {transport!r} transport (TCP only)")
    return TransferEngine(name=name)


def check_paths(engine: TransferEngine, transport: str | None) -> list[str]:
    """The payload paths of the engine's live links; raises unless all are ``transport``.

    A benchmark of one path must not silently measure another ("auto" picks samehost on one host).
    """
    links = getattr(engine.backend, "links", None)
    paths = sorted({link.path for link in links()}) if links is not None else ["tcp"]
    if transport not in (None, "auto") and paths != [transport]:
        raise RuntimeError(f"kvt links use {paths}, not the {transport!r} path measured here")
    return paths


def _receiver_main(conn, total: int, transport: str | None) -> None:  # the child process
    engine = make_engine("D", transport)
    dst = np.ones(total, dtype=np.uint8)  # touched now, so no run pays first-touch page faults
    region = engine.register_region(dst)
    plain = socket.create_server(("127.0.0.1", 0))
    done: queue.SimpleQueue = queue.SimpleQueue()
    conn.send((engine.data_address, region, plain.getsockname()[1]))
    expected = source_bytes(total)  # made while the parent makes its copy
    plain_sock = None
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "expect":
                engine.expect(args[0], timeout_s=60.0, on_complete=done.put)
                conn.send("ready")
            elif cmd == "completion":
                c = done.get()
                conn.send((c.status.value, c.nbytes))
            elif cmd == "plain":
                if plain_sock is None:
                    plain_sock, _ = plain.accept()
                view, got = memoryview(dst), 0
                conn.send("ready")
                while got < total:
                    n = plain_sock.recv_into(view[got:], total - got)
                    if n == 0:
                        raise ConnectionError("plain sender went away")
                    got += n
                plain_sock.sendall(b"k")
            elif cmd == "verify":
                pattern: ScatterPattern = args[0]
                conn.send(pattern.check_and_reset(dst, expected))
            elif cmd == "close":
                break
    finally:
        if plain_sock is not None:
            plain_sock.close()
        plain.close()
        engine.close()
        conn.close()


class Contender(Protocol):
    """Another system moving the same scattered blocks, run in the same rounds (competitors)."""

    label: str

    def run(self, pattern: ScatterPattern) -> float:
        """Move every block of ``pattern`` once; seconds taken."""

    def verify(self, pattern: ScatterPattern) -> bool:
        """Byte-exact check of the last run's destination (then reset it)."""


@dataclass
class Measurement:
    label: str
    block_size: int
    blocks: int
    seconds: list[float]
    total: int
    # Per round: plain socket seconds / this variant's seconds in the same round.
    round_ratios: list[float] = field(default_factory=list)
    exact_rounds: int = 0  # timed rounds whose destination was byte-exact afterwards

    @property
    def best_gbps(self) -> float:
        return self.total / min(self.seconds) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.total / statistics.median(self.seconds) / 1e9

    @property
    def median_round_ratio(self) -> float:
        return statistics.median(self.round_ratios) if self.round_ratios else float("nan")


@dataclass
class LoopbackResult:
    total: int
    plain: Measurement
    kvt: list[Measurement]
    verified: dict[int, bool]
    contenders: list[Measurement] = field(default_factory=list)
    contenders_verified: dict[str, bool] = field(default_factory=dict)
    kvt_paths: list[str] = field(default_factory=list)  # payload paths kvt's links used


def _rotated(items: Sequence, shift: int) -> list:
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def run_loopback(
    total: int = 256 << 20,
    block_sizes: tuple[int, ...] = (64 << 10,),
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    *,
    contenders: Sequence[tuple[Contender, int]] = (),
    transport: str | None = "tcp",
) -> LoopbackResult:
    """Measure kvt (scattered blocks) and a plain contiguous socket between two processes.

    ``contenders``: (system, block size) pairs measured in the same rounds on the same pattern.
    ``transport``: kvt's data path for both engines ("tcp" by default: this is the TCP benchmark).
    """
    say = progress or (lambda _msg: None)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, total, transport), daemon=True)
    say("starting the receiver process")
    proc.start()
    child.close()
    engine = make_engine("P", transport)
    plain_sock = None
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver process did not start")
        data_address, dst_region, plain_port = parent.recv()
        src = source_bytes(total)
        src_region = engine.register_region(src)

        plain_sock = socket.create_connection(("127.0.0.1", plain_port))

        def plain_run() -> float:
            parent.send(("plain",))
            parent.recv()
            start = time.perf_counter()
            plain_sock.sendall(memoryview(src))
            if plain_sock.recv(1) != b"k":
                raise ConnectionError("plain receiver went away")
            return time.perf_counter() - start

        def kvt_run(rid: str, blocks: np.ndarray) -> float:
            done: queue.SimpleQueue = queue.SimpleQueue()
            parent.send(("expect", rid))
            parent.recv()
            start = time.perf_counter()
            engine.send(rid, data_address, blocks, last=True, on_complete=done.put)
            completion = done.get()
            elapsed = time.perf_counter() - start
            parent.send(("completion",))
            recv_status, _ = parent.recv()
            if not completion.ok or recv_status != "done":
                raise RuntimeError(f"transfer failed: {completion} / receiver {recv_status}")
            return elapsed

        patterns = {b: ScatterPattern.permutation(total, b) for b in block_sizes}
        kvt_blocks = {
            b: make_blocks(
                p.src_offsets,
                p.dst_offsets,
                p.lengths,
                src_region=src_region,
                dst_region=dst_region,
            )
            for b, p in patterns.items()
        }
        for _, b in contenders:
            patterns.setdefault(b, ScatterPattern.permutation(total, b))

        # Variants: "plain", ("kvt", block size), (contender index, block size).
        variants: list = ["plain", *(("kvt", b) for b in block_sizes)]
        variants += [(i, b) for i, (_, b) in enumerate(contenders)]
        times: dict = {v: [] for v in variants}
        exact: dict = {v: [] for v in variants if v != "plain"}
        for round_no in range(repeats + 1):
            say("warm-up round" if round_no == 0 else f"round {round_no}/{repeats}")
            for v in _rotated(variants, round_no):
                if v == "plain":
                    t = plain_run()
                elif v[0] == "kvt":
                    t = kvt_run(f"bench-{v[1]}-{round_no}", kvt_blocks[v[1]])
                    parent.send(("verify", patterns[v[1]]))
                    ok = parent.recv()
                else:
                    system, block_size = contenders[v[0]]
                    t = system.run(patterns[block_size])
                    ok = system.verify(patterns[block_size])
                if round_no:
                    times[v].append(t)
                    if v != "plain":
                        exact[v].append(ok)
            if round_no == 0:
                paths = check_paths(engine, transport)
        verified = {b: all(exact["kvt", b]) for b in block_sizes}
        contenders_verified = {
            f"{system.label}, {b >> 10} KiB": all(exact[i, b])
            for i, (system, b) in enumerate(contenders)
        }

        def measured(label: str, v, block_size: int) -> Measurement:
            ratios = [p / t for p, t in zip(times["plain"], times[v], strict=True)]
            m = Measurement(label, block_size, total // block_size, times[v], total, ratios)
            m.exact_rounds = sum(exact.get(v, []))
            return m

        plain = measured("plain socket, contiguous", "plain", total)
        results = [
            measured(f"kvt, {total // b} x {b >> 10} KiB scattered", ("kvt", b), b)
            for b in block_sizes
        ]
        others = [
            measured(f"{system.label}, {total // b} x {b >> 10} KiB scattered", (i, b), b)
            for i, (system, b) in enumerate(contenders)
        ]
        return LoopbackResult(
            total, plain, results, verified, others, contenders_verified, kvt_paths=paths
        )
    finally:
        if plain_sock is not None:
            plain_sock.close()
        stop_child(parent, proc)
        engine.close()


def stop_child(parent: Any, proc: Any, timeout_s: float = 30.0) -> None:
    """Ask a benchmark's child process to close (``("close",)`` on its pipe), wait for it, kill
    it if it does not stop in ``timeout_s``, and close the pipe: nothing outlives the benchmark."""
    with contextlib.suppress(OSError):
        parent.send(("close",))
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
    parent.close()
