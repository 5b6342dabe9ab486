"""put + get: refstore against one memcpy and Ray's object store, side by side in one run.

Every case runs inside Ray actors, interleaved round by round so that all see the same machine:

- **memcpy warm**: ``np.copyto`` of the payload's bytes into a preallocated, pre-faulted shared
  mapping (what a put must do at least: copy into shared memory the store has already mapped). This
  is the limit a put is held to (``put / memcpy``).
- **memcpy fresh**: ``np.copyto`` into freshly allocated memory (page faults included), shown for
  what a store that maps new memory per object pays.
- **refstore**, **Ray defaults** and **Ray zero-copy** (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``),
  each in one process (the producer actor puts and gets) and actor to actor (the producer puts, a
  consumer actor gets what it is handed). Ray's setting is read when a worker imports ray, so each
  Ray mode has its own pair of actors, started with the variable in its ``runtime_env`` env_vars;
  the run checks that it took effect (a torch get in zero-copy mode is a view of the object store:
  two gets of one object share memory; with the defaults they do not).

refstore's master runs as its own process (``refstore serve``), as it would on a node.

    python packages/refstore/benchmarks/bench_putget.py          # full: table + results/putget.json
    python packages/refstore/benchmarks/bench_putget.py --smoke  # tiny sizes, few rounds (CI)

Times are medians over rounds (40 up to 16 MiB after 5 untimed ones, 7 at 64-256 MiB, 5 at 1 GiB);
"get" is the time until the caller holds a usable array or tensor (a zero-copy view for refstore).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import refstore
import torch
from refstore import _fastpath
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

MIB = 1 << 20
RESULTS = Path(__file__).parent / "results" / "putget.json"
NAME = "bench-putget"
ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"
RAY_MODES = {"ray": "0", "rayzc": "1"}  # row prefix -> the variable's value in that mode's actors
SIZES_MIB = "1,4,16,64,256,1024"


def make(kind: str, nbytes: int):
    array = np.full(nbytes // 4, 7, dtype=np.float32)  # touched: no page faults inside the timing
    return torch.from_numpy(array) if kind == "torch" else array


def reps_for(nbytes: int) -> int:
    return 40 if nbytes <= 16 * MIB else 7 if nbytes <= 256 * MIB else 5


def warmup_for(nbytes: int) -> int:
    """Untimed rounds first, for every store: the first rounds of a case pay one-time costs (the
    reservations of a new size class, torch's first import in a worker, its thread pools spinning
    up) that would weigh on the median of the small sizes."""
    return 5 if nbytes <= 16 * MIB else 1


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def as_bytes(obj) -> np.ndarray:
    array = obj.numpy() if isinstance(obj, torch.Tensor) else obj
    return array.reshape(-1).view(np.uint8)


def actor_classes(ray):
    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, name: str) -> None:
            self.client = refstore.Client(name)
            self.obj = None
            self.warm: mmap.mmap | None = None
            self.warm_view: np.ndarray | None = None

        def make(self, kind: str, nbytes: int) -> None:
            self.obj = self.warm_view = None
            if self.warm is not None:
                self.warm.close()
                self.warm = None
            if nbytes == 0:
                return
            self.obj = make(kind, nbytes)
            # Shared memory mapped and faulted in ahead of time, as the store's pool is.
            self.warm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            self.warm_view = np.frombuffer(self.warm, dtype=np.uint8)
            np.copyto(self.warm_view, as_bytes(self.obj))

        def memcpy_warm(self) -> float:
            source = as_bytes(self.obj)
            return timed(lambda: np.copyto(self.warm_view, source))[0]

        def memcpy_fresh(self) -> float:
            source = as_bytes(self.obj)
            return timed(lambda: np.copyto(np.empty_like(source), source))[0]

        def put_refstore(self):
            t, ref = timed(lambda: self.client.put(self.obj))
            return ref, t

        def put_refstore_split(self):
            """The same put with its copy split over two threads (``set_copy_threads(2)``)."""
            previous = _fastpath.set_copy_threads(2)
            try:
                t, ref = timed(lambda: self.client.put(self.obj))
            finally:
                _fastpath.set_copy_threads(previous)
            return ref, t

        def put_ray(self):
            t, oref = timed(lambda: ray.put(self.obj))
            return [oref], t  # in a list: handed over as a reference, not resolved by Ray

        def same_refstore(self) -> tuple[float, float]:
            t_put, ref = timed(lambda: self.client.put(self.obj))
            t_get, view = timed(lambda ref=ref: self.client.get(ref))
            assert view.shape == self.obj.shape
            del view
            self.client.release(ref)
            return t_put, t_get

        def same_ray(self) -> tuple[float, float]:
            t_put, oref = timed(lambda: ray.put(self.obj))
            t_get, value = timed(lambda oref=oref: ray.get(oref))
            assert value.shape == self.obj.shape
            del value, oref
            return t_put, t_get

        def zero_copy_setting(self) -> bool:
            context = ray._private.worker.global_worker.get_serialization_context()
            return bool(context._zero_copy_tensors_enabled)

        def close(self) -> None:
            self.make("numpy", 0)
            self.client.close()

    @ray.remote(num_cpus=0)
    class Consumer:
        def __init__(self, name: str) -> None:
            self.client = refstore.Client(name)

        def get_refstore(self, ref) -> float:
            t, view = timed(lambda: self.client.get(ref))
            del view
            self.client.release(ref)
            return t

        def get_ray(self, orefs) -> float:
            t, value = timed(lambda: ray.get(orefs[0]))
            del value
            return t

        def gets_share_memory(self, orefs) -> bool:
            """Two gets of one object: the same memory when Ray's get is a view of its store."""
            first, second = ray.get(orefs[0]), ray.get(orefs[0])
            return first.data_ptr() == second.data_ptr()

        def close(self) -> None:
            self.client.close()

    return Producer, Consumer


def check_zero_copy_mode(ray, pairs) -> dict[str, bool]:
    """Does each Ray mode's pair run as configured? Checked on a tensor, the way the mode works."""
    found = {}
    for mode, (producer, consumer) in pairs.items():
        ray.get(producer.make.remote("torch", MIB))
        enabled = ray.get(producer.zero_copy_setting.remote())
        handle, _ = ray.get(producer.put_ray.remote())
        shares = ray.get(consumer.gets_share_memory.remote(handle))
        want = RAY_MODES[mode] == "1"
        if enabled != want or shares != want:
            raise RuntimeError(
                f"{mode}: {ZERO_COPY_ENV} enabled={enabled}, gets share memory={shares}; "
                f"expected {want}"
            )
        found[mode] = shares
    return found


def case(ray, pairs, kind: str, nbytes: int, *, reps: int, warmup: int) -> dict[str, float]:
    """One (kind, size): every store's rounds interleaved; medians in seconds."""
    for producer, _ in pairs.values():
        ray.get(producer.make.remote(kind, nbytes))
    rs_producer, rs_consumer = pairs["ray"]
    samples: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    def a2a(prefix: str, put: Any, get: Any) -> None:
        """The producer puts, the consumer gets what it was handed; both time their own call."""
        start = time.perf_counter()
        handle, t_put = ray.get(put.remote())
        t_get = ray.get(get.remote(handle))
        add(f"a2a_{prefix}_e2e", time.perf_counter() - start)
        add(f"a2a_{prefix}_put", t_put)
        add(f"a2a_{prefix}_get", t_get)

    def same(prefix: str, call: Any) -> None:
        t_put, t_get = ray.get(call.remote())
        add(f"same_{prefix}_put", t_put)
        add(f"same_{prefix}_get", t_get)

    def one_round() -> None:
        add("memcpy_warm", ray.get(rs_producer.memcpy_warm.remote()))
        add("memcpy_fresh", ray.get(rs_producer.memcpy_fresh.remote()))
        a2a("rs", rs_producer.put_refstore, rs_consumer.get_refstore)
        if nbytes >= _fastpath.SPLIT_MIN * 2:
            a2a("rs2", rs_producer.put_refstore_split, rs_consumer.get_refstore)
        same("rs", rs_producer.same_refstore)
        for mode, (producer, consumer) in pairs.items():
            a2a(mode, producer.put_ray, consumer.get_ray)
            same(mode, producer.same_ray)

    for _ in range(warmup):
        one_round()
    samples.clear()
    for _ in range(reps):
        one_round()
    for producer, _ in pairs.values():
        ray.get(producer.make.remote("numpy", 0))
    return {k: statistics.median(v) for k, v in samples.items()}


def ratios(row: dict[str, Any]) -> None:
    """Add the ratios the targets are stated in (>1 means refstore is faster)."""
    for where in ("same", "a2a"):
        rs = row[f"{where}_rs_put"] + row[f"{where}_rs_get"]
        row[f"{where}_put_over_memcpy"] = row[f"{where}_rs_put"] / row["memcpy_warm"]
        if f"{where}_rs2_put" in row:
            row[f"{where}_split_put_over_memcpy"] = row[f"{where}_rs2_put"] / row["memcpy_warm"]
        for mode in RAY_MODES:
            ray_total = row[f"{where}_{mode}_put"] + row[f"{where}_{mode}_get"]
            row[f"{where}_{mode}_over_rs"] = ray_total / rs


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


COLUMNS = (
    "case",
    "payload",
    "memcpy warm ms",
    "memcpy fresh ms",
    "rs put ms",
    "rs get ms",
    "put/memcpy",
    "2-thread put/memcpy",
    "Ray put+get ms",
    "Ray zc put ms",
    "Ray zc get ms",
    "Ray/rs",
    "Ray zc/rs",
)
MARKDOWN_SKIPS = {"2-thread put/memcpy"}  # in the JSON; the README says it in words


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One dict per line of the table (COLUMNS -> text): actor to actor, then one process."""
    out = []
    for where, label in (("a2a", "actor to actor"), ("same", "one process")):
        for row in rows:
            split = row.get(f"{where}_split_put_over_memcpy")
            cells = (
                label,
                f"{row['kind']} {row['mib']:g} MiB",
                ms(row["memcpy_warm"]),
                ms(row["memcpy_fresh"]),
                ms(row[f"{where}_rs_put"]),
                ms(row[f"{where}_rs_get"]),
                f"{row[f'{where}_put_over_memcpy']:.2f}",
                "" if split is None else f"{split:.2f}",
                ms(row[f"{where}_ray_put"] + row[f"{where}_ray_get"]),
                ms(row[f"{where}_rayzc_put"]),
                ms(row[f"{where}_rayzc_get"]),
                f"{row[f'{where}_ray_over_rs']:.2f}x",
                f"{row[f'{where}_rayzc_over_rs']:.2f}x",
            )
            out.append(dict(zip(COLUMNS, cells, strict=True)))
    return out


def print_table(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="put+get, ms (medians); ratios within this run")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("case", "payload") else "right")
    for line in table_rows(rows):
        table.add_row(*line.values())
    console.print(table)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README's table."""
    columns = [c for c in COLUMNS if c not in MARKDOWN_SKIPS]
    lines = ["| " + " | ".join(columns) + " |", "|---|---|" + "---:|" * (len(columns) - 2)]
    for line in table_rows(rows):
        line["Ray zc/rs"] = f"**{line['Ray zc/rs']}**"
        lines.append("| " + " | ".join(line[c] for c in columns) + " |")
    return "\n".join(lines)


def start_ray(workdir: str):
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    import ray

    kwargs = {
        "num_cpus": 2,
        "include_dashboard": False,
        "log_to_driver": False,
        "object_store_memory": 4 << 30,
        "runtime_env": {"env_vars": {"REFSTORE_DIR": workdir}},
    }
    for attempt in range(3):  # Ray allows its raylet a fixed 30 s: not always enough here
        try:
            ray.init(**kwargs)
            break
        except Exception as err:
            if "timed out during startup" not in str(err) or attempt == 2:
                raise
            ray.shutdown()
    return ray


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, two rounds each")
    parser.add_argument("--sizes-mib", default=None, help=f"default {SIZES_MIB} (smoke: 0.25,1)")
    parser.add_argument("--kinds", default="torch,numpy")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--markdown", type=Path, help="print the README table of a results file")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())["rows"]))
        return 0
    smoke = args.smoke
    sizes_mib = args.sizes_mib or ("0.25,1" if smoke else SIZES_MIB)
    sizes = [int(float(s) * MIB) for s in sizes_mib.split(",")]
    kinds = args.kinds.split(",")
    pool = 3 * max(sizes) + (256 * MIB)
    console = Console(stderr=True)
    workdir = tempfile.mkdtemp(prefix="refstore-bench-")
    os.environ["REFSTORE_DIR"] = workdir
    rows: list[dict[str, Any]] = []
    ray = None
    pairs: dict[str, tuple[Any, Any]] = {}
    master = client = None
    try:
        with console.status("starting refstore's master and Ray"):
            master = refstore.start_master_process(NAME, pool)
            client = refstore.Client(NAME)
            ray = start_ray(workdir)
            Producer, Consumer = actor_classes(ray)
            for mode, value in RAY_MODES.items():
                env = {"env_vars": {"REFSTORE_DIR": workdir, ZERO_COPY_ENV: value}}
                pairs[mode] = (
                    Producer.options(runtime_env=env).remote(NAME),
                    Consumer.options(runtime_env=env).remote(NAME),
                )
            verified = check_zero_copy_mode(ray, pairs)
        console.log(f"Ray modes checked (torch get shares the store's memory): {verified}")
        cases = [(kind, nbytes) for kind in kinds for nbytes in sizes]
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("cases", total=len(cases))
            for kind, nbytes in cases:
                progress.update(task, description=f"{kind} {nbytes / MIB:g} MiB")
                reps = 2 if smoke else reps_for(nbytes)
                warmup = 1 if smoke else warmup_for(nbytes)
                row = {"kind": kind, "mib": nbytes / MIB}
                row.update(case(ray, pairs, kind, nbytes, reps=reps, warmup=warmup))
                ratios(row)
                rows.append(row)
                split = row.get("a2a_split_put_over_memcpy")
                split_note = "" if split is None else f" (2 threads {split:.2f})"
                progress.console.log(
                    f"{kind} {nbytes / MIB:g} MiB: put/memcpy {row['a2a_put_over_memcpy']:.2f}"
                    f"{split_note}, "
                    f"Ray zero-copy/refstore {row['a2a_rayzc_over_rs']:.2f}x (actor to actor)"
                )
                progress.advance(task)
    finally:
        for producer, consumer in pairs.values():
            ray.get([producer.close.remote(), consumer.close.remote()])
        if ray is not None:
            ray.shutdown()
        if client is not None:
            client.shutdown_master("benchmark done")
            client.close()
        if master is not None:
            master.wait(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)

    print_table(Console(width=200), rows)
    if not smoke:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        note = "seconds; *_over_rs = Ray / refstore (put+get); put_over_memcpy = rs put / memcpy"
        args.out.write_text(json.dumps({"rows": rows, "note": note}, indent=1))
        console.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
