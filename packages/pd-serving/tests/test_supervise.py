"""``pd_serving.supervise``: SIGTERM to an instance under ``pdserve up`` drains it through the
proxy before its vLLM gets SIGTERM. A stand-in child (a Python script reporting its signals)
and a stand-in proxy drain endpoint; real processes and signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from pd_serving.launcher import free_port

# Prints its pid, then waits; SIGTERM: writes the marker, exits 3; SIGINT: says so, exits 4.
CHILD = """
import os, signal, sys, threading
marker = sys.argv[1]
def term(*_):
    open(marker, "w").write("SIGTERM")
    os._exit(3)
signal.signal(signal.SIGTERM, term)
signal.signal(signal.SIGINT, lambda *_: os._exit(4))
print(os.getpid(), flush=True)
if len(sys.argv) > 2:
    os._exit(int(sys.argv[2]))
threading.Event().wait()
"""


class DrainEndpoint:
    """/admin/drain answering NDJSON once ``release`` is set; checks the child still runs."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.queries: list[dict[str, str]] = []
        self.child_pid: int | None = None
        self.child_alive_when_called: bool | None = None
        self.marker: Path | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.queries.append(dict(request.query))
        assert self.child_pid is not None
        assert self.marker is not None
        try:
            os.kill(self.child_pid, 0)
            self.child_alive_when_called = not self.marker.exists()
        except ProcessLookupError:
            self.child_alive_when_called = False
        self.called.set()
        out = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await out.prepare(request)
        await out.write(json.dumps({"phase": "draining", "moved": 0}).encode() + b"\n")
        await self.release.wait()
        await out.write(json.dumps({"phase": "drained", "moved": 2}).encode() + b"\n")
        await out.write_eof()
        return out


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[DrainEndpoint, str]]:
    drain = DrainEndpoint()
    app = web.Application()
    app.router.add_post("/admin/drain", drain.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield drain, f"http://127.0.0.1:{port}/admin/drain"
    finally:
        drain.release.set()
        await runner.cleanup()


async def _supervise(
    drain_url: str, marker: Path, *child_args: str
) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pd_serving.supervise",
        "--drain",
        drain_url,
        "--instance",
        "decode0",
        "--grace",
        "5",
        "--",
        sys.executable,
        "-c",
        CHILD,
        str(marker),
        *child_args,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    child_pid = int(await asyncio.wait_for(proc.stdout.readline(), 30))
    return proc, child_pid


async def test_sigterm_drains_through_the_proxy_before_vllm_stops(
    endpoint: tuple[DrainEndpoint, str], tmp_path: Path
) -> None:
    drain, url = endpoint
    marker = tmp_path / "child-got"
    drain.marker = marker
    proc, drain.child_pid = await _supervise(url, marker)
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(drain.called.wait(), 30)
    assert drain.queries == [{"instance": "decode0", "wait": "5"}]
    assert drain.child_alive_when_called, "vLLM was stopped before the drain"
    assert proc.returncode is None
    drain.release.set()  # drained: now the child gets its SIGTERM
    assert await asyncio.wait_for(proc.wait(), 30) == 3
    assert marker.read_text() == "SIGTERM"


async def test_an_unreachable_proxy_stops_the_instance_at_once(tmp_path: Path) -> None:
    marker = tmp_path / "child-got"
    closed = f"http://127.0.0.1:{free_port()}/admin/drain"
    proc, _ = await _supervise(closed, marker)
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 30) == 3
    assert marker.read_text() == "SIGTERM"


async def test_a_second_sigterm_stops_it_without_waiting_for_the_drain(
    endpoint: tuple[DrainEndpoint, str], tmp_path: Path
) -> None:
    drain, url = endpoint
    marker = tmp_path / "child-got"
    drain.marker = marker
    proc, drain.child_pid = await _supervise(url, marker)
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(drain.called.wait(), 30)
    proc.send_signal(signal.SIGTERM)  # the drain is still held
    assert await asyncio.wait_for(proc.wait(), 30) == 3


async def test_the_child_exiting_ends_it_with_the_child_code(tmp_path: Path) -> None:
    proc, _ = await _supervise("http://127.0.0.1:1/admin/drain", tmp_path / "m", "7")
    assert await asyncio.wait_for(proc.wait(), 30) == 7


async def test_sigint_is_passed_on(tmp_path: Path) -> None:
    proc, _ = await _supervise("http://127.0.0.1:1/admin/drain", tmp_path / "m")
    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), 30) == 4
