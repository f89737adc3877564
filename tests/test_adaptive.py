"""Adaptive speculation: the depth choice against a stub step-time table (spec/adaptive.py), and
the engine's output unchanged by any choice of depths (spec/adaptive_worker.py)."""
from __future__ import annotations

import collections
import random
import time

import pytest
import torch

from helpers import TP_PLACEMENTS, random_prompts, tp_placement

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.spec.adaptive import AcceptanceEstimate, DepthPolicy, StepTimes, expected_tokens

# Milliseconds, shaped like the H100 8B numbers: at bs=1 a 3-draft chain step costs
# ~1.1x a plain one, at bs=64 1.55x.
TIMES = StepTimes({1: {0: 6.0, 1: 6.2, 3: 6.6, 5: 7.2},
                   16: {0: 7.0, 1: 7.6, 3: 8.5, 5: 9.6},
                   64: {0: 10.0, 1: 12.0, 3: 15.5, 5: 19.0}})


ROWS = list(range(1, 65))


def _policy(probe_every: int = 4, prior: float = 0.5, decay: float = 0.5, max_probe_every: int = 16) -> DepthPolicy:
    return DepthPolicy(TIMES, AcceptanceEstimate(64, prior=prior, decay=decay), probe_every=probe_every,
                       max_probe_every=max_probe_every)


def test_expected_tokens():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(0.9, 0) == 1.0


def test_deep_drafts_at_small_batches_plain_at_large_ones_with_poor_acceptance():
    policy = _policy()
    assert policy.best(1, 0.8) == 5
    assert policy.best(1, 0.02) == 0        # 1.02 tokens for 1.03x the time
    # The same acceptance: one draft pays at bs=1 (1.2 tokens, 1.03x), not at bs=64 (1.2x).
    assert policy.best(1, 0.2) == 1 and policy.best(64, 0.2) == 0
    # bs=64 at a middling rate: a 3-draft step's 1.74 tokens for 1.55x lose to one draft.
    assert policy.best(64, 0.45) == 1
    assert policy.best(64, 0.7) == 3


@pytest.mark.parametrize("margin", [0.0, 0.03])
def test_the_choice_maximises_tokens_per_second(margin):
    """The fastest depth, or within the margin of it; never below plain decoding."""
    policy = DepthPolicy(TIMES, AcceptanceEstimate(64), deeper_margin=margin)
    for rate in [i / 20 for i in range(21)]:
        for bs in (1, 2, 16, 40, 64, 200):
            chosen = policy.best(bs, rate)
            speed = {d: expected_tokens(rate, d) / TIMES.seconds(bs, d) for d in TIMES.depths}
            assert speed[chosen] * (1 + margin) >= max(speed.values())
            assert speed[chosen] >= speed[0]


def test_batches_between_buckets_take_the_next_larger_bucket():
    assert TIMES.seconds(2, 3) == TIMES.seconds(16, 3) == 8.5
    assert TIMES.seconds(17, 0) == 10.0
    assert TIMES.seconds(500, 5) == 19.0   # past the largest: the largest
    assert TIMES.depths == (0, 1, 3, 5)


def test_acceptance_estimate_counts_truncated_runs_per_row():
    est = AcceptanceEstimate(8, prior=0.5, decay=0.5)
    est.update(3, [1, 2], [4, 4])            # every draft accepted: 3 of 3 tried a row
    assert est.rate([1]) == est.rate([1, 2]) == pytest.approx((0.5 * 0.5 + 3) / (0.5 * 1 + 3))
    assert est.rate([3]) == 0.5              # a row no step ran: the prior
    est.update(0, [1, 2, 3], [1, 1, 1])      # plain steps say nothing
    assert est.rate([1, 2]) == pytest.approx((0.5 * 0.5 + 3) / (0.5 * 1 + 3))
    for _ in range(20):
        est.update(3, [3, 4], [1, 2])        # 0 of 1 tried, 1 of 2
    assert est.rate([3]) == pytest.approx(0.0, abs=1e-4) and est.rate([4]) == pytest.approx(0.5, abs=1e-4)
    assert est.rate([3, 4]) == pytest.approx(1 / 3, abs=1e-4)  # pooled: 1 of 3 tried
    est.reset([1])                            # a new request in row 1: the traffic's rate
    assert est.rate([1]) == pytest.approx(est.traffic_rate()) == pytest.approx(1 / 3, abs=1e-4)


def test_a_new_request_starts_at_the_traffic_rate_not_the_prior():
    """Where drafts fail for every request, a new one starts near 0, not at the optimistic
    prior: its first steps are plain, not a dozen losing deep ones."""
    policy = _policy(prior=0.9)
    est = policy.estimate
    assert est.traffic_rate() == 0.9         # nothing tried yet: the prior
    for _ in range(30):
        est.update(5, [1, 2], [1, 1])         # every draft rejected
    est.reset([3])
    assert est.rate([3]) < 0.05 and policy.choose([3]) == 0


def test_a_batch_is_chosen_for_by_its_own_requests():
    policy = _policy()
    est = policy.estimate
    for _ in range(10):
        est.update(5, [1], [6])              # row 1 accepts everything
        est.update(5, [2], [1])              # row 2 nothing
    assert policy.choose([1]) == 5 and policy.choose([2]) == 0


def test_falls_back_to_plain_and_probes_back_when_acceptance_recovers():
    policy = _policy(prior=0.9)
    est = policy.estimate
    assert policy.choose(ROWS) == 5
    for _ in range(6):
        est.update(5, ROWS, [1] * 64)        # nothing accepted: plain wins
    assert est.rate(ROWS) < 0.1
    chosen = [policy.choose(ROWS) for _ in range(60)]
    # Plain, with a probe at the smallest depth after 4 plain steps in a row, then (nothing
    # accepted by the probes) 8, 16, and 16 again: the cap.
    probes = [i for i, d in enumerate(chosen) if d]
    assert set(chosen) == {0, 1} and probes == [4, 13, 30, 47]
    for _ in range(6):
        est.update(1, ROWS, [2] * 64)        # the probes are accepted again
    assert policy.choose(ROWS) == 5
    for _ in range(6):
        est.update(5, ROWS, [1] * 64)        # and no longer: plain, probing after 4 again
    assert [policy.choose(ROWS) for _ in range(5)] == [0, 0, 0, 0, 1]


def test_a_step_observed_moves_its_bucket_and_depth_only():
    times = StepTimes({1: {0: 1.0, 3: 2.0}, 8: {0: 4.0, 3: 6.0}})
    times.observe(2, 3, 10.0, weight=0.25)    # bs=2 pads to bucket 8
    assert times.seconds(8, 3) == 7.0
    assert (times.seconds(1, 0), times.seconds(1, 3), times.seconds(8, 0)) == (1.0, 2.0, 4.0)
    times.observe(1, 0, 1.5, weight=1.0)
    assert times.seconds(1, 0) == 1.5
    times.observe(1, 3, 100.0, weight=0.25)  # an outlier counts as twice the current time
    assert times.seconds(1, 3) == 2.5


def test_depths_measured_too_high_relax_back_and_are_tried_again():
    """Plain steps measured 1.5x their time for a run (another part's host work delaying their
    reads) priced plain out at no acceptance; the deeper steps chosen then relax plain's time
    back toward its start-up value, until plain is chosen (and measured) again."""
    times = StepTimes({16: {0: 7.0, 1: 7.6}})
    policy = DepthPolicy(times, AcceptanceEstimate(64, prior=0.0), relax=0.05)
    assert policy.choose(ROWS[:16]) == 0
    for _ in range(8):
        policy.observe(16, 0, 10.5)                # plain steps measured at 1.5x
    assert policy.choose(ROWS[:16]) == 1 and times.seconds(16, 0) > 7.6
    chosen = []
    for _ in range(40):
        chosen.append(policy.choose(ROWS[:16]))
        policy.observe(16, chosen[-1], {0: 7.0, 1: 7.6}[chosen[-1]])   # their true times
    assert chosen[0] == 1 and chosen[-1] == 0 and times.seconds(16, 0) < 7.6
    # Without relaxing, plain would never be tried again.
    stuck = DepthPolicy(StepTimes({16: {0: 7.0, 1: 7.6}}), AcceptanceEstimate(64, prior=0.0), relax=0.0)
    for _ in range(8):
        stuck.observe(16, 0, 10.5)
    assert all(stuck.choose(ROWS[:16]) == 1 for _ in range(40))


def test_one_slow_step_does_not_price_the_best_depth_out():
    """A host pause of 100x a step, once, while the deepest runs: it stays the choice."""
    policy = DepthPolicy(StepTimes({1: {0: 0.38, 1: 0.38, 4: 0.38, 7: 0.38}}), AcceptanceEstimate(4, prior=0.9))
    assert policy.choose([1]) == 7
    policy.observe(1, 7, 38.0)
    assert [policy.choose([1]) for _ in range(3)] == [7, 7, 7]


def test_deeper_drafts_priced_by_kernels_but_free_in_wall_time_go_deepest():
    """The start-up table (device time alone) makes 7 drafts cost 1.7x 4, more than the 8
    tokens against 5 that whole copies give, so depth 4 wins; the loop's steps then take the
    same wall time at every depth (the host's per-step work dominates: the demo pair at bs=1),
    and once observed the deepest wins, after a few tries of the cheap depth it had not run."""
    device = {0: 0.08, 1: 0.09, 4: 0.12, 7: 0.204}
    policy = DepthPolicy(StepTimes({1: device}), AcceptanceEstimate(4, prior=0.5, decay=0.5))
    for _ in range(20):
        policy.estimate.update(4, [1], [5])  # every draft accepted
    chosen = []
    for _ in range(40):
        depth = policy.choose([1])
        chosen.append(depth)
        policy.observe(1, depth, 0.38)       # wall time per step, whatever the depth
    assert chosen[0] == 4
    assert chosen[-20:] == [7] * 20
    assert chosen.count(7) > 30 and 0 not in chosen   # plain: never worth a try at this acceptance
    # Without observing, the device-only table keeps choosing depth 4.
    fixed = DepthPolicy(StepTimes({1: device}), policy.estimate, observe_weight=0.0)
    fixed.observe(1, 4, 0.38)
    assert fixed.choose([1]) == 4 and fixed.times.seconds(1, 4) == 0.12


@pytest.mark.parametrize("seconds,field", [
    ({}, "step_times"),
    ({1: {1: 5.0, 3: 6.0}}, "step_times"),            # no plain step
    ({1: {0: 5.0, 3: 6.0}, 8: {0: 5.0}}, "step_times"),  # buckets disagree on depths
    ({1: {0: 5.0, 3: 0.0}}, "step_times"),
])
def test_bad_tables_are_refused_naming_the_field(seconds, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        StepTimes(seconds)


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^prior:"):
        AcceptanceEstimate(4, prior=1.5)
    with pytest.raises(ValueError, match=r"^decay:"):
        AcceptanceEstimate(4, decay=1.0)
    with pytest.raises(ValueError, match=r"^probe_every:"):
        DepthPolicy(TIMES, AcceptanceEstimate(4), probe_every=0)
    with pytest.raises(ValueError, match=r"^relax:"):
        DepthPolicy(TIMES, AcceptanceEstimate(4), relax=1.5)
    with pytest.raises(ValueError, match=r"^max_probe_every:"):
        DepthPolicy(TIMES, AcceptanceEstimate(4), probe_every=8, max_probe_every=4)
    with pytest.raises(ValueError, match=r"^observe_weight:"):
        DepthPolicy(TIMES, AcceptanceEstimate(4), observe_weight=1.5)
    with pytest.raises(ValueError, match="deeper_margin"):
        DepthPolicy(TIMES, AcceptanceEstimate(4), deeper_margin=-0.1)


# --- the engine: any choice of depths leaves the output unchanged ---------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers import make_predictable_pair

    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


class RandomDepths:
    """A stand-in policy: a seeded random depth per step (the worker's depths, plain included)."""

    def __init__(self, depths, seed: int):
        self.depths = depths
        self.rng = random.Random(seed)
        self.chosen = []

    def choose(self, rows) -> int:
        self.chosen.append(self.rng.choice(self.depths))
        return self.chosen[-1]

    def observe(self, batch_size: int, depth: int, seconds: float) -> None:
        pass


def _spec(pair, algorithm: str, **kwargs) -> SpecConfig:
    """A chain of 4 drafts; "eagle-tree": 4 levels of width 2, the 7 best nodes verified."""
    draft = None if algorithm in ("ngram", "suffix") else pair[1]
    if algorithm == "eagle-tree":
        return SpecConfig(algorithm="eagle", draft_model=draft, num_steps=4, topk=2, num_draft_tokens=8,
                          adaptive=True, **kwargs)
    return SpecConfig(algorithm=algorithm, draft_model=draft, num_steps=4, num_draft_tokens=5, adaptive=True,
                      **kwargs)


def _randomise(engine, seed: int) -> RandomDepths:
    worker = engine.core.worker
    worker.policy = RandomDepths(sorted(worker.workers), seed)
    return worker.policy


@pytest.fixture(scope="module")
def reference(pair):
    from specserve.engine import Engine, EngineConfig

    prompts = random_prompts(8, seed=3, max_len=24)
    params = [SamplingParams(max_new_tokens=[3, 30][i % 2], temperature=[0.0, 0.8][i % 3 == 2],
                             seed=100 + i, n=2 if i == 5 else 1, ignore_eos=True) for i in range(8)]
    with Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    return prompts, params, [o.token_ids for o in outs]


@pytest.mark.parametrize("algorithm", ["eagle", "eagle-tree", "ngram", "suffix"])
@pytest.mark.parametrize("overlap", [False, True])
def test_random_depths_leave_greedy_and_seeded_outputs_unchanged(pair, reference, make_engine, algorithm, overlap):
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair, algorithm), enable_overlap=overlap)
    assert sorted(engine.core.worker.workers) == [0, 1, 2, 4]
    policy = _randomise(engine, seed=7)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert set(policy.chosen) == {0, 1, 2, 4}
    if algorithm == "eagle-tree":  # width 2 at every depth: 2 + 4 (d - 1) candidates, 7 verified at most
        shapes = {d: tuple(w.drafter.shape) for d, w in engine.core.worker.workers.items()}
        assert shapes == {0: (2, 0, 1), 1: (2, 1, 3), 2: (2, 2, 7), 4: (2, 4, 8)}
    # Each decode step reports the depth it ran (the server's specserve_spec_decode_steps).
    decodes = [s.draft_depth for s in engine.take_step_stats() if not s.extend]
    assert collections.Counter(decodes) == collections.Counter(policy.chosen)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle-tree"])
def test_random_depths_under_graphs_and_retraction(pair, reference, make_engine, monkeypatch, algorithm):
    """Every depth's captured step (the CPU stand-in), requests retracted in between."""
    from helpers import graphed_engine

    prompts, params, expected = reference
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=_spec(pair, algorithm),
                                    max_total_tokens=110)
    _randomise(engine, seed=8)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert engine.metrics.num_retractions > 0
    replayed = {id(g) for g, _, _ in graphs.replays}
    for worker in engine.core.worker.workers.values():  # greedy or sampled variants
        assert replayed & {id(g) for g in (worker.graphs, *worker.sampled_graphs.values())}
    # Plain steps' rows got their drafter state back through the captured refresh.
    assert id(engine.core.worker.drafter._refresh_graphs[0]) in replayed


def _drafted_tokens(engine) -> list:
    """Every draft's tokens, in step order (each depth's drafter's `draft` wrapped)."""
    drafted = []
    for worker in engine.core.worker.workers.values():
        def draft(s, snap, run=worker.drafter.draft):
            nodes = run(s, snap)
            drafted.append(nodes.tokens.clone())
            return nodes
        worker.drafter.draft = draft
    return drafted


@pytest.mark.parametrize("algorithm", ["eagle", "eagle-tree"])
def test_plain_steps_defer_the_draft_state_and_refresh_it_exactly(pair, reference, make_engine, algorithm):
    """A plain (depth-0) step of a draft model only stores its rows' draft KV; the next deeper
    step first drafts their state again (`refresh`). Its drafts equal those of an engine whose
    plain steps ran the full draft extend, step for step (the same random depths); outputs
    equal plain decoding's."""
    prompts, params, expected = reference
    drafted, refreshed = {}, []
    for refreshes in (True, False):
        engine = make_engine(pair[0], spec=_spec(pair, algorithm))
        worker = engine.core.worker
        assert worker.drafter.refreshes_state  # an EAGLE head stores its KV alone
        worker.drafter.refreshes_state = refreshes
        for sub in worker.workers.values():
            sub.drafter.refreshes_state = refreshes
            if refreshes:
                refresh = sub.drafter.refresh
                sub.drafter.refresh = lambda rows, *a, run=refresh: (refreshed.append(rows.tolist()), run(rows, *a))
        policy = _randomise(engine, seed=9)
        drafted[refreshes] = _drafted_tokens(engine)
        assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
        assert 0 in policy.chosen
    assert refreshed and all(rows for rows in refreshed)
    assert len(drafted[True]) == len(drafted[False]) > 0
    for i, (ours, full) in enumerate(zip(drafted[True], drafted[False])):
        assert torch.equal(ours, full), (i, ours, full)


def test_start_up_measures_every_depth_and_acceptance_feeds_the_policy(pair, make_engine):
    engine = make_engine(pair[0], spec=_spec(pair, "eagle"), max_running_requests=4)
    worker = engine.core.worker
    times = worker.policy.times
    assert times.buckets == [1, 4] and times.depths == (0, 1, 2, 4)
    assert all(times.seconds(bs, d) > 0 for bs in (1, 4) for d in times.depths)
    # Measured times are the machine's: choose by a table where drafting is free, so that the
    # steps draft (and their acceptance is measured) whatever this machine timed.
    worker.policy = DepthPolicy(StepTimes({4: {d: 1.0 for d in times.depths}}), worker.estimate, observe_weight=0.0)
    rows = list(range(1, 5))
    before = worker.estimate.rate(rows)
    prompts = random_prompts(4, seed=5, max_len=20)
    engine.generate(prompt_token_ids=prompts, sampling=SamplingParams(max_new_tokens=30, temperature=0.0,
                                                                      ignore_eos=True))
    # The predictable pair accepts most drafts: its rows' estimate rose from the prior.
    assert worker.estimate.rate(rows) > before


class Recorded(DepthPolicy):
    """The policy, its choices recorded."""

    chosen: list

    def choose(self, rows) -> int:
        self.chosen.append(super().choose(rows))
        return self.chosen[-1]


@pytest.mark.parametrize("spec_cost,expected_depth", [(10.0, 0), (1.0, 4)], ids=["costly", "free"])
def test_the_engine_runs_the_depth_its_policy_picks(pair, make_engine, monkeypatch, spec_cost, expected_depth):
    """A stub table where drafting costs 10x a plain step: plain steps (and a probe now and
    then); where it costs nothing: the deepest. The output is plain decoding's either way."""
    prompts = random_prompts(3, seed=6, max_len=16)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=params)]
    engine = make_engine(pair[0], spec=_spec(pair, "eagle"))
    worker = engine.core.worker
    table = StepTimes({4: {d: 1.0 if d == 0 else spec_cost for d in worker.workers}})
    worker.policy = Recorded(table, worker.estimate, probe_every=8, observe_weight=0.0)
    worker.policy.chosen = []
    launched = []  # (depth of the worker that ran the step, its verify's node count)
    for depth, sub in worker.workers.items():
        def launch(step, refresh=(), depth=depth, sub=sub, run=sub.launch_decode):
            launched.append((depth, sub.verifier.shape.num_draft_tokens))
            return run(step, refresh)
        monkeypatch.setattr(sub, "launch_decode", launch)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    chosen = worker.policy.chosen
    assert chosen.count(expected_depth) > len(chosen) * 0.8
    assert launched == [(d, d + 1) for d in chosen]
    assert worker.depth_steps == collections.Counter(chosen)


def test_the_engine_feeds_each_steps_wall_time_to_the_table(pair, reference, make_engine):
    """Each step the policy chose reports its wall time (host clocks, between result reads):
    with weight 1 the table holds the last one measured, a plausible step time. The output
    stays plain decoding's."""
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair, "ngram"))
    worker = engine.core.worker
    start = {d: 1e6 for d in worker.workers}   # far above any real step: every one observed moves it
    worker.policy = Recorded(StepTimes({8: start}), worker.estimate, observe_weight=1.0)
    worker.policy.chosen = []
    t0 = time.perf_counter()
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    elapsed = time.perf_counter() - t0
    # Equal at the start: the deepest first (the most tokens); once measured it is far cheaper
    # than the others' 1e6 s, which no step then measures.
    ran = set(worker.policy.chosen)
    assert ran
    for d in worker.workers:
        seconds = worker.policy.times.seconds(8, d)
        assert (0 < seconds < elapsed) if d in ran else seconds == 1e6


def test_adaptive_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^spec.adaptive:"):
        SpecConfig(adaptive="yes")


@pytest.mark.parametrize("placement", TP_PLACEMENTS)
def test_tp_ranks_take_rank0s_step_times(pair, reference, make_engine, placement):
    """tp > 1: outputs equal plain decoding's (every rank runs the same depths: a rank choosing
    its own would run other graphs, other collectives); rank 0's step times reach its own
    policy only as the control message every rank applies at the next step's start."""
    size, device = tp_placement(placement)
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair, "eagle"), tp_size=size, **device)
    worker = engine.core.worker
    applied = []
    apply = worker.observe_step_times
    worker.observe_step_times = lambda observed: (applied.extend(observed), apply(observed))
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    decodes = sum(n for d, n in worker.depth_steps.items())
    # Each decode step's time is applied at a later step's start, the last ones still queued.
    assert 0 < len(applied) <= decodes and len(applied) + len(worker.take_step_times()) == decodes
    assert {seen.depth for seen in applied} <= set(worker.depth_steps)


def test_cli_turns_adaptive_on():
    from specserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--speculative-algorithm", "ngram",
                                      "--speculative-adaptive"])
    assert engine_config_from_args(args).spec == SpecConfig(algorithm="ngram", adaptive=True)
    plain = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x"])
    assert engine_config_from_args(plain).spec == "default"


# --- GPU (pytest -m gpu) ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["eagle", "eagle-tree", "ngram", "suffix"])
def test_gpu_adaptive_graphs_every_depth_and_keeps_outputs(pair, reference, make_engine, algorithm):
    """Graphs for every depth, a table measured from their replays, random depths equal to
    plain decoding, and the policy's own steps without a blocking host sync."""
    from helpers import steady_state_steps

    prompts, params, expected = reference
    engine = make_engine(pair[0], device="cuda", attention_backend="triton", max_running_requests=16,
                         spec=_spec(pair, algorithm))
    worker = engine.core.worker
    assert engine.core.uses_cuda_graphs and all(w.graphs is not None for w in worker.workers.values())
    assert worker.policy.times.buckets == worker.deepest.graphs.buckets
    policy = worker.policy
    _randomise(engine, seed=9)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    worker.policy = policy
    steady_state_steps(engine, [5, 6, 7, 8])


def test_a_near_tie_goes_to_the_shallower_depth():
    """Where no draft is accepted, a deeper depth measured 1 % cheaper (wall-clock noise) is not
    taken; one that pays by more than the margin is."""
    times = StepTimes({1: {0: 6.15, 1: 6.09, 3: 7.0}})
    policy = DepthPolicy(times, AcceptanceEstimate(4, prior=0.0))
    assert policy.best(1, rate=0.0) == 0
    assert DepthPolicy(times, AcceptanceEstimate(4), deeper_margin=0.0).best(1, rate=0.0) == 1
    assert policy.best(1, rate=0.05) == 1     # 1.05 tokens for 6.09 ms: 6 % over plain
    assert policy.best(1, rate=0.9) == 3
