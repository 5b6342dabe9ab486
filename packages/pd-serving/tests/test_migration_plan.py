"""The live migration's state machine alone: every named path as a table, then any order of
events (hypothesis), checked after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_serving.migration import Action, Decision, Migration, Phase

D1, D2, D3 = "d1", "d2", "d3"
# D1 stopped the request and its end came: the target was called.
SWITCHED = [("requested", D2), ("d1_stopped",), ("d1_ended",)]


def _run(events: list[tuple[str, ...]]) -> tuple[Migration, list[Decision]]:
    migration = Migration(D1)
    out = []
    for name, *args in events:
        out.append(getattr(migration, name)(*args))
    return migration, out


PATHS = {
    "stopped, then D1's end": (
        [("requested", D2), ("d1_stopped",), ("d1_ended",), ("called_first_token",)],
        [Action.ASK_D1, Action.WAIT, Action.CALL, Action.RELAY],
        Phase.MOVED,
    ),
    "D1's end, then stopped": (
        [("requested", D2), ("d1_ended",), ("d1_stopped",), ("called_first_token",)],
        [Action.ASK_D1, Action.HOLD, Action.CALL, Action.RELAY],
        Phase.MOVED,
    ),
    "refused: D1 goes on": (
        [("requested", D2), ("d1_refused", "busy"), ("d1_ended",)],
        [Action.ASK_D1, Action.KEEP, Action.END_ON_D1],
        Phase.DONE,
    ),
    "refused after D1's end: the end is forwarded": (
        [("requested", D2), ("d1_ended",), ("d1_refused", "request finished")],
        [Action.ASK_D1, Action.HOLD, Action.END_ON_D1],
        Phase.DONE,
    ),
    "refused, asked again, moved": (
        [
            ("requested", D2),
            ("d1_refused", "not running yet"),
            ("requested", D2),
            ("d1_stopped",),
            ("d1_ended",),
            ("called_first_token",),
        ],
        [Action.ASK_D1, Action.KEEP, Action.ASK_D1, Action.WAIT, Action.CALL, Action.RELAY],
        Phase.MOVED,
    ),
    "D2 fails: back to D1": (
        [
            ("requested", D2),
            ("d1_stopped",),
            ("d1_ended",),
            ("called_failed", "refused"),
            ("called_first_token",),
        ],
        [Action.ASK_D1, Action.WAIT, Action.CALL, Action.CALL, Action.RELAY],
        Phase.MOVED,
    ),
    "D2 and D1 fail: a third D recomputes": (
        [
            ("requested", D2),
            ("d1_stopped",),
            ("d1_ended",),
            ("called_failed", "refused"),
            ("called_failed", "refused"),
            ("recompute_on", D3),
            ("called_first_token",),
        ],
        [
            Action.ASK_D1,
            Action.WAIT,
            Action.CALL,
            Action.CALL,
            Action.RECOMPUTE,
            Action.RECOMPUTE,
            Action.RELAY,
        ],
        Phase.MOVED,
    ),
    "D2 and D1 fail, no D left: the stream ends in error": (
        [
            ("requested", D2),
            ("d1_stopped",),
            ("d1_ended",),
            ("called_failed", "refused"),
            ("called_failed", "refused"),
            ("no_target", "no other D"),
        ],
        [Action.ASK_D1, Action.WAIT, Action.CALL, Action.CALL, Action.RECOMPUTE, Action.FAIL],
        Phase.DONE,
    ),
    "a recomputing D fails: the next one": (
        [
            ("requested", D2),
            ("d1_failed", "reset"),
            ("called_failed", "503"),
            ("recompute_on", D3),
            ("called_first_token",),
        ],
        [Action.ASK_D1, Action.RECOMPUTE, Action.RECOMPUTE, Action.RECOMPUTE, Action.RELAY],
        Phase.MOVED,
    ),
    "D1 breaks after the stop: D2 recomputes": (
        [("requested", D2), ("d1_stopped",), ("d1_failed", "reset"), ("called_first_token",)],
        [Action.ASK_D1, Action.WAIT, Action.RECOMPUTE, Action.RELAY],
        Phase.MOVED,
    ),
    "D1 breaks while warming: D2 recomputes": (
        [("requested", D2, True), ("precopy_offered",), ("d1_failed", "reset")],
        [Action.ASK_PRECOPY, Action.WARM, Action.RECOMPUTE],
        Phase.RECOMPUTING,
    ),
    "D1 unreachable for PRECOPY: D2 recomputes": (
        [("requested", D2, True), ("d1_unreachable", "refused"), ("called_first_token",)],
        [Action.ASK_PRECOPY, Action.RECOMPUTE, Action.RELAY],
        Phase.MOVED,
    ),
    "D1 unreachable for MIGRATE_OUT: D2 recomputes": (
        [("requested", D2), ("d1_unreachable", "reset")],
        [Action.ASK_D1, Action.RECOMPUTE],
        Phase.RECOMPUTING,
    ),
    "D1 unreachable after its cut end: D2 recomputes": (
        [("requested", D2), ("d1_ended", False), ("d1_unreachable", "reset")],
        [Action.ASK_D1, Action.HOLD, Action.RECOMPUTE],
        Phase.RECOMPUTING,
    ),
    "D1 stopped it as it ended whole: the end is forwarded": (
        [("requested", D2), ("d1_ended", True), ("d1_stopped",)],
        [Action.ASK_D1, Action.HOLD, Action.END_ON_D1],
        Phase.DONE,
    ),
    "D1 unreachable after its whole answer: it is forwarded": (
        [("requested", D2), ("d1_ended", True), ("d1_unreachable", "reset")],
        [Action.ASK_D1, Action.HOLD, Action.END_ON_D1],
        Phase.DONE,
    ),
    "no migration: D1 ends": ([("d1_ended",)], [Action.END_ON_D1], Phase.DONE),
    "asked twice": (
        [("requested", D2), ("requested", D2)],
        [Action.ASK_D1, Action.REFUSE],
        Phase.STOPPING,
    ),
    "asked to move where it is": ([("requested", D1)], [Action.REFUSE], Phase.STREAMING),
    "asked after D1's end": (
        [("d1_ended",), ("requested", D2)],
        [Action.END_ON_D1, Action.REFUSE],
        Phase.DONE,
    ),
    "D1 breaks while stopping: D2 recomputes": (
        [("requested", D2), ("d1_failed", "reset")],
        [Action.ASK_D1, Action.RECOMPUTE],
        Phase.RECOMPUTING,
    ),
    "D1 breaks with no migration under way": (
        [("d1_failed", "reset")],
        [Action.FAIL],
        Phase.DONE,
    ),
    "D1 breaks after a failed warm-up: no target left": (
        [("requested", D2, True), ("precopy_offered",), ("warm_failed", "x"), ("d1_failed", "r")],
        [Action.ASK_PRECOPY, Action.WARM, Action.KEEP, Action.FAIL],
        Phase.DONE,
    ),
    "client gone while switching": (
        [("requested", D2), ("d1_stopped",), ("d1_ended",), ("client_gone",)],
        [Action.ASK_D1, Action.WAIT, Action.CALL, Action.FREE],
        Phase.DONE,
    ),
    "pre-copied, warmed, stopped, moved": (
        [
            ("requested", D2, True),
            ("precopy_offered",),
            ("warmed",),
            ("d1_stopped",),
            ("d1_ended",),
            ("called_first_token",),
        ],
        [Action.ASK_PRECOPY, Action.WARM, Action.ASK_D1, Action.WAIT, Action.CALL, Action.RELAY],
        Phase.MOVED,
    ),
    "pre-copy refused: a plain stop-and-copy": (
        [("requested", D2, True), ("precopy_refused", "no full block"), ("d1_stopped",)],
        [Action.ASK_PRECOPY, Action.ASK_D1, Action.WAIT],
        Phase.STOPPED,
    ),
    "the warm-up fails: the request stays on D1": (
        [("requested", D2, True), ("precopy_offered",), ("warm_failed", "503"), ("d1_ended",)],
        [Action.ASK_PRECOPY, Action.WARM, Action.KEEP, Action.END_ON_D1],
        Phase.DONE,
    ),
    "D1 ends while warming": (
        [("requested", D2, True), ("precopy_offered",), ("d1_ended",), ("warmed",)],
        [Action.ASK_PRECOPY, Action.WARM, Action.END_ON_D1, Action.KEEP],
        Phase.DONE,
    ),
    "D1 ends while pre-copying": (
        [("requested", D2, True), ("d1_ended",), ("precopy_offered",)],
        [Action.ASK_PRECOPY, Action.END_ON_D1, Action.KEEP],
        Phase.DONE,
    ),
    "asked while pre-copying": (
        [("requested", D2, True), ("requested", D2)],
        [Action.ASK_PRECOPY, Action.REFUSE],
        Phase.PRECOPYING,
    ),
    "client gone after the move": (
        [*SWITCHED, ("called_first_token",), ("client_gone",)],
        [Action.ASK_D1, Action.WAIT, Action.CALL, Action.RELAY, Action.FREE],
        Phase.DONE,
    ),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_named_paths(name: str) -> None:
    events, actions, phase = PATHS[name]
    migration, decisions = _run(events)
    assert [d.action for d in decisions] == actions
    assert migration.phase is phase


def test_the_switch_calls_the_target_and_going_back_calls_d1() -> None:
    _, decisions = _run(
        [("requested", D2), ("d1_stopped",), ("d1_ended",), ("called_failed", "5xx")]
    )
    assert [d.target for d in decisions if d.action is Action.CALL] == [D2, D1]


@pytest.mark.parametrize(
    ("events", "released"),
    [
        # D1 holds M once it stopped, until a D streams from it.
        ([("requested", D2), ("d1_stopped",), ("client_gone",)], True),
        ([("requested", D2), ("d1_stopped",), ("d1_failed", "reset")], True),
        (
            [*SWITCHED, ("called_failed", "x"), ("called_failed", "x")],
            True,
        ),
        (
            [*SWITCHED, ("called_first_token",), ("called_failed_mid_stream", "reset")],
            False,
        ),
        # Asked, no answer yet: D1 may stop it any moment; released, it frees at once then.
        ([("requested", D2), ("client_gone",)], True),
        ([("requested", D2), ("d1_refused", "no"), ("client_gone",)], False),
    ],
)
def test_release_only_while_d1_holds_for_nobody(
    events: list[tuple[str, ...]], released: bool
) -> None:
    _, decisions = _run(events)
    assert [d.release for d in decisions].count(True) == int(released)
    assert decisions[-1].release is released


@pytest.mark.parametrize(
    ("events", "released"),
    [
        # C is D1's from PRECOPY until refused; released once, whatever came after.
        ([("requested", D2, True), ("precopy_offered",), ("warmed",)], True),
        ([("requested", D2, True), ("precopy_offered",), ("warm_failed", "x")], True),
        ([("requested", D2, True), ("precopy_offered",), ("d1_ended",)], True),
        ([("requested", D2, True), ("client_gone",)], True),
        ([("requested", D2, True), ("precopy_offered",), ("d1_failed", "reset")], True),
        ([("requested", D2, True), ("precopy_refused", "no"), ("client_gone",)], False),
        (
            [
                ("requested", D2, True),
                ("precopy_offered",),
                ("warmed",),
                ("d1_stopped",),
                ("client_gone",),
            ],
            True,
        ),
    ],
)
def test_the_precopy_id_is_released_once_unless_refused(
    events: list[tuple[str, ...]], released: bool
) -> None:
    _, decisions = _run(events)
    assert [d.release_precopy for d in decisions].count(True) == int(released)


def test_the_warm_up_goes_to_the_target() -> None:
    _, decisions = _run([("requested", D2, True), ("precopy_offered",), ("warmed",)])
    assert [(d.action, d.target) for d in decisions[1:]] == [
        (Action.WARM, D2),
        (Action.ASK_D1, D2),
    ]


def test_the_switch_recomputes_on_neither_failed_d() -> None:
    migration, decisions = _run([*SWITCHED, ("called_failed", "5xx"), ("called_failed", "reset")])
    assert decisions[-1] == Decision(Action.RECOMPUTE, release=True, message="reset")
    assert migration.failed == {D1, D2}
    assert migration.recompute_on(D2).action is Action.KEEP, "never on a D that failed"
    assert migration.recompute_on(D3) == Decision(Action.RECOMPUTE, target=D3)


def test_d1_failing_mid_migration_recomputes_on_the_target_and_releases() -> None:
    _, decisions = _run([("requested", D2, True), ("d1_failed", "reset")])
    assert decisions[-1].action is Action.RECOMPUTE
    assert decisions[-1].target == D2
    assert decisions[-1].release_precopy
    _, decisions = _run([("requested", D2), ("d1_stopped",), ("d1_failed", "reset")])
    assert (decisions[-1].action, decisions[-1].target, decisions[-1].release) == (
        Action.RECOMPUTE,
        D2,
        True,
    )


EVENTS = st.sampled_from(
    [
        ("requested", D2),
        ("requested", D2, True),
        ("precopy_offered",),
        ("precopy_refused", "no"),
        ("warmed",),
        ("warm_failed", "refused"),
        ("requested", D1),
        ("d1_refused", "no"),
        ("d1_unreachable", "refused"),
        ("d1_stopped",),
        ("d1_ended",),
        ("d1_ended", True),
        ("d1_failed", "reset"),
        ("called_first_token",),
        ("called_failed", "refused"),
        ("called_failed_mid_stream", "reset"),
        ("recompute_on", D2),
        ("recompute_on", D3),
        ("no_target", "none"),
        ("client_gone",),
    ]
)
TERMINAL = {Action.END_ON_D1, Action.FAIL, Action.FREE}
UNDER_WAY = {Phase.PRECOPYING, Phase.WARMING, Phase.STOPPING, Phase.STOPPED}


@settings(max_examples=600, deadline=None)
@given(st.lists(EVENTS, max_size=14))
def test_any_order_of_events(events: list[tuple[str, ...]]) -> None:
    migration = Migration(D1)
    stopped = ended = False
    releases = 0
    precopies = precopy_released = 0
    for name, *args in events:
        before = migration.phase
        decision = getattr(migration, name)(*args)
        precopies += decision.action is Action.ASK_PRECOPY
        precopy_released += decision.release_precopy or (
            name == "precopy_refused" and before is Phase.PRECOPYING
        )
        assert precopy_released <= precopies, "C released at most once per pre-copy"
        if decision.action is Action.WARM:
            assert before is Phase.PRECOPYING
        if migration.phase not in (Phase.PRECOPYING, Phase.WARMING):
            assert precopy_released == precopies, "no pre-copy hold left behind"
            assert not migration.precopy_holds
        stopped |= name == "d1_stopped" and before is Phase.STOPPING
        ended |= name == "d1_ended"
        releases += decision.release
        if decision.action is Action.CALL:
            # Only once D1 stopped and every token of its answer went to the client, and
            # never past the client's budget.
            assert stopped
            assert ended
            assert not migration.end_complete
        if decision.action is Action.HOLD:
            assert before is Phase.STOPPING
        if decision.release:
            assert before in (*UNDER_WAY, Phase.SWITCHING)
        if decision.action is Action.ASK_D1:
            assert migration.target == D2
        # (D1 is unreachable only for an RPC in flight: PRECOPY or MIGRATE_OUT.)
        if (name == "d1_failed" and before in UNDER_WAY) or (
            name == "d1_unreachable" and before in (Phase.PRECOPYING, Phase.STOPPING)
        ):
            # D1 failing mid-migration never ends the client's answer: the target recomputes.
            assert decision.action in (Action.RECOMPUTE, Action.END_ON_D1)
            if decision.action is Action.RECOMPUTE:
                assert decision.target == D2
        if decision.action is Action.RECOMPUTE:
            assert migration.phase is Phase.RECOMPUTING
            assert decision.target not in migration.failed
            assert not migration.holds, "M released before any recompute"
        if name == "called_failed" and before is Phase.RECOMPUTING:
            assert decision.action is Action.RECOMPUTE, "a failed recompute tries another D"
        if decision.action in TERMINAL:
            assert migration.phase is Phase.DONE
    assert releases <= 1, "RELEASE of M at most once"
    if migration.phase in (Phase.STOPPING, Phase.STOPPED, Phase.SWITCHING):
        assert migration.holds
    if migration.phase in (Phase.STREAMING, Phase.RECOMPUTING, Phase.MOVED, Phase.DONE):
        assert not migration.holds
