"""kvt TCP throughput between two processes vs a plain contiguous socket, Mooncake and NIXL.

The region (256 MiB) is cut into 64 KiB or 16 KiB blocks; kvt moves every block from a random
source slot to a random destination slot (sendmsg scatter/gather out, recvmsg_into straight into
the destination region), the baseline moves the same bytes as one contiguous buffer with
``sendall`` / ``recv_into``. Mooncake TransferEngine (tcp) and NIXL (UCX over tcp) move the same
scattered blocks, each between two processes of its own, in the same rounds (competitors.py).
Rounds rotate the order of the variants; one warm-up round, then N timed rounds; every system's
every round is checked byte for byte (exact: rounds byte-exact / rounds).

Usage: python bench_tcp.py [--smoke] [--repeats N] [--no-competitors]
Full mode writes results/tcp.json. Run under ``flock /tmp/bench.lock`` on shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from competitors import Competitor, unavailable
from kvt.loopback import Measurement, run_loopback

COMPETITORS = (
    ("mooncake", "Mooncake TE (tcp)", {}),
    ("nixl", "NIXL (UCX tcp)", {"UCX_TLS": "tcp"}),
)


def _row(m: Measurement, plain: Measurement, exact: bool | None, system: str) -> dict:
    return {
        "transfer": m.label, "system": system, "block_size": m.block_size, "blocks": m.blocks,
        "best_gbps": m.best_gbps, "median_gbps": m.median_gbps,
        "ratio_best": m.best_gbps / plain.best_gbps,
        "ratio_median": m.median_gbps / plain.median_gbps,
        "ratio_median_paired": m.median_round_ratio,
        "byte_exact": exact, "exact_rounds": m.exact_rounds, "rounds": len(m.seconds),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="16 MiB, one round: a CI check")
    parser.add_argument("--repeats", type=int, default=11, help="timed rounds after a warm-up")
    parser.add_argument("--no-competitors", action="store_true")
    args = parser.parse_args()
    total = (16 << 20) if args.smoke else (256 << 20)
    repeats = 1 if args.smoke else args.repeats
    kvt_sizes = (64 << 10,) if args.smoke else (64 << 10, 16 << 10)

    load_before = os.getloadavg()
    systems: list[Competitor] = []
    skipped: dict[str, str] = {}
    try:
        for system, label, env in () if args.no_competitors else COMPETITORS:
            reason = unavailable(system)
            if reason:
                print(f"skipping {label}: {reason}")
                skipped[label] = reason
                continue
            systems.append(Competitor(system, label, total, env))
        contenders = [(s, b) for s in systems for b in kvt_sizes]
        result = run_loopback(total, kvt_sizes, repeats=repeats, contenders=contenders)
    finally:
        for s in systems:
            s.close()
    load_after = os.getloadavg()

    plain = result.plain
    rows = [_row(plain, plain, None, "plain")]
    rows += [_row(m, plain, result.verified[m.block_size], "kvt") for m in result.kvt]
    kvt_median = {m.block_size: m.median_gbps for m in result.kvt}
    for m, (system, _) in zip(result.contenders, contenders, strict=True):
        key = f"{system.label}, {m.block_size >> 10} KiB"
        row = _row(m, plain, result.contenders_verified[key], system.system)
        row["kvt_speedup_median"] = kvt_median[m.block_size] / m.median_gbps
        rows.append(row)

    print(
        f"{total >> 20} MiB between two processes, loopback TCP, {repeats} round(s) after "
        f"warm-up; kvt links on {result.kvt_paths}; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after"
    )
    print(
        f"{'transfer':44} {'best GB/s':>9} {'median':>7} {'vs plain':>9} {'paired':>7} "
        f"{'exact':>6} {'kvt is':>7}"
    )
    for r in rows:
        exact = "" if r["byte_exact"] is None else f"{r['exact_rounds']}/{r['rounds']}"
        speedup = f"{r['kvt_speedup_median']:.1f}x" if "kvt_speedup_median" in r else ""
        print(
            f"{r['transfer']:44} {r['best_gbps']:>9.2f} {r['median_gbps']:>7.2f} "
            f"{r['ratio_median']:>8.2f}x {r['ratio_median_paired']:>6.2f}x {exact:>6} "
            f"{speedup:>7}"
        )
    print("vs plain: median GB/s over plain's median; paired: median of per-round ratios")
    wrong = [k for k, ok in result.contenders_verified.items() if not ok]
    if wrong:  # reported, not fatal: the competitor's result, not a fault of this benchmark
        print(f"WRONG BYTES after a reported success: {', '.join(wrong)} (see 'exact')")
    if not all(result.verified.values()):
        raise SystemExit("kvt delivered wrong bytes")
    if not args.smoke:
        out = Path(__file__).parent / "results" / "tcp.json"
        out.parent.mkdir(exist_ok=True)
        meta = {
            "total_bytes": total, "repeats": repeats, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
            "load_average_before": load_before, "load_average_after": load_after,
            "skipped": skipped, "kvt_paths": result.kvt_paths,
        }  # fmt: skip
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
