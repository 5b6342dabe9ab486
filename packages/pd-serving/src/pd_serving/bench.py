"""``pdserve bench``: TTFT / TPOT of 1P1D against one vLLM instance, same model, same run.

Every system gets the same requests (fixed prompt length, distinct prompts so no prefix-cache
hits, greedy, ``ignore_eos``) at a fixed concurrency; the systems take turns in rounds (a quarter
of the prompts each), one at a time so they never compete for the CPU, and a burst of load from
elsewhere falls on all of them. ``--compare`` brings up single, HybridConnector 1P1D (measured
with both dispatch modes through two proxies on the same P/D pair, the second proxy with prompts
of its own, else it would hit the first one's in P's prefix cache) and NixlConnector 1P1D in one
run; ``--compare-transports`` brings up single and two HybridConnector 1P1D pairs, one forced
onto kvt's same-host path and one onto kvt's TCP path (``kvt_transport``), parallel dispatch.
``--rates`` is the load sweep (``pd_serving.sweep``): open-loop Poisson arrivals per rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from pd_serving.client import Completion, complete, exact_length_prompt, load_tokenizer
from pd_serving.deploy import Deployment, proxy_config_for
from pd_serving.launcher import ManagedProcess, free_port, stop_all, wait_all_ready
from pd_serving.model import cache_dir, default_model_dir, make_model
from pd_serving.proxy import READY_LINE, Dispatch
from pd_serving.servers import Connector, CpuSettings, Role, VllmServer, plan_servers
from pd_serving.sweep import (
    Slo,
    describe_max_rate,
    load_points,
    machine_load,
    max_rate_meeting_slo,
    percentile,
    regrade,
    render_sweep_table,
    sweep_markdown_table,
    sweep_payload,
    sweep_systems,
    write_plots,
)
from pd_serving.workload import parse_length_dist, plan_rate


@dataclass
class SystemResult:
    name: str
    requests: int
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_tokens_per_s: float
    wall_s: float
    # Greedy answers identical to the first system's (the single instance) for every prompt.
    same_tokens_as_single: bool | None = None
    ttft_p50_vs_single: float | None = None
    # PD only: mean round trip of the proxy's call to P (from the proxy's own histogram).
    prefill_call_mean_ms: float | None = None


def summarize(
    name: str,
    results: list[Completion],
    wall_s: float,
    *,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
) -> SystemResult:
    ttfts = [r.ttft_s * 1000 for r in results]
    tpots = [r.tpot_s * 1000 for r in results]
    out_tokens = sum(r.completion_tokens for r in results)
    return SystemResult(
        name=name,
        requests=len(results),
        concurrency=concurrency,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        output_tokens_per_s=out_tokens / wall_s if wall_s > 0 else 0.0,
        wall_s=wall_s,
    )


async def run_load(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompts: list[Any],
    *,
    concurrency: int,
    max_tokens: int,
) -> tuple[list[Completion], float]:
    """Every prompt once, ``concurrency`` in flight, streaming; returns answers and wall time."""
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt: Any) -> Completion:
        async with limit:
            return await complete(session, base_url, model, prompt, max_tokens=max_tokens)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - started


async def bench_systems(
    systems: list[tuple[str, str]],
    model: str,
    prompts: list[Any],
    *,
    concurrency: int,
    max_tokens: int,
    prompt_tokens: int,
    rounds: int = 4,
    warmup: int = 2,
    own_prompts: dict[str, list[Any]] | None = None,
    console: Console | None = None,
) -> list[SystemResult]:
    """Measure each (name, base_url); the first one is the reference for equality.

    The prompts are split into ``rounds`` slices and the systems take turns slice by slice, so a
    burst of load from elsewhere on the machine hits every system rather than one.
    ``own_prompts[name]`` (as many as ``prompts``) replaces the prompts of a system that shares
    its vLLM instances with another one (two proxies on one P/D pair), which would otherwise
    find the other's prompts in the prefix cache; the reference answers those sets too,
    unmeasured, for the token comparison.
    """
    own_prompts = own_prompts or {}
    prompts_of = {name: own_prompts.get(name, prompts) for name, _ in systems}
    answers: dict[str, list[Completion | None]] = {
        name: [None] * len(prompts) for name, _ in systems
    }
    walls = dict.fromkeys(answers, 0.0)
    p_calls: dict[str, list[float]] = {name: [0.0, 0.0] for name in answers}
    async with aiohttp.ClientSession() as session:
        for _name, url in systems:
            await run_load(
                session,
                url,
                model,
                [f"warm up {i}" for i in range(warmup)],
                concurrency=concurrency,
                max_tokens=4,
            )
        for r in range(rounds):
            indexes = list(range(r, len(prompts), rounds))
            for name, url in systems:
                if console:
                    console.print(f"  round {r + 1}/{rounds}: {name} ({len(indexes)} requests)")
                p_before = await _prefill_histogram(session, url)
                results, wall = await run_load(
                    session,
                    url,
                    model,
                    [prompts_of[name][i] for i in indexes],
                    concurrency=concurrency,
                    max_tokens=max_tokens,
                )
                p_after = await _prefill_histogram(session, url)
                if p_before and p_after:
                    p_calls[name][0] += p_after[0] - p_before[0]
                    p_calls[name][1] += p_after[1] - p_before[1]
                walls[name] += wall
                for i, result in zip(indexes, results, strict=True):
                    answers[name][i] = result
        reference_name, reference_url = systems[0]
        references: dict[str, list[Completion | None]] = {}
        for name in own_prompts:
            references[name], _ = await run_load(
                session,
                reference_url,
                model,
                own_prompts[name],
                concurrency=concurrency,
                max_tokens=max_tokens,
            )
    out: list[SystemResult] = []
    for name, _ in systems:
        reference = [a for a in references.get(name, answers[reference_name]) if a is not None]
        results = [a for a in answers[name] if a is not None]
        summary = summarize(
            name,
            results,
            walls[name],
            concurrency=concurrency,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )
        total, count = p_calls[name]
        if count:
            summary.prefill_call_mean_ms = 1000 * total / count
        if out:
            summary.same_tokens_as_single = all(
                a.token_ids == b.token_ids for a, b in zip(reference, results, strict=True)
            )
            summary.ttft_p50_vs_single = summary.ttft_p50_ms / out[0].ttft_p50_ms
        out.append(summary)
    return out


async def _prefill_histogram(
    session: aiohttp.ClientSession, url: str
) -> tuple[float, float] | None:
    """(sum, count) of the proxy's ``pdserve_prefill_seconds``; None when ``url`` is no proxy."""
    async with session.get(f"{url}/metrics") as resp:
        if resp.status != 200:
            return None
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line.startswith(("pdserve_prefill_seconds_sum ", "pdserve_prefill_seconds_count ")):
            name, value = line.split()
            values[name] = float(value)
    if len(values) != 2:
        return None
    return values["pdserve_prefill_seconds_sum"], values["pdserve_prefill_seconds_count"]


def render_table(results: list[SystemResult], title: str) -> Table:
    table = Table(title=title)
    table.add_column("system", no_wrap=True)
    for col in ("TTFT p50 ms", "TTFT p99 ms", "vs single", "TPOT p50 ms", "TPOT p99 ms"):
        table.add_column(col, justify="right")
    table.add_column("out tok/s", justify="right")
    table.add_column("P call ms", justify="right")
    table.add_column("same tokens")
    for r in results:
        table.add_row(
            r.name,
            f"{r.ttft_p50_ms:.0f}",
            f"{r.ttft_p99_ms:.0f}",
            "1.00x" if r.ttft_p50_vs_single is None else f"{r.ttft_p50_vs_single:.2f}x",
            f"{r.tpot_p50_ms:.1f}",
            f"{r.tpot_p99_ms:.1f}",
            f"{r.output_tokens_per_s:.0f}",
            "-" if r.prefill_call_mean_ms is None else f"{r.prefill_call_mean_ms:.0f}",
            "-" if r.same_tokens_as_single is None else str(r.same_tokens_as_single).lower(),
        )
    return table


def markdown_table(results: list[SystemResult]) -> str:
    lines = [
        "| system | TTFT p50 ms | TTFT p99 ms | TTFT p50 vs single | TPOT p50 ms | TPOT p99 ms "
        "| out tok/s | P call mean ms | same tokens as single |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = "1.00x" if r.ttft_p50_vs_single is None else f"{r.ttft_p50_vs_single:.2f}x"
        same = "-" if r.same_tokens_as_single is None else str(r.same_tokens_as_single).lower()
        p_call = "-" if r.prefill_call_mean_ms is None else f"{r.prefill_call_mean_ms:.0f}"
        lines.append(
            f"| {r.name} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {ratio} | "
            f"{r.tpot_p50_ms:.1f} | {r.tpot_p99_ms:.1f} | {r.output_tokens_per_s:.0f} | "
            f"{p_call} | {same} |"
        )
    return "\n".join(lines)


def write_json(path: Path, results: list[SystemResult], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


@dataclass
class PdPair:
    """One 1P1D pair of the bench: its connector, kvt transport (hybrid) and servers."""

    connector: Connector
    transport: str | None  # kv_connector_extra_config "kvt_transport"; None: the default
    servers: list[VllmServer]

    @property
    def label(self) -> str:
        return self.connector.value + (f" {self.transport}" if self.transport else "")

    @property
    def tag(self) -> str:
        return self.label.replace(" ", "-")


def plan_pairs(args: argparse.Namespace) -> list[tuple[Connector, str | None]]:
    """The 1P1D pairs a bench run measures: (connector, kvt transport)."""
    if getattr(args, "compare_transports", False):
        return [(Connector.HYBRID, "samehost"), (Connector.HYBRID, "tcp")]
    transport = getattr(args, "kvt_transport", None)
    if args.compare:
        return [(Connector.HYBRID, transport), (Connector.NIXL, None)]
    connector = Connector(args.connector)
    return [(connector, transport if connector is Connector.HYBRID else None)]


def _proxy_processes(
    pairs: list[PdPair],
    model: Path,
    *,
    args: argparse.Namespace,
    log_dir: Path,
) -> list[tuple[str, ManagedProcess, str, int]]:
    """One `pdserve proxy` process per PD pair and dispatch mode (hybrid: both modes): (name,
    process, URL, prompt set: 0 for the first proxy on a pair, 1 for the second, ...).

    Separate processes, as in a deployment: a proxy sharing the measuring client's event loop
    would delay both and blur TTFT/TPOT.
    """
    out = []
    for pair in pairs:
        connector = pair.connector
        dispatches = [Dispatch.SEQUENTIAL]
        if connector is Connector.HYBRID:
            dispatches = [Dispatch.SEQUENTIAL, Dispatch.PARALLEL]  # the default first
        if args.dispatch and not args.compare:
            dispatches = [Dispatch(args.dispatch)]
        elif getattr(args, "compare_transports", False):
            dispatches = [Dispatch.PARALLEL]  # the transports differ, not the dispatch
        elif getattr(args, "rates", None):
            dispatches = dispatches[:1]  # the sweep: each connector's default dispatch only
        config = proxy_config_for(pair.servers, connector)
        for dispatch in dispatches:
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "pd_serving.cli",
                "proxy",
                "--port",
                str(port),
                "--connector",
                connector.value,
                "--dispatch",
                dispatch.value,
                "--model-name",
                str(model),
                # The connectors are compared: every prompt goes through P and its transfer.
                "--bypass-below-tokens",
                "0",
            ]
            for b in config.prefill:
                argv += ["--prefill", f"{b.url}@{b.rpc_address}" if b.rpc_address else b.url]
            for b in config.decode:
                argv += ["--decode", b.url]
            name = f"1P1D {pair.label} ({dispatch.value})"
            prompt_set = dispatches.index(dispatch)  # one set per proxy on this P/D pair
            proc = ManagedProcess(
                f"proxy-{pair.tag}-{dispatch.value}",
                argv,
                log_path=log_dir / f"proxy-{pair.tag}-{dispatch.value}.log",
                ready_marker=READY_LINE,
                health_url=f"http://127.0.0.1:{port}/health",
            )
            out.append((name, proc, f"http://127.0.0.1:{port}", prompt_set))
    return out


def run_bench(args: argparse.Namespace) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=160)
    sweep = bool(getattr(args, "rates", None))
    if args.smoke:
        args.requests, args.prompt_tokens, args.max_tokens = 4, 32, 4
        if sweep:
            args.prompt_dist = args.output_dist = None
    arch = args.arch
    model = args.model.resolve() if args.model else make_model(default_model_dir(arch), arch)
    planned = plan_pairs(args)
    log_dir = args.log_dir or cache_dir() / "logs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    cpu = CpuSettings(
        kv_cache_bytes=args.kv_cache_mib * 1024 * 1024,
        max_model_len=args.max_model_len,
        arch=arch,
    )
    pairs: list[PdPair] = []
    for connector, transport in planned:
        extra = {} if transport is None else {"kvt_transport": transport}
        pair = PdPair(
            connector,
            transport,
            plan_servers(
                model, log_dir=log_dir, connector=connector, cpu=cpu, extra_connector_config=extra
            ),
        )
        for server in pair.servers:
            server.name = f"{pair.tag}-{server.name}"
        pairs.append(pair)
    servers = [s for pair in pairs for s in pair.servers]
    servers += plan_servers(
        model, log_dir=log_dir, connector=planned[0][0], prefill=0, decode=0, single=1, cpu=cpu
    )
    tokenizer = load_tokenizer(model)
    if sweep:
        plans = _plan_sweep(args, tokenizer)
    else:
        prompt_sets = [
            [
                exact_length_prompt(tokenizer, args.prompt_tokens, seed=1000 + 100_000 * k + i)
                for i in range(args.requests)
            ]
            for k in range(2)  # at most two proxies (dispatch modes) share a P/D pair
        ]
    console.print(
        f"[bold]pdserve bench[/bold]: {len(servers)} vLLM instances "
        f"({', '.join(p.label for p in pairs)} + single); logs in {log_dir}"
    )
    load_before = machine_load()
    with Deployment(servers) as deployment:
        with console.status("starting vLLM instances (1-3 min each, in parallel)"):
            deployment.start(timeout=args.startup_timeout)
        proxies = _proxy_processes(pairs, model, args=args, log_dir=log_dir)
        try:
            for _, proc, _, _ in proxies:
                proc.start()
            wait_all_ready([proc for _, proc, _, _ in proxies], timeout=120)
            systems = [("single", deployment.by_role(Role.SINGLE)[0].url)]
            systems += [(name, url) for name, _, url, _ in proxies]
            if sweep:
                points = asyncio.run(
                    sweep_systems(
                        systems,
                        str(model),
                        plans,
                        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms),
                        rounds=args.rounds,
                        timeout_s=args.request_timeout,
                        prefill_probe=_prefill_histogram,
                        console=console,
                    )
                )
            else:
                own = {name: prompt_sets[k] for name, _, _, k in proxies if k}
                results = asyncio.run(
                    bench_systems(
                        systems,
                        str(model),
                        prompt_sets[0],
                        own_prompts=own,
                        concurrency=args.concurrency,
                        max_tokens=args.max_tokens,
                        prompt_tokens=args.prompt_tokens,
                        console=console,
                    )
                )
        finally:
            stop_all([proc for _, proc, _, _ in proxies])
    meta = {
        "command": "pdserve bench "
        + (
            "--compare-transports"
            if args.compare_transports
            else "--compare"
            if args.compare
            else args.connector
        ),
        "pairs": [p.label for p in pairs],
        "model": f"tiny {arch} (hybrid_connector.tiny_model.make_tiny_model)",
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if sweep:
        meta["machine_load"] = {"before": load_before, "after": machine_load()}
        return report_sweep(args, points, meta, console)
    title = (
        f"TTFT/TPOT, {args.requests} requests x {args.prompt_tokens} prompt tokens -> "
        f"{args.max_tokens} tokens, concurrency {args.concurrency}"
    )
    console.print(render_table(results, title))
    console.print(markdown_table(results), markup=False, highlight=False)
    if args.json:
        write_json(args.json, results, meta)
        console.print(f"wrote {args.json}")
    same = all(r.same_tokens_as_single is not False for r in results)
    return 0 if same else 1


def _length_dists(args: argparse.Namespace):
    prompt = args.prompt_dist or parse_length_dist(str(args.prompt_tokens))
    output = args.output_dist or parse_length_dist(str(args.max_tokens))
    return prompt, output


def _plan_sweep(args: argparse.Namespace, tokenizer) -> dict[float, list]:
    """Each rate's requests, with prompts distinct across rates and requests (no prefix hits)."""
    prompt_dist, output_dist = _length_dists(args)
    plans = {}
    for k, rate in enumerate(args.rates):
        plan = plan_rate(
            rate,
            args.requests,
            prompt_dist=prompt_dist,
            output_dist=output_dist,
            seed=args.seed,
            max_model_len=args.max_model_len,
        )
        for req in plan:
            prompt_seed = 1_000_000 * (args.seed + 1) + 10_000 * k + req.index
            req.prompt = exact_length_prompt(tokenizer, req.prompt_tokens, seed=prompt_seed)
        plans[rate] = plan
    return plans


def report_sweep(args: argparse.Namespace, points: list, meta: dict[str, Any], console) -> int:
    """Tables, the SLO-max-rate lines, and with ``--json`` the JSON and its plots; exit code."""
    prompt_dist, output_dist = _length_dists(args)
    meta |= {
        "rates": args.rates,
        "requests_per_rate": args.requests,
        "prompt_dist": str(prompt_dist),
        "output_dist": str(output_dist),
        "seed": args.seed,
        "rounds": args.rounds,
        "request_timeout_s": args.request_timeout,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
    }
    publish_sweep(points, meta, args.json, console)
    same = all(p.same_tokens_as_single is not False for p in points)
    return 0 if same else 1


def replot_sweep(path: Path, slo: Slo, console) -> None:
    """A stored sweep judged against ``slo``: goodput from its per-request samples, the tables,
    the SLO-max-rate lines, the JSON and its plots written again. Starts nothing."""
    payload = json.loads(path.read_text())
    points = [regrade(p, slo) for p in load_points(payload)]
    meta = payload["meta"] | {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}}
    publish_sweep(points, meta, path, console)


def publish_sweep(points: list, meta: dict[str, Any], path: Path | None, console) -> None:
    slo = Slo(meta["slo"]["ttft_ms"], meta["slo"]["tpot_ms"])
    systems = list(dict.fromkeys(p.system for p in points))
    max_rates = {s: max_rate_meeting_slo(points, s, slo.ttft_ms) for s in systems}
    lengths = f"prompt {meta['prompt_dist']} -> {meta['output_dist']}"
    title = f"load sweep, {meta['requests_per_rate']} Poisson requests per rate, {lengths} tokens"
    console.print(render_sweep_table(points, title))
    console.print(sweep_markdown_table(points), markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"highest rate meeting TTFT p99 <= {slo.ttft_ms:g} ms with no failures, at every "
        "rate up to it:"
    )
    for system, result in max_rates.items():
        console.print(f"  {system}: {describe_max_rate(result, slo.ttft_ms)}", highlight=False)
    meta["max_rate_meeting_ttft_p99_slo"] = {
        s: {"rate": rate, "highest_swept": at_top} for s, (rate, at_top) in max_rates.items()
    }
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sweep_payload(points, meta), indent=1) + "\n")
        plot_title = f"{' vs '.join(systems)}, {lengths}"
        for written in [path, *write_plots(points, path.with_suffix(""), slo, plot_title)]:
            console.print(f"wrote {written}")
