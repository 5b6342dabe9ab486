"""KVS load path: a store hit's bytes into vLLM's scattered blocks, against a memcpy of them.

One process, a real refstore master, a KV cache laid out as vLLM's CPU backend lays it out
(one buffer; per layer ``[num_blocks, kv_heads, block_size, 2 * head_dim]``). A context of
``--tokens`` tokens (each size given) is saved through ``KvsWorker`` (as vLLM's worker saves
it), then loaded into other, shuffled blocks:

* memcpy: the same bytes copied from the stored objects' payloads to the same scattered block
  segments, one C ``memcpy`` per segment in one native loop (refstore's segment copy), with the
  objects already looked up and located and every address computed beforehand: the copy alone,
  the least any load must do;
* KVS load, verify=header / verify=checksum: ``KvsWorker`` loading the hit as it does in vLLM
  (the objects located in the pool, the trailers checked, with the checksum or without, the
  addresses computed, the copy); timed from the load's hand-over to its report.

Reported per size: medians over ``--repeats`` and load/memcpy as throughput ratios (memcpy
time / load time: 1.0 = as fast as the memcpy).

    python packages/hybrid-connector/benchmarks/bench_kvs_load.py        # 16k and 32k tokens
    python packages/hybrid-connector/benchmarks/bench_kvs_load.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import refstore
from hybrid_connector import kvs_keys
from hybrid_connector.config import KvsConfig
from hybrid_connector.kvs_worker import GroupCopy, KvsWorker
from hybrid_connector.layout import Buffer, CacheGeometry, KvCacheGeometry
from hybrid_connector.metadata import KvsLoad, KvsSave
from ipcblock import Segment

RESULTS = Path(__file__).parent / "results"


def make_cache(layers: int, heads: int, head_dim: int, block_size: int, num_blocks: int):
    block_bytes = heads * block_size * 2 * head_dim * 2  # bf16, K and V interleaved per head
    buffer = np.zeros(layers * num_blocks * block_bytes, np.uint8)
    group = KvCacheGeometry(
        buffers=(),
        layer_names=tuple(f"l{i}" for i in range(layers)),
        layer_offsets=tuple(i * num_blocks * block_bytes for i in range(layers)),
        buffer_index=(0,) * layers,
        num_blocks=num_blocks,
        block_size=block_size,
        segments=(Segment("kv", 0, block_bytes, block_bytes),),
        kind="blocks_major",
        family="attention",
        dtype="bfloat16",
        total_heads=heads,
        num_heads=heads,
    )
    geometry = CacheGeometry((Buffer(buffer.ctypes.data, buffer.nbytes),), (group,))
    return buffer, geometry


def measure(args: argparse.Namespace, tokens: int) -> dict[str, float]:
    """Medians (seconds) of the memcpy and the two loads of a ``tokens``-token hit."""
    blocks = tokens // args.block_size
    buffer, geometry = make_cache(
        args.layers, args.heads, args.head_dim, args.block_size, 2 * blocks + 1
    )
    rng = np.random.default_rng(0)
    buffer[:] = rng.integers(0, 256, buffer.size, dtype=np.uint8)
    payload = geometry.groups[0].segments[0].nbytes * args.layers * blocks
    name = f"bench-kvs-{uuid.uuid4().hex[:6]}"
    pool = max(256 << 20, int(payload * 1.3))
    store = refstore.connect(name, autostart=True, pool_size=pool)
    results: dict[str, list[float]] = {"memcpy": [], "header": [], "checksum": []}
    try:
        done = threading.Event()
        saved = threading.Event()
        outcome: dict[str, bool] = {}

        def report(request_id: str, failed: bool) -> None:
            outcome[request_id] = failed
            done.set()

        workers = {
            verify: KvsWorker(
                KvsConfig(store=name, verify=verify),
                geometry,
                tp_rank=0,
                tp_size=1,
                connect=lambda: refstore.Client(name),
                report_load=report,
                report_save=lambda save_id: saved.set(),
            )
            for verify in ("header", "checksum")
        }
        root = kvs_keys.root_key(kvs_keys.ModelIdentity("bench"), [])
        chains = kvs_keys.chain(root, np.arange(tokens), args.block_size)
        src_blocks = list(range(blocks))
        workers["checksum"].handle([], [KvsSave(0, [src_blocks], chains)])
        workers["checksum"].step_done()
        if not saved.wait(600):
            raise SystemExit("save did not finish")
        keys, _ = kvs_keys.lookup_keys(chains, [geometry.groups[0]], 1)  # type: ignore[list-item]
        copy = GroupCopy.of(geometry.groups[0], geometry.buffers)
        for i in range(args.repeats):
            dst_blocks = list(blocks + 1 + rng.permutation(blocks))
            refs = store.lookup(keys, hold_s=60)
            assert len(refs) == blocks, f"the store holds {len(refs)} of {blocks} blocks"
            # memcpy: objects located and every address computed first; then the copy alone.
            located = store.payloads(refs)
            src = (located.offsets[:, None] + copy.offset[None, :]).ravel()
            dst, lengths = copy.kv_addresses(dst_blocks)
            t = time.perf_counter()
            located.copy_out(src, dst, lengths)
            results["memcpy"].append(time.perf_counter() - t)
            del located
            for verify in ("header", "checksum"):
                sources = [[(r, 0)] for r in refs]
                done.clear()
                t = time.perf_counter()
                workers[verify].handle(
                    [KvsLoad(f"r{i}{verify}", [dst_blocks], chains, sources)], []
                )
                assert done.wait(600)
                results[verify].append(time.perf_counter() - t)
                assert outcome[f"r{i}{verify}"] is False, "load failed"
            # The loaded blocks hold the saved bytes.
            for block_src, block_dst in list(zip(src_blocks, dst_blocks, strict=True))[:8]:
                a, _ = copy.kv_addresses([block_src])
                b, _ = copy.kv_addresses([block_dst])
                base = buffer.ctypes.data
                n = int(copy.length[0])
                assert np.array_equal(
                    buffer[int(a[0]) - base : int(a[0]) - base + n],
                    buffer[int(b[0]) - base : int(b[0]) - base + n],
                )
            store.unhold(refs)
        for worker in workers.values():
            worker.close()
    finally:
        store.shutdown_master()
        store.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    mib = payload / 2**20
    print(
        f"{tokens} tokens, {blocks} blocks, {args.layers} layers: {mib:.0f} MiB, "
        f"{args.repeats} repeats"
    )
    for k in ("memcpy", "header", "checksum"):
        ratio = med["memcpy"] / med[k]
        print(f"  {k:8s} {med[k] * 1e3:8.2f} ms  {mib / 1024 / med[k]:6.2f} GiB/s  x{ratio:.2f}")
    return {**med, "mib": mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS / "kvs_load.json")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.repeats, args.layers = [1024], 2, 2
    sizes = {str(tokens): measure(args, tokens) for tokens in args.tokens}
    if not args.smoke:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "args": vars(args) | {"json": str(args.json)},
            "date": time.strftime("%Y-%m-%d"),
            "median_s": sizes,
        }
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
