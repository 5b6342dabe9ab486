"""A real RL loop on a tiny MoE model: vLLM rollout -> R3 records by reference -> GRPO -> reload.

One step::

    vLLM LLM (offline, in this process)         refstore (pool)          MoeTrainer (torch)
    generate G samples per prompt               the recorder's objects:
      + per-token logprobs                      one per request, rows
      + the connector's R3 recorder  -------->  [tokens, layers, top_k]
    reward, group advantages                        |  Manifest over them (no copy)
    Batch(tokens, advantages, logprobs, Manifest) -> GroupBySample -> SortByLength
                                                  -> PackMicroBatches -> [Batch]
                                                                            |
                    trainer: gather each micro-batch's records into its padded layout (one
                    copy), replay them in every MoE block, GRPO loss, backward; one Adam step;
                    release the objects
    <-- model.safetensors into the model dir, collective_rpc(reload_moe_weights),
        reset_prefix_cache()  (the next rollout samples from the new policy)

``LoopConfig.serving = "pd"`` runs the rollout on a 1P1D of vLLM's OpenAI servers behind
pd-serving's proxy instead (``rollout.PdEngine``): P records the prompt's routing while it
prefills, D pulls those rows with the KV, records the rest and stores the whole record; the
weight sync reloads P and D alike.

Routing records come from one function (``RecordSource``); the default, ``engine_records``,
takes the engine's own recorder's objects (HybridConnector with ``kv_connector_extra_config["r3"]``
on; ``hybrid_connector.r3``) by reference, straight into the manifest.

``R3`` modes: ``off`` records nothing (the connector runs without r3) and the trainer routes by
itself; ``replay`` (R3 on) replays the records. With ``compare`` the trainer also runs the batch
without replay (no gradient) to count how often its own routing differs from the rollout's.

``R3Transport``: ``ref`` (the default) carries a manifest as above; ``value`` carries the records
as verl and slime do, by value through Ray's object store: the rollout copies them out (an
engine that returns routing with its output hands over such an array), ``ray.put`` -> ``ray.get``
to the stages (the rollout worker's answer to the driver), the stages rebuild the arrays as they
reorder and cut the batch, ``ray.put`` -> ``ray.get`` of each micro-batch's rows to the trainer,
which copies them into its padded layout. Only the records go through Ray (the token ids and
advantages do not, in either transport), so the two differ by how the records travel alone.
Ray starts in this process for ``value`` only (``ray.init(num_cpus=2)``).

memprof runs in this process (as in every pipeline actor), and in the P and D servers of
``serving="pd"``.
"""

from __future__ import annotations

import enum
import os
import shutil
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import ray
import refstore

from .pipeline import Batch, GroupBySample, PackMicroBatches, SortByLength, _start_memprof
from .rollout import (
    OfflineEngine,
    PdEngine,
    RolloutEngine,
    SamplingSpec,
    Serving,
    reload_moe_weights,
)

__all__ = [
    "R3",
    "LoopConfig",
    "R3Transport",
    "RLLoop",
    "Serving",
    "reload_moe_weights",
    "run_loop",
]

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
    REPLAY = "replay"


class R3Transport(enum.StrEnum):
    REF = "ref"  # a refstore Manifest over the engine's own objects: no copy before the gather
    VALUE = "value"  # the records copied out and sent through Ray's object store (verl, slime)


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
    r3_transport: str = R3Transport.REF.value  # how the records go from rollout to trainer
    compare: bool = False  # also measure the batch without replay (R3 on only)
    micro_batch_tokens: int = 192
    temperature: float = 1.0
    seed: int = 0
    # Where the rollout runs (rollout.Serving): "offline", vLLM in this process; "pd", a 1P1D of
    # vLLM's OpenAI servers behind pd-serving's proxy (R3 records come through the KV hand-off).
    serving: str = Serving.OFFLINE.value
    kv_cache_bytes: int = 64 << 20
    pool_size: str = "64M"


def reward(completion: np.ndarray, config: LoopConfig) -> float:
    """A verifiable toy reward: the share of generated tokens in the target set."""
    completion = np.asarray(completion)
    inside = (completion >= config.target_lo) & (completion < config.target_hi)
    return float(inside.mean()) if len(completion) else 0.0


# -- routing records ---------------------------------------------------------------------------

# (the engine's finished requests, each sample's token ids, the loop's refstore client) -> a
# Manifest of each sample's routing rows [len(tokens) - 1, layers, top_k], in sample order; the
# trainer releases its refs once it has trained on them.
RecordSource = Callable[[Sequence[Any], Sequence[np.ndarray], refstore.Client], refstore.Manifest]


class RecordError(RuntimeError):
    """A request's routing record is missing, incomplete or not the sample's shape."""


def engine_records(
    outputs: Sequence[Any],
    tokens: Sequence[np.ndarray],
    client: refstore.Client,
    timeout_s: float = 10.0,
    subscription: refstore.KeySubscription | None = None,
) -> refstore.Manifest:
    """The engine recorder's own objects, by reference: each finished request's
    ``kv_transfer_params["r3"]`` names a keyed object in refstore (``hybrid_connector.r3``) that
    the worker stores just after the request ends; the manifest points at those objects (one per
    sample, rows from 0), so no routing byte is copied before the trainer's gather. A record the
    engine knew incomplete is refused here; the rows themselves are checked where they are read
    (``check_rows``, on the trainer's gather: no read of each object before it). Records not
    stored yet are waited for on the master's key events (``subscription``: a long-lived one of
    the caller's; else one for this call)."""
    keys, lengths, geometry = [], [], None
    for output, ids in zip(outputs, tokens, strict=True):
        params = (output.kv_transfer_params or {}).get("r3")
        if params is None:
            raise RecordError(f"request {output.request_id}: no r3 record (is r3 on?)")
        if not params.get("complete", False):
            raise RecordError(f"request {output.request_id}: r3 record incomplete")
        if int(params["tokens"]) != len(ids) - 1:
            raise RecordError(
                f"request {output.request_id}: r3 record of {params['tokens']} tokens, the"
                f" sample has {len(ids) - 1} model inputs"
            )
        mine = (int(params["layers"]), int(params["top_k"]), str(params["dtype"]))
        if geometry is not None and mine != geometry:
            raise RecordError(f"r3 records of two shapes in one batch: {geometry}, {mine}")
        geometry = mine
        keys.append(str(params["key"]).encode())
        lengths.append(len(ids) - 1)
    refs = _lookup_all(client, keys, timeout_s, subscription)
    assert geometry is not None
    layers, top_k, dtype = geometry
    return refstore.Manifest.from_refs(refs, lengths, dtype=dtype, row_shape=(layers, top_k))


def check_rows(rows: np.ndarray, lengths: np.ndarray, sample_ids: np.ndarray) -> None:
    """``rows`` of records as gathered, ``[samples, longest, layers, top_k]`` (padded) or
    ``[rows, layers, top_k]`` (packed, samples back to back): ``RecordError`` if a row of a
    sample is missing (an id equal to its dtype's maximum, "no row", in ``hybrid_connector.r3``)."""
    missing = (rows == np.iinfo(rows.dtype).max).reshape(*rows.shape[: rows.ndim - 2], -1).any(-1)
    if rows.ndim == 4:  # padded: the rows past each sample's length are padding
        missing &= np.arange(rows.shape[1]) < np.asarray(lengths)[:, None]
        bad = np.flatnonzero(missing.any(-1))
    else:
        bad = np.unique(np.searchsorted(np.cumsum(lengths), np.flatnonzero(missing), "right"))
    if len(bad):
        raise RecordError(
            f"r3 records of samples {np.asarray(sample_ids)[bad][:5].tolist()}: rows missing"
        )


def copy_records(manifest: refstore.Manifest, client: refstore.Client) -> np.ndarray:
    """The records of ``manifest`` as one array ``[rows, layers, top_k]`` (samples back to back,
    a copy, checked whole), the store's objects released: what an engine that returns routing by
    value with its output hands over."""
    try:
        rows = refstore.materialize(manifest, client=client, layout="packed")
    finally:
        client.release(list(manifest.refs))
    check_rows(rows, manifest.length, manifest.sample_id)
    return rows


def _lookup_all(
    client: refstore.Client,
    keys: list[bytes],
    timeout_s: float,
    subscription: refstore.KeySubscription | None = None,
) -> list[Any]:
    """The refs of ``keys``: one lookup when every record is stored already; else one more after
    each batch of the master's key events (on ``subscription``, or one of its own for this call),
    until every key is bound or ``timeout_s`` passed. A lookup finds the keys up to the first
    one not bound, so each round asks once, from there."""
    if subscription is not None and subscription.alive:
        subscription.take()  # older events: what they name is bound now, the lookup finds it
    found = client.lookup(keys, hold_s=0)
    if len(found) < len(keys):
        own = subscription is None or not subscription.alive
        events = client.subscribe_keys() if own else subscription
        try:
            deadline = time.monotonic() + timeout_s
            while len(found) < len(keys):
                found += client.lookup(keys[len(found) :], hold_s=0)  # bound since
                left = deadline - time.monotonic()
                if len(found) == len(keys) or left <= 0 or not events.alive:
                    break
                if events.wait(left):
                    events.take()
        finally:
            if own:
                events.close()
    if len(found) < len(keys):
        missing = [k.decode() for k in keys[len(found) :]]
        raise RecordError(f"{len(missing)} r3 records not in the store: {missing[:3]}")
    return found


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
        self.by_value = R3Transport(config.r3_transport) is R3Transport.VALUE
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
            self.engine = self._make_engine(Path(work_dir))
            self._closers.append(self.engine.close)
            from .trainer import MoeTrainer

            self.trainer = MoeTrainer(self.model_dir, lr=config.lr, seed=config.seed)
            self.records: RecordSource | None = None
            if R3(config.r3) is R3.REPLAY:
                # One subscription to the master's key events for the loop's life: a record not
                # stored yet is waited for without a new connection and thread each step.
                key_events = self.client.subscribe_keys()
                self._closers.append(key_events.close)
                self.records = record_source or partial(engine_records, subscription=key_events)
            if self.by_value and self.records is not None:
                from .cli import init_ray

                init_ray(object_store_gib=1.0)
                self._closers.append(ray.shutdown)
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

    def _make_engine(self, work_dir: Path) -> RolloutEngine:
        cfg = self.config
        store = REFSTORE_NAME if R3(cfg.r3) is R3.REPLAY else None
        max_model_len = cfg.prompt_len + cfg.completion_len + 16
        max_num_seqs = max(16, cfg.prompts * cfg.group_size)
        if Serving(cfg.serving) is Serving.PD:
            log_dir = work_dir / "pd-logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            return PdEngine(
                self.model_dir,
                log_dir,
                r3_store=store,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                kv_cache_bytes=cfg.kv_cache_bytes,
            )
        return OfflineEngine(
            self.model_dir,
            r3_store=store,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_bytes=cfg.kv_cache_bytes,
            seed=cfg.seed,
        )

    # -- one step --------------------------------------------------------------------------------
    def rollout(self) -> tuple[Batch, dict[str, float]]:
        cfg = self.config
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        n = cfg.prompts * cfg.group_size
        prompt_ids = np.repeat(np.arange(cfg.prompts), cfg.group_size)
        base = (cfg.seed * 1_000_003 + self.steps) * n
        outputs = self.engine.generate(
            [self.prompts[p].tolist() for p in prompt_ids],
            [base + i for i in range(n)],
            SamplingSpec(max_tokens=cfg.completion_len, temperature=cfg.temperature),
        )
        timings["generate"] = time.perf_counter() - t0
        tokens, completions, logprobs = [], [], []
        for out in outputs:
            completion = np.asarray(out.token_ids, np.int32)
            tokens.append(np.concatenate([np.asarray(out.prompt_token_ids, np.int32), completion]))
            completions.append(completion)
            logprobs.append(np.asarray(out.logprobs, np.float32))
        rewards = np.array([reward(c, cfg) for c in completions])
        from .trainer import group_advantages

        advantages = group_advantages(rewards, prompt_ids)
        lengths = np.array([len(t) - 1 for t in tokens], np.int64)  # model inputs per sample
        sample_ids = np.arange(n, dtype=np.int64) + self.steps * n
        r3: Any = None
        offsets = None
        if self.records is not None:
            t1 = time.perf_counter()
            r3 = self.records(outputs, tokens, self.client)
            r3.sample_id[:] = sample_ids
            if self.by_value:
                r3 = copy_records(r3, self.client)
                offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            timings["records"] = time.perf_counter() - t1
        batch = Batch(
            sample_ids,
            prompt_ids.astype(np.int64) + self.steps * cfg.prompts,
            lengths,
            tokens,
            r3,
            offsets,
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
        recorded: list[np.ndarray | None] = []
        materialise_s = 0.0
        try:
            for mb in micro_batches:
                rows = None
                if isinstance(mb.r3, refstore.Manifest):
                    t1 = time.perf_counter()
                    # One copy per byte, straight into the trainer's padded layout.
                    rows = refstore.materialize(mb.r3, client=self.client, layout="padded")
                    check_rows(rows, mb.r3.length, mb.sample_ids)
                    materialise_s += time.perf_counter() - t1
                elif mb.r3 is not None:  # by value: the rows Ray delivered, into that layout
                    t1 = time.perf_counter()
                    rows = _padded(mb)
                    materialise_s += time.perf_counter() - t1
                recorded.append(rows)
                groups.append(
                    [
                        Sample(
                            tokens,
                            int(mb.columns["prompt_len"][i]),
                            float(mb.columns["advantage"][i]),
                            mb.columns["logprobs"][i],
                        )
                        for i, tokens in enumerate(mb.tokens)
                    ]
                )
            compared = {}
            if self.config.compare and replay:  # the same batch, the same weights, no replay
                t1 = time.perf_counter()
                compared = self.trainer.measure(groups, replay=False, recorded=recorded)
                compared = {f"{k}_without_replay": v for k, v in compared.items()}
                compared["compare_s"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            stats = {
                **self.trainer.grpo_step(groups, replay=replay, recorded=recorded),
                **compared,
            }
            # Without the agreement figures: measurements, not part of a training step.
            compute_s = time.perf_counter() - t1 - stats["agreement_s"]
        finally:
            t1 = time.perf_counter()
            refs = {
                ref
                for mb in micro_batches
                if isinstance(mb.r3, refstore.Manifest)
                for ref in mb.r3.refs
            }
            if refs:
                self.client.release(list(refs))
            release_s = time.perf_counter() - t1
        return stats, {
            "materialise": materialise_s,
            "compute": compute_s,
            "release": release_s,
            "train": time.perf_counter() - t0,
        }

    def sync_weights(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.trainer.export_weights(self.model_dir)
        t1 = time.perf_counter()
        self.engine.reload_weights()
        t2 = time.perf_counter()
        return {"export": t1 - t0, "reload": t2 - t1}

    def step(self) -> dict[str, Any]:
        """One RL step; returns the reward of this step's rollout, the trainer's statistics and
        timings (seconds)."""
        started = time.perf_counter()
        batch, timings = self.rollout()
        reward_mean = timings.pop("reward")
        t0 = time.perf_counter()
        ray_s = 0.0
        if self.by_value and batch.r3 is not None:
            batch.r3 = _through_ray(batch.r3)  # the rollout worker's answer to the driver
            ray_s += time.perf_counter() - t0
        for stage in self.stages:
            batch = stage.run(batch)
        micro_batches = self.pack.run(batch)
        if self.by_value and batch.r3 is not None:
            t1 = time.perf_counter()
            for mb in micro_batches:  # the driver's dispatch to the trainer
                mb.r3 = _through_ray(mb.r3)
            ray_s += time.perf_counter() - t1
        timings["stages"] = time.perf_counter() - t0 - ray_s
        if self.by_value:
            timings["ray"] = ray_s
        stats, train_timings = self.train(micro_batches)
        timings.update(train_timings)
        # Without the weight sync, nor the measurements (the comparison's extra forward pass,
        # the agreement figures).
        measured = stats.get("compare_s", 0.0) + stats["agreement_s"]
        timings["step"] = time.perf_counter() - started - measured
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


def _through_ray(rows: np.ndarray) -> np.ndarray:
    """``rows`` by value through Ray's object store: put (a copy into it), get (numpy comes back
    zero-copy, read-only)."""
    return ray.get(ray.put(rows))


def _padded(mb: Batch) -> np.ndarray:
    """A by-value micro-batch's rows in the trainer's padded layout ``[samples, longest,
    layers, top_k]`` (a copy; what ``materialize(layout="padded")`` makes by reference)."""
    assert mb.r3_offsets is not None
    lengths = mb.lengths
    out = np.zeros((len(lengths), int(lengths.max()), *mb.r3.shape[1:]), mb.r3.dtype)
    for i, (offset, n) in enumerate(zip(mb.r3_offsets.tolist(), lengths.tolist(), strict=True)):
        out[i, :n] = mb.r3[offset : offset + n]
    return out


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
            "memprof": loop.memprof,  # in this process
            "engine_memprof": loop.engine.memprof(),  # in each server process (pd)
        }
    finally:
        loop.close()
