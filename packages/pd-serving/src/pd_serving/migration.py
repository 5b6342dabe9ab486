"""One live migration of a streaming request, D1 -> D2, as a pure state machine.

The proxy's stream shell (``live.py``) relays D1's stream to the client and feeds this machine
what happens; each event answers with a :class:`Decision` the shell carries out. No sockets,
no clock: the tests drive it event by event.

How a migration goes (hybrid-connector's ``migration.py`` is D1's side): the shell asks D1 to
stop the request (MIGRATE_OUT); D1 stops it after its next token, holds its KV under a new
transfer id M and answers with the request's tokens; D1's stream ends normally ("length") with
every token it generated. The shell withholds that end, calls D2 with the prompt plus those
tokens (pulling M from D1: D2 computes only the last token) and relays D2's stream as the rest
of the client's. Greedy output is token for token the same as without the migration::

    STREAMING --requested(D2)--> STOPPING: ASK_D1 (MIGRATE_OUT)
    STOPPING --D1 refused-----------------> STREAMING: KEEP (D1 goes on), or END_ON_D1 when
                                            D1's end came meanwhile (the end is forwarded)
    STOPPING --D1's end came--------------> STOPPING: HOLD (withheld until D1 answers)
    STOPPING --D1 stopped, its end came---> SWITCHING: CALL D2 (prompt + tokens, pull M)
    STOPPING --D1 stopped, end not yet----> STOPPED: WAIT --D1's end--> SWITCHING: CALL D2
    SWITCHING --D2's first token----------> MOVED: RELAY (D2's stream is the client's now)
    SWITCHING --D2 failed before a token--> SWITCHING: CALL D1 (once: D1 takes the request
                                            back, pulling M from itself), then FAIL
    STREAMING --D1's end------------------> DONE: END_ON_D1 (no migration after all)

    D1 breaks before its end, a switched-to D breaks after its first token: FAIL (the stream
    ends in error, as any D failing mid-stream). The client goes away: FREE (every call closed;
    ``release``: D1 still holds M for a D that will not pull it).

``release`` on a decision: the shell sends hybrid-connector's RELEASE for M to D1 (D1 holds M's
blocks, or may still stop the request and hold them, and no D will pull them: a client gone or a
failure after MIGRATE_OUT was sent and not refused, before a D streamed). D1 frees held blocks at
once and those of a request that stops later as soon as it stops; a release of a transfer nobody
holds any more is harmless.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.StrEnum):
    STREAMING = "streaming"  # on D1, no migration asked (or the last one refused)
    STOPPING = "stopping"  # MIGRATE_OUT sent to D1, no answer yet
    STOPPED = "stopped"  # D1 stopped the request and holds M; its stream's end not seen yet
    SWITCHING = "switching"  # a D was called with prompt + tokens; no token from it yet
    MOVED = "moved"  # that D streams: the migration is over
    DONE = "done"  # ended: on D1, failed, or freed


class Action(enum.StrEnum):
    ASK_D1 = "ask_d1"  # send MIGRATE_OUT to D1
    KEEP = "keep"  # go on relaying D1
    HOLD = "hold"  # withhold D1's end (its finish chunk, usage, [DONE]) until D1 answers
    WAIT = "wait"  # go on relaying D1 until its end
    CALL = "call"  # call ``target`` with prompt + tokens, pulling M from D1
    RELAY = "relay"  # relay the called D's stream as the rest of the client's
    END_ON_D1 = "end_on_d1"  # forward D1's end as it is: the request ended on D1
    REFUSE = "refuse"  # the asked migration cannot start (already one under way, ended)
    FAIL = "fail"  # end the client's stream in error
    FREE = "free"  # the client is gone: close every call


@dataclass(frozen=True)
class Decision:
    action: Action
    target: str = ""  # the D to call (CALL)
    release: bool = False  # send RELEASE for M to D1
    message: str = ""


@dataclass
class Migration:
    """One request's live migration (the diagram above). ``source`` is D1's key; a D is named
    by its key (``routing.Backend.key``)."""

    source: str
    phase: Phase = Phase.STREAMING
    target: str = ""
    end_seen: bool = False  # D1's finish chunk arrived (and, while STOPPING, is withheld)
    moved_back: bool = False  # the request went back to D1 after the target failed
    holds: bool = False  # D1 holds (or may be about to hold) M's blocks, no D streams from them
    reason: str = ""  # why the last migration was refused

    # -- the proxy asks ---------------------------------------------------------------------
    def requested(self, target: str) -> Decision:
        if self.phase is not Phase.STREAMING or self.end_seen:
            return Decision(Action.REFUSE, message=f"the request is {self.phase}")
        if target == self.source:
            return Decision(Action.REFUSE, message="the target is the instance it runs on")
        self.phase, self.target, self.holds = Phase.STOPPING, target, True
        return Decision(Action.ASK_D1, target=target)

    # -- D1 ---------------------------------------------------------------------------------
    def d1_refused(self, reason: str) -> Decision:
        """MIGRATE_OUT answered "not stopped" (or could not be sent): nothing moved."""
        if self.phase is not Phase.STOPPING:
            return Decision(Action.KEEP)
        self.phase, self.target, self.reason, self.holds = Phase.STREAMING, "", reason, False
        if self.end_seen:
            self.phase = Phase.DONE
            return Decision(Action.END_ON_D1, message=reason)
        return Decision(Action.KEEP, message=reason)

    def d1_stopped(self) -> Decision:
        """D1 stopped the request after its next token and holds its KV under M."""
        if self.phase is not Phase.STOPPING:
            return Decision(Action.KEEP)
        if self.end_seen:
            self.phase = Phase.SWITCHING
            return Decision(Action.CALL, target=self.target)
        self.phase = Phase.STOPPED
        return Decision(Action.WAIT)

    def d1_ended(self) -> Decision:
        """D1's stream sent its finish chunk (the request finished on D1, for whatever reason)."""
        if self.phase in (Phase.SWITCHING, Phase.MOVED, Phase.DONE):
            return Decision(Action.KEEP)  # D1's stream ends once: a second end changes nothing
        self.end_seen = True
        if self.phase is Phase.STOPPING:
            return Decision(Action.HOLD)
        if self.phase is Phase.STOPPED:
            self.phase = Phase.SWITCHING
            return Decision(Action.CALL, target=self.target)
        self.phase = Phase.DONE
        return Decision(Action.END_ON_D1)

    def d1_failed(self, message: str) -> Decision:
        """D1's stream broke before its end."""
        return self._fail(f"{self.source} broke off: {message}")

    # -- the D called with prompt + tokens ----------------------------------------------------
    def called_first_token(self) -> Decision:
        if self.phase is not Phase.SWITCHING:
            return Decision(Action.RELAY)
        self.phase, self.holds = Phase.MOVED, False
        return Decision(Action.RELAY)

    def called_failed(self, message: str) -> Decision:
        """The called D failed before its first token (refused, 5xx, timeout, broke)."""
        if self.phase is not Phase.SWITCHING:
            return self._fail(message)
        if not self.moved_back:
            # D1 takes the request back: it pulls M from itself (or hits its own prefix cache).
            self.moved_back, self.target = True, self.source
            return Decision(Action.CALL, target=self.source, message=message)
        return self._fail(message)

    def called_failed_mid_stream(self, message: str) -> Decision:
        return self._fail(message)

    # -- the client ---------------------------------------------------------------------------
    def client_gone(self) -> Decision:
        release = self._take_release()
        self.phase = Phase.DONE
        return Decision(Action.FREE, release=release, message="client went away")

    # -- internals ----------------------------------------------------------------------------
    def _fail(self, message: str) -> Decision:
        release = self._take_release()
        self.phase = Phase.DONE
        return Decision(Action.FAIL, release=release, message=message)

    def _take_release(self) -> bool:
        """D1 holds M for nobody (once): asked and not refused, before a D streamed from M."""
        release, self.holds = self.holds, False
        return release
