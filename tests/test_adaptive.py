"""Adaptive speculation: the shape choice (chain or tree, and its depth) against a stub
step-time table (spec/adaptive.py), and the engine's output unchanged by any choice of shapes
(spec/adaptive_worker.py)."""
from __future__ import annotations

import collections
import pickle
import random
import time

import pytest
import torch

from helpers import TP_PLACEMENTS, random_prompts, tp_placement

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.spec.adaptive import (PLAIN, AcceptanceEstimate, DraftShape, ShapePolicy, StepTimes,
                                            expected_tokens, level_prior, observe_acceptance)


def _chains(row: dict) -> dict:
    """A table row of chains keyed by depth (0: plain)."""
    return {DraftShape(depth): t for depth, t in row.items()}


# Milliseconds, shaped like the H100 8B numbers: at bs=1 a 3-draft chain step costs
# ~1.1x a plain one, at bs=64 1.55x.
TIMES = StepTimes({1: _chains({0: 6.0, 1: 6.2, 3: 6.6, 5: 7.2}),
                   16: _chains({0: 7.0, 1: 7.6, 3: 8.5, 5: 9.6}),
                   64: _chains({0: 10.0, 1: 12.0, 3: 15.5, 5: 19.0})})
# The same chains and trees of width 4 beside them: at bs=1 a tree costs a little more than
# its chain, at bs=64 much more (its draft forwards run 4 branches, its verify 8 nodes).
TREE_TIMES = StepTimes({1: {**_chains({0: 6.0, 1: 6.2, 3: 6.6, 5: 7.2}),
                            DraftShape(1, 4): 6.4, DraftShape(3, 4): 7.1, DraftShape(5, 4): 7.8},
                        64: {**_chains({0: 10.0, 1: 12.0, 3: 15.5, 5: 19.0}),
                             DraftShape(1, 4): 14.0, DraftShape(3, 4): 22.0, DraftShape(5, 4): 30.0}})


ROWS = list(range(1, 65))


def _policy(probe_every: int = 4, prior: float = 0.5, decay: float = 0.5, max_probe_every: int = 16) -> ShapePolicy:
    return ShapePolicy(TIMES, {1: AcceptanceEstimate(64, prior=prior, decay=decay)}, probe_every=probe_every,
                       max_probe_every=max_probe_every)


def _tree_policy(decay: float = 0.5, **kwargs) -> ShapePolicy:
    """Chains and trees of width 4, each width at its own prior (spec/adaptive_worker.py's)."""
    return ShapePolicy(TREE_TIMES, {w: AcceptanceEstimate(64, prior=level_prior(0.5, w), decay=decay)
                                    for w in (1, 4)}, **kwargs)


def test_expected_tokens():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(0.9, 0) == 1.0


def test_draft_shapes_sort_cheapest_first_and_name_themselves():
    assert TREE_TIMES.shapes == (PLAIN, DraftShape(1), DraftShape(1, 4), DraftShape(3), DraftShape(3, 4),
                                 DraftShape(5), DraftShape(5, 4))
    assert PLAIN == DraftShape(0, 1) and DraftShape(3).width == 1
    assert [str(s) for s in (PLAIN, DraftShape(3), DraftShape(3, 2))] == ["0", "3", "3x2"]
    # The table as the start-up log and bench rows show it: ms by bucket and shape name.
    times = StepTimes({8: {PLAIN: 0.0061, DraftShape(3, 2): 0.0071}, 1: {PLAIN: 0.006, DraftShape(3, 2): 0.007}})
    assert times.milliseconds() == {1: {"0": 6.0, "3x2": 7.0}, 8: {"0": 6.1, "3x2": 7.1}}


def test_deep_drafts_at_small_batches_plain_at_large_ones_with_poor_acceptance():
    policy = _policy()
    assert policy.best(1, {1: 0.8}) == DraftShape(5)
    assert policy.best(1, {1: 0.02}) == PLAIN       # 1.02 tokens for 1.03x the time
    # The same acceptance: one draft pays at bs=1 (1.2 tokens, 1.03x), not at bs=64 (1.2x).
    assert policy.best(1, {1: 0.2}) == DraftShape(1) and policy.best(64, {1: 0.2}) == PLAIN
    # bs=64 at a middling rate: a 3-draft step's 1.74 tokens for 1.55x lose to one draft.
    assert policy.best(64, {1: 0.45}) == DraftShape(1)
    assert policy.best(64, {1: 0.7}) == DraftShape(3)


def test_the_tree_where_its_level_acceptance_pays_its_cost_the_chain_where_not():
    policy = _tree_policy()
    # Chain drafts accepted at 0.6, a tree's levels at 0.8: at bs=1 the 5-level tree's 3.69
    # tokens for 7.8 ms beat the 5-draft chain's 2.38 for 7.2 ms; at bs=64 the tree costs
    # 1.6-1.9x its chain and the 3-draft chain (2.18 tokens, 15.5 ms) wins.
    assert policy.best(1, {1: 0.6, 4: 0.8}) == DraftShape(5, 4)
    assert policy.best(64, {1: 0.6, 4: 0.8}) == DraftShape(3)
    # A tree that accepts little more than the chain does not pay its cost, even at bs=1: a
    # chain (of 3 drafts: the 5-draft chain's 0.5 % more tokens a second are under the margin).
    assert policy.best(1, {1: 0.6, 4: 0.62}) == DraftShape(3)
    # One level of 4 candidates pays at bs=64 where one draft does not (plain's 1 token, 10 ms).
    assert policy.best(64, {1: 0.1, 4: 0.6}) == DraftShape(1, 4)
    assert policy.best(64, {1: 0.1, 4: 0.1}) == PLAIN


@pytest.mark.parametrize("margin", [0.0, 0.03])
@pytest.mark.parametrize("table", [TIMES, TREE_TIMES], ids=["chains", "chains-and-trees"])
def test_the_choice_maximises_tokens_per_second(margin, table):
    """The fastest shape, or within the margin of it; never below plain decoding."""
    widths = sorted({s.width for s in table.shapes})
    policy = ShapePolicy(table, {w: AcceptanceEstimate(64) for w in widths}, costlier_margin=margin)
    rng = random.Random(0)
    for _ in range(200):
        rates = {w: rng.choice([i / 20 for i in range(21)]) for w in widths}
        for bs in (1, 2, 16, 40, 64, 200):
            chosen = policy.best(bs, rates)
            speed = {s: expected_tokens(rates[s.width], s.depth) / table.seconds(bs, s) for s in table.shapes}
            assert speed[chosen] * (1 + margin) >= max(speed.values())
            assert speed[chosen] >= speed[PLAIN]


def test_a_width_never_tried_starts_at_its_prior():
    """Nothing measured: the tree's prior (any of 4 candidates at the chain's 0.5) makes it the
    choice at bs=1, so it is tried; once its steps accept nothing, the chain, never run and
    still at its own prior, takes over."""
    assert level_prior(0.5, 1) == 0.5 and level_prior(0.5, 4) == pytest.approx(0.9375)
    policy = _tree_policy()
    chain, tree = policy.estimates[1], policy.estimates[4]
    assert (chain.rate([1]), tree.rate([1])) == (0.5, pytest.approx(0.9375))
    assert policy.choose([1]) == DraftShape(5, 4)
    for _ in range(10):
        tree.update(5, [1], [1])               # the tree's steps: nothing accepted
    assert chain.rate([1]) == 0.5 and tree.rate([1]) < 0.01
    assert policy.choose([1]) == DraftShape(3)  # 1.875 tokens for 6.6 ms
    tree.reset([2])                           # a new request: each width's own traffic rate
    chain.reset([2])
    assert tree.rate([2]) < 0.01 and chain.rate([2]) == 0.5


def test_each_width_is_chosen_by_its_own_estimate():
    """The estimates are separate: a tree step's counts move the tree's alone, and the choice
    follows whichever width the batch's requests accept at."""
    policy = _tree_policy()
    chain, tree = policy.estimates[1], policy.estimates[4]
    for _ in range(10):
        chain.update(5, [1, 2], [6, 1])        # row 1 accepts every chain draft, row 2 none
        tree.update(5, [1, 2], [1, 6])         # row 2 every tree level, row 1 none
    assert chain.rate([1]) > 0.99 and tree.rate([1]) < 0.01
    assert policy.choose([1]) == DraftShape(5) and policy.choose([2]) == DraftShape(5, 4)
    before = chain.rate([3]), tree.rate([3])
    tree.update(3, [3], [1])
    assert chain.rate([3]) == before[0] and tree.rate([3]) < before[1]


def test_an_unused_widths_estimate_relaxes_toward_its_prior():
    """Each step of another width moves a row's counts by `relax` toward a fresh row's (one
    pseudo-trial at the prior): the rate drifts back to the prior, and its weight to one trial,
    so one step of its own measures it again. Plain steps and rows outside the step keep theirs."""
    chain, tree = AcceptanceEstimate(8, prior=0.5), AcceptanceEstimate(8, prior=0.75, relax=0.05)
    estimates = {1: chain, 2: tree}
    for _ in range(30):
        observe_acceptance(estimates, DraftShape(3, 2), [1, 2], [1, 1])   # the tree: nothing accepted
    fallen, traffic = tree.rate([1]), tree.traffic_rate()
    assert fallen < 0.05 and traffic < 0.05 and chain.rate([1]) == 0.5
    observe_acceptance(estimates, PLAIN, [1, 2], [1, 1])                    # plain: nothing moves
    observe_acceptance(estimates, DraftShape(3), [2], [4])                  # a chain step of row 2
    assert tree.rate([1]) == fallen and fallen < tree.rate([2]) < 0.75 and traffic < tree.traffic_rate()
    for _ in range(200):
        observe_acceptance(estimates, DraftShape(3), [1], [4])              # the chain runs row 1
    assert tree.rate([1]) == pytest.approx(0.75, abs=1e-3)
    tree.update(3, [1], [1])                  # one step of its own, nothing accepted: about halves it
    assert tree.rate([1]) == pytest.approx(0.9 * 0.75 / (0.9 + 1), abs=1e-3)
    still = AcceptanceEstimate(8, prior=0.75, relax=0.0)
    still.update(3, [1], [1])
    before = still.rate([1])
    still.relax([1])
    assert still.rate([1]) == before


@pytest.mark.parametrize("tree_recovers", [True, False], ids=["recovers", "stays-poor"])
def test_a_fallen_width_is_tried_again_while_another_drafts(tree_recovers):
    """bs=1: the tree's drafts fail, the 5-draft chain (2 of 3 tried accepted) takes over. The
    tree's estimate relaxes toward its prior while the chain runs, so it is tried again: where
    its drafts are accepted again (a phase change) it is the choice from then on; where they
    still fail, one step each retry measures it down again and the chain runs the rest. Without
    relaxing the tree is never tried again either way."""
    def run(relax: float) -> list:
        policy = _tree_policy(decay=0.9)
        for est in policy.estimates.values():
            est.relax_weight = relax
        chosen = []
        for step in range(2000):
            shape = policy.choose([1])
            chosen.append(shape)
            accepted = min(shape.depth, 2) if shape.width == 1 else \
                shape.depth if tree_recovers and step >= 200 else 0
            observe_acceptance(policy.estimates, shape, [1], [accepted + 1])
        return chosen

    chosen = run(relax=0.01)
    trees = [step for step, shape in enumerate(chosen) if shape.width > 1]
    assert trees[0] == 0 and chosen[1].width == 1   # its prior: tried first; failed, the chain
    if tree_recovers:
        assert 200 < trees[2] < 600 and chosen[-100:] == [DraftShape(5, 4)] * 100
    else:                                     # retried now and then, one step each time
        assert 3 <= len(trees) < 40 and all(chosen[step + 1].width == 1 for step in trees)
    assert [step for step, shape in enumerate(run(relax=0.0)) if shape.width > 1] == [0]


def test_batches_between_buckets_take_the_next_larger_bucket():
    assert TIMES.seconds(2, DraftShape(3)) == TIMES.seconds(16, DraftShape(3)) == 8.5
    assert TIMES.seconds(17, PLAIN) == 10.0
    assert TIMES.seconds(500, DraftShape(5)) == 19.0   # past the largest: the largest
    assert TIMES.shapes == (PLAIN, DraftShape(1), DraftShape(3), DraftShape(5))


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
    est = policy.estimates[1]
    assert est.traffic_rate() == 0.9         # nothing tried yet: the prior
    for _ in range(30):
        est.update(5, [1, 2], [1, 1])         # every draft rejected
    est.reset([3])
    assert est.rate([3]) < 0.05 and policy.choose([3]) == PLAIN


def test_a_batch_is_chosen_for_by_its_own_requests():
    policy = _policy()
    est = policy.estimates[1]
    for _ in range(10):
        est.update(5, [1], [6])              # row 1 accepts everything
        est.update(5, [2], [1])              # row 2 nothing
    assert policy.choose([1]) == DraftShape(5) and policy.choose([2]) == PLAIN


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "chains-and-trees"])
def test_falls_back_to_plain_and_probes_back_when_acceptance_recovers(trees):
    """The probe is the cheapest shape, the chain of one draft, with or without trees beside it."""
    policy = _tree_policy(probe_every=4, max_probe_every=16) if trees else _policy(prior=0.9)
    deepest = DraftShape(5, 4) if trees else DraftShape(5)
    assert policy.choose(ROWS) == deepest
    for _ in range(6):
        for est in policy.estimates.values():
            est.update(5, ROWS, [1] * 64)    # nothing accepted: plain wins
    assert all(est.rate(ROWS) < 0.1 for est in policy.estimates.values())
    chosen = [policy.choose(ROWS) for _ in range(60)]
    # Plain, with a probe at the smallest depth after 4 plain steps in a row, then (nothing
    # accepted by the probes) 8, 16, and 16 again: the cap.
    probes = [i for i, shape in enumerate(chosen) if shape != PLAIN]
    assert set(chosen) == {PLAIN, DraftShape(1)} and probes == [4, 13, 30, 47]
    for _ in range(6):
        policy.estimates[1].update(1, ROWS, [2] * 64)   # the probes are accepted again
    assert policy.choose(ROWS) == DraftShape(5)       # the chain: the tree's estimate is its own
    for _ in range(6):
        policy.estimates[1].update(5, ROWS, [1] * 64)   # and no longer: plain, probing after 4 again
    assert [policy.choose(ROWS) for _ in range(5)] == [PLAIN] * 4 + [DraftShape(1)]


def test_a_step_observed_moves_its_bucket_and_shape_only():
    times = StepTimes({1: _chains({0: 1.0, 3: 2.0}), 8: _chains({0: 4.0, 3: 6.0})})
    times.observe(2, DraftShape(3), 10.0, weight=0.25)    # bs=2 pads to bucket 8
    assert times.seconds(8, DraftShape(3)) == 7.0
    assert (times.seconds(1, PLAIN), times.seconds(1, DraftShape(3)), times.seconds(8, PLAIN)) == (1.0, 2.0, 4.0)
    times.observe(1, PLAIN, 1.5, weight=1.0)
    assert times.seconds(1, PLAIN) == 1.5
    times.observe(1, DraftShape(3), 100.0, weight=0.25)  # an outlier counts as twice the current time
    assert times.seconds(1, DraftShape(3)) == 2.5
    trees = StepTimes({1: {PLAIN: 1.0, DraftShape(3): 2.0, DraftShape(3, 2): 3.0}})
    trees.observe(1, DraftShape(3, 2), 4.0, weight=0.5)  # the tree's entry, not its chain's
    assert (trees.seconds(1, DraftShape(3)), trees.seconds(1, DraftShape(3, 2))) == (2.0, 3.5)


def test_shapes_measured_too_high_relax_back_and_are_tried_again():
    """Plain steps measured 1.5x their time for a run (another part's host work delaying their
    reads) priced plain out at no acceptance; the deeper steps chosen then relax plain's time
    back toward its start-up value, until plain is chosen (and measured) again."""
    one = DraftShape(1)
    times = StepTimes({16: _chains({0: 7.0, 1: 7.6})})
    policy = ShapePolicy(times, {1: AcceptanceEstimate(64, prior=0.0)}, relax=0.05)
    assert policy.choose(ROWS[:16]) == PLAIN
    for _ in range(8):
        policy.observe(16, PLAIN, 10.5)                # plain steps measured at 1.5x
    assert policy.choose(ROWS[:16]) == one and times.seconds(16, PLAIN) > 7.6
    chosen = []
    for _ in range(40):
        chosen.append(policy.choose(ROWS[:16]))
        policy.observe(16, chosen[-1], {PLAIN: 7.0, one: 7.6}[chosen[-1]])   # their true times
    assert chosen[0] == one and chosen[-1] == PLAIN and times.seconds(16, PLAIN) < 7.6
    # Without relaxing, plain would never be tried again.
    stuck = ShapePolicy(StepTimes({16: _chains({0: 7.0, 1: 7.6})}), {1: AcceptanceEstimate(64, prior=0.0)},
                        relax=0.0)
    for _ in range(8):
        stuck.observe(16, PLAIN, 10.5)
    assert all(stuck.choose(ROWS[:16]) == one for _ in range(40))


def test_one_slow_step_does_not_price_the_best_shape_out():
    """A host pause of 100x a step, once, while the deepest runs: it stays the choice."""
    policy = ShapePolicy(StepTimes({1: _chains({0: 0.38, 1: 0.38, 4: 0.38, 7: 0.38})}),
                         {1: AcceptanceEstimate(4, prior=0.9)})
    assert policy.choose([1]) == DraftShape(7)
    policy.observe(1, DraftShape(7), 38.0)
    assert [policy.choose([1]) for _ in range(3)] == [DraftShape(7)] * 3


def test_deeper_drafts_priced_by_kernels_but_free_in_wall_time_go_deepest():
    """The start-up table (device time alone) makes 7 drafts cost 1.7x 4, more than the 8
    tokens against 5 that whole copies give, so depth 4 wins; the loop's steps then take the
    same wall time at every depth (the host's per-step work dominates: the demo pair at bs=1),
    and once observed the deepest wins, after a few tries of the cheap depth it had not run."""
    device = _chains({0: 0.08, 1: 0.09, 4: 0.12, 7: 0.204})
    policy = ShapePolicy(StepTimes({1: device}), {1: AcceptanceEstimate(4, prior=0.5, decay=0.5)})
    for _ in range(20):
        policy.estimates[1].update(4, [1], [5])  # every draft accepted
    chosen = []
    for _ in range(40):
        shape = policy.choose([1])
        chosen.append(shape.depth)
        policy.observe(1, shape, 0.38)       # wall time per step, whatever the depth
    assert chosen[0] == 4
    assert chosen[-20:] == [7] * 20
    assert chosen.count(7) > 30 and 0 not in chosen   # plain: never worth a try at this acceptance
    # Without observing, the device-only table keeps choosing depth 4.
    fixed = ShapePolicy(StepTimes({1: device}), policy.estimates, observe_weight=0.0)
    fixed.observe(1, DraftShape(4), 0.38)
    assert fixed.choose([1]) == DraftShape(4) and fixed.times.seconds(1, DraftShape(4)) == 0.12


@pytest.mark.parametrize("seconds,field", [
    ({}, "step_times"),
    ({1: _chains({1: 5.0, 3: 6.0})}, "step_times"),            # no plain step
    ({1: _chains({0: 5.0, 3: 6.0}), 8: _chains({0: 5.0})}, "step_times"),  # buckets disagree on shapes
    ({1: {PLAIN: 5.0, DraftShape(3): 6.0}, 8: {PLAIN: 5.0, DraftShape(3, 2): 6.0}}, "step_times"),
    ({1: _chains({0: 5.0, 3: 0.0})}, "step_times"),
    ({1: {0: 5.0, 3: 6.0}}, "step_times"),                     # depths, not DraftShapes
    ({1: {PLAIN: 5.0, DraftShape(0, 2): 6.0}}, "step_times"),  # a wide plain step
    ({1: {PLAIN: 5.0, DraftShape(3, 0): 6.0}}, "step_times"),  # no candidates a level
])
def test_bad_tables_are_refused_naming_the_field(seconds, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        StepTimes(seconds)


def test_bad_settings_are_refused_naming_the_field():
    chain = {1: AcceptanceEstimate(4)}
    with pytest.raises(ValueError, match=r"^prior:"):
        AcceptanceEstimate(4, prior=1.5)
    with pytest.raises(ValueError, match=r"^decay:"):
        AcceptanceEstimate(4, decay=1.0)
    with pytest.raises(ValueError, match=r"^relax:"):
        AcceptanceEstimate(4, relax=-0.1)
    with pytest.raises(ValueError, match=r"^estimates:"):
        ShapePolicy(TREE_TIMES, chain)                  # no estimate of width 4
    with pytest.raises(ValueError, match=r"^estimates:"):
        ShapePolicy(TIMES, {1: AcceptanceEstimate(4), 2: AcceptanceEstimate(4)})  # no shape of width 2
    with pytest.raises(ValueError, match=r"^probe_every:"):
        ShapePolicy(TIMES, chain, probe_every=0)
    with pytest.raises(ValueError, match=r"^relax:"):
        ShapePolicy(TIMES, chain, relax=1.5)
    with pytest.raises(ValueError, match=r"^max_probe_every:"):
        ShapePolicy(TIMES, chain, probe_every=8, max_probe_every=4)
    with pytest.raises(ValueError, match=r"^observe_weight:"):
        ShapePolicy(TIMES, chain, observe_weight=1.5)
    with pytest.raises(ValueError, match=r"^costlier_margin:"):
        ShapePolicy(TIMES, chain, costlier_margin=-0.1)


def test_shapes_survive_the_tp_control_messages_pickling():
    """tp > 1: rank 0's table (`measure_step_times`' agree) and step times (tp.ObservedStepTimes)
    reach the other ranks pickled (broadcast_object_list); their shapes stay DraftShapes."""
    from specserve.engine.spec.adaptive_worker import StepObservation
    from specserve.engine.tp import ObservedStepTimes

    table = {1: {PLAIN: 1.0, DraftShape(3): 2.0, DraftShape(3, 2): 3.0}}
    message = ObservedStepTimes([StepObservation(4, DraftShape(3, 2), 0.5)])
    table_there, message_there = pickle.loads(pickle.dumps((table, message)))
    assert table_there == table and StepTimes(table_there).shapes == StepTimes(table).shapes
    assert message_there == message and type(message_there.observed[0].shape) is DraftShape


# --- the engine: any choice of shapes leaves the output unchanged ---------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers import make_predictable_pair

    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


class RandomShapes:
    """A stand-in policy: a seeded random shape per step (the worker's shapes, plain included),
    each round of len(shapes) steps every shape once in a shuffled order (so any run of that
    many steps tries them all, whatever its length)."""

    def __init__(self, shapes, seed: int):
        self.shapes = sorted(shapes)
        self.rng = random.Random(seed)
        self.chosen = []
        self._round = []

    def choose(self, rows) -> DraftShape:
        if not self._round:
            self._round = self.rng.sample(self.shapes, len(self.shapes))
        self.chosen.append(self._round.pop())
        return self.chosen[-1]

    def observe(self, batch_size: int, shape: DraftShape, seconds: float) -> None:
        pass


def _spec(pair, algorithm: str, **kwargs) -> SpecConfig:
    """A chain of 4 drafts; "eagle-tree": 4 levels of width 2, the 7 best nodes verified. (The
    engines here take 16 rows, enough for `reference`: the start-up measurement times each
    shape at the buckets 1 and max_running_requests, eagerly on the CPU.)"""
    draft = None if algorithm in ("ngram", "suffix") else pair[1]
    if algorithm == "eagle-tree":
        return SpecConfig(algorithm="eagle", draft_model=draft, num_steps=4, topk=2, num_draft_tokens=8,
                          adaptive=True, **kwargs)
    return SpecConfig(algorithm=algorithm, draft_model=draft, num_steps=4, num_draft_tokens=5, adaptive=True,
                      **kwargs)


CHAIN_SHAPES = [PLAIN, DraftShape(1), DraftShape(2), DraftShape(4)]
TREE_SHAPES = sorted(CHAIN_SHAPES + [DraftShape(1, 2), DraftShape(2, 2), DraftShape(4, 2)])


def _randomise(engine, seed: int, shapes=None) -> RandomShapes:
    """Random shapes among `shapes` (default: all the worker's) from now on."""
    worker = engine.core.worker
    worker.policy = RandomShapes(shapes or worker.workers, seed)
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


def _record_estimate_updates(worker) -> list:
    """(width of the estimate, the depth of its update or "relax") of every acceptance update
    and relaxing, in order."""
    updates = []
    for width, est in worker.estimates.items():
        def update(depth, rows, accept_lens, width=width, run=est.update):
            updates.append((width, depth))
            run(depth, rows, accept_lens)

        def relax(rows, width=width, run=est.relax):
            updates.append((width, "relax"))
            run(rows)
        est.update, est.relax = update, relax
    return updates


@pytest.mark.parametrize("algorithm", ["eagle", "eagle-tree", "ngram", "suffix"])
@pytest.mark.parametrize("overlap", [False, True])
def test_random_shapes_leave_greedy_and_seeded_outputs_unchanged(pair, reference, make_engine, algorithm, overlap):
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair, algorithm), max_running_requests=16, enable_overlap=overlap)
    worker = engine.core.worker
    shapes = TREE_SHAPES if algorithm == "eagle-tree" else CHAIN_SHAPES
    assert sorted(worker.workers) == shapes
    policy = _randomise(engine, seed=7)
    updates = _record_estimate_updates(worker)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert set(policy.chosen) == set(shapes)   # chains and (eagle-tree) trees, every depth
    # Each decode step's acceptance went to the estimate of its own width; a drafting step
    # relaxed the other width's (eagle-tree).
    assert updates == [(width, shape.depth if width == shape.width else "relax") for shape in policy.chosen
                       for width in sorted(worker.estimates) if width == shape.width or shape.depth]
    assert ("relax" in {step for _, step in updates}) == (algorithm == "eagle-tree")
    if algorithm == "eagle-tree":
        # (topk, levels, verified nodes): a chain of d verifies d + 1; a tree of width 2 holds
        # 2 + 4 (d - 1) candidates, 7 verified at most.
        assert {shape: tuple(w.drafter.shape) for shape, w in worker.workers.items()} == {
            PLAIN: (1, 0, 1), DraftShape(1): (1, 1, 2), DraftShape(2): (1, 2, 3), DraftShape(4): (1, 4, 5),
            DraftShape(1, 2): (2, 1, 3), DraftShape(2, 2): (2, 2, 7), DraftShape(4, 2): (2, 4, 8)}
    # Each decode step reports the depth it ran (the server's specserve_spec_decode_steps).
    decodes = [s.draft_depth for s in engine.take_step_stats() if not s.extend]
    assert collections.Counter(decodes) == collections.Counter(shape.depth for shape in policy.chosen)
    assert worker.shape_steps == collections.Counter(policy.chosen)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle-tree"])
def test_random_shapes_under_graphs_and_retraction(pair, reference, make_engine, monkeypatch, algorithm):
    """Every shape's captured step (the CPU stand-in), requests retracted in between."""
    from helpers import graphed_engine

    prompts, params, expected = reference
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=_spec(pair, algorithm),
                                    max_running_requests=16, max_total_tokens=110)
    policy = _randomise(engine, seed=8)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert engine.metrics.num_retractions > 0
    assert set(policy.chosen) == set(TREE_SHAPES if algorithm == "eagle-tree" else CHAIN_SHAPES)
    replayed = {id(g) for g, _, _ in graphs.replays}
    for worker in engine.core.worker.workers.values():  # greedy or sampled variants
        assert replayed & {id(g) for g in (worker.graphs, *worker.sampled_graphs.values())}
    # Plain steps' rows got their drafter state back through the captured refresh.
    assert id(engine.core.worker.drafter._refresh_graphs[0]) in replayed


def test_constrained_batches_run_the_configured_tree_and_every_shape_has_graphs(pair, make_engine, monkeypatch):
    """The eagle-tree engine's graphs (the CPU stand-in): greedy, sampled and filtered steps for
    each of its 7 shapes, the constrained ones and the extends for the configured tree alone,
    the refresh once; all in one pool. Batches with a grammar run the configured tree's
    constrained graphs whatever the policy would pick, the others the random shapes; the
    outputs are plain decoding's."""
    from helpers import graphed_engine
    from specserve.engine import GrammarSpec

    prompts = random_prompts(6, seed=11, max_len=12)
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=bool(i % 3),
                             grammar=None if i % 3 else GrammarSpec("json_object")) for i in range(6)]
    expected = [o.token_ids for o in make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=params)]
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], constrained=True,
                                    spec=_spec(pair, "eagle-tree"), max_running_requests=16)
    worker = engine.core.worker
    configured = DraftShape(4, 2)
    pool = worker.deepest.graphs.pool
    decode = [g for w in worker.workers.values() for g in (w.graphs, *w.sampled_graphs.values())]
    assert len(decode) == 3 * len(TREE_SHAPES) == 21
    assert all(isinstance(g, graphs) and g.pool is pool for g in decode)
    assert [shape for shape, w in worker.workers.items() if w.constrained_graphs] == [configured]
    assert all(g.pool is pool for g in worker.deepest.constrained_graphs.values())
    assert [shape for shape, w in worker.workers.items() if w.extend_graphs is not None] == [configured]
    assert worker.drafter._refresh_graphs[0].pool is pool
    # The start-up log's count and static-input bytes (builder.py) take every shape's graphs,
    # not the configured shape's alone (the worker's own attributes).
    from specserve.engine import builder
    counted = builder._graph_sets(worker)
    assert {id(g) for g in decode} < {id(g) for g in counted}
    assert len(counted) == len(decode) + len(worker.deepest.constrained_graphs) + 1   # + the extends
    configured_alone = sum(t.nbytes for g in (worker.graphs, *worker.sampled_graphs.values())
                           for c in g.captured.values() for t in c.inputs if isinstance(t, torch.Tensor))
    assert builder._static_input_bytes(worker) > configured_alone
    policy = _randomise(engine, seed=12)
    steps = []  # (constrained, the shape of the worker that ran it)
    for shape, sub in worker.workers.items():
        def launch(step, refresh=(), shape=shape, run=sub.launch_decode):
            steps.append((step.grammar is not None, shape))
            return run(step, refresh)
        monkeypatch.setattr(sub, "launch_decode", launch)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    constrained = [shape for grammar, shape in steps if grammar]
    assert constrained and set(constrained) == {configured}
    assert [shape for grammar, shape in steps if not grammar] == policy.chosen
    replayed = [g for g, rows, part in graphs.replays if part == 0 and rows is not None]
    assert sum(g is worker.deepest.constrained_graphs["greedy"] for g in replayed) == len(constrained)


def _drafted_tokens(engine) -> list:
    """Every draft's tokens, in step order (each shape's drafter's `draft` wrapped)."""
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
    """A plain step of a draft model only stores its rows' draft KV; the next deeper step first
    drafts their state again (`refresh`). Its drafts equal those of an engine whose plain
    steps ran the full draft extend, step for step (the same random shapes); outputs equal
    plain decoding's."""
    prompts, params, expected = reference
    drafted, refreshed = {}, []
    for refreshes in (True, False):
        engine = make_engine(pair[0], spec=_spec(pair, algorithm), max_running_requests=16)
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
        assert PLAIN in policy.chosen
        if algorithm == "eagle-tree":  # refreshed rows went on to chains and trees
            assert {shape.width for shape in policy.chosen} == {1, 2}
    assert refreshed and all(rows for rows in refreshed)
    assert len(drafted[True]) == len(drafted[False]) > 0
    for i, (ours, full) in enumerate(zip(drafted[True], drafted[False])):
        assert torch.equal(ours, full), (i, ours, full)


def test_a_tree_engines_chains_draft_what_a_chain_engine_drafts(pair, reference, make_engine):
    """A chain step of a width-2 drafter drafts from the top 1 of the 2-wide state it finds:
    an eagle-tree engine running only chains (and plain steps) drafts exactly what an eagle
    chain engine does at the same random shapes, step for step."""
    prompts, params, expected = reference
    drafted = {}
    for algorithm in ("eagle", "eagle-tree"):
        engine = make_engine(pair[0], spec=_spec(pair, algorithm), max_running_requests=16)
        policy = _randomise(engine, seed=10, shapes=CHAIN_SHAPES)
        drafted[algorithm] = _drafted_tokens(engine)
        assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
        assert set(policy.chosen) == set(CHAIN_SHAPES)
    assert len(drafted["eagle"]) == len(drafted["eagle-tree"]) > 0
    for i, (tree_engine, chain_engine) in enumerate(zip(drafted["eagle-tree"], drafted["eagle"])):
        assert torch.equal(tree_engine, chain_engine), (i, tree_engine, chain_engine)


def test_every_shape_drafts_from_the_wide_state_whichever_shape_stashed_it(pair, reference, make_engine):
    """Random chains and trees in turn: each step finds the state the last one stashed 2 wide
    (two distinct candidates a row), a chain drafts its first token from the top 1 and a tree
    its first level from both."""
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair, "eagle-tree"), max_running_requests=16)
    worker = engine.core.worker
    future_map = engine.core.worker.drafter.future_map
    firsts = []  # (shape, the stashed candidates, the draft's first-level tokens)
    for shape, sub in worker.workers.items():
        def draft(s, snap, shape=shape, run=sub.drafter.draft):
            stashed = future_map.gather_draft_state(s.rows).topk_index.clone()
            nodes = run(s, snap)
            if shape.depth:
                first = nodes.tokens[:, :1] if shape.width == 1 else \
                    torch.stack([row[parents == 0] for row, parents in zip(nodes.tokens, nodes.parents)])
                firsts.append((shape, stashed, first))
            return nodes
        sub.drafter.draft = draft
    policy = _randomise(engine, seed=11)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert {shape for shape, _, _ in firsts} == set(TREE_SHAPES) - {PLAIN}
    # (Drafting steps only: plain steps in between stash the state too, or defer it.)
    widths = [shape.width for shape in policy.chosen if shape.depth]
    follows = set(zip(widths, widths[1:]))
    assert (1, 2) in follows and (2, 1) in follows   # a tree after a chain, a chain after a tree
    for shape, stashed, first in firsts:
        assert stashed.shape[1] == 2 and bool((stashed[:, 0] != stashed[:, 1]).all())
        if shape.width == 1:
            assert torch.equal(first, stashed[:, :1]), shape
        else:  # a tree of 2 levels or more may keep one first-level candidate only
            assert all(set(f.tolist()) <= set(s.tolist()) for f, s in zip(first, stashed)), shape
            if shape.depth == 1:
                assert torch.equal(first, stashed), shape


def test_drafters_refuse_shapes_they_cannot_draft_naming_the_field(pair, make_engine):
    tree = make_engine(pair[0], spec=_spec(pair, "eagle-tree"), max_running_requests=16).core.worker.drafter
    assert tuple(tree.at_shape(3, 1).shape) == (1, 3, 4) and tuple(tree.at_shape(3, 2).shape) == (2, 3, 8)
    with pytest.raises(ValueError, match=r"^width:"):
        tree.at_shape(2, 3)                    # wider than the stashed topk (2)
    with pytest.raises(ValueError, match=r"^width:"):
        tree.at_shape(0, 2)                    # plain is one node
    with pytest.raises(ValueError, match=r"^depth:"):
        tree.at_shape(5, 2)                    # deeper than num_steps (4)
    narrow = make_engine(pair[0], spec=SpecConfig(algorithm="eagle", draft_model=pair[1], num_steps=4, topk=2,
                                                  num_draft_tokens=4, adaptive=True),
                         max_running_requests=4).core.worker
    # num_draft_tokens 4: no chain of 4 drafts (5 nodes); the tree of 4 levels keeps 3 of its nodes.
    assert sorted(narrow.workers) == [PLAIN, DraftShape(1), DraftShape(1, 2), DraftShape(2), DraftShape(2, 2),
                                      DraftShape(4, 2)]
    with pytest.raises(ValueError, match=r"^depth:"):
        narrow.drafter.at_shape(4, 1)
    ngram = make_engine(pair[0], spec=_spec(pair, "ngram"), max_running_requests=16).core.worker.drafter
    assert tuple(ngram.at_shape(2, 1).shape) == (1, 2, 3)
    with pytest.raises(ValueError, match=r"^width:"):
        ngram.at_shape(2, 2)


def test_start_up_measures_every_shape_and_acceptance_feeds_the_policy(pair, make_engine):
    engine = make_engine(pair[0], spec=_spec(pair, "eagle-tree"), max_running_requests=4)
    worker = engine.core.worker
    times = worker.policy.times
    assert times.buckets == [1, 4] and list(times.shapes) == TREE_SHAPES
    assert all(times.seconds(bs, shape) > 0 for bs in (1, 4) for shape in times.shapes)
    # Measured times are the machine's: choose by a table where drafting is free, so that the
    # steps draft (and their acceptance is measured) whatever this machine timed: the deepest
    # tree, its width's prior above the chain's.
    worker.policy = Recorded(StepTimes({4: {shape: 1.0 for shape in times.shapes}}), worker.estimates,
                             observe_weight=0.0)
    worker.policy.chosen = []
    rows = list(range(1, 5))
    chain, tree = worker.estimates[1], worker.estimates[2]
    before = chain.rate(rows), tree.rate(rows)
    assert before == (0.5, 0.75)
    prompts = random_prompts(4, seed=5, max_len=20)
    engine.generate(prompt_token_ids=prompts, sampling=SamplingParams(max_new_tokens=30, temperature=0.0,
                                                                      ignore_eos=True))
    # The predictable pair accepts most levels: the tree's estimate is its measure now, not
    # its prior; the chain, never run, kept its own.
    assert set(worker.policy.chosen) == {DraftShape(4, 2)}
    assert 0.5 < tree.rate(rows) != before[1] and chain.rate(rows) == before[0]


class Recorded(ShapePolicy):
    """The policy, its choices recorded."""

    chosen: list

    def choose(self, rows) -> DraftShape:
        self.chosen.append(super().choose(rows))
        return self.chosen[-1]


@pytest.mark.parametrize("algorithm,spec_cost,expected_shape", [
    ("eagle", 10.0, PLAIN), ("eagle", 1.0, DraftShape(4)), ("eagle-tree", 1.0, DraftShape(4, 2)),
], ids=["costly", "free", "free-tree"])
def test_the_engine_runs_the_shape_its_policy_picks(pair, make_engine, monkeypatch, algorithm, spec_cost,
                                                    expected_shape):
    """A stub table where drafting costs 10x a plain step: plain steps (and a probe now and
    then); where it costs nothing: the deepest (a tree config: the tree, its prior above the
    chain's). The output is plain decoding's either way."""
    prompts = random_prompts(3, seed=6, max_len=16)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=params)]
    engine = make_engine(pair[0], spec=_spec(pair, algorithm), max_running_requests=16)
    worker = engine.core.worker
    table = StepTimes({4: {shape: 1.0 if shape == PLAIN else spec_cost for shape in worker.workers}})
    worker.policy = Recorded(table, worker.estimates, probe_every=8, observe_weight=0.0)
    worker.policy.chosen = []
    launched = []  # (shape of the worker that ran the step, its verify's node count)
    for shape, sub in worker.workers.items():
        def launch(step, refresh=(), shape=shape, sub=sub, run=sub.launch_decode):
            launched.append((shape, sub.verifier.shape.num_draft_tokens))
            return run(step, refresh)
        monkeypatch.setattr(sub, "launch_decode", launch)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    chosen = worker.policy.chosen
    assert chosen.count(expected_shape) > len(chosen) * 0.8
    # A chain of d verifies d + 1 nodes, the tree of width 2 its 7 best (8 with the root).
    assert launched == [(shape, 8 if shape.width == 2 else shape.depth + 1) for shape in chosen]
    assert worker.shape_steps == collections.Counter(chosen)


def test_the_engine_feeds_each_steps_wall_time_to_the_table(pair, reference, make_engine):
    """Each step the policy chose reports its wall time (host clocks, between result reads):
    with weight 1 the table holds the last one measured, a plausible step time. The output
    stays plain decoding's."""
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair, "ngram"), max_running_requests=16)
    worker = engine.core.worker
    start = {shape: 1e6 for shape in worker.workers}   # far above any real step: every one observed moves it
    worker.policy = Recorded(StepTimes({8: start}), worker.estimates, observe_weight=1.0)
    worker.policy.chosen = []
    t0 = time.perf_counter()
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    elapsed = time.perf_counter() - t0
    # Equal at the start: the deepest first (the most tokens); once measured it is far cheaper
    # than the others' 1e6 s, which no step then measures.
    ran = set(worker.policy.chosen)
    assert ran
    for shape in worker.workers:
        seconds = worker.policy.times.seconds(8, shape)
        assert (0 < seconds < elapsed) if shape in ran else seconds == 1e6


def test_adaptive_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^spec.adaptive:"):
        SpecConfig(adaptive="yes")


@pytest.mark.parametrize("placement", TP_PLACEMENTS)
def test_tp_ranks_take_rank0s_step_times(pair, reference, make_engine, placement):
    """tp > 1: outputs equal plain decoding's (every rank runs the same shapes: a rank choosing
    its own would run other graphs, other collectives); rank 0's step times reach its own
    policy only as the control message every rank applies at the next step's start. A tree
    config, by its measured table: which shapes that picks is the machine's (a stub policy on
    rank 0 alone would leave the follower on its own; the messages' shapes:
    test_shapes_survive_the_tp_control_messages_pickling)."""
    size, device = tp_placement(placement)
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair, "eagle-tree"), max_running_requests=16, tp_size=size, **device)
    worker = engine.core.worker
    applied = []
    apply = worker.observe_step_times
    worker.observe_step_times = lambda observed: (applied.extend(observed), apply(observed))
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    decodes = sum(worker.shape_steps.values())
    # Each decode step's time is applied at a later step's start, the last ones still queued.
    assert 0 < len(applied) <= decodes and len(applied) + len(worker.take_step_times()) == decodes
    assert {seen.shape for seen in applied} <= set(worker.shape_steps) <= set(TREE_SHAPES)


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
def test_gpu_adaptive_graphs_every_shape_and_keeps_outputs(pair, reference, make_engine, algorithm):
    """Graphs for every shape (eagle-tree: chains and trees), a table measured from their
    replays, random shapes equal to plain decoding, and the policy's own steps without a
    blocking host sync."""
    from helpers import steady_state_steps

    prompts, params, expected = reference
    engine = make_engine(pair[0], device="cuda", attention_backend="triton", max_running_requests=16,
                         spec=_spec(pair, algorithm))
    worker = engine.core.worker
    assert engine.core.uses_cuda_graphs and all(w.graphs is not None for w in worker.workers.values())
    assert sorted(worker.workers) == (TREE_SHAPES if algorithm == "eagle-tree" else CHAIN_SHAPES)
    assert worker.policy.times.buckets == worker.deepest.graphs.buckets
    assert list(worker.policy.times.shapes) == sorted(worker.workers)
    policy = worker.policy
    chosen = _randomise(engine, seed=9).chosen
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert set(chosen) == set(worker.workers)
    worker.policy = policy
    steady_state_steps(engine, [5, 6, 7, 8])


def test_a_near_tie_goes_to_the_cheaper_shape():
    """Where no draft is accepted, a deeper depth measured 1 % cheaper (wall-clock noise) is not
    taken; one that pays by more than the margin is. The same between a chain and the tree of
    its depth: the wider is taken only by more than the margin."""
    times = StepTimes({1: _chains({0: 6.15, 1: 6.09, 3: 7.0})})
    policy = ShapePolicy(times, {1: AcceptanceEstimate(4, prior=0.0)})
    assert policy.best(1, {1: 0.0}) == PLAIN
    assert ShapePolicy(times, {1: AcceptanceEstimate(4)}, costlier_margin=0.0).best(1, {1: 0.0}) == DraftShape(1)
    assert policy.best(1, {1: 0.05}) == DraftShape(1)     # 1.05 tokens for 6.09 ms: 6 % over plain
    assert policy.best(1, {1: 0.9}) == DraftShape(3)
    trees = StepTimes({1: {PLAIN: 6.0, DraftShape(3): 7.0, DraftShape(3, 2): 7.0}})
    policy = ShapePolicy(trees, {1: AcceptanceEstimate(4), 2: AcceptanceEstimate(4)})
    assert policy.best(1, {1: 0.5, 2: 0.51}) == DraftShape(3)       # 1 % more tokens: the chain
    assert policy.best(1, {1: 0.5, 2: 0.6}) == DraftShape(3, 2)     # 14 % more: the tree
