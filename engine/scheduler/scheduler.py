"""The scheduler: continuous batching with chunked prefill, retraction and abort, in two loops.

Normal loop: schedule a batch, launch it, process its result. Overlap loop: schedule and
launch batch N+1, then process batch N, so the host works while the device runs. Every
value batch N+1 needs from batch N (the sampled token, speculative lengths) travels through
the FutureMap on the device; the host's own view lags one step and is corrected when N's
result is processed. A request that finished in N is still in N+1: its result is skipped.
"""
from __future__ import annotations

import collections
import time
from typing import Optional

import torch

from specserve.engine.layers.sampler import SamplingInfo
from specserve.engine.outputs import StepOutput
from specserve.engine.runtime.forward_batch import ForwardMode
from specserve.engine.runtime.worker import ForwardInputs
from specserve.engine.scheduler.schedule_batch import Req, ReqStatus, ScheduleBatch
from specserve.engine.spec.eagle_worker import SpecDecodeInputs


class SchedulerMetrics:
    def __init__(self):
        self.num_steps = 0
        self.host_blocked_seconds = 0.0   # waiting for results (copy_done)
        self.num_verify_steps = 0
        self.num_spec_tokens = 0
        self.num_retractions = 0

    @property
    def mean_accept_length(self) -> float:
        return self.num_spec_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


class Scheduler:
    def __init__(self, *, worker, ctx, req_to_token, allocator, future_map, vocab_size: int,
                 max_running_requests: int, chunked_prefill_size: int, max_context_len: int,
                 enable_overlap: bool, eos_ids, needs_cpu_seq_lens: bool, spec=None):
        self.worker = worker
        self.ctx = ctx
        self.device = ctx.device
        self.req_to_token = req_to_token
        self.allocator = allocator
        self.future_map = future_map
        self.vocab_size = vocab_size
        self.max_running = max_running_requests
        self.chunk_budget = chunked_prefill_size if chunked_prefill_size > 0 else 1 << 62
        self.max_context_len = max_context_len
        self.enable_overlap = enable_overlap
        self.eos_ids = list(eos_ids)
        self.needs_cpu_seq_lens = needs_cpu_seq_lens
        self.spec = spec
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []          # hold a row (prefilling or decoding)
        self.reqs: dict[str, Req] = {}
        self.inflight: collections.deque[ScheduleBatch] = collections.deque()
        self.last_read_done = None
        self.pending_outputs: list[StepOutput] = []
        self.metrics = SchedulerMetrics()
        self._admit_counter = 0
        self._sampling_key, self._sampling = None, None
        self._serial = 0

    # --- requests ------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a validated request (Engine.add_request checks the rid and the prompt)."""
        req.fill_ids = list(req.prompt_ids)
        self._serial += 1
        req.serial = self._serial  # unique for the engine's lifetime, unlike a client's rid
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.status is ReqStatus.FINISHED:
            return
        self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or bool(self.inflight)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one iteration -------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self._schedule()
        if batch is not None:
            self._launch(batch)
            self.inflight.append(batch)
        keep = 1 if (self.enable_overlap and batch is not None) else 0
        while len(self.inflight) > keep:
            self._process(self.inflight.popleft())
        self.metrics.num_steps += batch is not None
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def drain(self) -> None:
        """Process every launched batch (shutdown, leak checks)."""
        while self.inflight:
            self._process(self.inflight.popleft())

    # --- scheduling ----------------------------------------------------------------------
    def _schedule(self) -> Optional[ScheduleBatch]:
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _decode_ready(self) -> list[Req]:
        return [r for r in self.running if not r.is_prefilling and self._can_decode(r)]

    def _can_decode(self, req: Req) -> bool:
        """False once the tokens already in flight reach a length limit (host-known)."""
        projected_outputs = len(req.output_ids) + req.num_inflight_tokens
        projected_len = len(req.prompt_ids) + projected_outputs
        return projected_outputs < req.sampling.max_new_tokens and projected_len < self.max_context_len

    def _schedule_prefill(self) -> Optional[ScheduleBatch]:
        budget = self.chunk_budget
        free = self.allocator.num_free  # slots are taken when the batch's inputs are built
        reqs, chunks = [], []
        # A request in the middle of a chunked prefill goes first.
        for req in self.running:
            if req.is_prefilling and budget > 0:
                n = min(budget, len(req.fill_ids) - req.num_prefilled, free)
                if n == 0:
                    break
                reqs.append(req)
                chunks.append(self._alloc_chunk(req, n))
                budget -= n
                free -= n
        # Admit only what leaves room for the next decode step of every running request and of
        # the new one (a speculative step reserves several slots each): admitting into slots
        # that step needs would force a retraction straight away.
        step_slots = self.worker.slots_per_request()
        headroom = sum(self._slots_to_reserve(r) for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_running \
                and self.req_to_token.num_free > 0:
            req = self.waiting[0]
            if req.num_inflight_tokens:   # retracted with a result still in flight
                break
            req.fill_ids = req.prompt_ids + req.output_ids
            n = min(budget, len(req.fill_ids))
            if n + headroom + step_slots > free:
                break
            headroom += step_slots
            self.waiting.popleft()
            req.row = self.req_to_token.alloc()
            req.status = ReqStatus.RUNNING
            req.num_prefilled = req.kv_committed_len = req.kv_allocated_len = 0
            self._admit_counter += 1
            req.admit_order = self._admit_counter
            self.running.append(req)
            reqs.append(req)
            chunks.append(self._alloc_chunk(req, n))
            budget -= n
            free -= n
        if not reqs:
            return None
        samples = [end == len(r.fill_ids) for r, (_, end) in zip(reqs, chunks)]
        for r, s in zip(reqs, samples):
            r.num_inflight_tokens += s
        return ScheduleBatch(ForwardMode.EXTEND, reqs, chunks=chunks, samples=samples)

    def _alloc_chunk(self, req: Req, n: int) -> tuple[int, int]:
        start = req.num_prefilled
        req.num_prefilled += n
        req.kv_committed_len = req.kv_allocated_len = start + n
        return start, start + n

    def _schedule_decode(self) -> Optional[ScheduleBatch]:
        reqs = self._decode_ready()
        if not reqs:
            if any(r.is_prefilling for r in self.running) and not self.inflight:
                self._retract_one()  # every holder is stuck mid-prefill on a full pool
            return None
        # A retracted request leaves the batch before anything is launched or reserved for it.
        while self.allocator.num_free < sum(self._slots_to_reserve(r) for r in reqs):
            self._retract_one()
            reqs = self._decode_ready()
            if not reqs:
                return None
        for r in reqs:
            r.num_inflight_tokens += 1  # at least one token per step, speculative or not
        return ScheduleBatch(ForwardMode.DECODE, reqs)

    def _slots_to_reserve(self, req: Req) -> int:
        """Slots a decode step must add so that the row covers committed + the worker's need."""
        want = min(req.kv_committed_len + self.worker.slots_per_request(), self.req_to_token.row_width)
        return max(0, want - req.kv_allocated_len)

    def _reserve_decode_slots(self, reqs: list[Req]) -> torch.Tensor:
        width = self.req_to_token.row_width
        flat = []
        for r in reqs:
            n = self._slots_to_reserve(r)
            flat += range(r.row * width + r.kv_allocated_len, r.row * width + r.kv_allocated_len + n)
            r.kv_allocated_len += n
        slots = self.allocator.alloc(len(flat))
        self._write_req_to_token(flat, slots)
        return slots

    def _retract_one(self) -> None:
        """Free the most recently admitted request's KV and queue it again (outputs stay exact:
        it will be prefilled again over prompt + outputs)."""
        if len(self.running) <= 1:
            # The engine caps max_context_len so that one request's peak KV fits the pool
            # (Engine._fit_context_to_pool); a lone request short of slots means lost slots.
            raise RuntimeError(f"KV pool accounting is broken: {self.allocator.num_free} of "
                               f"{self.allocator.num_slots} slots free for a lone request")
        victim = max(self.running, key=lambda r: r.admit_order)
        self.metrics.num_retractions += 1
        self._release_kv(victim)
        victim.status = ReqStatus.WAITING
        self.waiting.appendleft(victim)

    # --- launching -----------------------------------------------------------------------
    def _write_req_to_token(self, flat_index: list[int], slots: torch.Tensor) -> None:
        """Schedule-side table write, after the last forward finished reading the table."""
        if self.last_read_done is not None:
            self.ctx.schedule_wait(self.last_read_done)
        idx = torch.tensor(flat_index, dtype=torch.int64).to(self.device, non_blocking=True)
        self.req_to_token.table.view(-1)[idx] = slots

    def _launch(self, batch: ScheduleBatch) -> None:
        inputs = (self._extend_inputs if batch.mode is ForwardMode.EXTEND else self._decode_inputs)(batch)
        batch.result, self.last_read_done = self.worker.launch(inputs)
        batch.keep_alive.append(inputs)

    def _to_device(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _sampling_info(self, reqs: list[Req]) -> SamplingInfo:
        """Rebuilt only when the batch's requests change (its tensors are read-only, so batches
        still in flight may share it)."""
        key = tuple(r.serial for r in reqs)
        if key != self._sampling_key:
            self._sampling_key = key
            self._sampling = SamplingInfo.build([r.sampling for r in reqs], [r.seed for r in reqs],
                                                [len(r.prompt_ids) for r in reqs], self.eos_ids,
                                                self.vocab_size, self.device)
        return self._sampling

    def _extend_inputs(self, batch: ScheduleBatch) -> ForwardInputs:
        width = self.req_to_token.row_width
        ids, positions, flat, sample_rows, prompt_rows, prompt_tokens = [], [], [], [], [], []
        shifted = []  # EAGLE draft rows read token p + 1; the sampled token fills the last slot
        for i, (req, (start, end)) in enumerate(zip(batch.reqs, batch.chunks)):
            ids += req.fill_ids[start:end]
            shifted += req.fill_ids[start + 1:end + 1] + [0] * batch.samples[i]
            positions += range(start, end)
            flat += range(req.row * width + start, req.row * width + end)
            sample_rows.append(len(ids) - 1)
            if batch.samples[i]:
                prompt_rows += [req.row] * len(req.fill_ids)
                prompt_tokens += req.fill_ids
        slots = self.allocator.alloc(len(ids))
        self._write_req_to_token(flat, slots)
        lens = [end - start for start, end in batch.chunks]
        seq_lens = [end for _, end in batch.chunks]
        rows = self._to_device([r.row for r in batch.reqs])
        batch.sampling_info = self._sampling_info(batch.reqs)
        sampled_rows = [r.row if s else 0 for r, s in zip(batch.reqs, batch.samples)]
        return ForwardInputs(
            mode=ForwardMode.EXTEND, input_ids=self._to_device(ids), positions=self._to_device(positions),
            req_pool_indices=rows, prefix_lens=self._to_device([s for s, _ in batch.chunks]),
            extend_lens_cpu=lens, extend_lens=self._to_device(lens), out_cache_loc=slots,
            seq_lens_cpu=seq_lens if self.needs_cpu_seq_lens else None, max_seq_len=max(seq_lens),
            sample_rows=self._to_device(sample_rows), sampling_info=batch.sampling_info,
            stash_rows=self._to_device(sampled_rows),
            presence_init=(rows, self._to_device(prompt_rows), self._to_device(prompt_tokens))
            if batch.sampling_info.any_penalty else None,
            extras={} if self.spec is None else {
                "shifted_ids": self._to_device(shifted),
                "samples": self._to_device(batch.samples, torch.bool)})

    def _decode_inputs(self, batch: ScheduleBatch):
        reqs = batch.reqs
        batch.sampling_info = self._sampling_info(reqs)
        if self.spec is not None:
            return self._spec_decode_inputs(batch)
        # The token being fed sits at index kv_committed_len; its KV is written now.
        positions = [r.kv_committed_len for r in reqs]
        slots = self._reserve_decode_slots(reqs)
        for r in reqs:
            r.kv_committed_len += 1
        seq_lens = [p + 1 for p in positions]
        rows = self._to_device([r.row for r in reqs])
        return ForwardInputs(
            mode=ForwardMode.DECODE, input_ids=-rows, positions=self._to_device(positions),
            req_pool_indices=rows, prefix_lens=self._to_device(positions),
            extend_lens_cpu=[1] * len(reqs), extend_lens=torch.ones_like(rows), out_cache_loc=slots,
            seq_lens_cpu=seq_lens if self.needs_cpu_seq_lens else None,
            max_seq_len=max(seq_lens), sample_rows=torch.arange(len(reqs), device=self.device),
            sampling_info=batch.sampling_info, stash_rows=rows)

    def _spec_decode_inputs(self, batch: ScheduleBatch) -> SpecDecodeInputs:
        """The host does not know the lengths after the in-flight verify: the FutureMap has
        them on the device, and the over-reserved slots cover whatever they turn out to be."""
        reqs = batch.reqs
        self._reserve_decode_slots(reqs)
        rows_cpu = [r.row for r in reqs]
        rows = self._to_device(rows_cpu)
        seq_lens, seq_lens_cpu = self.future_map.resolve_seq_lens(rows, rows_cpu)
        return SpecDecodeInputs(req_pool_indices=rows, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
                                max_seq_len=max(r.kv_allocated_len for r in reqs),
                                sampling_info=batch.sampling_info)

    # --- results -------------------------------------------------------------------------
    def _process(self, batch: ScheduleBatch) -> None:
        result = batch.result
        t0 = time.perf_counter()
        result.copy_done.synchronize()
        self.metrics.host_blocked_seconds += time.perf_counter() - t0
        tokens = result.token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        lengths = result.accept_lens.tolist() if result.accept_lens is not None else None
        for i, req in enumerate(batch.reqs):
            if batch.mode is ForwardMode.EXTEND and not batch.samples[i]:
                continue
            req.num_inflight_tokens -= 1
            if req.status is ReqStatus.FINISHED:
                continue
            if lengths is None:
                self._deliver(req, [tokens[i]], None if logprobs is None else [logprobs[i]])
                continue
            n = lengths[i]
            if req.status is ReqStatus.RUNNING:
                req.kv_committed_len += n
            req.num_verify_steps += 1
            self.metrics.num_verify_steps += 1
            self.metrics.num_spec_tokens += n
            self._deliver(req, tokens[i][:n], None if logprobs is None else logprobs[i][:n],
                          num_drafts=n - 1)

    def _deliver(self, req: Req, tokens: list[int], logprobs: Optional[list[float]],
                 num_drafts: int = 0) -> None:
        """Append a step's tokens, cutting exactly where plain decoding would have stopped, and
        emit them. A verify's first `num_drafts` tokens are accepted drafts (the last is the
        target's own); only the drafts kept in the output count."""
        kept, finish_reason = self._append_tokens(req, tokens, logprobs)
        req.num_accepted_drafts += min(kept, num_drafts)
        if finish_reason is None:
            self._emit(req)
        else:
            self._finish(req, finish_reason)

    def _append_tokens(self, req: Req, tokens: list[int],
                       logprobs: Optional[list[float]]) -> tuple[int, Optional[str]]:
        """Returns how many tokens were kept and the finish reason, if one was reached."""
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            if req.sampling.logprobs and logprobs is not None:
                req.logprobs = (req.logprobs or []) + [logprobs[j]]
            n_out = len(req.output_ids)
            if tok in req.stop_ids and n_out > req.sampling.min_new_tokens:
                req.matched_stop = tok
                return j + 1, "stop"
            if n_out >= req.sampling.max_new_tokens or req.seq_len >= self.max_context_len:
                return j + 1, "length"
        return len(tokens), None

    def _emit(self, req: Req) -> None:
        new = req.output_ids[req.num_emitted:]
        finished = req.status is ReqStatus.FINISHED
        if not new and not finished:
            return
        lps = req.logprobs[req.num_emitted:] if req.logprobs is not None else None
        req.num_emitted = len(req.output_ids)
        self.pending_outputs.append(StepOutput(
            rid=req.rid, new_token_ids=new, new_logprobs=lps, finished=finished,
            finish_reason=req.finish_reason, matched_stop=req.matched_stop,
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            num_verify_steps=req.num_verify_steps, num_accepted_drafts=req.num_accepted_drafts))

    def _finish(self, req: Req, reason: str) -> None:
        if req.status is ReqStatus.RUNNING:
            self._release_kv(req)
        elif req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        del self.reqs[req.rid]
        self._emit(req)

    def _release_kv(self, req: Req) -> None:
        """Free a request's slots and row. Safe while a launched forward still uses them:
        later writes to them are ordered after it (stream order and the read-done barrier)."""
        if req.kv_allocated_len:
            self.allocator.free(self.req_to_token.table[req.row, :req.kv_allocated_len].clone())
        self.req_to_token.free(req.row)
        self.running.remove(req)
        req.row = 0
        req.num_prefilled = req.kv_committed_len = req.kv_allocated_len = 0
