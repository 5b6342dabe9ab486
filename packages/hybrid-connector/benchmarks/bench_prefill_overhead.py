"""What HybridConnector adds to a prefill-only request on P: plain vLLM vs vLLM + connector.

One offline vLLM ``LLM`` per variant, each in its own spawned process (vLLM's KV-transfer group
is process-global), same tiny model, same prompts, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``OMP_NUM_THREADS=1``, ``enforce_eager``:

* plain: no connector;
* connector: ``HybridConnector`` as ``kv_both``, each request with
  ``{"do_remote_decode": true, "transfer_id": X}`` (what the proxy sends P).

Each request is a ``LLM.generate`` of one prompt with ``max_tokens=1``, timed end to end, run
sequentially. Nobody pulls, so the connector holds every request's blocks under a lease (the
P state between the answer and D's pull). Reported: median and p90 per variant and the
connector/plain ratio. The variants run alternately, in rounds, to share machine noise.

``--multiprocessing`` runs the engine core in its own process with vLLM's busy loop, as
``vllm serve`` does. There, while any finished request's blocks are held (``delay_free``), vLLM
keeps stepping empty steps (~1 kHz, each a round trip to the worker process over spinning shared
memory queues): that, not the connector's hooks, is the cost of holding blocks (README). It also
loads the machine while the other variant is timed; ``--lease-s`` bounds it.

    python packages/hybrid-connector/benchmarks/bench_prefill_overhead.py           # table + JSON
    python packages/hybrid-connector/benchmarks/bench_prefill_overhead.py --smoke   # CI
    python .../bench_prefill_overhead.py --profile /tmp/prof   # + cProfile dump per variant
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from hybrid_connector.tiny_model import OFFLINE_VLLM_ENV

RESULTS = Path(__file__).parent / "results" / "prefill_overhead.json"

ENV = OFFLINE_VLLM_ENV


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kv_config(lease_s: float) -> dict[str, Any]:
    return {
        "kv_connector": "HybridConnector",
        "kv_connector_module_path": "hybrid_connector.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"rpc_port": _free_port(), "lease_s": lease_s},
    }


def _prompts(count: int, length: int) -> list[list[int]]:
    # Distinct prompts (no prefix-cache hits), token ids well inside the tiny vocabulary.
    return [[(7 * i + 13 * j) % 200 + 10 for j in range(length)] for i in range(count)]


def _variant_main(conn: Any, model: str, variant: str, opts: dict[str, Any]) -> None:
    """Child: build one LLM, then time the requests of each round the parent asks for."""
    os.environ.update(ENV)
    if opts.get("multiprocessing"):
        # The engine core in its own process, running vLLM's busy loop (as in `vllm serve`).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import logging

    logging.basicConfig(level=logging.WARNING)
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": model,
        "enforce_eager": True,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "seed": 0,
        "enable_prefix_caching": False,
    }
    connector = variant != "plain"
    remote_decode = variant == "connector"
    if connector:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**_kv_config(opts["lease_s"]))
    llm = LLM(**kwargs)
    profiler = None
    if opts.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
    conn.send("ready")
    while True:
        cmd, prompts = conn.recv()
        if cmd == "close":
            break
        latencies = []
        if profiler is not None and cmd == "timed":
            profiler.enable()
        for ids in prompts:
            kv = (
                {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}
                if remote_decode
                else None
            )
            params = SamplingParams(
                temperature=0.0,
                max_tokens=1,
                extra_args={"kv_transfer_params": kv} if kv is not None else None,
            )
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
            assert len(out[0].outputs[0].token_ids) == 1
            if remote_decode:
                assert out[0].kv_transfer_params, "P returned no kv_transfer_params"
        if profiler is not None and cmd == "timed":
            profiler.disable()
        conn.send(latencies)
    if profiler is not None:
        profiler.dump_stats(os.path.join(opts["profile"], f"{variant}.prof"))
    llm.llm_engine.engine_core.shutdown()
    conn.send("closed")


class _Variant:
    def __init__(self, model: str, variant: str, opts: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_variant_main, args=(child, model, variant, opts))
        self._process.start()
        child.close()

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError("benchmark child did not answer")
        return self._conn.recv()

    def ready(self) -> None:
        assert self._recv(600) == "ready"

    def run(self, cmd: str, prompts: list[list[int]]) -> list[float]:
        self._conn.send((cmd, prompts))
        return self._recv(600)

    def close(self) -> None:
        try:
            if self._process.is_alive():
                self._conn.send(("close", None))
                self._recv(120)
        finally:
            self._process.join(60)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            self._conn.close()


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
        "n": len(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few requests, no JSON")
    parser.add_argument("--requests", type=int, default=50, help="timed requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--model", help="model dir (default: build the tiny model in a tmp dir)")
    parser.add_argument("--profile", help="directory for cProfile dumps of the timed requests")
    parser.add_argument("--lease-s", type=float, default=30.0, help="the connector's lease_s")
    parser.add_argument(
        "--variants",
        default="plain,connector",
        help="comma-separated, among plain, connector, connector-idle (connector loaded, "
        "requests without kv_transfer_params)",
    )
    parser.add_argument(
        "--multiprocessing",
        action="store_true",
        help="engine core in its own process with vLLM's busy loop, as in an API server",
    )
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.rounds, args.prompt_tokens = 4, 1, 64

    from hybrid_connector.tiny_model import make_tiny_model

    model = args.model or str(
        make_tiny_model(Path(tempfile.gettempdir()) / "hybrid-connector-tiny-model")
    )
    opts: dict[str, Any] = {
        "profile": args.profile,
        "multiprocessing": args.multiprocessing,
        "lease_s": args.lease_s,
    }
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    prompts = _prompts(args.requests, args.prompt_tokens)
    warmup = _prompts(3, args.prompt_tokens)
    names = args.variants.split(",")
    variants = {name: _Variant(model, name, opts) for name in names}
    latencies: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for variant in variants.values():
            variant.ready()
        for variant in variants.values():
            variant.run("warmup", warmup)
        for _ in range(args.rounds):
            for name, variant in variants.items():
                latencies[name] += variant.run("timed", prompts)
    finally:
        for variant in variants.values():
            variant.close()

    results = {name: _summary(values) for name, values in latencies.items()}
    measured_name = "connector" if "connector" in results else names[-1]
    baseline, measured = results[names[0]], results[measured_name]
    ratio = measured["median_ms"] / baseline["median_ms"]
    print(
        f"prefill-only request (max_tokens=1), {args.prompt_tokens}-token prompt, "
        f"{args.rounds} rounds x {args.requests} sequential requests"
    )
    print(f"{'variant':<10} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8}")
    for name, summary in results.items():
        print(
            f"{name:<10} {summary['median_ms']:>10.1f} {summary['p90_ms']:>8.1f} "
            f"{summary['mean_ms']:>8.1f}"
        )
    print(f"{measured_name} / {names[0]} (median): {ratio:.2f}x")
    if args.smoke:
        return
    path = RESULTS.with_name("prefill_overhead_mp.json") if args.multiprocessing else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "benchmark": "prefill_overhead",
                "prompt_tokens": args.prompt_tokens,
                "requests_per_round": args.requests,
                "rounds": args.rounds,
                "lease_s": args.lease_s,
                "engine_core_in_own_process": args.multiprocessing,
                "variants": names,
                "results": results,
                "connector_over_plain_median": ratio,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
