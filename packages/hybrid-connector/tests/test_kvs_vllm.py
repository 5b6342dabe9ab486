"""KVS through vLLM: a prefix computed once is loaded by another instance, by a restarted one,
by the same one after its own cache forgot it, and by a D that pulls only what the store lacks
from P (nothing, when it has every full block, even from a P that is gone); every fault falls
back to recompute.

Shared engines (``tests/harness/pool.py``): ``engine_kvs_a`` and ``engine_kvs_b`` (qwen2; b
checks each block's checksum), ``engine_kvs_mla`` and ``engine_kvs_gdn`` (a Gated DeltaNet
hybrid: attention blocks plus the linear layers' states) share one refstore master
(``kvs_store``). Each test uses prompts of its own (a seed each), so no test hits what another
one stored, and ends with the engines idle (no request, every block back in vLLM's pool, no
save holding a block) and the store back to its counts at the test's start (``kvs_clean``: no
hold, no leased, reserved or pinned object, no client connection added).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import refstore
from harness.checks import (
    KV_BYTES_PER_TOKEN,
    MAX_TOKENS,
    assert_idle,
    copied_tokens,
    prefill_params,
    prompts,
    pull_params,
    salt,
    wait_for,
    wait_for_sends,
)
from harness.fds import describe_sockets
from harness.kvs import (
    evict_before_each_load,
    kv_cache_layout,
    prompt_keys,
    reset_prefix_cache,
    scrub_free_blocks,
    start_failure,
)
from harness.offline import OfflineEngine
from harness.pool import KVS_STORE, count_vllm_start, engine_spec
from harness.ports import dead_address
from refstore import faults
from refstore.errors import PoolFull

BLOCK = 32  # the qwen2 KVS engines' block size
LENGTHS = (300, 170, 97)  # 9, 5 and 3 full blocks of 32 tokens


def _stored_blocks(prompt: list[int], block: int = BLOCK) -> int:
    """Full blocks of a prompt that another instance can load (all but the last token)."""
    return (len(prompt) - 1) // block


def _counter(engine: OfflineEngine, name: str) -> int:
    return engine.counters().get(name, 0)


def _wait_saved(engine: OfflineEngine, before: int, n: int) -> None:
    """Until ``n`` more saves of ``engine`` reached its scheduler half (every rank)."""
    wait_for(
        f"{engine.name}: {n} KVS save report(s)",
        lambda: _counter(engine, "kvs_save_reports") >= before + n * engine.tp,
        timeout=60,
    )


def _compute_and_save(engine: OfflineEngine, batch: list[list[int]]) -> list[Any]:
    """Greedy outputs of ``batch`` on ``engine``, once its saves are in the store."""
    before = _counter(engine, "kvs_save_reports")
    saves_before = engine.stats()["kvs"]["saves"]
    outs = engine.generate(batch, MAX_TOKENS)
    saves = engine.stats()["kvs"]["saves"] - saves_before
    _wait_saved(engine, before, saves)
    return outs


def _by_source(engine: OfflineEngine) -> dict[str, int]:
    return dict(engine.stats()["by_source"])


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.token_ids for o in outs]


# ------------------------------------------------------------------ hits
def test_a_prefix_computed_on_one_instance_is_loaded_by_another(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    batch = prompts(2501, LENGTHS)
    keys_before = kvs_store.stats().keys
    expected = _compute_and_save(engine_kvs_a, batch)
    stored = sum(_stored_blocks(p) for p in batch)
    # Keys of every full block, prompt and output (307, 177, 104 tokens: 9 + 5 + 3).
    assert kvs_store.stats().keys - keys_before >= stored
    before = _by_source(engine_kvs_b)
    got = engine_kvs_b.generate(batch, MAX_TOKENS)
    assert _tokens(got) == _tokens(expected)
    after = _by_source(engine_kvs_b)
    assert _delta(after, before, "external_kv_transfer") == stored * BLOCK
    assert _delta(after, before, "local_compute") == sum(len(p) for p in batch) - stored * BLOCK
    kvs_clean(engine_kvs_a, engine_kvs_b)


def test_the_second_instance_extends_what_the_first_stored(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    """A turn 2 (turn 1 plus more tokens) on the other instance loads turn 1's blocks, then
    saves only its own new ones."""
    (turn1,) = prompts(2502, (200,))
    (more,) = prompts(2503, (130,))
    first = _compute_and_save(engine_kvs_a, [turn1])
    turn2 = turn1 + first[0].token_ids + more
    before = _by_source(engine_kvs_b)
    saved_before = engine_kvs_b.stats()["kvs"]["saved_blocks"]
    want = engine_kvs_a.generate([turn2], MAX_TOKENS, salt="no-hit-on-a")  # a, from scratch
    got = _compute_and_save(engine_kvs_b, [turn2])
    assert _tokens(got) == _tokens(want)
    after = _by_source(engine_kvs_b)
    loaded = (len(turn1) + MAX_TOKENS - 1) // BLOCK * BLOCK  # turn 1's full blocks (a's saves)
    assert _delta(after, before, "external_kv_transfer") == loaded
    full = (len(turn2) + MAX_TOKENS - 1) // BLOCK
    assert engine_kvs_b.stats()["kvs"]["saved_blocks"] - saved_before == full - loaded // BLOCK
    kvs_clean(engine_kvs_a, engine_kvs_b)


def test_mla_blocks_load_back_after_the_instance_forgot_them(
    engine_kvs_mla: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    engine = engine_kvs_mla
    block = engine.block_size
    batch = prompts(2504, (290, 140))
    expected = _compute_and_save(engine, batch)
    assert engine.call(reset_prefix_cache)
    before = _by_source(engine)
    got = engine.generate(batch, MAX_TOKENS)
    assert _tokens(got) == _tokens(expected)
    stored = sum(_stored_blocks(p, block) for p in batch)
    assert _delta(_by_source(engine), before, "external_kv_transfer") == stored * block
    kvs_clean(engine)


def test_gdn_attention_and_state_load_back_as_vllm_own_prefix_hit_would(
    engine_kvs_gdn: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    """A hybrid prefix: vLLM computes a prompt's first 2 blocks in one block-aligned step and
    keeps the state after them (mamba_cache_mode "align"). The prompt extended then hits that
    prefix in vLLM's own cache; after the cache forgot it, it loads the attention blocks and
    the state from the store instead, and answers exactly as that local hit did (same
    logprobs: the same computation on the same bytes) and as recomputing it does."""
    engine = engine_kvs_gdn
    block = engine.block_size
    # vLLM's hybrid KV-cache manager is on: attention and state are groups of their own.
    layout = engine.call(kv_cache_layout)
    assert layout["hybrid_manager"]
    assert layout["mamba_cache_mode"] == "align"
    assert "MambaSpec" in layout["groups"]
    assert "FullAttentionSpec" in layout["groups"]
    (turn1,) = prompts(2520, (2 * block + 88,))
    (more,) = prompts(2521, (100,))
    first = _compute_and_save(engine, [turn1])
    turn2 = turn1 + first[0].token_ids + more
    before = _by_source(engine)
    local = engine.generate([turn2], MAX_TOKENS)  # vLLM's own hit of turn 1's first 2 blocks
    after = _by_source(engine)
    # turn 1's states: after its first step (2 blocks) and at its end (not a boundary).
    assert _delta(after, before, "local_cache_hit") == 2 * block
    assert _delta(after, before, "external_kv_transfer") == 0
    want = engine.generate([turn2], MAX_TOKENS, salt="recompute")  # neither cache nor store
    assert engine.call(reset_prefix_cache)
    # The freed blocks keep their bytes, and vLLM may hand the same ones out again: noise in
    # them, so only what the load writes can give the same answer.
    assert engine.call(scrub_free_blocks) > 0
    before, counters, kvs = _by_source(engine), engine.counters(), engine.stats()["kvs"]
    got = engine.generate([turn2], MAX_TOKENS)
    after = _by_source(engine)
    assert _delta(engine.counters(), counters, "kvs_loads") == 1
    assert _delta(engine.stats()["kvs"], kvs, "hit_blocks") == 2
    assert _delta(after, before, "external_kv_transfer") == 2 * block
    assert _delta(after, before, "local_compute") == len(turn2) - 2 * block
    assert _tokens(got) == _tokens(want)
    assert got[0].token_ids == local[0].token_ids
    assert got[0].logprobs == local[0].logprobs
    kvs_clean(engine)


@pytest.mark.starts_vllm
def test_a_hybrid_model_whose_states_vllm_does_not_keep_is_refused_at_start(
    models_dir: Path, kvs_store: Any
) -> None:
    """GDN with prefix caching off: vLLM keeps only each request's running state
    (mamba_cache_mode "none"), never one at a block boundary, so the attention blocks could be
    stored but not the state that goes with them. The engine does not start, and says why."""
    spec = dataclasses.replace(
        engine_spec("engine_kvs_gdn", models_dir),
        name="engine_kvs_gdn_no_prefix_caching",
        prefix_caching=False,
    )
    keys = kvs_store.stats().keys
    error = start_failure(spec)
    count_vllm_start(spec.name)
    assert "kvs: this model's KV cache cannot be stored" in error
    assert "mamba_cache_mode 'none'" in error
    assert "enable_prefix_caching" in error
    assert kvs_store.stats().keys == keys  # nothing stored, in part or whole


# ------------------------------------------------------------------ PD with the store
def _prefill_and_save(p: OfflineEngine, batch: list[list[int]]) -> list[dict[str, Any]]:
    """P prefills ``batch`` for a D (no salt: D's keys are the same); the params for D, once
    P's saves are in the store."""
    reports = _counter(p, "kvs_save_reports")
    saves_before = p.stats()["kvs"]["saves"]
    outs = p.generate(batch, 1, [prefill_params() for _ in batch])
    _wait_saved(p, reports, p.stats()["kvs"]["saves"] - saves_before)
    return [o.kv_transfer_params for o in outs]


def test_d_loads_what_p_saved_and_p_releases_without_a_pull(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    p, d = engine_kvs_a, engine_kvs_b
    batch = prompts(2513, LENGTHS)
    expected = d.generate(batch, MAX_TOKENS, salt=salt())  # d from scratch
    params = _prefill_and_save(p, batch)
    p_before, d_before, sources = p.counters(), d.counters(), _by_source(d)
    got = d.generate(batch, MAX_TOKENS, params)
    assert _tokens(got) == _tokens(expected)
    stored = sum(_stored_blocks(prompt) for prompt in batch)
    after = _by_source(d)
    assert _delta(after, sources, "external_kv_transfer") == stored * BLOCK
    assert _delta(after, sources, "local_compute") == sum(map(len, batch)) - stored * BLOCK
    kvs_clean(p, d)
    p_after, d_after = p.counters(), d.counters()
    assert _delta(d_after, d_before, "pulls_started") == 0
    assert _delta(p_after, p_before, "sends_done") == 0
    assert _delta(p_after, p_before, "leases_expired") == 0  # released at once, not by lease


def test_d_pulls_from_p_only_the_blocks_the_store_lacks(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    p, d = engine_kvs_a, engine_kvs_b
    batch = prompts(2514, LENGTHS)
    expected = d.generate(batch, MAX_TOKENS, salt=salt())
    params = _prefill_and_save(p, batch)
    kept = 2  # the store keeps each prompt's first two blocks
    for prompt in batch:
        faults.evict_keys(kvs_store, p.call(prompt_keys, prompt)[kept:])
    p_before, d_before, sources = p.counters(), d.counters(), _by_source(d)
    got = d.generate(batch, MAX_TOKENS, params)
    assert _tokens(got) == _tokens(expected)
    after = _by_source(d)
    assert _delta(after, sources, "external_kv_transfer") == sum(map(len, batch))
    kvs_clean(p, d)
    wait_for_sends(p, p_before, len(batch))
    d_after = d.counters()
    assert _delta(d_after, d_before, "pulls_done") == len(batch)
    assert _delta(d_after, d_before, "kvs_loads") == len(batch)
    pulled = sum(copied_tokens(len(prompt), BLOCK, BLOCK, kept) for prompt in batch)
    assert _delta(d_after, d_before, "bytes_received") == pulled * KV_BYTES_PER_TOKEN["qwen2"]


def test_d_loads_from_the_store_when_p_is_gone(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    """P computed the prompt and saved it, then died: D's pull names a P nobody answers for,
    and D loads from the store instead of recomputing."""
    batch = prompts(2515, LENGTHS)
    expected = _compute_and_save(engine_kvs_a, batch)
    d = engine_kvs_b
    sources = _by_source(d)
    got = d.generate(batch, MAX_TOKENS, [pull_params(dead_address()) for _ in batch])
    assert _tokens(got) == _tokens(expected)
    stored = sum(_stored_blocks(prompt) for prompt in batch)
    assert _delta(_by_source(d), sources, "external_kv_transfer") == stored * BLOCK
    kvs_clean(engine_kvs_a, d)


def test_gdn_d_loads_stored_attention_and_pulls_the_rest_and_the_state_from_p(
    engine_kvs_gdn: OfflineEngine, engine_gdn: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    """A hybrid D (GDN) with the store: the store has the prompt's attention blocks (D itself
    computed the prompt once, then its own cache forgot it); P (``engine_gdn``, no store)
    prefills it. D loads the attention from the store and pulls from P only the last block and
    P's state after the prompt (a stored state is never used for a pull): the answer is the
    one D computes from scratch."""
    d, p = engine_kvs_gdn, engine_gdn
    block = d.block_size
    (prompt,) = prompts(2522, (2 * block + 88,))  # 2 full blocks, then 88 tokens
    expected = d.generate([prompt], MAX_TOKENS, salt=salt())  # neither cache nor store
    _compute_and_save(d, [prompt])
    (params,) = [o.kv_transfer_params for o in p.generate([prompt], 1, [prefill_params()])]
    assert d.call(reset_prefix_cache)
    assert d.call(scrub_free_blocks) > 0
    p_before, d_before, sources, kvs = p.counters(), d.counters(), _by_source(d), d.stats()["kvs"]
    got = d.generate([prompt], MAX_TOKENS, [params])
    assert _tokens(got) == _tokens(expected)
    d_after = d.counters()
    assert _delta(d_after, d_before, "kvs_loads") == 1
    assert _delta(d.stats()["kvs"], kvs, "hit_blocks") == 2
    assert _delta(d_after, d_before, "pulls_done") == 1
    # Every prompt token but the last came from outside (store or P); D computed one.
    after = _by_source(d)
    assert _delta(after, sources, "external_kv_transfer") == len(prompt) - 1
    assert _delta(after, sources, "local_compute") == 1
    wait_for_sends(p, p_before, 1)
    assert_idle(p)
    kvs_clean(d)


def test_a_gdn_d_whose_p_is_gone_recomputes_the_same_answer(
    engine_kvs_gdn: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    """The store has the prompt's attention, and its P is gone: the pull fails (the state after
    the prompt was only P's) and D recomputes what it could not pull, token for token."""
    d = engine_kvs_gdn
    (prompt,) = prompts(2523, (2 * d.block_size + 88,))
    expected = d.generate([prompt], MAX_TOKENS, salt=salt())
    _compute_and_save(d, [prompt])
    assert d.call(reset_prefix_cache)
    got = d.generate([prompt], MAX_TOKENS, [pull_params(dead_address())])
    assert _tokens(got) == _tokens(expected)
    kvs_clean(d)


# ------------------------------------------------------------------ faults: recompute, same tokens
def _recomputes(
    engine: OfflineEngine, batch: list[list[int]], expected: list[Any], failed_loads: int = 0
) -> None:
    """``batch`` on ``engine`` answers ``expected``, every prompt token computed: a miss each,
    or ``failed_loads`` loads refused (in step: vLLM counted their tokens as loaded when it
    admitted the requests, then recomputed them from the first refused block; nothing had
    reached those blocks, so only the recompute gives the expected answer)."""
    before, failed = _by_source(engine), _counter(engine, "kvs_loads_failed")
    got = engine.generate(batch, MAX_TOKENS)
    assert _tokens(got) == _tokens(expected)
    after = _by_source(engine)
    assert _counter(engine, "kvs_loads_failed") - failed == failed_loads
    if not failed_loads:
        assert _delta(after, before, "external_kv_transfer") == 0
        assert _delta(after, before, "local_compute") == sum(len(p) for p in batch)


def test_a_store_that_fails_lookups_and_saves_costs_only_the_hits(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    batch = prompts(2505, LENGTHS)
    faults.inject(kvs_store, "lookup:fail;put_keyed:fail")
    try:
        failures = _counter(engine_kvs_a, "kvs_save_reports")
        expected = engine_kvs_a.generate(batch, MAX_TOKENS)  # saves fail, reported anyway
        wait_for(
            "a's failed saves reported",
            lambda: _counter(engine_kvs_a, "kvs_save_reports") > failures,
        )
        _recomputes(engine_kvs_b, batch, expected)  # lookups fail: misses
    finally:
        faults.clear(kvs_store)
    assert engine_kvs_b.stats()["kvs"]["lookup_misses"] >= len(batch)
    kvs_clean(engine_kvs_a, engine_kvs_b)


def _generate_fresh(engine: OfflineEngine, batch: list[list[int]]) -> tuple[list[Any], int]:
    """``batch`` on ``engine`` with its own prefix cache emptied first: (outputs, tokens it
    loaded from the store). vLLM empties it only once no block is in use, and the engine's
    earlier saves reference theirs until its workers report them stored."""
    wait_for(
        f"{engine.name}: its saves reported",
        lambda: engine.stats()["kvs"]["pending_saves"] == 0,
        timeout=60,
    )
    assert engine.call(reset_prefix_cache)
    before = _by_source(engine)
    outs = engine.generate(batch, MAX_TOKENS)
    return outs, _delta(_by_source(engine), before, "external_kv_transfer")


def test_a_stalled_store_is_a_miss_and_no_step_waits_for_it(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    """The master answers lookups past ``lookup_timeout_s`` (2 s): the request is scheduled as
    a miss when its lookup times out, and meanwhile b's engine keeps stepping (vLLM is told
    "ask again"; a step that waited on the lookup would be one step in those seconds, not
    hundreds). Once the store answers again, b's lookups reach it and load."""
    batch = prompts(2530, (300,))
    expected = _compute_and_save(engine_kvs_a, batch)  # in the store: only the stall misses it
    steps, misses = _counter(engine_kvs_b, "steps"), engine_kvs_b.stats()["kvs"]["lookup_misses"]
    faults.inject(kvs_store, "lookup:delay=4")
    try:
        _recomputes(engine_kvs_b, batch, expected)
    finally:
        faults.clear(kvs_store)
    assert engine_kvs_b.stats()["kvs"]["lookup_misses"] - misses == 1
    assert _counter(engine_kvs_b, "steps") - steps >= 50
    stored = _stored_blocks(batch[0]) * BLOCK

    def loads_again() -> bool:
        got, loaded = _generate_fresh(engine_kvs_b, batch)
        assert _tokens(got) == _tokens(expected)
        return loaded == stored

    wait_for("b to load from the store again", loads_again)
    kvs_clean(engine_kvs_a, engine_kvs_b)


def test_an_object_evicted_between_lookup_and_load_is_recomputed(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    batch = prompts(2506, LENGTHS)
    expected = _compute_and_save(engine_kvs_a, batch)
    failed = _counter(engine_kvs_b, "kvs_loads_failed")
    engine_kvs_b.call(evict_before_each_load, kvs_store.name, True)
    try:
        got = engine_kvs_b.generate(batch, MAX_TOKENS)
    finally:
        engine_kvs_b.call(evict_before_each_load, kvs_store.name, False)
    assert _tokens(got) == _tokens(expected)
    assert _counter(engine_kvs_b, "kvs_loads_failed") - failed == len(batch), (
        engine_kvs_b.counters(),
        engine_kvs_b.stats()["kvs"],
    )
    kvs_clean(engine_kvs_a, engine_kvs_b)


@pytest.mark.parametrize("damage", ["corrupt", "short"])
def test_a_damaged_object_is_refused_and_recomputed(
    engine_kvs_a: OfflineEngine,
    engine_kvs_b: OfflineEngine,
    kvs_store: Any,
    damage: str,
    kvs_clean: Any,
) -> None:
    """b checks checksums: a flipped byte is caught; a checks headers: a short object is."""
    seed = {"corrupt": 2507, "short": 2508}[damage]
    loader, saver = (
        (engine_kvs_b, engine_kvs_a) if damage == "corrupt" else (engine_kvs_a, engine_kvs_b)
    )
    batch = prompts(seed, (200,))
    expected = _compute_and_save(saver, batch)
    keys = loader.call(prompt_keys, batch[0])
    (ref,) = kvs_store.lookup(keys[3:4], hold_s=0)
    if damage == "corrupt":
        view = kvs_store.get(ref, writable=True)
        view.reshape(-1).view(np.uint8)[100] ^= 0x40
    else:
        whole = np.array(kvs_store.get(ref)).reshape(-1).view(np.uint8)
        faults.evict_keys(kvs_store, keys[3:4])
        kvs_store.put_keyed([(keys[3], whole[:-64].copy())], ttl=None)
    _recomputes(loader, batch, expected, failed_loads=1)
    kvs_clean(engine_kvs_a, engine_kvs_b)


def test_a_full_store_saves_what_fits_and_the_rest_is_recomputed(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    batch = prompts(2509, LENGTHS)
    ballast = []
    # A client of its own: repeated puts stock reservations ahead, which its close gives back.
    filler = refstore.Client(KVS_STORE)
    try:
        chunk = 16 << 20
        while chunk >= 4096:  # leased: evicts every cache entry, and cannot be evicted itself
            try:
                ballast.append(filler.put(np.zeros(chunk, np.uint8), ttl=120))
            except PoolFull:
                chunk //= 2
        full_before = _counter(engine_kvs_a, "kvs_save_reports")
        expected = engine_kvs_a.generate(batch, MAX_TOKENS)
        wait_for(
            "a's saves reported", lambda: _counter(engine_kvs_a, "kvs_save_reports") > full_before
        )
        before = _by_source(engine_kvs_b)
        got = engine_kvs_b.generate(batch, MAX_TOKENS)
        assert _tokens(got) == _tokens(expected)
        after = _by_source(engine_kvs_b)
        total = sum(len(p) for p in batch)
        loaded = _delta(after, before, "external_kv_transfer")
        assert _delta(after, before, "local_compute") == total - loaded
        assert loaded < sum(_stored_blocks(p) for p in batch) * BLOCK  # not everything fit
    finally:
        filler.release(ballast)
        filler.close()
    kvs_clean(engine_kvs_a, engine_kvs_b)


# ------------------------------------------------------------------ restart
@pytest.mark.destroys("engine_kvs_b")
def test_a_restarted_instance_loads_what_both_stored_before(
    engine_pool: Any,
    engine_kvs_a: OfflineEngine,
    engine_kvs_b: OfflineEngine,
    kvs_store: Any,
    kvs_clean: Any,
) -> None:
    from_a, from_b = prompts(2510, (260,)), prompts(2511, (230,))
    want_a = _compute_and_save(engine_kvs_a, from_a)
    want_b = _compute_and_save(engine_kvs_b, from_b)
    engine_kvs_b.close()
    restarted = engine_pool.start("engine_kvs_b")
    restarted.wait_ready(900)
    before = _by_source(restarted)
    got = restarted.generate(from_a + from_b, MAX_TOKENS)
    assert _tokens(got) == _tokens(want_a) + _tokens(want_b)
    stored = _stored_blocks(from_a[0]) + _stored_blocks(from_b[0])
    assert _delta(_by_source(restarted), before, "external_kv_transfer") == stored * BLOCK
    kvs_clean(engine_kvs_a, restarted)


def _without_addresses(threads: list[str]) -> list[str]:
    """Thread names without the peer address some carry ("simple-rpc-client HOST:PORT")."""
    return sorted(name.split(" ", 1)[0] for name in threads)


@pytest.mark.destroys("kvs_store")
def test_a_store_killed_and_restarted_is_missed_then_used_again(
    engine_pool: Any, engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any
) -> None:
    """The master dies (SIGKILL: every stored block is lost) and a new one starts under its
    name. What the old one held is a miss, recomputed token for token; then every client
    re-attaches to the new one (MasterRestarted: b's lookups, a's saves, b's in-step loads,
    whose first load after the restart recomputes) and b loads what a saves there again.
    Nothing leaks: no hold, no connection to the dead master, no connection added per request,
    no thread."""
    # The pool's current engines: a test that destroys engine_kvs_b may have restarted it.
    a, b = (engine_pool.get(name) for name in ("engine_kvs_a", "engine_kvs_b"))
    lost = prompts(2531, LENGTHS)
    expected = _compute_and_save(a, lost)
    before = {e.name: e.stats() for e in (a, b)}
    dead_master = kvs_store.address
    engine_pool.restart_store()
    got, loaded = _generate_fresh(b, lost)
    assert _tokens(got) == _tokens(expected)
    assert loaded == 0
    rounds = iter(range(2532, 2600))

    def loads_again() -> bool:
        batch = prompts(next(rounds), LENGTHS)
        want = _compute_and_save(a, batch)
        got, loaded = _generate_fresh(b, batch)
        assert _tokens(got) == _tokens(want)
        return loaded == sum(_stored_blocks(p) for p in batch) * BLOCK

    wait_for("b to load what a saved in the new store", loads_again, timeout=120)
    # A lookup re-subscribes to key events once it finds the old feed ended (an engine that
    # looks nothing up, as the other KVS engines here, stays unsubscribed until it does): once
    # more, so that a's and b's feeds are surely back.
    assert loads_again()
    settled = kvs_store.stats()
    sockets = {e.name: e.stats()["worker_socket_fds"] for e in (a, b)}
    for _ in range(2):  # every client is attached now: none is added
        assert loads_again()
    assert_idle(a, b)
    now = kvs_store.stats()
    assert (now.held, now.leased, now.reserved) == (0, 0, 0)
    assert (now.clients, now.subscribers) == (settled.clients, settled.subscribers)
    for engine in (a, b):
        after = engine.stats()
        # The same threads; the clients' carry the new master's address in their names.
        assert _without_addresses(after["threads"]) == _without_addresses(
            before[engine.name]["threads"]
        )
        if kvs_store.address != dead_master:  # (the new master may take the same port)
            for fds in after["worker_socket_fds"]:
                assert not [c for c in describe_sockets(fds) if c.endswith(f" {dead_master}")]
        then = sockets[engine.name]
        last = then

        def none_added(engine: OfflineEngine = engine, then: list[list[str]] = then) -> bool:
            nonlocal last
            last = engine.stats()["worker_socket_fds"]
            return all(len(n) <= len(t) for n, t in zip(last, then, strict=True))

        try:  # a socket a request closes may close a moment after its answer
            wait_for(f"{engine.name} to hold no socket more than when settled", none_added)
        except AssertionError as exc:
            described = [
                (describe_sockets(t), describe_sockets(n)) for t, n in zip(then, last, strict=True)
            ]
            raise AssertionError(f"{exc}; per worker, then and now: {described}") from None
