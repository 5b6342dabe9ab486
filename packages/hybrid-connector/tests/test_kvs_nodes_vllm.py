"""KVS across nodes through vLLM: what another node's store holds is loaded here, fetched by
this node's master from its peer; a peer that refuses or breaks off mid-transfer is a miss, and
the request is recomputed token for token.

The other node is a second refstore master in the test process (``MasterThread``) holding the
blocks a KVS engine stored (copied byte for byte from this node's store, which then forgets
them), and given to the KVS engines' master as its peer for the test's length.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from harness.checks import MAX_TOKENS, prompts, wait_for
from harness.kvs import prompt_keys, reset_prefix_cache
from harness.offline import OfflineEngine
from refstore import Client, MasterThread, faults

BLOCK = 32  # the qwen2 KVS engines' block size
LENGTHS = (300, 170, 97)


def _saves(engine: OfflineEngine) -> int:
    return engine.counters().get("kvs_save_reports", 0)


def _stored_tokens(batch: list[list[int]]) -> int:
    return sum((len(prompt) - 1) // BLOCK * BLOCK for prompt in batch)


@contextlib.contextmanager
def _other_node(
    store: Any,
    source: OfflineEngine,
    batch: list[list[int]],
    env: pytest.MonkeyPatch | None = None,
) -> Iterator[tuple[MasterThread, Client, list[Any]]]:
    """A second node's master holding ``batch``'s blocks (computed on ``source``, moved off this
    node's store), the KVS engines' master peering with it; yields the master, its client and the
    greedy outputs ``source`` gave. With ``env``, its kvt engine sends over TCP only (a cut
    then cuts: the same-host path would read the blocks whole)."""
    if env is not None:
        env.setenv("KVT_TRANSPORT", "tcp")
    before = _saves(source)
    saves_before = source.stats()["kvs"]["saves"]
    expected = source.generate(batch, MAX_TOKENS)
    saves = source.stats()["kvs"]["saves"] - saves_before
    wait_for("the saves to land", lambda: _saves(source) >= before + saves, timeout=60)
    keys = [key for prompt in batch for key in source.call(prompt_keys, prompt)]
    with (
        MasterThread(f"kvs-node-{uuid.uuid4().hex[:6]}", "64M", remote="kvt") as node,
        Client(node.master.name, timeout=20.0) as other,
    ):
        refs = store.lookup(keys, hold_s=30.0)
        assert len(refs) == len(keys)
        blocks = [store.get(ref) for ref in refs]
        copied = other.put_keyed(list(zip(keys, blocks, strict=True)))
        assert all(ref is not None for ref in copied)
        store.unhold(refs)
        faults.evict_keys(store, keys)
        assert store.lookup(keys[:1], hold_s=0) == []
        store.peers(add=[node.address])
        try:
            yield node, other, expected
        finally:
            store.peers(remove=[node.address])
            faults.evict_keys(store, keys)  # the copies: later tests start from nothing


def _generate_fresh(engine: OfflineEngine, batch: list[list[int]]) -> tuple[list[Any], int]:
    """``batch`` on ``engine`` with its own prefix cache empty: (outputs, tokens loaded)."""
    assert engine.call(reset_prefix_cache)
    before = engine.stats()["by_source"].get("external_kv_transfer", 0)
    outs = engine.generate(batch, MAX_TOKENS)
    return outs, engine.stats()["by_source"].get("external_kv_transfer", 0) - before


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_a_prefix_stored_on_another_node_is_fetched_and_loaded(
    engine_kvs_a: OfflineEngine, engine_kvs_b: OfflineEngine, kvs_store: Any, kvs_clean: Any
) -> None:
    batch = prompts(2601, LENGTHS)
    with _other_node(kvs_store, engine_kvs_a, batch) as (_node, other, expected):
        fetched = kvs_store.stats().peer_keys
        got, loaded = _generate_fresh(engine_kvs_b, batch)
        assert _tokens(got) == _tokens(expected)
        assert loaded == _stored_tokens(batch)
        assert kvs_store.stats().peer_keys - fetched == sum((n - 1) // BLOCK for n in LENGTHS)
        assert other.stats().peer_served > 0
    kvs_clean(engine_kvs_a, engine_kvs_b)


SEEDS = {"refuses": 2602, "is gone": 2603, "is cut mid-transfer": 2604}


@pytest.mark.parametrize("fault", list(SEEDS))
def test_a_peer_that_refuses_is_gone_or_is_cut_off_is_a_miss_and_recomputed(
    engine_kvs_a: OfflineEngine,
    engine_kvs_b: OfflineEngine,
    kvs_store: Any,
    fault: str,
    kvs_clean: Any,
) -> None:
    """The peer refuses the lookup, is gone, or dies in the middle of sending the blocks (its
    kvt link dropped after half a frame: over TCP; the same-host path would read them whole).
    None of it reaches this node's store; the request recomputes, token for token."""
    batch = prompts(SEEDS[fault], LENGTHS)
    with (
        pytest.MonkeyPatch.context() as env,
        _other_node(kvs_store, engine_kvs_a, batch, env) as (node, other, expected),
    ):
        if fault == "refuses":
            faults.inject(other, "peer_lookup:fail")
        elif fault == "is cut mid-transfer":
            faults.inject(other, "send_to:cut")
        else:
            node.close()  # its address refuses from now on
        misses = engine_kvs_b.stats()["kvs"]["lookup_misses"]
        fetched = kvs_store.stats().peer_keys
        got, loaded = _generate_fresh(engine_kvs_b, batch)
        assert _tokens(got) == _tokens(expected)
        assert loaded == 0
        assert engine_kvs_b.stats()["kvs"]["lookup_misses"] - misses == len(batch)
        assert kvs_store.stats().peer_keys == fetched
        [peer] = [p for p in kvs_store.peers() if p.address == node.address]
        assert peer.state != "up"
        assert peer.failures >= 1
    kvs_clean(engine_kvs_a, engine_kvs_b)
