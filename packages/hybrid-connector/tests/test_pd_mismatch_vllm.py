"""A layout mismatch between P and D through real vLLM: refused before any byte moves, and D
recomputes the prompt.

P serves the tiny GDN hybrid (a state group and an attention group) and D the tiny Qwen2 (one
attention group): D's transfer_kv names a cache P cannot write into, P refuses it with a
PeerError and releases its blocks, D reports the pull failed and computes the prompt itself, so
its tokens equal its own single-instance tokens. Both pools are empty afterwards.
"""

from __future__ import annotations

import pytest
from harness.checks import MAX_TOKENS, assert_idle, delta, prefill, prompts, reference, salt
from harness.offline import OfflineEngine

pytestmark = pytest.mark.timeout(600)


def test_mismatched_caches_are_refused_and_decode_recomputes(
    engine_gdn: OfflineEngine, engine_qwen2: OfflineEngine
) -> None:
    p, d = engine_gdn, engine_qwen2
    batch = prompts(7, (37, 300))
    expected = reference(d, batch)  # D alone
    p_before, d_before = p.counters(), d.counters()
    got = d.generate(batch, MAX_TOKENS, prefill(p, batch), salt=salt())
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    d_after = d.counters()
    assert delta(d_after, d_before, "pulls_failed") == len(batch)
    assert delta(d_after, d_before, "bytes_received") == 0
    assert_idle(p, d)
    p_after = p.counters()
    assert delta(p_after, p_before, "sends_done") == 0
    assert delta(p_after, p_before, "leases_expired") == 0, "P freed its blocks when it refused"
