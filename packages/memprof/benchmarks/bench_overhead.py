"""memprof overhead, side by side with plain, jemalloc alone, tracemalloc and memray.

Each (workload, variant) runs as its own process; variants are interleaved in a shuffled order
within every repetition and medians are reported, because the machine is shared. The workload
measures its own region (start-up excluded) in wall time and in CPU time of the whole process
(all threads: the snapshot writer and jemalloc's background threads are counted). Peak RSS
comes from wait4(). Also: snapshot write time with 100k live samples (in this process).

    python packages/memprof/benchmarks/bench_overhead.py            # full: table + JSON
    python packages/memprof/benchmarks/bench_overhead.py --smoke    # a few seconds (CI)
Run the full one under `flock /tmp/bench.lock` on shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
WORKLOAD = HERE / "workload.py"
RESULTS = HERE / "results" / "overhead.json"
PY = sys.executable


def _memray() -> str | None:
    cand = Path(PY).parent / "memray"
    return str(cand) if cand.exists() else shutil.which("memray")


def variants(
    tmp: Path, smoke: bool, baseline: str | None = None
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (command prefix before the workload script, extra environment).

    baseline: the Python of another checkout (e.g. the starting commit's .venv/bin/python):
    its `memprof run` is measured too, as `memprof_baseline`, for a before/after in one run."""
    from memprof.native import DEFAULT_MALLOC_CONF, find_jemalloc

    memprof_run = [PY, "-m", "memprof.cli", "run", "--out", str(tmp / "mp"), "--"]
    out: dict[str, tuple[list[str], dict[str, str]]] = {
        "plain": ([PY], {}),
        "memprof": ([*memprof_run[:-1], "--", PY], {}),
    }
    if baseline:
        base_run = [baseline, "-m", "memprof.cli", "run", "--out", str(tmp / "mp"), "--"]
        out["memprof_baseline"] = ([*base_run, baseline], {})
    jem = find_jemalloc()
    if jem is not None:
        out["memprof_native"] = ([*memprof_run[:-1], "--native", "--", PY], {})
        if not smoke:
            # the allocator alone, with the same non-profiling settings native mode uses
            conf = ",".join(o for o in DEFAULT_MALLOC_CONF.split(",") if "prof" not in o)
            out["jemalloc_only"] = ([PY], {"LD_PRELOAD": str(jem), "MALLOC_CONF": conf})
    if not smoke:
        out["tracemalloc_1"] = ([PY, "-X", "tracemalloc=1"], {})
        memray = _memray()
        if memray:
            out["memray"] = ([memray, "run", "-q", "-f", "-o", str(tmp / "memray.bin")], {})
    return out


def run_one(prefix: list[str], env_extra: dict[str, str], workload: str, scale: float) -> dict:
    env = dict(os.environ, **env_extra)
    cmd = [*prefix, str(WORKLOAD), workload, "--scale", str(scale)]
    with (
        tempfile.TemporaryFile() as err,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env) as proc,
    ):
        out = proc.stdout.read()
        # wait4 (not Popen.wait) to get this child's own rusage: its peak RSS
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{cmd} failed ({proc.returncode}): {err.read().decode()[-2000:]}")
    line = [ln for ln in out.decode().splitlines() if ln.startswith("{")][-1]
    res = json.loads(line)
    res["peak_rss_mib"] = usage.ru_maxrss / 1024
    return res


def snapshot_write_time(n_samples: int, reps: int) -> dict:
    import memprof

    def alloc_at_depth(depth: int, n: int, out: list) -> None:
        if depth:
            alloc_at_depth(depth - 1, n, out)
            return
        for _ in range(n):
            out.append(bytearray(40))

    keep: list = []
    keep_b: list = []
    memprof.start(mean=1, seed=1)  # every allocation sampled
    try:
        per_stack = max(1, n_samples // 2 // 1000)
        calls = 0
        while memprof.stats()["live_samples"] < n_samples:  # ~1000 distinct stacks
            alloc_at_depth(calls % 50, per_stack, keep if calls % 2 else keep_b)
            calls += 1
        live = memprof.stats()["live_samples"]
        stacks = memprof.stats()["stacks"]
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "snap.mprof"
            writes = [memprof.write_snapshot(path) for _ in range(reps)]
            size = path.stat().st_size
        encodes = []
        for _ in range(reps):
            t0 = time.perf_counter()
            memprof._core.snapshot_bytes()
            encodes.append(time.perf_counter() - t0)
    finally:
        memprof.stop()
    return {
        "live_samples": live,
        "stacks": stacks,
        "file_bytes": size,
        "write_ms_median": 1e3 * statistics.median(writes),
        "encode_ms_median": 1e3 * statistics.median(encodes),
        "write_ms_all": [1e3 * w for w in writes],
    }


def _median_ratio(by_variant: dict[str, list[dict]], name: str, key: str) -> float:
    return statistics.median(r[key] for r in by_variant[name]) / statistics.median(
        r[key] for r in by_variant["plain"]
    )


def _progress():
    """A rich progress bar on stderr (the tables go to stdout)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[progress.description]{task.description:<36}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--workloads", default="dict_list_str,object_graph,numpy_churn,threaded_mix")
    ap.add_argument(
        "--variants", help="comma-separated subset of the variants (default: all available)"
    )
    ap.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="also measure `memprof run` of another checkout (its .venv/bin/python)",
    )
    args = ap.parse_args()
    reps, scale = (1, 0.03) if args.smoke else (args.reps, args.scale)
    workloads = args.workloads.split(",")
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("numpy not installed: skipping numpy_churn and threaded_mix")
        workloads = [w for w in workloads if w not in ("numpy_churn", "threaded_mix")]
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="memprof-bench-") as tmpdir, _progress() as progress:
        tmp = Path(tmpdir)
        var = variants(tmp, args.smoke, args.baseline)
        if args.variants:
            keep = {"plain", *args.variants.split(",")}
            var = {name: v for name, v in var.items() if name in keep}
        rng = random.Random(1)
        task = progress.add_task("runs", total=reps * len(workloads) * len(var))
        for rep in range(reps):
            for wl in workloads:
                order = list(var)
                rng.shuffle(order)
                for name in order:
                    progress.update(task, description=f"rep {rep + 1}/{reps} {wl} {name}")
                    prefix, env = var[name]
                    res = run_one(prefix, env, wl, scale)
                    runs.setdefault(wl, {}).setdefault(name, []).append(res)
                    shutil.rmtree(tmp / "mp", ignore_errors=True)
                    (tmp / "memray.bin").unlink(missing_ok=True)
                    progress.advance(task)
            if "memprof" in var and "plain" in var:
                so_far = ", ".join(
                    f"{wl} {_median_ratio(runs[wl], 'memprof', 'cpu'):.3f}" for wl in workloads
                )
                progress.console.print(f"rep {rep + 1}/{reps}: memprof CPU x plain so far {so_far}")
        progress.update(task, description="snapshot write time")
        snap = snapshot_write_time(10_000 if args.smoke else 100_000, 3 if args.smoke else 15)

    summary: dict[str, dict[str, dict]] = {}
    for wl, by_var in runs.items():
        base = {k: statistics.median(r[k] for r in by_var["plain"]) for k in ("wall", "cpu")}
        base_rss = statistics.median(r["peak_rss_mib"] for r in by_var["plain"])
        for name, rs in by_var.items():
            wall = statistics.median(r["wall"] for r in rs)
            cpu = statistics.median(r["cpu"] for r in rs)
            rss = statistics.median(r["peak_rss_mib"] for r in rs)
            summary.setdefault(wl, {})[name] = {
                "wall_s": wall,
                "cpu_s": cpu,
                "peak_rss_mib": rss,
                "wall_x": wall / base["wall"],
                "cpu_x": cpu / base["cpu"],
                "rss_x": rss / base_rss,
                "runs": rs,
            }
    names = list(next(iter(summary.values())))
    print(f"\n{'workload':<14} {'variant':<15} {'wall s':>7} {'x':>6} {'cpu s':>7} {'x':>6} "
          f"{'RSS MiB':>8} {'x':>6}")  # fmt: skip
    for wl, by_var in summary.items():
        for name in names:
            s = by_var[name]
            print(f"{wl:<14} {name:<15} {s['wall_s']:7.3f} {s['wall_x']:6.3f} {s['cpu_s']:7.3f} "
                  f"{s['cpu_x']:6.3f} {s['peak_rss_mib']:8.1f} {s['rss_x']:6.3f}")  # fmt: skip
    geo = {}
    for name in names:
        for key in ("wall_x", "cpu_x", "rss_x"):
            vals = [summary[wl][name][key] for wl in summary]
            geo.setdefault(name, {})[key] = statistics.geometric_mean(vals)
    print("\ngeomean over workloads (x plain):")
    for name, g in geo.items():
        print(f"  {name:<15} wall {g['wall_x']:.3f}  cpu {g['cpu_x']:.3f}  rss {g['rss_x']:.3f}")
    print(
        f"\nsnapshot with {snap['live_samples']} live samples, {snap['stacks']} stacks: "
        f"write+fsync+rename {snap['write_ms_median']:.2f} ms (median), "
        f"encode {snap['encode_ms_median']:.2f} ms, file {snap['file_bytes']} B"
    )
    if not args.smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        load = os.getloadavg()
        RESULTS.write_text(
            json.dumps(
                {
                    "reps": reps,
                    "scale": scale,
                    "loadavg_at_end": load,
                    "summary": summary,
                    "geomean": geo,
                    "snapshot": snap,
                },
                indent=1,
            )
        )
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
