"""Time to drain one D with streams in flight: migrating them against waiting for them to end.

1P2D HybridConnector behind an in-process proxy. ``--requests`` streaming greedy requests run on
one D (the other D drains while they are routed, then comes back); once every client has
``--drain-after`` tokens, that D drains (``POST /admin/drain``). ``migrate``: its streams move to
the other D (at most ``--concurrency`` at once); ``wait``: the other D drains too, so nothing
can move and the drain lasts until the requests end by themselves (what a drain without live
migration costs). Per system: the time from the drain's start to drained (the proxy's report),
how many moved, and whether every client's tokens equal the other system's. Median of
``--rounds``; the systems' order flips every round.

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_drain.py

(JSON in ``benchmarks/results/drain.json``; ``--smoke`` runs it against stand-ins in seconds,
without vLLM: the harness and the table, numbers meaningless.)
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
SYSTEMS = ("migrate", "wait")


async def _round(
    url: str, model: str, prompts: list[Any], system: str, args: argparse.Namespace, *, salt: int
) -> dict[str, Any]:
    import aiohttp

    counts = [0] * len(prompts)
    enough = asyncio.Event()

    async def admin(session: Any, path: str, **query: str) -> list[dict[str, Any]]:
        async with session.post(f"{url}/admin/{path}", params=query) as resp:
            assert resp.status == 200, await resp.text()
            return [json.loads(line) for line in (await resp.text()).splitlines()]

    margins: list[list[float]] = [[] for _ in prompts]

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
            "cache_salt": f"{system}-{salt}",  # each system's own prefix caches
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
                counts[i] = len(tokens)
                if min(counts) >= args.drain_after:
                    enough.set()
        return tokens

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await admin(session, "drain", instance="d1")
        clients = [asyncio.create_task(client(session, i)) for i in range(len(prompts))]
        await enough.wait()
        if system == "migrate":
            await admin(session, "undrain", instance="d1")
        started = time.perf_counter()
        reports = await admin(
            session, "drain", instance="d0", wait="300", concurrency=str(args.concurrency)
        )
        wall = time.perf_counter() - started
        outputs = await asyncio.gather(*clients)
        for name in ("d0", "d1"):
            await admin(session, "undrain", instance=name)
    final = reports[-1]
    assert final["phase"] == "drained", final
    assert final["failed"] == 0, final
    return {"drained_s": final["elapsed_s"], "wall_s": wall, "moved": final["moved"],
            "tokens": outputs, "margins": margins}  # fmt: skip


async def measure(
    prefill: Any, decodes: list[Any], model: str, make_prompt: Callable, args: argparse.Namespace
) -> dict[str, Any]:
    from pd_serving.launcher import free_port
    from pd_serving.proxy import PdProxy, ProxyConfig, serve
    from pd_serving.routing import Backend

    config = ProxyConfig(
        prefill=[Backend(prefill.url, rpc_address=prefill.rpc_address, name="p")],
        decode=[
            Backend(d.url, rpc_address=d.rpc_address, name=f"d{i}") for i, d in enumerate(decodes)
        ],
        model_names=[model],
        health=None,
    )
    proxy = PdProxy(config)
    proxy.live.precopy = args.precopy
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    samples: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    try:
        for r in range(args.rounds):
            prompts = [make_prompt(args.prompt_tokens, 100 * r + i) for i in range(args.requests)]
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                samples[system].append(await _round(url, model, prompts, system, args, salt=r))
    finally:
        await runner.cleanup()
    return {"samples": samples}


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    s = result["samples"]
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(s["migrate"], s["wait"], strict=True))
    row = {
        "requests": args.requests,
        "migrate_drained_s": statistics.median(x["drained_s"] for x in s["migrate"]),
        "wait_drained_s": statistics.median(x["drained_s"] for x in s["wait"]),
        "moved": statistics.median(x["moved"] for x in s["migrate"]),
        "same_tokens": f"{same}/{args.rounds}",
        # requests whose tokens differ between the systems, over all rounds: (round, index,
        # first differing token, the top-1 minus top-2 logprob there, the smaller of the two
        # systems': a near-tie when small)
        "differing": [
            (r, i, k, _margin_at(k, m["margins"][i], w["margins"][i]))
            for r, (m, w) in enumerate(zip(s["migrate"], s["wait"], strict=True))
            for i, (a, b) in enumerate(zip(m["tokens"], w["tokens"], strict=True))
            if a != b
            for k in [next(k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)]
        ],
    }
    row["wait_over_migrate"] = row["wait_drained_s"] / max(row["migrate_drained_s"], 1e-9)
    return row


def _margin_at(k: int, *margins: list[float]) -> float | None:
    """The smallest top-1 minus top-2 logprob at token ``k`` of the given runs (None: none)."""
    found = [m[k] for m in margins if k < len(m)]
    return round(min(found), 4) if found else None


def markdown(row: dict[str, Any]) -> str:
    return "\n".join([
        "| requests in flight | drained, migrating | drained, waiting | wait / migrate "
        "| moved | same tokens |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {row['requests']} | {row['migrate_drained_s']:.2f} s | {row['wait_drained_s']:.2f} s "
        f"| {row['wait_over_migrate']:.1f}x | {row['moved']:g} | {row['same_tokens']} |",
    ])  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="against stand-ins, in seconds")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--drain-after", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--arch",
        default="qwen2",
        help="the random-weight model (qwen2-wide: decode slow enough that waiting costs)",
    )
    parser.add_argument(
        "--precopy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="migrations pre-copy (the proxy's default) or stop and copy",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "drain.json")
    return parser


async def _smoke(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(TESTS))
    from stand_ins import MODEL, fake_1p2d, model_tokens, smoke_prompt

    async with fake_1p2d(token_delay_s=0.002) as (prefill, decodes):
        result = await measure(prefill, decodes, MODEL, smoke_prompt, args)
    row = summarize(result, args)
    print(markdown(row))
    assert row["same_tokens"] == f"{args.rounds}/{args.rounds}", row
    assert row["moved"] == args.requests, row
    first = result["samples"]["migrate"][0]["tokens"][0]
    assert first == model_tokens(smoke_prompt(args.prompt_tokens, 0), args.max_tokens)
    print("bench_drain smoke: ok")
    return 0


def run(args: argparse.Namespace) -> int:
    from pd_serving.client import load_tokenizer
    from pd_serving.deploy import Deployment
    from pd_serving.model import default_model_dir, make_model
    from pd_serving.servers import Connector, CpuSettings, Role, plan_servers

    model = make_model(default_model_dir(args.arch), args.arch)
    load_tokenizer(model)
    log_dir = Path("/tmp") / f"bench-drain-{int(time.time())}"
    longest = args.prompt_tokens + args.max_tokens + 64
    # Room on one D for every request at its longest (the wide model: 2 KiB a token).
    cpu = CpuSettings(kv_cache_bytes=max(64 << 20, 2 * args.requests * longest * 2048))
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
        args.prompt_tokens, args.max_tokens, args.drain_after, args.rounds = 8, 60, 5, 2
        return asyncio.run(_smoke(args))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
