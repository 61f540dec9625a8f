"""Automatic prefix caching: the KV of recent sequences, in blocks, for requests that
start with the same tokens.

A block holds what the attention cache keeps for `block_tokens` consecutive positions of
every layer (GQA: keys and values; as `KVCache.read` returns them). Blocks form a trie: a block is
keyed by (its parent block's id, its own tokens), so a block stands for all the tokens
from the start of the sequence to its end — the scheme of vLLM's automatic prefix
caching (a block per hash of every token up to its end), with the tokens themselves as
the key so two different prefixes can never share a block. Only whole blocks are kept.

Reuse is exact: a position's keys and values depend only on the tokens up to it (the
forward pass's reduction order is fixed by shapes, and a prompt's chunking does not
change them), so a sequence that starts from cached blocks holds the very values its own
prefill would have computed, and its tokens and logits are those without reuse.

The cache is bounded in bytes and evicts the least recently used block first; a lookup
or a store touches a chain from its end back to its start, so a parent is always more
recent than its children and leaves go first (an evicted block takes its subtree with
it: nothing could reach it any more). Not thread-safe: the engine thread owns it.

Isolation: a lookup's `salt` (None, or any hashable: a request's cache_salt, a client's
identity) is the parent key of its first block, as vLLM mixes cache_salt into the hash of
the first block; so a chain is only found by lookups with the same salt, and requests of
different salts share no block (nor learn, from cached_tokens or timing, what the other
salt's prompts began with). None is the shared root of unsalted requests.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from daemon.engine.prefix_store import SavedBlock
from ext.models.kvcache import KVCache

BLOCK_TOKENS = 16               # positions per block (vLLM's default block size)


def block_bytes(kv_bytes_per_token: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Bytes of one block, from the bytes one token adds to a sequence's KV cache."""
    return kv_bytes_per_token * block_tokens


@dataclass
class _Block:
    id: int
    key: tuple                  # (parent id, or the salted root, tokens)
    data: list[np.ndarray]      # KVCache.read of the block's positions
    children: set = field(default_factory=set)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start: queries (lookups, one per admitted request), hits (lookups
    that reused at least one block), tokens_queried (prompt tokens looked up), tokens
    reused, blocks stored and evicted; gauges: blocks and bytes held, capacity."""

    queries: int = 0
    hits: int = 0
    tokens_queried: int = 0
    tokens_reused: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


class PrefixCache:
    """Blocks of KV for reuse by sequences that share a prefix.

    kv_bytes_per_token: what one token adds to a sequence's KV cache (the attention
    kind's `kv_bytes_per_token`). capacity_bytes: at most this many bytes of blocks are
    kept (0: the cache keeps nothing and every lookup misses). block_tokens: positions
    per block, >= 1. Raises ValueError for negative sizes.
    """

    def __init__(self, kv_bytes_per_token: int, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if capacity_bytes < 0 or block_tokens < 1:
            raise ValueError(f"capacity_bytes must be >= 0 and block_tokens >= 1, got "
                             f"{capacity_bytes} and {block_tokens}")
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes(kv_bytes_per_token, block_tokens)
        self.capacity_bytes = capacity_bytes
        self._blocks: collections.OrderedDict[tuple, _Block] = collections.OrderedDict()
        self._by_id: dict[int, _Block] = {}
        self._ids = itertools.count(1)
        self._counts = collections.Counter()

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    @staticmethod
    def _root(salt: Hashable | None) -> Hashable:
        """The parent key of a chain's first block: 0 unsalted (block ids start at 1),
        else a tuple, which no block id equals."""
        return 0 if salt is None else ("salt", salt)

    def _chain(self, tokens: Seq[int], n_blocks: int, salt: Hashable | None) -> list[_Block]:
        """The cached blocks that start `tokens` under `salt`, at most n_blocks of them."""
        out, parent, B = [], self._root(salt), self.block_tokens
        for b in range(n_blocks):
            block = self._blocks.get((parent, tuple(tokens[b * B:(b + 1) * B])))
            if block is None:
                break
            out.append(block)
            parent = block.id
        return out

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):          # the start of the chain ends most recent
            self._blocks.move_to_end(block.key)

    def load(self, tokens: Seq[int], kv: KVCache, salt: Hashable | None = None) -> int:
        """Fill `kv` (empty) with the cached blocks that start `tokens`, stored under the
        same `salt`, and return how many positions it now holds: a multiple of
        block_tokens, below len(tokens) (the last token is always left to compute, for its
        logits). Counts one query."""
        if kv.length:
            raise ValueError("load fills an empty KV cache")
        chain = self._chain(tokens, (len(tokens) - 1) // self.block_tokens, salt)
        self._counts["queries"] += 1
        self._counts["tokens_queried"] += len(tokens)
        if not chain:
            return 0
        self._touch(chain)
        B = self.block_tokens
        kv.reserve(len(chain) * B)
        for b, block in enumerate(chain):
            kv.write(b * B, block.data)
        self._counts["hits"] += 1
        self._counts["tokens_reused"] += len(chain) * B
        return len(chain) * B

    def store(self, tokens: Seq[int], kv: KVCache, salt: Hashable | None = None) -> int:
        """Keep the whole blocks of `kv` (which holds the KV of `tokens[:kv.length]`)
        that are not cached yet under `salt`, evicting least recently used blocks to stay
        within capacity_bytes. Returns the blocks added."""
        B = self.block_tokens
        n_blocks = min(len(tokens), kv.length) // B
        n_blocks = min(n_blocks, self.capacity_blocks)
        if n_blocks == 0:
            return 0
        chain = self._chain(tokens, n_blocks, salt)
        added = 0
        for b in range(len(chain), n_blocks):
            parent = chain[-1] if chain else None
            key = (parent.id if parent else self._root(salt), tuple(tokens[b * B:(b + 1) * B]))
            block = _Block(next(self._ids), key, kv.read(b * B, (b + 1) * B))
            self._blocks[key] = block
            self._by_id[block.id] = block
            if parent is not None:
                parent.children.add(block.id)
            chain.append(block)
            added += 1
        self._touch(chain)
        self._counts["blocks_stored"] += added
        while len(self._blocks) > self.capacity_blocks:
            self._evict(next(iter(self._blocks.values())))
        return added

    def _evict(self, block: _Block) -> None:
        stack = [block]
        while stack:
            b = stack.pop()
            stack.extend(self._by_id[c] for c in b.children)
            del self._blocks[b.key]
            del self._by_id[b.id]
            self._counts["blocks_evicted"] += 1
        parent = self._by_id.get(block.key[0])
        if parent is not None:
            parent.children.discard(block.id)

    def resize(self, capacity_bytes: int) -> None:
        """A new byte budget (SIGHUP); blocks over it are evicted at once."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        while len(self._blocks) > self.capacity_blocks:
            self._evict(next(iter(self._blocks.values())))

    @property
    def version(self) -> int:
        """Changes whenever blocks are stored or evicted (a save can be skipped when it
        has not)."""
        return self._counts["blocks_stored"] + self._counts["blocks_evicted"]

    def snapshot(self) -> list[SavedBlock]:
        """Every block, the most recent first (so a parent comes before its children):
        its parent's index in the list (-1 for a chain's first block), its chain's salt,
        tokens and arrays. The arrays are the cache's own (never written after a store):
        the list may be saved from another thread while the cache goes on."""
        out: list[SavedBlock] = []
        index: dict[int, int] = {}
        for block in reversed(self._blocks.values()):
            parent, tokens = block.key
            if isinstance(parent, int) and parent in self._by_id:
                entry = SavedBlock(index[parent], None, tokens, block.data)
            else:
                salt = None if parent == 0 else parent[1]
                entry = SavedBlock(-1, salt, tokens, block.data)
            index[block.id] = len(out)
            out.append(entry)
        return out

    def restore(self, saved: list[SavedBlock]) -> int:
        """Fill an empty cache with saved blocks (`snapshot`'s order: most recent first,
        parents first), as many as capacity_blocks holds; returns how many. Raises
        ValueError when the cache is not empty, a block's tokens are not block_tokens or a
        block repeats another (the cache is then to be cleared)."""
        if self._blocks:
            raise ValueError("restore fills an empty prefix cache")
        built: list[_Block] = []
        for entry in saved[:self.capacity_blocks]:
            if len(entry.tokens) != self.block_tokens:
                raise ValueError(f"a saved block of {len(entry.tokens)} tokens, not {self.block_tokens}")
            parent = built[entry.parent] if entry.parent >= 0 else None
            key = (parent.id if parent else self._root(entry.salt), tuple(entry.tokens))
            if key in self._blocks:
                raise ValueError(f"saved block {len(built)} repeats an earlier one")
            block = _Block(next(self._ids), key, entry.data)
            self._blocks[key] = block
            self._by_id[block.id] = block
            if parent is not None:
                parent.children.add(block.id)
            built.append(block)
        for block in reversed(built):          # the least recent first: the first saved ends last
            self._blocks.move_to_end(block.key)
        return len(built)

    def clear(self) -> None:
        """Drop every block (the model changed); the counters stay."""
        self._blocks.clear()
        self._by_id.clear()

    def stats(self) -> PrefixCacheStats:
        c = self._counts
        return PrefixCacheStats(
            queries=c["queries"], hits=c["hits"], tokens_queried=c["tokens_queried"],
            tokens_reused=c["tokens_reused"], blocks_stored=c["blocks_stored"],
            blocks_evicted=c["blocks_evicted"], blocks=len(self._blocks),
            bytes=len(self._blocks) * self.block_bytes, capacity_bytes=self.capacity_bytes)
