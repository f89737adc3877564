"""Turning a step's host results into request outputs: append, stop, emit."""
from __future__ import annotations

from typing import Optional

from specserve.engine.outputs import StepOutput, TopLogprobs
from specserve.engine.scheduler.schedule_batch import Req, ReqStatus


class OutputProcessor:
    def __init__(self, max_context_len: int):
        self.max_context_len = max_context_len

    def deliver(self, req: Req, tokens: list[int], logprobs: Optional[list[float]],
                top: Optional[list[TopLogprobs]] = None, num_drafts: int = 0) -> Optional[str]:
        """Append a step's tokens, cutting exactly where plain decoding would have stopped;
        returns the finish reason if one was reached. A verify's first `num_drafts` tokens
        are accepted drafts (the last is the target's own); only the drafts kept count.
        `top`: each token's top_logprobs alternatives, already cut to the request's k."""
        kept, reason = len(tokens), None
        keep_logprobs = req.sampling.logprobs and logprobs is not None
        if keep_logprobs and req.logprobs is None:
            req.logprobs = []
        keep_top = req.sampling.top_logprobs > 0 and top is not None
        if keep_top and req.top_logprobs is None:
            req.top_logprobs = []
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            if keep_logprobs:
                req.logprobs.append(logprobs[j])  # appended: a copy per token grew quadratically
            if keep_top:
                req.top_logprobs.append(top[j])
            n_out = len(req.output_ids)
            if tok in req.stop_ids and n_out > req.sampling.min_new_tokens:
                req.matched_stop, reason = tok, "stop"
            elif n_out >= req.sampling.max_new_tokens or req.seq_len >= self.max_context_len:
                reason = "length"
            if reason is not None:
                kept = j + 1
                break
        req.num_accepted_drafts += min(kept, num_drafts)
        return reason

    @staticmethod
    def deliver_prompt_logprobs(req: Req, logprobs: list[float],
                                top: Optional[list[TopLogprobs]]) -> None:
        """A prefill chunk's scored prompt tokens (Req.take_prompt_span), in order."""
        req.prompt_scores.logprobs += logprobs
        if top is not None:
            req.prompt_scores.top_logprobs += top

    @staticmethod
    def emit(req: Req) -> Optional[StepOutput]:
        """The output tokens not handed out yet (and the finish, once finished), if any."""
        new = req.output_ids[req.num_emitted:]
        finished = req.status is ReqStatus.FINISHED
        if not new and not finished:
            return None
        lps = req.logprobs[req.num_emitted:] if req.logprobs is not None else None
        top = req.top_logprobs[req.num_emitted:] if req.top_logprobs is not None else None
        prompt_lps = prompt_top = None
        if req.sampling.prompt_logprobs is not None and not req.prompt_logprobs_emitted:
            req.prompt_logprobs_emitted = True
            prompt_lps = req.prompt_scores.logprobs
            prompt_top = req.prompt_scores.top_logprobs if req.sampling.prompt_logprobs else None
        req.num_emitted = len(req.output_ids)
        stamps = None
        if new and not req.stamps_sent:
            req.stamps_sent = True
            stamps = (req.received_at, req.admitted_at, req.first_token_at)
        return StepOutput(
            rid=req.rid, index=req.index, new_token_ids=new, new_logprobs=lps, new_top_logprobs=top,
            prompt_logprobs=prompt_lps, prompt_top_logprobs=prompt_top, finished=finished,
            finish_reason=req.finish_reason, matched_stop=req.matched_stop,
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            num_verify_steps=req.num_verify_steps, num_accepted_drafts=req.num_accepted_drafts,
            cached_tokens=req.cached_tokens, stamps=stamps, error=req.error)
