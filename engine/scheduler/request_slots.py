"""Request-slot accounting: request-table rows, KV slots, and the table writes that map them.

Every write to the request table waits for the last launched forward's `read_done` (the
write-after-read barrier), so a forward in flight never sees the next step's rewrites.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from specserve.engine.kvcache.pools import ReqToTokenPool, TokenSlotAllocator
from specserve.engine.layers.sampler import SamplingInfo
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.step import DecodeStep, ExtendStep
from specserve.engine.scheduler.schedule_batch import Decision, Req


class RequestSlots:
    def __init__(self, req_to_token: ReqToTokenPool, allocator: TokenSlotAllocator,
                 ctx: DeviceContext, step_slots: int):
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.ctx = ctx
        self.step_slots = step_slots  # slots a decode step needs past the committed length
        self.last_read_done = None    # set by the scheduler at each launch

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_free_rows(self) -> int:
        return self.req_to_token.num_free

    def admit(self, req: Req, order: int) -> None:
        """Give a request a row; a sequence whose request's prompt KV is live maps it and
        prefills past it, the first one admitted becomes its creator."""
        row = self.req_to_token.alloc()
        shared = req.shared
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

    def prefilled_on_admission(self, req: Req) -> int:
        """Tokens of a waiting request whose KV admission maps without a prefill."""
        return req.shared.length if req.shared is not None and req.shared.live else 0

    def to_reserve(self, req: Req) -> int:
        """Slots a decode step must add so that the row covers committed + the step's need."""
        want = min(req.kv_committed_len + self.step_slots, self.req_to_token.row_width)
        return max(0, want - req.kv_allocated_len)

    def extend_step(self, decision: Decision, sampling: SamplingInfo) -> ExtendStep:
        """Allocate and map the slots of every chunk (Req.take_chunk already counted them)."""
        width = self.req_to_token.row_width
        flat = [i for req, (start, end) in zip(decision.reqs, decision.chunks)
                for i in range(req.row * width + start, req.row * width + end)]
        slots = self.allocator.alloc(len(flat))
        self._write_table(flat, slots)
        for req, (_, end) in zip(decision.reqs, decision.chunks):
            shared = req.shared
            if shared is not None and shared.creator is req and end >= shared.length:
                # The creator's prefill now covers the prefix: capture its slots (a device
                # gather, ordered after the table write) for the other sequences.
                shared.slots = self.req_to_token.table[req.row, :shared.length].clone()
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
        slots = self.allocator.alloc(len(flat))
        self._write_table(flat, slots)
        return DecodeStep(rows=[r.row for r in reqs], committed_lens=[r.kv_committed_len for r in reqs],
                          allocated_lens=[r.kv_allocated_len for r in reqs], out_cache_loc=slots,
                          sampling=sampling)

    def release(self, req: Req) -> None:
        """Free a request's slots and row (the shared prefix's only with its last owner). Safe
        while a launched forward still uses them: later writes to them are ordered after it
        (stream order and the read-done barrier)."""
        own_from, shared = 0, req.shared
        if req.owns_share:
            own_from = shared.length
            req.owns_share = False
            shared.owners -= 1
            if shared.owners == 0:
                self.allocator.free(shared.slots)
                shared.slots = None
        elif shared is not None and shared.creator is req:
            shared.creator = None  # released before its prefill reached the prefix's end
        if req.kv_allocated_len > own_from:
            self.allocator.free(self.req_to_token.table[req.row, own_from:req.kv_allocated_len].clone())
        self.req_to_token.free(req.row)
        req.release()

    @contextlib.contextmanager
    def scratch(self, n: int) -> Iterator[tuple[int, torch.Tensor]]:
        """A row holding n fresh slots for a one-off forward on an idle engine (scoring)."""
        row = self.req_to_token.alloc()
        slots = self.allocator.alloc(n)
        self.req_to_token.table[row, :n] = slots
        try:
            yield row, slots
        finally:
            self.allocator.free(slots)
            self.req_to_token.free(row)

    def _write_table(self, flat_index: Sequence[int], slots: torch.Tensor) -> None:
        """Schedule-side table write, after the last forward finished reading the table."""
        if self.last_read_done is not None:
            self.ctx.schedule_wait(self.last_read_done)
        idx = torch.tensor(flat_index, dtype=torch.int64).to(self.ctx.device, non_blocking=True)
        self.req_to_token.table.view(-1)[idx] = slots
