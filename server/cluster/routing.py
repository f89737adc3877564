"""Which data-parallel replica serves a request: prefix-cache affinity, bounded by load.

Each replica's engine keeps a radix prefix cache, so a prompt is cheapest on the replica that
holds its longest prefix. A prompt is cut into blocks of `block_size` tokens, each named by a
hash chained over every block before it (engine/kvcache/block_events.py: a block hash stands
for the whole prefix up to its end, as in vLLM's block-hash indexes); per replica the router
keeps the set of chain hashes it believes cached (an LRU bounded near a KV pool's size), and
the longest run of a prompt's leading hashes in a replica's set is that replica's expected hit.

The engines say what they cache: each replica publishes its KV-cache events (BlockStored,
BlockRemoved, AllBlocksCleared; cache_events.py reads them), which `apply_events` applies, so
evictions and flushes leave the router's view as they happen. Events come after the prefill
that caches a prompt, so the router also adds a prompt's blocks when it routes it (the next
request with that prefix, arriving before the events, still goes there); an engine that never
caches them (the request failed first) leaves those entries until the LRU bound drops them.

Load bounds the affinity: the replica with the longest hit is chosen only if its load (the
requests in flight to it through this server: exact and current, where the engines' own
queue figures are polled and lag by seconds) is at most
`max_load_imbalance` above the least loaded live replica; otherwise the least loaded replica
(ties broken by the longer hit, then round robin) gets the request, and caches the prefix in
turn, so a hot system prompt spreads over replicas as load demands instead of flooding one.

KV use bounds it too: a replica whose KV pool was more than `max_kv_use` full at the latest
poll is passed over while another is not (its cache is about to be evicted, or its requests
retracted).

A plain policy of our own rather than Ray Serve's router: our fronts (gRPC + OpenAI HTTP) and
their streaming, cancellation and watchdog live in one server process that talks to engines
over ZeroMQ, and Ray Serve's request path would replace all of that; what we need from it, a
choice among a few replicas, is this small, testable function of what the server knows.
"""
from __future__ import annotations

import collections
import enum
import itertools
from dataclasses import dataclass
from typing import Sequence

from specserve.engine.kvcache.block_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                    KVEvent, chain_hashes)


class RoutingPolicy(enum.Enum):
    PREFIX = "prefix"            # prefix affinity bounded by load (above)
    ROUND_ROBIN = "round-robin"  # the next live replica in turn (the baseline in benchmarks)


@dataclass(frozen=True)
class RoutingConfig:
    policy: RoutingPolicy = RoutingPolicy.PREFIX
    # Tokens per hashed block (a partial last block is not hashed); the replica set uses its
    # engines' kv_events_block_size, the size their events name blocks by.
    block_size: int = 16
    max_blocks_per_replica: int = 8192  # LRU bound of each replica's remembered chain hashes
    max_load_imbalance: int = 8    # affinity yields once its replica is this much busier
    max_kv_use: float = 0.9        # ... or once its KV pool is fuller than this

    def __post_init__(self):
        for name in ("block_size", "max_blocks_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.policy, RoutingPolicy):
            raise ValueError(f"policy: one of {[p.value for p in RoutingPolicy]}, got "
                             f"{self.policy!r}")
        if self.max_load_imbalance < 0:
            raise ValueError(f"max_load_imbalance: must be >= 0, got {self.max_load_imbalance}")
        if not 0 < self.max_kv_use <= 1:
            raise ValueError(f"max_kv_use: must be in (0, 1], got {self.max_kv_use}")


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica when it routes."""

    index: int
    load: int              # requests in flight to it
    kv_use: float = 0.0    # its KV pool's used fraction at the latest poll


@dataclass(frozen=True)
class Route:
    replica: int
    matched_tokens: int  # the prompt tokens the chosen replica is expected to hold cached
    reason: str          # "affinity" | "least_loaded" | "round_robin" (for the metrics)


class PrefixRouter:
    """Not thread-safe: called on the server's event loop only."""

    def __init__(self, num_replicas: int, config: RoutingConfig = RoutingConfig()):
        self.config = config
        self._seen: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(num_replicas)]
        self._tie_break = itertools.count()

    def route(self, prompt: Sequence[int], replicas: Sequence[ReplicaState]) -> Route:
        """Pick one of `replicas` (the live ones; at least one) and remember that it now holds
        the prompt's blocks."""
        if not replicas:
            raise ValueError("replicas: no live replica to route to")
        if self.config.policy is RoutingPolicy.ROUND_ROBIN:
            return Route(replicas[next(self._tie_break) % len(replicas)].index, 0, "round_robin")
        hashes = chain_hashes(prompt, self.config.block_size)
        roomy = [r for r in replicas if r.kv_use <= self.config.max_kv_use] or replicas
        matched = {r.index: self._matched_blocks(r.index, hashes) for r in roomy}
        least = min(r.load for r in roomy)
        best = max(roomy, key=lambda r: (matched[r.index], -r.load))
        if matched[best.index] > 0 and best.load <= least + self.config.max_load_imbalance:
            chosen, reason = best, "affinity"
        else:
            idle = [r for r in roomy if r.load == least]
            longest = max(matched[r.index] for r in idle)
            idle = [r for r in idle if matched[r.index] == longest]
            chosen, reason = idle[next(self._tie_break) % len(idle)], "least_loaded"
        self._remember(chosen.index, hashes)
        return Route(chosen.index, matched[chosen.index] * self.config.block_size, reason)

    def forget(self, replica: int) -> None:
        """The replica restarted (or was flushed, or its events were lost): its cache is empty,
        or unknown."""
        self._seen[replica].clear()

    def apply_events(self, replica: int, events: Sequence[KVEvent]) -> None:
        """What the replica's engine reported of its prefix cache (cache_events.py)."""
        seen = self._seen[replica]
        for event in events:
            if isinstance(event, BlockStored):
                self._remember(replica, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    seen.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                seen.clear()

    def _matched_blocks(self, replica: int, hashes: list[int]) -> int:
        seen = self._seen[replica]
        for count, h in enumerate(hashes):
            if h not in seen:
                return count
        return len(hashes)

    def _remember(self, replica: int, hashes: Sequence[int]) -> None:
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.config.max_blocks_per_replica:
            seen.popitem(last=False)
