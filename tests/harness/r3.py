"""R3 probes that run in an engine's child process (``OfflineEngine.call``; TP 1, the worker in
that process): importable by name there, so they live here and not in a test module."""

from __future__ import annotations

from typing import Any

# MoE layer -> the capture hook its router had before ``skip_captures`` took it away.
_SKIPPED: dict[int, Any] = {}


def skip_captures(child: Any, layers: list[int]) -> list[int]:
    """Make vLLM skip the R3 capture hook of these MoE layers' routers (as a router that never
    calls it would); ``[]`` gives every hook back. Returns the layers skipping now."""
    from hybrid_connector.connector import _moe_routers

    routers = _moe_routers(child.engine.vllm_config)
    for layer, router in enumerate(routers):
        if layer in layers and layer not in _SKIPPED:
            _SKIPPED[layer] = router.capture_fn
            router.set_capture_fn(None)
        elif layer not in layers and layer in _SKIPPED:
            router.set_capture_fn(_SKIPPED.pop(layer))
    return sorted(_SKIPPED)


def fill_free_routing_rows(child: Any, expert: int) -> int:
    """Write expert id ``expert`` into every routing row of every block no request holds: what a
    previous request's rows look like to a request that gets such a block. Returns how many
    blocks."""
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state

    pool = child.core.scheduler.kv_cache_manager.block_pool
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks() if not b.is_null]
    recorder = kv_transfer_state.get_kv_transfer_group()._worker.r3
    recorder.blocks[torch.tensor(free, dtype=torch.long)] = expert
    return len(free)


def ledger_size(child: Any) -> int:
    """Requests on the scheduler half's R3 ledger (0 when the engine is idle)."""
    return child.core.scheduler.connector._scheduler._r3_ledger.tracked
