"""R3 through vLLM: the routing records of the tiny Qwen3-MoE (``engine_r3``: kv_both, block 32,
KVS on, records into the harness's refstore master).

A record is the routing the engine computed for each token of the request, wherever its KV came
from: one instance computing everything, D pulling the prompt's KV (and its rows) from P, a
prefix-cache hit, a KVS load after the instance forgot the prefix and its free blocks were filled
with noise. The records of the same greedy requests are byte for byte the same each way.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import numpy as np
import pytest
from harness.checks import (
    MAX_TOKENS,
    assert_idle,
    delta,
    prefill,
    prefill_params,
    prompts,
    pull_params,
    salt,
    wait_for,
)
from harness.kvs import reset_prefix_cache, scrub_free_blocks, start_failure
from harness.migration import decoded, precopy_offered, pull_of, stop
from harness.offline import Gen, OfflineEngine, Req
from harness.pool import KVS_STORE, count_vllm_start, engine_spec
from harness.ports import free_port
from harness.r3 import fill_free_routing_rows, ledger_size, skip_captures
from hybrid_connector.migration import MIGRATION_ID_PREFIX
from hybrid_connector.r3 import R3RecordError, read_record

pytestmark = pytest.mark.timeout(600)

BLOCK = 32
EXPERTS, LAYERS, TOP_K = 8, 2, 2  # the tiny Qwen3-MoE


def _records(outs: list[Gen], store: Any) -> list[np.ndarray]:
    records = []
    for out in outs:
        params = out.kv_transfer_params
        assert params is not None
        assert "r3" in params
        ref = params["r3"]
        assert ref["complete"] is True
        assert ref["store"] == KVS_STORE
        assert (ref["layers"], ref["top_k"], ref["dtype"]) == (LAYERS, TOP_K, "uint8")
        rows = read_record(params, store)
        assert rows.shape == (ref["tokens"], LAYERS, TOP_K)
        assert int(rows.max()) < EXPERTS
        # top-k picks distinct experts for every token and layer
        assert (rows[..., 0] != rows[..., 1]).all()
        records.append(rows)
    return records


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert a.tobytes() == b.tobytes()


def test_one_instance_and_pd_record_the_same_routing(
    engine_r3: OfflineEngine, kvs_store: Any
) -> None:
    engine = engine_r3
    batch = prompts(3101, (37, BLOCK, 2 * BLOCK + 45))
    want_out = engine.generate(batch, MAX_TOKENS, salt=salt())
    want = _records(want_out, kvs_store)
    for rows, prompt in zip(want, batch, strict=True):
        # the prompt, then every generated token but the last (never through the model)
        assert rows.shape[0] == len(prompt) + MAX_TOKENS - 1
    before = engine.counters()
    p_params = prefill(engine, batch)
    assert not any("r3" in p for p in p_params)  # the rows go with the KV; D records
    got_out = engine.generate(batch, MAX_TOKENS, p_params, salt=salt())
    assert [o.token_ids for o in got_out] == [o.token_ids for o in want_out]
    _assert_same(_records(got_out, kvs_store), want)
    after = engine.counters()
    assert delta(after, before, "pulls_done") == len(batch)
    assert delta(after, before, "pulls_failed") == 0
    assert delta(after, before, "r3_incomplete") == 0
    assert_idle(engine)


def test_a_prefix_cache_hit_records_what_computing_it_did(
    engine_r3: OfflineEngine, kvs_store: Any
) -> None:
    engine = engine_r3
    batch = prompts(3102, (3 * BLOCK + 5,))
    shared = salt()
    first = engine.generate(batch, MAX_TOKENS, salt=shared)
    before = dict(engine.stats()["by_source"])
    second = engine.generate(batch, MAX_TOKENS, salt=shared)
    after = dict(engine.stats()["by_source"])
    assert after.get("local_cache_hit", 0) - before.get("local_cache_hit", 0) == 3 * BLOCK
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    _assert_same(_records(second, kvs_store), _records(first, kvs_store))
    assert_idle(engine)


def test_a_kvs_hit_loads_the_rows_with_the_kv(engine_r3: OfflineEngine, kvs_store: Any) -> None:
    """The prefix is stored, vLLM's own cache forgets it, every free block (the routing layer
    too) is overwritten: the second request's rows can only have come from the store."""
    engine = engine_r3
    batch = prompts(3103, (4 * BLOCK + 9,))
    reports = engine.counters().get("kvs_save_reports", 0)
    first = engine.generate(batch, MAX_TOKENS)
    wait_for(
        "the prompt's KVS saves",
        lambda: engine.counters().get("kvs_save_reports", 0) > reports,
        timeout=60,
    )
    want = _records(first, kvs_store)
    assert engine.call(reset_prefix_cache)
    assert engine.call(scrub_free_blocks) > 0
    before = dict(engine.stats()["by_source"])
    second = engine.generate(batch, MAX_TOKENS)
    after = dict(engine.stats()["by_source"])
    loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    assert loaded == 4 * BLOCK
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    _assert_same(_records(second, kvs_store), want)
    assert_idle(engine)


MIGRATED_TOKENS = 300  # long enough that the moves land mid-decode on a loaded box
DECODED_FIRST = 50  # D1's tokens before the pre-copy: more than a block of them


def test_a_migrated_request_keeps_its_rows(engine_r3: OfflineEngine, kvs_store: Any) -> None:
    """P -> D1 -> D2 with a pre-copy while D1 decodes on, then the stop (all three the one
    kv_both engine, each its own prefix-cache salt): D2's record, from the first prompt token to
    the last generated one, is that of the same request never moved. D1's quiet decode steps
    keep their rows unwritten until a step moves blocks, so the pre-copy and the stop must
    write them before anything pulls."""
    engine = engine_r3
    [prompt] = prompts(3106, (3 * BLOCK + 5,))
    [unmoved] = engine.generate([prompt], MIGRATED_TOKENS, salt=salt())
    [want] = _records([unmoved], kvs_store)
    tid, cid = f"t-{uuid.uuid4().hex}", f"{MIGRATION_ID_PREFIX}pre-{uuid.uuid4().hex}"
    mid = f"{MIGRATION_ID_PREFIX}{uuid.uuid4().hex}"
    on_d1 = Req(prompt, MIGRATED_TOKENS, pull_params(engine.rpc_address, tid), salt())
    running = engine.submit([Req(prompt, 1, prefill_params(tid), salt()), on_d1])
    wait_for("D1 to decode", lambda: engine.call(decoded, on_d1.request_id) >= DECODED_FIRST)
    offered = precopy_offered(engine, tid, cid)
    assert offered.offered, offered.reason
    d2_salt = salt()
    n_pre = len(offered.token_ids)
    address, tp = offered.remote_rpc_address, offered.remote_tp_size
    warm_prompt = offered.token_ids + offered.next_token_ids
    engine.generate([warm_prompt], 1, [pull_of(cid, address, tp, n_pre)], salt=d2_salt)
    answer = stop(engine, tid, mid)
    _, d1 = running.result()
    assert answer.stopped, answer.reason
    n = len(answer.output_token_ids)
    [d2] = engine.generate(
        [prompt + d1.token_ids],
        MIGRATED_TOKENS - n,
        [pull_of(mid, answer.remote_rpc_address, answer.remote_tp_size, answer.num_tokens)],
        salt=d2_salt,
    )
    assert d1.token_ids + d2.token_ids == unmoved.token_ids
    [got] = _records([d2], kvs_store)
    assert got.shape == want.shape == (len(prompt) + MIGRATED_TOKENS - 1, LAYERS, TOP_K)
    assert got.tobytes() == want.tobytes()
    assert_idle(engine)


def _stored(params: dict[str, Any], store: Any) -> np.ndarray:
    """The stored rows of a record, as they are (``read_record`` would refuse incomplete ones)."""
    key = params["r3"]["key"].encode()
    refs = wait_for(f"record {key!r}", lambda: store.lookup([key], hold_s=5.0), timeout=30)
    try:
        return np.array(store.get(refs[0]))
    finally:
        store.unhold(refs)


def test_a_skipped_capture_is_flagged_never_filled_by_a_reused_blocks_rows(
    engine_r3: OfflineEngine, kvs_store: Any
) -> None:
    """MoE layer 1's router skips the capture hook, and every free block's routing rows look
    written (expert 0, as a previous request's would). Each record must say incomplete: in its
    params when a pass before the request's last one missed (the engine knew at the end), and in
    the stored object always (the request's new blocks were reset, so layer 1's rows are "no
    row", never the block's old ones); ``read_record`` refuses both."""
    engine = engine_r3
    batch = prompts(3105, (BLOCK + 5, 2 * BLOCK + 9))
    before = engine.counters()
    try:
        assert engine.call(skip_captures, [1]) == [1]
        assert engine.call(fill_free_routing_rows, 0) > 0
        decodes = engine.generate(batch, MAX_TOKENS, salt=salt())
        prefilled = engine.generate(batch, 1, salt=salt())  # the miss is in their last pass
    finally:
        assert engine.call(skip_captures, []) == []
    for outs, engine_knew in ((decodes, True), (prefilled, False)):
        for out in outs:
            params = out.kv_transfer_params
            assert params is not None
            assert params["r3"]["complete"] is not engine_knew
            rows = _stored(params, kvs_store)
            assert (rows[:, 1] == 0xFF).all()  # layer 1: no row, not expert 0
            assert (rows[:, 0] < EXPERTS).all()  # layer 0 captured
            match = "the engine said so" if engine_knew else "token rows missing"
            with pytest.raises(R3RecordError, match=match):
                read_record(params, kvs_store)
    after = engine.counters()
    assert delta(after, before, "r3_incomplete") == 2 * len(batch)
    assert delta(after, before, "r3_missed_steps") >= 2
    # every hook back: records complete again
    _records(engine.generate(batch, MAX_TOKENS, salt=salt()), kvs_store)
    assert_idle(engine)
    assert engine.call(ledger_size) == 0


@pytest.mark.starts_vllm
def test_r3_on_a_model_without_moe_routers_is_refused_at_start(
    models_dir: Any,
) -> None:
    base = engine_spec("engine_qwen2", models_dir)
    spec = dataclasses.replace(
        base, name="qwen2-r3", extra_config={**base.extra_config, "r3": True}
    )
    count_vllm_start("qwen2-r3")
    error = start_failure(spec)
    assert "r3" in error
    assert "no MoE routers" in error


@pytest.mark.engines("engine_r3")
def test_a_pull_from_another_block_layout_is_refused_and_d_records_its_own(
    engine_r3: OfflineEngine, kvs_store: Any, models_dir: Any
) -> None:
    """P at block 64, D at 32: the routing layer moves only byte for byte, so P refuses the
    pull, D recomputes the prompt and its record is its own computed routing."""
    base = engine_spec("engine_r3", models_dir)
    extra = {k: v for k, v in base.extra_config.items() if k != "kvs"}
    spec = dataclasses.replace(
        base, name="engine_r3_b64", block_size=64, extra_config={**extra, "rpc_port": free_port()}
    )
    p = OfflineEngine(spec)
    count_vllm_start(spec.name)
    try:
        p.wait_ready()
        batch = prompts(3104, (2 * 64 + 7,))
        want_out = engine_r3.generate(batch, MAX_TOKENS, salt=salt())
        want = _records(want_out, kvs_store)
        before = engine_r3.counters()
        got_out = engine_r3.generate(batch, MAX_TOKENS, prefill(p, batch), salt=salt())
        assert [o.token_ids for o in got_out] == [o.token_ids for o in want_out]
        _assert_same(_records(got_out, kvs_store), want)
        after = engine_r3.counters()
        assert delta(after, before, "pulls_failed") == 1
        assert delta(after, before, "pulls_done") == 0
        assert_idle(p, engine_r3)
    finally:
        p.close()
