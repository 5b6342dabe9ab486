"""One 1P1D deployment (`pdserve up` as a real child process) plus one single vLLM instance.

Both are started in parallel, once per test module, on the session's tiny model. Every test must
pass in any order (`nox -s e2e` shuffles them with pytest-random-order), so no test may end the
deployment or rely on what an earlier test left in a prefix cache.

Timeouts: each test function gets ``TEST_TIMEOUT_S`` (pytest-timeout, ``func_only``); starting
vLLM is a fixture and has its own allowance, ``STARTUP_TIMEOUT_S``, enforced by
``wait_all_ready`` (which also fails at once with the log tail if a child dies).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pd_serving.launcher import ManagedProcess, free_port, stop_all, wait_all_ready
from pd_serving.proxy import READY_LINE, Backend, Dispatch, PdProxy, ProxyConfig, serve
from pd_serving.servers import Connector, CpuSettings, Role, VllmServer

# HybridConnector is the default; PDSERVE_E2E_CONNECTOR=nixl runs the same suite on NIXL.
CONNECTOR = os.environ.get("PDSERVE_E2E_CONNECTOR", "hybrid")
DISPATCH = os.environ.get(
    "PDSERVE_E2E_DISPATCH", "parallel" if CONNECTOR == "hybrid" else "sequential"
)
STARTUP_TIMEOUT_S = 600.0
TEST_TIMEOUT_S = 240.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Fixture setup (vLLM start-up, once per module, in whichever test comes first) is bounded by
    # STARTUP_TIMEOUT_S instead: counted here it would make every test's limit ten minutes.
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S, func_only=True))


@dataclass
class Cluster:
    model: Path
    proxy_url: str
    single_url: str
    pdserve: ManagedProcess
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return str(self.model)


@pytest.fixture(scope="module")
def sequential_proxy_url(cluster: Cluster) -> Iterator[str]:
    """A second proxy, in this process, in front of the same P and D with sequential dispatch."""
    backends = [Backend(url) for url in cluster.decode_urls]
    with urllib.request.urlopen(f"{cluster.proxy_url}/health") as resp:
        health = json.load(resp)
    prefill = [Backend(b["url"], rpc_address=b["rpc_address"]) for b in health["prefill"]]
    proxy = PdProxy(
        ProxyConfig(
            prefill=prefill,
            decode=backends,
            connector=Connector(CONNECTOR),
            dispatch=Dispatch.SEQUENTIAL,
        )
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sequential-proxy", daemon=True)
    thread.start()
    port = free_port()
    runner = asyncio.run_coroutine_threadsafe(serve(proxy, "127.0.0.1", port), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def pdserve_up(model: Path, log_dir: Path) -> ManagedProcess:
    """`pdserve up` (1P1D) as a child process, not started yet; ready once its proxy listens."""
    port = free_port()
    return ManagedProcess(
        "pdserve",
        [
            sys.executable,
            "-m",
            "pd_serving.cli",
            "up",
            "--model",
            str(model),
            "--port",
            str(port),
            "--connector",
            CONNECTOR,
            "--dispatch",
            DISPATCH,
            "--log-dir",
            str(log_dir),
        ],
        log_path=log_dir / "pdserve.log",
        ready_marker=READY_LINE,
        health_url=f"http://127.0.0.1:{port}/health",
    )


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("pd-logs")
    pdserve = pdserve_up(tiny_model, log_dir)
    single = VllmServer(
        name="single0",
        model=tiny_model,
        role=Role.SINGLE,
        connector=None,
        log_dir=log_dir,
        cpu=CpuSettings(),
    )
    processes = [pdserve, single.make_process()]
    try:
        for proc in processes:
            proc.start()
        wait_all_ready(processes, STARTUP_TIMEOUT_S)
        assert pdserve.health_url is not None
        proxy_url = pdserve.health_url.removesuffix("/health")
        with urllib.request.urlopen(pdserve.health_url) as resp:
            health = json.load(resp)
        yield Cluster(
            model=tiny_model,
            proxy_url=proxy_url,
            single_url=single.url,
            pdserve=pdserve,
            prefill_urls=[b["url"] for b in health["prefill"]],
            decode_urls=[b["url"] for b in health["decode"]],
        )
    finally:
        stop_all(processes)
