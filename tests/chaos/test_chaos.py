"""The chaos suite: 2P2D HybridConnector, every instance and the proxy on a host (network
namespace) of its own, under a steady load of 8 streaming clients, while a P and then a D are
killed (``kill -9``; each time the busiest one, so requests are on it), both are restarted,
and the network between the other P and both D's is cut and restored.

Every request must complete token for token like the single instance or end with a clear error
(an HTTP error status or an SSE error event with finish_reason "error"), none past its deadline
(``load.py``). Afterwards: no KV blocks held on any instance, the restarted instances serve
requests through the proxy again, no process of any run left (group, namespace or vLLM child).
The counts (requests, completed, failed over, errors, TTFT p99 during faults) are printed and
written as JSON to ``$PDSERVE_CHAOS_REPORT`` (default: the test's tmp dir).

``PDSERVE_CHAOS_PHASE_S`` (default 8) is how long each fault (and the calm before and after)
lasts under load; the default is the CI slice, restarts of vLLM take most of the time.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest
from e2e.helpers import metric_sum, wait_idle, wait_until
from pd_serving.client import exact_length_prompt, load_tokenizer
from pd_serving.launcher import wait_all_ready
from pd_serving.servers import Role

from .cluster import HostedCluster, reference_answers
from .conftest import needs_chaos_session
from .load import FaultWindow, SteadyLoad, report

PHASE_S = float(os.environ.get("PDSERVE_CHAOS_PHASE_S", "8"))
CLIENTS = 8
MAX_TOKENS = 16
DEADLINE_S = 60.0
# D gives up a pull after this long and recomputes (the default, 60 s, is the whole deadline).
TRANSFER_TIMEOUT_S = 10.0
ATTEMPT_TIMEOUT_S = 20.0
PROMPT_LENGTHS = (40, 90, 130, 200, 260, 300, 350, 420)


async def _failovers(session: aiohttp.ClientSession, proxy_url: str) -> float:
    """The proxy's failover counter(s): every sample named ``pdserve_failover*``."""
    async with session.get(f"{proxy_url}/metrics") as resp:
        text = await resp.text()
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("pdserve_failover") and not s.name.endswith("_created")
    )


async def _busiest(
    session: aiohttp.ClientSession, cluster: HostedCluster, role: Role, within_s: float
) -> str:
    """The instance of ``role`` with the most running requests (waiting up to ``within_s`` for
    one to have any; then the last reading's busiest, ties to the first)."""

    async def running() -> dict[str, float]:
        return {
            inst.name: await metric_sum(session, inst.url, "vllm:num_requests_running")
            for inst in cluster.by_role(role)
        }

    reading = await wait_until(running, lambda r: max(r.values()) > 0, within_s=within_s)
    return max(reading, key=lambda name: reading[name])


@needs_chaos_session
@pytest.mark.timeout(1800)
async def test_2p2d_survives_kills_restarts_and_a_cut(
    netns_lab, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lab = netns_lab(["p0", "p1", "d0", "d1", "proxy"])
    cluster = HostedCluster(
        lab,
        tiny_model,
        tmp_path / "logs",
        prefill=2,
        decode=2,
        connector_config={"transfer_timeout_s": TRANSFER_TIMEOUT_S},
    )
    out_path = Path(os.environ.get("PDSERVE_CHAOS_REPORT", tmp_path / "chaos.json"))
    windows: list[FaultWindow] = []
    try:
        t0 = time.monotonic()
        await asyncio.to_thread(cluster.start)
        # An attempt that hangs (a cut link) fails over well inside the request's deadline.
        proxy_url = await asyncio.to_thread(
            cluster.start_proxy, ["--attempt-timeout-s", str(ATTEMPT_TIMEOUT_S)]
        )
        started_s = time.monotonic() - t0
        tokenizer = load_tokenizer(tiny_model)
        prompts = [
            exact_length_prompt(tokenizer, n, seed=5000 + i) for i, n in enumerate(PROMPT_LENGTHS)
        ]
        async with aiohttp.ClientSession() as session:
            expected = await reference_answers(
                session, cluster.single.url, cluster.model_name, prompts, MAX_TOKENS
            )
            await asyncio.to_thread(cluster.single_process.stop)  # its cores go to P and D
            failovers_before = await _failovers(session, proxy_url)

            load = SteadyLoad(
                proxy_url,
                cluster.model_name,
                prompts,
                expected,
                clients=CLIENTS,
                max_tokens=MAX_TOKENS,
                deadline_s=DEADLINE_S,
            )
            async with load:
                calm_from = time.monotonic()
                assert await load.wait_for(
                    lambda _: load.completed_since(calm_from) >= CLIENTS, within_s=120
                ), "the load never got going"
                await asyncio.sleep(PHASE_S)

                # Kill the instance that is busiest right now (routing may keep one idle:
                # a kill there would test nothing), a D with streams in flight.
                victim_p = await _busiest(session, cluster, Role.PREFILL, within_s=10)
                kill_p = FaultWindow(f"kill -9 {victim_p}", time.monotonic())
                windows.append(kill_p)
                await asyncio.to_thread(cluster.kill, victim_p)
                await asyncio.sleep(PHASE_S)

                victim_d = await _busiest(session, cluster, Role.DECODE, within_s=30)
                kill_d = FaultWindow(f"kill -9 {victim_d}", time.monotonic())
                windows.append(kill_d)
                await asyncio.to_thread(cluster.kill, victim_d)
                await asyncio.sleep(PHASE_S)

                restart = FaultWindow(f"restart {victim_p} + {victim_d}", time.monotonic())
                windows.append(restart)
                restarted = [cluster.restart(victim_p), cluster.restart(victim_d)]
                await asyncio.to_thread(wait_all_ready, restarted, 600.0)
                restart.ended = kill_p.ended = kill_d.ended = time.monotonic()
                restart_s = restart.ended - restart.started

                # Back in rotation: each restarted instance serves the proxy's requests again
                # (vLLM's counters start at zero with the new process).
                async def served() -> dict[str, float]:
                    return {
                        name: await metric_sum(
                            session, cluster.instances[name].url, "vllm:request_success_total"
                        )
                        for name in (victim_p, victim_d)
                    }

                rotation = await wait_until(
                    served, lambda s: all(v > 0 for v in s.values()), within_s=60
                )

                # The P that was not killed, cut off from both D's.
                (other_p,) = (i for i in cluster.by_role(Role.PREFILL) if i.name != victim_p)
                cut_host = other_p.host
                cut = FaultWindow(f"cut {other_p.name} <-> decode0, decode1", time.monotonic())
                windows.append(cut)
                for d in ("d0", "d1"):
                    lab.cut(cut_host, d)
                await asyncio.sleep(max(PHASE_S, TRANSFER_TIMEOUT_S + 2))
                for d in ("d0", "d1"):
                    lab.restore(cut_host, d)
                cut.ended = time.monotonic()
                await asyncio.sleep(PHASE_S)
            failed_over = await _failovers(session, proxy_url) - failovers_before
            served_per_instance = {
                name: await metric_sum(session, inst.url, "vllm:request_success_total")
                for name, inst in cluster.instances.items()
            }

            async def nudge_prefills() -> None:
                for inst in cluster.by_role(Role.PREFILL):
                    body = {"model": cluster.model_name, "prompt": "idle?", "max_tokens": 1}
                    async with session.post(f"{inst.url}/v1/completions", json=body) as resp:
                        resp.raise_for_status()

            idle = await wait_idle(
                session,
                [inst.url for inst in cluster.instances.values()],
                before_each=nudge_prefills,
            )
        summary = report(
            load.outcomes,
            windows,
            failed_over=failed_over,
            extra={
                "topology": "2P2D HybridConnector (kvt tcp), P/D/proxy in 5 network namespaces",
                "clients": CLIENTS,
                "max_tokens": MAX_TOKENS,
                "deadline_s": DEADLINE_S,
                "phase_s": PHASE_S,
                "startup_s": round(started_s, 1),
                "restart_s": round(restart_s, 1),
                "served_since_restart": rotation,
                "served_per_instance": served_per_instance,
                "idle_gauges": idle,
            },
        )
        out_path.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(out_path.write_text, json.dumps(summary, indent=2))
        with capsys.disabled():
            brief = {
                k: v for k, v in summary.items() if k not in ("violation_samples", "idle_gauges")
            }
            print(f"\nchaos report ({out_path}):\n{json.dumps(brief, indent=2)}")

        assert summary["violations"] == 0, json.dumps(summary["violation_samples"], indent=1)
        assert all(v > 0 for v in rotation.values()), f"restarted, not back in rotation: {rotation}"
        for url, gauges in idle.items():
            assert all(v == 0.0 for v in gauges.values()), (url, gauges)
        assert summary["completed"] > 0
    finally:
        for p in ("p0", "p1"):
            for d in ("d0", "d1"):
                lab.restore(p, d)
        await asyncio.to_thread(cluster.stop)
    assert cluster.survivors() == []
