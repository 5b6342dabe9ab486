"""The drain state machine alone (drain.py), event by event on a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pd_serving.drain import Drain, DrainConfig, DrainPhase


def _drain(**config: int | float) -> Drain:
    return Drain("d1", started=0.0, config=DrainConfig(**config))


def test_an_idle_instance_is_drained_at_once() -> None:
    drain = _drain()
    drain.calls_open(0, now=0.5)
    assert drain.phase is DrainPhase.DRAINED
    assert drain.report(9.0)["elapsed_s"] == 0.5


def test_streams_migrate_a_few_at_a_time_then_drained() -> None:
    drain = _drain(concurrency=2)
    for s in "abc":
        drain.stream_seen(s, 0.0)
    drain.calls_open(3, 0.0)
    first = drain.next_migrations(0.0)
    assert first == ["a", "b"]
    assert drain.next_migrations(0.0) == [], "the bound holds while two are under way"
    drain.migration_ended("a", "moved", "", 0.1)
    assert drain.next_migrations(0.1) == ["c"]
    drain.migration_ended("b", "moved", "", 0.2)
    drain.migration_ended("c", "moved", "", 0.3)
    assert drain.phase is DrainPhase.DRAINING, "the old legs' calls are still open"
    drain.calls_open(0, 0.4)
    assert drain.phase is DrainPhase.DRAINED
    assert drain.report(0.4)["moved"] == 3


def test_a_refused_stream_is_retried_later_then_stays() -> None:
    drain = _drain(max_attempts=2, retry_after_s=1.0)
    drain.stream_seen("a", 0.0)
    drain.calls_open(1, 0.0)
    assert drain.next_migrations(0.0) == ["a"]
    drain.migration_ended("a", "refused", "not running yet", 0.1)
    assert drain.next_migrations(0.5) == [], "not before its retry time"
    assert drain.wake_at() == pytest.approx(1.1)
    assert drain.next_migrations(1.1) == ["a"]
    drain.migration_ended("a", "refused", "not running yet", 1.2)
    assert drain.next_migrations(10.0) == []
    report = drain.report(1.2)
    assert report["staying"] == 1
    assert report["stayed"] == {"refused: not running yet": 1}
    assert drain.phase is DrainPhase.DRAINING, "it finishes where it is"
    drain.stream_left("a", 2.0)
    drain.calls_open(0, 2.0)
    assert drain.phase is DrainPhase.DRAINED


def test_no_other_d_the_stream_finishes_in_place() -> None:
    drain = _drain()
    drain.stream_seen("a", 0.0)
    drain.calls_open(2, 0.0)
    [a] = drain.next_migrations(0.0)
    drain.no_target(a, "no other decode instance", 0.0)
    report = drain.report(0.0)
    assert report["stayed"] == {"no other decode instance": 1}
    assert report["in_place"] == 1, "a call that is no migratable stream"
    drain.calls_open(0, 3.0)
    assert drain.phase is DrainPhase.DRAINED


def test_a_drain_without_migrations_only_waits() -> None:
    drain = Drain("d1", 0.0, migrate=False)
    drain.stream_seen("a", 0.0)
    drain.calls_open(1, 0.0)
    assert drain.next_migrations(0.0) == []
    assert drain.report(0.0)["staying"] == 1


def test_a_call_opening_again_undoes_drained_and_undrain_ends_it() -> None:
    drain = _drain()
    drain.calls_open(0, 0.0)
    drain.calls_open(1, 1.0)  # a request sent back to it (a failed target)
    assert drain.phase is DrainPhase.DRAINING
    drain.undrain()
    assert drain.phase is DrainPhase.RESUMED
    assert drain.done
    drain.stream_seen("a", 2.0)
    assert drain.next_migrations(2.0) == []


def test_a_migration_under_way_keeps_it_draining() -> None:
    drain = _drain()
    drain.stream_seen("a", 0.0)
    drain.calls_open(1, 0.0)
    drain.next_migrations(0.0)
    drain.calls_open(0, 0.1)
    assert drain.phase is DrainPhase.DRAINING
    drain.migration_ended("a", "failed", "target broke", 0.2)
    assert drain.phase is DrainPhase.DRAINED
    assert drain.report(0.2)["failed"] == 1


events = st.lists(
    st.tuples(
        st.sampled_from(["seen", "left", "calls", "next", "moved", "refused", "failed", "none"]),
        st.sampled_from("abcd"),
        st.integers(0, 4),
    ),
    max_size=60,
)


@given(events)
def test_any_order_of_events_keeps_the_invariants(sequence) -> None:
    drain = _drain(concurrency=2, max_attempts=2, retry_after_s=0.5)
    now = 0.0
    migrating: set[str] = set()
    for kind, stream, n in sequence:
        now += 0.1
        if kind == "seen":
            drain.stream_seen(stream, now)
        elif kind == "left":
            drain.stream_left(stream, now)  # one migrating waits for its outcome
        elif kind == "calls":
            drain.calls_open(n, now)
        elif kind == "next":
            started = drain.next_migrations(now)
            assert not set(started) & migrating, "never twice at once"
            migrating |= set(started)
        elif kind == "none" and stream in migrating:
            drain.no_target(stream, "none", now)
            migrating.discard(stream)
        elif stream in migrating:
            drain.migration_ended(stream, kind, "", now)
            migrating.discard(stream)
        report = drain.report(now)
        assert report["migrating"] <= 2
        if drain.phase is DrainPhase.DRAINED:
            assert drain.calls == 0
            assert report["migrating"] == 0
    drain.calls_open(0, now)
    for stream in list(migrating):
        drain.migration_ended(stream, "moved", "", now)
    assert drain.phase is DrainPhase.DRAINED
