"""P's transfer logic as a pure state machine: events in, actions out. No I/O.

The worker shell (``worker_side.ProducerShell``) feeds it what happened (vLLM's metadata, a
transfer_kv or release RPC that arrived, a kvt completion, a deadline it armed) and carries out
what it decides (start a kvt send and answer the pull, fail a pull, abort, give the blocks back,
arm a deadline). It owns no thread, socket, timer or clock; the tests drive it event by event.
D's side is ``consumer.py``.

P (``Producer``), one record per transfer id::

    (none) --pull arrives-------> PARKED --request finished-----------------> SENDING
      |                             |  '--final prefill starts (rapid: it still runs)--> SENDING*
      |                             '--lease passes / release / abort: pull fails--> (none) or
      |                                                                              CANCELLED
      |--final prefill starts (rapid)--> HELD* --pull arrives (mid-forward)------> SENDING*
      |                                    |  '--request finished--> HELD (then as below)
      |                                    '--lease passes / release / bad pull--> SENT
      |--request finished--> HELD --pull arrives--> SENDING --kvt completion--> given back
      |                        '--lease passes / release / bad pull--------------> given back
      '--release / abort---> CANCELLED --one lease later--> (none)

    given back: ``ReturnBlocks`` (the worker's SEND_DONE to the owner of P's blocks, the
    scheduler half's ``holds.BlockHolds``), and a CANCELLED tombstone stays for one lease, so a
    later pull for the transfer (a second D the proxy failed over to) fails at once.

    SENDING* --kvt completion--> SENT --request finished--> given back
    SENDING* --request finished--> SENDING (then as above)

    SENDING --send deadline--> SENDING (kvt told to abort; its completion still decides)

  CANCELLED: a pull fails at once and a late "request finished" is given back at once.
  ``*``: the request still runs (its prompt's forward pass, announced by ``FinalPrefillStarts``).

- **Rapid transfer_kv** (``FinalPrefillStarts``: this step's forward pass completes the prompt):
  the record holds the step's layer events, so a pull parked before the step, one that arrives at
  any moment of the forward pass, and a late D rank's (TP) all get a ``StartSend`` held by those
  events: kvt sends the layers already written at once and each other one as the pass marks it. A
  pull after the request finished still waits on those events (all marked by then): on a GPU the
  step's CUDA events, not vLLM's report that the request finished, say when the pass's kernels
  have written the KV.

- **Given back** (``ReturnBlocks``: this rank no longer needs the blocks; the owner gives them to
  vLLM once every rank did) happens exactly once per finished request, and never while kvt may
  still read the blocks: from SENDING only on kvt's completion, or when kvt refused the send
  without taking any batch. The send deadline (``transfer_timeout_s``) only aborts the send; the
  blocks come back with the completion that the abort produces (kvt delivers exactly one, after
  its I/O stopped).
- Blocks of a request that is still running belong to vLLM: a rapid send's request is given back
  only once it has finished (SENT waits for it). A running request must not be preempted under a
  rapid send: the scheduler announces only requests that finish in the step that completes their
  prompt (``max_tokens=1``), see ``scheduler_side``.
- Each record has at most one deadline (``ArmDeadline``/``CancelDeadline``, keyed by transfer
  id): the lease in PARKED and HELD, the send guard in SENDING, the tombstone's in CANCELLED.

- Per KV-cache group: a record holds one block list per group (vLLM's hybrid KV-cache manager:
  full attention plus linear-attention state, sliding window plus full, ...). The groups share
  the record's one lease, one send and one give-back: the owner frees every group's blocks
  together. A pull must name P's groups (count, family, geometry, dtype:
  ``check_cache_compatible``) or it fails at once with ``PeerError``, before any byte moves;
  which block goes where inside a group (D's prefix hit, block counts) is decided by
  ``mapping.plan_copy`` when the send starts.

- Tensor parallelism (fan-in): each P rank runs its own machine. A record takes one pull per
  D rank (``TransferKvRequest.layout.tp_rank``); how many D ranks pull from this P rank follows
  from D's TP size (``pulling_ranks``), learnt from the first pull. Each pull is its own send,
  under its own kvt id (``kvt_transfer_id``: one per rank pair) and send guard; the record's
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybrid_connector.common import Abort, Count, Log, ShuttingDown, describe
from hybrid_connector.errors import ConfigError, LeaseExpired, PeerError, TransferError
from hybrid_connector.mapping import check_cache_compatible, kvt_transfer_id, pulling_ranks
from hybrid_connector.metadata import FinalPrefill, OfferSpec
from hybrid_connector.protocol import CacheSpec, TransferKvRequest

if TYPE_CHECKING:
    from kvt import Completion, LayerEvents


# ============================================================================== P: events
@dataclass(frozen=True, slots=True)
class RequestFinished:
    """vLLM finished the request on P (``request_finished`` delayed the free of its blocks)."""

    spec: OfferSpec


@dataclass(frozen=True, slots=True)
class RequestCancelled:
    """The request ended on P without KV to offer (aborted before its prompt completed)."""

    transfer_id: str


@dataclass(frozen=True, slots=True)
class FinalPrefillStarts:
    """This step's forward pass completes the prompt (rapid transfer_kv); ``layer_events`` are
    marked as the pass writes each layer (passed through to ``StartSend`` untouched). Fed
    before the pass starts; the request is not finished until ``RequestFinished``."""

    spec: FinalPrefill
    layer_events: LayerEvents | None = None


@dataclass(frozen=True, slots=True)
class PullArrived:
    """D's transfer_kv RPC; ``pull`` is the shell's handle for answering it."""

    pull: int
    request: TransferKvRequest
    peer: str


@dataclass(frozen=True, slots=True)
class PullGone:
    """The RPC of ``pull`` went away unanswered (D's connection closed)."""

    transfer_id: str
    pull: int


@dataclass(frozen=True, slots=True)
class ReleaseArrived:
    """D or the proxy: nobody will pull ``transfer_id``."""

    transfer_id: str
    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class SendRefused:
    """``StartSend`` could not be carried out. ``kvt_has_blocks``: kvt accepted some batch
    before refusing, so it may still read the blocks and a completion will follow.
    ``transfer_id`` is the send's kvt id (``StartSend.kvt_id``)."""

    transfer_id: str
    error: Exception
    kvt_has_blocks: bool


@dataclass(frozen=True, slots=True)
class SendCompleted:
    """kvt's (one) completion of the send (``transfer_id``: its kvt id)."""

    transfer_id: str
    completion: Completion


@dataclass(frozen=True, slots=True)
class DeadlineReached:
    """The deadline armed for ``transfer_id`` passed (a transfer's lease, or a send guard
    armed under the send's kvt id)."""

    transfer_id: str


ProducerEvent = (
    RequestFinished
    | RequestCancelled
    | FinalPrefillStarts
    | PullArrived
    | PullGone
    | ReleaseArrived
    | SendRefused
    | SendCompleted
    | DeadlineReached
    | ShuttingDown
)


# ============================================================================== P: actions
@dataclass(frozen=True, slots=True)
class StartSend:
    """Write P's ``src_block_ids`` (per group, every block of the request) into D's blocks (per
    ``request``, ``mapping.plan_copy`` per group) with kvt, then answer ``pull`` with what was
    queued; on failure feed ``SendRefused``. With ``layer_events`` (rapid): one batch per layer,
    each held until ``layer_events`` marks that layer written."""

    transfer_id: str
    pull: int
    request_id: str
    src_block_ids: list[list[int]]
    request: TransferKvRequest
    layer_events: LayerEvents | None = None
    # kvt's request id of this (P rank, D rank) send (``kvt_transfer_id``); "" = transfer_id.
    kvt_id: str = ""


@dataclass(frozen=True, slots=True)
class FailPull:
    """Answer ``pull`` with ``error``."""

    pull: int
    error: Exception


@dataclass(frozen=True, slots=True)
class ReturnBlocks:
    """This rank no longer needs ``request_id``'s blocks (SEND_DONE to the owner of P's blocks,
    ``holds.py``); ``outcome`` says why, for logs."""

    request_id: str
    transfer_id: str
    outcome: str


@dataclass(frozen=True, slots=True)
class AnswerRelease:
    """Answer the release RPC: True if held blocks were freed by it."""

    transfer_id: str
    released: bool


@dataclass(frozen=True, slots=True)
class ArmDeadline:
    """Feed ``DeadlineReached(transfer_id)`` after ``delay_s`` (replaces the one armed)."""

    transfer_id: str
    delay_s: float


@dataclass(frozen=True, slots=True)
class CancelDeadline:
    transfer_id: str


ProducerAction = (
    StartSend
    | FailPull
    | Abort
    | ReturnBlocks
    | AnswerRelease
    | ArmDeadline
    | CancelDeadline
    | Count
    | Log
)


# ============================================================================== P: the machine
class Phase(enum.Enum):
    PARKED = "parked"  # pulls wait for the request
    HELD = "held"  # the blocks wait for (more) pulls; nothing is being sent
    SENDING = "sending"  # kvt may be reading the blocks (one send per pulling D rank)
    SENT = "sent"  # rapid: every send is over, the request still runs
    CANCELLED = "cancelled"  # nothing will be offered, or nobody will pull


@dataclass(slots=True)
class _Send:
    """One D rank's pull being sent (kvt may read the blocks until its completion)."""

    transfer_id: str
    d_rank: int
    aborting: bool = False  # the send guard passed (or kvt refused a later batch)


@dataclass(slots=True)
class _Transfer:
    phase: Phase
    # The request whose blocks are involved (HELD, SENDING, SENT).
    spec: OfferSpec | None = None
    # vLLM has finished the request (its blocks are the owner's, waiting for our give-back).
    finished: bool = False
    # PARKED: the waiting pulls by D rank (their transfer_kv calls are not answered yet).
    parked: dict[int, PullArrived] = field(default_factory=dict)
    # SENDING: the sends in flight, by kvt id.
    sends: dict[str, _Send] = field(default_factory=dict)
    # D ranks whose pull was taken (parked, sending, sent or refused): a second one is a dup.
    pulled: set[int] = field(default_factory=set)
    # How many D ranks pull from this rank (P's fan-in), known from the first pull.
    expected: int | None = None
    # No more pulls are taken: the lease passed, D released it, or a pull was refused.
    closed: bool = False
    # Rapid: the layer events of the step that computes the prompt (for late D ranks too).
    layer_events: LayerEvents | None = None
    # Why the blocks are given back (ReturnBlocks.outcome): the last send's, the lease's, ...
    outcome: str = "sent"
    # CANCELLED: why later pulls fail (a tombstone after an abort, a release or a give-back).
    reason: str = ""

    def waits_for_pulls(self) -> bool:
        return not self.closed and (self.expected is None or len(self.pulled) < self.expected)


@dataclass
class ProducerSettings:
    lease_s: float
    transfer_timeout_s: float


class Producer:
    """P's offers, leases, parked pulls, cancellations and rapid sends, for one TP rank. Pure: see
    the module docstring for the states; :meth:`handle` returns what the shell must do, in order.
    """

    def __init__(self, local_spec: CacheSpec, settings: ProducerSettings) -> None:
        self._spec = local_spec
        self._settings = settings
        self._transfers: dict[str, _Transfer] = {}
        self._send_of: dict[str, str] = {}  # kvt id -> transfer id

    def phase(self, transfer_id: str) -> Phase | None:
        """The record's phase (None: nothing is known about ``transfer_id``)."""
        record = self._transfers.get(transfer_id)
        return None if record is None else record.phase

    def __len__(self) -> int:
        """Records that hold blocks or pulls (tombstones, which hold nothing, not counted)."""
        return sum(1 for r in self._transfers.values() if r.phase is not Phase.CANCELLED)

    def tombstones(self) -> int:
        """CANCELLED records: each refuses pulls for one lease, then goes."""
        return len(self._transfers) - len(self)

    def handle(self, event: ProducerEvent) -> list[ProducerAction]:
        out: list[ProducerAction] = []
        match event:
            case RequestFinished(spec):
                self._request_finished(spec, out)
            case RequestCancelled(tid):
                self._request_cancelled(tid, out)
            case FinalPrefillStarts(spec, layer_events):
                self._final_prefill_starts(spec, layer_events, out)
            case PullArrived():
                self._pull_arrived(event, out)
            case PullGone(tid, pull):
                self._pull_gone(tid, pull, out)
            case ReleaseArrived():
                self._release_arrived(event, out)
            case SendRefused(kvt_id, error, kvt_has_blocks):
                self._send_refused(kvt_id, error, kvt_has_blocks, out)
            case SendCompleted(kvt_id, completion):
                self._send_completed(kvt_id, completion, out)
            case DeadlineReached(key):
                self._deadline(key, out)
            case ShuttingDown():
                for tid, record in list(self._transfers.items()):
                    for parked in record.parked.values():
                        out.append(FailPull(parked.pull, TransferError("P is shutting down")))
                    for kvt_id in record.sends:
                        if kvt_id != tid:
                            out.append(CancelDeadline(kvt_id))
                    out.append(CancelDeadline(tid))
                self._transfers.clear()
                self._send_of.clear()
            case _:
                raise TypeError(f"not a producer event: {event!r}")
        return out

    # -- vLLM ------------------------------------------------------------------------------
    def _request_finished(self, spec: OfferSpec, out: list[ProducerAction]) -> None:
        tid = spec.transfer_id
        record = self._transfers.get(tid)
        phase = None if record is None else record.phase
        rapid = record is not None and record.spec is not None and not record.finished
        if rapid and record.spec.request_id == spec.request_id:
            # An announced request finished: give it back once every send is over.
            record.finished = True
            if phase is Phase.SENT:
                self._give_back(tid, out)
            elif phase is Phase.HELD:
                out.append(ArmDeadline(tid, self._settings.lease_s))  # the lease, from now
            return
        if phase is Phase.CANCELLED:
            out.append(Count("released_by_peer"))
            out.append(ReturnBlocks(spec.request_id, tid, record.reason or "cancelled"))
            return
        if record is not None and phase is not Phase.PARKED:
            assert record.spec is not None
            out.append(
                Log(
                    logging.WARNING,
                    "request %s: transfer_id %s is already held for request %s; releasing the "
                    "new request's blocks at once",
                    (spec.request_id, tid, record.spec.request_id),
                )
            )
            if record.spec.request_id != spec.request_id:
                out.append(ReturnBlocks(spec.request_id, tid, "duplicate transfer id"))
            return
        out.append(Count("offers"))
        if record is None:
            # No pull yet: hold the blocks for one lease.
            self._transfers[tid] = _Transfer(Phase.HELD, spec=spec, finished=True)
            out.append(ArmDeadline(tid, self._settings.lease_s))
            out.append(
                Log(
                    logging.DEBUG,
                    "request %s: holding blocks for transfer %s",
                    (spec.request_id, tid),
                )
            )
            return
        record.phase, record.spec, record.finished = Phase.HELD, spec, True
        if record.waits_for_pulls():
            out.append(ArmDeadline(tid, self._settings.lease_s))  # the D ranks still to pull
        self._start_parked(tid, record, out)

    def _request_cancelled(self, tid: str, out: list[ProducerAction]) -> None:
        record = self._transfers.get(tid)
        if record is None or record.phase is Phase.PARKED:
            self._cancel(tid, "prefill request aborted on P", out)

    def _final_prefill_starts(
        self, spec: FinalPrefill, layer_events: LayerEvents | None, out: list[ProducerAction]
    ) -> None:
        tid = spec.transfer_id
        record = self._transfers.get(tid)
        held = OfferSpec(spec.request_id, tid, spec.block_ids, spec.num_tokens)
        if record is None:
            # No pull yet: one that arrives during the forward pass (HELD*, under a lease) or
            # later is sent layer by layer as the step's events say the layers are written.
            self._transfers[tid] = _Transfer(Phase.HELD, spec=held, layer_events=layer_events)
            out.append(Count("offers"))
            out.append(ArmDeadline(tid, self._settings.lease_s))
            out.append(
                Log(
                    logging.DEBUG,
                    "request %s: transfer %s offered during its prefill",
                    (spec.request_id, tid),
                )
            )
            return
        if record.phase is not Phase.PARKED:
            # CANCELLED (released, aborted): the request is given back once it finished; any
            # other record is a repeat, or another request's (request_finished warns).
            return
        record.phase = Phase.HELD
        record.spec = held
        record.finished = False
        record.layer_events = layer_events
        self._start_parked(tid, record, out)

    def _start_parked(self, tid: str, record: _Transfer, out: list[ProducerAction]) -> None:
        parked, record.parked = record.parked, {}
        for d_rank in sorted(parked):
            if tid not in self._transfers:
                out.append(FailPull(parked[d_rank].pull, TransferError(f"transfer {tid}: over")))
            else:
                self._start_send(tid, record, parked[d_rank], out)
        if tid in self._transfers and not record.sends:
            self._settle(tid, record, out)

    # -- D and the proxy --------------------------------------------------------------------
    def _fan_in(self, request: TransferKvRequest) -> int:
        """How many D ranks pull from this rank; PeerError if ``request``'s rank is not one."""
        d_rank, d_tp = request.layout.tp_rank, request.layout.tp_size
        p_rank, p_tp = self._spec.tp_rank, self._spec.tp_size
        if p_tp == 1 and d_tp == 1:
            return 1
        try:
            ranks = pulling_ranks(p_rank, p_tp, d_tp, request.layout.groups)
        except ConfigError as err:
            raise PeerError(str(err)) from err
        if d_rank not in ranks:
            raise PeerError(f"D rank {d_rank} of {d_tp} takes nothing from P rank {p_rank}")
        return len(ranks)

    def _pull_arrived(self, event: PullArrived, out: list[ProducerAction]) -> None:
        request, pull, peer = event.request, event.pull, event.peer
        tid = request.transfer_id
        d_rank = request.layout.tp_rank
        record = self._transfers.get(tid)
        try:
            check_cache_compatible(self._spec, request.layout)
            expected = self._fan_in(request)
        except PeerError as err:
            who = record.spec.request_id if record and record.spec else "(not finished on P)"
            out.append(
                Log(
                    logging.WARNING,
                    "request %s: transfer_kv from %s for transfer %s (D request %s) rejected: %s",
                    (who, peer, tid, request.request_id, err),
                )
            )
            out.append(FailPull(pull, err))
            if record is not None and record.phase is Phase.HELD:
                # D recomputes: its other ranks' pulls are of no use any more.
                record.closed = True
                record.outcome = "pull refused"
                self._settle(tid, record, out)
            return
        if record is None:
            # P has not finished (or not even seen) the request: hold the pull within the lease.
            self._transfers[tid] = _Transfer(
                Phase.PARKED, parked={d_rank: event}, pulled={d_rank}, expected=expected
            )
            out.append(Count("early_pulls"))
            out.append(ArmDeadline(tid, self._settings.lease_s))
            out.append(
                Log(
                    logging.DEBUG,
                    "transfer %s: transfer_kv from %s waits for the request",
                    (tid, peer),
                )
            )
            return
        if record.phase is Phase.CANCELLED:
            why = record.reason or "cancelled on P"
            out.append(FailPull(pull, TransferError(f"transfer {tid}: {why}")))
            return
        if d_rank in record.pulled:
            if record.phase is Phase.PARKED:
                msg = f"transfer {tid}: duplicate transfer_kv while waiting for the request"
            else:
                msg = f"transfer {tid} is already being sent (duplicate transfer_kv)"
            out.append(FailPull(pull, PeerError(msg)))
            return
        if record.expected is not None and record.expected != expected:
            msg = f"transfer {tid}: D's TP size changed between its ranks' pulls"
            out.append(FailPull(pull, PeerError(msg)))
            return
        if record.closed or record.phase is Phase.SENT:
            out.append(FailPull(pull, TransferError(f"transfer {tid}: no longer held on P")))
            return
        record.expected = expected
        record.pulled.add(d_rank)
        if record.phase is Phase.PARKED:
            record.parked[d_rank] = event
            return
        self._start_send(tid, record, event, out)

    def _pull_gone(self, tid: str, pull: int, out: list[ProducerAction]) -> None:
        record = self._transfers.get(tid)
        if record is None:
            return
        for d_rank, parked in list(record.parked.items()):
            if parked.pull == pull:
                del record.parked[d_rank]
                record.pulled.discard(d_rank)
        if record.phase is Phase.PARKED and not record.parked:
            self._forget(tid, out)

    def _release_arrived(self, event: ReleaseArrived, out: list[ProducerAction]) -> None:
        tid = event.transfer_id
        record = self._transfers.get(tid)
        if record is not None and record.phase is Phase.HELD:
            assert record.spec is not None
            out.append(
                Log(
                    logging.DEBUG,
                    "request %s: transfer %s released by %s (%s)",
                    (record.spec.request_id, tid, event.peer, event.reason),
                )
            )
            out.append(Count("released_by_peer"))
            record.closed = True
            record.outcome = f"released by {event.peer}"
            self._settle(tid, record, out)
            # A running request's blocks (HELD*) come back only once it finished.
            out.append(AnswerRelease(tid, record.finished))
            return
        if record is None or record.phase is Phase.PARKED:
            if record is not None:
                out.append(Count("early_pulls_released"))
            self._cancel(tid, f"released by {event.peer}: {event.reason}", out)
        elif record.phase is Phase.SENDING:
            # The sends go on (D aborts them through kvt if it must); no new pull is taken.
            record.closed = True
        out.append(AnswerRelease(tid, False))

    # -- kvt --------------------------------------------------------------------------------
    def _start_send(
        self, tid: str, record: _Transfer, parked: PullArrived, out: list[ProducerAction]
    ) -> None:
        pull, request, peer = parked.pull, parked.request, parked.peer
        spec = record.spec
        assert spec is not None
        try:
            src_block_ids = self._source_blocks(spec, request)
        except PeerError as err:
            out.append(
                Log(
                    logging.WARNING,
                    "request %s: transfer %s for %s (D request %s) rejected: %s",
                    (spec.request_id, tid, peer, request.request_id, err),
                )
            )
            out.append(FailPull(pull, err))
            record.closed = True
            record.outcome = "pull refused"
            if not record.sends:
                self._settle(tid, record, out)
            return
        d_rank, d_tp = request.layout.tp_rank, request.layout.tp_size
        kvt_id = kvt_transfer_id(tid, self._spec.tp_rank, self._spec.tp_size, d_rank, d_tp)
        record.phase = Phase.SENDING
        record.sends[kvt_id] = _Send(tid, d_rank)
        self._send_of[kvt_id] = tid
        if kvt_id != tid and not record.waits_for_pulls():
            out.append(CancelDeadline(tid))  # every D rank pulled: the lease is over
        # Guard: kvt has its own deadline too; whatever happens, abort after this long.
        out.append(ArmDeadline(kvt_id, self._settings.transfer_timeout_s))
        events = record.layer_events  # the announcing step's (None: the plain path's)
        if events is not None and not record.finished:
            out.append(Count("rapid_sends"))
        out.append(StartSend(tid, pull, spec.request_id, src_block_ids, request, events, kvt_id))

    def _source_blocks(self, spec: OfferSpec, request: TransferKvRequest) -> list[list[int]]:
        """P's blocks per group; what can be checked without the layouts (plan_copy does the
        per-group block counts, which depend on each side's block size)."""
        groups = len(self._spec.groups)
        if len(request.block_ids) != groups or len(request.first_block) != groups:
            raise PeerError(
                f"transfer_kv names {len(request.block_ids)} block lists and "
                f"{len(request.first_block)} first blocks for {groups} KV-cache groups"
            )
        if len(spec.block_ids) != groups:
            raise PeerError(f"P holds {len(spec.block_ids)} block lists for {groups} groups")
        if not any(request.block_ids):
            raise PeerError("transfer_kv names no destination block")
        if request.num_tokens > spec.num_tokens:
            raise PeerError(
                f"D needs {request.num_tokens} prompt tokens but P computed {spec.num_tokens}"
            )
        return [list(ids) for ids in spec.block_ids]

    def _sending(self, kvt_id: str) -> tuple[str, _Transfer, _Send] | None:
        tid = self._send_of.get(kvt_id)
        record = None if tid is None else self._transfers.get(tid)
        send = None if record is None else record.sends.get(kvt_id)
        if tid is None or record is None or send is None:
            return None
        return tid, record, send

    def _send_refused(
        self, kvt_id: str, error: Exception, kvt_has_blocks: bool, out: list[ProducerAction]
    ) -> None:
        found = self._sending(kvt_id)
        if found is None:
            return
        tid, record, send = found
        assert record.spec is not None
        out.append(
            Log(
                logging.WARNING,
                "request %s: kvt refused to send transfer %s: %s; %s",
                (
                    record.spec.request_id,
                    kvt_id,
                    error,
                    "aborting it, blocks back after its completion"
                    if kvt_has_blocks
                    else "releasing",
                ),
            )
        )
        record.outcome = "send refused"
        if kvt_has_blocks:
            if not send.aborting:
                send.aborting = True
                out.append(Abort(kvt_id, f"send refused on P: {error}"))
            return
        self._send_over(tid, record, kvt_id, out)

    def _send_completed(self, kvt_id: str, completion: Completion, out: list[ProducerAction]):
        found = self._sending(kvt_id)
        if found is None:
            return  # not ours (kvt refused the first batch and told this callback too)
        tid, record, _ = found
        assert record.spec is not None
        out.append(Count("sends_done" if completion.ok else "sends_failed"))
        if not completion.ok:
            record.outcome = "send failed"
            out.append(
                Log(
                    logging.WARNING,
                    "request %s: sending transfer %s failed (%s)",
                    (record.spec.request_id, kvt_id, describe(completion)),
                )
            )
        self._send_over(tid, record, kvt_id, out)

    def _send_over(self, tid: str, record: _Transfer, kvt_id: str, out: list[ProducerAction]):
        """kvt no longer reads the blocks for ``kvt_id``."""
        del record.sends[kvt_id]
        del self._send_of[kvt_id]
        if kvt_id != tid:
            out.append(CancelDeadline(kvt_id))
        if not record.sends:
            self._settle(tid, record, out)

    # -- deadlines --------------------------------------------------------------------------
    def _deadline(self, key: str, out: list[ProducerAction]) -> None:
        found = self._sending(key)
        if found is not None:
            tid, record, send = found
            if not send.aborting:
                assert record.spec is not None
                out.append(
                    Log(
                        logging.WARNING,
                        "request %s: transfer %s not confirmed within %.1fs; aborting it (its "
                        "blocks come back with kvt's completion)",
                        (record.spec.request_id, key, self._settings.transfer_timeout_s),
                    )
                )
                send.aborting = True
                out.append(Count("sends_timed_out"))
                out.append(Abort(key, "send timed out on P"))
            return
        tid = key
        record = self._transfers.get(tid)
        if record is None:
            return
        if record.phase in (Phase.HELD, Phase.SENDING):
            assert record.spec is not None
            out.append(Count("leases_expired"))
            out.append(
                Log(
                    logging.WARNING,
                    "request %s: %d of %s decode rank(s) pulled transfer %s within the %.1fs "
                    "lease; releasing its blocks%s",
                    (
                        record.spec.request_id,
                        len(record.pulled),
                        record.expected or "the",
                        tid,
                        self._settings.lease_s,
                        " once the sends are over" if record.sends else "",
                    ),
                )
            )
            if not record.finished:
                out.append(
                    Log(
                        logging.WARNING,
                        "request %s: still running on P; its blocks go back once it finished",
                        (record.spec.request_id,),
                    )
                )
            record.closed = True
            record.outcome = "lease passed"
            if not record.sends:
                self._settle(tid, record, out)
        elif record.phase is Phase.PARKED:
            for parked in record.parked.values():
                out.append(Count("early_pulls_expired"))
                out.append(
                    Log(
                        logging.WARNING,
                        "transfer %s: transfer_kv from %s (D request %s) expired: the request did "
                        "not finish on P within the %.1fs lease",
                        (tid, parked.peer, parked.request.request_id, self._settings.lease_s),
                    )
                )
                error = LeaseExpired(f"transfer {tid} not on P in time")
                out.append(FailPull(parked.pull, error))
            del self._transfers[tid]
        elif record.phase is Phase.CANCELLED:
            del self._transfers[tid]

    # -- internals --------------------------------------------------------------------------
    def _settle(self, tid: str, record: _Transfer, out: list[ProducerAction]) -> None:
        """Nothing is being sent: wait for the other D ranks' pulls, or end the transfer."""
        if record.waits_for_pulls():
            record.phase = Phase.HELD  # the lease (armed under tid) still runs
        elif record.finished:
            self._give_back(tid, out)
        else:
            # Rapid: the request still runs; give it back when vLLM finishes it.
            out.append(CancelDeadline(tid))
            record.phase = Phase.SENT

    def _cancel(self, tid: str, reason: str, out: list[ProducerAction]) -> None:
        """No KV will be offered (or pulled) for ``tid``: fail its parked pulls, refuse later
        pulls and release a late request at once, for one lease."""
        record = self._transfers.get(tid)
        if record is not None:
            for parked in record.parked.values():
                out.append(FailPull(parked.pull, TransferError(f"transfer {tid}: {reason}")))
        self._transfers[tid] = _Transfer(Phase.CANCELLED, reason=reason)
        out.append(ArmDeadline(tid, self._settings.lease_s))

    def _give_back(self, tid: str, out: list[ProducerAction]) -> None:
        """Give the blocks back (the record ends)."""
        record = self._transfers.pop(tid)
        assert record.spec is not None
        assert not record.sends
        out.append(CancelDeadline(tid))
        out.append(ReturnBlocks(record.spec.request_id, tid, record.outcome))
        # A tombstone for one lease: a later pull (a proxy failing over to a second D after the
        # first one pulled) fails at once, so that D recomputes now, not after a parked lease.
        self._cancel(tid, "already sent, blocks freed", out)

    def _forget(self, tid: str, out: list[ProducerAction]) -> None:
        del self._transfers[tid]
        out.append(CancelDeadline(tid))
