"""kvt TCP throughput between two processes vs a plain contiguous socket, same run.

The region (256 MiB) is cut into 64 KiB or 16 KiB blocks; kvt moves every block from a random
source slot to a random destination slot (sendmsg scatter/gather out, recvmsg_into straight into
the destination region), the baseline moves the same bytes as one contiguous buffer with
``sendall`` / ``recv_into``. Each row: best and median of N timed runs after one warm-up.

Usage: python bench_tcp.py [--smoke] [--repeats N]
Full mode writes results/tcp.json. Run under ``flock /tmp/bench.lock`` on shared machines.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from kvt.loopback import run_loopback

# Mooncake TransferEngine 0.3.13 (tcp, P2PHANDSHAKE) measured on this kind of machine
# (shared/MEASURED.md), for reference only: not re-measured in this run.
MOONCAKE_REFERENCE_GBPS = {64 << 10: 0.75, 16 << 10: 0.28}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="16 MiB, one run: a CI check")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    total = (16 << 20) if args.smoke else (256 << 20)
    repeats = 1 if args.smoke else args.repeats
    result = run_loopback(total, (64 << 10, 16 << 10), repeats=repeats)

    plain = result.plain
    rows = [
        {
            "transfer": plain.label, "block_size": None, "blocks": 1,
            "best_gbps": plain.best_gbps, "median_gbps": plain.median_gbps,
            "ratio_best": 1.0, "ratio_median": 1.0, "byte_exact": None,
        }
    ]  # fmt: skip
    for m in result.kvt:
        rows.append(
            {
                "transfer": m.label, "block_size": m.block_size, "blocks": m.blocks,
                "best_gbps": m.best_gbps, "median_gbps": m.median_gbps,
                "ratio_best": m.best_gbps / plain.best_gbps,
                "ratio_median": m.median_gbps / plain.median_gbps,
                "byte_exact": result.verified[m.block_size],
                "mooncake_reference_gbps": MOONCAKE_REFERENCE_GBPS.get(m.block_size),
            }
        )  # fmt: skip
    print(f"{total >> 20} MiB between two processes, loopback TCP, {repeats} run(s) after warm-up")
    print(f"{'transfer':38} {'best GB/s':>9} {'median':>7} {'ratio':>6} {'exact':>6}")
    for r in rows:
        exact = "" if r["byte_exact"] is None else ("yes" if r["byte_exact"] else "NO")
        print(
            f"{r['transfer']:38} {r['best_gbps']:>9.2f} {r['median_gbps']:>7.2f} "
            f"{r['ratio_best']:>5.2f}x {exact:>6}"
        )
    if not all(result.verified.values()):
        raise SystemExit("kvt delivered wrong bytes")
    if not args.smoke:
        out = Path(__file__).parent / "results" / "tcp.json"
        out.parent.mkdir(exist_ok=True)
        meta = {"total_bytes": total, "repeats": repeats, "python": platform.python_version()}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
