"""kvt under faults on purpose: 10,000 transfers per transport with random aborts and link faults.

Each transport runs the soak (tests/soak.py): two senders and a receiver in this process,
requests in waves, random aborts from both sides at random moments, and the senders' fault plan
dropping links (at a frame boundary and mid-payload), stalling writes and corrupting frame
headers. Every request must complete exactly once on each side, the two sides must agree (the
README's rule of agreement), DONE ones must be byte-exact, and no kvt thread or fd may be left
afterwards.

Then an abort storm per transport (2,240 transfers, 320 with --smoke): every request aborted from
both sides within about a millisecond, no faults. Crossed aborts must name one first aborter:
the count of those with two answers (both sides LOCAL or TIMEOUT) is printed and must be 0.

Usage: python bench_reliability.py [--smoke] [--transfers N] [--transport tcp memory]
Full mode writes results/reliability.json. Run under ``flock /tmp/bench.lock`` on shared machines.
Exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the soak lives there
from fault_plans import FaultRates
from soak import SOAK_TRANSPORTS, SoakReport, soak

RATES = FaultRates(drop=0.002, drop_mid=0.002, corrupt=0.002, stall=0.02)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="500 transfers each: a CI check")
    parser.add_argument("--transfers", type=int, default=10_000)
    parser.add_argument("--transport", nargs="+", default=list(SOAK_TRANSPORTS))
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--storm-transfers", type=int, default=2_240)
    args = parser.parse_args()
    transfers = 500 if args.smoke else args.transfers
    storm_transfers = 320 if args.smoke else args.storm_transfers
    logging.basicConfig(level=logging.ERROR)  # the injected faults log a warning each
    fds_before = len(os.listdir("/proc/self/fd"))
    rows, storms, failed = [], [], False
    for transport in args.transport:
        report = soak(transport, transfers, seed=args.seed, rates=RATES)
        leaks = _report(report, fds_before)
        failed |= bool(report.violations or any(leaks.values()))
        rows.append({
            "transport": transport, "transfers": report.transfers, "done": report.done,
            "seconds": round(report.seconds, 2),
            "transfers_per_s": round(report.transfers / report.seconds, 1),
            "abort_calls": report.local_aborts, "faults": dict(report.faults),
            "outcomes": dict(report.outcomes), "splits": report.splits,
            "crossed": report.crossed, "crossed_two_answers": report.two_answers,
            "violations": len(report.violations), **leaks,
        })  # fmt: skip
    for transport in args.transport:
        report = soak(transport, storm_transfers, seed=args.seed, storm=True)
        print("abort storm:", end=" ")
        leaks = _report(report, fds_before)
        print(f"  crossed aborts with two answers: {report.two_answers} of {report.crossed}")
        failed |= bool(report.violations or report.two_answers or any(leaks.values()))
        storms.append({
            "transport": transport, "transfers": report.transfers,
            "seconds": round(report.seconds, 2), "outcomes": dict(report.outcomes),
            "crossed": report.crossed, "crossed_two_answers": report.two_answers,
            "violations": len(report.violations), **leaks,
        })  # fmt: skip
    if not args.smoke:
        meta = {
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load": os.getloadavg()[0], "seed": args.seed, "rates": dataclasses.asdict(RATES),
        }  # fmt: skip
        out = Path(__file__).parent / "results" / "reliability.json"
        result = {"meta": meta, "rows": rows, "abort_storm": storms}
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 1 if failed else 0


def _report(report: SoakReport, fds_before: int) -> dict[str, int]:
    """Print a soak's summary and its first violations; returns what it leaked (nonzero: fail)."""
    leaked_threads = [t.name for t in threading.enumerate() if t.name.startswith("kvt-")]
    leaked_fds = len(os.listdir("/proc/self/fd")) - fds_before
    print(report.summary())
    for violation in report.violations[:10]:
        print("  VIOLATION", violation)
    if leaked_threads or leaked_fds:
        print(f"  LEAK: threads {leaked_threads}, fds {leaked_fds:+d}")
    return {"leaked_threads": len(leaked_threads), "leaked_fds": leaked_fds}


if __name__ == "__main__":
    sys.exit(main())
