"""D's transfer logic as a pure state machine: events in, actions out. No I/O.

The worker shell (``worker_side.ConsumerShell``) feeds it what happened (vLLM's metadata, a
failed transfer_kv call, a kvt completion) and carries out what it decides (kvt expects, the
transfer_kv and release calls to P, aborts, reports to vLLM). P's side is ``producer.py``.

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

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hybrid_connector.common import Abort, Count, Log, ShuttingDown, describe
from hybrid_connector.config import rank_address
from hybrid_connector.errors import ConfigError, PeerError
from hybrid_connector.mapping import kvt_transfer_id, pull_sources
from hybrid_connector.metadata import RecvSpec, ReleaseSpec
from hybrid_connector.protocol import CacheSpec

if TYPE_CHECKING:
    from kvt import Completion


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
                    out.append(
                        Log(
                            logging.WARNING,
                            "request %s: pull already in flight; ignoring a second one",
                            (spec.request_id,),
                        )
                    )
                else:
                    self._start(spec, out)
            case ExpectRefused(request_id, error, kvt_id):
                found = self._part(request_id, kvt_id)
                if found is not None:
                    pull, part = found
                    out.append(
                        Log(
                            logging.WARNING,
                            "request %s: cannot expect %s from %s: %s; recomputing locally",
                            (
                                request_id,
                                kvt_id or pull.spec.transfer_id,
                                part.spec.remote_rpc_address,
                                error,
                            ),
                        )
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
            out.append(
                Log(
                    logging.WARNING,
                    "request %s: cannot pull transfer %s from %s (P TP %d, D TP %d): %s; "
                    "recomputing locally",
                    (
                        spec.request_id,
                        spec.transfer_id,
                        spec.remote_rpc_address,
                        spec.remote_tp_size,
                        self._ranks()[1],
                        err,
                    ),
                )
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
        out.append(
            Log(
                logging.WARNING,
                "request %s: pulling %s from %s failed (%s); vLLM recomputes it",
                (spec.request_id, kvt_id, spec.remote_rpc_address, describe(completion)),
            )
        )
        self._part_failed(pull, f"another part failed: {completion.reason}", out)

    def _maybe_done(self, pull: _Receive, out: list[ConsumerAction]) -> None:
        """Report the request once every part is over."""
        if not all(part.done for part in pull.parts.values()):
            return
        del self._pulls[pull.spec.request_id]
        out.append(Count("pulls_failed" if pull.failed else "pulls_done"))
        out.append(ReportRecv(pull.spec.request_id, failed=pull.failed))
