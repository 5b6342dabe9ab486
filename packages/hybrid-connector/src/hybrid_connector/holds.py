"""P's blocks: one owner (the scheduler half), one way back to vLLM (SEND_DONE).

Who may use the blocks of a P request that D will pull: vLLM's forward pass until the request
finishes, then P's worker ranks (kvt reading them into D) until each says it is done. This module
is the one place that knows whose blocks are held, and the only one that gives them back to vLLM:
``BlockOwner`` decides (pure: events in, actions out; tables in ``tests/test_holds.py``) and
``BlockHolds`` is its shell against vLLM's block pool.

Why the owner takes its own reference: with ``delay_free=True`` a finished request stays in
vLLM's scheduler until the worker reports it in ``finished_sending``; while any such request
exists ``Scheduler.has_requests()`` is true and the engine core runs empty steps at about 1 kHz,
only to ask the worker "done yet?". Instead the owner references the request's ``KVCacheBlock``s
in ``request_finished`` and vLLM frees the request at once (``delay_free=False``). The blocks can
not be reallocated while the reference lasts (vLLM reuses a block only at ``ref_cnt`` 0), and the
engine core sleeps on its input queue. Nothing wakes the engine to give them back: blocks matter
only to a ``schedule()``, and every ``schedule()`` calls a hook (``drain``) first.

One record per P request that D may pull (``do_remote_decode``), by request id::

    (none) --announce: this step completes the prompt--> ANNOUNCED --SEND_DONE of a rank--+
      |              (the worker offers it at the step's end)  |   ^    (the send ended   |
      |                                                        |   '--- inside the step) -'
      | finish with KV: reference, Offer                       | finish: reference
      v  (the worker learns of it in the next step's metadata) v  (with or without KV)
     HELD <----------------------------------------------------+
      |                                        ANNOUNCED --finish, every rank reported--> (none)
      | SEND_DONE of the last TP rank
      v
    RELEASING --drain (the next hook, engine-core thread): unreference--> (none)

    (none) --finish without KV (aborted, nothing computed): Withdraw--> (none); vLLM frees them
    any record --shut down: unreference what is referenced--> (none); from then on nothing is
                                                              held (vLLM's own free is the last)

- The one way back: the worker never reports a P request in ``finished_sending``. Each TP rank's
  worker sends one SEND_DONE per request it was told of (``final_prefills`` or ``to_offer``),
  when its ``producer.Producer`` gives the blocks back (``ReturnBlocks``: sent, failed, lease
  passed, released, refused); the owner drops its reference once every rank did.
- Exactly once: a finish references the request's blocks at most once; each reference is
  dropped exactly once (drain or shut down); a rank's second SEND_DONE is ignored; a SEND_DONE
  for a request neither announced nor held (a stray, or late after a shut down) is ignored and
  kept nowhere.
- ``Offer``: the scheduler half queues the request's ``OfferSpec`` for the worker (a request
  that was not announced finishes after its last step; vLLM runs one more step for its
  ``finished_req_ids``, and that step's metadata carries the offer). ``Withdraw``: it queues
  ``cancel_offer``, so the worker fails pulls parked for the transfer at once.
- Threads (the shell): ``announce``, ``finish``, ``drain`` and ``release_all`` run on the
  engine-core thread, ``send_done`` on the SEND_DONE server's thread. One lock guards the owner;
  vLLM's pool is touched only outside it, by the engine-core thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybrid_connector.common import Log

log = logging.getLogger(__name__)


# ============================================================================== events
@dataclass(frozen=True, slots=True)
class Announce:
    """This step completes ``request_id``'s prompt and finishes it (``final_prefills``): its
    worker ranks offer it at the step's end and may read its blocks from then on."""

    request_id: str
    transfer_id: str


@dataclass(frozen=True, slots=True)
class Finish:
    """vLLM finished the request (``request_finished``); ``blocks``: its blocks per KV-cache
    group (vLLM's ``KVCacheBlock`` objects, null blocks left out). ``has_kv``: it finished
    normally with KV that D can pull."""

    request_id: str
    transfer_id: str
    blocks: list[list[Any]]
    has_kv: bool


@dataclass(frozen=True, slots=True)
class SendDone:
    """TP rank ``tp_rank``'s worker no longer needs ``request_id``'s blocks (SEND_DONE)."""

    request_id: str
    tp_rank: int
    outcome: str = ""


@dataclass(frozen=True, slots=True)
class Drain:
    """A scheduler hook runs on the engine-core thread: give back what was released."""


@dataclass(frozen=True, slots=True)
class ShutDown:
    """The scheduler half closes: every reference still held goes, once."""


OwnerEvent = Announce | Finish | SendDone | Drain | ShutDown


# ============================================================================== actions
@dataclass(frozen=True, slots=True)
class Reference:
    """Take one reference on each of ``blocks`` (vLLM's ``block_pool.touch``), now."""

    request_id: str
    blocks: list[list[Any]]


@dataclass(frozen=True, slots=True)
class Unreference:
    """Drop the reference taken on ``blocks`` (vLLM's ``block_pool.free_blocks``), now."""

    request_id: str
    blocks: list[list[Any]]


@dataclass(frozen=True, slots=True)
class Offer:
    """Tell the worker in the next metadata: ``request_id`` finished, its blocks are offered
    for ``transfer_id`` (``OfferSpec`` in ``to_offer``)."""

    request_id: str
    transfer_id: str


@dataclass(frozen=True, slots=True)
class Withdraw:
    """Tell the worker in the next metadata: no KV will be offered for ``transfer_id``
    (``cancel_offer``: pulls parked for it fail at once)."""

    transfer_id: str


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """The answer to a SEND_DONE: ``held`` if it counted (the blocks were held and this rank's
    report was new)."""

    request_id: str
    held: bool


OwnerAction = Reference | Unreference | Offer | Withdraw | Acknowledge | Log


# ============================================================================== the machine
class Holding(enum.Enum):
    ANNOUNCED = "announced"  # the worker may read the blocks; vLLM still runs the request
    HELD = "held"  # vLLM finished it; this owner references its blocks
    RELEASING = "releasing"  # every rank reported; the next drain drops the reference


@dataclass(slots=True)
class _Record:
    holding: Holding
    transfer_id: str
    blocks: list[list[Any]] = field(default_factory=list)
    done: set[int] = field(default_factory=set)  # TP ranks whose SEND_DONE counted


class BlockOwner:
    """The record of every P request whose blocks a worker may use (diagram: module docstring).
    Pure: no lock, no pool, no clock; :meth:`handle` returns what the shell must do, in order."""

    def __init__(self, tp_size: int = 1) -> None:
        self._tp_size = tp_size
        self._records: dict[str, _Record] = {}
        self._releasing: list[str] = []
        self.held_blocks = 0  # blocks referenced now
        self.released = 0  # references dropped so far (one per held request)
        self._closed = False  # shut down: nothing is held any more, vLLM's free is the last

    def __len__(self) -> int:
        """Requests whose blocks are referenced (HELD or RELEASING)."""
        return sum(1 for r in self._records.values() if r.holding is not Holding.ANNOUNCED)

    def holding(self, request_id: str) -> Holding | None:
        record = self._records.get(request_id)
        return None if record is None else record.holding

    @property
    def releasing(self) -> int:
        """Requests the next drain gives back (the shell may peek without its lock)."""
        return len(self._releasing)

    def handle(self, event: OwnerEvent) -> list[OwnerAction]:
        out: list[OwnerAction] = []
        if self._closed and isinstance(event, Announce | Finish):
            return out
        match event:
            case Announce(request_id, transfer_id):
                if request_id in self._records:
                    out.append(Log(logging.WARNING, "request %s: announced twice", (request_id,)))
                else:
                    self._records[request_id] = _Record(Holding.ANNOUNCED, transfer_id)
            case Finish():
                self._finish(event, out)
            case SendDone(request_id, tp_rank, outcome):
                self._send_done(request_id, tp_rank, outcome, out)
            case Drain():
                for request_id in self._releasing:
                    record = self._records.pop(request_id)
                    out.append(Unreference(request_id, record.blocks))
                self._releasing.clear()
            case ShutDown():
                for request_id, record in self._records.items():
                    if record.holding is Holding.HELD:
                        self._drop(record)  # RELEASING ones were counted at their SEND_DONE
                    if record.holding is not Holding.ANNOUNCED:
                        out.append(Unreference(request_id, record.blocks))
                self._records.clear()
                self._releasing.clear()
                self._closed = True
            case _:
                raise TypeError(f"not an owner event: {event!r}")
        return out

    def _finish(self, event: Finish, out: list[OwnerAction]) -> None:
        request_id, transfer_id = event.request_id, event.transfer_id
        record = self._records.get(request_id)
        if record is not None and record.holding is not Holding.ANNOUNCED:
            out.append(Log(logging.WARNING, "request %s: finished twice", (request_id,)))
            return
        if record is None and not event.has_kv:
            out.append(Withdraw(transfer_id))  # vLLM frees the blocks; early pulls fail
            return
        if record is not None and len(record.done) >= self._tp_size:
            # Every rank was done with the blocks before vLLM finished the request: vLLM's free
            # is the last one, nothing to reference.
            del self._records[request_id]
            return
        if record is None:
            record = self._records[request_id] = _Record(Holding.HELD, transfer_id)
            out.append(Offer(request_id, transfer_id))
        record.holding = Holding.HELD
        record.blocks = [list(group) for group in event.blocks]
        self.held_blocks += sum(len(group) for group in record.blocks)
        out.insert(0, Reference(request_id, record.blocks))

    def _send_done(self, request_id: str, tp_rank: int, outcome: str, out: list[OwnerAction]):
        record = self._records.get(request_id)
        if record is None or record.holding is Holding.RELEASING or tp_rank in record.done:
            why = "a second report" if record is not None else "not held here"
            out.append(
                Log(
                    logging.DEBUG,
                    "request %s: SEND_DONE (%s) of rank %d ignored: %s",
                    (request_id, outcome, tp_rank, why),
                )
            )
            out.append(Acknowledge(request_id, held=False))
            return
        record.done.add(tp_rank)
        out.append(Acknowledge(request_id, held=True))
        if record.holding is Holding.HELD and len(record.done) >= self._tp_size:
            record.holding = Holding.RELEASING
            self._releasing.append(request_id)
            self._drop(record)

    def _drop(self, record: _Record) -> None:
        self.held_blocks -= sum(len(group) for group in record.blocks)
        self.released += 1


# ============================================================================== the shell
class BlockPool(Protocol):
    """What vLLM's ``BlockPool`` offers that this module uses."""

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...


class BlockHolds:
    """``BlockOwner`` against vLLM's block pool: thread-safe, touches the pool only from the
    engine-core thread (see the module docstring)."""

    def __init__(self, pool: BlockPool | None = None, tp_size: int = 1) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._owner = BlockOwner(tp_size)

    def bind_pool(self, pool: BlockPool) -> None:
        """vLLM's block pool (known once the scheduler binds its KV-cache manager)."""
        self._pool = pool

    def __len__(self) -> int:
        with self._lock:
            return len(self._owner)

    @property
    def held_blocks(self) -> int:
        """Blocks referenced now (tests, metrics)."""
        return self._owner.held_blocks

    @property
    def released(self) -> int:
        """Held requests given back so far."""
        return self._owner.released

    def is_announced(self, request_id: str) -> bool:
        with self._lock:
            return self._owner.holding(request_id) is Holding.ANNOUNCED

    def announce(self, request_id: str, transfer_id: str) -> None:
        """Engine-core thread, in ``build_connector_meta``."""
        self._feed(Announce(request_id, transfer_id))

    def finish(
        self, request_id: str, transfer_id: str, blocks: Sequence[Sequence[Any]], *, has_kv: bool
    ) -> list[Offer | Withdraw]:
        """Engine-core thread, in ``request_finished``: reference ``blocks`` (per group; null
        blocks skipped) if a worker may use them. Returns what to tell the worker."""
        kept = [[b for b in group if not getattr(b, "is_null", False)] for group in blocks]
        actions = self._feed(Finish(request_id, transfer_id, kept, has_kv))
        return [a for a in actions if isinstance(a, Offer | Withdraw)]

    def send_done(self, request_id: str, tp_rank: int, outcome: str = "") -> bool:
        """Any thread (the SEND_DONE server): True if the report counted."""
        actions = self._feed(SendDone(request_id, tp_rank, outcome))
        return any(isinstance(a, Acknowledge) and a.held for a in actions)

    def drain(self) -> int:
        """Engine-core thread, in every hook: drop the references SEND_DONE released. Returns
        the number of blocks given back."""
        if not self._owner.releasing:  # unlocked peek: a report that races it waits one hook
            return 0
        return self._given_back(self._feed(Drain()))

    def release_all(self) -> int:
        """Engine-core thread, at shutdown: drop every reference still held, once."""
        return self._given_back(self._feed(ShutDown()))

    def _feed(self, event: OwnerEvent) -> list[OwnerAction]:
        with self._lock:
            actions = self._owner.handle(event)
        for action in actions:
            match action:
                case Reference(_, blocks):
                    for group in blocks:
                        self._touch(group)
                case Log(level, message, args):
                    log.log(level, message, *args)
        return actions

    def _given_back(self, actions: list[OwnerAction]) -> int:
        freed = 0
        for action in actions:
            if isinstance(action, Unreference):
                for group in action.blocks:
                    # Tail first, as vLLM frees a request's blocks (the tail is evicted first).
                    self._bound_pool().free_blocks(reversed(group))
                    freed += len(group)
        return freed

    def _bound_pool(self) -> BlockPool:
        if self._pool is None:
            raise RuntimeError("BlockHolds: no block pool bound")
        return self._pool

    def _touch(self, blocks: list[Any]) -> None:
        by_pool: dict[int, tuple[BlockPool, list[Any]]] = {}
        for block in blocks:
            pool = getattr(block, "pool", None) or self._bound_pool()
            by_pool.setdefault(id(pool), (pool, []))[1].append(block)
        for pool, group in by_pool.values():
            pool.touch(group)
