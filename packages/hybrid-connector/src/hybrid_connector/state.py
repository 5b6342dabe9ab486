"""P's and D's transfer logic as pure state machines: events in, actions out. No I/O.

The worker shell (``worker_side.py``) feeds these machines what happened (vLLM's metadata, an
RPC that arrived, a kvt completion, a deadline it armed) and carries out what they decide (start
a kvt send and answer the pull, fail a pull, abort, report blocks to vLLM, arm a deadline). They
own no thread, socket, timer or clock; the tests drive them event by event.

P (``Producer``), one record per transfer id::

    (none) --pull arrives-------> PARKED --request finished-----------------> SENDING
      |                             |  '--prefill done (rapid: request still running)--> SENDING*
      |                             '--lease passes / release / abort: pull fails--> (none) or
      |                                                                              CANCELLED
      |--prefill done (rapid)--> HELD* --pull arrives (mid-forward)--------------> SENDING*
      |                            |  '--request finished--> HELD (then as below)
      |                            '--lease passes / release / bad pull--> SENT
      |--request finished--> HELD --pull arrives--> SENDING --kvt completion--> reported
      |                        '--lease passes / release / bad pull--------------> reported
      '--release / abort---> CANCELLED --one lease later--> (none)

    reported: the blocks go back to vLLM and a CANCELLED tombstone stays for one lease, so a
    later pull for the transfer (a second D the proxy failed over to) fails at once.

    SENDING* --kvt completion--> SENT --request finished--> reported
    SENDING* --request finished--> SENDING (then as above)
    HELD*, SENDING*, SENT --request finished, aborted--> no more pulls; reported once the
                                                         sends are over, then CANCELLED

    SENDING --send deadline--> SENDING (kvt told to abort; its completion still decides)

  CANCELLED: a pull fails at once and a late "request finished" is reported at once.
  ``*``: the request still runs (its prompt's forward pass, announced by ``PrefillDone``).

- **Rapid transfer_kv** (``PrefillDone``: this step's forward pass completes the prompt): the
  record holds the step's layer events, so a pull parked before the step, one that arrives
  at any moment of the forward pass, and a late D rank's (TP) all get a ``StartSend`` held by
  those events: kvt sends the layers already written at once and each other one as the pass
  marks it. A pull after the request finished still waits on those events (all marked by
  then): on a GPU the step's CUDA events, not vLLM's report that the request finished, say
  when the pass's kernels have written the KV.

- **Reported** (``ReportSent``: the request id goes into vLLM's ``finished_sending``, so vLLM
  frees its blocks) happens exactly once per finished request, and never while kvt may still read
  the blocks: from SENDING only on kvt's completion, or when kvt refused the send without taking
  any batch. The send deadline (``transfer_timeout_s``) only aborts the send; the blocks come back
  with the completion that the abort produces (kvt delivers exactly one, after its I/O stopped).
- Blocks of a request that is still running belong to vLLM: a rapid send's request is reported
  only once it has finished (SENT waits for it). A running request must not be preempted under a
  rapid send: the scheduler announces only requests that finish in the step that completes their
  prompt (``max_tokens=1``), see ``scheduler_side``.
- Each record has at most one deadline (``ArmDeadline``/``CancelDeadline``, keyed by transfer
  id): the lease in PARKED and HELD, the send guard in SENDING, the tombstone's in CANCELLED.

- Per KV-cache group: a record holds one block list per group (vLLM's hybrid KV-cache manager:
  full attention plus linear-attention state, sliding window plus full, ...). The groups share
  the record's one lease, one send and one report: vLLM frees every group's blocks when the
  request is reported. A pull must name P's groups (count, kind, geometry, dtype:
  ``check_cache_compatible``) or it fails at once with ``PeerError``, before any byte moves;
  which block goes where inside a group (D's prefix hit, block counts) is decided by
  ``mapping.plan_copy`` when the send starts.

- Tensor parallelism (fan-in): each P rank runs its own machine. A record takes one pull per
  D rank (``TransferKvRequest.layout.tp_rank``); how many D ranks pull from this P rank follows
  from D's TP size (``pulling_ranks``), learnt from the first pull. Each pull is its own send,
  under its own kvt id (``kvt_transfer_id``: one per rank pair) and send guard; the record's
  lease (armed under the transfer id) runs until every expected D rank has pulled. SENDING
  holds while any send runs; when the last one is over the record goes back to HELD if D
  ranks are still to pull, else it is reported. The lease passing, a release or a refused
  pull *closes* the record (no further pull is taken): it is reported once its sends are
  over, exactly once. A second pull from the same D rank fails alone.

D (``Consumer``), one record per D request::

    (none) --pull requested--> PULLING --every part's kvt completion--> reported
       \\                        |       (failed if any part failed)
        \\                       |  RPC failed / a part failed / request aborted: abort
         \\                      '  every running part, wait for their completions
          '--kvt refused expect (every part) / TP cannot map--> reported failed

- Tensor parallelism (fan-out): a pull has one *part* per P rank this D rank takes bytes from
  (``pull_sources``: every P rank holding one of its KV heads; MLA: one rank, spread), each its
  own kvt receive and transfer_kv call to ``config.rank_address(remote_rpc_address, p)``, with
  the block lists of the groups that rank serves. D's rank 0 also releases P ranks nobody
  pulls from (MLA with P TP > D TP). Each TP rank reports the request itself; vLLM counts a
  request as received (or sent) once every TP worker has reported it (KVOutputAggregator).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hybrid_connector.config import rank_address
from hybrid_connector.errors import ConfigError, LeaseExpired, PeerError, TransferError
from hybrid_connector.mapping import check_compatible, source_ranks
from hybrid_connector.metadata import PrefillSpec, RecvSpec, ReleaseSpec, SendSpec
from hybrid_connector.protocol import CacheSpec, LayoutSpec, TransferKvRequest

if TYPE_CHECKING:
    from kvt import Completion, LayerEvents

log = logging.getLogger(__name__)


def describe(completion: Completion) -> str:
    """One log-friendly line for a kvt completion."""
    origin = completion.origin.name if completion.origin is not None else None
    code = completion.code.name if completion.code is not None else None
    return f"{completion.status.name} origin={origin} code={code} reason={completion.reason!r}"


def check_cache_compatible(local: CacheSpec, remote: CacheSpec) -> None:
    """Raise PeerError unless every KV-cache group of ``remote`` matches ``local``'s, in order
    (count, kind, dtype; then ``mapping.check_compatible`` per group)."""
    if len(local.groups) != len(remote.groups):
        raise PeerError(
            f"KV-cache groups differ: local {[g.group for g in local.groups]}, "
            f"peer {[g.group for g in remote.groups]}"
        )
    for index, (mine, theirs) in enumerate(zip(local.groups, remote.groups, strict=True)):
        if mine.group != theirs.group:
            raise PeerError(f"group {index}: kind differs: local {mine.group}, peer {theirs.group}")
        if mine.dtype and theirs.dtype and mine.dtype != theirs.dtype:
            raise PeerError(
                f"group {index}: dtype differs: local {mine.dtype}, peer {theirs.dtype}"
            )
        try:
            check_compatible(mine, theirs)
        except PeerError as err:
            raise PeerError(f"group {index} ({mine.group}): {err}") from err


# ============================================================================== shared actions
@dataclass(frozen=True, slots=True)
class Count:
    """Add ``n`` to event counter ``name`` (metrics, ``transfer_counters()``)."""

    name: str
    n: int = 1


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort kvt's side of ``transfer_id`` (P's send, D's receive); its completion follows."""

    transfer_id: str
    reason: str


# ============================================================================== shared events
@dataclass(frozen=True, slots=True)
class ShuttingDown:
    """The worker closes: P's parked pulls fail, D's pulls are aborted; nothing is reported."""


# ============================================================================== P: events
@dataclass(frozen=True, slots=True)
class RequestFinished:
    """vLLM finished the request on P (``request_finished`` delayed the free of its blocks)."""

    spec: SendSpec


@dataclass(frozen=True, slots=True)
class RequestCancelled:
    """The request ended on P without KV to offer (aborted before its prompt completed)."""

    transfer_id: str


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """This step's forward pass completes the prompt (rapid transfer_kv); ``layer_events`` are
    marked as the pass writes each layer (passed through to ``StartSend`` untouched). Fed
    before the pass starts; the request is not finished until ``RequestFinished``."""

    spec: PrefillSpec
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
    | PrefillDone
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
class ReportSent:
    """Put ``request_id`` into vLLM's ``finished_sending``: its blocks may be reused now."""

    request_id: str


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
    StartSend | FailPull | Abort | ReportSent | AnswerRelease | ArmDeadline | CancelDeadline | Count
)


# ============================================================================== P: the machine
class Phase(enum.Enum):
    PARKED = "parked"  # pulls wait for the request
    HELD = "held"  # the blocks wait for (more) pulls; nothing is being sent
    SENDING = "sending"  # kvt may be reading the blocks (one send per pulling D rank)
    SENT = "sent"  # rapid: every send is over, the request still runs
    CANCELLED = "cancelled"  # nothing will be offered, or nobody will pull


def kvt_transfer_id(transfer_id: str, p_rank: int, p_tp: int, d_rank: int, d_tp: int) -> str:
    """kvt's request id for the bytes P rank ``p_rank`` sends D rank ``d_rank``: the transfer id
    itself with one rank on each side, else one id per rank pair (a kvt id is unique per engine,
    and one P rank may serve several D ranks, one D rank pull from several P ranks)."""
    if p_tp == 1 and d_tp == 1:
        return transfer_id
    return f"{transfer_id}/p{p_rank}d{d_rank}"


def pull_sources(
    p_tp: int, d_tp: int, d_rank: int, groups: list[LayoutSpec]
) -> dict[int, list[int]]:
    """The P ranks D rank ``d_rank`` pulls from, each with the KV-cache groups (indices) it takes
    from that rank (``mapping.source_ranks`` per group). PeerError/ConfigError if impossible."""
    sources: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        for source in source_ranks(p_tp, d_tp, d_rank, group):
            taken = sources.setdefault(source.p_rank, [])
            if index not in taken:
                taken.append(index)
    return dict(sorted(sources.items()))


def pulling_ranks(p_rank: int, p_tp: int, d_tp: int, groups: list[LayoutSpec]) -> list[int]:
    """The D ranks that pull from P rank ``p_rank`` (P's fan-in)."""
    return [d for d in range(d_tp) if p_rank in pull_sources(p_tp, d_tp, d, groups)]


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
    spec: SendSpec | None = None
    # vLLM has finished the request and waits for our report.
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
    # The request was aborted: no usable KV, later pulls fail at once (a tombstone follows).
    aborted: bool = False
    # CANCELLED: why later pulls fail (a tombstone after an abort, a release or a report).
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
            case PrefillDone(spec, layer_events):
                self._prefill_done(spec, layer_events, out)
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
    def _request_finished(self, spec: SendSpec, out: list[ProducerAction]) -> None:
        tid = spec.transfer_id
        record = self._transfers.get(tid)
        phase = None if record is None else record.phase
        rapid = record is not None and record.spec is not None and not record.finished
        if rapid and record.spec.request_id == spec.request_id:
            # An announced request finished: report it once every send is over.
            record.finished = True
            if spec.aborted:
                # No usable KV: no more pulls; the sends in flight end first.
                record.closed = record.aborted = True
                if not record.sends:
                    self._settle(tid, record, out)
            elif phase is Phase.SENT:
                self._report(tid, out)
            elif phase is Phase.HELD:
                out.append(ArmDeadline(tid, self._settings.lease_s))  # the lease, from now
            return
        if phase is Phase.CANCELLED:
            if not spec.aborted:
                out.append(Count("released_by_peer"))
            out.append(ReportSent(spec.request_id))
            return
        if record is not None and phase is not Phase.PARKED:
            assert record.spec is not None
            log.warning(
                "request %s: transfer_id %s is already held for request %s; releasing the "
                "new request's blocks at once",
                spec.request_id,
                tid,
                record.spec.request_id,
            )
            if record.spec.request_id != spec.request_id:
                out.append(ReportSent(spec.request_id))
            return
        if spec.aborted:
            self._request_cancelled(tid, out)
            out.append(ReportSent(spec.request_id))
            return
        out.append(Count("offers"))
        if record is None:
            # No pull yet: hold the blocks for one lease.
            self._transfers[tid] = _Transfer(Phase.HELD, spec=spec, finished=True)
            out.append(ArmDeadline(tid, self._settings.lease_s))
            log.debug("request %s: holding blocks for transfer %s", spec.request_id, tid)
            return
        record.phase, record.spec, record.finished = Phase.HELD, spec, True
        if record.waits_for_pulls():
            out.append(ArmDeadline(tid, self._settings.lease_s))  # the D ranks still to pull
        self._start_parked(tid, record, out)

    def _request_cancelled(self, tid: str, out: list[ProducerAction]) -> None:
        record = self._transfers.get(tid)
        if record is None or record.phase is Phase.PARKED:
            self._cancel(tid, "prefill request aborted on P", out)

    def _prefill_done(
        self, spec: PrefillSpec, layer_events: LayerEvents | None, out: list[ProducerAction]
    ) -> None:
        tid = spec.transfer_id
        record = self._transfers.get(tid)
        held = SendSpec(spec.request_id, tid, spec.block_ids, spec.num_tokens)
        if record is None:
            # No pull yet: one that arrives during the forward pass (HELD*, under a lease) or
            # later is sent layer by layer as the step's events say the layers are written.
            self._transfers[tid] = _Transfer(Phase.HELD, spec=held, layer_events=layer_events)
            out.append(Count("offers"))
            out.append(ArmDeadline(tid, self._settings.lease_s))
            log.debug("request %s: transfer %s offered during its prefill", spec.request_id, tid)
            return
        if record.phase is not Phase.PARKED:
            # CANCELLED (released, aborted): the request is reported once it finished; any
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
            log.warning(
                "request %s: transfer_kv from %s for transfer %s (D request %s) rejected: %s",
                who,
                peer,
                tid,
                request.request_id,
                err,
            )
            out.append(FailPull(pull, err))
            if record is not None and record.phase is Phase.HELD:
                # D recomputes: its other ranks' pulls are of no use any more.
                record.closed = True
                self._settle(tid, record, out)
            return
        if record is None:
            # P has not finished (or not even seen) the request: hold the pull within the lease.
            self._transfers[tid] = _Transfer(
                Phase.PARKED, parked={d_rank: event}, pulled={d_rank}, expected=expected
            )
            out.append(Count("early_pulls"))
            out.append(ArmDeadline(tid, self._settings.lease_s))
            log.debug("transfer %s: transfer_kv from %s waits for the request", tid, peer)
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
            log.debug(
                "request %s: transfer %s released by %s (%s)",
                record.spec.request_id,
                tid,
                event.peer,
                event.reason,
            )
            out.append(Count("released_by_peer"))
            record.closed = True
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
            log.warning(
                "request %s: transfer %s for %s (D request %s) rejected: %s",
                spec.request_id,
                tid,
                peer,
                request.request_id,
                err,
            )
            out.append(FailPull(pull, err))
            record.closed = True
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

    def _source_blocks(self, spec: SendSpec, request: TransferKvRequest) -> list[list[int]]:
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
        log.warning(
            "request %s: kvt refused to send transfer %s: %s; %s",
            record.spec.request_id,
            kvt_id,
            error,
            "aborting it, blocks back after its completion" if kvt_has_blocks else "releasing",
        )
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
            log.warning(
                "request %s: sending transfer %s failed (%s)",
                record.spec.request_id,
                kvt_id,
                describe(completion),
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
                log.warning(
                    "request %s: transfer %s not confirmed within %.1fs; aborting it (its "
                    "blocks come back with kvt's completion)",
                    record.spec.request_id,
                    key,
                    self._settings.transfer_timeout_s,
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
            log.warning(
                "request %s: %d of %s decode rank(s) pulled transfer %s within the %.1fs "
                "lease; releasing its blocks%s",
                record.spec.request_id,
                len(record.pulled),
                record.expected or "the",
                tid,
                self._settings.lease_s,
                " once the sends are over" if record.sends else "",
            )
            if not record.finished:
                log.warning(
                    "request %s: still running on P; its blocks go back once it finished",
                    record.spec.request_id,
                )
            record.closed = True
            if not record.sends:
                self._settle(tid, record, out)
        elif record.phase is Phase.PARKED:
            for parked in record.parked.values():
                out.append(Count("early_pulls_expired"))
                log.warning(
                    "transfer %s: transfer_kv from %s (D request %s) expired: the request did "
                    "not finish on P within the %.1fs lease",
                    tid,
                    parked.peer,
                    parked.request.request_id,
                    self._settings.lease_s,
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
            self._report(tid, out)
        else:
            # Rapid: the request still runs; report it when vLLM finishes it.
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

    def _report(self, tid: str, out: list[ProducerAction]) -> None:
        """Give the blocks back to vLLM (the record ends)."""
        record = self._transfers.pop(tid)
        assert record.spec is not None
        assert not record.sends
        out.append(CancelDeadline(tid))
        out.append(ReportSent(record.spec.request_id))
        # A tombstone for one lease: a later pull (a proxy failing over to a second D after the
        # first one pulled) fails at once, so that D recomputes now, not after a parked lease.
        reason = "prefill request aborted on P" if record.aborted else "already sent, blocks freed"
        self._cancel(tid, reason, out)

    def _forget(self, tid: str, out: list[ProducerAction]) -> None:
        del self._transfers[tid]
        out.append(CancelDeadline(tid))


# ============================================================================== D: events
@dataclass(frozen=True, slots=True)
class PullRequested:
    """vLLM allocated blocks for a request whose prompt's KV is on P."""

    spec: RecvSpec


@dataclass(frozen=True, slots=True)
class ExpectRefused:
    """kvt refused ``expect`` (``StartPull`` could not start): nothing will be written.
    ``kvt_id``: the part's (``StartPull.kvt_id``); "" = the request's only part."""

    request_id: str
    error: Exception
    kvt_id: str = ""


@dataclass(frozen=True, slots=True)
class PullCallFailed:
    """The transfer_kv RPC to P failed (unreachable, rejected, timed out)."""

    request_id: str
    error: Exception
    kvt_id: str = ""


@dataclass(frozen=True, slots=True)
class RecvCompleted:
    """kvt's (one) completion of the receive of one part."""

    request_id: str
    completion: Completion
    kvt_id: str = ""


@dataclass(frozen=True, slots=True)
class PullCancelled:
    """The D request finished (aborted) while its pull was in flight."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReleaseRequested:
    """D will not pull: tell P to free the transfer."""

    spec: ReleaseSpec


ConsumerEvent = (
    PullRequested
    | ExpectRefused
    | PullCallFailed
    | RecvCompleted
    | PullCancelled
    | ReleaseRequested
    | ShuttingDown
)


# ============================================================================== D: actions
@dataclass(frozen=True, slots=True)
class StartPull:
    """kvt ``expect`` ``kvt_id`` (feeding ``RecvCompleted`` on completion, ``ExpectRefused``
    if refused), then call transfer_kv on ``spec.remote_rpc_address`` (feeding
    ``PullCallFailed`` if it fails). ``spec`` is this part's: one P rank's address and the
    block lists of the groups that rank serves (empty for the others)."""

    spec: RecvSpec
    kvt_id: str = ""


@dataclass(frozen=True, slots=True)
class StopCall:
    """Stop waiting for the transfer_kv answer of ``kvt_id`` (the completion decided)."""

    request_id: str
    kvt_id: str = ""


@dataclass(frozen=True, slots=True)
class CallRelease:
    """Send the release RPC to P (best effort: P's lease frees it otherwise)."""

    spec: ReleaseSpec


@dataclass(frozen=True, slots=True)
class ReportRecv:
    """Put ``request_id`` into vLLM's ``finished_recving`` (and ``failed_recving`` if failed)."""

    request_id: str
    failed: bool


ConsumerAction = StartPull | StopCall | Abort | CallRelease | ReportRecv | Count


@dataclass(slots=True)
class _Part:
    """One P rank's share of a pull."""

    spec: RecvSpec
    done: bool = False
    aborting: bool = False


@dataclass(slots=True)
class _Receive:
    spec: RecvSpec
    parts: dict[str, _Part]  # by kvt id
    failed: bool = False


class Consumer:
    """D's pulls, for one TP rank. Pure: a request is reported exactly once, after kvt's
    completion of every part (kvt then no longer writes into its blocks), or at once if kvt
    never accepted any; failed if any part failed.

    With TP on either side a pull fans out: one part per P rank this rank takes bytes from
    (``pull_sources``), each its own kvt receive and transfer_kv call. A failed part aborts
    the others (vLLM recomputes the request anyway).
    """

    def __init__(self, local_spec: CacheSpec | None = None) -> None:
        self._local = local_spec
        self._pulls: dict[str, _Receive] = {}

    def __len__(self) -> int:
        return len(self._pulls)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pulls

    def handle(self, event: ConsumerEvent) -> list[ConsumerAction]:
        out: list[ConsumerAction] = []
        match event:
            case PullRequested(spec):
                if spec.request_id in self._pulls:
                    log.warning(
                        "request %s: pull already in flight; ignoring a second one",
                        spec.request_id,
                    )
                else:
                    self._start(spec, out)
            case ExpectRefused(request_id, error, kvt_id):
                found = self._part(request_id, kvt_id)
                if found is not None:
                    pull, part = found
                    log.warning(
                        "request %s: cannot expect %s from %s: %s; recomputing locally",
                        request_id,
                        kvt_id or pull.spec.transfer_id,
                        part.spec.remote_rpc_address,
                        error,
                    )
                    part.done = True
                    self._part_failed(pull, f"expect refused: {error}", out)
            case PullCallFailed(request_id, error, kvt_id):
                found = self._part(request_id, kvt_id)
                if found is not None:
                    self._abort(found[0], f"transfer_kv failed: {error}", out)
            case RecvCompleted(request_id, completion, kvt_id):
                found = self._part(request_id, kvt_id)
                if found is not None:
                    self._completed(*found, completion, out)
            case PullCancelled(request_id):
                pull = self._pulls.get(request_id)
                if pull is not None:
                    for address in self._addresses(pull):
                        out.append(
                            CallRelease(
                                ReleaseSpec(request_id, pull.spec.transfer_id, address, "aborted")
                            )
                        )
                    self._abort(pull, "decode request aborted", out)
            case ReleaseRequested(spec):
                for p in range(max(1, spec.remote_tp_size)):
                    address = spec.remote_rpc_address
                    if spec.remote_tp_size > 1:
                        address = rank_address(address, p)
                    out.append(CallRelease(replace(spec, remote_rpc_address=address)))
            case ShuttingDown():
                # Their completions are not reported: the worker is closing.
                for pull in self._pulls.values():
                    for kvt_id, part in pull.parts.items():
                        if not part.done:
                            out.append(Abort(kvt_id, "decode instance shutting down"))
                self._pulls.clear()
            case _:
                raise TypeError(f"not a consumer event: {event!r}")
        return out

    # -- fan-out ----------------------------------------------------------------------------
    def _ranks(self) -> tuple[int, int]:
        local = self._local
        return (0, 1) if local is None else (local.tp_rank, local.tp_size)

    def _plan(self, spec: RecvSpec) -> dict[str, _Part]:
        """One part per P rank this rank pulls from (PeerError/ConfigError: TP cannot map)."""
        d_rank, d_tp = self._ranks()
        p_tp = spec.remote_tp_size
        if p_tp == 1 and d_tp == 1:
            return {spec.transfer_id: _Part(spec)}
        assert self._local is not None
        parts: dict[str, _Part] = {}
        for p_rank, groups in pull_sources(p_tp, d_tp, d_rank, self._local.groups).items():
            block_ids = [ids if g in groups else [] for g, ids in enumerate(spec.block_ids)]
            address = rank_address(spec.remote_rpc_address, p_rank)
            kvt_id = kvt_transfer_id(spec.transfer_id, p_rank, p_tp, d_rank, d_tp)
            parts[kvt_id] = _Part(replace(spec, remote_rpc_address=address, block_ids=block_ids))
        return parts

    def _idle_p_ranks(self, spec: RecvSpec) -> list[int]:
        """P ranks no D rank pulls from (MLA, P TP > D TP): rank 0 releases them."""
        d_rank, d_tp = self._ranks()
        p_tp = spec.remote_tp_size
        if d_rank != 0 or p_tp == 1 or self._local is None:
            return []
        used: set[int] = set()
        for d in range(d_tp):
            used.update(pull_sources(p_tp, d_tp, d, self._local.groups))
        return [p for p in range(p_tp) if p not in used]

    def _start(self, spec: RecvSpec, out: list[ConsumerAction]) -> None:
        try:
            parts = self._plan(spec)
            idle = self._idle_p_ranks(spec)
        except (PeerError, ConfigError) as err:
            log.warning(
                "request %s: cannot pull transfer %s from %s (P TP %d, D TP %d): %s; "
                "recomputing locally",
                spec.request_id,
                spec.transfer_id,
                spec.remote_rpc_address,
                spec.remote_tp_size,
                self._ranks()[1],
                err,
            )
            out.append(Count("pulls_failed"))
            out.append(ReportRecv(spec.request_id, failed=True))
            return
        self._pulls[spec.request_id] = _Receive(spec, parts)
        out.append(Count("pulls_started"))
        for kvt_id, part in parts.items():
            out.append(StartPull(part.spec, kvt_id))
        for p in idle:
            address = rank_address(spec.remote_rpc_address, p)
            reason = "no decode rank pulls from this rank"
            out.append(CallRelease(ReleaseSpec(spec.request_id, spec.transfer_id, address, reason)))

    def _addresses(self, pull: _Receive) -> list[str]:
        return [part.spec.remote_rpc_address for part in pull.parts.values()]

    def _part(self, request_id: str, kvt_id: str) -> tuple[_Receive, _Part] | None:
        """The running part ``kvt_id`` of ``request_id``'s pull ("": its first running one)."""
        pull = self._pulls.get(request_id)
        if pull is None:
            return None
        if kvt_id:
            part = pull.parts.get(kvt_id)
        else:
            part = next((p for p in pull.parts.values() if not p.done), None)
        return None if part is None or part.done else (pull, part)

    def _abort(self, pull: _Receive, reason: str, out: list[ConsumerAction]) -> None:
        """Abort every part still running (each one's completion, ABORTED, reports it)."""
        for kvt_id, part in pull.parts.items():
            if not part.done and not part.aborting:
                part.aborting = True
                out.append(Abort(kvt_id, reason))

    def _part_failed(self, pull: _Receive, reason: str, out: list[ConsumerAction]) -> None:
        pull.failed = True
        self._abort(pull, reason, out)
        self._maybe_done(pull, out)

    def _completed(
        self, pull: _Receive, part: _Part, completion: Completion, out: list[ConsumerAction]
    ) -> None:
        spec = part.spec
        part.done = True
        kvt_id = next(k for k, p in pull.parts.items() if p is part)
        out.append(StopCall(spec.request_id, kvt_id))
        if completion.ok:
            out.append(Count("bytes_received", int(completion.nbytes)))
            self._maybe_done(pull, out)
            return
        log.warning(
            "request %s: pulling %s from %s failed (%s); vLLM recomputes it",
            spec.request_id,
            kvt_id,
            spec.remote_rpc_address,
            describe(completion),
        )
        self._part_failed(pull, f"another part failed: {completion.reason}", out)

    def _maybe_done(self, pull: _Receive, out: list[ConsumerAction]) -> None:
        """Report the request once every part is over."""
        if not all(part.done for part in pull.parts.values()):
            return
        del self._pulls[pull.spec.request_id]
        out.append(Count("pulls_failed" if pull.failed else "pulls_done"))
        out.append(ReportRecv(pull.spec.request_id, failed=pull.failed))
