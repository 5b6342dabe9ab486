"""TTFT of short prompts and of follow-up turns with bypass on against off, 1P1D HybridConnector.

One P/D pair; two proxies in this process in front of it, one with ``--bypass-below-tokens 0``
(off: every request through P) and one with bypass on (``--bypass-below-tokens N``: short prompts
go to D alone, and so do follow-ups whose uncached tail on the D that served their history is
short). Scenarios:

- ``short``: fresh prompts of ``--short-tokens`` tokens (no prefix-cache hits anywhere).
- ``follow-up``: a ``--history-tokens`` prompt is served first (unmeasured), then it plus a
  ``--tail-tokens`` tail is the measured request (a chat's next turn): off, P finds the history
  in its prefix cache and the KV goes to D again; on, D serves it from its own prefix cache.
- ``long``: fresh ``--history-tokens`` prompts: the control, the same path both ways.

The two systems take turns batch by batch (the order flips every round), each with prompts of its
own, one request at a time (streaming, greedy, ``ignore_eos``).

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_bypass.py

(JSON in ``benchmarks/results/bypass_ttft.json``; ``--smoke`` runs it against stand-ins in
seconds, without vLLM.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# The smoke run's stand-in upstreams are the tests' (stand_ins.py there).
TESTS = Path(__file__).resolve().parents[1] / "tests"
SYSTEMS = ("bypass off", "bypass on")
SCENARIOS = ("short", "follow-up", "long")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _start_proxy(prefill, decode, model: str, bypass_below: int):
    from pd_serving.launcher import free_port
    from pd_serving.proxy import PdProxy, ProxyConfig, serve
    from pd_serving.routing import Backend, RoutingPolicy

    config = ProxyConfig(
        prefill=[Backend(prefill.url, rpc_address=prefill.rpc_address, name="p")],
        decode=[Backend(decode.url, name="d")],
        model_names=[model],
        routing=RoutingPolicy(bypass_below_tokens=bypass_below),
        health=None,  # one pair, nothing to fail over to; keeps the two proxies identical
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    return f"http://127.0.0.1:{port}", proxy, runner


async def measure(
    prefill,
    decode,
    model: str,
    make_prompt: Callable[[int, int], str],
    args: argparse.Namespace,
) -> dict:
    """Runs every scenario on both proxies; returns TTFT samples (ms) and the bypass counts."""
    import aiohttp
    from pd_serving.client import complete

    proxies = {
        "bypass off": await _start_proxy(prefill, decode, model, 0),
        "bypass on": await _start_proxy(prefill, decode, model, args.bypass_below_tokens),
    }
    ttft: dict[str, dict[str, list[float]]] = {s: {c: [] for c in SCENARIOS} for s in SYSTEMS}
    seeds = iter(range(10_000, 10**9))
    try:
        async with aiohttp.ClientSession() as session:

            async def one(url: str, prompt: str) -> float:
                out = await complete(session, url, model, prompt, max_tokens=args.max_tokens)
                return out.ttft_s * 1000

            # Warm-up: the first requests of a fresh vLLM are slow (compilation, allocation).
            for url, _, _ in proxies.values():
                for tokens in (args.short_tokens, args.history_tokens):
                    await one(url, make_prompt(tokens, next(seeds)))
            for rnd in range(args.rounds):
                order = SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    url = proxies[system][0]
                    for _ in range(args.requests):
                        short = make_prompt(args.short_tokens, next(seeds))
                        ttft[system]["short"].append(await one(url, short))
                        history = make_prompt(args.history_tokens, next(seeds))
                        await one(url, history)  # the earlier turn, unmeasured
                        tail = make_prompt(args.tail_tokens, next(seeds))
                        ttft[system]["follow-up"].append(await one(url, history + tail))
                        long = make_prompt(args.history_tokens, next(seeds))
                        ttft[system]["long"].append(await one(url, long))
        bypassed = {}
        for system, (_, proxy, _) in proxies.items():
            samples = proxy.metrics.bypasses.collect()[0].samples
            bypassed[system] = {
                s.labels["reason"]: int(s.value) for s in samples if s.name.endswith("_total")
            }
    finally:
        for _, _, runner in proxies.values():
            await runner.cleanup()
    return {"ttft_ms": ttft, "bypassed": bypassed}


def summarize(result: dict) -> list[dict]:
    rows = []
    for scenario in SCENARIOS:
        off = result["ttft_ms"]["bypass off"][scenario]
        on = result["ttft_ms"]["bypass on"][scenario]
        if not off or not on:
            continue
        rows.append(
            {
                "scenario": scenario,
                "requests": len(on),
                "off_p50": statistics.median(off),
                "off_p99": _pct(off, 0.99),
                "on_p50": statistics.median(on),
                "on_p99": _pct(on, 0.99),
                "on_vs_off_p50": statistics.median(on) / statistics.median(off),
            }
        )
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "| scenario | requests each | TTFT p50 off ms | TTFT p50 on ms | on / off p50 "
        "| TTFT p99 off ms | TTFT p99 on ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    what = {
        "short": f"short prompt ({args.short_tokens} tok)",
        "follow-up": f"follow-up ({args.history_tokens} + {args.tail_tokens} tok)",
        "long": f"long prompt ({args.history_tokens} tok, control)",
    }
    for r in rows:
        lines.append(
            f"| {what[r['scenario']]} | {r['requests']} | {r['off_p50']:.0f} | {r['on_p50']:.0f} "
            f"| {r['on_vs_off_p50']:.2f}x | {r['off_p99']:.0f} | {r['on_p99']:.0f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="against stand-ins, in seconds")
    parser.add_argument("--bypass-below-tokens", type=int, default=64, help="estimated tokens")
    parser.add_argument("--short-tokens", type=int, default=24)
    parser.add_argument("--history-tokens", type=int, default=300)
    parser.add_argument("--tail-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8, help="per system, batch and scenario")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, default=RESULTS / "bypass_ttft.json")
    return parser


async def _smoke(args: argparse.Namespace) -> int:
    from pd_serving.routing import Backend

    sys.path.insert(0, str(TESTS))
    from stand_ins import MODEL, FakeUpstream

    p, d = FakeUpstream("P", kv_params={}), FakeUpstream("D")
    await p.start()
    await d.start()
    try:

        def make_prompt(tokens: int, seed: int) -> str:
            rng = random.Random(seed)
            return "".join(rng.choice("abcdefgh ") for _ in range(tokens * 4))

        result = await measure(
            Backend(p.url, rpc_address="127.0.0.1:1"), Backend(d.url), MODEL, make_prompt, args
        )
    finally:
        await p.close()
        await d.close()
    rows = summarize(result)
    print(markdown(rows, args))
    n = args.rounds * args.requests
    assert [r["requests"] for r in rows] == [n, n, n], rows
    assert result["bypassed"]["bypass off"] == {}, result["bypassed"]
    assert result["bypassed"]["bypass on"] == {"short_prompt": n + 1, "prefix_cached": n}
    print("bench_bypass smoke: ok")
    return 0


def run(args: argparse.Namespace) -> int:
    from pd_serving.client import exact_length_prompt, load_tokenizer
    from pd_serving.deploy import Deployment
    from pd_serving.model import default_model_dir, make_model
    from pd_serving.servers import Connector, Role, plan_servers

    model = make_model(default_model_dir("qwen2"), "qwen2")
    tokenizer = load_tokenizer(model)
    log_dir = Path("/tmp") / f"bench-bypass-{int(time.time())}"
    servers = plan_servers(model, log_dir=log_dir, connector=Connector.HYBRID)
    with Deployment(servers) as deployment:
        deployment.start(timeout=600)
        prefill = deployment.by_role(Role.PREFILL)[0]
        decode = deployment.by_role(Role.DECODE)[0]
        started = time.time()
        result = asyncio.run(
            measure(
                prefill,
                decode,
                str(model),
                lambda n, seed: exact_length_prompt(tokenizer, n, seed=seed),
                args,
            )
        )
    rows = summarize(result)
    table = markdown(rows, args)
    print(table)
    print("bypassed:", result["bypassed"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "started": started,
                "rows": rows,
                "table": table,
                **result,
            },
            indent=1,
        )
    )
    return 0


def main() -> int:
    args = _parser().parse_args()
    if args.smoke:
        args.requests, args.rounds = 2, 2
        return asyncio.run(_smoke(args))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
