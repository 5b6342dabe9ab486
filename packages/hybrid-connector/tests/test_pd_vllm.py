"""Prefill/decode through real vLLM (CPU, offline LLM) with HybridConnector on kvt.

P and D are two spawned processes, each holding one LLM (started once for the module). Greedy
decode on D after pulling P's KV must equal a single instance's tokens, token for token; every
failure path must end with D recomputing (still the same tokens) and no blocks held anywhere.
"""

from __future__ import annotations

import random
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _harness import Instance
from hybrid_connector.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(600)

LEASE_S = 3.0
MAX_TOKENS = 8
CONNECTOR = {
    "kv_connector": "HybridConnector",
    "kv_connector_module_path": "hybrid_connector.connector",
    "kv_load_failure_policy": "recompute",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prompt(rng: random.Random, n: int) -> list[int]:
    # Token ids 3..499: no special tokens (0..2).
    return [rng.randrange(3, 500) for _ in range(n)]


def _wait_for(what: str, probe: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Re-ask a child process until probe() is truthy (the child's state is in another process)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class PD:
    def __init__(
        self, prefill: Instance, decode: Instance, rpc_address: str, transport: str = "auto"
    ) -> None:
        self.p = prefill
        self.d = decode
        self.rpc_address = rpc_address
        self.transport = transport  # the kvt_transport both instances were given
        self.block_size = int(prefill.ready_info["block_size"])
        self._reference: dict[tuple[int, ...], list[int]] = {}

    def reference(self, prompts: list[list[int]]) -> list[list[int]]:
        """Single-instance greedy tokens (P runs a request without kv_transfer_params normally;
        P has prefix caching off, so this is a plain full prefill + decode)."""
        missing = [p for p in prompts if tuple(p) not in self._reference]
        if missing:
            for prompt, out in zip(missing, self.p.generate(missing, MAX_TOKENS), strict=True):
                self._reference[tuple(prompt)] = out.token_ids
        return [self._reference[tuple(p)] for p in prompts]

    def counters(self, inst: Instance) -> dict[str, int]:
        return inst.stats()["counters"]

    def assert_idle(self, inst: Instance) -> None:
        """No request left and every block back in the free pool."""

        def idle() -> bool:
            s = inst.stats()
            return s["requests"] == 0 and s["free_blocks"] == s["total_blocks"]

        _wait_for(f"{inst.name} to hold no blocks", idle, timeout=LEASE_S + 20)


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shared across runs (pytest keeps the base dir's parent); make_tiny_model is idempotent.
    return make_tiny_model(tmp_path_factory.getbasetemp().parent / "hc-tiny-model")


@pytest.fixture(scope="module", params=["auto", "tcp"], ids=["auto-samehost", "forced-tcp"])
def pd(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[PD]:
    """P and D, once per kvt transport: the default (auto: samehost, both on this host) and tcp
    forced through kv_connector_extra_config's ``kvt_transport``."""
    transport = request.param
    forced = {} if transport == "auto" else {"kvt_transport": transport}
    port = _free_port()
    rpc_address = f"127.0.0.1:{port}"
    prefill = Instance(
        "P",
        str(model_dir),
        {
            **CONNECTOR,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "rpc_port": port,
                "lease_s": LEASE_S,
                "transfer_timeout_s": 20,
                **forced,
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
            "kv_connector_extra_config": {"transfer_timeout_s": 20, **forced},
        },
        opts={"enable_prefix_caching": True},
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield PD(prefill, decode, rpc_address, transport)
    finally:
        p_info = prefill.close()
        d_info = decode.close()
    # Clean shutdown leaves no connector or kvt thread behind (P may have been killed).
    for info in (p_info, d_info):
        if info is not None:
            leaked = [t for t in info["threads"] if t.startswith(("hybrid-connector", "kvt-"))]
            assert not leaked, leaked


def _prompts(pd: PD, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    bs = pd.block_size
    return [
        _prompt(rng, 37),  # shorter than a block
        _prompt(rng, bs),  # exactly one block
        _prompt(rng, 2 * bs + 45),  # several blocks plus a partial one
        _prompt(rng, 2 * bs),  # exactly two blocks
    ]


def test_pd_tokens_equal_single_instance(pd: PD) -> None:
    prompts = _prompts(pd, seed=1)
    expected = pd.reference(prompts)
    p_before, d_before = pd.counters(pd.p), pd.counters(pd.d)

    tids = [str(uuid.uuid4()) for _ in prompts]
    p_out = pd.p.generate(prompts, 1, [{"do_remote_decode": True, "transfer_id": t} for t in tids])
    for out, tid, prompt in zip(p_out, tids, prompts, strict=True):
        params = out.kv_transfer_params
        assert params is not None
        assert params["do_remote_prefill"] is True
        assert params["transfer_id"] == tid
        assert params["remote_rpc_address"] == pd.rpc_address
        assert params["remote_num_tokens"] == len(prompt)
        assert len(params["remote_block_ids"][0]) == -(-len(prompt) // pd.block_size)

    d_out = pd.d.generate(prompts, MAX_TOKENS, [o.kv_transfer_params for o in p_out])
    assert [o.token_ids for o in d_out] == expected

    d_after = pd.counters(pd.d)
    assert _delta(d_after, d_before, "pulls_done") == len(prompts)
    assert _delta(d_after, d_before, "pulls_failed") == 0
    kv_bytes_per_token = 2 * 2 * 32 * 2 * 2  # (k, v) * heads * head_dim * bf16 * layers
    full_blocks = sum(-(-len(p) // pd.block_size) for p in prompts)
    expected_bytes = full_blocks * pd.block_size * kv_bytes_per_token
    assert _delta(d_after, d_before, "bytes_received") == expected_bytes
    pd.assert_idle(pd.p)
    pd.assert_idle(pd.d)
    p_after = pd.counters(pd.p)
    assert _delta(p_after, p_before, "sends_done") == len(prompts)
    assert _delta(p_after, p_before, "leases_expired") == 0
    # The KV went over the path asked for: auto on one host must pick samehost, not stay on tcp.
    path = "samehost" if pd.transport == "auto" else pd.transport
    assert pd.p.stats()["kvt_paths"] == [path]
    assert pd.d.stats()["kvt_paths"] == [path]


def test_decode_with_local_prefix_hit_pulls_only_the_rest(pd: PD) -> None:
    """D already caches the first blocks of this prompt (previous test): it pulls only the tail."""
    prompt = _prompts(pd, seed=1)[2]  # 2 full blocks + 45 tokens, cached on D by the last test
    expected = pd.reference([prompt])
    d_before = pd.counters(pd.d)
    tid = str(uuid.uuid4())
    p_out = pd.p.generate([prompt], 1, [{"do_remote_decode": True, "transfer_id": tid}])
    d_out = pd.d.generate([prompt], MAX_TOKENS, [p_out[0].kv_transfer_params])
    assert [o.token_ids for o in d_out] == expected
    d_after = pd.counters(pd.d)
    assert _delta(d_after, d_before, "pulls_done") == 1
    one_block = pd.block_size * 2 * 2 * 32 * 2 * 2
    assert _delta(d_after, d_before, "bytes_received") == one_block
    pd.assert_idle(pd.p)
    pd.assert_idle(pd.d)


def test_parallel_dispatch_transfer_kv_before_prefill(pd: PD) -> None:
    """The proxy sends to D first; D's transfer_kv waits on P until P's prefill runs."""
    prompts = _prompts(pd, seed=2)[1:3]
    expected = pd.reference(prompts)
    p_before, d_before = pd.counters(pd.p), pd.counters(pd.d)
    tids = [str(uuid.uuid4()) for _ in prompts]
    pd.d.submit_generate(
        prompts,
        MAX_TOKENS,
        [
            {"do_remote_prefill": True, "transfer_id": t, "remote_rpc_address": pd.rpc_address}
            for t in tids
        ],
    )
    _wait_for(
        "D's transfer_kv to reach P",
        lambda: _delta(pd.counters(pd.p), p_before, "early_pulls") == len(prompts),
    )
    pd.p.generate(prompts, 1, [{"do_remote_decode": True, "transfer_id": t} for t in tids])
    d_out = pd.d.result()
    assert [o.token_ids for o in d_out] == expected
    assert _delta(pd.counters(pd.d), d_before, "pulls_done") == len(prompts)
    # The pulls were parked when P's prefill ran: rapid transfer_kv sent each layer as the
    # forward pass wrote it.
    assert _delta(pd.counters(pd.p), p_before, "rapid_sends") == len(prompts)
    pd.assert_idle(pd.p)
    pd.assert_idle(pd.d)


def test_lease_expiry_releases_prefill_blocks(pd: PD) -> None:
    prompt = _prompts(pd, seed=3)[2]
    p_before = pd.counters(pd.p)
    pd.p.generate([prompt], 1, [{"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}])
    held = pd.p.stats()
    # No D ever asks: the blocks stay held (until the lease ends)...
    assert held["total_blocks"] - held["free_blocks"] == -(-len(prompt) // pd.block_size)
    # ...and then come back, reported as a lease expiry.
    pd.assert_idle(pd.p)
    assert _delta(pd.counters(pd.p), p_before, "leases_expired") == 1


def test_decode_abort_while_pulling_frees_both_sides(pd: PD) -> None:
    """D's client goes away while its pull is parked on P: D keeps the blocks until the pull is
    aborted, then frees them; P drops the parked pull. Nothing stays held."""
    prompt = _prompts(pd, seed=6)[2]
    p_before, d_before = pd.counters(pd.p), pd.counters(pd.d)
    params = {
        "do_remote_prefill": True,
        "transfer_id": str(uuid.uuid4()),
        "remote_rpc_address": pd.rpc_address,
    }
    assert pd.d.abort_while_pulling(prompt, params)
    pd.assert_idle(pd.d)
    assert _delta(pd.counters(pd.d), d_before, "pulls_failed") == 1

    def parked_pull_gone() -> bool:
        after = pd.counters(pd.p)
        return any(
            _delta(after, p_before, key) == 1
            for key in ("early_pulls_released", "early_pulls_expired")
        )

    _wait_for("P to drop the parked pull", parked_pull_gone, timeout=LEASE_S + 10)
    pd.assert_idle(pd.p)


def test_unreachable_prefill_instance_recomputes(pd: PD) -> None:
    prompts = _prompts(pd, seed=4)[:3]
    expected = pd.reference(prompts)
    d_before = pd.counters(pd.d)
    dead = f"127.0.0.1:{_free_port()}"
    d_out = pd.d.generate(
        prompts,
        MAX_TOKENS,
        [
            {
                "do_remote_prefill": True,
                "transfer_id": str(uuid.uuid4()),
                "remote_rpc_address": dead,
            }
            for _ in prompts
        ],
    )
    assert [o.token_ids for o in d_out] == expected
    assert _delta(pd.counters(pd.d), d_before, "pulls_failed") == len(prompts)
    pd.assert_idle(pd.d)


def test_prefill_killed_while_pull_waits_recomputes(pd: PD) -> None:
    """Last test (it kills P): D's pull is parked on P, P dies, D recomputes and answers."""
    prompts = _prompts(pd, seed=5)[:2]
    expected = pd.reference(prompts)
    p_before, d_before = pd.counters(pd.p), pd.counters(pd.d)
    pd.d.submit_generate(
        prompts,
        MAX_TOKENS,
        [
            {
                "do_remote_prefill": True,
                "transfer_id": str(uuid.uuid4()),
                "remote_rpc_address": pd.rpc_address,
            }
            for _ in prompts
        ],
    )
    _wait_for(
        "D's transfer_kv to reach P",
        lambda: _delta(pd.counters(pd.p), p_before, "early_pulls") == len(prompts),
    )
    pd.p.kill()
    d_out = pd.d.result()
    assert [o.token_ids for o in d_out] == expected
    assert _delta(pd.counters(pd.d), d_before, "pulls_failed") == len(prompts)
    pd.assert_idle(pd.d)
