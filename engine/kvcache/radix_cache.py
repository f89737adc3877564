"""The radix prefix cache: a tree over token keys mapping prefixes to KV slots (page size 1).

A request that finishes (or is retracted) leaves its committed KV here; a later request whose
prompt starts with the same tokens takes those slots instead of prefilling them. Target and
draft KV share one slot per position (as in the pools), so one tree serves both.

Keys. Plain decoding keys position p by its token: the target KV at p is a function of the
tokens up to p. EAGLE's draft KV at p is a function of the tokens up to p + 1 (the draft row
at p reads the target's feature of token p and the token p + 1), so with a draft model the key
of position p is the pair (token p, token p + 1): every cached slot then holds exactly the
target and draft KV a fresh prefill would write, and a match never ends on a position whose
draft KV was made for a different next token. Either way a request's key covers at most all
but its last known token, so a prefill always has at least one token to run (the one whose
logits sample the next token).

Slots stay on the device. Nodes keep their slots as device tensors that are only sliced and
concatenated (SGLang's layout), and every decision (match, split, insert, evict) reads host
keys, lengths and counters: the cache never reads device memory, so it adds no host sync to
the decode loop. A request's row already holds its slots on the device; `insert` is handed
that row's copy when the request leaves.

Ownership: a slot is free (in the allocator), in this tree, or owned by one running request.
Tree nodes are reference-counted by the running requests whose cached prefix passes through
them; unreferenced nodes are `evictable` (reclaimable on demand, least recently used leaves
first). LRU time is a counter, not a clock, so every tensor-parallel rank evicts the same.

With a BlockEventRecorder attached (`record_events`: the engine process, for
--kv-events-endpoint and the data-parallel router), inserts, splits, evictions and flushes are
also reported as block events (block_events.py); without one they cost nothing more.
"""
from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple, Optional, Sequence

import torch

from specserve.engine.kvcache.block_events import BlockEventRecorder
from specserve.engine.kvcache.pools import TokenSlotAllocator


class _Node:
    __slots__ = ("key", "slots", "parent", "children", "ref", "last_use", "serial")

    def __init__(self, key: list[int], slots: Optional[torch.Tensor], parent: Optional["_Node"],
                 serial: int):
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.ref = 0          # running requests whose cached prefix passes through this node
        self.last_use = 0     # logical time of the last match or insert through it
        self.serial = serial  # creation order: the deterministic LRU tie-break


class PrefixPeek(NamedTuple):
    """What admitting a request would take from the cache, without taking it."""

    length: int      # cached positions it would reuse
    lock_cost: int   # of those, slots now evictable that admitting would pin


class PrefixMatch(NamedTuple):
    """A cached prefix taken by a request: its slots (device) and the node that pins them."""

    length: int
    slots: Optional[torch.Tensor]
    node: _Node


class InsertResult(NamedTuple):
    """Which of the inserting request's positions the tree kept: [0, already_cached) were in the
    tree already (the request's own copies there are duplicates), [already_cached, taken) are
    now the tree's, the rest stay the request's to free."""

    already_cached: int
    taken: int


class RadixCache:
    def __init__(self, allocator: TokenSlotAllocator, pair_keys: bool):
        self.allocator = allocator
        self.pair_keys = pair_keys
        self._serial = itertools.count()
        self.root = _Node([], None, None, next(self._serial))
        self.root.ref = 1  # never evicted
        self._clock = 0
        self.size = 0            # positions (slots) held by the tree
        self.evictable_size = 0  # of those, in nodes no running request references
        self.num_queried = 0     # prompt positions looked up at admission, and of those
        self.num_hit = 0         # the ones served from the cache (the hit rate's terms)
        self.num_evicted = 0     # slots given back to the allocator, since start
        self.events: Optional[BlockEventRecorder] = None  # KV-cache events: off unless recorded

    def record_events(self, block_size: int) -> BlockEventRecorder:
        """Report the tree's changes as block events (block_events.py) from now on; the blocks
        it holds already come first, as stored."""
        token_of = (lambda key: key >> 32) if self.pair_keys else (lambda key: key)
        self.events = BlockEventRecorder(block_size, token_of)
        for node in self._nodes():  # parents before their children
            self.events.stored(node)
        return self.events

    # --- keys ------------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], num_positions: int) -> list[int]:
        """The keys of a sequence's first `num_positions` positions whose KV is determined by
        `tokens` (its known tokens): with pair keys, a position needs the token after it."""
        if self.pair_keys:
            n = min(num_positions, len(tokens) - 1)
            return [(tokens[i] << 32) | tokens[i + 1] for i in range(n)]
        return list(tokens[:num_positions])

    # --- lookups ---------------------------------------------------------------------------
    def peek(self, keys: list[int]) -> PrefixPeek:
        """The cached prefix of `keys` and what pinning it would cost; changes nothing."""
        node, pos, cost = self.root, 0, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            n = _common_len(child.key, keys, pos)
            if child.ref == 0:
                cost += n
            pos += n
            if n < len(child.key):
                break
            node = child
        return PrefixPeek(pos, cost)

    def acquire(self, keys: list[int]) -> PrefixMatch:
        """Take the cached prefix of `keys`: split its last node at the match so the pinned
        path ends exactly there, reference every node on it, and mark it used."""
        node, pos = self._descend(keys)
        self.num_queried += len(keys)
        self.num_hit += pos
        self._touch(node)
        self._ref(node, +1)
        slots = None
        if pos:
            path = []
            walk = node
            while walk is not self.root:
                path.append(walk.slots)
                walk = walk.parent
            slots = path[0] if len(path) == 1 else torch.cat(path[::-1])
        return PrefixMatch(pos, slots, node)

    def _descend(self, keys: list[int]) -> tuple[_Node, int]:
        """The deepest node whose path is a prefix of `keys`, and that prefix's length; a node
        the match ends inside is split there first."""
        node, pos = self.root, 0
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            n = _common_len(child.key, keys, pos)
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        return node, pos

    def release(self, match: PrefixMatch) -> None:
        """A request no longer uses its cached prefix."""
        self._ref(match.node, -1)

    # --- insertion -------------------------------------------------------------------------
    def insert(self, keys: list[int], slots: torch.Tensor) -> InsertResult:
        """Cache the KV of `keys` (slot i holds the KV of key i). Keys already in the tree keep
        the tree's slots."""
        node, pos = self._descend(keys)
        already = pos
        if pos < len(keys):
            leaf = _Node(keys[pos:], slots[pos:len(keys)], node, next(self._serial))
            node.children[keys[pos]] = leaf
            self.size += len(leaf.key)
            self.evictable_size += len(leaf.key)
            if self.events is not None:
                self.events.stored(leaf)
            node = leaf
        self._touch(node)
        return InsertResult(already, len(keys))

    def grow(self, match: PrefixMatch, keys: list[int], slots: torch.Tensor) -> PrefixMatch:
        """A running request whose KV now covers `keys` (slot i holds key i; the first
        `match.length` are its pinned prefix) caches the rest and pins the longer prefix
        instead. Only when the tree holds nothing past its prefix: had another request cached
        those keys meanwhile, the tree's slots would differ from the ones this request's row
        uses (the request keeps its own until it leaves)."""
        if len(keys) <= match.length or self.peek(keys).length != match.length:
            return match
        self.insert(keys, slots)
        leaf = match.node.children[keys[match.length]]  # the node is the root for an empty prefix
        self._ref(leaf, +1)
        self._ref(match.node, -1)
        return PrefixMatch(len(keys), slots[:len(keys)], leaf)

    # --- eviction --------------------------------------------------------------------------
    def evict(self, num_slots: int) -> int:
        """Free at least `num_slots` slots (or every evictable one), least recently used leaves
        first; returns the number freed."""
        leaves = [(n.last_use, n.serial, n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_slots and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.allocator.free(leaf.slots)
            freed += len(leaf.key)
            self.num_evicted += len(leaf.key)
            self.size -= len(leaf.key)
            self.evictable_size -= len(leaf.key)
            if self.events is not None:
                self.events.removed(leaf)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(leaves, (parent.last_use, parent.serial, parent))
        return freed

    def flush(self) -> int:
        """Free every cached slot no running request uses; returns the number freed."""
        freed = self.evict(self.evictable_size)
        if self.events is not None and self.size == 0:
            self.events.cleared()
        return freed

    # --- checks ----------------------------------------------------------------------------
    def cached_slots(self) -> list[torch.Tensor]:
        """Every slot the tree holds (device tensors; for leak checks)."""
        return [n.slots for n in self._nodes()]

    def refs(self) -> dict[int, int]:
        """Reference count per node serial (for leak checks)."""
        return {n.serial: n.ref for n in self._nodes()}

    # --- internals -------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node` after its first n keys; returns the new upper node (the object passed in
        stays the lower part, so a request pinning it keeps its exact path)."""
        upper = _Node(node.key[:n], node.slots[:n], node.parent, next(self._serial))
        upper.ref, upper.last_use = node.ref, node.last_use
        node.parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        upper.children[node.key[0]] = node
        if self.events is not None:
            self.events.split(upper, node)
        return upper

    def _ref(self, node: _Node, delta: int) -> None:
        while node is not self.root:
            if node.ref == 0:
                self.evictable_size -= len(node.key)
            node.ref += delta
            assert node.ref >= 0, "radix cache: reference count below zero"
            if node.ref == 0:
                self.evictable_size += len(node.key)
            node = node.parent

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        while node is not self.root:
            node.last_use = self._clock
            node = node.parent


def _common_len(key: list[int], keys: list[int], pos: int) -> int:
    """Length of the common prefix of `key` and `keys[pos:]` (a slice compare first: whole
    nodes usually match)."""
    n = min(len(key), len(keys) - pos)
    if key[:n] == keys[pos:pos + n]:
        return n
    i = 0
    while key[i] == keys[pos + i]:
        i += 1
    return i
