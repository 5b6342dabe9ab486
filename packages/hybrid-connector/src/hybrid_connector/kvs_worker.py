"""KVS, worker half: copy blocks between vLLM's KV cache and the shared store, off the step.

One thread per worker (``KvsWorker``) owns this rank's refstore client and does every copy:
loads first (a request waits for them), then saves. vLLM's hooks only queue: ``handle`` (from
``bind_connector_metadata``) queues loads at once and saves for the step's end, ``step_done``
(``wait_for_save``: the forward pass wrote the step's blocks) releases the saves.

An object holds one block of one KV-cache group on one TP rank (a rank-shared group, MLA's
latent, only rank 0 saves; every rank loads it): each layer's segments of the block, in layer
order (a state group's block is one state: each linear layer's conv and recurrent state), then
a trailer that names what the bytes are::

    payload (block_nbytes) | magic "KVSBLK01" | key (19) | layout fingerprint (16) |
                             payload length (u64) | CRC32 of the payload (u32) | zero pad to 64

A load checks the trailer against what it asked for (the key, this rank's layout, the length,
and with ``verify="crc"`` the CRC) before a byte reaches vLLM's blocks; any mismatch, a missing
object or a failing store fails the load, and vLLM recomputes the request. The copies between
the pool and the scattered block segments are one ``process_vm_readv`` on this process per
1024 segments (a vectorised scatter/gather in the kernel, no Python loop per segment).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import hashlib
import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybrid_connector import kvs_keys
from hybrid_connector.config import KvsConfig
from hybrid_connector.layout import CacheGeometry, KvCacheGeometry
from hybrid_connector.metadata import NO_BLOCK, KvsLoad, KvsSave

log = logging.getLogger(__name__)

MAGIC = b"KVSBLK01"
_TRAILER = struct.Struct(f"<8s{kvs_keys.KEY_BYTES}s16sQI")
TRAILER_BYTES = 64
IOV_MAX = 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


class KvsLoadError(Exception):
    """A stored block could not be loaded (gone, short, another layout, corrupt)."""


def scatter_copy(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]``, all in this process:
    ``process_vm_readv`` on ourselves, IOV_MAX segments per call."""
    pid = os.getpid()
    n = len(lengths)
    local = np.empty((min(n, IOV_MAX), 2), np.uint64)
    remote = np.empty_like(local)
    for start in range(0, n, IOV_MAX):
        stop = min(start + IOV_MAX, n)
        k = stop - start
        local[:k, 0], local[:k, 1] = dst[start:stop], lengths[start:stop]
        remote[:k, 0], remote[:k, 1] = src[start:stop], lengths[start:stop]
        want = int(lengths[start:stop].sum())
        got = _libc.process_vm_readv(pid, local.ctypes.data, k, remote.ctypes.data, k, 0)
        if got != want:
            err = ctypes.get_errno()
            raise OSError(err, f"scatter copy moved {got} of {want} bytes: {os.strerror(err)}")


@dataclass(frozen=True)
class GroupCopy:
    """Where one group's block bytes lie on this rank: per (layer, segment), the address of
    block 0 and the block stride (vLLM's KV cache), and the offset in an object's payload."""

    base: np.ndarray  # uint64, (L*S,)
    stride: np.ndarray  # uint64, (L*S,)
    length: np.ndarray  # uint64, (L*S,)
    offset: np.ndarray  # uint64, (L*S,): in the payload
    block_nbytes: int
    fingerprint: bytes
    shared: bool  # the same bytes on every TP rank (saved by rank 0 only)

    @classmethod
    def of(cls, group: KvCacheGeometry, buffers: Sequence[Any]) -> GroupCopy:
        base, stride, length = [], [], []
        for layer, offset in enumerate(group.layer_offsets):
            buffer = buffers[group.buffer_index[layer]]
            for seg in group.segments:
                base.append(buffer.address + offset + seg.offset)
                stride.append(seg.block_stride)
                length.append(seg.nbytes)
        lengths = np.asarray(length, np.uint64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        described = (
            group.family,
            group.dtype,
            group.attn_isa,
            group.total_heads,
            group.head_start,
            group.num_heads,
            group.block_size,
            tuple((s.name, s.nbytes) for s in group.segments),
            len(group.layer_names),
        )
        fingerprint = hashlib.blake2b(repr(described).encode(), digest_size=16).digest()
        shared = kvs_keys.family_rank_shared(group.family)
        return cls(
            np.asarray(base, np.uint64),
            np.asarray(stride, np.uint64),
            lengths,
            offsets,
            int(lengths.sum()),
            fingerprint,
            shared,
        )

    def kv_addresses(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(address, length) of every segment of ``block_ids`` in vLLM's cache, block-major."""
        blocks = np.asarray(block_ids, np.uint64)[:, None]
        addresses = self.base[None, :] + blocks * self.stride[None, :]
        lengths = np.broadcast_to(self.length[None, :], addresses.shape)
        return addresses.ravel(), lengths.ravel()


def trailer(key: bytes, fingerprint: bytes, payload: np.ndarray) -> bytes:
    packed = _TRAILER.pack(MAGIC, key, fingerprint, len(payload), zlib.crc32(payload))
    return packed.ljust(TRAILER_BYTES, b"\0")


def check_trailer(obj: np.ndarray, key: bytes, copy: GroupCopy, *, crc: bool) -> np.ndarray:
    """The payload of a stored block, if its trailer says it is the block asked for."""
    if len(obj) != copy.block_nbytes + TRAILER_BYTES:
        raise KvsLoadError(
            f"object of {len(obj)} bytes, expected {copy.block_nbytes + TRAILER_BYTES}"
        )
    payload = obj[: copy.block_nbytes]
    tail = obj[copy.block_nbytes : copy.block_nbytes + _TRAILER.size].tobytes()
    magic, stored_key, fingerprint, nbytes, value = _TRAILER.unpack(tail)
    if magic != MAGIC:
        raise KvsLoadError("not a KVS block (bad magic)")
    if stored_key != key:
        raise KvsLoadError("the object holds another block (key mismatch)")
    if fingerprint != copy.fingerprint:
        raise KvsLoadError("the block was stored by another layout")
    if nbytes != copy.block_nbytes:
        raise KvsLoadError(f"payload length {nbytes}, expected {copy.block_nbytes}")
    if crc and value != zlib.crc32(payload):
        raise KvsLoadError("CRC mismatch: the stored bytes are corrupt")
    return payload


class KvsWorker:
    """The worker's KVS thread (see the module docstring).

    ``connect``: makes this rank's refstore client (on the KVS thread). ``report_load``:
    ``(request_id, failed)`` once per load; ``report_save``: ``save_id`` once per save, stored
    or not (the scheduler half holds its blocks until every rank reported it).
    """

    def __init__(
        self,
        config: KvsConfig,
        geometry: CacheGeometry,
        *,
        tp_rank: int,
        tp_size: int,
        connect: Callable[[], Any],
        report_load: Callable[[str, bool], None],
        report_save: Callable[[int], None],
        name: str = "",
    ) -> None:
        self._config = config
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._copies = [GroupCopy.of(g, geometry.buffers) for g in geometry.groups]
        self._connect = connect
        self._report_load = report_load
        self._report_save = report_save
        self._client: Any = None
        self._cond = threading.Condition()
        self._loads: collections.deque[KvsLoad] = collections.deque()
        self._saves: collections.deque[KvsSave] = collections.deque()
        self._step_saves: list[KvsSave] = []
        self._closing = False
        self.counters: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(
            target=self._main, name=f"hybrid-connector-kvs{name}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ vLLM's thread
    def handle(self, loads: Sequence[KvsLoad], saves: Sequence[KvsSave]) -> None:
        """This step's metadata: loads start now, saves once the forward pass is done."""
        self._step_saves.extend(saves)
        if loads:
            with self._cond:
                self._loads.extend(loads)
                self._cond.notify()

    def step_done(self) -> None:
        saves, self._step_saves = self._step_saves, []
        if saves:
            with self._cond:
                self._saves.extend(saves)
                self._cond.notify()

    # ------------------------------------------------------------------ the KVS thread
    def _main(self) -> None:
        try:
            self._store()  # connect now: the first load must not pay for it
        except Exception as exc:  # the store is down: the first job tries again
            log.warning("KVS: the store is not reachable yet (%s)", exc)
        while True:
            with self._cond:
                while not (self._loads or self._saves or self._closing):
                    self._cond.wait()
                if self._loads:
                    job: KvsLoad | KvsSave = self._loads.popleft()
                elif self._saves:
                    job = self._saves.popleft()
                else:
                    return  # closing, and nothing left to do
            if isinstance(job, KvsLoad):
                self._run_load(job)
            else:
                self._run_save(job)

    def _store(self) -> Any:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _run_load(self, load: KvsLoad) -> None:
        try:
            self._load(load)
        except Exception as exc:
            self.counters["load_failures"] += 1
            log.warning(
                "KVS: request %s: loading %d block(s) failed (%s); vLLM recomputes it",
                load.request_id,
                len(load.chains),
                exc,
            )
            if isinstance(exc, ConnectionError):  # the store is gone: a new client next time
                self._drop_client()
            self._report_load(load.request_id, True)
        else:
            self.counters["loads"] += 1
            self.counters["loaded_blocks"] += len(load.chains)
            self._report_load(load.request_id, False)

    def _load(self, load: KvsLoad) -> None:
        if load.error:
            raise KvsLoadError(load.error)
        client = self._store()
        crc = self._config.verify == "crc"
        views: list[Any] = []
        dst_parts, src_parts, len_parts = [], [], []
        if len(load.sources) != len(load.chains):
            raise KvsLoadError(f"{len(load.sources)} blocks of objects for {len(load.chains)}")
        for j, chain in enumerate(load.chains):
            entries = load.sources[j]
            objects = self._block_objects(load.block_ids, j)
            if len(entries) != len(objects):
                raise KvsLoadError(f"block {j}: {len(entries)} objects, expected {len(objects)}")
            for (g, rank), (ref, _index) in zip(objects, entries, strict=True):
                if rank not in (kvs_keys.SHARED_RANK, self._tp_rank):
                    continue
                copy = self._copies[g]
                obj = client.get(ref, as_="numpy")
                views.append(obj)
                payload = check_trailer(
                    obj.reshape(-1).view(np.uint8), kvs_keys.object_key(chain, g, rank), copy,
                    crc=crc,
                )  # fmt: skip
                dst, lengths = copy.kv_addresses([load.block_ids[g][j]])
                dst_parts.append(dst)
                len_parts.append(lengths)
                src_parts.append(payload.ctypes.data + copy.offset)
        if dst_parts:
            scatter_copy(
                np.concatenate(dst_parts), np.concatenate(src_parts), np.concatenate(len_parts)
            )
        del views

    def _block_objects(self, block_ids: Sequence[Sequence[int]], j: int) -> list[tuple[int, int]]:
        """(group, key rank) of the objects block ``j`` of a load reads, in source order."""
        return [
            (g, r)
            for g, r in self._per_block()
            if g < len(block_ids) and j < len(block_ids[g]) and block_ids[g][j] != NO_BLOCK
        ]

    def _per_block(self) -> list[tuple[int, int]]:
        """(group, key rank) of a block's objects, in ``kvs_keys.lookup_keys`` order."""
        return [
            (g, r)
            for g, copy in enumerate(self._copies)
            for r in ([kvs_keys.SHARED_RANK] if copy.shared else range(self._tp_size))
        ]

    def _run_save(self, save: KvsSave) -> None:
        try:
            self._save(save)
        except Exception as exc:
            self.counters["save_failures"] += 1
            log.warning("KVS: saving %d block(s) failed (%s)", len(save.chains), exc)
            if isinstance(exc, ConnectionError):
                self._drop_client()
        finally:
            self._report_save(save.save_id)

    def _save(self, save: KvsSave) -> None:
        items = []
        for g, copy in enumerate(self._copies):
            if copy.shared and self._tp_rank != 0:
                continue
            rank = kvs_keys.SHARED_RANK if copy.shared else self._tp_rank
            # (block of the save, vLLM block): a state group saves only its kept states.
            picked = [(j, b) for j, b in enumerate(save.block_ids[g]) if b != NO_BLOCK]
            n = len(picked)
            if n == 0:
                continue
            stride = copy.block_nbytes + TRAILER_BYTES
            staging = np.empty(n * stride, np.uint8)
            src, lengths = copy.kv_addresses([b for _, b in picked])
            dst = (
                staging.ctypes.data
                + (np.arange(n, dtype=np.uint64) * np.uint64(stride))[:, None]
                + copy.offset[None, :]
            ).ravel()
            scatter_copy(dst, src, lengths)
            for i, (j, _) in enumerate(picked):
                key = kvs_keys.object_key(save.chains[j], g, rank)
                block = staging[i * stride : (i + 1) * stride]
                block[copy.block_nbytes :] = np.frombuffer(
                    trailer(key, copy.fingerprint, block[: copy.block_nbytes]), np.uint8
                )
                items.append((key, block))
        if not items:
            return
        client = self._store()
        refs = client.put_keyed(items, ttl=None)
        stored = sum(ref is not None for ref in refs)
        self.counters["saved_objects"] += stored
        self.counters["save_full"] += len(refs) - stored

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=60)
        self._drop_client()
