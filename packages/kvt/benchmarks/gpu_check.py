"""One short, prepared check for a session that is lent a GPU (the `device` tool; never run in CI).

    uv run --frozen --no-sync python packages/kvt/benchmarks/gpu_check.py            # on a GPU
    uv run --frozen --no-sync python packages/kvt/benchmarks/gpu_check.py --dry-run  # CPU, fakes

In order, each step bounded so that the whole run stays under ~4 minutes:
1. the CUDA tests (``tests/test_gpu_cuda.py``), their summary line kept;
2. GPU to GPU through two engines in this process (one host; TCP loopback, and every other
   host-byte path this build offers: ``transport="samehost"``), the sources scattered 64 KiB
   blocks at random slots, staged through pinned memory, checked byte for byte; next to a plain
   contiguous D2D ``copy_`` and a scattered D2D gather/scatter of the same bytes, timed in the
   same run;
3. a per-layer pipeline: a fake "model" computes layer after layer on the compute stream (a
   matmul loop, then the layer's KV is written) while each layer's batch waits for its
   CudaLayerEvent; it records when the receiver saw the first layer's bytes and when the last
   layer was computed, so the JSON shows whether layer 0 was on the wire before the last layer
   was computed;
4. ``ibv_devices`` output (is there an RDMA device on this machine?).

Writes ``gpu_check.json`` to ``$OUT`` (if set) and prints it. ``--dry-run`` runs steps 2 and 3
on CPU: numpy arrays as "device" memory, kvt.staging.ThreadCopier as the copier, CpuLayerEvents
marked by a thread as "compute" (checks this script itself, not a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from ipcblock import make_blocks
from kvt import CpuLayerEvents, CudaLayerEvents, TransferEngine, TransferStatus
from kvt.access import DeviceMemory
from kvt.engine import Engine
from kvt.staging import ThreadCopier

BLOCK = 64 << 10
HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests" / "test_gpu_cuda.py"


class Memory:
    """Source and destination "KV" of one check: CUDA tensors, or numpy in --dry-run."""

    def __init__(self, nbytes: int, dry: bool) -> None:
        self.dry, self.nbytes = dry, nbytes
        if dry:
            self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            self.dst = np.zeros(nbytes, dtype=np.uint8)
        else:
            import torch

            self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
            self.dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")

    def regions(self) -> tuple[Any, Any]:
        if self.dry:
            return tuple(
                DeviceMemory(int(a.ctypes.data), a.nbytes, "cuda:0", owner=a)
                for a in (self.src, self.dst)
            )
        return self.src, self.dst

    def clear_dst(self) -> None:
        self.dst[:] = 0

    def equal(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> bool:
        slots = self.nbytes // BLOCK
        if self.dry:
            s, d = self.src.reshape(slots, BLOCK), self.dst.reshape(slots, BLOCK)
            return bool(np.array_equal(d[dst_slots], s[src_slots]))
        import torch

        s, d = self.src.view(slots, BLOCK), self.dst.view(slots, BLOCK)
        si = torch.as_tensor(src_slots, device="cuda:0")
        di = torch.as_tensor(dst_slots, device="cuda:0")
        return bool(torch.equal(d[di], s[si]))


def make_engines(transport: str, dry: bool) -> tuple[Engine, Engine]:
    if dry:
        from kvt.tcp import TcpBackend

        def one(name: str) -> Engine:
            return Engine(TcpBackend("127.0.0.1", 0, name=name), name=name,
                          device_copier=ThreadCopier(name=f"kvt-{name}-copier"))  # fmt: skip

        return one("P"), one("D")
    # forced even for tcp: auto would pick samehost (one host), or rdma where the GPU box has a
    # NIC, which does not move device memory yet
    kwargs = {"transport": transport} if transport != "tcp" or len(transports(dry)) > 1 else {}
    return TransferEngine(name="P", **kwargs), TransferEngine(name="D", **kwargs)


def transports(dry: bool) -> list[str]:
    """tcp, plus samehost when this build of kvt has it (TransferEngine(transport=...))."""
    if dry:
        return ["tcp"]
    import inspect

    out = ["tcp"]
    if "transport" in inspect.signature(TransferEngine.__init__).parameters:
        out.append("samehost")
    return out


def sync(dry: bool) -> None:
    if not dry:
        import torch

        torch.cuda.synchronize()


# ------------------------------------------------------------------ step 2: throughput
def throughput(transport: str, nbytes: int, batch_blocks: int, repeats: int, dry: bool) -> dict:
    memory = Memory(nbytes, dry)
    p, d = make_engines(transport, dry)
    try:
        src_region, dst_region = memory.regions()
        src_id, dst_id = p.register_region(src_region), d.register_region(dst_region)
        slots = nbytes // BLOCK
        rng = np.random.default_rng(1)
        times, exact = [], []
        for i in range(repeats + 1):  # one warm-up
            src_slots, dst_slots = rng.permutation(slots), rng.permutation(slots)
            blocks = make_blocks(
                (src_slots * BLOCK).tolist(), (dst_slots * BLOCK).tolist(), BLOCK,
                src_region=src_id, dst_region=dst_id,
            )  # fmt: skip
            memory.clear_dst()
            sync(dry)
            done = threading.Event()
            result: list[Any] = []
            d.expect(f"t{i}", timeout_s=60,
                     on_complete=lambda c, r=result, e=done: (r.append(c), e.set()))  # fmt: skip
            t0 = time.perf_counter()
            for start in range(0, slots, batch_blocks):
                last = start + batch_blocks >= slots
                p.send(f"t{i}", d.data_address, blocks[start : start + batch_blocks], last=last)
            assert done.wait(120), "transfer did not complete"
            elapsed = time.perf_counter() - t0
            if result[0].status is not TransferStatus.DONE:
                raise RuntimeError(f"transfer failed: {result[0]}")
            if i:
                times.append(elapsed)
                exact.append(memory.equal(src_slots, dst_slots))
        baseline = d2d_baseline(memory, repeats, dry)
        median = statistics.median(times)
        return {
            "transport": transport,
            "bytes": nbytes,
            "blocks": slots,
            "block_bytes": BLOCK,
            "batch_blocks": batch_blocks,
            "kvt_gbps_median": nbytes / median / 1e9,
            "kvt_gbps_best": nbytes / min(times) / 1e9,
            "byte_exact": all(exact),
            **baseline,
            "kvt_vs_d2d_contiguous_median": baseline["d2d_contiguous_gbps"]
            and (nbytes / median / 1e9 / baseline["d2d_contiguous_gbps"]),
        }
    finally:
        p.close()
        d.close()


def d2d_baseline(memory: Memory, repeats: int, dry: bool) -> dict:
    """The same bytes by a plain device copy: contiguous, and scattered blocks (gather/scatter)."""
    slots = memory.nbytes // BLOCK
    rng = np.random.default_rng(2)
    src_slots, dst_slots = rng.permutation(slots), rng.permutation(slots)
    contiguous, scattered = [], []
    if dry:
        s, d = memory.src.reshape(slots, BLOCK), memory.dst.reshape(slots, BLOCK)
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(memory.dst, memory.src)
            contiguous.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            d[dst_slots] = s[src_slots]
            scattered.append(time.perf_counter() - t0)
    else:
        import torch

        s, d = memory.src.view(slots, BLOCK), memory.dst.view(slots, BLOCK)
        si = torch.as_tensor(src_slots, device="cuda:0")
        di = torch.as_tensor(dst_slots, device="cuda:0")
        memory.dst.copy_(memory.src)  # warm-up
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            memory.dst.copy_(memory.src)
            end.record()
            end.synchronize()
            contiguous.append(start.elapsed_time(end) / 1e3)
            start.record()
            d[di] = s[si]
            end.record()
            end.synchronize()
            scattered.append(start.elapsed_time(end) / 1e3)
    return {
        "d2d_contiguous_gbps": memory.nbytes / statistics.median(contiguous) / 1e9,
        "d2d_scattered_gbps": memory.nbytes / statistics.median(scattered) / 1e9,
    }


# ------------------------------------------------------------------ step 3: per-layer pipeline
LAST_LAYER_HOLD_S = 30.0  # the CPU rehearsal's bound on waiting for the first layer at D


def pipeline(layers: int, layer_blocks: int, compute_ms: float, dry: bool) -> dict:
    nbytes = layers * layer_blocks * BLOCK * 2
    memory = Memory(nbytes, dry)
    p, d = make_engines("tcp", dry)
    events: Any = None
    try:
        src_region, dst_region = memory.regions()
        src_id, dst_id = p.register_region(src_region), d.register_region(dst_region)
        slots = nbytes // BLOCK
        rng = np.random.default_rng(3)
        src_slots = rng.permutation(slots)[: layers * layer_blocks].reshape(layers, layer_blocks)
        dst_slots = rng.permutation(slots)[: layers * layer_blocks].reshape(layers, layer_blocks)
        events = CpuLayerEvents(layers) if dry else CudaLayerEvents(layers)
        t0 = time.perf_counter()
        ready_at = [0.0] * layers
        for layer in range(layers):
            events.when_ready(layer, lambda k=layer: ready_at.__setitem__(k, time.perf_counter()))
        first_batch_at: list[float] = []
        first_batch = threading.Event()
        on_batch = d.on_batch

        def timed_on_batch(link, batch):  # D's backend calls this as each batch arrives
            if not first_batch_at:
                first_batch_at.append(time.perf_counter())
                first_batch.set()
            return on_batch(link, batch)

        d.on_batch = timed_on_batch  # type: ignore[method-assign]
        done = threading.Event()
        result: list[Any] = []
        d.expect("pipe", timeout_s=120, on_complete=lambda c: (result.append(c), done.set()))
        for layer in range(layers):
            blocks = make_blocks(
                (src_slots[layer] * BLOCK).tolist(), (dst_slots[layer] * BLOCK).tolist(), BLOCK,
                src_region=src_id, dst_region=dst_id,
            )  # fmt: skip
            p.send("pipe", d.data_address, blocks, last=layer == layers - 1,
                   after=(events, layer))  # fmt: skip
        t0 = time.perf_counter()
        compute(events, layers, compute_ms, memory, dry, first_batch=first_batch)
        assert done.wait(120), "pipeline transfer did not complete"
        t_done = time.perf_counter()
        if result[0].status is not TransferStatus.DONE:
            raise RuntimeError(f"pipeline transfer failed: {result[0]}")
        exact = memory.equal(src_slots.reshape(-1), dst_slots.reshape(-1))
        return {
            "layers": layers,
            "bytes_per_layer": layer_blocks * BLOCK,
            "compute_ms_per_layer": compute_ms,
            "first_layer_ready_s": ready_at[0] - t0,
            "first_bytes_at_receiver_s": first_batch_at[0] - t0,
            "last_layer_ready_s": ready_at[-1] - t0,
            "done_s": t_done - t0,
            "first_layer_on_wire_before_last_computed": first_batch_at[0] < ready_at[-1],
            "transfer_after_last_layer_s": t_done - ready_at[-1],
            "byte_exact": exact,
        }
    finally:
        p.close()
        d.close()
        if events is not None:
            events.close()


def compute(
    events: Any,
    layers: int,
    compute_ms: float,
    memory: Memory,
    dry: bool,
    *,
    first_batch: threading.Event,
) -> None:
    """The fake model: per layer, busy work, then the layer is "written" and its event recorded.
    The KV bytes are already in place (they were filled at random): the work stands in for the
    attention that writes them.

    The CPU rehearsal holds the last layer until the first layer's bytes reach D (at most
    ``LAST_LAYER_HOLD_S``): a transport that sends per layer gets them there first whatever the
    box's load, one that waits for the whole model does not, and the report says so."""
    if dry:

        def run() -> None:
            for layer in range(layers):
                time.sleep(compute_ms / 1e3)
                if layer == layers - 1:
                    first_batch.wait(LAST_LAYER_HOLD_S)
                events.mark_ready(layer)

        thread = threading.Thread(target=run, name="fake-model")
        thread.start()
        thread.join()
        return
    import torch

    a = torch.randn(4096, 4096, device="cuda:0")
    _ = a @ a  # warm-up (cuBLAS handles), so the timing below is one matmul
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    _ = a @ a
    end.record()
    end.synchronize()
    per_matmul_ms = max(start.elapsed_time(end), 1e-3)
    reps = max(1, round(compute_ms / per_matmul_ms))
    for layer in range(layers):  # queued at once; the GPU runs them one after the other
        for _ in range(reps):
            a = (a @ a).clamp_(-1, 1)
        events.record(layer, stream)


# ------------------------------------------------------------------ steps 1 and 4
def cuda_tests(timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", str(TESTS), "-q", "-rs", "-p", "no:cacheprovider"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"rc": None, "summary": f"timed out after {timeout_s}s"}
    lines = (out.stdout + out.stderr).strip().splitlines()
    return {"rc": out.returncode, "summary": lines[-1] if lines else "", "tail": lines[-15:]}


def rdma_devices() -> str:
    tool = shutil.which("ibv_devices")
    if tool is None:
        return "ibv_devices not installed"
    out = subprocess.run([tool], capture_output=True, text=True, timeout=20, check=False)
    return (out.stdout + out.stderr).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU only, fake device and copier")
    parser.add_argument("--mib", type=int, default=None, help="bytes per throughput transfer")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dry = args.dry_run
    report: dict[str, Any] = {"dry_run": dry, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    t_start = time.perf_counter()
    if not dry:
        import torch

        if not torch.cuda.is_available():
            print("CUDA not available: run with --dry-run on CPU", file=sys.stderr)
            return 2
        report["device"] = torch.cuda.get_device_name(0)
        report["torch"] = torch.__version__
        report["cuda_tests"] = cuda_tests(timeout_s=120)
    mib = args.mib or (16 if dry else 1024)
    report["throughput"] = []
    for transport in transports(dry):
        try:
            report["throughput"].append(
                throughput(transport, mib << 20, batch_blocks=1024, repeats=args.repeats, dry=dry)
            )
        except Exception as exc:  # one path failing must not lose the other figures
            report["throughput"].append({"transport": transport, "error": repr(exc)})
    try:
        report["pipeline"] = pipeline(
            layers=8 if dry else 32, layer_blocks=16 if dry else 256,
            compute_ms=5.0 if dry else 20.0, dry=dry,
        )  # fmt: skip
    except Exception as exc:
        report["pipeline"] = {"error": repr(exc)}
    if not dry:
        report["rdma_devices"] = rdma_devices()
    report["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(report, indent=2)
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gpu_check.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
