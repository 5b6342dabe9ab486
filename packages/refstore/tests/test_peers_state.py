"""The peer table and a lookup's round (``peers.py``): pure, on a clock the test moves."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from refstore.peers import BACKOFF_S, MAX_BACKOFF_S, PeerState, PeerTable

A, B, C = "10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"


def test_every_up_peer_is_asked_and_the_longest_continuation_wins_ties_to_the_first():
    table = PeerTable([A, B, C])
    round_ = table.begin(0.0)
    assert round_.asked == [A, B, C]
    assert not round_.answered(A, 2)
    assert not round_.answered(B, 3)
    assert not round_.answered(C, 3)
    assert round_.best() == (B, 3)
    round_.fetched(3, 3000)
    status = {s.address: s for s in table.status(0.0)}
    assert (status[B].hits, status[B].keys, status[B].bytes) == (1, 3, 3000)
    assert (status[A].misses, status[C].misses, status[B].misses) == (1, 1, 0)
    assert table.totals() == {
        "peer_lookups": 1,
        "peer_hits": 1,
        "peer_keys": 3,
        "peer_bytes": 3000,
        "peer_misses": 2,
        "peer_failures": 0,
    }


def test_no_continuation_anywhere_chooses_none():
    table = PeerTable([A, B])
    round_ = table.begin(0.0)
    round_.answered(A, 0)
    round_.failed(B, "timeout")
    assert round_.best() is None
    with pytest.raises(ValueError, match="without a chosen peer"):
        round_.fetch_failed("x", 0.0)


def test_a_failed_peer_is_logged_once_skipped_during_its_backoff_then_probed_alone():
    table = PeerTable([A, B])
    first = table.begin(0.0)
    assert first.failed(A, "no answer in 0.5 s")  # the one log line
    first.answered(B, 0)
    assert table.state(A) is PeerState.DOWN
    assert table.begin(BACKOFF_S / 2).asked == [B]  # backing off: not asked
    probe = table.begin(BACKOFF_S)
    assert probe.asked == [A, B]
    assert table.state(A) is PeerState.PROBING
    assert table.begin(BACKOFF_S).asked == [B]  # one probe at a time
    assert not probe.failed(A, "still nothing")  # down already: not logged again
    [status] = [s for s in table.status(BACKOFF_S) if s.address == A]
    assert (status.state, status.retry_in_s, status.failures) == ("down", 2 * BACKOFF_S, 2)
    assert status.last_error == "still nothing"
    probe = table.begin(3 * BACKOFF_S)
    assert probe.answered(A, 1)  # back: worth a log line
    assert table.state(A) is PeerState.UP
    # Up again: the next failure starts the back-off from the base.
    assert table.begin(3 * BACKOFF_S).failed(A, "again")
    assert table.status(3 * BACKOFF_S)[0].retry_in_s == BACKOFF_S


def test_backoff_doubles_up_to_the_cap():
    table = PeerTable([A], backoff_s=1.0, max_backoff_s=5.0)
    now, waits = 0.0, []
    for _ in range(6):
        round_ = table.begin(now)
        assert round_.asked == [A]
        round_.failed(A, "down")
        waits.append(table.status(now)[0].retry_in_s)
        now += waits[-1]
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_a_failed_fetch_backs_the_chosen_peer_off_and_keeps_what_arrived():
    table = PeerTable([A])
    round_ = table.begin(0.0)
    round_.answered(A, 4)
    assert round_.best() == (A, 4)
    round_.fetched(2, 200)
    assert round_.fetch_failed("link lost", 0.0)
    [status] = table.status(0.0)
    assert (status.state, status.keys, status.failures) == ("down", 2, 1)


def test_an_abandoned_round_leaves_a_probe_due_and_an_up_peer_up():
    table = PeerTable([A, B])
    table.begin(0.0).failed(A, "x")
    round_ = table.begin(BACKOFF_S)
    assert table.state(A) is PeerState.PROBING
    round_.abandon()
    assert (table.state(A), table.state(B)) == (PeerState.DOWN, PeerState.UP)
    assert table.begin(BACKOFF_S).asked == [A, B]


def test_removed_peers_are_not_asked_and_their_late_answers_are_ignored():
    table = PeerTable([A, B])
    round_ = table.begin(0.0)
    assert table.remove([A, C]) == [A]
    assert table.add([B, C]) == [C]
    assert not round_.failed(A, "gone")
    round_.answered(B, 1)
    assert round_.best() == (B, 1)
    assert [s.address for s in table.status(0.0)] == [B, C]
    assert table.begin(0.0).asked == [B, C]


def test_a_round_rejects_answers_from_peers_it_did_not_ask_or_twice():
    table = PeerTable([A])
    round_ = table.begin(0.0)
    with pytest.raises(ValueError, match="not asked"):
        round_.answered(B, 1)
    round_.answered(A, 1)
    with pytest.raises(ValueError, match="already"):
        round_.failed(A, "x")
    with pytest.raises(ValueError):
        PeerTable([A], backoff_s=0.0)


events = st.lists(
    st.one_of(
        st.tuples(st.just("round"), st.lists(st.sampled_from(["ok", "fail", "empty"]), max_size=3)),
        st.tuples(st.just("wait"), st.floats(0.0, 40.0)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events)
def test_random_rounds_keep_the_backoff_promises(script):
    """A peer in back-off is never asked; a failure is logged only when the peer was up; a
    retry comes between BACKOFF_S and MAX_BACKOFF_S after a failure."""
    peers = [A, B, C]
    table = PeerTable(peers)
    now = 0.0
    up = dict.fromkeys(peers, True)
    retry_at = dict.fromkeys(peers, 0.0)
    for kind, arg in script:
        if kind == "wait":
            now += arg
            continue
        round_ = table.begin(now)
        for address in peers:
            due = up[address] or retry_at[address] <= now + 1e-9
            if abs(retry_at[address] - now) > 1e-6:  # not at the edge of float rounding
                assert (address in round_.asked) == due
        for address, outcome in zip(round_.asked, arg + ["ok"] * 3, strict=False):
            if outcome == "fail":
                logged = round_.failed(address, "x")
                assert logged == up[address]
                up[address] = False
                wait = table.status(now)[peers.index(address)].retry_in_s
                assert BACKOFF_S - 1e-9 <= wait <= MAX_BACKOFF_S + 1e-9
                retry_at[address] = now + wait
            else:
                back = round_.answered(address, 0 if outcome == "empty" else 2)
                assert back == (not up[address])
                up[address] = True
        assert round_.settled
        best = round_.best()
        assert best is None or best[1] == 2
