"""Objects <-> (layout, byte sources), and pool bytes -> zero-copy views.

Supported: numpy arrays (any fixed-size dtype, any strides: non-contiguous ones are gathered by the
single copy into the pool), torch CPU tensors (any dtype including bfloat16), bytes / bytearray /
memoryview, and a list, tuple or dict (str or int keys) of those, stored as one object (one
allocation, one lease, one ref). Items are 64-byte aligned inside the object.

torch is imported only when a tensor is put or asked for.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _fastpath
from .errors import CallerError
from .header import TensorPlan, Writer, encode_layout, tensor_plan
from .protocol import (
    CONTAINER_DICT,
    CONTAINER_LIST,
    CONTAINER_SINGLE,
    CONTAINER_TUPLE,
    KIND_BYTES,
    KIND_NUMPY,
    KIND_TORCH,
    Item,
    Layout,
)

ALIGN = 64
LAYOUT_CACHE_MAX = 1024


def dtype_to_str(dtype: np.dtype) -> str:
    """numpy dtype -> a string that round-trips, structured dtypes included."""
    return (
        dtype.str if dtype.fields is None else "descr:" + repr(np.lib.format.dtype_to_descr(dtype))
    )


def str_to_dtype(text: str) -> np.dtype:
    if text.startswith("descr:"):
        return np.lib.format.descr_to_dtype(ast.literal_eval(text[6:]))
    return np.dtype(text)


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _source(obj: Any, key: str | int | None, offset: int) -> tuple[Item, Any]:
    """(item, source) where source is a numpy array or a torch tensor to copy from."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise CallerError(f"item {key!r}: object arrays cannot be stored (dtype {obj.dtype})")
        return Item(
            key, KIND_NUMPY, dtype_to_str(obj.dtype), tuple(obj.shape), offset, obj.nbytes
        ), obj
    if _is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise CallerError(f"item {key!r}: only CPU tensors are supported, got {obj.device}")
        dtype = str(obj.dtype).removeprefix("torch.")
        nbytes = obj.numel() * obj.element_size()
        return Item(key, KIND_TORCH, dtype, tuple(obj.shape), offset, nbytes), obj
    if isinstance(obj, bytes | bytearray | memoryview):
        view = memoryview(obj).cast("B") if isinstance(obj, memoryview) else memoryview(obj)
        array = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
        return Item(key, KIND_BYTES, "|u1", (view.nbytes,), offset, view.nbytes), array
    raise CallerError(
        f"item {key!r}: cannot store {type(obj).__name__}; use numpy arrays, torch CPU tensors, "
        "bytes/memoryviews, or a list/tuple/dict of those"
    )


def encode(obj: Any) -> tuple[Layout, list[Any], int]:
    """Returns (layout, sources in item order, total bytes)."""
    if isinstance(obj, Mapping):
        container, entries = CONTAINER_DICT, list(obj.items())
        for key, _ in entries:
            if not isinstance(key, str | int):
                raise CallerError(f"dict keys must be str or int, got {type(key).__name__}")
    elif isinstance(obj, list | tuple):
        container = CONTAINER_LIST if isinstance(obj, list) else CONTAINER_TUPLE
        entries = list(enumerate(obj))
    else:
        container, entries = CONTAINER_SINGLE, [(None, obj)]
    items, sources = [], []
    offset = 0
    for key, value in entries:
        item, source = _source(value, key, offset)
        items.append(item)
        sources.append(source)
        offset += -(-item.nbytes // ALIGN) * ALIGN
    total = items[-1].offset + items[-1].nbytes if items else 0
    return Layout(container, items), sources, total


def size_class(nbytes: int) -> int:
    """Round up to one of 8 classes per power of two (at most 12.5% of a block unused): the
    sizes clients reserve blocks in."""
    if nbytes <= 4096:
        return max(256, -(-nbytes // 256) * 256)
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class Encoded:
    """What a put needs to know about an object besides its bytes: layout, size, header."""

    __slots__ = ("block", "complex", "direct", "header", "layout", "nbytes")

    def __init__(self, layout: Layout, nbytes: int) -> None:
        self.layout = layout
        self.nbytes = nbytes
        self.header = Writer(encode_layout(layout))
        self.block = size_class(self.header.hlen + nbytes)  # header + payload, rounded up
        # The kind of a lone item that one native call puts, payload and header
        # (``_fastpath.put_sealed``), or None: several items or none.
        items = layout.items
        lone = len(items) == 1 and items[0].nbytes > 0
        self.direct = items[0].kind if lone else None
        self.complex = lone and items[0].dtype.startswith("complex")


def encode_cached(obj: Any, cache: dict[Any, Encoded]) -> tuple[Encoded, list[Any]]:
    """``encode`` plus the object's header, remembered per (type, dtype, shape) of a single array
    or tensor: puts of the same shape (the usual case in a pipeline) skip building the layout."""
    cls = type(obj)
    torch = sys.modules.get("torch")
    if cls is np.ndarray or (torch is not None and cls is torch.Tensor and obj.is_cpu):
        key = (cls, obj.dtype, obj.shape)
        hit = cache.get(key)
        if hit is None:
            layout, _, nbytes = encode(obj)
            hit = Encoded(layout, nbytes)
            if len(cache) >= LAYOUT_CACHE_MAX:
                cache.clear()
            cache[key] = hit
        return hit, [obj]
    layout, sources, nbytes = encode(obj)
    return Encoded(layout, nbytes), sources


def copy_into(view: memoryview, start: int, source: Any, item: Item) -> None:
    """The one copy of a put: from ``source`` (a numpy array or a torch tensor) into ``view``
    (the pool) at ``start``. A contiguous payload is one native call (non-temporal stores for
    large ones; without the GIL from ``_fastpath.RELEASE_GIL_MIN``, split over threads when
    ``_fastpath.set_copy_threads`` asks for it); a strided one is copied by numpy or torch."""
    if item.nbytes == 0:
        return
    if item.kind != KIND_TORCH:
        if _fastpath.copy_in(view, start, source):
            return  # False: not C-contiguous
        dst = view[start : start + item.nbytes]
        target = np.frombuffer(dst, dtype=source.dtype, count=source.size).reshape(source.shape)
        np.copyto(target, source, casting="no")
        return
    if source.is_contiguous() and not source.is_conj() and not source.is_neg():
        _fastpath.copy_from(view, start, source.data_ptr(), item.nbytes)
        return
    import torch

    dst = view[start : start + item.nbytes]
    target = torch.frombuffer(dst, dtype=getattr(torch, item.dtype), count=source.numel())
    target.view(source.shape).copy_(source.detach())


def _torch_view(buf: memoryview, item: Item) -> Any:
    """A tensor over ``buf`` (always a writable buffer: torch has no read-only tensors, and a
    read-only buffer would only add a warning, whose suppression costs more than the view)."""
    import torch

    dtype = getattr(torch, item.dtype)
    if item.nbytes == 0:
        return torch.empty(item.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(item.shape)


def tensor_on_pool(pool: Any, start: int, plan: TensorPlan) -> Any:
    """The C-contiguous tensor ``plan`` describes, at byte ``start`` of ``pool`` (a
    ``SharedPool``), made the cheapest way torch has, which matters in a process with cold caches
    (a Ray actor after a task dispatch): a DLPack capsule over the pool (one C call each side),
    else one ``as_strided`` of the pool's flat tensor of its dtype. Both hold a slice of the
    pool's view, so the mapping outlives ``close()`` while the tensor lives. None once the pool is
    closed."""
    dtype, shape, strides, _, dlpack = plan
    if dlpack is not None:
        keeper = pool.keeper()
        if keeper is not None:
            global _from_dlpack
            if _from_dlpack is None:
                import torch.utils.dlpack

                # What torch.utils.dlpack.from_dlpack does with a capsule, without its Python.
                _from_dlpack = getattr(torch._C, "_from_dlpack", torch.utils.dlpack.from_dlpack)
            capsule = _fastpath.tensor_capsule(keeper, start, shape, *dlpack)
            try:
                return _from_dlpack(capsule)
            except (RuntimeError, TypeError, BufferError):
                pass  # a torch without this DLPack type: the long way below
    flat = pool.torch_flat(dtype)  # imports torch; None once the pool is closed
    if flat is None or start % flat[1]:
        return None
    return flat[0].as_strided(shape, strides, start // flat[1])


_from_dlpack: Any = None


def view_item(
    base: memoryview,
    offset: int,
    item: Item,
    as_: str | None,
    writable: bool,
    *,
    pool: Any = None,
) -> Any:
    """A view of one item; ``base`` is the writable pool view, read-only-ness is applied here
    (numpy arrays and memoryviews are marked read-only; torch tensors cannot be). ``pool``: the
    ``SharedPool`` of ``base``, whose torch views are cheaper than ``torch.frombuffer``."""
    start = offset + item.offset
    kind = item.kind
    if kind == KIND_TORCH:
        tensor = None
        if pool is not None and item.nbytes:
            tensor = tensor_on_pool(pool, start, tensor_plan(item))
        if tensor is not None and as_ != "numpy":
            return tensor
    buf = base[start : start + item.nbytes]
    if as_ == "torch" and kind != KIND_TORCH:
        if kind == KIND_BYTES:
            return _torch_view(buf, Item(item.key, KIND_TORCH, "uint8", item.shape, 0, item.nbytes))
        import torch

        dtype = torch.from_numpy(np.empty(0, dtype=np.dtype(item.dtype))).dtype
        name = str(dtype).removeprefix("torch.")
        return _torch_view(buf, Item(item.key, KIND_TORCH, name, item.shape, 0, item.nbytes))
    if kind == KIND_TORCH:
        if tensor is None:
            tensor = _torch_view(buf, item)
        if as_ != "numpy":
            return tensor
        import torch

        if tensor.dtype == torch.bfloat16:
            raise CallerError(f"item {item.key!r}: bfloat16 has no numpy dtype; get it as torch")
        array = tensor.numpy()
        if not writable:
            array.flags.writeable = False
        return array
    if kind == KIND_BYTES and as_ is None:
        return buf if writable else buf.toreadonly()
    array = np.frombuffer(buf, dtype=str_to_dtype(item.dtype)).reshape(item.shape)
    if not writable:
        array.flags.writeable = False
    return array


def decode(
    base: memoryview,
    offset: int,
    layout: Layout,
    as_: str | None,
    writable: bool,
    *,
    pool: Any = None,
) -> Any:
    items = layout.items
    if layout.container == CONTAINER_SINGLE:
        return view_item(base, offset, items[0], as_, writable, pool=pool)
    values = [view_item(base, offset, item, as_, writable, pool=pool) for item in items]
    if layout.container == CONTAINER_DICT:
        return {item.key: value for item, value in zip(layout.items, values, strict=True)}
    if layout.container == CONTAINER_TUPLE:
        return tuple(values)
    return values
