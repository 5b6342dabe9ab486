"""KVS, worker half: copy blocks between vLLM's KV cache and the shared store.

Two threads per worker (``KvsWorker``), each with its own refstore client: the load thread
does the loads a request waits for outside the running set (a D request's, with its pull; a
hybrid model's); the save thread the gathers of saves, then their puts, at a lower CPU
priority (``save_nice``): on a core it shares with the forward pass (an instance pinned to one
core) its copies take what the pass leaves, so a save never slows the step that computes
another request's prompt, nor the answer of the one it saves (the copies are the same work,
done later; on a core that never idles they still take their share). vLLM's hooks only queue,
but for one copy: ``handle`` (from ``bind_connector_metadata``, before the forward pass) copies
the step's in-step loads at once (``load_in_step``: a plain request of a one-group model,
whose rest this step computes; from this node's pool, without a call: its objects are held
since the lookup), queues the other loads and keeps the step's saves; ``layer_written``
(``save_kv_layer``: the forward pass wrote one layer) queues the gather of that layer's
segments of every save of the step into its staging buffer, so the copy overlaps the rest of
the forward pass (``save_by_layer``); ``step_done`` (``wait_for_save``: every layer is written)
queues the saves' puts, each gathering first what no layer hook gathered (state groups, whose
layers have no such hook, or ``save_by_layer`` off)::

    handle(loads, saves) --in-step loads: copied now; others: queued--> kept for the step
        --layer_written(l): gather l of each save--> ...
        --step_done--> put: gather the layers left, trailers, one put_keyed --> reported

An object holds one block of one KV-cache group on one TP rank (a rank-shared group, MLA's
latent, only rank 0 saves; every rank loads it): each layer's segments of the block, in layer
order (a state group's block is one state: each linear layer's conv and recurrent state), then
a trailer that names what the bytes are::

    payload (block_nbytes) | magic "KVSBLK02" | key (19) | layout fingerprint (16) |
                             payload length (u64) | XXH64 of the payload (u64) | zero pad to 64

A load locates every object it reads in the pool at once (refstore's ``payloads``: headers
checked, no view per object), checks their trailers against what it asked for (the key, this
rank's layout, the length, and with ``verify="checksum"`` the payload's XXH64, which every save
writes) before a byte reaches vLLM's blocks, then copies every segment in one native loop with
the GIL released once (a thread that copies in many calls waits for the GIL after each one while
vLLM's threads spin). Any
mismatch, a missing object or a failing store fails the load: an async one is reported
failed, an in-step one by its blocks (vLLM recomputes either). A save gathers the scattered
block segments into its staging buffer the same way (``refstore.gather``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import refstore

from hybrid_connector import kvs_keys
from hybrid_connector.config import KvsConfig
from hybrid_connector.layout import CacheGeometry, KvCacheGeometry
from hybrid_connector.metadata import NO_BLOCK, KvsLoad, KvsSave

log = logging.getLogger(__name__)

MAGIC = b"KVSBLK02"
_TRAILER = struct.Struct(f"<8s{kvs_keys.KEY_BYTES}s16sQQ")
TRAILER_BYTES = 64


class KvsLoadError(Exception):
    """A stored block could not be loaded (gone, short, another layout, corrupt)."""


@dataclass
class _StagedGroup:
    """One group's objects of one save, being gathered (the KVS thread's only)."""

    group: int
    rank: int
    picked: list[tuple[int, int]]  # (block of the save, vLLM block)
    staging: np.ndarray  # n objects of block_nbytes + TRAILER_BYTES
    src: np.ndarray  # (n, L*S) addresses in vLLM's cache
    dst: np.ndarray  # (n, L*S) offsets in staging
    lengths: np.ndarray  # (n, L*S)
    segments: int  # S: segments per layer
    gathered: np.ndarray  # (L,) bool

    def gather(self, layers: Sequence[int] | None = None) -> None:
        """Copy these layers' segments (None: every layer not gathered yet) into staging."""
        todo = np.flatnonzero(~self.gathered) if layers is None else np.asarray(layers)
        todo = todo[~self.gathered[todo]]
        if todo.size == 0:
            return
        cols = (todo[:, None] * self.segments + np.arange(self.segments)[None, :]).ravel()
        refstore.gather(
            self.staging, self.dst[:, cols].ravel(), self.src[:, cols].ravel(),
            self.lengths[:, cols].ravel(),
        )  # fmt: skip
        self.gathered[todo] = True


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
    layers: int = 1  # L

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
            len(group.layer_offsets),
        )

    def kv_addresses(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(address, length) of every segment of ``block_ids`` in vLLM's cache, block-major."""
        blocks = np.asarray(block_ids, np.uint64)[:, None]
        addresses = self.base[None, :] + blocks * self.stride[None, :]
        lengths = np.broadcast_to(self.length[None, :], addresses.shape)
        return addresses.ravel(), lengths.ravel()


def trailer(key: bytes, fingerprint: bytes, payload: np.ndarray) -> bytes:
    packed = _TRAILER.pack(MAGIC, key, fingerprint, len(payload), refstore.checksum(payload))
    return packed.ljust(TRAILER_BYTES, b"\0")


def check_trailer(obj: np.ndarray, key: bytes, copy: GroupCopy, *, checksum: bool) -> np.ndarray:
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
    if checksum and value != refstore.checksum(payload):
        raise KvsLoadError("checksum mismatch: the stored bytes are corrupt")
    return payload


_TRAILERS = np.dtype(
    {
        "names": ["magic", "key", "fingerprint", "nbytes"],
        "formats": ["S8", f"V{kvs_keys.KEY_BYTES}", "V16", "<u8"],
        "offsets": [0, 8, 8 + kvs_keys.KEY_BYTES, 24 + kvs_keys.KEY_BYTES],
        "itemsize": TRAILER_BYTES,
    }
)


def check_payloads(
    payloads: Any, index: np.ndarray, keys: Sequence[bytes], copy: GroupCopy
) -> None:
    """``check_trailer`` without the checksum for many stored blocks at once: objects ``index`` of
    ``payloads`` (refstore's ``Payloads``) hold the blocks of ``copy`` named ``keys``."""
    lengths = payloads.nbytes[index]
    expected = copy.block_nbytes + TRAILER_BYTES
    short = np.flatnonzero(lengths != expected)
    if short.size:
        raise KvsLoadError(f"object of {int(lengths[short[0]])} bytes, expected {expected}")
    trailers = np.empty(len(index), _TRAILERS)
    at = trailers.ctypes.data + np.arange(len(index), dtype=np.uint64) * np.uint64(TRAILER_BYTES)
    payloads.copy_out(
        payloads.offsets[index] + np.uint64(copy.block_nbytes),
        at,
        np.full(len(index), TRAILER_BYTES, np.uint64),
    )
    if np.any(trailers["magic"] != MAGIC):
        raise KvsLoadError("not a KVS block (bad magic)")
    wanted = np.frombuffer(b"".join(keys), _TRAILERS["key"])
    if np.any(trailers["key"] != wanted):
        raise KvsLoadError("the object holds another block (key mismatch)")
    if np.any(trailers["fingerprint"] != np.frombuffer(copy.fingerprint, _TRAILERS["fingerprint"])):
        raise KvsLoadError("the block was stored by another layout")
    if np.any(trailers["nbytes"] != copy.block_nbytes):
        raise KvsLoadError(f"payload length differs from {copy.block_nbytes}")


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
        report_in_step: Callable[[str, bool], None] | None = None,
        name: str = "",
    ) -> None:
        self._config = config
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._copies = [GroupCopy.of(g, geometry.buffers) for g in geometry.groups]
        # Layer name -> (group, layer index in it): what a layer hook lets the thread gather.
        self._layers_of: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        for g, group in enumerate(geometry.groups):
            for index, layer_name in enumerate(group.layer_names):
                self._layers_of[layer_name].append((g, index))
        self._gathers: collections.deque[tuple[tuple[KvsSave, ...], list[tuple[int, int]]]] = (
            collections.deque()
        )
        self._staged: dict[int, list[_StagedGroup]] = {}  # save id -> its groups (save thread)
        self._running = 0  # jobs taken off the queues and not done yet
        self._connect = connect
        self._report_load = report_load
        self._report_save = report_save
        self._report_in_step = report_in_step
        # "load" / "save" -> that thread's client; "step": in-step loads' (vLLM's thread reads
        # it, the load thread makes it: a connect is a call, and a step makes none).
        self._clients: dict[str, Any] = {}
        self._renew = False  # the load thread is to make a new "step" client
        # Each thread's first connect, done or failed (``wait_first_connect``).
        self._first_connects = {"load": threading.Event(), "save": threading.Event()}
        # In-step loads of the current step (vLLM's thread only): the requests loaded, and the
        # blocks of those that failed (vLLM recomputes them).
        self._loaded_in_step: list[str] = []
        self._failed_blocks: set[int] = set()
        self._cond = threading.Condition()
        self._loads: collections.deque[KvsLoad] = collections.deque()
        self._saves: collections.deque[KvsSave] = collections.deque()
        self._step_saves: list[KvsSave] = []
        self._closing = False
        self.counters: collections.Counter[str] = collections.Counter()
        self._threads = [
            threading.Thread(
                target=self._main, args=(role,), name=f"hybrid-connector-kvs-{role}{name}",
                daemon=True,
            )
            for role in ("load", "save")
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def wait_first_connect(self, timeout: float) -> bool:
        """Wait until the load and save threads' first connects to the store are done or
        failed (a readiness check: they connect on their threads after start); False on
        timeout."""
        deadline = time.monotonic() + timeout
        return all(
            event.wait(max(0.0, deadline - time.monotonic()))
            for event in self._first_connects.values()
        )

    # ------------------------------------------------------------------ vLLM's thread
    def handle(self, loads: Sequence[KvsLoad], saves: Sequence[KvsSave]) -> None:
        """This step's metadata (before its forward pass): in-step loads are copied now, the
        others start on the load thread; saves wait for the end of the forward pass."""
        self._step_saves.extend(saves)
        queued = []
        for load in loads:
            if load.in_step:
                self._load_in_step(load)
            else:
                queued.append(load)
        if queued:
            with self._cond:
                self._loads.extend(queued)
                self._cond.notify_all()

    def _load_in_step(self, load: KvsLoad) -> None:
        """vLLM's worker thread, before the forward pass that computes the rest of the request:
        the copy from this node's pool, never a call to the master (``ask_master=False``: an
        object its header cannot vouch for fails the load). A failed load's blocks are
        reported (``take_failed_blocks``) and vLLM recomputes them; a failure that may be the
        client's (the master restarted: the refs are of another pool) gets a new client made
        on the load thread for the next load."""
        client = self._clients.get("step")
        try:
            if client is None:
                raise KvsLoadError("no connection to the store yet")
            self._load(load, client, ask_master=False)
        except Exception as exc:
            self.counters["load_failures"] += 1
            log.warning(
                "KVS: request %s: loading %d block(s) in the step failed (%s); vLLM recomputes "
                "them",
                load.request_id,
                len(load.chains),
                exc,
            )
            if client is None or not isinstance(exc, KvsLoadError):
                with self._cond:
                    self._renew = True
                    self._cond.notify_all()
            self._failed_blocks.update(b for ids in load.block_ids for b in ids if b != NO_BLOCK)
            failed = True
        else:
            self.counters["loads"] += 1
            self.counters["loaded_blocks"] += len(load.chains)
            failed = False
        self._loaded_in_step.append(load.request_id)
        if self._report_in_step is not None:
            self._report_in_step(load.request_id, failed)

    def take_loaded_in_step(self) -> list[str]:
        """vLLM's thread, after the step: the requests whose in-step loads it ran (done or
        failed)."""
        loaded, self._loaded_in_step = self._loaded_in_step, []
        return loaded

    def take_failed_blocks(self) -> set[int]:
        """vLLM's thread, after the step: the blocks of in-step loads that failed."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def layer_written(self, layer_name: str) -> None:
        """The forward pass wrote ``layer_name`` (save_kv_layer): gather it for the saves."""
        if not self._step_saves or not self._config.save_by_layer:
            return
        where = self._layers_of.get(layer_name)
        if where:
            with self._cond:
                self._gathers.append((tuple(self._step_saves), where))
                self._cond.notify_all()

    def step_done(self) -> None:
        saves, self._step_saves = self._step_saves, []
        if saves:
            with self._cond:
                self._saves.extend(saves)
                self._cond.notify_all()

    # ------------------------------------------------------------------ the KVS threads
    def _main(self, role: str) -> None:
        if role == "save" and self._config.save_nice:
            tid = threading.get_native_id()  # this thread only: a PRIO_PROCESS target on Linux
            try:
                nice = os.getpriority(os.PRIO_PROCESS, tid) + self._config.save_nice
                os.setpriority(os.PRIO_PROCESS, tid, min(nice, 19))
            except OSError as exc:
                log.warning("KVS: the save thread keeps its CPU priority (%s)", exc)
        try:
            self._store(role)  # connect now: the first job must not pay for it
            if role == "load":
                self._store("step")
        except Exception as exc:  # the store is down: the first job tries again
            log.warning("KVS: the store is not reachable yet (%s)", exc)
        finally:
            self._first_connects[role].set()
        while True:
            with self._cond:
                gather = None
                job: KvsLoad | KvsSave | None = None
                renew = False
                while True:
                    if role == "load":
                        if self._renew:
                            renew, self._renew = True, False
                            break
                        if self._loads:
                            job = self._loads.popleft()
                            break
                    elif self._gathers:  # a step's layers, queued before its saves' puts
                        gather = self._gathers.popleft()
                        break
                    elif self._saves:
                        job = self._saves.popleft()
                        break
                    if self._closing:
                        if role == "save":
                            self._staged.clear()
                        return  # closing, and nothing left to do
                    self._cond.wait()
                self._running += 1
            try:
                if renew:
                    self._renew_step_client()
                elif gather is not None:
                    self._run_gather(*gather)
                elif isinstance(job, KvsLoad):
                    self._run_load(job)
                elif job is not None:
                    self._run_save(job)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every job queued so far is done (True), or ``timeout_s`` passed."""

        def idle() -> bool:
            return not (self._running or self._loads or self._gathers or self._saves)

        with self._cond:
            return self._cond.wait_for(lambda: idle() and not self._renew, timeout=timeout_s)

    def _store(self, role: str) -> Any:
        client = self._clients.get(role)
        if client is None:
            client = self._clients[role] = self._connect()
        return client

    def _renew_step_client(self) -> None:
        """Load thread: a new client for in-step loads (vLLM's thread takes it up at its next
        load; the old one is closed here, after the swap)."""
        try:
            client = self._connect()
        except Exception as exc:
            log.warning("KVS: the store is not reachable (%s); in-step loads fail until it is", exc)
            client = None
        old = self._clients.pop("step", None)
        if client is not None:
            self._clients["step"] = client
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()

    def _drop_client(self, role: str) -> None:
        client = self._clients.pop(role, None)
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
                self._drop_client("load")
            self._report_load(load.request_id, True)
        else:
            self.counters["loads"] += 1
            self.counters["loaded_blocks"] += len(load.chains)
            self._report_load(load.request_id, False)

    def _load(self, load: KvsLoad, client: Any = None, *, ask_master: bool = True) -> None:
        """Every object this rank reads, located in the pool at once; their trailers checked
        together; then one copy of every segment into vLLM's blocks (one native call, the GIL
        released once: a thread that copies in many calls waits for the GIL after each one
        while vLLM's threads spin)."""
        if load.error:
            raise KvsLoadError(load.error)
        if len(load.sources) != len(load.chains):
            raise KvsLoadError(f"{len(load.sources)} blocks of objects for {len(load.chains)}")
        picked: list[tuple[int, int, int]] = []  # (block of the load, group, key rank)
        refs: list[Any] = []
        for j, entries in enumerate(load.sources):
            objects = self._block_objects(load.block_ids, j)
            if len(entries) != len(objects):
                raise KvsLoadError(f"block {j}: {len(entries)} objects, expected {len(objects)}")
            for (g, rank), (ref, _index) in zip(objects, entries, strict=True):
                if rank in (kvs_keys.SHARED_RANK, self._tp_rank):
                    picked.append((j, g, rank))
                    refs.append(ref)
        if not refs:
            return
        client = self._store("load") if client is None else client
        payloads = client.payloads(refs, ask_master=ask_master)
        checksum = self._config.verify == "checksum"
        src_parts, dst_parts, len_parts = [], [], []
        for g, copy in enumerate(self._copies):
            mine = [i for i, (_, group, _) in enumerate(picked) if group == g]
            if not mine:
                continue
            index = np.asarray(mine)
            offsets = payloads.offsets[index]
            keys = [kvs_keys.object_key(load.chains[picked[i][0]], g, picked[i][2]) for i in mine]
            check_payloads(payloads, index, keys, copy)
            if checksum:
                for i, key in zip(mine, keys, strict=True):
                    check_trailer(payloads.array(i), key, copy, checksum=True)
            blocks = [load.block_ids[g][picked[i][0]] for i in mine]
            dst, lengths = copy.kv_addresses(blocks)
            dst_parts.append(dst)
            len_parts.append(lengths)
            src_parts.append((offsets[:, None] + copy.offset[None, :]).ravel())
        payloads.copy_out(
            np.concatenate(src_parts), np.concatenate(dst_parts), np.concatenate(len_parts)
        )

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
                self._drop_client("save")
        finally:
            self._report_save(save.save_id)

    def _stage(self, save: KvsSave) -> list[_StagedGroup]:
        """This rank's objects of ``save``: staging buffers and where their bytes come from."""
        groups = []
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
            blocks = np.asarray([b for _, b in picked], np.uint64)[:, None]
            src = copy.base[None, :] + blocks * copy.stride[None, :]
            dst = (np.arange(n, dtype=np.uint64) * np.uint64(stride))[:, None] + copy.offset[
                None, :
            ]
            segments = len(copy.base) // copy.layers
            groups.append(
                _StagedGroup(
                    g, rank, picked, staging, src, dst,
                    np.broadcast_to(copy.length[None, :], src.shape), segments,
                    np.zeros(copy.layers, bool),
                )
            )  # fmt: skip
        return groups

    def _run_gather(self, saves: tuple[KvsSave, ...], where: list[tuple[int, int]]) -> None:
        """One layer, written: its segments of each of the step's saves into their staging."""
        for save in saves:
            staged = self._staged.get(save.save_id)
            if staged is None:
                try:
                    staged = self._staged[save.save_id] = self._stage(save)
                except Exception as exc:  # the put stages again, and reports it
                    log.debug("KVS: staging save %d failed (%s)", save.save_id, exc)
                    continue
            for group in staged:
                layers = [index for g, index in where if g == group.group]
                if layers:
                    group.gather(layers)
        self.counters["layer_gathers"] += 1

    def _save(self, save: KvsSave) -> None:
        items = []
        staged = self._staged.pop(save.save_id, None)
        if staged is None:
            staged = self._stage(save)
        for group in staged:
            group.gather()  # what no layer hook gathered
            copy = self._copies[group.group]
            stride = copy.block_nbytes + TRAILER_BYTES
            for i, (j, _) in enumerate(group.picked):
                key = kvs_keys.object_key(save.chains[j], group.group, group.rank)
                block = group.staging[i * stride : (i + 1) * stride]
                packed = trailer(key, copy.fingerprint, block[: copy.block_nbytes])
                block[copy.block_nbytes :] = np.frombuffer(packed, np.uint8)
                items.append((key, block))
        if not items:
            return
        client = self._store("save")
        refs = client.put_keyed(items, ttl=None)
        stored = sum(ref is not None for ref in refs)
        self.counters["saved_objects"] += stored
        self.counters["save_full"] += len(refs) - stored

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=60)
        for role in ("load", "save", "step"):
            self._drop_client(role)
