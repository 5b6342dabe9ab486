"""The request lifecycle (kvt.lifecycle), pure: two machines wired by a simulated link, fed every
ordering of the events that race (caller aborts, deadlines, the receiver's last byte, the sender's
last frame ending, a lost link), with the messages between them delivered at once or held so that
they cross. No sockets, no threads: every ordering is checked against the rule of agreement."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import pytest
from kvt.control import Abort, AbortTarget, Done
from kvt.lifecycle import (
    VERDICT_ASKS,
    AskVerdict,
    CallerAbort,
    CloseLink,
    Complete,
    DeadlinePassed,
    EngineClosing,
    FrameEnded,
    LastBatchSubmitted,
    LastBatchWritten,
    Lifecycle,
    LinkLost,
    Log,
    PeerAbort,
    PeerDone,
    Phase,
    RequestKey,
    SendFrame,
    SendVerdict,
    Side,
    VerdictAskFailed,
)
from kvt.outcome import AbortCode, AbortOrigin, Completion, TransferStatus
from soak import crossed_two_answers, disagreement

FIRST_LINK = "link-1"
NBYTES = 4096


@dataclass
class Wire:
    """Two lifecycles of one request and the messages in flight between them, per direction."""

    send: Lifecycle
    recv: Lifecycle
    to_recv: deque = field(default_factory=deque)  # (link, message)
    to_send: deque = field(default_factory=deque)
    dead: set = field(default_factory=set)
    completions: dict = field(default_factory=lambda: {Side.SEND: [], Side.RECV: []})
    links: int = 1
    fail_asks: bool = False
    link_hit: bool = False

    def fresh_link(self) -> str:
        self.links += 1
        return f"link-{self.links}"

    def feed(self, side: Side, event, reply_link=None) -> None:
        lifecycle = self.send if side is Side.SEND else self.recv
        self.carry_out(side, lifecycle.handle(event), reply_link)

    def carry_out(self, side: Side, actions, reply_link=None) -> None:
        outbox = self.to_recv if side is Side.SEND else self.to_send
        lifecycle = self.send if side is Side.SEND else self.recv
        for action in actions:
            if isinstance(action, Complete):
                self.completions[side].append(action.completion)
            elif isinstance(action, SendFrame):
                link = action.link if action.link is not None else self.fresh_link()
                outbox.append((link, action.message))
            elif isinstance(action, SendVerdict):
                outbox.append((reply_link, action.message))
            elif isinstance(action, AskVerdict):
                assert side is Side.SEND
                if self.fail_asks:
                    self.feed(side, VerdictAskFailed("no route"))
                else:
                    lifecycle.link = self.fresh_link()
                    outbox.append((lifecycle.link, action.message))
            elif isinstance(action, CloseLink):
                self.lose(action.link)

    def lose(self, link) -> None:
        """The link dies: its messages in flight are lost, each side bound to it hears it."""
        if link in self.dead:
            return
        self.dead.add(link)
        self.link_hit = True
        for box in (self.to_recv, self.to_send):
            kept = [(lk, m) for lk, m in box if lk != link]
            box.clear()
            box.extend(kept)
        for side, lifecycle in ((Side.SEND, self.send), (Side.RECV, self.recv)):
            if lifecycle.link == link:
                self.feed(side, LinkLost(AbortCode.CONNECTION_LOST, f"{link} lost"))

    def deliver(self, to: Side) -> bool:
        box = self.to_recv if to is Side.RECV else self.to_send
        if not box:
            return False
        link, message = box.popleft()
        if link in self.dead:
            return True
        if isinstance(message, Done):
            self.feed(to, PeerDone(message.nbytes))
        else:
            assert isinstance(message, Abort)
            expected = AbortTarget.RECEIVER if to is Side.RECV else AbortTarget.SENDER
            assert message.target is expected
            peer = "P" if to is Side.RECV else "D"
            event = PeerAbort(message.code, message.reason, peer, message.confirms)
            self.feed(to, event, reply_link=link)
        return True

    def drain(self, senders_first: bool = True) -> None:
        """Deliver what is in flight; ``senders_first``: the sender's messages land first."""
        order = (Side.RECV, Side.SEND) if senders_first else (Side.SEND, Side.RECV)
        while any([self.deliver(order[0]), self.deliver(order[1])]):
            pass

    def settle(self) -> None:
        """Deliver everything, then let deadlines pass until both sides completed."""
        for _ in range(2 * VERDICT_ASKS + 4):
            self.drain()
            pending = [
                (side, lc)
                for side, lc in ((Side.SEND, self.send), (Side.RECV, self.recv))
                if lc.phase is not Phase.COMPLETE
            ]
            if not pending:
                return
            for side, lifecycle in pending:
                if lifecycle.phase is Phase.DRAINING:
                    self.feed(side, FrameEnded(0))
                else:
                    self.feed(side, DeadlinePassed("deadline"))


def transfer(*, last_frame_in_flight: bool = False, bytes_written: bool = True) -> Wire:
    """One request whose last (only) frame has begun: its bytes left (or are still leaving)
    and the receiver holds them (or is still writing them); DONE not decided yet."""
    send = Lifecycle(RequestKey(Side.SEND, "r"), peer="D", peer_address="D:1")
    recv = Lifecycle(RequestKey(Side.RECV, "r"))
    send.link = recv.link = FIRST_LINK
    recv.peer = "P"
    send.handle(LastBatchSubmitted())
    assert send.begin_io(last=True)
    assert recv.begin_io()
    wire = Wire(send, recv)
    if not last_frame_in_flight:
        wire.feed(Side.SEND, FrameEnded(NBYTES, last_left=True))
    if bytes_written:
        wire.feed(Side.RECV, FrameEnded(NBYTES))
    return wire


# The events that race, by name: what each does to the wire.
RACING = {
    "sender abort": lambda w: w.feed(Side.SEND, CallerAbort("sender gave up")),
    "receiver abort": lambda w: w.feed(Side.RECV, CallerAbort("receiver gave up")),
    "receiver DONE": lambda w: w.feed(Side.RECV, LastBatchWritten()),
    "link lost": lambda w: w.lose(FIRST_LINK),
    "sender deadline": lambda w: w.feed(Side.SEND, DeadlinePassed("sender deadline")),
    "receiver deadline": lambda w: w.feed(Side.RECV, DeadlinePassed("receiver deadline")),
}
ABORTS = {"sender abort": "send", "receiver abort": "recv"}


def check(wire: Wire, names: tuple[str, ...]) -> tuple[Completion, Completion]:
    wire.settle()
    sends, recvs = wire.completions[Side.SEND], wire.completions[Side.RECV]
    assert len(sends) == 1, (names, sends)
    assert len(recvs) == 1, (names, recvs)
    send, recv = sends[0], recvs[0]
    aborted = {ABORTS[n] for n in names if n in ABORTS}
    why = disagreement(send, recv, aborted, wire.link_hit)
    assert why is None, (names, why, send, recv)
    assert not crossed_two_answers(send, recv), (names, send, recv)
    return send, recv


DELIVERY = ["at once", "held, the receiver's land first", "held, the sender's land first"]


def run(names: tuple[str, ...], delivery: str, **setup) -> tuple[Completion, Completion]:
    wire = transfer(**setup)
    for name in names:
        RACING[name](wire)
        if delivery == "at once":
            wire.drain()
    wire.drain(senders_first=delivery != "held, the receiver's land first")
    return check(wire, names)


def orderings(size: int):
    for events in itertools.combinations(RACING, size):
        yield from itertools.permutations(events)


@pytest.mark.parametrize("delivery", DELIVERY)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_ordering_of_the_racing_events_keeps_the_rule(size, delivery) -> None:
    for names in orderings(size):
        run(names, delivery)


@pytest.mark.parametrize("delivery", DELIVERY)
def test_every_ordering_with_the_last_frame_still_leaving(delivery) -> None:
    """The sender's last frame ends (FrameEnded) at any point of the race."""
    racing = dict(RACING)
    racing["last frame ends"] = lambda w: w.feed(Side.SEND, FrameEnded(NBYTES, last_left=True))
    for events in itertools.combinations([n for n in racing if n != "last frame ends"], 2):
        for names in itertools.permutations((*events, "last frame ends")):
            wire = transfer(last_frame_in_flight=True)
            for name in names:
                racing[name](wire)
                if delivery == "at once":
                    wire.drain()
            wire.drain(senders_first=delivery != "held, the receiver's land first")
            check(wire, tuple(n for n in names if n in RACING))


def test_every_ordering_when_no_fresh_link_can_be_had() -> None:
    for names in orderings(3):
        wire = transfer()
        wire.fail_asks = True
        for name in names:
            RACING[name](wire)
        wire.drain()
        check(wire, names)


def outcome(c: Completion) -> str:
    return "DONE" if c.ok else c.origin.name


@pytest.mark.parametrize(
    ("names", "delivery", "expected"),
    [
        # Crossed aborts: whichever reached the receiver first is the first aborter on both sides.
        (("receiver abort", "sender abort"), "held, the receiver's land first", ("PEER", "LOCAL")),
        # The sender's ABORT still in flight when the receiver aborts: the receiver's came first.
        (("sender abort", "receiver abort"), "held, the sender's land first", ("PEER", "LOCAL")),
        (("sender abort", "receiver abort"), "at once", ("LOCAL", "PEER")),
        (("receiver abort", "sender abort"), "at once", ("PEER", "LOCAL")),
        # The receiver's abort crossing the sender's deadline: the receiver's came first.
        (
            ("sender deadline", "receiver abort"),
            "held, the receiver's land first",
            ("PEER", "LOCAL"),
        ),
        (("sender deadline", "receiver abort"), "at once", ("TIMEOUT", "PEER")),
        # An abort after the receiver's last byte comes too late: DONE on both sides.
        (("receiver DONE", "sender abort"), "held, the receiver's land first", ("DONE", "DONE")),
        (("receiver DONE", "receiver abort"), "at once", ("DONE", "DONE")),
        # The link lost once the last batch began: the sender asks, the receiver says DONE.
        (("receiver DONE", "link lost"), "held, the receiver's land first", ("DONE", "DONE")),
        (("link lost", "receiver DONE"), "at once", ("TRANSPORT", "TRANSPORT")),
    ],
)
def test_who_aborted_first(names, delivery, expected) -> None:
    send, recv = run(names, delivery)
    assert (outcome(send), outcome(recv)) == expected


def test_a_decision_waits_for_the_backend_to_let_go() -> None:
    """DRAINING: decided while a frame is in flight; delivered only once that frame ended."""
    lifecycle = Lifecycle(RequestKey(Side.RECV, "r"))
    lifecycle.link = FIRST_LINK
    assert lifecycle.begin_io()
    actions = lifecycle.handle(CallerAbort("gave up"))
    assert lifecycle.phase is Phase.DRAINING
    assert not [a for a in actions if isinstance(a, Complete)]
    assert not lifecycle.begin_io()  # no new frame touches the memory
    actions = lifecycle.handle(FrameEnded(10))
    (complete,) = [a for a in actions if isinstance(a, Complete)]
    assert complete.completion.origin is AbortOrigin.LOCAL
    assert lifecycle.phase is Phase.COMPLETE
    assert lifecycle.handle(CallerAbort("again")) == []  # idempotent


def test_a_waiting_sender_starts_no_frame_and_close_decides_at_once() -> None:
    wire = transfer()
    wire.feed(Side.SEND, CallerAbort("gave up"))
    assert wire.send.phase is Phase.VERDICT_WAIT
    assert not wire.send.begin_io()
    wire.feed(Side.SEND, EngineClosing())
    (send,) = wire.completions[Side.SEND]
    assert (send.origin, send.code) == (AbortOrigin.LOCAL, AbortCode.ENGINE_CLOSED)


def test_the_receiver_answers_every_abort_with_its_outcome() -> None:
    recv = Lifecycle(RequestKey(Side.RECV, "r"))
    recv.link = FIRST_LINK
    recv.handle(CallerAbort("receiver gave up"))
    (answer,) = recv.handle(PeerAbort(AbortCode.CALLER_ABORT, "sender gave up", "P"))
    assert isinstance(answer, SendVerdict)
    assert answer.message.code is AbortCode.CALLER_ABORT
    assert not answer.message.confirms  # the receiver aborted first
    other = Lifecycle(RequestKey(Side.RECV, "s"))
    actions = other.handle(PeerAbort(AbortCode.CALLER_ABORT, "sender gave up", "P"))
    assert other.outcome.origin is AbortOrigin.PEER
    assert actions[-1].message.confirms  # the sender's abort came first


def test_a_sender_without_a_peer_decides_its_abort_at_once() -> None:
    lifecycle = Lifecycle(RequestKey(Side.SEND, "r"))
    actions = lifecycle.handle(CallerAbort("gave up"))
    (complete,) = [a for a in actions if isinstance(a, Complete)]
    assert complete.completion.status is TransferStatus.ABORTED
    assert complete.completion.origin is AbortOrigin.LOCAL


def test_a_passed_deadline_says_where_the_request_stood() -> None:
    """The first line a stall leaves: side, peer, phase, bytes moved, frames in flight."""
    recv = Lifecycle(RequestKey(Side.RECV, "r"), peer="P")
    recv.link = FIRST_LINK
    assert recv.begin_io()
    recv.handle(FrameEnded(1024))
    line, *_ = [
        a for a in recv.handle(DeadlinePassed("no completion within 60s")) if isinstance(a, Log)
    ]
    text = line.message % line.args
    assert text.startswith("request 'r' (recv, peer P): no completion within 60s in phase ")
    assert "1024 payload bytes moved, inside 0 frames, link on ?, handshake ?" in text
    # The sender, told that the receiver timed out, says where it stood too.
    send = Lifecycle(RequestKey(Side.SEND, "s"), peer="D")
    line, *_ = [
        a
        for a in send.handle(PeerAbort(AbortCode.TIMEOUT, "no completion within 60s", "D"))
        if isinstance(a, Log)
    ]
    text = line.message % line.args
    assert text.startswith("request 's' (send, peer D): the receiver timed out (no completion")
    assert "0 payload bytes moved, inside 0 frames, no link" in text
