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
from typing import Iterator, Optional, Sequence

import torch

from specserve.engine.host_copy import to_device
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
        """The KV admitting `req` now would map instead of prefilling: its cached prefix, or
        without the cache a live shared prompt prefix (whose slots are held already)."""
        if self.cache is None:
            shared = req.shared
            return PrefixPeek(shared.length if shared is not None and shared.live else 0, 0)
        return self.cache.peek(self._prefix_keys(req))

    def admit(self, req: Req, order: int) -> None:
        """Give `req` a row that starts with the KV it can map: its cached prefix (pinned until
        it leaves), or without the cache a live shared prompt prefix (n > 1). The first
        sequence of an n > 1 request admitted creates the shared prefix."""
        row = self.req_to_token.alloc()
        shared = req.shared
        if self.cache is not None:
            if shared is not None and not shared.cached and shared.creator is None:
                shared.creator = req
            prefix = self.cache.acquire(self._prefix_keys(req))
            req.admit(row, order, prefix)
            if prefix.length:
                self._wait_table_readers()
                self.req_to_token.table[row, :prefix.length] = prefix.slots
            return
        if shared is not None and shared.live:
            self._write_table(range(row * self.req_to_token.row_width,
                                    row * self.req_to_token.row_width + shared.length), shared.slots)
            shared.owners += 1
            req.owns_share = True
            req.admit(row, order, prefilled=shared.length)
            return
        if shared is not None and shared.creator is None:
            shared.creator = req
        req.admit(row, order)

    def _prefix_keys(self, req: Req) -> list[int]:
        """Cache keys of every position a prefill of `req` could skip (all but its last token),
        memoised per length: admission looks at waiting requests every step."""
        if req.prefix_keys is None or req.prefix_keys[0] != req.seq_len:
            tokens = req.prompt_ids + req.output_ids
            req.prefix_keys = (req.seq_len, self.cache.keys(tokens, len(tokens) - 1))
        if req.sampling.prompt_logprobs is not None:
            # The row at position i - 1 scores prompt token i: rows from the first unscored
            # token's on must be computed, not taken from the cache.
            return req.prefix_keys[1][:max(0, req.prompt_scores.scored_to - 1)]
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
        for req, (_, end) in zip(decision.reqs, decision.chunks):
            shared = req.shared
            if shared is not None and shared.creator is req and end >= shared.length:
                # The creator's prefill now covers the prefix: capture its slots (a device
                # gather, ordered after the table write) for the other sequences, in the
                # prefix cache when it is on (they are admitted in later steps: their forwards
                # read the slots after this one writes them).
                prefix_slots = self.req_to_token.table[req.row, :shared.length].clone()
                if self.cache is not None:
                    keys = self.cache.keys(req.prompt_ids, shared.length)
                    req.prefix = self.cache.grow(req.prefix, keys, prefix_slots[:len(keys)])
                    shared.cached, shared.creator = True, None
                else:
                    shared.slots = prefix_slots
                    shared.owners, shared.creator, req.owns_share = 1, None, True
        return ExtendStep(rows=[r.row for r in decision.reqs],
                          fill_ids=[r.fill_ids for r in decision.reqs], chunks=list(decision.chunks),
                          samples=list(decision.samples), out_cache_loc=slots, sampling=sampling,
                          prompt_lens=[len(r.prompt_ids) for r in decision.reqs],
                          prompt_spans=list(decision.prompt_spans),
                          prompt_top_k=[r.sampling.prompt_logprobs or 0 for r in decision.reqs])

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
        """Free a request's row, and its slots or hand them to the prefix cache (without the
        cache, a shared prefix's slots go with its last owner). Safe while a launched forward
        still uses them: later writes to them are ordered after it (stream order and the
        read-done barrier)."""
        shared = req.shared
        if shared is not None and shared.creator is req:
            shared.creator = None  # released before its prefill reached the prefix's end
        if self.cache is not None:
            if req.kv_allocated_len:
                self._cache_committed(req, self.req_to_token.table[req.row, :req.kv_allocated_len].clone())
            self.cache.release(req.prefix)
            self.req_to_token.free(req.row)
            req.release()
            return
        own_from = 0
        if req.owns_share:
            own_from = shared.length
            req.owns_share = False
            shared.owners -= 1
            if shared.owners == 0:
                self.allocator.free(shared.slots)
                shared.slots = None
        if req.kv_allocated_len > own_from:
            self.allocator.free(self.req_to_token.table[req.row, own_from:req.kv_allocated_len].clone())
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

    def _write_table(self, flat_index: Sequence[int], slots: torch.Tensor) -> None:
        """Schedule-side table write, after the last forward finished reading the table."""
        self._wait_table_readers()
        idx = to_device(flat_index, torch.int64, self.ctx.device)  # every step: pinned on CUDA
        self.req_to_token.table.view(-1)[idx] = slots

    def _wait_table_readers(self) -> None:
        if self.last_read_done is not None:
            self.ctx.schedule_wait(self.last_read_done)
