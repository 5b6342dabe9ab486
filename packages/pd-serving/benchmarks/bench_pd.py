"""TTFT/TPOT of 1P1D (HybridConnector and vLLM's NixlConnector) against one vLLM instance.

Full run (a few minutes; five vLLM instances on the tiny model, measured one system at a time):

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_pd.py

which is ``pdserve bench --compare`` writing ``benchmarks/results/pd_ttft.json``; with
``--transports`` it is ``pdserve bench --compare-transports`` (1P1D over kvt's same-host path
against kvt's TCP path) writing ``benchmarks/results/pd_transports.json``; with ``--sweep`` it is
the load sweep ``pdserve bench --compare --rates 0.5,1,2,4 --requests 24`` (Poisson arrivals,
300 -> 64 tokens) writing ``benchmarks/results/pd_sweep.json`` and its plots
``pd_sweep_latency.png``, ``pd_sweep_goodput.png`` (about 12 minutes). Other options go through
to ``pdserve bench`` (later ones win, e.g. ``--sweep --rates 1,2``).

``--replot [--slo-ttft-ms MS] [--slo-tpot-ms MS]`` judges the stored sweep against another SLO
(goodput from its per-request samples) and writes its JSON and plots again, starting nothing.

``--smoke`` (CI, seconds): the same harness (proxy, streaming client, percentiles, table; the
sweep's open-loop sending, JSON and plots) against stand-in upstreams instead of vLLM; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from pd_serving.bench import bench_systems, render_table, replot_sweep, report_sweep
from pd_serving.cli import build_parser
from pd_serving.cli import main as pdserve_main
from pd_serving.launcher import free_port
from pd_serving.proxy import Backend, Dispatch, PdProxy, ProxyConfig, serve
from pd_serving.servers import Connector
from pd_serving.sweep import Slo, sweep_systems
from pd_serving.workload import LengthDist, plan_rate
from rich.console import Console

# The smoke run's stand-in upstreams are the tests' (packages/pd-serving/tests/stand_ins.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from stand_ins import MODEL, FakeUpstream

RESULTS = Path(__file__).parent / "results" / "pd_ttft.json"
TRANSPORT_RESULTS = Path(__file__).parent / "results" / "pd_transports.json"
SWEEP_RESULTS = Path(__file__).parent / "results" / "pd_sweep.json"
SWEEP = ["--compare", "--rates", "0.5,1,2,4", "--requests", "24"]


async def smoke_measure(plans: dict) -> tuple[list, list]:
    """The fixed-concurrency bench and the sweep against stand-ins of single, P and D."""
    single, p, d = FakeUpstream("single"), FakeUpstream("P", kv_params={}), FakeUpstream("D")
    for upstream in (single, p, d):
        upstream.token_delay_s = 0.002
        await upstream.start()
    proxy = PdProxy(
        ProxyConfig(
            prefill=[Backend(p.url, rpc_address="127.0.0.1:1", name="p0")],
            decode=[Backend(d.url, name="d0")],
            connector=Connector.HYBRID,
            dispatch=Dispatch.PARALLEL,
        )
    )
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    systems = [("single (stand-in)", single.url), ("1P1D (stand-in)", f"http://127.0.0.1:{port}")]
    try:
        results = await bench_systems(
            systems, MODEL, ["a", "b", "c", "d"], concurrency=2, max_tokens=4, prompt_tokens=1
        )
        points = await sweep_systems(systems, MODEL, plans, slo=Slo(1000, 50), warmup=1)
    finally:
        await runner.cleanup()
        for upstream in (single, p, d):
            await upstream.close()
    return results, points


def smoke() -> int:
    console = Console(width=160)
    with tempfile.TemporaryDirectory() as tmp:
        args = build_parser().parse_args(
            ["bench", "--rates", "20,40", "--requests", "6", "--json", f"{tmp}/sweep.json"]
        )
        fixed = LengthDist("fixed", 1), LengthDist("fixed", 4)
        plans = {
            rate: plan_rate(rate, 6, prompt_dist=fixed[0], output_dist=fixed[1], seed=0)
            for rate in args.rates
        }
        for plan in plans.values():
            for req in plan:
                req.prompt = f"prompt {req.index}"
        results, points = asyncio.run(smoke_measure(plans))
        console.print(render_table(results, "smoke: stand-in upstreams, numbers mean nothing"))
        assert all(r.requests == 4 for r in results)
        assert report_sweep(args, points, {"command": "bench_pd.py --smoke"}, console) == 0
        payload = json.loads(Path(args.json).read_text())
        assert [(p["rate"], p["completed"]) for p in payload["points"]] == [
            (20.0, 6),
            (20.0, 6),
            (40.0, 6),
            (40.0, 6),
        ]
        for name in ("sweep_latency.png", "sweep_goodput.png"):
            assert (Path(tmp) / name).read_bytes().startswith(b"\x89PNG")
    return 0


def replot(argv: list[str]) -> int:
    stored = json.loads(SWEEP_RESULTS.read_text())["meta"]["slo"]
    parser = argparse.ArgumentParser(prog="bench_pd.py --replot")
    parser.add_argument("--slo-ttft-ms", type=float, default=stored["ttft_ms"])
    parser.add_argument("--slo-tpot-ms", type=float, default=stored["tpot_ms"])
    args = parser.parse_args(argv)
    replot_sweep(SWEEP_RESULTS, Slo(args.slo_ttft_ms, args.slo_tpot_ms), Console(width=160))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--transports",
        action="store_true",
        help="hybrid 1P1D over kvt samehost against kvt tcp (pdserve bench --compare-transports)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the load sweep: pdserve bench " + " ".join(SWEEP) + f" --json {SWEEP_RESULTS.name}",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help=f"judge the stored {SWEEP_RESULTS.name} against [--slo-ttft-ms MS] [--slo-tpot-ms "
        "MS] (default: its own): tables, SLO-max-rate lines, JSON and plots again; starts nothing",
    )
    args, rest = parser.parse_known_args()
    if args.smoke:
        return smoke()
    if args.replot:
        return replot(rest)
    if args.sweep:
        return pdserve_main(["bench", *SWEEP, "--json", str(SWEEP_RESULTS), *rest])
    if args.transports:
        return pdserve_main(
            ["bench", "--compare-transports", "--json", str(TRANSPORT_RESULTS), *rest]
        )
    return pdserve_main(["bench", "--compare", "--json", str(RESULTS), *rest])


if __name__ == "__main__":
    sys.exit(main())
