"""The disk tier: a ``lookup`` of N keyed blocks of 256 KiB-2 MiB (KV blocks' sizes) and the gets
and copies of them, served from memory, from the disk tier with the file in the page cache, and
from the disk tier with the file's pages dropped; against reading the same bytes straight from
the file with as many threads as the tier's readers (what the disk itself gives). One master in
this process; every copy is CRC-checked. Reported in GiB/s per tier, so that a consumer can
compare a tier with the throughput of recomputing what it holds.

    flock /tmp/bench.lock python packages/refstore/benchmarks/bench_disk_tier.py  # results/
    python packages/refstore/benchmarks/bench_disk_tier.py --smoke  # 4 blocks, seconds

A round, each case timed to the caller holding a copy of all N blocks in its own buffer (the
copy a KV connector makes into its cache), and also to the views alone (lookup + get):

- **spill**: N fresh keys put, then pushed out of the pool by as many bytes of ballast (keyed
  entries, released afterwards): timed to the writer having written them all (``flush_disk``);
- **disk cold**: the file's pages dropped (``fsync`` + ``posix_fadvise(DONTNEED)``, the file
  only: other users' page cache is left alone), then the lookup promotes the N keys;
- **disk warm**: pushed out again by ballast (their records hold their bytes: nothing is
  written), the file still in the page cache, then the lookup promotes them;
- **memory**: the same lookup again, all N now in the pool;
- **file cold / file warm**: the records' byte ranges read with ``preadv`` by the same number of
  threads into one buffer (no lookup, no checksum, no second copy).

The keys are then evicted (memory and disk) for the next round.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import refstore
from refstore import faults
from refstore.disk_tier import DISK_READERS

RESULTS = Path(__file__).parent / "results" / "disk_tier.json"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SIZES = (256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB)
CASES = ("disk_cold", "disk_warm", "memory", "file_cold", "file_warm")


def payloads(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, SIZES[i % len(SIZES)], dtype=np.uint8) for i in range(count)]


def drop_file_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pages_resident(path: Path) -> float | None:
    """Share of the file's pages in the page cache (``fincore``), None if unknown."""
    fincore = shutil.which("fincore")
    if fincore is None:
        return None
    import subprocess

    out = subprocess.run(
        [fincore, "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    return int(out[0]) / max(1, int(out[1])) if len(out) == 2 else None


class Round:
    def __init__(self, master, client, plain: refstore.Client, blocks, dst):
        self.master, self.client, self.blocks, self.dst = master, client, blocks, dst
        self.plain = plain  # a master of the same pool size without a disk tier
        self.crcs = [zlib.crc32(b) for b in blocks]
        self.starts = np.cumsum([0] + [b.nbytes for b in blocks[:-1]])
        self.path = master.master.disk.path

    def push_out(self, tag: str, client: refstore.Client | None = None) -> float:
        """Evict whatever is in the pool with ballast (seconds the puts took), then release the
        ballast (a release writes nothing to disk)."""
        client = client or self.client
        ballast = [(b"ballast-%s-%04d" % (tag.encode(), i), b) for i, b in enumerate(self.blocks)]
        start = time.perf_counter()
        refs = [client.put_keyed([pair])[0] for pair in ballast]
        took = time.perf_counter() - start
        client.release([r for r in refs if r is not None])
        return took

    def fetch(self, keys: list[bytes]) -> tuple[float, float]:
        """Lookup + gets (views), then + copies: seconds to each."""
        start = time.perf_counter()
        refs = self.client.lookup(keys, hold_s=0)
        views = [self.client.get(r) for r in refs]
        viewed = time.perf_counter()
        for view, at in zip(views, self.starts, strict=False):
            np.copyto(self.dst[at : at + view.nbytes], view)
        copied = time.perf_counter()
        if len(refs) != len(keys):
            raise AssertionError(f"lookup found {len(refs)} of {len(keys)}")
        del views
        self.check()
        return viewed - start, copied - start

    def read_file(self, keys: list[bytes]) -> float:
        index = self.master.master.disk.index
        ranges = [(index.get(k).payload_offset, at, b.nbytes)
                  for k, at, b in zip(keys, self.starts, self.blocks, strict=True)]  # fmt: skip
        fd = os.open(self.path, os.O_RDONLY)
        dst = memoryview(self.dst)
        try:
            with concurrent.futures.ThreadPoolExecutor(DISK_READERS) as pool:
                start = time.perf_counter()
                got = list(
                    pool.map(lambda r: os.preadv(fd, [dst[r[1] : r[1] + r[2]]], r[0]), ranges)
                )
                took = time.perf_counter() - start
        finally:
            os.close(fd)
        if got != [n for *_, n in ranges]:
            raise AssertionError("short file read")
        self.check()
        return took

    def check(self) -> None:
        spans = zip(self.starts, self.blocks, strict=True)
        got = [zlib.crc32(self.dst[at : at + b.nbytes]) for at, b in spans]
        if got != self.crcs:
            raise AssertionError("a copy differs from the block put")
        self.dst[:] = 0

    def run(self, r: int) -> dict[str, float]:
        keys = [b"bench-disk-%02d-%04d" % (r, i) for i in range(len(self.blocks))]
        out: dict[str, float] = {}
        for key, block in zip(keys, self.blocks, strict=True):
            self.plain.put_keyed([(key, block)])
            self.client.put_keyed([(key, block)])
        out["evicting_puts_no_tier"] = self.push_out(f"{r}a", self.plain)
        faults.evict_keys(self.plain, keys)
        start = time.perf_counter()
        out["evicting_puts"] = self.push_out(f"{r}a")  # the puts, their evictions spilling
        self.master.flush_disk()
        out["spill"] = time.perf_counter() - start  # and until all is written
        stats = self.client.stats()
        if stats.spill_dropped:
            raise AssertionError(f"{stats.spill_dropped} spills dropped: a bigger spill queue")
        on_disk = sum(key in self.master.master.disk.index for key in keys)
        if on_disk != len(keys) or stats.keys:
            raise AssertionError(f"{on_disk} of {len(keys)} on disk, {stats.keys} in memory")

        drop_file_pages(self.path)
        resident = pages_resident(self.path)
        out["resident_after_drop"] = -1.0 if resident is None else resident
        out["file_cold"] = self.read_file(keys)
        drop_file_pages(self.path)
        out["disk_cold_views"], out["disk_cold"] = self.fetch(keys)
        self.push_out(f"{r}b")  # the promoted ones are records' mirrors: nothing written
        out["file_warm"] = self.read_file(keys)
        out["disk_warm_views"], out["disk_warm"] = self.fetch(keys)
        out["memory_views"], out["memory"] = self.fetch(keys)
        faults.evict_keys(self.client, keys)  # memory and disk: the next round starts empty
        return out


def measure(blocks: list[np.ndarray], reps: int, workdir: str) -> dict[str, float]:
    total = sum(b.nbytes for b in blocks)
    # The N blocks (or as many bytes of ballast) and less than the smallest block more, so
    # that the ballast pushes every one of them out.
    # (An object's header takes 128-256 bytes of its block; the control page 4 KiB.)
    pool = total + len(blocks) * 512 + 4096 + min(SIZES) // 4
    dst = np.zeros(total, dtype=np.uint8)
    with (
        refstore.MasterThread(
            "bench-disk",
            pool,
            disk=Path(workdir) / "tier",
            disk_size=2 * total + 64 * MIB,
            spill_queue=total + 16 * MIB,
        ) as master,
        refstore.MasterThread("bench-plain", pool),
        refstore.Client("bench-disk", timeout=300.0) as client,
        refstore.Client("bench-plain", timeout=300.0) as plain,
    ):
        bench = Round(master, client, plain, blocks, dst)
        rounds = [bench.run(r) for r in range(reps + 1)][1:]  # the first warms everything up
        stats = client.stats()
        if stats.disk_errors:
            raise AssertionError(f"{stats.disk_errors} disk errors")
    return {case: statistics.median(r[case] for r in rounds) for case in rounds[0]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="4 blocks, one round")
    parser.add_argument("--count", type=int, default=128, help="blocks per lookup")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("refstore.master").setLevel(logging.ERROR)  # each round's evict_keys
    count, reps = (4, 1) if args.smoke else (args.count, args.reps)
    blocks = payloads(count)
    total = sum(b.nbytes for b in blocks)
    workdir = tempfile.mkdtemp(prefix="refstore-bench-disk-", dir=os.environ.get("BENCH_DISK_DIR"))
    os.environ["REFSTORE_DIR"] = str(Path(workdir) / "discovery")
    try:
        seconds = measure(blocks, reps, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    gib_s = {
        c: total / GIB / seconds[c]
        for c in (*CASES, "spill", "evicting_puts", "evicting_puts_no_tier")
    }
    views_gib_s = {
        c: total / GIB / seconds[f"{c}_views"] for c in ("disk_cold", "disk_warm", "memory")
    }
    ratios = {
        # Both end with the bytes in memory once: the promotion's views against a plain read.
        "disk_cold_views_over_file_cold": views_gib_s["disk_cold"] / gib_s["file_cold"],
        "disk_warm_views_over_file_warm": views_gib_s["disk_warm"] / gib_s["file_warm"],
        "memory_over_disk_warm": gib_s["memory"] / gib_s["disk_warm"],
        "memory_over_disk_cold": gib_s["memory"] / gib_s["disk_cold"],
        # What spilling adds to the puts whose evictions it writes (the loop thread's copy).
        "evicting_puts_over_no_tier": seconds["evicting_puts"] / seconds["evicting_puts_no_tier"],
    }
    resident = seconds["resident_after_drop"]
    print(
        f"{count} keyed blocks of {'/'.join(f'{s // KIB}K' for s in SIZES)}, "
        f"{total / MIB:.0f} MiB in all, median of {reps}; page cache after the drop: "
        + ("unknown" if resident < 0 else f"{resident:.0%} resident")
    )
    print(f"  {'case':22} {'GiB/s':>8} {'views GiB/s':>12} {'ms':>9}")
    for case, rate in gib_s.items():
        views = views_gib_s.get(case)
        print(
            f"  {case:22} {rate:8.2f} {'' if views is None else f'{views:12.2f}':>12} "
            f"{seconds[case] * 1e3:9.1f}"
        )
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}")
    if not args.smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "count": count,
            "nbytes": total,
            "sizes": SIZES,
            "reps": reps,
            "readers": DISK_READERS,
            "cpus": os.cpu_count(),
            "page_cache_drop": "fsync + posix_fadvise(POSIX_FADV_DONTNEED) of the tier file",
            "resident_after_drop": None if resident < 0 else resident,
            "seconds": seconds,
            "gib_s": gib_s,
            "views_gib_s": views_gib_s,
            "ratios": ratios,
        }
        RESULTS.write_text(json.dumps(payload, indent=1))
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
