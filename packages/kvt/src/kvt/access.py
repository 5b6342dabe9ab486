"""Access layer: registered memory regions and per-layer compute-ready events.

A *region* is a contiguous range of bytes this process lets kvt read (as a sender) or write (as a
receiver). IpcBlocks address regions by id and offset, never by raw pointer, so everything a peer
sends can be checked against what was registered here (:meth:`RegionTable.views`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from ipcblock import IPCBLOCK_DTYPE

from kvt.errors import InvalidBlocksError, InvalidRegionError

MAX_REGION_ID = 0xFFFF


@dataclass(frozen=True, eq=False)
class Region:
    region_id: int
    view: memoryview  # 1-D unsigned-byte view over the whole region
    address: int
    nbytes: int
    writable: bool
    owner: Any  # keeps the registered object alive while the region exists
    device: str = "cpu"  # where the bytes live: "cpu", or a torch device such as "cuda:0"


def _view_of(obj: Any) -> tuple[memoryview, Any]:
    """A flat byte memoryview over ``obj`` plus the object that keeps the memory alive."""
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
        address, nbytes = obj
        if address <= 0 or nbytes <= 0:
            raise InvalidRegionError(f"raw region needs a positive address and size, got {obj}")
        raw = (ctypes.c_ubyte * nbytes).from_address(address)
        return memoryview(raw).cast("B"), raw
    module = type(obj).__module__ or ""
    if module.startswith("torch"):
        return _torch_view(obj)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidRegionError("numpy regions must be C-contiguous")
        return memoryview(obj.reshape(-1).view(np.uint8)), obj
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidRegionError(f"cannot register a {type(obj).__name__} as a region") from None
    if not view.c_contiguous:
        raise InvalidRegionError("memoryview regions must be C-contiguous")
    return view.cast("B"), obj


def _torch_view(tensor: Any) -> tuple[memoryview, Any]:
    import torch  # only when a torch object is actually passed

    if not isinstance(tensor, torch.Tensor):
        raise InvalidRegionError(f"cannot register a {type(tensor).__name__} as a region")
    if tensor.device.type != "cpu":
        raise InvalidRegionError(
            f"tensor on {tensor.device}: the TCP backend reads and writes host memory only"
        )
    if not tensor.is_contiguous():
        raise InvalidRegionError("tensor regions must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise InvalidRegionError("empty tensor")
    raw = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(raw).cast("B"), (tensor, raw)


class RegionTable:
    """Region id -> Region. Thread-safe; lookups take no lock (dict reads are atomic in CPython)."""

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._next_id = 0

    def register(self, obj: Any, *, writable: bool | None = None) -> Region:
        view, owner = _view_of(obj)
        if view.nbytes == 0:
            raise InvalidRegionError("cannot register an empty region")
        is_writable = not view.readonly
        if writable and not is_writable:
            raise InvalidRegionError("region requested writable but the memory is read-only")
        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        with self._lock:
            if len(self._regions) > MAX_REGION_ID:
                raise InvalidRegionError("region table full (u16 ids)")
            while self._next_id in self._regions:
                self._next_id = (self._next_id + 1) & MAX_REGION_ID
            region_id = self._next_id
            self._next_id = (self._next_id + 1) & MAX_REGION_ID
            region = Region(region_id, view, address, view.nbytes, is_writable, owner)
            self._regions[region_id] = region
        return region

    def unregister(self, region_id: int) -> None:
        with self._lock:
            if self._regions.pop(region_id, None) is None:
                raise InvalidRegionError(f"unknown region id {region_id}")

    def get(self, region_id: int) -> Region | None:
        return self._regions.get(region_id)

    def views(self, blocks: np.ndarray, side: str) -> list[memoryview]:
        """The memory each block names on this engine, in record order.

        ``side="src"``: the bytes a sender reads (``src_region``, ``src_offset``); ``side="dst"``:
        the bytes a receiver writes (``dst_region``, ``dst_offset``; the region must be writable).
        Raises :class:`InvalidBlocksError` unless every block lies inside a registered region.
        Vectorised per region, no Python loop per block except for slicing the views.
        """
        if not isinstance(blocks, np.ndarray) or blocks.dtype != IPCBLOCK_DTYPE:
            raise InvalidBlocksError("blocks must be a numpy array of ipcblock.IPCBLOCK_DTYPE")
        if blocks.size == 0:
            return []
        region_ids = blocks[f"{side}_region"]
        offsets = blocks[f"{side}_offset"]
        lengths = blocks["length"]
        regions: dict[int, Region] = {}
        for rid in np.unique(region_ids).tolist():
            region = self._regions.get(rid)
            if region is None:
                raise InvalidBlocksError(f"unknown region {rid}")
            if side == "dst" and not region.writable:
                raise InvalidBlocksError(f"region {rid} is read-only")
            mask = region_ids == rid
            size = np.uint64(region.nbytes)
            length, offset = lengths[mask], offsets[mask]
            # offset + length <= size, written so that no u64 sum can wrap around
            bad = (length > size) | (offset > size - np.minimum(length, size))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidBlocksError(
                    f"block [{int(offset[i])}, +{int(length[i])}) outside region {rid} "
                    f"of {region.nbytes} bytes"
                )
            regions[rid] = region
        ends = (offsets + lengths).tolist()
        return [
            regions[r].view[o:e]
            for r, o, e in zip(region_ids.tolist(), offsets.tolist(), ends, strict=True)
        ]

    def addresses(self, blocks: np.ndarray, side: str) -> np.ndarray:
        """uint64 address of each block's bytes (``side`` as in :meth:`views`, whose checks the
        blocks must already have passed); vectorised, one lookup per distinct region."""
        region_ids = blocks[f"{side}_region"]
        bases = np.zeros(len(blocks), dtype=np.uint64)
        for rid in np.unique(region_ids).tolist():
            bases[region_ids == rid] = self._regions[rid].address
        return bases + blocks[f"{side}_offset"].astype(np.uint64)

    def __len__(self) -> int:
        return len(self._regions)

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()


# ------------------------------------------------------------------ layer events
class LayerEvents(Protocol):
    """When is layer ``i``'s KV computed and safe to read?

    The control layer calls :meth:`when_ready` and sends that layer's blocks from the callback; an
    implementation calls each callback exactly once, on any thread, as soon as the layer is ready
    (at once if it already is). CPU: the caller marks layers ready (e.g. from vLLM's
    ``save_kv_layer``). GPU: a CUDA event recorded per layer, waited on by a thread.
    """

    def when_ready(self, layer: int, callback: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


class CpuLayerEvents:
    """Layers become ready when the caller says so (:meth:`mark_ready`); no thread of its own."""

    def __init__(self, num_layers: int) -> None:
        self._ready = [False] * num_layers
        self._waiters: list[list[Callable[[], None]]] = [[] for _ in range(num_layers)]
        self._lock = threading.Lock()

    def mark_ready(self, layer: int) -> None:
        with self._lock:
            self._ready[layer] = True
            waiters, self._waiters[layer] = self._waiters[layer], []
        for callback in waiters:
            callback()

    def is_ready(self, layer: int) -> bool:
        return self._ready[layer]

    def when_ready(self, layer: int, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._ready[layer]:
                self._waiters[layer].append(callback)
                return
        callback()

    def reset(self) -> None:
        """Start a new forward pass: every layer not ready again (pending callbacks are kept)."""
        with self._lock:
            self._ready = [False] * len(self._ready)

    def close(self) -> None:
        with self._lock:
            for waiters in self._waiters:
                waiters.clear()


class CudaLayerEvents:
    """One CUDA event per layer, recorded on the compute stream after the layer's attention.

    A single waiter thread (owned here, stopped by :meth:`close`) takes recorded layers in order,
    blocks in ``event.synchronize()`` (no polling) and then fires that layer's callbacks.
    Untested on this CPU-only project; the interface is what the control layer relies on.
    """

    def __init__(self, num_layers: int) -> None:
        import queue

        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaLayerEvents needs CUDA; use CpuLayerEvents on CPU")
        self._torch = torch
        self._events = [torch.cuda.Event() for _ in range(num_layers)]
        self._cpu = CpuLayerEvents(num_layers)
        self._recorded: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._wait_loop, name="kvt-cuda-events", daemon=True)
        self._thread.start()

    def record(self, layer: int, stream: Any | None = None) -> None:
        """Call right after layer ``layer``'s KV is written (on the compute stream)."""
        self._events[layer].record(stream)
        self._recorded.put(layer)

    def when_ready(self, layer: int, callback: Callable[[], None]) -> None:
        self._cpu.when_ready(layer, callback)

    def reset(self) -> None:
        self._cpu.reset()

    def _wait_loop(self) -> None:
        while (layer := self._recorded.get()) is not None:
            self._events[layer].synchronize()
            self._cpu.mark_ready(layer)

    def close(self) -> None:
        if self._thread.is_alive():
            self._recorded.put(None)
            self._thread.join()
        self._cpu.close()
