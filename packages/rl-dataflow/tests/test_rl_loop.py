"""The RL loop end to end: vLLM rollout, R3 records by reference, GRPO with replay, reload."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from hybrid_connector.tiny_model import make_tiny_model
from rl_dataflow.rl_loop import R3, LoopConfig, run_loop

STEPS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3-moe")


@pytest.mark.starts_vllm
def test_loop_raises_the_reward_and_leaves_the_pool_as_it_was(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / "refstore"))
    (tmp_path / "refstore").mkdir()
    config = LoopConfig(prompts=8, group_size=8, lr=2e-2, r3=R3.REPLAY.value)
    seen = []
    out = run_loop(config, model_dir, tmp_path / "work", STEPS, progress=seen.append)
    steps = out["steps"]
    assert [s["step"] for s in seen] == list(range(1, STEPS + 1))
    rewards = np.array([s["reward"] for s in steps])
    # A random policy scores ~1/8; the last steps' rollouts must be clearly better.
    assert rewards[-2:].mean() > rewards[0] + 0.15, rewards
    assert out["pool_back_to_baseline"]
    assert out["memprof"]
    for s in steps:
        assert s["micro_batches"] > 1  # the batch went through PackMicroBatches in pieces
        assert s["routed_tokens"] > 0
        # The engine runs the weights the trainer exported (in bf16): had the reload left the
        # engine's experts stale or garbled, its log-probs would drift from the trainer's.
        assert s["logprob_abs_diff_mean"] < 0.1, s


@pytest.mark.starts_vllm
def test_loop_with_r3_off_records_nothing(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / "refstore"))
    (tmp_path / "refstore").mkdir()
    config = LoopConfig(prompts=4, group_size=4, lr=2e-2, r3=R3.OFF.value)
    out = run_loop(config, model_dir, tmp_path / "work", 3)
    assert out["pool_back_to_baseline"]
    for s in out["steps"]:
        assert s["routed_tokens"] == 0  # no records reached the trainer
        assert "records" not in s["timings"]
        assert s["logprob_abs_diff_mean"] < 0.1, s  # the weights still reach the engine
