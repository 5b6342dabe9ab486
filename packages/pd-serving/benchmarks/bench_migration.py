"""Downtime of a live migration: the extra gap a client sees at the switch, KV pull against
recompute.

1P2D HybridConnector; two proxies in this process in front of the same instances: one moves a
request by pulling its KV from the D it leaves (``kv``, pd-serving's live migration), the other
sends the same prompt + tokens to the new D without KV, which recomputes the whole context
(``recompute``). One streaming greedy request at a time: after ``--migrate-after`` tokens the
client asks ``POST /admin/migrate`` to move it off its D; ``--after-tokens`` more follow from the
other D. Per request, the gap between the last token before the switch and the first after it,
minus the median inter-token gap of the same request, is the switch's extra gap ("downtime").
Context lengths (``--contexts``: tokens at the switch) and rounds (the systems' order flips
every round) as given; the tokens of both systems are compared with each other.

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_migration.py

(JSON in ``benchmarks/results/migration.json``; ``--smoke`` runs it against stand-ins in
seconds, without vLLM: the harness and the table, numbers meaningless.)
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
# The smoke run's stand-in upstreams are the tests' (stand_ins.py there).
TESTS = Path(__file__).resolve().parents[1] / "tests"
SYSTEMS = ("kv", "recompute")


async def _start_proxy(prefill: Any, decodes: list[Any], model: str, pull_kv: bool):
    from pd_serving.launcher import free_port
    from pd_serving.proxy import PdProxy, ProxyConfig, serve
    from pd_serving.routing import Backend

    config = ProxyConfig(
        prefill=[Backend(prefill.url, rpc_address=prefill.rpc_address, name="p")],
        decode=[
            Backend(d.url, rpc_address=d.rpc_address, name=f"d{i}") for i, d in enumerate(decodes)
        ],
        model_names=[model],
        health=None,  # nothing fails here; keeps the two proxies identical
    )
    proxy = PdProxy(config)
    proxy.live.pull_kv = pull_kv
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    return f"http://127.0.0.1:{port}", proxy, runner


async def _one(session: Any, url: str, body: dict[str, Any], migrate_after: int) -> dict:
    """One streaming request moved after ``migrate_after`` tokens: token ids, arrival times,
    the admin endpoint's answer."""
    times: list[float] = []
    tokens: list[int] = []
    asked: asyncio.Task[Any] | None = None

    async def migrate() -> dict[str, Any]:
        async with session.get(f"{url}/health") as resp:
            health = await resp.json()
        busy = [d["name"] for d in health["decode"] if d["inflight"]]
        async with session.post(f"{url}/admin/migrate", params={"instance": busy[0]}) as resp:
            return await resp.json()

    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[5:])
            ids = [t for c in event.get("choices") or [] for t in c.get("token_ids") or []]
            if ids:
                now = time.perf_counter()
                tokens += ids
                times += [now] * len(ids)
            if asked is None and len(tokens) >= migrate_after:
                asked = asyncio.create_task(migrate())
    assert asked is not None
    answer = await asked
    return {"tokens": tokens, "times": times, "answer": answer["requests"]}


def _extra_gap_ms(sample: dict) -> float | None:
    [moved] = sample["answer"] or [{}]
    if moved.get("outcome") != "moved":
        return None
    at = moved["tokens_before"]  # index of the first token from the new D
    gaps = [b - a for a, b in zip(sample["times"], sample["times"][1:], strict=False)]
    switch = gaps[at - 1]
    usual = statistics.median(gaps[: at - 1] + gaps[at:])
    return (switch - usual) * 1000


async def measure(
    prefill: Any,
    decodes: list[Any],
    model: str,
    make_prompt: Callable[[int, int], Any],
    args: argparse.Namespace,
) -> dict:
    import aiohttp

    proxies = {
        "kv": await _start_proxy(prefill, decodes, model, pull_kv=True),
        "recompute": await _start_proxy(prefill, decodes, model, pull_kv=False),
    }
    samples: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in args.contexts} for s in SYSTEMS}
    try:
        async with aiohttp.ClientSession() as session:
            for round_ in range(args.rounds):
                order = SYSTEMS if round_ % 2 == 0 else SYSTEMS[::-1]
                for context in args.contexts:
                    prompt = make_prompt(context - args.migrate_after, 1000 * context + round_)
                    for system in order:
                        body = {
                            "model": model,
                            "prompt": prompt,
                            "max_tokens": args.migrate_after + args.after_tokens,
                            "temperature": 0.0,
                            "ignore_eos": True,
                            "return_token_ids": True,
                            "stream": True,
                        }
                        url = proxies[system][0]
                        sample = await _one(session, url, body, args.migrate_after)
                        samples[system][context].append(sample)
    finally:
        for _, proxy, runner in proxies.values():
            await proxy.drain_background()
            await runner.cleanup()
    return {"samples": samples}


def summarize(result: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    samples = result["samples"]
    for context in args.contexts:
        row: dict[str, Any] = {"context": context}
        for system in SYSTEMS:
            runs = samples[system][context]
            gaps = [g for g in map(_extra_gap_ms, runs) if g is not None]
            itl = [
                statistics.median(b - a for a, b in zip(r["times"], r["times"][1:], strict=False))
                for r in runs
            ]
            row[f"{system}_moved"] = len(gaps)
            row[f"{system}_extra_gap_ms"] = statistics.median(gaps) if gaps else None
            row[f"{system}_itl_ms"] = statistics.median(itl) * 1000 if itl else None
        same = [
            a["tokens"] == b["tokens"]
            for a, b in zip(samples["kv"][context], samples["recompute"][context], strict=True)
        ]
        row["same_tokens"] = f"{sum(same)}/{len(same)}"
        kv, re = row["kv_extra_gap_ms"], row["recompute_extra_gap_ms"]
        row["recompute_over_kv"] = re / kv if kv and re is not None and kv > 0 else None
        rows.append(row)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        f"Migration after {args.migrate_after} tokens, {args.after_tokens} after; "
        f"{args.rounds} rounds; medians.",
        "",
        "| context | kv: extra gap ms | recompute: extra gap ms | recompute / kv | ITL ms "
        "(kv / recompute) | moved (kv / recompute) | same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "-" if r["recompute_over_kv"] is None else f"{r['recompute_over_kv']:.2f}x"
        lines.append(
            f"| {r['context']} | {ms(r['kv_extra_gap_ms'])} | {ms(r['recompute_extra_gap_ms'])} "
            f"| {ratio} | {ms(r['kv_itl_ms'])} / {ms(r['recompute_itl_ms'])} "
            f"| {r['kv_moved']} / {r['recompute_moved']} | {r['same_tokens']} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="against stand-ins, in seconds")
    parser.add_argument(
        "--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 1792]
    )
    parser.add_argument("--migrate-after", type=int, default=64)
    parser.add_argument("--after-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=RESULTS / "migration.json")
    return parser


async def _smoke(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(TESTS))
    from pd_serving.routing import Backend
    from stand_ins import MODEL, FakeDecode, FakeUpstream, model_tokens

    p = FakeUpstream(
        "P",
        kv_params=lambda kv: {
            "do_remote_prefill": True,
            "transfer_id": kv["transfer_id"],
            "remote_rpc_address": "127.0.0.1:1",
        },
    )
    decodes = [FakeDecode(f"D{i}", token_delay_s=0.001) for i in range(2)]
    await p.start()
    for d in decodes:
        await d.start()
    try:
        result = await measure(
            Backend(p.url, rpc_address="127.0.0.1:1"),
            decodes,
            MODEL,
            lambda n, seed: [3 + (seed + i) % 400 for i in range(n)],
            args,
        )
    finally:
        await p.close()
        for d in decodes:
            await d.close()
    rows = summarize(result, args)
    print(markdown(rows, args))
    n = args.rounds
    assert all(r["kv_moved"] == n and r["recompute_moved"] == n for r in rows), rows
    assert all(r["same_tokens"] == f"{n}/{n}" for r in rows), rows
    sample = result["samples"]["kv"][args.contexts[0]][0]
    prompt_len = args.contexts[0] - args.migrate_after
    prompt = [3 + (1000 * args.contexts[0] + i) % 400 for i in range(prompt_len)]
    assert sample["tokens"] == model_tokens(prompt, args.migrate_after + args.after_tokens)
    print("bench_migration smoke: ok")
    return 0


def run(args: argparse.Namespace) -> int:
    from pd_serving.client import load_tokenizer
    from pd_serving.deploy import Deployment
    from pd_serving.model import default_model_dir, make_model
    from pd_serving.servers import Connector, Role, plan_servers

    model = make_model(default_model_dir("qwen2"), "qwen2")
    load_tokenizer(model)  # the model is complete before the servers start
    log_dir = Path("/tmp") / f"bench-migration-{int(time.time())}"
    servers = plan_servers(model, log_dir=log_dir, connector=Connector.HYBRID, decode=2)
    vocab = 400

    def make_prompt(n: int, seed: int) -> list[int]:
        return [3 + (seed * 7919 + i * 104729) % vocab for i in range(n)]

    with Deployment(servers) as deployment:
        deployment.start(timeout=600)
        prefill = deployment.by_role(Role.PREFILL)[0]
        decodes = deployment.by_role(Role.DECODE)
        started = time.time()
        result = asyncio.run(measure(prefill, decodes, str(model), make_prompt, args))
    rows = summarize(result, args)
    table = markdown(rows, args)
    print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "started": started,
                "rows": rows,
                "table": table,
            },
            indent=1,
        )
    )
    return 0


def main() -> int:
    args = _parser().parse_args()
    if args.smoke:
        args.contexts, args.migrate_after, args.after_tokens, args.rounds = [24, 40], 8, 6, 2
        return asyncio.run(_smoke(args))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
