"""The master's state machine on its own: no sockets, no threads, a fake clock."""

from __future__ import annotations

import contextlib
import math

import pytest
import refstore
from refstore.protocol import Item, Layout
from refstore.state import MasterState

LAYOUT = Layout(0, [Item(None, 2, "|u1", (100,), 0, 100)])
BAD_TTLS = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(clock: Clock) -> MasterState:
    return MasterState(1 << 20, "epoch", clock=clock, wall_clock=clock)


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_alloc_and_extend_refuse_a_ttl_that_is_not_a_finite_positive_number(ttl):
    state = _state(Clock())
    with pytest.raises(refstore.CallerError, match="ttl"):
        state.alloc(100, LAYOUT, ttl, False)
    obj = state.alloc(100, LAYOUT, 10.0, False)
    state.seal(obj.oid)
    with pytest.raises(refstore.CallerError, match="ttl"):
        state.extend("epoch", [obj.oid], ttl)
    assert obj.deadline == 1010.0  # unchanged
    assert state.stats().objects == 1


def test_a_refused_nan_ttl_does_not_delay_another_objects_lease():
    """A NaN deadline in the lease heap compares false with everything: a shorter lease pushed
    below it never rises to the top, and expires only when a longer one ahead of it does."""
    clock = Clock()
    state = _state(clock)
    long = state.alloc(100, LAYOUT, 10.0, False)
    with contextlib.suppress(refstore.CallerError):  # before the fix it was taken
        state.alloc(100, LAYOUT, math.nan, False)
    state.alloc(100, LAYOUT, 20.0, False)
    short = state.alloc(100, LAYOUT, 1.0, False)
    assert state.next_deadline() == 1001.0
    clock.now += 2.0
    assert state.expire_due() == 1
    assert short.oid not in state.objects
    assert long.oid in state.objects


@pytest.mark.parametrize(
    ("nbytes", "header", "items"),
    [
        (-1, 0, []),
        (100, -64, [Item(None, 2, "|u1", (100,), 0, 100)]),
        (100, 0, [Item(None, 2, "|u1", (200,), 0, 200)]),  # an item past the payload
        (100, 0, [Item(None, 2, "|u1", (100,), -64, 100)]),
        (100, 0, [Item(None, 2, "|u1", (-100,), 0, 100)]),
        (100, 0, [Item(None, 9, "|u1", (100,), 0, 100)]),  # no such kind
    ],
)
def test_alloc_refuses_sizes_and_layouts_out_of_range(nbytes, header, items):
    state = _state(Clock())
    with pytest.raises(refstore.CallerError):
        state.alloc(nbytes, Layout(0, items), 10.0, False, header)
    assert state.stats().used == 0
