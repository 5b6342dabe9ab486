"""KVS probes that run in an engine's child process (``OfflineEngine.call``): importable by
name there, so they live here and not in a test module."""

from __future__ import annotations

from typing import Any


def _scheduler_kvs(child: Any) -> Any:
    side = child.core.scheduler.connector._scheduler
    return side.kvs


def prompt_keys(child: Any, prompt: list[int]) -> list[bytes]:
    """The store keys of every full block of ``prompt`` on this engine (its root, groups, TP)."""
    from hybrid_connector import kvs_keys

    kvs = _scheduler_kvs(child)
    chains = kvs_keys.chain(kvs.root, prompt, kvs._block_size)
    keys, _ = kvs_keys.lookup_keys(chains, kvs._groups, kvs._tp_size)
    return keys


def reset_prefix_cache(child: Any) -> bool:
    """Empty vLLM's own prefix cache: the next identical prompt can only hit the store."""
    return bool(child.llm.reset_prefix_cache())


def evict_before_each_load(child: Any, store_name: str, on: bool) -> None:
    """Make this engine's KVS worker evict a load's objects from the store right before it
    reads them: the object is gone between lookup and load. ``on=False`` undoes it."""
    from hybrid_connector import kvs_keys
    from hybrid_connector.kvs_worker import KvsWorker
    from refstore import faults

    original = getattr(KvsWorker, "_original_load", None)
    if original is None:
        original = KvsWorker._original_load = KvsWorker._load  # type: ignore[attr-defined]
    if not on:
        KvsWorker._load = original  # type: ignore[method-assign]
        return

    def evicting_load(self: KvsWorker, load: Any) -> None:
        client = self._store()
        keys = [
            kvs_keys.object_key(chain, g, r) for chain in load.chains for g, r in self._per_block()
        ]
        faults.evict_keys(client, keys)
        original(self, load)

    KvsWorker._load = evicting_load  # type: ignore[method-assign]
    _ = store_name
