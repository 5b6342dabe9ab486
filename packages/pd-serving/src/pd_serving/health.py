"""Health of the vLLM instances behind the proxy: a circuit breaker per instance (pure) and the
active health checker (the I/O shell that probes every instance and scrapes its load).

Circuit breaker, one per instance, fed events with an explicit ``now`` (seconds, monotonic)::

                 failure (fewer than N in a row)      success: the count restarts
                 +----+                               +----+
                 |    v                               |    v
              +----------+   N failures in a row   +--------+
    start --> |  CLOSED  | ----------------------> |  OPEN  | <------------------+
              +----------+                         +--------+                    |
                   ^                                   |  cool-down elapsed      |
                   |                                   v  (seen by any event)    |
                   |   the probe succeeds        +-----------+  the probe fails  |
                   +---------------------------- | HALF_OPEN | ------------------+
                                                 +-----------+
                                    lets exactly one request (the probe) through

- CLOSED: every request may go; ``failures`` consecutive failures (passive: a call failed;
  active: a health probe failed) open it. Consecutive rather than a failure rate: with the few
  requests per second of one small deployment a rate over a window is mostly noise, and a dead
  instance fails every call, so N in a row finds it within N calls or N probe intervals.
- OPEN: nothing goes for ``cooldown_s``; successes and failures that arrive meanwhile (requests
  that were in flight when it opened) change nothing.
- HALF_OPEN: once the cool-down has elapsed, the next ``acquire`` claims the one probe; any
  other caller is refused until the probe's outcome comes in. The first outcome after the
  cool-down decides, whether it is the probe request or an active health probe (so an instance
  restarted while no request tries it comes back in rotation with the next health check). A probe
  that never reports (a caller that forgot) is given up after another ``cooldown_s``.

Every event returns the transitions it caused (old state, new state, why), which is what the
proxy counts in /metrics. Failure kinds (:class:`FailureKind`) tell a dead instance (connection
refused) from a slow one (timeout) in the instance's status; both count as failures, since an
instance that does not answer within the probe timeout cannot serve either (a hung process, a
cut link).

The checker (:class:`HealthChecker`) is one asyncio task owned by the proxy (``start`` /
``close``): every ``interval_s`` it probes each instance's ``/health`` and scrapes its
``/metrics`` (``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``), all instances at once, each probe bounded by ``timeout_s``, and
reports to the :class:`~pd_serving.routing.Router` (``record_success`` / ``record_failure``,
``update_load``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class FailureKind(enum.StrEnum):
    REFUSED = "refused"  # nothing listens: the instance is dead (or not started yet)
    TIMEOUT = "timeout"  # no answer in time: slow, hung, or the link is cut
    HTTP_5XX = "http_5xx"  # it answered, with a server error
    BROKEN = "broken"  # the connection broke off (reset, EOF mid-answer)
    ERROR = "error"  # anything else


def failure_kind(exc: BaseException) -> FailureKind:
    """Classifies an exception of a call to an instance (for the caller's ``record_failure``)."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return FailureKind.TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return FailureKind.REFUSED
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return FailureKind.BROKEN
    if isinstance(exc, ConnectionError | aiohttp.ClientOSError):
        return FailureKind.BROKEN
    return FailureKind.ERROR


@dataclass(frozen=True)
class Transition:
    old: BreakerState
    new: BreakerState
    reason: str


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 5.0  # how long it stays open before one probe may go

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError("the breaker needs at least one failure to open")
        if self.cooldown_s < 0:
            raise ValueError("the cool-down cannot be negative")


class CircuitBreaker:
    """The breaker of one instance (diagram in the module docstring). No I/O, no clock of its
    own: every event gets ``now``."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.probe_since: float | None = None  # HALF_OPEN: when the probe was let through
        self.last_error: str | None = None
        self.last_error_kind: FailureKind | None = None
        self.last_success_at: float | None = None
        self.last_failure_at: float | None = None

    def _move(self, new: BreakerState, reason: str, out: list[Transition]) -> None:
        out.append(Transition(self.state, new, reason))
        self.state = new

    def _advance(self, now: float, out: list[Transition]) -> None:
        """Time-driven moves: OPEN -> HALF_OPEN after the cool-down; a lost probe given up."""
        cooldown = self.config.cooldown_s
        if self.state is BreakerState.OPEN:
            assert self.opened_at is not None
            if now >= self.opened_at + cooldown:
                self.probe_since = None
                self._move(BreakerState.HALF_OPEN, "cool-down elapsed", out)
        elif (
            self.state is BreakerState.HALF_OPEN
            and self.probe_since is not None
            and now >= self.probe_since + cooldown
        ):
            self.probe_since = None  # its outcome never came: let another probe go

    def _open(self, now: float, reason: str, out: list[Transition]) -> None:
        self.opened_at = now
        self.probe_since = None
        self._move(BreakerState.OPEN, reason, out)

    def available(self, now: float) -> bool:
        """Whether ``acquire`` would let a request through now (a query: changes nothing)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            assert self.opened_at is not None
            return now >= self.opened_at + self.config.cooldown_s
        return self.probe_since is None or now >= self.probe_since + self.config.cooldown_s

    def acquire(self, now: float) -> tuple[bool, list[Transition]]:
        """A request wants to go to this instance: allowed?, and the transitions on the way."""
        out: list[Transition] = []
        self._advance(now, out)
        if self.state is BreakerState.CLOSED:
            return True, out
        if self.state is BreakerState.HALF_OPEN and self.probe_since is None:
            self.probe_since = now
            return True, out
        return False, out

    def release(self) -> None:
        """The request that ``acquire`` let through was never sent (e.g. its P failed before its
        D was called): a half-open probe it held is free again. Nothing else changes."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_since = None

    def on_success(self, now: float) -> list[Transition]:
        out: list[Transition] = []
        self._advance(now, out)
        self.last_success_at = now
        if self.state is BreakerState.CLOSED:
            self.consecutive_failures = 0
        elif self.state is BreakerState.HALF_OPEN:
            self.consecutive_failures = 0
            self.probe_since = None
            self.opened_at = None
            self._move(BreakerState.CLOSED, "probe succeeded", out)
        return out

    def on_failure(
        self, now: float, why: str, kind: FailureKind = FailureKind.ERROR
    ) -> list[Transition]:
        out: list[Transition] = []
        self._advance(now, out)
        self.last_error = why
        self.last_error_kind = kind
        self.last_failure_at = now
        if self.state is BreakerState.CLOSED:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.config.failures:
                self._open(now, f"{self.consecutive_failures} failures in a row ({kind})", out)
        elif self.state is BreakerState.HALF_OPEN:
            self.consecutive_failures += 1
            self._open(now, f"probe failed ({kind})", out)
        return out

    @property
    def condition(self) -> str:
        """ok / slow (its last failure was a timeout) / dead (refused) / failing (other errors),
        as of the last event: a slow instance is alive but does not answer in time."""
        if self.state is BreakerState.CLOSED and self.consecutive_failures == 0:
            return "ok"
        if self.last_error_kind is FailureKind.TIMEOUT:
            return "slow"
        if self.last_error_kind is FailureKind.REFUSED:
            return "dead"
        return "failing"

    def describe(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "condition": self.condition,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_error_kind": self.last_error_kind.value if self.last_error_kind else None,
        }


# -- load from vLLM's /metrics --------------------------------------------------------------
@dataclass
class InstanceLoad:
    """What an instance's own /metrics say about its load (vLLM's gauges)."""

    waiting: int = 0  # vllm:num_requests_waiting
    running: int = 0  # vllm:num_requests_running
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1


_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name


def parse_load(text: str) -> InstanceLoad:
    """vLLM's prometheus text -> its load (sums over the engines/models of one server).
    Raises ValueError on text that is not prometheus exposition format."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (_WAITING, _RUNNING, *_KV_USAGE):
            totals[family.name] = totals.get(family.name, 0.0) + sum(
                s.value for s in family.samples if s.name == family.name
            )
    kv = next((totals[n] for n in _KV_USAGE if n in totals), 0.0)
    return InstanceLoad(
        waiting=int(totals.get(_WAITING, 0)),
        running=int(totals.get(_RUNNING, 0)),
        kv_usage=float(kv),
    )


# -- the active checker (I/O) ---------------------------------------------------------------
@dataclass(frozen=True)
class HealthCheckConfig:
    interval_s: float = 2.0  # time between two rounds of probes
    # per probe (/health and /metrics together); generous: on a loaded box a busy vLLM API
    # server answers late, and three late answers in a row take it out of rotation
    timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("health check interval and timeout must be positive")


class Probed(Protocol):
    """An instance as the checker sees it (routing.Backend)."""

    url: str


class HealthSink(Protocol):
    """Where probe results go (routing.Router); routing imports this module, not the reverse."""

    prefill: Sequence[Probed]
    decode: Sequence[Probed]

    def record_success(self, backend: Probed, now: float) -> None: ...
    def record_failure(self, backend: Probed, now: float, why: str, kind: FailureKind) -> None: ...
    def update_load(self, backend: Probed, load: InstanceLoad) -> None: ...


class HealthChecker:
    """One asyncio task probing every instance of ``router`` each ``interval_s``; owned by the
    proxy (``start`` / ``close``), on the proxy's ``session``."""

    def __init__(
        self,
        router: HealthSink,
        session: aiohttp.ClientSession,
        config: HealthCheckConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = router
        self.session = session
        self.config = config or HealthCheckConfig()
        self.clock = clock
        self.rounds = 0
        self.round_done = asyncio.Event()  # set after each round (tests wait on it)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="pdserve-health-checker")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.interval_s)  # timer-driven: the probe interval

    async def check_all(self) -> None:
        """One round: every instance probed at once."""
        backends = [*self.router.prefill, *self.router.decode]
        await asyncio.gather(*(self.check(b) for b in backends))
        self.rounds += 1
        self.round_done.set()
        self.round_done = asyncio.Event()

    async def check(self, backend: Probed) -> None:
        try:
            async with asyncio.timeout(self.config.timeout_s):
                async with self.session.get(f"{backend.url}/health") as resp:
                    await resp.read()
                    if resp.status >= 500:
                        self.router.record_failure(
                            backend,
                            self.clock(),
                            f"/health answered {resp.status}",
                            kind=FailureKind.HTTP_5XX,
                        )
                        return
                # vLLM answers 200, or 503 once its engine died; any other answer (a server
                # without /health) still shows a live HTTP server: alive, no load figures.
                load = await self._scrape(backend) if resp.status == 200 else None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure of a probe is a probe failure
            kind = failure_kind(exc)
            if kind is FailureKind.TIMEOUT:
                why = f"/health: no answer within {self.config.timeout_s:g} s"
            else:
                why = f"/health: {exc!r}"
            self.router.record_failure(backend, self.clock(), why, kind=kind)
            return
        self.router.record_success(backend, self.clock())
        if load is not None:
            self.router.update_load(backend, load)

    async def _scrape(self, backend: Probed) -> InstanceLoad | None:
        """Its load from /metrics; None (keep the old figures) if /metrics is missing or bad:
        that is no reason to take a healthy instance out of rotation."""
        async with self.session.get(f"{backend.url}/metrics") as resp:
            text = await resp.text()
            if resp.status != 200:
                return None
        try:
            return parse_load(text)
        except ValueError as exc:
            log.warning("%s/metrics is not prometheus text: %r", backend.url, exc)
            return None
