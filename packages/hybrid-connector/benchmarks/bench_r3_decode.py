"""What R3 recording costs the engine's decode throughput: the connector without r3 vs with r3.

One offline vLLM ``LLM`` per run, each in a fresh process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``OMP_NUM_THREADS=1``, ``enforce_eager``), a refstore master of its own (its own process, as a
node's master), HybridConnector as ``kv_both`` in every variant:

* ``off``: the connector without r3;
* ``on``: ``"r3": {"store": ...}``: the routing layer, the routers' capture hook, the copy out
  and the put of every finished request's record;
* ``capture`` (``--attribute``): r3 on, the copy out a no-op (the layer and the capture only);
* ``layer`` (``--attribute``): r3 on, the routers unhooked and the copy out a no-op (only the
  extra KV layer and the scheduler half's plan).

``--pairs N`` instead: per round one process with r3 on, N pairs of batches alternating (ABBA)
between the recorder running and its capture hooks and copy out switched off; the ratio per
pair, no difference between processes in it (the box's noise between processes is larger
than the cost on the tiny model).

``on - capture`` is then the copy out and the put, ``capture - layer`` the capture hook,
``layer - off`` the rest. ``--before DIR`` adds ``on@before``: r3 on with the project's packages
imported from another checkout (``DIR/packages/*/src``), so a change is measured against the
code before it in the same run.

Each run: one warm-up batch, then ``--reps`` timed batches of ``--requests`` requests with
``--prompt-len``-token prompts decoding ``--tokens`` tokens each (``ignore_eos``). Timed per
batch: the ``generate`` and the engine step after it that hands the finished requests over
(vLLM runs that step after any request finishes; the connector copies the rows out in it), and,
apart, the wait until the put thread stored every record. Throughput: output tokens / (generate
+ that step). Runs of one round alternate their order; per round the ratio on / off of the
runs' median throughputs; over rounds the median ratio and its range (min .. max).

    flock /tmp/bench.lock python packages/hybrid-connector/benchmarks/bench_r3_decode.py \\
        --arch qwen3-moe --rounds 5
    flock /tmp/bench.lock python packages/hybrid-connector/benchmarks/bench_r3_decode.py \\
        --arch qwen3-moe-wide --rounds 3
    flock /tmp/bench.lock python packages/hybrid-connector/benchmarks/bench_r3_decode.py \\
        --arch qwen3-moe --pairs 16 --rounds 4
    python packages/hybrid-connector/benchmarks/bench_r3_decode.py --smoke   # 1 round, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The same --before mechanism as the prefill-overhead bench (this directory is on sys.path).
from bench_prefill_overhead import _use_code_dir

# Nothing of the project is imported at module level: a child running ``@before`` imports it
# from the other checkout (_use_code_dir).
RESULTS = Path(__file__).parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[3]
BEFORE_SUFFIX = "@before"
STORE = "bench-r3-decode"
VARIANTS = ("off", "on")
PAIRED = "paired"
ATTRIBUTION = ("capture", "layer")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prompts(count: int, length: int) -> list[list[int]]:
    # Distinct prompts (no prefix-cache hits), token ids well inside the tiny vocabulary.
    return [[(7 * i + 13 * j) % 200 + 10 for j in range(length)] for i in range(count)]


def _patch_attribution(variant: str) -> None:
    """``capture``: the recorder copies nothing out; ``layer``: nor are the routers hooked."""
    from hybrid_connector import connector, r3_worker

    r3_worker.R3Recorder.copy_out = lambda self, copies: None  # type: ignore[method-assign]
    if variant == "layer":
        routers = connector._moe_routers

        class _Unhooked:
            def set_capture_fn(self, fn: Any) -> None:
                return

        connector._moe_routers = lambda cfg: [_Unhooked() for _ in routers(cfg)]  # type: ignore[attr-defined]


def child(args: argparse.Namespace) -> None:
    """One run in this process; JSON on stdout's last line."""
    variant = args.child
    base = variant.removesuffix(BEFORE_SUFFIX)
    if variant.endswith(BEFORE_SUFFIX):
        _use_code_dir(args.before)
    import hybrid_connector
    from hybrid_connector.tiny_model import OFFLINE_KV_CACHE_BYTES, OFFLINE_VLLM_ENV

    os.environ.update(OFFLINE_VLLM_ENV)
    with tempfile.TemporaryDirectory(prefix="bench-r3-decode-") as work:
        os.environ["REFSTORE_DIR"] = work
        from refstore.launch import start_master_process

        master = start_master_process(STORE, "512M")
        try:
            result = _run(args, base, OFFLINE_KV_CACHE_BYTES)
        finally:
            master.terminate()
            master.wait(timeout=30)
    result["code"] = str(Path(hybrid_connector.__file__).resolve().parents[1])
    print(json.dumps({"variant": variant, **result}))


def _run(args: argparse.Namespace, variant: str, kv_bytes: int) -> dict[str, Any]:
    from hybrid_connector.tiny_model import make_tiny_model
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import kv_transfer_state

    if variant in ATTRIBUTION:
        _patch_attribution(variant)
    model = make_tiny_model(Path(args.model_cache) / args.arch, args.arch)
    extra: dict[str, Any] = {"rpc_port": _free_port()}
    if variant != "off":
        extra["r3"] = {"store": STORE}
    llm = LLM(
        model=str(model),
        enforce_eager=True,
        max_model_len=args.prompt_len + args.tokens + 16,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests * args.prompt_len),
        seed=0,
        kv_cache_memory_bytes=kv_bytes,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridConnector",
            kv_connector_module_path="hybrid_connector.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    core = llm.llm_engine.engine_core.engine_core  # in process (no multiprocessing)
    worker = kv_transfer_state.get_kv_transfer_group()._worker  # in process too
    prompts = [{"prompt_token_ids": p} for p in _prompts(args.requests, args.prompt_len)]

    def batch(tokens: int) -> dict[str, float]:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        stored_before = worker.r3.counters["stored"] if worker.r3 is not None else 0
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        t1 = time.perf_counter()
        while core.scheduler.has_requests():  # the step that hands the finished ones over
            core.step()
        t2 = time.perf_counter()
        stored = stored_before + len(prompts)
        if variant == "on" and worker.r3 is not None and not worker.r3.wait_stored(stored, 60):
            raise RuntimeError(f"records not stored: {worker.r3.counters}")
        t3 = time.perf_counter()
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
        return {"generate_s": t1 - t0, "finish_s": t2 - t1, "records_s": t3 - t2}

    def timed() -> dict[str, float]:
        cpu0 = time.process_time()
        rep = batch(args.tokens)
        rep["process_cpu_s"] = time.process_time() - cpu0
        rep["tokens_per_s"] = args.requests * args.tokens / (rep["generate_s"] + rep["finish_s"])
        return rep

    batch(8)  # warm-up
    if variant == PAIRED:
        return _paired(args, llm, worker, timed)
    reps = [timed() for _ in range(args.reps)]
    counters = worker.r3.counters if worker.r3 is not None else {}
    llm.llm_engine.engine_core.shutdown()
    return {"reps": reps, "r3_counters": dict(counters)}


def _paired(
    args: argparse.Namespace, llm: Any, worker: Any, timed: Callable[[], dict[str, float]]
) -> dict[str, Any]:
    """One engine with r3 on; batches alternate (ABBA) between the recorder as it runs (the
    routers' capture hook and the copy out of finished requests' rows) and both switched off,
    so no difference between processes enters the ratio. The extra KV layer and the scheduler
    half's plan run in both (``layer`` measures them)."""
    from hybrid_connector import connector

    routers = connector._moe_routers(llm.llm_engine.vllm_config)
    hooks = [router.capture_fn for router in routers]
    recorder = worker.r3

    def set_recording(on: bool) -> None:
        for router, hook in zip(routers, hooks, strict=True):
            router.set_capture_fn(hook if on else None)
        if on:
            recorder.__dict__.pop("copy_out", None)
        else:
            recorder.copy_out = lambda copies: None

    pairs = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        runs = {}
        for on in order:
            set_recording(on)
            stored = recorder.counters["stored"]
            runs[on] = timed()
            # The put thread's work stays out of the next batch (and out of the throughput,
            # as for the variants).
            if on and not recorder.wait_stored(stored + args.requests, 60):
                raise RuntimeError(f"records not stored: {recorder.counters}")
        pairs.append({"on": runs[True], "off": runs[False]})
    llm.llm_engine.engine_core.shutdown()
    return {"pairs": pairs}


def run_child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", variant]
    for name in ("arch", "requests", "tokens", "prompt_len", "reps", "pairs", "model_cache"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.before:
        cmd += ["--before", args.before]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{variant} run failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def summarise(rounds: list[dict[str, dict[str, Any]]], variants: list[str]) -> dict[str, Any]:
    per_round = []
    for r in rounds:
        row: dict[str, Any] = {}
        for v in variants:
            reps = r[v]["reps"]
            row[v] = {k: _median([rep[k] for rep in reps]) for k in reps[0]}
        for v in variants[1:]:
            row[f"{v}/off"] = row[v]["tokens_per_s"] / row["off"]["tokens_per_s"]
            # Tokens per CPU second of the process (engine, workers and put thread are
            # threads of it): less moved by other jobs than wall-clock throughput.
            row[f"{v}/off cpu"] = row["off"]["process_cpu_s"] / row[v]["process_cpu_s"]
        per_round.append(row)
    summary: dict[str, Any] = {"per_round": per_round}
    for v in variants[1:]:
        ratios = [row[f"{v}/off"] for row in per_round]
        cpu = [row[f"{v}/off cpu"] for row in per_round]
        # The cost: throughput lost, 1 - on/off (positive: R3 is slower).
        summary[v] = {
            "throughput_ratio_median": _median(ratios),
            "throughput_ratio_min": float(min(ratios)),
            "throughput_ratio_max": float(max(ratios)),
            "cost_median": 1 - _median(ratios),
            "cpu_ratio_median": _median(cpu),
            "cpu_ratio_min": float(min(cpu)),
            "cpu_ratio_max": float(max(cpu)),
        }
    return summary


def print_summary(summary: dict[str, Any], variants: list[str]) -> None:
    print("round  " + "  ".join(f"{v + ' tok/s':>13}" for v in variants), end="")
    print("  " + "  ".join(f"{v + '/off':>13}" for v in variants[1:]))
    for i, row in enumerate(summary["per_round"], 1):
        cells = "  ".join(f"{row[v]['tokens_per_s']:13.1f}" for v in variants)
        ratios = "  ".join(f"{row[v + '/off']:13.4f}" for v in variants[1:])
        print(f"{i:5}  {cells}  {ratios}")
    for v in variants[1:]:
        s = summary[v]
        median = 100 * (s["throughput_ratio_median"] - 1)
        print(
            f"{v} vs off, decode throughput: median {median:+.2f}%"
            f" (rounds {100 * (s['throughput_ratio_min'] - 1):+.2f}% .."
            f" {100 * (s['throughput_ratio_max'] - 1):+.2f}%); per CPU second:"
            f" {100 * (s['cpu_ratio_median'] - 1):+.2f}%"
            f" ({100 * (s['cpu_ratio_min'] - 1):+.2f}% .. {100 * (s['cpu_ratio_max'] - 1):+.2f}%)"
        )
    last = summary["per_round"][-1]
    for v in variants:
        print(
            f"{v:>10}: generate {1e3 * last[v]['generate_s']:.1f} ms, finish step"
            f" {1e3 * last[v]['finish_s']:.1f} ms, records wait {1e3 * last[v]['records_s']:.1f} ms"
            " (last round)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child")
    parser.add_argument("--arch", default="qwen3-moe", help="qwen3-moe or qwen3-moe-wide")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="timed batches per run")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--attribute", action="store_true", help="+ capture, layer variants")
    parser.add_argument("--before", help="+ on@before: r3 on with this checkout's packages")
    parser.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "r3-models"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--pairs", type=int, default=0,
        help="instead of variants in processes: this many on/off batch pairs in one engine",
    )  # fmt: skip
    parser.add_argument("--out", help="JSON path (default: results/r3_decode_<arch>.json)")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.pairs:
        paired_main(args)
        return
    variants = list(VARIANTS)
    if args.attribute:
        variants += ATTRIBUTION
    if args.before:
        variants.append("on" + BEFORE_SUFFIX)
    if args.smoke:
        args.rounds, args.reps, args.requests, args.tokens = 1, 1, 4, 16
    rounds = []
    for i in range(args.rounds):
        order = variants if i % 2 == 0 else variants[::-1]
        rounds.append({v: run_child(v, args) for v in order})
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    summary = summarise(rounds, variants)
    print_summary(summary, variants)
    if args.smoke:
        return
    out = Path(args.out) if args.out else RESULTS / f"r3_decode_{args.arch}.json"
    out.write_text(
        json.dumps(
            {"config": vars(args), "variants": variants, "summary": summary, "rounds": rounds},
            indent=1,
        )
    )
    print(f"wrote {out}")


def median_interval(values: list[float], resamples: int = 20000) -> tuple[float, float]:
    """The median's 95% percentile-bootstrap interval (seeded: a rerun on the same pairs gives
    the same interval)."""
    import numpy as np

    samples = np.random.default_rng(0).choice(np.asarray(values), (resamples, len(values)))
    medians = np.median(samples, axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def paired_main(args: argparse.Namespace) -> None:
    """``--pairs``: per round one engine alternating the recorder on and off (``_paired``);
    per pair the ratio of throughputs on / off; over every pair the median, its 95% bootstrap
    interval, quartiles, range."""
    if args.smoke:
        args.rounds, args.pairs, args.requests, args.tokens = 1, 2, 4, 16
    rounds = []
    for i in range(args.rounds):
        rounds.append(run_child(PAIRED, args))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    ratios = sorted(
        p["on"]["tokens_per_s"] / p["off"]["tokens_per_s"] for r in rounds for p in r["pairs"]
    )
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    low, high = median_interval(ratios)
    summary = {
        "pairs": len(ratios),
        "ratio_median": median,
        "ratio_median_ci95": [low, high],
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
        "round_medians": [
            _median([p["on"]["tokens_per_s"] / p["off"]["tokens_per_s"] for p in r["pairs"]])
            for r in rounds
        ],
    }
    print(
        f"recording on vs off in one engine, {len(ratios)} pairs: median {100 * (median - 1):+.2f}%"
        f" (95% interval {100 * (low - 1):+.2f}% .. {100 * (high - 1):+.2f}%;"
        f" quartiles {100 * (q1 - 1):+.2f}% .. {100 * (q3 - 1):+.2f}%, range"
        f" {100 * (ratios[0] - 1):+.2f}% .. {100 * (ratios[-1] - 1):+.2f}%); round medians "
        + ", ".join(f"{100 * (m - 1):+.2f}%" for m in summary["round_medians"])
    )
    if args.smoke:
        return
    out = Path(args.out) if args.out else RESULTS / f"r3_decode_{args.arch}_paired.json"
    out.write_text(
        json.dumps({"config": vars(args), "summary": summary, "rounds": rounds}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
