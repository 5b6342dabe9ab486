"""The end-to-end tests run against the session's xPyD deployment (``harness.pool``'s ``xpyd``:
``pdserve up --prefill 2 --decode 2`` as a real child process, its proxy included).

Every test must pass in any order, so no test may end the deployment (``test_shutdown`` does, and
is marked to run last) or rely on what an earlier test left in a prefix cache. The single
instance the answers are compared with is P1 asked directly (a plain request, no transfer).

Timeouts: each test function gets ``TEST_TIMEOUT_S`` (pytest-timeout, ``func_only``); starting
vLLM is a fixture and has its own allowance (``harness.pool.STARTUP_TIMEOUT_S``, enforced by
``wait_all_ready``, which also fails at once with the log tail if a child dies).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness.pool import Xpyd
from pd_serving.launcher import ManagedProcess, free_port
from pd_serving.proxy import PdProxy, serve

TEST_TIMEOUT_S = 240.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Fixture setup (vLLM start-up, once per session, in whichever test comes first) is bounded
    # by the harness instead: counted here it would make every test's limit ten minutes.
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
    xpyd: Xpyd
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return str(self.model)


@pytest.fixture
def cluster(xpyd: Xpyd) -> Cluster:
    return Cluster(
        model=xpyd.model,
        proxy_url=xpyd.proxy_url,
        single_url=xpyd.reference_url,
        pdserve=xpyd.pdserve,
        xpyd=xpyd,
        prefill_urls=xpyd.prefill_urls,
        decode_urls=xpyd.decode_urls,
    )


@pytest.fixture(scope="module")
def sequential_proxy_url(xpyd: Xpyd) -> Iterator[str]:
    """A second proxy, in this process, in front of the same P's and D's with sequential
    dispatch."""
    proxy = PdProxy(xpyd.proxy_config(dispatch="sequential"))
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
