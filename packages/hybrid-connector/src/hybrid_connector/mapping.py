"""Which bytes of P's cache go to which bytes of D's: one KV-cache group of one rank pair at a time.

The one place that knows how two ranks' caches relate; it returns IpcBlocks and knows nothing of
the network. ``check_compatible`` runs when a pull arrives, before any byte moves; ``plan_copy``
when the send starts; ``source_ranks`` tells a D rank which P ranks to pull from.

How a pair is mapped (each step refuses with PeerError what it cannot do)::

    LayoutSpec (P rank)           LayoutSpec (D rank)
         |  ipc_layout: segments with head/token axes, derived from kind, head fields and
         |  attn_isa (the CPU kernel's byte order: vec, or AMX tiles)
         v                             v
    heads: both narrowed to the KV heads they share (TP split or merge); replicated groups
           (MLA latent, state slots) are taken whole
         |
    block size equal -> parse_blocks (block i -> block i)
    block size differs (integer ratio) -> layout.token_major() + parse_blocks_resized
                                          (token ranges; ipcblock knows where tokens lie)
    state group -> slots copied 1:1, no token arithmetic
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ipcblock import (
    CPU_ISAS,
    BlockSizeRatioError,
    Dim,
    HeadRangeError,
    IpcBlockError,
    NotTokenMajorError,
    PagedKVLayout,
    Segment,
    head_name,
    parse_blocks,
    parse_blocks_resized,
)

from hybrid_connector.errors import ConfigError, PeerError
from hybrid_connector.protocol import CacheSpec, LayoutSpec, SegmentSpec

STATE = "state"
MLA = "mla"
# vLLM's CPU backend ([nb, kv_heads, block_size, 2*head_dim] per layer): PagedKVLayout.cpu
# knows what its bytes are per attention ISA (heads outermost; inside each head K transposed for
# "vec", K and V in tiles for "amx").
HEAD_MAJOR_KINDS = frozenset({"blocks_major", "cpu"})
# CPU attention ISAs that store a block in the "vec" byte order ("" = not said).
VEC_ISAS = frozenset({"", "vec", "vec16"})
# Element sizes of the cache dtypes whose CPU layout was measured (dtype as LayoutSpec names it).
CPU_ITEMSIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
# FlashAttention [2, nb, bs, H, hd] / FlashInfer [nb, 2, bs, H, hd]: a K or V block is [bs, H, hd].
TOKEN_MAJOR_KINDS = frozenset({"kv_first", "blocks_first"})

BlockIds = Sequence[int] | np.ndarray


# ------------------------------------------------------------------ layouts
def ipc_layout(spec: LayoutSpec) -> PagedKVLayout:
    """The ipcblock layout of one group of one rank, with head and token axes where known.

    CPU attention blocks come from ipcblock's constructor (it knows where each head and token
    lies); other kinds get axes from ``kind``, ``group`` and the head fields, so the wire needs
    nothing more than LayoutSpec. A segment of an unknown kind is opaque: it is copied whole, to
    the same geometry only.
    """
    replicated = spec.family in {STATE, MLA} or spec.total_heads == 0
    try:
        cpu = None if replicated else _cpu_layout(spec)
        if cpu is not None:
            return cpu
        return PagedKVLayout.from_segments(
            np.asarray(spec.layer_offsets, dtype=np.int64),
            spec.num_blocks,
            [_segment(spec, s) for s in spec.segments],
            kind=spec.kind,
            block_size=0 if spec.family == STATE else spec.block_size,
            head_start=0 if replicated else spec.head_start,
            total_heads=0 if replicated else spec.total_heads,
        )
    except IpcBlockError as err:
        raise PeerError(f"invalid {spec.family} KV layout: {err}") from err


def _cpu_layout(spec: LayoutSpec) -> PagedKVLayout | None:
    """PagedKVLayout.cpu for a CPU attention group described as one whole-block segment, in the
    byte order of its attention ISA (unsaid: "vec"); None when the spec does not say enough
    (dtype not in CPU_ITEMSIZE, heads unknown, an ISA whose byte order is not known)."""
    itemsize = CPU_ITEMSIZE.get(spec.dtype, 0)
    heads, bs = spec.num_heads, spec.block_size
    isa = spec.attn_isa or "vec"
    if spec.kind not in HEAD_MAJOR_KINDS or not itemsize or len(spec.segments) != 1:
        return None
    if isa not in CPU_ISAS:
        return None
    seg = spec.segments[0]
    if heads <= 0 or bs <= 0 or seg.offset or seg.nbytes % (2 * itemsize * bs * heads):
        return None
    return PagedKVLayout.cpu(
        np.asarray(spec.layer_offsets, dtype=np.int64), spec.num_blocks, heads, bs,
        seg.nbytes // (2 * itemsize * bs * heads), itemsize, head_start=spec.head_start,
        total_heads=spec.total_heads, block_stride=seg.block_stride, isa=isa,
    )  # fmt: skip


def _segment(spec: LayoutSpec, seg: SegmentSpec) -> Segment:
    dims, has_heads = _derived_dims(spec, seg.nbytes)
    name = seg.name
    if spec.kind in HEAD_MAJOR_KINDS and spec.attn_isa not in VEC_ISAS:
        # Bytes in another kernel's order (AMX fp8, an ISA not measured): equal only to its own.
        name = f"{name}_{spec.attn_isa}"
    if has_heads:
        stop = spec.head_start + spec.num_heads
        name = head_name(seg.name, spec.head_start, stop, spec.total_heads)
    return Segment(name, seg.offset, seg.block_stride, seg.nbytes, dims)


def _derived_dims(spec: LayoutSpec, nbytes: int) -> tuple[tuple[Dim, ...], bool]:
    """(axes of one segment, whether they include a head axis) from the layout's kind."""
    bs = spec.block_size
    if spec.family == STATE or bs <= 0:
        return (), False
    known = spec.kind in HEAD_MAJOR_KINDS or spec.kind in TOKEN_MAJOR_KINDS
    if spec.family == MLA:
        # One latent row per token ([nb, 1, bs, row] on CPU, [nb, bs, row] on GPU).
        if not known or nbytes % bs:
            return (), False
        return (Dim("token", bs, nbytes // bs),), False
    heads = spec.num_heads
    if not known or heads <= 0 or spec.total_heads <= 0 or nbytes % (heads * bs):
        return (), False
    row = nbytes // (heads * bs)
    if spec.kind in HEAD_MAJOR_KINDS:
        # A CPU block of a dtype not in CPU_ITEMSIZE: heads are outermost (TP slicing works),
        # but where a token lies inside a head depends on the element size: not resizable.
        return (Dim("head", heads, bs * row),), True
    return (Dim("token", bs, heads * row), Dim("head", heads, row)), True


@dataclass(frozen=True)
class _Pair:
    src: PagedKVLayout
    dst: PagedKVLayout
    resized: bool


def _pair(src: LayoutSpec, dst: LayoutSpec) -> _Pair:
    """P's and D's layouts narrowed to the bytes they share, ready for parse_blocks(_resized)."""
    if src.family != dst.family:
        raise PeerError(f"KV-cache group family differs: P {src.family}, D {dst.family}")
    if src.layer_names != dst.layer_names:
        raise PeerError(
            f"layers differ: P {len(src.layer_names)} ({src.layer_names[:2]}...), "
            f"D {len(dst.layer_names)} ({dst.layer_names[:2]}...)"
        )
    for spec, side in ((src, "P"), (dst, "D")):
        if len(spec.region_ids) != len(spec.layer_offsets):
            raise PeerError(f"{side} layout: one region id per layer expected")
    s, d = ipc_layout(src), ipc_layout(dst)
    s, d = _shared_heads(src, dst, s, d)
    resized = src.block_size != dst.block_size
    if resized and src.family == STATE:
        raise PeerError(
            f"state group block sizes differ (P {src.block_size}, D {dst.block_size}): in a "
            "hybrid model vLLM aligns state slots to the block size, so P and D would disagree "
            "on which slot holds the final state"
        )
    try:
        if resized:
            big, small = max(src.block_size, dst.block_size), min(src.block_size, dst.block_size)
            if small <= 0 or big % small:
                raise BlockSizeRatioError(
                    f"block sizes P {src.block_size} and D {dst.block_size} are not integer "
                    "multiples of each other"
                )
            s, d = s.token_major(), d.token_major()
            # Geometry check without ids: per-token bytes, names, pieces.
            parse_blocks_resized(s, d, [], [], num_tokens=0)
        else:
            parse_blocks(s, d, [], [])
    except NotTokenMajorError as err:
        raise PeerError(
            f"block_size differs (P {src.block_size}, D {dst.block_size}) but the "
            f"{src.kind} layout does not say where each token lies: {err}"
        ) from err
    except IpcBlockError as err:
        raise PeerError(f"block geometry differs: {err}") from err
    return _Pair(s, d, resized)


def _shared_heads(
    src: LayoutSpec, dst: LayoutSpec, s: PagedKVLayout, d: PagedKVLayout
) -> tuple[PagedKVLayout, PagedKVLayout]:
    """Both layouts restricted to the global KV heads P's rank and D's rank have in common."""
    if not s.total_heads and not d.total_heads:
        return s, d  # replicated (MLA latent, state) or heads unknown
    if s.total_heads != d.total_heads:
        raise PeerError(f"KV heads differ: P has {s.total_heads} in all, D {d.total_heads}")
    p_heads = range(src.head_start, src.head_start + src.num_heads)
    d_heads = range(dst.head_start, dst.head_start + dst.num_heads)
    lo, hi = max(p_heads.start, d_heads.start), min(p_heads.stop, d_heads.stop)
    if lo >= hi:
        raise PeerError(
            f"P's rank holds KV heads [{p_heads.start}, {p_heads.stop}), D's rank "
            f"[{d_heads.start}, {d_heads.stop}): none in common (pulled from the wrong P rank)"
        )
    if p_heads == d_heads:
        return s, d
    if not s.num_heads or not d.num_heads:
        raise PeerError(
            f"P holds heads {list(p_heads)}, D {list(d_heads)}, but the {src.kind} layout "
            "does not say where each head lies"
        )
    try:
        return s.select_heads(lo, hi - lo), d.select_heads(lo, hi - lo)
    except HeadRangeError as err:
        raise PeerError(f"cannot split KV heads: {err}") from err


# ------------------------------------------------------------------ checks and plans
def check_compatible(local: LayoutSpec, remote: LayoutSpec) -> None:
    """Raise PeerError unless P's group ``local`` can fill D's group ``remote``.

    Allowed: same geometry; a different block size with an integer ratio (not for state
    groups); a different TP split of the KV heads as long as the two ranks share a head.
    """
    _pair(local, remote)


def plan_copy(
    src: LayoutSpec,
    dst: LayoutSpec,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    first_block: int = 0,
    num_tokens: int | None = None,
) -> np.ndarray:
    """IpcBlocks that write the request's KV of one group from P (``src``) into D (``dst``).

    ``src_block_ids``: every block P holds for the request in this group, from token 0, in P's
    block size. ``dst_block_ids``: D's new blocks, after the ``first_block`` ones D already holds
    (its prefix-cache hit), in D's block size. ``num_tokens``: prompt tokens D needs in total
    (default: D's blocks full). Only the KV heads both ranks hold are copied, straight into D's
    blocks. For a state group (``group == "state"``) a block is a state slot and the slots are
    copied 1:1, with no token arithmetic. PeerError when the counts do not fit.
    """
    pair = _pair(src, dst)
    src_ids = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    if dst_ids.size == 0:
        raise PeerError("transfer_kv names no destination block")
    if src.family == STATE:
        if src_ids.size != dst_ids.size:
            raise PeerError(
                f"state group: P holds {src_ids.size} state slots, D gave {dst_ids.size}"
            )
        return _parse(pair, src, dst, src_ids, dst_ids)
    if first_block < 0:
        raise PeerError(f"first_block must not be negative, got {first_block}")
    d_bs, s_bs = dst.block_size, src.block_size
    if num_tokens is None:
        num_tokens = (first_block + dst_ids.size) * d_bs
    needed = -(-num_tokens // d_bs)
    if first_block + dst_ids.size != needed:
        raise PeerError(
            f"D sent {dst_ids.size} blocks after {first_block} cached ones for {num_tokens} "
            f"tokens ({needed} blocks of {d_bs})"
        )
    src_needed = -(-num_tokens // s_bs)
    if src_ids.size < src_needed:
        raise PeerError(
            f"D needs {num_tokens} tokens ({src_needed} blocks of {s_bs} on P) but P holds "
            f"{src_ids.size} blocks"
        )
    if not pair.resized:
        return _parse(pair, src, dst, src_ids[first_block:needed], dst_ids)
    src_first = first_block * d_bs // s_bs
    return _parse(
        pair,
        src,
        dst,
        src_ids[src_first:src_needed],
        dst_ids,
        num_tokens=num_tokens,
        src_first_block=src_first,
        dst_first_block=first_block,
    )


def _parse(
    pair: _Pair,
    src: LayoutSpec,
    dst: LayoutSpec,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    **resize: int,
) -> np.ndarray:
    regions = {
        "src_region": np.asarray(src.region_ids, dtype=np.int64),
        "dst_region": np.asarray(dst.region_ids, dtype=np.int64),
    }
    try:
        if pair.resized:
            return parse_blocks_resized(pair.src, pair.dst, src_ids, dst_ids, **regions, **resize)
        return parse_blocks(pair.src, pair.dst, src_ids, dst_ids, **regions)
    except IpcBlockError as err:  # ids out of range, duplicate destinations, token range
        raise PeerError(f"cannot map P's blocks onto D's: {err}") from err


# ------------------------------------------------------------------ tensor parallelism
def rank_heads(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads that rank ``tp_rank`` of ``tp_size`` holds, as vLLM shards them.

    With more ranks than KV heads vLLM replicates: ``tp_size // total_heads`` consecutive ranks
    hold the same one head. ``total_heads == 0`` (replicated group): empty range.
    """
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if total_heads <= 0:
        return range(0)
    if tp_size >= total_heads:
        if tp_size % total_heads:
            raise ConfigError(f"tp_size {tp_size} is not a multiple of {total_heads} KV heads")
        head = tp_rank // (tp_size // total_heads)
        return range(head, head + 1)
    if total_heads % tp_size:
        raise ConfigError(f"{total_heads} KV heads do not split over tp_size {tp_size}")
    per_rank = total_heads // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


@dataclass(frozen=True)
class Source:
    """One P rank a D rank pulls from, and the global KV heads it takes from it.

    ``heads`` is empty for a group taken whole from that one rank (MLA latent, state slots).
    """

    p_rank: int
    heads: range


def source_ranks(p_tp: int, d_tp: int, d_rank: int, group: LayoutSpec) -> list[Source]:
    """The P ranks D's rank ``d_rank`` pulls one group from, in head order.

    Paged K/V: every P rank holding one of D's heads, each head from exactly one P rank (where P
    replicates a head, D's ranks are spread over the copies). MLA's latent is replicated: one P
    rank, ``d_rank % p_tp``, so D's ranks spread over P's instead of all reading rank 0. State
    groups: the same rank (equal TP only, PeerError otherwise).
    """
    if p_tp <= 0 or d_tp <= 0:
        raise ConfigError(f"tensor parallel sizes must be positive, got P {p_tp}, D {d_tp}")
    rank_heads(0, d_tp, d_rank)  # validates d_rank
    if group.family == STATE:
        # Linear-attention state is sharded by heads too, and its layout does not say how.
        if p_tp != d_tp:
            raise PeerError(f"state groups need equal TP on P and D, got P {p_tp}, D {d_tp}")
        return [Source(d_rank, range(0))]
    total = 0 if group.family == MLA else group.total_heads
    if total <= 0:
        return [Source(d_rank % p_tp, range(0))]
    p_ranges = [rank_heads(total, p_tp, p) for p in range(p_tp)]
    sources: list[Source] = []
    for head in rank_heads(total, d_tp, d_rank):
        holders = [p for p, heads in enumerate(p_ranges) if head in heads]
        p_rank = holders[d_rank % len(holders)]
        last = sources[-1] if sources else None
        if last is not None and last.p_rank == p_rank and last.heads.stop == head:
            sources[-1] = Source(p_rank, range(last.heads.start, head + 1))
        else:
            sources.append(Source(p_rank, range(head, head + 1)))
    return sources


# ------------------------------------------------------------------ whole caches, TP pairs
def check_cache_compatible(local: CacheSpec, remote: CacheSpec) -> None:
    """Raise PeerError unless every KV-cache group of ``remote`` matches ``local``'s, in order
    (count, family, dtype; then ``mapping.check_compatible`` per group)."""
    if len(local.groups) != len(remote.groups):
        raise PeerError(
            f"KV-cache groups differ: local {[g.family for g in local.groups]}, "
            f"peer {[g.family for g in remote.groups]}"
        )
    for index, (mine, theirs) in enumerate(zip(local.groups, remote.groups, strict=True)):
        if mine.family != theirs.family:
            raise PeerError(
                f"group {index}: family differs: local {mine.family}, peer {theirs.family}"
            )
        if mine.dtype and theirs.dtype and mine.dtype != theirs.dtype:
            raise PeerError(
                f"group {index}: dtype differs: local {mine.dtype}, peer {theirs.dtype}"
            )
        try:
            check_compatible(mine, theirs)
        except PeerError as err:
            raise PeerError(f"group {index} ({mine.family}): {err}") from err


def kvt_transfer_id(transfer_id: str, p_rank: int, p_tp: int, d_rank: int, d_tp: int) -> str:
    """kvt's request id for the bytes P rank ``p_rank`` sends D rank ``d_rank``: the transfer id
    itself with one rank on each side, else one id per rank pair (a kvt id is unique per engine,
    and one P rank may serve several D ranks, one D rank pull from several P ranks)."""
    if p_tp == 1 and d_tp == 1:
        return transfer_id
    return f"{transfer_id}/p{p_rank}d{d_rank}"


def pull_sources(
    p_tp: int, d_tp: int, d_rank: int, groups: list[LayoutSpec]
) -> dict[int, list[int]]:
    """The P ranks D rank ``d_rank`` pulls from, each with the KV-cache groups (indices) it takes
    from that rank (``mapping.source_ranks`` per group). PeerError/ConfigError if impossible."""
    sources: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        for source in source_ranks(p_tp, d_tp, d_rank, group):
            taken = sources.setdefault(source.p_rank, [])
            if index not in taken:
                taken.append(index)
    return dict(sorted(sources.items()))


def pulling_ranks(p_rank: int, p_tp: int, d_tp: int, groups: list[LayoutSpec]) -> list[int]:
    """The D ranks that pull from P rank ``p_rank`` (P's fan-in)."""
    return [d for d in range(d_tp) if p_rank in pull_sources(p_tp, d_tp, d, groups)]
