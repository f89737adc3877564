"""KV-cache events: the radix prefix cache's changes as blocks, the way vLLM reports its cache.

vLLM's cache is made of fixed blocks, each named by a hash chained over every block before it,
and it tells gateways (llm-d's precise prefix-cache scorer, Dynamo's KV router) which blocks it
stored or removed. Our cache is a radix tree of single token slots, so blocks are defined here:
block k of a path is its positions [k * block_size, (k + 1) * block_size). It is *stored* when
the tree holds the path down to its last position, and *removed* when that position is evicted.
A tree node therefore owns the blocks whose last position falls inside it (a leaf's insert
stores them, its eviction removes them; a split moves them between the two halves and changes
nothing a subscriber sees).

A block's hash is `block_hash(hash of the block before it, its token ids)` (None before the
first), so equal prefixes get equal hashes on every engine, and a hash stands for the whole
prefix up to its block's end, as vLLM's prefix hashes do. With a draft model the tree keys a
position by (token, next token) (radix_cache.py); a block's tokens are the first halves, so the
hash names the tokens that are cached, and a prompt that matches them all reuses every position
but the block's last (recomputed when the next token differs).

Two tree paths can hold the same block only with pair keys (paths that part at a block's last
position); the recorder counts the holders of each hash, so a hash is stored once and removed
when its last holder goes.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Callable, NamedTuple, Optional, Sequence, Union


class BlockStored(NamedTuple):
    """Consecutive blocks of one path became cached: block_hashes[0]'s parent is
    parent_block_hash (None: the path's first block), and token_ids are the blocks' tokens."""

    block_hashes: tuple[int, ...]
    parent_block_hash: Optional[int]
    token_ids: tuple[int, ...]
    block_size: int


class BlockRemoved(NamedTuple):
    block_hashes: tuple[int, ...]


class AllBlocksCleared(NamedTuple):
    """The cache holds nothing (after a flush that left no block behind)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def block_hash(parent: Optional[int], token_ids: Sequence[int]) -> int:
    """A block's 64-bit chain hash: BLAKE2b over the parent's hash (0 for none) and the tokens
    (little-endian uint32)."""
    digest = hashlib.blake2b(struct.pack(f"<Q{len(token_ids)}I", parent or 0, *token_ids),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big")


def chain_hashes(token_ids: Sequence[int], block_size: int,
                 parent: Optional[int] = None) -> list[int]:
    """The hashes of the whole blocks of `token_ids` (a partial last block has none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class _Owned(NamedTuple):
    start: int              # the node's first position on its path
    hashes: tuple[int, ...]  # the blocks whose last position is in the node, in path order


class BlockEventRecorder:
    """Turns the radix tree's inserts, splits and evictions into block events.

    The tree calls `stored(leaf)` after it links a new leaf, `split(upper, lower)` after a
    split, `removed(leaf)` after it unlinks an evicted leaf and `cleared()` when a flush left
    it empty; nodes are read through `.key` and `.parent` only (None: the root). `take()`
    hands over the events since the last call, in order."""

    def __init__(self, block_size: int, token_of: Callable[[int], int]):
        if block_size < 1:
            raise ValueError(f"kv_events_block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self._token_of = token_of  # a tree key -> the token id at its position
        self._owned: dict[object, _Owned] = {}
        self._holders: dict[int, int] = {}  # hash -> nodes owning a block with it
        self._events: list[KVEvent] = []

    # --- the tree's hooks ------------------------------------------------------------------
    def stored(self, leaf) -> None:
        parent, size = leaf.parent, self.block_size
        start = self._end(parent)
        end = start + len(leaf.key)
        first, last = start // size, end // size  # the blocks first..last-1 end in the leaf
        hashes: tuple[int, ...] = ()
        if last > first:
            lead = self._path_tail(parent, start - first * size)
            tokens = lead + [self._token_of(k) for k in leaf.key[:last * size - start]]
            parent_hash = self._last_hash(parent)
            hashes = tuple(chain_hashes(tokens, size, parent_hash))
            self._hold(hashes, parent_hash, tokens)
        self._owned[leaf] = _Owned(start, hashes)

    def split(self, upper, lower) -> None:
        whole = self._owned.pop(lower)
        cut = whole.start + len(upper.key)
        n = cut // self.block_size - whole.start // self.block_size  # blocks ending in upper
        self._owned[upper] = _Owned(whole.start, whole.hashes[:n])
        self._owned[lower] = _Owned(cut, whole.hashes[n:])

    def removed(self, leaf) -> None:
        gone = []
        for h in self._owned.pop(leaf).hashes:
            self._holders[h] -= 1
            if not self._holders[h]:
                del self._holders[h]
                gone.append(h)
        if gone:
            self._events.append(BlockRemoved(tuple(gone)))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    # --- the publisher's side --------------------------------------------------------------
    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def held_hashes(self) -> set[int]:
        """The hashes of every block the tree holds now (for checks)."""
        return set(self._holders)

    # --- internals -------------------------------------------------------------------------
    def _hold(self, hashes: tuple[int, ...], parent_hash: Optional[int], tokens: list[int]) -> None:
        """Count the holders; one BlockStored per run of blocks no other node holds."""
        size, run = self.block_size, []
        for i, h in enumerate(hashes):
            count = self._holders.get(h, 0)
            self._holders[h] = count + 1
            if count == 0:
                run.append(i)
            if run and (count or i == len(hashes) - 1):
                stop = run[-1] + 1
                self._events.append(BlockStored(
                    hashes[run[0]:stop], hashes[run[0] - 1] if run[0] else parent_hash,
                    tuple(tokens[run[0] * size:stop * size]), size))
                run = []

    def _end(self, node) -> int:
        """The position after `node`'s last (0 for the root)."""
        if node.parent is None:
            return 0
        owned = self._owned[node]
        return owned.start + len(node.key)

    def _last_hash(self, node) -> Optional[int]:
        """The hash of the last block that ends at or above `node` on its path."""
        while node.parent is not None:
            hashes = self._owned[node].hashes
            if hashes:
                return hashes[-1]
            node = node.parent
        return None

    def _path_tail(self, node, count: int) -> list[int]:
        """The last `count` tokens of the path down to `node`."""
        keys: list[int] = []
        while len(keys) < count:
            keys[:0] = node.key
            node = node.parent
        return [self._token_of(k) for k in keys[len(keys) - count:]]
