"""KVS, scheduler half: which prefix the shared store has, what to load, what to save.

Per request, in vLLM's scheduler thread (a D request that pulls from P looks up and loads the
same way, through ``stored_tokens``; the pull brings only the blocks after the store's)::

    (new) --first get_num_new_matched_tokens: lookup sent--> LOOKING --answer or deadline--> KNOWN
    KNOWN --vLLM allocated, store has blocks past the local hit: KvsLoad--> LOADING
    LOADING --the worker copied them (finished_recving; failed: vLLM recomputes)--> RUNNING
    KNOWN --the same, in step: KvsLoad(in_step), the request runs this step--> RUNNING
        (the step's report, StepReport, ends the holds; failed blocks: vLLM recomputes)
    KNOWN --nothing to load--> RUNNING
    RUNNING --each step: blocks that become full and the store lacks: KvsSave--> RUNNING
    any --request_finished--> (gone); its saves still hold their block references

- **Nothing waits.** ``get_num_new_matched_tokens`` answers ``None`` (vLLM asks again at its next
  schedule) while the lookup, on the lookup thread, is out; a lookup not answered within
  ``lookup_timeout_s`` counts as a miss. A store that is down is a miss, logged once.
- **In-step loads** (``load_in_step``, a plain request of a model of one KV-cache group):
  vLLM is told the hit is not async, so the request is scheduled at once and computes the
  rest of its prompt in the step that admits it; the worker copies the hit from this node's
  pool into its blocks before that step's forward pass (no call, no network: the objects are
  held since the lookup, and a peer's were fetched here before it answered). No step waits
  for the load and no extra step sees it done. A failed one names its blocks and vLLM
  recomputes them (which vLLM can do for one group only); the holds end with the step's report
  (``load_finished``), also for a request that ended before it. A D request that pulls from P
  and a hybrid model's request load async, as a pull.
- **Saves hold their blocks.** A save's blocks get a reference in vLLM's pool when it is planned
  (``block_pool.touch``), so vLLM cannot hand them to another request, even after a preemption
  or the request's end, while the worker copies them; every TP rank reports the save done by
  SEND_DONE (as P's workers report sends, no step needed), and the reference goes at the next
  hook after all have (``drain``), or at shut down.
- **What is saved.** Every full block of a request's tokens (prompt and output, as vLLM's prefix
  cache keeps them) past the blocks the store already had at lookup. Blocks of a request whose
  tokens are not plain token ids (prompt embeddings, multimodal input) are never stored: their
  tokens do not name their bytes. A request whose ``kv_transfer_params`` say ``"kvs": false``
  is neither looked up nor saved.
- **State groups** (linear attention: GDN, Mamba; vLLM's ``mamba_cache_mode="align"``). vLLM
  keeps a request's recurrent state only at some block boundaries (where a step ended, or a
  prefill checkpoint): in the state group's block ``j`` (a prefix-cache entry: vLLM hashed it)
  is the state after token ``(j+1) * block_size``, every other block of the group is null or a
  running state. So a state object is saved for exactly the blocks vLLM hashed, and a lookup
  ends at the longest prefix whose every token object is stored and whose last block has its
  state object (``walk``). A hit of ``n`` blocks loads the token groups' blocks past the local
  hit and the state into the state group's block ``n-1``: where vLLM's own prefix hit of ``n``
  blocks has it, and where the worker's align-mode copy takes the running state from
  (``(num_computed_tokens - 1) // block_size``). A D request that pulls from P asks for the
  token groups' objects only (``tokens_only``): P's pull brings the state after the prompt,
  so any boundary will do and the load writes no state.
- **Events.** A save the workers finished becomes a vLLM ``BlockStored`` (medium ``"KVS"``,
  blocks named by their chain hash, with their tokens), a key the store dropped a
  ``BlockRemoved`` (``take_events``; vLLM publishes them with its own KV events).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_connector import kvs_keys
from hybrid_connector.config import KvsConfig
from hybrid_connector.layout import KvGroup
from hybrid_connector.metadata import NO_BLOCK, KvsLoad, KvsSave

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


MEDIUM = "KVS"
# A save's SEND_DONE names it "kvs-save:<id>" (P's name their request).
SAVE_REPORT_PREFIX = "kvs-save:"


def save_report_id(save_id: int) -> str:
    return f"{SAVE_REPORT_PREFIX}{save_id}"


def unsupported_reason(groups: Sequence[KvGroup], *, state_cache_mode: str = "none") -> str | None:
    """Why these KV-cache groups cannot be stored (None: they can). Checked at start-up: a
    configuration that cannot be stored whole is refused, never stored in part.
    ``state_cache_mode``: vLLM's ``cache_config.mamba_cache_mode``."""
    for group in groups:
        if group.family not in ("attention", "mla", "state"):
            return (
                f"a {group.family} KV-cache group ({len(group.layer_names)} layers) cannot be "
                "stored yet: KVS stores full-attention, MLA and linear-attention state caches"
            )
        if group.family == "state":
            if state_cache_mode != "align":
                return (
                    f"a state KV-cache group ({len(group.layer_names)} layers) with "
                    f"mamba_cache_mode {state_cache_mode!r}: vLLM then keeps only the running "
                    "state, never one at a block boundary; turn prefix caching on "
                    "(enable_prefix_caching, which sets mamba_cache_mode 'align')"
                )
            if group.num_speculative_blocks:
                return (
                    "a state KV-cache group with speculative blocks (speculative decoding "
                    "moves the kept states between blocks): turn speculative decoding off"
                )
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        return (
            f"KV-cache groups with different block sizes {sorted(sizes)} (a state group needs "
            "mamba_block_size = block_size)"
        )
    return None


# ============================================================================== lookups (I/O)
_PIN = "\0pin"  # a job of the lookup thread: pin these refs (no request id starts with NUL)
# Blocks whose load counts are remembered for the pin policy (oldest forgotten first).
LOAD_COUNTS = 65536


@dataclass
class LookupAnswer:
    # The token objects the store holds, leading ones in ``LookupPlan.tokens`` order: (ref,
    # index); those of blocks past ``blocks`` are held but not loadable.
    found: list[tuple[Any, int]]
    error: str = ""
    blocks: int = 0  # the hit: leading blocks with every object a load needs
    # The state objects of block ``blocks - 1`` (state groups only).
    states: list[tuple[Any, int]] = field(default_factory=list)
    stray: list[Any] = field(default_factory=list)  # found, held, of no use: to unhold


def held_refs(answer: LookupAnswer) -> list[Any]:
    """Every object an answer holds in the store (each once)."""
    return [ref for ref, _ in answer.found] + [ref for ref, _ in answer.states] + list(answer.stray)


@dataclass(frozen=True)
class LookupPlan:
    """What one lookup asks the store: the token objects of every usable block (block by
    block, ``per_block`` each) and, with state groups, each block's state objects."""

    tokens: list[bytes]
    per_block: int
    num_blocks: int
    states: list[list[bytes]] = field(default_factory=list)  # [] without state groups


def walk(lookup: Callable[[list[bytes]], list[Any]], plan: LookupPlan) -> LookupAnswer:
    """The longest prefix of ``plan``'s blocks the store can load, by ``lookup`` (refstore's:
    the leading keys that are bound, each found one held): the token objects' prefix first,
    then, with state groups, the last block of it whose state objects are all stored, from
    the longest down (states are kept only at some boundaries)."""
    refs = lookup(plan.tokens) if plan.tokens else []
    found = [(ref, getattr(ref, "index", 0)) for ref in refs]
    dense = len(found) // plan.per_block if plan.per_block else plan.num_blocks
    if not plan.states:
        return LookupAnswer(found, blocks=dense)
    stray: list[Any] = []
    for n in range(dense, 0, -1):
        keys = plan.states[n - 1]
        got = lookup(keys)
        if len(got) == len(keys):
            states = [(ref, getattr(ref, "index", 0)) for ref in got]
            return LookupAnswer(found, blocks=n, states=states, stray=stray)
        stray.extend(got)  # some ranks' objects only: no state
    return LookupAnswer(found, blocks=0, stray=stray)


# The lookup thread's first key subscription, at start-up (later ones: the client's timeout).
FIRST_SUBSCRIBE_TIMEOUT_S = 15.0


class Lookups:
    """The scheduler half's one connection to the store, on its own thread: lookups go in,
    answers come back into a dict the scheduler thread reads (no waiting on either side).

    ``connect``: makes a refstore client (called on the lookup thread; may raise). After a
    failure the next lookup reconnects, at most once per ``retry_s``; lookups in between are
    misses.

    Holds: the store keeps one hold per object and connection, and requests sharing a prefix
    find the same objects, so the lookup thread counts the answers holding each object and
    unholds it when the last of them gives it up (``unhold``), or when its answer is never
    read (``forget``: the request ended, or stopped waiting).
    """

    def __init__(
        self, connect: Callable[[], Any], *, hold_s: float, retry_s: float = 1.0, name: str = ""
    ) -> None:
        self._connect = connect
        self._hold_s = hold_s
        self._retry_s = retry_s
        self._client: Any = None
        # The store's key events (what it drops), on the client's own connection; read by the
        # scheduler thread (``key_events``), made and replaced by the lookup thread.
        self._subscription: Any = None
        self._down_until = 0.0
        self._warned = False
        # (request id, plan) to look up, (None, refs) to unhold, (_PIN, refs) to pin, None to
        # stop.
        self._jobs: queue.SimpleQueue[tuple[str | None, Any] | None] = queue.SimpleQueue()
        self._answers: dict[str, LookupAnswer] = {}
        self._pending: set[str] = set()  # submitted, not answered yet (nor forgotten)
        self._holding: collections.Counter[Any] = collections.Counter()  # lookup thread only
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._first_connect = threading.Event()  # the lookup thread's first connect, done
        self._thread = threading.Thread(
            target=self._main, name=f"hybrid-connector-kvs-lookup{name}", daemon=True
        )
        self._thread.start()

    def submit(self, request_id: str, plan: LookupPlan) -> None:
        with self._lock:
            self._pending.add(request_id)
        self._jobs.put((request_id, plan))

    def unhold(self, refs: list[Any]) -> None:
        """One answer gives these up (loaded, or not to be loaded): the store may evict them
        again once no other answer holds them."""
        if refs:
            self._jobs.put((None, refs))

    def pin(self, refs: list[Any]) -> None:
        """Soft-pin these (hot prefixes): the store evicts them only after every unpinned one."""
        if refs:
            self._jobs.put((_PIN, refs))

    def answer(self, request_id: str, wait_s: float = 0.0) -> LookupAnswer | None:
        """The lookup's answer if it is in, waiting at most ``wait_s`` for it (a condition
        wait: the lookup thread runs meanwhile, the caller's thread holds nothing)."""
        with self._answered:
            if wait_s > 0:
                self._answered.wait_for(lambda: request_id in self._answers, timeout=wait_s)
            return self._answers.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request no longer wants its answer: its holds go, now or when it comes."""
        with self._lock:
            answer = self._answers.pop(request_id, None)
            self._pending.discard(request_id)  # an answer still to come is given up on arrival
        if answer is not None:
            self.unhold(held_refs(answer))

    def wait_first_connect(self, timeout: float) -> bool:
        """Wait until the first connect to the store (and its key subscription) is done or
        failed (a readiness check: the connection is made on the lookup thread after start);
        False on timeout."""
        return self._first_connect.wait(timeout)

    @property
    def holding(self) -> int:
        """Objects the answers hold in the store now (a gauge; any thread may read it)."""
        return len(self._holding)

    def client(self) -> Any:
        """The lookup thread's client, connected if possible (None: the store is down)."""
        if self._client is not None:
            self._subscribe()
            return self._client
        now = time.monotonic()
        if now < self._down_until:
            return None
        try:
            self._client = self._connect()
        except Exception as exc:
            self._down_until = now + self._retry_s
            if not self._warned:
                self._warned = True
                log.warning("KVS: the store is not reachable (%s); lookups miss until it is", exc)
            return None
        if self._warned:
            log.info("KVS: the store is reachable again")
            self._warned = False
        self._subscribe()
        return self._client

    @property
    def subscribed(self) -> bool:
        """Whether the store's key events reach the lookups now (any thread may read it)."""
        sub = self._subscription
        return sub is not None and sub.alive

    def _subscribe(self, timeout: float | None = None) -> None:
        """Lookup thread: follow the store's key events (again, if the last feed ended)."""
        sub = self._subscription
        if sub is not None and sub.alive:
            return
        try:
            new = self._client.subscribe_keys(timeout)
        except Exception as exc:  # no events then: the store still serves lookups
            log.debug("KVS: no key events from the store (%s)", exc)
            return
        self._subscription = new
        if sub is not None:
            with contextlib.suppress(Exception):
                sub.close()

    def key_events(self) -> list[Any]:
        """The store's key events since the last call (never blocks; any thread)."""
        sub = self._subscription
        if sub is None:
            return []
        try:
            return list(sub.take())
        except Exception:
            return []

    def _lookup(self, plan: LookupPlan) -> LookupAnswer:
        client = self.client()
        if client is None:
            return LookupAnswer([], "store down")
        held: list[Any] = []

        def lookup(keys: list[bytes]) -> list[Any]:
            refs = client.lookup(keys, hold_s=self._hold_s)
            held.extend(refs)
            return refs

        try:
            return walk(lookup, plan)
        except Exception as exc:
            log.warning("KVS: lookup failed (%s); a miss", exc)
            if isinstance(exc, ConnectionError):  # the store answered nothing: reconnect later
                self._drop_client()
            else:  # a later call of the walk failed: what the earlier ones held goes
                # (unless another answer holds it too: the store keeps one hold for both)
                mine = [ref for ref in held if not self._holding[ref]]
                with contextlib.suppress(Exception):
                    client.unhold(mine)
            return LookupAnswer([], str(exc))

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        self._down_until = time.monotonic() + self._retry_s
        if client is not None:
            try:
                client.close()
            except Exception:
                log.debug("KVS: closing a failed client", exc_info=True)

    def _main(self) -> None:
        try:
            # Connect now: the first request must not pay for it. The first subscription may
            # take longer than a lookup (a store busy with instances starting beside this one):
            # one missed here would be made at the first lookup.
            if self.client() is not None:
                self._subscribe(FIRST_SUBSCRIBE_TIMEOUT_S)
        finally:
            self._first_connect.set()
        while (job := self._jobs.get()) is not None:
            request_id, items = job
            if request_id is None or request_id is _PIN:
                client = self._client
                if request_id is None:
                    items = self._last_holders_gone(items)
                if client is not None and items:
                    try:
                        if request_id is None:
                            client.unhold(items)
                        else:
                            client.pin(items)
                    except Exception as exc:  # holds lapse by themselves; a pin is a hint
                        log.debug("KVS: unhold or pin failed (%s)", exc)
                continue
            answer = self._lookup(items)  # type: ignore[arg-type]
            held = held_refs(answer)
            self._holding.update(held)
            with self._answered:
                late = request_id not in self._pending
                if not late:
                    self._pending.discard(request_id)
                    self._answers[request_id] = answer
                    self._answered.notify_all()
            if late and held:
                self._jobs.put((None, held))

    def _last_holders_gone(self, refs: list[Any]) -> list[Any]:
        """Lookup thread: one answer fewer holds each of ``refs``; those no answer holds."""
        gone = []
        for ref in refs:
            left = self._holding[ref] - 1
            if left > 0:
                self._holding[ref] = left
            else:
                self._holding.pop(ref, None)
                gone.append(ref)
        return gone

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
        sub, self._subscription = self._subscription, None
        if sub is not None:
            with contextlib.suppress(Exception):
                sub.close()
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                log.debug("KVS: closing the lookup client", exc_info=True)


# ============================================================================== the planner
@dataclass
class _Request:
    request: Request
    chains: list[bytes] = field(default_factory=list)
    asked_at: float = 0.0
    answer: LookupAnswer | None = None
    store_blocks: int = 0  # the store's hit at lookup (blocks a load may take)
    # Per block of the hit (from ``sources_from``): the objects a load reads, in
    # ``kvs_keys.block_objects`` order; each is held until loaded or given up.
    sources: list[list[tuple[Any, int]]] = field(default_factory=list)
    sources_from: int = 0
    # Per group: blocks [0, saved_upto[g]) are in the store or being saved.
    saved_upto: list[int] = field(default_factory=list)
    local_tokens: int = 0  # vLLM's local prefix hit, as last told
    polled: bool = False  # vLLM asked for the lookup's answer at least once
    # The lookup's answer was used (loaded, or its holds given up): a request scheduled again
    # (preempted) does not load from it a second time.
    spent: bool = False
    loading: bool = False
    # A D request that pulls from P: the pull brings P's state, so the store is asked for the
    # token groups' blocks only and a load writes no state.
    tokens_only: bool = False
    # Its load is copied in the step that admits it (vLLM was told so: not async).
    in_step: bool = False
    # vLLM finished it while its in-step load was still out (forgotten once reported).
    request_gone: bool = False


@dataclass
class _Save:
    request_id: str
    blocks: list[Any]  # vLLM KVCacheBlocks referenced for the save (every group)
    chains: list[bytes]
    parent: bytes | None
    tokens: list[int]
    ranks: set[int] = field(default_factory=set)  # the TP ranks that reported it done


class KvsScheduler:
    """The scheduler half's KVS decisions (see the module docstring)."""

    def __init__(
        self,
        config: KvsConfig,
        groups: Sequence[KvGroup],
        *,
        block_size: int,
        tp_size: int,
        identity: kvs_keys.ModelIdentity,
        lookups: Lookups | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._groups = list(groups)
        self._block_size = block_size
        self._tp_size = tp_size
        self._root = kvs_keys.root_key(identity, self._groups)
        self._has_state = any(kvs_keys.is_state(g) for g in self._groups)
        # vLLM recovers a failed in-step load by the blocks it names, with one group only.
        self._in_step = config.load_in_step and len(self._groups) == 1 and not self._has_state
        self._objects = kvs_keys.block_objects(self._groups, tp_size)
        self._lookups = lookups
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._saves: dict[int, _Save] = {}
        self._next_save = 0
        self._manager: KVCacheManager | None = None
        self._events: list[Any] = []
        # SEND_DONE reports of saves (server thread), taken in by ``drain``.
        self._reports: list[tuple[int, int]] = []
        self._reports_lock = threading.Lock()
        self.counters: dict[str, int] = {
            "lookups": 0,
            "lookup_misses": 0,
            "hit_blocks": 0,
            "loads": 0,
            "saves": 0,
            "saved_blocks": 0,
            "pinned_blocks": 0,
        }
        self._load_counts: dict[bytes, int] = {}

    @property
    def root(self) -> bytes:
        return self._root

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._manager = manager

    # ------------------------------------------------------------------ lookup
    def _chains(self, tracked: _Request) -> list[bytes]:
        request = tracked.request
        tracked.chains = kvs_keys.chain(
            self._root,
            request.all_token_ids,
            self._block_size,
            start=tracked.chains,
            cache_salt=getattr(request, "cache_salt", None),
            lora_name=_lora_name(request),
        )
        return tracked.chains

    def _storable(self, request: Request) -> bool:
        """Plain token ids (their tokens name their bytes), and not opted out by the request
        (``kv_transfer_params: {"kvs": false}``: a prompt that must not be stored)."""
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get("kvs") is False:
            return False
        return request.prompt_token_ids is not None and not getattr(request, "mm_features", None)

    def _plan(self, chains: list[bytes], tokens_only: bool = False) -> LookupPlan:
        tokens, per_block = kvs_keys.token_keys(chains, self._groups, self._tp_size)
        states = (
            [kvs_keys.state_keys(c, self._groups, self._tp_size) for c in chains]
            if self._has_state and not tokens_only
            else []
        )
        return LookupPlan(tokens, per_block, len(chains), states)

    def get_num_new_matched_tokens(
        self,
        request: Request,
        num_computed_tokens: int,
        tokens_only: bool = False,
        pulls: bool = False,
    ) -> tuple[int | None, bool]:
        """vLLM's hook: (tokens the store adds to the local hit, whether they load async); None
        while the lookup is out. ``pulls``: a D request that pulls the rest from P (its load is
        async, done with the pull)."""
        request_id = request.request_id
        tracked = self._requests.get(request_id)
        if tracked is None:
            if not self._storable(request):
                return 0, False
            tracked = self._requests[request_id] = _Request(
                request, tokens_only=tokens_only, in_step=self._in_step and not pulls
            )
            chains = self._chains(tracked)
            # The last prompt token is computed here (to sample), so no lookup for a prompt
            # of under one block and one token.
            usable = (request.num_prompt_tokens - 1) // self._block_size
            if not self._config.load or self._lookups is None or usable == 0:
                self._take_answer(tracked, LookupAnswer([]))
            else:
                self._lookups.submit(request_id, self._plan(chains[:usable], tokens_only))
                tracked.asked_at = self._clock()
                self.counters["lookups"] += 1
        if tracked.answer is None:
            assert self._lookups is not None
            # The first ask waits a moment: a local store answers in well under a millisecond,
            # and vLLM would otherwise ask again only after another turn of its busy loop.
            first = not tracked.polled
            tracked.polled = True
            answer = self._lookups.answer(request_id, self._config.lookup_wait_s if first else 0.0)
            if answer is None:
                if self._clock() - tracked.asked_at < self._config.lookup_timeout_s:
                    return None, False
                answer = LookupAnswer([], "lookup timed out")
                self._lookups.forget(request_id)
            self._take_answer(tracked, answer)
            if not tracked.store_blocks:
                self.counters["lookup_misses"] += 1
        if tracked.loading or tracked.spent:
            return 0, False
        tracked.local_tokens = num_computed_tokens
        hit_tokens = tracked.store_blocks * self._block_size
        count = hit_tokens - num_computed_tokens
        if count < self._config.min_load_blocks * self._block_size:
            self._unhold(tracked, 0, 0)  # nothing to load: every hold goes
            return 0, False
        return count, not tracked.in_step

    def _take_answer(self, tracked: _Request, answer: LookupAnswer) -> None:
        """The lookup's answer: the hit's objects per block, what is already stored per group;
        held objects no load can use are given up at once."""
        tracked.answer = answer
        _, per_block = kvs_keys.token_keys([], self._groups, self._tp_size)
        hit = answer.blocks
        found = answer.found
        sources = [found[j * per_block : (j + 1) * per_block] for j in range(hit)]
        if hit and answer.states:
            sources[-1] = _merge(self._objects, self._groups, sources[-1], answer.states)
        tracked.sources, tracked.sources_from = sources, 0
        tracked.store_blocks = hit
        dense = len(found) // per_block if per_block else hit
        tracked.saved_upto = [hit if kvs_keys.is_state(g) else dense for g in self._groups]
        unused = [ref for ref, _ in found[hit * per_block :]] + list(answer.stray)
        if unused and self._lookups is not None:
            self._lookups.unhold(unused)

    def stored_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """D, a request that pulls from P: the prompt tokens the local hit and the store hold
        together (None while the lookup is out); ``update_state_after_alloc`` then loads the
        store's part of them. With state groups only the token groups' blocks count: the pull
        brings P's state after the prompt, which supersedes any stored one."""
        count, _ = self.get_num_new_matched_tokens(
            request, num_computed_tokens, tokens_only=self._has_state, pulls=True
        )
        if count is None:
            return None
        return num_computed_tokens + count

    def _unhold(self, tracked: _Request, first: int, last: int) -> None:
        """Give up the lookup's holds on the blocks outside [first, last) (those not loaded)."""
        if tracked.answer is None or self._lookups is None:
            return
        base = tracked.sources_from
        sources = tracked.sources
        lo, hi = max(first - base, 0), max(last - base, 0)
        unused = sources[:lo] + sources[hi:]
        tracked.sources, tracked.sources_from = sources[lo:hi], base + lo
        tracked.spent = True
        self._lookups.unhold([ref for entries in unused for ref, _ in entries])

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> KvsLoad | None:
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.answer is None or tracked.spent:
            return None
        if num_external_tokens <= 0:
            self._unhold(tracked, 0, 0)
            return None
        first = tracked.local_tokens // self._block_size
        end = tracked.local_tokens + num_external_tokens
        last = min(-(-end // self._block_size), tracked.store_blocks)
        if last <= first:
            return None
        self._unhold(tracked, first, last)
        sources = tracked.sources  # now only blocks [first, last)
        tracked.loading = True
        block_ids: list[list[int]] = []
        for group, held in zip(self._groups, blocks.blocks, strict=True):
            if not kvs_keys.is_state(group):
                block_ids.append([b.block_id for b in held[first:last]])
                continue
            if tracked.tokens_only:
                block_ids.append([NO_BLOCK] * (last - first))  # the pull brings the state
                continue
            # The stored state is the one after the hit's last token: it goes where vLLM
            # looks for the state of a prefix of ``last`` blocks, the group's block last-1.
            state = held[last - 1] if last - 1 < len(held) else None
            if end != tracked.store_blocks * self._block_size or state is None or state.is_null:
                self._release_holds(tracked)
                log.warning(
                    "KVS: request %s: vLLM took %d tokens of a %d-token hit (no block for "
                    "the state there); vLLM recomputes it",
                    request.request_id,
                    end,
                    tracked.store_blocks * self._block_size,
                )
                return KvsLoad(request.request_id, [], [], [], error="no state block")
            block_ids.append([NO_BLOCK] * (last - first - 1) + [state.block_id])
        self.counters["loads"] += 1
        self.counters["hit_blocks"] += last - first
        self._count_loads(tracked.chains[first:last], sources)
        return KvsLoad(
            request_id=request.request_id,
            block_ids=block_ids,
            chains=tracked.chains[first:last],
            sources=sources,
            in_step=tracked.in_step,
        )

    def _count_loads(self, chains: list[bytes], sources: list[list[tuple[Any, int]]]) -> None:
        """Hot prefixes: a block loaded by ``pin_after_loads`` requests is soft-pinned (a
        system prompt outlives the cold tails LRU would otherwise keep in its place)."""
        threshold = self._config.pin_after_loads
        if threshold <= 0 or self._lookups is None:
            return
        counts = self._load_counts
        to_pin = []
        for chain, entries in zip(chains, sources, strict=True):
            n = counts.pop(chain, 0) + 1
            counts[chain] = n  # most recent last
            if n == threshold:
                to_pin.extend(ref for ref, _ in entries)
                self.counters["pinned_blocks"] += 1
        while len(counts) > LOAD_COUNTS:
            counts.pop(next(iter(counts)))
        self._lookups.pin(to_pin)

    def load_finished(self, request_id: str) -> None:
        """The workers copied a request's blocks: the lookup's holds on them end now. Holds are
        the lookup client's own (the store keeps them per connection), so they are given up
        here, not by the workers that read the objects."""
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.loading = False
            self._release_holds(tracked)
            if tracked.request_gone:
                del self._requests[request_id]

    def _release_holds(self, tracked: _Request) -> None:
        """Every hold the request's answer still has (the blocks it loads) goes."""
        sources, tracked.sources = tracked.sources, []
        if sources and self._lookups is not None:
            self._lookups.unhold([ref for entries in sources for ref, _ in entries])

    # ------------------------------------------------------------------ saves
    def plan_saves(self, scheduler_output: SchedulerOutput) -> list[KvsSave]:
        """The blocks this step fills that the store lacks: referenced now, saved by the
        workers after the step (they read them once the forward pass wrote them)."""
        if not self._config.save or self._manager is None:
            return []
        saves = []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, n in scheduled.items():
            tracked = self._requests.get(request_id)
            if tracked is None or tracked.answer is None:
                continue
            request = tracked.request
            computed = min(request.num_computed_tokens + n, len(request.all_token_ids))
            full = computed // self._block_size
            first = min(tracked.saved_upto)
            if full <= first:
                continue
            chains = self._chains(tracked)
            full = min(full, len(chains))
            picked = self._pick(tracked, self._manager.get_blocks(request_id).blocks, first, full)
            if picked is None:
                continue  # not all of them are real blocks (a group dropped some): never save half
            tracked.saved_upto = [max(upto, full) for upto in tracked.saved_upto]
            flat = [b for p in picked for b in p if b is not None]
            if not flat:
                continue  # nothing new: a state group's blocks in between are not kept
            save_id = self._next_save
            self._next_save += 1
            self._manager.block_pool.touch(flat)
            tokens = list(request.all_token_ids[first * self._block_size : full * self._block_size])
            self._saves[save_id] = _Save(
                request_id,
                flat,
                chains[first:full],
                chains[first - 1] if first else None,
                tokens,
            )
            saves.append(
                KvsSave(
                    save_id=save_id,
                    block_ids=[[NO_BLOCK if b is None else b.block_id for b in p] for p in picked],
                    chains=chains[first:full],
                )
            )
            self.counters["saves"] += 1
            self.counters["saved_blocks"] += full - first
        return saves

    def _pick(
        self, tracked: _Request, held_by_group: Sequence[Sequence[Any]], first: int, full: int
    ) -> list[list[Any]] | None:
        """Per group, the blocks [first, full) to save (None where that group saves nothing
        for a block: stored already, or a state vLLM did not keep); None if a token group
        lacks a real block."""
        picked = []
        for group, held, upto in zip(self._groups, held_by_group, tracked.saved_upto, strict=True):
            start = min(max(first, upto), full)
            row: list[Any] = [None] * (start - first)
            if kvs_keys.is_state(group):
                # vLLM hashed exactly the blocks whose state it keeps (a prefix-cache entry:
                # the state after the block's last token); the rest are null or running.
                for j in range(start, full):
                    block = held[j] if j < len(held) else None
                    row.append(block if _kept_state(block, (j + 1) * self._block_size) else None)
            else:
                blocks = list(held[start:full])
                if len(blocks) != full - start or any(b.is_null for b in blocks):
                    return None
                row.extend(blocks)
            picked.append(row)
        return picked

    @staticmethod
    def is_save_report(request_id: str) -> bool:
        return request_id.startswith(SAVE_REPORT_PREFIX)

    def save_reported(self, request_id: str, tp_rank: int) -> bool:
        """SEND_DONE server thread: rank ``tp_rank`` finished save ``request_id``
        (``save_report_id``); taken into account at the next ``drain``."""
        try:
            save_id = int(request_id.removeprefix(SAVE_REPORT_PREFIX))
        except ValueError:
            return False
        with self._reports_lock:
            self._reports.append((save_id, tp_rank))
        return True

    def drain(self) -> None:
        """Engine-core thread (every hook): saves every rank finished let go of their blocks
        and become vLLM KV events."""
        with self._reports_lock:
            reports, self._reports = self._reports, []
        for save_id, tp_rank in reports:
            save = self._saves.get(save_id)
            if save is None or tp_rank in save.ranks:
                continue  # a stray, or a rank's second report
            save.ranks.add(tp_rank)
            if len(save.ranks) < self._tp_size:
                continue
            del self._saves[save_id]
            self._unref(save)
            self._events.append(("stored", save.chains, save.parent, save.tokens, self._block_size))

    def _unref(self, save: _Save) -> None:
        if self._manager is not None and save.blocks:
            self._manager.block_pool.free_blocks(reversed(save.blocks))
        save.blocks = []

    def removed(self, chains: Sequence[bytes]) -> None:
        """The store dropped these blocks (its key events)."""
        self._events.append(("removed", list(chains)))

    def take_events(self) -> list[Any]:
        """vLLM's ``take_events``: blocks stored by this instance's saves, and blocks the store
        dropped (its key events; every instance on the node passes them on)."""
        if self._lookups is not None:
            for event in self._lookups.key_events():
                keys = getattr(event, "keys", None)
                if keys is not None and getattr(event, "reason", None) is not None:
                    self.removed(list(dict.fromkeys(kvs_keys.chain_of(k) for k in keys)))
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ end
    def request_finished(self, request: Request) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.loading and tracked.in_step:
            # Ended before the report of its step came back (an abort): the worker may still
            # copy from the objects, whose holds go with the report (``load_finished``).
            tracked.request_gone = True
        elif tracked is not None:
            del self._requests[request.request_id]
            self._release_holds(tracked)  # not loaded, or a load vLLM gave up on
        if self._lookups is not None:
            self._lookups.forget(request.request_id)

    def wait_store(self, timeout: float) -> bool:
        """Wait until the lookups' first connect to the store is done or failed (True at once
        without a lookup connection); False on timeout."""
        return self._lookups is None or self._lookups.wait_first_connect(timeout)

    def lookups_subscribed(self) -> bool:
        """Whether the store's key events reach the lookups (True without lookups)."""
        return self._lookups is None or self._lookups.subscribed

    def gauges(self) -> dict[str, int]:
        """Saves holding vLLM blocks, requests tracked, objects the lookups hold in the store."""
        return {
            "pending_saves": len(self._saves),
            "tracked_requests": len(self._requests),
            "store_holds": 0 if self._lookups is None else self._lookups.holding,
        }

    def close(self) -> int:
        """Shut down: every block a save still references goes back. Returns how many saves."""
        saves, self._saves = self._saves, {}
        for save in saves.values():
            self._unref(save)
        if self._lookups is not None:
            self._lookups.close()
        return len(saves)


def _kept_state(block: Any, boundary: int) -> bool:
    """True if ``block`` of a state group holds the state at token ``boundary`` that vLLM keeps
    (hashed by its prefix cache at that boundary)."""
    if block is None or block.is_null or getattr(block, "block_hash", None) is None:
        return False
    covered = getattr(block, "block_hash_num_tokens", None)
    return covered is None or covered == boundary


def _merge(
    objects: Sequence[tuple[int, int]],
    groups: Sequence[KvGroup],
    tokens: Sequence[tuple[Any, int]],
    states: Sequence[tuple[Any, int]],
) -> list[tuple[Any, int]]:
    """A block's token objects and state objects, in ``kvs_keys.block_objects`` order."""
    token_it, state_it = iter(tokens), iter(states)
    return [next(state_it if kvs_keys.is_state(groups[g]) else token_it) for g, _ in objects]


def _lora_name(request: Request) -> str | None:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else str(getattr(lora, "lora_name", ""))
