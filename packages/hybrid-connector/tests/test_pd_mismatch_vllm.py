"""A layout mismatch between P and D through real vLLM: refused before any byte moves, and D
recomputes the prompt.

P serves the tiny GDN hybrid (a state group and an attention group) and D the tiny Qwen2 (one
attention group): D's transfer_kv names a cache P cannot write into, P refuses it with a
PeerError and releases its blocks, D reports the pull failed and computes the prompt itself, so
its tokens equal its own single-instance tokens. Both pools are empty afterwards.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
from _harness import Instance
from hybrid_connector.tiny_model import make_tiny_model
from test_pd_vllm import CONNECTOR, PD, _delta, _free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.getbasetemp().parent
    gdn: Path = make_tiny_model(base / "hc-tiny-gdn", "gdn")
    qwen2: Path = make_tiny_model(base / "hc-tiny-model")
    port = _free_port()
    prefill = Instance(
        "P",
        str(gdn),
        {
            **CONNECTOR,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"rpc_port": port, "lease_s": 3.0},
        },
    )
    decode = Instance(
        "D",
        str(qwen2),
        {**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": {}},
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield PD(prefill, decode, f"127.0.0.1:{port}")
    finally:
        prefill.close()
        decode.close()


def test_mismatched_caches_are_refused_and_decode_recomputes(mismatched: PD) -> None:
    pd = mismatched
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (37, 300)]
    expected = [o.token_ids for o in pd.d.generate(prompts, 8)]  # D alone
    tids = [str(uuid.uuid4()) for _ in prompts]
    p_out = pd.p.generate(prompts, 1, [{"do_remote_decode": True, "transfer_id": t} for t in tids])
    d_before = pd.counters(pd.d)
    d_out = pd.d.generate(prompts, 8, [o.kv_transfer_params for o in p_out])
    assert [o.token_ids for o in d_out] == expected
    d_after = pd.counters(pd.d)
    assert _delta(d_after, d_before, "pulls_failed") == len(prompts)
    assert _delta(d_after, d_before, "bytes_received") == 0
    pd.assert_idle(pd.p)
    pd.assert_idle(pd.d)
    p_counters = pd.counters(pd.p)
    assert p_counters.get("sends_done", 0) == 0
    assert p_counters.get("leases_expired", 0) == 0, "P freed its blocks when it refused"
