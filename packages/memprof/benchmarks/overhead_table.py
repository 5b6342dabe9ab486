"""The README's overhead tables (markdown) from bench_overhead.py's results JSON.

python packages/memprof/benchmarks/overhead_table.py [results/overhead.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = [
    "plain",
    "memprof",
    "memprof_baseline",
    "memprof_native",
    "jemalloc_only",
    "tracemalloc_1",
    "memray",
]


def tables(doc: dict) -> str:
    summary, geo = doc["summary"], doc["geomean"]
    workloads = list(summary)
    names = [n for n in ORDER if n in geo] + [n for n in geo if n not in ORDER]
    head = "| variant | " + " | ".join(workloads) + " | geomean |"
    rule = "|---" * (len(workloads) + 2) + "|"
    out = [head, rule]
    for n in names:
        cells = [f"{summary[w][n]['cpu_x']:.3f} ({summary[w][n]['wall_x']:.2f})" for w in workloads]
        g = geo[n]
        out.append(
            f"| {n} | " + " | ".join(cells) + f" | **{g['cpu_x']:.3f}** ({g['wall_x']:.2f}) |"
        )
    out += ["", "| peak RSS (MiB, ratio) | " + " | ".join(workloads) + " | geomean |", rule]
    for n in names:
        cells = [
            f"{summary[w][n]['peak_rss_mib']:.1f} ({summary[w][n]['rss_x']:.3f})" for w in workloads
        ]
        out.append(f"| {n} | " + " | ".join(cells) + f" | {geo[n]['rss_x']:.3f} |")
    plain = ", ".join(
        f"{w} {summary[w]['plain']['cpu_s']:.2f} / {summary[w]['plain']['wall_s']:.2f}"
        for w in workloads
    )
    snap = doc["snapshot"]
    load = ", ".join(f"{x:.1f}" for x in doc["loadavg_at_end"])
    out += [
        "",
        f"plain medians (s, CPU / wall): {plain}",
        "",
        f"Snapshot with {snap['live_samples']} live samples ({snap['stacks']} stacks): encode "
        f"{snap['encode_ms_median']:.2f} ms, write + fsync + rename "
        f"{snap['write_ms_median']:.2f} ms (median of {len(snap['write_ms_all'])}), file "
        f"{snap['file_bytes']} bytes. Load average at the end: {load}.",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    default = Path(__file__).parent / "results" / "overhead.json"
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    print(tables(json.loads(path.read_text())))
