"""Admission and retraction: which requests hold a row, and what the next launch covers.

Prefill goes first (a request in the middle of a chunked prefill, then new admissions within
the chunk budget: FCFS, or longest cached prefix first with the prefix cache); otherwise one
decode step over every running request that may still grow. When the pool cannot cover a
decode step, the most recently admitted request is retracted: its KV is freed (or, with the
prefix cache, cached and evictable) and it waits to be prefilled again over prompt + outputs.

Decode fairness (`prefill_interleave_tokens` > 0): while some running request could take a
decode step of at most `MIXED_MAX_ROW_TOKENS` row tokens, prompts ride with it in one mixed
step (the worker's `mixed_row_tokens` > 0; scheduler/mixed_batch.py: as many prompt tokens
as keep the step within `mixed_step_time_ratio` of the decode step alone, by the step-cost
model `step_cost` that the scheduler's timed steps refine, scheduler/step_cost.py; more where
prompt tokens wait, to drain them within a few steps), so decoding requests never wait behind
an extend. Where a request cannot be prefilled in a mixed step (mixed_batch.py
`rides_mixed`; every request decodes in one), the decode batch is larger, or the worker runs
none, an extend computes at most that many tokens and is always followed by a decode step, so
decoding requests never wait behind more than one bounded extend. With nobody decoding (an idle server's first
arrivals) an extend is bounded by the chunk budget only.
"""
from __future__ import annotations

import collections
import logging
import math
from typing import Callable, Optional, Sequence

from specserve.engine.forward_batch import ForwardMode
from specserve.engine.scheduler.mixed_batch import (
    DRAIN_STEPS, DRAIN_TIME_RATIO, MIXED_MAX_ROW_TOKENS, plan_prompt_budget, rides_mixed)
from specserve.engine.scheduler.request_slots import RequestSlots
from specserve.engine.scheduler.schedule_batch import Decision, MixedPlan, Req, ReqStatus
from specserve.engine.scheduler.step_cost import StepCostFit, StepCostSample

logger = logging.getLogger("specserve.engine")
# The mixed steps' cost model is logged after every this many priced steps (a served engine's
# log shows what its budget learnt: ~15 s apart at 8B speeds).
LOG_COST_EVERY = 1024
# Waiting requests beyond this many are admitted in arrival order; a request bypassed this many
# times by later arrivals with longer cached prefixes is admitted next.
LPM_WINDOW = 128
MAX_BYPASS = 32


class AdmissionPolicy:
    def __init__(self, slots: RequestSlots, *, max_running_requests: int, chunked_prefill_size: int,
                 max_context_len: int, prefill_interleave_tokens: int = 0, mixed_row_tokens: int = 0,
                 mixed_step_time_ratio: float = 0.0):
        """mixed_row_tokens: tokens a decode row adds to a mixed step (Worker.mixed_row_tokens);
        0: no mixed steps. mixed_step_time_ratio: a mixed step's predicted time at most this
        many times the decode step alone's (EngineConfig.mixed_step_time_ratio); 0: no cost
        model, prompts fill `prefill_interleave_tokens`."""
        self.slots = slots
        self.max_running = max_running_requests
        self.chunk_budget = chunked_prefill_size if chunked_prefill_size > 0 else 1 << 62
        self.interleave_tokens = prefill_interleave_tokens  # 0: decode fairness off
        self.mixed_row_tokens = mixed_row_tokens
        self.mixed_step_time_ratio = mixed_step_time_ratio
        # The decode and mixed steps' cost by forward tokens (None: no mixed steps, or no ratio).
        self.step_cost = StepCostFit() if mixed_row_tokens and mixed_step_time_ratio else None
        # The token counts of the worker's mixed-step graphs (set once they are captured): the
        # prompt budget fills the bucket a step replays (mixed_batch.py prompt_budget).
        self.mixed_graph_tokens: tuple[int, ...] = ()
        # A mixed step's prefill stopped at a request that cannot ride: the next step that is
        # not a decode step owed is a separate extend, which takes it (in admission order).
        self._non_rider_next = False
        self._last_was_extend = False  # the last decision schedule() returned (and was launched)
        self.max_context_len = max_context_len
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []          # hold a row (prefilling or decoding)
        self.num_retractions = 0
        self._admit_counter = 0

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def remove(self, req: Req) -> None:
        """A finished request gives up its row and KV, or its place in the queue."""
        if req.status is ReqStatus.RUNNING:
            self.slots.release(req)
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)

    def schedule(self, nothing_in_flight: bool) -> Optional[Decision]:
        """The next launch. Every decision returned is launched (the overlap loop calls this
        while the previous one is still in flight; `_last_was_extend` is about that one)."""
        # Whether a running request could take a decode step (the host's view: one whose
        # prefill's last chunk is launched counts, its first token still in flight).
        ready = self._decode_ready() if self.interleave_tokens > 0 else []
        decoding = bool(ready)
        if decoding and self._last_was_extend:
            decision = self._decode(nothing_in_flight)  # decode fairness: a decode step is owed
        elif (decoding and self.mixed_row_tokens and not self._non_rider_next
              and len(ready) * self.mixed_row_tokens <= MIXED_MAX_ROW_TOKENS):
            decision = self._mixed(nothing_in_flight)
        else:
            self._non_rider_next = False
            budget = min(self.chunk_budget, self.interleave_tokens) if decoding else self.chunk_budget
            decision = self._prefill(budget) or self._decode(nothing_in_flight)
        self._last_was_extend = decision is not None and decision.mode is ForwardMode.EXTEND
        return decision

    # --- mixed ---------------------------------------------------------------------------
    def _mixed(self, nothing_in_flight: bool) -> Optional[Decision]:
        """A decode step of every request that may grow, with prompt chunks riding along (a
        plain decode step when no prompt is ready, a plain extend when nobody is left to
        decode after retractions)."""
        decode = self._decode(nothing_in_flight)
        if decode is None:
            return self._prefill(self.chunk_budget)
        reserved = sum(self.slots.to_reserve(r) for r in decode.reqs)
        rows = len(decode.reqs) * self.mixed_row_tokens
        within = stretch = math.inf
        cost = None if self.step_cost is None else self.step_cost.model
        if cost is not None:
            within = cost.extra_tokens_within(rows, self.mixed_step_time_ratio)
            stretch = cost.extra_tokens_within(rows, DRAIN_TIME_RATIO)
        backlog = self._prompt_backlog(DRAIN_STEPS * self.interleave_tokens)
        planned = plan_prompt_budget(rows, self.interleave_tokens, within, self.mixed_graph_tokens, backlog, stretch)
        plan = MixedPlan(min(self.chunk_budget, planned.tokens),
                         "chunk" if self.chunk_budget < planned.tokens else planned.bound, backlog, cost)
        extend = self._prefill(plan.budget, reserved=reserved, only=rides_mixed)
        if extend is None:
            return decode._replace(plan=plan)
        return Decision(ForwardMode.MIXED, decode.reqs + extend.reqs, extend.chunks, extend.samples,
                        extend.prompt_spans, num_decode=len(decode.reqs), plan=plan)

    def _prompt_backlog(self, enough: int) -> int:
        """Prompt tokens waiting to be prefilled, counted up to `enough` (the most the budget
        can use: the scan stays short however long the queue): the running requests' unfilled
        rest, then the queued requests' prompt + outputs. A queued request counts whole, its
        cached prefix too (matching every queued request against the cache each step would
        cost host time; an overcount only drains the queue sooner, within the cap)."""
        backlog = sum(len(r.fill_ids) - r.num_prefilled for r in self.running if r.is_prefilling)
        for req in self.waiting:
            if backlog >= enough:
                break
            backlog += req.seq_len
        return backlog

    def forward_tokens(self, decision: Decision) -> int:
        """The tokens a decode or mixed step's target forward computes: the decode rows' and
        the chunks'."""
        return (len(decision.decode_reqs) * self.mixed_row_tokens
                + sum(end - start for start, end in decision.chunks))

    def observe_step_costs(self, samples: Sequence[StepCostSample]) -> None:
        """Timed priced steps (Decision.priced), in the order they were processed."""
        fit = self.step_cost
        for sample in samples:
            fit.observe(*sample)
            if fit.num_samples % LOG_COST_EVERY == 0:
                cost = fit.model
                logger.info("mixed steps' cost model after %d steps: %.2f ms + %.2f us a token past %d "
                            "(the last step: %d tokens, %.2f ms)", fit.num_samples, 1e3 * cost.fixed,
                            1e6 * cost.per_token, cost.knee, sample.tokens, 1e3 * sample.seconds)

    # --- prefill -------------------------------------------------------------------------
    def _prefill(self, budget: int, reserved: int = 0,
                 only: Optional[Callable[[Req], bool]] = None) -> Optional[Decision]:
        """Prefill chunks computing at most `budget` tokens (a cached or shared prefix is
        mapped, not computed, so it is free). `reserved`: slots a decode step launched with
        these chunks reserves; `only`: the requests that may take a chunk (the first that may
        not ends the decision, so none is bypassed, and `_non_rider_next` is set)."""
        taken = reserved  # slots this decision's chunks (and the decode rows) take when built
        reqs, chunks, spans = [], [], []
        # A request in the middle of a chunked prefill goes first.
        for req in self.running:
            if req.is_prefilling and budget > 0:
                if only is not None and not only(req):
                    self._non_rider_next = True
                    break
                n = min(budget, len(req.fill_ids) - req.num_prefilled, self.slots.num_free - taken)
                if n == 0:
                    break
                reqs.append(req)
                chunks.append(req.take_chunk(n))
                spans.append(req.take_prompt_span(*chunks[-1]))
                budget -= n
                taken += n
        # Admit only what leaves room for the next decode step of every running request and of
        # the new one (a speculative step reserves several slots each): admitting into slots
        # that step needs would force a retraction straight away. A cached prefix is not
        # prefilled, but pinning it takes its slots out of the evictable ones.
        headroom = sum(self.slots.to_reserve(r) for r in self.running) - reserved
        can_admit = lambda: (budget > 0 and len(self.running) < self.max_running  # noqa: E731
                             and self.slots.num_free_rows > 0)
        admitting = self.waiting and can_admit() and not self._non_rider_next
        for req in self._admission_order() if admitting else ():
            if not can_admit():
                break
            if req.shared is not None and req.shared.blocks(req):
                continue  # another sequence of its request is prefilling the shared prompt
            if req.num_inflight_tokens:   # retracted with a result still in flight
                break
            if req.waits_for_grammar:
                continue
            if only is not None and not only(req):
                self._non_rider_next = True
                break
            # It prefills prompt + outputs so far, past what its row can map (a cached or a
            # shared prefix).
            cached = self.slots.peek_prefix(req)
            n = min(budget, req.seq_len - cached.length)
            if n + headroom + self.slots.step_slots + cached.lock_cost > self.slots.num_free - taken:
                break
            headroom += self.slots.step_slots
            self._take_from_queue(req)
            self._admit_counter += 1
            self.slots.admit(req, self._admit_counter)
            self.running.append(req)
            reqs.append(req)
            chunks.append(req.take_chunk(n))
            spans.append(req.take_prompt_span(*chunks[-1]))
            budget -= n
            taken += n
        if not reqs:
            return None
        samples = [end == len(r.fill_ids) for r, (_, end) in zip(reqs, chunks)]
        for r, s in zip(reqs, samples):
            r.num_inflight_tokens += s
        return Decision(ForwardMode.EXTEND, reqs, chunks, samples, spans)

    def _admission_order(self) -> list[Req]:
        """First come, first served; with the prefix cache, the longest cached prefix first
        (SGLang's LPM: requests sharing a prefix run while it is cached), except that a
        request bypassed `MAX_BYPASS` times goes first, so that none waits for ever. Queues
        longer than `LPM_WINDOW` stay in arrival order (matching them all costs host time)."""
        if self.slots.cache is None or len(self.waiting) > LPM_WINDOW or len(self.waiting) < 2:
            return list(self.waiting)
        queue = list(self.waiting)
        cached = [self.slots.peek_prefix(r).length for r in queue]
        order = sorted(range(len(queue)),
                       key=lambda i: (queue[i].num_bypassed < MAX_BYPASS, -cached[i], i))
        return [queue[i] for i in order]

    def _take_from_queue(self, req: Req) -> None:
        """Remove an admitted request from the queue; those queued ahead of it were bypassed."""
        for ahead in self.waiting:
            if ahead is req:
                break
            ahead.num_bypassed += 1
        self.waiting.remove(req)

    # --- decode --------------------------------------------------------------------------
    def _decode(self, nothing_in_flight: bool) -> Optional[Decision]:
        reqs = self._decode_ready()
        if not reqs:
            if any(r.is_prefilling for r in self.running) and nothing_in_flight:
                self._retract_one()  # every holder is stuck mid-prefill on a full pool
            return None
        # A retracted request leaves the batch before anything is launched or reserved for it.
        while self.slots.num_free < sum(self.slots.to_reserve(r) for r in reqs):
            self._retract_one()
            reqs = self._decode_ready()
            if not reqs:
                return None
        for r in reqs:
            r.num_inflight_tokens += 1  # at least one token per step, speculative or not
        return Decision(ForwardMode.DECODE, reqs)

    def _decode_ready(self) -> list[Req]:
        return [r for r in self.running if not r.is_prefilling and self._can_decode(r)]

    def _can_decode(self, req: Req) -> bool:
        """False once the tokens already in flight reach a length limit (host-known)."""
        projected_outputs = len(req.output_ids) + req.num_inflight_tokens
        projected_len = len(req.prompt_ids) + projected_outputs
        return projected_outputs < req.sampling.max_new_tokens and projected_len < self.max_context_len

    def _retract_one(self) -> None:
        """Free the most recently admitted request's KV and queue it again (outputs stay exact:
        it will be prefilled again over prompt + outputs)."""
        if len(self.running) <= 1:
            # The engine caps max_context_len so that one request's peak KV fits the pool
            # (Engine._fit_context_to_pool); a lone request short of slots means lost slots.
            raise RuntimeError(f"KV pool accounting is broken: {self.slots.num_free} of "
                               f"{self.slots.allocator.num_slots} slots free for a lone request")
        victim = max(self.running, key=lambda r: r.admit_order)
        self.num_retractions += 1
        self.slots.release(victim)
        self.running.remove(victim)
        victim.status = ReqStatus.WAITING
        self.waiting.appendleft(victim)
