"""KVS without vLLM: keys, the worker's copies and checks, the scheduler half's plans.

The store here is a dict with refstore's keyed-object API (``FakeStore``): what is under test is
what the connector writes, reads and refuses; refstore's own keyed objects are tested in its
package, and the whole path through vLLM in ``test_kvs_vllm.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hybrid_connector import kvs, kvs_keys
from hybrid_connector.config import ConfigError, HybridConfig, KvsConfig, parse_config
from hybrid_connector.kvs import (
    KvsScheduler,
    LookupAnswer,
    LookupPlan,
    Lookups,
    unsupported_reason,
)
from hybrid_connector.kvs_worker import (
    TRAILER_BYTES,
    GroupCopy,
    KvsWorker,
    check_trailer,
)
from hybrid_connector.layout import Buffer, CacheGeometry, KvCacheGeometry, KvGroup
from hybrid_connector.metadata import KvsLoad, KvsSave
from ipcblock import Segment
from refstore import Payloads

IDENTITY = kvs_keys.ModelIdentity(model="/models/tiny-qwen2", dtype="bfloat16", tp_size=1)
GROUP = KvGroup("attention", ("l0", "l1"), 4, "bfloat16", total_heads=2, num_heads=2)


# ------------------------------------------------------------------ keys
def test_the_same_prefix_has_the_same_key_in_another_process() -> None:
    root = kvs_keys.root_key(IDENTITY, [GROUP])
    here = [c.hex() for c in kvs_keys.chain(root, list(range(13)), 4, cache_salt="s")]
    code = (
        "from hybrid_connector import kvs_keys as k\n"
        "from hybrid_connector.layout import KvGroup\n"
        "i = k.ModelIdentity(model='/models/tiny-qwen2', dtype='bfloat16', tp_size=1)\n"
        "g = KvGroup('attention', ('l0', 'l1'), 4, 'bfloat16', total_heads=2, num_heads=2)\n"
        "print(' '.join(c.hex() for c in k.chain(k.root_key(i, [g]), list(range(13)), 4,"
        " cache_salt='s')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.split() == here
    assert len(here) == 3  # full blocks only


@pytest.mark.parametrize(
    "change",
    [
        {"identity": {"dtype": "float16"}},
        {"identity": {"namespace": "weights-v2"}},
        {"identity": {"tp_size": 2}},
        {"identity": {"cache_dtype": "fp8"}},
        {"group": {"attn_isa": "amx"}},
        {"group": {"block_size": 8}},
        {"group": {"family": "mla"}},
        {"salt": "tenant-b"},
        {"lora": "adapter"},
    ],
)
def test_anything_that_changes_the_bytes_changes_the_key(change: dict[str, Any]) -> None:
    def chains(identity: dict, group: dict, salt: str | None, lora: str | None) -> list[bytes]:
        ident = kvs_keys.ModelIdentity(**{**IDENTITY.__dict__, **identity})
        g = KvGroup(**{**GROUP.__dict__, **group})
        return kvs_keys.chain(
            kvs_keys.root_key(ident, [g]), list(range(16)), 4, cache_salt=salt, lora_name=lora
        )

    base = chains({}, {}, None, None)
    other = chains(
        change.get("identity", {}), change.get("group", {}), change.get("salt"), change.get("lora")
    )
    assert not set(base) & set(other)


def test_the_chain_depends_on_every_earlier_token_and_extends_incrementally() -> None:
    root = kvs_keys.root_key(IDENTITY, [GROUP])
    a = kvs_keys.chain(root, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = kvs_keys.chain(root, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, another first one
    assert kvs_keys.chain(root, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4, start=a[:1])[:2] == a


def test_lookup_keys_name_every_rank_of_split_groups_and_one_object_of_shared_ones() -> None:
    mla = KvGroup("mla", ("m0",), 4, "bfloat16")
    keys, per_block = kvs_keys.lookup_keys([b"x" * 16, b"y" * 16], [GROUP, mla], tp_size=2)
    assert per_block == 3  # attention on rank 0 and 1, MLA once
    assert len(keys) == 6
    assert len(set(keys)) == 6
    assert keys[2] == kvs_keys.object_key(b"x" * 16, 1, kvs_keys.SHARED_RANK)


def test_what_cannot_be_stored_whole_is_refused_at_start() -> None:
    state = KvGroup("state", ("s",), 4)
    assert unsupported_reason([GROUP]) is None
    assert unsupported_reason([state, GROUP], state_cache_mode="align") is None
    # Prefix caching off: vLLM keeps no state at a block boundary, only the running one.
    assert "enable_prefix_caching" in unsupported_reason([state, GROUP])
    spec = KvGroup("state", ("s",), 4, num_speculative_blocks=2)
    assert "speculative" in unsupported_reason([spec, GROUP], state_cache_mode="align")
    other_size = KvGroup("state", ("s",), 8)
    assert "mamba_block_size" in unsupported_reason([other_size, GROUP], state_cache_mode="align")
    assert "sliding_window" in unsupported_reason([KvGroup("sliding_window", ("w",), 4)])


def test_kvs_config_is_validated() -> None:
    cfg = parse_config({"rpc_port": 1, "kvs": {"store": "s", "hold_s": 5}}, is_producer=True)
    assert isinstance(cfg, HybridConfig)
    assert cfg.kvs == KvsConfig(store="s", hold_s=5)
    with pytest.raises(ConfigError, match="verify"):
        parse_config({"kvs": {"verify": "none"}}, is_producer=False)
    with pytest.raises(ConfigError, match="kvs"):
        parse_config({"kvs": {"stroe": "x"}}, is_producer=False)


# ------------------------------------------------------------------ a KV cache in numpy
@dataclass
class Cache:
    """Two layers of [num_blocks, heads, block_size, 2*head_dim] bytes in one buffer."""

    num_blocks: int = 16
    block_bytes: int = 256
    buffer: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.buffer = np.zeros(2 * self.num_blocks * self.block_bytes, np.uint8)

    def geometry(self, family: str = "attention") -> CacheGeometry:
        group = KvCacheGeometry(
            buffers=(),
            layer_names=("l0", "l1"),
            layer_offsets=(0, self.num_blocks * self.block_bytes),
            buffer_index=(0, 0),
            num_blocks=self.num_blocks,
            block_size=4,
            segments=(Segment("kv", 0, self.block_bytes, self.block_bytes),),
            kind="blocks_major",
            family=family,
            dtype="bfloat16",
            total_heads=2 if family == "attention" else 0,
            num_heads=2 if family == "attention" else 0,
        )
        buffer = Buffer(self.buffer.ctypes.data, self.buffer.nbytes)
        return CacheGeometry((buffer,), (group,))

    def block(self, layer: int, block_id: int) -> np.ndarray:
        start = (layer * self.num_blocks + block_id) * self.block_bytes
        return self.buffer[start : start + self.block_bytes]


class Gone(Exception):
    pass


@dataclass(frozen=True)
class FakeRef:
    key: bytes
    index: int = 0


class FakeStore:
    """refstore's keyed-object calls over a dict (first writer wins, prefix lookups)."""

    def __init__(self) -> None:
        self.objects: dict[bytes, np.ndarray] = {}
        self.unheld: list[Any] = []
        self.closed = 0
        self.gate = threading.Event()  # lookups wait on it (set: they do not)
        self.gate.set()

    def put_keyed(self, items: list[tuple[bytes, np.ndarray]], ttl: Any = None) -> list[Any]:
        for key, obj in items:
            self.objects.setdefault(key, np.array(obj, copy=True))
        return [FakeRef(key) for key, _ in items]

    def lookup(self, keys: list[bytes], hold_s: float = 0) -> list[Any]:
        assert self.gate.wait(timeout=30)
        out = []
        for key in keys:
            if key not in self.objects:
                break
            out.append(FakeRef(key))
        return out

    def get(self, ref: Any, as_: str = "numpy") -> np.ndarray:
        if ref.key not in self.objects:
            raise Gone(f"object {ref.key.hex()[:8]} evicted")
        view = self.objects[ref.key].view()
        view.flags.writeable = False
        return view

    def payloads(self, refs: list[Any], ask_master: bool = True) -> Payloads:
        """refstore's ``payloads``: the objects side by side in one buffer (a copy)."""
        blobs = [self.get(ref) for ref in refs]
        sizes = np.array([len(b) for b in blobs], np.uint64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        whole = np.concatenate(blobs) if blobs else np.empty(0, np.uint8)
        return Payloads(memoryview(whole), offsets, sizes)

    def unhold(self, refs: list[Any]) -> None:
        self.unheld.extend(refs)

    def close(self) -> None:
        self.closed += 1


class Reports:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.loads: dict[str, bool] = {}
        self.saves: list[int] = []

    def __call__(self, request_id: str, failed: bool) -> None:
        with self.cond:
            self.loads[request_id] = failed
            self.cond.notify_all()

    def save(self, save_id: int) -> None:
        with self.cond:
            self.saves.append(save_id)
            self.cond.notify_all()

    def wait_save(self, save_id: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: save_id in self.saves, timeout=30)

    def wait(self, request_id: str) -> bool:
        with self.cond:
            assert self.cond.wait_for(lambda: request_id in self.loads, timeout=30)
            return self.loads[request_id]


def _worker(
    cache: Cache,
    store: FakeStore,
    reports: Reports,
    connect: Callable[[], FakeStore] | None = None,
    **config: Any,
) -> KvsWorker:
    """A worker of ``store`` (or of whatever ``connect`` returns), verifying by checksum."""
    config.setdefault("verify", "checksum")
    return KvsWorker(
        KvsConfig(**config),
        cache.geometry(),
        tp_rank=0,
        tp_size=1,
        connect=connect or (lambda: store),
        report_load=reports,
        report_save=reports.save,
    )


def _chains(n: int, seed: int = 0) -> list[bytes]:
    root = kvs_keys.root_key(IDENTITY, [GROUP])
    return kvs_keys.chain(root, list(range(seed, seed + 4 * n)), 4)


def _save_and_wait(
    worker: KvsWorker, reports: Reports, block_ids: list[int], chains: list[bytes], save_id: int = 0
) -> None:
    worker.handle([], [KvsSave(save_id, [block_ids], chains)])
    worker.step_done()
    reports.wait_save(save_id)


def _sources(store: FakeStore, chains: list[bytes]) -> list[list[tuple[Any, int]]]:
    keys, per_block = kvs_keys.lookup_keys(chains, [GROUP], 1)
    found = store.lookup(keys)
    return [
        [(r, 0) for r in found[j * per_block : (j + 1) * per_block]] for j in range(len(chains))
    ]


def test_saved_blocks_load_back_byte_for_byte_into_other_blocks() -> None:
    cache, store, reports = Cache(), FakeStore(), Reports()
    rng = np.random.default_rng(0)
    cache.buffer[:] = rng.integers(0, 256, cache.buffer.size, dtype=np.uint8)
    worker = _worker(cache, store, reports)
    try:
        chains = _chains(3)
        _save_and_wait(worker, reports, [5, 2, 9], chains)
        assert len(store.objects) == 3
        assert all(len(o) == 2 * cache.block_bytes + TRAILER_BYTES for o in store.objects.values())
        expected = {(layer, b): cache.block(layer, b).copy() for layer in (0, 1) for b in (5, 2, 9)}
        worker.handle([KvsLoad("r1", [[11, 12, 13]], chains, _sources(store, chains))], [])
        assert reports.wait("r1") is False
        for layer in (0, 1):
            for src, dst in zip((5, 2, 9), (11, 12, 13), strict=True):
                assert np.array_equal(cache.block(layer, dst), expected[layer, src])
        assert store.unheld == []  # holds are the lookup's: the scheduler half ends them
    finally:
        worker.close()
    assert store.closed == 3  # the load thread's client, the save thread's, in-step loads'
    assert not [t for t in threading.enumerate() if t.name.startswith("hybrid-connector-kvs")]


def test_the_save_thread_gives_way_and_loads_keep_the_workers_priority() -> None:
    """Saves run niced (``save_nice`` added to the worker's nice value) on their own thread:
    on an instance's one core the forward pass wins; a load (a request waits) is not niced."""
    cache, store, reports = Cache(), FakeStore(), Reports()
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = _worker(cache, store, reports, save_nice=3)
    try:
        chains = _chains(1)
        _save_and_wait(worker, reports, [1], chains)
        worker.handle([KvsLoad("r1", [[4]], chains, _sources(store, chains))], [])
        assert reports.wait("r1") is False
        threads = {
            t.name: t.native_id
            for t in threading.enumerate()
            if t.name.startswith("hybrid-connector-kvs")
        }
        assert sorted(threads) == ["hybrid-connector-kvs-load", "hybrid-connector-kvs-save"]
        assert os.getpriority(os.PRIO_PROCESS, threads["hybrid-connector-kvs-load"]) == base
        assert os.getpriority(os.PRIO_PROCESS, threads["hybrid-connector-kvs-save"]) == min(
            base + 3, 19
        )
    finally:
        worker.close()


@pytest.mark.parametrize("damage", ["flip", "short", "swap", "layout", "gone"])
def test_a_damaged_or_missing_block_fails_the_load_and_leaves_the_cache_alone(damage: str) -> None:
    cache, store, reports = Cache(), FakeStore(), Reports()
    cache.buffer[:] = 7
    worker = _worker(cache, store, reports)
    try:
        chains = _chains(2)
        _save_and_wait(worker, reports, [1, 2], chains)
        keys = list(store.objects)
        sources = _sources(store, chains)
        if damage == "flip":
            store.objects[keys[1]][10] ^= 1
        elif damage == "short":
            store.objects[keys[1]] = store.objects[keys[1]][:-1]
        elif damage == "swap":  # another block's bytes under this key
            store.objects[keys[1]] = store.objects[keys[0]]
        elif damage == "layout":
            store.objects[keys[1]][2 * cache.block_bytes + 8 + kvs_keys.KEY_BYTES] ^= 1
        else:
            del store.objects[keys[1]]
        before = cache.buffer.copy()
        worker.handle([KvsLoad("r", [[8, 9]], chains, sources)], [])
        assert reports.wait("r") is True
        assert np.array_equal(cache.buffer, before)  # nothing half-written
        assert worker.counters["load_failures"] == 1
    finally:
        worker.close()


def test_an_in_step_load_copies_before_handle_returns_and_reports_failures_by_block() -> None:
    """In-step loads run on vLLM's thread, inside the hook that hands the step over (before
    its forward pass): done when it returns. A failed one leaves the cache alone and names
    its blocks; one without a client (the store was down at start) gets one made on the load
    thread for the next."""
    cache, store, reports = Cache(), FakeStore(), Reports()
    rng = np.random.default_rng(1)
    cache.buffer[:] = rng.integers(0, 256, cache.buffer.size, dtype=np.uint8)
    in_step: list[tuple[str, bool]] = []
    worker = KvsWorker(
        KvsConfig(),
        cache.geometry(),
        tp_rank=0,
        tp_size=1,
        connect=lambda: store,
        report_load=reports,
        report_save=reports.save,
        report_in_step=lambda request_id, failed: in_step.append((request_id, failed)),
    )
    try:
        chains = _chains(2)
        _save_and_wait(worker, reports, [5, 2], chains)
        expected = [cache.block(layer, b).copy() for layer in (0, 1) for b in (5, 2)]
        sources = _sources(store, chains)
        worker.handle([KvsLoad("a", [[11, 12]], chains, sources, in_step=True)], [])
        got = [cache.block(layer, b) for layer in (0, 1) for b in (11, 12)]
        assert all(np.array_equal(x, y) for x, y in zip(got, expected, strict=True))
        assert worker.take_loaded_in_step() == ["a"]
        assert worker.take_failed_blocks() == set()
        del store.objects[next(iter(store.objects))]  # evicted between lookup and load
        before = cache.buffer.copy()
        worker.handle([KvsLoad("b", [[13, 14]], chains, sources, in_step=True)], [])
        assert np.array_equal(cache.buffer, before)
        assert worker.take_loaded_in_step() == ["b"]
        assert worker.take_failed_blocks() == {13, 14}
        assert in_step == [("a", False), ("b", True)]
        assert reports.loads == {}  # never a pull's report: vLLM reads the step's output
    finally:
        worker.close()


def test_in_step_loads_without_a_client_fail_until_the_load_thread_makes_one() -> None:
    cache, store, reports = Cache(), FakeStore(), Reports()
    down = threading.Event()
    down.set()

    def connect() -> FakeStore:
        if down.is_set():
            raise ConnectionError("no master")
        return store

    worker = _worker(cache, store, reports, connect, verify="header")
    try:
        assert worker.wait_idle(30)
        chains = _chains(1)
        worker.handle([KvsLoad("a", [[3]], chains, [[(FakeRef(b"x"), 0)]], in_step=True)], [])
        assert worker.take_failed_blocks() == {3}
        down.clear()  # the store is up: the load thread's next connect succeeds
        assert worker.wait_idle(30)
        worker.handle([KvsLoad("b", [[3]], chains, [[(FakeRef(b"x"), 0)]], in_step=True)], [])
        assert worker.take_failed_blocks() == {3}  # the failed attempt asked for a client
        assert worker.wait_idle(30)
        store.objects[b"x"] = np.zeros(1, np.uint8)
        worker.handle([KvsLoad("c", [[3]], chains, [[(FakeRef(b"x"), 0)]], in_step=True)], [])
        assert worker.take_failed_blocks() == {3}  # a client now: a short object, refused
        assert worker.counters["load_failures"] == 3
        assert worker._clients.get("step") is store
    finally:
        worker.close()


def test_header_verification_skips_only_the_checksum() -> None:
    cache, store, reports = Cache(), FakeStore(), Reports()
    worker = _worker(cache, store, reports, verify="header")
    try:
        chains = _chains(1)
        _save_and_wait(worker, reports, [1], chains)
        key = next(iter(store.objects))
        store.objects[key][0] ^= 1  # payload damage: not seen without the checksum
        worker.handle([KvsLoad("a", [[3]], chains, _sources(store, chains))], [])
        assert reports.wait("a") is False
        store.objects[key] = store.objects[key][:-1]  # a short object still is
        worker.handle([KvsLoad("b", [[3]], chains, _sources(store, chains))], [])
        assert reports.wait("b") is True
    finally:
        worker.close()


def test_a_store_that_fails_puts_reports_the_save_done_anyway() -> None:
    cache, reports = Cache(), Reports()

    class Broken(FakeStore):
        def put_keyed(self, items: Any, ttl: Any = None) -> list[Any]:
            raise ConnectionError("master gone")

    store = Broken()
    worker = _worker(cache, store, reports)
    try:
        _save_and_wait(worker, reports, [1], _chains(1))  # the blocks must go back either way
        assert worker.counters["save_failures"] == 1
    finally:
        worker.close()


def test_saves_wait_for_the_end_of_the_forward_pass() -> None:
    cache, store, reports = Cache(), FakeStore(), Reports()
    worker = _worker(cache, store, reports)
    try:
        worker.handle([], [KvsSave(0, [[1]], _chains(1))])
        # No step_done yet: the pass may still be writing the block; nothing is queued.
        assert not worker._saves
        assert not store.objects
        worker.step_done()
        reports.wait_save(0)
        assert reports.saves == [0]
    finally:
        worker.close()


@pytest.mark.parametrize("by_layer", [True, False])
def test_a_save_takes_each_layer_as_the_forward_pass_writes_it(by_layer: bool) -> None:
    """By layer, a layer's bytes are copied when its hook says it is written (what the pass does
    to it later does not reach the store); otherwise all of them at the step's end."""
    cache, store, reports = Cache(), FakeStore(), Reports()
    worker = _worker(cache, store, reports, save_by_layer=by_layer)
    try:
        cache.block(0, 3)[:] = 1
        cache.block(1, 3)[:] = 2
        chains = _chains(1)
        worker.handle([], [KvsSave(0, [[3]], chains)])
        worker.layer_written("l0")
        assert worker.wait_idle(30)
        cache.block(0, 3)[:] = 3  # after l0's hook
        worker.layer_written("l1")
        assert worker.wait_idle(30)
        cache.block(1, 3)[:] = 4  # after l1's hook
        worker.step_done()
        reports.wait_save(0)
        [stored] = store.objects.values()
        n = cache.block_bytes
        layer0, layer1 = stored[:n], stored[n : 2 * n]
        assert (int(layer0[0]), int(layer1[0])) == ((1, 2) if by_layer else (3, 4))
        assert np.all(layer0 == layer0[0])
        assert np.all(layer1 == layer1[0])
        # The checksum is the payload's, as gathered layer by layer.
        copy = GroupCopy.of(cache.geometry().groups[0], cache.geometry().buffers)
        check_trailer(stored, kvs_keys.object_key(chains[0], 0, 0), copy, checksum=True)
        assert worker.counters["layer_gathers"] == (2 if by_layer else 0)
        worker.layer_written("l0")  # no save in this step: nothing to gather
        assert worker.wait_idle(30)
        assert worker.counters["layer_gathers"] == (2 if by_layer else 0)
    finally:
        worker.close()


def test_group_copy_places_each_layer_segment_in_the_payload() -> None:
    cache = Cache()
    copy = GroupCopy.of(cache.geometry().groups[0], cache.geometry().buffers)
    addresses, lengths = copy.kv_addresses([3])
    assert list(lengths) == [cache.block_bytes] * 2
    assert int(addresses[0]) == cache.block(0, 3).ctypes.data
    assert int(addresses[1]) == cache.block(1, 3).ctypes.data
    assert list(copy.offset) == [0, cache.block_bytes]


# ------------------------------------------------------------------ the scheduler half
class FakeLookups:
    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.pending: dict[str, LookupPlan] = {}
        self.closed = False
        self.slow = False  # True: no answer comes
        self.events: list[Any] = []
        self.pinned: list[Any] = []
        self.waits: list[float] = []

    def submit(self, request_id: str, plan: LookupPlan) -> None:
        self.pending[request_id] = plan

    def answer(self, request_id: str, wait_s: float = 0.0) -> LookupAnswer | None:
        self.waits.append(wait_s)
        if self.slow:
            return None
        plan = self.pending.pop(request_id, None)
        if plan is None:
            return None
        return kvs.walk(self.store.lookup, plan)

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def unhold(self, refs: list[Any]) -> None:
        self.store.unhold(refs)

    def pin(self, refs: list[Any]) -> None:
        self.pinned.extend(refs)

    def key_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self.closed = True


@dataclass
class Block:
    block_id: int
    is_null: bool = False
    ref_cnt: int = 1
    block_hash: Any = None  # vLLM's prefix-cache hash: a kept state, in a state group
    block_hash_num_tokens: int | None = None


NULL = Block(0, is_null=True)


def _kept(block_id: int, boundary: int) -> Block:
    """A state group's block holding the state vLLM keeps at token ``boundary``."""
    return Block(block_id, block_hash=b"h%d" % boundary, block_hash_num_tokens=boundary)


class Pool:
    def __init__(self) -> None:
        self.touched: list[int] = []
        self.freed: list[int] = []

    def touch(self, blocks: list[Block]) -> None:
        self.touched += [b.block_id for b in blocks]

    def free_blocks(self, blocks: Any) -> None:
        self.freed += [b.block_id for b in blocks]


class Manager:
    def __init__(self) -> None:
        self.block_pool = Pool()
        self.blocks: dict[str, list[Block] | tuple[list[Block], ...]] = {}

    def get_blocks(self, request_id: str) -> Any:
        blocks = self.blocks[request_id]
        return SimpleNamespace(blocks=blocks if isinstance(blocks, tuple) else (blocks,))


def _req(request_id: str, tokens: list[int], computed: int = 0) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        all_token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        num_computed_tokens=computed,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _planner(
    store: FakeStore,
    clock: Clock | None = None,
    groups: list[KvGroup] | None = None,
    tp_size: int = 1,
    **config: Any,
) -> KvsScheduler:
    planner = KvsScheduler(
        KvsConfig(**config),
        groups or [GROUP],
        block_size=4,
        tp_size=tp_size,
        identity=IDENTITY,
        lookups=FakeLookups(store),  # type: ignore[arg-type]
        clock=clock or Clock(),
    )
    planner.bind_kv_cache_manager(Manager())  # type: ignore[arg-type]
    return planner


def _output(**scheduled: int) -> Any:
    return SimpleNamespace(num_scheduled_tokens=scheduled)


@pytest.mark.parametrize("in_step", [True, False])
def test_the_store_hit_past_the_local_hit_is_loaded(in_step: bool) -> None:
    """In the step that admits the request (vLLM is told the load is not async) or while the
    request waits, as for a pull: either way the holds last until the load is over."""
    store = FakeStore()
    planner = _planner(store, load_in_step=in_step)
    tokens = list(range(14))
    chains = kvs_keys.chain(planner.root, tokens, 4)
    for key in kvs_keys.lookup_keys(chains[:2], [GROUP], 1)[0]:
        store.objects[key] = np.zeros(1, np.uint8)  # the store has blocks 0 and 1
    request = _req("r", tokens)
    # The local hit is block 0; the store adds block 1.
    assert planner.get_num_new_matched_tokens(request, 4) == (4, not in_step)
    blocks = SimpleNamespace(blocks=([Block(i) for i in (20, 21, 22, 23)],))
    load = planner.update_state_after_alloc(request, blocks, 4)
    assert load is not None
    assert load.in_step is in_step
    assert load.block_ids == [[21]]
    assert load.chains == chains[1:2]
    assert [ref.key for ref, _ in load.sources[0]] == [kvs_keys.object_key(chains[1], 0, 0)]
    # Block 0 is local: its hold goes at once; block 1's once the load is over.
    assert [ref.key for ref in store.unheld] == [kvs_keys.object_key(chains[0], 0, 0)]
    planner.load_finished("r")
    assert [ref.key for ref in store.unheld] == [
        kvs_keys.object_key(chains[0], 0, 0),
        kvs_keys.object_key(chains[1], 0, 0),
    ]
    assert planner.get_num_new_matched_tokens(request, 0) == (0, False)  # preempted: no reload
    planner.request_finished(request)  # nothing held any more: nothing unheld twice
    assert len(store.unheld) == 2


def test_an_in_step_load_keeps_its_holds_until_its_step_reports_it() -> None:
    """A request vLLM ends before the report of the step that loads it (an abort): the
    worker may still read the objects, so their holds go with the report, not before."""
    store = FakeStore()
    planner = _planner(store)
    tokens = list(range(9))
    chains = kvs_keys.chain(planner.root, tokens, 4)
    for key in kvs_keys.lookup_keys(chains, [GROUP], 1)[0]:
        store.objects[key] = np.zeros(1, np.uint8)
    request = _req("r", tokens)
    assert planner.get_num_new_matched_tokens(request, 0) == (8, False)
    load = planner.update_state_after_alloc(request, SimpleNamespace(blocks=([Block(1)],)), 8)
    assert load is not None
    assert load.in_step
    planner.request_finished(request)
    assert store.unheld == []
    planner.load_finished("r")
    assert sorted(ref.key for ref in store.unheld) == sorted(
        kvs_keys.object_key(c, 0, 0) for c in chains
    )
    planner.load_finished("r")  # a second rank's report: nothing more
    assert len(store.unheld) == 2
    assert planner._requests == {}


def test_a_request_that_pulls_from_p_loads_with_its_pull() -> None:
    """D's request loads what the store has and pulls the rest: one async receive, in parts."""
    store = FakeStore()
    planner = _planner(store)
    tokens = list(range(9))
    chains = kvs_keys.chain(planner.root, tokens, 4)
    for key in kvs_keys.lookup_keys(chains, [GROUP], 1)[0]:
        store.objects[key] = np.zeros(1, np.uint8)
    request = _req("r", tokens)
    assert planner.stored_tokens(request, 0) == 8
    load = planner.update_state_after_alloc(request, SimpleNamespace(blocks=([Block(1)],)), 8)
    assert load is not None
    assert not load.in_step


def test_a_lookup_that_does_not_answer_in_time_is_a_miss() -> None:
    clock = Clock()
    planner = _planner(FakeStore(), clock, lookup_timeout_s=0.5)
    lookups: FakeLookups = planner._lookups  # type: ignore[assignment]
    lookups.slow = True
    request = _req("r", list(range(12)))
    assert planner.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now = 0.4
    assert planner.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now = 0.6
    assert planner.get_num_new_matched_tokens(request, 0) == (0, False)
    assert planner.counters["lookup_misses"] == 1
    assert lookups.waits == [0.005, 0.0, 0.0]  # only the first ask waits (a moment)


def test_blocks_are_saved_once_as_they_fill_and_held_until_every_rank_reports() -> None:
    store = FakeStore()
    planner = _planner(store)
    manager: Manager = planner._manager  # type: ignore[assignment]
    request = _req("r", list(range(10)))
    manager.blocks["r"] = [Block(i) for i in (7, 8, 9)]
    planner.get_num_new_matched_tokens(request, 0)
    planner.get_num_new_matched_tokens(request, 0)  # the miss
    saves = planner.plan_saves(_output(r=6))  # tokens 0..5: one full block
    assert [(s.block_ids, len(s.chains)) for s in saves] == [([[7]], 1)]
    request.num_computed_tokens = 6
    assert planner.plan_saves(_output(r=1)) == []  # 7 tokens: still one full block
    request.num_computed_tokens = 7
    request.all_token_ids += [10, 11]
    saves += planner.plan_saves(_output(r=3))  # decoding filled block 1 too (tokens 0..9)
    assert [s.block_ids for s in saves] == [[[7]], [[8]]]
    assert manager.block_pool.touched == [7, 8]
    assert manager.block_pool.freed == []
    planner.request_finished(request)  # the request ends: its saves keep their blocks
    report = kvs.save_report_id(saves[0].save_id)
    assert planner.is_save_report(report)
    assert not planner.is_save_report("req-1")
    assert planner.save_reported(report, 0)
    assert manager.block_pool.freed == []  # taken in at the next hook
    planner.drain()
    assert manager.block_pool.freed == [7]
    planner.save_reported(report, 0)  # a second report of the rank: nothing more
    planner.drain()
    assert manager.block_pool.freed == [7]
    events = planner.take_events()
    assert events[0][0] == "stored"
    assert events[0][3] == list(range(4))
    assert planner.close() == 1
    assert manager.block_pool.freed == [7, 8]


def test_blocks_the_store_had_at_lookup_are_not_saved_again() -> None:
    store = FakeStore()
    planner = _planner(store)
    manager: Manager = planner._manager  # type: ignore[assignment]
    tokens = list(range(13))
    chains = kvs_keys.chain(planner.root, tokens, 4)
    for key in kvs_keys.lookup_keys(chains[:2], [GROUP], 1)[0]:
        store.objects[key] = np.zeros(1, np.uint8)
    request = _req("r", tokens)
    manager.blocks["r"] = [Block(i) for i in (1, 2, 3, 4)]
    planner.get_num_new_matched_tokens(request, 0)
    planner.get_num_new_matched_tokens(request, 8)  # all of it local already
    request.num_computed_tokens = 8
    saves = planner.plan_saves(_output(r=5))
    assert [s.block_ids for s in saves] == [[[3]]]


@pytest.mark.parametrize("why", ["embeddings", "opted out"])
def test_requests_with_embeddings_or_opted_out_are_neither_looked_up_nor_saved(why: str) -> None:
    planner = _planner(FakeStore())
    lookups: FakeLookups = planner._lookups  # type: ignore[assignment]
    request = _req("r", list(range(12)))
    if why == "embeddings":
        request.prompt_token_ids = None
    else:
        request.kv_transfer_params = {"kvs": False}
    assert planner.get_num_new_matched_tokens(request, 0) == (0, False)
    assert lookups.pending == {}
    assert planner.plan_saves(_output(r=12)) == []


def test_the_lookup_thread_misses_while_the_store_is_down_and_reconnects() -> None:
    store = FakeStore()
    down = threading.Event()
    down.set()

    def connect() -> FakeStore:
        if down.is_set():
            raise ConnectionRefusedError("no master")
        return store

    lookups = Lookups(connect, hold_s=1.0, retry_s=0.0)
    try:
        assert lookups._lookup(LookupPlan([b"k"], 1, 1)).error == "store down"
        down.clear()
        store.objects[b"k"] = np.zeros(1, np.uint8)
        assert [r.key for r, _ in lookups._lookup(LookupPlan([b"k", b"x"], 1, 2)).found] == [b"k"]
    finally:
        lookups.close()
    assert store.closed == 1


def _settled(lookups: Lookups) -> None:
    """Every job queued so far has run (the lookup thread takes them in order)."""
    lookups.submit("sync", LookupPlan([b"none"], 1, 1))
    assert lookups.answer("sync", wait_s=30) is not None


def _refs(answer: LookupAnswer | None) -> list[Any]:
    assert answer is not None
    return [ref for ref, _ in answer.found]


def test_a_hold_two_requests_share_goes_when_the_last_one_gives_it_up() -> None:
    store = FakeStore()
    store.objects[b"k"] = np.zeros(1, np.uint8)
    lookups = Lookups(lambda: store, hold_s=30.0)
    try:
        lookups.submit("r1", LookupPlan([b"k"], 1, 1))
        lookups.submit("r2", LookupPlan([b"k"], 1, 1))
        first, second = lookups.answer("r1", wait_s=30), lookups.answer("r2", wait_s=30)
        lookups.unhold(_refs(first))
        _settled(lookups)
        assert store.unheld == []  # r2 may still be loading from it
        lookups.unhold(_refs(second))
        _settled(lookups)
        assert store.unheld == [FakeRef(b"k")]
    finally:
        lookups.close()


@pytest.mark.parametrize("when", ["before the answer", "after the answer"])
def test_a_forgotten_lookup_gives_its_holds_up(when: str) -> None:
    store = FakeStore()
    store.objects[b"k"] = np.zeros(1, np.uint8)
    lookups = Lookups(lambda: store, hold_s=30.0)
    try:
        if when == "before the answer":
            store.gate.clear()
            lookups.submit("r", LookupPlan([b"k"], 1, 1))
            lookups.forget("r")  # the request ended while its lookup was out
            store.gate.set()
        else:
            lookups.submit("r", LookupPlan([b"k"], 1, 1))
            with lookups._answered:
                assert lookups._answered.wait_for(lambda: "r" in lookups._answers, timeout=30)
            lookups.forget("r")
        _settled(lookups)
        assert store.unheld == [FakeRef(b"k")]
        assert lookups._answers == {}
        assert lookups._pending == set()  # nothing kept for a request that is gone
        lookups.forget("r")  # again, or for a request whose answer was read: nothing happens
        _settled(lookups)
        assert store.unheld == [FakeRef(b"k")]
    finally:
        lookups.close()


def test_a_forgotten_hybrid_lookup_gives_up_its_state_and_stray_holds_too() -> None:
    store = FakeStore()
    for key in (b"t0", b"t1", b"s0", b"s1a"):  # block 1's state only on one of two ranks
        store.objects[key] = np.zeros(1, np.uint8)
    lookups = Lookups(lambda: store, hold_s=30.0)
    try:
        lookups.submit("r", LookupPlan([b"t0", b"t1"], 1, 2, [[b"s0"], [b"s1a", b"s1b"]]))
        with lookups._answered:
            assert lookups._answered.wait_for(lambda: "r" in lookups._answers, timeout=30)
            assert lookups._answers["r"].blocks == 1
        lookups.forget("r")  # the request ended before it read the answer
        _settled(lookups)
        assert sorted(r.key for r in store.unheld) == [b"s0", b"s1a", b"t0", b"t1"]
    finally:
        lookups.close()


def test_blocks_the_store_drops_become_removed_events() -> None:
    from refstore import KeysRemoved, KeysStored

    planner = _planner(FakeStore())
    lookups: FakeLookups = planner._lookups  # type: ignore[assignment]
    chain = b"c" * kvs_keys.CHAIN_BYTES
    lookups.events = [
        KeysStored([kvs_keys.object_key(chain, 0, 0)]),  # another instance's save: its own event
        KeysRemoved(
            [kvs_keys.object_key(chain, 0, 0), kvs_keys.object_key(chain, 0, 1)], "evicted"
        ),
    ]
    assert planner.take_events() == [("removed", [chain])]  # one block, however many objects
    assert planner.take_events() == []


def test_a_block_loaded_by_a_second_request_is_soft_pinned() -> None:
    store = FakeStore()
    planner = _planner(store)
    lookups: FakeLookups = planner._lookups  # type: ignore[assignment]
    tokens = list(range(9))
    chains = kvs_keys.chain(planner.root, tokens, 4)
    for key in kvs_keys.lookup_keys(chains, [GROUP], 1)[0]:
        store.objects[key] = np.zeros(1, np.uint8)
    for n, request_id in enumerate(("r1", "r2", "r3"), 1):
        request = _req(request_id, tokens)
        assert planner.get_num_new_matched_tokens(request, 0) == (8, False)
        blocks = SimpleNamespace(blocks=([Block(i) for i in (1, 2, 3)],))
        assert planner.update_state_after_alloc(request, blocks, 8) is not None
        assert len(lookups.pinned) == (0 if n == 1 else 2)  # pinned once, at the second load
    assert planner.counters["pinned_blocks"] == 2


# ------------------------------------------------------------------ hybrid: a state group
STATE = KvGroup("state", ("s0", "s1"), 4, "bfloat16,bfloat16")
HYBRID = [STATE, GROUP]  # as vLLM orders a GDN model's groups: the linear layers' first


def _store_hybrid(
    store: FakeStore, root: bytes, tokens: list[int], token_blocks: int, states: dict[int, Any]
) -> list[bytes]:
    """Put the attention objects of blocks [0, token_blocks) and the state objects of the
    blocks in ``states`` (block -> the ranks stored) into ``store``; returns the chains."""
    chains = kvs_keys.chain(root, tokens, 4)
    for j in range(token_blocks):
        store.objects[kvs_keys.object_key(chains[j], 1, 0)] = np.zeros(1, np.uint8)
    for j, ranks in states.items():
        for rank in ranks:
            store.objects[kvs_keys.object_key(chains[j], 0, rank)] = np.zeros(1, np.uint8)
    return chains


def test_a_hybrid_lookup_ends_at_the_last_boundary_whose_state_is_stored() -> None:
    store = FakeStore()
    root = kvs_keys.root_key(IDENTITY, HYBRID)
    tokens = list(range(17))
    # Attention for 4 blocks; a state after block 1 and after block 3, but the latter only on
    # rank 0 of 2: the longest loadable prefix is 2 blocks.
    chains = kvs_keys.chain(root, tokens, 4)
    for j in range(4):
        for rank in (0, 1):
            store.objects[kvs_keys.object_key(chains[j], 1, rank)] = np.zeros(1, np.uint8)
    for rank in (0, 1):
        store.objects[kvs_keys.object_key(chains[1], 0, rank)] = np.zeros(1, np.uint8)
    store.objects[kvs_keys.object_key(chains[3], 0, 0)] = np.zeros(1, np.uint8)
    asked: list[list[bytes]] = []

    def lookup(keys: list[bytes]) -> list[Any]:
        asked.append(keys)
        return store.lookup(keys)

    tokens_keys, per_block = kvs_keys.token_keys(chains, HYBRID, 2)
    states = [kvs_keys.state_keys(c, HYBRID, 2) for c in chains]
    answer = kvs.walk(lookup, LookupPlan(tokens_keys, per_block, 4, states))
    assert answer.blocks == 2
    assert len(answer.found) == 8  # every attention object: those past the hit are unheld later
    assert [r.key for r, _ in answer.states] == states[1]
    assert [r.key for r in answer.stray] == states[3][:1]  # rank 0's state of block 3 alone
    # The token objects in one call, then one per boundary, from the longest down to a hit.
    assert asked == [tokens_keys, states[3], states[2], states[1]]
    # No state anywhere: a miss, however much attention is stored.
    none = kvs.walk(store.lookup, LookupPlan(tokens_keys, per_block, 4, [[b"?" * 19]] * 4))
    assert none.blocks == 0


def test_a_hybrid_hit_loads_attention_past_the_local_hit_and_the_state_into_the_last_block() -> (
    None
):
    store = FakeStore()
    planner = _planner(store, groups=HYBRID)
    tokens = list(range(14))
    # Attention for blocks 0..2, the state only after block 1 (a step ended at token 8).
    chains = _store_hybrid(store, planner.root, tokens, 3, {1: [0]})
    request = _req("r", tokens)
    assert planner.get_num_new_matched_tokens(request, 0) == (8, True)
    unheld = {ref.key for ref in store.unheld}
    assert unheld == {kvs_keys.object_key(chains[2], 1, 0)}  # attention past the hit
    # vLLM's blocks for 8 external tokens: attention 0..1 (and the rest of the prompt), the
    # state group null up to block 1, which takes the state.
    blocks = SimpleNamespace(blocks=([NULL, Block(31)], [Block(i) for i in (20, 21, 22, 23)]))
    load = planner.update_state_after_alloc(request, blocks, 8)
    assert load is not None
    assert not load.error
    assert not load.in_step  # vLLM recovers failed in-step loads of one-group models only
    assert load.block_ids == [[kvs.NO_BLOCK, 31], [20, 21]]
    assert load.chains == chains[:2]
    keys = [[ref.key for ref, _ in entries] for entries in load.sources]
    assert keys == [
        [kvs_keys.object_key(chains[0], 1, 0)],
        [kvs_keys.object_key(chains[1], 0, 0), kvs_keys.object_key(chains[1], 1, 0)],
    ]
    # The loaded objects' holds (attention and state) go when the load is over, each once.
    planner.load_finished("r")
    planner.request_finished(request)
    assert sorted(ref.key for ref in store.unheld) == sorted(
        [kvs_keys.object_key(chains[2], 1, 0)] + [k for row in keys for k in row]
    )


def test_a_hybrid_hit_past_a_local_hit_loads_only_the_blocks_after_it() -> None:
    store = FakeStore()
    planner = _planner(store, groups=HYBRID)
    tokens = list(range(18))
    chains = _store_hybrid(store, planner.root, tokens, 4, {0: [0], 3: [0]})
    request = _req("r", tokens)
    assert planner.get_num_new_matched_tokens(request, 4) == (12, True)  # local: block 0
    blocks = SimpleNamespace(
        blocks=([NULL, NULL, NULL, Block(33)], [Block(i) for i in (20, 21, 22, 23, 24)])
    )
    load = planner.update_state_after_alloc(request, blocks, 12)
    assert load is not None
    assert load.block_ids == [[kvs.NO_BLOCK, kvs.NO_BLOCK, 33], [21, 22, 23]]
    assert load.chains == chains[1:4]
    assert [len(entries) for entries in load.sources] == [1, 1, 2]
    # Block 0's attention (the local hit has it) is given up at once; its state was never
    # looked up (the walk stops at the longest boundary with a state).
    assert [ref.key for ref in store.unheld] == [kvs_keys.object_key(chains[0], 1, 0)]


def test_a_hybrid_prefix_without_any_stored_state_is_a_miss() -> None:
    store = FakeStore()
    planner = _planner(store, groups=HYBRID)
    tokens = list(range(14))
    _store_hybrid(store, planner.root, tokens, 3, {})
    request = _req("r", tokens)
    assert planner.get_num_new_matched_tokens(request, 0) == (0, False)
    assert len(store.unheld) == 3  # every attention object found
    assert planner.counters["lookup_misses"] == 1


def test_a_hybrid_hit_vllm_takes_only_in_part_fails_the_load() -> None:
    """The state is the one at the hit's end: a load of fewer tokens has none to give."""
    store = FakeStore()
    planner = _planner(store, groups=HYBRID)
    tokens = list(range(14))
    _store_hybrid(store, planner.root, tokens, 3, {1: [0]})
    request = _req("r", tokens)
    assert planner.get_num_new_matched_tokens(request, 0) == (8, True)
    blocks = SimpleNamespace(blocks=([Block(31)], [Block(20), Block(21)]))
    load = planner.update_state_after_alloc(request, blocks, 4)
    assert load is not None
    assert load.error
    assert len({ref.key for ref in store.unheld}) == 4  # 3 attention, 1 state: nothing held
    planner.load_finished("r")  # the failed load's report, then the request's end
    planner.request_finished(request)
    assert len(store.unheld) == 4  # nothing unheld twice


def test_a_hybrid_request_saves_attention_blocks_and_only_the_states_vllm_keeps() -> None:
    store = FakeStore()
    planner = _planner(store, groups=HYBRID)
    manager: Manager = planner._manager  # type: ignore[assignment]
    request = _req("r", list(range(10)))
    attention = [Block(i) for i in (7, 8, 9)]
    # The first step computes 8 tokens (block-aligned, as vLLM splits a hybrid prefill): the
    # state after token 8 is kept in block 1; block 0 never held a state; block 2 runs.
    state = [NULL, _kept(5, 8), Block(6)]
    manager.blocks["r"] = (state, attention)
    planner.get_num_new_matched_tokens(request, 0)
    planner.get_num_new_matched_tokens(request, 0)
    saves = planner.plan_saves(_output(r=8))
    assert [(s.block_ids, len(s.chains)) for s in saves] == [([[kvs.NO_BLOCK, 5], [7, 8]], 2)]
    request.num_computed_tokens = 8
    assert planner.plan_saves(_output(r=2)) == []  # 10 tokens: block 2 not full
    # Decoding reaches token 12: vLLM keeps the state there too (hashed at 12).
    request.num_computed_tokens = 11
    request.all_token_ids += [10, 11]
    state[2] = _kept(6, 12)
    saves += planner.plan_saves(_output(r=1))
    assert saves[1].block_ids == [[6], [9]]
    assert manager.block_pool.touched == [5, 7, 8, 6, 9]
    # A state hashed at another boundary (a partial checkpoint) is not the block's.
    request.all_token_ids += [12, 13, 14, 15]
    request.num_computed_tokens = 15
    attention.append(Block(10))
    state.append(Block(4, block_hash=b"x", block_hash_num_tokens=14))
    saves += planner.plan_saves(_output(r=1))
    assert saves[2].block_ids == [[kvs.NO_BLOCK], [10]]


def test_a_hybrid_cache_saves_and_loads_the_state_where_it_is_asked() -> None:
    """The worker: an attention group and a state group (two tensors per layer) in one
    buffer; a state is saved for one block only, and loads into the block named for it."""
    cache, store, reports = Cache(), FakeStore(), Reports()
    rng = np.random.default_rng(2)
    cache.buffer[:] = rng.integers(0, 256, cache.buffer.size, dtype=np.uint8)
    attention = cache.geometry().groups[0]
    half = cache.block_bytes // 2
    state = KvCacheGeometry(
        buffers=(),
        layer_names=("s0", "s1"),
        layer_offsets=attention.layer_offsets,
        buffer_index=(0, 0),
        num_blocks=cache.num_blocks,
        block_size=4,
        segments=(
            Segment("state0", 0, cache.block_bytes, half),
            Segment("state1", half, cache.block_bytes, half),
        ),
        kind="state_slots",
        family="state",
        dtype="bfloat16,bfloat16",
    )
    geometry = CacheGeometry(cache.geometry().buffers, (state, attention))
    worker = KvsWorker(
        KvsConfig(verify="checksum"),
        geometry,
        tp_rank=0,
        tp_size=1,
        connect=lambda: store,
        report_load=reports,
        report_save=reports.save,
    )
    try:
        chains = _chains(2)
        worker.handle([], [KvsSave(0, [[kvs.NO_BLOCK, 2], [3, 4]], chains)])
        worker.step_done()
        reports.wait_save(0)
        assert len(store.objects) == 3  # two attention blocks, one state
        assert kvs_keys.object_key(chains[0], 0, 0) not in store.objects
        want_state = [cache.block(layer, 2).copy() for layer in (0, 1)]
        want_kv = {(layer, b): cache.block(layer, b).copy() for layer in (0, 1) for b in (3, 4)}
        untouched = [cache.block(layer, 10).copy() for layer in (0, 1)]
        sources = [
            [(SimpleNamespace(key=kvs_keys.object_key(chains[0], 1, 0)), 0)],
            [
                (SimpleNamespace(key=kvs_keys.object_key(chains[1], 0, 0)), 0),
                (SimpleNamespace(key=kvs_keys.object_key(chains[1], 1, 0)), 0),
            ],
        ]
        load = KvsLoad("r", [[kvs.NO_BLOCK, 13], [11, 12]], chains, sources)
        worker.handle([load], [])
        assert reports.wait("r") is False
        # Attention and state share these blocks' bytes here (one buffer): the state went
        # into block 13, the attention into 11 and 12, nothing into block 10.
        for layer in (0, 1):
            assert np.array_equal(cache.block(layer, 13), want_state[layer])
            assert np.array_equal(cache.block(layer, 11), want_kv[layer, 3])
            assert np.array_equal(cache.block(layer, 12), want_kv[layer, 4])
            assert np.array_equal(cache.block(layer, 10), untouched[layer])
        # A load the scheduler half could not plan fails without touching the cache.
        before = cache.buffer.copy()
        worker.handle([KvsLoad("bad", [], [], [], error="no state block")], [])
        assert reports.wait("bad") is True
        assert np.array_equal(cache.buffer, before)
    finally:
        worker.close()


class _SlowSubscriptions(FakeStore):
    """A store whose key subscription times out at the client's (lookup) timeout, as a master
    busy with instances starting beside this one would."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def subscribe_keys(self, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        if timeout is None:
            raise TimeoutError("subscribe: no answer within the client's timeout")
        return SimpleNamespace(alive=True, close=lambda: None, take=list)


def test_the_first_key_subscription_is_patient_so_no_lookup_has_to_make_it() -> None:
    """A subscription missed at start would be made at the first lookup, a connection the
    store gains in the middle of serving; the start-up's second try waits longer."""
    store = _SlowSubscriptions()
    lookups = Lookups(lambda: store, hold_s=1.0)
    try:
        assert lookups.wait_first_connect(30)
        assert lookups.subscribed
        assert store.timeouts == [None, kvs.FIRST_SUBSCRIBE_TIMEOUT_S]
    finally:
        lookups.close()


@pytest.mark.parametrize("outcome", ["connected", "refused"])
def test_the_first_connect_is_waited_for_until_it_is_done_or_failed(outcome: str) -> None:
    """A readiness check: the lookup and the worker threads connect after start; their first
    connect's end, made or refused, is what ``wait_first_connect`` waits for."""
    store, cache, reports = FakeStore(), Cache(), Reports()
    go = threading.Event()

    def connect() -> FakeStore:
        go.wait(30)
        if outcome == "refused":
            raise ConnectionRefusedError("no master")
        return store

    lookups = Lookups(connect, hold_s=1.0)
    worker = _worker(cache, store, reports, connect, verify="header")
    try:
        assert not lookups.wait_first_connect(0.05)
        assert not worker.wait_first_connect(0.05)
        go.set()
        assert lookups.wait_first_connect(30)
        assert worker.wait_first_connect(30)
        assert (lookups._client is store) == (outcome == "connected")
    finally:
        lookups.close()
        worker.close()
