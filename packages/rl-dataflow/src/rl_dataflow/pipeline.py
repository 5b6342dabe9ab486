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
import itertools
import logging
import os
import resource
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import ray
import refstore
import refstore.ray as rsray

from .prefetch import Prefetcher

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
    prefetch_slots: int = 3  # trainer buffers for prefetched batches (0: no prefetch)
    # Replay stand-in: "inline" reads a micro-batch's rows before its compute, on the step's
    # thread; "alongside" reads them on a second thread while the compute runs (as a router reads
    # its indices inside the forward pass, on a GPU host).
    replay: str = "inline"

    @property
    def row_bytes(self) -> int:
        return self.layers * self.topk * 4

    @property
    def max_batch_rows(self) -> int:
        """The most R3 rows one batch can have (the rollout clips lengths to 1.4x the mean)."""
        return self.samples * int(self.mean_len * 1.4)


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
    # Small per-sample values that follow the samples (the RL loop's advantages, log-probs).
    columns: dict[str, list[Any]] = field(default_factory=dict)

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
            {name: [values[i] for i in order] for name, values in self.columns.items()},
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
                    {name: values[begin:end] for name, values in self.columns.items()},
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

    def generate(
        self, mode_name: str, format_name: str | None = None, sequence: str | None = None
    ) -> Batch:
        """The next batch of ``sequence`` (default: ``mode/format``), recordings as
        ``format_name`` (default: the config's); every sequence sees the same samples and
        recordings, step by step."""
        started = time.perf_counter()
        mode = R3Mode(mode_name)
        cfg = self.config
        r3_format = R3Format(format_name or cfg.r3_format)
        sequence = sequence or f"{mode.value}/{r3_format.value}"
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
            t0 = time.perf_counter()
            ref = rsray.client(REFSTORE_NAME).put({"topk": recordings})  # the one copy
            put_s = time.perf_counter() - t0
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
        if mode is R3Mode.REF:
            batch.timings["put"] = put_s
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
    """Materialises each micro-batch into its final layout and runs a stand-in training step.

    Two ways in: ``step(micro_batches)`` materialises synchronously (one micro-batch at a time,
    into one reused buffer); ``prefetch(key, micro_batches)`` hands over the next batch while the
    current one trains, and ``step(micro_batches, key)`` then takes the rows a background thread
    gathered into one of ``config.prefetch_slots`` preallocated buffers (``prefetch.py``)."""

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
        self._lock = threading.Lock()  # the two dicts below (prefetch and step run on two threads)
        self._held: dict[Any, list[Batch]] = {}  # prefetched batches: their refs are ours
        self._dropped: set[Any] = set()  # keys discarded before their prefetch arrived
        # Keys a step trained before their prefetch arrived (a threaded actor runs calls in no
        # set order): the late prefetch must not gather (or hold a buffer for) a finished batch.
        self._trained_early: set[Any] = set()
        self.prefetcher: Prefetcher | None = None
        if config.prefetch_slots:
            self.prefetcher = Prefetcher(
                self._gather,
                slots=config.prefetch_slots,
                slot_rows=config.max_batch_rows,
                row_shape=(config.layers, config.topk),
                dtype=np.int32,
                pinned=torch.cuda.is_available(),
            )
        self._memcpy_buffers: tuple[np.ndarray, np.ndarray] | None = None
        if config.replay not in ("inline", "alongside"):
            raise ValueError(f"replay must be 'inline' or 'alongside', got {config.replay!r}")
        self._replayer: ThreadPoolExecutor | None = None
        if config.replay == "alongside":
            self._replayer = ThreadPoolExecutor(1, thread_name_prefix="rl-dataflow-replay")

    # -- prefetch ------------------------------------------------------------------------------
    def prefetch(self, key: Any, micro_batches: list[Batch]) -> None:
        """Start gathering a batch that trains later (returns at once)."""
        assert self.prefetcher is not None, "prefetch_slots = 0"
        with self._lock:
            if key in self._trained_early:  # its step ran first and released its refs
                self._trained_early.discard(key)
                return
            if key in self._dropped:  # discarded before it got here
                self._dropped.discard(key)
                self._release_refs(micro_batches)
                return
            self._held.setdefault(key, micro_batches)
            # Under the lock: a discard landing in between must not free refs being gathered
            # (submit only queues).
            self.prefetcher.submit(key, micro_batches, _r3_rows(micro_batches))

    def discard(self, key: Any, micro_batches: list[Batch]) -> None:
        """A prefetched batch that will not train: free its buffer and its refs."""
        assert self.prefetcher is not None
        with self._lock:
            held = self._held.pop(key, None)
            if held is None:
                self._dropped.add(key)
                return
        self.prefetcher.discard(key)
        self._release_refs(held)

    def close(self) -> None:
        """End the prefetch thread and release what was prefetched but never trained."""
        if self._replayer is not None:
            self._replayer.shutdown(wait=True)
        if self.prefetcher is None:
            return
        for key in self.prefetcher.pending():
            with self._lock:
                held = self._held.pop(key, None)
            self.prefetcher.discard(key)
            if held is not None:
                self._release_refs(held)
        self.prefetcher.close()

    def _gather(self, micro_batches: list[Batch], buffer: np.ndarray) -> list[np.ndarray | None]:
        """On the prefetch thread: every micro-batch's rows, back to back in ``buffer``."""
        rows = _r3_rows(micro_batches)
        if rows > len(buffer):  # a batch bigger than a slot (longer than the config allows)
            buffer = np.empty((rows, *buffer.shape[1:]), buffer.dtype)
        out: list[np.ndarray | None] = []
        offset = 0
        for mb in micro_batches:
            if mb.r3 is None:
                out.append(None)
                continue
            n = int(mb.lengths.sum())
            out.append(self._materialise(mb, buffer[offset : offset + n]))
            offset += n
        return out

    def _materialise(self, mb: Batch, out: np.ndarray | None) -> np.ndarray:
        """``mb``'s recordings in ``out`` (or a new array when None), one copy per byte."""
        import torch

        if isinstance(mb.r3, refstore.Manifest):
            return refstore.materialize(mb.r3, out, client=rsray.client(REFSTORE_NAME))
        if out is None:
            out = np.empty(tuple(mb.r3.shape), np.int32)
        if isinstance(mb.r3, np.ndarray):
            np.copyto(out, mb.r3)
        else:  # a torch tensor, by value
            torch.from_numpy(out).copy_(mb.r3)
        return out

    def _release_refs(self, micro_batches: list[Batch]) -> None:
        refs = {
            ref
            for mb in micro_batches
            if isinstance(mb.r3, refstore.Manifest)
            for ref in mb.r3.refs
        }
        if refs:
            rsray.client(REFSTORE_NAME).release(list(refs))

    # -- the step ------------------------------------------------------------------------------
    def step(self, micro_batches: list[Batch], key: Any = None) -> dict[str, Any]:

        started = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        materialise_s = replay_s = compute_s = gather_s = 0.0
        prefetched: list[np.ndarray | None] | None = None
        prefetch_came = True
        if key is not None:  # prefetched (or, if the prefetch is late, submitted now)
            assert self.prefetcher is not None, "prefetch_slots = 0"
            with self._lock:
                prefetch_came = key in self._held
                self._held.setdefault(key, micro_batches)
                self.prefetcher.submit(key, micro_batches, _r3_rows(micro_batches))
        try:
            if key is not None:
                prefetched, gather_s = self.prefetcher.take(key)
                materialise_s = time.perf_counter() - started  # the wait for the gather
            r3_checksum, tokens_seen, materialise_s, replay_s, compute_s = self._train(
                micro_batches, prefetched, materialise_s
            )
        finally:
            # Also when the gather or the compute failed: else the buffer is held until close.
            t0 = time.perf_counter()
            if key is not None:
                assert self.prefetcher is not None
                with self._lock:
                    self._held.pop(key, None)
                    if not prefetch_came:
                        self._trained_early.add(key)
                self.prefetcher.release(key)  # the buffer may take the next batch now
            self._release_refs(micro_batches)
        timings = dict(micro_batches[0].timings) if micro_batches else {}
        timings["materialise"] = materialise_s
        timings["gather"] = gather_s  # prefetched: on the background thread, overlapped
        timings["replay"] = replay_s
        timings["compute"] = compute_s
        timings["release"] = time.perf_counter() - t0
        timings["train"] = time.perf_counter() - started
        timings["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return {
            "tokens": tokens_seen,
            "r3_bytes": _r3_rows(micro_batches) * self.config.row_bytes,
            "r3_checksum": r3_checksum,
            "timings": timings,
            "memprof": self.memprof,
        }

    def _train(
        self,
        micro_batches: list[Batch],
        prefetched: list[np.ndarray | None] | None,
        materialise_s: float,
    ) -> tuple[int, int, float, float, float]:
        """The step's micro-batches: (checksum, tokens, materialise s, replay s, compute s)."""
        import torch

        replay_s = compute_s = 0.0
        r3_checksum = 0
        tokens_seen = 0
        for i, mb in enumerate(micro_batches):
            n = int(mb.lengths.sum())
            t0 = time.perf_counter()
            tokens = self.tokens_out[:n] if n <= len(self.tokens_out) else np.empty(n, np.int32)
            np.concatenate(mb.tokens, out=tokens)
            if prefetched is not None:
                r3_rows = prefetched[i]
            elif mb.r3 is not None:
                r3_rows = self._materialise(mb, self.r3_out[:n] if n <= len(self.r3_out) else None)
            else:
                r3_rows = None
            t1 = time.perf_counter()
            materialise_s += t1 - t0
            replaying = None
            if r3_rows is not None:
                if self._replayer is not None:
                    replaying = self._replayer.submit(
                        _replay, r3_rows, r3_checksum, self.config.verify
                    )
                else:
                    r3_checksum = _replay(r3_rows, r3_checksum, self.config.verify)
            t2 = time.perf_counter()
            replay_s += t2 - t1
            hidden = self.embed[torch.from_numpy(tokens).long()]
            for _ in range(self.config.train_passes):
                hidden = torch.tanh(hidden @ self.weight)
            t3 = time.perf_counter()
            compute_s += t3 - t2
            if replaying is not None:  # the rows must stay valid until the replay has read them
                r3_checksum = replaying.result()
                replay_s += time.perf_counter() - t3
            tokens_seen += n
        return r3_checksum, tokens_seen, materialise_s, replay_s, compute_s

    def memcpy(self, nbytes: int, repeats: int = 3) -> float:
        """The baseline: seconds of one numpy copy of ``nbytes`` into a warm buffer (median)."""
        if self._memcpy_buffers is None or self._memcpy_buffers[0].nbytes < nbytes:
            src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            np.copyto(dst, src)  # both warm
            self._memcpy_buffers = (src, dst)
        src, dst = (b[:nbytes] for b in self._memcpy_buffers)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))


def _r3_rows(micro_batches: list[Batch]) -> int:
    return sum(int(mb.lengths.sum()) for mb in micro_batches if mb.r3 is not None)


def _replay(rows: np.ndarray, checksum: int, verify: bool) -> int:
    """A stand-in for replay that reads every recorded byte once: a CRC32 (``verify``) or a sum of
    64-bit words (wrapping; the cheapest full read numpy has)."""
    if verify:
        return zlib.crc32(rows, checksum)
    flat = rows.reshape(-1).view(np.uint8)
    words = flat[: len(flat) // 8 * 8].view(np.uint64)
    total = int(words.sum()) + int(flat[len(words) * 8 :].sum())
    return (checksum + total) % (1 << 64)


RolloutActor = ray.remote(num_cpus=0)(Rollout)
GroupBySampleActor = ray.remote(num_cpus=0)(GroupBySample)
SortByLengthActor = ray.remote(num_cpus=0)(SortByLength)
PackMicroBatchesActor = ray.remote(num_cpus=0)(PackMicroBatches)
# Threads: a prefetch arrives while a step runs (and a step may come before its prefetch).
TrainerActor = ray.remote(num_cpus=0, max_concurrency=4)(Trainer)


class _Driver:
    """The schedules, for actors (``Pipeline``) or plain objects (``LocalPipeline``) alike:
    ``_call`` starts a method, ``_wait`` gets its result.

    Two schedules per step: serial (``overlap=False``: rollout, stages, trainer, one after the
    other) and overlapped (``overlap=True``: while batch N trains, batch N+1 goes through the
    rollout and the stages and is handed to the trainer's prefetch; each label is its own stream
    of batches, so other labels' steps in between do not disturb it)."""

    rollout: Any
    stages: list[Any]
    pack: Any
    trainer: Any

    def _call(self, obj: Any, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def _wait(self, handle: Any) -> Any:
        raise NotImplementedError

    def _start(self) -> None:
        self._next: dict[str, tuple[str, Any]] = {}  # label -> the prefetched next batch
        self._serial = itertools.count()

    def _chain(self, mode: R3Mode, fmt: str | None, sequence: str | None = None) -> Any:
        batch = self._call(self.rollout, "generate", mode.value, fmt, sequence)
        for stage in self.stages:
            batch = self._call(stage, "run", batch)
        return self._call(self.pack, "run", batch)

    def _launch(self, mode: R3Mode, fmt: str | None, label: str) -> tuple[str, Any]:
        key = f"{label}#{next(self._serial)}"
        packed = self._chain(mode, fmt, label)
        self._call(self.trainer, "prefetch", key, packed)
        return key, packed

    def step(
        self, mode: R3Mode | str, r3_format: R3Format | str | None = None, *, overlap: bool = False
    ) -> dict[str, Any]:
        """One step end to end; with actors the driver only passes ObjectRefs along."""
        started = time.perf_counter()
        mode = R3Mode(mode)
        fmt = R3Format(r3_format).value if r3_format else None
        if not overlap:
            train = self._call(self.trainer, "step", self._chain(mode, fmt))
        else:
            label = _label(mode, fmt, overlap)
            key, packed = self._next.pop(label, None) or self._launch(mode, fmt, label)
            train = self._call(self.trainer, "step", packed, key)
            self._next[label] = self._launch(mode, fmt, label)  # runs while this batch trains
        result = self._wait(train)
        result["step_s"] = time.perf_counter() - started
        return result

    def memcpy(self, nbytes: int) -> float:
        return self._wait(self._call(self.trainer, "memcpy", nbytes))

    def drain(self) -> None:
        """Drop the batches prefetched for steps that will not come (their refs are released)."""
        pending, self._next = list(self._next.values()), {}
        for handle in [self._call(self.trainer, "discard", *batch) for batch in pending]:
            self._wait(handle)


class Pipeline(_Driver):
    """Owns the pipeline's actors, shared by the R3 modes (the box has two cores); ``close()``
    ends them."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.rollout = RolloutActor.remote(config)
        self.stages = [GroupBySampleActor.remote(), SortByLengthActor.remote()]
        self.pack = PackMicroBatchesActor.remote(config.micro_batch_tokens)
        self.trainer = TrainerActor.remote(config)
        self._start()

    def _call(self, obj: Any, method: str, *args: Any) -> Any:
        return getattr(obj, method).remote(*args)

    def _wait(self, handle: Any) -> Any:
        return ray.get(handle)

    def close(self) -> None:
        try:
            self.drain()
            ray.get(self.trainer.close.remote(), timeout=60)
        finally:
            for actor in (self.rollout, *self.stages, self.pack, self.trainer):
                ray.kill(actor)


class LocalPipeline(_Driver):
    """The same stages called in this process, without Ray (smoke runs: exercises every stage's
    code; "by value" then passes arrays by Python reference, so it measures nothing). Overlapped
    steps gather the next batch on the trainer's prefetch thread during the following steps."""

    def __init__(self, config: PipelineConfig) -> None:
        self.rollout = Rollout(config)
        self.stages = [GroupBySample(), SortByLength()]
        self.pack = PackMicroBatches(config.micro_batch_tokens)
        self.trainer = Trainer(config)
        self._start()

    def _call(self, obj: Any, method: str, *args: Any) -> Any:
        return getattr(obj, method)(*args)

    def _wait(self, handle: Any) -> Any:
        return handle

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.trainer.close()


def _label(mode: R3Mode, fmt: str | None, overlap: bool) -> str:
    """A run's name: ``off``, ``ref``, ``ref+overlap``, with ``/format`` for recording modes."""
    name = f"{mode.value}+overlap" if overlap else mode.value
    return name if fmt is None or mode is R3Mode.OFF else f"{name}/{fmt}"


Progress = Callable[[str, int, dict[str, Any]], None]


def plan_runs(
    modes: Sequence[R3Mode], formats: Sequence[R3Format], overlap: Sequence[R3Mode] = ()
) -> list[tuple[str, R3Mode, R3Format | None, bool]]:
    """(label, mode, format, overlapped) of every run, in the order a round runs them: R3 off
    once per schedule, the recording modes once per format."""
    runs: list[tuple[str, R3Mode, R3Format | None, bool]] = []
    for lap in (False, True):
        for mode in map(R3Mode, modes):
            if lap and mode not in overlap:
                continue
            for fmt in [None] if mode is R3Mode.OFF else list(map(R3Format, formats)):
                runs.append((_label(mode, fmt and fmt.value, lap), mode, fmt, lap))
    return runs


def run(
    config: PipelineConfig,
    modes: list[R3Mode],
    *,
    steps: int = 3,
    warmup: int = 1,
    pool_size: str = "2G",
    local: bool = False,
    overlap: Sequence[R3Mode] = (),
    progress: Progress | None = None,
) -> dict[str, dict[str, Any]]:
    """Run ``steps`` measured steps per mode (after ``warmup``), recordings in
    ``config.r3_format``, modes interleaved step by step so that load from other processes hits
    all of them alike. Modes in ``overlap`` run a second time in the overlapped schedule (as
    ``"<mode>+overlap"``). Returns ``{label: results}``. Needs ``ray.init()`` done, unless
    ``local`` (no Ray: stages called in this process, refstore master on a thread)."""
    fmt = R3Format(config.r3_format)
    return run_formats(
        config,
        modes,
        [fmt],
        steps=steps,
        warmup=warmup,
        pool_size=pool_size,
        local=local,
        overlap=overlap,
        progress=progress,
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
    overlap: Sequence[R3Mode] = (),
    progress: Progress | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Like ``run``, for several recording formats in one run: every (mode, format, schedule)
    interleaved step by step. R3 off records nothing, so it runs once per schedule and its
    results are shared by every format. After each round, the trainer times one memcpy of the
    bytes its last by-ref step read (``memcpy_s`` in every by-ref result). Returns ``{format:
    {label: results}}`` with labels ``off``, ``value``, ``ref``, ``off+overlap``, ``ref+overlap``.
    ``progress(label, step, outcome)`` is called after every step (``step`` < 0: warm-up)."""
    modes = [R3Mode(m) for m in modes]
    formats = [R3Format(f) for f in formats]
    runs = plan_runs(modes, formats, overlap)
    master = None
    if R3Mode.REF in modes:
        if local:
            master = refstore.MasterThread(REFSTORE_NAME, pool_size)
        else:
            rsray.start_masters(pool_size=pool_size, name=REFSTORE_NAME)
    pipeline = LocalPipeline(config) if local else Pipeline(config)
    by_label: dict[str, dict[str, Any]] = {label: {"steps": []} for label, *_ in runs}
    memcpy_s: list[float] = []
    try:
        for i in range(warmup + steps):
            ref_bytes = 0
            for label, mode, fmt, lap in runs:
                outcome = pipeline.step(mode, fmt, overlap=lap)
                if mode is R3Mode.REF:
                    ref_bytes = outcome["r3_bytes"]
                if i >= warmup:
                    by_label[label]["steps"].append(outcome)
                if progress is not None:
                    progress(label, i - warmup, outcome)
            if ref_bytes and i >= warmup:
                memcpy_s.append(pipeline.memcpy(ref_bytes))
        pipeline.drain()
        if R3Mode.REF in modes:
            # Every step released what it put: nothing may be left behind.
            objects_left = rsray.client(REFSTORE_NAME).stats().objects
            for label, mode, *_ in runs:
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
    for label, mode, *_ in runs:
        entry = by_label[label]
        times = [s["step_s"] for s in entry["steps"]]
        entry["step_s"] = float(np.median(times))
        entry["r3_checksums"] = [s["r3_checksum"] for s in entry["steps"]]
        entry["timings"] = {
            name: float(np.median([s["timings"].get(name, 0.0) for s in entry["steps"]]))
            for name in entry["steps"][0]["timings"]
        }
        entry["materialise_s"] = entry["timings"]["materialise"]
        # The step without the stand-in model's compute: the pipeline's data path end to end.
        entry["data_path_s"] = float(
            np.median([s["step_s"] - s["timings"]["compute"] for s in entry["steps"]])
        )
        if mode is R3Mode.REF and memcpy_s:
            entry["memcpy_s"] = float(np.median(memcpy_s))
    return {
        fmt.value: {
            _label(mode, None, lap): by_label[label]
            for label, mode, run_fmt, lap in runs
            if run_fmt is None or run_fmt is fmt
        }
        for fmt in formats
    }
