"""Blocks P's scheduler half holds for its worker after vLLM forgot the request.

Why: with ``delay_free=True`` a finished request stays in vLLM's scheduler until the worker
reports it in ``finished_sending``; while any such request exists ``Scheduler.has_requests()``
is true and the engine core runs empty steps at about 1 kHz (26-36% of a core here), only to
ask the worker "done yet?". Instead, for a request the worker knows finished in its step (one
announced in ``final_prefills``), the scheduler half takes its own reference on the request's
``KVCacheBlock``s and lets vLLM free the request at once (``delay_free=False``). The blocks can
not be reallocated while the reference lasts (vLLM reuses a block only at ``ref_cnt`` 0), and the
engine core sleeps on its input queue. The worker says when it no longer needs them with one
SEND_DONE RPC per TP rank (``send_done.SendDoneServer``); the reference is dropped in the
scheduler's next hook, on the engine-core thread, the only thread that may touch vLLM's block
pool. Nothing wakes the engine for it: blocks matter only to a schedule(), and every schedule()
calls a hook first.

One record per request::

    (none) --hold--> HELD --SEND_DONE of every TP rank--> FREEING --drain--> (none)
    (none) --SEND_DONE (before hold; the send can end inside the step)--> EARLY
    EARLY --SEND_DONE of the other ranks--> EARLY;  EARLY --hold--> (none), nothing touched, or
                                                                    HELD for the ranks left

- Released exactly once: a rank's second SEND_DONE is ignored (``False``), and ``release_all``
  (scheduler shutdown) frees what is still held, once.
- Thread rules: ``hold``, ``drain`` and ``release_all`` run on the engine-core thread;
  ``send_done`` on the SEND_DONE server's loop thread. One lock guards the records; vLLM's pool
  is touched only outside it, by the engine-core thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

# SEND_DONEs for requests not (yet) held are kept this many at most: a stray peer's reports
# must not grow memory without bound (a real one is consumed by its hold within a step).
MAX_EARLY = 4096


class BlockPool(Protocol):
    """What vLLM's ``BlockPool`` offers that this module uses."""

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...


@dataclass(slots=True)
class _Hold:
    transfer_id: str
    # Per KV-cache group, vLLM's KVCacheBlock objects with this module's reference on them.
    blocks: list[list[Any]] = field(default_factory=list)
    # TP ranks whose SEND_DONE arrived.
    done: set[int] = field(default_factory=set)


class BlockHolds:
    """References on finished requests' blocks, dropped after every TP rank's SEND_DONE."""

    def __init__(self, pool: BlockPool, tp_size: int = 1) -> None:
        self._pool = pool
        self._tp_size = tp_size
        self._lock = threading.Lock()
        self._held: dict[str, _Hold] = {}
        self._early: dict[str, set[int]] = {}
        self._to_free: list[list[list[Any]]] = []
        self.held_blocks = 0  # blocks referenced now (tests, metrics)
        self.released = 0  # holds released so far

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(self, request_id: str, transfer_id: str, blocks: Sequence[Sequence[Any]]) -> bool:
        """Engine-core thread, in ``request_finished``: reference ``blocks`` (per group; null
        blocks are skipped) until every rank's SEND_DONE. False if every rank already sent it
        (nothing was referenced: vLLM may free the blocks now)."""
        kept = [[b for b in group if not getattr(b, "is_null", False)] for group in blocks]
        with self._lock:
            done = self._early.pop(request_id, set())
            if len(done) >= self._tp_size:
                return False
            if request_id in self._held:
                log.warning("request %s: blocks already held; holding them once", request_id)
                return True
            self._held[request_id] = _Hold(transfer_id, kept, done)
            self.held_blocks += sum(len(g) for g in kept)
        for group in kept:
            self._touch(group)
        return True

    def send_done(self, request_id: str, tp_rank: int) -> bool:
        """Any thread (SEND_DONE server): TP rank ``tp_rank`` no longer needs ``request_id``'s
        blocks. True if they were held and this rank's report was new."""
        with self._lock:
            record = self._held.get(request_id)
            if record is None:
                early = self._early.get(request_id)
                if early is None:
                    if len(self._early) >= MAX_EARLY:
                        log.warning(
                            "SEND_DONE for request %s ignored: %d reports for requests never "
                            "held are pending",
                            request_id,
                            len(self._early),
                        )
                        return False
                    early = self._early[request_id] = set()
                if tp_rank in early:
                    return False
                early.add(tp_rank)
                return False
            if tp_rank in record.done:
                return False
            record.done.add(tp_rank)
            if len(record.done) < self._tp_size:
                return True
            del self._held[request_id]
            self._to_free.append(record.blocks)
            self.held_blocks -= sum(len(g) for g in record.blocks)
            self.released += 1
            return True

    def drain(self) -> int:
        """Engine-core thread, in every hook: drop the references SEND_DONE released. Returns
        the number of blocks given back."""
        if not self._to_free:  # unlocked peek: a report that races it is drained next hook
            return 0
        with self._lock:
            batches, self._to_free = self._to_free, []
        freed = 0
        for blocks in batches:
            for group in blocks:
                # Tail first, as vLLM frees a request's blocks (the tail is evicted first).
                self._pool.free_blocks(reversed(group))
                freed += len(group)
        return freed

    def release_all(self) -> int:
        """Engine-core thread, at shutdown: drop every reference still held, once."""
        with self._lock:
            for record in self._held.values():
                self._to_free.append(record.blocks)
                self.held_blocks -= sum(len(g) for g in record.blocks)
                self.released += 1
            self._held.clear()
            self._early.clear()
        return self.drain()

    def _touch(self, blocks: list[Any]) -> None:
        by_pool: dict[int, tuple[Any, list[Any]]] = {}
        for block in blocks:
            pool = getattr(block, "pool", None) or self._pool
            by_pool.setdefault(id(pool), (pool, []))[1].append(block)
        for pool, group in by_pool.values():
            pool.touch(group)
