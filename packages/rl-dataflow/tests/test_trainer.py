"""The trainer's routing replay and GRPO step on the tiny MoE model (no vLLM, no Ray)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_connector.tiny_model import make_tiny_model  # noqa: E402
from rl_dataflow.trainer import MoeTrainer, Sample, group_advantages  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3-moe")


@pytest.fixture
def trainer(model_dir, tmp_path):
    own = tmp_path / "model"
    shutil.copytree(model_dir, own)
    return MoeTrainer(own, lr=1e-2, threads=1)


def _ids(batch=2, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (batch, length), generator=gen)


def test_replaying_own_routing_gives_identical_logits(trainer):
    ids = _ids()
    with torch.no_grad():
        free = trainer.forward(ids)
        replayed = trainer.forward(ids, routes=free.own_routes)
    assert free.own_routes.shape == (2, 12, trainer.moe_layers, trainer.top_k)
    assert torch.equal(free.logits, replayed.logits)
    assert torch.equal(free.own_routes, replayed.own_routes)


def test_replaying_other_experts_changes_logits(trainer):
    ids = _ids()
    experts = trainer.config.num_experts
    with torch.no_grad():
        free = trainer.forward(ids)
        other = (free.own_routes + 1) % experts  # still k distinct ids, never the same set
        replayed = trainer.forward(ids, routes=other)
        # Only layer 1 replayed differently: layer 0's routing is the model's own.
        mixed = free.own_routes.clone()
        mixed[:, :, 1] = other[:, :, 1]
        half = trainer.forward(ids, routes=mixed)
    assert not torch.allclose(free.logits, replayed.logits)
    assert not torch.allclose(free.logits, half.logits)
    # With layer 0 replayed as its own, layer 0's choice is unchanged: the trainer still reports it.
    assert torch.equal(half.own_routes[:, :, 0], free.own_routes[:, :, 0])


def test_replay_gradient_reaches_gate_and_the_replayed_experts(trainer):
    ids = _ids(batch=1, length=6)
    with torch.no_grad():
        own = trainer.forward(ids).own_routes
    # Route every token of every layer to experts 0 and 1 only.
    forced = torch.zeros_like(own)
    forced[..., 1] = 1
    trainer.model.zero_grad()
    trainer.forward(ids, routes=forced).logprobs.sum().backward()
    moe = [m for m in trainer.model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    for block in moe:
        gate_grad = block.gate.weight.grad
        assert gate_grad is not None
        assert gate_grad[:2].abs().sum() > 0
        assert gate_grad[2:].abs().sum() > 0  # the softmax's denominator sees every expert
        expert_grad = block.experts.down_proj.grad
        assert expert_grad[:2].abs().sum() > 0
        assert expert_grad[2:].abs().sum() == 0  # experts no token was routed to


def test_wrong_route_shape_is_refused(trainer):
    ids = _ids()
    with pytest.raises(ValueError, match="routes are"):
        trainer.forward(ids, routes=torch.zeros(2, 11, trainer.moe_layers, trainer.top_k))


def test_export_round_trips_through_the_checkpoint_layout(trainer, tmp_path):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)
    out_dir = tmp_path / "export"
    shutil.copytree(trainer.model_dir, out_dir)
    trainer.export_weights(out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    mine = trainer.model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, mine[name].to(torch.bfloat16).float()), name


def test_group_advantages():
    adv = group_advantages(np.array([1.0, 0.0, 2.0, 2.0]), np.array([0, 0, 1, 1]))
    assert adv[0] > 0 > adv[1]
    assert np.allclose(adv[2:], 0.0)


def test_grpo_steps_raise_the_likelihood_of_rewarded_tokens(trainer):
    """Samples whose completion is in the target set get positive advantages; a few steps make
    those completions likelier and the others less likely."""
    rng = np.random.default_rng(0)
    target = np.arange(100, 164)
    prompt = rng.integers(0, 512, 6)

    def make(good: bool, advantage: float) -> Sample:
        pool = target if good else np.setdiff1d(np.arange(512), target)
        return Sample(np.concatenate([prompt, rng.choice(pool, 8)]), 6, advantage)

    samples = [make(i % 2 == 0, 1.0 if i % 2 == 0 else -1.0) for i in range(8)]

    def mean_logprob(group: list[Sample]) -> float:
        batch = trainer.pad(group, replay=False)
        with torch.no_grad():
            fwd = trainer.forward(batch["input_ids"], batch["attention_mask"])
        return float(fwd.logprobs[batch["completion"]].mean())

    good, bad = samples[0::2], samples[1::2]
    before = mean_logprob(good), mean_logprob(bad)
    for _ in range(3):
        stats = trainer.grpo_step([samples[:4], samples[4:]], replay=False)
    after = mean_logprob(good), mean_logprob(bad)
    assert stats["samples"] == 8
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1]


def test_padded_records_and_per_sample_routes_give_one_batch(trainer):
    """The loop gathers records straight into the padded layout; a sample's own routes are the
    other way in. Both must build the same batch."""
    rng = np.random.default_rng(1)
    lengths = [9, 5, 7]
    routes = [rng.integers(0, 8, (n - 1, trainer.moe_layers, 2), dtype=np.uint8) for n in lengths]
    samples = [
        Sample(rng.integers(0, 512, n), 3, 0.5, routes=r)
        for n, r in zip(lengths, routes, strict=True)
    ]
    padded = np.zeros((3, max(lengths) - 1, trainer.moe_layers, 2), np.uint8)
    for i, r in enumerate(routes):
        padded[i, : len(r)] = r
    bare = [Sample(s.tokens, s.prompt_len, s.advantage) for s in samples]
    a = trainer.pad(samples, replay=True)
    b = trainer.pad(bare, replay=True, recorded=padded)
    assert torch.equal(a["routes"], b["routes"])
    assert torch.equal(a["recorded"], b["recorded"])
    with pytest.raises(ValueError, match="without recorded routes"):
        trainer.pad(bare, replay=True)


def test_with_replay_the_experts_get_the_recorded_routing_on_every_token(trainer):
    """Recorded routing unlike the trainer's own: with replay every token's experts are the
    recorded ones (the agreement says 0% rerouted in use, while the router would pick others);
    without replay the experts get the router's own choice."""
    rng = np.random.default_rng(2)
    experts = trainer.config.num_experts
    lengths = [9, 6]
    samples = []
    for n in lengths:
        tokens = rng.integers(0, 512, n)
        with torch.no_grad():
            own = trainer.forward(torch.as_tensor(tokens)[None]).own_routes[0, : n - 1]
        other = ((own + 1) % experts).numpy()  # k distinct ids, never the router's own set
        samples.append(Sample(tokens, 3, 0.5, routes=other))
    replayed = trainer.measure([samples], replay=True)
    free = trainer.measure([samples], replay=False)
    assert replayed["routed_tokens"] == sum(n - 1 for n in lengths)
    assert replayed["used_rerouted_token_share"] == 0.0
    assert replayed["rerouted_token_share"] > 0.5  # the router itself would pick otherwise
    assert free["used_rerouted_token_share"] == free["rerouted_token_share"] == 1.0
