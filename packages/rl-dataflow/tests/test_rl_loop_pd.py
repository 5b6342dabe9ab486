"""The RL loop with its rollout on a 1P1D (pd-serving's proxy, vLLM's OpenAI servers): D pulls
every prompt's KV and its routing rows from P, the records reach the trainer complete and are
what its experts get, the weight sync reaches both instances, memprof runs in both, and nothing
is left in the pool, on the instances or in the loop's threads."""

from __future__ import annotations

import re
import threading
import urllib.request

import numpy as np
import pytest

pytest.importorskip("vllm")

from harness.checks import wait_for
from harness.pool import count_vllm_start
from hybrid_connector.tiny_model import make_tiny_model
from rl_dataflow.rl_loop import R3, LoopConfig, RLLoop

pytestmark = [pytest.mark.starts_vllm, pytest.mark.timeout(900)]

STEPS = 8


def _prompt_tokens(url: str) -> dict[str, float]:
    """vLLM's prompt tokens by source (local compute, local cache hit, external KV transfer)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)'
    out: dict[str, float] = {}
    for source, value in re.findall(pattern, text, re.MULTILINE):
        out[source] = out.get(source, 0.0) + float(value)
    return out


def _our_threads() -> set[str]:
    prefixes = ("hybrid-connector", "kvt-", "refstore", "rl-")
    return {t.name for t in threading.enumerate() if t.name.startswith(prefixes)}


def test_loop_through_pd_trains_on_records_d_pulled_from_p(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / "refstore"))
    (tmp_path / "refstore").mkdir()
    model = make_tiny_model(tmp_path / "qwen3-moe", arch="qwen3-moe")
    config = LoopConfig(prompts=8, group_size=8, lr=2e-2, r3=R3.REPLAY.value, serving="pd")
    count_vllm_start("rl-loop-pd", 2)
    threads = _our_threads()
    loop = RLLoop(config, model, tmp_path / "work")
    try:
        steps = [loop.step() for _ in range(STEPS)]
        pool_back = loop.pool_back_to_baseline()  # (idle()'s nudges store records of their own)
        memprof = loop.engine.memprof()
        (p_url,) = [u for u in loop.engine.instances if u not in loop.engine.decode_urls]
        (d_url,) = loop.engine.decode_urls
        on_p, on_d = _prompt_tokens(p_url), _prompt_tokens(d_url)
        # P lets go of a prompt's blocks once D's pull is done (reported at P's next step).
        idle = wait_for("P and D to hold no request and no KV block", loop.engine.idle)
    finally:
        loop.close()
    samples = STEPS * config.prompts * config.group_size
    # Every prompt was prefilled on P and its KV (and routing rows) pulled by D.
    assert on_p.get("local_compute", 0) == samples * config.prompt_len
    assert on_d.get("external_kv_transfer", 0) == samples * config.prompt_len
    assert on_d.get("local_compute", 0) == 0
    assert idle  # P let go of every pulled prompt, D of every answer
    assert pool_back
    assert memprof == [True, True]  # in P's and D's server processes
    assert _our_threads() <= threads
    rewards = np.array([s["reward"] for s in steps])
    assert rewards[-2:].mean() > rewards[0] + 0.15, rewards
    for s in steps:
        # Each sample's record: the prompt's rows from P, the generated tokens' from D.
        assert s["routed_tokens"] == config.prompts * config.group_size * (
            config.prompt_len + config.completion_len - 1
        )
        assert s["used_rerouted_token_share"] == 0.0  # the experts got the records' routing
        # Both instances run the trainer's weights: stale or garbled experts on D would show.
        assert s["logprob_abs_diff_mean"] < 0.1, s
