"""One live migration of a decoding request, D1 -> D2, as a pure state machine.

The proxy's shell (``live.py``) relays D1's answer to the client and feeds this machine what
happens; each event answers with a :class:`Decision` the shell carries out. No sockets, no
clock: the tests drive it event by event.

How a migration goes (hybrid-connector's ``migration.py`` is D1's side): the shell asks D1 to
stop the request (MIGRATE_OUT); D1 stops it after its next token, holds its KV under a new
transfer id M and answers with the request's tokens; D1's answer ends normally ("length") with
every token it generated. The shell withholds that end, calls D2 with the prompt plus those
tokens (pulling M from D1: D2 computes only the last token) and relays D2's answer as the rest
of the client's. Greedy output is token for token the same as without the migration::

    STREAMING --requested(D2)--> STOPPING: ASK_D1 (MIGRATE_OUT)
    STREAMING --requested(D2, precopy)--> PRECOPYING: ASK_PRECOPY (PRECOPY to D1, see below)
    STOPPING --D1 refused-----------------> STREAMING: KEEP (D1 goes on), or END_ON_D1 when
                                            D1's end came meanwhile (the end is forwarded)
    STOPPING --D1's end came--------------> STOPPING: HOLD (withheld until D1 answers)
    STOPPING --D1 stopped, its end came---> SWITCHING: CALL D2 (prompt + tokens, pull M)
    STOPPING --D1 stopped, end not yet----> STOPPED: WAIT --D1's end--> SWITCHING: CALL D2
    (an end that answered the request whole: DONE, END_ON_D1, M released: nothing is left)
    SWITCHING --D2's first token----------> MOVED: RELAY (D2's answer is the client's now)
    SWITCHING --D2 failed before a token--> SWITCHING: CALL D1 (once: D1 takes the request
                                            back, pulling M from itself), then RECOMPUTE
    STREAMING --D1's end------------------> DONE: END_ON_D1 (no migration after all)

Faults. D1 fails while a migration is under way (its answer breaks off, or its transfer
address cannot be reached: PRECOPY or MIGRATE_OUT fail in transport), before or after the
stop: the target recomputes from the tokens the client has (no pull: D1 may be gone), and the
client's answer goes on from there. The called D and then D1 both fail at the switch: any
other D recomputes. A D that fails a recompute is left out and the next one is tried; when
none is left the answer ends in its error::

    PRECOPYING, WARMING, STOPPING, STOPPED --D1 broke off--> RECOMPUTING: RECOMPUTE D2
    PRECOPYING, STOPPING --D1 unreachable--> RECOMPUTING: RECOMPUTE D2 (D1's answer is cut
                           where the client has it), or END_ON_D1 when D1's end came and was
                           complete (nothing more to generate)
    SWITCHING --D1 failed too (moved back)--> RECOMPUTING: RECOMPUTE (any D but D1 and D2)
    RECOMPUTING --the D failed before a token--> RECOMPUTING: RECOMPUTE (any D not failed)
    RECOMPUTING --recompute_on(D)--> RECOMPUTING: RECOMPUTE D (the shell found one)
    RECOMPUTING --no D left--> DONE: FAIL
    RECOMPUTING --its first token--> MOVED: RELAY

    D1 breaks with no migration under way (STREAMING), or a switched-to D breaks after its first
    token: FAIL (the answer ends in error, as any D failing mid-stream). The client goes away:
    FREE (every call closed; ``release``: D1 still holds M for a D that will not pull it).

Pre-copy (before the stop): D1 offers the request's full blocks under a pre-copy id C while it
decodes on; the shell sends D2 a one-token request whose prompt is their tokens, pulling C
(the "warm-up"): they land in D2's prefix cache, and the stop's call pulls only the rest::

    PRECOPYING --D1 offered C------------> WARMING: WARM (call D2 with the warm-up)
    PRECOPYING --D1 refused (or no RPC)--> STOPPING: ASK_D1 (a plain stop-and-copy)
    WARMING --the warm-up answered-------> STOPPING: ASK_D1, release C
    WARMING --the warm-up failed---------> STREAMING: KEEP (D2 failed: the request stays on
                                           D1), release C
    PRECOPYING, WARMING --D1's end-------> DONE: END_ON_D1, release C (the warm-up is dropped)

``release_precopy`` on a decision: the shell sends RELEASE for C to D1, once per migration,
from the time PRECOPY was sent until it was refused: after a warm-up that pulled C it finds
nothing held (SEND_DONE already gave the blocks back), after one that hit D2's own cache or
failed, or while PRECOPY is unanswered, it frees them (a later offer is given back at once).

``release`` on a decision: the shell sends hybrid-connector's RELEASE for M to D1 (D1 holds M's
blocks, or may still stop the request and hold them, and no D will pull them: a client gone, a
recompute or a failure after MIGRATE_OUT was sent and not refused, before a D streamed). D1
frees held blocks at once and those of a request that stops later as soon as it stops; a
release of a transfer nobody holds any more (or sent to a D that is gone) is harmless.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Phase(enum.StrEnum):
    STREAMING = "streaming"  # on D1, no migration asked (or the last one refused)
    PRECOPYING = "precopying"  # PRECOPY sent to D1, no answer yet
    WARMING = "warming"  # the target's warm-up (pulling the pre-copied blocks) runs
    STOPPING = "stopping"  # MIGRATE_OUT sent to D1, no answer yet
    STOPPED = "stopped"  # D1 stopped the request and holds M; its answer's end not seen yet
    SWITCHING = "switching"  # a D was called with prompt + tokens; no token from it yet
    RECOMPUTING = "recomputing"  # D1 failed: a D recomputes from the client's tokens
    MOVED = "moved"  # that D answers: the migration is over
    DONE = "done"  # ended: on D1, failed, or freed


# A migration is under way on D1 (a target chosen, D1 still the request's D).
_UNDER_WAY = (Phase.PRECOPYING, Phase.WARMING, Phase.STOPPING, Phase.STOPPED)


class Action(enum.StrEnum):
    ASK_D1 = "ask_d1"  # send MIGRATE_OUT to D1
    ASK_PRECOPY = "ask_precopy"  # send PRECOPY to D1
    WARM = "warm"  # call ``target`` with the warm-up request (the pre-copied tokens)
    KEEP = "keep"  # go on relaying D1
    HOLD = "hold"  # withhold D1's end (its finish chunk, usage, [DONE]) until D1 answers
    WAIT = "wait"  # go on relaying D1 until its end
    CALL = "call"  # call ``target`` with prompt + tokens, pulling M from D1
    # Call ``target`` (empty: a D the shell picks, not in ``Migration.failed``; it answers with
    # ``recompute_on`` or ``no_target``) with the prompt + the tokens the client has, no pull.
    # D1's answer, if still open, is closed where the client has it.
    RECOMPUTE = "recompute"
    RELAY = "relay"  # relay the called D's answer as the rest of the client's
    END_ON_D1 = "end_on_d1"  # forward D1's end as it is: the request ended on D1
    REFUSE = "refuse"  # the asked migration cannot start (already one under way, ended)
    FAIL = "fail"  # end the client's answer in error
    FREE = "free"  # the client is gone: close every call


@dataclass(frozen=True)
class Decision:
    action: Action
    target: str = ""  # the D to call (CALL, WARM, RECOMPUTE; empty RECOMPUTE: the shell picks)
    release: bool = False  # send RELEASE for M to D1
    release_precopy: bool = False  # send RELEASE for the pre-copy id C to D1
    message: str = ""


@dataclass
class Migration:
    """One request's live migration (the diagram above). ``source`` is D1's key; a D is named
    by its key (``routing.Backend.key``)."""

    source: str
    phase: Phase = Phase.STREAMING
    target: str = ""
    end_seen: bool = False  # D1's finish chunk arrived (and, while STOPPING, is withheld)
    # That end answered the request whole (a stop token or string, or its whole max_tokens):
    # a recompute would have nothing left to generate.
    end_complete: bool = False
    moved_back: bool = False  # the request went back to D1 after the target failed
    holds: bool = False  # D1 holds (or may be about to hold) M's blocks, no D streams from them
    precopy_holds: bool = False  # D1 holds (or may be about to hold) C's blocks, not released
    reason: str = ""  # why the last migration was refused
    # The D's that failed this migration (D1 included once it did): no recompute goes there.
    failed: set[str] = field(default_factory=set)

    # -- the proxy asks ---------------------------------------------------------------------
    def requested(self, target: str, precopy: bool = False) -> Decision:
        if self.phase is not Phase.STREAMING or self.end_seen:
            return Decision(Action.REFUSE, message=f"the request is {self.phase}")
        if target == self.source:
            return Decision(Action.REFUSE, message="the target is the instance it runs on")
        self.target = target
        if precopy:
            self.phase, self.precopy_holds = Phase.PRECOPYING, True
            return Decision(Action.ASK_PRECOPY, target=target)
        self.phase, self.holds = Phase.STOPPING, True
        return Decision(Action.ASK_D1, target=target)

    # -- pre-copy ---------------------------------------------------------------------------
    def precopy_offered(self) -> Decision:
        """D1 holds the request's full blocks under C: warm the target up with them."""
        if self.phase is not Phase.PRECOPYING:
            return Decision(Action.KEEP)
        self.phase = Phase.WARMING
        return Decision(Action.WARM, target=self.target)

    def precopy_refused(self, reason: str) -> Decision:
        """PRECOPY answered "not offered": stop and copy it all."""
        if self.phase is not Phase.PRECOPYING:
            return Decision(Action.KEEP)
        self.precopy_holds = False
        return self._stop(f"no pre-copy: {reason}")

    def warmed(self) -> Decision:
        """The target answered the warm-up: the pre-copied blocks are in its prefix cache (or
        will be pulled by the stop's call if it evicted them)."""
        if self.phase is not Phase.WARMING:
            return Decision(Action.KEEP)
        return self._stop("", release_precopy=self._take_precopy_release())

    def warm_failed(self, message: str) -> Decision:
        """The target failed the warm-up (refused, 5xx, broke, timed out): no migration to it;
        the request goes on on D1."""
        if self.phase is not Phase.WARMING:
            return Decision(Action.KEEP)
        self.phase, self.target, self.reason = Phase.STREAMING, "", message
        return Decision(Action.KEEP, release_precopy=self._take_precopy_release(), message=message)

    def _stop(self, message: str, release_precopy: bool = False) -> Decision:
        # D1's end while pre-copying ended the request on D1: end_seen is False here.
        self.phase, self.holds = Phase.STOPPING, True
        return Decision(
            Action.ASK_D1, target=self.target, release_precopy=release_precopy, message=message
        )

    # -- D1 ---------------------------------------------------------------------------------
    def d1_refused(self, reason: str) -> Decision:
        """MIGRATE_OUT answered "not stopped": nothing moved."""
        if self.phase is not Phase.STOPPING:
            return Decision(Action.KEEP)
        self.phase, self.target, self.reason, self.holds = Phase.STREAMING, "", reason, False
        if self.end_seen:
            self.phase = Phase.DONE
            return Decision(Action.END_ON_D1, message=reason)
        return Decision(Action.KEEP, message=reason)

    def d1_unreachable(self, message: str) -> Decision:
        """PRECOPY or MIGRATE_OUT failed in transport (D1's transfer address refuses, the
        connection broke, no answer in time): D1 may be gone, whatever its answer still says."""
        if self.phase is Phase.PRECOPYING or (self.phase is Phase.STOPPING and not self.end_seen):
            return self._recompute_on_target(f"{self.source} unreachable: {message}")
        if self.phase is Phase.STOPPING:  # D1's end is withheld
            if self.end_complete:
                self.phase = Phase.DONE
                return Decision(Action.END_ON_D1, release=self._take_release(), message=message)
            return self._recompute_on_target(f"{self.source} unreachable: {message}")
        return Decision(Action.KEEP)

    def d1_stopped(self) -> Decision:
        """D1 stopped the request after its next token and holds its KV under M."""
        if self.phase is not Phase.STOPPING:
            return Decision(Action.KEEP)
        if self.end_seen:
            return self._switch()
        self.phase = Phase.STOPPED
        return Decision(Action.WAIT)

    def d1_ended(self, complete: bool = False) -> Decision:
        """D1's answer ended (the request finished on D1, for whatever reason); ``complete``:
        with the whole answer (a stop, or the client's max_tokens), not a stop for a move."""
        if self.phase not in (Phase.STREAMING, *_UNDER_WAY):
            return Decision(Action.KEEP)  # D1's answer ends once: a second end changes nothing
        self.end_seen, self.end_complete = True, complete
        if self.phase in (Phase.PRECOPYING, Phase.WARMING):
            self.phase, self.target = Phase.DONE, ""
            release = self._take_precopy_release()
            return Decision(
                Action.END_ON_D1, release_precopy=release, message="the request ended on D1"
            )
        if self.phase is Phase.STOPPING:
            return Decision(Action.HOLD)
        if self.phase is Phase.STOPPED:
            return self._switch()
        self.phase = Phase.DONE
        return Decision(Action.END_ON_D1)

    def d1_failed(self, message: str) -> Decision:
        """D1's answer broke off before its end."""
        message = f"{self.source} broke off: {message}"
        if self.phase in _UNDER_WAY:
            return self._recompute_on_target(message)
        if self.phase in (Phase.SWITCHING, Phase.RECOMPUTING):
            return Decision(Action.KEEP)  # D1's end came: what follows it is not needed
        return self._fail(message)

    # -- the D called with prompt + tokens ----------------------------------------------------
    def called_first_token(self) -> Decision:
        if self.phase not in (Phase.SWITCHING, Phase.RECOMPUTING):
            return Decision(Action.RELAY)
        self.phase, self.holds = Phase.MOVED, False
        return Decision(Action.RELAY)

    def called_failed(self, message: str) -> Decision:
        """The called D failed before its first token (refused, 5xx, timeout, broke)."""
        if self.phase is Phase.RECOMPUTING:
            self.failed.add(self.target)
            self.failed.discard("")  # (no D was called yet)
            return self._recompute_anywhere(message)
        if self.phase is not Phase.SWITCHING:
            return self._fail(message)
        self.failed.add(self.target)
        if not self.moved_back:
            # D1 takes the request back: it pulls M from itself (or hits its own prefix cache).
            self.moved_back, self.target = True, self.source
            return Decision(Action.CALL, target=self.source, message=message)
        return self._recompute_anywhere(message)

    def called_failed_mid_stream(self, message: str) -> Decision:
        return self._fail(message)

    def recompute_on(self, target: str) -> Decision:
        """The shell found ``target`` for a RECOMPUTE that named no D."""
        if self.phase is not Phase.RECOMPUTING or self.target or target in self.failed:
            return Decision(Action.KEEP)
        self.target = target
        return Decision(Action.RECOMPUTE, target=target)

    def no_target(self, message: str) -> Decision:
        """No D is left to recompute on: the answer ends in error."""
        if self.phase is not Phase.RECOMPUTING:
            return Decision(Action.KEEP)
        return self._fail(message)

    # -- the client ---------------------------------------------------------------------------
    def client_gone(self) -> Decision:
        release, precopy = self._take_release(), self._take_precopy_release()
        self.phase = Phase.DONE
        return Decision(
            Action.FREE, release=release, release_precopy=precopy, message="client went away"
        )

    # -- internals ----------------------------------------------------------------------------
    def _switch(self) -> Decision:
        """D1 stopped and its end came: call the target, unless that end answered the request
        whole (nothing left to generate: it is forwarded, and M released)."""
        if self.end_complete:
            self.phase = Phase.DONE
            message = "the request ended on D1"
            return Decision(Action.END_ON_D1, release=self._take_release(), message=message)
        self.phase = Phase.SWITCHING
        return Decision(Action.CALL, target=self.target)

    def _recompute_on_target(self, message: str) -> Decision:
        """D1 failed mid-migration: the chosen target recomputes (D1 holds nothing for it)."""
        self.failed.add(self.source)
        release, precopy = self._take_release(), self._take_precopy_release()
        self.phase = Phase.RECOMPUTING
        return Decision(
            Action.RECOMPUTE,
            target=self.target,
            release=release,
            release_precopy=precopy,
            message=message,
        )

    def _recompute_anywhere(self, message: str) -> Decision:
        release, precopy = self._take_release(), self._take_precopy_release()
        self.phase, self.target = Phase.RECOMPUTING, ""
        return Decision(Action.RECOMPUTE, release=release, release_precopy=precopy, message=message)

    def _fail(self, message: str) -> Decision:
        release, precopy = self._take_release(), self._take_precopy_release()
        self.phase = Phase.DONE
        return Decision(Action.FAIL, release=release, release_precopy=precopy, message=message)

    def _take_precopy_release(self) -> bool:
        """D1 holds C for nobody (once): PRECOPY sent and not refused, not released yet."""
        release, self.precopy_holds = self.precopy_holds, False
        return release

    def _take_release(self) -> bool:
        """D1 holds M for nobody (once): asked and not refused, before a D streamed from M."""
        release, self.holds = self.holds, False
        return release
