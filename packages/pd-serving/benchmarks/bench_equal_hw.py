"""PD against one instance on equal hardware, under the mixed load PD is for.

Three systems on the same two cores, measured one at a time (the others paused), taking turns
in rounds at each rate (``pd_serving.equal_hw``): one vLLM instance on both cores, two
instances with a core each behind the proxy (data parallel), 1P1D with P on core 0 and D on
core 1 (``--pd-layout``; ``--compare-layout`` adds others: ``pd_serving.equal_hw.LAYOUTS``),
short prompts (under ``--bypass-below-tokens``) to D alone; first, with ``--low-load``,
every system one request at a time, short and long prompts apart, each stage's time read from
vLLM's histograms around each request (the TTFT breakdown). Open-loop Poisson arrivals of a
mix of long prompts (1-4k tokens, 32 out) and short
prompts decoding 256 tokens; the benchmark model (``pd_serving.model.make_bench_model``: a
75M-parameter Qwen2, random weights, the tiny model's tokenizer). Client timings are checked
against vLLM's own histograms. Writes ``results/equal_hw.json`` and ``results/equal_hw.png``:

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_equal_hw.py

(about 7 minutes: 2-3 starting three instances, the rest measuring). ``--smoke`` (CI,
seconds): the same harness against stand-in upstreams, numbers meaningless.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from pd_serving.equal_hw import (
    BUSY_OTHER_CPU,
    LAYOUTS,
    Layout,
    Placement,
    Slo,
    SystemUnderTest,
    compare_systems,
    cpu_snapshot,
    cpu_use,
    judge,
    low_load_breakdown,
    low_load_markdown,
    make_layout,
    markdown_table,
    payload,
    render_table,
    run_equal_hw,
    run_low_load,
    write_plot,
)
from pd_serving.workload import LengthDist, MixSpec, SweepRequest, parse_rates, plan_mixed
from rich.console import Console

RESULTS = Path(__file__).parent / "results"
BUSY_SAMPLE_S = 3.0


def other_cpu_now() -> float:
    """Cores' worth of CPU the box uses over a few seconds before anything is started: other
    jobs'."""
    import time as clock

    before = cpu_snapshot()
    clock.sleep(BUSY_SAMPLE_S)  # a measurement window, not a wait for something
    use = cpu_use(before, cpu_snapshot(), {}, ticks_per_s=float(os.sysconf("SC_CLK_TCK")))
    return use.share("other") if use else 0.0


SINGLE, DP, PD = "single, 2 cores", "2x single, DP", "1P1D"
PD_NO_BYPASS = "1P1D, no bypass"


def layout_of(name: str, args) -> Layout:
    return make_layout(
        name,
        low_nice=args.p_nice,
        low_omp_wait_policy=args.p_omp_wait_policy or None,
        low_worker_in_engine=args.p_worker_in_engine,
        d_worker_in_engine=args.d_worker_in_engine,
        worker_in_engine=args.worker_in_engine,
    )


def describe_layout(layout: Layout) -> str:
    def one(p: Placement) -> str:
        return (
            f"cores {p.cpus}, OMP {p.threads}, nice {p.nice}, OMP_WAIT_POLICY="
            f"{p.omp_wait_policy or 'unset'}, worker in engine core: {p.worker_in_engine}"
        )

    return f"P: {one(layout.prefill)}; D: {one(layout.decode)}"


def build_plans(args, tokenizer, mix: MixSpec) -> dict[float, list[SweepRequest]]:
    from pd_serving.client import exact_length_prompt

    plans = {}
    for k, rate in enumerate(args.rates):
        plan = plan_mixed(
            rate, args.requests, mix, seed=args.seed, max_model_len=args.max_model_len
        )
        for req in plan:
            seed = 1_000_000 * (args.seed + 1) + 10_000 * k + req.index
            req.prompt = exact_length_prompt(tokenizer, req.prompt_tokens, seed=seed)
        plans[rate] = plan
    return plans


def plan_low_load(args, tokenizer, mix: MixSpec) -> dict[str, list[SweepRequest]]:
    """``--low-load`` requests of each kind, lengths drawn from the mix's, sent one at a time."""
    import random

    from pd_serving.client import exact_length_prompt

    rng = random.Random(args.seed + 77)
    out: dict[str, list[SweepRequest]] = {}
    for kind, dist in (("short", mix.short_prompt), ("long", mix.long_prompt)):
        reqs = []
        for i in range(args.low_load):
            n = min(dist.sample(rng), args.max_model_len - args.low_load_output)
            prompt = exact_length_prompt(tokenizer, n, seed=900_000 + 1000 * (kind == "long") + i)
            reqs.append(SweepRequest(i, 0.0, n, args.low_load_output, prompt))
        out[kind] = reqs
    return out


def publish_low_load(samples, console: Console) -> dict:
    rows = low_load_breakdown(samples, reference=SINGLE)
    console.print("one request at a time (p50 of each stage, ms):")
    console.print(low_load_markdown(rows), markup=False, highlight=False, soft_wrap=True)
    return {"rows": [r.__dict__ for r in rows]}


def publish(args, turns, mix: MixSpec, meta: dict, console: Console, *, json_path: Path | None):
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    # DP's instances run the same OpenMP thread count as P and D: the like-for-like reference.
    points = compare_systems(
        turns, slo, long_prompt_above=mix.short_prompt.bounds()[1], reference=DP
    )
    title = f"equal hardware (2 cores), {mix.describe()}"
    console.print(render_table(points, title))
    console.print(markdown_table(points), markup=False, highlight=False, soft_wrap=True)
    verdict = judge(points, single=SINGLE, others=[DP], pd=PD)
    console.print(f"verdict: {verdict.describe()}", highlight=False)
    meta |= {
        "mix": mix.describe(),
        "rates": args.rates,
        "requests_per_rate": args.requests,
        "rounds": args.rounds,
        "seed": args.seed,
        "slo": {"ttft_ms": slo.ttft_ms, "itl_p99_per_request_ms": slo.itl_ms},
        "verdict": verdict.describe(),
    }
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload(points, meta), indent=1) + "\n")
        png = write_plot(points, json_path.with_suffix(".png"), slo, title)
        console.print(f"wrote {json_path} and {png}")
    return points


def run(args) -> int:
    from pd_serving.client import load_tokenizer
    from pd_serving.deploy import Deployment, proxy_config_for
    from pd_serving.launcher import ManagedProcess, free_port, stop_all, wait_all_ready
    from pd_serving.model import cache_dir, make_bench_model
    from pd_serving.proxy import READY_LINE
    from pd_serving.servers import Connector, CpuSettings, parse_cpu_list, plan_servers
    from pd_serving.timings import custom_buckets_arg

    console = Console(width=200)
    other = other_cpu_now()
    console.print(f"the rest of the box: {other:.2f} cores busy (load {os.getloadavg()[0]:.1f})")
    if other > BUSY_OTHER_CPU and not args.allow_busy:
        console.print(
            f"refused: other jobs use {other:.2f} cores (over {BUSY_OTHER_CPU}); their CPU "
            "would be measured as the systems'. Wait, or --allow-busy (the rounds are flagged)."
        )
        return 2
    model = make_bench_model(args.model)
    mix = MixSpec(long_share=args.long_share)
    log_dir = cache_dir() / "logs" / f"equal-hw-{time.strftime('%Y%m%d-%H%M%S')}"
    base = CpuSettings(
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
    )
    layouts = list(dict.fromkeys([args.pd_layout, *args.compare_layout]))
    names = {args.pd_layout: PD} | {lay: f"{PD}, {lay}" for lay in layouts if lay != args.pd_layout}
    # One instance per distinct placement: DP runs on the split layout's P and D (a request
    # without kv_transfer_params is a plain request to them); layouts share what they can.
    split = layout_of("split", args)
    wanted = {"prefill": [split.prefill], "decode": [split.decode]}
    # A P for idle times: shared-p's placement (both cores, two threads, a lower priority).
    wide = layout_of("shared-p", args).prefill
    if args.compare_idle_wide_p and wide not in wanted["prefill"]:
        wanted["prefill"].append(wide)
    for lay in layouts:
        chosen = layout_of(lay, args)
        for role, where in (("prefill", chosen.prefill), ("decode", chosen.decode)):
            if where not in wanted[role]:
                wanted[role].append(where)
    servers = plan_servers(
        model,
        log_dir=log_dir,
        connector=Connector.HYBRID,
        prefill=len(wanted["prefill"]),
        decode=len(wanted["decode"]),
        single=1,
        cpu=base,
    )
    single = replace(base, cpu_bind="0-1", omp_threads=2, worker_in_engine=args.worker_in_engine)
    settings = {"single0": single} | {
        f"{role}{i}": where.apply(base)
        for role, places in wanted.items()
        for i, where in enumerate(places)
    }
    for server in servers:
        server.cpu = settings[server.name]
        # Same prompts for every system: no instance may answer one from its prefix cache.
        server.extra_args += [
            "--no-enable-prefix-caching",
            "--custom-histogram-buckets",
            custom_buckets_arg(),
        ]

    def instances(lay: str) -> tuple[str, str]:
        chosen = layout_of(lay, args)
        return (
            f"prefill{wanted['prefill'].index(chosen.prefill)}",
            f"decode{wanted['decode'].index(chosen.decode)}",
        )

    tokenizer = load_tokenizer(model)
    plans = build_plans(args, tokenizer, mix)
    low_load = plan_low_load(args, tokenizer, mix) if args.low_load else {}
    warm = [SweepRequest(i, 0.0, 0, 8, f"warm up {i} " * (1 + 200 * (i % 2))) for i in range(4)]
    config = proxy_config_for(servers, Connector.HYBRID)
    by_name = {s.name: s for s in servers}
    by_url = {b.url: b for b in config.prefill}
    bypass = ["--bypass-below-tokens", str(args.bypass_below_tokens)]
    idle = ["--bypass-idle-below-tokens", str(args.bypass_idle_below_tokens)]
    proxies: dict[str, list[str]] = {}
    proxy_cpus: dict[str, frozenset[int]] = {}  # proxies pinned to cores (else unpinned)
    pd_idle = f"{PD}, idle bypass under {args.compare_idle_bypass}"
    pd_pinned = f"{PD}, proxy on core(s) {args.compare_proxy_cpus}"
    pd_wide = f"{PD}, wide P when idle"
    pd_systems: dict[str, tuple[str, str]] = {}  # system -> (P's name, D's name)
    wide_p: dict[str, str] = {}  # system -> its P for idle times' URL
    for lay in layouts:
        p_name, d_name = instances(lay)
        p = by_url[by_name[p_name].url]
        pair = ["--prefill", f"{p.url}@{p.rpc_address}", "--decode", by_name[d_name].url]
        proxies[names[lay]] = pair + bypass + idle
        pd_systems[names[lay]] = (p_name, d_name)
        if args.proxy_on_p_cores:  # as `pdserve up --proxy-cpus prefill`: off D's cores
            proxy_cpus[names[lay]] = parse_cpu_list(layout_of(lay, args).prefill.cpus)
        if lay != args.pd_layout:
            continue
        if args.bypass_below_tokens and args.compare_no_bypass:
            proxies[PD_NO_BYPASS] = [*pair, "--bypass-below-tokens", "0"]
            pd_systems[PD_NO_BYPASS] = (p_name, d_name)
            if names[lay] in proxy_cpus:
                proxy_cpus[PD_NO_BYPASS] = proxy_cpus[names[lay]]
        if args.compare_idle_bypass != args.bypass_idle_below_tokens:
            other = ["--bypass-idle-below-tokens", str(args.compare_idle_bypass)]
            proxies[pd_idle] = pair + bypass + other
            pd_systems[pd_idle] = (p_name, d_name)
        if args.compare_idle_wide_p:
            w = by_url[by_name[f"prefill{wanted['prefill'].index(wide)}"].url]
            proxies[pd_wide] = [*pair, "--prefill-when-idle", f"{w.url}@{w.rpc_address}"]
            proxies[pd_wide] += bypass + idle
            pd_systems[pd_wide] = (p_name, d_name)
            wide_p[pd_wide] = w.url
            if names[lay] in proxy_cpus:
                proxy_cpus[pd_wide] = proxy_cpus[names[lay]]
        if args.compare_proxy_cpus:
            proxies[pd_pinned] = pair + bypass + idle
            pd_systems[pd_pinned] = (p_name, d_name)
            proxy_cpus[pd_pinned] = parse_cpu_list(args.compare_proxy_cpus)
    dp_first, dp_second = (by_name[n] for n in instances("split"))
    proxies[DP] = ["--decode", dp_first.url, "--decode", dp_second.url]  # no P: each prefills
    if args.proxy_on_p_cores:  # where 1P1D's runs: on the first instance's core
        proxy_cpus[DP] = parse_cpu_list(split.prefill.cpus)
    console.print(f"[bold]equal hardware[/bold]: model {model}; logs in {log_dir}")
    for name, (p_name, d_name) in pd_systems.items():
        console.print(f"  {name}: P {p_name}, D {d_name}", highlight=False)
    for server in servers:
        c = server.cpu
        console.print(
            f"  {server.name}: cores {c.cpu_bind}, OMP {c.omp_threads}, nice {c.nice}, "
            f"wait {c.omp_wait_policy}, worker in engine {c.worker_in_engine}",
            highlight=False,
        )
    load_before = os.getloadavg()
    with Deployment(servers) as dep:
        dep.start(timeout=600)
        procs, urls = {}, {}
        for k, (name, backends) in enumerate(proxies.items()):
            port = free_port()
            tag = f"proxy{k}"
            procs[name] = ManagedProcess(
                tag,
                [
                    sys.executable, "-m", "pd_serving.cli", "proxy", "--port", str(port),
                    "--connector", "hybrid", "--model-name", str(model), *backends,
                ],
                log_path=log_dir / f"{tag}.log",
                ready_marker=READY_LINE,
                health_url=f"http://127.0.0.1:{port}/health",
                cpus=proxy_cpus.get(name),
            )  # fmt: skip
            urls[name] = f"http://127.0.0.1:{port}"
        try:
            for proc in procs.values():
                proc.start()
            wait_all_ready(list(procs.values()), timeout=120)
            single = by_name["single0"]
            systems = [
                SystemUnderTest(SINGLE, single.url, [[single.url]], [single.process]),
                SystemUnderTest(
                    DP,
                    urls[DP],
                    [[dp_first.url, dp_second.url]],
                    [dp_first.process, dp_second.process, procs[DP]],
                ),
            ]
            by_server_url = {s.url: s for s in servers}
            for name, (p_name, d_name) in pd_systems.items():
                pp, dd = by_name[p_name], by_name[d_name]
                ps = [pp] + ([by_server_url[wide_p[name]]] if name in wide_p else [])
                systems.append(
                    SystemUnderTest(
                        name,
                        urls[name],
                        [[p.url for p in ps], [dd.url]],
                        [*(p.process for p in ps), dd.process, procs[name]],
                    )
                )
            every = [s.process for s in servers] + list(procs.values())
            low = []
            if low_load:
                low = asyncio.run(
                    run_low_load(
                        systems,
                        str(model),
                        low_load,
                        rounds=args.rounds,
                        every_process=every,
                        console=console,
                    )
                )
            turns = asyncio.run(
                run_equal_hw(
                    systems,
                    str(model),
                    plans,
                    rounds=args.rounds,
                    every_process=every,
                    warmup=warm,
                    budget_s=args.budget_s,
                    console=console,
                )
            )
        finally:
            stop_all(list(procs.values()))
    meta = {
        "command": " ".join(sys.argv),
        "model": f"{model.name}: pd_serving.model.BENCH_MODEL_SPEC, random weights, bf16",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_count": os.cpu_count(),
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "systems": {
            SINGLE: "one instance, every process on cores 0-1, OMP_NUM_THREADS=2, worker in "
            f"engine core: {args.worker_in_engine}",
            DP: "instances on core 0 and core 1 (OMP 1 each), pdserve proxy by load, no P; the "
            f"proxy on core 0: {args.proxy_on_p_cores}",
            **{
                names[lay]: f"{describe_layout(layout_of(lay, args))}; pdserve proxy (on P's "
                f"cores: {args.proxy_on_p_cores}), sequential dispatch, "
                f"prompts under {args.bypass_below_tokens} estimated tokens (characters / 4) "
                "to D alone (--bypass-below-tokens), and prompts under "
                f"{args.bypass_idle_below_tokens} while D and P are idle "
                "(--bypass-idle-below-tokens; 0: never)"
                for lay in layouts
            },
            PD_NO_BYPASS: f"{PD}'s P, D and dispatch, every prompt through P",
            pd_idle: f"{PD} with --bypass-idle-below-tokens {args.compare_idle_bypass}",
            pd_pinned: f"{PD} with its proxy process on cores {args.compare_proxy_cpus}",
            pd_wide: f"{PD} and a P for idle times ({describe_layout(layout_of('shared-p', args))}"
            "; the proxy's --prefill-when-idle: it prefills while D and P are idle)",
        },
        "other_cpu_before": other,
        "pd_layout": args.pd_layout,
        "layouts": {
            names[lay]: {
                "layout": lay,
                "pdserve_up_flags": " ".join(layout_of(lay, args).pdserve_flags()),
            }
            for lay in layouts
        },
        "instances": {s.name: s.cpu.__dict__ for s in servers},
        "low_load": publish_low_load(low, console) if low else None,
        "prefix_caching": False,
        "max_num_seqs": args.max_num_seqs,
    }
    points = publish(args, turns, mix, meta, console, json_path=args.json)
    return 0 if all(p.same_tokens_as_reference is not False for p in points) else 1


TESTS = Path(__file__).resolve().parents[1] / "tests"


async def smoke_measure(plans) -> list:
    sys.path.insert(0, str(TESTS))
    from pd_serving.launcher import free_port
    from pd_serving.proxy import Backend, Dispatch, PdProxy, ProxyConfig, serve
    from pd_serving.servers import Connector
    from stand_ins import MODEL, FakeUpstream

    single, a, b = FakeUpstream("single"), FakeUpstream("a"), FakeUpstream("b")
    p, d = FakeUpstream("P", kv_params={}), FakeUpstream("D")
    ups = (single, a, b, p, d)
    for up in ups:
        up.token_delay_s = 0.002
        await up.start()
    configs = {
        DP: ProxyConfig(prefill=[], decode=[Backend(a.url, name="a"), Backend(b.url, name="b")]),
        PD: ProxyConfig(
            prefill=[Backend(p.url, rpc_address="127.0.0.1:1", name="p0")],
            decode=[Backend(d.url, name="d0")],
            connector=Connector.HYBRID,
            dispatch=Dispatch.SEQUENTIAL,
        ),
    }
    runners, urls = [], {}
    for name, config in configs.items():
        port = free_port()
        runners.append(await serve(PdProxy(config), "127.0.0.1", port))
        urls[name] = f"http://127.0.0.1:{port}"
    systems = [
        SystemUnderTest(SINGLE, single.url, [[single.url]]),
        SystemUnderTest(DP, urls[DP], [[a.url, b.url]]),
        SystemUnderTest(PD, urls[PD], [[p.url], [d.url]]),
    ]
    low = {
        kind: [SweepRequest(i, 0.0, n, 2, f"{kind} {i}") for i in range(2)]
        for kind, n in (("short", 1), ("long", 8))
    }
    try:
        turns = await run_equal_hw(systems, MODEL, plans, rounds=2, timeout_s=30)
        return turns, await run_low_load(systems, MODEL, low, rounds=2, timeout_s=30)
    finally:
        for runner in runners:
            await runner.cleanup()
        for up in ups:
            await up.close()


def smoke() -> int:
    console = Console(width=200)
    args = argparse.Namespace(
        rates=[20.0, 40.0], requests=6, rounds=2, seed=0, slo_ttft_ms=1000.0, slo_itl_ms=100.0
    )
    mix = MixSpec(
        long_share=0.3,
        long_prompt=LengthDist("fixed", 8),
        long_output=LengthDist("fixed", 2),
        short_prompt=LengthDist("fixed", 1),
        short_output=LengthDist("fixed", 4),
    )
    plans = {rate: plan_mixed(rate, 6, mix, seed=0) for rate in args.rates}
    for plan in plans.values():
        for req in plan:
            req.prompt = f"prompt {req.index}"
    turns, low = asyncio.run(smoke_measure(plans))
    breakdown = publish_low_load(low, console)["rows"]
    assert [(r["kind"], r["system"], r["requests"], r["failed"]) for r in breakdown] == [
        (kind, s, 2, 0) for kind in ("short", "long") for s in (SINGLE, DP, PD)
    ], breakdown
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "equal_hw.json"
        meta = {"command": "bench_equal_hw.py --smoke"}
        points = publish(args, turns, mix, meta, console, json_path=path)
        stored = json.loads(path.read_text())
        assert [(q["system"], q["completed"]) for q in stored["points"]] == [
            (s, 6) for _ in args.rates for s in (SINGLE, DP, PD)
        ], stored["points"]
        assert path.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
        # Stand-ins publish no vLLM histograms: nothing to check against, and it says so.
        assert all(not q.timing_agrees for q in points)
    print("bench_equal_hw smoke: ok")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="stand-ins, seconds (CI)")
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,3"))
    parser.add_argument("--requests", type=int, default=20, help="per rate and system")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-share", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=100.0)
    parser.add_argument("--model", type=Path, default=None, help="default: the bench model")
    parser.add_argument("--kv-cache-mib", type=int, default=384)
    parser.add_argument("--max-model-len", type=int, default=4608)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="no rate starts after this many seconds of measuring (bounded lock holds)",
    )
    parser.add_argument(
        "--low-load",
        type=int,
        default=8,
        help="first, this many short and as many long prompts to every system one at a time "
        "(the TTFT breakdown per stage; 0: none)",
    )
    parser.add_argument("--low-load-output", type=int, default=16, help="tokens each answers")
    parser.add_argument(
        "--bypass-below-tokens",
        type=int,
        default=256,
        help="1P1D's proxy sends prompts under this many estimated tokens to D alone "
        "(the bench tokenizer: about 2.4 characters a token, so 256 is about 430 real ones)",
    )
    parser.add_argument(
        "--bypass-idle-below-tokens",
        type=int,
        default=0,
        help="1P1D's proxy also sends prompts under this many estimated tokens to D alone "
        "while D and P are idle (0: never)",
    )
    parser.add_argument(
        "--compare-idle-bypass",
        type=int,
        default=0,
        metavar="N",
        help="also 1P1D (its layout) with --bypass-idle-below-tokens N",
    )
    parser.add_argument(
        "--compare-no-bypass",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also 1P1D with every prompt through P",
    )
    parser.add_argument(
        "--pd-layout",
        choices=LAYOUTS,
        default="split",
        help="where 1P1D's P and D run (split: a core each; shared-d: D on both cores, P on "
        "core 0 at a lower priority; shared-p: P on both cores at a lower priority)",
    )
    parser.add_argument(
        "--compare-layout",
        choices=LAYOUTS,
        action="append",
        default=[],
        help="also 1P1D on this layout (repeatable), named '1P1D, LAYOUT'",
    )
    parser.add_argument("--p-nice", type=int, default=10, help="a P sharing a core with D: nice")
    parser.add_argument(
        "--p-omp-wait-policy",
        default="passive",
        help="a P sharing a core with D: OMP_WAIT_POLICY ('' unset)",
    )
    parser.add_argument(
        "--p-worker-in-engine", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument(
        "--d-worker-in-engine", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument(
        "--worker-in-engine",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every instance, the single one too, runs vLLM's worker in its engine-core "
        "process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no worker spinning a second after each "
        "step on the cores it shares)",
    )
    parser.add_argument(
        "--proxy-on-p-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="1P1D's proxy on P's cores (pdserve up's default), DP's on the first instance's",
    )
    parser.add_argument(
        "--compare-proxy-cpus",
        default="",
        metavar="CPUS",
        help="also 1P1D with its proxy process pinned to these cores (e.g. P's: 0)",
    )
    parser.add_argument(
        "--compare-idle-wide-p",
        action="store_true",
        help="also 1P1D with a second P on both cores (two threads, a lower priority: --p-*) "
        "that prefills only while D and the first P are idle (pdserve proxy --prefill-when-idle)",
    )
    parser.add_argument(
        "--allow-busy",
        action="store_true",
        help=f"run even when other jobs use over {BUSY_OTHER_CPU} cores before the start",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "equal_hw.json")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
