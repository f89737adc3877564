"""The mixed step's policy: which requests may ride in a mixed forward, and how many prompt
tokens ride with the decode rows.

A mixed step (ForwardMode.MIXED, runtime/mixed_step.py) runs one decode (or speculative
verify) step of the decoding requests and prefill chunks of others in one target forward,
under one token budget: `prefill_interleave_tokens` counts every token the forward computes,
the decode rows' (one each, or the verify width) included, and the prompt chunks get what is
left. So the prompt share shrinks as the decode batch grows (a forward of a few hundred tokens
stays about as fast as the decode step alone on a GPU), down to a quarter of the budget, so
that prompts still advance while a large batch decodes. Where the worker captured mixed-step
graphs (runtime/captured_mixed.py), the share is rounded up to fill the token bucket the step
replays.

A request whose sampling needs per-row device state the mixed forward does not carry rides
in no mixed step: a grammar (the grammar process plans one kind of step per launch), repeat
penalties (the penalty table's prefill init), logprobs and prompt logprobs (their result
shapes). While such a request decodes, the policy keeps the separate-extend order (an extend,
then a decode step owed); when a mixed step's prefill reaches one (mid-prefill, or next in the
admission order), the step stops there and the next one is a separate extend, which takes it.
"""
from __future__ import annotations

from typing import Sequence

from specserve.engine.scheduler.schedule_batch import Req


def rides_mixed(req: Req) -> bool:
    """Whether `req` may be a row of a mixed step (the module's docstring says why not)."""
    p = req.sampling
    return (p.grammar is None and not p.penalises_repeats and not p.logprobs and not p.top_logprobs
            and p.prompt_logprobs is None)


def prompt_budget(step_tokens: int, num_decode: int, row_tokens: int,
                  graph_tokens: Sequence[int] = ()) -> int:
    """Prompt tokens that ride with `num_decode` rows of `row_tokens` each under a budget of
    `step_tokens` for the whole forward: what the rows leave, and at least a quarter; with
    mixed-step graphs of `graph_tokens` tokens (ascending), up to the smallest that holds
    that forward: it replays padded to that many tokens anyway, and prompt tokens in the
    padding's place cost the same."""
    rows = num_decode * row_tokens
    budget = max(step_tokens - rows, step_tokens // 4, 1)
    bucket = next((t for t in graph_tokens if t >= rows + budget), None)
    return budget if bucket is None else bucket - rows
