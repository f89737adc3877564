"""The mixed step's prompt budget (scheduler/mixed_batch.py prompt_budget) and the step-cost
model it reads (scheduler/step_cost.py): the budget follows the decode batch and the steps'
observed times, within its floor and cap; the scheduler feeds the fit each priced step's
forward tokens and time (a fake clock: every step takes what a known cost says), in both loops,
and rank 0's times on every rank with tensor parallelism."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib
import sys

import pytest

from helpers import FakeClock, drive, make_predictable_pair, random_prompts, record_steps, step_seconds

from specserve.cli import build_parser, engine_config_from_args
from specserve.engine import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.runtime.captured_mixed import TOKEN_BUCKETS
from specserve.engine.scheduler import mixed_batch, policy as policy_module
from specserve.engine.scheduler.mixed_batch import DRAIN_STEPS, DRAIN_TIME_RATIO, FLOOR_SHARE, prompt_budget
from specserve.engine.scheduler.step_cost import (OUTLIER_FACTOR, PRIOR_FIXED_TOKENS, StepCost, StepCostFit,
                                                  StepCostSample)
from specserve.engine.tp import ObservedStepCosts

H100_CHAIN = StepCost(fixed=0.0122, per_token=25e-6, knee=256)  # 8B chain-like: 12.2 ms at 64 rows


# --- the model -------------------------------------------------------------------------------
def test_the_step_cost_prices_tokens_above_its_knee_only():
    cost = StepCost(fixed=0.010, per_token=20e-6, knee=256)
    assert cost.seconds(0) == cost.seconds(256) == 0.010
    assert cost.seconds(756) == pytest.approx(0.020)
    # Within 1.5x of a step at the knee: 5 ms more, 250 tokens; below the knee the tokens up to
    # it come free besides; above it the allowance grows with the step's own tokens.
    assert cost.extra_tokens_within(256, 1.5) == pytest.approx(250)
    assert cost.extra_tokens_within(4, 1.5) == pytest.approx(252 + 250)
    assert cost.extra_tokens_within(1024, 1.5) == pytest.approx(0.5 * (500 + 768))
    assert cost.extra_tokens_within(300, 1.0) == 0
    assert cost.extra_tokens_within(300, 2.0) > cost.extra_tokens_within(300, 1.5)
    assert StepCost(0.010, 0.0, 256).extra_tokens_within(300, 1.5) == math.inf


def _fit(truth: StepCost, tokens, fit=None) -> StepCostFit:
    fit = fit or StepCostFit(knee=truth.knee)
    for n in tokens:
        fit.observe(n, truth.seconds(n))
    return fit


def _spread(n: int, low: int = 256, high: int = 1000) -> list[int]:
    return [low + (i * 97) % (high - low) for i in range(n)]


def test_before_any_step_the_fit_is_the_priors_shape():
    fit = StepCostFit(knee=256, prior_fixed_tokens=1024)
    assert fit.num_samples == 0
    assert fit.model.extra_tokens_within(256, 1.5) == pytest.approx(512)
    assert fit.model.extra_tokens_within(64, 1.5) == pytest.approx(192 + 512)
    for bad in (dict(knee=-1), dict(prior_fixed_tokens=0), dict(half_life_steps=0), dict(prior_weight=-1),
                dict(prior_spread=0)):
        with pytest.raises(ValueError, match="step cost fit"):
            StepCostFit(**bad)


def test_the_fit_finds_the_line_the_steps_lie_on():
    fit = _fit(H100_CHAIN, _spread(300))
    assert fit.num_samples == 300
    assert fit.model.fixed == pytest.approx(H100_CHAIN.fixed, rel=0.1)
    assert fit.model.per_token == pytest.approx(H100_CHAIN.per_token, rel=0.1)
    assert fit.model.knee == 256


def test_without_spread_the_prior_gives_the_slope_through_the_steps_time():
    # Every step at one token count: the steps' time, the prior's shape (fixed = 512 slopes).
    fit = _fit(H100_CHAIN, [300] * 50)
    assert fit.model.seconds(300) == pytest.approx(H100_CHAIN.seconds(300))
    assert fit.model.fixed / fit.model.per_token == pytest.approx(PRIOR_FIXED_TOKENS) == 512


def test_the_fit_follows_the_steps_when_they_change():
    fit = _fit(H100_CHAIN, _spread(300))
    slow = StepCost(H100_CHAIN.fixed, 4 * H100_CHAIN.per_token, 256)
    before = fit.model.extra_tokens_within(256, 1.5)
    _fit(slow, _spread(300), fit)
    assert fit.model.per_token == pytest.approx(slow.per_token, rel=0.1)
    assert fit.model.extra_tokens_within(256, 1.5) < before / 3


def test_an_outlier_step_counts_as_twice_its_prediction_at_most():
    a, b = _fit(H100_CHAIN, _spread(100)), _fit(H100_CHAIN, _spread(100))
    predicted = a.model.seconds(512)
    a.observe(512, 100 * predicted)
    b.observe(512, OUTLIER_FACTOR * predicted)
    assert a.model == b.model
    assert a.model.seconds(512) < 1.2 * predicted


def test_a_line_tilted_down_by_noise_prices_tokens_free():
    fit = StepCostFit(knee=0, prior_weight=1e-6)
    for n, t in ((100, 0.020), (900, 0.010)) * 20:
        fit.observe(n, t)
    assert fit.model.per_token == 0.0 and fit.model.extra_tokens_within(100, 1.5) == math.inf


# --- the budget ----------------------------------------------------------------------------
def test_the_budget_is_what_the_ratio_allows_within_its_floor_and_cap():
    assert prompt_budget(256, 1024, 300.7) == 300
    assert prompt_budget(256, 1024, math.inf) == 1024            # no model: the cap
    assert prompt_budget(256, 1024, 5000.0) == 1024              # the cap holds
    assert prompt_budget(256, 1024, 3.0) == 1024 // FLOOR_SHARE  # the floor: prompts advance
    assert prompt_budget(256, 1024, 0.0) == 128
    assert prompt_budget(4, 2, 0.0) == 1                        # at least one token


# A ladder of graph buckets the expectations below were worked out on (the policy takes any).
LADDER = (64, 128, 256, 512, 768, 1024, 1536, 2048)


def test_the_budget_fills_the_graph_bucket_where_the_ratio_allows_else_shrinks_to_one():
    buckets = LADDER
    assert prompt_budget(256, 1024, math.inf, buckets) == 1280  # 1280 -> the 1536 bucket, filled
    assert prompt_budget(256, 700, 800.0, buckets) == 768      # 956 replays 1024: filled, past the cap
    assert prompt_budget(256, 1024, 600.0, buckets) == 512     # 856 -> 1024 is over: the 768 bucket
    assert prompt_budget(256, 1024, 0.0, buckets) == 256       # the floor's 384 replays 512 anyway
    assert prompt_budget(128, 1024, 0.0, buckets) == 128       # the floor's 256 is a bucket
    assert prompt_budget(2400, 1024, math.inf, buckets) == 1024  # no bucket holds it: eager
    assert prompt_budget(1800, 1024, 100.0, buckets) == 248      # the floor's 1928 replays 2048 anyway
    assert prompt_budget(1800, 1024, 300.0, buckets) == 300      # 2100: eager, as the ratio says
    assert prompt_budget(256, 1024, 300.0) == 300              # no graphs: as the ratio says


def test_waiting_prompt_tokens_raise_the_budget_to_drain_within_a_few_steps():
    assert DRAIN_STEPS == 2 and DRAIN_TIME_RATIO == 2.0
    assert prompt_budget(1024, 1024, 100.0, backlog=1500) == 750           # the backlog's share
    assert prompt_budget(1024, 1024, 100.0, backlog=1501) == 751           # rounded up: it drains
    assert prompt_budget(1024, 1024, 100.0, backlog=1500, stretch=600.7) == 600  # within 2x the step
    assert prompt_budget(256, 1024, 300.0, backlog=200) == 300             # the ratio allows more
    assert prompt_budget(0, 1024, 0.0, backlog=10 ** 6) == 1024            # the cap holds
    assert prompt_budget(0, 1024, math.inf, backlog=10 ** 6) == 1024
    assert prompt_budget(256, 1024, 0.0, backlog=100) == 128               # the floor holds
    assert prompt_budget(256, 1024, 0.0, backlog=10 ** 6, stretch=5.0) == 128


def test_with_graphs_the_budget_shrinks_to_a_smaller_bucket_only_if_it_holds_the_backlogs_share():
    buckets = LADDER
    # 256 rows and 600 allowed: 856 replays 1024, whose fill (768) the ratio does not allow.
    assert prompt_budget(256, 1024, 600.0, buckets) == 512                 # the 768 bucket
    assert prompt_budget(256, 1024, 600.0, buckets, backlog=600) == 512    # 300 fits in it
    assert prompt_budget(256, 1024, 600.0, buckets, backlog=1100) == 768   # 550 does not: filled
    # 256 chain rows (1024 tokens), ~760 prompt tokens arriving a step: the 2048 bucket, filled.
    assert prompt_budget(1024, 1024, 400.0, buckets, backlog=1520) == 1024
    assert prompt_budget(1024, 1024, 400.0, buckets) == 512


def test_the_backlogs_share_never_rounds_up_to_a_bucket_past_the_drain_ratio():
    """Whatever the backlog, a graphed step replays a bucket whose predicted time is within
    DRAIN_TIME_RATIO of its decode rows' step, unless only the floor's own bucket is left."""
    for rows in range(4, 1025, 4):
        within = H100_CHAIN.extra_tokens_within(rows, 1.5)
        stretch = H100_CHAIN.extra_tokens_within(rows, DRAIN_TIME_RATIO)
        tokens = prompt_budget(rows, 1024, within, TOKEN_BUCKETS, 10 ** 6, stretch)
        bucket = next(t for t in TOKEN_BUCKETS if t >= rows + tokens)
        floors = next(t for t in TOKEN_BUCKETS if t >= rows + 1024 // FLOOR_SHARE)
        assert (H100_CHAIN.seconds(bucket) <= DRAIN_TIME_RATIO * H100_CHAIN.seconds(rows) * 1.001
                or bucket == floors), rows


def test_the_closed_loop_simulation_predicts_the_ratio_alone_starves_and_the_backlogs_share_keeps_up():
    """bench/mixed_budget_sim.py (which chose DRAIN_STEPS and DRAIN_TIME_RATIO) at 256 chain
    streams and the prior's costly slope: the shape where the H100 starved the queue."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import mixed_budget_sim as sim

    cost = sim.COSTS["25 us"]
    separate, ratio_only, drained = (sim.simulate(256, policy, cost) for policy in (
        sim.Policy("separate", mixed=False), sim.Policy("ratio only", mixed=True),
        sim.Policy("drained", mixed=True, drain_steps=DRAIN_STEPS)))
    assert ratio_only.tok_s < separate.tok_s <= drained.tok_s
    # the backlog's share keeps up: TTFT in hundreds of ms, not the ratio's seconds; holding the
    # steps within DRAIN_TIME_RATIO costs a cohort's last arrivals some TTFT against separate
    # extends (which stall every stream instead)
    assert ratio_only.ttft_p50 > 4 * drained.ttft_p50 and drained.ttft_p99 < 1.2 * separate.ttft_p99
    assert drained.gap_p99 <= DRAIN_TIME_RATIO * drained.gap_p50


def _budget(cost: StepCost, num_decode: int, graph_tokens=TOKEN_BUCKETS) -> int:
    rows = num_decode * 4  # chain verify rows of 4 tokens
    return prompt_budget(rows, 1024, cost.extra_tokens_within(rows, 1.5), graph_tokens)


def test_the_budget_shrinks_as_the_decode_batch_grows_to_the_knee():
    budgets = [_budget(H100_CHAIN, n, ()) for n in (1, 8, 16, 32, 64)]
    assert budgets == [496, 468, 436, 372, 244]  # 12.2 ms / 2 at 25 us a token, and the knee's rest
    # Graphed: 64 rows (256 tokens) and 244 would replay the 512 bucket (1.52x, over the
    # ratio): the 384 bucket, which holds the floor (128). 32 rows (128 tokens) and 372 would
    # too: the 384 bucket, filled (256).
    assert _budget(H100_CHAIN, 64) == 128 and _budget(H100_CHAIN, 32) == 256


def test_the_budget_shrinks_when_prompt_tokens_prove_slow_and_grows_when_fast():
    fits = {per_token: _fit(StepCost(0.0122, per_token, 256), _spread(200))
            for per_token in (2e-6, 25e-6, 100e-6)}
    budgets = [_budget(fit.model, 64, ()) for fit in fits.values()]
    # Nearly free: the cap; 4x the 8B's cost: the floor.
    assert budgets[0] == 1024 > budgets[1] > budgets[2] == 1024 // FLOOR_SHARE


# --- the engine ----------------------------------------------------------------------------
CAP = 64


@pytest.fixture
def make_engine(make_engine):
    return functools.partial(make_engine, mixed_steps=True, prefill_interleave_tokens=CAP)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _arrivals():
    """Four requests decoding, then a burst of prompts (enough prompt tokens that the budget,
    not the arrivals, sets what rides), then one every other step."""
    prompts = random_prompts(24, seed=21, min_len=20, max_len=60)
    return ([(0, f"d{i}", prompts[i], _greedy(60)) for i in range(4)]
            + [(3 if i < 10 else 2 * i, f"a{i}", prompts[4 + i], _greedy(4)) for i in range(20)])


def _timed_engine(make_engine, tiny_model, truth: StepCost, overlap: bool):
    engine = make_engine(tiny_model, enable_overlap=overlap)
    policy = engine.core.scheduler.policy
    # The tiny model's forwards are tens of tokens: a knee at 0, a prior at that scale (3x
    # cheaper tokens than the slow truth's) whose evidence is worth a few steps there.
    policy.step_cost = StepCostFit(knee=truth.knee, prior_fixed_tokens=64, prior_spread=2)
    FakeClock().drive(engine, step_seconds(truth.fixed, truth.per_token, truth.knee, policy, extend=0.05))
    return engine, record_steps(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_mixed_steps_stay_within_the_ratio_of_the_decode_step_they_carry(tiny_model, make_engine, overlap,
                                                                          monkeypatch):
    # The ratio alone: the backlog's share off (the burst below would raise it to 2x).
    monkeypatch.setattr(mixed_batch, "DRAIN_STEPS", 10 ** 9)
    slow = StepCost(fixed=0.010, per_token=0.0005, knee=0)   # 20 tokens cost half a step
    free = StepCost(fixed=0.010, per_token=0.0, knee=0)
    engine, steps = _timed_engine(make_engine, tiny_model, slow, overlap)
    got = drive(engine, _arrivals())
    fit = engine.core.scheduler.policy.step_cost
    # The scheduler fed the fit every priced step: each mixed step and each decode step but the
    # one owed after an extend (an idle engine's first: the policy's separate-extend order).
    priced = [s for s in steps if s.priced]
    assert fit.num_samples == len(priced)
    assert priced == [s for i, s in enumerate(steps) if not s.extend and not steps[i - 1].extend]
    assert fit.model.per_token == pytest.approx(slow.per_token, rel=0.15)
    assert fit.model.fixed == pytest.approx(slow.fixed, rel=0.15)
    mixed = [s for s in steps if s.mixed]
    assert len(mixed) > 20
    # Once the fit has seen some steps, a mixed step takes at most 1.5x its decode rows' step
    # (up to the fit's error: its steps hardly spread, so the prior still pulls), or it carries
    # no more than the floor.
    floor = CAP // FLOOR_SHARE
    settled = mixed[10:]
    assert settled and all(slow.seconds(s.num_decode + s.computed) <= 1.5 * 1.05 * slow.seconds(s.num_decode)
                           or s.computed <= floor for s in settled)
    assert max(s.computed for s in settled) < CAP / 2
    # Where prompt tokens cost nothing, the same arrivals ride up to the cap.
    engine2, steps2 = _timed_engine(make_engine, tiny_model, free, overlap)
    assert drive(engine2, _arrivals()) == got  # the budget moves when tokens run, never which
    mixed2 = [s for s in steps2 if s.mixed]
    assert max(s.computed for s in mixed2) == CAP
    assert sum(s.computed for s in mixed2) / len(mixed2) > sum(s.computed for s in mixed) / len(mixed)


def _steady_arrivals():
    """Two requests decoding throughout, and a 24-token prompt arriving every step for 40 steps
    (4 outputs each): more prompt tokens a step than the ratio lets ride at the slow cost below
    (half of 20 tokens + the rows), fewer than twice the decode step takes (20 + the rows)."""
    prompts = random_prompts(42, seed=23, min_len=24, max_len=24)
    return ([(0, f"d{i}", prompts[i], _greedy(120)) for i in range(2)]
            + [(3 + i, f"a{i}", prompts[2 + i], _greedy(4)) for i in range(40)])


def _queue_lengths(engine) -> list[int]:
    """The requests queued when each decision is made, from now on."""
    policy, lengths = engine.core.scheduler.policy, []
    schedule = policy.schedule

    def watching(nothing_in_flight: bool):
        lengths.append(len(policy.waiting))
        return schedule(nothing_in_flight)

    policy.schedule = watching
    return lengths


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_backlogs_share_drains_a_queue_that_the_ratio_alone_starves(tiny_model, make_engine, overlap,
                                                                         monkeypatch):
    slow = StepCost(fixed=0.010, per_token=0.0005, knee=0)
    engine, steps = _timed_engine(make_engine, tiny_model, slow, overlap)
    queued = _queue_lengths(engine)
    got = drive(engine, _steady_arrivals())
    monkeypatch.setattr(mixed_batch, "DRAIN_STEPS", 10 ** 9)  # the ratio alone
    starved, steps_starved = _timed_engine(make_engine, tiny_model, slow, overlap)
    queued_starved = _queue_lengths(starved)
    assert drive(starved, _steady_arrivals()) == got  # the budget moves when tokens run, never which
    # Each arrival rides within a step or two; the ratio alone takes about one every other step,
    # so the queue grows for as long as they arrive.
    assert max(queued) <= 2
    assert max(queued_starved) >= 10 and queued_starved.index(max(queued_starved)) > 30
    # The backlog's share stretches a step past the ratio, never past DRAIN_TIME_RATIO (up to
    # the fit's error), or carries no more than the floor.
    settled = [s for s in steps if s.mixed][10:]
    stretch = [slow.seconds(s.num_decode + s.computed) / slow.seconds(s.num_decode) for s in settled]
    assert settled and all(x <= DRAIN_TIME_RATIO * 1.05 or s.computed <= CAP // FLOOR_SHARE
                           for x, s in zip(stretch, settled))
    assert sum(x > 1.5 * 1.05 for x in stretch) > len(settled) / 2
    mean = lambda steps: sum(s.computed for s in steps) / len(steps)  # noqa: E731
    assert mean([s for s in steps_starved if s.mixed][10:]) < 0.75 * mean(settled)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_burst_stretches_the_steps_to_the_drain_ratio_and_no_further(tiny_model, make_engine, overlap):
    slow = StepCost(fixed=0.010, per_token=0.0005, knee=0)
    engine, steps = _timed_engine(make_engine, tiny_model, slow, overlap)
    drive(engine, _arrivals())  # the burst's backlog asks for the cap (64) a step: 3x and more
    settled = [s for s in steps if s.mixed][10:]
    stretch = [slow.seconds(s.num_decode + s.computed) / slow.seconds(s.num_decode) for s in settled]
    assert settled and all(x <= DRAIN_TIME_RATIO * 1.05 or s.computed <= CAP // FLOOR_SHARE
                           for x, s in zip(stretch, settled))
    assert max(stretch) > 1.5 * 1.05


def test_the_backlog_is_the_running_prompts_rest_and_the_queued_requests_counted_up_to_enough(
        tiny_model, make_engine):
    engine = make_engine(tiny_model, enable_overlap=False, chunked_prefill_size=16)
    policy = engine.core.scheduler.policy
    prompts = random_prompts(3, seed=5, min_len=40, max_len=40)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, _greedy(2))
    assert policy._prompt_backlog(math.inf) == 120
    assert policy._prompt_backlog(1) == 40 and policy._prompt_backlog(41) == 80  # the scan stops there
    engine.step()  # r0's first chunk of 16
    assert [r.is_prefilling for r in policy.running] == [True] and len(policy.waiting) == 2
    assert policy._prompt_backlog(math.inf) == 24 + 80
    assert policy._prompt_backlog(1) == 24
    while engine.has_unfinished():
        engine.step()
    assert policy._prompt_backlog(math.inf) == 0


def test_without_a_ratio_there_is_no_model_and_prompts_fill_the_cap(tiny_model, make_engine):
    engine = make_engine(tiny_model, mixed_step_time_ratio=0)
    policy = engine.core.scheduler.policy
    assert policy.step_cost is None
    steps = record_steps(engine)
    drive(engine, _arrivals())
    assert not any(s.extend and s.decoding for s in steps)
    assert max(s.computed for s in steps if s.mixed) == CAP
    assert make_engine(tiny_model, mixed_steps=False).core.scheduler.policy.step_cost is None


def test_with_tensor_parallelism_rank_0_sends_its_step_times_to_every_rank(tiny_model, make_engine):
    """Rank 0 keeps its priced steps' times for the next step's control message (engine/tp.py
    ObservedStepCosts), which every rank's policy takes at the same point, rank 0's too (a
    stand-in group records what rank 0 sends)."""
    engine = make_engine(tiny_model)
    core = engine.core
    core.scheduler._tp_rank = 0
    FakeClock().drive(engine, step_seconds(0.010, 0.0005, 0, core.scheduler.policy, extend=0.05))
    sent = []

    class Group:
        def exchange(self, changes):
            sent.append(changes)
            return changes

    engine.core = dataclasses.replace(core, tp_group=Group())
    try:
        steps = record_steps(engine)
        drive(engine, _arrivals()[:8])
    finally:
        engine.core = core
    samples = [sample for changes in sent for change in changes if isinstance(change, ObservedStepCosts)
               for sample in change.samples]
    priced = [s for s in steps if s.priced]
    # Each step sends what was processed since the last; the last results wait for a next step.
    left = core.scheduler.take_step_costs()
    assert [n for n, _ in samples + left] == [s.num_decode + s.computed for s in priced] and samples
    assert all(isinstance(s, StepCostSample) and s.seconds == pytest.approx(0.010 + 0.0005 * s.tokens)
               for s in samples + left)
    assert core.scheduler.policy.step_cost.num_samples == len(samples)


def test_a_speculative_step_prices_each_verify_row_at_its_width(tmp_path, make_engine):
    """Chain speculation: a decode row's forward tokens are its verify nodes (4 here)."""
    target, head = make_predictable_pair(str(tmp_path))
    engine = make_engine(target, spec=SpecConfig(algorithm="eagle", draft_model=head, num_steps=3, topk=1,
                                                 num_draft_tokens=4))
    policy = engine.core.scheduler.policy
    assert policy.mixed_row_tokens == 4
    seen = []
    policy.observe_step_costs = seen.extend
    FakeClock().drive(engine, step_seconds(0.010, 0.0005, 0, policy, extend=0.05))
    steps = record_steps(engine)
    drive(engine, _arrivals()[:8])
    priced = [s for s in steps if s.priced]
    assert any(s.mixed for s in priced) and any(not s.mixed for s in priced)
    assert [n for n, _ in seen] == [4 * s.num_decode + s.computed for s in priced]
    assert [t for _, t in seen] == pytest.approx([0.010 + 0.0005 * (4 * s.num_decode + s.computed) for s in priced])


def test_another_ranks_own_step_times_go_nowhere(tiny_model, make_engine):
    engine = make_engine(tiny_model)
    scheduler = engine.core.scheduler
    scheduler._tp_rank = 1
    drive(engine, _arrivals()[:8])
    assert engine.metrics.num_mixed_steps > 0
    assert scheduler.take_step_costs() == [] and scheduler.policy.step_cost.num_samples == 0
    samples = [StepCostSample(8, 0.01), StepCostSample(40, 0.02)]
    ObservedStepCosts(samples).apply(engine.core)  # rank 0's, at the start of a step
    assert scheduler.policy.step_cost.num_samples == 2


# --- configuration -------------------------------------------------------------------------
def test_the_time_ratio_is_configured_and_checked():
    assert EngineConfig().mixed_step_time_ratio == 1.5
    assert EngineConfig(mixed_step_time_ratio=0).mixed_step_time_ratio == 0
    assert EngineConfig(mixed_step_time_ratio=2).mixed_step_time_ratio == 2
    for bad in (0.5, -1, math.inf, math.nan, True, "1.5"):
        with pytest.raises(ValueError, match="mixed_step_time_ratio"):
            EngineConfig(mixed_step_time_ratio=bad)
    parse = lambda *flags: engine_config_from_args(build_parser().parse_args(["serve", *flags]))  # noqa: E731
    assert parse().mixed_step_time_ratio == 1.5
    assert parse("--mixed-step-time-ratio", "1.2").mixed_step_time_ratio == 1.2


def test_the_cost_model_is_logged_every_so_many_priced_steps(tiny_model, make_engine, caplog, monkeypatch):
    monkeypatch.setattr(policy_module, "LOG_COST_EVERY", 4)
    engine = make_engine(tiny_model)
    policy = engine.core.scheduler.policy
    with caplog.at_level(logging.INFO, logger="specserve.engine"):
        policy.observe_step_costs([StepCostSample(8, 0.01)] * 3)
        assert "cost model" not in caplog.text
        policy.observe_step_costs([StepCostSample(40, 0.02)])
    assert "mixed steps' cost model after 4 steps" in caplog.text
    assert "the last step: 40 tokens, 20.00 ms" in caplog.text
