"""Request-slot accounting: request-table rows, KV slots, and the table writes that map them.

Every write to the request table waits for the last launched forward's `read_done` (the
write-after-read barrier), so a forward in flight never sees the next step's rewrites.

With the prefix cache, a request's row starts with the cached prefix it took at admission
(pinned in the tree while it runs); when it leaves (finish, abort, retraction) its committed
KV goes to the tree and only the rest is freed. Slots the tree holds unpinned count as free:
they are evicted when an allocation needs them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from specserve.engine.kvcache.pools import ReqToTokenPool, TokenSlotAllocator
from specserve.engine.kvcache.radix_cache import PrefixPeek, RadixCache
from specserve.engine.layers.sampler import SamplingInfo
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.step import DecodeStep, ExtendStep
from specserve.engine.scheduler.schedule_batch import Decision, Req


MIN_EVICTION = 256


class RequestSlots:
    def __init__(self, req_to_token: ReqToTokenPool, allocator: TokenSlotAllocator,
                 ctx: DeviceContext, step_slots: int, cache: Optional[RadixCache] = None):
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.cache = cache            # None: the prefix cache is off
        self.ctx = ctx
        self.step_slots = step_slots  # slots a decode step needs past the committed length
        self.last_read_done = None    # set by the scheduler at each launch

    @property
    def num_free(self) -> int:
        """Slots an allocation can get: free ones and cached ones no running request pins."""
        return self.allocator.num_free + (self.cache.evictable_size if self.cache is not None else 0)

    @property
    def num_free_rows(self) -> int:
        return self.req_to_token.num_free

    def peek_prefix(self, req: Req) -> PrefixPeek:
        """The cached prefix admitting `req` now would reuse (nothing when the cache is off)."""
        if self.cache is None:
            return PrefixPeek(0, 0)
        return self.cache.peek(self._prefix_keys(req))

    def admit(self, req: Req, order: int) -> None:
        """Give `req` a row that starts with its cached prefix (pinned until it leaves)."""
        row = self.req_to_token.alloc()
        prefix = self.cache.acquire(self._prefix_keys(req)) if self.cache is not None else None
        req.admit(row, order, prefix)
        if prefix is not None and prefix.length:
            self._wait_table_readers()
            self.req_to_token.table[row, :prefix.length] = prefix.slots

    def _prefix_keys(self, req: Req) -> list[int]:
        """Cache keys of every position a prefill of `req` could skip (all but its last token),
        memoised per length: admission looks at waiting requests every step."""
        if req.prefix_keys is None or req.prefix_keys[0] != req.seq_len:
            tokens = req.prompt_ids + req.output_ids
            req.prefix_keys = (req.seq_len, self.cache.keys(tokens, len(tokens) - 1))
        return req.prefix_keys[1]

    def to_reserve(self, req: Req) -> int:
        """Slots a decode step must add so that the row covers committed + the step's need."""
        want = min(req.kv_committed_len + self.step_slots, self.req_to_token.row_width)
        return max(0, want - req.kv_allocated_len)

    def extend_step(self, decision: Decision, sampling: SamplingInfo) -> ExtendStep:
        """Allocate and map the slots of every chunk (Req.take_chunk already counted them)."""
        width = self.req_to_token.row_width
        flat = [i for req, (start, end) in zip(decision.reqs, decision.chunks)
                for i in range(req.row * width + start, req.row * width + end)]
        slots = self._alloc(len(flat))
        self._write_table(flat, slots)
        return ExtendStep(rows=[r.row for r in decision.reqs],
                          fill_ids=[r.fill_ids for r in decision.reqs], chunks=list(decision.chunks),
                          samples=list(decision.samples), out_cache_loc=slots, sampling=sampling)

    def decode_step(self, reqs: list[Req], sampling: SamplingInfo, commit_fed_token: bool) -> DecodeStep:
        """Reserve what the step needs; plain decoding commits the token it feeds right away
        (its KV is written by this step), speculative decoding when results arrive."""
        width = self.req_to_token.row_width
        flat = []
        for r in reqs:
            n = self.to_reserve(r)
            flat += range(r.row * width + r.kv_allocated_len, r.row * width + r.kv_allocated_len + n)
            r.reserve(n)
            if commit_fed_token:
                r.commit(1)
        slots = self._alloc(len(flat))
        self._write_table(flat, slots)
        return DecodeStep(rows=[r.row for r in reqs], committed_lens=[r.kv_committed_len for r in reqs],
                          allocated_lens=[r.kv_allocated_len for r in reqs], out_cache_loc=slots,
                          sampling=sampling)

    def release(self, req: Req) -> None:
        """Free a request's row, and its slots or hand them to the prefix cache. Safe while a
        launched forward still uses them: later writes to them are ordered after it (stream
        order and the read-done barrier)."""
        if req.kv_allocated_len:
            row_slots = self.req_to_token.table[req.row, :req.kv_allocated_len].clone()
            if self.cache is None:
                self.allocator.free(row_slots)
            else:
                self._cache_committed(req, row_slots)
        if req.prefix is not None:
            self.cache.release(req.prefix)
        self.req_to_token.free(req.row)
        req.release()

    def cache_prefilled(self, req: Req) -> None:
        """A running request whose prefill result arrived caches its prompt now (not only
        when it leaves), so that requests arriving meanwhile share it; its row is unchanged."""
        if self.cache is None:
            return
        tokens = req.prompt_ids + req.output_ids
        keys = self.cache.keys(tokens, min(req.kv_committed_len, len(tokens)))
        if len(keys) > req.cached_len:
            req.prefix = self.cache.grow(req.prefix, keys, self.req_to_token.table[req.row, :len(keys)].clone())

    def _cache_committed(self, req: Req, row_slots: torch.Tensor) -> None:
        """Insert the committed positions whose tokens the host knows (a verify's tokens past a
        stop were cut from the outputs, so their KV cannot be keyed); free the request's copies
        of positions the tree had already and everything past the committed ones (rejected
        drafts, over-reserved slots)."""
        tokens = req.prompt_ids + req.output_ids
        kept = self.cache.insert(self.cache.keys(tokens, min(req.kv_committed_len, len(tokens))), row_slots)
        self.allocator.free(row_slots[req.cached_len:kept.already_cached])
        self.allocator.free(row_slots[kept.taken:])

    def _alloc(self, n: int) -> torch.Tensor:
        """n fresh slots, evicting unpinned cached ones first when too few are free. An
        eviction walks the whole tree, so it frees at least MIN_EVICTION slots: on a full pool
        the decode steps that follow then allocate without walking it again."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(max(short, MIN_EVICTION))
        return self.allocator.alloc(n)

    @contextlib.contextmanager
    def scratch(self, n: int) -> Iterator[tuple[int, torch.Tensor]]:
        """A row holding n fresh slots for a one-off forward on an idle engine (scoring)."""
        row = self.req_to_token.alloc()
        slots = self._alloc(n)
        self.req_to_token.table[row, :n] = slots
        try:
            yield row, slots
        finally:
            self.allocator.free(slots)
            self.req_to_token.free(row)

    def _write_table(self, flat_index: list[int], slots: torch.Tensor) -> None:
        """Schedule-side table write, after the last forward finished reading the table."""
        self._wait_table_readers()
        idx = torch.tensor(flat_index, dtype=torch.int64).to(self.ctx.device, non_blocking=True)
        self.req_to_token.table.view(-1)[idx] = slots

    def _wait_table_readers(self) -> None:
        if self.last_read_done is not None:
            self.ctx.schedule_wait(self.last_read_done)
