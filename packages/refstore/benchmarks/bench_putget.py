"""put + get: refstore against Ray's object store (ray.put / ray.get), side by side in one run.

Cases: numpy arrays and torch CPU tensors of 1 MiB .. 1 GiB, in one process, and actor to actor
(a producer actor puts, a consumer actor gets what it is handed). Ray runs with its defaults (torch
tensors are pickled; numpy gets are zero-copy). refstore's master runs as its own process
(``refstore serve``), as it would on a node.

    python packages/refstore/benchmarks/bench_putget.py          # full: table + results/putget.json
    python packages/refstore/benchmarks/bench_putget.py --smoke  # a few seconds, no Ray

Times are medians over repetitions (40 up to 16 MiB, after 5 untimed rounds for each store); "get"
is the time until the caller holds a usable array or tensor (zero-copy view for refstore).
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
from pathlib import Path
from typing import Any

import numpy as np
import refstore
import torch

MIB = 1 << 20
RESULTS = Path(__file__).parent / "results" / "putget.json"
POOL = "2560M"
NAME = "bench-putget"


def make(kind: str, nbytes: int):
    array = np.full(nbytes // 4, 7, dtype=np.float32)  # touched: no page faults inside the timing
    return torch.from_numpy(array) if kind == "torch" else array


def reps_for(nbytes: int) -> int:
    return 40 if nbytes <= 16 * MIB else 5 if nbytes <= 256 * MIB else 3


def warmup_for(nbytes: int) -> int:
    """Untimed rounds first, for both stores: the first rounds of a case pay one-time costs (the
    reservations of a new size class, torch's first import in a worker, its thread pools spinning
    up) that would weigh on the median of the small sizes."""
    return 5 if nbytes <= 16 * MIB else 0


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


# -- same process ---------------------------------------------------------------------------------
def refstore_same(client: refstore.Client, obj, reps: int) -> tuple[float, float]:
    puts, gets = [], []
    for _ in range(warmup_for(obj.nbytes)):
        client.release(client.put(obj))
    for _ in range(reps):
        t_put, ref = timed(lambda: client.put(obj))
        t_get, view = timed(lambda ref=ref: client.get(ref))
        assert view.shape == obj.shape
        del view
        client.release(ref)
        puts.append(t_put)
        gets.append(t_get)
    return statistics.median(puts), statistics.median(gets)


def ray_same(ray, obj, reps: int) -> tuple[float, float]:
    puts, gets = [], []
    for _ in range(warmup_for(obj.nbytes)):
        ray.get(ray.put(obj))
    for _ in range(reps):
        t_put, oref = timed(lambda: ray.put(obj))
        t_get, value = timed(lambda oref=oref: ray.get(oref))
        assert value.shape == obj.shape
        del value, oref
        puts.append(t_put)
        gets.append(t_get)
    return statistics.median(puts), statistics.median(gets)


# -- actor to actor -------------------------------------------------------------------------------
def actor_classes(ray):
    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, name: str) -> None:
            self.client = refstore.Client(name)
            self.obj = None

        def make(self, kind: str, nbytes: int) -> None:
            self.obj = None
            self.obj = make(kind, nbytes)

        def put_refstore(self):
            t, ref = timed(lambda: self.client.put(self.obj))
            return ref, t

        def put_ray(self):
            t, oref = timed(lambda: ray.put(self.obj))
            return [oref], t  # in a list: handed over as a reference, not resolved by Ray

        def close(self) -> None:
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

        def close(self) -> None:
            self.client.close()

    return Producer, Consumer


def actor_case(ray, actors, kind: str, nbytes: int, reps: int) -> dict[str, float]:
    producer, consumer = actors
    ray.get(producer.make.remote(kind, nbytes))
    out: dict[str, list[float]] = {
        k: [] for k in ("rs_put", "rs_get", "rs_e2e", "ray_put", "ray_get", "ray_e2e")
    }

    def one_round(prefix: str, put: Any, get: Any) -> None:
        """The producer puts, the consumer gets what it was handed; both time their own call."""
        start = time.perf_counter()
        handle, t_put = ray.get(put.remote())
        t_get = ray.get(get.remote(handle))
        out[f"{prefix}_e2e"].append(time.perf_counter() - start)
        out[f"{prefix}_put"].append(t_put)
        out[f"{prefix}_get"].append(t_get)

    for _ in range(warmup_for(nbytes)):
        one_round("rs", producer.put_refstore, consumer.get_refstore)
        one_round("ray", producer.put_ray, consumer.get_ray)
    out = {k: [] for k in out}
    for _ in range(reps):  # interleaved, so both see the same machine
        one_round("rs", producer.put_refstore, consumer.get_refstore)
        one_round("ray", producer.put_ray, consumer.get_ray)
    ray.get(producer.make.remote("numpy", 0))
    return {k: statistics.median(v) for k, v in out.items()}


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, refstore only, no Ray")
    parser.add_argument("--sizes-mib", default="1,16,256,1024")
    args = parser.parse_args()
    smoke = args.smoke
    sizes = [MIB, 4 * MIB] if smoke else [int(s) * MIB for s in args.sizes_mib.split(",")]
    workdir = tempfile.mkdtemp(prefix="refstore-bench-")
    os.environ["REFSTORE_DIR"] = workdir
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    master = refstore.start_master_process(NAME, "64M" if smoke else POOL)
    client = refstore.Client(NAME)
    rows = []
    ray = None
    producer = consumer = None
    try:
        if not smoke:
            import ray as ray_module

            ray = ray_module
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=4 << 30,
                runtime_env={"env_vars": {"REFSTORE_DIR": workdir}},
            )
            Producer, Consumer = actor_classes(ray)
            producer, consumer = Producer.remote(NAME), Consumer.remote(NAME)
        for kind in ("numpy", "torch"):
            for nbytes in sizes:
                obj = make(kind, nbytes)
                reps = 3 if smoke else reps_for(nbytes)
                rs_put, rs_get = refstore_same(client, obj, reps)
                row = {
                    "case": "same process",
                    "kind": kind,
                    "mib": nbytes // MIB,
                    "rs_put": rs_put,
                    "rs_get": rs_get,
                }
                if ray is not None:
                    row["ray_put"], row["ray_get"] = ray_same(ray, obj, reps)
                rows.append(row)
                del obj
                if ray is not None:
                    a2a = actor_case(ray, (producer, consumer), kind, nbytes, reps)
                    rows.append(
                        {"case": "actor to actor", "kind": kind, "mib": nbytes // MIB, **a2a}
                    )
                print(f"done {kind} {nbytes // MIB} MiB", file=sys.stderr, flush=True)
    finally:
        if producer is not None:
            ray.get([producer.close.remote(), consumer.close.remote()])
        if ray is not None:
            ray.shutdown()
        client.shutdown_master("benchmark done")
        client.close()
        master.wait(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)

    header = f"{'case':15} {'kind':6} {'MiB':>5} | {'rs put ms':>9} {'rs get ms':>9}"
    if not smoke:
        header += (
            f" | {'ray put ms':>10} {'ray get ms':>10} | {'put x':>6} {'get x':>8} {'put+get x':>9}"
        )
    print(header)
    for row in rows:
        line = (
            f"{row['case']:15} {row['kind']:6} {row['mib']:5d} | "
            f"{fmt_ms(row['rs_put'])} {fmt_ms(row['rs_get'])}"
        )
        if "ray_put" in row:
            row["put_speedup"] = row["ray_put"] / row["rs_put"]
            row["get_speedup"] = row["ray_get"] / row["rs_get"]
            row["putget_speedup"] = (row["ray_put"] + row["ray_get"]) / (
                row["rs_put"] + row["rs_get"]
            )
            line += (
                f" | {fmt_ms(row['ray_put']):>10} {fmt_ms(row['ray_get']):>10} | "
                f"{row['put_speedup']:6.2f} {row['get_speedup']:8.1f} {row['putget_speedup']:9.2f}"
            )
        print(line)
    if not smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            json.dumps({"rows": rows, "note": "seconds; *_speedup = ray / refstore"}, indent=1)
        )
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
