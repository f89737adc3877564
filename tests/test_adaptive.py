"""Adaptive speculation's depth choice against a stub step-time table (spec/adaptive.py)."""
from __future__ import annotations

import pytest

from specserve.engine.spec.adaptive import AcceptanceEstimate, DepthPolicy, StepTimes, expected_tokens

# Milliseconds, shaped like the H100 8B numbers: at bs=1 a 3-draft chain step costs
# ~1.1x a plain one, at bs=64 1.55x.
TIMES = StepTimes({1: {0: 6.0, 1: 6.2, 3: 6.6, 5: 7.2},
                   16: {0: 7.0, 1: 7.6, 3: 8.5, 5: 9.6},
                   64: {0: 10.0, 1: 12.0, 3: 15.5, 5: 19.0}})


def _policy(rate: float, probe_every: int = 4) -> DepthPolicy:
    return DepthPolicy(TIMES, AcceptanceEstimate(prior=rate), probe_every=probe_every)


def test_expected_tokens():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(0.9, 0) == 1.0


def test_deep_drafts_at_small_batches_plain_at_large_ones_with_poor_acceptance():
    assert _policy(0.8).best(1) == 5
    assert _policy(0.02).best(1) == 0        # 1.02 tokens for 1.03x the time
    # The same acceptance: one draft pays at bs=1 (1.2 tokens, 1.03x), not at bs=64 (1.2x).
    assert _policy(0.2).best(1) == 1 and _policy(0.2).best(64) == 0
    # bs=64 at a middling rate: a 3-draft step's 1.74 tokens for 1.55x lose to one draft.
    assert _policy(0.45).best(64) == 1
    assert _policy(0.7).best(64) == 3


def test_the_choice_maximises_tokens_per_second():
    for rate in [i / 20 for i in range(21)]:
        for bs in (1, 2, 16, 40, 64, 200):
            policy = _policy(rate)
            chosen = policy.best(bs)
            speed = {d: expected_tokens(rate, d) / TIMES.seconds(bs, d) for d in TIMES.depths}
            assert speed[chosen] == max(speed.values())
            # Never below plain decoding.
            assert speed[chosen] >= speed[0]


def test_batches_between_buckets_take_the_next_larger_bucket():
    assert TIMES.seconds(2, 3) == TIMES.seconds(16, 3) == 8.5
    assert TIMES.seconds(17, 0) == 10.0
    assert TIMES.seconds(500, 5) == 19.0   # past the largest: the largest
    assert TIMES.depths == (0, 1, 3, 5)


def test_acceptance_estimate_counts_truncated_runs():
    est = AcceptanceEstimate(prior=0.5, decay=0.5)
    est.update(3, [4, 4])                   # every draft accepted: 6 of 6 tried
    assert est.rate == pytest.approx((0.5 * 0.5 + 6) / (0.5 * 1 + 6))
    est.update(0, [1, 1, 1])                # plain steps say nothing
    assert est.rate == pytest.approx((0.5 * 0.5 + 6) / (0.5 * 1 + 6))
    low = AcceptanceEstimate(prior=1.0, decay=0.5)
    for _ in range(20):
        low.update(3, [1, 2])               # 0 of 1 and 1 of 2 tried
    assert low.rate == pytest.approx(1 / 3, abs=1e-4)


def test_falls_back_to_plain_and_probes_back_when_acceptance_recovers():
    est = AcceptanceEstimate(prior=0.9, decay=0.5)
    policy = DepthPolicy(TIMES, est, probe_every=4)
    assert policy.choose(64) == 5
    for _ in range(6):
        est.update(5, [1] * 64)             # nothing accepted: plain wins
    assert est.rate < 0.1
    chosen = [policy.choose(64) for _ in range(10)]
    # Plain, with a probe at the smallest depth after every 4 plain steps in a row.
    assert chosen == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    for _ in range(6):
        est.update(1, [2] * 64)             # the probes are accepted again
    assert policy.choose(64) == 5


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
        AcceptanceEstimate(prior=1.5)
    with pytest.raises(ValueError, match=r"^decay:"):
        AcceptanceEstimate(decay=1.0)
    with pytest.raises(ValueError, match=r"^probe_every:"):
        DepthPolicy(TIMES, AcceptanceEstimate(), probe_every=0)
