"""Which prompt prefixes each instance holds, learned from its own KV-cache events. Pure.

Fed the decoded batches of every instance (``kv_events.EventBatch``, one stream per instance),
it answers, for a prompt's token ids, how many leading tokens each instance has cached locally
(its GPU/CPU prefix cache) and how many its shared store (medium ``"KVS"``) holds.

**Own chain keys.** vLLM names a block by a hash seeded per process, useless across instances.
Each stored block gets a key of our own, the same on every instance for the same tokens::

    key(first block) = H(root(lora) | tokens of the block [| its extra keys])
    key(block k)     = H(key(block k-1) | tokens of block k [| its extra keys])

(H: blake2b-128; tokens as little-endian int64). A view keeps ``engine hash -> own key`` to
place a stored block under its parent and to apply removals; a query walks the prompt's keys
block by block and stops at the first one not held. A block whose event carries extra keys
(a cache salt, multimodal input) gets a key no plain prompt produces, so it never matches.

**State per instance**::

                    first batch (any seq)             seq == last + 1: apply
        (no view) ------------------------> LIVE <--------------------------+
                                            |  |                           |
          seq > last + 1 (a gap: events     |  |  seq <= last (a new       |
          missed, removals among them)      |  |  publisher: a restart)    |
                                            v  v                           |
                            forget the local view (and, on a gap, the      |
                            store's view), then apply this batch ----------+

    forget(instance): the same, asked from outside (its breaker opened, its stream
    disconnected, a message did not decode); the next batch starts a fresh baseline.

Forgetting keeps the index a subset of what is cached: what it missed can only be a block it
does not know (a hit it did not predict), never a block it wrongly believes held (zmq delivers
one publisher's messages in order or drops them, and a drop shows as a gap).

**Views.** Per instance, per KV-cache group (``group_idx``; block size learned from the
events), one local view (every medium but ``"KVS"``). Per store, one store view fed by the
``"KVS"`` events of every instance attached to it (our connector names stored blocks by their
content chain hash, the same on every instance). An instance with no store named gets a store
of its own. For a model with several KV-cache groups a prefix counts as cached when one group
holds it (an approximation: vLLM needs every group's hit).

**Bounded memory.** Each view keeps at most ``max_blocks`` blocks, the oldest stored first out
(a store event of a block already held makes it the newest); a block dropped here is only a
missed prediction. A partial block (vLLM's partial prefix entries, fewer tokens than the
group's block size) is kept for removals but never matched.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pd_serving.kv_events import (
    MEDIUM_STORE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

DEFAULT_MAX_BLOCKS = 1 << 18
_ROOT = b"pd-serving prefix root\0"


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def root_key(lora: str | None) -> bytes:
    return _h(_ROOT, (lora or "").encode("utf-8", "surrogatepass"))


def chain_keys(
    tokens: Sequence[int], block_size: int, lora: str | None = None, limit: int | None = None
) -> list[bytes]:
    """Own keys of the full blocks of ``tokens`` (at most ``limit``)."""
    parent = root_key(lora)
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    out = []
    for j in range(count):
        parent = _h(parent, _tokens_bytes(tokens[j * block_size : (j + 1) * block_size]))
        out.append(parent)
    return out


class _PromptKeys:
    """A prompt's chain keys, computed only as far as some view's walk goes (a miss at the
    first block costs one hash, not one per block)."""

    def __init__(self, tokens: Sequence[int], block_size: int, lora: str | None) -> None:
        self._tokens, self._size = tokens, block_size
        self._count = len(tokens) // block_size
        self._keys: list[bytes] = []
        self._parent = root_key(lora)

    def __iter__(self) -> Iterator[bytes]:
        j = 0
        while j < self._count:
            if j == len(self._keys):
                chunk = self._tokens[j * self._size : (j + 1) * self._size]
                self._parent = _h(self._parent, _tokens_bytes(chunk))
                self._keys.append(self._parent)
            yield self._keys[j]
            j += 1


@dataclass(frozen=True)
class CachedPrefix:
    """Leading prompt tokens an instance has: in its own cache, and in its store."""

    local_tokens: int = 0
    store_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Tokens it need not compute (a store hit is loaded)."""
        return max(self.local_tokens, self.store_tokens)


@dataclass(frozen=True)
class Applied:
    """What one batch did to an instance's views (for metrics and logs)."""

    stored: int = 0
    removed: int = 0
    cleared: bool = False
    unplaced: int = 0  # stored blocks whose parent the view does not know, or odd token counts
    gap: bool = False  # events were missed: the views were forgotten first
    restart: bool = False  # a new publisher: the local view was forgotten first


_EntryKey = tuple[str | None, int | None, BlockHash]  # (medium, group, engine hash)


@dataclass
class _View:
    """Blocks one owner (an instance's cache, or a store) holds."""

    max_blocks: int
    # (medium, group, engine hash) -> (group, own key), oldest stored first
    entries: OrderedDict[_EntryKey, tuple[int | None, bytes]] = field(default_factory=OrderedDict)
    held: dict[int | None, Counter[bytes]] = field(default_factory=dict)
    block_size: dict[int | None, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.held.clear()

    def _drop(self, entry: _EntryKey) -> bool:
        found = self.entries.pop(entry, None)
        if found is None:
            return False
        group, key = found
        counts = self.held[group]
        counts[key] -= 1
        if counts[key] <= 0:
            del counts[key]
        return True

    def store(self, event: BlockStored) -> tuple[int, int]:
        """(blocks placed, blocks not placed)."""
        hashes, size, group = event.block_hashes, event.block_size, event.group
        if not hashes or len(event.token_ids) != size * len(hashes):
            # vLLM leaves masked-out (sliding window) blocks out of the hashes but not of the
            # tokens: which tokens a hash covers is then unknown.
            return 0, len(hashes)
        if event.parent is None:
            parent = root_key(event.lora)
        else:
            found = self.entries.get((event.medium, group, event.parent))
            if found is None:
                return 0, len(hashes)
            parent = found[1]
        if size > self.block_size.get(group, 0):
            self.block_size[group] = size  # partial entries are smaller than the block size
        counts = self.held.setdefault(group, Counter())
        for j, engine_hash in enumerate(hashes):
            parts = [parent, _tokens_bytes(event.token_ids[j * size : (j + 1) * size])]
            extra = event.extra_keys[j] if event.extra_keys is not None else None
            if extra is not None:
                parts.append(b"\0extra" + msgspec.msgpack.encode(extra))
            parent = _h(*parts)
            entry = (event.medium, group, engine_hash)
            old = self.entries.get(entry)
            if old is not None and old[1] == parent:
                self.entries.move_to_end(entry)
                continue
            if old is not None:
                self._drop(entry)
            self.entries[entry] = (group, parent)
            counts[parent] += 1
        while len(self.entries) > self.max_blocks:
            self._drop(next(iter(self.entries)))
        return len(hashes), 0

    def remove(self, event: BlockRemoved) -> int:
        return sum(self._drop((event.medium, event.group, h)) for h in event.block_hashes)

    def match(self, keys_for: Any) -> int:
        """Leading tokens held, over the groups (``keys_for(block_size)``: the prompt's keys)."""
        best = 0
        for group, counts in self.held.items():
            size = self.block_size.get(group)
            if not counts or not size:
                continue
            held = 0
            for key in keys_for(size):
                if key not in counts:
                    break
                held += 1
            best = max(best, held * size)
        return best


@dataclass
class _Instance:
    store: str
    local: _View
    last_seq: int | None = None


class PrefixIndex:
    """The prefix caches of a set of instances (see the module docstring). Not thread-safe:
    fed and asked on one thread (the proxy's event loop)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("a view keeps at least one block")
        self.max_blocks = max_blocks
        self._instances: dict[str, _Instance] = {}
        self._stores: dict[str, _View] = {}

    # -- membership ---------------------------------------------------------------------------
    def attach(self, instance: str, store: str | None = None) -> None:
        """Track ``instance``; ``store``: the shared store it loads from (None: none shared)."""
        store_name = store if store is not None else f"\0own:{instance}"
        self._instances[instance] = _Instance(store_name, _View(self.max_blocks))
        self._stores.setdefault(store_name, _View(self.max_blocks))

    def _get(self, instance: str) -> _Instance:
        found = self._instances.get(instance)
        if found is None:
            self.attach(instance)
            found = self._instances[instance]
        return found

    # -- events -------------------------------------------------------------------------------
    def apply(self, instance: str, batch: EventBatch) -> Applied:
        state = self._get(instance)
        gap = restart = False
        if state.last_seq is not None:
            if batch.seq > state.last_seq + 1:
                gap = True
                state.local.clear()
                self._stores[state.store].clear()
            elif batch.seq <= state.last_seq:
                restart = True
                state.local.clear()
        state.last_seq = batch.seq
        stored = removed = unplaced = 0
        cleared = False
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                state.local.clear()
                cleared = True
                continue
            view = self._stores[state.store] if event.medium == MEDIUM_STORE else state.local
            if isinstance(event, BlockStored):
                placed, lost = view.store(event)
                stored, unplaced = stored + placed, unplaced + lost
            elif isinstance(event, BlockRemoved):
                removed += view.remove(event)
        return Applied(stored, removed, cleared, unplaced, gap, restart)

    def forget(self, instance: str) -> None:
        """Drop what ``instance``'s cache is believed to hold; its next batch is a new
        baseline. Its store's view stays (the store outlives an instance)."""
        state = self._instances.get(instance)
        if state is not None:
            state.local.clear()
            state.last_seq = None

    # -- queries ------------------------------------------------------------------------------
    def holds_any(self, instances: Iterable[str] | None = None) -> bool:
        """Whether any of ``instances`` (default: all) has a block in its cache or store."""
        names = self._instances if instances is None else instances
        for name in names:
            state = self._instances.get(name)
            if state is not None and (len(state.local) or len(self._stores[state.store])):
                return True
        return False

    def lookup(
        self, tokens: Sequence[int], instances: Iterable[str], lora: str | None = None
    ) -> dict[str, CachedPrefix]:
        """Per instance, the leading tokens of ``tokens`` cached locally and in its store."""
        keys: dict[int, _PromptKeys] = {}

        def keys_for(block_size: int) -> Iterator[bytes]:
            found = keys.get(block_size)
            if found is None:
                found = keys[block_size] = _PromptKeys(tokens, block_size, lora)
            return iter(found)

        out: dict[str, CachedPrefix] = {}
        store_match: dict[str, int] = {}
        for name in instances:
            state = self._instances.get(name)
            if state is None:
                out[name] = CachedPrefix()
                continue
            if state.store not in store_match:
                store_match[state.store] = self._stores[state.store].match(keys_for)
            out[name] = CachedPrefix(state.local.match(keys_for), store_match[state.store])
        return out

    def describe(self, instance: str) -> dict[str, Any]:
        state = self._instances.get(instance)
        if state is None:
            return {"blocks": 0, "store_blocks": 0, "last_seq": None}
        return {
            "blocks": len(state.local),
            "store_blocks": len(self._stores[state.store]),
            "last_seq": state.last_seq,
        }
