"""jemalloc's own effect on numpy churn, by decay setting (why native mode uses what it uses).

Runs the numpy_churn workload (see workload.py) under glibc malloc and under jemalloc with
several MALLOC_CONF settings, with and without memprof's profiling, interleaved, medians.

    python packages/memprof/benchmarks/bench_jemalloc_decay.py          # full: table + JSON
    python packages/memprof/benchmarks/bench_jemalloc_decay.py --smoke
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import PY, _progress, run_one

RESULTS = Path(__file__).parent / "results" / "jemalloc_decay.json"
# plain jemalloc (no profiling): MALLOC_CONF as given
ALLOCATOR_ONLY = {
    "jemalloc defaults": "",
    "jemalloc background_thread:true": "background_thread:true",
    "jemalloc no decay (-1/-1)": "dirty_decay_ms:-1,muzzy_decay_ms:-1",
}
# `memprof run --native --malloc-conf X`: X is appended to memprof's default MALLOC_CONF
# (prof:true,lg_prof_sample:19,...,background_thread:true)
WITH_MEMPROF = {
    "memprof --native, background_thread:false": "background_thread:false",
    "memprof --native, background_thread:true (default)": "",
    "memprof --native, no decay, background_thread:false": (
        "background_thread:false,dirty_decay_ms:-1,muzzy_decay_ms:-1"
    ),
}


def main() -> None:
    from memprof.native import find_jemalloc

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    jem = find_jemalloc()
    if jem is None:
        print("libjemalloc.so.2 not found (apt install libjemalloc2): nothing to measure")
        return
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("numpy not installed: nothing to measure")
        return
    reps, scale = (1, 0.03) if args.smoke else (args.reps, 1.0)
    variants: dict[str, tuple[list[str], dict[str, str]]] = {"glibc malloc": ([PY], {})}
    for name, conf in ALLOCATOR_ONLY.items():
        variants[name] = ([PY], {"LD_PRELOAD": jem, "MALLOC_CONF": conf})
    for name, conf in WITH_MEMPROF.items():
        cmd = [PY, "-m", "memprof.cli", "run", "--out", "/tmp/memprof-decay", "--native"]
        variants[name] = ([*cmd, "--malloc-conf", conf, "--", PY], {})
    runs: dict[str, list[dict]] = {}
    rng = random.Random(2)
    with _progress() as progress:
        task = progress.add_task("runs", total=reps * len(variants))
        for rep in range(reps):
            order = list(variants)
            rng.shuffle(order)
            for name in order:
                progress.update(task, description=f"rep {rep + 1}/{reps} {name[:26]}")
                prefix, env = variants[name]
                runs.setdefault(name, []).append(run_one(prefix, env, "numpy_churn", scale))
                progress.advance(task)
    shutil.rmtree("/tmp/memprof-decay", ignore_errors=True)
    base = {k: statistics.median(r[k] for r in runs["glibc malloc"]) for k in ("wall", "cpu")}
    rows = {}
    print(f"{'allocator / MALLOC_CONF':<62} {'wall x':>7} {'cpu x':>7} {'RSS MiB':>8}")
    for name, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs) / base["wall"]
        cpu = statistics.median(r["cpu"] for r in rs) / base["cpu"]
        rss = statistics.median(r["peak_rss_mib"] for r in rs)
        rows[name] = {"wall_x": wall, "cpu_x": cpu, "peak_rss_mib": rss, "runs": rs}
        print(f"{name:<54} {wall:7.3f} {cpu:7.3f} {rss:8.1f}")
    if not args.smoke:
        RESULTS.write_text(json.dumps({"reps": reps, "rows": rows}, indent=1))
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
