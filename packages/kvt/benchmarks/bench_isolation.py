"""Peers isolated: throughput to receiver B while receiver A has stopped reading vs A absent.

One sender P (this process) and a receiver B (a spawned process). Each round moves ``--mib`` MiB
to B as requests of 64 scattered 64 KiB blocks, all in flight at once, and times until the last
one completes. Rounds alternate between:
* "A absent": P talks to B only;
* "A stuck": first P starts a request to A that can never finish (4 GiB), where A is a socket that
  says HELLO and never reads. P's writer to A blocks once the socket buffers are full; the round
  to B starts after that. After the round A's socket is reset, which fails P's link to A.
The ratio (median GB/s to B with A stuck / with A absent, same run) is the isolation claim: 1.0x
means a stuck peer costs the others nothing. Every round to B is verified byte for byte.

Usage: python bench_isolation.py [--smoke] [--repeats N] [--mib M]
Full mode writes results/isolation.json. Run under ``flock /tmp/bench.lock`` on shared machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import platform
import queue
import socket
import statistics
import struct
import time
from pathlib import Path

import numpy as np
from ipcblock import make_blocks
from kvt import TransferEngine, TransferStatus
from kvt.protocol import encode_hello

BLOCK = 64 << 10
BLOCKS_PER_REQUEST = 64  # 4 MiB per request
STUCK_COPIES = 64  # A's request names P's whole region this many times: it never completes


def _receiver_main(conn, total: int) -> None:  # runs in the child process (B)
    engine = TransferEngine(name="B")
    dst = np.ones(total, dtype=np.uint8)  # touched now: no round pays first-touch faults
    region = engine.register_region(dst)
    done: queue.SimpleQueue = queue.SimpleQueue()
    conn.send((engine.data_address, region))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "expect":
                for rid in args[0]:
                    engine.expect(rid, timeout_s=120.0, on_complete=done.put)
                conn.send("ready")
            elif cmd == "completions":
                statuses = [done.get().status.value for _ in range(args[0])]
                conn.send(statuses)
            elif cmd == "checksum":
                block_size, perm_dst = args
                conn.send(dst.reshape(-1, block_size)[perm_dst].tobytes()[:: 1 << 12])
                dst[:] = 1
            elif cmd == "close":
                break
    finally:
        engine.close()
        conn.close()


class StuckPeer:
    """A listening socket: P's link to it says HELLO both ways, then nothing is ever read."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0), backlog=1)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.conn: socket.socket | None = None

    def accept(self) -> None:
        self.conn, _ = self.server.accept()
        self.conn.sendall(encode_hello("stuck-A", self.address))

    def reset(self) -> None:
        """Close with RST (SO_LINGER 0): P's writer, blocked in sendmsg, fails at once."""
        if self.conn is not None:
            self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.conn.close()
        self.server.close()

    def queued_bytes(self) -> int:
        """Bytes P has pushed that A never read (its receive queue)."""
        import fcntl
        import termios

        assert self.conn is not None
        raw = fcntl.ioctl(self.conn.fileno(), termios.FIONREAD, b"\0\0\0\0")
        return struct.unpack("i", raw)[0]


def run(total: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, total), daemon=True)
    proc.start()
    child.close()
    p = TransferEngine(name="P", default_timeout_s=120.0)
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver process did not start")
        b_address, b_region = parent.recv()
        src = np.frombuffer(np.random.default_rng(7).bytes(total), dtype=np.uint8).copy()
        rs = p.register_region(src)
        n = total // BLOCK
        rng = np.random.default_rng(11)
        perm_src, perm_dst = rng.permutation(n), rng.permutation(n)
        blocks = make_blocks(perm_src * BLOCK, perm_dst * BLOCK, BLOCK, src_region=rs,
                             dst_region=b_region)  # fmt: skip
        batches = [blocks[i : i + BLOCKS_PER_REQUEST] for i in range(0, n, BLOCKS_PER_REQUEST)]
        want = src.reshape(-1, BLOCK)[perm_src].tobytes()[:: 1 << 12]

        def round_to_b(tag: str) -> tuple[float, bool]:
            rids = [f"{tag}-{i}" for i in range(len(batches))]
            parent.send(("expect", rids))
            parent.recv()
            done: queue.SimpleQueue = queue.SimpleQueue()
            start = time.perf_counter()
            for rid, batch in zip(rids, batches, strict=True):
                p.send(rid, b_address, batch, last=True, on_complete=done.put)
            mine = [done.get() for _ in rids]
            elapsed = time.perf_counter() - start
            parent.send(("completions", len(rids)))
            theirs = parent.recv()
            if not all(c.ok for c in mine) or set(theirs) != {"done"}:
                raise RuntimeError(f"round {tag} failed: {mine[:2]} / {theirs[:2]}")
            parent.send(("checksum", BLOCK, perm_dst))
            return elapsed, parent.recv() == want

        times: dict[str, list[float]] = {"absent": [], "stuck": []}
        exact = True
        stuck_queued: list[int] = []
        whole = make_blocks(0, 0, total, src_region=rs, dst_region=0)
        for round_no in range(repeats + 1):
            for variant in ("absent", "stuck"):
                tag = f"{variant}-{round_no}"
                peer = None
                if variant == "stuck":
                    peer = StuckPeer()
                    stuck_done: queue.SimpleQueue = queue.SimpleQueue()
                    p.send("A-" + tag, peer.address, np.tile(whole, STUCK_COPIES), last=True,
                           on_complete=stuck_done.put, timeout_s=600.0)  # fmt: skip
                    peer.accept()
                    # P's writer to A is stuck once A's receive queue stops growing (full).
                    seen, queued = -1, 0
                    while queued == 0 or queued != seen:
                        time.sleep(0.05)  # a harness wait on kernel state, not part of a timing
                        seen, queued = queued, peer.queued_bytes()
                    stuck_queued.append(queued)
                try:
                    elapsed, ok = round_to_b(tag)
                finally:
                    if peer is not None:
                        if p.status("A-" + tag) is not TransferStatus.TRANSFERRING:
                            raise RuntimeError("A's request was not stuck mid-frame")
                        peer.reset()
                        a_completion = stuck_done.get(timeout=30)
                        assert a_completion.status is TransferStatus.ABORTED
                exact = exact and ok
                if round_no:
                    times[variant].append(elapsed)
        gbps = {k: [total / t / 1e9 for t in v] for k, v in times.items()}
        return {
            "total_bytes": total,
            "block_size": BLOCK,
            "blocks_per_request": BLOCKS_PER_REQUEST,
            "requests_per_round": len(batches),
            "repeats": repeats,
            "absent_median_gbps": statistics.median(gbps["absent"]),
            "stuck_median_gbps": statistics.median(gbps["stuck"]),
            "absent_best_gbps": max(gbps["absent"]),
            "stuck_best_gbps": max(gbps["stuck"]),
            "ratio_median": statistics.median(gbps["stuck"]) / statistics.median(gbps["absent"]),
            "ratio_best": max(gbps["stuck"]) / max(gbps["absent"]),
            # Each stuck round over the absent round just before it: drift in the box's load
            # between rounds cancels out better than in a ratio of medians.
            "ratio_paired_median": statistics.median(
                s / a for a, s in zip(gbps["absent"], gbps["stuck"], strict=True)
            ),
            "stuck_bytes_queued_at_A": stuck_queued,
            "byte_exact": exact,
            "runs_gbps": gbps,
        }
    finally:
        p.close()
        parent.send(("close",))
        proc.join(30)
        if proc.exitcode is None:  # B did not stop: leave nothing behind
            proc.kill()
            proc.join()
        parent.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="16 MiB, one run: a CI check")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    logging.getLogger("kvt").setLevel(logging.ERROR)  # A's lost links are expected, not news
    total = (16 << 20) if args.smoke else (args.mib << 20)
    repeats = 1 if args.smoke else args.repeats
    result = run(total, repeats)
    result["machine"] = platform.platform()
    print(
        f"{total >> 20} MiB to B per round ({result['requests_per_round']} requests of "
        f"{BLOCKS_PER_REQUEST} x 64 KiB), {repeats} round(s) per variant after warm-up"
    )
    print(f"{'to B, while':24} {'best GB/s':>9} {'median':>7}")
    print(
        f"{'A absent':24} {result['absent_best_gbps']:>9.2f} {result['absent_median_gbps']:>7.2f}"
    )
    print(f"{'A stuck (not reading)':24} {result['stuck_best_gbps']:>9.2f} "
          f"{result['stuck_median_gbps']:>7.2f}")  # fmt: skip
    print(
        f"ratio stuck/absent: median {result['ratio_median']:.2f}x, best "
        f"{result['ratio_best']:.2f}x, paired rounds (median) {result['ratio_paired_median']:.2f}x;"
        f" A left {max(result['stuck_bytes_queued_at_A']) >> 10} KiB "
        f"unread; byte-exact: {'yes' if result['byte_exact'] else 'NO'}"
    )
    if not result["byte_exact"]:
        raise SystemExit("transfers to B were not byte-exact")
    if not args.smoke:
        out = Path(__file__).parent / "results" / "isolation.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
