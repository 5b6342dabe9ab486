"""ParseBlock throughput: vectorised parse_blocks vs a naive Python loop, same inputs, same run.

Usage: python bench_parse.py [--smoke]
Full mode prints a table and writes results/parse.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from ipcblock import IPCBLOCK_DTYPE, PagedKVLayout, parse_blocks, stacked_layer_offsets


def naive_parse(src: PagedKVLayout, dst: PagedKVLayout, src_ids, dst_ids, layers) -> np.ndarray:
    """What one would write first: a Python loop per (layer, segment, block) plus a merge loop."""
    records: list[tuple[int, int, int, int, int, int]] = []
    for layer in layers:
        s_base, d_base = int(src.layer_offsets[layer]), int(dst.layer_offsets[layer])
        entries = []
        for s_seg, d_seg in zip(src.segments, dst.segments, strict=True):
            for s_id, d_id in zip(src_ids, dst_ids, strict=True):
                entries.append(
                    (
                        s_base + s_seg.offset + int(s_id) * s_seg.block_stride,
                        d_base + d_seg.offset + int(d_id) * d_seg.block_stride,
                        s_seg.nbytes,
                    )
                )
        entries.sort()
        for s_off, d_off, n in entries:
            if records and records[-1][5] == layer:
                ps, pd, pn = records[-1][2], records[-1][3], records[-1][4]
                if ps + pn == s_off and pd + pn == d_off:
                    records[-1] = (0, 0, ps, pd, pn + n, layer)
                    continue
            records.append((0, 0, s_off, d_off, n, layer))
    return np.array(records, dtype=IPCBLOCK_DTYPE)


def best_of(repeats: int, fn, *args) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = parser.parse_args()
    num_layers, n_blocks, pool = (4, 256, 1024) if args.smoke else (32, 4096, 16384)
    repeats = 2 if args.smoke else 5
    rng = np.random.default_rng(0)
    heads, block_size, head_dim, itemsize = 8, 16, 128, 2
    rows = []
    for kind in ("cpu", "kv_first"):
        ctor = getattr(PagedKVLayout, kind)
        probe = ctor([0], pool, heads, block_size, head_dim, itemsize)
        offsets = stacked_layer_offsets(num_layers, probe.layer_nbytes)
        layout = ctor(offsets, pool, heads, block_size, head_dim, itemsize)
        for pattern in ("scattered", "contiguous"):
            if pattern == "scattered":
                src_ids = rng.choice(pool, n_blocks, replace=False)
                dst_ids = rng.choice(pool, n_blocks, replace=False)
            else:
                src_ids = np.arange(n_blocks) + 7
                dst_ids = np.arange(n_blocks) + 100
            layers = np.arange(num_layers)
            fast = parse_blocks(layout, layout, src_ids, dst_ids, layers)
            slow = naive_parse(layout, layout, src_ids, dst_ids, layers)
            order = np.lexsort((fast["src_offset"], fast["tag"]))
            np.testing.assert_array_equal(fast[order], slow)  # same answer before timing it
            inputs = (layout, layout, src_ids, dst_ids, layers)
            t_fast = best_of(repeats, parse_blocks, *inputs)
            t_slow = best_of(1, naive_parse, *inputs)
            pairs = n_blocks * num_layers
            rows.append(
                {
                    "layout": kind,
                    "pattern": pattern,
                    "blocks": n_blocks,
                    "layers": num_layers,
                    "records_out": int(fast.size),
                    "vectorised_ms": t_fast * 1e3,
                    "naive_ms": t_slow * 1e3,
                    "vectorised_block_layers_per_s": pairs / t_fast,
                    "naive_block_layers_per_s": pairs / t_slow,
                    "speedup": t_slow / t_fast,
                }
            )
    header = f"{'layout':10} {'pattern':10} {'records':>8} {'vec ms':>8} {'naive ms':>9} "
    header += f"{'vec Mblk/s':>10} {'naive Mblk/s':>12} {'speedup':>8}"
    print(f"parse_blocks: {n_blocks} blocks x {num_layers} layers")
    print(header)
    for r in rows:
        print(
            f"{r['layout']:10} {r['pattern']:10} {r['records_out']:>8} {r['vectorised_ms']:>8.2f} "
            f"{r['naive_ms']:>9.1f} {r['vectorised_block_layers_per_s'] / 1e6:>10.2f} "
            f"{r['naive_block_layers_per_s'] / 1e6:>12.3f} {r['speedup']:>7.0f}x"
        )
    if not args.smoke:
        out = Path(__file__).parent / "results" / "parse.json"
        out.parent.mkdir(exist_ok=True)
        meta = {"python": platform.python_version(), "numpy": np.__version__}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
