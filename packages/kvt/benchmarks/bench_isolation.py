"""Peers isolated: throughput to receiver B while receiver A has stopped reading vs A absent.

One sender P (this process) and a receiver B (a spawned process). Each round moves ``--mib`` MiB
to B as requests of 64 scattered 64 KiB blocks, all in flight at once, and times until the last
one completes. Rounds alternate between:
* "A absent": P talks to B only;
* "A stuck": receiver A is a real engine (in this process) whose reader thread is held in a
  completion callback, so it reads nothing more. P starts a request to A that can never finish
  (16 GiB); P's writer (tcp) or its unacknowledged frame (samehost) is stuck on it before the
  round to B starts. After the round P's link to A is closed, which ends A's request.
The ratio (median GB/s to B with A stuck / with A absent, same run) is the isolation claim: 1.0x
means a stuck peer costs the others nothing. Every round to B is verified.

Usage: python bench_isolation.py [--smoke] [--repeats N] [--mib M] [--transport tcp|samehost]
Full mode writes results/isolation[-<transport>].json. Run under ``flock /tmp/bench.lock``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import platform
import queue
import statistics
import threading
import time
from pathlib import Path

import numpy as np
from ipcblock import make_blocks
from kvt import TransferEngine, TransferStatus
from kvt.loopback import stop_child

BLOCK = 64 << 10
BLOCKS_PER_REQUEST = 64  # 4 MiB per request
STUCK_COPIES = 64  # A's request names P's whole region this many times: it never completes


def _receiver_main(conn, total: int, transport: str) -> None:  # runs in the child process (B)
    engine = TransferEngine(name="B", transport=transport)
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


class HeldReceiver:
    """Receiver A: an engine whose reader thread is held in the completion callback of a first
    small request (callbacks run on the reader), so nothing P sends it afterwards is read."""

    def __init__(self, p: TransferEngine, p_region: int, total: int, transport: str, tag: str):
        self.p, self.tag = p, tag
        self.engine = TransferEngine(name="A", transport=transport)
        self._dst = np.empty(total, dtype=np.uint8)  # never written: nothing is read into it
        self.region = self.engine.register_region(self._dst)
        self.held, self.release = threading.Event(), threading.Event()

        def hold(_completion) -> None:
            self.held.set()
            self.release.wait(600)

        self.engine.expect(f"warm-{tag}", on_complete=hold)
        warm = make_blocks(0, 0, BLOCK, src_region=p_region, dst_region=self.region)
        p.send(f"warm-{tag}", self.engine.data_address, warm, last=True)
        if not self.held.wait(30):
            raise RuntimeError("A never got its first request")

    def stop(self) -> None:
        """Close P's link to A (that ends P's stuck request), then let A's reader go."""
        self.p.backend.link_to(self.engine.data_address).close("bench round over")
        self.release.set()
        self.engine.close()


def run(total: int, repeats: int, transport: str) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, total, transport), daemon=True)
    proc.start()
    child.close()
    p = TransferEngine(name="P", default_timeout_s=120.0, transport=transport)
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
        paths = set()
        for round_no in range(repeats + 1):
            for variant in ("absent", "stuck"):
                tag = f"{variant}-{round_no}"
                held = None
                if variant == "stuck":
                    held = HeldReceiver(p, rs, total, transport, tag)
                    stuck_done: queue.SimpleQueue = queue.SimpleQueue()
                    whole = make_blocks(0, 0, total, src_region=rs, dst_region=held.region)
                    p.send("A-" + tag, held.engine.data_address, np.tile(whole, STUCK_COPIES),
                           last=True, on_complete=stuck_done.put, timeout_s=600.0)  # fmt: skip
                    while p.status("A-" + tag) is not TransferStatus.TRANSFERRING:
                        time.sleep(0.01)  # a harness wait (the frame begins), not a timing
                    paths.add(p.backend.link_to(held.engine.data_address).path)
                try:
                    elapsed, ok = round_to_b(tag)
                finally:
                    if held is not None:
                        if p.status("A-" + tag) is not TransferStatus.TRANSFERRING:
                            raise RuntimeError("A's request was not stuck mid-frame")
                        held.stop()
                        a_completion = stuck_done.get(timeout=30)
                        assert a_completion.status is TransferStatus.ABORTED
                exact = exact and ok
                if round_no:
                    times[variant].append(elapsed)
        paths.add(p.backend.link_to(b_address).path)
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
            "transport": transport,
            "paths_used": sorted(paths),
            "byte_exact": exact,
            "runs_gbps": gbps,
        }
    finally:
        p.close()
        stop_child(parent, proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="16 MiB, one run: a CI check")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--transport", choices=("tcp", "samehost"), default="tcp")
    args = parser.parse_args()
    logging.getLogger("kvt").setLevel(logging.ERROR)  # A's lost links are expected, not news
    total = (16 << 20) if args.smoke else (args.mib << 20)
    repeats = 1 if args.smoke else args.repeats
    result = run(total, repeats, args.transport)
    result["machine"] = platform.platform()
    print(
        f"{total >> 20} MiB to B per round ({result['requests_per_round']} requests of "
        f"{BLOCKS_PER_REQUEST} x 64 KiB) over {'/'.join(result['paths_used'])}, "
        f"{repeats} round(s) per variant after warm-up"
    )
    print(f"{'to B, while':24} {'best GB/s':>9} {'median':>7}")
    print(
        f"{'A absent':24} {result['absent_best_gbps']:>9.2f} {result['absent_median_gbps']:>7.2f}"
    )
    print(f"{'A stuck (reader held)':24} {result['stuck_best_gbps']:>9.2f} "
          f"{result['stuck_median_gbps']:>7.2f}")  # fmt: skip
    print(
        f"ratio stuck/absent: median {result['ratio_median']:.2f}x, best "
        f"{result['ratio_best']:.2f}x, paired rounds (median) {result['ratio_paired_median']:.2f}x;"
        f" byte-exact: {'yes' if result['byte_exact'] else 'NO'}"
    )
    if not result["byte_exact"]:
        raise SystemExit("transfers to B were not byte-exact")
    if not args.smoke:
        suffix = "" if args.transport == "tcp" else f"-{args.transport}"
        out = Path(__file__).parent / "results" / f"isolation{suffix}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
