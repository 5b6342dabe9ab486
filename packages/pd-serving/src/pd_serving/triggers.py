"""What starts live migrations: draining an instance, and rebalancing hot D's (the I/O shells).

``Drains`` serves the admin endpoints and runs one asyncio task per draining instance around
the pure ``drain.Drain``:

- ``POST /admin/drain?instance=NAME[&concurrency=N][&wait=S]``: the router stops sending the
  instance anything new at once (``Router.draining``); its streams migrate to other D's, at most
  ``concurrency`` at a time; the answer is the drain's report (``drain.Drain.report``). With
  ``wait`` the answer is a stream of reports (NDJSON, one line per change) that ends when the
  instance is drained or ``wait`` seconds passed.
- ``POST /admin/undrain?instance=NAME``: back in rotation.
- ``GET /admin/drain``: every drain's report.

The drain task wakes on events only: a call of the proxy's opening or closing on the instance
(``calls_changed``, from ``PdProxy._open``), a stream registering or leaving (``LiveStreams.
on_change``), a migration ending, and the retry time of a refused stream.

``Rebalancer`` (off by default; ``--rebalance``) runs after every round of the health checker
(``HealthChecker.round_done``): the pure ``rebalance.RebalancePolicy`` decides from the scraped
loads, it migrates one stream per ``migrate`` decision, and every decision is counted.

Imports nothing of ``proxy`` (it imports this module).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Gauge

from pd_serving.drain import Drain, DrainConfig, DrainPhase
from pd_serving.migration import Phase
from pd_serving.rebalance import DecodeLoad, RebalanceConfig, RebalancePolicy, Verdict
from pd_serving.routing import Backend, NoBackend

log = logging.getLogger(__name__)

_PHASE_LEVEL = {DrainPhase.DRAINING: 1, DrainPhase.DRAINED: 2, DrainPhase.RESUMED: 0}


class Drains:
    """The proxy's drains, by instance key; owned by the ``PdProxy`` (``close``)."""

    def __init__(self, proxy: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.proxy = proxy
        self.clock = clock
        self.config = proxy.config.drain
        self.drains: dict[str, Drain] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._logged: dict[str, float | None] = {}  # the drained time last logged, per instance
        self._wake: dict[str, asyncio.Event] = {}  # set on anything the drain task must see
        self.progress = asyncio.Event()  # replaced after each change (waiters re-read reports)
        registry = proxy.metrics.registry
        self.state = Gauge(
            "pdserve_instance_drain_state",
            "Drain state per instance: 0 serving, 1 draining, 2 drained",
            ["backend"],
            registry=registry,
        )
        self.migrations = Counter(
            "pdserve_drain_migrations",
            "Migrations started by a drain, by outcome (moved, refused, failed, no_target)",
            ["backend", "outcome"],
            registry=registry,
        )
        self.seconds = Gauge(
            "pdserve_drain_seconds",
            "Time the instance's last drain took, from its start to drained",
            ["backend"],
            registry=registry,
        )

    # -- hooks ------------------------------------------------------------------------------
    def calls_changed(self, backend: Backend) -> None:
        if (wake := self._wake.get(backend.key)) is not None:
            wake.set()

    def streams_changed(self, key: str) -> None:
        if (wake := self._wake.get(key)) is not None:
            wake.set()

    def phase(self, key: str) -> str:
        drain = self.drains.get(key)
        return "serving" if drain is None or drain.phase is DrainPhase.RESUMED else drain.phase

    def backend(self, name: str) -> Backend | None:
        for backend in [*self.proxy.config.decode, *self.proxy.config.prefill]:
            if name in (backend.key, backend.name, backend.url):
                return backend
        return None

    # -- drains -----------------------------------------------------------------------------
    def start(
        self, backend: Backend, config: DrainConfig | None = None, migrate: bool = True
    ) -> Drain:
        """Drain ``backend`` (a drain under way goes on as it is)."""
        drain = self.drains.get(backend.key)
        if drain is not None and drain.phase is not DrainPhase.RESUMED:
            return drain
        drain = Drain(backend.key, self.clock(), config or self.config, migrate=migrate)
        self.drains[backend.key] = drain
        self.proxy.router.draining.add(backend.key)
        self._wake[backend.key] = asyncio.Event()
        self.state.labels(backend.key).set(1)
        log.info("drain of %s: started (migrate=%s)", backend.key, migrate)
        self._step(drain, backend)  # drained at once when nothing runs there
        self._tasks[backend.key] = asyncio.create_task(
            self._run(drain, backend), name=f"pdserve-drain-{backend.key}"
        )
        return drain

    def undrain(self, backend: Backend) -> Drain | None:
        drain = self.drains.get(backend.key)
        self.proxy.router.draining.discard(backend.key)
        self.state.labels(backend.key).set(0)
        if drain is None:
            return None
        drain.undrain()
        if (wake := self._wake.get(backend.key)) is not None:
            wake.set()
        self._changed()
        log.info("drain of %s: undrained", backend.key)
        return drain

    async def wait(self, keys: list[str], timeout_s: float) -> bool:
        """Until every drain of ``keys`` is over (drained or undrained), or ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not all(self.drains[k].done for k in keys):
                    await self.progress.wait()
        return all(self.drains[k].done for k in keys)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def _run(self, drain: Drain, backend: Backend) -> None:
        wake = self._wake[backend.key]
        try:
            while drain.phase is not DrainPhase.RESUMED:
                wait_at = drain.wake_at()
                timeout = None if wait_at is None else max(0.0, wait_at - self.clock())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):  # a refused stream's retry time
                        await wake.wait()
                wake.clear()
                self._step(drain, backend)
        finally:
            self._changed()

    def _step(self, drain: Drain, backend: Backend) -> None:
        """Show the drain the instance as it is now; start the migrations it answers."""
        now = self.clock()
        current = set(self.proxy.live.streams.get(backend.key, ()))
        for stream in drain.tracked():
            if stream not in current:
                drain.stream_left(stream, now)
        for stream in current:
            if stream.plan.phase is Phase.STREAMING:
                drain.stream_seen(stream, now)
        drain.calls_open(self.proxy.open_on(backend), now)
        for stream in drain.next_migrations(now):
            self._migrate(drain, backend, stream)
        if drain.phase is DrainPhase.DRAINED:
            if drain.drained_at != self._logged.get(backend.key):
                self._logged[backend.key] = drain.drained_at
                self.seconds.labels(backend.key).set(drain.report(now)["elapsed_s"])
                log.info("drain of %s: drained: %s", backend.key, drain.report(now))
            self.state.labels(backend.key).set(2)
        elif drain.phase is DrainPhase.DRAINING:
            self.state.labels(backend.key).set(1)
        self._changed()

    def _migrate(self, drain: Drain, backend: Backend, stream: Any) -> None:
        wake = self._wake[backend.key]
        try:
            target = self.proxy.router.pick_decode(stream.flow.key, {backend.key})
        except NoBackend:
            self.migrations.labels(backend.key, "no_target").inc()
            drain.no_target(stream, "no other decode instance to migrate to", self.clock())
            return

        def ended(fut: asyncio.Future[dict[str, Any]]) -> None:
            result = fut.result() if not fut.cancelled() else {"outcome": "failed"}
            self.migrations.labels(backend.key, result["outcome"]).inc()
            drain.migration_ended(stream, result["outcome"], result.get("reason", ""), self.clock())
            wake.set()

        stream.migrate(target).add_done_callback(ended)

    def _changed(self) -> None:
        self.progress.set()
        self.progress = asyncio.Event()

    # -- the admin endpoints ------------------------------------------------------------------
    async def handle_drain(self, request: web.Request) -> web.StreamResponse:
        name = request.query.get("instance", "")
        backend = self.backend(name)
        if backend is None:
            return _error(404, f"no instance {name!r}")
        try:
            wait_s = float(request.query.get("wait", "0"))
            concurrency = int(request.query.get("concurrency", self.config.concurrency))
            config = DrainConfig(concurrency, self.config.max_attempts, self.config.retry_after_s)
        except ValueError as exc:
            return _error(400, f"bad drain parameter: {exc}")
        drain = self.start(backend, config)
        if wait_s <= 0:
            return web.json_response(drain.report(self.clock()))
        out = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await out.prepare(request)
        deadline = self.clock() + wait_s
        last: dict[str, Any] | None = None
        while True:
            progress = self.progress
            report = drain.report(self.clock())
            if {**report, "elapsed_s": 0} != last:
                await out.write(json.dumps(report).encode() + b"\n")
                last = {**report, "elapsed_s": 0}
            left = deadline - self.clock()
            if drain.done or left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await progress.wait()
        if not drain.done:
            await out.write(
                json.dumps({**drain.report(self.clock()), "timed_out": True}).encode() + b"\n"
            )
        await out.write_eof()
        return out

    async def handle_undrain(self, request: web.Request) -> web.Response:
        name = request.query.get("instance", "")
        backend = self.backend(name)
        if backend is None:
            return _error(404, f"no instance {name!r}")
        drain = self.undrain(backend)
        now = self.clock()
        return web.json_response(
            drain.report(now) if drain else {"instance": backend.key, "phase": "serving"}
        )

    async def handle_status(self, _request: web.Request) -> web.Response:
        now = self.clock()
        return web.json_response({"drains": [d.report(now) for d in self.drains.values()]})


class Rebalancer:
    """After each health round, migrates streams off D's far above the others (``--rebalance``)."""

    def __init__(
        self,
        proxy: Any,
        config: RebalanceConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proxy = proxy
        self.policy = RebalancePolicy(config or RebalanceConfig())
        self.clock = clock
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None
        registry = proxy.metrics.registry
        self.decisions = Counter(
            "pdserve_rebalance_decisions",
            "Rebalancing decisions per round and hot D: migrate, or why not (balanced, "
            "cooldown, no_stream, no_target, rate_limited, too_few)",
            ["decision"],
            registry=registry,
        )
        self.outcomes = Counter(
            "pdserve_rebalance_migrations",
            "Migrations the rebalancer started, by outcome (moved, refused, failed)",
            ["outcome"],
            registry=registry,
        )

    def start(self) -> None:
        if self._task is None and self.proxy.health is not None:
            self._task = asyncio.create_task(self._run(), name="pdserve-rebalancer")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await self.proxy.health.round_done.wait()  # fresh figures
            self.step()

    def step(self) -> list[Any]:
        """One round of decisions on the current figures; the migrations it started."""
        router, live = self.proxy.router, self.proxy.live
        now = self.clock()
        backends = {
            b.key: b
            for b in self.proxy.config.decode
            if b.key not in router.draining and router.breaker(b).available(now)
        }
        loads = {
            key: DecodeLoad(
                kv_usage=b.load.kv_usage,
                waiting=b.load.waiting,
                streams=sum(s.plan.phase is Phase.STREAMING for s in live.streams.get(key, ())),
            )
            for key, b in backends.items()
        }
        started = []
        for decision in self.policy.decide(now, loads):
            self.decisions.labels(decision.verdict.value).inc()
            if decision.verdict is not Verdict.MIGRATE:
                continue
            streams = sorted(
                (
                    s
                    for s in live.streams.get(decision.source, ())
                    if s.plan.phase is Phase.STREAMING
                ),
                key=lambda s: s.transfer_id,
            )
            log.info("rebalance: %s -> %s (%s)", decision.source, decision.target, decision.detail)
            outcome = streams[0].migrate(backends[decision.target])
            outcome.add_done_callback(
                lambda f: self.outcomes.labels(
                    "failed" if f.cancelled() else f.result()["outcome"]
                ).inc()
            )
            started.append(outcome)
        self.rounds += 1
        return started


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)
