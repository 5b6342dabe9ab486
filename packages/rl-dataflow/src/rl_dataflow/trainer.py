"""The trainer: the rollout engine's MoE model in torch, with routing replay (R3) and a GRPO step.

``MoeTrainer`` loads the model directory the rollout engine serves (transformers
``Qwen3MoeForCausalLM``, float32 master weights) and patches every MoE block's router so that a
forward pass can **replay** given routing: for each token, the block uses the recorded expert ids
instead of its own top-k, and weighs them with its *own* gate: the softmax of its router logits,
gathered at the recorded ids and renormalised when the model's ``norm_topk_prob`` says so (what
its own top-k would have got, had it picked those ids). Gradients flow through the gate (the
gathered probabilities) and through the chosen experts. Without replay the router picks its own
top-k, exactly as transformers does. Either way the ids the router would pick itself are kept
(``Forward.own_routes``), so a caller can count how often the trainer disagrees with the rollout.

Routing arrays are int ``[batch, time, moe_layers, top_k]`` (row ``t`` = the token at position
``t``); padded positions carry any valid id (their outputs are masked out).

``export_weights`` writes the master weights back in the checkpoint's own layout (bfloat16, one
``model.safetensors``, replaced atomically) for the engine to reload. torch and transformers are
imported here only.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Agreement", "Forward", "MoeTrainer", "RouterState", "Sample", "group_advantages"]


class RouterState:
    """What every patched router of one model reads and writes during a forward pass."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.replay: torch.Tensor | None = None  # long [tokens, layers, top_k] or None
        self.own: list[torch.Tensor | None] = [None] * layers  # long [tokens, top_k] per layer
        self.used: list[torch.Tensor | None] = [None] * layers  # what the experts were given


def _replayable_forward(state: RouterState, layer: int) -> Any:
    """The router forward of MoE layer ``layer``: transformers' Qwen3MoeTopKRouter, plus replay."""

    def forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        own = torch.topk(router_probs.detach(), self.top_k, dim=-1).indices
        state.own[layer] = own
        if state.replay is None:
            indices = own
        else:
            indices = state.replay[:, layer]
            if indices.shape != own.shape:
                raise ValueError(
                    f"replayed routing of layer {layer} is {tuple(indices.shape)}, the forward"
                    f" needs {tuple(own.shape)} (tokens, top_k)"
                )
        state.used[layer] = indices
        top = router_probs.gather(1, indices)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return router_logits, top.to(router_logits.dtype), indices

    return forward


@dataclass
class Forward:
    logprobs: torch.Tensor  # float [batch, time - 1]: log p(token t+1 | tokens <= t)
    logits: torch.Tensor  # float [batch, time, vocab]
    own_routes: torch.Tensor  # long [batch, time, layers, top_k]: the trainer's own choice
    used_routes: torch.Tensor  # long [batch, time, layers, top_k]: what the experts were given


@dataclass
class Sample:
    """One response: ``tokens`` = prompt + completion; the model sees ``tokens[:-1]``."""

    tokens: np.ndarray  # int [prompt + completion]
    prompt_len: int
    advantage: float
    rollout_logprobs: np.ndarray | None = None  # float [completion]
    routes: np.ndarray | None = None  # int [prompt + completion - 1, layers, top_k]


def group_advantages(rewards: np.ndarray, group_ids: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation
    (0 for a group whose rewards are all equal)."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for group in np.unique(group_ids):
        mask = group_ids == group
        r = rewards[mask]
        out[mask] = (r - r.mean()) / (r.std() + eps)
    return out


class MoeTrainer:
    """The rollout model in float32 with replayable routing, an Adam optimiser and a GRPO step."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        lr: float = 1e-3,
        clip: float = 0.2,
        seed: int = 0,
        threads: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.model.train()
        self.config = self.model.config
        self.routers = [
            module.gate
            for module in self.model.modules()
            if type(module).__name__.endswith("SparseMoeBlock")
        ]
        if not self.routers:
            raise ValueError(f"{model_dir}: no MoE block to replay ({type(self.model).__name__})")
        self.top_k = int(self.config.num_experts_per_tok)
        self.state = RouterState(len(self.routers))
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(_replayable_forward(self.state, layer), router)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip = clip
        self.steps = 0

    @property
    def moe_layers(self) -> int:
        return len(self.routers)

    # -- forward --------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        routes: torch.Tensor | np.ndarray | None = None,
    ) -> Forward:
        """Logits and next-token log-probs of ``input_ids`` [batch, time]; with ``routes`` [batch,
        time, layers, top_k] every MoE block replays them."""
        batch, time_ = input_ids.shape
        if routes is not None:
            routes = torch.as_tensor(routes).to(torch.long)
            want = (batch, time_, self.moe_layers, self.top_k)
            if tuple(routes.shape) != want:
                raise ValueError(f"routes are {tuple(routes.shape)}, expected {want}")
            self.state.replay = routes.reshape(batch * time_, self.moe_layers, self.top_k)
        try:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        finally:
            self.state.replay = None
        own = torch.stack([o for o in self.state.own if o is not None], dim=1)
        used = torch.stack([u for u in self.state.used if u is not None], dim=1)
        self.state.own = [None] * self.moe_layers
        self.state.used = [None] * self.moe_layers
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        token_logprobs = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        shape = (batch, time_, self.moe_layers, -1)
        return Forward(token_logprobs, logits, own.reshape(shape), used.reshape(shape))

    def pad(
        self, samples: list[Sample], replay: bool, recorded: np.ndarray | None = None
    ) -> dict[str, torch.Tensor]:
        """The samples right-padded into one batch: ids, attention mask, completion mask (over
        next-token positions), rollout log-probs, and the recorded routes (``"recorded"``; also
        ``"routes"`` with ``replay``): from ``recorded`` when given (already padded, [samples,
        >= longest - 1, layers, top_k], e.g. gathered straight into that layout), else from each
        sample's ``routes``."""
        width = max(len(s.tokens) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        attention = torch.zeros(len(samples), width, dtype=torch.long)
        completion = torch.zeros(len(samples), width - 1, dtype=torch.bool)
        old = torch.zeros(len(samples), width - 1, dtype=torch.float32)
        routes = torch.zeros(len(samples), width, self.moe_layers, self.top_k, dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s.tokens)
            ids[i, :n] = torch.as_tensor(s.tokens, dtype=torch.long)
            attention[i, :n] = 1
            completion[i, s.prompt_len - 1 : n - 1] = True
            if s.rollout_logprobs is not None:
                old[i, s.prompt_len - 1 : n - 1] = torch.as_tensor(s.rollout_logprobs)
            if recorded is None and s.routes is not None:
                if len(s.routes) != n - 1:
                    raise ValueError(f"{len(s.routes)} recorded rows for {n - 1} model inputs")
                routes[i, : n - 1] = torch.as_tensor(s.routes, dtype=torch.long)
            # Position n - 1 (the last token) never goes through the model: any valid id.
        out = {"input_ids": ids, "attention_mask": attention, "completion": completion, "old": old}
        has_routes = recorded is not None or all(s.routes is not None for s in samples)
        if recorded is not None:
            rows = min(recorded.shape[1], width - 1)
            routes[:, :rows] = torch.from_numpy(np.ascontiguousarray(recorded[:, :rows]))
        if has_routes:
            out["recorded"] = routes
        if replay:
            if not has_routes:
                raise ValueError("replay asked for a sample without recorded routes")
            out["routes"] = routes
        return out

    # -- the GRPO step -------------------------------------------------------------------------
    def grpo_step(
        self,
        micro_batches: list[list[Sample]],
        *,
        replay: bool,
        recorded: list[np.ndarray | None] | None = None,
    ) -> dict[str, float | int]:
        """One policy-gradient step over all micro-batches (gradients accumulated, one optimiser
        step): PPO's clipped surrogate with group-normalised advantages, ratios against the
        trainer's own log-probs before the update (on-policy: one update per rollout), token-mean
        per sequence, mean over sequences. Also returns how the trainer's log-probs and routing
        (in this forward, before the update) agree with the rollout's (``Agreement``), and the
        seconds that took (``agreement_s``: a measurement, not part of a training step).
        ``recorded``: each micro-batch's routes, padded (see ``pad``), instead of the samples'."""
        samples = sum(len(mb) for mb in micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        agreement = Agreement()
        agreement_s = 0.0
        for i, mb in enumerate(micro_batches):
            batch = self.pad(mb, replay, recorded[i] if recorded else None)
            fwd = self.forward(batch["input_ids"], batch["attention_mask"], batch.get("routes"))
            mask = batch["completion"]
            advantage = torch.tensor([s.advantage for s in mb], dtype=torch.float32)[:, None]
            ratio = torch.exp(fwd.logprobs - fwd.logprobs.detach())
            surrogate = torch.minimum(
                ratio * advantage, ratio.clamp(1 - self.clip, 1 + self.clip) * advantage
            )
            per_seq = (surrogate * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            loss = -per_seq.sum() / samples
            loss.backward()
            loss_total += float(loss.detach())
            started = time.perf_counter()
            agreement.add(self, mb, batch, fwd)
            agreement_s += time.perf_counter() - started
        self.optimizer.step()
        self.steps += 1
        return {
            "loss": loss_total,
            "samples": samples,
            **agreement.result(),
            "agreement_s": agreement_s,
        }

    def measure(
        self,
        micro_batches: list[list[Sample]],
        *,
        replay: bool,
        recorded: list[np.ndarray | None] | None = None,
    ) -> dict[str, float]:
        """``Agreement`` of a forward pass over the batch (no gradient, no update)."""
        agreement = Agreement()
        with torch.no_grad():
            for i, mb in enumerate(micro_batches):
                batch = self.pad(mb, replay, recorded[i] if recorded else None)
                fwd = self.forward(batch["input_ids"], batch["attention_mask"], batch.get("routes"))
                agreement.add(self, mb, batch, fwd)
        return agreement.result()

    # -- weights out ---------------------------------------------------------------------------
    def export_weights(self, model_dir: str | os.PathLike[str] | None = None) -> Path:
        """The weights in the checkpoint's layout and dtype, as ``model.safetensors`` in
        ``model_dir`` (default: the one loaded), replaced atomically; returns the file."""
        from safetensors.torch import save_file

        target_dir = Path(model_dir or self.model_dir)
        dtype = _checkpoint_dtype(target_dir)
        tensors = checkpoint_state_dict(self.model, dtype)
        fd, tmp = tempfile.mkstemp(prefix=".model.", suffix=".safetensors", dir=target_dir)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"format": "pt"})
            os.replace(tmp, target_dir / "model.safetensors")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target_dir / "model.safetensors"


def _same_experts(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """bool [..., layers]: the same set of experts (the order within top-k does not matter)."""
    return (own.sort(-1).values == recorded.sort(-1).values).all(-1)


def _checkpoint_dtype(model_dir: Path) -> torch.dtype:
    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return getattr(torch, name)


def checkpoint_state_dict(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's parameters under the checkpoint's names: transformers 5 fuses each MoE layer's
    experts into ``experts.gate_up_proj`` [experts, 2 * inter, hidden] and ``experts.down_proj``
    [experts, hidden, inter]; checkpoints (and vLLM) name one expert at a time."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        tensor = param.detach().to(dtype)
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        elif prefix.endswith(".experts") and leaf == "down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


class Agreement:
    """How a trainer forward agrees with the rollout: |trainer - rollout| token log-probs over
    the completions (mean, max); the share of model inputs (tokens: any MoE layer; token
    layers) where the trainer's router picks another expert set than the rollout recorded
    (``rerouted``); and the share of tokens whose experts in this forward were another set than
    the recorded one (``used_rerouted_token_share``: 0 with replay, by construction and checked
    here on every token)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.diff_sum = 0.0
        self.diff_max = 0.0
        self.routed_tokens = self.rerouted_tokens = 0
        self.routed_layers = self.rerouted_layers = 0
        self.used_rerouted_tokens = 0

    def add(self, trainer: MoeTrainer, mb: list[Sample], batch: dict, fwd: Forward) -> None:
        with torch.no_grad():
            mask = batch["completion"]
            if any(s.rollout_logprobs is not None for s in mb):
                gap = (fwd.logprobs.detach() - batch["old"]).abs()[mask]
                self.diff_sum += float(gap.sum())
                self.diff_max = max(self.diff_max, float(gap.max()) if gap.numel() else 0.0)
                self.tokens += int(mask.sum())
            recorded = batch.get("recorded")
            if recorded is None:
                return
            inputs = batch["attention_mask"].bool().clone()
            inputs[torch.arange(len(mb)), batch["attention_mask"].sum(-1) - 1] = False
            same = _same_experts(fwd.own_routes, recorded)[inputs]  # [inputs, layers]
            self.routed_layers += int(same.numel())
            self.rerouted_layers += int((~same).sum())
            self.routed_tokens += int(same.shape[0])
            self.rerouted_tokens += int((~same.all(-1)).sum())
            used_same = _same_experts(fwd.used_routes, recorded)[inputs]
            self.used_rerouted_tokens += int((~used_same.all(-1)).sum())

    def result(self) -> dict[str, float]:
        nan = float("nan")
        return {
            "logprob_abs_diff_mean": self.diff_sum / self.tokens if self.tokens else nan,
            "logprob_abs_diff_max": self.diff_max,
            "routed_tokens": self.routed_tokens,
            "rerouted_token_share": (
                self.rerouted_tokens / self.routed_tokens if self.routed_tokens else nan
            ),
            "rerouted_layer_share": (
                self.rerouted_layers / self.routed_layers if self.routed_layers else nan
            ),
            "used_rerouted_token_share": (
                self.used_rerouted_tokens / self.routed_tokens if self.routed_tokens else nan
            ),
        }
