"""Two-process loopback transfer: kvt vs a plain contiguous socket, measured in the same run.

Not a backend: "loopback" is the TCP loopback interface this harness measures kvt's TCP data plane
over (the in-memory data plane, for engines in one process, is :mod:`kvt.memory`).

Shared by ``kvt-demo`` and ``benchmarks/bench_tcp.py``. The parent process is the sender (P);
a spawned child is the receiver (D). The pattern is a KV-like region: ``total`` bytes cut into
blocks of ``block_size``, sent from a random permutation of source blocks to a random
permutation of destination blocks (every block scattered), verified byte for byte afterwards.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ipcblock import make_blocks

from kvt import TransferEngine

_FILL_SEED = 1234


def _source(total: int) -> np.ndarray:
    """Reproducible bytes in which every 4 KiB page differs (a misplaced block cannot pass).

    A 1 MiB random tile repeated, each 4 KiB page stamped with its index: as good as random for
    catching misplaced or torn blocks, and ten times cheaper to make than 256 MiB of random bytes.
    """
    tile = np.frombuffer(np.random.default_rng(_FILL_SEED).bytes(1 << 20), dtype=np.uint8)
    data = np.resize(tile, total)
    pages = total // 4096
    data[: pages * 4096].view(np.uint64).reshape(pages, 512)[:, 0] = np.arange(pages)
    return data


def _permutations(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(n), rng.permutation(n)


def _receiver_main(conn, total: int) -> None:  # runs in the child process
    engine = TransferEngine(name="D")
    dst = np.ones(total, dtype=np.uint8)  # touched now, so no run pays first-touch page faults
    region = engine.register_region(dst)
    plain = socket.create_server(("127.0.0.1", 0))
    done: queue.SimpleQueue = queue.SimpleQueue()
    conn.send((engine.data_address, region, plain.getsockname()[1]))
    expected = _source(total)  # made while the parent makes its copy
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
                block_size, seed = args
                n = total // block_size
                perm_src, perm_dst = _permutations(n, seed)
                src = expected.reshape(n, block_size)
                ok = bool(np.array_equal(dst.reshape(n, block_size)[perm_dst], src[perm_src]))
                conn.send(ok)
                dst[:] = 1  # next pattern starts from a known state
            elif cmd == "close":
                break
    finally:
        if plain_sock is not None:
            plain_sock.close()
        plain.close()
        engine.close()
        conn.close()


@dataclass
class Measurement:
    label: str
    block_size: int
    blocks: int
    seconds: list[float]
    total: int

    @property
    def best_gbps(self) -> float:
        return self.total / min(self.seconds) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.total / statistics.median(self.seconds) / 1e9


@dataclass
class LoopbackResult:
    total: int
    plain: Measurement
    kvt: list[Measurement]
    verified: dict[int, bool]


def run_loopback(
    total: int = 256 << 20,
    block_sizes: tuple[int, ...] = (64 << 10,),
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> LoopbackResult:
    """Measure kvt (scattered blocks) and a plain contiguous socket between two processes."""
    say = progress or (lambda _msg: None)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, total), daemon=True)
    say("starting the receiver process")
    proc.start()
    child.close()
    engine = TransferEngine(name="P")
    plain_sock = None
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver process did not start")
        data_address, dst_region, plain_port = parent.recv()
        src = _source(total)
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

        patterns = {}
        for block_size in block_sizes:
            n = total // block_size
            perm_src, perm_dst = _permutations(n, seed=block_size)
            patterns[block_size] = make_blocks(
                perm_src * block_size, perm_dst * block_size, block_size,
                src_region=src_region, dst_region=dst_region,
            )  # fmt: skip

        # Rounds interleave every variant (plain, then kvt per block size), so load from other
        # processes hits all of them alike; round 0 warms up. The last round is verified.
        plain_times: list[float] = []
        kvt_times: dict[int, list[float]] = {b: [] for b in block_sizes}
        verified: dict[int, bool] = {}
        for round_no in range(repeats + 1):
            say("warm-up round" if round_no == 0 else f"round {round_no}/{repeats}")
            t = plain_run()
            if round_no:
                plain_times.append(t)
            for block_size, blocks in patterns.items():
                t = kvt_run(f"bench-{block_size}-{round_no}", blocks)
                if round_no:
                    kvt_times[block_size].append(t)
                if round_no == repeats:
                    parent.send(("verify", block_size, block_size))
                    verified[block_size] = parent.recv()
        plain = Measurement("plain socket, contiguous", total, 1, plain_times, total)
        results = [
            Measurement(f"kvt, {total // b} x {b >> 10} KiB scattered", b, total // b, ts, total)
            for b, ts in kvt_times.items()
        ]
        return LoopbackResult(total, plain, results, verified)
    finally:
        if plain_sock is not None:
            plain_sock.close()
        with contextlib.suppress(OSError):
            parent.send(("close",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()
        engine.close()
