"""``pdserve demo``: 1P1D next to a single instance on the same two cores, on the tiny model.

Two parts, each system measured alone (the other paused with SIGSTOP):

1. Token identity: each prompt, one at a time, on the single instance and through 1P1D; TTFT
   and TPOT side by side, and the path each prompt took through 1P1D (P then D, or D alone:
   the proxy's default bypass of short prompts). TPOT is vLLM's own (its inter-token histogram
   read before and after each request, ``timings``), checked against the client's stream: an
   answer the client read in a burst is marked, never shown as a TPOT of 0.
2. A short mixed load (``equal_hw``): Poisson arrivals of long prompts that answer briefly and
   short prompts that decode long. On one instance every long prefill stalls the decoding of
   the others (their ITL p99); 1P1D prefills on P and keeps D decoding.

Equal hardware, as ``benchmarks/bench_equal_hw.py``: the single instance's processes and its
two OpenMP threads on both cores, P's on one core and D's on the other, one thread each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pd_serving.client import Completion, complete, exact_length_prompt, load_tokenizer
from pd_serving.deploy import Deployment
from pd_serving.equal_hw import (
    Slo,
    SystemUnderTest,
    activate,
    compare_systems,
    payload,
    run_equal_hw,
)
from pd_serving.launcher import ManagedProcess, free_port, stop_all, wait_all_ready
from pd_serving.model import (
    DEFAULT_ARCH,
    cache_dir,
    default_model_dir,
    make_bench_model,
    make_model,
)
from pd_serving.proxy import READY_LINE, Dispatch
from pd_serving.routing import DEFAULT_BYPASS_BELOW_TOKENS
from pd_serving.servers import (
    Connector,
    CpuSettings,
    Role,
    connector_extra,
    cpu_bind_for,
    plan_servers,
    proxy_cores,
)
from pd_serving.timings import EMPTY, ITL, Histogram, custom_buckets_arg, parse_histograms
from pd_serving.workload import LengthDist, MixSpec, SweepRequest, plan_mixed

DEMO_PROMPT_TOKENS = (16, 127, 128, 300, 700, 1000)

# Greedy tokens of a random-weight model can flip at a near tie when two instances add the same
# sums in another order: the single instance's two OpenMP threads split them otherwise than P's
# and D's one, and D computes an MLA model's last prompt token on the absorbed decode path where
# one instance runs the prefill path. So 1P1D's answers are compared token for token with D
# alone (one instance on P's and D's thread count; near ties allowed only for NEAR_TIE_ARCHS),
# and with the single instance as vLLM's own tests compare: token for token, else equal up to
# the first divergence and there each side's token among the other's top TOP_LOGPROBS ("near
# tie at N"); anything else is a difference.
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


# The mixed load of part 2, sized for the tiny model and the demo's 2048-token context: short.
DEMO_MIX = MixSpec(
    long_share=0.5,
    long_prompt=LengthDist("uniform", 1200, 1900),
    long_output=LengthDist("fixed", 16),
    short_prompt=LengthDist("uniform", 32, 64),
    short_output=LengthDist("fixed", 128),
)
# The SLOs of part 2: the tiny model decodes in 2-4 ms a step, the benchmark model in 23-30 ms.
TINY_MODEL_SLO = Slo(ttft_ms=1000, itl_ms=50)
BENCH_MODEL_SLO = Slo(ttft_ms=3000, itl_ms=100)
# Rates that keep a few short requests decoding whenever a long prompt arrives.
TINY_MODEL_RATE, BENCH_MODEL_RATE = 8.0, 2.0
# 1P1D's ITL p99 at most this fraction of the single instance's: the stalls show.
IT_SHOWS = 0.8
# A client TPOT this far from vLLM's own: the client read the answer in bursts.
TPOT_TOLERANCE = 0.25


def _wait_ready_with_progress(
    processes: list[ManagedProcess], console: Console, timeout: float
) -> None:
    with _progress(console) as progress:
        task = progress.add_task(
            f"starting {len(processes)} vLLM instances (1-3 min on a small CPU)",
            total=len(processes),
        )
        for proc in processes:
            proc.start()

        def ready(proc: ManagedProcess) -> None:
            progress.advance(task)
            progress.console.print(f"  [green]ready[/green] {proc.name} (log {proc.log_path})")

        wait_all_ready(processes, timeout, on_ready=ready)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


@dataclass
class Answer:
    """One demo request: the client's completion and vLLM's own step times for it."""

    completion: Completion
    # Mean inter-token latency of this request on the decoding instance; nan: not read.
    server_tpot_s: float
    path: str = ""  # 1P1D: "P -> D", or "D alone" (bypassed)

    @property
    def client_tpot_s(self) -> float:
        return self.completion.tpot_s

    @property
    def server_known(self) -> bool:
        return math.isfinite(self.server_tpot_s) and self.server_tpot_s > 0

    @property
    def client_saw_every_gap(self) -> bool:
        """Every token came in a chunk of its own, the last one after the first (a stream
        read in one burst has chunks of several tokens, or none after the first)."""
        chunks = self.completion.chunk_tokens
        return len(chunks) > 1 and all(n == 1 for n in chunks) and self.client_tpot_s > 0

    @property
    def burst(self) -> bool:
        """The client's TPOT is not vLLM's: it read tokens that had queued up."""
        if not self.server_known:
            return not self.client_saw_every_gap
        deviation = abs(self.client_tpot_s - self.server_tpot_s) / self.server_tpot_s
        return deviation > TPOT_TOLERANCE

    def tpot_cell(self) -> str:
        """vLLM's TPOT, marked "*" when the client's reading of the stream disagrees; without
        vLLM's figure the client's, marked "?" (unchecked), if the client saw every gap, else
        "-". Never a TPOT of 0 for an answer of several tokens."""
        if self.completion.completion_tokens < 2:
            return "-"  # one token: no time per output token
        if self.server_known:
            return _tpot_ms(self.server_tpot_s) + ("*" if self.burst else "")
        if self.client_saw_every_gap:
            return _tpot_ms(self.client_tpot_s) + "?"
        return "-"


def _tpot_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.1f}" if ms >= 0.05 else "<0.1"


async def _metrics(session: aiohttp.ClientSession, url: str) -> str | None:
    """An instance's (or the proxy's) /metrics text; None when it cannot be read."""
    try:
        async with session.get(f"{url}/metrics") as resp:
            return await resp.text() if resp.status == 200 else None
    except aiohttp.ClientError:
        return None


async def _itl(session: aiohttp.ClientSession, url: str) -> Histogram:
    text = await _metrics(session, url)
    return EMPTY if text is None else parse_histograms(text, [ITL])[ITL]


def request_tpot_s(before: Histogram, after: Histogram) -> float:
    """One request's mean step time from the decoding instance's ITL histogram read around it;
    nan when either read failed or the histogram did not move."""
    if before is EMPTY or after is EMPTY:
        return float("nan")
    step = after - before
    return step.mean if step.count > 0 else float("nan")


BYPASSES = "pdserve_bypass_total"


def bypass_count(metrics_text: str | None) -> float:
    """Requests the proxy sent to D alone so far (every reason); nan when not read."""
    if metrics_text is None:
        return float("nan")
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(BYPASSES + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _one_by_one(
    session: aiohttp.ClientSession,
    url: str,
    decode_url: str,
    model_name: str,
    prompts: list[str],
    *,
    max_tokens: int,
    logprobs: int | None,
    progress: Progress,
    task,
    extra: dict | None = None,
) -> list[Answer]:
    answers = []
    proxied = url != decode_url
    for prompt in prompts:
        before = await _itl(session, decode_url)
        bypassed = bypass_count(await _metrics(session, url)) if proxied else math.nan
        completion = await complete(
            session, url, model_name, prompt, max_tokens=max_tokens, logprobs=logprobs,
            extra=extra,
        )  # fmt: skip
        tpot = request_tpot_s(before, await _itl(session, decode_url))
        path = ""
        if proxied:
            now = bypass_count(await _metrics(session, url))
            path = "?" if math.isnan(now - bypassed) else "D alone" if now > bypassed else "P -> D"
        answers.append(Answer(completion, tpot, path))
        progress.advance(task)
    return answers


async def _identity_check(
    single: SystemUnderTest,
    pd: SystemUnderTest,
    every: list[ManagedProcess],
    *,
    model_name: str,
    prompts: list[str],
    warmups: list[str],
    max_tokens: int,
    logprobs: int | None,
    console: Console,
) -> list[tuple[Answer, Answer, Answer]]:
    """Every prompt on the single instance (1P1D paused), then through 1P1D and to D alone
    (single paused): (single's, 1P1D's, D's) answers. D alone is one vLLM instance on P's and
    D's thread count: the reference for token identity (the single instance's two threads add
    sums in another order)."""
    out: dict[str, list[Answer]] = {}
    decode_url = pd.stages[-1][0]
    async with aiohttp.ClientSession() as session:
        with _progress(console) as progress:
            for system in (single, pd):
                activate(system, every)
                # The first requests pay lazy initialisation (P's too, the logprobs path's);
                # prompts of their own, or the measured ones would come from a prefix cache.
                for warm in warmups:
                    await complete(
                        session, system.url, model_name, warm, max_tokens=2, logprobs=logprobs
                    )
                task = progress.add_task(
                    f"requests, one at a time: {system.name}", total=len(prompts)
                )
                out[system.name] = await _one_by_one(
                    session,
                    system.url,
                    decode_url if system is pd else system.url,
                    model_name,
                    prompts,
                    max_tokens=max_tokens,
                    logprobs=logprobs,
                    progress=progress,
                    task=task,
                )
            task = progress.add_task("the same to D alone", total=len(prompts))
            # Salted: D computes the whole prompt itself, none of it from the blocks 1P1D's
            # transfers left in its prefix cache.
            out["D"] = await _one_by_one(
                session,
                decode_url,
                decode_url,
                model_name,
                prompts,
                max_tokens=max_tokens,
                logprobs=logprobs,
                progress=progress,
                task=task,
                extra={"cache_salt": "pdserve-demo-reference"},
            )
    return list(zip(out[single.name], out[pd.name], out["D"], strict=True))


def uses_bench_model(args: argparse.Namespace) -> bool:
    """The 75M benchmark model (a Qwen2): the default for qwen2 unless a model or --tiny is
    asked; the other architectures run their tiny model."""
    return args.model is None and not args.tiny and args.arch == DEFAULT_ARCH


def _demo_servers(args: argparse.Namespace, model: Path, log_dir: Path, connector: Connector):
    servers = plan_servers(
        model,
        log_dir=log_dir,
        connector=connector,
        prefill=1,
        decode=1,
        single=1,
        cpu=CpuSettings(
            # The benchmark model's KV is 12 KiB a token: 64 MiB would hold 5k tokens.
            kv_cache_bytes=max(args.kv_cache_mib, 384 if uses_bench_model(args) else 0) << 20,
            max_model_len=args.max_model_len,
            arch=args.arch,
        ),
        extra_connector_config=connector_extra(args),
    )
    p_core, d_core = cpu_bind_for(Role.PREFILL, 0), cpu_bind_for(Role.DECODE, 0)
    for server in servers:
        if server.role is Role.SINGLE and "nobind" not in (p_core, d_core):
            # Equal hardware: the single instance gets P's core and D's, every process and an
            # OpenMP thread on each.
            cores = sorted({int(p_core), int(d_core)})
            server.cpu = replace(
                server.cpu, cpu_bind=",".join(map(str, cores)), omp_threads=len(cores)
            )
            server.process_cpus = frozenset(cores)
        # vLLM's step times in fine buckets (its default ITL ladder starts at 10 ms).
        server.extra_args += ["--custom-histogram-buckets", custom_buckets_arg()]
    return servers


def _proxy_process(
    deployment: Deployment, *, connector: Connector, dispatch: Dispatch, model: Path, log_dir: Path
):
    config = deployment.proxy_config(connector, dispatch, model_names=[str(model)])
    port = free_port()
    argv = [
        sys.executable, "-m", "pd_serving.cli", "proxy", "--port", str(port),
        "--connector", connector.value, "--dispatch", dispatch.value, "--model-name", str(model),
    ]  # fmt: skip
    for b in config.prefill:
        argv += ["--prefill", f"{b.url}@{b.rpc_address}" if b.rpc_address else b.url]
    for b in config.decode:
        argv += ["--decode", b.url]
    proc = ManagedProcess(
        "proxy",
        argv,
        log_path=log_dir / "proxy.log",
        ready_marker=READY_LINE,
        health_url=f"http://127.0.0.1:{port}/health",
        # As `pdserve up` runs it: on P's cores, off D's.
        cpus=proxy_cores(deployment.servers, "prefill"),
    )
    return proc, f"http://127.0.0.1:{port}"


def run_demo(args: argparse.Namespace) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=110)
    connector = Connector(args.connector)
    dispatch = Dispatch(args.dispatch or Dispatch.SEQUENTIAL)  # as pdserve up; see cli.py
    if args.bench_model and args.arch != DEFAULT_ARCH:
        raise SystemExit(
            f"pdserve: the 75M model is a {DEFAULT_ARCH}; --arch {args.arch} runs tiny"
        )
    bench_model = uses_bench_model(args)
    if bench_model:
        with console.status("making the benchmark model (75M parameters, once)"):
            model = make_bench_model()
    elif args.model is None:
        target = default_model_dir(args.arch)
        with console.status(f"making the tiny {args.arch} model in {target} (once)"):
            model = make_model(target, args.arch)
    else:
        model = args.model.resolve()
    log_dir = args.log_dir or cache_dir() / "logs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    tokenizer = load_tokenizer(model)
    lengths = DEMO_PROMPT_TOKENS[: args.requests] if args.requests <= 6 else None
    lengths = lengths or tuple(16 + (i * 997) % 1000 for i in range(args.requests))
    prompts = [exact_length_prompt(tokenizer, n, seed=i) for i, n in enumerate(lengths)]
    # A short prompt and one long enough to go through P, unlike any measured one.
    warmups = [exact_length_prompt(tokenizer, n, seed=90_000 + n) for n in (16, max(lengths))]
    load_rate = args.load_rate or (BENCH_MODEL_RATE if bench_model else TINY_MODEL_RATE)
    plan = plan_mixed(
        load_rate, args.load_requests, DEMO_MIX, seed=7, max_model_len=args.max_model_len
    )
    for req in plan:
        req.prompt = exact_length_prompt(tokenizer, req.prompt_tokens, seed=50_000 + req.index)
    servers = _demo_servers(args, model, log_dir, connector)
    console.print(
        f"[bold]pdserve demo[/bold]: 1 prefill + 1 decode ({connector.value} connector, "
        f"{dispatch.value} dispatch) against 1 single instance on the same cores; "
        f"{args.arch} model {model}"
    )
    with Deployment(servers) as deployment:
        processes = [s.process for s in servers if s.process is not None]
        _wait_ready_with_progress(processes, console, args.startup_timeout)
        proxy, proxy_url = _proxy_process(
            deployment, connector=connector, dispatch=dispatch, model=model, log_dir=log_dir
        )
        try:
            proxy.start()
            wait_all_ready([proxy], timeout=120)
            single, p, d = (
                deployment.by_role(r)[0] for r in (Role.SINGLE, Role.PREFILL, Role.DECODE)
            )
            systems = [
                SystemUnderTest("single", single.url, [[single.url]], [single.process]),
                SystemUnderTest(
                    "1P1D", proxy_url, [[p.url], [d.url]], [p.process, d.process, proxy]
                ),
            ]
            every = [s.process for s in servers] + [proxy]
            pairs = asyncio.run(
                _identity_check(
                    *systems,
                    every,
                    model_name=str(model),
                    prompts=prompts,
                    warmups=warmups,
                    max_tokens=args.max_tokens,
                    logprobs=TOP_LOGPROBS,
                    console=console,
                )
            )
            code = _report(console, lengths, pairs, near_ties=args.arch in NEAR_TIE_ARCHS)
            points = []
            slo = BENCH_MODEL_SLO if bench_model else TINY_MODEL_SLO
            if args.load_requests:
                console.print(
                    f"mixed load: {args.load_requests} Poisson arrivals at {load_rate:g} "
                    f"req/s, {DEMO_MIX.describe()}; each system alone"
                )
                warm = [SweepRequest(0, 0.0, 0, 4, "warm up")]
                turns = asyncio.run(
                    run_equal_hw(
                        systems,
                        str(model),
                        {load_rate: plan},
                        rounds=1,
                        every_process=every,
                        warmup=warm,
                    )
                )
                points = compare_systems(turns, slo, long_prompt_above=64)
        finally:
            stop_all([proxy])
        console.print("stopping every instance ...")
    if points:
        _report_load(console, points, slo)
    if args.json is not None:
        meta = {
            "command": "pdserve " + " ".join(sys.argv[1:]),
            "model": str(model),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "load": {"rate": load_rate, "requests": args.load_requests, "mix": DEMO_MIX.describe()},
            "slo": {"ttft_ms": slo.ttft_ms, "itl_p99_per_request_ms": slo.itl_ms},
        }
        summary = payload(points, meta) | {
            "identity": [
                asdict(r)
                for r in identity_rows(lengths, pairs, near_ties=args.arch in NEAR_TIE_ARCHS)
            ]
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
        console.print(f"wrote {args.json}")
    return code


@dataclass
class IdentityRow:
    """One prompt of part 1, as the table shows it and the summary stores it."""

    prompt_tokens: int
    output_tokens: int
    path: str
    ttft_single_ms: float
    ttft_pd_ms: float
    tpot_single: str  # the cells: vLLM's, marked, never 0
    tpot_pd: str
    same_as_d: str  # 1P1D against D alone: "yes" ("near tie at N" for NEAR_TIE_ARCHS) or "NO"
    same_as_single: str  # against the single instance: "yes", "near tie at N" or "NO"


def identity_rows(
    lengths: tuple[int, ...],
    results: list[tuple[Answer, Answer, Answer]],
    *,
    near_ties: bool = False,
) -> list[IdentityRow]:
    return [
        IdentityRow(
            prompt_tokens=n,
            output_tokens=pd.completion.completion_tokens,
            path=pd.path,
            ttft_single_ms=1000 * single.completion.ttft_s,
            ttft_pd_ms=1000 * pd.completion.ttft_s,
            tpot_single=single.tpot_cell(),
            tpot_pd=pd.tpot_cell(),
            same_as_d=compare(alone.completion, pd.completion, near_ties=near_ties),
            same_as_single=compare(single.completion, pd.completion, near_ties=True),
        )
        for n, (single, pd, alone) in zip(lengths, results, strict=True)
    ]


def _verdict_cell(verdict: str) -> str:
    return f"[green]{verdict}[/green]" if verdict != "NO" else "[red]NO[/red]"


def _report(
    console: Console,
    lengths: tuple[int, ...],
    results: list[tuple[Answer, Answer, Answer]],
    *,
    near_ties: bool = False,
) -> int:
    table = Table(title="greedy completions: single instance vs 1P1D through the proxy")
    for col in (
        "prompt tok", "out tok", "1P1D path", "TTFT single ms", "TTFT 1P1D ms",
        "TPOT single ms", "TPOT 1P1D ms",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    table.add_column("1P1D = D alone")
    table.add_column("1P1D = single")
    rows = identity_rows(lengths, results, near_ties=near_ties)
    for row in rows:
        table.add_row(
            str(row.prompt_tokens),
            str(row.output_tokens),
            row.path,
            f"{row.ttft_single_ms:.0f}",
            f"{row.ttft_pd_ms:.0f}",
            row.tpot_single,
            row.tpot_pd,
            _verdict_cell(row.same_as_d),
            _verdict_cell(row.same_as_single),
        )
    console.print(table)
    bursts = [
        f"{n} tokens on {name}: client {answer.client_tpot_s * 1000:.1f} ms, "
        f"vLLM {answer.server_tpot_s * 1000:.1f} ms"
        for n, answers in zip(lengths, results, strict=True)
        for name, answer in zip(("single", "1P1D"), answers, strict=False)
        if answer.burst and answer.server_known
    ]
    console.print(
        "TPOT: vLLM's own mean step time for the request (its inter-token histogram), "
        "checked against the client's stream. 1P1D path: the proxy sends prompts under "
        f"{DEFAULT_BYPASS_BELOW_TOKENS} estimated tokens (characters / 4) to D alone.",
        highlight=False,
    )
    if bursts:
        console.print(
            "* the client read this answer in bursts (tokens that had queued up), so its own "
            "TPOT is not the step time: " + "; ".join(bursts),
            highlight=False,
        )
    if any(a.tpot_cell().endswith("?") for answers in results for a in answers[:2]):
        console.print("? vLLM's histogram could not be read: the client's TPOT, unchecked.")
    sample = results[-1][1].completion.text.replace("\n", " ")
    console.print(f"last answer (random weights, so no meaning): {sample[:80]!r}")
    console.print(
        "1P1D = D alone: the same prompt to D as a plain request (one vLLM instance on P's and "
        "D's one thread). 1P1D = single: against the single instance, whose two threads add "
        f"the same sums in another order: a near tie (each side's token in the other's top "
        f"{TOP_LOGPROBS} at the first difference) can flip a greedy token of random weights.",
        highlight=False,
    )
    exact = [row.same_as_d for row in rows]
    if "NO" in exact or any(row.same_as_single == "NO" for row in rows):
        console.print("[bold red]1P1D differs from one vLLM instance.[/]")
        return 1
    if all(v == "yes" for v in exact):
        console.print("[bold green]1P1D answered token for token like one vLLM instance.[/]")
    else:
        console.print(
            "[bold green]1P1D answered like one vLLM instance up to near ties (MLA: D computes "
            "the last prompt token on the absorbed decode path).[/]"
        )
    return 0


def timing_summary(point) -> str:
    """The timings column: whether the client's ITL and TTFT agree with vLLM's."""
    if point.timing_agrees and point.ttft_agrees:
        return "client agrees with vLLM"
    notes = [n for ok, n in ((point.timing_agrees, point.timing_note),
                             (point.ttft_agrees, point.ttft_note)) if not ok]  # fmt: skip
    return "; ".join(notes)


def _report_load(console: Console, points, slo: Slo) -> None:
    table = Table(title="mixed load on the same two cores (ITL: the gaps between tokens)")
    for col in (
        "system", "TTFT p50 ms", "TTFT p99 ms", "TTFT mean ms client / vLLM", "TPOT p50 ms",
        "ITL p50 ms", "ITL p99 ms", "ITL p99 vLLM ms", "longest stall ms",
        f"within SLO (TTFT<={slo.ttft_ms:g}, ITL p99<={slo.itl_ms:g} ms)", "timings",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(
            p.system,
            f"{p.ttft_p50_ms:.0f}",
            f"{p.ttft_p99_ms:.0f}",
            f"{p.ttft_mean_ms:.0f} / {p.server_ttft_mean_ms:.0f}",
            f"{p.tpot_p50_ms:.1f}" if p.timing_agrees else f"{p.server_tpot_p50_ms:.1f} (vLLM)",
            f"{p.itl_p50_ms:.1f}" if p.timing_agrees else f"{p.server_itl_p50_ms:.1f} (vLLM)",
            f"{p.checked_itl_p99_ms:.1f}",
            f"{p.server_itl_p99_ms:.1f}",
            f"{p.itl_max_ms:.0f}",
            f"{100 * p.slo_attainment:.0f}%",
            timing_summary(p),
        )
    console.print(table)
    console.print(
        "TTFT vLLM: per request, the single instance's own TTFT; on 1P1D P's whole request "
        "plus D's TTFT (or D's alone for a prompt that bypassed P). The client's is higher by "
        "the proxy and HTTP hops.",
        highlight=False,
    )
    by = {p.system: p for p in points}
    single, pd = by.get("single"), by.get("1P1D")
    if not (single and pd and single.checked_itl_p99_ms > 0):
        return
    ratio = pd.checked_itl_p99_ms / single.checked_itl_p99_ms
    stalls = f"longest stall {single.itl_max_ms:.0f} vs {pd.itl_max_ms:.0f} ms"
    if ratio <= IT_SHOWS:
        console.print(
            f"1P1D's ITL p99 is {ratio:.2f}x the single instance's ({stalls}): on one instance "
            "every long prefill stalls the tokens of every request decoding beside it; 1P1D "
            "prefills on P and D only decodes."
        )
    else:
        console.print(
            f"1P1D's ITL p99 is {ratio:.2f}x the single instance's ({stalls}): this model "
            "prefills a long prompt in a few steps' time, too little to stall decoding. Run "
            "`pdserve demo` without --tiny (the 75M model) to see a long prefill stall one "
            "instance and not 1P1D."
        )
