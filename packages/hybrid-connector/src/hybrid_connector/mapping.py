"""Which bytes of P's cache go to which bytes of D's: one KV-cache group at a time.

The one place that knows how two ranks' caches relate (same or different block size, TP size,
head split); it returns IpcBlocks and knows nothing of the network. ``check_compatible`` runs when
a pull arrives, before any byte moves; ``plan_copy`` when the send starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from ipcblock import parse_blocks

from hybrid_connector.errors import PeerError
from hybrid_connector.layout import layout_from_spec
from hybrid_connector.protocol import LayoutSpec

STATE = "state"

BlockIds = Sequence[int] | np.ndarray


def check_compatible(local: LayoutSpec, remote: LayoutSpec) -> None:
    """Raise PeerError unless blocks can be copied between the two groups."""
    if local.group != remote.group:
        raise PeerError(f"KV-cache group kind differs: local {local.group}, peer {remote.group}")
    if local.block_size != remote.block_size:
        raise PeerError(f"block_size differs: local {local.block_size}, peer {remote.block_size}")
    if local.layer_names != remote.layer_names:
        raise PeerError(
            f"layers differ: local {len(local.layer_names)} ({local.layer_names[:2]}...), "
            f"peer {len(remote.layer_names)} ({remote.layer_names[:2]}...)"
        )
    if len(remote.region_ids) != len(remote.layer_offsets):
        raise PeerError("peer layout: one region id per layer expected")
    sig_local = [(s.name, s.nbytes) for s in local.segments]
    sig_remote = [(s.name, s.nbytes) for s in remote.segments]
    if sig_local != sig_remote:
        raise PeerError(f"block geometry differs: local {sig_local}, peer {sig_remote}")


def plan_copy(
    src: LayoutSpec,
    dst: LayoutSpec,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    first_block: int = 0,
    num_tokens: int | None = None,
) -> np.ndarray:
    """IpcBlocks that write the request's KV of one group from P (``src``) into D (``dst``).

    ``src_block_ids``: every block P holds for the request in this group, from token 0, in P's
    block size. ``dst_block_ids``: D's new blocks, after the ``first_block`` ones D already holds
    (its prefix-cache hit), in D's block size. ``num_tokens``: prompt tokens D needs in total
    (default: D's blocks full). For a state group (``group == "state"``) a block is a state slot
    and the slots are copied 1:1, with no token arithmetic. PeerError when the counts do not fit.
    """
    src_ids = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    if dst_ids.size == 0:
        raise PeerError("transfer_kv names no destination block")
    if STATE in (src.group, dst.group):
        if src_ids.size != dst_ids.size:
            raise PeerError(
                f"state group: P holds {src_ids.size} state slots, D gave {dst_ids.size}"
            )
        return _parse(src, dst, src_ids, dst_ids)
    if first_block < 0:
        raise PeerError(f"first_block must not be negative, got {first_block}")
    block_size = dst.block_size
    if num_tokens is None:
        num_tokens = (first_block + dst_ids.size) * block_size
    needed = -(-num_tokens // block_size)
    if first_block + dst_ids.size != needed:
        raise PeerError(
            f"D sent {dst_ids.size} blocks after {first_block} cached ones for {num_tokens} "
            f"tokens ({needed} blocks of {block_size})"
        )
    if src_ids.size < needed:
        raise PeerError(
            f"D needs {num_tokens} tokens ({needed} blocks of {block_size}) but P holds "
            f"{src_ids.size} blocks"
        )
    return _parse(src, dst, src_ids[first_block:needed], dst_ids)


def _parse(src: LayoutSpec, dst: LayoutSpec, src_ids: np.ndarray, dst_ids: np.ndarray):
    try:
        return parse_blocks(
            layout_from_spec(src),
            layout_from_spec(dst),
            src_ids,
            dst_ids,
            src_region=np.asarray(src.region_ids, dtype=np.int64),
            dst_region=np.asarray(dst.region_ids, dtype=np.int64),
        )
    except PeerError:
        raise
    except ValueError as err:  # ipcblock's typed errors: ids out of range, geometry mismatch
        raise PeerError(f"cannot map P's blocks onto D's: {err}") from err
