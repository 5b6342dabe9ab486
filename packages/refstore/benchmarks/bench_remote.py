"""Remote get: a payload owned by another master pulled into the local pool, kvt (TCP data plane,
zero-copy from and into the registered pools) against simple-rpc raw frames (``--remote rpc``),
same run, two masters on loopback.

    python packages/refstore/benchmarks/bench_remote.py          # 256 MiB, results/remote.json
    python packages/refstore/benchmarks/bench_remote.py --smoke  # 4 MiB, a few seconds
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

RESULTS = Path(__file__).parent / "results" / "remote.json"


def measure(mode: str, nbytes: int, reps: int) -> float:
    pool = max(64 << 20, 2 * nbytes + (16 << 20))
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    crc = zlib.crc32(data)
    times = []
    with (
        refstore.MasterThread(f"here-{mode}", pool, remote=mode),
        refstore.MasterThread(f"there-{mode}", pool, remote=mode),
        refstore.Client(f"here-{mode}") as here,
        refstore.Client(f"there-{mode}") as there,
    ):
        for i in range(reps + 1):  # the first pull also starts the transfer engines
            ref = there.put(data)
            start = time.perf_counter()
            view = here.get(ref)
            elapsed = time.perf_counter() - start
            if zlib.crc32(view) != crc:
                raise AssertionError(f"{mode}: payload corrupted")
            del view
            here.release(ref)
            if i:
                times.append(elapsed)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    nbytes, reps = (4 << 20, 1) if args.smoke else (256 << 20, 5)
    workdir = tempfile.mkdtemp(prefix="refstore-bench-remote-")
    os.environ["REFSTORE_DIR"] = workdir
    try:
        results = {mode: measure(mode, nbytes, reps) for mode in ("kvt", "rpc")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"remote get of {nbytes >> 20} MiB (median of {reps}, loopback)")
    for mode, seconds in results.items():
        print(f"  {mode:4} {seconds * 1e3:8.1f} ms  {nbytes / seconds / 2**30:5.2f} GiB/s")
    ratio = results["rpc"] / results["kvt"]
    print(f"  kvt is {ratio:.2f}x faster than the simple-rpc path")
    if not args.smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        payload = {"nbytes": nbytes, "seconds": results, "kvt_over_rpc": ratio}
        RESULTS.write_text(json.dumps(payload, indent=1))
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
