"""A request's lifecycle on one side, as a pure state machine: events in, actions out. No I/O.

The engine (:mod:`kvt.engine`) owns the tables, the lock and the threads: it feeds each request's
:class:`Lifecycle` what happened (a frame begun or ended, the peer's DONE or ABORT, a lost link,
the deadline, the caller's abort, close) under its lock and carries out what comes back (send a
control frame, answer with a verdict, ask for one on a fresh link, complete, arm a deadline,
close a stalled link, log) outside it. Nothing here owns a thread, socket, timer or clock; the
tests drive it event by event (``tests/test_lifecycle.py``).

States (:class:`Phase`), one machine per request and side::

    PENDING --first frame begins--> TRANSFERRING --receiver wrote every byte--> DONE
       |                               |
       |  (receiver) caller abort, deadline, peer ABORT, link lost, bad input: decided at once
       |
       '--(sender) caller abort / deadline--> VERDICT_WAIT: ABORT sent, no more frames begin
       |        --receiver's DONE---------------------------------> DONE (the abort came late)
       |        --receiver confirms the sender's ABORT came first--> ABORTED(LOCAL / TIMEOUT)
       |        --receiver's own ABORT (it aborted first)----------> ABORTED(PEER)
       |        --link lost--> ask again on a fresh link (3 links at most, then TRANSPORT)
       |        --deadline--> one grace (VERDICT_GRACE_S) more, then ABORTED(LOCAL / TIMEOUT),
       |                      the peer told again
       '--(sender) link lost once the last batch began--> VERDICT_ASK: ABORT(CONNECTION_LOST)
                --receiver's DONE--> DONE                               on a fresh link
                --receiver's ABORT--> ABORTED(TRANSPORT, or PEER if it aborted first)
                --the fresh link lost too--> ask again, or ABORTED(TRANSPORT) after 3 links
                --no fresh link / deadline and one grace--> ABORTED(TRANSPORT)

    any decision while the backend is inside a frame of the request --> DRAINING
        --the backend lets go (frame ended)--> COMPLETE (the completion is delivered)

DONE and ABORTED are the completion's status; the machine's last phases are DRAINING (decided,
the backend still touching the request's memory) and COMPLETE (delivered). The outcome is stored
once (:attr:`Lifecycle.outcome`) and never changes after it is set.

**Who aborted first: the receiver decides.** The receiver decides every abort at once, in the
order its events come: its caller's ``abort()``, its deadline, the sender's ABORT, a lost link.
A sender never decides an abort it started itself (its caller's ``abort()``, its deadline): it
sends ABORT and waits for the receiver's verdict. The receiver answers every ABORT from its
sender with its own outcome: DONE (the abort came too late), a confirmation (``Abort.confirms``:
the sender's ABORT was the first thing that ended the request there, which completed ABORTED
(PEER)) or its own earlier ABORT (it aborted first, or refused bad input, or lost the link).
So crossed aborts (both callers abort within a millisecond) get one answer on both sides: the
one whose abort reached the receiver's lock first says LOCAL, the other PEER. The same holds
for a sender's deadline crossing a receiver's abort. The wait is bounded: a lost link asks again
on a fresh one (3 links at most), and a deadline ends it: the request's deadline gives the
verdict one grace of :data:`VERDICT_GRACE_S` more (it may be crossing the deadline), then the
sender's own abort stands. Only ``close()`` decides at once (it cannot wait), and a sender that
cannot reach the receiver at all.

Also kept here: the sender waits for the verdict when its link dies once its last batch began
(the receiver may be DONE, its DONE lost with the link), and a request is never COMPLETE while
the backend is inside one of its frames, so callers may free their blocks as the callback runs.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvt.control import Abort, AbortTarget, ControlMessage, Done
from kvt.outcome import AbortCode, AbortOrigin, Completion, TransferStatus

VERDICT_ASKS = 3  # fresh links a sender tries for the receiver's verdict
VERDICT_GRACE_S = 1.0  # how long a sender whose deadline passed waits for the receiver's verdict


class Side(enum.Enum):
    SEND = "send"
    RECV = "recv"


class RequestKey(NamedTuple):
    """What identifies a request on one engine: its side and its id (a tombstone's key)."""

    side: Side
    request_id: str


class Phase(enum.Enum):
    PENDING = "pending"  # nothing of the request moved yet
    TRANSFERRING = "transferring"  # frames move
    VERDICT_WAIT = "verdict-wait"  # sender: its abort is out, the receiver's verdict decides
    VERDICT_ASK = "verdict-ask"  # sender: link lost once the last batch began, asked anew
    DRAINING = "draining"  # decided; the backend is still inside a frame of the request
    COMPLETE = "complete"  # decided and delivered


WAITING = (Phase.VERDICT_WAIT, Phase.VERDICT_ASK)
DECIDED = (Phase.DRAINING, Phase.COMPLETE)


# ============================================================================== events
@dataclass(frozen=True, slots=True)
class LastBatchSubmitted:
    """Sender: the caller's send(last=True) came."""


@dataclass(frozen=True, slots=True)
class FrameEnded:
    """The backend let go of a frame (sender) or chunk (receiver) begun with :meth:`begin_io`;
    ``last_left``: the sender's every byte of its last batch has left."""

    nbytes: int
    last_left: bool = False


@dataclass(frozen=True, slots=True)
class LastBatchWritten:
    """Receiver: every byte of the last batch is in its destination."""


@dataclass(frozen=True, slots=True)
class PeerDone:
    """Sender: the receiver's DONE (``nbytes`` written)."""

    nbytes: int


@dataclass(frozen=True, slots=True)
class PeerAbort:
    """The peer's ABORT for this request (``confirms``: it confirms this side's own ABORT)."""

    code: AbortCode
    reason: str
    peer: str
    confirms: bool = False


@dataclass(frozen=True, slots=True)
class LinkLost:
    """The request's link died (``code``: CONNECTION_LOST, or CONNECT_FAILED)."""

    code: AbortCode
    reason: str


@dataclass(frozen=True, slots=True)
class VerdictAskFailed:
    """Sender: :class:`AskVerdict` found no fresh link to the receiver."""

    reason: str


@dataclass(frozen=True, slots=True)
class DeadlinePassed:
    """The deadline armed for the request passed (its own, or the grace of an abort)."""

    reason: str


@dataclass(frozen=True, slots=True)
class CallerAbort:
    reason: str


@dataclass(frozen=True, slots=True)
class EngineClosing:
    """close(): decide at once, tell the peer."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused the request: bad input, a protocol breach, an unreachable peer, a link
    that changed under it. Decided at once; ``tell_peer``: send the peer an ABORT."""

    origin: AbortOrigin
    code: AbortCode
    reason: str
    tell_peer: bool


Event = (
    LastBatchSubmitted
    | FrameEnded
    | LastBatchWritten
    | PeerDone
    | PeerAbort
    | LinkLost
    | VerdictAskFailed
    | DeadlinePassed
    | CallerAbort
    | EngineClosing
    | Refused
)


# ============================================================================== actions
@dataclass(frozen=True, slots=True)
class SendFrame:
    """A control frame to the peer: on ``link`` if given, else on a fresh link to ``address``
    (best effort), else nowhere (nobody to tell)."""

    message: ControlMessage
    link: Any = None
    address: str | None = None


@dataclass(frozen=True, slots=True)
class SendVerdict:
    """Receiver: answer the ABORT just fed, on the link it came on."""

    message: ControlMessage


@dataclass(frozen=True, slots=True)
class AskVerdict:
    """Sender: send ``message`` on a fresh link to ``address`` (not ``old_link``), which becomes
    the request's link; feed :class:`VerdictAskFailed` if there is none."""

    message: Abort
    address: str
    old_link: Any


@dataclass(frozen=True, slots=True)
class Complete:
    """Deliver the completion (callbacks, metrics, the deadline cancelled): decided and the
    backend has let go of the request's memory."""

    completion: Completion


@dataclass(frozen=True, slots=True)
class ArmDeadline:
    """Feed :class:`DeadlinePassed` after ``delay_s`` (replaces the deadline armed)."""

    delay_s: float


@dataclass(frozen=True, slots=True)
class CloseLink:
    """The backend is stuck inside a frame of the request past its deadline: close ``link``
    (it wakes the I/O thread, which then lets go)."""

    link: Any
    reason: str


@dataclass(frozen=True, slots=True)
class Log:
    """One log line: ``message`` %-formatted with ``args`` (the engine prefixes its name)."""

    level: int
    message: str
    args: tuple[object, ...] = ()


Action = SendFrame | SendVerdict | AskVerdict | Complete | ArmDeadline | CloseLink | Log


class _Wanted(NamedTuple):
    """The outcome a waiting sender gets if the receiver confirms that its abort came first."""

    origin: AbortOrigin
    code: AbortCode
    reason: str


# ============================================================================== the machine
class Lifecycle:
    """One request on one side. Not thread-safe: the engine calls it under its lock."""

    __slots__ = (
        "by_peer",
        "grace_armed",
        "io_active",
        "key",
        "last_begun",
        "last_left",
        "last_submitted",
        "late_data_answered",
        "link",
        "nbytes",
        "outcome",
        "peer",
        "peer_address",
        "phase",
        "verdict_asks",
        "wanted",
    )

    def __init__(self, key: RequestKey, peer: str | None = None, peer_address: str | None = None):
        self.key = key
        self.phase = Phase.PENDING
        self.outcome: Completion | None = None  # set once, by _decide
        self.link: Any = None  # the request's link (sender: the one it sends on; receiver: bound)
        self.peer = peer  # the peer's name, for completions and logs
        self.peer_address = peer_address  # where to reach the peer without a link
        self.nbytes = 0  # payload bytes moved so far
        self.io_active = 0  # frames or chunks the backend is inside of
        self.last_submitted = False  # sender: send(last=True) came
        self.last_begun = False  # sender: the last batch's frames began (the peer may get them)
        self.last_left = False  # sender: every byte of the last batch left
        self.wanted: _Wanted | None = None  # sender, VERDICT_*: the outcome a confirmation gives
        self.verdict_asks = 0  # sender: fresh links asked for the verdict
        self.grace_armed = False  # sender: a deadline passed while waiting; one grace more
        self.by_peer = False  # receiver: the sender's ABORT decided the outcome (it confirms)
        self.late_data_answered = False  # receiver: frames after the abort were answered once

    @classmethod
    def finished(cls, key: RequestKey, completion: Completion, *, by_peer=False) -> Lifecycle:
        """A request decided before the engine tracked it (abort before expect(), an ABORT or
        data for an id never expected): only a tombstone."""
        lifecycle = cls(key, peer=completion.peer)
        lifecycle.outcome, lifecycle.phase, lifecycle.by_peer = completion, Phase.COMPLETE, by_peer
        return lifecycle

    @property
    def decided(self) -> bool:
        return self.outcome is not None

    @property
    def status(self) -> TransferStatus:
        """What ``Engine.status`` reports: the outcome once delivered, else how far it got."""
        if self.phase is Phase.COMPLETE:
            assert self.outcome is not None
            return self.outcome.status
        if self.phase is Phase.PENDING:
            return TransferStatus.PENDING
        return TransferStatus.TRANSFERRING

    # ------------------------------------------------------------------ the backend's frames
    def begin_io(self, last: bool = False) -> bool:
        """A frame (sender) or chunk (receiver) is about to touch the request's memory: True if
        it may (the backend then ends it with :class:`FrameEnded`). A sender waiting for a
        verdict begins no more frames; ``last``: a frame of the sender's last batch."""
        if self.phase in DECIDED or self.phase in WAITING:
            return False
        self.phase = Phase.TRANSFERRING
        self.io_active += 1
        if last:
            self.last_begun = True
        return True

    # ------------------------------------------------------------------ events
    def handle(self, event: Event) -> list[Action]:
        out: list[Action] = []
        send = self.key.side is Side.SEND
        match event:
            case FrameEnded(nbytes, last_left):
                self.nbytes += nbytes
                self.io_active -= 1
                self.last_left |= last_left
                if self.phase is Phase.DRAINING and self.io_active == 0:
                    self._complete(out)
            case LastBatchSubmitted():
                self.last_submitted = True
            case LastBatchWritten():
                if not self.decided:
                    self._decide(None, None, "", out)
                    out.append(SendFrame(Done(self.key.request_id, self.nbytes), self.link))
            case PeerDone(nbytes):
                self._peer_done(nbytes, out)
            case PeerAbort():
                if send:
                    self._sender_peer_abort(event, out)
                else:
                    self._receiver_peer_abort(event, out)
            case LinkLost(code, reason):
                if send:
                    self._sender_link_lost(code, reason, out)
                elif not self.decided:
                    self._decide(AbortOrigin.TRANSPORT, code, reason, out)
            case VerdictAskFailed(reason):
                if self.phase in WAITING:
                    self._decide_lost(AbortCode.CONNECTION_LOST, reason, out)
            case DeadlinePassed(reason):
                self._deadline(reason, out)
            case CallerAbort(reason):
                self._abort(AbortOrigin.LOCAL, AbortCode.CALLER_ABORT, reason, out)
            case EngineClosing():
                if not self.decided:
                    self._decide(AbortOrigin.LOCAL, AbortCode.ENGINE_CLOSED, "engine closed", out)
                    self._tell_peer(AbortCode.ENGINE_CLOSED, "engine closed", out)
            case Refused(origin, code, reason, tell_peer):
                if not self.decided:
                    self._decide(origin, code, reason, out)
                    if tell_peer:
                        self._tell_peer(code, reason, out)
                    elif send and code is AbortCode.CONNECTION_LOST:
                        self._tell_lost(reason, out)
            case _:
                raise TypeError(f"not a lifecycle event: {event!r}")
        return out

    # ------------------------------------------------------------------ both sides
    def _abort(self, origin: AbortOrigin, code: AbortCode, reason: str, out: list[Action]):
        """This side's own abort (its caller, its deadline)."""
        if self.decided or self.phase in WAITING:
            return  # decided, or an abort (or the link-loss question) is already out
        if self.key.side is Side.RECV or (self.link is None and self.peer_address is None):
            self._decide(origin, code, reason, out)  # the receiver decides; or nobody to ask
            self._tell_peer(code, reason, out)
            return
        # The sender asks: the receiver's verdict says who aborted first.
        self.phase, self.wanted = Phase.VERDICT_WAIT, _Wanted(origin, code, reason)
        self._tell_peer(code, reason, out)
        out.append(
            Log(
                logging.DEBUG,
                "send request %r: %s abort waits for the receiver's verdict: %s",
                (self.key.request_id, origin.name, reason),
            )
        )

    def _where_it_stood(self, reason: str) -> Log:
        """A timed-out request's state: what tells a link that never came up (or never got a
        handshake through) from a stalled one or a peer that never started."""
        link = self.link
        if link is None:
            where = "no link"
        else:
            done = getattr(link, "handshake_done", None)
            handshake = "?" if done is None else ("done" if done else "pending")
            where = f"link on {getattr(link, 'path', '?')}, handshake {handshake}"
        return Log(
            logging.WARNING,
            "request %r (%s, peer %s): %s in phase %s: %d payload bytes moved, inside %d frames, "
            "%s; last batch submitted %s, begun %s, left %s",
            (
                self.key.request_id,
                self.key.side.name.lower(),
                self.peer,
                reason,
                self.phase.name,
                self.nbytes,
                self.io_active,
                where,
                self.last_submitted,
                self.last_begun,
                self.last_left,
            ),
        )

    def _deadline(self, reason: str, out: list[Action]) -> None:
        if self.phase is Phase.COMPLETE:
            return
        link = self.link
        out.append(self._where_it_stood(reason))
        # The backend is inside a frame of this request past its deadline: the link is stalled
        # or far too slow. Closing it wakes the I/O thread, which then lets go of the memory.
        stuck = self.io_active > 0 and link is not None
        rid = self.key.request_id
        if self.phase is Phase.DRAINING:
            # An earlier decision waits for the backend to leave a frame that has not moved since.
            assert self.outcome is not None
            if stuck:
                out.append(CloseLink(link, f"request {rid!r} stuck mid-frame past its deadline"))
                if self.outcome.origin in (AbortOrigin.LOCAL, AbortOrigin.TIMEOUT):
                    # Its ABORT was queued on the link just closed: tell the peer on a fresh one.
                    self._tell_peer(self.outcome.code, self.outcome.reason, out, fresh=True)
            return
        if self.phase in WAITING and not self.grace_armed:
            # The verdict may be on its way (the deadline and the receiver's answer crossed):
            # wait one grace more, then what this side knows stands.
            self.grace_armed = True
            out.append(ArmDeadline(VERDICT_GRACE_S))
            if stuck:
                out.append(CloseLink(link, f"request {rid!r} timed out mid-frame"))
            return
        if self.phase in WAITING:  # no verdict in time: this side's abort, or the lost link
            assert self.wanted is not None
            origin, code, why = self.wanted
            self._decide(origin, code, why, out)
            if stuck:
                out.append(CloseLink(link, f"request {rid!r} timed out mid-frame"))
            if origin is not AbortOrigin.TRANSPORT:  # the first ABORT may not have got there
                self._tell_peer(code, why, out, fresh=True)
            return
        if self.key.side is Side.SEND and link is not None:
            # The receiver decides this abort too; a stuck link's loss asks on a fresh one.
            self._abort(AbortOrigin.TIMEOUT, AbortCode.TIMEOUT, reason, out)
            self.grace_armed = True
            out.append(ArmDeadline(VERDICT_GRACE_S))
            if stuck:
                out.append(CloseLink(link, f"request {rid!r} timed out mid-frame"))
            return
        self._decide(AbortOrigin.TIMEOUT, AbortCode.TIMEOUT, reason, out)
        if stuck:
            out.append(CloseLink(link, f"request {rid!r} timed out mid-frame"))
        self._tell_peer(AbortCode.TIMEOUT, reason, out, fresh=stuck)

    def _decide(
        self, origin: AbortOrigin | None, code: AbortCode | None, reason: str, out: list[Action]
    ) -> None:
        """The one outcome (DONE if origin is None); delivered now or once the backend lets go."""
        assert self.outcome is None
        status = TransferStatus.DONE if origin is None else TransferStatus.ABORTED
        side, rid = self.key
        self.outcome = Completion(rid, side.value, status, origin, code, reason, self.nbytes,
                                  self.peer)  # fmt: skip
        self.wanted = None
        if origin is not None:
            level = logging.DEBUG if origin is AbortOrigin.LOCAL else logging.INFO
            out.append(
                Log(
                    level,
                    "%s request %r aborted (%s, %s): %s",
                    (side.value, rid, origin.name, code.name if code else "-", reason),
                )
            )
        if self.io_active:
            self.phase = Phase.DRAINING  # Complete comes with the last FrameEnded
        else:
            self._complete(out)

    def _complete(self, out: list[Action]) -> None:
        assert self.outcome is not None
        self.phase = Phase.COMPLETE
        out.append(Complete(self.outcome))

    def _tell_peer(
        self, code: AbortCode | None, reason: str, out: list[Action], *, fresh: bool = False
    ) -> None:
        """ABORT to the other side: on the request's link, else (or ``fresh``) on a new one."""
        target = AbortTarget.RECEIVER if self.key.side is Side.SEND else AbortTarget.SENDER
        message = Abort(self.key.request_id, code or AbortCode.CALLER_ABORT, target, reason)
        link = None if fresh else self.link
        if link is not None or self.peer_address is not None:
            out.append(SendFrame(message, link, self.peer_address))

    # ------------------------------------------------------------------ sender
    def _peer_done(self, nbytes: int, out: list[Action]) -> None:
        if self.decided or self.key.side is not Side.SEND:
            return
        if not self.last_submitted:
            reason = f"peer confirmed {self.key.request_id!r} before the last batch was sent"
            out.append(Log(logging.WARNING, "%s (peer %s)", (reason, self.peer)))
            self._decide(AbortOrigin.PEER, AbortCode.PROTOCOL_ERROR, reason, out)
            self._tell_peer(AbortCode.PROTOCOL_ERROR, reason, out)
            return
        self.nbytes = max(self.nbytes, nbytes)
        self._decide(None, None, "", out)

    def _sender_peer_abort(self, abort: PeerAbort, out: list[Action]) -> None:
        if self.decided:
            return
        if abort.code is AbortCode.TIMEOUT:  # the receiver gave up waiting: where this side was
            out.append(self._where_it_stood(f"the receiver timed out ({abort.reason})"))
        if abort.confirms and self.wanted is not None:
            origin, code, reason = self.wanted  # the receiver says this side's abort came first
            self._decide(origin, code, reason, out)
            return
        lost = abort.code is AbortCode.CONNECTION_LOST
        # CONNECTION_LOST: the peer lost the request's link; neither side chose to abort, so both
        # say TRANSPORT (the README's rule of agreement).
        origin = AbortOrigin.TRANSPORT if lost else AbortOrigin.PEER
        reason = f"peer {abort.peer} aborted ({abort.code.name}): {abort.reason}"
        self._decide(origin, abort.code, reason, out)

    def _sender_link_lost(self, code: AbortCode, reason: str, out: list[Action]) -> None:
        if self.decided:
            return
        # Waiting: the ABORT (or the question) may have died with the link. Last batch begun:
        # the receiver may have every byte, its DONE lost with the link. Ask anew.
        may_ask = self.verdict_asks < VERDICT_ASKS and self.peer_address is not None
        if may_ask and (self.phase in WAITING or self.last_begun):
            rid = self.key.request_id
            if self.phase is Phase.VERDICT_WAIT:
                assert self.wanted is not None
                question = Abort(rid, self.wanted.code, AbortTarget.RECEIVER, self.wanted.reason)
            else:
                if self.phase is not Phase.VERDICT_ASK:
                    self.phase = Phase.VERDICT_ASK
                    self.wanted = _Wanted(AbortOrigin.TRANSPORT, code, reason)
                question = Abort(rid, AbortCode.CONNECTION_LOST, AbortTarget.RECEIVER, reason)
            self.verdict_asks += 1
            out.append(AskVerdict(question, self.peer_address, self.link))
            self.link = None  # until the shell has the fresh link: the old one is gone
            return
        self._decide_lost(code, reason, out)

    def _decide_lost(self, code: AbortCode, reason: str, out: list[Action]) -> None:
        self._decide(AbortOrigin.TRANSPORT, code, reason, out)
        if code is AbortCode.CONNECTION_LOST:
            self._tell_lost(reason, out)

    def _tell_lost(self, reason: str, out: list[Action]) -> None:
        # The receiver may not have seen this request on the dead link (nothing of it arrived, so
        # its loss aborts nothing there): tell it on a fresh one rather than have it hold its
        # blocks until its own deadline. It completes ABORTED(TRANSPORT) too.
        if self.peer_address is not None:
            message = Abort(self.key.request_id, AbortCode.CONNECTION_LOST, AbortTarget.RECEIVER,
                            reason)  # fmt: skip
            out.append(SendFrame(message, None, self.peer_address))

    # ------------------------------------------------------------------ receiver
    def _receiver_peer_abort(self, abort: PeerAbort, out: list[Action]) -> None:
        if not self.decided:
            lost = abort.code is AbortCode.CONNECTION_LOST
            origin = AbortOrigin.TRANSPORT if lost else AbortOrigin.PEER
            reason = f"peer {abort.peer} aborted ({abort.code.name}): {abort.reason}"
            out.append(Log(logging.INFO, "request %r: %s", (self.key.request_id, reason)))
            self._decide(origin, abort.code, reason, out)
            self.by_peer = True
        out.append(SendVerdict(self.verdict()))

    def verdict(self) -> ControlMessage:
        """Receiver: its answer to the sender's ABORT, from its outcome."""
        outcome, rid = self.outcome, self.key.request_id
        assert outcome is not None
        if outcome.status is TransferStatus.DONE:
            return Done(rid, outcome.nbytes)
        code = outcome.code or AbortCode.CALLER_ABORT
        return Abort(rid, code, AbortTarget.SENDER, outcome.reason, confirms=self.by_peer)

    def late_data_reply(self) -> Abort | None:
        """Receiver, aborted: the ABORT that answers late frames of the request (once)."""
        outcome = self.outcome
        if outcome is None or outcome.ok or self.late_data_answered:
            return None
        self.late_data_answered = True
        code = outcome.code or AbortCode.CALLER_ABORT
        return Abort(self.key.request_id, code, AbortTarget.SENDER, outcome.reason)


__all__ = [
    "DECIDED",
    "VERDICT_ASKS",
    "VERDICT_GRACE_S",
    "WAITING",
    "Action",
    "AskVerdict",
    "CallerAbort",
    "CloseLink",
    "Complete",
    "DeadlinePassed",
    "EngineClosing",
    "Event",
    "FrameEnded",
    "LastBatchSubmitted",
    "LastBatchWritten",
    "Lifecycle",
    "LinkLost",
    "Log",
    "PeerAbort",
    "PeerDone",
    "Phase",
    "Refused",
    "RequestKey",
    "SendFrame",
    "SendVerdict",
    "Side",
    "VerdictAskFailed",
]
