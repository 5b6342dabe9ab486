"""The same GPU paths on real CUDA: skipped without it ("CUDA not available").

What the CPU tests in test_gpu_staging.py fake (device memory, the copier, the events), these run
for real: CUDA tensors as regions, CudaCopier through pinned staging over TCP, CudaLayerEvents.
``benchmarks/gpu_check.py`` runs this file first on a machine with a GPU.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
from conftest import Completions
from ipcblock import make_blocks
from kvt import CudaLayerEvents, TransferEngine, TransferStatus

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

BLOCK = 64 << 10
LAYERS = 4
PER_LAYER = 16


def test_cuda_tensor_registers_as_a_device_region(no_leaks) -> None:
    engine = TransferEngine(name="G")
    tensor = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    rid = engine.register_region(tensor)
    region = engine.regions.get(rid)
    assert region is not None
    assert (region.device, region.address, region.nbytes) == ("cuda:0", tensor.data_ptr(), 1 << 20)
    assert region.view is None
    engine.close()


def test_cuda_layer_events_fire_after_the_kernels_before_them(no_leaks) -> None:
    events = CudaLayerEvents(2)
    x = torch.zeros(1 << 22, device="cuda:0")
    fired: queue.SimpleQueue[int] = queue.SimpleQueue()
    for layer in range(2):
        events.when_ready(layer, lambda layer=layer: fired.put(layer))
    stream = torch.cuda.current_stream()
    for layer in range(2):
        x.add_(1)
        events.record(layer, stream)
    assert [fired.get(timeout=30), fired.get(timeout=30)] == [0, 1]
    assert float(x[0]) == 2.0
    events.close()


def test_gpu_to_gpu_over_tcp_per_layer_is_byte_exact(no_leaks) -> None:
    # forced: auto would pick samehost (one host) or rdma (a NIC on the GPU box), not tcp
    p, d = TransferEngine(name="P", transport="tcp"), TransferEngine(name="D", transport="tcp")
    nbytes = 2 * LAYERS * PER_LAYER * BLOCK
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    src_id, dst_id = p.register_region(src), d.register_region(dst)
    rng = np.random.default_rng(0)
    slots = nbytes // BLOCK
    src_slots = rng.permutation(slots)[: LAYERS * PER_LAYER].reshape(LAYERS, PER_LAYER)
    dst_slots = rng.permutation(slots)[: LAYERS * PER_LAYER].reshape(LAYERS, PER_LAYER)
    events = CudaLayerEvents(LAYERS)
    recv, sent = Completions(), Completions()
    d.expect("g1", on_complete=recv)
    for layer in range(LAYERS):
        blocks = make_blocks(
            (src_slots[layer] * BLOCK).tolist(), (dst_slots[layer] * BLOCK).tolist(), BLOCK,
            src_region=src_id, dst_region=dst_id,
        )  # fmt: skip
        p.send("g1", d.data_address, blocks, last=layer == LAYERS - 1, on_complete=sent,
               after=(events, layer))  # fmt: skip
    stream = torch.cuda.current_stream()
    for layer in range(LAYERS):
        events.record(layer, stream)
    assert recv.wait(60).status is TransferStatus.DONE
    assert sent.wait(60).status is TransferStatus.DONE
    s, t = src.view(slots, BLOCK).cpu(), dst.view(slots, BLOCK).cpu()
    for layer in range(LAYERS):
        assert torch.equal(t[dst_slots[layer]], s[src_slots[layer]])
    events.close()
    for engine in (p, d):
        assert engine._stager is not None
        assert engine._stager.pool.leased == 0
        engine.close()
