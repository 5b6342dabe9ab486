"""Where one request goes: which P, which D, or straight to D (bypass).

The proxy asks the :class:`Router` for a :class:`Route` per request and per retry (``exclude``
names the instances that already failed this request) and reports every call's outcome back
(``record_success`` / ``record_failure``: passive health, the circuit breakers of ``health.py``)
and every served request (``record_routed``: what each D has in its prefix cache). The router
does no I/O itself: load figures and active health come in as events (``update_load``; the
:class:`~pd_serving.health.HealthChecker` is the I/O shell that probes and scrapes).

The decisions, in order:

1. **Eligible** instances: not excluded for this request, not draining (``draining``), and
   their breaker lets a request through (closed, or half-open with its one probe free).
2. **Bypass to D, prefix cached**: the longest prompt prefix some eligible D served recently
   (a bounded LRU of prefix hashes per D, at every ``chunk`` boundary) leaves an uncached tail
   under ``bypass_below_tokens``: D prefills only that tail itself, no transfer. That D, unless
   it is overloaded (``prefix_overload`` more pending requests than the least-loaded D).
3. **Bypass to D, short prompt**: the prompt is under ``bypass_below_tokens`` (estimated):
   the least-loaded D prefills it; a transfer would cost more than it saves. **Bypass to an
   idle D**: a prompt under ``bypass_idle_below_tokens`` goes to D alone too when the proxy has
   no call open on that D nor on any P (the proxy's own counts: a scrape is seconds old). An
   idle D prefilling on all its cores beats P on fewer cores plus the transfer, and no decode
   is there to stall; under load D is busy and the prompt goes through P.
4. Otherwise **PD**: D by cached prefix (below), else by load; P by cached prefix, else by
   prefix affinity (rendezvous hashing of the prompt's first ``prefix_chars`` characters, or
   ``prefix_chars // 4`` token ids, over the eligible P's), the least-loaded P when the affine
   one is overloaded; no eligible P -> D prefills (``bypass_reason="no_healthy_prefill"``).
   **A P for idle times** (``Backend.when_idle``: one that shares the cores of the others, on
   more of them): it prefills while D and every P are idle (no call of the proxy open on them),
   and the other P's prefill otherwise (it takes over only when none of them is eligible). One
   prompt at a time it prefills on every core; under load it stays out of the way of D's decodes
   and of the P on fewer cores.

**Cached prefix** (with a :class:`~pd_serving.prefix_index.PrefixIndex`, fed by the instances'
KV-cache events; ``RoutingPolicy.cache_aware``): for the prompt's token ids (``RequestKey.
cache_tokens``) the index says how many leading tokens each eligible instance holds in its own
cache and in the shared store it is attached to. Each gets a value::

    cached = local + store_weight * max(0, store - local)            (tokens it need not compute)
    value  = cached - cache_load_tokens * (inflight - least inflight)

``inflight``: the requests the proxy has on the instance now. Instances more than
``prefix_overload`` in flight above the least-loaded one are out; the highest value wins, ties
by load (``score``), then round robin. The proxy's own count, not the scraped figures of
``score``: a scrape is seconds old, and the instance that just served a conversation's previous
turn still shows that turn running (and its blocks in use) there, which would steer the next
turn away from the one instance holding its context. ``cache_load_tokens`` is the bound that
keeps a hot prefix (a system prompt every request shares) from piling every request onto the
instance that cached it first: each request in flight more than the least-loaded instance's
outweighs that many cached tokens, so the others get requests and cache it too. The reason is
on the route (``Route.decode_cache`` / ``prefill_cache``): ``cached_prefix`` (the longest hit
won), ``balanced`` (a shorter hit, or none, won on load), or why the usual routing decided:
``overloaded`` (only busy instances hold a hit), ``no_match``, ``index_empty`` (nothing known
about these instances: no events yet, or forgotten), ``no_tokens`` (the request's token ids are
unknown, or it carries a ``cache_salt``, whose blocks match no plain prompt).

Load of an instance (lower is better): ``pending + waiting + kv_weight * kv_usage``, with
``pending = max(the proxy's own in-flight count, the instance's running + waiting)``: the
proxy's count is fresher than a scrape, a scrape also sees other clients' requests; waiting
requests count twice (they queue behind all running ones), a full KV cache (preemption) like
``kv_weight`` requests. Ties go round robin.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from pd_serving.health import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    FailureKind,
    InstanceLoad,
    Transition,
)
from pd_serving.prefix_index import CachedPrefix, PrefixIndex

# Characters per token when no tokenizer is asked (BPE on English text: about 4); the estimate
# only decides bypasses, never what vLLM computes.
CHARS_PER_TOKEN = 4


@dataclass
class Backend:
    """One vLLM instance behind the proxy."""

    url: str
    rpc_address: str | None = None  # P only: where D's connector sends transfer_kv
    name: str = ""
    # Where its vLLM publishes KV-cache events (zmq, e.g. tcp://host:5557); None: no events.
    kv_events: str | None = None
    # The shared KV store it loads from (the store's name); its "KVS" events name it.
    kv_store: str | None = None
    # P only: prefills only while D and every P are idle (module docstring).
    when_idle: bool = False
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
            "kv_events": self.kv_events,
            "kv_store": self.kv_store,
            "inflight": self.inflight,
            "when_idle": self.when_idle,
        }


@dataclass(frozen=True)
class RequestKey:
    """What routing may look at in a request, taken once by the proxy from the client's body."""

    prompt_text: str = ""  # the prompt, or the chat messages' contents joined
    prompt_token_ids: tuple[int, ...] = ()  # when the client sent token ids
    estimated_prompt_tokens: int = 0
    # The prompt as the engine computes it, when the proxy asked (a text prompt tokenized, a
    # chat templated); the client's own token ids need no asking.
    engine_token_ids: tuple[int, ...] = ()
    lora: str | None = None  # the LoRA adapter the request names, if it names one
    # False: the request's blocks are salted (cache_salt) and match nothing another request
    # cached, so the prefix index cannot tell where it is cached.
    cacheable: bool = True

    @property
    def cache_tokens(self) -> tuple[int, ...]:
        """The token ids the prefix index is asked about (empty: it cannot be asked)."""
        if not self.cacheable:
            return ()
        return self.prompt_token_ids or self.engine_token_ids

    @property
    def tokens(self) -> int:
        """Prompt tokens: exact for token ids, else the caller's estimate or chars / 4."""
        if self.prompt_token_ids:
            return len(self.prompt_token_ids)
        if self.engine_token_ids:
            return len(self.engine_token_ids)
        if self.estimated_prompt_tokens:
            return self.estimated_prompt_tokens
        return -(-len(self.prompt_text) // CHARS_PER_TOKEN)

    @property
    def empty(self) -> bool:
        return not self.prompt_text and not self.prompt_token_ids


def request_key(body: dict[str, Any]) -> RequestKey:
    """The routing view of a validated /v1/completions or /v1/chat/completions body."""
    prompt = body.get("prompt")
    cacheable = not body.get("cache_salt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return RequestKey(prompt_token_ids=tuple(prompt), cacheable=cacheable)
    else:
        # Chat: the contents in order; a later turn of a conversation extends an earlier one's
        # text, so its prefix matches (the chat template adds the same markers to both).
        parts: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(f"{message.get('role', '')}\n{content}")
            elif isinstance(content, list):
                texts = [c.get("text", "") for c in content if isinstance(c, dict)]
                parts.append(f"{message.get('role', '')}\n{''.join(texts)}")
        text = "\n".join(parts)
    return RequestKey(
        prompt_text=text,
        estimated_prompt_tokens=-(-len(text) // CHARS_PER_TOKEN),
        cacheable=cacheable,
    )


@dataclass(frozen=True)
class Route:
    decode: Backend
    prefill: Backend | None  # None: D prefills locally (bypass, or no P configured/healthy)
    # Why no P ("short_prompt", "prefix_cached", "idle", "no_prefill", ...).
    bypass_reason: str | None = None
    # How the prefix index decided D and P (module docstring); None: it was not asked.
    decode_cache: str | None = None
    prefill_cache: str | None = None


class NoBackend(Exception):
    """No healthy instance of a role is left for this request."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} instance")
        self.role = role


# `pdserve up` and `pdserve proxy`'s --bypass-below-tokens: what measured best on equal
# hardware (benchmarks/bench_equal_hw.py; README, "Low load"): a short prompt's TTFT 1.13x one
# instance's against 2.1x through P, and more goodput under the mixed load. RoutingPolicy()
# itself bypasses nothing: a Router built in code sends every prompt through P unless told.
DEFAULT_BYPASS_BELOW_TOKENS = 256


@dataclass(frozen=True)
class RoutingPolicy:
    """How the Router decides (``pdserve up/proxy`` flags of the same names; their defaults are
    these but for ``bypass_below_tokens``: ``DEFAULT_BYPASS_BELOW_TOKENS`` there)."""

    # Prompts (or a prefix-cached request's uncached tail) under this many tokens skip P;
    # 0 turns both bypasses off.
    bypass_below_tokens: int = 0
    # Prompts under this many tokens skip P too while D and every P are idle (no call of the
    # proxy open on them); 0 = off.
    bypass_idle_below_tokens: int = 0
    # Characters of the prompt hashed for P affinity (token ids: a quarter as many); 0 = off.
    prefix_chars: int = 256
    # The affine P (or D holding the prefix) is skipped when it has this many more pending
    # requests than the least-loaded one.
    prefix_overload: float = 4.0
    # Prefix hashes remembered per D (bounded LRU) for the prefix-cached bypass; 0 = off.
    decode_prefix_entries: int = 4096
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    kv_weight: float = 8.0
    # Route by the prefix index (instances' KV events) when the proxy has one.
    cache_aware: bool = True
    # A token the shared store holds counts this much of one in the instance's own cache (it
    # is loaded, not computed).
    store_weight: float = 0.9
    # Cached tokens one request in flight more than the least-loaded instance's outweighs.
    cache_load_tokens: float = 256.0

    def __post_init__(self) -> None:
        sizes = (
            self.bypass_below_tokens,
            self.bypass_idle_below_tokens,
            self.prefix_chars,
            self.decode_prefix_entries,
        )
        if min(sizes) < 0:
            raise ValueError("bypass, prefix and LRU sizes cannot be negative")
        if self.prefix_overload < 0 or self.kv_weight < 0:
            raise ValueError("prefix_overload and kv_weight cannot be negative")
        if not 0 <= self.store_weight <= 1 or self.cache_load_tokens < 0:
            raise ValueError("store_weight is within [0, 1]; cache_load_tokens is not negative")
        self.breaker  # noqa: B018 - BreakerConfig checks its own numbers

    @property
    def breaker(self) -> BreakerConfig:
        return BreakerConfig(failures=self.breaker_failures, cooldown_s=self.breaker_cooldown_s)


# Prefix hashes are taken every CHUNK units (characters of text, or token ids): 64 characters is
# about one 16-token KV block.
TEXT_CHUNK = 64
TOKEN_CHUNK = 16


def _units(key: RequestKey) -> tuple[bytes, int, int]:
    """(the prompt as bytes, bytes per unit, units per chunk) for hashing its prefixes."""
    if key.prompt_token_ids:
        data = b"".join(t.to_bytes(4, "little", signed=True) for t in key.prompt_token_ids)
        return b"t" + data, 4, TOKEN_CHUNK
    return b"s" + key.prompt_text.encode("utf-8", "surrogatepass"), 1, TEXT_CHUNK


def prefix_hashes(key: RequestKey) -> Iterator[tuple[int, bytes]]:
    """(units covered, hash) of every chunk-boundary prefix of the prompt, shortest first, the
    whole prompt last (O(length): one running hash, copied at each boundary)."""
    data, width, chunk = _units(key)
    total = (len(data) - 1) // width
    running = hashlib.blake2b(data[:1], digest_size=16)
    done = 0
    for end in range(chunk, total + 1, chunk):
        running.update(data[1 + done * width : 1 + end * width])
        done = end
        yield end, running.copy().digest()
    if done < total:
        running.update(data[1 + done * width :])
        yield total, running.digest()


def _tokens_of(key: RequestKey, units: int) -> int:
    return units if key.prompt_token_ids else -(-units // CHARS_PER_TOKEN)


def affinity_key(key: RequestKey, prefix_chars: int) -> bytes | None:
    """What P affinity hashes: the first ``prefix_chars`` characters (or a quarter as many token
    ids); None when the request carries no prompt."""
    if key.empty or prefix_chars <= 0:
        return None
    if key.prompt_token_ids:
        ids = key.prompt_token_ids[: max(1, prefix_chars // CHARS_PER_TOKEN)]
        return b"t" + b"".join(t.to_bytes(4, "little", signed=True) for t in ids)
    return b"s" + key.prompt_text[:prefix_chars].encode("utf-8", "surrogatepass")


def rendezvous_order(affinity: bytes, backends: list[Backend]) -> list[Backend]:
    """Highest random weight first: each (prefix, instance) pair gets a hash; taking an instance
    out moves only the prefixes it had to another one."""

    def weight(b: Backend) -> bytes:
        return hashlib.blake2b(affinity + b"\0" + b.key.encode(), digest_size=8).digest()

    return sorted(backends, key=weight, reverse=True)


class _PrefixLru:
    """Prefix hashes a D served recently, oldest evicted first (its prefix cache evicts too)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, None] = OrderedDict()

    def add(self, digest: bytes) -> None:
        self._entries[digest] = None
        self._entries.move_to_end(digest)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


TransitionCallback = Callable[[Backend, Transition], None]


class Router:
    """Picks instances; fed outcomes and load. Not thread-safe: used on the proxy's event loop."""

    def __init__(
        self,
        prefill: list[Backend],
        decode: list[Backend],
        policy: RoutingPolicy | None = None,
        *,
        on_transition: TransitionCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        index: PrefixIndex | None = None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.policy = policy or RoutingPolicy()
        self.on_transition = on_transition
        self.clock = clock
        # What the instances' caches hold (fed by kv_feed); instances with events are attached.
        self.index = index
        if index is not None:
            for backend in [*prefill, *decode]:
                if backend.kv_events is not None:
                    index.attach(backend.key, backend.kv_store)
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self._breakers = {b.key: CircuitBreaker(self.policy.breaker) for b in [*prefill, *decode]}
        self._cached = {b.key: _PrefixLru(self.policy.decode_prefix_entries) for b in decode}
        self.transitions: list[tuple[str, Transition]] = []  # every one so far, for /health
        # Instances being drained (triggers.Drains): no new request, no migration to them.
        self.draining: set[str] = set()

    # -- health -----------------------------------------------------------------------------
    def breaker(self, backend: Backend) -> CircuitBreaker:
        breaker = self._breakers.get(backend.key)
        if breaker is None:  # an instance added after construction
            breaker = self._breakers[backend.key] = CircuitBreaker(self.policy.breaker)
        return breaker

    def breaker_state(self, backend: Backend) -> BreakerState:
        return self.breaker(backend).state

    def _emit(self, backend: Backend, transitions: list[Transition]) -> None:
        for t in transitions:
            self.transitions.append((backend.key, t))
            del self.transitions[:-256]
            if t.new is BreakerState.OPEN:
                # Whatever it had cached is no longer a safe bet (it may have restarted).
                if backend.key in self._cached:
                    self._cached[backend.key].clear()
                if self.index is not None:
                    self.index.forget(backend.key)
            if self.on_transition is not None:
                self.on_transition(backend, t)

    def describe(self, backend: Backend) -> dict[str, Any]:
        """The instance for the proxy's /health: identity, breaker, load."""
        load = backend.load
        return {
            **backend.describe(),
            **self.breaker(backend).describe(),
            "load": {"waiting": load.waiting, "running": load.running, "kv_usage": load.kv_usage},
        }

    # -- load -------------------------------------------------------------------------------
    def score(self, backend: Backend) -> float:
        """Lower is less loaded (formula in the module docstring)."""
        load = backend.load
        pending = max(backend.inflight, load.running + load.waiting)
        return pending + load.waiting + self.policy.kv_weight * load.kv_usage

    def _eligible(
        self, backends: list[Backend], exclude: Collection[str], now: float
    ) -> list[Backend]:
        return [
            b
            for b in backends
            if b.key not in exclude
            and b.key not in self.draining
            and self.breaker(b).available(now)
        ]

    def _least_loaded(self, role: str, eligible: list[Backend]) -> Backend | None:
        if not eligible:
            return None
        scores = [self.score(b) for b in eligible]
        least = min(scores)
        tied = [b for b, s in zip(eligible, scores, strict=True) if s == least]
        return tied[next(self._turns[role]) % len(tied)]

    def _take(self, backend: Backend, now: float) -> bool:
        """Claim a request slot on ``backend`` (the half-open probe, if it is half-open)."""
        allowed, transitions = self.breaker(backend).acquire(now)
        self._emit(backend, transitions)
        return allowed

    def _pick(self, role: str, candidates: list[Backend], now: float) -> Backend | None:
        while candidates:
            chosen = self._least_loaded(role, candidates)
            assert chosen is not None
            if self._take(chosen, now):
                return chosen
            candidates = [b for b in candidates if b is not chosen]
        return None

    def _pick_affine(self, key: RequestKey, eligible: list[Backend], now: float) -> Backend | None:
        affinity = affinity_key(key, self.policy.prefix_chars)
        if affinity is None or len(eligible) < 2:
            return None
        least = min(self.score(b) for b in eligible)
        for candidate in rendezvous_order(affinity, eligible):
            if self.score(candidate) - least > self.policy.prefix_overload:
                return None  # the affine P is busy: least loaded instead
            if self._take(candidate, now):
                return candidate
        return None

    def pick_prefill(
        self, key: RequestKey, exclude: Collection[str] = (), now: float | None = None
    ) -> Backend | None:
        """A P for this request, or None when no P is configured or healthy."""
        return self._prefill_and_reason(key, exclude, now)[0]

    def _prefill_and_reason(
        self, key: RequestKey, exclude: Collection[str], now: float | None, *, idle: bool = False
    ) -> tuple[Backend | None, str | None]:
        now = self.clock() if now is None else now
        eligible = self._eligible(self.prefill, exclude, now)
        for_idle = [b for b in eligible if b.when_idle]
        if for_idle and idle:
            eligible = for_idle
        elif len(for_idle) < len(eligible):
            eligible = [b for b in eligible if not b.when_idle]
        cached, reason = self._pick_by_cache("prefill", key, eligible, now)
        if cached is not None:
            return cached, reason
        affine = self._pick_affine(key, eligible, now)
        if affine is not None:
            return affine, reason
        return self._pick("prefill", eligible, now), reason

    def pick_decode(
        self, key: RequestKey, exclude: Collection[str] = (), now: float | None = None
    ) -> Backend:
        """A D for this request; raises NoBackend when none is left."""
        now = self.clock() if now is None else now
        eligible = self._eligible(self.decode, exclude, now)
        backend = self._pick_by_cache("decode", key, eligible, now)[0]
        if backend is None:
            backend = self._pick("decode", eligible, now)
        if backend is None:
            raise NoBackend("decode")
        return backend

    # -- cached prefix ----------------------------------------------------------------------
    def cached_prefixes(
        self, key: RequestKey, backends: list[Backend]
    ) -> tuple[dict[str, CachedPrefix] | None, str | None]:
        """What the prefix index knows of ``key``'s prompt on ``backends``: (per backend key,
        None) or (None, why not; None when cache-aware routing is off)."""
        if self.index is None or not self.policy.cache_aware or not backends:
            return None, None
        names = [b.key for b in backends]
        if not self.index.holds_any(names):
            return None, "index_empty"
        tokens = key.cache_tokens
        if not tokens:
            return None, "no_tokens"
        return self.index.lookup(tokens, names, key.lora), None

    def _cached_tokens(self, hit: CachedPrefix) -> float:
        extra = max(0, hit.store_tokens - hit.local_tokens)
        return hit.local_tokens + self.policy.store_weight * extra

    def _pick_by_cache(
        self, role: str, key: RequestKey, eligible: list[Backend], now: float
    ) -> tuple[Backend | None, str | None]:
        """The instance the module docstring's values pick, and why; (None, why not)."""
        hits, reason = self.cached_prefixes(key, eligible)
        if hits is None:
            return None, reason
        cached = {b.key: self._cached_tokens(hits[b.key]) for b in eligible}
        if max(cached.values()) <= 0:
            return None, "no_match"
        inflight = {b.key: b.inflight for b in eligible}
        least = min(inflight.values())
        within = [b for b in eligible if inflight[b.key] - least <= self.policy.prefix_overload]
        longest = max(cached[b.key] for b in within)
        if longest <= 0:
            return None, "overloaded"
        weight = self.policy.cache_load_tokens
        values = {b.key: cached[b.key] - weight * (inflight[b.key] - least) for b in within}
        # Best value first; a half-open instance whose probe is taken gives way to the next.
        for value in sorted(set(values.values()), reverse=True):
            chosen = self._pick(role, [b for b in within if values[b.key] == value], now)
            if chosen is not None:
                return chosen, "cached_prefix" if cached[chosen.key] >= longest else "balanced"
        return None, "overloaded"

    # -- bypass -----------------------------------------------------------------------------
    def cached_tail(self, key: RequestKey, decode: Backend) -> int:
        """Estimated prompt tokens ``decode`` would prefill itself (what its cache lacks)."""
        lru = self._cached.get(decode.key)
        matched = 0
        if lru is not None and len(lru):
            for units, digest in prefix_hashes(key):
                if digest not in lru:
                    break
                matched = units
        total = len(key.prompt_token_ids) if key.prompt_token_ids else len(key.prompt_text)
        return _tokens_of(key, total - matched) if key.prompt_token_ids or key.prompt_text else 0

    def _pick_cached_decode(
        self, key: RequestKey, eligible: list[Backend], now: float
    ) -> Backend | None:
        threshold = self.policy.bypass_below_tokens
        hits = self.cached_prefixes(key, eligible)[0]
        if (self.policy.decode_prefix_entries <= 0 and hits is None) or key.empty or not eligible:
            return None
        total = key.tokens
        if total < threshold:
            return None  # short anyway: any D will do (least loaded)
        least = min(self.score(b) for b in eligible)
        best: tuple[int, Backend] | None = None
        for backend in eligible:
            if hits is not None:  # the index knows exactly; the LRU only estimates
                tail = len(key.cache_tokens) - hits[backend.key].tokens
            else:
                tail = self.cached_tail(key, backend)
            if tail < threshold and tail < total and (best is None or tail < best[0]):
                best = (tail, backend)
        if best is None or self.score(best[1]) - least > self.policy.prefix_overload:
            return None
        return best[1] if self._take(best[1], now) else None

    def route(
        self,
        key: RequestKey,
        *,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
        now: float | None = None,
    ) -> Route:
        now = self.clock() if now is None else now
        eligible_d = self._eligible(self.decode, exclude_decode, now)
        if self.policy.bypass_below_tokens > 0 and not key.empty:
            cached = self._pick_cached_decode(key, eligible_d, now)
            if cached is not None:
                return Route(decode=cached, prefill=None, bypass_reason="prefix_cached")
        decode, d_reason = self._pick_by_cache("decode", key, eligible_d, now)
        if decode is None:
            decode = self._pick("decode", eligible_d, now)
        if decode is None:
            raise NoBackend("decode")
        local = Route(decode=decode, prefill=None, decode_cache=d_reason)
        if not self.prefill:
            return replace(local, bypass_reason="no_prefill")
        if 0 < key.tokens < self.policy.bypass_below_tokens and not key.empty:
            return replace(local, bypass_reason="short_prompt")
        idle = decode.inflight == 0 and all(b.inflight == 0 for b in self.prefill)
        if 0 < key.tokens < self.policy.bypass_idle_below_tokens and not key.empty and idle:
            return replace(local, bypass_reason="idle")
        prefill, p_reason = self._prefill_and_reason(key, exclude_prefill, now, idle=idle)
        if prefill is None:
            return replace(local, bypass_reason="no_healthy_prefill")
        return Route(decode=decode, prefill=prefill, decode_cache=d_reason, prefill_cache=p_reason)

    # -- events ---------------------------------------------------------------------------
    def record_success(self, backend: Backend, now: float) -> None:
        """A call to ``backend`` succeeded (passive health), or its active probe did."""
        self._emit(backend, self.breaker(backend).on_success(now))

    def record_failure(
        self, backend: Backend, now: float, why: str, kind: FailureKind | str = FailureKind.ERROR
    ) -> None:
        """A call to ``backend`` failed: connection refused/reset, 5xx, timeout (not a 4xx).
        ``kind``: a :class:`~pd_serving.health.FailureKind` (``health.failure_kind(exc)``)."""
        self._emit(backend, self.breaker(backend).on_failure(now, why, FailureKind(kind)))

    def record_unused(self, backend: Backend) -> None:
        """``route`` chose ``backend`` but no call went to it (P failed before D was called):
        if that took its half-open probe, the probe is free for the next request."""
        self.breaker(backend).release()

    def record_routed(self, key: RequestKey, route: Route) -> None:
        """The request was served along ``route``: its prompt is now in D's prefix cache (with
        a P the KV was transferred into D's blocks, without one D computed it)."""
        lru = self._cached.get(route.decode.key)
        if lru is None or lru.capacity <= 0 or key.empty:
            return
        # Longest first, so the short prefixes (which every longer match needs) are the freshest.
        for _units_covered, digest in reversed(list(prefix_hashes(key))):
            lru.add(digest)

    def update_load(self, backend: Backend, load: InstanceLoad) -> None:
        backend.load = load
