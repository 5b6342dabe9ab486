"""One allocation-heavy workload, run as its own process by bench_overhead.py.

Prints one JSON line: wall and CPU seconds of the measured region (start-up excluded).
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def dict_list_str(scale: float) -> None:
    keep: list = []
    for i in range(int(800_000 * scale)):
        d = {"id": i, "name": f"item-{i}", "tags": [str(i), str(i * 2)], "pos": (i, i + 1)}
        keep.append(d)
        if len(keep) > 5000:
            keep = keep[2500:]


class Node:
    __slots__ = ("children", "payload", "value")

    def __init__(self, value: int) -> None:
        self.value = value
        self.payload = [value] * 4
        self.children: list[Node] = []


def object_graph(scale: float) -> None:
    for _ in range(max(1, int(6 * scale))):
        root = Node(0)
        frontier = [root]
        count = 1
        while count < 60_000:
            nxt = []
            for node in frontier:
                for _ in range(4):
                    child = Node(count)
                    node.children.append(child)
                    nxt.append(child)
                    count += 1
            frontier = nxt
        del root, frontier, nxt  # teardown


def numpy_churn(scale: float) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    sizes = [1 << 14, 1 << 17, 1 << 20, 1 << 22]  # 128 KiB .. 32 MiB of float64
    acc = 0.0
    for i in range(int(100 * scale)):
        n = sizes[i % len(sizes)] // (8 if i % 3 else 1)
        a = rng.standard_normal(n)
        b = a * 2.0 + 1.0
        c = np.concatenate([a, b])
        acc += float(c[::97].sum())
    if acc == 42.0:  # keep the work observable
        print(acc)


def threaded_mix(scale: float) -> None:
    threads = [
        threading.Thread(target=dict_list_str, args=(scale / 2,)),
        threading.Thread(target=object_graph, args=(scale / 2,)),
        threading.Thread(target=numpy_churn, args=(scale / 2,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


WORKLOADS = {
    "dict_list_str": dict_list_str,
    "object_graph": object_graph,
    "numpy_churn": numpy_churn,
    "threaded_mix": threaded_mix,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--scale", type=float, default=1.0)
    args = p.parse_args()
    fn = WORKLOADS[args.workload]
    w0, c0 = time.perf_counter(), time.process_time()
    fn(args.scale)
    w1, c1 = time.perf_counter(), time.process_time()
    print(json.dumps({"wall": w1 - w0, "cpu": c1 - c0}), flush=True)


if __name__ == "__main__":
    main()
