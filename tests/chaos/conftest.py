"""Fixtures of the chaos suite: network-namespace labs and the gate for the vLLM tests.

The tests that start vLLM run only in ``nox -s chaos`` (which sets ``PDSERVE_CHAOS=1``) or by
hand with that variable: ``nox -s cross`` collects ``tests/`` too and must not pay minutes of
fault injection. The netns harness tests (no vLLM, seconds) run anywhere root is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import pytest

from .netns import NetnsLab, NetnsUnavailable, unavailable_reason

CHAOS_ENV = "PDSERVE_CHAOS"

needs_chaos_session = pytest.mark.skipif(
    os.environ.get(CHAOS_ENV) != "1",
    reason=f"starts vLLM and injects faults: run by `nox -s chaos` (or set {CHAOS_ENV}=1)",
)


@pytest.fixture
def netns_lab() -> Iterator[Callable[[Sequence[str]], NetnsLab]]:
    """``netns_lab(["a", "b"])`` -> an entered NetnsLab, closed after the test whatever happens;
    skips the test (with the reason) where namespaces cannot be made."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    labs: list[NetnsLab] = []

    def make(names: Sequence[str]) -> NetnsLab:
        lab = NetnsLab(names)
        try:
            lab.__enter__()
        except NetnsUnavailable as exc:
            pytest.skip(f"network namespaces unavailable here: {exc}")
        labs.append(lab)
        return lab

    try:
        yield make
    finally:
        for lab in labs:
            lab.close()
        left = [name for lab in labs for name in lab.leftovers()]
        assert not left, f"netns lab left {left}"
