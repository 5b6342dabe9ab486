"""R3 in the worker: the routing buffer, the routers' capture hooks, the copies into the store.

``R3Recorder.attach`` allocates the routing buffer as one more "layer" of the attention group:
a tensor of the same shape, strides and dtype as that group's KV layers, whose first
``block_size * row_nbytes`` bytes per block hold one routing row per token slot (``r3.py``).
Since it is a layer of the group like any other, every path that moves the group's blocks (PD
pulls, KVS saves and loads, migration) moves the rows with them, byte for byte; a pull between
instances whose group layouts differ (block size, TP heads) would reorder those bytes as KV,
so ``r3.check_peer`` refuses it (D recomputes, and records its own rows).

Each MoE router's capture hook (vLLM's ``BaseRouter.set_capture_fn``: called in every forward
with the logical ``topk_ids``, before EPLB mapping) sends the ids to the step's token slots (the
forward context's slot mapping of the attention group; the pass's first MoE layer plans their
flat index). On a GPU each hook writes at once, on the device, without a host sync (padding
slots, negative, are sent to a row of vLLM's null block, which no request owns, instead of being
filtered out).

On a CPU the hooks only keep: the pass's first MoE layer a copy of its slots (vLLM refills one
slot tensor in place), every layer its ``topk_ids`` (fresh tensors each layer); the resets of
fresh blocks are kept with them, in order. ``flush`` writes what is kept, in order, one numpy
scatter per pass. Between torch kernels every numpy call runs on cold caches (about ten times
its warm cost), so the writes wait for a step that needs the buffer current and then run back
to back, warm: ``begin_step`` flushes before any step whose metadata moves, offers, loads,
saves, copies out or frees blocks (``moves_blocks``), and ``step_done`` after that step's
forward pass; a quiet run of decode steps flushes every ``KEEP_PASSES`` passes. Nothing reads
the buffer, or hands a block to another writer, but through that metadata: a pull or a save of
blocks starts from it, a record's copy too.

``begin_step`` (from the metadata, before the step's forward pass): ``copy_out`` gathers the
finished requests' rows and hands them to the put thread, which stores them under the records'
keys (only TP rank 0 stores: every rank holds the same rows); then the blocks newly given to
requests are reset to "no row" (after the copy: a finished request's freed block may be among
them); then the step's capture check starts: ``report`` (after the forward pass) names the
steps whose pass left some MoE layer without the routing of all the step's tokens.

Imports torch; vLLM's objects (routers, the slot mapping) come from ``connector.py``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch

from hybrid_connector import r3
from hybrid_connector.config import R3Config
from hybrid_connector.errors import ConfigError
from hybrid_connector.metadata import HybridConnectorMetadata, R3Copy

log = logging.getLogger(__name__)


class _Pass(NamedTuple):
    """CPU: a forward pass kept unwritten: its slots, its layers' (layer, topk_ids)."""

    slots: list[int]
    layers: list[tuple[int, torch.Tensor]]


class _Reset(NamedTuple):
    """CPU: blocks newly given to requests, to be "no row" again, kept in order."""

    blocks: list[int]


class _Records(NamedTuple):
    """One step's finished requests for the put thread: their rows, gathered in one copy, and
    per record its key, its request, its first row in ``rows`` and its number of rows."""

    rows: np.ndarray  # [gathered rows, layers, top_k]
    records: list[tuple[str, str, int, int]]


_TORCH_DTYPES = {"uint8": torch.uint8, "uint16": torch.int16}  # uint16 ids < 0x7FFF


PUT_BATCH = 64  # records in one put_keyed at most
# CPU: the most forward passes (and their tokens, for long prefills) kept unwritten.
KEEP_PASSES = 32
KEEP_TOKENS = 1 << 14
# Where a padding row's ids go: the first row of vLLM's null block (block 0), which no request
# owns, so nothing ever reads it.
_PAD_ROW = 0


class R3Recorder:
    """One worker's routing buffer and its record puts (owner of the put thread)."""

    def __init__(
        self,
        config: R3Config,
        rows: r3.RowGeometry,
        *,
        tp_rank: int = 0,
        connect: Callable[[], Any] | None = None,
        name: str = "",
        numpy_on_cpu: bool = True,
    ) -> None:
        self._config = config
        self.rows = rows
        self._tp_rank = tp_rank
        self._connect = connect or (lambda: _refstore_client(config.store))
        self._name = name
        # False: the device path (torch operations only) on a CPU buffer too (tests).
        self._numpy_on_cpu = numpy_on_cpu
        self.counters = dict.fromkeys(
            ("captures", "records", "stored", "incomplete", "failed", "resets", "missed_steps"), 0
        )
        self.blocks: torch.Tensor | None = None  # [num_blocks, block_size, layers, top_k]
        self._tensor: torch.Tensor | None = None
        self._slot_layer = ""
        self._slots: Callable[[str], torch.Tensor | None] = lambda name: None
        # The buffer as one flat tensor of ids (on a CPU, ``blocks`` as numpy), and the running
        # forward pass's write plan, made once per pass at its first MoE layer.
        self._flat: torch.Tensor | None = None
        self._blocks_np: np.ndarray | None = None  # CPU only: ``blocks`` as numpy
        self._layer_offsets: torch.Tensor | None = None  # device: [layers, 1, top_k]
        self._block_elems = 0
        self._plan_slots: torch.Tensor | None = None
        self._plan_rows = -1
        self._plan_index: Any = None  # device: [layers, n, top_k], each id's flat index
        # CPU: each slot's block and offset in it, one more entry for the padding slot (-1,
        # vLLM's PAD_SLOT_ID: the null block's first row); a kept pass's ids are copied into
        # ``_ids`` before its scatter (a table lookup and a copy into a kept buffer instead of
        # divmod and stack).
        self._slot_at: tuple[np.ndarray, np.ndarray] | None = None  # (blocks, offsets)
        self._ids: np.ndarray | None = None  # [tokens, layers, top_k], grown as needed
        self._plan_n = 0
        # CPU: what is not yet written (``flush``), in order: passes, each its slots (a copy)
        # and its layers' (layer, topk_ids) (the running pass's layers: the last entry's list),
        # and resets of blocks newly given to requests.
        self._kept: list[_Pass | _Reset] = []
        self._kept_tokens = 0
        self._flush_at_step_end = False
        # The step's capture check: its number, its tokens, the MoE layers that captured them.
        self._step = 0
        self._step_tokens = 0
        self._step_layers = 0  # bit l: layer l captured every token of the pass
        self._all_layers = (1 << rows.layers) - 1
        # r3.no_row as the buffer's torch type holds it (uint16 ids live in an int16 buffer)
        self._no_row = -1 if rows.dtype == "uint16" else 0xFF
        self._missed: list[int] = []
        self._puts: queue.SimpleQueue[_Records | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self.stored = threading.Condition()

    # ------------------------------------------------------------------ start-up
    def attach(
        self,
        template: torch.Tensor,
        block_size: int,
        slot_layer: str,
        routers: Sequence[Any],
        slots: Callable[[str], torch.Tensor | None],
    ) -> torch.Tensor:
        """Allocate the buffer like ``template`` (one KV layer of the attention group, blocks
        first), hook ``routers`` (one per MoE layer, in layer order) and return the tensor to
        register as ``r3.ROUTING_LAYER``. ``slots(slot_layer)``: the running forward pass's
        slot mapping of the group (None outside one)."""
        if len(routers) != self.rows.layers:
            raise ConfigError(
                f"r3: the model has {len(routers)} MoE routers, its config says {self.rows.layers}"
            )
        num_blocks = int(template.shape[0])
        itemsize = template.element_size()
        block_stride = int(template.stride(0)) * itemsize
        block_nbytes = int(np.prod(template.shape[1:])) * itemsize
        need = block_size * self.rows.row_nbytes
        if need > block_nbytes:
            raise ConfigError(
                f"r3: a token's routing row ({self.rows.row_nbytes} B) does not fit the KV "
                f"block of one layer ({block_nbytes // block_size} B per token)"
            )
        tensor = torch.empty_strided(
            tuple(template.shape), tuple(template.stride()), dtype=template.dtype,
            device=template.device,
        )  # fmt: skip
        raw = torch.empty(0, dtype=torch.uint8, device=template.device)
        raw.set_(tensor.untyped_storage())
        raw.fill_(0xFF)  # "no row" everywhere (r3.no_row for every dtype)
        typed = raw.view(_TORCH_DTYPES[self.rows.dtype])
        step = np.dtype(self.rows.dtype).itemsize
        layers, top_k = self.rows.layers, self.rows.top_k
        self.blocks = typed.as_strided(
            (num_blocks, block_size, layers, top_k),
            (block_stride // step, layers * top_k, top_k, 1),
        )
        self._tensor = tensor
        self._flat = typed
        self._block_elems = block_stride // step
        if typed.device.type == "cpu" and self._numpy_on_cpu:
            self._blocks_np = self.blocks.numpy()
            slot_index = np.arange(num_blocks * block_size + 1, dtype=np.intp)
            slot_index[-1] = _PAD_ROW
            self._slot_at = np.divmod(slot_index, block_size)
        else:
            offsets = np.arange(layers * top_k, dtype=np.int64).reshape(layers, 1, top_k)
            self._layer_offsets = torch.from_numpy(offsets).to(typed.device)
        self._slot_layer = slot_layer
        self._slots = slots
        for index, router in enumerate(routers):
            router.set_capture_fn(partial(self._capture, index))
        self._thread = threading.Thread(
            target=self._run, name=f"hybrid-connector-r3{self._name}", daemon=True
        )
        self._thread.start()
        return tensor

    # ------------------------------------------------------------------ the forward pass
    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """A router's hook: this layer's ids of the step's tokens for their slots (CPU: kept
        for ``flush``; device: written at once, the slots' flat index planned once per pass)."""
        slots = self._slots(self._slot_layer)
        if self._flat is None or slots is None or topk_ids.dim() != 2:
            return  # outside a forward pass with KV (a dummy run)
        rows = int(topk_ids.shape[0])
        # A new pass starts at the first MoE layer; the slot tensor or the row count changing
        # within one (never seen) starts one again rather than write to stale slots.
        new_pass = layer == 0 or slots is not self._plan_slots or rows != self._plan_rows
        if self._blocks_np is not None:
            if new_pass:
                self._keep_pass(slots, rows)
            self._kept[-1].layers.append((layer, topk_ids))
        else:
            if new_pass:
                self._plan(slots, rows)
            ids = topk_ids[: self._plan_n].to(self._flat.dtype)
            self._flat.put_(self._plan_index[layer], ids)
        if self._plan_n >= self._step_tokens:
            self._step_layers |= 1 << layer
        self.counters["captures"] += 1

    def _keep_pass(self, slots: torch.Tensor, rows: int) -> None:
        """CPU: a new pass, its slots copied (vLLM refills the tensor for the next pass); as
        a list: between torch kernels ``tolist`` costs half of what a numpy view does."""
        n = min(int(slots.shape[0]), rows)
        kept = slots.tolist()
        del kept[n:]
        self._kept.append(_Pass(kept, []))
        self._kept_tokens += n
        self._plan_n = n
        self._plan_slots = slots
        self._plan_rows = rows

    def flush(self) -> None:
        """CPU: write what is kept, in order (a slot written twice keeps its last row; a
        block reset after a pass's rows went to it loses them), one lookup of every pass's
        rows, then one scatter per pass and one fill per reset."""
        kept, self._kept, self._kept_tokens = self._kept, [], 0
        if not kept or self._slot_at is None or self._blocks_np is None:
            return
        self._plan_slots = None  # a later hook of the running pass starts a new entry
        passes = [entry.slots for entry in kept if isinstance(entry, _Pass)]
        slots = np.array([slot for pass_slots in passes for slot in pass_slots], np.intp)
        blocks, offsets = self._slot_at[0][slots], self._slot_at[1][slots]
        start = 0
        for entry in kept:
            if isinstance(entry, _Reset):
                self._blocks_np[np.asarray(entry.blocks, dtype=np.intp)] = self._no_row
                continue
            end = start + len(entry.slots)
            if entry.layers:
                self._write(blocks[start:end], offsets[start:end], entry.layers)
            start = end

    def step_done(self) -> None:
        """The end of a step's forward pass: flush if the step moves blocks, or enough is kept."""
        full = len(self._kept) >= KEEP_PASSES or self._kept_tokens > KEEP_TOKENS
        if self._flush_at_step_end or full:
            self.flush()

    def _write(
        self, block: np.ndarray, offset: np.ndarray, pending: list[tuple[int, torch.Tensor]]
    ) -> None:
        """One pass's ids into the rows at (block, offset), one per token (a padding slot, -1:
        the tables' last entry, the null block's first row)."""
        assert self._blocks_np is not None
        n = len(block)
        layers = [layer for layer, _ in pending]
        if layers == list(range(self.rows.layers)):
            if self._ids is None or self._ids.shape[0] < n:
                shape = (max(n, 256), self.rows.layers, self.rows.top_k)
                self._ids = np.empty(shape, self._blocks_np.dtype)
            ids = self._ids[:n]
            for layer, topk_ids in pending:
                ids[:, layer] = topk_ids.numpy()[:n]
            self._blocks_np[block, offset] = ids
        else:
            ids = np.stack([topk_ids.numpy()[:n] for _, topk_ids in pending], axis=1)
            self._blocks_np[block[:, None], offset[:, None], layers] = ids

    def _plan(self, slots: torch.Tensor, rows: int) -> None:
        """Device: each id's flat index of this pass (a negative slot, padding: the null
        block's first row)."""
        assert self.blocks is not None
        n = min(int(slots.shape[0]), rows)
        block_size = int(self.blocks.shape[1])
        s = slots[:n].to(torch.int64)
        row_elems = self.rows.layers * self.rows.top_k
        base = (s // block_size) * self._block_elems + (s % block_size) * row_elems
        base = torch.where(s < 0, _PAD_ROW, base)
        self._plan_index = base.reshape(1, -1, 1) + self._layer_offsets
        self._plan_n = n
        self._plan_slots = slots
        self._plan_rows = rows

    # ------------------------------------------------------------------ steps
    def begin_step(self, meta: HybridConnectorMetadata) -> None:
        """Before the step's forward pass: copy the finished requests' rows out, reset the
        blocks newly given to requests (in that order: a freed block may be both), start the
        step's capture check."""
        # A step that moves blocks reads or writes the buffer: what is kept first, and this
        # step's pass at its end (step_done). A reset alone is kept, in order.
        self._flush_at_step_end = meta.moves_blocks()
        if self._flush_at_step_end:
            self.flush()
        if meta.r3_copies:
            self.copy_out(meta.r3_copies)
        if meta.r3_fresh_blocks:
            self.reset(meta.r3_fresh_blocks)
        self._step, self._step_tokens, self._step_layers = meta.r3_step, meta.r3_step_tokens, 0

    def reset(self, block_ids: Sequence[int]) -> None:
        """Every row of these blocks to "no row" (CPU: kept, after what is kept already)."""
        blocks = self.blocks
        if blocks is None:
            return
        self.counters["resets"] += len(block_ids)
        if self._blocks_np is not None:
            self._kept.append(_Reset(list(block_ids)))
        else:
            index = torch.as_tensor(block_ids, dtype=torch.int64, device=blocks.device)
            blocks.index_fill_(0, index, self._no_row)

    def report(self) -> tuple[int, ...]:
        """After the step's forward pass: the steps (this one, if so) whose pass left some MoE
        layer without the routing of all its tokens (empty: none)."""
        if self._step_tokens > 0 and self._step_layers != self._all_layers:
            self._missed.append(self._step)
            self.counters["missed_steps"] += 1
            if self.counters["missed_steps"] == 1 or self.counters["missed_steps"] % 1000 == 0:
                log.warning(
                    "r3: the forward pass of step %d captured the routing of %s of %d MoE "
                    "layers for all its %d tokens (%d such steps so far); its requests' "
                    "records say incomplete",
                    self._step, bin(self._step_layers).count("1"), self.rows.layers,
                    self._step_tokens, self.counters["missed_steps"],
                )  # fmt: skip
        self._step_tokens = 0
        missed, self._missed = tuple(self._missed), []
        return missed

    # ------------------------------------------------------------------ finished requests
    def copy_out(self, copies: Sequence[R3Copy]) -> None:
        """Gather the finished requests' rows now (before the step's forward pass may reuse
        their blocks), all in one copy, and queue the puts; the completeness check runs on the
        put thread. Only TP rank 0 stores (and checks): every rank holds the same rows."""
        self.flush()
        blocks = self.blocks
        if blocks is None or not copies:
            return
        self.counters["records"] += len(copies)
        if self._tp_rank != 0:
            return
        ids = [b for copy in copies for b in copy.block_ids]
        index = torch.as_tensor(ids, dtype=torch.int64, device=blocks.device)
        gathered = blocks[index].cpu().numpy().view(self.rows.dtype)  # a copy
        gathered = gathered.reshape(-1, self.rows.layers, self.rows.top_k)
        block_size = int(blocks.shape[1])
        records, start = [], 0
        for copy in copies:
            records.append((copy.key, copy.request_id, start, copy.num_tokens))
            start += len(copy.block_ids) * block_size
        self._puts.put(_Records(gathered, records))

    def _run(self) -> None:
        closing = False
        while not closing and (item := self._puts.get()) is not None:
            # Every record queued by now goes in one put_keyed (one allocation and one seal
            # round trip for a whole batch of finished requests, not one per request).
            steps = [item]
            queued = len(item.records)
            while queued < PUT_BATCH:
                try:
                    more = self._puts.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                steps.append(more)
                queued += len(more.records)
            pairs = [pair for step in steps for pair in self._checked(step)]
            for first in range(0, len(pairs), PUT_BATCH):
                self._store(pairs[first : first + PUT_BATCH])

    def _store(self, pairs: list[tuple[bytes, np.ndarray]]) -> None:
        try:
            if self._client is None:
                self._client = self._connect()
            refs = self._client.put_keyed(pairs, ttl=self._config.ttl_s)
            outcomes = ["stored" if ref is not None else "failed" for ref in refs]
        except Exception as exc:
            log.warning("r3: %d record(s) not stored (%s), first %s", len(pairs), exc, pairs[0][0])
            self._drop_client()
            outcomes = ["failed"] * len(pairs)
        with self.stored:
            for outcome in outcomes:
                self.counters[outcome] += 1
            self.stored.notify_all()

    def _checked(self, step: _Records) -> list[tuple[bytes, np.ndarray]]:
        """What is stored for each record of ``step``; a record with rows missing is counted
        (WARNING). One pass over the step's rows finds the missing ones, not one check per
        record: the put thread's time is taken from the interpreter the engine shares."""
        rows = step.rows
        flat = rows.reshape(len(rows), self.rows.layers * self.rows.top_k)
        missing = np.concatenate(([0], np.cumsum((flat == r3.no_row(rows.dtype)).any(axis=1))))
        pairs = []
        for key, request_id, start, count in step.records:
            lost = int(missing[start + count] - missing[start])
            if lost:
                with self.stored:
                    self.counters["incomplete"] += 1
                log.warning(
                    "r3: request %s: %d of %d token rows missing; its record says incomplete",
                    request_id, lost, count,
                )  # fmt: skip
            pairs.append((key.encode(), r3.stored_object(rows[start : start + count])))
        return pairs

    def wait_stored(self, at_least: int, timeout_s: float) -> bool:
        """Block until ``at_least`` records were stored (tests and tools, never a step)."""
        with self.stored:
            return self.stored.wait_for(lambda: self.counters["stored"] >= at_least, timeout_s)

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                log.debug("r3: closing the store client failed", exc_info=True)

    def close(self) -> None:
        if self._thread is not None:
            self._puts.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        self._drop_client()
        self.blocks = None
        self._flat = self._blocks_np = None
        self._plan_slots = self._plan_index = None
        self._kept = []
        self._tensor = None


def _refstore_client(store: str) -> Any:
    import refstore

    return refstore.Client(store, timeout=10.0)
