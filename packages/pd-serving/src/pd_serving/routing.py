"""Where one request goes: which P, which D, or straight to D (bypass).

The proxy asks the :class:`Router` for a :class:`Route` per request and per retry (``exclude``
names the instances that already failed this request) and reports every call's outcome back
(``record_success`` / ``record_failure``), which is what passive health checks and circuit
breakers are fed from. The router does no I/O itself: load figures and health come in as events
(``update_load``; the health checker in ``health.py`` is the I/O shell that scrapes them).

This module is the interface both the proxy (failover) and the routing policies (load, prefix,
bypass) build on; the first version only keeps today's behaviour: least in flight, round robin
on ties, never a bypass.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any


@dataclass
class InstanceLoad:
    """What an instance's own /metrics say about its load (vLLM's gauges)."""

    waiting: int = 0  # vllm:num_requests_waiting
    running: int = 0  # vllm:num_requests_running
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1


@dataclass
class Backend:
    """One vLLM instance behind the proxy."""

    url: str
    rpc_address: str | None = None  # P only: where D's connector sends transfer_kv
    name: str = ""
    inflight: int = 0
    load: InstanceLoad = field(default_factory=InstanceLoad)

    @property
    def key(self) -> str:
        return self.name or self.url

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "rpc_address": self.rpc_address,
            "inflight": self.inflight,
        }


@dataclass(frozen=True)
class RequestKey:
    """What routing may look at in a request, taken once by the proxy from the client's body."""

    prompt_text: str = ""  # the prompt, or the chat messages' contents joined
    prompt_token_ids: tuple[int, ...] = ()  # when the client sent token ids
    estimated_prompt_tokens: int = 0


@dataclass(frozen=True)
class Route:
    decode: Backend
    prefill: Backend | None  # None: D prefills locally (bypass, or no P configured/healthy)
    bypass_reason: str | None = None  # why no P ("short_prompt", "prefix_cached", "no_prefill")


class NoBackend(Exception):
    """No healthy instance of a role is left for this request."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} instance")
        self.role = role


class Router:
    """Picks instances; fed outcomes and load. Not thread-safe: used on the proxy's event loop."""

    def __init__(self, prefill: list[Backend], decode: list[Backend]) -> None:
        self.prefill = prefill
        self.decode = decode
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    def _least_loaded(
        self, role: str, backends: list[Backend], exclude: Collection[str]
    ) -> Backend | None:
        eligible = [b for b in backends if b.key not in exclude]
        if not eligible:
            return None
        start = next(self._turns[role]) % len(eligible)
        rotated = eligible[start:] + eligible[:start]
        return min(rotated, key=lambda b: b.inflight)

    def pick_prefill(self, key: RequestKey, exclude: Collection[str] = ()) -> Backend | None:
        """A P for this request, or None when no P is configured or healthy."""
        return self._least_loaded("prefill", self.prefill, exclude)

    def pick_decode(self, key: RequestKey, exclude: Collection[str] = ()) -> Backend:
        """A D for this request; raises NoBackend when none is left."""
        backend = self._least_loaded("decode", self.decode, exclude)
        if backend is None:
            raise NoBackend("decode")
        return backend

    def route(
        self,
        key: RequestKey,
        *,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Route:
        decode = self.pick_decode(key, exclude_decode)
        if not self.prefill:
            return Route(decode=decode, prefill=None, bypass_reason="no_prefill")
        prefill = self.pick_prefill(key, exclude_prefill)
        if prefill is None:
            return Route(decode=decode, prefill=None, bypass_reason="no_healthy_prefill")
        return Route(decode=decode, prefill=prefill)

    # -- events ---------------------------------------------------------------------------
    def record_success(self, backend: Backend, now: float) -> None:
        """A call to ``backend`` succeeded (passive health)."""

    def record_failure(self, backend: Backend, now: float, why: str) -> None:
        """A call to ``backend`` failed: connection refused/reset, 5xx, timeout (not a 4xx)."""

    def record_routed(self, key: RequestKey, route: Route) -> None:
        """The request was served along ``route`` (prefix affinity and D's prefix cache)."""

    def update_load(self, backend: Backend, load: InstanceLoad) -> None:
        backend.load = load
