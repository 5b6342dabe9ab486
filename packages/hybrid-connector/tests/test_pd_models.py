"""Prefill/decode through real vLLM (CPU) for the model families beyond GQA: MLA and GDN.

For each family the session's ``kv_both`` engine (``engine_mla``, ``engine_gdn``) is P and D of
its own transfers; the same engine without transfer parameters is the single instance the PD
output is compared with. Every test checks that the engine holds no blocks after, and that D's
prompt tokens were counted by vLLM as external KV transfer
(``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``), which proves the KV moved.

Both are compared the way vLLM's own tests compare models (``check_logprobs_close``): equal up
to the first divergence, and there each side's token is in the other's top logprobs. MLA: D
computes the last prompt token on the decode path (absorbed weights) where the single instance
ran it in the prefill path. GDN: D continues from P's state after all prompt tokens but the last,
rounded to the bf16 state cache, where one instance keeps it in fp32 inside its chunked scan
(exact with ``mamba_ssm_cache_dtype=float32``, which makes vLLM pick 3072-token blocks). Both
flip greedy near-ties of random weights; for MLA, D's rows are also compared byte for byte with
the single instance's.

vLLM's CPU platform turns prefix caching off for MLA unless the CPU has AMX
(``CpuPlatform.check_and_update_config``), so the D-side prefix-hit test is skipped where the
MLA engine reports prefix caching off. GDN runs with prefix caching on
(``TINY_ENGINE_ARGS["gdn"]``: it fixes the state group's block size, which P and D must share):
P computes all prompt tokens but the last (a state cannot be rewound) and D computes that one.
"""

from __future__ import annotations

import pytest
from harness.checks import (
    MAX_TOKENS,
    assert_idle,
    assert_same_greedy,
    delta,
    prefill,
    prompts,
    pull_params,
    reference,
    salt,
    wait_for_sends,
)
from harness.offline import Gen, OfflineEngine, Req
from harness.ports import dead_address

pytestmark = [pytest.mark.timeout(900), pytest.mark.engines("engine_mla", "engine_gdn")]

EXTERNAL = "external_kv_transfer"
LOCAL_HIT = "local_cache_hit"


@pytest.fixture(params=["mla", "gdn"])
def engine(request: pytest.FixtureRequest) -> OfflineEngine:
    return request.getfixturevalue(f"engine_{request.param}")


def _batch(engine: OfflineEngine, seed: int) -> list[list[int]]:
    bs = engine.block_size
    # Shorter than a block, exactly one block, several blocks plus a partial one.
    return prompts(seed, (bs // 2 + 3, bs, min(3 * bs + bs // 3, 900)))


def _moved(engine: OfflineEngine, prompt: list[int]) -> int:
    """Prompt tokens P computes for D: all of them, or all but the last with a state group
    (a state cannot be rewound, so P stops before the last token and D computes it)."""
    return len(prompt) - 1 if engine.ready_info["has_state"] else len(prompt)


def _prefill(engine: OfflineEngine, batch: list[list[int]]) -> list[dict]:
    params = prefill(engine, batch)
    for param, prompt in zip(params, batch, strict=True):
        assert param["do_remote_prefill"] is True
        assert param["remote_num_tokens"] == _moved(engine, prompt)
    return params


def test_pd_equals_single_instance_and_moves_the_prompt(engine: OfflineEngine) -> None:
    batch = _batch(engine, seed=1)
    singles = [Req(p, MAX_TOKENS, cache_salt=salt()) for p in batch]
    expected: list[Gen] = engine.submit(singles).result()
    before = engine.stats()

    pulls = [
        Req(p, MAX_TOKENS, params, salt())
        for p, params in zip(batch, _prefill(engine, batch), strict=True)
    ]
    got = engine.submit(pulls).result()
    assert_same_greedy(got, expected, near_tie=True)

    assert_idle(engine)
    wait_for_sends(engine, before["counters"], len(batch))
    after = engine.stats()
    assert delta(after["counters"], before["counters"], "pulls_done") == len(batch)
    assert delta(after["counters"], before["counters"], "pulls_failed") == 0
    assert delta(after["counters"], before["counters"], "sends_done") == len(batch)
    # vLLM counted every prompt token P computed as loaded from outside, none as a local hit.
    moved = sum(_moved(engine, p) for p in batch)
    assert delta(after["by_source"], before["by_source"], EXTERNAL) == moved
    assert delta(after["by_source"], before["by_source"], LOCAL_HIT) == 0
    # D's attention layers hold the single instance's bytes for every prompt token but the last
    # (D recomputes it), read when vLLM freed each request's blocks. Single-group models only:
    # in a hybrid pool a freed block can become another group's page first.
    if engine.spec.record_kv:
        for pulled, single in zip(pulls, singles, strict=True):
            assert engine.prompt_kv(pulled.request_id) == engine.prompt_kv(single.request_id)


def test_decode_with_local_prefix_hit_pulls_only_the_rest(engine: OfflineEngine) -> None:
    """D caches the first blocks of a prompt from an earlier request: it pulls only the rest."""
    if not engine.ready_info["prefix_caching"]:
        pytest.skip(
            f"{engine.name}: vLLM turned prefix caching off (CPU MLA without AMX, "
            "CpuPlatform.check_and_update_config), so D has no prefix to hit"
        )
    first, second = _batch(engine, seed=2)[2], _batch(engine, seed=3)[2]
    # Every full block of `first`: a hybrid model hits only where vLLM kept the state, at the end
    # of the (block-aligned) chunks it computed, i.e. the last full block here.
    shared = len(first) // engine.block_size * engine.block_size
    prompt = first[:shared] + second[shared:]
    expected = reference(engine, [first, prompt])

    d_salt = salt()
    # D computes `first` itself (no transfer parameters), so it caches its blocks.
    d_out = engine.generate([first], MAX_TOKENS, salt=d_salt)
    assert_same_greedy(d_out, expected[:1], near_tie=True)
    before = engine.stats()
    d_out = engine.generate([prompt], MAX_TOKENS, _prefill(engine, [prompt]), salt=d_salt)
    assert_same_greedy(d_out, expected[1:], near_tie=True)

    after = engine.stats()
    assert delta(after["by_source"], before["by_source"], LOCAL_HIT) == shared
    assert (
        delta(after["by_source"], before["by_source"], EXTERNAL) == _moved(engine, prompt) - shared
    )
    assert delta(after["counters"], before["counters"], "pulls_done") == 1
    assert_idle(engine)


def test_unreachable_prefill_instance_recomputes(engine: OfflineEngine) -> None:
    """A failed pull leaves D recomputing the prompt, with the single instance's output."""
    batch = _batch(engine, seed=4)[:2]
    expected = reference(engine, batch)
    before = engine.counters()
    dead = dead_address()
    got = engine.generate(batch, MAX_TOKENS, [pull_params(dead) for _ in batch], salt=salt())
    assert_same_greedy(got, expected, near_tie=True)
    assert delta(engine.counters(), before, "pulls_failed") == len(batch)
    assert_idle(engine)
