"""RDMA WRITE planning: one frame's IpcBlocks to work requests. Pure numpy, no device, no pyverbs.

Inputs: the frame's records, where each record's source bytes are in this process (addresses, as
``SendJob.addresses``) and the local memory key (lkey) of the region that holds them, the peer's
advertised writable regions (region id -> remote address, length, rkey) and the device's limits.
Output: a :class:`WritePlan`, the work requests in record order:

1. every record is checked against the peer's advertised region first (:class:`RemoteRegionError`
   before any work request exists; the peer's NIC would fail the whole QP on a bad write);
2. records contiguous on both sides (same lkey, same rkey) merge into one span;
3. spans whose remote ranges follow each other form a run: one remote range, several local pieces;
4. a run is cut at every multiple of ``max_msg_size`` bytes of its remote range (a span crossing a
   cut becomes two pieces), and each cut's pieces are grouped ``max_sge`` at a time: one RDMA WRITE
   each, so no work request exceeds either limit;
5. the last work request is a WRITE_WITH_IMM carrying the frame's 32-bit sequence number (a frame
   with no bytes plans as one zero-length WRITE_WITH_IMM; kvt.rdma never posts one: pyverbs wants
   a scatter entry per request, so the receiver ends such frames itself), and the requests are
   cut into windows of at most ``sq_depth // 2`` whose last request is signaled: a poster that
   keeps two windows in flight never has more than ``sq_depth`` requests on the send queue.

Every step is a numpy expression over all records at once (no Python loop per record).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from ipcblock import IPCBLOCK_DTYPE

from kvt.access import first_out_of_bounds
from kvt.errors import InvalidBlocksError

_U64 = np.uint64
MAX_IMM = 0xFFFF_FFFF
MAX_SGE_BYTES = 1 << 31  # a scatter entry's length is a u32 in verbs; 2 GiB is what ports offer


class RemoteRegionError(InvalidBlocksError):
    """A record names memory the peer did not advertise as writable (nothing was posted)."""


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """A writable region the peer advertised: ``length`` bytes at ``address`` under ``rkey``."""

    address: int
    length: int
    rkey: int

    def __post_init__(self) -> None:
        if self.address < 0 or self.length < 0 or self.address + self.length > (1 << 64) - 1:
            raise ValueError(f"remote region {self} does not fit a 64-bit address space")
        if not 0 <= self.rkey <= 0xFFFF_FFFF:
            raise ValueError(f"rkey {self.rkey} is not a u32")


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """What one work request and the send queue may hold (from the device and its QP)."""

    max_sge: int  # scatter/gather entries per RDMA WRITE
    max_msg_size: int  # bytes per work request (the port's max_msg_sz)
    sq_depth: int  # work requests the send queue holds at once

    def __post_init__(self) -> None:
        if self.max_sge < 1 or self.sq_depth < 1:
            raise ValueError(f"{self}: max_sge and sq_depth must be at least 1")
        if not 1 <= self.max_msg_size <= MAX_SGE_BYTES:
            raise ValueError(f"{self}: max_msg_size must be 1..{MAX_SGE_BYTES}")

    @property
    def window(self) -> int:
        """Work requests per signaled window (two windows fit the send queue)."""
        return max(1, self.sq_depth // 2)


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Work requests of one frame. Request ``i`` gathers scatter entries
    ``wr_sge[i]:wr_sge[i + 1]`` (local address, length, lkey) into the remote range
    ``[wr_remote_addr[i], +wr_length[i])`` under ``wr_rkey[i]``; the last one carries ``imm``."""

    sge_addr: np.ndarray  # uint64
    sge_length: np.ndarray  # uint32
    sge_lkey: np.ndarray  # uint32
    wr_sge: np.ndarray  # int64, n_wr + 1 offsets into the sge arrays
    wr_remote_addr: np.ndarray  # uint64
    wr_rkey: np.ndarray  # uint32
    wr_length: np.ndarray  # uint64
    signaled: np.ndarray  # bool: a completion is asked for (window ends, and the last request)
    imm: int
    nbytes: int

    @property
    def n_wr(self) -> int:
        return len(self.wr_length)

    def windows(self) -> list[tuple[int, int]]:
        """``(start, end)`` ranges of requests, each ending with a signaled one."""
        ends = np.flatnonzero(self.signaled) + 1
        starts = np.r_[0, ends[:-1]]
        return list(zip(starts.tolist(), ends.tolist(), strict=True))

    def sges(self, i: int) -> list[tuple[int, int, int]]:
        """Request ``i``'s scatter entries as (address, length, lkey)."""
        lo, hi = int(self.wr_sge[i]), int(self.wr_sge[i + 1])
        return list(
            zip(
                self.sge_addr[lo:hi].tolist(),
                self.sge_length[lo:hi].tolist(),
                self.sge_lkey[lo:hi].tolist(),
                strict=True,
            )
        )


def check_remote(blocks: np.ndarray, remote: Mapping[int, RemoteRegion]) -> tuple[np.ndarray, ...]:
    """Remote address and rkey of each record; raises :class:`RemoteRegionError` naming the first
    record outside what the peer advertised (offset + length checked without u64 wrap-around)."""
    if not isinstance(blocks, np.ndarray) or blocks.dtype != IPCBLOCK_DTYPE:
        raise InvalidBlocksError("blocks must be a numpy array of ipcblock.IPCBLOCK_DTYPE")
    region_ids = blocks["dst_region"]
    ids = np.unique(region_ids)
    for rid in ids.tolist():
        if rid not in remote:
            i = int(np.flatnonzero(region_ids == rid)[0])
            raise RemoteRegionError(f"record {i}: the peer advertised no writable region {rid}")
    table = [remote[rid] for rid in ids.tolist()]
    index = np.searchsorted(ids, region_ids)
    base = np.array([r.address for r in table], dtype=_U64)[index]
    size = np.array([r.length for r in table], dtype=_U64)[index]
    rkey = np.array([r.rkey for r in table], dtype=np.uint32)[index]
    offset, length = blocks["dst_offset"].astype(_U64), blocks["length"].astype(_U64)
    i = first_out_of_bounds(offset, length, size)
    if i is not None:
        raise RemoteRegionError(
            f"record {i}: [{int(offset[i])}, +{int(length[i])}) is outside the peer's region "
            f"{int(region_ids[i])} of {int(size[i])} bytes"
        )
    return base + offset, rkey


def plan_writes(
    blocks: np.ndarray,
    local_addresses: np.ndarray,
    local_lkeys: np.ndarray,
    *,
    remote: Mapping[int, RemoteRegion],
    limits: DeviceLimits,
    imm: int,
) -> WritePlan:
    """The work requests that write ``blocks`` (one frame) into the peer; see the module docstring.

    ``local_addresses[i]`` / ``local_lkeys[i]``: where record i's source bytes are and the lkey of
    the memory region holding them. Raises :class:`RemoteRegionError` before planning anything if
    a record falls outside the peer's advertised regions.
    """
    if not 0 <= imm <= MAX_IMM:
        raise ValueError(f"immediate data {imm} is not a u32")
    remote_addr, rkey = check_remote(blocks, remote)
    length = blocks["length"].astype(_U64)
    keep = length > 0
    local = np.asarray(local_addresses, dtype=_U64)[keep]
    lkey = np.asarray(local_lkeys, dtype=np.uint32)[keep]
    remote_addr, rkey, length = remote_addr[keep], rkey[keep], length[keep]
    if length.size == 0:
        return _empty_plan(imm)

    # 2. spans: records contiguous on both sides, in the same two memory regions
    follows = (
        (local[1:] == local[:-1] + length[:-1])
        & (lkey[1:] == lkey[:-1])
        & (remote_addr[1:] == remote_addr[:-1] + length[:-1])
        & (rkey[1:] == rkey[:-1])
    )
    first = np.flatnonzero(np.r_[True, ~follows])
    span_local, span_lkey = local[first], lkey[first]
    span_remote, span_rkey = remote_addr[first], rkey[first]
    span_len = np.add.reduceat(length, first)

    # 3. runs: spans whose remote ranges follow each other; s, e: a span's bytes within its run
    joins = span_remote[1:] == span_remote[:-1] + span_len[:-1]
    joins &= span_rkey[1:] == span_rkey[:-1]
    run_starts = np.r_[True, ~joins]
    run_of_span = np.cumsum(run_starts) - 1
    end_in_all = np.cumsum(span_len, dtype=_U64)
    start_in_all = end_in_all - span_len
    s = start_in_all - start_in_all[np.flatnonzero(run_starts)][run_of_span]
    e = s + span_len

    # 4. pieces: spans cut at every multiple of max_msg_size of their run's remote range
    msg = _U64(limits.max_msg_size)
    first_cut, last_cut = s // msg, (e - _U64(1)) // msg
    n_pieces = (last_cut - first_cut + _U64(1)).astype(np.int64)
    span_of = np.repeat(np.arange(len(span_len)), n_pieces)
    piece_in_span = np.arange(len(span_of)) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    cut = first_cut[span_of] + piece_in_span.astype(_U64)
    p_start = np.maximum(s[span_of], cut * msg)
    p_end = np.minimum(e[span_of], (cut + _U64(1)) * msg)
    skip = p_start - s[span_of]
    sge_addr = span_local[span_of] + skip
    sge_remote = span_remote[span_of] + skip
    sge_length = p_end - p_start

    # ... grouped max_sge at a time within one (run, cut): one work request per group
    run_of = run_of_span[span_of]
    new_group = np.r_[True, (run_of[1:] != run_of[:-1]) | (cut[1:] != cut[:-1])]
    group_start = np.flatnonzero(new_group)
    index_in_group = np.arange(len(cut)) - group_start[np.cumsum(new_group) - 1]
    wr_first = np.flatnonzero(index_in_group % limits.max_sge == 0)
    n_wr = len(wr_first)
    signaled = np.zeros(n_wr, dtype=bool)
    signaled[limits.window - 1 :: limits.window] = True
    signaled[-1] = True
    return WritePlan(
        sge_addr=sge_addr,
        sge_length=sge_length.astype(np.uint32),
        sge_lkey=span_lkey[span_of],
        wr_sge=np.r_[wr_first, len(cut)].astype(np.int64),
        wr_remote_addr=sge_remote[wr_first],
        wr_rkey=span_rkey[span_of][wr_first],
        wr_length=np.add.reduceat(sge_length, wr_first).astype(_U64),
        signaled=signaled,
        imm=imm,
        nbytes=int(length.sum(dtype=_U64)),
    )


def _empty_plan(imm: int) -> WritePlan:
    """No bytes to move: one zero-length WRITE_WITH_IMM still tells the receiver the frame ended."""
    return WritePlan(
        sge_addr=np.zeros(0, _U64),
        sge_length=np.zeros(0, np.uint32),
        sge_lkey=np.zeros(0, np.uint32),
        wr_sge=np.zeros(2, np.int64),
        wr_remote_addr=np.zeros(1, _U64),
        wr_rkey=np.zeros(1, np.uint32),
        wr_length=np.zeros(1, _U64),
        signaled=np.ones(1, dtype=bool),
        imm=imm,
        nbytes=0,
    )


__all__ = [
    "DeviceLimits",
    "RemoteRegion",
    "RemoteRegionError",
    "WritePlan",
    "check_remote",
    "plan_writes",
]
