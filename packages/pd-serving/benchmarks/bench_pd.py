"""TTFT/TPOT of 1P1D (HybridConnector and vLLM's NixlConnector) against one vLLM instance.

Full run (a few minutes; five vLLM instances on the tiny model, measured one system at a time):

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_pd.py

which is ``pdserve bench --compare`` writing ``benchmarks/results/pd_ttft.json``; with
``--transports`` it is ``pdserve bench --compare-transports`` (1P1D over kvt's same-host path
against kvt's TCP path) writing ``benchmarks/results/pd_transports.json``.

``--smoke`` (CI, seconds): the same harness (proxy, streaming client, percentiles, table) against
stand-in upstreams instead of vLLM; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from pd_serving.bench import bench_systems, render_table
from pd_serving.cli import main as pdserve_main
from pd_serving.launcher import free_port
from pd_serving.proxy import Backend, Dispatch, PdProxy, ProxyConfig, serve
from pd_serving.servers import Connector
from pd_serving.testing import MODEL, FakeUpstream
from rich.console import Console

RESULTS = Path(__file__).parent / "results" / "pd_ttft.json"
TRANSPORT_RESULTS = Path(__file__).parent / "results" / "pd_transports.json"


async def smoke() -> int:
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
    try:
        results = await bench_systems(
            [("single (stand-in)", single.url), ("1P1D (stand-in)", f"http://127.0.0.1:{port}")],
            MODEL,
            ["a", "b", "c", "d"],
            concurrency=2,
            max_tokens=4,
            prompt_tokens=1,
        )
    finally:
        await runner.cleanup()
        for upstream in (single, p, d):
            await upstream.close()
    Console().print(render_table(results, "smoke: stand-in upstreams, numbers mean nothing"))
    assert all(r.requests == 4 for r in results)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--transports",
        action="store_true",
        help="hybrid 1P1D over kvt samehost against kvt tcp (pdserve bench --compare-transports)",
    )
    args, rest = parser.parse_known_args()
    if args.smoke:
        return asyncio.run(smoke())
    if args.transports:
        return pdserve_main(
            ["bench", "--compare-transports", "--json", str(TRANSPORT_RESULTS), *rest]
        )
    return pdserve_main(["bench", "--compare", "--json", str(RESULTS), *rest])


if __name__ == "__main__":
    sys.exit(main())
