"""ParseBlock throughput: vectorised parse_blocks vs a naive Python loop, same inputs, same run.

Usage: python bench_parse.py [--smoke]
Full mode prints tables and writes results/parse.json. Sections: paged K/V (4,096 blocks x 32
layers), MLA at DeepSeek V3's shape (128k tokens x 61 layers, latent 576 bf16, block size 16 as on
vLLM CPU and 64 as FlashMLA), and GDN state slots against prompt length (O(1)).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from ipcblock import IPCBLOCK_DTYPE, PagedKVLayout, Segment, parse_blocks, stacked_layer_offsets


def naive_parse(src: PagedKVLayout, dst: PagedKVLayout, src_ids, dst_ids, layers) -> np.ndarray:
    """What one would write first: a Python loop per (layer, segment, block) plus a merge loop."""
    records: list[tuple[int, int, int, int, int, int]] = []
    for layer in layers:
        s_base, d_base = int(src.layer_offsets[layer]), int(dst.layer_offsets[layer])
        entries = []
        for s_seg, d_seg in zip(src.segments, dst.segments, strict=True):
            # A segment is one or more contiguous pieces per block (CPU: one per head).
            (s_pieces, piece), (d_pieces, _) = s_seg.pieces(), d_seg.pieces()
            for s_id, d_id in zip(src_ids, dst_ids, strict=True):
                for s_in, d_in in zip(s_pieces.tolist(), d_pieces.tolist(), strict=True):
                    entries.append(
                        (
                            s_base + s_seg.offset + int(s_id) * s_seg.block_stride + s_in,
                            d_base + d_seg.offset + int(d_id) * d_seg.block_stride + d_in,
                            piece,
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


def timings(repeats: int, fn, *args, cpu: list[float] | None = None) -> list[float]:
    """Sorted wall times; with ``cpu``, also this thread's CPU time per call (sorted), which
    leaves out the time the shared box's other jobs held the cores."""
    times = []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn(*args)
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.thread_time() - start_cpu)
    if cpu is not None:
        cpu.sort()
    return sorted(times)


def best_of(repeats: int, fn, *args) -> float:
    return timings(repeats, fn, *args)[0]


def mla_layout(layer_offsets, pool: int, block_size: int, row: int) -> PagedKVLayout:
    """PagedKVLayout.mla, or the same single segment on versions without it (for "before")."""
    if hasattr(PagedKVLayout, "mla"):
        return PagedKVLayout.mla(layer_offsets, pool, block_size, row)
    page = block_size * row
    return PagedKVLayout.from_segments(layer_offsets, pool, [Segment("latent", 0, page, page)])


def mla_rows(smoke: bool, rng: np.random.Generator) -> list[dict]:
    """DeepSeek V3: 61 layers, latent 576 x bf16, 128k tokens (CPU block 16, FlashMLA 64)."""
    num_layers, tokens, row = (8, 8192, 1152) if smoke else (61, 128 * 1024, 1152)
    repeats = 3 if smoke else 30
    out = []
    for block_size in (16, 64):
        n_blocks = tokens // block_size
        pool = 2 * n_blocks
        layout = mla_layout(
            stacked_layer_offsets(num_layers, pool * block_size * row), pool, block_size, row
        )
        for pattern in ("contiguous", "shuffled"):
            if pattern == "shuffled":
                src_ids, dst_ids = (
                    rng.permutation(pool)[:n_blocks],
                    rng.permutation(pool)[:n_blocks],
                )
            else:
                src_ids, dst_ids = np.arange(n_blocks) + 3, np.arange(n_blocks) + 11
            inputs = (layout, layout, src_ids, dst_ids)
            fast = parse_blocks(*inputs)
            layers = np.arange(num_layers)
            slow_t = None
            if not smoke or block_size == 64:
                slow = naive_parse(layout, layout, src_ids, dst_ids, layers)
                order = np.lexsort((fast["src_offset"], fast["tag"]))
                np.testing.assert_array_equal(fast[order], slow)
                slow_t = best_of(1, naive_parse, layout, layout, src_ids, dst_ids, layers)
            cpu: list[float] = []
            times = timings(repeats, parse_blocks, *inputs, cpu=cpu)
            out.append(
                {
                    "layout": f"mla bs={block_size}",
                    "pattern": pattern,
                    "tokens": tokens,
                    "layers": num_layers,
                    "records_out": int(fast.size),
                    "best_ms": times[0] * 1e3,
                    "median_ms": times[len(times) // 2] * 1e3,
                    "cpu_median_ms": cpu[len(cpu) // 2] * 1e3,
                    "naive_ms": None if slow_t is None else slow_t * 1e3,
                }
            )
    return out


def state_rows(smoke: bool) -> list[dict]:
    """GDN state (Qwen3-Next shapes, 36 linear layers): one slot per request, any prompt length."""
    num_layers, slots = 36, 1024
    conv, ssm = 3 * 8192 * 2, 32 * 128 * 128 * 2  # conv (k-1, conv_dim) bf16, ssm (hv, dv, dk)
    layout = PagedKVLayout.state(
        stacked_layer_offsets(num_layers, slots * (conv + ssm)),
        slots,
        [("conv", conv), ("ssm", ssm)],
    )
    out = []
    for tokens in (1024, 32 * 1024, 128 * 1024) if not smoke else (1024, 128 * 1024):
        # The state group's input does not depend on the prompt: the request's one final slot.
        times = timings(5 if smoke else 50, parse_blocks, layout, layout, [17], [401])
        fast = parse_blocks(layout, layout, [17], [401])
        out.append(
            {
                "layout": "gdn state",
                "tokens": tokens,
                "layers": num_layers,
                "records_out": int(fast.size),
                "best_ms": times[0] * 1e3,
                "median_ms": times[len(times) // 2] * 1e3,
            }
        )
    return out


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
    mla = mla_rows(args.smoke, rng)
    print("\nMLA (DeepSeek V3 latent 576 bf16), all layers in one call")
    print(
        f"{'layout':12} {'pattern':10} {'records':>8} {'best ms':>8} {'median':>8} "
        f"{'cpu med':>8} {'naive ms':>9}"
    )
    for r in mla:
        naive = "-" if r["naive_ms"] is None else f"{r['naive_ms']:.0f}"
        print(
            f"{r['layout']:12} {r['pattern']:10} {r['records_out']:>8} {r['best_ms']:>8.2f} "
            f"{r['median_ms']:>8.2f} {r['cpu_median_ms']:>8.2f} {naive:>9}"
        )
    state = state_rows(args.smoke) if hasattr(PagedKVLayout, "state") else []
    if state:
        print("\nGDN state slots (one per request) against prompt length")
        for r in state:
            print(
                f"tokens {r['tokens']:>7}: {r['records_out']} records, best {r['best_ms']:.3f} ms, "
                f"median {r['median_ms']:.3f} ms"
            )
    if not args.smoke:
        out = Path(__file__).parent / "results" / "parse.json"
        out.parent.mkdir(exist_ok=True)
        meta = {"python": platform.python_version(), "numpy": np.__version__}
        doc = {"meta": meta, "rows": rows, "mla": mla, "state": state}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
