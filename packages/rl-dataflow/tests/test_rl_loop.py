"""The RL loop end to end: vLLM rollout, R3 records by reference (or by value through Ray), GRPO
with replay, reload; and every engine, pool and thread of the loop back to where it started."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("vllm")

from hybrid_connector.tiny_model import make_tiny_model
from rl_dataflow.rl_loop import R3, LoopConfig, R3Transport, RLLoop, run_loop

STEPS = 8
# Threads of this project's packages: each has an owner that must have joined it by close().
OURS = ("hybrid-connector", "kvt-", "refstore", "rl-")


def _our_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith(OURS)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3-moe")


@pytest.fixture
def refstore_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / "refstore"))
    (tmp_path / "refstore").mkdir()


@pytest.mark.starts_vllm
@pytest.mark.usefixtures("refstore_dir")
def test_loop_raises_the_reward_and_leaves_engine_pool_and_threads_as_they_were(
    model_dir, tmp_path
):
    config = LoopConfig(prompts=8, group_size=8, lr=2e-2, r3=R3.REPLAY.value)
    threads = _our_threads()
    loop = RLLoop(config, model_dir, tmp_path / "work")
    try:
        steps = [loop.step() for _ in range(STEPS)]
        pool_back = loop.pool_back_to_baseline()
        engine_idle = loop.engine.idle()
        memprof = loop.memprof
    finally:
        loop.close()
    rewards = np.array([s["reward"] for s in steps])
    # A random policy scores ~1/8; the last steps' rollouts must be clearly better.
    assert rewards[-2:].mean() > rewards[0] + 0.15, rewards
    assert pool_back  # every record released: no object, no byte left in the pool
    assert engine_idle  # no request, no KV block held
    assert memprof
    assert _our_threads() <= threads
    for s in steps:
        assert s["micro_batches"] > 1  # the batch went through PackMicroBatches in pieces
        assert s["routed_tokens"] == config.prompts * config.group_size * (
            config.prompt_len + config.completion_len - 1
        )
        # The experts got the rollout's routing on every token (the trainer's router alone
        # would have picked otherwise on some).
        assert s["used_rerouted_token_share"] == 0.0
        # The engine runs the weights the trainer exported (in bf16): had the reload left the
        # engine's experts stale or garbled, its log-probs would drift from the trainer's.
        assert s["logprob_abs_diff_mean"] < 0.1, s


@pytest.mark.starts_vllm
@pytest.mark.usefixtures("refstore_dir")
def test_loop_by_value_through_ray_trains_on_the_records(model_dir, tmp_path):
    """The records copied out and through Ray's object store, as verl and slime carry them:
    the trainer replays them the same way, nothing stays in the pool, Ray is shut down."""
    import ray

    config = LoopConfig(
        prompts=4, group_size=4, lr=2e-2, r3=R3.REPLAY.value, r3_transport=R3Transport.VALUE.value
    )
    out = run_loop(config, model_dir, tmp_path / "work", 2)
    assert out["pool_back_to_baseline"]
    assert not ray.is_initialized()
    for s in out["steps"]:
        assert s["routed_tokens"] == 16 * (config.prompt_len + config.completion_len - 1)
        assert s["used_rerouted_token_share"] == 0.0
        assert s["timings"]["ray"] > 0
        assert s["logprob_abs_diff_mean"] < 0.1, s


@pytest.mark.starts_vllm
@pytest.mark.usefixtures("refstore_dir")
def test_loop_with_r3_off_records_nothing(model_dir, tmp_path):
    config = LoopConfig(prompts=4, group_size=4, lr=2e-2, r3=R3.OFF.value)
    loop = RLLoop(config, model_dir, tmp_path / "work")
    try:
        steps = [loop.step() for _ in range(3)]
        assert loop.pool_back_to_baseline()
        assert loop.engine.idle()
    finally:
        loop.close()
    for s in steps:
        assert s["routed_tokens"] == 0  # no records reached the trainer
        assert "records" not in s["timings"]
        assert s["logprob_abs_diff_mean"] < 0.1, s  # the weights still reach the engine
