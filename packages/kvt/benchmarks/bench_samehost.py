"""Same host: scattered 64 KiB KV blocks between two processes vs single-thread memcpy.

The region is a vLLM CPU KV cache (``ipcblock.PagedKVLayout.cpu``: 8 layers, 2 KV heads, 128
tokens a block, head_dim 64, bf16, so 64 KiB per block and layer); every block id moves to a
random other block id, every layer (``parse_blocks``, runs merged as the connector does). Per
size (64 MiB to 1 GiB), in the same interleaved rounds (order rotating, one warm-up):

* memcpy: one ``np.copyto`` of the same number of bytes, contiguous, one thread (the baseline);
* scattered memcpy: the same records copied block by block in one process, one thread
  (``ctypes.memmove`` per record): what one thread does for the same scattered bytes without a
  second process (the second baseline: the issue's "single-thread memcpy of the same bytes");
* kvt: two engines in two processes on kvt's same-host path (``transport="samehost"``), send to
  completion; skipped, with the reason, while kvt has no such path;
* CMA: the receiver's own ``process_vm_readv`` from the sender's addresses into its region, 1,024
  iovecs a call (what kvt's same-host path does, without kvt around it);
* memfd: the sender's region lives in a memfd that the receiver maps (``MAP_POPULATE``); the
  receiver copies every record out of the mapping. Shmem gets 4 KiB pages here (MEASURED.md):
  ``shmem_enabled`` is "never" (no THP for shmem, madvise or not) and no hugetlb pages are
  reserved, so ``MFD_HUGETLB`` fails; it is tried first and used where it works;
* Mooncake TransferEngine (its best local transport in this build is tcp: it has no shared-memory
  transport without an RDMA device) and NIXL (UCX; the UCX_TLS with the best probe at 64 MiB of
  UCX's own choice, cma and shared memory, then measured in the rounds), two processes each.

Times: memcpy in the benchmark process, CMA and memfd around the copy in the receiver, kvt from
``send`` to the sender's completion, competitors around their own "write and wait" call.
Every system's destination is checked byte for byte after every round (untimed).

Usage: python bench_samehost.py [--smoke] [--repeats N] [--sizes-mib 64 256 1024]
Full mode writes results/samehost.json. Run under ``flock /tmp/bench.lock`` on shared machines.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import platform
import queue
import statistics
import time
from pathlib import Path

import numpy as np
from competitors import Competitor, unavailable
from ipcblock import PagedKVLayout, make_blocks, parse_blocks
from ipcblock.layouts import stacked_layer_offsets
from kvt.loopback import ScatterPattern, check_paths, make_engine, source_bytes, stop_child

LAYERS, KV_HEADS, BLOCK_TOKENS, HEAD_DIM, ITEMSIZE = 8, 2, 128, 64, 2
BLOCK_BYTES = KV_HEADS * 2 * BLOCK_TOKENS * HEAD_DIM * ITEMSIZE  # 64 KiB per block and layer
IOV_MAX = 1024
SCATTERED = "memcpy, scattered blocks"
NIXL_VARIANTS = {"auto": None, "cma": "cma,tcp", "shm": "shm,tcp"}  # UCX_TLS (None: unset)


def kv_pattern(total: int) -> ScatterPattern:
    """Every block id of a ``total``-byte CPU KV cache to a random other id, all layers."""
    num_blocks = total // (LAYERS * BLOCK_BYTES)
    layout = PagedKVLayout.cpu(
        stacked_layer_offsets(LAYERS, num_blocks * BLOCK_BYTES),
        num_blocks, KV_HEADS, BLOCK_TOKENS, HEAD_DIM, ITEMSIZE,
    )  # fmt: skip
    rng = np.random.default_rng(total)
    src_ids, dst_ids = rng.permutation(num_blocks), rng.permutation(num_blocks)
    return ScatterPattern.of_blocks(parse_blocks(layout, layout, src_ids, dst_ids))


# ------------------------------------------------------------------ CMA (process_vm_readv)
_IOVEC = np.dtype([("base", np.uint64), ("len", np.uint64)])  # struct iovec on 64-bit Linux
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong,
]  # fmt: skip


def cma_read(pid: int, local: np.ndarray, remote: np.ndarray) -> None:
    """Read every remote iovec of process ``pid`` into the local ones (same lengths, in order)."""
    for start in range(0, len(local), IOV_MAX):
        loc, rem = local[start : start + IOV_MAX], remote[start : start + IOV_MAX]
        want = int(loc["len"].sum())
        got = _libc.process_vm_readv(pid, loc.ctypes.data, len(loc), rem.ctypes.data, len(rem), 0)
        if got != want:  # a partial read only happens at an unmapped page: a bug here
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv read {got} of {want} bytes: {os.strerror(err)}")


def _iovecs(base: int, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    out = np.empty(len(offsets), dtype=_IOVEC)
    out["base"] = base + offsets
    out["len"] = lengths
    return out


# ------------------------------------------------------------------ the receiver process
def _receiver_main(conn, total: int, sender_pid: int, kvt_transport: str | None) -> None:
    dst = np.ones(total, dtype=np.uint8)  # touched: no first-touch faults inside a timed run
    engine = None
    address = region = None
    if kvt_transport is not None:
        engine = make_engine("D", kvt_transport)
        region = engine.register_region(dst)
        address = engine.data_address
    conn.send((address, region))
    expected = source_bytes(total)
    done: queue.SimpleQueue = queue.SimpleQueue()
    mapping = None
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "expect":
                engine.expect(args[0], timeout_s=120.0, on_complete=done.put)  # type: ignore[union-attr]
                conn.send("ready")
            elif cmd == "completion":
                c = done.get()
                conn.send((c.status.value, c.nbytes, getattr(c, "peer", None)))
            elif cmd == "cma":
                pattern, src_base = args
                local = _iovecs(dst.ctypes.data, pattern.dst_offsets, pattern.lengths)
                remote = _iovecs(src_base, pattern.src_offsets, pattern.lengths)
                start = time.perf_counter()
                cma_read(sender_pid, local, remote)
                conn.send(time.perf_counter() - start)
            elif cmd == "map":
                fd = os.open(f"/proc/{sender_pid}/fd/{args[0]}", os.O_RDONLY)
                try:  # populated now: no first-touch faults inside a timed run
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    mapping = mmap.mmap(fd, total, flags=flags, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                conn.send("ok")
            elif cmd == "memfd":
                pattern = args[0]
                moves = zip(
                    pattern.src_offsets.tolist(),
                    pattern.dst_offsets.tolist(),
                    pattern.lengths.tolist(),
                    strict=True,
                )
                view, out = memoryview(mapping), memoryview(dst)  # type: ignore[arg-type]
                start = time.perf_counter()
                for s, d, n in moves:
                    out[d : d + n] = view[s : s + n]
                elapsed = time.perf_counter() - start
                view.release()
                conn.send(elapsed)
            elif cmd == "verify":
                conn.send(args[0].check_and_reset(dst, expected))
            elif cmd == "close":
                break
    finally:
        if mapping is not None:
            mapping.close()
        if engine is not None:
            engine.close()
        conn.close()


def _kvt_samehost_reason() -> str | None:
    """None if kvt offers a same-host path to measure, else why not."""
    try:
        with make_engine("probe", "samehost"):
            return None
    except Exception as exc:
        return f"kvt has no same-host path here ({type(exc).__name__}: {exc})"


def _memfd_source(total: int, src: np.ndarray) -> tuple[int, mmap.mmap, str]:
    """The sender's region in a memfd (huge pages if the kernel gives them); its fd and kind."""
    kind, fd = "memfd, 4 KiB pages", None
    if hasattr(os, "MFD_HUGETLB"):
        try:
            fd = os.memfd_create("kvt-bench-huge", os.MFD_HUGETLB)
            os.ftruncate(fd, total)
            mapping = mmap.mmap(fd, total)
            kind = "memfd, MFD_HUGETLB"
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    if fd is None:
        fd = os.memfd_create("kvt-bench")
        os.ftruncate(fd, total)
        mapping = mmap.mmap(fd, total)
    np.frombuffer(mapping, dtype=np.uint8)[:] = src  # fills (and faults in) every page
    return fd, mapping, kind


# ------------------------------------------------------------------ one size
def _measure_size(total: int, repeats: int, kvt_reason: str | None, competitors: list) -> dict:
    pattern = kv_pattern(total)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    kvt_transport = None if kvt_reason else "samehost"
    proc = ctx.Process(
        target=_receiver_main, args=(child, total, os.getpid(), kvt_transport), daemon=True
    )
    proc.start()
    child.close()
    src = source_bytes(total)
    copy_dst = np.ones(total, dtype=np.uint8)
    scatter_dst = np.ones(total, dtype=np.uint8)
    fd, mapping, memfd_kind = _memfd_source(total, src)
    engine = make_engine("P", "samehost") if kvt_transport else None
    systems: list[Competitor] = []
    try:
        address, dst_region = parent.recv()
        parent.send(("map", fd))
        parent.recv()

        def ask(*msg):
            parent.send(msg)
            return parent.recv()

        blocks = None
        if engine is not None:
            src_region = engine.register_region(src)
            blocks = make_blocks(
                pattern.src_offsets, pattern.dst_offsets, pattern.lengths,
                src_region=src_region, dst_region=dst_region,
            )  # fmt: skip

        def kvt_run(rid: str) -> float:
            done: queue.SimpleQueue = queue.SimpleQueue()
            ask("expect", rid)
            start = time.perf_counter()
            engine.send(rid, address, blocks, last=True, on_complete=done.put)  # type: ignore[union-attr]
            completion = done.get()
            elapsed = time.perf_counter() - start
            status, _, _ = ask("completion")
            if not completion.ok or status != "done":
                raise RuntimeError(f"kvt transfer failed: {completion} / receiver {status}")
            return elapsed

        def memcpy_run() -> float:
            start = time.perf_counter()
            np.copyto(copy_dst, src)
            return time.perf_counter() - start

        moves = list(
            zip(
                (scatter_dst.ctypes.data + pattern.dst_offsets).tolist(),
                (src.ctypes.data + pattern.src_offsets).tolist(),
                pattern.lengths.tolist(),
                strict=True,
            )
        )

        def scattered_memcpy_run() -> float:
            memmove = ctypes.memmove
            start = time.perf_counter()
            for d, s, n in moves:
                memmove(d, s, n)
            return time.perf_counter() - start

        def scattered_memcpy_check() -> bool:
            ok = pattern.delivered(scatter_dst, src)
            scatter_dst[:] = 1
            return ok

        runs = {
            "memcpy": memcpy_run,
            SCATTERED: scattered_memcpy_run,
            "CMA (process_vm_readv)": lambda: ask("cma", pattern, src.ctypes.data),
            memfd_kind: lambda: ask("memfd", pattern),
        }
        if engine is not None:
            rounds = iter(range(1 << 30))
            runs["kvt samehost"] = lambda: kvt_run(f"sh-{total}-{next(rounds)}")
        checks = {name: (lambda: ask("verify", pattern)) for name in runs if name != "memcpy"}
        checks[SCATTERED] = scattered_memcpy_check
        for system, label, env in competitors:
            c = Competitor(system, label, total, env)
            systems.append(c)
            runs[label] = lambda c=c: c.run(pattern)
            checks[label] = lambda c=c: c.verify(pattern)

        names = list(runs)
        times: dict[str, list[float]] = {n: [] for n in names}
        exact: dict[str, list[bool]] = {n: [] for n in checks}
        for round_no in range(repeats + 1):
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                t = runs[name]()
                ok = checks[name]() if name in checks else None  # every round, untimed
                if round_no:
                    times[name].append(t)
                    if ok is not None:
                        exact[name].append(ok)
            if round_no == 0 and engine is not None:
                check_paths(engine, "samehost")
        rows = []
        memcpy, scattered = times["memcpy"], times[SCATTERED]
        for name in names:
            ts = times[name]
            ratios = [m / t for m, t in zip(memcpy, ts, strict=True)]
            scattered_ratios = [m / t for m, t in zip(scattered, ts, strict=True)]
            median = statistics.median(ts)
            rows.append(
                {
                    "transfer": name, "bytes": total, "records": pattern.blocks,
                    "best_gbps": total / min(ts) / 1e9,
                    "median_gbps": total / statistics.median(ts) / 1e9,
                    "vs_memcpy_median": statistics.median(memcpy) / statistics.median(ts),
                    "vs_memcpy_best": min(memcpy) / min(ts),
                    "vs_memcpy_paired": statistics.median(ratios),
                    "vs_scattered_memcpy_median": statistics.median(scattered) / median,
                    "vs_scattered_memcpy_paired": statistics.median(scattered_ratios),
                    "byte_exact": all(exact[name]) if name in exact else None,
                    "exact_rounds": sum(exact.get(name, [])), "rounds": len(ts),
                }
            )  # fmt: skip
        return {"bytes": total, "records": pattern.blocks, "rows": rows}
    finally:
        for c in systems:
            c.close()
        stop_child(parent, proc)
        if engine is not None:
            engine.close()
        mapping.close()
        os.close(fd)


def _pick_nixl(total: int) -> tuple[str, dict[str, float]]:
    """NIXL's best UCX_TLS on this host: a short probe (3 runs, best) of each variant."""
    pattern = kv_pattern(total)
    probe: dict[str, float] = {}
    for name, tls in NIXL_VARIANTS.items():
        env = {} if tls is None else {"UCX_TLS": tls}
        try:
            with Competitor("nixl", f"NIXL ({name})", total, env) as c:
                best = min(c.run(pattern) for _ in range(3))
                probe[name] = total / best / 1e9
        except Exception as exc:  # a UCX_TLS that UCX refuses here
            print(f"NIXL UCX_TLS={tls}: {exc}")
    return max(probe, key=probe.__getitem__), probe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="16 MiB, one round: a CI check")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds after a warm-up")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--no-competitors", action="store_true")
    args = parser.parse_args()
    sizes = [16 << 20] if args.smoke else [m << 20 for m in args.sizes_mib]
    repeats = 1 if args.smoke else args.repeats
    load_before = os.getloadavg()

    kvt_reason = _kvt_samehost_reason()
    if kvt_reason:
        print(f"skipping kvt samehost: {kvt_reason}")
    competitors, skipped, nixl_probe = [], {}, {}
    if kvt_reason:
        skipped["kvt samehost"] = kvt_reason
    for system in () if args.no_competitors else ("mooncake", "nixl"):
        reason = unavailable(system)
        if reason:
            print(f"skipping {system}: {reason}")
            skipped[system] = reason
        elif system == "mooncake":
            competitors.append(("mooncake", "Mooncake TE (tcp)", {}))
        elif args.smoke:
            competitors.append(("nixl", "NIXL (UCX auto)", {}))
        else:
            best, nixl_probe = _pick_nixl(64 << 20)
            tls = NIXL_VARIANTS[best]
            print("NIXL probe at 64 MiB, best GB/s: " + ", ".join(
                f"{k} {v:.2f}" for k, v in nixl_probe.items()) + f"; measuring {best}")  # fmt: skip
            competitors.append(
                ("nixl", f"NIXL (UCX {best})", {} if tls is None else {"UCX_TLS": tls})
            )

    results = [_measure_size(total, repeats, kvt_reason, competitors) for total in sizes]
    load_after = os.getloadavg()
    print(
        f"same host, two processes, {repeats} round(s) after warm-up; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(
        f"{'size':>6} {'transfer':28} {'best GB/s':>9} {'median':>7} {'vs memcpy':>10} "
        f"{'paired':>7} {'vs scattered':>12} {'paired':>7} {'exact':>6}"
    )
    for result in results:
        for r in result["rows"]:
            exact = "" if r["byte_exact"] is None else f"{r['exact_rounds']}/{r['rounds']}"
            print(
                f"{result['bytes'] >> 20:>4}Mi {r['transfer']:28} {r['best_gbps']:>9.2f} "
                f"{r['median_gbps']:>7.2f} {r['vs_memcpy_median']:>9.2f}x "
                f"{r['vs_memcpy_paired']:>6.2f}x {r['vs_scattered_memcpy_median']:>11.2f}x "
                f"{r['vs_scattered_memcpy_paired']:>6.2f}x {exact:>6}"
            )
    print(
        "vs memcpy: contiguous memcpy's median time over this one's; vs scattered: the scattered "
        "memcpy's (same records, block by block); paired: median of per-round ratios"
    )
    wrong = {r["transfer"] for res in results for r in res["rows"] if r["byte_exact"] is False}
    if wrong:  # a competitor's wrong bytes are its result; kvt's fail the benchmark
        print(f"WRONG BYTES after a reported success: {', '.join(sorted(wrong))}")
    if "kvt samehost" in wrong:
        raise SystemExit("kvt delivered wrong bytes")
    if not args.smoke:
        out = Path(__file__).parent / "results" / "samehost.json"
        out.parent.mkdir(exist_ok=True)
        meta = {
            "repeats": repeats, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
            "load_average_before": load_before, "load_average_after": load_after,
            "layout": f"vLLM CPU, {LAYERS} layers, {BLOCK_BYTES >> 10} KiB per block and layer",
            "nixl_probe_gbps_64mib": nixl_probe, "skipped": skipped,
        }  # fmt: skip
        out.write_text(json.dumps({"meta": meta, "sizes": results}, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
