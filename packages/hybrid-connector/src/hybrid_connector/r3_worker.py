"""R3 in the worker: the routing buffer, the routers' capture hooks, the copies into the store.

``R3Recorder.attach`` allocates the routing buffer as one more "layer" of the attention group:
a tensor of the same shape, strides and dtype as that group's KV layers, whose first
``block_size * row_nbytes`` bytes per block hold one routing row per token slot (``r3.py``).
Since it is a layer of the group like any other, every path that moves the group's blocks (PD
pulls, KVS saves and loads, migration) moves the rows with them, byte for byte; a pull between
instances whose group layouts differ (block size, TP heads) would reorder those bytes as KV,
so ``r3.check_peer`` refuses it (D recomputes, and records its own rows).

Each MoE router's capture hook (vLLM's ``BaseRouter.set_capture_fn``: called in every forward
with the logical ``topk_ids``, before EPLB mapping) scatters the ids to the step's token slots
(the forward context's slot mapping of the attention group). ``copy_out`` (from the metadata,
before the step's forward pass) gathers a finished request's rows and hands them to the put
thread, which stores them under the record's key; only TP rank 0 stores (every rank holds the
same rows).

Imports torch; vLLM's objects (routers, the slot mapping) come from ``connector.py``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from hybrid_connector import r3
from hybrid_connector.config import R3Config
from hybrid_connector.errors import ConfigError
from hybrid_connector.metadata import R3Copy

log = logging.getLogger(__name__)

_Put = tuple[str, dict[str, np.ndarray]]  # a record's key and what is stored under it
_TORCH_DTYPES = {"uint8": torch.uint8, "uint16": torch.int16}  # uint16 ids < 0x7FFF


PUT_BATCH = 64  # records in one put_keyed at most


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
    ) -> None:
        self._config = config
        self.rows = rows
        self._tp_rank = tp_rank
        self._connect = connect or (lambda: _refstore_client(config.store))
        self._name = name
        self.counters = dict.fromkeys(("captures", "records", "stored", "incomplete", "failed"), 0)
        self.blocks: torch.Tensor | None = None  # [num_blocks, block_size, layers, top_k]
        self._tensor: torch.Tensor | None = None
        self._slot_layer = ""
        self._slots: Callable[[str], torch.Tensor | None] = lambda name: None
        self._puts: queue.SimpleQueue[_Put | None] = queue.SimpleQueue()
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
        """A router's hook: this layer's ids of the step's tokens into their slots."""
        blocks = self.blocks
        slots = self._slots(self._slot_layer)
        if blocks is None or slots is None or topk_ids.dim() != 2:
            return  # outside a forward pass with KV (a dummy run)
        n = min(int(slots.shape[0]), int(topk_ids.shape[0]))
        slots = slots[:n].to(torch.int64)
        keep = slots >= 0
        slots = slots[keep]
        block_size = blocks.shape[1]
        blocks[slots // block_size, slots % block_size, layer] = topk_ids[:n][keep].to(blocks.dtype)
        self.counters["captures"] += 1

    # ------------------------------------------------------------------ finished requests
    def copy_out(self, copies: Sequence[R3Copy]) -> None:
        """Gather each finished request's rows now (before the step's forward pass may reuse
        its blocks) and queue the put."""
        blocks = self.blocks
        if blocks is None:
            return
        for copy in copies:
            self.counters["records"] += 1
            ids = torch.as_tensor(copy.block_ids, dtype=torch.int64, device=blocks.device)
            rows = blocks[ids].reshape(-1, self.rows.layers, self.rows.top_k)[: copy.num_tokens]
            array = rows.cpu().numpy().view(self.rows.dtype).copy()
            stored = r3.stored_object(array)
            if not stored["complete"][0]:
                self.counters["incomplete"] += 1
                log.warning(
                    "r3: request %s: %d of %d token rows missing; its record says incomplete",
                    copy.request_id, r3.missing_rows(array), copy.num_tokens,
                )  # fmt: skip
            if self._tp_rank == 0:
                self._puts.put((copy.key, stored))

    def _run(self) -> None:
        closing = False
        while not closing and (item := self._puts.get()) is not None:
            # Every record queued by now goes in one put_keyed (one allocation and one seal
            # round trip for a whole batch of finished requests, not one per request).
            batch = [item]
            while len(batch) < PUT_BATCH:
                try:
                    more = self._puts.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                batch.append(more)
            try:
                if self._client is None:
                    self._client = self._connect()
                pairs = [(key.encode(), stored) for key, stored in batch]
                refs = self._client.put_keyed(pairs, ttl=self._config.ttl_s)
                outcomes = ["stored" if ref is not None else "failed" for ref in refs]
            except Exception as exc:
                log.warning(
                    "r3: %d record(s) not stored (%s), first %s", len(batch), exc, batch[0][0]
                )
                self._drop_client()
                outcomes = ["failed"] * len(batch)
            with self.stored:
                for outcome in outcomes:
                    self.counters[outcome] += 1
                self.stored.notify_all()

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
        self._tensor = None


def _refstore_client(store: str) -> Any:
    import refstore

    return refstore.Client(store, timeout=10.0)
