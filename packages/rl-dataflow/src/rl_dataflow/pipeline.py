"""A rollout -> train pipeline on Ray that carries R3 recordings by reference.

One step::

    Rollout  --Batch-->  GroupBySample  --Batch-->  SortByLength  --Batch-->  PackMicroBatches
       (token ids + R3 top-k recordings)                                           |
                                                                         list[Batch] (micro-batches)
                                                                                   v
                                                     Trainer: materialise -> stand-in step (matmul)

``Batch`` always carries the token ids by value (small). The R3 recordings (top-k indices, int32
``[tokens, layers, k]``; hundreds of MiB per batch) come out of the rollout as torch tensors (as
an inference engine's would) or numpy arrays (``R3Format``), and travel in one of three ways
(``R3Mode``):

- ``off``: not recorded at all (the baseline step time);
- ``value``: as they are (torch tensors or numpy arrays) through Ray's object store; every stage
  that reorganises samples rebuilds them (a copy) and returns them (another trip through the
  store; Ray pickles torch tensors, while numpy arrays get its zero-copy path);
- ``ref``: the rollout puts the recordings into refstore once; the stages reorganise a
  ``refstore.Manifest`` (a few bytes per sample); the trainer gathers them from shared memory
  straight into its final layout (``refstore.materialize``, one copy per byte), then releases them.

Every actor uses no CPU reservation (``num_cpus=0``), so the whole pipeline fits a 2-core box, and
turns on ``memprof`` (the always-on memory profiler) when it is importable.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import ray
import refstore
import refstore.ray as rsray

log = logging.getLogger("rl_dataflow")

REFSTORE_NAME = "rl-dataflow"


class R3Mode(enum.StrEnum):
    OFF = "off"
    VALUE = "value"
    REF = "ref"


class R3Format(enum.StrEnum):
    """What the rollout's recordings are: torch tensors (what an inference engine hands out) or
    numpy arrays (the conservative case: Ray's by-value path is cheapest for numpy)."""

    TORCH = "torch"
    NUMPY = "numpy"


class PipelineConfig(msgspec.Struct, frozen=True):
    samples: int = 64  # responses per step
    group_size: int = 8  # responses per prompt (GRPO-style groups)
    mean_len: int = 1024  # tokens per response, on average
    layers: int = 32
    topk: int = 32
    hidden: int = 1024  # stand-in model width
    train_passes: int = 1  # matmuls per micro-batch (sets the step's compute)
    micro_batch_tokens: int = 16384
    seed: int = 0
    verify: bool = False  # replay stand-in: crc32 of the recordings (tests) instead of a sum
    r3_format: str = R3Format.TORCH.value  # the rollout's recordings: "torch" or "numpy"

    @property
    def row_bytes(self) -> int:
        return self.layers * self.topk * 4


@dataclass
class Batch:
    """What flows between stages. ``r3`` is None (off), an ndarray (value) or a Manifest (ref)."""

    sample_ids: np.ndarray  # int64 [samples]
    prompt_ids: np.ndarray  # int64 [samples]
    lengths: np.ndarray  # int64 [samples]
    tokens: list[np.ndarray]  # per sample int32 [length]
    r3: Any = None
    r3_offsets: np.ndarray | None = None  # value mode: row offset of each sample in ``r3``
    timings: dict[str, float] = field(default_factory=dict)

    def reorder(self, order: np.ndarray) -> Batch:
        """The samples in a new order; recordings follow (by value: copied, by ref: metadata)."""
        r3, offsets = self.r3, None
        if isinstance(r3, refstore.Manifest):
            r3 = r3.take(order)
        elif r3 is not None:  # by value: a numpy array or a torch tensor
            assert self.r3_offsets is not None
            pieces = [r3[self.r3_offsets[i] : self.r3_offsets[i] + self.lengths[i]] for i in order]
            r3 = _concatenate(pieces) if pieces else r3[:0]
            offsets = np.concatenate(([0], np.cumsum(self.lengths[order])[:-1]))
        return Batch(
            self.sample_ids[order],
            self.prompt_ids[order],
            self.lengths[order],
            [self.tokens[i] for i in order],
            r3,
            offsets,
            dict(self.timings),
        )

    def split(self, bounds: list[tuple[int, int]]) -> list[Batch]:
        out = []
        for begin, end in bounds:
            index = np.arange(begin, end)
            if isinstance(self.r3, refstore.Manifest):
                r3, offsets = self.r3[begin:end], None
            elif self.r3 is not None:  # by value: a numpy array or a torch tensor
                assert self.r3_offsets is not None
                lo = self.r3_offsets[begin]
                hi = self.r3_offsets[end - 1] + self.lengths[end - 1]
                # A copy: a view would keep the whole batch's array alive in every micro-batch
                # (and a pickled torch view would carry the whole batch's storage along).
                r3 = _copy(self.r3[lo:hi])
                offsets = self.r3_offsets[begin:end] - lo
            else:
                r3, offsets = None, None
            out.append(
                Batch(
                    self.sample_ids[index],
                    self.prompt_ids[index],
                    self.lengths[index],
                    self.tokens[begin:end],
                    r3,
                    offsets,
                    dict(self.timings),
                )
            )
        return out


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _concatenate(pieces: list[Any]) -> Any:
    if _is_torch_tensor(pieces[0]):
        import torch

        return torch.cat(pieces)
    return np.concatenate(pieces)


def _copy(rows: Any) -> Any:
    return rows.clone() if _is_torch_tensor(rows) else rows.copy()


def _start_memprof() -> bool:
    """Turn the always-on memory profiler on in this actor, if it is installed and works."""
    if os.environ.get("RL_DATAFLOW_MEMPROF", "1") == "0":
        return False
    try:
        import memprof

        if not memprof.is_running():
            memprof.start(out_dir=os.environ.get("RL_DATAFLOW_MEMPROF_DIR"))
        return True
    except Exception as err:  # profiling is optional: never fail the pipeline for it
        log.warning("memprof not started: %s: %s", type(err).__name__, err)
        return False


class Rollout:
    """Stands in for the inference engine: its recordings already sit in an output buffer, as a
    real engine's top-k indices would after a forward pass; recording them is what costs."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.memprof = _start_memprof()
        self.capacity = int(config.samples * config.mean_len * 1.5)
        buf_rng = np.random.default_rng(config.seed + 1)
        self.engine_output = buf_rng.integers(
            0, 1 << 16, (self.capacity, config.layers, config.topk), dtype=np.int32
        )
        self.rngs: dict[str, np.random.Generator] = {}
        self.steps: dict[str, int] = {}

    def generate(self, mode_name: str, format_name: str | None = None) -> Batch:
        """The next batch of ``mode_name``'s sequence, recordings as ``format_name`` (default: the
        config's); every mode and format sees the same sequence of samples and recordings."""
        started = time.perf_counter()
        mode = R3Mode(mode_name)
        cfg = self.config
        r3_format = R3Format(format_name or cfg.r3_format)
        sequence = f"{mode.value}/{r3_format.value}"
        if sequence not in self.rngs:
            self.rngs[sequence] = np.random.default_rng(cfg.seed)
            self.steps[sequence] = 0
        rng, step = self.rngs[sequence], self.steps[sequence]
        self.steps[sequence] += 1
        n = cfg.samples
        lengths = np.clip(
            rng.normal(cfg.mean_len, cfg.mean_len / 4, n).astype(np.int64),
            16,
            int(cfg.mean_len * 1.4),
        )
        groups = n // cfg.group_size
        prompt_ids = rng.permutation(np.repeat(np.arange(groups), cfg.group_size))
        prompt_ids = np.concatenate([prompt_ids, np.arange(n - len(prompt_ids))]) + step * n
        sample_ids = np.arange(n, dtype=np.int64) + step * n
        tokens = [rng.integers(0, 32000, int(length), dtype=np.int32) for length in lengths]
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        total = int(lengths.sum())
        start = int(rng.integers(0, self.capacity - total + 1))
        recordings: Any = self.engine_output[start : start + total]
        if r3_format is R3Format.TORCH and mode is not R3Mode.OFF:
            import torch

            # A tensor over exactly this batch's rows (its storage is just these rows, so pickling
            # it carries no more than the batch), as an engine's output tensor would be.
            recordings = torch.from_numpy(recordings)
        r3: Any = None
        if mode is R3Mode.VALUE:
            # Returned from this actor as it is: Ray copies it into its object store (numpy) or
            # pickles it there (torch).
            r3 = recordings
        elif mode is R3Mode.REF:
            ref = rsray.client(REFSTORE_NAME).put({"topk": recordings})  # the one copy
            r3 = refstore.Manifest.from_packed(
                ref,
                lengths,
                dtype=np.int32,
                row_shape=(cfg.layers, cfg.topk),
                key="topk",
                sample_ids=sample_ids,
            )
        batch = Batch(
            sample_ids, prompt_ids, lengths, tokens, r3, offsets if r3 is not None else None
        )
        batch.timings["rollout"] = time.perf_counter() - started
        return batch


class GroupBySample:
    """Brings each prompt's responses together (e.g. for group-relative advantages)."""

    def __init__(self) -> None:
        _start_memprof()

    def run(self, batch: Batch) -> Batch:
        started = time.perf_counter()
        out = batch.reorder(np.argsort(batch.prompt_ids, kind="stable"))
        out.timings["group"] = time.perf_counter() - started
        return out


class SortByLength:
    """Longest first, so micro-batches are packed tightly."""

    def __init__(self) -> None:
        _start_memprof()

    def run(self, batch: Batch) -> Batch:
        started = time.perf_counter()
        out = batch.reorder(np.argsort(-batch.lengths, kind="stable"))
        out.timings["sort"] = time.perf_counter() - started
        return out


class PackMicroBatches:
    """Cuts the batch into micro-batches of at most ``max_tokens`` tokens (long samples alone)."""

    def __init__(self, max_tokens: int) -> None:
        _start_memprof()
        self.max_tokens = max_tokens

    def run(self, batch: Batch) -> list[Batch]:
        started = time.perf_counter()
        bounds, begin, tokens = [], 0, 0
        for i, n in enumerate(batch.lengths.tolist()):
            if tokens and tokens + n > self.max_tokens:
                bounds.append((begin, i))
                begin, tokens = i, 0
            tokens += n
        if begin < len(batch.lengths):
            bounds.append((begin, len(batch.lengths)))
        out = batch.split(bounds)
        elapsed = time.perf_counter() - started
        for mb in out:
            mb.timings["pack"] = elapsed
        return out


class Trainer:
    """Materialises each micro-batch into its final layout and runs a stand-in training step."""

    def __init__(self, config: PipelineConfig) -> None:
        import torch

        self.memprof = _start_memprof()
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        self.embed = torch.randn(32000, config.hidden, generator=gen) * 0.02
        self.weight = torch.randn(config.hidden, config.hidden, generator=gen) * 0.02
        # The final layouts, allocated once: packed token ids and packed R3 rows.
        self.tokens_out = np.empty(config.micro_batch_tokens * 2, np.int32)
        rows = config.micro_batch_tokens * 2
        self.r3_out = np.empty((rows, config.layers, config.topk), np.int32)

    def step(self, micro_batches: list[Batch]) -> dict[str, Any]:
        import torch

        started = time.perf_counter()
        materialise_s = 0.0
        compute_s = 0.0
        r3_checksum = 0
        tokens_seen = 0
        for mb in micro_batches:
            n = int(mb.lengths.sum())
            t0 = time.perf_counter()
            tokens = self.tokens_out[:n] if n <= len(self.tokens_out) else np.empty(n, np.int32)
            np.concatenate(mb.tokens, out=tokens)
            r3_rows = None
            if isinstance(mb.r3, refstore.Manifest):
                out = self.r3_out[:n] if n <= len(self.r3_out) else None
                r3_rows = refstore.materialize(mb.r3, out, client=rsray.client(REFSTORE_NAME))
            elif isinstance(mb.r3, np.ndarray):
                out = self.r3_out[:n] if n <= len(self.r3_out) else np.empty_like(mb.r3)
                np.copyto(out, mb.r3)
                r3_rows = out
            elif mb.r3 is not None:  # a torch tensor, by value
                out = self.r3_out[:n] if n <= len(self.r3_out) else np.empty(mb.r3.shape, np.int32)
                torch.from_numpy(out).copy_(mb.r3)
                r3_rows = out
            materialise_s += time.perf_counter() - t0
            if r3_rows is not None:
                # A stand-in for replay that reads every recorded byte once.
                if self.config.verify:
                    r3_checksum = zlib.crc32(r3_rows, r3_checksum)
                else:
                    r3_checksum += int(r3_rows.sum(dtype=np.int64))
            t0 = time.perf_counter()
            hidden = self.embed[torch.from_numpy(tokens).long()]
            for _ in range(self.config.train_passes):
                hidden = torch.tanh(hidden @ self.weight)
            compute_s += time.perf_counter() - t0
            tokens_seen += n
        refs = {
            ref
            for mb in micro_batches
            if isinstance(mb.r3, refstore.Manifest)
            for ref in mb.r3.refs
        }
        if refs:
            rsray.client(REFSTORE_NAME).release(list(refs))
        timings = dict(micro_batches[0].timings) if micro_batches else {}
        timings["materialise"] = materialise_s
        timings["compute"] = compute_s
        timings["train"] = time.perf_counter() - started
        return {
            "tokens": tokens_seen,
            "r3_checksum": r3_checksum,
            "timings": timings,
            "memprof": self.memprof,
        }


RolloutActor = ray.remote(num_cpus=0)(Rollout)
GroupBySampleActor = ray.remote(num_cpus=0)(GroupBySample)
SortByLengthActor = ray.remote(num_cpus=0)(SortByLength)
PackMicroBatchesActor = ray.remote(num_cpus=0)(PackMicroBatches)
TrainerActor = ray.remote(num_cpus=0)(Trainer)


class Pipeline:
    """Owns the pipeline's actors, shared by the R3 modes (the box has two cores); ``close()``
    ends them."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.rollout = RolloutActor.remote(config)
        self.stages = [GroupBySampleActor.remote(), SortByLengthActor.remote()]
        self.pack = PackMicroBatchesActor.remote(config.micro_batch_tokens)
        self.trainer = TrainerActor.remote(config)

    def step(self, mode: R3Mode | str, r3_format: R3Format | str | None = None) -> dict[str, Any]:
        """One step end to end; the driver only passes ObjectRefs along (never the batches)."""
        started = time.perf_counter()
        fmt = R3Format(r3_format).value if r3_format else None
        batch = self.rollout.generate.remote(R3Mode(mode).value, fmt)
        for stage in self.stages:
            batch = stage.run.remote(batch)
        result = ray.get(self.trainer.step.remote(self.pack.run.remote(batch)))
        result["step_s"] = time.perf_counter() - started
        return result

    def close(self) -> None:
        for actor in (self.rollout, *self.stages, self.pack, self.trainer):
            ray.kill(actor)


class LocalPipeline:
    """The same stages called in this process, without Ray (smoke runs: exercises every stage's
    code; "by value" then passes arrays by Python reference, so it measures nothing)."""

    def __init__(self, config: PipelineConfig) -> None:
        self.rollout = Rollout(config)
        self.stages = [GroupBySample(), SortByLength()]
        self.pack = PackMicroBatches(config.micro_batch_tokens)
        self.trainer = Trainer(config)

    def step(self, mode: R3Mode | str, r3_format: R3Format | str | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        fmt = R3Format(r3_format).value if r3_format else None
        batch = self.rollout.generate(R3Mode(mode).value, fmt)
        for stage in self.stages:
            batch = stage.run(batch)
        result = self.trainer.step(self.pack.run(batch))
        result["step_s"] = time.perf_counter() - started
        return result

    def close(self) -> None:
        pass


def run(
    config: PipelineConfig,
    modes: list[R3Mode],
    *,
    steps: int = 3,
    warmup: int = 1,
    pool_size: str = "2G",
    local: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run ``steps`` measured steps per mode (after ``warmup``), recordings in
    ``config.r3_format``, modes interleaved step by step so that load from other processes hits
    all of them alike. Returns ``{mode: results}``. Needs ``ray.init()`` done, unless ``local``
    (no Ray: stages called in this process, refstore master on a thread)."""
    fmt = R3Format(config.r3_format)
    return run_formats(
        config, modes, [fmt], steps=steps, warmup=warmup, pool_size=pool_size, local=local
    )[fmt.value]


def run_formats(
    config: PipelineConfig,
    modes: list[R3Mode],
    formats: list[R3Format],
    *,
    steps: int = 3,
    warmup: int = 1,
    pool_size: str = "2G",
    local: bool = False,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Like ``run``, for several recording formats in one run: every (mode, format) interleaved
    step by step. R3 off records nothing, so it runs once and its results are shared by every
    format. Returns ``{format: {mode: results}}``."""
    modes = [R3Mode(m) for m in modes]
    formats = [R3Format(f) for f in formats]
    # (label, mode, format): "off" once, the recording modes once per format.
    runs: list[tuple[str, R3Mode, R3Format | None]] = []
    for mode in modes:
        if mode is R3Mode.OFF:
            runs.append((mode.value, mode, None))
        else:
            runs.extend((f"{mode.value}/{fmt.value}", mode, fmt) for fmt in formats)
    master = None
    if R3Mode.REF in modes:
        if local:
            master = refstore.MasterThread(REFSTORE_NAME, pool_size)
        else:
            rsray.start_masters(pool_size=pool_size, name=REFSTORE_NAME)
    pipeline = LocalPipeline(config) if local else Pipeline(config)
    by_label: dict[str, dict[str, Any]] = {label: {"steps": []} for label, _, _ in runs}
    try:
        for i in range(warmup + steps):
            for label, mode, fmt in runs:
                outcome = pipeline.step(mode, fmt)
                if i >= warmup:
                    by_label[label]["steps"].append(outcome)
        if R3Mode.REF in modes:
            # Every step released what it put: nothing may be left behind.
            objects_left = rsray.client(REFSTORE_NAME).stats().objects
            for label, mode, _ in runs:
                if mode is R3Mode.REF:
                    by_label[label]["objects_left"] = objects_left
    finally:
        pipeline.close()
        if R3Mode.REF in modes:
            rsray.close_clients()
            if master is not None:
                master.close()
            else:
                rsray.stop_masters(REFSTORE_NAME)
    for entry in by_label.values():
        times = [s["step_s"] for s in entry["steps"]]
        entry["step_s"] = float(np.median(times))
        entry["r3_checksums"] = [s["r3_checksum"] for s in entry["steps"]]
        entry["materialise_s"] = float(
            np.median([s["timings"]["materialise"] for s in entry["steps"]])
        )
        # The step without the stand-in model's compute: the pipeline's data path end to end.
        entry["data_path_s"] = float(
            np.median([s["step_s"] - s["timings"]["compute"] for s in entry["steps"]])
        )
    return {
        fmt.value: {
            mode.value: by_label[label]
            for label, mode, run_fmt in runs
            if run_fmt is None or run_fmt is fmt
        }
        for fmt in formats
    }
