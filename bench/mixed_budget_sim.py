"""A host-only closed-loop simulation of the mixed step's prompt budget (issue 41), to choose
its constants (scheduler/mixed_batch.py DRAIN_STEPS, DRAIN_TIME_RATIO, the time ratio) before
a GPU run: no model, no engine, the budget from `prompt_budget` itself.

N clients each send a prompt, wait for its outputs and send the next, as bench/serving.py's
closed loop does. A step decodes every prefilled request (chain verify rows of 4 tokens, 1-4
accepted, ~3 on average) and prefills chunks in arrival order (the mid-prefill request first);
its time comes from a StepCost (the fit is taken as exact). "separate" runs prompts in extends
of their own, at most the cap each while someone decodes, a decode step owed after each;
"mixed" lets them ride as `prompt_budget` says (with the mixed graphs' token buckets: a step
pays its bucket's time). Reports tok/s, TTFT and the chunk gaps (time between a stream's
consecutive outputs) as the serving bench does.

    python bench/mixed_budget_sim.py          # ~1 minute on one core
"""
from __future__ import annotations

import math
import random
from statistics import quantiles
from typing import NamedTuple, Optional
from unittest import mock

from specserve.engine.runtime.captured_mixed import TOKEN_BUCKETS
from specserve.engine.scheduler import mixed_batch
from specserve.engine.scheduler.step_cost import StepCost

PROMPT, OUTPUT, VERIFY_WIDTH = 127, 128, 4    # bench/serving.py's text rows, chain speculation
CAP, CHUNK = 1024, 2048                        # prefill_interleave_tokens, chunked_prefill_size
ACCEPTED = (1, 2, 3, 4, 4, 4)                  # tokens a verify step emits, ~3 on average
COSTS = {"10 us": StepCost(0.0122, 10.2e-6, 256),   # an H100 8B chain step: 20 ms at 256 rows
         "25 us": StepCost(0.0122, 25e-6, 256)}     # the step-cost prior's slope (costlier)


class Policy(NamedTuple):
    label: str
    mixed: bool
    ratio: float = 1.5                     # mixed_step_time_ratio
    drain_steps: Optional[int] = None      # None: no backlog term
    time_ratio: float = mixed_batch.DRAIN_TIME_RATIO


class Result(NamedTuple):
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    gap_p50: float
    gap_p99: float


class _Stream:
    def __init__(self, arrival: float):
        self.arrival, self.unfilled, self.outputs, self.last = arrival, PROMPT, 0, arrival


def _chunk_tokens(policy: Policy, cost: StepCost, rows: int, backlog: int, owed: bool) -> int:
    """Prompt tokens the next step may compute (0: a decode step)."""
    if not rows:
        return CHUNK if backlog else 0
    if not policy.mixed:
        return 0 if owed or not backlog else CAP
    within = cost.extra_tokens_within(rows, policy.ratio)
    stretch = cost.extra_tokens_within(rows, policy.time_ratio)
    drain = policy.drain_steps is not None
    with mock.patch.object(mixed_batch, "DRAIN_STEPS", policy.drain_steps or 1):
        return mixed_batch.prompt_budget(rows, CAP, within, TOKEN_BUCKETS, backlog if drain else 0, stretch)


def _step_seconds(cost: StepCost, rows: int, prompt_tokens: int) -> float:
    """A step's time: a mixed one replays the smallest graph bucket that holds it (else runs
    eagerly), a decode step or a separate extend its own tokens."""
    tokens = rows + prompt_tokens
    if rows and prompt_tokens:
        tokens = next((t for t in TOKEN_BUCKETS if t >= tokens), tokens)
    return cost.seconds(tokens)


def simulate(streams: int, policy: Policy, cost: StepCost, requests: int = 512, seed: int = 0) -> Result:
    rng = random.Random(seed)
    now, sent, done, emitted, owed = 0.0, streams, 0, 0, False
    queue = [_Stream(0.0) for _ in range(streams)]
    running: list[_Stream] = []
    ttfts, gaps = [], []
    while done < requests:
        decoding = [s for s in running if not s.unfilled]
        backlog = sum(s.unfilled for s in running) + sum(s.unfilled for s in queue)
        budget = _chunk_tokens(policy, cost, len(decoding) * VERIFY_WIDTH, backlog, owed)
        separate_extend = bool(budget) and (not policy.mixed or not decoding)
        owed = separate_extend and bool(decoding)
        if separate_extend:
            decoding = []
        rows = len(decoding) * VERIFY_WIDTH
        filled, spent = [], 0
        for s in [s for s in running if s.unfilled] + queue:
            if spent == budget:
                break
            n = min(budget - spent, s.unfilled)
            s.unfilled -= n
            spent += n
            if s not in running:
                running.append(s)
            if not s.unfilled:
                filled.append(s)
        queue = [s for s in queue if s not in running]
        now += _step_seconds(cost, rows, spent)
        for s in decoding:
            k = min(rng.choice(ACCEPTED), OUTPUT - s.outputs)
            s.outputs += k
            emitted += k
            gaps.append(now - s.last)
            s.last = now
        for s in filled:
            ttfts.append(now - s.arrival)
            s.outputs, s.last = 1, now
            emitted += 1
        for s in [s for s in running if s.outputs >= OUTPUT]:
            running.remove(s)
            done += 1
            if sent < requests:
                queue.append(_Stream(now))
                sent += 1
    q = lambda xs, p: 1e3 * quantiles(xs, n=100)[p - 1]  # noqa: E731
    return Result(emitted / now, q(ttfts, 50), q(ttfts, 99), q(gaps, 50), q(gaps, 99))


POLICIES = [Policy("separate", mixed=False), Policy("mixed, ratio only", mixed=True)] + [
    Policy(f"mixed, drain {d}, {'no bound' if x == math.inf else f'{x:g}x'}", True, drain_steps=d, time_ratio=x)
    for d in (1, 2, 3) for x in (mixed_batch.DRAIN_TIME_RATIO, math.inf)] + [
    Policy("mixed, ratio 2, drain 2, 2x", True, ratio=2.0, drain_steps=2)]


def main() -> None:
    print(f"closed loop: {PROMPT}-token prompts, {OUTPUT} outputs, chain rows of {VERIFY_WIDTH}, cap {CAP}; "
          f"now DRAIN_STEPS={mixed_batch.DRAIN_STEPS}, DRAIN_TIME_RATIO={mixed_batch.DRAIN_TIME_RATIO:g}")
    for name, cost in COSTS.items():
        print(f"\nstep cost: {cost.fixed * 1e3:.1f} ms + {name} a token past {cost.knee}")
        print(f"{'policy':>30} {'N':>4} {'tok/s':>7} {'TTFT p50':>8} {'p99':>7} {'gap p50':>7} {'p99':>6} {'x':>5}")
        for streams in (64, 256):
            for policy in POLICIES:
                r = simulate(streams, policy, cost)
                print(f"{policy.label:>30} {streams:>4} {r.tok_s:7.0f} {r.ttft_p50:8.1f} {r.ttft_p99:7.1f} "
                      f"{r.gap_p50:7.2f} {r.gap_p99:6.2f} {r.gap_p99 / r.gap_p50:5.2f}")


if __name__ == "__main__":
    main()
