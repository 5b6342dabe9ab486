"""R3 manifests: which rows of which stored objects make up which sample, as pure metadata.

A ``Manifest`` describes a batch of samples of one tensor field (e.g. R3 top-k recordings, rows of
shape ``[layers, k]`` int32, one row per token). Sample ``i`` is rows
``[row_start[i], row_start[i] + length[i])`` of item ``key`` of object ``refs[ref_index[i]]``.
Reorganising a batch (slicing, reordering, grouping, concatenating, cutting token ranges) only
rewrites these small numpy columns: no payload byte is read or moved, and pickling a manifest costs
a few bytes per sample (KBs for a batch whose payload is GBs).

``materialize`` is the only place payload bytes move: it gathers every sample straight from the
shared pool into the training layout (packed ``[tokens, *row]`` or padded ``[samples, max_len,
*row]``), one copy per byte, with contiguous runs merged so that neighbouring samples of one object
become a single copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import CallerError
from .ref import Ref

if TYPE_CHECKING:
    from .client import Client


class Manifest:
    __slots__ = (
        "dtype",
        "key",
        "length",
        "ref_index",
        "refs",
        "row_shape",
        "row_start",
        "sample_id",
    )

    def __init__(
        self,
        refs: Sequence[Ref],
        ref_index: np.ndarray,
        row_start: np.ndarray,
        length: np.ndarray,
        sample_id: np.ndarray,
        *,
        dtype: Any,
        row_shape: tuple[int, ...],
        key: str | int | None = None,
    ) -> None:
        self.refs = list(refs)
        self.ref_index = np.ascontiguousarray(ref_index, dtype=np.int32)
        self.row_start = np.ascontiguousarray(row_start, dtype=np.int64)
        self.length = np.ascontiguousarray(length, dtype=np.int64)
        self.sample_id = np.ascontiguousarray(sample_id, dtype=np.int64)
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(int(d) for d in row_shape)
        self.key = key
        n = len(self.ref_index)
        if not len(self.row_start) == len(self.length) == len(self.sample_id) == n:
            raise CallerError("manifest columns must have one entry per sample")
        if n and (self.ref_index.min() < 0 or self.ref_index.max() >= len(self.refs)):
            raise CallerError("manifest ref_index out of range")
        if n and (self.length.min() < 0 or self.row_start.min() < 0):
            raise CallerError("manifest rows must be non-negative")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_packed(
        cls,
        ref: Ref,
        lengths: Sequence[int] | np.ndarray,
        *,
        dtype: Any,
        row_shape: tuple[int, ...],
        key: str | int | None = None,
        sample_ids: Sequence[int] | np.ndarray | None = None,
    ) -> Manifest:
        """One object whose item ``key`` holds the samples' rows back to back."""
        lengths = np.asarray(lengths, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(lengths) else lengths
        ids = np.arange(len(lengths)) if sample_ids is None else np.asarray(sample_ids)
        return cls(
            [ref], np.zeros(len(lengths), np.int32), starts, lengths, ids,
            dtype=dtype, row_shape=row_shape, key=key,
        )  # fmt: skip

    @classmethod
    def from_refs(
        cls,
        refs: Sequence[Ref],
        lengths: Sequence[int] | np.ndarray,
        *,
        dtype: Any,
        row_shape: tuple[int, ...],
        key: str | int | None = None,
        sample_ids: Sequence[int] | np.ndarray | None = None,
    ) -> Manifest:
        """One object per sample (rows from 0)."""
        n = len(refs)
        ids = np.arange(n) if sample_ids is None else np.asarray(sample_ids)
        return cls(
            refs, np.arange(n), np.zeros(n, np.int64), np.asarray(lengths), ids,
            dtype=dtype, row_shape=row_shape, key=key,
        )  # fmt: skip

    def _with(self, index: Any, refs: list[Ref] | None = None) -> Manifest:
        return Manifest(
            self.refs if refs is None else refs,
            self.ref_index[index], self.row_start[index], self.length[index], self.sample_id[index],
            dtype=self.dtype, row_shape=self.row_shape, key=self.key,
        )  # fmt: skip

    # -- reorganisation (metadata only) ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ref_index)

    def __getitem__(self, index: int | slice | np.ndarray | Sequence[int]) -> Manifest:
        """Samples by position: an int, a slice, an index array (reorders) or a boolean mask."""
        if isinstance(index, int | np.integer):
            index = slice(int(index), int(index) + 1 if index != -1 else None)
        return self._with(index)

    def take(self, order: Sequence[int] | np.ndarray) -> Manifest:
        return self._with(np.asarray(order, dtype=np.int64))

    def sort_by_length(self, descending: bool = True) -> Manifest:
        order = np.argsort(-self.length if descending else self.length, kind="stable")
        return self._with(order)

    def group_by_sample(self) -> Manifest:
        """Samples ordered by sample id (stable), e.g. to bring a sample's responses together."""
        return self._with(np.argsort(self.sample_id, kind="stable"))

    def token_slice(
        self, start: int | np.ndarray, stop: int | np.ndarray | None = None
    ) -> Manifest:
        """Keep tokens ``[start, stop)`` of every sample (scalars or per-sample arrays; clipped)."""
        start_arr = np.clip(
            np.broadcast_to(np.asarray(start, np.int64), self.length.shape), 0, self.length
        )
        stop_arr = (
            self.length
            if stop is None
            else np.broadcast_to(np.asarray(stop, np.int64), self.length.shape)
        )
        stop_arr = np.clip(stop_arr, start_arr, self.length)
        return Manifest(
            self.refs,
            self.ref_index,
            self.row_start + start_arr,
            stop_arr - start_arr,
            self.sample_id,
            dtype=self.dtype,
            row_shape=self.row_shape,
            key=self.key,
        )

    def split_by_tokens(self, max_tokens: int) -> list[Manifest]:
        """Consecutive micro-batches of at most ``max_tokens`` tokens (a longer sample alone)."""
        if max_tokens <= 0:
            raise CallerError(f"max_tokens must be positive, got {max_tokens}")
        batches, begin, tokens = [], 0, 0
        for i, n in enumerate(self.length.tolist()):
            if tokens and tokens + n > max_tokens:
                batches.append(self[begin:i])
                begin, tokens = i, 0
            tokens += n
        if begin < len(self):
            batches.append(self[begin:])
        return batches

    @staticmethod
    def concat(manifests: Iterable[Manifest]) -> Manifest:
        parts = list(manifests)
        if not parts:
            raise CallerError("concat needs at least one manifest")
        first = parts[0]
        for m in parts[1:]:
            if (m.dtype, m.row_shape, m.key) != (first.dtype, first.row_shape, first.key):
                raise CallerError(
                    "cannot concat manifests of different fields: "
                    f"{m.dtype}{m.row_shape}[{m.key!r}] vs "
                    f"{first.dtype}{first.row_shape}[{first.key!r}]"
                )
        refs: dict[Ref, int] = {}
        remapped = []
        for m in parts:
            table = np.array([refs.setdefault(r, len(refs)) for r in m.refs], dtype=np.int32)
            remapped.append(table[m.ref_index] if len(m) else m.ref_index)
        return Manifest(
            list(refs),
            np.concatenate(remapped),
            np.concatenate([m.row_start for m in parts]),
            np.concatenate([m.length for m in parts]),
            np.concatenate([m.sample_id for m in parts]),
            dtype=first.dtype,
            row_shape=first.row_shape,
            key=first.key,
        )

    def __add__(self, other: Manifest) -> Manifest:
        return Manifest.concat([self, other])

    # -- facts --------------------------------------------------------------------------------
    @property
    def row_nbytes(self) -> int:
        return int(self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64)))

    @property
    def num_tokens(self) -> int:
        return int(self.length.sum())

    @property
    def nbytes(self) -> int:
        """Payload bytes this manifest refers to (not its own size)."""
        return self.num_tokens * self.row_nbytes

    def used_refs(self) -> list[Ref]:
        return [self.refs[i] for i in np.unique(self.ref_index)]

    def __repr__(self) -> str:
        return (
            f"Manifest({len(self)} samples, {self.num_tokens} tokens of "
            f"{self.dtype}{list(self.row_shape)}, {self.nbytes / 2**20:.1f} MiB "
            f"in {len(self.refs)} refs)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        columns = (self.ref_index, self.row_start, self.length, self.sample_id)
        meta = (self.dtype.str, self.row_shape, self.key)
        return (_rebuild, (self.refs, columns, meta))


def _rebuild(refs: list[Ref], columns: tuple[np.ndarray, ...], meta: tuple) -> Manifest:
    dtype, row_shape, key = meta
    return Manifest(refs, *columns, dtype=dtype, row_shape=row_shape, key=key)


def _rows(value: Any, manifest: Manifest) -> np.ndarray:
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype != manifest.dtype and array.dtype.itemsize == manifest.dtype.itemsize:
        array = array.view(manifest.dtype)
    if array.dtype != manifest.dtype:
        raise CallerError(f"stored item has dtype {array.dtype}, manifest says {manifest.dtype}")
    return array.reshape(-1, *manifest.row_shape)


def materialize(
    manifest: Manifest,
    out: Any = None,
    *,
    client: Client,
    layout: str = "packed",
    pad_value: int | float = 0,
) -> Any:
    """Gather the manifest's rows into ``out`` (numpy array or torch CPU tensor), one copy per byte.

    ``layout="packed"``: ``out`` is ``[num_tokens, *row_shape]``, samples back to back in manifest
    order. ``layout="padded"``: ``out`` is ``[samples, max_len, *row_shape]``; the tail of each
    sample's row block is filled with ``pad_value``. ``out=None`` allocates a numpy array.
    """
    n = len(manifest)
    lengths = manifest.length
    if layout == "packed":
        shape = (manifest.num_tokens, *manifest.row_shape)
        dst_rows = np.concatenate(([0], np.cumsum(lengths)[:-1])) if n else lengths
    elif layout == "padded":
        max_len = int(lengths.max()) if n else 0
        shape = (n, max_len, *manifest.row_shape)
        dst_rows = np.arange(n, dtype=np.int64) * max_len
    else:
        raise CallerError(f"layout must be 'packed' or 'padded', got {layout!r}")
    if out is None:
        out = np.empty(shape, dtype=manifest.dtype)
    target = out.numpy() if not isinstance(out, np.ndarray) else out  # torch CPU: shares memory
    if tuple(target.shape) != shape or target.dtype != manifest.dtype:
        raise CallerError(
            f"out must be {manifest.dtype}{list(shape)}, got {target.dtype}{list(target.shape)}"
        )
    flat = target.reshape(-1, *manifest.row_shape)
    if layout == "padded" and n:
        pad_mask = np.arange(shape[1])[None, :] >= lengths[:, None]
        target[pad_mask] = pad_value
    if n == 0:
        return out
    # Merge runs: consecutive samples from one object, contiguous at both ends, become one copy.
    src_end = manifest.row_start + lengths
    joins = (
        (manifest.ref_index[1:] == manifest.ref_index[:-1])
        & (manifest.row_start[1:] == src_end[:-1])
        & (dst_rows[1:] == dst_rows[:-1] + lengths[:-1])
    )
    run_starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    run_ends = np.concatenate((run_starts[1:], [n]))
    sources: dict[int, np.ndarray] = {}
    for first, last in zip(run_starts.tolist(), run_ends.tolist(), strict=True):
        ref_i = int(manifest.ref_index[first])
        rows = sources.get(ref_i)
        if rows is None:
            value = client.get(manifest.refs[ref_i], as_="numpy")
            if manifest.key is not None:
                value = value[manifest.key]
            rows = sources[ref_i] = _rows(value, manifest)
        src = int(manifest.row_start[first])
        count = int(src_end[last - 1] - src)
        dst = int(dst_rows[first])
        if src + count > len(rows):
            raise CallerError(
                f"sample {int(manifest.sample_id[first])}: rows {src}..{src + count} beyond the "
                f"{len(rows)} rows of {manifest.refs[ref_i]!r}"
            )
        flat[dst : dst + count] = rows[src : src + count]
    return out
