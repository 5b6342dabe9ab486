"""``pdserve demo``: 1P1D next to a single instance on the tiny model, TTFT/TPOT side by side."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pd_serving.client import Completion, complete, exact_length_prompt, load_tokenizer
from pd_serving.deploy import Deployment
from pd_serving.launcher import ManagedProcess, free_port, wait_all_ready
from pd_serving.model import cache_dir, default_model_dir, make_model
from pd_serving.proxy import Dispatch, PdProxy, serve
from pd_serving.servers import Connector, CpuSettings, Role, connector_extra, plan_servers

DEMO_PROMPT_TOKENS = (16, 127, 128, 300, 700, 1000)

# D computes the last prompt token of an MLA model on the absorbed decode path where a single
# instance ran it on the prefill path: with random weights a greedy near-tie can flip. These archs
# are compared as vLLM's own tests do: equal up to the first divergence, and there each side's
# token among the other's top TOP_LOGPROBS.
NEAR_TIE_ARCHS = frozenset({"mla"})
TOP_LOGPROBS = 5


def compare(single: Completion, pd: Completion, *, near_ties: bool) -> str:
    """ "yes" (token for token), "near tie at N" (allowed when `near_ties`), or "NO"."""
    if single.text == pd.text and single.token_ids == pd.token_ids:
        return "yes"
    if not near_ties or len(single.token_ids) != len(pd.token_ids):
        return "NO"
    for i, (a, b) in enumerate(zip(single.token_ids, pd.token_ids, strict=True)):
        if a != b:
            tied = (
                i < min(len(single.top_logprobs), len(pd.top_logprobs))
                and b in single.top_logprobs[i]
                and a in pd.top_logprobs[i]
            )
            return f"near tie at {i}" if tied else "NO"
    return "NO"  # same tokens, different text


def _progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    )


def _wait_ready_with_progress(deployment: Deployment, console: Console, timeout: float) -> None:
    processes = [s.process for s in deployment.servers]
    with _progress(console) as progress:
        task = progress.add_task(
            f"starting {len(processes)} vLLM instances (1-3 min on a small CPU)",
            total=len(processes),
        )
        for proc in processes:
            assert proc is not None
            proc.start()

        def ready(proc: ManagedProcess) -> None:
            progress.advance(task)
            progress.console.print(f"  [green]ready[/green] {proc.name} (log {proc.log_path})")

        wait_all_ready([p for p in processes if p is not None], timeout, on_ready=ready)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


async def _requests(
    proxy: PdProxy,
    proxy_url: str,
    *,
    single_url: str,
    model_name: str,
    prompts: list[str],
    max_tokens: int,
    console: Console,
    logprobs: int | None = None,
) -> list[tuple[Completion, Completion]]:
    await proxy.start()
    results = []
    async with aiohttp.ClientSession() as session:
        # One warm-up each: the first request of an instance pays lazy initialisation.
        for url in (single_url, proxy_url):
            await complete(session, url, model_name, "warm up", max_tokens=2)
        with _progress(console) as progress:
            task = progress.add_task("requests (single, then 1P1D)", total=len(prompts))
            for prompt in prompts:
                single = await complete(
                    session,
                    single_url,
                    model_name,
                    prompt,
                    max_tokens=max_tokens,
                    logprobs=logprobs,
                )
                pd = await complete(
                    session,
                    proxy_url,
                    model_name,
                    prompt,
                    max_tokens=max_tokens,
                    logprobs=logprobs,
                )
                results.append((single, pd))
                progress.advance(task)
    return results


async def _serve_and_run(
    deployment: Deployment,
    *,
    connector: Connector,
    dispatch: Dispatch,
    model: Path,
    prompts: list[str],
    max_tokens: int,
    console: Console,
    logprobs: int | None = None,
) -> list[tuple[Completion, Completion]]:
    proxy = PdProxy(deployment.proxy_config(connector, dispatch, model_names=[str(model)]))
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    try:
        single_url = deployment.by_role(Role.SINGLE)[0].url
        return await _requests(
            proxy,
            f"http://127.0.0.1:{port}",
            single_url=single_url,
            model_name=str(model),
            prompts=prompts,
            max_tokens=max_tokens,
            console=console,
            logprobs=logprobs,
        )
    finally:
        await runner.cleanup()


def run_demo(args: argparse.Namespace) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=100)
    connector = Connector(args.connector)
    dispatch = Dispatch(args.dispatch or Dispatch.SEQUENTIAL)  # as pdserve up; see cli.py
    if args.model is None:
        target = default_model_dir(args.arch)
        with console.status(f"making the tiny {args.arch} model in {target} (once)"):
            model = make_model(target, args.arch)
    else:
        model = args.model.resolve()
    log_dir = args.log_dir or cache_dir() / "logs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    near_ties = args.arch in NEAR_TIE_ARCHS
    tokenizer = load_tokenizer(model)
    lengths = DEMO_PROMPT_TOKENS[: args.requests] if args.requests <= 6 else None
    lengths = lengths or tuple(16 + (i * 997) % 1000 for i in range(args.requests))
    prompts = [exact_length_prompt(tokenizer, n, seed=i) for i, n in enumerate(lengths)]
    servers = plan_servers(
        model,
        log_dir=log_dir,
        connector=connector,
        prefill=1,
        decode=1,
        single=1,
        cpu=CpuSettings(
            kv_cache_bytes=args.kv_cache_mib * 1024 * 1024,
            max_model_len=args.max_model_len,
            arch=args.arch,
        ),
        extra_connector_config=connector_extra(args),
    )
    console.print(
        f"[bold]pdserve demo[/bold]: 1 prefill + 1 decode ({connector.value} connector, "
        f"{dispatch.value} dispatch) next to 1 single instance; {args.arch} model {model}"
    )
    with Deployment(servers) as deployment:
        _wait_ready_with_progress(deployment, console, args.startup_timeout)
        results = asyncio.run(
            _serve_and_run(
                deployment,
                connector=connector,
                dispatch=dispatch,
                model=model,
                prompts=prompts,
                max_tokens=args.max_tokens,
                console=console,
                logprobs=TOP_LOGPROBS if near_ties else None,
            )
        )
        console.print("stopping every instance ...")
    return _report(console, lengths, results, near_ties=near_ties)


def _report(
    console: Console,
    lengths: tuple[int, ...],
    results: list[tuple[Completion, Completion]],
    *,
    near_ties: bool = False,
) -> int:
    table = Table(title="greedy completions: single instance vs 1P1D through the proxy")
    for col in ("prompt tok", "out tok", "TTFT single ms", "TTFT 1P1D ms", "TPOT single ms"):
        table.add_column(col, justify="right")
    table.add_column("TPOT 1P1D ms", justify="right")
    table.add_column("same text")
    all_equal = True
    for n, (single, pd) in zip(lengths, results, strict=True):
        verdict = compare(single, pd, near_ties=near_ties)
        equal = verdict != "NO"
        all_equal &= equal
        table.add_row(
            str(n),
            str(pd.completion_tokens),
            _ms(single.ttft_s),
            _ms(pd.ttft_s),
            f"{single.tpot_s * 1000:.1f}",
            f"{pd.tpot_s * 1000:.1f}",
            f"[green]{verdict}[/green]" if equal else "[red]NO[/red]",
        )
    console.print(table)
    sample = results[-1][1].text.replace("\n", " ")
    console.print(f"last answer (random weights, so no meaning): {sample[:80]!r}")
    if all_equal and near_ties:
        console.print(
            "[bold green]1P1D answered like the single instance (token for token up to the first "
            "near tie, where each side's token is in the other's top 5: MLA's absorbed decode "
            "path on D).[/]"
        )
        return 0
    if all_equal:
        console.print("[bold green]1P1D answered token for token like the single instance.[/]")
        return 0
    console.print("[bold red]1P1D and the single instance differ.[/]")
    return 1
