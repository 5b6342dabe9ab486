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


def scrub_free_blocks(child: Any) -> int:
    """Fill every block no request holds with noise, in every layer (attention and state):
    what a load must write is then never there already (after ``reset_prefix_cache`` a freed
    block still holds its old bytes, and vLLM may hand the same block out again). TP 1 only:
    the worker is in this process. Returns how many blocks."""
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state

    pool = child.core.scheduler.kv_cache_manager.block_pool
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks() if not b.is_null]
    ids = torch.tensor(free, dtype=torch.long)
    caches = kv_transfer_state.get_kv_transfer_group()._worker._kv_caches
    generator = torch.Generator().manual_seed(0)
    for value in caches.values():
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            shape = (len(free), *tensor.shape[1:])
            noise = torch.randn(shape, generator=generator, dtype=torch.float32)
            tensor[ids] = noise.to(tensor.dtype)
    return len(free)


def kv_cache_layout(child: Any) -> dict[str, Any]:
    """How vLLM laid this engine's KV cache out: its KV-cache groups (the spec type of each),
    whether the hybrid KV-cache manager is on, and the state groups' cache mode."""
    vllm_config = child.engine.vllm_config
    groups = child.core.scheduler.kv_cache_config.kv_cache_groups
    return {
        "groups": [type(g.kv_cache_spec).__name__ for g in groups],
        "hybrid_manager": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "mamba_cache_mode": str(vllm_config.cache_config.mamba_cache_mode),
    }


def start_failure(spec: Any, timeout: float = 600) -> str:
    """Start an engine that must not start: the error it stopped with at start-up ('' if it
    started; it is closed either way)."""
    from harness.offline import OfflineEngine

    engine = OfflineEngine(spec)
    try:
        # The child's first word: ("reply", 0, True, ...) once started, ("reply", -1, False,
        # traceback) if the start failed.
        if not engine._conn.poll(timeout):
            raise TimeoutError(f"{spec.name}: neither started nor failed within {timeout}s")
        kind, call_id, ok, value = engine._conn.recv()
        if ok:
            return ""
        assert (kind, call_id) == ("reply", -1), (kind, call_id)
        return str(value)
    finally:
        engine.close()
