"""The flame graph in a real headless Chromium, driven over the DevTools protocol: it loads
without script errors, renders frames with their sizes, and search, the inverted view and the
import / native / library switches change what it shows as the snapshot says they should."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import memprof
import pytest
from conftest import run_cli, run_user_sites
from memprof.native import find_jemalloc

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt install chromium)"
)
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("numpy")  # the workload allocates through numpy


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="memprof-browser-"))  # see conftest.tmp_path
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def page_and_snap(workdir) -> tuple[Path, memprof.Snapshot]:
    _, snap_path = run_user_sites(workdir / "snaps")
    html = workdir / "fg.html"
    run_cli("flamegraph", snap_path, "-o", str(html))
    return html, memprof.Snapshot.load(snap_path)


@pytest.fixture(scope="module")
def devtools(workdir) -> Iterator[str]:
    """A headless Chromium with its DevTools endpoint: yields http://127.0.0.1:<port>.
    The browser (its whole process group) is killed and its profile removed in every case."""
    profile = Path(tempfile.mkdtemp(prefix="memprof-chromium-"))
    args = [CHROMIUM, "--headless=new", "--remote-debugging-port=0",
            f"--user-data-dir={profile}", "--disable-gpu", "--no-first-run",
            "--no-default-browser-check", "--window-size=1400,900", "about:blank"]  # fmt: skip
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    found = threading.Event()
    endpoint: list[str] = []
    log: list[str] = []

    def read_stderr() -> None:  # the port is only known from Chromium's own log line
        for line in proc.stderr:
            log.append(line)
            if line.startswith("DevTools listening on ws://") and not endpoint:
                endpoint.append("http://" + line.split("ws://", 1)[1].split("/", 1)[0])
                found.set()
        found.set()  # stderr closed: the browser exited

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        found.wait(60)
        assert endpoint, "chromium did not start:\n" + "".join(log[-30:])
        yield endpoint[0]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            proc.wait(10)
        reader.join(10)
        proc.stderr.close()
        shutil.rmtree(profile, ignore_errors=True)


class Page:
    """One browser tab over the DevTools protocol (JSON messages on a websocket)."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self.loaded = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self.pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            else:
                self.events.append(data)
                if data.get("method") == "Page.loadEventFired":
                    self.loaded.set()

    async def send(self, method: str, **params) -> dict:
        msg_id = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = fut
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, 30)
        assert "error" not in reply, reply
        return reply["result"]

    async def js(self, expression: str):
        res = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in res, res
        return res["result"].get("value")

    async def open(self, url: str) -> None:
        """A fresh load of `url` (via about:blank: a change of the fragment alone would be a
        same-document navigation, without a load event)."""
        for target in ("about:blank", url):
            self.loaded.clear()
            await self.send("Page.navigate", url=target)
            await asyncio.wait_for(self.loaded.wait(), 30)

    def script_errors(self) -> list[dict]:
        return [
            e
            for e in self.events
            if e.get("method") == "Runtime.exceptionThrown"
            or (
                e.get("method") == "Runtime.consoleAPICalled"
                and e["params"].get("type") in ("error", "assert")
            )
        ]


async def _with_page(endpoint: str, body) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{endpoint}/json/new?about:blank") as resp:
            target = await resp.json(content_type=None)
        try:
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                try:
                    await page.send("Page.enable")
                    await page.send("Runtime.enable")
                    await body(page)
                finally:
                    page.reader.cancel()
        finally:
            async with http.get(f"{endpoint}/json/close/{target['id']}"):
                pass


def run_in_page(endpoint: str, body) -> None:
    asyncio.run(_with_page(endpoint, body))


FRAMES = "[...document.querySelectorAll('#g .frame')]"


def _frames_js(where: str = "true") -> str:
    return (
        f"{FRAMES}.filter(e => {where}).map(e => ({{name: e.dataset.name, "
        "bytes: +e.dataset.bytes, text: e.textContent, match: e.classList.contains('match'), "
        "top: parseInt(e.style.top)}))"
    )


def _stack_bytes(snap: memprof.Snapshot, pred) -> int:
    return sum(round(r.est_bytes) for r in snap.records if r.est_bytes > 0 and pred(r))


def test_page_loads_and_renders_frames_with_sizes(devtools, page_and_snap):
    html, snap = page_and_snap

    async def body(page: Page) -> None:
        await page.open(html.as_uri())
        assert page.script_errors() == []
        assert await page.js("window.__errors") == []
        frames = await page.js(_frames_js())
        assert len(frames) >= 20
        assert len(frames) == int(await page.js("document.body.dataset.frames"))
        root = frames[0]
        assert root["name"] == "all"
        assert root["bytes"] == _stack_bytes(snap, lambda r: True)
        # save_array holds numpy's 16 MB BytesIO buffer: its frame shows the bytes and share
        (save,) = [f for f in frames if f["name"] == "save_array"]
        expect = _stack_bytes(snap, lambda r: "save_array" in str(snap.stack(r.stack_id)))
        assert save["bytes"] == expect
        mib = expect / 2**20
        share = 100 * expect / root["bytes"]
        assert f"save_array{mib:.1f} MiB {share:.1f}%" in save["text"], save
        # the tooltip says the same, with the file and line
        await page.js(
            f"{FRAMES}.find(e => e.dataset.name === 'save_array')"
            ".dispatchEvent(new MouseEvent('mousemove', {clientX: 50, clientY: 50}))"
        )
        tip = await page.js("document.getElementById('tip').textContent")
        assert "user_sites.py:22" in tip
        assert f"live {mib:.1f} MiB" in tip
        assert page.script_errors() == []

    run_in_page(devtools, body)


def test_search_highlights_and_sums_the_matches(devtools, page_and_snap):
    html, snap = page_and_snap

    async def body(page: Page) -> None:
        await page.open(html.as_uri())
        await page.js(
            "(() => { const s = document.getElementById('search'); s.value = 'load_json';"
            " s.dispatchEvent(new Event('input')); })()"
        )
        frames = await page.js(_frames_js())
        matches = [f for f in frames if f["match"]]
        assert [f["name"] for f in matches] == ["load_json"]
        expect = _stack_bytes(snap, lambda r: "load_json" in str(snap.stack(r.stack_id)))
        assert int(await page.js("document.getElementById('matched').dataset.bytes")) == expect
        assert "search=load_json" in await page.js("location.hash")
        # a /regex/ from the URL fragment: both user functions, nothing else
        await page.open(html.as_uri() + "#search=/^(load_json|save_array)$/")
        names = {f["name"] for f in await page.js(_frames_js("e.classList.contains('match')"))}
        assert names == {"load_json", "save_array"}
        assert page.script_errors() == []

    run_in_page(devtools, body)


def test_inverted_view_and_import_switch(devtools, page_and_snap):
    html, snap = page_and_snap
    in_import = _stack_bytes(snap, lambda r: snap.stack(r.stack_id).in_import)
    total = _stack_bytes(snap, lambda r: True)
    assert in_import > 0.7 * 2000 * 4096  # imported_table's 8 MiB, at least

    async def body(page: Page) -> None:
        await page.open(html.as_uri() + "#view=inverted")
        first_row = {f["name"] for f in await page.js(_frames_js("parseInt(e.style.top) === 18"))}
        assert {"write_array", "JSONDecoder.raw_decode", "<listcomp>"} <= first_row
        assert "<module>" not in first_row or "save_array" not in first_row
        await page.js(
            "(() => { const c = document.getElementById('imports'); c.checked = true;"
            " c.dispatchEvent(new Event('change')); })()"
        )
        frames = await page.js(_frames_js())
        assert frames[0]["bytes"] == total - in_import
        assert not any(f["name"] == "<listcomp>" for f in frames)  # imported_table's table
        assert "imports=hide" in await page.js("location.hash")
        # library frames folded: importlib's frames are gone, the user's save_array is on top
        await page.open(html.as_uri() + "#view=inverted&lib=fold")
        top = {f["name"] for f in await page.js(_frames_js("parseInt(e.style.top) === 18"))}
        assert "save_array" in top
        assert not any(n.startswith("_find_and_load") for n in top)
        assert page.script_errors() == []

    run_in_page(devtools, body)


@pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc2 not installed")
def test_native_callers_view(devtools, workdir):
    native_run = ("--native", "--malloc-conf", "lg_prof_sample:16")
    _, snap_path = run_user_sites(workdir / "native", *native_run)
    html = workdir / "native.html"
    run_cli("flamegraph", snap_path, "-o", str(html))
    snap = memprof.Snapshot.load(snap_path)
    native = _stack_bytes(snap, lambda r: r.kind == 1)

    async def body(page: Page) -> None:
        await page.open(html.as_uri())
        names = {f["name"] for f in await page.js(_frames_js())}
        assert "[native allocation]" in names  # under its Python caller by default
        await page.open(html.as_uri() + "#view=native-callers&lib=fold")
        frames = await page.js(_frames_js())
        assert frames[0]["bytes"] == native
        first_row = {f["name"] for f in frames if f["top"] == 18}
        assert "make_ones" in first_row  # the user's caller of numpy's malloc
        await page.open(html.as_uri() + "#native=fold")
        assert "[native allocation]" not in {f["name"] for f in await page.js(_frames_js())}
        assert page.script_errors() == []

    run_in_page(devtools, body)
