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

from kvt.errors import DeviceMemoryError, InvalidBlocksError, InvalidRegionError

MAX_REGION_ID = 0xFFFF


@dataclass(frozen=True, eq=False)
class Region:
    region_id: int
    view: memoryview | None  # 1-D unsigned-byte view over the whole region; None: device memory
    address: int
    nbytes: int
    writable: bool
    owner: Any  # keeps the registered object alive while the region exists
    device: str = "cpu"  # where the bytes live: "cpu", or a torch device such as "cuda:0"


@dataclass(frozen=True)
class DeviceMemory:
    """Device memory by address (e.g. a CUDA KV cache known only by its storage pointer).

    ``register_region(DeviceMemory(ptr, nbytes, "cuda:0"))``: the host never reads these bytes; a
    staging copier (:mod:`kvt.staging`) or a device-capable path (RDMA) moves them. ``owner``
    (optional) is kept alive while the region exists.
    """

    address: int
    nbytes: int
    device: str
    owner: Any = None
    writable: bool = True

    def __post_init__(self) -> None:
        if self.address <= 0 or self.nbytes <= 0:
            raise InvalidRegionError(f"device region needs a positive address and size: {self}")
        if self.device == "cpu":
            raise InvalidRegionError("DeviceMemory is for device memory; register host memory")


def _view_of(obj: Any) -> tuple[memoryview, Any] | DeviceMemory:
    """A flat byte memoryview over ``obj`` plus the object that keeps the memory alive, or the
    device memory ``obj`` stands for (CUDA tensor, :class:`DeviceMemory`)."""
    if isinstance(obj, DeviceMemory):
        return obj
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


def _torch_view(tensor: Any) -> tuple[memoryview, Any] | DeviceMemory:
    import torch  # only when a torch object is actually passed

    if not isinstance(tensor, torch.Tensor):
        raise InvalidRegionError(f"cannot register a {type(tensor).__name__} as a region")
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidRegionError(f"tensor on {tensor.device}: only CPU and CUDA memory")
    if not tensor.is_contiguous():
        raise InvalidRegionError("tensor regions must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise InvalidRegionError("empty tensor")
    if tensor.device.type == "cuda":
        device = f"cuda:{tensor.device.index if tensor.device.index is not None else 0}"
        return DeviceMemory(tensor.data_ptr(), nbytes, device, owner=tensor)
    raw = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(raw).cast("B"), (tensor, raw)


def first_out_of_bounds(offset: np.ndarray, length: np.ndarray, size) -> int | None:
    """Index of the first range ``[offset, +length)`` that does not fit in ``size`` bytes, or None.

    Vectorised over uint64 arrays (``size`` a scalar or one per range); written so that no
    ``offset + length`` can wrap around.
    """
    bad = (length > size) | (offset > size - np.minimum(length, size))
    return int(np.flatnonzero(bad)[0]) if bad.any() else None


class RegionTable:
    """Region id -> Region. Thread-safe; lookups take no lock (dict reads are atomic in CPython)."""

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._next_id = 0

    def register(self, obj: Any, *, writable: bool | None = None) -> Region:
        memory = _view_of(obj)
        if isinstance(memory, DeviceMemory):
            if writable and not memory.writable:
                raise InvalidRegionError("region requested writable but the memory is read-only")
            return self._add(
                None, memory.address, memory.nbytes, memory.writable, memory, memory.device
            )
        view, owner = memory
        if view.nbytes == 0:
            raise InvalidRegionError("cannot register an empty region")
        is_writable = not view.readonly
        if writable and not is_writable:
            raise InvalidRegionError("region requested writable but the memory is read-only")
        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        return self._add(view, address, view.nbytes, is_writable, owner)

    def _add(self, view, address, nbytes, writable, owner, device="cpu") -> Region:  # noqa: PLR0917
        with self._lock:
            if len(self._regions) > MAX_REGION_ID:
                raise InvalidRegionError("region table full (u16 ids)")
            while self._next_id in self._regions:
                self._next_id = (self._next_id + 1) & MAX_REGION_ID
            region_id = self._next_id
            self._next_id = (self._next_id + 1) & MAX_REGION_ID
            region = Region(region_id, view, address, nbytes, writable, owner, device)
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
        Raises :class:`InvalidBlocksError` unless every block lies inside a registered region, and
        :class:`DeviceMemoryError` if one lies in device memory (no host view exists: the staging
        layer moves those, see :meth:`device_of`).
        Vectorised per region, no Python loop per block except for slicing the views.
        """
        regions = self._checked(blocks, side)
        for rid, region in regions.items():
            if region.view is None:
                raise DeviceMemoryError(
                    f"region {rid} is {region.device} memory: no host bytes to read or write"
                )
        return self._slice(blocks, side, regions)

    def locate(self, blocks: np.ndarray, side: str) -> tuple[str, HostSpans | None]:
        """One check for both kinds: ("cpu", the checked :class:`HostSpans`) for host memory, or
        (device, None) for device memory (see :meth:`device_of`). Every block is checked here,
        before any byte moves; views are only sliced if a path asks for them."""
        regions = self._checked(blocks, side)
        device = self._device(regions)
        return (device, HostSpans(blocks, side, regions) if device == "cpu" else None)

    @staticmethod
    def _slice(blocks: np.ndarray, side: str, regions: dict[int, Region]) -> list[memoryview]:
        if not regions:
            return []
        region_ids, offsets = blocks[f"{side}_region"], blocks[f"{side}_offset"]
        ends = (offsets + blocks["length"]).tolist()
        return [
            regions[r].view[o:e]  # type: ignore[index]
            for r, o, e in zip(region_ids.tolist(), offsets.tolist(), ends, strict=True)
        ]

    def device_of(self, blocks: np.ndarray, side: str) -> str:
        """Where the memory of ``blocks`` lives ("cpu" or e.g. "cuda:0"), after the checks of
        :meth:`views`; a batch that mixes host and device memory (or two devices) is refused."""
        return self._device(self._checked(blocks, side))

    @staticmethod
    def _device(regions: dict[int, Region]) -> str:
        devices = {region.device for region in regions.values()}
        if len(devices) > 1:
            raise InvalidBlocksError(f"one batch names memory on {sorted(devices)}: split it")
        return devices.pop() if devices else "cpu"

    def _checked(self, blocks: np.ndarray, side: str) -> dict[int, Region]:
        """The regions ``blocks`` name, each block checked to lie inside its region."""
        if not isinstance(blocks, np.ndarray) or blocks.dtype != IPCBLOCK_DTYPE:
            raise InvalidBlocksError("blocks must be a numpy array of ipcblock.IPCBLOCK_DTYPE")
        regions: dict[int, Region] = {}
        if blocks.size == 0:
            return regions
        region_ids = blocks[f"{side}_region"]
        offsets = blocks[f"{side}_offset"]
        lengths = blocks["length"]
        for rid in np.unique(region_ids).tolist():
            region = self._regions.get(rid)
            if region is None:
                raise InvalidBlocksError(f"unknown region {rid}")
            if side == "dst" and not region.writable:
                raise InvalidBlocksError(f"region {rid} is read-only")
            mask = region_ids == rid
            length, offset = lengths[mask], offsets[mask]
            i = first_out_of_bounds(offset, length, np.uint64(region.nbytes))
            if i is not None:
                raise InvalidBlocksError(
                    f"block [{int(offset[i])}, +{int(length[i])}) outside region {rid} "
                    f"of {region.nbytes} bytes"
                )
            regions[rid] = region
        return regions

    def addresses(self, blocks: np.ndarray, side: str) -> np.ndarray:
        """uint64 address of each block's bytes (``side`` as in :meth:`views`, whose checks the
        blocks must already have passed); vectorised, one lookup per distinct region."""
        return _addresses(blocks, side, self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()


def _addresses(blocks: np.ndarray, side: str, regions: dict[int, Region]) -> np.ndarray:
    region_ids = blocks[f"{side}_region"]
    unique = np.unique(region_ids).tolist()
    if len(unique) == 1:  # the usual case (one KV cache region): no mask
        bases = np.uint64(regions[unique[0]].address)
        return blocks[f"{side}_offset"].astype(np.uint64) + bases
    bases = np.zeros(len(blocks), dtype=np.uint64)
    for rid in unique:
        bases[region_ids == rid] = regions[rid].address
    return bases + blocks[f"{side}_offset"].astype(np.uint64)


class HostSpans:
    """Host memory of checked blocks (:meth:`RegionTable.locate`), in the two forms paths use.

    Address-based paths (samehost, rdma) take :attr:`addresses` (vectorised); socket and
    in-process paths take :attr:`views`, one memoryview per block, sliced on first use only: a
    path that never asks pays nothing per block. Both come from the regions the check found, so
    a region unregistered meanwhile cannot change what the checked blocks name.
    """

    __slots__ = ("_addresses", "_regions", "_side", "_views", "blocks")

    def __init__(self, blocks: np.ndarray, side: str, regions: dict[int, Region]) -> None:
        self.blocks, self._side, self._regions = blocks, side, regions
        self._views: list[memoryview] | None = None
        self._addresses: np.ndarray | None = None

    @property
    def views(self) -> list[memoryview]:
        if self._views is None:
            self._views = RegionTable._slice(self.blocks, self._side, self._regions)
        return self._views

    @property
    def addresses(self) -> np.ndarray:
        if self._addresses is None:
            if not self._regions:
                self._addresses = np.zeros(0, dtype=np.uint64)
            else:
                self._addresses = _addresses(self.blocks, self._side, self._regions)
        return self._addresses


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


class DeviceEvent(Protocol):
    """What kvt needs of a CUDA event (``torch.cuda.Event``); a test passes a fake."""

    def record(self, stream: Any | None = None) -> None: ...

    def synchronize(self) -> None: ...


class EventWaiter:
    """One kvt thread that waits on device events in the order they were queued (blocking in
    ``synchronize()``, no polling) and runs each one's callback after it completed.

    Owned by whoever made it (a :class:`CudaLayerEvents`, or a worker sharing one between the
    layer events of many steps); :meth:`close` waits for what is queued, then joins the thread.
    """

    def __init__(self, name: str = "kvt-cuda-events") -> None:
        import queue

        self._queue: queue.SimpleQueue[tuple[DeviceEvent, Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def after(self, event: DeviceEvent, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the waiter thread once ``event`` completed."""
        if self._closed:
            raise RuntimeError("event waiter is closed")
        self._queue.put((event, callback))

    def _main(self) -> None:
        from kvt.control import mark_io_thread

        mark_io_thread()  # completions decided here run their callbacks here (a kvt thread)
        while (item := self._queue.get()) is not None:
            event, callback = item
            try:
                event.synchronize()
                callback()
            except Exception:
                import logging

                logging.getLogger(__name__).exception("kvt: device event callback failed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


def _cuda_event_factory() -> Callable[[], DeviceEvent]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("CudaLayerEvents needs CUDA; use CpuLayerEvents on CPU")
    return torch.cuda.Event


class CudaLayerEvents:
    """Per-layer readiness from CUDA events recorded on the compute stream after each layer.

    :meth:`record` (the compute thread, right after the layer's attention wrote its KV) records a
    new event on ``stream`` and hands it to an :class:`EventWaiter`: kvt's thread waits for it and
    then releases the layer's callbacks (:meth:`when_ready`), so the compute thread never waits.
    Events complete in stream order, and the waiter takes them in the order recorded.

    ``event_factory`` (default ``torch.cuda.Event``; a test passes a fake) makes one event per
    record. ``waiter``: share one waiter thread between many of these (e.g. one per vLLM step);
    when omitted, this object starts its own and :meth:`close` joins it.
    """

    def __init__(
        self,
        num_layers: int,
        *,
        event_factory: Callable[[], DeviceEvent] | None = None,
        waiter: EventWaiter | None = None,
    ) -> None:
        self._new_event = event_factory if event_factory is not None else _cuda_event_factory()
        self._cpu = CpuLayerEvents(num_layers)
        self._recorded = [False] * num_layers
        self._own_waiter = waiter is None
        self._waiter = waiter if waiter is not None else EventWaiter()

    def record(self, layer: int, stream: Any | None = None) -> None:
        """Layer ``layer``'s KV is written once the work queued on ``stream`` so far is done."""
        event = self._new_event()
        event.record(stream)
        self._recorded[layer] = True
        self._waiter.after(event, lambda: self._cpu.mark_ready(layer))

    def record_rest(self, stream: Any | None = None) -> None:
        """Record every layer not recorded yet (end of the forward pass: all KV is queued)."""
        for layer, done in enumerate(self._recorded):
            if not done:
                self.record(layer, stream)

    def is_recorded(self, layer: int) -> bool:
        return self._recorded[layer]

    def is_ready(self, layer: int) -> bool:
        return self._cpu.is_ready(layer)

    def when_ready(self, layer: int, callback: Callable[[], None]) -> None:
        self._cpu.when_ready(layer, callback)

    def reset(self) -> None:
        self._recorded = [False] * len(self._recorded)
        self._cpu.reset()

    def close(self) -> None:
        """Stop (own waiter: after the recorded events completed); pending callbacks dropped."""
        if self._own_waiter:
            self._waiter.close()
        self._cpu.close()
