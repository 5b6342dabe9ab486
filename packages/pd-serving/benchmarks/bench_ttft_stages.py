"""Where 1P1D TTFT goes: per-stage times of the proxy, P and D, against a single instance.

One deployment (single + HybridConnector 1P1D), two `pdserve proxy` processes in front of the
same P/D pair (parallel and sequential dispatch), each with aiohttp ``TraceConfig`` timestamps
(``GET /trace``); vLLM's own histograms of P and D scraped around every batch; CPU time of every
process tree. Variants re-pin the running P and D between batches: ``pinned`` (every process of
P on core 0, of D on the last core: the default since issue 15) and ``unpinned`` (only the
workers bound, the API servers and engine cores free: the behaviour before). The systems and
variants take turns batch by batch, same prompts for every system in a slot.

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_ttft_stages.py

(JSON in ``benchmarks/results/ttft_stages.json``.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
HIST = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:time_to_first_token_seconds",
)
STAGES = ("p_sent", "d_sent", "d_headers", "p_headers", "pcall_end", "d_first_chunk")


def serve_traced_proxy(argv: list[str]) -> int:
    """`pdserve proxy` plus per-request stage timestamps, dumped (and cleared) by GET /trace."""
    import aiohttp
    from aiohttp import web
    from pd_serving import proxy as px
    from pd_serving.cli import main

    trace: contextvars.ContextVar[dict] = contextvars.ContextVar("trace")
    records: list[dict] = []
    prefill_ports: set[str] = set()

    def mark(suffix: str):
        async def hook(_session, _ctx, params) -> None:
            d = trace.get(None)
            if d is not None:
                stage = "p" if str(params.url.port) in prefill_ports else "d"
                d.setdefault(f"{stage}_{suffix}", time.perf_counter())

        return hook

    async def count_new(_session, _ctx, _params) -> None:
        d = trace.get(None)
        if d is not None:
            d["new_conns"] = d.get("new_conns", 0) + 1

    config = aiohttp.TraceConfig()
    config.on_request_headers_sent.append(mark("sent"))
    config.on_request_end.append(mark("headers"))
    config.on_response_chunk_received.append(mark("first_chunk"))
    config.on_connection_create_end.append(count_new)
    session_class = aiohttp.ClientSession

    class TracedSession(session_class):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("trace_configs", [config])
            super().__init__(*args, **kwargs)

    px.aiohttp.ClientSession = TracedSession
    handle, prefill_call, init = (
        px.PdProxy._handle_generate,
        px.PdProxy._prefill_call,
        px.PdProxy.__init__,
    )

    async def traced_handle(self, request):
        d = {"recv": time.perf_counter()}
        trace.set(d)
        try:
            return await handle(self, request)
        finally:
            records.append(d)

    async def traced_prefill_call(self, *args):
        try:
            return await prefill_call(self, *args)
        finally:
            trace.get()["pcall_end"] = time.perf_counter()

    def traced_init(self, config_):
        init(self, config_)
        prefill_ports.update(b.url.rsplit(":", 1)[1] for b in config_.prefill)

        async def dump(_request):
            out = [
                {k: v if k == "new_conns" else v - r["recv"] for k, v in r.items()} for r in records
            ]
            records.clear()
            return web.json_response(out)

        self.app.router.add_get("/trace", dump)

    px.PdProxy._handle_generate = traced_handle
    px.PdProxy._prefill_call = traced_prefill_call
    px.PdProxy.__init__ = traced_init
    return main(["proxy", *argv])


def set_tree_affinity(pid: int, cpus: set[int], *, skip_workers: bool) -> None:
    """Every thread of ``pid`` and its descendants; vLLM's workers keep their own binding."""
    import psutil

    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        if skip_workers and proc.name().startswith("VLLM::Worker"):
            continue
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), cpus)


def tree_cpu_s(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


async def scrape(session, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in HIST:
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix):
                    key = name.split(":")[1].removesuffix("_seconds") + suffix
                    out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


async def measure(args, dep, proxies, model: str, prompts: list[str]) -> dict:
    import aiohttp
    from pd_serving.client import complete
    from pd_serving.servers import Role

    single, p, d = (dep.by_role(r)[0] for r in (Role.SINGLE, Role.PREFILL, Role.DECODE))
    every = set(range(os.cpu_count() or 1))
    fresh = iter(prompts)
    out: dict = {}

    async def batch(key: str, name: str, url: str, *, backends: dict, slot: list, conc: int):
        entry = out.setdefault(
            key, {"ttft": [], "tokens": [], "trace": [], "vllm": {}, "cpu_s": {}, "wall_s": 0.0}
        )
        if name != "single":
            async with session.get(f"{url}/trace") as resp:
                await resp.json()
        before = {k: await scrape(session, b.url) for k, b in backends.items()}
        cpu0 = {k: tree_cpu_s(b.process.pid) for k, b in backends.items()}
        started = time.perf_counter()
        limit = asyncio.Semaphore(conc)

        async def one(prompt: str):
            async with limit:
                return await complete(session, url, model, prompt, max_tokens=args.max_tokens)

        answers = await asyncio.gather(*(one(x) for x in slot))
        entry["wall_s"] += time.perf_counter() - started
        for k, b in backends.items():
            entry["cpu_s"][k] = entry["cpu_s"].get(k, 0.0) + tree_cpu_s(b.process.pid) - cpu0[k]
            after = await scrape(session, b.url)
            for h, v in after.items():
                entry["vllm"][f"{k}.{h}"] = (
                    entry["vllm"].get(f"{k}.{h}", 0.0) + v - before[k].get(h, 0.0)
                )
        entry["ttft"] += [a.ttft_s * 1000 for a in answers]
        entry["tokens"] += [a.token_ids for a in answers]
        if name != "single":
            async with session.get(f"{url}/trace") as resp:
                entry["trace"] += await resp.json()
        return [a.token_ids for a in answers]

    async with aiohttp.ClientSession() as session:
        for _name, url in [("single", single.url), *proxies]:
            for i in range(3):
                await complete(session, url, model, f"warm up {i}", max_tokens=4)
        for conc in [int(c) for c in args.concurrency.split(",")]:
            for _round in range(args.rounds):
                for variant in args.variants.split(","):
                    for server in (p, d):
                        cpus = server.cpus if variant == "pinned" else every
                        set_tree_affinity(server.process.pid, set(cpus), skip_workers=True)
                    for name, url in proxies:
                        # Fresh prompts for every batch: P and D are shared by both proxies and
                        # vLLM's prefix cache would serve a repeated prompt. The single instance
                        # answers the same prompts just before, for TTFT and token equality.
                        slot = [next(fresh) for _ in range(args.requests)]
                        ref = await batch(
                            f"single c{conc}",
                            "single",
                            single.url,
                            backends={"single": single},
                            slot=slot,
                            conc=conc,
                        )
                        key = f"{name} c{conc} {variant}"
                        got = await batch(
                            key, name, url, backends={"P": p, "D": d}, slot=slot, conc=conc
                        )
                        out[key]["same"] = out[key].get("same", True) and got == ref
    return out


def summarize(raw: dict) -> dict:
    rows = {}
    for key, e in raw.items():
        single = raw[f"single {key.split()[1]}"]
        row = {
            "ttft_p50_ms": round(statistics.median(e["ttft"]), 1),
            "ttft_mean_ms": round(statistics.mean(e["ttft"]), 1),
            "requests": len(e["ttft"]),
        }
        if not key.startswith("single"):
            row["vs_single"] = round(row["ttft_p50_ms"] / statistics.median(single["ttft"]), 2)
            row["same_tokens_as_single"] = e["same"]
            row["proxy_stage_p50_ms"] = {
                s: round(statistics.median(t[s] * 1000 for t in e["trace"] if s in t), 1)
                for s in STAGES
                if any(s in t for t in e["trace"])
            }
            row["new_connections"] = sum(t.get("new_conns", 0) for t in e["trace"])
            row["upstream_calls"] = 2 * len(e["trace"])
        vllm = e["vllm"]
        row["vllm_mean_ms"] = {
            k.removesuffix("_sum"): round(1000 * v / vllm[k.removesuffix("_sum") + "_count"], 1)
            for k, v in vllm.items()
            if k.endswith("_sum") and vllm.get(k.removesuffix("_sum") + "_count")
        }
        row["cpu_pct_of_a_core"] = {k: round(100 * v / e["wall_s"]) for k, v in e["cpu_s"].items()}
        rows[key] = row
    return rows


def run(args) -> int:
    from pd_serving.client import exact_length_prompt, load_tokenizer
    from pd_serving.deploy import Deployment, proxy_config_for
    from pd_serving.launcher import ManagedProcess, free_port, stop_all, wait_all_ready
    from pd_serving.model import cache_dir, default_model_dir, make_model
    from pd_serving.proxy import READY_LINE
    from pd_serving.servers import Connector, plan_servers

    model = make_model(default_model_dir("qwen2"))
    log_dir = cache_dir() / "logs" / f"ttft-stages-{time.strftime('%Y%m%d-%H%M%S')}"
    servers = plan_servers(model, log_dir=log_dir, connector=Connector.HYBRID, single=1)
    tokenizer = load_tokenizer(model)
    batches = len(args.concurrency.split(",")) * args.rounds * len(args.variants.split(",")) * 2
    n = args.requests * batches
    prompts = [exact_length_prompt(tokenizer, args.prompt_tokens, seed=7000 + i) for i in range(n)]
    config = proxy_config_for(servers, Connector.HYBRID)
    with Deployment(servers) as dep:
        dep.start(timeout=900)
        procs, proxies = [], []
        for dispatch in ("parallel", "sequential"):
            port = free_port()
            argv = [
                sys.executable,
                __file__,
                "--serve-proxy",
                "--port",
                str(port),
                "--connector",
                "hybrid",
                "--dispatch",
                dispatch,
                "--model-name",
                str(model),
                "--decode",
                config.decode[0].url,
                "--prefill",
                f"{config.prefill[0].url}@{config.prefill[0].rpc_address}",
                "--bypass-below-tokens",  # the stages of the path through P are measured
                "0",
            ]
            procs.append(
                ManagedProcess(
                    f"proxy-{dispatch}",
                    argv,
                    log_path=log_dir / f"proxy-{dispatch}.log",
                    ready_marker=READY_LINE,
                    health_url=f"http://127.0.0.1:{port}/health",
                )
            )
            proxies.append((dispatch, f"http://127.0.0.1:{port}"))
        try:
            for proc in procs:
                proc.start()
            wait_all_ready(procs, timeout=120)
            raw = asyncio.run(measure(args, dep, proxies, str(model), prompts))
        finally:
            stop_all(procs)
    (log_dir / "ttft_stages.raw.json").write_text(json.dumps(raw))  # kept should summarize fail
    args.json.parent.mkdir(parents=True, exist_ok=True)
    rows = summarize(raw)
    meta = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "load_average": os.getloadavg(),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
    }
    args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    for key, row in rows.items():
        print(
            f"{key:28s} TTFT p50 {row['ttft_p50_ms']:6.1f} ms  {row.get('vs_single', 1.0):.2f}x  "
            f"same={row.get('same_tokens_as_single', '-')}  vllm={row['vllm_mean_ms']}  "
            f"proxy={row.get('proxy_stage_p50_ms', '-')}  cpu={row['cpu_pct_of_a_core']}"
        )
    return 0 if all(r.get("same_tokens_as_single", True) for r in rows.values()) else 1


def smoke() -> int:
    """CI: the stage maths on made-up samples, starting nothing (psutil, for the CPU of each
    process tree, comes with vLLM, which this session does not install)."""
    entry = {
        "ttft": [90.0, 110.0],
        "same": True,
        "trace": [{stage: 0.001 * (i + 1) for i, stage in enumerate(STAGES)} | {"new_conns": 1}],
        "vllm": {"vllm:request_queue_time_seconds_sum": 0.02,
                 "vllm:request_queue_time_seconds_count": 2.0},
        "cpu_s": {"P": 0.5},
        "wall_s": 1.0,
    }  # fmt: skip
    single = entry | {"ttft": [50.0, 50.0], "trace": []}
    rows = summarize({"single c1": single, "sequential c1": entry})
    row = rows["sequential c1"]
    assert row["vs_single"] == 2.0, row
    assert row["proxy_stage_p50_ms"]["p_sent"] == 1.0, row
    assert row["vllm_mean_ms"]["vllm:request_queue_time_seconds"] == 10.0, row
    assert row["cpu_pct_of_a_core"] == {"P": 50}, row
    print("bench_ttft_stages smoke: ok")
    return 0


def main() -> int:
    if "--smoke" in sys.argv:
        return smoke()
    if "--serve-proxy" in sys.argv:
        return serve_traced_proxy([a for a in sys.argv[1:] if a != "--serve-proxy"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", type=int, default=8, help="per batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variants", default="pinned,unpinned")
    parser.add_argument("--json", type=Path, default=RESULTS / "ttft_stages.json")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
