"""KVS save path: a prefill step's blocks into the store, gathered layer by layer or at its end.

One process, a real refstore master, a KV cache laid out as vLLM's CPU backend lays it out (as
``bench_kvs_load.py``). A prefill step of ``--tokens`` tokens is simulated the way vLLM runs it:
per layer a stand-in for the layer's compute (a float32 matmul, one BLAS thread, sized by
``--layer-ms``) and then ``KvsWorker.layer_written`` (vLLM's ``save_kv_layer``), and at the end
``step_done`` (``wait_for_save``). Both ways take turns, with new keys every step:

* by layer (``save_by_layer=True``, the default): each layer's segments are gathered into the
  save's staging buffer by the KVS thread while the next layers compute;
* at the end (``save_by_layer=False``): every byte is gathered after the step.

Reported: medians over ``--repeats`` of the step (its compute, slowed or not by the gathers
beside it) and of the save's latency (the step's end to the save reported: what the store lacks
meanwhile), and their ratios (by layer / at the end).

    OMP_NUM_THREADS=1 python packages/hybrid-connector/benchmarks/bench_kvs_save.py
    ... bench_kvs_save.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy: the forward's one BLAS thread

import numpy as np
import refstore
from bench_kvs_load import make_cache
from hybrid_connector import kvs_keys
from hybrid_connector.config import KvsConfig
from hybrid_connector.kvs_worker import KvsWorker
from hybrid_connector.metadata import KvsSave

RESULTS = Path(__file__).parent / "results"


def _layer_work(ms: float) -> tuple[np.ndarray, np.ndarray]:
    """Matrices whose product takes about ``ms`` on this host (one thread)."""
    n = 128
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a  # the BLAS library's first call sets it up
    while True:
        t = time.perf_counter()
        a @ a
        took = (time.perf_counter() - t) * 1e3
        if took >= ms or n >= 4096:
            return a, a
        n = int(n * min(2.0, max(1.1, (ms / max(took, 1e-3)) ** (1 / 3))))
        a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layer-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS / "kvs_save.json")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.repeats, args.layers, args.layer_ms = 1024, 2, 2, 2.0
    blocks = args.tokens // args.block_size
    buffer, geometry = make_cache(args.layers, args.heads, args.head_dim, args.block_size, blocks)
    buffer[:] = np.random.default_rng(0).integers(0, 256, buffer.size, dtype=np.uint8)
    payload = geometry.groups[0].segments[0].nbytes * args.layers * blocks
    a, b = _layer_work(args.layer_ms)
    name = f"bench-kvs-save-{uuid.uuid4().hex[:6]}"
    # Room for every step's objects: the saves must not wait on eviction.
    pool = int(payload * 1.2 * 2 * args.repeats) + (64 << 20)
    store = refstore.connect(name, autostart=True, pool_size=pool)
    ways = {"by_layer": True, "at_end": False}
    step: dict[str, list[float]] = {way: [] for way in ways}
    latency: dict[str, list[float]] = {way: [] for way in ways}
    saved = threading.Event()
    workers = {
        way: KvsWorker(
            KvsConfig(store=name, save_by_layer=by_layer),
            geometry,
            tp_rank=0,
            tp_size=1,
            connect=lambda: refstore.Client(name),
            report_load=lambda request_id, failed: None,
            report_save=lambda save_id: saved.set(),
        )
        for way, by_layer in ways.items()
    }
    try:
        for i in range(args.repeats):
            for way in ways if i % 2 == 0 else reversed(list(ways)):  # order flips each turn
                worker = workers[way]
                root = kvs_keys.root_key(kvs_keys.ModelIdentity(f"bench-{way}-{i}"), [])
                chains = kvs_keys.chain(root, np.arange(args.tokens), args.block_size)
                saved.clear()
                t = time.perf_counter()
                worker.handle([], [KvsSave(i, [list(range(blocks))], chains)])
                for layer in range(args.layers):
                    a @ b  # the layer's compute; its KV is written
                    worker.layer_written(f"l{layer}")
                worker.step_done()
                end = time.perf_counter()
                if not saved.wait(600):
                    raise SystemExit("the save did not finish")
                step[way].append(end - t)
                latency[way].append(time.perf_counter() - end)
                assert worker.counters["save_failures"] == 0
    finally:
        for worker in workers.values():
            worker.close()
        store.shutdown_master()
        store.close()
    med_step = {way: statistics.median(v) for way, v in step.items()}
    med_latency = {way: statistics.median(v) for way, v in latency.items()}
    ratios = {
        "step": med_step["by_layer"] / med_step["at_end"],
        "save_latency": med_latency["by_layer"] / med_latency["at_end"],
        "step_plus_save": (med_step["by_layer"] + med_latency["by_layer"])
        / (med_step["at_end"] + med_latency["at_end"]),
    }
    mib = payload / 2**20
    print(
        f"{args.tokens} tokens, {blocks} blocks, {args.layers} layers of ~{args.layer_ms:g} ms: "
        f"{mib:.0f} MiB saved per step, {args.repeats} repeats"
    )
    for way in ways:
        print(
            f"  {way:9s} step {med_step[way] * 1e3:8.1f} ms   "
            f"save done {med_latency[way] * 1e3:7.1f} ms after it"
        )
    print("  by layer / at end: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    if not args.smoke:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "median_step_s": med_step,
                    "median_save_latency_s": med_latency,
                    "ratios": ratios,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
