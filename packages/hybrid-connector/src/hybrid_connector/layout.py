"""Describe vLLM's KV cache tensors as registered regions plus one ipcblock layout per group.

vLLM hands the worker one tensor per attention layer. On the CPU backend each is
``[num_blocks, kv_heads, block_size, 2*head_dim]`` and all layers are views of one buffer; on
other backends a layer may be ``[2, num_blocks, ...]`` (K plane then V plane) and layers may live
in separate buffers. This module finds the distinct buffers (they become kvt regions) and the
per-layer byte geometry, without assuming either arrangement.

A model may have several KV-cache groups (vLLM's hybrid KV-cache manager): full attention plus
linear-attention state (Qwen3-Next), sliding window plus full attention, ... Each group gets its
own layout; all groups share one block pool and, on vLLM's allocation, the same buffers (a state
layer and an attention layer are views of one tensor), so buffers are found across all groups.
A linear-attention (mamba/GDN) layer is a list of tensors (conv state, recurrent state), each
``[num_blocks, ...]`` with the (padded) page as block stride: one segment per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipcblock import Segment

from hybrid_connector.errors import UnsupportedLayoutError
from hybrid_connector.protocol import CacheSpec, LayoutSpec, SegmentSpec

if TYPE_CHECKING:
    import torch


FAMILIES = ("attention", "mla", "state", "sliding_window")


@dataclass(frozen=True)
class KvGroup:
    """One vLLM KV-cache group, as the connector sees it (built from vLLM's KVCacheGroupSpec in
    ``connector.py``, so that nothing else imports vLLM)."""

    family: str  # one of FAMILIES
    layer_names: tuple[str, ...]
    block_size: int
    dtype: str = ""
    # "state" groups: trailing scratch slots vLLM allocates per request (speculative decoding).
    num_speculative_blocks: int = 0
    # Tensor parallelism (see LayoutSpec): this rank's KV heads [head_start, head_start +
    # num_heads) of total_heads; 0 = every rank holds the same bytes (MLA latent, state slots).
    total_heads: int = 0
    head_start: int = 0
    num_heads: int = 0
    # vLLM's CPU attention kernel ISA for the group ("amx", "vec", ...): where each token lies in
    # a CPU block depends on it. "" = not a CPU attention group, or not known.
    attn_isa: str = ""


def state_slot(block_ids: list[int], num_speculative_blocks: int = 0) -> list[int]:
    """The slot of a "state" group's block list that holds the request's running state: the
    last one before the speculative scratch slots (vLLM 0.32: with prefix caching off the list
    is that slot plus the scratch ones; with it on ("align" mode) earlier entries are null
    placeholders or superseded checkpoints). As vLLM's own ``clip_ssm_state_blocks``."""
    if not block_ids:
        return []
    scratch = min(num_speculative_blocks, len(block_ids) - 1)
    kept = block_ids[: len(block_ids) - scratch]
    return kept[-1:]


@dataclass(frozen=True)
class Buffer:
    """One distinct memory buffer holding the KV of one or more layers."""

    address: int
    nbytes: int
    device: str = "cpu"  # "cpu", or the CUDA device holding it ("cuda:0")


@dataclass(frozen=True)
class KvCacheGeometry:
    """Buffers (to register) and the layout of the layers inside them (region = buffer index)."""

    buffers: tuple[Buffer, ...]
    layer_names: tuple[str, ...]
    layer_offsets: tuple[int, ...]
    buffer_index: tuple[int, ...]
    num_blocks: int
    block_size: int
    segments: tuple[Segment, ...]
    kind: str
    family: str = "attention"
    dtype: str = ""
    total_heads: int = 0
    head_start: int = 0
    num_heads: int = 0
    attn_isa: str = ""

    def spec(self, region_ids: list[int]) -> LayoutSpec:
        """The wire description, with buffer indexes replaced by registered region ids."""
        return LayoutSpec(
            layer_names=list(self.layer_names),
            layer_offsets=list(self.layer_offsets),
            region_ids=[region_ids[i] for i in self.buffer_index],
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            segments=[
                SegmentSpec(s.name, s.offset, s.block_stride, s.nbytes) for s in self.segments
            ],
            kind=self.kind,
            family=self.family,
            dtype=self.dtype,
            total_heads=self.total_heads,
            head_start=self.head_start,
            num_heads=self.num_heads,
            attn_isa=self.attn_isa,
        )


@dataclass(frozen=True)
class CacheGeometry:
    """Every group of one worker: the distinct buffers (to register once) and one layout per
    group, whose ``buffer_index`` points into ``buffers``."""

    buffers: tuple[Buffer, ...]
    groups: tuple[KvCacheGeometry, ...]
    tp_rank: int = 0
    tp_size: int = 1

    def spec(self, region_ids: list[int]) -> CacheSpec:
        return CacheSpec(
            groups=[g.spec(region_ids) for g in self.groups],
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer of every group, in group order (the index of a layer's rapid-send event)."""
        return tuple(name for g in self.groups for name in g.layer_names)


def _block_segments(tensor: torch.Tensor, num_blocks: int) -> tuple[tuple[Segment, ...], str]:
    """Per-block segments of one layer tensor, from its shape and strides."""
    itemsize = tensor.element_size()
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())

    def contiguous_tail(dims: tuple[int, ...], dim_strides: tuple[int, ...]) -> int | None:
        # Bytes of the trailing dims if they are densely packed, else None.
        expected = 1
        for size, stride in zip(reversed(dims), reversed(dim_strides), strict=True):
            if size != 1 and stride != expected:
                return None
            expected *= size
        return expected * itemsize

    if shape and shape[0] == num_blocks:
        # [num_blocks, ...]: one segment per block (CPU: [nb, kv_heads, block_size, 2*head_dim]).
        nbytes = contiguous_tail(shape[1:], strides[1:])
        if nbytes is not None:
            return (Segment("kv", 0, strides[0] * itemsize, nbytes),), "blocks_major"
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        # [2, num_blocks, ...]: a K plane and a V plane.
        nbytes = contiguous_tail(shape[2:], strides[2:])
        if nbytes is not None:
            stride = strides[1] * itemsize
            return (
                Segment("k", 0, stride, nbytes),
                Segment("v", strides[0] * itemsize, stride, nbytes),
            ), "kv_first"
    raise UnsupportedLayoutError(
        f"KV cache tensor of shape {shape}, strides {strides} (num_blocks={num_blocks}) "
        "is neither [num_blocks, ...] nor [2, num_blocks, ...] with dense blocks"
    )


def _layer_segments(
    name: str, value: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...], num_blocks: int
) -> tuple[torch.Tensor, tuple[Segment, ...], str]:
    """(first tensor, segments relative to it, kind) of one layer: a tensor, or a list of state
    tensors (one segment each, named state0, state1, ...) that must share one buffer."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise UnsupportedLayoutError(f"layer {name}: empty list of KV cache tensors")
        first = value[0]
        base = first.untyped_storage().data_ptr()
        segments = []
        for i, tensor in enumerate(value):
            if tensor.untyped_storage().data_ptr() != base:
                raise UnsupportedLayoutError(f"layer {name}: state tensors in separate buffers")
            if not tensor.shape or tensor.shape[0] != num_blocks:
                raise UnsupportedLayoutError(
                    f"layer {name}: state tensor {i} of shape {tuple(tensor.shape)} is not "
                    f"[num_blocks={num_blocks}, ...]"
                )
            (seg,), _ = _block_segments(tensor, num_blocks)
            delta = tensor.data_ptr() - first.data_ptr()
            segments.append(Segment(f"state{i}", delta, seg.block_stride, seg.nbytes))
        return first, tuple(segments), "state_slots"
    segments, kind = _block_segments(value, num_blocks)
    return value, segments, kind


def describe_kv_cache_groups(
    kv_caches: dict[str, torch.Tensor] | dict[str, object],
    groups: list[KvGroup],
    num_blocks: int | None = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> CacheGeometry:
    """Find the buffers behind ``kv_caches`` and, per group, each layer's place in them.

    ``num_blocks`` (vLLM's ``kv_cache_config.num_blocks``) tells the block dimension apart; when
    not given, a 5-d ``[2, num_blocks, ...]`` tensor is taken as K/V-first, anything else as
    blocks-first. Every layer of a group must have the same block geometry.
    """
    if not kv_caches:
        raise UnsupportedLayoutError("vLLM registered no KV cache tensors")
    firsts = {n: (v[0] if isinstance(v, (list, tuple)) and v else v) for n, v in kv_caches.items()}
    devices = {_device_name(t.device) for t in firsts.values()}  # type: ignore[union-attr]
    device = next(iter(devices)) if len(devices) == 1 else ""
    if not (device == "cpu" or device.startswith("cuda:")):
        raise UnsupportedLayoutError(
            f"KV caches must all be in host memory or all on one CUDA device, not {sorted(devices)}"
        )
    if num_blocks is None:
        first = next(iter(firsts.values()))
        kv_first = first.dim() == 5 and first.shape[0] == 2  # type: ignore[union-attr]
        num_blocks = int(first.shape[1] if kv_first else first.shape[0])  # type: ignore[union-attr]
    buffers: list[Buffer] = []
    by_base: dict[int, int] = {}
    described: list[KvCacheGeometry] = []
    for group in groups:
        if group.family not in FAMILIES:
            raise UnsupportedLayoutError(f"KV-cache group family {group.family!r} is not supported")
        missing = [n for n in group.layer_names if n not in kv_caches]
        if missing or not group.layer_names:
            raise UnsupportedLayoutError(f"{group.family} group: no KV cache for layers {missing}")
        segments: tuple[Segment, ...] | None = None
        kind = ""
        offsets: list[int] = []
        index: list[int] = []
        for name in group.layer_names:
            tensor, seg, seg_kind = _layer_segments(name, kv_caches[name], num_blocks)  # type: ignore[arg-type]
            if segments is None:
                segments, kind = seg, seg_kind
            elif seg != segments:
                raise UnsupportedLayoutError(
                    f"layer {name} has a different block geometry than the rest of its "
                    f"{group.family} group"
                )
            storage = tensor.untyped_storage()
            base = storage.data_ptr()
            if base not in by_base:
                by_base[base] = len(buffers)
                buffers.append(Buffer(base, storage.nbytes(), device))
            index.append(by_base[base])
            offsets.append(tensor.data_ptr() - base)
        assert segments is not None
        described.append(
            KvCacheGeometry(
                buffers=(),
                layer_names=tuple(group.layer_names),
                layer_offsets=tuple(offsets),
                buffer_index=tuple(index),
                num_blocks=num_blocks,
                block_size=group.block_size,
                segments=segments,
                kind=kind,
                family=group.family,
                dtype=group.dtype,
                total_heads=group.total_heads,
                head_start=group.head_start,
                num_heads=group.num_heads,
                attn_isa=group.attn_isa if device == "cpu" else "",
            )
        )
    return CacheGeometry(tuple(buffers), tuple(described), tp_rank, tp_size)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index or 0}"
    return device.type
