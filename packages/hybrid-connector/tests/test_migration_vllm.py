"""Live migration through real vLLM (CPU, offline LLM): a decoding request stopped on D1 with
its KV held, continued on D2, which pulls that KV and computes only the last token.

The session's ``kv_both`` engine plays P, D1 and D2 (each request its own prefix-cache salt, so
D2 pulls instead of hitting D1's blocks): P prefills, D1 pulls P's KV and decodes, MIGRATE_OUT
stops D1's request after the next token, D2 takes prompt + D1's tokens and pulls them from
D1. The tokens of D1 then D2 must equal a single instance's, and nothing stays held.

Pre-copy: PRECOPY offers D1's full blocks while it decodes on; D2's one-token warm-up (D2's salt)
pulls them into D2's prefix cache, so D2's request after the stop hits them and pulls only the
rest. A warm-up that never comes (D2 died) is released and D1 finishes as if never asked.
"""

from __future__ import annotations

import uuid

import pytest
from harness.checks import (
    assert_idle,
    assert_same_greedy,
    delta,
    prefill,
    prefill_params,
    prompts,
    pull_params,
    salt,
    wait_for,
    wait_for_sends,
)
from harness.migration import decoded, precopy_offered, pull_of, release, stop
from harness.offline import Gen, OfflineEngine, Req
from hybrid_connector.migration import MIGRATION_ID_PREFIX

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 400  # long enough that the migration lands mid-decode on a loaded box
DECODED_FIRST = 50  # D1's tokens before the migration: more than a block of them


def test_a_migrated_request_decodes_on_as_if_never_moved(engine_qwen2: OfflineEngine) -> None:
    engine = engine_qwen2
    bs = engine.block_size
    [prompt] = prompts(seed=4242, lengths=(2 * bs + 13,))
    [expected] = engine.generate([prompt], MAX_TOKENS, salt=salt())
    before = engine.stats()

    tid, mid = f"t-{uuid.uuid4().hex}", f"{MIGRATION_ID_PREFIX}{uuid.uuid4().hex}"
    d1_request = Req(prompt, MAX_TOKENS, pull_params(engine.rpc_address, tid), salt())
    on_d1 = engine.submit([Req(prompt, 1, prefill_params(tid), salt()), d1_request])
    wait_for(
        "D1 to decode",
        lambda: engine.call(decoded, d1_request.request_id) >= DECODED_FIRST,
    )
    answer = stop(engine, tid, mid)
    _, d1 = on_d1.result()
    assert answer.stopped, answer.reason
    n = len(answer.output_token_ids)
    assert DECODED_FIRST <= n < MAX_TOKENS
    assert d1.token_ids == answer.output_token_ids, "D1 streamed every token it answered with"
    assert answer.prompt_token_ids == prompt
    length = len(prompt) + n
    assert answer.num_tokens == length - 1, "KV for all but D1's last token"

    d2_params = pull_of(mid, answer.remote_rpc_address, answer.remote_tp_size, answer.num_tokens)
    [d2] = engine.generate([prompt + d1.token_ids], MAX_TOKENS - n, [d2_params], salt=salt())
    assert d1.token_ids + d2.token_ids == expected.token_ids, "token for token"
    wait_for_sends(engine, before["counters"], 2)  # P -> D1, D1 -> D2
    after = engine.stats()
    # D2 pulled every token D1 had KV for and computed one; D1 pulled P's whole prompt.
    pulled = delta(after["by_source"], before["by_source"], "external_kv_transfer")
    assert pulled == len(prompt) + (length - 1), after["by_source"]
    computed = delta(after["by_source"], before["by_source"], "local_compute")
    assert computed == len(prompt) + 1, "P's prompt and D2's one token, nothing recomputed"
    assert delta(after["counters"], before["counters"], "pulls_started") == 2
    assert_idle(engine)


def test_a_precopied_migration_pulls_only_the_last_blocks_at_thestop(
    engine_qwen2: OfflineEngine,
) -> None:
    engine = engine_qwen2
    bs = engine.block_size
    [prompt] = prompts(seed=4343, lengths=(3 * bs + 5,))
    [expected] = engine.generate([prompt], MAX_TOKENS, salt=salt())
    tid = f"t-{uuid.uuid4().hex}"
    cid = f"{MIGRATION_ID_PREFIX}pre-{uuid.uuid4().hex}"
    mid = f"{MIGRATION_ID_PREFIX}{uuid.uuid4().hex}"
    d1_request = Req(prompt, MAX_TOKENS, pull_params(engine.rpc_address, tid), salt())
    on_d1 = engine.submit([Req(prompt, 1, prefill_params(tid), salt()), d1_request])
    wait_for(
        "D1 to decode",
        lambda: engine.call(decoded, d1_request.request_id) >= DECODED_FIRST,
    )
    offered = precopy_offered(engine, tid, cid)
    assert offered.offered, offered.reason
    n_pre = len(offered.token_ids)
    assert n_pre % bs == 0
    assert n_pre >= len(prompt) + DECODED_FIRST - bs - 1
    assert offered.token_ids[: len(prompt)] == prompt

    assert len(offered.next_token_ids) == 1
    d2_salt = salt()
    before = engine.stats()
    # The warm-up's prompt ends with the token after the blocks: it pulls every offered token
    # and computes that next one, so the blocks it caches hold D1's KV alone.
    [warm] = engine.generate(
        [offered.token_ids + offered.next_token_ids],
        1,
        [pull_of(cid, offered.remote_rpc_address, offered.remote_tp_size, n_pre)],
        salt=d2_salt,
    )
    assert len(warm.token_ids) == 1
    wait_for_sends(engine, before["counters"], 1)  # D1 -> D2's warm-up; C given back
    warmed = engine.stats()
    assert delta(warmed["by_source"], before["by_source"], "external_kv_transfer") == n_pre
    assert delta(warmed["by_source"], before["by_source"], "local_compute") == 1

    answer = stop(engine, tid, mid)
    _, d1 = on_d1.result()
    assert answer.stopped, answer.reason
    n = len(answer.output_token_ids)
    assert d1.token_ids == answer.output_token_ids
    length = len(prompt) + n
    tokens = prompt + d1.token_ids
    assert tokens[:n_pre] == offered.token_ids, "the pre-copied tokens are the request's"
    assert tokens[n_pre] == offered.next_token_ids[0]
    [d2] = engine.generate(
        [tokens],
        MAX_TOKENS - n,
        [pull_of(mid, answer.remote_rpc_address, answer.remote_tp_size, answer.num_tokens)],
        salt=d2_salt,
    )
    assert d1.token_ids + d2.token_ids == expected.token_ids, "token for token"
    wait_for_sends(engine, warmed["counters"], 1)  # D1 -> D2: the last blocks only
    after = engine.stats()
    hit = delta(after["by_source"], warmed["by_source"], "local_cache_hit")
    pulled = delta(after["by_source"], warmed["by_source"], "external_kv_transfer")
    assert hit == n_pre, "D2 hit every pre-copied block in its own prefix cache"
    assert pulled == length - 1 - n_pre, "and pulled only the blocks after them"
    assert_idle(engine)


def test_a_precopy_nobody_pulls_is_released_and_d1_finishes_unchanged(
    engine_qwen2: OfflineEngine,
) -> None:
    """D2 died before its warm-up: the proxy releases C; D1 decodes to its end, token for
    token, and nothing stays held."""
    engine = engine_qwen2
    bs = engine.block_size
    [prompt] = prompts(seed=4444, lengths=(2 * bs + 7,))
    [expected] = engine.generate([prompt], MAX_TOKENS, salt=salt())
    tid = f"t-{uuid.uuid4().hex}"
    cid = f"{MIGRATION_ID_PREFIX}pre-{uuid.uuid4().hex}"
    d1_request = Req(prompt, MAX_TOKENS, pull_params(engine.rpc_address, tid), salt())
    on_d1 = engine.submit([Req(prompt, 1, prefill_params(tid), salt()), d1_request])
    wait_for(
        "D1 to decode",
        lambda: engine.call(decoded, d1_request.request_id) >= DECODED_FIRST,
    )
    offered = precopy_offered(engine, tid, cid)
    assert offered.offered, offered.reason
    release(engine, cid)
    _, d1 = on_d1.result()
    assert d1.token_ids == expected.token_ids, "D1 finished as if never asked"
    assert_idle(engine)


# ------------------------------------------------------------------ every family PD supports


FAMILY_MAX_TOKENS = 160


@pytest.fixture(params=["mla", "gdn"])
def family_engine(request: pytest.FixtureRequest) -> OfflineEngine:
    return request.getfixturevalue(f"engine_{request.param}")


@pytest.mark.engines("engine_mla", "engine_gdn")
def test_a_migrated_request_of_each_family_decodes_on(family_engine: OfflineEngine) -> None:
    """MLA (one latent per token) and Gated DeltaNet (attention layers and a recurrent state):
    D2 continues from D1's KV, and for GDN from D1's state after all but the last token (its
    running state's slot, which D1's last step wrote), and computes that one. Compared as the
    PD tests compare these families (``test_pd_models.py``): equal up to a near-tie."""
    engine = family_engine
    has_state = engine.ready_info["has_state"]
    [prompt] = prompts(seed=4545, lengths=(min(2 * engine.block_size + 13, 300),))
    [expected] = engine.submit([Req(prompt, FAMILY_MAX_TOKENS, cache_salt=salt())]).result()
    before = engine.stats()

    # P answers first and D1 pulls with its parameters, as test_pd_models.py does.
    [params] = prefill(engine, [prompt])
    tid, mid = params["transfer_id"], f"{MIGRATION_ID_PREFIX}{uuid.uuid4().hex}"
    d1_request = Req(prompt, FAMILY_MAX_TOKENS, params, salt())
    on_d1 = engine.submit([d1_request])
    wait_for(
        "D1 to decode",
        lambda: engine.call(decoded, d1_request.request_id) >= DECODED_FIRST,
    )
    answer = stop(engine, tid, mid)
    [d1] = on_d1.result()
    assert answer.stopped, answer.reason
    n = len(answer.output_token_ids)
    assert d1.token_ids == answer.output_token_ids
    length = len(prompt) + n
    assert answer.num_tokens == length - 1, "KV (and the state) for all but D1's last token"
    d2_params = pull_of(mid, answer.remote_rpc_address, answer.remote_tp_size, answer.num_tokens)
    d2_request = Req(prompt + d1.token_ids, FAMILY_MAX_TOKENS - n, d2_params, salt())
    [d2] = engine.submit([d2_request]).result()
    migrated = Gen(d2.request_id, d1.token_ids + d2.token_ids, d1.logprobs + d2.logprobs, None)
    assert_same_greedy([migrated], [expected], near_tie=True)
    wait_for_sends(engine, before["counters"], 2)  # P -> D1, D1 -> D2
    after = engine.stats()
    pulled = delta(after["by_source"], before["by_source"], "external_kv_transfer")
    moved_prompt = len(prompt) - 1 if has_state else len(prompt)
    assert pulled == moved_prompt + (length - 1), after["by_source"]
    # P's prompt (all but its last token with a state: D1 computed that one), D2's one token.
    computed = delta(after["by_source"], before["by_source"], "local_compute")
    assert computed == len(prompt) + 1, after["by_source"]
    assert_idle(engine)


@pytest.mark.engines("engine_mla", "engine_gdn")
def test_precopy_on_each_family_is_offered_or_refused_with_its_reason(
    family_engine: OfflineEngine,
) -> None:
    """GDN: refused, a state changes with every token (a pre-copied state would be stale by
    the stop), so its migration is a plain stop-and-copy. MLA: offered where D2 can keep the
    blocks in its prefix cache; refused, saying so, where vLLM turned prefix caching off."""
    engine = family_engine
    [prompt] = prompts(seed=4646, lengths=(min(2 * engine.block_size + 7, 300),))
    tid = f"t-{uuid.uuid4().hex}"
    cid = f"{MIGRATION_ID_PREFIX}pre-{uuid.uuid4().hex}"
    d1_request = Req(prompt, FAMILY_MAX_TOKENS, pull_params(engine.rpc_address, tid), salt())
    on_d1 = engine.submit([Req(prompt, 1, prefill_params(tid), salt()), d1_request])
    wait_for(
        "D1 to decode",
        lambda: engine.call(decoded, d1_request.request_id) >= DECODED_FIRST,
    )
    offered = precopy_offered(engine, tid, cid)
    if engine.ready_info["has_state"]:
        assert not offered.offered
        assert "state" in offered.reason, offered.reason
    elif not engine.ready_info["prefix_caching"]:
        assert not offered.offered
        assert "prefix caching" in offered.reason, offered.reason
    else:
        assert offered.offered, offered.reason
        assert len(offered.token_ids) % engine.block_size == 0
        release(engine, cid)
    on_d1.result()
    assert_idle(engine)
