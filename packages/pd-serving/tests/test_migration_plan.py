"""The live migration's state machine alone: every named path as a table, then any order of
events (hypothesis), checked after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_serving.migration import Action, Decision, Migration, Phase

D1, D2 = "d1", "d2"
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
    "D2 and D1 fail: the stream ends in error": (
        [
            ("requested", D2),
            ("d1_stopped",),
            ("d1_ended",),
            ("called_failed", "refused"),
            ("called_failed", "refused"),
        ],
        [Action.ASK_D1, Action.WAIT, Action.CALL, Action.CALL, Action.FAIL],
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
    "D1 breaks while stopping": (
        [("requested", D2), ("d1_failed", "reset")],
        [Action.ASK_D1, Action.FAIL],
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
        ("d1_stopped",),
        ("d1_ended",),
        ("d1_failed", "reset"),
        ("called_first_token",),
        ("called_failed", "refused"),
        ("called_failed_mid_stream", "reset"),
        ("client_gone",),
    ]
)
TERMINAL = {Action.END_ON_D1, Action.FAIL, Action.FREE}


@settings(max_examples=400, deadline=None)
@given(st.lists(EVENTS, max_size=12))
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
            # Only once D1 stopped and every token of its stream went to the client.
            assert stopped
            assert ended
        if decision.action is Action.HOLD:
            assert before is Phase.STOPPING
        if decision.release:
            assert before in (Phase.STOPPING, Phase.STOPPED, Phase.SWITCHING)
        if decision.action is Action.ASK_D1:
            assert migration.target == D2
        if decision.action in TERMINAL:
            assert migration.phase is Phase.DONE
    assert releases <= 1, "RELEASE of M at most once"
    if migration.phase in (Phase.STOPPING, Phase.STOPPED, Phase.SWITCHING):
        assert migration.holds
    if migration.phase in (Phase.STREAMING, Phase.MOVED, Phase.DONE):
        assert not migration.holds
