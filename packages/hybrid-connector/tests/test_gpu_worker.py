"""hybrid-connector with vLLM's KV cache on a GPU, as far as it runs without one.

Rapid transfer_kv on CUDA layer events: save_kv_layer records an event per layer on the compute
stream and returns at once; kvt's thread waits for it and only then sends that layer. The events
are faked here (the KV stays in host memory); test_gpu_cuda.py in kvt runs the real ones.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from hybrid_connector.errors import UnsupportedLayoutError
from hybrid_connector.layout import KvGroup, describe_kv_cache_groups
from hybrid_connector.metadata import FinalPrefill, HybridConnectorMetadata
from test_worker_side import Pair, _layer_blocks, _wait, pair  # noqa: F401 (fixture)

NOTHING = (set(), set())


class FakeCudaEvent:
    """Stands in for torch.cuda.Event: "completes" when the test says the GPU got there."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.stream = None

    def record(self, stream=None) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        self.done.wait()


def test_rapid_transfer_waits_for_each_layers_cuda_event(pair: Pair) -> None:  # noqa: F811
    made: list[FakeCudaEvent] = []

    def new_event() -> FakeCudaEvent:
        made.append(FakeCudaEvent())
        return made[-1]

    pair.p._start_device_events("cuda:0", current_stream=lambda: "compute", event_factory=new_event)
    tid = str(uuid.uuid4())
    src, dst = [3, 4], [9, 10]
    pair.pull("d-req", tid, dst, num_tokens=6)
    assert _wait(pair.d, timeout=0.3) == NOTHING
    pair.p.handle_metadata(
        HybridConnectorMetadata(final_prefills=[FinalPrefill("p-req", tid, [src], 6)])
    )
    names = list(pair.p_kv)
    # save_kv_layer: records the layer's event on the compute stream and returns at once (the
    # fake events are not complete: a wait here would hang the test).
    pair.p.layer_saved(names[0])
    pair.p.layer_saved(names[1])
    assert [e.stream for e in made] == ["compute", "compute"]
    made[0].done.set()
    made[1].done.set()
    assert _wait(pair.d, timeout=0.3) == NOTHING  # layer 2 not even queued on the GPU
    pair.p.step_done()  # wait_for_save: records the layers not recorded yet
    assert len(made) == 3
    assert _wait(pair.d, timeout=0.3) == NOTHING  # the GPU has not finished layer 2
    made[2].done.set()
    assert _wait(pair.d) == ({"d-req"}, set())
    for got, want in zip(_layer_blocks(pair.d_kv, dst), _layer_blocks(pair.p_kv, src), strict=True):
        assert torch.equal(got, want)
    # Offered once the step's last layer was on the GPU; given back once its send is over.
    assert pair.returned() == {"p-req"}


def test_kv_caches_on_other_devices_are_refused() -> None:
    meta = {"l0": torch.empty((4, 2, 4, 16), device="meta")}
    with pytest.raises(UnsupportedLayoutError, match="one CUDA device"):
        describe_kv_cache_groups(meta, [KvGroup("attention", ("l0",), 4)])


def test_gpu_kv_buffers_register_as_kvt_device_memory() -> None:
    from hybrid_connector.layout import Buffer
    from hybrid_connector.worker_side import _region_of
    from kvt.access import DeviceMemory

    assert _region_of(Buffer(4096, 8192)) == (4096, 8192)
    assert _region_of(Buffer(4096, 8192, "cuda:1")) == DeviceMemory(4096, 8192, "cuda:1")
