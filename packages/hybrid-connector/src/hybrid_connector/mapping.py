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


def check_compatible(local: LayoutSpec, remote: LayoutSpec) -> None:
    """Raise PeerError unless blocks can be copied between the two groups."""
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
    src_block_ids: Sequence[int] | np.ndarray,
    dst_block_ids: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """IpcBlocks copying ``src_block_ids[i]`` of ``src`` into ``dst_block_ids[i]`` of ``dst``."""
    return parse_blocks(
        layout_from_spec(src),
        layout_from_spec(dst),
        np.asarray(src_block_ids, dtype=np.int64),
        np.asarray(dst_block_ids, dtype=np.int64),
        src_region=np.asarray(src.region_ids, dtype=np.int64),
        dst_region=np.asarray(dst.region_ids, dtype=np.int64),
    )
