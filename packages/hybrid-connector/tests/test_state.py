"""P's and D's state machines (hybrid_connector.producer, .consumer), event by event: no I/O.

A simulator plays everything around a machine (vLLM, D's RPCs, kvt, the timers) and checks the
rules after every action:

* a request's blocks are reported to vLLM at most once, only after vLLM finished the request,
  and never while kvt may still read (P) or write (D) them;
* every pull is answered at most once; at the end every pull was answered (or its caller left);
* once time passes (kvt completes, deadlines fire) nothing is left: every finished request was
  reported exactly once and the machine holds no record.

The races are run in every order (``itertools.permutations``), then the named ones as tables
with the exact step at which the blocks come back; a hypothesis state machine mixes many
transfers at once.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterable

import hypothesis.strategies as st
import msgspec
import pytest
from hybrid_connector import common, consumer, producer
from hybrid_connector.errors import LeaseExpired, PeerError, TransferError
from hybrid_connector.metadata import FinalPrefill, OfferSpec, RecvSpec, ReleaseSpec
from hybrid_connector.protocol import CacheSpec, LayoutSpec, SegmentSpec, TransferKvRequest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, rule
from kvt import AbortOrigin, Completion, TransferStatus

BLOCK_SIZE = 4
ATTENTION = LayoutSpec(
    layer_names=["l0", "l1"],
    layer_offsets=[0, 4096],
    region_ids=[1, 1],
    num_blocks=16,
    block_size=BLOCK_SIZE,
    segments=[SegmentSpec("kv", 0, 256, 256)],
    dtype="bfloat16",
)
# Linear-attention state (GDN): a block is a slot, one segment per state tensor.
STATE = LayoutSpec(
    layer_names=["s0", "s2"],
    layer_offsets=[8192, 12288],
    region_ids=[1, 1],
    num_blocks=16,
    block_size=BLOCK_SIZE,
    segments=[SegmentSpec("state0", 0, 256, 16), SegmentSpec("state1", 16, 256, 128)],
    kind="state_slots",
    family="state",
    dtype="bfloat16,bfloat16",
)
MLA = LayoutSpec(
    layer_names=["m0", "m1"],
    layer_offsets=[0, 4096],
    region_ids=[1, 1],
    num_blocks=16,
    block_size=BLOCK_SIZE,
    segments=[SegmentSpec("kv", 0, 256, 192)],
    family="mla",
    dtype="bfloat16",
)
SPEC = CacheSpec([ATTENTION])
HYBRID = CacheSpec([STATE, ATTENTION])
T, P_REQ = "t-1", "p-1"
PROMPT_BLOCKS, PROMPT_TOKENS = [3, 5], 6
STATE_SLOT = [9]


def _held(spec: CacheSpec) -> list[list[int]]:
    """P's blocks per group: the prompt's blocks, or the state slot."""
    return [STATE_SLOT if g.family == "state" else PROMPT_BLOCKS for g in spec.groups]


def _pull_request(tid: str = T, *, num_tokens: int = PROMPT_TOKENS, layout=SPEC):
    blocks = -(-num_tokens // BLOCK_SIZE)
    ids = [[0] if g.family == "state" else list(range(blocks)) for g in layout.groups]
    return TransferKvRequest(
        tid, "d-1", "127.0.0.1:9", layout, ids, [0] * len(layout.groups), num_tokens
    )


class StepEvents:
    """Stands for the kvt layer events of the step that completes a prompt (the machine passes
    them through to ``StartSend`` untouched; which layer is marked is kvt's business)."""

    def __init__(self, tid: str) -> None:
        self.tid = tid

    def __repr__(self) -> str:
        return f"StepEvents({self.tid})"


def _completion(tid: str, ok: bool, role: str = "send") -> Completion:
    if ok:
        return Completion(tid, role, TransferStatus.DONE, nbytes=512)
    return Completion(tid, role, TransferStatus.ABORTED, AbortOrigin.PEER, reason="test")


# ================================================================================ P simulator
class PSim:
    """Plays vLLM, D, kvt and the timers around ``producer.Producer``; asserts the rules."""

    def __init__(self, refuse: str | None = None, spec: CacheSpec = SPEC) -> None:
        self.spec = spec
        self.core = producer.Producer(
            spec, producer.ProducerSettings(lease_s=30, transfer_timeout_s=60)
        )
        self.sends: list[producer.StartSend] = []
        self.refuse = refuse  # kvt refuses StartSend: None, "first" batch, or a "later" one
        self.finished: set[str] = set()  # requests vLLM finished (it waits for our report)
        self.reported: Counter[str] = Counter()
        self.kvt_reading: set[str] = set()  # kvt ids of sends kvt accepted, not completed
        self.kvt_tid: dict[str, str] = {}  # kvt id -> transfer id
        self.armed: set[str] = set()
        self.arrived: set[int] = set()
        self.left: set[int] = set()  # pulls whose caller went away
        self.answers: dict[int, object] = {}  # pull -> "sent" or the exception
        self.aborts: Counter[str] = Counter()
        self.tid_of: dict[str, str] = {}
        self.announced: set[str] = set()
        self.layer_events: dict[str, StepEvents] = {}  # tid -> its prefill step's events
        self.actions: list[producer.ProducerAction] = []
        self.logs: list[common.Log] = []
        self.step = 0
        self.reported_at: dict[str, int] = {}

    # -- what the world does -------------------------------------------------------------
    def feed(self, event: producer.ProducerEvent) -> None:
        queue = [event]
        while queue:
            for action in self.core.handle(queue.pop(0)):
                if isinstance(action, common.Log):
                    self.logs.append(action)  # what the shell would log
                    continue
                self.actions.append(action)
                queue.extend(self._do(action))

    def _do(self, action: producer.ProducerAction) -> list[producer.ProducerEvent]:
        match action:
            case producer.ReturnBlocks(rid, tid):
                assert self.tid_of[rid] == tid
                assert rid in self.finished, f"{rid} reported while vLLM still runs it"
                reading = {self.kvt_tid[k] for k in self.kvt_reading}
                assert self.tid_of[rid] not in reading, f"{rid}: kvt may still read"
                self.reported[rid] += 1
                assert self.reported[rid] == 1, f"{rid} reported twice"
                self.reported_at[rid] = self.step
            case producer.StartSend(tid, pull, rid):
                self.sends.append(action)
                self._answer(pull, "sent")
                assert self.tid_of.get(rid) == tid
                if rid not in self.finished:
                    # Mid-forward: kvt must wait for each layer to be written.
                    assert rid in self.announced, f"{rid} sent before its prompt was computed"
                    assert action.layer_events is self.layer_events[tid], (
                        f"{rid}: sent mid-forward without its step's layer events"
                    )
                else:  # announced: the step's events still say when the kernels ran (GPU)
                    assert action.layer_events in (None, self.layer_events.get(tid))
                kvt_id = action.kvt_id or tid
                self.kvt_tid[kvt_id] = tid
                if self.refuse == "first":
                    return [producer.SendRefused(kvt_id, TransferError("refused"), False)]
                self.kvt_reading.add(kvt_id)
                if self.refuse == "later":
                    return [producer.SendRefused(kvt_id, TransferError("refused"), True)]
            case producer.FailPull(pull, error):
                self._answer(pull, error)
            case common.Abort(tid):
                self.aborts[tid] += 1
            case producer.ArmDeadline(tid):
                self.armed.add(tid)
            case producer.CancelDeadline(tid):
                self.armed.discard(tid)
        return []

    def _answer(self, pull: int, answer: object) -> None:
        assert pull in self.arrived, f"pull {pull} answered before it arrived"
        assert pull not in self.answers, f"pull {pull} answered twice"
        self.answers[pull] = answer

    def pull(self, pull: int = 1, tid: str = T, **kw) -> None:
        self.arrived.add(pull)
        kw.setdefault("layout", self.spec)
        self.feed(producer.PullArrived(pull, _pull_request(tid, **kw), "d:1"))

    def prefill(self, rid: str = P_REQ, tid: str = T) -> None:
        self.tid_of[rid] = tid
        self.announced.add(rid)
        events = self.layer_events.setdefault(tid, StepEvents(tid))
        spec = FinalPrefill(rid, tid, _held(self.spec), PROMPT_TOKENS)
        self.feed(producer.FinalPrefillStarts(spec, events))  # type: ignore[arg-type]

    def finish(self, rid: str = P_REQ, tid: str = T, *, aborted: bool = False, tokens=None):
        """vLLM finished the request. Not announced and aborted: nothing is offered (the
        scheduler half's ``cancel_offer``). Announced: the worker offers it at its step's end,
        whatever way vLLM finishes it afterwards (the owner holds its blocks either way)."""
        self.tid_of.setdefault(rid, tid)
        if aborted and rid not in self.announced:
            self.feed(producer.RequestCancelled(tid))
            return
        self.finished.add(rid)
        spec = OfferSpec(rid, tid, _held(self.spec), tokens or PROMPT_TOKENS)
        self.feed(producer.RequestFinished(spec))

    def release(self, tid: str = T) -> None:
        self.feed(producer.ReleaseArrived(tid, "proxy", "test"))

    def complete(self, tid: str = T, ok: bool = True) -> None:
        if tid in self.kvt_reading:  # kvt completes only what it accepted, once
            self.kvt_reading.discard(tid)
            self.feed(producer.SendCompleted(tid, _completion(tid, ok)))

    def deadline(self, tid: str = T) -> None:
        if tid in self.armed:
            self.armed.discard(tid)
            self.feed(producer.DeadlineReached(tid))

    def gone(self, pull: int = 1, tid: str = T) -> None:
        if pull in self.arrived and pull not in self.answers:  # only a waiting call can leave
            self.left.add(pull)
            self.feed(producer.PullGone(tid, pull))

    def settle(self) -> None:
        """Time passes: kvt completes what it accepted, armed deadlines fire, until quiet."""
        for _ in range(6):
            for tid in sorted(self.kvt_reading):
                self.complete(tid, ok=False)
            for tid in sorted(self.armed):
                self.deadline(tid)
        assert not self.kvt_reading
        assert not self.armed
        assert len(self.core) == 0, "records left behind"
        assert self.arrived == set(self.answers) | self.left, "a pull was never answered"
        assert set(self.reported) == self.finished, "finished requests not reported"

    def play(
        self, steps: Iterable[str], ok: bool = True, aborted: bool = False, check=None
    ) -> PSim:
        """Run ``steps`` (``check(self, name)`` after each one), leaving time stopped."""
        for self.step, name in enumerate(steps):
            match name:
                case "finish":
                    self.finish(aborted=aborted)
                case "complete":
                    self.complete(ok=ok)
                case "dup_pull":
                    self.pull(2)
                case _:
                    getattr(self, name)()
            if check is not None:
                check(self, name)
        self.step += 1
        return self

    def run(self, steps: Iterable[str], ok: bool = True, aborted: bool = False, check=None) -> PSim:
        self.play(steps, ok, aborted, check)
        self.settle()
        return self

    def shutdown(self) -> None:
        self.feed(common.ShuttingDown())

    def finish_reports_once(self) -> None:
        """vLLM finishes the request: its blocks come back now, once; nothing is left."""
        self.finish()
        assert self.reported[P_REQ] == 1
        self.settle()


def _orders(steps: list[str], before: tuple[str, str] | None = None) -> list[tuple[str, ...]]:
    """Every order of ``steps``, keeping ``before[0]`` ahead of ``before[1]``."""
    out = []
    for order in itertools.permutations(steps):
        if before is None or order.index(before[0]) < order.index(before[1]):
            out.append(order)
    return out


# ================================================================================ P: every order
RAPID_RACE = ["pull", "prefill", "finish", "complete", "release", "deadline", "dup_pull"]
PLAIN_RACE = ["pull", "finish", "complete", "release", "deadline", "dup_pull", "gone"]


def _served_mid_forward(order: Iterable[str]) -> str | None:
    """The pull step that must start a rapid send at once: the first pull, when it arrives
    during the forward pass that completes the prompt (after the prefill is announced, before
    the request finished) and nothing closed the transfer before it (release, lease)."""
    seen: set[str] = set()
    for step in order:
        if step in ("pull", "dup_pull"):
            mid_forward = "prefill" in seen and "finish" not in seen
            return step if mid_forward and not seen & {"release", "deadline"} else None
        seen.add(step)
    return None


def _check_mid_forward(order: tuple[str, ...]):
    served = _served_mid_forward(order)

    def check(sim: PSim, name: str) -> None:
        if name == served:
            pull = 1 if name == "pull" else 2
            assert sim.answers.get(pull) == "sent", f"{order}: a mid-forward pull waited"
            assert sim.sends[-1].layer_events is sim.layer_events[T]

    return check


@pytest.mark.parametrize("aborted", [False, True], ids=["finished", "aborted"])
@pytest.mark.parametrize("ok", [True, False], ids=["send-ok", "send-failed"])
@pytest.mark.parametrize("spec", [SPEC, HYBRID], ids=["one-group", "state+attention"])
def test_rapid_send_races_in_every_order(ok: bool, aborted: bool, spec: CacheSpec) -> None:
    """The pull arrives before the step that completes the prompt (parked) or during its
    forward pass (after the prefill is announced): either way it is sent layer by layer at
    once, and the blocks come back once, after the request finished and every send is over."""
    # vLLM announces the prefill in the step before it reports the request finished.
    for order in _orders(RAPID_RACE, before=("prefill", "finish")):
        PSim(spec=spec).run(order, ok=ok, aborted=aborted, check=_check_mid_forward(order))


def test_shutting_down_at_any_point_of_a_rapid_send() -> None:
    """ShuttingDown after any prefix of the rapid race: every waiting pull is answered, no
    record or deadline is left, and nothing more is reported (the worker is closing)."""
    race = [step for step in RAPID_RACE if step != "dup_pull"]
    prefixes = {
        order[:cut]
        for order in _orders(race, before=("prefill", "finish"))
        for cut in range(len(order) + 1)
    }
    for prefix in sorted(prefixes):
        sim = PSim().play(prefix)
        reported = Counter(sim.reported)
        sim.shutdown()
        assert len(sim.core) == 0, prefix
        assert not sim.armed, prefix
        assert sim.arrived == set(sim.answers) | sim.left, prefix
        assert sim.reported == reported, prefix


@pytest.mark.parametrize("aborted", [False, True], ids=["finished", "aborted"])
@pytest.mark.parametrize("ok", [True, False], ids=["send-ok", "send-failed"])
@pytest.mark.parametrize("spec", [SPEC, HYBRID], ids=["one-group", "state+attention"])
def test_plain_send_races_in_every_order(ok: bool, aborted: bool, spec: CacheSpec) -> None:
    for order in _orders(PLAIN_RACE):
        PSim(spec=spec).run(order, ok=ok, aborted=aborted)


@pytest.mark.parametrize("refuse", ["first", "later"])
def test_kvt_refusing_the_send_in_every_order(refuse: str) -> None:
    for order in _orders(["pull", "prefill", "finish", "complete", "release", "deadline"]):
        if order.index("prefill") < order.index("finish"):
            PSim(refuse=refuse).run(order)
        PSim(refuse=refuse).run([s for s in order if s != "prefill"])


# ================================================================================ P: named races
# (steps, the step after which P's blocks are reported; None: never, the request was not
# finished-and-delayed by vLLM). "complete" is kvt's completion of the send.
NAMED_RACES = {
    "sequential: pull finds the request finished": (["finish", "pull", "complete"], 2),
    "parallel: the pull waits, then the request finishes": (["pull", "finish", "complete"], 2),
    "send guard passes: abort only, blocks back with kvt's completion": (
        ["finish", "pull", "deadline", "complete"],
        3,
    ),
    "rapid: send done before the request finished": (["pull", "prefill", "complete", "finish"], 3),
    "rapid: request finished before the send is done": (
        ["pull", "prefill", "finish", "complete"],
        3,
    ),
    "rapid: release while sending does not free the blocks": (
        ["pull", "prefill", "release", "finish", "complete"],
        4,
    ),
    "lease passes with no pull": (["finish", "deadline"], 1),
    "release by D of held blocks": (["finish", "release"], 1),
    "release by the proxy before the request finished": (["release", "finish"], 1),
    "parked pull expires, the request finishes later": (["pull", "deadline", "finish"], None),
    "duplicate pull while sending changes nothing": (
        ["finish", "pull", "dup_pull", "complete"],
        3,
    ),
    "D's call goes away while parked": (["pull", "gone", "finish", "deadline"], 3),
    "request aborted on P before its prompt completed": (["pull", "abort"], None),
    # The pull reaches P during the forward pass that completes the prompt.
    "mid-forward: send done before the request finished": (
        ["prefill", "pull", "complete", "finish"],
        3,
    ),
    "mid-forward: request finished before the send is done": (
        ["prefill", "pull", "finish", "complete"],
        3,
    ),
    "mid-forward: request aborted while sending": (["prefill", "pull", "abort", "complete"], 3),
    "mid-forward: release while sending does not free the blocks": (
        ["prefill", "pull", "release", "complete", "finish"],
        4,
    ),
    "announced, no pull: held for a lease once finished": (["prefill", "finish", "deadline"], 2),
    "announced, pulled after it finished": (["prefill", "finish", "pull", "complete"], 3),
    "announced, released during the pass: back when it finishes": (
        ["prefill", "release", "finish"],
        2,
    ),
    "announced, the lease passes during the pass: back when it finishes": (
        ["prefill", "deadline", "finish"],
        2,
    ),
    # vLLM may abort an announced request after its step (async scheduling): its KV is whole
    # and offered from the step's end; the proxy's release (client gone) or the lease ends it.
    "announced, aborted after its step, no pull: held for the lease": (["prefill", "abort"], None),
}


@pytest.mark.parametrize("name", list(NAMED_RACES))
def test_named_race(name: str) -> None:
    steps, reported_after = NAMED_RACES[name]
    sim = PSim()
    for sim.step, step in enumerate(steps):
        match step:
            case "dup_pull":
                sim.pull(2)
            case "abort":
                sim.finish(aborted=True)
            case _:
                getattr(sim, step)()
    assert sim.reported_at.get(P_REQ) == reported_after
    sim.step = len(steps)
    sim.settle()


def test_pull_during_the_forward_pass_starts_a_rapid_send_at_once() -> None:
    """Issue 15 item 3: the pull arrives after the step that completes the prompt began: it is
    answered at once with a send held by that step's layer events (kvt sends the layers already
    marked at once and each other one as it is marked), and nothing is reported before vLLM
    finished the request."""
    sim = PSim()
    sim.prefill()
    assert sim.core.phase(T) is producer.Phase.HELD
    assert T in sim.armed, "a lease covers the record while nobody pulls"
    sim.pull()
    (send,) = sim.sends
    assert sim.answers[1] == "sent"
    assert send.layer_events is sim.layer_events[T]
    assert (send.src_block_ids, send.kvt_id) == ([PROMPT_BLOCKS], T)
    assert common.Count("rapid_sends") in sim.actions
    sim.complete()
    assert not sim.reported, "the request still runs: its blocks are vLLM's"
    assert sim.core.phase(T) is producer.Phase.SENT
    sim.finish_reports_once()


def test_announced_request_without_a_pull_is_held_under_its_lease() -> None:
    sim = PSim()
    sim.prefill()
    sim.finish()
    assert not sim.reported
    assert sim.core.phase(T) is producer.Phase.HELD
    assert T in sim.armed
    sim.deadline()  # nobody pulled within the lease
    assert sim.reported[P_REQ] == 1
    assert common.Count("leases_expired") in sim.actions
    sim.settle()


def test_release_during_the_pass_answers_not_released_and_frees_at_the_finish() -> None:
    sim = PSim()
    sim.prefill()
    sim.release()
    assert producer.AnswerRelease(T, False) in sim.actions, "nothing was freed yet"
    sim.pull()
    assert isinstance(sim.answers[1], TransferError), "released: no pull is taken"
    assert not sim.reported
    sim.finish_reports_once()


def test_an_announced_request_aborted_after_its_step_is_still_served() -> None:
    """Its step ran the whole prompt: the worker offered it at the step's end, so a pull gets
    its KV, and the blocks go back once, after the send."""
    sim = PSim()
    sim.prefill()
    sim.finish(aborted=True)
    assert not sim.reported
    sim.pull()
    assert sim.answers[1] == "sent"
    sim.complete()
    assert sim.reported[P_REQ] == 1
    sim.settle()


def test_shutdown_during_a_mid_forward_send_reports_nothing() -> None:
    sim = PSim()
    sim.prefill()
    sim.pull()
    sim.shutdown()
    assert len(sim.core) == 0
    assert not sim.armed
    sim.finish()  # vLLM's late finish after shutdown finds nothing
    assert not sim.reported


def test_send_guard_aborts_and_waits_for_the_completion() -> None:
    sim = PSim()
    sim.finish()
    sim.pull()
    assert sim.answers[1] == "sent"
    sim.actions.clear()
    sim.deadline()  # transfer_timeout_s passed without kvt's completion
    assert sim.actions == [
        common.Count("sends_timed_out"),
        common.Abort(T, "send timed out on P"),
    ]
    assert not sim.reported, "blocks handed back while kvt may still read them"
    sim.deadline()  # nothing armed any more: no second abort
    assert sim.aborts[T] == 1
    sim.complete(ok=False)  # the abort's completion: kvt stopped reading
    assert sim.reported[P_REQ] == 1
    sim.settle()


def test_kvt_refusing_a_later_batch_waits_for_the_completion() -> None:
    sim = PSim(refuse="later")
    sim.pull()
    sim.prefill()
    sim.finish()
    assert isinstance(sim.answers[1], str)
    assert sim.aborts[T] == 1
    assert not sim.reported
    sim.complete(ok=False)
    assert sim.reported[P_REQ] == 1


def test_kvt_refusing_the_first_batch_releases_at_once() -> None:
    sim = PSim(refuse="first")
    sim.finish()
    sim.pull()
    assert sim.reported[P_REQ] == 1
    assert not sim.aborts


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"num_tokens": PROMPT_TOKENS + 4}, "D needs 10 prompt tokens but P computed 6"),
        (
            {"layout": CacheSpec([msgspec.structs.replace(ATTENTION, layer_names=["l0"])])},
            "group 0 (attention)",
        ),
    ],
    ids=["too-many-tokens", "bad-layout"],
)
def test_a_bad_pull_fails_and_frees_held_blocks(kw: dict, error: str) -> None:
    sim = PSim()
    sim.finish()
    sim.pull(**kw)
    assert isinstance(sim.answers[1], PeerError)
    assert error in str(sim.answers[1])
    assert sim.reported[P_REQ] == 1
    sim.settle()


# ================================================================================ P: groups
def test_two_groups_are_held_sent_and_reported_once() -> None:
    """State slot plus attention blocks: one record, one send of both groups, one report."""
    sim = PSim(spec=HYBRID)
    sim.finish()
    assert not sim.reported, "held until pulled"
    sim.pull()
    (send,) = sim.sends
    assert send.src_block_ids == [STATE_SLOT, PROMPT_BLOCKS]
    assert send.request.block_ids == [[0], [0, 1]]
    assert not sim.reported, "kvt reads both groups until its completion"
    sim.complete()
    assert sim.reported[P_REQ] == 1
    sim.settle()
    assert sim.reported[P_REQ] == 1


def test_prefix_hit_in_one_group_passes_every_p_block_to_the_planner() -> None:
    """D holds the first attention block (its prefix hit) but needs the state: P offers every
    block of each group and lets plan_copy skip D's first_block per group."""
    sim = PSim(spec=HYBRID)
    sim.finish()
    request = TransferKvRequest(T, "d-1", "127.0.0.1:9", HYBRID, [[4], [7]], [0, 1], 6)
    sim.arrived.add(1)
    sim.feed(producer.PullArrived(1, request, "d:1"))
    (send,) = sim.sends
    assert send.src_block_ids == [STATE_SLOT, PROMPT_BLOCKS]
    assert send.request.first_block == [0, 1]
    sim.complete()
    assert sim.reported[P_REQ] == 1
    sim.settle()


def _mismatch(family: LayoutSpec, how: str) -> CacheSpec:
    """D's cache for a P whose cache is ``CacheSpec([family, ATTENTION])``, wrong in one way."""
    other = {"attention": MLA, "mla": STATE, "state": ATTENTION}[family.family]
    match how:
        case "group-count":
            return CacheSpec([family])
        case "group-family":
            return CacheSpec(
                [msgspec.structs.replace(other, layer_names=family.layer_names), ATTENTION]
            )
        case "segments":
            segments = [msgspec.structs.replace(s, nbytes=s.nbytes // 2) for s in family.segments]
            return CacheSpec([msgspec.structs.replace(family, segments=segments), ATTENTION])
        case "dtype":
            return CacheSpec([msgspec.structs.replace(family, dtype="float8_e4m3"), ATTENTION])
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["group-count", "group-family", "segments", "dtype"])
@pytest.mark.parametrize("family", [ATTENTION, MLA, STATE], ids=lambda f: f.family)
def test_a_layout_mismatch_fails_the_pull_before_any_byte_moves(
    family: LayoutSpec, how: str
) -> None:
    """Each layout family: D's cache differs from P's (groups, kind, segments, dtype): the pull
    fails with PeerError and no send starts (D then recomputes), P's held blocks are freed
    once, and the log names the request and the peer."""
    spec = CacheSpec([family, ATTENTION])
    sim = PSim(spec=spec)
    sim.finish()
    request = _pull_request(layout=_mismatch(family, how))
    sim.arrived.add(1)
    sim.feed(producer.PullArrived(1, request, "d:1"))
    assert isinstance(sim.answers[1], PeerError)
    assert not sim.sends
    assert sim.reported[P_REQ] == 1
    (warning,) = [line for line in sim.logs if line.level >= logging.WARNING]
    assert P_REQ in warning.text()
    assert "d:1" in warning.text()
    sim.settle()


def test_a_pull_naming_the_wrong_number_of_block_lists_fails() -> None:
    sim = PSim(spec=HYBRID)
    sim.finish()
    request = TransferKvRequest(T, "d-1", "127.0.0.1:9", HYBRID, [[0, 1]], [0], 6)
    sim.arrived.add(1)
    sim.feed(producer.PullArrived(1, request, "d:1"))
    assert isinstance(sim.answers[1], PeerError)
    assert "2 KV-cache groups" in str(sim.answers[1])
    assert not sim.sends
    assert sim.reported[P_REQ] == 1
    sim.settle()


def test_pull_after_cancel_fails_at_once_and_tombstone_is_forgotten() -> None:
    sim = PSim()
    sim.finish(aborted=True)  # unannounced abort: RequestCancelled
    assert sim.core.phase(T) is producer.Phase.CANCELLED
    sim.pull()
    assert isinstance(sim.answers[1], TransferError)
    sim.deadline()
    assert sim.core.phase(T) is None
    sim.settle()


def test_parked_pull_lease_fails_it_with_lease_expired() -> None:
    sim = PSim()
    sim.pull()
    sim.deadline()
    assert isinstance(sim.answers[1], LeaseExpired)
    assert common.Count("early_pulls_expired") in sim.actions


def test_second_request_with_a_held_transfer_id_is_released_at_once() -> None:
    sim = PSim()
    sim.finish()
    sim.finish("p-2")
    assert sim.reported["p-2"] == 1
    assert P_REQ not in sim.reported
    sim.pull()
    sim.complete()
    assert sim.reported[P_REQ] == 1


def test_shutdown_fails_parked_pulls() -> None:
    sim = PSim()
    sim.pull()
    sim.feed(common.ShuttingDown())
    assert isinstance(sim.answers[1], TransferError)
    assert len(sim.core) == 0


# ================================================================================ P: many at once
class ManyTransfers(RuleBasedStateMachine):
    """Several transfers whose events interleave in any order hypothesis picks."""

    def __init__(self) -> None:
        super().__init__()
        self.sim = PSim()
        self.pulls = itertools.count(1)
        self.done_steps: set[tuple[str, str]] = set()

    tids = st.sampled_from(["a", "b", "c"])

    def _once(self, tid: str, step: str) -> bool:
        if (tid, step) in self.done_steps:
            return False
        self.done_steps.add((tid, step))
        return True

    @rule(tid=tids)
    def pull(self, tid: str) -> None:
        rid, pull = "r" + tid, next(self.pulls)
        # HELD while its request runs (one D rank): announced, nobody pulled, nothing closed.
        mid_forward = (
            self.sim.core.phase(tid) is producer.Phase.HELD and rid not in self.sim.finished
        )
        self.sim.pull(pull, tid)
        if mid_forward:
            assert self.sim.answers[pull] == "sent", "a mid-forward pull waited"
            assert self.sim.sends[-1].layer_events is self.sim.layer_events[tid]

    @rule(tid=tids)
    def prefill(self, tid: str) -> None:
        if ("r" + tid, "finish") not in self.done_steps and self._once(tid, "prefill"):
            self.sim.prefill("r" + tid, tid)

    @rule(tid=tids, aborted=st.booleans())
    def finish(self, tid: str, aborted: bool) -> None:
        if self._once("r" + tid, "finish"):
            self.sim.finish("r" + tid, tid, aborted=aborted)

    @rule(tid=tids)
    def release(self, tid: str) -> None:
        self.sim.release(tid)

    @rule(tid=tids, ok=st.booleans())
    def complete(self, tid: str, ok: bool) -> None:
        self.sim.complete(tid, ok)

    @rule(tid=tids)
    def deadline(self, tid: str) -> None:
        self.sim.deadline(tid)

    def teardown(self) -> None:
        for rid in sorted(self.sim.announced - self.sim.finished):
            self.sim.finish(rid, self.sim.tid_of[rid])  # vLLM finishes what it still runs
        self.sim.settle()


TestManyTransfers = ManyTransfers.TestCase
TestManyTransfers.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)


# ================================================================================ D simulator
class DSim:
    """Plays vLLM, P and kvt around ``consumer.Consumer``; asserts the rules."""

    def __init__(self, expect_refused: bool = False) -> None:
        self.core = consumer.Consumer()
        self.expect_refused = expect_refused
        self.kvt_writing: set[str] = set()
        self.reported: Counter[str] = Counter()
        self.failed: set[str] = set()
        self.aborts: Counter[str] = Counter()
        self.releases: list[ReleaseSpec] = []
        self.calls: set[str] = set()
        self.spec = RecvSpec("d-1", T, "127.0.0.1:8200", [[0, 1]], [0], PROMPT_TOKENS)

    def feed(self, event: consumer.ConsumerEvent) -> None:
        queue = [event]
        while queue:
            for action in self.core.handle(queue.pop(0)):
                match action:
                    case consumer.StartPull(spec):
                        if self.expect_refused:
                            queue.append(
                                consumer.ExpectRefused(spec.request_id, TransferError("x"))
                            )
                        else:
                            self.kvt_writing.add(spec.transfer_id)
                            self.calls.add(spec.request_id)
                    case consumer.StopCall(rid):
                        self.calls.discard(rid)
                    case common.Abort(tid):
                        self.aborts[tid] += 1  # kvt decides ABORTED (unless already done)
                    case consumer.CallRelease(spec):
                        self.releases.append(spec)
                    case consumer.ReportRecv(rid, failed):
                        assert T not in self.kvt_writing, "reported while kvt may still write"
                        self.reported[rid] += 1
                        assert self.reported[rid] == 1, "reported twice"
                        if failed:
                            self.failed.add(rid)

    def start(self) -> None:
        self.feed(consumer.PullRequested(self.spec))

    def complete(self, ok: bool = True) -> None:
        if T in self.kvt_writing:
            self.kvt_writing.discard(T)
            ok = ok and not self.aborts[T]
            self.feed(consumer.RecvCompleted("d-1", _completion(T, ok, "recv")))

    def call_failed(self) -> None:
        if "d-1" in self.calls:
            self.calls.discard("d-1")
            self.feed(consumer.PullCallFailed("d-1", TransferError("unreachable")))

    def cancel(self) -> None:
        self.feed(consumer.PullCancelled("d-1"))

    def dup_start(self) -> None:
        if "d-1" in self.core:  # the scheduler plans one pull per request: a repeat can only
            self.start()  # come while the first is in flight

    def settle(self) -> None:
        self.complete(ok=False)
        assert not self.kvt_writing
        assert self.reported["d-1"] == 1
        assert len(self.core) == 0
        assert not self.calls


@pytest.mark.parametrize("ok", [True, False])
def test_pull_races_in_every_order(ok: bool) -> None:
    for order in itertools.permutations(["complete", "call_failed", "cancel", "dup_start"]):
        sim = DSim()
        sim.start()
        for step in order:
            if step == "complete":
                sim.complete(ok)
            else:
                getattr(sim, step)()
        sim.settle()
        done_first = order.index("complete") < min(
            order.index("cancel"), order.index("call_failed")
        )
        if ok and done_first:
            assert "d-1" not in sim.failed
        if not done_first:
            assert sim.aborts[T] == 1  # one abort, however many reasons
            assert "d-1" in sim.failed


def test_cancel_releases_on_p_and_aborts_kvt() -> None:
    sim = DSim()
    sim.start()
    sim.cancel()
    assert [r.reason for r in sim.releases] == ["aborted"]
    assert sim.aborts[T] == 1
    assert not sim.reported  # kvt may still write until its completion
    sim.complete(ok=False)
    assert "d-1" in sim.failed


def test_expect_refused_reports_failed_at_once() -> None:
    sim = DSim(expect_refused=True)
    sim.start()
    assert "d-1" in sim.failed
    sim.settle()


def test_release_request_is_passed_on() -> None:
    sim = DSim()
    spec = ReleaseSpec("d-2", "t-2", "127.0.0.1:8200", "full local hit")
    sim.feed(consumer.ReleaseRequested(spec))
    assert sim.releases == [spec]


def test_shutdown_aborts_pulls_without_reporting_them() -> None:
    sim = DSim()
    sim.start()
    sim.feed(common.ShuttingDown())
    assert sim.aborts[T] == 1
    assert not sim.reported  # the worker is closing: nobody reads the results any more
    assert len(sim.core) == 0


# ================================================================================ TP: fan-in (P)
HEAD_DIM = 8


def _tp_attention(rank: int, tp: int, total_heads: int = 2) -> LayoutSpec:
    """Rank ``rank`` of ``tp`` of a 2-head model in vLLM's CPU layout ([nb, H, bs, 2*hd])."""
    heads = total_heads // tp
    block = heads * BLOCK_SIZE * 2 * HEAD_DIM * 2
    return LayoutSpec(
        layer_names=["l0", "l1"],
        layer_offsets=[0, 16 * block],
        region_ids=[1, 1],
        num_blocks=16,
        block_size=BLOCK_SIZE,
        segments=[SegmentSpec("kv", 0, block, block)],
        kind="blocks_major",
        dtype="bfloat16",
        total_heads=total_heads,
        head_start=rank * heads,
        num_heads=heads,
    )


def _rank_cache(rank: int, tp: int, family: str = "attention") -> CacheSpec:
    group = MLA if family == "mla" else _tp_attention(rank, tp)
    return CacheSpec([group], tp_rank=rank, tp_size=tp)


def _kvt(p_rank: int, d_rank: int) -> str:
    return f"{T}/p{p_rank}d{d_rank}"


class FanInSim(PSim):
    """P rank ``p_rank`` of ``p_tp`` serving D's ``d_tp`` ranks."""

    def __init__(self, p_rank: int = 0, p_tp: int = 1, d_tp: int = 2, family="attention"):
        super().__init__(spec=_rank_cache(p_rank, p_tp, family))
        self.p_rank, self.d_tp, self.family = p_rank, d_tp, family

    def pull_from(self, d_rank: int, pull: int | None = None, **kw) -> None:
        self.pull(pull or d_rank + 1, layout=_rank_cache(d_rank, self.d_tp, self.family), **kw)

    def complete_for(self, d_rank: int, ok: bool = True) -> None:
        self.complete(_kvt(self.p_rank, d_rank), ok)


def test_fan_in_one_p_rank_serves_every_d_rank_then_reports_once() -> None:
    """P TP=1, D TP=2: each D rank pulls its own head; P's blocks go back after both sends."""
    sim = FanInSim()
    sim.finish()
    sim.pull_from(0)
    assert [s.kvt_id for s in sim.sends] == [_kvt(0, 0)]
    assert T in sim.armed, "the lease still runs for D rank 1"
    sim.complete_for(0)
    assert not sim.reported, "D rank 1 has not pulled yet"
    assert sim.core.phase(T) is producer.Phase.HELD
    sim.pull_from(1)
    assert [s.kvt_id for s in sim.sends] == [_kvt(0, 0), _kvt(0, 1)]
    assert T not in sim.armed, "every D rank pulled: no lease any more"
    assert sim.answers == {1: "sent", 2: "sent"}
    sim.complete_for(1)
    assert sim.reported[P_REQ] == 1
    sim.settle()


def test_fan_in_parked_pulls_all_start_when_the_request_finishes() -> None:
    sim = FanInSim()
    sim.pull_from(1)
    sim.pull_from(0)
    assert not sim.sends
    sim.finish()
    assert sorted(s.kvt_id for s in sim.sends) == [_kvt(0, 0), _kvt(0, 1)]
    sim.complete_for(0)
    assert not sim.reported
    sim.complete_for(1, ok=False)
    assert sim.reported[P_REQ] == 1, "a failed send ends too: blocks back once"
    sim.settle()


def test_fan_in_one_send_fails_blocks_back_after_both() -> None:
    sim = FanInSim()
    sim.finish()
    sim.pull_from(0)
    sim.pull_from(1)
    sim.complete_for(1, ok=False)
    assert not sim.reported, "kvt still reads for D rank 0"
    sim.complete_for(0)
    assert sim.reported[P_REQ] == 1
    sim.settle()


def test_fan_in_lease_passes_with_one_of_two_pulls_done() -> None:
    sim = FanInSim()
    sim.finish()
    sim.pull_from(0)
    sim.complete_for(0)
    assert not sim.reported
    sim.deadline()  # the lease: D rank 1 never pulled
    assert sim.reported[P_REQ] == 1
    assert sim.core.phase(T) is producer.Phase.CANCELLED  # a late pull of rank 1 fails at once
    assert len(sim.core) == 0
    sim.settle()


def test_fan_in_lease_passes_while_one_send_runs() -> None:
    sim = FanInSim()
    sim.finish()
    sim.pull_from(0)
    sim.deadline()
    assert not sim.reported, "kvt still reads for D rank 0"
    sim.pull_from(1)
    assert isinstance(sim.answers[2], TransferError), "no pull is taken after the lease"
    sim.complete_for(0)
    assert sim.reported[P_REQ] == 1
    sim.settle()


def test_fan_in_duplicate_pull_from_the_same_d_rank_fails_alone() -> None:
    sim = FanInSim()
    sim.finish()
    sim.pull_from(0, pull=1)
    sim.pull_from(0, pull=2)
    assert isinstance(sim.answers[2], PeerError)
    assert "duplicate" in str(sim.answers[2])
    sim.pull_from(1, pull=3)
    assert sim.answers[3] == "sent"
    assert len(sim.sends) == 2
    sim.complete_for(0)
    sim.complete_for(1)
    assert sim.reported[P_REQ] == 1
    sim.settle()


@pytest.mark.parametrize(
    "steps",
    [["pull0", "prefill", "pull1"], ["prefill", "pull1", "pull0"]],
    ids=["one-parked-one-late", "both-mid-forward"],
)
def test_fan_in_rapid_d_ranks_wait_on_the_same_layer_events(steps: list[str]) -> None:
    sim = FanInSim()
    for step in steps:
        sim.prefill() if step == "prefill" else sim.pull_from(int(step[-1]))
    pulled = [int(step[-1]) for step in steps if step != "prefill"]
    assert [s.kvt_id for s in sim.sends] == [_kvt(0, d) for d in pulled]
    assert all(s.layer_events is sim.layer_events[T] for s in sim.sends)
    sim.complete_for(0)
    sim.complete_for(1)
    assert not sim.reported, "the request still runs"
    sim.finish_reports_once()


def test_fan_in_pull_from_a_rank_that_takes_nothing_here_fails() -> None:
    """MLA, P TP=2, D TP=1: D's only rank pulls from P rank 0; P rank 1 refuses a pull."""
    sim = FanInSim(p_rank=1, p_tp=2, d_tp=1, family="mla")
    sim.finish()
    sim.pull_from(0)
    assert isinstance(sim.answers[1], PeerError)
    assert "takes nothing from P rank 1" in str(sim.answers[1])
    sim.settle()


FAN_IN_RACE = ["pull0", "pull1", "finish", "complete0", "complete1", "deadline", "release"]


def _run_fan_in(order: Iterable[str], ok: bool) -> FanInSim:
    sim = FanInSim()
    for sim.step, step in enumerate(order):
        if step.startswith("pull"):
            sim.pull_from(int(step[-1]))
        elif step.startswith("complete"):
            sim.complete_for(int(step[-1]), ok)
        else:
            getattr(sim, step)()
    sim.step += 1
    sim.settle()
    return sim


@pytest.mark.parametrize("ok", [True, False], ids=["send-ok", "send-failed"])
def test_fan_in_races_in_every_order(ok: bool) -> None:
    for order in itertools.permutations(FAN_IN_RACE):
        _run_fan_in(order, ok)


def test_fan_in_rapid_races_in_every_order() -> None:
    """Both D ranks' pulls before or during the forward pass that completes the prompt, or
    after the request finished, with the lease anywhere (a release: the named fan-in tests):
    each send started while the request runs carries the step's layer events (PSim checks),
    blocks back once."""
    race = ["prefill", *(step for step in FAN_IN_RACE if step != "release")]
    for order in _orders(race, before=("prefill", "finish")):
        _run_fan_in(order, ok=order.index("complete0") % 2 == 0)


# ================================================================================ TP: fan-out (D)
def _recv(remote_tp: int) -> RecvSpec:
    return RecvSpec("d-1", T, "127.0.0.1:8200", [[0, 1]], [0], PROMPT_TOKENS, remote_tp)


def _run(core: consumer.Consumer, event: consumer.ConsumerEvent) -> list[consumer.ConsumerAction]:
    return core.handle(event)


def test_fan_out_d_rank_pulls_each_p_rank_and_reports_once() -> None:
    """P TP=2, D TP=1: D's rank pulls head 0 from P rank 0 and head 1 from P rank 1."""
    core = consumer.Consumer(_rank_cache(0, 1))
    actions = _run(core, consumer.PullRequested(_recv(2)))
    starts = [a for a in actions if isinstance(a, consumer.StartPull)]
    assert [(s.kvt_id, s.spec.remote_rpc_address) for s in starts] == [
        (_kvt(0, 0), "127.0.0.1:8200"),
        (_kvt(1, 0), "127.0.0.1:8201"),
    ]
    assert all(s.spec.transfer_id == T for s in starts)
    done = _run(
        core, consumer.RecvCompleted("d-1", _completion(_kvt(0, 0), True, "recv"), _kvt(0, 0))
    )
    assert not [a for a in done if isinstance(a, consumer.ReportRecv)], "P rank 1 still writes"
    done = _run(
        core, consumer.RecvCompleted("d-1", _completion(_kvt(1, 0), True, "recv"), _kvt(1, 0))
    )
    assert consumer.ReportRecv("d-1", failed=False) in done
    assert len(core) == 0


def test_fan_out_one_part_fails_aborts_the_other_and_reports_failed_after_both() -> None:
    core = consumer.Consumer(_rank_cache(0, 1))
    _run(core, consumer.PullRequested(_recv(2)))
    failed = _completion(_kvt(0, 0), False, "recv")
    actions = _run(core, consumer.RecvCompleted("d-1", failed, _kvt(0, 0)))
    assert common.Abort(_kvt(1, 0), "another part failed: test") in actions
    assert not [a for a in actions if isinstance(a, consumer.ReportRecv)], "kvt may still write"
    aborted = _completion(_kvt(1, 0), False, "recv")
    actions = _run(core, consumer.RecvCompleted("d-1", aborted, _kvt(1, 0)))
    assert [a for a in actions if isinstance(a, consumer.ReportRecv)] == [
        consumer.ReportRecv("d-1", failed=True)
    ]
    assert len(core) == 0


def test_fan_out_call_failure_aborts_every_part() -> None:
    core = consumer.Consumer(_rank_cache(0, 1))
    _run(core, consumer.PullRequested(_recv(2)))
    actions = _run(core, consumer.PullCallFailed("d-1", TransferError("down"), _kvt(1, 0)))
    assert {a.transfer_id for a in actions if isinstance(a, common.Abort)} == {
        _kvt(0, 0),
        _kvt(1, 0),
    }


def test_fan_out_expect_refused_on_one_part() -> None:
    core = consumer.Consumer(_rank_cache(0, 1))
    _run(core, consumer.PullRequested(_recv(2)))
    actions = _run(core, consumer.ExpectRefused("d-1", TransferError("x"), _kvt(1, 0)))
    assert common.Abort(_kvt(0, 0), "expect refused: x") in actions
    aborted = _completion(_kvt(0, 0), False, "recv")
    actions = _run(core, consumer.RecvCompleted("d-1", aborted, _kvt(0, 0)))
    assert consumer.ReportRecv("d-1", failed=True) in actions


def test_fan_out_each_d_rank_of_two_pulls_from_the_one_p_rank() -> None:
    for d_rank in (0, 1):
        core = consumer.Consumer(_rank_cache(d_rank, 2))
        (start,) = [
            a
            for a in _run(core, consumer.PullRequested(_recv(1)))
            if isinstance(a, consumer.StartPull)
        ]
        assert (start.kvt_id, start.spec.remote_rpc_address) == (_kvt(0, d_rank), "127.0.0.1:8200")


def test_fan_out_mla_spreads_d_ranks_and_releases_an_idle_p_rank() -> None:
    """MLA's latent is on every P rank: D rank r pulls from P rank r % P TP; with one D rank
    and two P ranks, D rank 0 releases P rank 1 (it would hold the blocks for a lease)."""
    core = consumer.Consumer(_rank_cache(1, 2, "mla"))
    starts = [
        a for a in _run(core, consumer.PullRequested(_recv(2))) if isinstance(a, consumer.StartPull)
    ]
    assert [s.spec.remote_rpc_address for s in starts] == ["127.0.0.1:8201"]
    core = consumer.Consumer(_rank_cache(0, 1, "mla"))
    actions = _run(core, consumer.PullRequested(_recv(2)))
    assert [a.spec.remote_rpc_address for a in actions if isinstance(a, consumer.StartPull)] == [
        "127.0.0.1:8200"
    ]
    (release,) = [a for a in actions if isinstance(a, consumer.CallRelease)]
    assert release.spec.remote_rpc_address == "127.0.0.1:8201"


def test_fan_out_cancel_and_release_reach_every_p_rank() -> None:
    core = consumer.Consumer(_rank_cache(0, 1))
    _run(core, consumer.PullRequested(_recv(2)))
    actions = _run(core, consumer.PullCancelled("d-1"))
    releases = [a.spec.remote_rpc_address for a in actions if isinstance(a, consumer.CallRelease)]
    assert releases == ["127.0.0.1:8200", "127.0.0.1:8201"]
    spec = ReleaseSpec("d-2", "t-2", "127.0.0.1:8200", "full local hit", remote_tp_size=2)
    actions = _run(core, consumer.ReleaseRequested(spec))
    assert [a.spec.remote_rpc_address for a in actions] == ["127.0.0.1:8200", "127.0.0.1:8201"]


def test_fan_out_state_groups_with_different_tp_recompute() -> None:
    core = consumer.Consumer(CacheSpec([STATE], tp_rank=0, tp_size=1))
    spec = RecvSpec("d-1", T, "127.0.0.1:8200", [[0]], [0], PROMPT_TOKENS, 2)
    assert _run(core, consumer.PullRequested(spec))[-1] == consumer.ReportRecv("d-1", failed=True)
    assert len(core) == 0
