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
      |--request finished--> HELD --pull arrives--> SENDING --kvt completion--> reported
      |                        '--lease passes / release / bad pull--------------> reported
      '--release / abort---> CANCELLED --one lease later--> (none)

    SENDING* --kvt completion--> SENT --request finished--> reported
    SENDING* --request finished--> SENDING (then as above)

    SENDING --send deadline--> SENDING (kvt told to abort; its completion still decides)

  CANCELLED: a pull fails at once and a late "request finished" is reported at once.

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

D (``Consumer``), one record per D request::

    (none) --pull requested--> PULLING --kvt completion--> reported (failed unless DONE)
       \\                        |  RPC failed / request aborted: abort kvt, wait for its
        \\                       '  completion (kvt may be writing into the blocks)
         '--kvt refused expect--> reported failed
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_connector.errors import LeaseExpired, PeerError, TransferError
from hybrid_connector.mapping import check_compatible
from hybrid_connector.metadata import PrefillSpec, RecvSpec, ReleaseSpec, SendSpec
from hybrid_connector.protocol import CacheSpec, TransferKvRequest

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
    marked as the pass writes each layer (passed through to ``StartSend`` untouched)."""

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
    before refusing, so it may still read the blocks and a completion will follow."""

    transfer_id: str
    error: Exception
    kvt_has_blocks: bool


@dataclass(frozen=True, slots=True)
class SendCompleted:
    """kvt's (one) completion of the send."""

    transfer_id: str
    completion: Completion


@dataclass(frozen=True, slots=True)
class DeadlineReached:
    """The deadline armed for ``transfer_id`` passed."""

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
    PARKED = "parked"  # a pull waits for the request
    HELD = "held"  # the request finished; its blocks wait for a pull
    SENDING = "sending"  # kvt may be reading the blocks
    SENT = "sent"  # rapid: the send is over, the request still runs
    CANCELLED = "cancelled"  # nothing will be offered, or nobody will pull


@dataclass(slots=True)
class _Transfer:
    phase: Phase
    # The request whose blocks are involved (HELD, SENDING, SENT).
    spec: SendSpec | None = None
    # SENDING/SENT: vLLM has finished the request and waits for our report.
    finished: bool = False
    # PARKED: the waiting pull (its transfer_kv call is not answered yet).
    parked: PullArrived | None = None
    # SENDING: the send guard passed (or kvt refused a later batch): kvt was told to abort.
    aborting: bool = False


@dataclass
class ProducerSettings:
    lease_s: float
    transfer_timeout_s: float


class Producer:
    """P's offers, leases, parked pulls, cancellations and rapid sends. Pure: see the module
    docstring for the states; :meth:`handle` returns what the shell must do, in order."""

    def __init__(self, local_spec: CacheSpec, settings: ProducerSettings) -> None:
        self._spec = local_spec
        self._settings = settings
        self._transfers: dict[str, _Transfer] = {}

    def phase(self, transfer_id: str) -> Phase | None:
        """The record's phase (None: nothing is known about ``transfer_id``)."""
        record = self._transfers.get(transfer_id)
        return None if record is None else record.phase

    def __len__(self) -> int:
        return len(self._transfers)

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
                record = self._transfers.get(tid)
                if record is not None and record.parked is not None and record.parked.pull == pull:
                    self._forget(tid, out)
            case ReleaseArrived():
                self._release_arrived(event, out)
            case SendRefused(tid, error, kvt_has_blocks):
                self._send_refused(tid, error, kvt_has_blocks, out)
            case SendCompleted(tid, completion):
                self._send_completed(tid, completion, out)
            case DeadlineReached(tid):
                self._deadline(tid, out)
            case ShuttingDown():
                for tid, record in list(self._transfers.items()):
                    if record.parked is not None:
                        error = TransferError("P is shutting down")
                        out.append(FailPull(record.parked.pull, error))
                    out.append(CancelDeadline(tid))
                self._transfers.clear()
            case _:
                raise TypeError(f"not a producer event: {event!r}")
        return out

    # -- vLLM ------------------------------------------------------------------------------
    def _request_finished(self, spec: SendSpec, out: list[ProducerAction]) -> None:
        tid = spec.transfer_id
        record = self._transfers.get(tid)
        phase = None if record is None else record.phase
        if record is not None and phase in (Phase.SENDING, Phase.SENT) and not record.finished:
            assert record.spec is not None
            if record.spec.request_id == spec.request_id:
                # A rapid send's request finished: report it once the send is over.
                record.finished = True
                if phase is Phase.SENT:
                    self._report(tid, out)
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
        parked, record.parked = record.parked, None
        assert parked is not None
        record.phase, record.spec, record.finished = Phase.HELD, spec, True
        self._start_send(tid, record, parked, out)

    def _request_cancelled(self, tid: str, out: list[ProducerAction]) -> None:
        record = self._transfers.get(tid)
        if record is None or record.phase is Phase.PARKED:
            self._cancel(tid, "prefill request aborted on P", out)

    def _prefill_done(
        self, spec: PrefillSpec, layer_events: LayerEvents | None, out: list[ProducerAction]
    ) -> None:
        tid = spec.transfer_id
        record = self._transfers.get(tid)
        if record is None or record.phase is not Phase.PARKED:
            return  # no pull yet: the plain path serves it once the request finished
        parked, record.parked = record.parked, None
        assert parked is not None
        record.phase = Phase.HELD
        record.spec = SendSpec(spec.request_id, tid, spec.block_ids, spec.num_tokens)
        record.finished = False
        out.append(Count("rapid_sends"))
        self._start_send(tid, record, parked, out, layer_events=layer_events)

    # -- D and the proxy --------------------------------------------------------------------
    def _pull_arrived(self, event: PullArrived, out: list[ProducerAction]) -> None:
        request, pull, peer = event.request, event.pull, event.peer
        tid = request.transfer_id
        record = self._transfers.get(tid)
        try:
            check_cache_compatible(self._spec, request.layout)
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
                self._report(tid, out)  # one pull per transfer: this one failed for good
            return
        if record is None:
            # P has not finished (or not even seen) the request: hold the pull within the lease.
            self._transfers[tid] = _Transfer(Phase.PARKED, parked=event)
            out.append(Count("early_pulls"))
            out.append(ArmDeadline(tid, self._settings.lease_s))
            log.debug("transfer %s: transfer_kv from %s waits for the request", tid, peer)
            return
        if record.phase is Phase.HELD:
            self._start_send(tid, record, event, out)
        elif record.phase is Phase.CANCELLED:
            out.append(FailPull(pull, TransferError(f"transfer {tid}: cancelled on P")))
        elif record.phase is Phase.PARKED:
            msg = f"transfer {tid}: duplicate transfer_kv while waiting for the request"
            out.append(FailPull(pull, PeerError(msg)))
        else:
            msg = f"transfer {tid} is already being sent (duplicate transfer_kv)"
            out.append(FailPull(pull, PeerError(msg)))

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
            self._report(tid, out)
            out.append(AnswerRelease(tid, True))
            return
        if record is None or record.phase is Phase.PARKED:
            if record is not None:
                out.append(Count("early_pulls_released"))
            self._cancel(tid, f"released by {event.peer}: {event.reason}", out)
        # SENDING / SENT: the send goes on (D aborts it through kvt if it must).
        out.append(AnswerRelease(tid, False))

    # -- kvt --------------------------------------------------------------------------------
    def _start_send(
        self,
        tid: str,
        record: _Transfer,
        parked: PullArrived,
        out: list[ProducerAction],
        layer_events: LayerEvents | None = None,
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
            self._over(tid, record, out)
            return
        record.phase = Phase.SENDING
        # Guard: kvt has its own deadline too; whatever happens, abort after this long.
        out.append(ArmDeadline(tid, self._settings.transfer_timeout_s))
        out.append(StartSend(tid, pull, spec.request_id, src_block_ids, request, layer_events))

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

    def _send_refused(
        self, tid: str, error: Exception, kvt_has_blocks: bool, out: list[ProducerAction]
    ) -> None:
        record = self._transfers.get(tid)
        if record is None or record.phase is not Phase.SENDING:
            return
        assert record.spec is not None
        log.warning(
            "request %s: kvt refused to send transfer %s: %s; %s",
            record.spec.request_id,
            tid,
            error,
            "aborting it, blocks back after its completion" if kvt_has_blocks else "releasing",
        )
        if kvt_has_blocks:
            if not record.aborting:
                record.aborting = True
                out.append(Abort(tid, f"send refused on P: {error}"))
            return
        self._over(tid, record, out)

    def _send_completed(self, tid: str, completion: Completion, out: list[ProducerAction]):
        record = self._transfers.get(tid)
        if record is None or record.phase is not Phase.SENDING:
            return  # not ours (kvt refused the first batch and told this callback too)
        assert record.spec is not None
        out.append(Count("sends_done" if completion.ok else "sends_failed"))
        if not completion.ok:
            log.warning(
                "request %s: sending transfer %s failed (%s); releasing its blocks",
                record.spec.request_id,
                tid,
                describe(completion),
            )
        self._over(tid, record, out)

    # -- deadlines --------------------------------------------------------------------------
    def _deadline(self, tid: str, out: list[ProducerAction]) -> None:
        record = self._transfers.get(tid)
        if record is None:
            return
        if record.phase is Phase.HELD:
            assert record.spec is not None
            out.append(Count("leases_expired"))
            log.warning(
                "request %s: no decode instance pulled transfer %s within the %.1fs lease; "
                "releasing its blocks",
                record.spec.request_id,
                tid,
                self._settings.lease_s,
            )
            self._report(tid, out)
        elif record.phase is Phase.PARKED:
            parked = record.parked
            assert parked is not None
            out.append(Count("early_pulls_expired"))
            log.warning(
                "transfer %s: transfer_kv from %s (D request %s) expired: the request did not "
                "finish on P within the %.1fs lease",
                tid,
                parked.peer,
                parked.request.request_id,
                self._settings.lease_s,
            )
            out.append(FailPull(parked.pull, LeaseExpired(f"transfer {tid} not on P in time")))
            del self._transfers[tid]
        elif record.phase is Phase.SENDING and not record.aborting:
            assert record.spec is not None
            log.warning(
                "request %s: transfer %s not confirmed within %.1fs; aborting it (its blocks "
                "come back with kvt's completion)",
                record.spec.request_id,
                tid,
                self._settings.transfer_timeout_s,
            )
            record.aborting = True
            out.append(Count("sends_timed_out"))
            out.append(Abort(tid, "send timed out on P"))
        elif record.phase is Phase.CANCELLED:
            del self._transfers[tid]

    # -- internals --------------------------------------------------------------------------
    def _cancel(self, tid: str, reason: str, out: list[ProducerAction]) -> None:
        """No KV will be offered (or pulled) for ``tid``: fail its parked pull, refuse later
        pulls and release a late request at once, for one lease."""
        record = self._transfers.get(tid)
        if record is not None and record.parked is not None:
            out.append(FailPull(record.parked.pull, TransferError(f"transfer {tid}: {reason}")))
        self._transfers[tid] = _Transfer(Phase.CANCELLED)
        out.append(ArmDeadline(tid, self._settings.lease_s))

    def _over(self, tid: str, record: _Transfer, out: list[ProducerAction]) -> None:
        """kvt no longer reads the blocks: report them if vLLM finished the request."""
        if record.finished:
            self._report(tid, out)
        else:
            out.append(CancelDeadline(tid))
            record.phase = Phase.SENT
            record.aborting = False

    def _report(self, tid: str, out: list[ProducerAction]) -> None:
        """Give the blocks back to vLLM (the record ends)."""
        record = self._transfers.pop(tid)
        assert record.spec is not None
        out.append(CancelDeadline(tid))
        out.append(ReportSent(record.spec.request_id))

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
    """kvt refused ``expect`` (``StartPull`` could not start): nothing will be written."""

    request_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class PullCallFailed:
    """The transfer_kv RPC to P failed (unreachable, rejected, timed out)."""

    request_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class RecvCompleted:
    """kvt's (one) completion of the receive."""

    request_id: str
    completion: Completion


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
    """kvt ``expect`` the transfer (feeding ``RecvCompleted`` on completion, ``ExpectRefused``
    if refused), then call transfer_kv on P (feeding ``PullCallFailed`` if it fails)."""

    spec: RecvSpec


@dataclass(frozen=True, slots=True)
class StopCall:
    """Stop waiting for the transfer_kv answer of ``request_id`` (the completion decided)."""

    request_id: str


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
class _Receive:
    spec: RecvSpec
    aborting: bool = False


class Consumer:
    """D's pulls. Pure: a request is reported exactly once, after kvt's completion (kvt then no
    longer writes into its blocks), or at once if kvt never accepted the receive."""

    def __init__(self) -> None:
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
                    self._pulls[spec.request_id] = _Receive(spec)
                    out.append(Count("pulls_started"))
                    out.append(StartPull(spec))
            case ExpectRefused(request_id, error):
                pull = self._pulls.pop(request_id, None)
                if pull is not None:
                    log.warning(
                        "request %s: cannot expect transfer %s from %s: %s; recomputing locally",
                        request_id,
                        pull.spec.transfer_id,
                        pull.spec.remote_rpc_address,
                        error,
                    )
                    out.append(Count("pulls_failed"))
                    out.append(ReportRecv(request_id, failed=True))
            case PullCallFailed(request_id, error):
                self._abort(request_id, f"transfer_kv failed: {error}", out)
            case RecvCompleted(request_id, completion):
                pull = self._pulls.pop(request_id, None)
                if pull is not None:
                    self._completed(pull, completion, out)
            case PullCancelled(request_id):
                pull = self._pulls.get(request_id)
                if pull is not None:
                    spec = pull.spec
                    out.append(
                        CallRelease(
                            ReleaseSpec(
                                request_id, spec.transfer_id, spec.remote_rpc_address, "aborted"
                            )
                        )
                    )
                    self._abort(request_id, "decode request aborted", out)
            case ReleaseRequested(spec):
                out.append(CallRelease(spec))
            case ShuttingDown():
                # Their completions are not reported: the worker is closing.
                for pull in self._pulls.values():
                    out.append(Abort(pull.spec.transfer_id, "decode instance shutting down"))
                self._pulls.clear()
            case _:
                raise TypeError(f"not a consumer event: {event!r}")
        return out

    def _abort(self, request_id: str, reason: str, out: list[ConsumerAction]) -> None:
        pull = self._pulls.get(request_id)
        if pull is not None and not pull.aborting:
            pull.aborting = True  # the completion (ABORTED) reports it
            out.append(Abort(pull.spec.transfer_id, reason))

    def _completed(self, pull: _Receive, completion: Completion, out: list[ConsumerAction]) -> None:
        spec = pull.spec
        ok = completion.ok
        out.append(StopCall(spec.request_id))
        out.append(Count("pulls_done" if ok else "pulls_failed"))
        if ok:
            out.append(Count("bytes_received", int(completion.nbytes)))
        else:
            log.warning(
                "request %s: pulling transfer %s from %s failed (%s); vLLM recomputes it",
                spec.request_id,
                spec.transfer_id,
                spec.remote_rpc_address,
                describe(completion),
            )
        out.append(ReportRecv(spec.request_id, failed=not ok))
