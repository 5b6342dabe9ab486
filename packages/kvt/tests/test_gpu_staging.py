"""GPU memory without a GPU: device regions, the staging pipeline and CUDA layer events on CPU.

numpy arrays registered as :class:`kvt.access.DeviceMemory` stand in for device memory, and
:class:`kvt.staging.ThreadCopier` (copies on its own thread, one event per batch, like a copy
stream) stands in for CUDA; the ordering and lifetime rules of kvt.staging are the same code that
runs on a GPU. The real-CUDA tests are in test_gpu_cuda.py (skipped without CUDA).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import Completions, wait_until
from ipcblock import make_blocks
from kvt import CpuLayerEvents, CudaLayerEvents, InMemoryBackend, TcpBackend, TransferStatus
from kvt.access import DeviceMemory, EventWaiter, RegionTable
from kvt.backend import Batch, DataPlaneBackend, MemoryInfo
from kvt.engine import Engine
from kvt.errors import DeviceMemoryError, InvalidBlocksError, InvalidRegionError
from kvt.staging import STAGING_REGION_ID, StagingPool, ThreadCopier, coalesce

BLOCK = 64 << 10
LAYERS = 4
BLOCKS_PER_LAYER = 8
REGION = LAYERS * BLOCKS_PER_LAYER * BLOCK * 2


def fake_device(array: np.ndarray) -> DeviceMemory:
    """A numpy array registered as if it were CUDA memory (only a copier may touch it)."""
    return DeviceMemory(int(array.ctypes.data), array.nbytes, "cuda:0", owner=array)


class Side:
    def __init__(self, backend: str, name: str, staging_bytes: int, timeout_s: float = 20):
        self.copier = ThreadCopier(name=f"kvt-{name}-fakecopy")
        data_plane = (
            TcpBackend("127.0.0.1", 0, name=name)
            if backend == "tcp"
            else InMemoryBackend(name=name)
        )
        self.engine = Engine(
            data_plane, name=name, default_timeout_s=timeout_s, device_copier=self.copier,
            staging_bytes=staging_bytes,
        )  # fmt: skip
        self.memory = np.zeros(REGION, dtype=np.uint8)
        self.region = self.engine.register_region(fake_device(self.memory))

    @property
    def pool(self) -> StagingPool:
        assert self.engine._stager is not None
        return self.engine._stager.pool


@pytest.fixture(params=["tcp", "memory"])
def gpu_pair(request, no_leaks):
    """P and D with fake device regions; staging pools of 2 layers' worth each."""
    made: list[Side] = []

    def make(name: str, staging_bytes: int = 2 * BLOCKS_PER_LAYER * BLOCK, **kw) -> Side:
        side = Side(request.param, name, staging_bytes, **kw)
        made.append(side)
        return side

    yield make
    for side in made:
        side.copier.resume()  # a failed test may have left the fake "device" held
        side.engine.close()


def layer_blocks(p: Side, d: Side, layer: int, rng_seed: int = 0) -> np.ndarray:
    """The layer's blocks, from scattered source slots to scattered destination slots."""
    rng = np.random.default_rng(rng_seed)
    slots = REGION // BLOCK
    src = rng.permutation(slots)[: slots // 2].reshape(LAYERS, BLOCKS_PER_LAYER)
    dst = rng.permutation(slots)[: slots // 2].reshape(LAYERS, BLOCKS_PER_LAYER)
    return make_blocks(
        (src[layer] * BLOCK).tolist(), (dst[layer] * BLOCK).tolist(), BLOCK,
        src_region=p.region, dst_region=d.region,
    )  # fmt: skip


def assert_landed(p: Side, d: Side, blocks: np.ndarray) -> None:
    for b in blocks:
        so, do, n = int(b["src_offset"]), int(b["dst_offset"]), int(b["length"])
        assert np.array_equal(d.memory[do : do + n], p.memory[so : so + n])


def landed(p: Side, d: Side, blocks: np.ndarray) -> bool:
    return all(
        np.array_equal(
            d.memory[int(b["dst_offset"]) : int(b["dst_offset"]) + int(b["length"])],
            p.memory[int(b["src_offset"]) : int(b["src_offset"]) + int(b["length"])],
        )
        for b in blocks
    )


def fill(p: Side) -> None:
    p.memory[:] = np.random.default_rng(1).integers(1, 256, REGION, dtype=np.uint8)


def assert_pools_empty(*sides: Side) -> None:
    for side in sides:
        wait_until(lambda s=side: s.pool.leased == 0 and s.pool.waiting == 0)
        assert side.pool.free_bytes == side.pool.capacity


# ------------------------------------------------------------------ regions
def test_device_regions_have_no_host_view_and_refuse_host_paths() -> None:
    table = RegionTable()
    host = np.zeros(4096, dtype=np.uint8)
    dev = np.zeros(4096, dtype=np.uint8)
    h, d = table.register(host).region_id, table.register(fake_device(dev)).region_id
    region = table.get(d)
    assert region is not None
    assert (region.device, region.view, region.address) == ("cuda:0", None, dev.ctypes.data)
    on_device = make_blocks([0], [0], 1024, src_region=d, dst_region=d)
    assert table.device_of(on_device, "src") == "cuda:0"
    assert table.device_of(make_blocks([0], [0], 64, src_region=h, dst_region=h), "dst") == "cpu"
    with pytest.raises(DeviceMemoryError, match="cuda:0"):
        table.views(on_device, "dst")
    assert issubclass(DeviceMemoryError, InvalidBlocksError)
    mixed = make_blocks([0, 0], [0, 0], 64, src_region=[h, d], dst_region=[h, d])
    with pytest.raises(InvalidBlocksError, match="split"):
        table.device_of(mixed, "src")
    with pytest.raises(InvalidBlocksError, match="outside"):  # bounds still checked
        table.device_of(make_blocks([4000], [0], 1024, src_region=d, dst_region=d), "src")
    with pytest.raises(InvalidRegionError):
        DeviceMemory(0, 10, "cuda:0")
    np.testing.assert_array_equal(table.addresses(on_device, "src"), [dev.ctypes.data])


class _RecordingBackend(InMemoryBackend):
    moves_device_memory = True  # like RDMA into GPU memory: no staging

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.registered: list[MemoryInfo] = []

    def register_memory(self, info: MemoryInfo) -> None:
        self.registered.append(info)


def test_device_regions_reach_register_memory_and_skip_staging(no_leaks) -> None:
    backend = _RecordingBackend(name="R")
    engine = Engine(backend, name="R")
    dev = np.zeros(1 << 16, dtype=np.uint8)
    rid = engine.register_region(fake_device(dev))
    assert backend.registered == [MemoryInfo(rid, dev.ctypes.data, dev.nbytes, True, "cuda:0")]
    assert engine._stager is None  # the backend moves device memory itself
    engine.close()


def test_the_staging_pool_is_registered_with_the_backend(no_leaks) -> None:
    backend = _RecordingBackend(name="R")
    backend.moves_device_memory = False  # host-byte paths: staging, whose memory paths may need
    engine = Engine(backend, name="R", device_copier=ThreadCopier(), staging_bytes=1 << 20)
    dev = np.zeros(1 << 16, dtype=np.uint8)
    rid = engine.register_region(fake_device(dev))
    assert engine._stager is not None
    pool = engine._stager.pool
    assert backend.registered == [
        MemoryInfo(STAGING_REGION_ID, pool.address, 1 << 20, True, "cpu"),
        MemoryInfo(rid, dev.ctypes.data, dev.nbytes, True, "cuda:0"),
    ]
    engine.close()


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    dst, src, n = coalesce(
        np.array([100, 110, 200, 300]), np.array([0, 10, 20, 50]), np.array([10, 10, 30, 5])
    )
    assert (dst.tolist(), src.tolist(), n.tolist()) == ([100, 200, 300], [0, 20, 50], [20, 30, 5])


# ------------------------------------------------------------------ the pool
def test_pool_first_fit_fifo_cancel_and_close() -> None:
    buffer = np.zeros(4096, dtype=np.uint8)
    pool = StagingPool(int(buffer.ctypes.data), 4096, buffer)
    got: list = []

    def take(nbytes: int):
        pool.request(nbytes, got.append)
        return got.pop()  # granted at once

    a, b = take(2048), take(2048)
    assert pool.free_bytes == 0
    big = pool.request(4096, got.append)  # waits: FIFO head
    small = pool.request(100, got.append)  # waits behind it although 100 bytes would fit later
    assert (got, pool.waiting) == ([], 2)
    a.release()
    a.release()  # idempotent
    assert got == []  # 2048 free, the head needs 4096; nobody overtakes it
    big.cancel()
    assert got[0] is None
    assert got[1].nbytes == 256  # the one behind it now fits
    assert pool.waiting == 0
    got[1].release()
    b.release()
    assert pool.free_bytes == 4096
    assert pool.leased == 0
    hold = take(4096)
    pool.request(512, got.append)
    pool.close()  # wakes waiters with None
    assert got[-1] is None
    hold.release()
    assert pool.leased == 0
    with pytest.raises(ValueError):
        pool.request(8192, got.append)
    small.cancel()  # already granted and released: a no-op


# ------------------------------------------------------------------ the staging pipeline
def test_device_to_device_is_byte_exact_and_returns_all_staging(gpu_pair) -> None:
    p, d = gpu_pair("P"), gpu_pair("D")
    fill(p)
    recv, sent = Completions(), Completions()
    d.engine.expect("r1", on_complete=recv)
    all_blocks = [layer_blocks(p, d, layer) for layer in range(LAYERS)]
    for layer, blocks in enumerate(all_blocks):
        last = layer == LAYERS - 1
        p.engine.send("r1", d.engine.data_address, blocks, last=last, on_complete=sent)
    done_recv, done_send = recv.wait(), sent.wait()
    assert done_recv.status is TransferStatus.DONE, done_recv
    assert done_send.status is TransferStatus.DONE, done_send
    assert done_recv.nbytes == LAYERS * BLOCKS_PER_LAYER * BLOCK
    for blocks in all_blocks:
        assert_landed(p, d, blocks)
    assert_pools_empty(p, d)
    # The pool (2 layers) was smaller than the request (4 layers): batches waited for space.
    assert p.copier.batches == LAYERS


def test_first_layer_on_the_wire_before_the_last_is_computed(gpu_pair) -> None:
    p, d = gpu_pair("P"), gpu_pair("D")
    fill(p)
    events = CpuLayerEvents(LAYERS)
    recv, sent = Completions(), Completions()
    d.engine.expect("r1", on_complete=recv)
    all_blocks = [layer_blocks(p, d, layer) for layer in range(LAYERS)]
    for layer, blocks in enumerate(all_blocks):
        p.engine.send(
            "r1", d.engine.data_address, blocks, last=layer == LAYERS - 1, on_complete=sent,
            after=(events, layer),
        )  # fmt: skip
    assert p.copier.batches == 0  # nothing copied before its layer is computed
    events.mark_ready(0)
    # Layer 0 reaches the receiver's device memory (D2H, wire, H2D) while layers 1.. are not
    # computed yet.
    wait_until(lambda: landed(p, d, all_blocks[0]))
    assert not events.is_ready(LAYERS - 1)
    assert not landed(p, d, all_blocks[LAYERS - 1])
    assert recv.empty()
    for layer in range(LAYERS - 1, 0, -1):  # out of order: DONE still waits for every layer
        events.mark_ready(layer)
    assert recv.wait().status is TransferStatus.DONE
    assert sent.wait().status is TransferStatus.DONE
    for blocks in all_blocks:
        assert_landed(p, d, blocks)
    assert_pools_empty(p, d)


def test_receiver_done_only_after_its_h2d_copy(gpu_pair) -> None:
    p, d = gpu_pair("P"), gpu_pair("D")
    fill(p)
    blocks = layer_blocks(p, d, 0)
    recv, sent = Completions(), Completions()
    d.engine.expect("r1", on_complete=recv)
    d.copier.hold()  # the receiver's "copy stream" is busy
    p.engine.send("r1", d.engine.data_address, blocks, last=True, on_complete=sent)
    wait_until(lambda: d.pool.leased == 1 and d.engine._stager is not None and p.pool.leased == 0)
    # Every byte is in the receiver's staging, none in its device memory: no DONE yet.
    wait_until(lambda: d.engine.status("r1", "recv") is TransferStatus.TRANSFERRING)
    assert recv.empty()
    assert sent.empty()
    assert not d.memory.any()
    d.copier.resume()
    assert recv.wait().status is TransferStatus.DONE
    assert sent.wait().status is TransferStatus.DONE
    assert_landed(p, d, blocks)
    assert_pools_empty(p, d)


def test_full_pool_makes_batches_wait_in_order(gpu_pair) -> None:
    one_layer = BLOCKS_PER_LAYER * BLOCK
    p, d = gpu_pair("P", staging_bytes=one_layer), gpu_pair("D", staging_bytes=one_layer)
    fill(p)
    recv = Completions()
    d.engine.expect("r1", on_complete=recv)
    p.copier.hold()
    all_blocks = [layer_blocks(p, d, layer) for layer in range(LAYERS)]
    for layer, blocks in enumerate(all_blocks):
        p.engine.send("r1", d.engine.data_address, blocks, last=layer == LAYERS - 1)
    # One layer fits the pool: one leased, the middle two wait in line (no allocation beyond the
    # pool), the last waits for them before it even asks for space.
    assert (p.pool.leased, p.pool.waiting) == (1, LAYERS - 2)
    p.copier.resume()
    assert recv.wait().status is TransferStatus.DONE
    for blocks in all_blocks:
        assert_landed(p, d, blocks)
    assert_pools_empty(p, d)
    big = np.concatenate(all_blocks[:2])
    with pytest.raises(InvalidBlocksError, match="staging pool"):
        p.engine.send("r2", d.engine.data_address, big, last=True)


def test_waiting_for_pool_space_is_bounded_by_the_deadline(gpu_pair) -> None:
    one_layer = BLOCKS_PER_LAYER * BLOCK
    p, d = gpu_pair("P", staging_bytes=one_layer), gpu_pair("D", staging_bytes=one_layer)
    fill(p)
    first, second, second_recv = Completions(), Completions(), Completions()
    d.engine.expect("r1")
    d.engine.expect("r2", on_complete=second_recv)
    p.copier.hold()
    p.engine.send("r1", d.engine.data_address, layer_blocks(p, d, 0), last=True, on_complete=first)
    p.engine.send(
        "r2", d.engine.data_address, layer_blocks(p, d, 1), last=True, on_complete=second,
        timeout_s=0.2,
    )  # fmt: skip
    assert p.pool.waiting == 1
    timed_out = second.wait()
    assert (timed_out.status, timed_out.origin.value) == (TransferStatus.ABORTED, "timeout")
    assert second_recv.wait().status is TransferStatus.ABORTED  # the receiver was told
    assert p.pool.waiting == 0  # its ticket left the line with it
    p.copier.resume()
    assert first.wait().status is TransferStatus.DONE
    assert_landed(p, d, layer_blocks(p, d, 0))
    assert not landed(p, d, layer_blocks(p, d, 1))
    assert_pools_empty(p, d)


def test_receiver_waits_for_its_pool_until_the_deadline(gpu_pair) -> None:
    one_layer = BLOCKS_PER_LAYER * BLOCK
    p = gpu_pair("P")
    d = gpu_pair("D", staging_bytes=one_layer)
    fill(p)
    first, second = Completions(), Completions()
    d.engine.expect("r1", on_complete=first)
    d.engine.expect("r2", timeout_s=0.3, on_complete=second)
    d.copier.hold()  # r1 keeps the receiver's whole pool until its H2D copy ran
    p.engine.send("r1", d.engine.data_address, layer_blocks(p, d, 0), last=True)
    p.engine.send("r2", d.engine.data_address, layer_blocks(p, d, 1), last=True)
    timed_out = second.wait()  # its batch waited for pool space on the link, then the deadline
    assert (timed_out.status, timed_out.origin.value) == (TransferStatus.ABORTED, "timeout")
    d.copier.resume()
    assert first.wait().status is TransferStatus.DONE
    assert_landed(p, d, layer_blocks(p, d, 0))
    assert_pools_empty(p, d)


@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_abort_while_copying_returns_the_staging(gpu_pair, who) -> None:
    p, d = gpu_pair("P"), gpu_pair("D")
    fill(p)
    recv, sent = Completions(), Completions()
    d.engine.expect("r1", on_complete=recv)
    side = p if who == "sender" else d
    side.copier.hold()
    p.engine.send("r1", d.engine.data_address, layer_blocks(p, d, 0), last=False, on_complete=sent)
    # The copy itself has begun (a receiver leases its staging before any byte arrives).
    wait_until(lambda: side.copier.submitted == 1)
    side.engine.abort("r1", "test abort")
    mine, theirs = (sent, recv) if who == "sender" else (recv, sent)
    # The copy still holds the request's memory: its completion waits for it.
    assert theirs.wait().status is TransferStatus.ABORTED
    assert mine.empty()
    side.copier.resume()
    assert mine.wait().status is TransferStatus.ABORTED
    assert_pools_empty(p, d)


def test_close_with_staged_batches_in_flight_leaks_nothing(gpu_pair) -> None:
    p, d = gpu_pair("P"), gpu_pair("D")
    fill(p)
    sent = Completions()
    d.engine.expect("r1")
    p.copier.hold()
    for layer in range(LAYERS):
        p.engine.send("r1", d.engine.data_address, layer_blocks(p, d, layer), on_complete=sent)
    threading.Timer(0.05, p.copier.resume).start()  # the "device" finishes while close() waits
    p.engine.close()
    assert sent.wait().code.name == "ENGINE_CLOSED"
    assert (p.pool.leased, p.pool.waiting) == (0, 0)


# ------------------------------------------------------------------ CUDA layer events, faked
class FakeEvent:
    """A CUDA event stand-in: completes when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.stream = "unset"

    def record(self, stream=None) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        self.done.wait()


def test_cuda_layer_events_fire_in_record_order_on_the_waiter_thread(no_leaks) -> None:
    made: list[FakeEvent] = []

    def factory() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    events = CudaLayerEvents(3, event_factory=factory)
    fired: list[tuple[int, str]] = []
    all_fired = threading.Event()

    def on(layer: int):
        def callback() -> None:
            fired.append((layer, threading.current_thread().name))
            if len(fired) == 3:
                all_fired.set()

        return callback

    for layer in range(3):
        events.when_ready(layer, on(layer))
    events.record(0, stream="s0")
    events.record(1, stream="s0")
    assert [e.stream for e in made] == ["s0", "s0"]
    assert events.is_recorded(1)
    assert not events.is_recorded(2)
    made[1].done.set()  # layer 1's event completes first: still waits for layer 0 (stream order)
    assert fired == []
    made[0].done.set()
    wait_until(lambda: len(fired) == 2)
    events.record_rest(stream="s1")  # end of the pass: layer 2 only
    assert len(made) == 3
    made[2].done.set()
    assert all_fired.wait(5)
    assert [layer for layer, _ in fired] == [0, 1, 2]
    assert {name for _, name in fired} == {"kvt-cuda-events"}  # never the recording thread
    events.close()
    events.close()


def test_cuda_layer_events_share_one_waiter_that_close_drains(no_leaks) -> None:
    waiter = EventWaiter(name="kvt-test-waiter")
    step1 = CudaLayerEvents(2, event_factory=_done_event, waiter=waiter)
    step2 = CudaLayerEvents(2, event_factory=_done_event, waiter=waiter)
    ready = Completions()
    step1.when_ready(1, lambda: ready("step1"))
    step2.when_ready(1, lambda: ready("step2"))
    step1.record_rest()
    step2.record_rest()
    assert {ready.wait(), ready.wait()} == {"step1", "step2"}
    step1.close()  # does not stop the shared waiter
    step2.record(0)
    waiter.close()  # waits for what was queued, then joins
    assert step2.is_ready(0)
    with pytest.raises(RuntimeError):
        waiter.after(_done_event(), lambda: None)
    step2.close()


def _done_event() -> FakeEvent:
    event = FakeEvent()
    event.done.set()
    return event


def test_cuda_layer_events_without_cuda_say_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaLayerEvents(2)


# ------------------------------------------------------------------ link lost mid-batch
class _FakeLink:
    peer, path = "fake-peer", "tcp"

    def send_control(self, message) -> None:
        pass

    def close(self, reason: str) -> None:
        pass


class _BreakingBackend(DataPlaneBackend):
    """Plays a data plane whose link dies inside a frame: begin, nothing sent, link lost."""

    def __init__(self) -> None:
        self.link = _FakeLink()
        self.listener = None

    @property
    def address(self) -> str:
        return "breaking:0"

    def start(self, listener) -> None:
        self.listener = listener

    def link_to(self, peer_address: str):
        return self.link

    def submit(self, link, job) -> None:
        assert job.begin_frame()
        job.end_frame(0)  # the socket died mid-frame: no end_frame for the rest, no fail()
        self.listener.on_link_lost(link, "link broke mid-frame", False)

    def close(self) -> None:
        pass


def test_link_lost_mid_batch_returns_the_staging_on_both_sides(no_leaks) -> None:
    memory = np.zeros(1 << 20, dtype=np.uint8)
    blocks = make_blocks([0, BLOCK], [BLOCK, 0], BLOCK, src_region=0, dst_region=0)
    # Sender: the job's frames never end; only the request's completion gives the lease back.
    sender = Engine(_BreakingBackend(), name="S", device_copier=ThreadCopier(name="kvt-S-fakecopy"))
    assert sender.register_region(fake_device(memory)) == 0
    sent = Completions()
    sender.send("r1", "anywhere", blocks, last=True, on_complete=sent)
    assert sent.wait().code.name == "CONNECTION_LOST"
    assert sender._stager is not None
    wait_until(lambda: sender._stager.pool.leased == 0)
    sender.close()
    # Receiver: this test plays its backend; the link dies after a chunk, before end_batch().
    receiver = Engine(
        InMemoryBackend(name="R"), name="R", device_copier=ThreadCopier(name="kvt-R-fakecopy")
    )
    assert receiver.register_region(fake_device(memory)) == 0
    recv = Completions()
    receiver.expect("r1", on_complete=recv)
    link = _FakeLink()
    sink = receiver.on_batch(link, Batch("r1", blocks, True))
    assert sink is not None
    assert receiver._stager.pool.leased == 1
    assert sink.begin_chunk()
    sink.views[0][:] = b"\x01" * BLOCK
    sink.end_chunk(BLOCK)
    receiver.on_link_lost(link, "link broke mid-batch", False)
    assert recv.wait().code.name == "CONNECTION_LOST"
    assert receiver._stager.pool.leased == 0
    assert not memory.any()  # nothing of a half batch reached "device" memory
    receiver.close()


def test_gpu_check_dry_run_runs_on_cpu(tmp_path) -> None:
    """The prepared device script (benchmarks/gpu_check.py) is import-clean and its CPU rehearsal
    produces the figures it will produce on a GPU."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(script), "--dry-run", "--mib", "4", "--repeats", "1"]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    (tcp,) = report["throughput"]
    assert tcp["byte_exact"], tcp
    assert report["pipeline"]["byte_exact"]
    assert report["pipeline"]["first_layer_on_wire_before_last_computed"]


def test_last_layer_ready_first_does_not_hold_the_pool(gpu_pair) -> None:
    # The last batch waits for the earlier ones before it may leave; it must not sit on pool
    # space while it waits, or a pool of one batch would starve the batches it waits for.
    one_layer = BLOCKS_PER_LAYER * BLOCK
    p = gpu_pair("P", staging_bytes=one_layer, timeout_s=5)
    d = gpu_pair("D", timeout_s=5)
    fill(p)
    events = CpuLayerEvents(LAYERS)
    recv = Completions()
    d.engine.expect("r1", on_complete=recv)
    all_blocks = [layer_blocks(p, d, layer) for layer in range(LAYERS)]
    for layer, blocks in enumerate(all_blocks):
        last = layer == LAYERS - 1
        p.engine.send("r1", d.engine.data_address, blocks, last=last, after=(events, layer))
    for layer in reversed(range(LAYERS)):
        events.mark_ready(layer)
    assert recv.wait().status is TransferStatus.DONE
    for blocks in all_blocks:
        assert_landed(p, d, blocks)
    assert_pools_empty(p, d)
