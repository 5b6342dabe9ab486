"""Rebalancing on real vLLM: a hot D sheds streams to the other before it would preempt.

1P2D HybridConnector on the tiny model, each D with a small KV cache (``--kv-tokens``).
``--requests`` streaming greedy requests all start on d0 (d1 takes nothing new until each has
its first token), each growing to ``--prompt-tokens`` + ``--max-tokens``: together more than
d0's cache holds, so d0 alone runs out of blocks and preempts (vLLM frees a running request's
blocks and computes it again later). Two proxies in this process in front of the same
instances, both scraping every instance each ``--health-interval-s``: ``rebalance`` runs the
rebalancer (``triggers.Rebalancer``: after each scrape, a D whose KV usage is ``--kv-gap`` above
the other's gives it one stream, live-migrated with its KV); ``off`` does not. Per system and
round: d0's preemptions (``vllm:num_preemptions``), the streams the rebalancer moved, d0's and
d1's peak KV usage as the proxy scraped it, the time until every stream ended, and whether
every client's tokens equal the other system's. The systems' order flips every round.

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_rebalance.py

(JSON in ``benchmarks/results/rebalance.json``; ``--smoke`` runs it against stand-ins in
seconds, without vLLM: the harness, numbers meaningless.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
TESTS = Path(__file__).resolve().parents[1] / "tests"  # the smoke run's stand-ins
SYSTEMS = ("rebalance", "off")
# KV bytes per token of the tiny qwen2: 2 layers * (k, v) * 2 KV heads * 32 dims * bf16.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 2


async def _preemptions(session: Any, url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:num_preemptions_total"
    )


async def _round(
    proxy: Any, url: str, prompts: list[Any], args: Any, *, d0_url: str, model: str, salt: str
) -> dict[str, Any]:
    import aiohttp

    first = [asyncio.Event() for _ in prompts]
    margins: list[list[float]] = [[] for _ in prompts]
    d0, d1 = (b.key for b in proxy.config.decode)
    registry = proxy.metrics.registry

    def moved() -> float:
        value = registry.get_sample_value(
            "pdserve_rebalance_migrations_total", {"outcome": "moved"}
        )
        return value or 0.0

    async def client(session: Any, i: int) -> list[int]:
        body = {
            "model": model,
            "prompt": prompts[i],
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "logprobs": 2,  # where the systems' tokens part: the margin there (a near-tie?)
            "cache_salt": salt,  # each system's own prefix caches
        }
        tokens: list[int] = []
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[5:])
                assert "error" not in event, event
                for choice in event.get("choices") or []:
                    tokens += choice.get("token_ids") or []
                    for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                        best = [*sorted((top or {}).values(), reverse=True), float("-inf")]
                        margins[i].append(best[0] - best[1])
                first[i].set()
        return tokens

    peak = {d0: 0.0, d1: 0.0}
    done = asyncio.Event()

    async def watch() -> None:  # the proxy's own scrapes, after each health round
        assert proxy.health is not None
        while not done.is_set():
            await proxy.health.round_done.wait()
            for backend in proxy.config.decode:
                peak[backend.key] = max(peak[backend.key], backend.load.kv_usage)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await _preemptions(session, d0_url)
        moved_before = moved()
        watcher = asyncio.create_task(watch())
        proxy.router.draining.add(d1)  # every request starts on d0
        started = time.perf_counter()
        clients = [asyncio.create_task(client(session, i)) for i in range(len(prompts))]
        await asyncio.gather(*(e.wait() for e in first))
        proxy.router.draining.discard(d1)
        outputs = await asyncio.gather(*clients)
        wall = time.perf_counter() - started
        done.set()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        preempted = await _preemptions(session, d0_url) - before
    return {
        "preemptions": preempted,
        "moved": moved() - moved_before,
        "peak_kv": {k: round(v, 3) for k, v in peak.items()},
        "wall_s": wall,
        "tokens": outputs,
        "margins": margins,
    }


async def _start_proxy(prefill: Any, decodes: list[Any], model: str, rebalance: bool, args: Any):
    from pd_serving.health import HealthCheckConfig
    from pd_serving.launcher import free_port
    from pd_serving.proxy import PdProxy, ProxyConfig, serve
    from pd_serving.rebalance import RebalanceConfig
    from pd_serving.routing import Backend

    config = ProxyConfig(
        prefill=[Backend(prefill.url, rpc_address=prefill.rpc_address, name="p")],
        decode=[
            Backend(d.url, rpc_address=d.rpc_address, name=f"d{i}") for i, d in enumerate(decodes)
        ],
        model_names=[model],
        health=HealthCheckConfig(interval_s=args.health_interval_s),
        rebalance=RebalanceConfig(
            kv_gap=args.kv_gap,
            max_per_interval=args.max_per_interval,
            interval_s=args.interval_s,
            cooldown_s=args.cooldown_s,
        )
        if rebalance
        else None,
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    return proxy, runner, f"http://127.0.0.1:{port}"


async def measure(
    prefill: Any, decodes: list[Any], model: str, make_prompt: Callable, args: argparse.Namespace
) -> dict[str, Any]:
    proxies = {
        s: await _start_proxy(prefill, decodes, model, s == "rebalance", args) for s in SYSTEMS
    }
    samples: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    try:
        for r in range(args.rounds):
            prompts = [make_prompt(args.prompt_tokens, 100 * r + i) for i in range(args.requests)]
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                proxy, _, url = proxies[system]
                samples[system].append(
                    await _round(
                        proxy,
                        url,
                        prompts,
                        args,
                        d0_url=decodes[0].url,
                        model=model,
                        salt=f"{system}-{r}",
                    )
                )
    finally:
        for proxy, runner, _ in proxies.values():
            await proxy.drain_background()
            await runner.cleanup()
    return {"samples": samples}


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    s = result["samples"]
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(s["rebalance"], s["off"], strict=True))
    row: dict[str, Any] = {"requests": args.requests, "same_tokens": f"{same}/{args.rounds}"}
    # Requests whose tokens differ between the systems: (round, index, first differing token,
    # the top-1 minus top-2 logprob there, the smaller of the two systems': a near-tie if small).
    row["differing"] = [
        (r, i, k, _margin_at(k, a["margins"][i], b["margins"][i]))
        for r, (a, b) in enumerate(zip(s["rebalance"], s["off"], strict=True))
        for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True))
        if x != y
        for k in [next(k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)]
    ]
    for system in SYSTEMS:
        runs = s[system]
        row[f"{system}_preemptions"] = [r["preemptions"] for r in runs]
        row[f"{system}_moved"] = [r["moved"] for r in runs]
        row[f"{system}_peak_kv_d0"] = statistics.median(r["peak_kv"]["d0"] for r in runs)
        row[f"{system}_peak_kv_d1"] = statistics.median(r["peak_kv"]["d1"] for r in runs)
        row[f"{system}_wall_s"] = statistics.median(r["wall_s"] for r in runs)
    return row


def _margin_at(k: int, *margins: list[float]) -> float | None:
    """The smallest top-1 minus top-2 logprob at token ``k`` of the given runs (None: none)."""
    found = [m[k] for m in margins if k < len(m)]
    return round(min(found), 4) if found else None


def markdown(row: dict[str, Any]) -> str:
    lines = [
        "| system | d0 preemptions (per round) | streams moved | peak KV d0 / d1 | all ended |",
        "|---|---:|---:|---:|---:|",
    ]
    for system in SYSTEMS:
        lines.append(
            f"| {system} | {', '.join(f'{x:g}' for x in row[f'{system}_preemptions'])} "
            f"| {', '.join(f'{x:g}' for x in row[f'{system}_moved'])} "
            f"| {row[f'{system}_peak_kv_d0']:.2f} / {row[f'{system}_peak_kv_d1']:.2f} "
            f"| {row[f'{system}_wall_s']:.2f} s |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="against stand-ins, in seconds")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--kv-tokens", type=int, default=3072, help="each instance's KV cache")
    parser.add_argument("--health-interval-s", type=float, default=0.2)
    parser.add_argument("--kv-gap", type=float, default=0.25)
    parser.add_argument("--max-per-interval", type=int, default=4)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--cooldown-s", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS / "rebalance.json")
    return parser


async def _smoke(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(TESTS))
    from stand_ins import MODEL, fake_1p2d, model_tokens, smoke_prompt

    async with fake_1p2d(token_delay_s=0.01, kv_capacity=args.kv_tokens) as (prefill, decodes):
        result = await measure(prefill, decodes, MODEL, smoke_prompt, args)
    row = summarize(result, args)
    print(markdown(row))
    assert row["same_tokens"] == f"{args.rounds}/{args.rounds}", row
    assert all(m > 0 for m in row["rebalance_moved"]), row
    assert row["off_moved"] == [0] * args.rounds, row
    first = result["samples"]["rebalance"][0]["tokens"][0]
    assert first == model_tokens(smoke_prompt(args.prompt_tokens, 0), args.max_tokens)
    print("bench_rebalance smoke: ok")
    return 0


def run(args: argparse.Namespace) -> int:
    from pd_serving.client import load_tokenizer
    from pd_serving.deploy import Deployment
    from pd_serving.model import default_model_dir, make_model
    from pd_serving.servers import Connector, CpuSettings, Role, plan_servers

    model = make_model(default_model_dir("qwen2"), "qwen2")
    load_tokenizer(model)
    log_dir = Path("/tmp") / f"bench-rebalance-{int(time.time())}"
    cpu = CpuSettings(
        kv_cache_bytes=args.kv_tokens * TINY_KV_BYTES_PER_TOKEN,
        max_model_len=args.prompt_tokens + args.max_tokens + 64,
    )
    servers = plan_servers(model, log_dir=log_dir, connector=Connector.HYBRID, decode=2, cpu=cpu)

    def make_prompt(n: int, seed: int) -> list[int]:
        return [3 + (seed * 7919 + i * 104729) % 400 for i in range(n)]

    with Deployment(servers) as deployment:
        deployment.start(timeout=600)
        prefill = deployment.by_role(Role.PREFILL)[0]
        decodes = deployment.by_role(Role.DECODE)
        started = time.time()
        result = asyncio.run(measure(prefill, decodes, str(model), make_prompt, args))
    row = summarize(result, args)
    table = markdown(row)
    print(table)
    print(json.dumps(row))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "started": started,
             "row": row, "table": table},
            indent=1,
        )
    )  # fmt: skip
    return 0


def main() -> int:
    args = _parser().parse_args()
    if args.smoke:
        args.requests, args.prompt_tokens, args.max_tokens, args.rounds = 4, 8, 60, 2
        args.kv_tokens, args.health_interval_s, args.cooldown_s = 200, 0.05, 0.05
        return asyncio.run(_smoke(args))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
