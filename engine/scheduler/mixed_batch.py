"""The mixed step's policy: which requests may ride in a mixed forward, and how many prompt
tokens ride with the decode rows.

A mixed step (ForwardMode.MIXED, runtime/mixed_step.py) runs one decode (or speculative
verify) step of the decoding requests and prefill chunks of others in one target forward. How
many prompt tokens ride (`prompt_budget`) adapts to the decode batch: the most whose predicted
step time stays within `mixed_step_time_ratio` times the decode step alone's, by the step-cost
model the scheduler fits from the steps it times (scheduler/step_cost.py: prompt tokens are
nearly free while the forward stays under the GEMMs' knee, then each costs its compute). So a
small batch takes prompts up to the knee and then some, a batch whose step is already long
takes proportionally more, and prompt tokens that turn out slow (a costly forward, host work
that grows with them) shrink it. `prefill_interleave_tokens` caps it, and it is at least an
eighth of that cap so that prompts always advance (and TTFT stays bounded) however costly they
look. It also keeps up with the arrivals: while prompt tokens wait (queued requests and the
unprefilled rest of running ones: the backlog), it is at least the backlog over `DRAIN_STEPS`,
so that a queue drains within a few steps whatever the ratio allows (the ratio alone, at a
batch past the knee, can admit fewer prompt tokens a step than arrive: the queue then grows
without bound, fewer streams decode and throughput falls), as long as the step stays within
`DRAIN_TIME_RATIO` of the decode step alone; the ratio bounds it only where the backlog's
share is less than it allows. Where the worker captured mixed-step graphs
(runtime/captured_mixed.py), the step fills the token bucket it replays when that bucket's
predicted time stays within the ratio (padding costs what prompt tokens in its place would, so
the fill may pass the cap), else shrinks to the largest bucket that still holds the floor and
the backlog's share (a step just over a bucket pays the next one's time), but never rounds the
backlog's share up to a bucket past DRAIN_TIME_RATIO (it shrinks to the largest bucket within
it: a CPU closed loop's step log at 256 chain streams showed 2.4-2.8x steps before).

Every request decodes in mixed steps: its rows are the step's decode rows, which sample as
a decode step's (a grammar's told to the grammar process as a decode step's, ONE or SPEC;
repeat penalties from the history table; logprobs and top alternatives in the step's result,
the chunks' rows padded). A request whose prefill needs what the chunks do not carry is
prefilled alone (`rides_mixed`): a grammar (a chunk that ended its prefill would sample its
first token under a mask in the same launch, and the grammar process plans one kind of step a
launch), repeat penalties (the penalty table's prefill init), logprobs (the first token's) and
prompt logprobs (the scored prompt spans). When a mixed step's prefill reaches one
(mid-prefill, or next in the admission order), the step stops there and the next one is a
separate extend, which takes it.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from specserve.engine.scheduler.schedule_batch import Req

FLOOR_SHARE = 8  # a mixed step carries at least prefill_interleave_tokens // FLOOR_SHARE prompt tokens
# A backlog of waiting prompt tokens drains within DRAIN_STEPS mixed steps, as long as that
# keeps the step within DRAIN_TIME_RATIO times the decode step alone (and within the cap): so a
# request waits a couple of steps and a steady arrival rate rides at about that rate every
# step, while a burst (a benchmark's start) cannot stretch the decoding streams' inter-token
# time past twice the usual (issue 41's target: p99 <= 2x p50). In a closed loop each decode
# row brings about prompt x accepted / output tokens a step (~3 at 127 in, 128 out, accept 3),
# fewer than its own verify tokens, so 2x (the step's time again in prompt tokens) keeps up
# with the arrivals at any batch. A host-only simulation of that loop (bench/mixed_budget_sim.py:
# 64 and 256 chain streams, 12.2 ms + 10 or 25 us a token past 256): 2 steps and 2x give
# chunk gap p99 1.2-1.3x p50 at 256 and 1.3-2.1x at 64 (a graph bucket's padding may pass 2x),
# TTFT p99 below separate extends', 8-25 % more tokens/s; the ratio alone starves the queue at
# 256 (as the H100 did); draining all that waits at once (1 step, no time bound) gives p99
# 3.6x at 64 streams; 3 steps queue requests longer for no steadier steps.
DRAIN_STEPS = 2
DRAIN_TIME_RATIO = 2.0
# Prompts ride in mixed steps while the decode rows verify at most this many tokens; a larger
# decode batch takes them in extends of their own (each followed by a decode step). On an H100
# (8B chain, gRPC, 127-token prompts, 1,024 requests a row, closed loop, after the split-KV
# fixes), mixed against separate extends: 64 streams (256 row tokens) chunk gap p99 1.5-2.0x
# p50 against 4.5-5.1x, TTFT p50 50-55 against 72-73 ms, for 4-7 % of tokens/s; 128 streams
# (512) gap 1.9x against 3.9x but 20 % of tokens/s and TTFT p99 868 against 593 ms; 256
# streams (1,024) 16 % of tokens/s, TTFT p50 181 against 116 ms, gap 3.0x against 1.8x.
MIXED_MAX_ROW_TOKENS = 256


def rides_mixed(req: Req) -> bool:
    """Whether `req` may be prefilled in a mixed step's chunks (the module's docstring says why
    not); every request may decode in one."""
    p = req.sampling
    return (p.grammar is None and not p.penalises_repeats and not p.logprobs and not p.top_logprobs
            and p.prompt_logprobs is None)


class PromptBudget(NamedTuple):
    """A mixed step's prompt budget and the term that set it (the step log shows it,
    scheduler/step_log.py): "ratio" (what the step-cost model allows within the time ratio),
    "cap", "floor", "backlog" (the backlog's share), "stretch" (that share held to
    DRAIN_TIME_RATIO, in tokens or in the graph bucket it replays), "bucket" (filled up to the
    graph bucket the step replays), "smaller_bucket" (shrunk to a bucket that holds the least
    where the ratio does not allow the fill)."""

    tokens: int
    bound: str


def prompt_budget(rows: int, cap: int, within: float, graph_tokens: Sequence[int] = (),
                  backlog: int = 0, stretch: float = math.inf) -> int:
    """`plan_prompt_budget`'s tokens."""
    return plan_prompt_budget(rows, cap, within, graph_tokens, backlog, stretch).tokens


def plan_prompt_budget(rows: int, cap: int, within: float, graph_tokens: Sequence[int] = (),
                       backlog: int = 0, stretch: float = math.inf) -> PromptBudget:
    """Prompt tokens that ride with decode rows of `rows` tokens in all (one per plain row, the
    verify width per speculative one): `within` (the most the step-cost model allows within the
    time ratio; math.inf without a model), at most `cap`; at least `cap // FLOOR_SHARE` (and 1)
    and the `backlog` (prompt tokens waiting) over DRAIN_STEPS, that share up to `cap` and up to
    `stretch` (the most the model allows within DRAIN_TIME_RATIO). With mixed-step graphs of
    `graph_tokens` tokens (ascending): the whole bucket the step replays where `within` holds it,
    else the largest smaller bucket that holds that least; where none does, that bucket anyway
    (its padding is paid whatever rides) if `stretch` holds it, else the largest smaller bucket
    within `stretch` that holds the floor, else that bucket; as much as without graphs where no
    bucket holds the step (it runs eagerly). With the term that set it."""
    floor = max(cap // FLOOR_SHARE, 1)
    share = math.ceil(backlog / DRAIN_STEPS)
    drain = int(min(share, stretch, cap))
    least = max(floor, drain)
    allowed = int(min(within, cap))
    budget = max(allowed, least)
    if budget == allowed:
        bound = "cap" if within >= cap else "ratio"
    elif drain > floor:
        bound = "backlog" if share <= min(stretch, cap) else "stretch" if stretch < cap else "cap"
    else:
        bound = "floor"
    bucket = next((t for t in graph_tokens if t >= rows + budget), None)
    if bucket is None:
        return PromptBudget(budget, bound)  # no graph holds the step: it runs eagerly
    fill = PromptBudget(bucket - rows, "bucket" if bucket - rows > budget else bound)
    if bucket - rows <= within:
        return fill
    smaller = [t for t in graph_tokens if rows + least <= t < bucket]
    if smaller:
        return PromptBudget(smaller[-1] - rows, "smaller_bucket")
    # No smaller bucket holds the least: the step replays this one anyway, unless that passes
    # DRAIN_TIME_RATIO, where the largest smaller bucket within it that holds the floor is
    # taken (the backlog's share, held to `stretch` in tokens, must not round up past it: 101
    # chain rows with a 636-token share would replay 1536 tokens, 2.8x their decode step, where
    # 1024 take 2x).
    held = [t for t in graph_tokens if rows + floor <= t < bucket and t - rows <= stretch]
    if bucket - rows > stretch and held:
        return PromptBudget(held[-1] - rows, "stretch")
    return fill
