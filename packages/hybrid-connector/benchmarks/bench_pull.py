"""Rapid transfer_kv vs sending after the prefill: time from prefill start to KV complete on D.

Two HybridConnector worker halves (P and D) in one process, on real simple_rpc and kvt over
loopback TCP, with KV caches laid out like vLLM's CPU backend. A prefill is simulated layer by
layer: each layer "computes" for ``layer_ms`` (sleep: device time that does not hold the GIL),
then the layer is marked written (what vLLM's ``save_kv_layer`` does).

D's pull is parked on P before the prefill starts (parallel dispatch):

* after-finish: the transfer starts when the request finished (the plain path: offer after the
  whole forward pass);
* rapid: the parked pull is answered at the start of the step; each layer leaves as it is written.

D's pull reaches P mid-forward, once half the layers are written (no pull parked at the step's
start):

* mid-forward, after finish: it waits on P until the request finished (what rapid transfer_kv
  did before: it served only a pull parked before the step);
* mid-forward, rapid: it is answered at once, the written layers leave at once, the others as
  they are written.

Reported: median latency from prefill start to D's ``finished_recving``, and the ratios.

    python packages/hybrid-connector/benchmarks/bench_pull.py            # full: table + JSON
    python packages/hybrid-connector/benchmarks/bench_pull.py --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import threading
import time
import uuid
from pathlib import Path

import torch
from hybrid_connector.config import HybridConfig
from hybrid_connector.metadata import FinalPrefill, HybridConnectorMetadata, OfferSpec, RecvSpec
from hybrid_connector.send_done import SendDoneServer
from hybrid_connector.worker_side import WorkerSide

RESULTS = Path(__file__).parent / "results" / "pull.json"
BLOCK_SIZE = 128


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _caches(layers: int, blocks: int, heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    buf = torch.ones(layers, blocks, heads, BLOCK_SIZE, 2 * head_dim, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}


def _wait_recv(side: WorkerSide, request_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recving, failed = side.drain(wait_s=deadline - time.monotonic())
        if request_id in recving:
            if failed:
                raise RuntimeError(f"pull {request_id} failed")
            return
    raise TimeoutError(request_id)


class _GivenBack:
    """P's scheduler half as its worker sees it: where SEND_DONE (P's blocks back) arrives."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests: set[str] = set()

    def send_done(self, request_id: str, tp_rank: int, outcome: str = "") -> bool:
        with self._cond:
            self._requests.add(request_id)
            self._cond.notify_all()
        return True

    def wait(self, request_id: str, timeout: float = 60.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._requests, timeout):
                raise TimeoutError(request_id)
            self._requests.discard(request_id)


class _Bench:
    def __init__(self, p: WorkerSide, d: WorkerSide, rpc: str, names: list[str], n_blocks: int):
        self.p, self.d, self.rpc, self.names, self.n_blocks = p, d, rpc, names, n_blocks
        self.given_back = _GivenBack()
        self.scheduler = SendDoneServer(self.given_back, host="127.0.0.1", advertise_host=None)
        p.handle_metadata(HybridConnectorMetadata(scheduler_address=self.scheduler.address))

    def once(self, layer_ms: float, *, rapid: bool, mid_forward: bool = False) -> float:
        """One prefill + pull; ``mid_forward``: D's pull is sent once half the layers are
        written, else it is parked on P before the prefill starts."""
        p, d = self.p, self.d
        tid = str(uuid.uuid4())
        src = list(range(self.n_blocks))
        dst = list(range(self.n_blocks, 2 * self.n_blocks))
        tokens = self.n_blocks * BLOCK_SIZE
        pull = RecvSpec("d", tid, self.rpc, [dst], [0], tokens)
        pull_at = len(self.names) // 2 if mid_forward else None
        if pull_at is None:
            d.handle_metadata(HybridConnectorMetadata(to_recv=[pull]))
            # Let the pull reach P and park there (parallel dispatch: D asked before P's prefill).
            parked = p.counters().get("early_pulls", 0) + 1
            if not p.wait_count("early_pulls", parked, timeout_s=10):
                raise TimeoutError("the pull did not reach P")
        start = time.perf_counter()
        if rapid:
            done = FinalPrefill("p", tid, [src], tokens)
            p.handle_metadata(HybridConnectorMetadata(final_prefills=[done]))
        for layer, name in enumerate(self.names):  # the forward pass
            if layer == pull_at:
                d.handle_metadata(HybridConnectorMetadata(to_recv=[pull]))
            time.sleep(layer_ms / 1000)
            if rapid:
                p.layer_saved(name)
        if rapid:
            p.step_done()  # the request finished in its step: offered now
        else:  # the request finished at the end of the step: its blocks are offered
            offer = OfferSpec("p", tid, [src], tokens)
            p.handle_metadata(HybridConnectorMetadata(to_offer=[offer]))
        _wait_recv(d, "d")
        elapsed = time.perf_counter() - start
        self.given_back.wait("p")
        return elapsed

    def median_ms(self, layer_ms: float, repeats: int, **variant: bool) -> float:
        return statistics.median(self.once(layer_ms, **variant) for _ in range(repeats)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--transport",
        default="tcp",
        choices=["tcp", "samehost", "auto"],
        help="kvt's payload path (default tcp: loopback TCP, as the README's table)",
    )
    args = parser.parse_args()
    smoke = args.smoke and not os.environ.get("BENCH_FULL")
    # Full: a 7B-class GQA shape (28 layers, 4 KV heads of 128) and a 2k-token prompt (~117 MB).
    layers, heads, head_dim, n_blocks = (4, 2, 64, 2) if smoke else (28, 4, 128, 16)
    layer_ms_list = [1.0] if smoke else [0.0, 2.0, 5.0]
    repeats = 2 if smoke else 7

    port = _free_port()
    rpc = f"127.0.0.1:{port}"
    p_cfg = HybridConfig(rpc_port=port, kvt_transport=args.transport)
    p = WorkerSide(p_cfg, is_producer=True, is_consumer=False, name="P")
    d_cfg = HybridConfig(kvt_transport=args.transport)
    d = WorkerSide(d_cfg, is_producer=False, is_consumer=True, name="D")
    p_kv = _caches(layers, 2 * n_blocks, heads, head_dim)
    p.register_kv_caches(p_kv, BLOCK_SIZE)
    d.register_kv_caches(_caches(layers, 2 * n_blocks, heads, head_dim), BLOCK_SIZE)
    names = list(p_kv)
    kv_bytes = n_blocks * layers * heads * BLOCK_SIZE * 2 * head_dim * 2
    rows = []
    bench = None
    try:
        bench = _Bench(p, d, rpc, names, n_blocks)
        bench.once(0.0, rapid=False)  # warm up the connections
        for layer_ms in layer_ms_list:
            row = {
                "layer_ms": layer_ms,
                "prefill_ms": layer_ms * layers,
                "after_finish_ms": bench.median_ms(layer_ms, repeats, rapid=False),
                "rapid_ms": bench.median_ms(layer_ms, repeats, rapid=True),
                "mid_forward_after_finish_ms": bench.median_ms(
                    layer_ms, repeats, rapid=False, mid_forward=True
                ),
                "mid_forward_rapid_ms": bench.median_ms(
                    layer_ms, repeats, rapid=True, mid_forward=True
                ),
            }
            row["after_over_rapid"] = row["after_finish_ms"] / row["rapid_ms"]
            row["mid_forward_after_over_rapid"] = (
                row["mid_forward_after_finish_ms"] / row["mid_forward_rapid_ms"]
            )
            rows.append(row)
    finally:
        if bench is not None:
            bench.scheduler.close()
        d.close()
        p.close()

    print(
        f"KV: {layers} layers x {n_blocks} blocks of {BLOCK_SIZE} tokens = {kv_bytes / 1e6:.1f} MB;"
        f" median of {repeats}; kvt transport {args.transport}"
    )
    print(f"{'':>21} {'pull parked before the prefill':^33} {'pull after half the layers':^33}")
    print(
        f"{'layer ms':>9} {'prefill ms':>11}"
        + f" {'after-finish ms':>16} {'rapid ms':>9} {'ratio':>6}" * 2
    )
    for r in rows:
        print(
            f"{r['layer_ms']:>9.1f} {r['prefill_ms']:>11.1f} {r['after_finish_ms']:>16.1f}"
            f" {r['rapid_ms']:>9.1f} {r['after_over_rapid']:>5.2f}x"
            f" {r['mid_forward_after_finish_ms']:>16.1f} {r['mid_forward_rapid_ms']:>9.1f}"
            f" {r['mid_forward_after_over_rapid']:>5.2f}x"
        )
    if not smoke:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            json.dumps(
                {
                    "benchmark": "pull latency from prefill start: after-finish vs rapid, "
                    "pull parked before the prefill or sent after half the layers",
                    "kv_bytes": kv_bytes,
                    "layers": layers,
                    "blocks": n_blocks,
                    "block_size": BLOCK_SIZE,
                    "repeats": repeats,
                    "transport": args.transport,
                    "machine": platform.platform(),
                    "cpus": os.cpu_count(),
                    "rows": rows,
                },
                indent=2,
            )
        )
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
