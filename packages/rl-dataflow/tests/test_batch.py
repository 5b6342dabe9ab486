"""Batch reorganisation without Ray: by value and by ref must deliver the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import refstore
from rl_dataflow.pipeline import Batch


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path))
    with refstore.MasterThread("rl-test", "16M"), refstore.Client("rl-test") as c:
        yield c


def _batches(client):
    rng = np.random.default_rng(3)
    lengths = np.array([5, 9, 2, 7, 4], dtype=np.int64)
    rows = rng.integers(0, 1000, (int(lengths.sum()), 3, 2), dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    tokens = [rng.integers(0, 100, int(n), dtype=np.int32) for n in lengths]
    ids = np.arange(5)
    prompts = np.array([1, 0, 1, 0, 2])
    by_value = Batch(ids, prompts, lengths, tokens, rows, offsets)
    ref = client.put({"topk": rows})
    manifest = refstore.Manifest.from_packed(
        ref, lengths, dtype=np.int32, row_shape=(3, 2), key="topk"
    )
    by_ref = Batch(ids, prompts, lengths, tokens, manifest, offsets)
    return by_value, by_ref


def _payload_reads(monkeypatch) -> list[refstore.Ref]:
    """The refs any refstore client of this process gets from now on. Counted in the client:
    gets answered from the object's header never reach the master's counters."""
    reads: list[refstore.Ref] = []
    get = refstore.Client.get

    def counted(self, ref, *args, **kwargs):
        reads.append(ref)
        return get(self, ref, *args, **kwargs)

    monkeypatch.setattr(refstore.Client, "get", counted)
    return reads


def test_reorder_and_split_agree(client, monkeypatch):
    by_value, by_ref = _batches(client)
    (stored,) = by_ref.r3.used_refs()
    reads = _payload_reads(monkeypatch)
    puts = client.stats().puts
    order = np.argsort(-by_value.lengths, kind="stable")
    value_parts = by_value.reorder(order).split([(0, 2), (2, 5)])
    ref_parts = by_ref.reorder(order).split([(0, 2), (2, 5)])
    assert reads == []  # the ref path touched no payload: no client read it
    assert client.stats().puts == puts  # nor stored a new one
    assert all(part.r3.used_refs() == [stored] for part in ref_parts)  # manifests of the same rows
    for v, r in zip(value_parts, ref_parts, strict=True):
        np.testing.assert_array_equal(v.sample_ids, r.sample_ids)
        np.testing.assert_array_equal(v.r3, refstore.materialize(r.r3, client=client))
        assert [len(t) for t in v.tokens] == list(v.lengths)


def test_torch_by_value_reorders_like_numpy(client):
    torch = pytest.importorskip("torch")
    by_value, _ = _batches(client)
    as_torch = Batch(
        by_value.sample_ids,
        by_value.prompt_ids,
        by_value.lengths,
        by_value.tokens,
        torch.from_numpy(by_value.r3),
        by_value.r3_offsets,
    )
    order = np.argsort(by_value.prompt_ids, kind="stable")
    numpy_parts = by_value.reorder(order).split([(0, 3), (3, 5)])
    torch_parts = as_torch.reorder(order).split([(0, 3), (3, 5)])
    for n, t in zip(numpy_parts, torch_parts, strict=True):
        assert isinstance(t.r3, torch.Tensor)
        # Each micro-batch owns just its rows: pickling it carries no more than that.
        assert t.r3.untyped_storage().nbytes() == t.r3.numel() * t.r3.element_size()
        np.testing.assert_array_equal(n.r3, t.r3.numpy())
        np.testing.assert_array_equal(n.r3_offsets, t.r3_offsets)
