"""Peer lookup: N keyed objects of 1-4 MiB found at a peer master, fetched and stored here by
one ``lookup``, against a lookup that hits here and against plain remote gets of the same bytes
(one ``get`` per object of a ref owned by the peer). Two masters on loopback in one process,
same run, per remote path (kvt, simple-rpc); every object is CRC-checked.

    flock /tmp/bench.lock python packages/refstore/benchmarks/bench_peers.py  # results/peers.json
    python packages/refstore/benchmarks/bench_peers.py --smoke  # 2 small objects, seconds

A round (each case timed to the caller holding views of all N objects):

- **peer**: B's ``lookup`` of the N keys, stored only at A (B evicts its copies between
  rounds), then B's gets (local: the copies carry headers);
- **local hit**: the same lookup again, now all here, then the gets;
- **remote get**: N ``get``s at B of plain objects of the same sizes put at A (each its own
  DESCRIBE + transfer), released between rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import refstore
from refstore import faults

RESULTS = Path(__file__).parent / "results" / "peers.json"
MIB = 1 << 20


def payloads(count: int, max_mib: int) -> list[np.ndarray]:
    """1..max_mib MiB each, cycling, distinct bytes."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, (1 + i % max_mib) * MIB, dtype=np.uint8) for i in range(count)]


def _check(views, crcs: list[int], what: str) -> None:
    if [zlib.crc32(v) for v in views] != crcs:
        raise AssertionError(f"{what}: payload corrupted")


def measure(mode: str, blocks: list[np.ndarray], reps: int) -> dict[str, float]:
    total = sum(b.nbytes for b in blocks)
    pool = 2 * total + (64 << 20)
    crcs = [zlib.crc32(b) for b in blocks]
    keys = [b"bench-peer-%04d" % i for i in range(len(blocks))]
    times: dict[str, list[float]] = {"peer": [], "local": [], "remote_get": []}
    with (
        refstore.MasterThread(f"a-{mode}", pool, remote=mode) as a,
        refstore.MasterThread(
            f"b-{mode}",
            pool,
            remote=mode,
            peers=[a.address],
            peer_timeout_s=30.0,
            peer_fetch_timeout_s=120.0,
        ),
        refstore.Client(f"a-{mode}", timeout=300.0) as ca,
        refstore.Client(f"b-{mode}", timeout=300.0) as cb,
    ):
        ca.put_keyed(list(zip(keys, blocks, strict=True)))
        for i in range(reps + 1):  # the first round also connects the transfer engines
            start = time.perf_counter()
            refs = cb.lookup(keys, hold_s=0)
            views = [cb.get(r) for r in refs]
            peer = time.perf_counter() - start
            if len(refs) != len(keys):
                raise AssertionError(f"{mode}: peer lookup found {len(refs)} of {len(keys)}")
            _check(views, crcs, f"{mode} peer")

            start = time.perf_counter()
            views = [cb.get(r) for r in cb.lookup(keys, hold_s=0)]
            local = time.perf_counter() - start
            _check(views, crcs, f"{mode} local")
            del views
            faults.evict_keys(cb, keys)  # the next round fetches again

            plain = [ca.put(b) for b in blocks]
            start = time.perf_counter()
            views = [cb.get(r) for r in plain]
            remote = time.perf_counter() - start
            _check(views, crcs, f"{mode} remote get")
            del views
            cb.release(plain)
            if i:
                times["peer"].append(peer)
                times["local"].append(local)
                times["remote_get"].append(remote)
        stats = cb.stats()
        if stats.peer_keys != len(keys) * (reps + 1):
            raise AssertionError(f"{mode}: {stats.peer_keys} keys fetched from the peer")
    return {case: statistics.median(values) for case, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="2 objects of 1 MiB, one round")
    parser.add_argument("--count", type=int, default=32, help="objects per lookup")
    args = parser.parse_args()
    count, max_mib, reps = (2, 1, 1) if args.smoke else (args.count, 4, 7)
    blocks = payloads(count, max_mib)
    total = sum(b.nbytes for b in blocks)
    workdir = tempfile.mkdtemp(prefix="refstore-bench-peers-")
    os.environ["REFSTORE_DIR"] = workdir
    try:
        results = {mode: measure(mode, blocks, reps) for mode in ("kvt", "rpc")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"{count} keyed objects, {total / MIB:.0f} MiB in all (1-{max_mib} MiB each), "
        f"median of {reps}, two masters on loopback"
    )
    print(f"  {'path':4} {'peer ms':>9} {'local ms':>9} {'rget ms':>9} {'peer/rget':>10} "
          f"{'peer/local':>11}")  # fmt: skip
    ratios = {}
    for mode, r in results.items():
        ratios[mode] = {
            "peer_over_remote_get": r["peer"] / r["remote_get"],
            "peer_over_local_hit": r["peer"] / r["local"],
        }
        print(
            f"  {mode:4} {r['peer'] * 1e3:9.2f} {r['local'] * 1e3:9.2f} "
            f"{r['remote_get'] * 1e3:9.2f} {ratios[mode]['peer_over_remote_get']:9.2f}x "
            f"{ratios[mode]['peer_over_local_hit']:10.1f}x"
        )
    if not args.smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "count": count,
            "nbytes": total,
            "reps": reps,
            "seconds": results,
            "ratios": ratios,
        }
        RESULTS.write_text(json.dumps(payload, indent=1))
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
