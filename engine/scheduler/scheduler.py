"""The scheduler: continuous batching with chunked prefill, retraction and abort, in two loops.

Normal loop: schedule a batch, launch it, process its result. Overlap loop: schedule and
launch batch N+1, then process batch N, so the host works while the device runs. Every
value batch N+1 needs from batch N (the sampled token, speculative lengths) travels through
the FutureMap on the device; the host's own view lags one step and is corrected when N's
result is processed. A request that finished in N is still in N+1: its result is skipped.

The jobs are split: `AdmissionPolicy` decides what runs, `RequestSlots` maps KV slots,
the worker builds device inputs and launches, `OutputProcessor` turns results into outputs.

Structured outputs: the scheduler never touches a matcher. Every matcher lives in the grammar
process (grammar/process.py): the scheduler sends it each request's grammar when the request is
added (admission waits until it compiled), the worker a plan of each constrained step it
launches, and the scheduler a drop when a request ends; the device hands the process the tokens
the masks depend on and waits for the masks on the device (grammar/channel.py). So constrained
and mixed batches keep the overlap loop like any other, and the scheduler thread never waits
for them. Greedy constrained decode steps replay CUDA graphs like the others (the worker
chooses; mixed batches included).

Tensor parallelism: only rank 0 has the grammar process, and every scheduler must make the same
decisions. So nothing the service says is read where only rank 0 could read it: the engine
collects it between steps (`hear_grammars`) and hands it to every rank with the step's request
changes (`take_grammar_news`), and the one read that must follow a result (was the service dead
when a constrained batch's result came back?) is rank 0's value on every rank (`rank0_value`).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Optional

from specserve.engine.forward_batch import ForwardMode
from specserve.engine.grammar.process import GONE, GrammarService
from specserve.engine.layers.sampler import SamplingInfo
from specserve.engine.outputs import FinishError, StepOutput, StepStat
from specserve.engine.runtime.step import Launched, MixedStep, Worker
from specserve.engine.scheduler.output_processor import OutputProcessor
from specserve.engine.scheduler.policy import AdmissionPolicy
from specserve.engine.scheduler.request_slots import RequestSlots
from specserve.engine.scheduler.schedule_batch import Decision, InflightBatch, Req, ReqStatus
from specserve.engine.scheduler.step_cost import StepCostSample
from specserve.engine.scheduler.step_log import StepLog

logger = logging.getLogger("specserve.engine")
# How long an otherwise idle step waits for a grammar being compiled (instead of spinning).
GRAMMAR_WAIT_SECONDS = 0.005


class SchedulerMetrics:
    def __init__(self, policy: AdmissionPolicy):
        self._policy = policy
        self.num_steps = 0
        self.host_blocked_seconds = 0.0   # waiting for results (copy_done)
        self.num_verify_steps = 0
        self.num_spec_tokens = 0
        self.num_mixed_steps = 0          # decode steps that carried prompt chunks (MIXED)
        self.num_mixed_prompt_tokens = 0  # the prompt tokens they computed
        # Steps processed since the last take_step_stats() (the engine process sends them with
        # its outputs); bounded, for an engine whose steps nobody takes (benches, tests).
        self.step_stats: collections.deque[StepStat] = collections.deque(maxlen=4096)

    def take_step_stats(self) -> list[StepStat]:
        stats = list(self.step_stats)
        self.step_stats.clear()
        return stats

    @property
    def num_retractions(self) -> int:
        return self._policy.num_retractions

    @property
    def mean_accept_length(self) -> float:
        return self.num_spec_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


class Scheduler:
    def __init__(self, *, worker: Worker, slots: RequestSlots, policy: AdmissionPolicy,
                 outputs: OutputProcessor, vocab_size: int, eos_ids, enable_overlap: bool,
                 speculative: bool, grammars: Optional[GrammarService] = None,
                 rank0_value: Optional[Callable[[Any], Any]] = None,
                 finished: Optional[Callable[[list[int], list[int]], None]] = None,
                 tp_rank: Optional[int] = None, clock: Callable[[], float] = time.perf_counter,
                 step_log: Optional[StepLog] = None):
        """grammars: the grammar process (a follower rank's stand-in, grammar/ranks.py); None:
        no tokenizer for grammars. rank0_value: rank 0's value of something every rank passes
        its own of (tensor parallelism: the control group's broadcast); None: one rank.
        finished: told each sequence's prompt and output tokens when it ends (suffix drafting's
        corpus, spec/suffix.py). tp_rank: this rank (tensor parallelism; None: one rank): the
        priced steps' times that refine the mixed steps' cost model are rank 0's on every rank
        (`take_step_costs`), as every rank must make the same decisions. clock: the host's
        clock for the requests' stamps and the steps' times (tests pass a fake one). step_log:
        where every step is logged (--step-log; None: off)."""
        self.worker = worker
        self.slots = slots
        self.policy = policy
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.enable_overlap = enable_overlap
        self.speculative = speculative
        self.reqs: dict[tuple[str, int], Req] = {}   # by (rid, sequence index)
        self._num_sequences: dict[str, int] = {}    # unfinished sequences per rid
        self.inflight: collections.deque[InflightBatch] = collections.deque()
        self.pending_outputs: list[StepOutput] = []
        self.metrics = SchedulerMetrics(policy)
        self._sampling_key, self._sampling = None, None
        self._serial = 0
        self.grammars = grammars
        self._rank0_value = rank0_value or (lambda value: value)
        self._compiling: list[Req] = []   # waiting for their grammar to compile
        self._idle_for_grammar = False    # the last step ran nothing, waiting for a compile
        self._constrained: dict[int, Req] = {}  # unfinished requests with a grammar, by serial
        self._last_result_at = 0.0        # clock() of the last processed batch's result
        self._finished = finished
        self._tp_rank = tp_rank
        self._step_costs: list[StepCostSample] = []  # rank 0's, for take_step_costs (tp > 1)
        self.clock = clock
        self.step_log = step_log

    # --- requests ------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a validated sequence (Engine.add_request checks the rid and the prompt)."""
        self._serial += 1
        req.serial = self._serial
        if not req.received_at:
            req.received_at = self.clock()
        self.reqs[req.key] = req
        self._num_sequences[req.rid] = self._num_sequences.get(req.rid, 0) + 1
        spec = req.sampling.grammar
        if spec is not None:  # Engine.add_request refused it when there is no compiler
            self.tend_grammars()  # an idle engine restarts a dead service before using it
            # Keyed by serial: a rid may come back once its request ended.
            req.grammar = self.grammars.add(req.serial, spec, req.stop_ids)
            self._constrained[req.serial] = req
            self._compiling.append(req)
        self.policy.add(req)

    def has_request(self, rid: str) -> bool:
        return rid in self._num_sequences

    def abort(self, rid: str, index: Optional[int] = None) -> None:
        """Abort every sequence of a request, or only sequence `index`."""
        keys = [(rid, index)] if index is not None else \
            [key for key in self.reqs if key[0] == rid] if rid in self._num_sequences else []
        for key in keys:
            req = self.reqs.get(key)
            if req is not None:
                self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or bool(self.inflight)

    @property
    def num_running(self) -> int:
        return len(self.policy.running)

    @property
    def num_waiting(self) -> int:
        return len(self.policy.waiting)

    # --- one iteration: schedule -> launch -> process ----------------------------------------
    def step(self) -> list[StepOutput]:
        decision = self.policy.schedule(nothing_in_flight=not self.inflight)
        if decision is not None:
            launched_at = self.clock()
            launched = self._launch(decision)
            for r in decision.extend_reqs:
                if not r.admitted_at:
                    r.admitted_at = launched_at
            self.inflight.append(InflightBatch(decision, launched, launched_at,
                                               len(self.policy.running) - len(decision.reqs)))
            if self.step_log is not None:
                self.step_log.launched(self.policy, launched_at, self.clock() - launched_at)
        self._idle_for_grammar = decision is None and bool(self._compiling) and not self.inflight
        keep = 1 if (self.enable_overlap and decision is not None) else 0
        while len(self.inflight) > keep:
            self._process(self.inflight.popleft())
        self.metrics.num_steps += decision is not None
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def drain(self) -> None:
        """Process every launched batch (shutdown, leak checks)."""
        while self.inflight:
            self._process(self.inflight.popleft())

    def close_step_log(self) -> None:
        """Write the step log's last rows and stop logging (shutdown, after `drain`)."""
        if self.step_log is not None:
            self.step_log.close()
            self.step_log = None

    def hear_grammars(self) -> Optional[tuple[list, bool]]:
        """Rank 0's (or the only rank's) news from the grammar service since the last step:
        (messages, whether it is dead), None if there is nothing to tell. The engine hands it to
        every rank's `take_grammar_news` before the next step. Restarts a dead service first
        where it may; after a step that ran nothing but wait for a compile, waits a few ms for
        the answer instead of spinning."""
        if self.grammars is None or not self.grammars.started:
            return None
        self.tend_grammars()
        messages = self.grammars.poll(GRAMMAR_WAIT_SECONDS if self._idle_for_grammar else 0.0)
        dead = self.grammars.dead
        return (messages, dead) if messages or dead else None

    def take_grammar_news(self, messages: list, dead: bool) -> None:
        """What the grammar process said (`hear_grammars`): a request whose grammar compiled may
        be admitted; one that failed to compile (a bad grammar, or over its budget:
        INVALID_ARGUMENT) or whose matcher failed (INTERNAL) ends with an error. If the process
        is `dead`, every constrained request ends (UNAVAILABLE; unconstrained ones go on)."""
        for kind, serial, error in messages:
            req = self._constrained.get(serial)
            if req is None:
                continue  # finished meanwhile
            if kind == "compiled":
                req.grammar.ready = True
                req.grammar.error = error = None if error is None else FinishError(*error)
            elif error is not None:  # a matcher refused a committed token
                error = FinishError("INTERNAL", error)
            if error is not None:
                logger.warning("request %s: structured output failed (%s): %s", req.rid, kind, error.message)
                self._finish(req, "error", error)
        for req in list(self._constrained.values()):
            if dead or req.grammar.error is not None:
                self._finish(req, "error", req.grammar.error or GONE)
        self._compiling = [r for r in self._compiling
                           if not r.grammar.ready and r.status is not ReqStatus.FINISHED]

    def tend_grammars(self) -> None:
        """Restart a dead grammar service once no constrained step is in flight (every
        constrained request has ended by then)."""
        if (self.grammars is not None and self.grammars.restartable and not self._constrained
                and not any(r.grammar is not None for b in self.inflight for r in b.decision.reqs)):
            self.grammars.restart()

    def _launch(self, decision: Decision) -> Launched:
        # The rows whose sampled token counts: a prefill chunk that does not end its prefill
        # samples nothing its matcher may see.
        samples = decision.samples if decision.mode is ForwardMode.EXTEND else [True] * len(decision.reqs)
        keys = [r.serial if r.grammar is not None and sampled else None
                for r, sampled in zip(decision.reqs, samples)]
        grammar = tuple(keys) if any(k is not None for k in keys) else None
        if decision.mode is ForwardMode.EXTEND:
            step = self.slots.extend_step(decision, self._sampling_info(decision.reqs))._replace(grammar=grammar)
            launched = self.worker.launch_extend(step)
        elif decision.mode is ForwardMode.MIXED:  # a grammar only in its decode rows (mixed_batch.py)
            launched = self.worker.launch_mixed(
                self._mixed_step(decision, None if grammar is None else grammar[:decision.num_decode]))
        else:
            step = self.slots.decode_step(decision.reqs, self._sampling_info(decision.reqs),
                                          commit_fed_token=not self.speculative)
            launched = self.worker.launch_decode(step._replace(grammar=grammar))
        self.slots.last_read_done = launched.read_done
        return launched

    def _mixed_step(self, decision: Decision, grammar: Optional[tuple]) -> MixedStep:
        """The decode rows' step (their SamplingInfo is the one plain decode steps reuse;
        `grammar`: the keys of the step's rows, whose chunks carry none), then the chunks'
        (slots in that order: the decode reservation was counted first)."""
        decode_reqs, extend_reqs = decision.decode_reqs, decision.extend_reqs
        decode = self.slots.decode_step(decode_reqs, self._sampling_info(decode_reqs),
                                        commit_fed_token=not self.speculative)._replace(grammar=grammar)
        chunks = decision._replace(mode=ForwardMode.EXTEND, reqs=extend_reqs, num_decode=0)
        extend = self.slots.extend_step(chunks, self._build_sampling(extend_reqs))
        self.metrics.num_mixed_steps += 1
        self.metrics.num_mixed_prompt_tokens += sum(end - start for start, end in decision.chunks)
        return MixedStep(decode, extend)

    def _sampling_info(self, reqs: list[Req]) -> SamplingInfo:
        """Rebuilt only when the batch's requests change (its tensors are read-only, so batches
        still in flight may share it)."""
        key = tuple(r.serial for r in reqs)
        if key != self._sampling_key:
            self._sampling_key = key
            self._sampling = self._build_sampling(reqs)
        return self._sampling

    def _build_sampling(self, reqs: list[Req]) -> SamplingInfo:
        return SamplingInfo.build([r.sampling for r in reqs], [r.seed for r in reqs],
                                  [len(r.prompt_ids) for r in reqs], self.eos_ids,
                                  self.vocab_size, self.slots.ctx.device)

    # --- results -------------------------------------------------------------------------
    def _process(self, batch: InflightBatch) -> None:
        t0 = self.clock()
        result = batch.launched.result.wait()
        done = self.clock()
        self.metrics.host_blocked_seconds += done - t0
        decision = batch.decision
        extend = decision.mode is ForwardMode.EXTEND  # a mixed step counts as a decode step
        seconds = done - max(batch.launched_at, self._last_result_at)
        self.metrics.step_stats.append(StepStat(
            extend, seconds,
            sum(end - start for start, end in decision.chunks) if extend else len(decision.decode_reqs),
            batch.num_others, 0 if extend else batch.launched.draft_depth))
        self._last_result_at = done
        if self.step_log is not None:
            self.step_log.processed(batch, seconds, done - t0)
        if decision.priced:
            self._price(StepCostSample(self.policy.forward_tokens(decision), seconds))
        tokens = result.token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        lengths = result.accept_lens.tolist() if result.accept_lens is not None else None
        top = _top_lists(result.top_ids, result.top_logprobs)
        if decision.mode is ForwardMode.EXTEND and result.prompt_logprobs is not None:
            self._deliver_prompt_logprobs(decision, result)
        # Its masks may have been the all-allowed ones of a dead service's released channel.
        released = (any(r.grammar is not None for r in decision.reqs)
                    and self._rank0_value(self.grammars.dead))
        # Rows from `prefill_from` on are prefill chunks (decision.samples); a mixed
        # speculative step gives each the token its chunk sampled in column 0.
        prefill_from = len(decision.reqs) - len(decision.extend_reqs)
        for i, req in enumerate(decision.reqs):
            prefill = i >= prefill_from
            if prefill and not decision.samples[i - prefill_from]:
                continue
            req.num_inflight_tokens -= 1
            if req.status is ReqStatus.FINISHED:
                continue
            if req.grammar is not None and released:
                self._finish(req, "error", GONE)
                continue
            k = req.sampling.top_logprobs
            num_before = len(req.output_ids)
            if lengths is None or prefill:
                token = tokens[i] if lengths is None else tokens[i][0]
                reason = self.outputs.deliver(req, [token], None if logprobs is None else [logprobs[i]],
                                              None if top is None else [top[i][:k]])
            else:
                n = lengths[i]
                if req.status is ReqStatus.RUNNING:
                    req.commit(n)
                req.num_verify_steps += 1
                self.metrics.num_verify_steps += 1
                self.metrics.num_spec_tokens += n
                reason = self.outputs.deliver(req, tokens[i][:n],
                                              None if logprobs is None else logprobs[i][:n],
                                              None if top is None else [t[:k] for t in top[i][:n]],
                                              num_drafts=n - 1)
            if not req.first_token_at and len(req.output_ids) > num_before:
                req.first_token_at = done
            if reason is not None:
                self._finish(req, reason)
            else:
                if prefill and req.status is ReqStatus.RUNNING:
                    self.slots.cache_prefilled(req)
                self._emit(req)

    def _price(self, sample: StepCostSample) -> None:
        """A priced step's time reaches the cost model now (one rank), or rank 0's reach every
        rank's at the start of the next step (engine/tp.py ObservedStepCosts)."""
        if self._tp_rank is None:
            self.policy.observe_step_costs([sample])
        elif self._tp_rank == 0:
            self._step_costs.append(sample)

    def take_step_costs(self) -> list[StepCostSample]:
        """Rank 0's priced step times since the last call (tp > 1), for every rank's policy."""
        samples, self._step_costs = self._step_costs, []
        return samples

    def _deliver_prompt_logprobs(self, decision: Decision, result) -> None:
        """Hand each request its slice of the scored prompt tokens (concatenated in batch
        order)."""
        logprobs = result.prompt_logprobs.tolist()
        top = _top_lists(result.prompt_top_ids, result.prompt_top_logprobs)
        offset = 0
        for req, span in zip(decision.reqs, decision.prompt_spans):
            if span is None:
                continue
            n, k = span[1] - span[0], req.sampling.prompt_logprobs
            # Delivered even to a finished (aborted) sequence: its request's other sequences
            # share the scores.
            self.outputs.deliver_prompt_logprobs(
                req, logprobs[offset:offset + n],
                None if top is None or not k else [t[:k] for t in top[offset:offset + n]])
            offset += n

    def _emit(self, req: Req) -> None:
        out = self.outputs.emit(req)
        if out is not None:
            self.pending_outputs.append(out)

    def _finish(self, req: Req, reason: str, error: Optional[FinishError] = None) -> None:
        self.policy.remove(req)
        req.error = error
        if req.grammar is not None:  # after every plan that holds it (launch order)
            self.grammars.drop(req.serial)
            del self._constrained[req.serial]
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if self._finished is not None:
            self._finished(req.prompt_ids, req.output_ids)
        del self.reqs[req.key]
        self._num_sequences[req.rid] -= 1
        if not self._num_sequences[req.rid]:
            del self._num_sequences[req.rid]
        self._emit(req)


def _top_lists(ids, logprobs) -> Optional[list]:
    """[..., K] host tensors -> nested lists whose leaves are lists of (token id, logprob)
    pairs. Alternatives of probability 0 (excluded by a grammar or a ban: -inf) are left out:
    they are not likely tokens, and -inf has no JSON form."""
    if ids is None:
        return None

    def pairs(i: list, lp: list) -> list:
        if i and isinstance(i[0], list):
            return [pairs(a, b) for a, b in zip(i, lp)]
        return [(t, v) for t, v in zip(i, lp) if v != float("-inf")]

    return [pairs(i, lp) for i, lp in zip(ids.tolist(), logprobs.tolist())]
