"""D with KVS on, without vLLM: a request that pulls from P loads what the store holds and pulls
only the blocks after it; a store that holds every full block of the prompt spares the pull."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from hybrid_connector import kvs, kvs_keys
from hybrid_connector.config import HybridConfig, KvsConfig
from hybrid_connector.kvs import KvsScheduler
from hybrid_connector.scheduler_side import SchedulerSide
from hybrid_connector.worker_side import _Results
from test_kvs import GROUP, HYBRID, IDENTITY, NULL, Block, FakeLookups, FakeStore, Manager

BLOCK = GROUP.block_size


def _d_side(store: FakeStore, groups: Any = None) -> tuple[SchedulerSide, KvsScheduler]:
    groups = groups or [GROUP]
    planner = KvsScheduler(
        KvsConfig(),
        groups,
        block_size=BLOCK,
        tp_size=1,
        identity=IDENTITY,
        lookups=FakeLookups(store),  # type: ignore[arg-type]
    )
    side = SchedulerSide(
        HybridConfig(),
        is_producer=False,
        is_consumer=True,
        block_size=BLOCK,
        groups=groups,
        kvs=planner,
    )
    manager = Manager()
    side.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
    return side, planner


def _pull(tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id="d-1",
        kv_transfer_params={
            "do_remote_prefill": True,
            "transfer_id": "t-1",
            "remote_rpc_address": "127.0.0.1:8200",
        },
        prompt_token_ids=list(tokens),
        all_token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        num_computed_tokens=0,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
    )


def _store_blocks(store: FakeStore, planner: KvsScheduler, tokens: list[int], n: int) -> None:
    chains = kvs_keys.chain(planner.root, tokens, BLOCK)
    for key in kvs_keys.lookup_keys(chains[:n], [GROUP], 1)[0]:
        store.objects[key] = np.zeros(1, np.uint8)


def _blocks(*ids: int) -> Any:
    return SimpleNamespace(
        blocks=([SimpleNamespace(block_id=i, block_hash=None, is_null=False) for i in ids],)
    )


def test_d_loads_the_stored_blocks_and_pulls_only_the_rest() -> None:
    store = FakeStore()
    side, planner = _d_side(store)
    tokens = list(range(3, 17))  # 14 tokens: blocks 0-2 full, then 2 tokens
    _store_blocks(store, planner, tokens, 1)  # the store has block 0
    request = _pull(tokens)
    assert side.get_num_new_matched_tokens(request, 0) == (14, True)
    side.update_state_after_alloc(request, _blocks(30, 31, 32, 33), 14)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    [load] = meta.kvs_loads
    assert load.block_ids == [[30]]
    [recv] = meta.to_recv
    assert recv.first_block == [1]  # P sends from block 1: block 0 comes from the store
    assert recv.block_ids == [[31, 32, 33]]
    assert meta.to_release == []
    assert planner.counters["hit_blocks"] == 1


def test_a_store_with_every_full_block_spares_the_pull_and_releases_p() -> None:
    store = FakeStore()
    side, planner = _d_side(store)
    tokens = list(range(3, 17))
    _store_blocks(store, planner, tokens, 3)
    request = _pull(tokens)
    # The store's 12 tokens, not the prompt's 14: D computes the last two itself.
    assert side.get_num_new_matched_tokens(request, 0) == (12, True)
    side.update_state_after_alloc(request, _blocks(30, 31, 32, 33), 12)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    [load] = meta.kvs_loads
    assert load.block_ids == [[30, 31, 32]]
    assert meta.to_recv == []
    [release] = meta.to_release
    assert (release.transfer_id, release.remote_rpc_address) == ("t-1", "127.0.0.1:8200")
    assert "store" in release.reason


def test_a_hybrid_d_loads_stored_attention_and_pulls_the_rest_and_p_state() -> None:
    """A state group (GDN): the store holds attention for every full block and no state at
    all; D, pulling from P, still loads that attention (a tokens-only lookup) and pulls the
    last attention block and P's state after the prompt, never a stored state."""
    store = FakeStore()
    side, planner = _d_side(store, HYBRID)
    tokens = list(range(3, 17))  # 14 tokens: P computed 13 (D computes the last one)
    chains = kvs_keys.chain(planner.root, tokens, BLOCK)
    for j in range(3):
        store.objects[kvs_keys.object_key(chains[j], 1, 0)] = np.zeros(1, np.uint8)
    request = _pull(tokens)
    assert side.get_num_new_matched_tokens(request, 0) == (13, True)
    blocks = SimpleNamespace(
        blocks=([NULL, NULL, NULL, Block(41)], [Block(i) for i in (30, 31, 32, 33)])
    )
    side.update_state_after_alloc(request, blocks, 13)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    [load] = meta.kvs_loads
    assert load.block_ids == [[kvs.NO_BLOCK] * 3, [30, 31, 32]]
    [recv] = meta.to_recv
    assert recv.first_block == [0, 3]  # the state from P; attention from block 3
    assert recv.block_ids == [[41], [33]]
    assert recv.num_tokens == 13
    assert meta.to_release == []  # P's state is needed: P is never released early


def test_a_store_miss_pulls_everything() -> None:
    store = FakeStore()
    side, _ = _d_side(store)
    request = _pull(list(range(3, 17)))
    assert side.get_num_new_matched_tokens(request, 0) == (14, True)
    side.update_state_after_alloc(request, _blocks(30, 31, 32, 33), 14)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.kvs_loads == []
    [recv] = meta.to_recv
    assert (recv.first_block, recv.block_ids) == ([0], [[30, 31, 32, 33]])


def test_a_pull_waits_for_the_lookup_without_blocking() -> None:
    store = FakeStore()
    side, planner = _d_side(store)
    lookups: FakeLookups = planner._lookups  # type: ignore[assignment]
    lookups.slow = True
    request = _pull(list(range(3, 17)))
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    lookups.slow = False
    assert side.get_num_new_matched_tokens(request, 0) == (14, True)


def test_a_request_received_in_two_parts_is_reported_once_both_are_in() -> None:
    results = _Results()
    results.expect("r", 2)
    results.received("r", failed=False)
    assert results.drain().finished_recving == set()
    results.received("r", failed=False)
    out = results.drain()
    assert (out.finished_recving, out.failed_recving) == ({"r"}, set())
    # One part failing fails the request, whichever comes first.
    results.expect("s", 2)
    results.received("s", failed=True)
    assert results.drain().finished_recving == set()
    results.received("s", failed=False)
    out = results.drain()
    assert (out.finished_recving, out.failed_recving) == ({"s"}, {"s"})
