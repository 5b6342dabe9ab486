"""One request's attempts as a pure state machine: which call failed how -> what happens next.

The proxy (``proxy.py``) is the I/O shell: it asks the Router for instances, makes the calls,
classifies how a call ended (:class:`Failure`) and feeds it here; :class:`AttemptPlan` answers
with a :class:`Decision`. No sockets, no clock, no Router: the tests drive it event by event.

One request, transfer id X, P's KV held under its lease on P (HybridConnector)::

    start --route has a P--> PD(P, D, X) --P answered, D streams--> done
      |                        |
      |                        |-- P fails (refused, 5xx, timeout, broke) ------> P excluded,
      |                        |     REROUTE: new route, new X (another P, or LOCAL when none)
      |                        |-- D fails before a byte reached the client:
      |                        |     hybrid: D excluded, RETRY_DECODE on D' with the same X and
      |                        |             P's address (D' pulls what P still holds)
      |                        |     NIXL:   D excluded, REROUTE (NIXL's KV read is one-shot)
      |                        '-- D fails after bytes reached the client --> FAIL (never resumed)
      '--route has no P----> LOCAL(D) --D fails before a byte--> D excluded, REROUTE
                                      '-D fails after bytes---> FAIL

    any 4xx from an instance -> RELAY (the request is wrong: another instance says the same)
    no eligible instance -> FAIL 503; retries used up -> FAIL 502; deadline -> FAIL 504

``release`` on a decision: the proxy must send hybrid-connector's RELEASE for X to P, because no
D will pull X any more (a new X, a local prefill, an error) while P answered or may still be
running it. Never on RETRY_DECODE (D' pulls X), never once D streamed (D pulled X), never when P
refused the call or rejected it (a 4xx: it never ran it). A P that failed otherwise (5xx,
timeout, a broken or unparseable answer) may have done the work and hold X's blocks: it gets the
release (a release of a transfer P does not hold is harmless).
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


class Stage(enum.StrEnum):
    PREFILL = "prefill"  # the call to P
    DECODE = "decode"  # the call to D that pulls P's KV
    LOCAL = "local"  # a call to D that prefills itself (no P: bypass or none healthy)


class Failure(enum.StrEnum):
    """How a call ended badly, as the proxy saw it."""

    REFUSED = "refused"  # no connection: the instance never saw the request
    HTTP_5XX = "http_5xx"  # the instance answered 5xx
    TIMEOUT = "timeout"  # no answer (P) or no first token (D) within the attempt timeout
    BROKE = "broke"  # the connection closed (or garbage came) before the client got a byte
    BROKE_MID_STREAM = "broke_mid_stream"  # the same after bytes went to the client
    REJECTED = "rejected"  # a 4xx: the request itself is wrong


class Action(enum.StrEnum):
    RETRY_DECODE = "retry_decode"  # another D, the same transfer id and P
    REROUTE = "reroute"  # a new route (and transfer id); LOCAL if it has no P
    RELAY = "relay"  # hand the instance's 4xx to the client
    FAIL = "fail"  # an error to the client (status, or an SSE error event once streaming)


@dataclass(frozen=True)
class Decision:
    action: Action
    release: bool = False  # send RELEASE for the abandoned transfer to P
    status: int = 502  # for FAIL
    message: str = ""


@dataclass
class Transfer:
    """The KV of this request that one P holds for D (HybridConnector/NIXL)."""

    transfer_id: str
    prefill: str  # the P's key
    prefill_answered: bool = False  # P answered 200: it holds the KV under its lease
    prefill_failed: bool = False  # P refused or rejected the call: it holds nothing
    released: bool = False  # a release was decided (once per transfer)


@dataclass
class AttemptPlan:
    """The attempts of one request. ``max_retries`` bounds the failed calls after the first;
    no instance is tried twice for one request (so there is no back-off to wait: a retry goes
    to an instance that has not failed it)."""

    hybrid: bool  # HybridConnector: a second D can pull the same transfer
    max_retries: int = 2
    new_transfer_id: Callable[[], str] = field(default=lambda: uuid.uuid4().hex)
    failed_prefill: set[str] = field(default_factory=set)
    failed_decode: set[str] = field(default_factory=set)
    transfer: Transfer | None = None
    failures: int = 0
    bytes_sent: bool = False  # something reached the client: no retry from then on
    finished: bool = False

    # -- attempts --------------------------------------------------------------------------
    def begin(self, prefill: str | None) -> Transfer | None:
        """A new route: PD with a new transfer when it has a P (``prefill``: its key), else
        LOCAL (the route's D prefills). Which D serves is the proxy's (its route)."""
        self.transfer = None if prefill is None else Transfer(self.new_transfer_id(), prefill)
        return self.transfer

    def retry_decode(self, decode: str) -> None:
        """The same transfer, another D (after RETRY_DECODE): one that has not failed it."""
        assert self.transfer is not None
        assert decode not in self.failed_decode

    def prefill_answered(self) -> None:
        assert self.transfer is not None
        self.transfer.prefill_answered = True

    def sent_to_client(self) -> None:
        self.bytes_sent = True

    # -- outcomes --------------------------------------------------------------------------
    def failed(self, stage: Stage, backend: str, failure: Failure) -> Decision:
        """A call of ``stage`` to ``backend`` failed; what now."""
        if stage is Stage.PREFILL:
            assert self.transfer is not None
            # Refused or a 4xx: P never ran it. A 5xx, timeout or bad answer may come from a P
            # that did the work and holds blocks: those keep the release.
            if failure in (Failure.REFUSED, Failure.REJECTED):
                self.transfer.prefill_failed = True
            if failure is not Failure.REJECTED:
                self.failed_prefill.add(backend)
        if failure is Failure.REJECTED:
            return self._end(Action.RELAY, status=400, message=f"{stage} {backend} rejected it")
        if stage is not Stage.PREFILL:
            self.failed_decode.add(backend)
        self.failures += 1
        if self.bytes_sent or failure is Failure.BROKE_MID_STREAM:
            # D pulled the KV already and output went out: resuming elsewhere could duplicate or
            # contradict it (sampling state, stop strings, usage), so the stream ends in error.
            return self._end(
                Action.FAIL, release=False, status=502, message=f"{stage} {backend}: {failure}"
            )
        if self.failures > self.max_retries:
            return self._end(
                Action.FAIL,
                status=502,
                message=f"{stage} {backend}: {failure}; {self.failures} calls failed, giving up",
            )
        if stage is Stage.DECODE and self.hybrid:
            assert self.transfer is not None
            return Decision(Action.RETRY_DECODE)
        # A new route: the abandoned transfer (NIXL's D failed; or P failed) is released unless
        # P never ran it (refused).
        return Decision(Action.REROUTE, release=self._take_release())

    def no_backend(self, role: str) -> Decision:
        """The Router has no eligible instance of ``role`` left for this request."""
        status = 502 if self.failures else 503  # 502: instances failed it; 503: none to try
        return self._end(Action.FAIL, status=status, message=f"no healthy {role} instance left")

    def deadline_passed(self) -> Decision:
        return self._end(Action.FAIL, status=504, message="the request's deadline passed")

    def client_gone(self) -> Decision:
        """The client went away: every call is closed; P's KV is released unless D streamed."""
        return self._end(Action.FAIL, status=499, message="client went away")

    def succeeded(self) -> None:
        self.finished = True

    # -- internals -------------------------------------------------------------------------
    def _take_release(self) -> bool:
        """Decide, once per transfer, whether P must get a release: True (and the transfer is
        marked released) when P answered or may still run it (parallel) and no D pulled it for
        the client yet."""
        t = self.transfer
        if t is None or t.prefill_failed or t.released or self.bytes_sent:
            return False
        t.released = True
        return True

    def _end(self, action: Action, *, release: bool | None = None, **kw: object) -> Decision:
        self.finished = True
        if release is None:
            release = self._take_release()
        return Decision(action, release=release, **kw)  # type: ignore[arg-type]
