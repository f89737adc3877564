"""Decode fairness (EngineConfig.prefill_interleave_tokens): while some request decodes, an
extend step computes at most the budget and the next step is a decode step; with nobody
decoding, an extend is bounded by chunked_prefill_size only; 0 is the old prefill-first order."""
from __future__ import annotations

import math
import random
from typing import NamedTuple

import pytest

from helpers import assert_no_leaks, make_predictable_pair, random_prompts

from specserve.engine import EngineConfig, GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.forward_batch import ForwardMode
from specserve.engine.scheduler.schedule_batch import ReqStatus

BUDGET = 8
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target + EAGLE-1 head with real partial acceptance (and a tokenizer, for grammars)."""
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


class Step(NamedTuple):
    extend: bool
    computed: int        # prompt tokens the extend computes (its chunks; cached prefixes excluded)
    decoding: bool       # some running request could take a decode step when it was scheduled
    reqs: tuple
    chunks: tuple


def _could_decode(req) -> bool:
    return (req.status is ReqStatus.RUNNING and not req.is_prefilling
            and len(req.output_ids) + req.num_inflight_tokens < req.sampling.max_new_tokens)


def record_steps(engine, old_order: bool = False) -> list[Step]:
    """Every decision the engine launches from now on, in launch order. old_order: schedule as
    the policy did before decode fairness (prefill first, then decode)."""
    policy = engine.core.scheduler.policy
    steps: list[Step] = []
    if old_order:
        schedule = lambda nothing_in_flight: (policy._prefill(policy.chunk_budget)  # noqa: E731
                                              or policy._decode(nothing_in_flight))
    else:
        schedule = policy.schedule

    def recording(nothing_in_flight: bool):
        decoding = any(_could_decode(r) for r in policy.running)
        decision = schedule(nothing_in_flight)
        if decision is not None:
            extend = decision.mode is ForwardMode.EXTEND
            steps.append(Step(extend, sum(end - start for start, end in decision.chunks) if extend else 0,
                              decoding, tuple(r.key for r in decision.reqs), tuple(decision.chunks)))
        return decision

    policy.schedule = recording
    return steps


def assert_decode_fair(steps: list[Step], budget: int) -> None:
    for i, step in enumerate(steps):
        if step.extend and step.decoding:
            assert step.computed <= budget, f"step {i}: an extend of {step.computed} tokens while requests decode"
            assert i == 0 or not steps[i - 1].extend, f"step {i}: two extends in a row while requests decode"


def drive(engine, arrivals, max_steps: int = 3000):
    """Add (step, rid, prompt, params) arrivals at their steps and run to the end; returns
    {(rid, index): (tokens, finish_reason)}."""
    tokens, results = {}, {}
    expected = sum(params.n for *_, params in arrivals)
    for step in range(max_steps):
        for at, rid, prompt, params in arrivals:
            if at == step:
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            key = (out.rid, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                results[key] = (tokens[key], out.finish_reason)
        if len(results) == expected and not engine.has_unfinished():
            break
    assert len(results) == expected, "not every request finished"
    return results


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _burst(seed: int = 11):
    """Four requests decoding, then twelve arrivals at once whose prompts sum to ~30 budgets."""
    prompts = random_prompts(16, seed=seed, min_len=12, max_len=40)
    return ([(0, f"d{i}", prompts[i], _greedy(40)) for i in range(4)]
            + [(5, f"b{i}", prompts[4 + i], _greedy(6)) for i in range(12)])


# --- the step sequence -----------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_a_burst_of_arrivals_is_interleaved_with_decode_steps(tiny_model, make_engine, overlap):
    arrivals = _burst()
    burst_tokens = sum(len(p) for at, _, p, _ in arrivals if at == 5)
    assert burst_tokens > 25 * BUDGET
    engine = make_engine(tiny_model, enable_overlap=overlap, prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    got = drive(engine, arrivals)
    assert_decode_fair(steps, BUDGET)
    # The first wave met an idle engine: one extend of all four prompts, uncapped.
    assert steps[0].extend and not steps[0].decoding
    assert steps[0].computed == sum(len(p) for at, _, p, _ in arrivals if at == 0) > BUDGET
    capped = [s for s in steps if s.extend and s.decoding]
    assert len(capped) >= math.ceil(burst_tokens / BUDGET)
    assert all(reason == "length" for _, reason in got.values())
    off = make_engine(tiny_model, enable_overlap=overlap, prefill_interleave_tokens=0)
    off_steps = record_steps(off)
    assert drive(off, arrivals) == got
    # Without the rule the burst is one extend, launched while the first four decode.
    assert any(s.extend and s.decoding and s.computed == burst_tokens for s in off_steps)
    assert_no_leaks(engine)


@pytest.mark.parametrize("chunk", [0, 2048, 24])
def test_with_nobody_decoding_the_first_extend_is_bounded_by_the_chunk_budget_only(
        tiny_model, make_engine, chunk):
    prompts = random_prompts(6, seed=4, min_len=10, max_len=30)
    total = sum(map(len, prompts))
    engine = make_engine(tiny_model, prefill_interleave_tokens=BUDGET, chunked_prefill_size=chunk)
    steps = record_steps(engine)
    on = engine.generate(prompt_token_ids=prompts, sampling=_greedy(5))
    assert steps[0].extend and not steps[0].decoding
    assert steps[0].computed == (min(chunk, total) if chunk > 0 else total)
    assert_decode_fair(steps, BUDGET)
    off = make_engine(tiny_model, prefill_interleave_tokens=0, chunked_prefill_size=chunk)
    off_steps = record_steps(off)
    assert [o.token_ids for o in off.generate(prompt_token_ids=prompts, sampling=_greedy(5))] == \
        [o.token_ids for o in on]
    assert off_steps[0] == steps[0]  # an idle engine's first extend is what it was


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_longer_than_the_budget_is_chunked_between_decode_steps(tiny_model, make_engine, overlap):
    short = random_prompts(2, seed=6, min_len=5, max_len=10)
    long = random_prompts(1, seed=7, min_len=100, max_len=100)[0]
    arrivals = [(0, "d0", short[0], _greedy(60)), (0, "d1", short[1], _greedy(60)),
                (3, "long", long, _greedy(8))]
    engine = make_engine(tiny_model, enable_overlap=overlap, prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    got = drive(engine, arrivals)
    assert_decode_fair(steps, BUDGET)
    mine = [s for s in steps if ("long", 0) in s.reqs and s.extend]
    assert len(mine) == math.ceil(len(long) / BUDGET)
    # Its chunks cover the prompt in order, each followed by a decode step of the others.
    chunks = [s.chunks[s.reqs.index(("long", 0))] for s in mine]
    assert chunks[0][0] == 0 and chunks[-1][1] == len(long)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert len(got[("long", 0)][0]) == 8
    off = make_engine(tiny_model, enable_overlap=overlap, prefill_interleave_tokens=0)
    assert drive(off, arrivals) == got


def test_a_cached_prefix_is_not_counted(tiny_model, make_engine):
    """A prompt whose first 60 tokens are cached computes only its tail: one small extend."""
    base = random_prompts(1, seed=8, min_len=60, max_len=60)[0]
    engine = make_engine(tiny_model, prefill_interleave_tokens=BUDGET)
    engine.generate(prompt_token_ids=[base], sampling=_greedy(2))   # caches `base`
    steps = record_steps(engine)
    arrivals = [(0, "d", random_prompts(1, seed=9, max_len=8)[0], _greedy(30)),
                (3, "warm", base + [5, 6, 7], _greedy(4))]
    got = drive(engine, arrivals)
    mine = [s for s in steps if ("warm", 0) in s.reqs and s.extend]
    assert len(mine) == 1 and mine[0].decoding and mine[0].computed <= 4  # the tail (and base's last token)
    assert_decode_fair(steps, BUDGET)
    assert len(got[("warm", 0)][0]) == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_zero_keeps_the_prefill_first_order(tiny_model, make_engine, overlap):
    arrivals = _burst(seed=12)
    new = make_engine(tiny_model, enable_overlap=overlap, chunked_prefill_size=16, prefill_interleave_tokens=0)
    new_steps = record_steps(new)
    new_out = drive(new, arrivals)
    old = make_engine(tiny_model, enable_overlap=overlap, chunked_prefill_size=16, prefill_interleave_tokens=0)
    old_steps = record_steps(old, old_order=True)
    assert drive(old, arrivals) == new_out
    assert new_steps == old_steps
    # ... in which extends run back to back while requests decode (what the rule prevents).
    assert any(a.extend and b.extend and b.decoding for a, b in zip(new_steps, new_steps[1:]))


# --- exactness: the rule changes when tokens are computed, never which ---------------------------
def _mixed_workload(seed: int, grammar: bool = False):
    """Staggered arrivals: random prompts, prompts sharing a long prefix (the prefix cache),
    n = 2 sequences sharing a prompt, seeded sampling, stop tokens; optionally a grammar."""
    rng = random.Random(seed)
    prompts = random_prompts(18, seed=seed, min_len=4, max_len=48)
    system = random_prompts(1, seed=seed + 1, min_len=40, max_len=40)[0]
    arrivals = []
    for i, prompt in enumerate(prompts):
        if i % 4 == 1:
            prompt = system + prompt[:6]
        sampled = i % 5 == 2
        constrained = GrammarSpec("regex", "[a-c]{2,6}x") if grammar and i % 7 == 4 else None
        params = SamplingParams(
            max_new_tokens=rng.choice([1, 3, 9, 24, 40]), temperature=0.8 if sampled else 0.0,
            seed=100 + i if sampled else None, n=2 if i % 6 == 3 else 1,
            ignore_eos=constrained is None, stop_token_ids=[rng.randrange(3, 320)], grammar=constrained)
        arrivals.append((rng.randrange(0, 30), f"r{i}", prompt, params))
    return arrivals


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "chain"])
def test_outputs_equal_the_rule_off(pair, make_engine, overlap, speculative):
    spec = SpecConfig(algorithm="eagle", draft_model=pair[1], **CHAIN) if speculative else None
    arrivals = _mixed_workload(seed=21, grammar=True)
    results = {}
    for budget in (0, BUDGET):
        engine = make_engine(pair[0], spec=spec, enable_overlap=overlap, prefill_interleave_tokens=budget)
        steps = record_steps(engine)
        results[budget] = drive(engine, arrivals)
        assert_no_leaks(engine)
        if budget:
            assert_decode_fair(steps, budget)
            assert any(s.extend and s.decoding and s.computed == budget for s in steps)  # it chunked
        if speculative:
            assert engine.metrics.mean_accept_length > 1.5
    assert results[BUDGET] == results[0]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "chain"])
def test_outputs_equal_the_rule_off_under_retraction(pair, make_engine, overlap, speculative):
    spec = SpecConfig(algorithm="eagle", draft_model=pair[1], **CHAIN) if speculative else None
    prompts = random_prompts(8, seed=31, min_len=10, max_len=30)
    arrivals = [(i // 2, f"r{i}", p, _greedy(40)) for i, p in enumerate(prompts)]
    results = {}
    for budget in (0, BUDGET):
        engine = make_engine(pair[0], spec=spec, enable_overlap=overlap, max_total_tokens=260,
                             prefill_interleave_tokens=budget)
        steps = record_steps(engine)
        results[budget] = drive(engine, arrivals)
        assert engine.metrics.num_retractions > 0
        assert_no_leaks(engine)
        if budget:
            assert_decode_fair(steps, budget)
    assert results[BUDGET] == results[0]


# --- configuration -------------------------------------------------------------------------
def test_the_option_is_on_by_default_and_negative_is_refused():
    assert EngineConfig().prefill_interleave_tokens == 1024
    assert EngineConfig(prefill_interleave_tokens=0).prefill_interleave_tokens == 0
    for bad in (-1, 1.5, "8"):
        with pytest.raises(ValueError, match="prefill_interleave_tokens"):
            EngineConfig(prefill_interleave_tokens=bad)


def test_the_cli_flag(capsys):
    from specserve.cli import build_parser, engine_config_from_args, main

    def config(*flags):
        return engine_config_from_args(build_parser().parse_args(["serve", *flags]))

    assert config().prefill_interleave_tokens == 1024
    assert config("--prefill-interleave-tokens", "0").prefill_interleave_tokens == 0
    assert config("--prefill-interleave-tokens", "64").prefill_interleave_tokens == 64
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--prefill-interleave-tokens", "-1"])
    assert exit_info.value.code == 2
    assert "prefill_interleave_tokens: must be an integer >= 0" in capsys.readouterr().err
