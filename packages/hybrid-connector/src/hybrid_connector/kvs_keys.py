"""KVS keys: the same prefix gives the same key in every process, instance and restart.

A stored block is named by a hash chain, as vLLM's prefix cache names its blocks, but seeded
only by what decides the block's bytes, never by a per-process seed (vLLM's own block hashes
start from a random value unless ``PYTHONHASHSEED`` is set: compared across processes they
never match)::

    root    = H("kvs1", namespace, model identity, tp_size, every group's layout, dtype, salt)
    chain_0 = H(root,      tokens of block 0, cache salt, LoRA name)
    chain_j = H(chain_j-1, tokens of block j, LoRA name)                    j > 0
    key     = chain_j | group index | rank          (the object of one group on one TP rank)

``H`` is BLAKE2b-128. The layout part names everything that changes where a byte lies: the
family, block size, dtype and cache dtype, the CPU attention ISA (AMX tiles K and V), the KV
heads and their split over TP ranks; two deployments that differ in any of these never share a
key. A group whose bytes are the same on every TP rank (MLA's latent) is keyed with rank
``SHARED_RANK``: one object serves every rank.

A "state" group (linear attention: GDN, Mamba) has an object for block ``j`` only where the
recurrent state after the block's last token was kept (vLLM's "align" mode keeps it at some
block boundaries only): its objects are sparse, every other group's are dense. A prefix of
``n`` blocks is loadable when every dense object of blocks ``0..n-1`` and every state object of
block ``n-1`` is stored (``token_keys`` / ``state_keys``).

Pure: no I/O, no vLLM.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from hybrid_connector.layout import KvGroup

CHAIN_BYTES = 16
SHARED_RANK = 0xFFFF
_KEY_TAIL = struct.Struct("<BH")  # group index, rank
KEY_BYTES = CHAIN_BYTES + _KEY_TAIL.size


def _h(*parts: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=CHAIN_BYTES)
    for part in parts:
        # Length-prefixed: (b"ab", b"c") and (b"a", b"bc") must not hash alike.
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.digest()


@dataclass(frozen=True)
class ModelIdentity:
    """What decides the KV bytes of a token besides its prefix: the model and how it runs."""

    model: str  # vLLM's model (path or name)
    revision: str = ""
    dtype: str = ""
    cache_dtype: str = ""
    tp_size: int = 1
    namespace: str = ""  # the operator's: e.g. a deployment name, or a weights version


def family_rank_shared(family: str) -> bool:
    """True if every TP rank holds the same bytes for a group of ``family`` (MLA's latent is
    not split by heads); attention is per rank, even when its heads are not described."""
    return family == "mla"


def rank_shared(group: KvGroup) -> bool:
    return family_rank_shared(group.family)


def root_key(identity: ModelIdentity, groups: Sequence[KvGroup]) -> bytes:
    """The chain's seed: the model's identity and every group's layout."""
    layout = [
        (g.family, g.block_size, g.dtype, g.total_heads, len(g.layer_names), g.attn_isa)
        for g in groups
    ]
    return _h(b"kvs1", msgspec.msgpack.encode((identity.__dict__, layout)))


def chain(
    root: bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    start: Sequence[bytes] = (),
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[bytes]:
    """Chain hashes of every full block of ``token_ids``; ``start``: hashes already known for
    its first blocks (a running request's, extended as it decodes)."""
    tokens = np.asarray(token_ids, dtype="<i4")
    out = list(start)
    lora = (lora_name or "").encode()
    parent = out[-1] if out else root
    for j in range(len(out), len(tokens) // block_size):
        block = tokens[j * block_size : (j + 1) * block_size].tobytes()
        salt = (cache_salt or "").encode() if j == 0 else b""
        parent = _h(parent, block, salt, lora)
        out.append(parent)
    return out


def object_key(chain_hash: bytes, group_index: int, rank: int) -> bytes:
    """The store key of one block's bytes of one group on one TP rank."""
    return chain_hash + _KEY_TAIL.pack(group_index, rank)


def chain_of(key: bytes) -> bytes:
    """The block's chain hash inside an object key (KV events name blocks by it)."""
    return key[:CHAIN_BYTES]


def is_state(group: KvGroup) -> bool:
    """A group of recurrent states (one per kept block boundary), not of per-token KV."""
    return group.family == "state"


def key_rank(group: KvGroup, tp_rank: int) -> int:
    return SHARED_RANK if rank_shared(group) else tp_rank


def lookup_keys(
    chains: Sequence[bytes], groups: Sequence[KvGroup], tp_size: int
) -> tuple[list[bytes], int]:
    """Every object a block needs, block by block (all groups, all ranks): a prefix of this
    list that the store holds, cut at whole blocks, is a prefix of loadable blocks. Returns the
    keys and how many there are per block."""
    per_block = [
        (g, r)
        for g, group in enumerate(groups)
        for r in ([SHARED_RANK] if rank_shared(group) else range(tp_size))
    ]
    keys = [object_key(c, g, r) for c in chains for g, r in per_block]
    return keys, len(per_block)


def block_objects(groups: Sequence[KvGroup], tp_size: int) -> list[tuple[int, int]]:
    """(group index, key rank) of every object a block may have, in ``lookup_keys`` order."""
    return [
        (g, r)
        for g, group in enumerate(groups)
        for r in ([SHARED_RANK] if rank_shared(group) else range(tp_size))
    ]


def token_keys(
    chains: Sequence[bytes], groups: Sequence[KvGroup], tp_size: int
) -> tuple[list[bytes], int]:
    """The dense objects (every group but the state ones), block by block, and how many per
    block: a prefix the store holds, cut at whole blocks, is a prefix of token KV."""
    token = [(g, r) for g, r in block_objects(groups, tp_size) if not is_state(groups[g])]
    return [object_key(c, g, r) for c in chains for g, r in token], len(token)


def state_keys(chain_hash: bytes, groups: Sequence[KvGroup], tp_size: int) -> list[bytes]:
    """The state objects of one block (every state group, every rank): all of them or none
    make the state at the block's end."""
    return [
        object_key(chain_hash, g, r)
        for g, r in block_objects(groups, tp_size)
        if is_state(groups[g])
    ]
