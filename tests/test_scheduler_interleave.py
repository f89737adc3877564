"""Decode fairness (EngineConfig.prefill_interleave_tokens): while some request decodes, prompt
chunks ride with its decode step in one mixed step, at most the budget's tokens (the cap of the
adaptive budget, scheduler/mixed_batch.py; tests/test_mixed_budget.py prices the steps); with
mixed steps off (a backend that cannot mix, or a request
that cannot ride) an extend step computes at most the budget and the next step is a decode
step; with nobody decoding, an extend is bounded by chunked_prefill_size only; 0 is the old
prefill-first order."""
from __future__ import annotations

import functools
import math
import random

import pytest

from helpers import (FakeClock, Step, assert_no_leaks, drive, graphed_engine, make_predictable_pair,
                     random_prompts, record_steps)

from specserve.engine import EngineConfig, GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.layers.sampler import graph_variant

BUDGET = 8
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


@pytest.fixture
def make_engine(make_engine):
    """This module's engines mix prompts into decode steps (off by default) unless a test says
    otherwise."""
    return functools.partial(make_engine, mixed_steps=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target + EAGLE-1 head with real partial acceptance (and a tokenizer, for grammars)."""
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def assert_decode_fair(steps: list[Step], budget: int) -> None:
    for i, step in enumerate(steps):
        if step.extend and step.decoding:
            assert step.computed <= budget, f"step {i}: an extend of {step.computed} tokens while requests decode"
            assert i == 0 or not steps[i - 1].extend, f"step {i}: two extends in a row while requests decode"
        if step.mixed:  # (no graphs: no token bucket to fill past the cap)
            assert step.decoding and step.num_decode > 0
            assert step.computed <= budget, f"step {i}: {step.computed} prompt tokens ride with {step.num_decode} decode rows"


def assert_rides(steps: list[Step]) -> None:
    """No request ever waited behind an extend: while some request decodes, prompts only ride."""
    stalls = [i for i, s in enumerate(steps) if s.extend and s.decoding]
    assert not stalls, f"steps {stalls}: extends of their own while requests decode"


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _burst(seed: int = 11):
    """Four requests decoding, then twelve arrivals at once whose prompts sum to ~30 budgets."""
    prompts = random_prompts(16, seed=seed, min_len=12, max_len=40)
    return ([(0, f"d{i}", prompts[i], _greedy(40)) for i in range(4)]
            + [(5, f"b{i}", prompts[4 + i], _greedy(6)) for i in range(12)])


def _engine(make_engine, model, mixed: bool, **kw):
    """mixed=False: prompts in extends of their own (EngineConfig.mixed_steps; what a worker
    whose attention backend cannot mix runs)."""
    engine = make_engine(model, mixed_steps=mixed, **kw)
    assert engine.core.scheduler.policy.mixed_row_tokens == (1 if mixed else 0)
    return engine


# --- the step sequence -----------------------------------------------------------------------
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_burst_of_arrivals_is_interleaved_with_decode_steps(tiny_model, make_engine, overlap, mixed):
    arrivals = _burst()
    burst_tokens = sum(len(p) for at, _, p, _ in arrivals if at == 5)
    assert burst_tokens > 25 * BUDGET
    engine = _engine(make_engine, tiny_model, mixed, enable_overlap=overlap, prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    got = drive(engine, arrivals)
    assert_decode_fair(steps, BUDGET)
    # The first wave met an idle engine: one extend of all four prompts, uncapped.
    assert steps[0].extend and not steps[0].decoding
    assert steps[0].computed == sum(len(p) for at, _, p, _ in arrivals if at == 0) > BUDGET
    # While the first four decode, the burst rides with their steps (mixed) or runs in extends
    # of at most the budget between them; once they are done, what is left is one extend.
    carried = [s for s in steps if (s.mixed if mixed else s.extend and s.decoding)]
    idle = [s for s in steps[1:] if s.extend and not s.decoding]
    assert len(carried) >= 20 and len(idle) <= 1
    assert sum(s.computed for s in carried + idle) == burst_tokens
    assert engine.metrics.num_mixed_steps == (len(carried) if mixed else 0)
    assert engine.metrics.num_mixed_prompt_tokens == (sum(s.computed for s in carried) if mixed else 0)
    if mixed:
        assert_rides(steps)
    assert all(reason == "length" for _, reason in got.values())
    off = make_engine(tiny_model, enable_overlap=overlap, prefill_interleave_tokens=0)
    off_steps = record_steps(off)
    assert drive(off, arrivals) == got
    # Without the rule the burst is one extend, launched while the first four decode.
    assert any(s.extend and s.decoding and s.computed == burst_tokens for s in off_steps)
    assert not any(s.mixed for s in off_steps)
    assert_no_leaks(engine)


def test_a_large_decode_batch_takes_prompts_in_extends_of_their_own(tiny_model, make_engine,
                                                                    monkeypatch):
    """Past `MIXED_MAX_ROW_TOKENS` decode row tokens (3 here: plain rows are a token each) the
    burst runs in bounded extends between decode steps, as with mixed steps off; below it,
    prompts ride. The outputs are the same either way."""
    from specserve.engine.scheduler import policy

    arrivals = _burst(seed=13)
    engine = _engine(make_engine, tiny_model, True, prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    with monkeypatch.context() as patch:
        patch.setattr(policy, "MIXED_MAX_ROW_TOKENS", 3)
        got = drive(engine, arrivals)
    assert_decode_fair(steps, BUDGET)
    assert all(s.num_decode <= 3 for s in steps if s.mixed)
    separate = [i for i, s in enumerate(steps) if s.extend and s.decoding]
    assert len(separate) >= 10
    assert all(steps[i + 1].num_decode > 3 for i in separate if i + 1 < len(steps))
    assert_no_leaks(engine)
    assert drive(_engine(make_engine, tiny_model, True, prefill_interleave_tokens=BUDGET), arrivals) == got


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


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_longer_than_the_budget_is_chunked_between_decode_steps(tiny_model, make_engine, overlap,
                                                                         mixed):
    short = random_prompts(2, seed=6, min_len=5, max_len=10)
    long = random_prompts(1, seed=7, min_len=100, max_len=100)[0]
    arrivals = [(0, "d0", short[0], _greedy(60)), (0, "d1", short[1], _greedy(60)),
                (3, "long", long, _greedy(8))]
    engine = _engine(make_engine, tiny_model, mixed, enable_overlap=overlap, prefill_interleave_tokens=BUDGET)
    # Every step takes as long (a fake clock): prompt tokens look free to the cost model, so a
    # mixed step's budget is the cap, as a separate extend's is.
    FakeClock().drive(engine, lambda decision: 0.01)
    steps = record_steps(engine)
    got = drive(engine, arrivals)
    assert_decode_fair(steps, BUDGET)
    mine = [s for s in steps if ("long", 0) in s.reqs and (s.extend or s.mixed)]
    assert len(mine) == math.ceil(len(long) / BUDGET)
    assert all(s.mixed == mixed for s in mine)
    # Its chunks cover the prompt in order (separate: each followed by a decode step of the others).
    chunks = [s.chunks[s.reqs.index(("long", 0))] for s in mine]
    assert chunks[0][0] == 0 and chunks[-1][1] == len(long)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert len(got[("long", 0)][0]) == 8
    off = make_engine(tiny_model, enable_overlap=overlap, prefill_interleave_tokens=0)
    assert drive(off, arrivals) == got


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
def test_a_cached_prefix_is_not_counted(tiny_model, make_engine, mixed):
    """A prompt whose first 60 tokens are cached computes only its tail: one small chunk."""
    base = random_prompts(1, seed=8, min_len=60, max_len=60)[0]
    engine = _engine(make_engine, tiny_model, mixed, prefill_interleave_tokens=BUDGET)
    engine.generate(prompt_token_ids=[base], sampling=_greedy(2))   # caches `base`
    steps = record_steps(engine)
    arrivals = [(0, "d", random_prompts(1, seed=9, max_len=8)[0], _greedy(30)),
                (3, "warm", base + [5, 6, 7], _greedy(4))]
    got = drive(engine, arrivals)
    mine = [s for s in steps if ("warm", 0) in s.reqs and (s.extend or s.mixed)]
    assert len(mine) == 1 and mine[0].decoding and mine[0].computed <= 4  # the tail (and base's last token)
    assert mine[0].mixed == mixed
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
            assert any(s.mixed for s in steps)  # prompts rode with decode steps
            # ... and the constrained requests (which cannot ride) had extends of their own.
            assert any(s.extend and s.decoding for s in steps)
        if speculative:
            assert engine.metrics.mean_accept_length > 1.5
    assert results[BUDGET] == results[0]


def _outputs(engine, waves: list) -> dict:
    """Add the requests of `waves` one a step, each wave's once every request of the waves
    before it has a token; every sequence's (tokens, logprobs, top logprobs, prompt logprobs,
    finish reason)."""
    fields = ("new_token_ids", "new_logprobs", "new_top_logprobs")
    got, results, started, added = {}, {}, set(), []
    waiting = [(i, arrival) for i, wave in enumerate(waves) for arrival in wave]
    for _ in range(3000):
        if waiting and started >= {rid for i, (rid, *_) in added if i < waiting[0][0]}:
            added.append(waiting.pop(0))
            engine.add_request(*added[-1][1])
        for out in engine.step():
            seq = got.setdefault((out.rid, out.index), {f: [] for f in fields} | {"prompt": out.prompt_logprobs})
            for f in fields:
                seq[f] += getattr(out, f) or []
            started.add(out.rid)
            if out.finished:
                results[out.rid, out.index] = (*seq.values(), out.finish_reason)
        if not waiting and len(results) == len(added) and not engine.has_unfinished():
            break
    return results


def _graphed_or_not(make_engine, monkeypatch, model, graphs: bool, **kwargs):
    """(engine, the graphs' stand-in or None); with `graphs` its constrained graphs too."""
    if graphs:
        return graphed_engine(make_engine, monkeypatch, model, constrained=True, **kwargs)
    return make_engine(model, **kwargs), None


def _record_mixed(engine) -> tuple[list, set]:
    """From now on, per mixed step launched (its decode rows' grammar keys, whether their
    sampling has a captured variant), and the rids that decoded in one."""
    worker, scheduler, planned, decoded = engine.core.worker, engine.core.scheduler, [], set()
    launch_mixed, mixed_step = worker.launch_mixed, scheduler._mixed_step

    def launched(step):
        planned.append((step.decode.grammar, graph_variant(step.decode.sampling) is not None))
        return launch_mixed(step)

    def decision_rows(decision, grammar):
        decoded.update(r.rid for r in decision.decode_reqs)
        return mixed_step(decision, grammar)

    worker.launch_mixed, scheduler._mixed_step = launched, decision_rows
    return planned, decoded


def _assert_outputs_equal(got: dict, expected: dict) -> None:
    """Tokens, top alternatives' ids and finish reasons exact; logprobs to float rounding (a
    row's logits come from a GEMM over another batch than alone)."""
    assert got.keys() == expected.keys()
    for key, (tokens, logprobs, top, prompt, finish) in got.items():
        want = expected[key]
        assert (tokens, finish, [[i for i, _ in t] for t in top]) == \
            (want[0], want[4], [[i for i, _ in t] for t in want[2]]), key
        assert logprobs == pytest.approx(want[1], abs=1e-4), key
        assert [lp for t in top for _, lp in t] == pytest.approx([lp for t in want[2] for _, lp in t], abs=1e-4)
        assert (prompt is None) == (want[3] is None)
        assert prompt is None or prompt == pytest.approx(want[3], abs=1e-4)


def _alone(make_engine, model, spec, overlap: bool, waves: list) -> dict:
    engine = make_engine(model, spec=spec, enable_overlap=overlap, prefill_interleave_tokens=0)
    expected = {}
    for arrival in (a for wave in waves for a in wave):
        expected.update(_outputs(engine, [[arrival]]))
    return expected


TREE = dict(num_steps=2, topk=2, num_draft_tokens=4)


@pytest.mark.parametrize("overlap,graphs", [(False, False), (True, False), (True, True)],
                         ids=["normal", "overlap", "overlap-graphs"])
@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_constrained_requests_decode_in_mixed_steps(pair, make_engine, monkeypatch, overlap, graphs, shape):
    """Two requests with a grammar (greedy, and seeded sampling) decode while unconstrained
    prompts arrive, one a step once both decode: they were prefilled alone, and decode as rows
    of the mixed steps that carry the prompts (the grammar process told of the decode rows
    only); every output equals its request run alone; no KV leaks. With graphs (the CPU
    stand-in) the mixed forward replays, and a chain's wrap its constrained variants."""
    spec = SpecConfig(algorithm="eagle", draft_model=pair[1], **shape) if shape else None
    grammar = GrammarSpec("regex", "[a-c]{30,60}x")
    prompts = random_prompts(8, seed=43, min_len=6, max_len=30)
    waves = [[("g0", prompts[0], SamplingParams(max_new_tokens=30, temperature=0.0, grammar=grammar)),
              ("g1", prompts[1], SamplingParams(max_new_tokens=30, temperature=0.9, seed=7, grammar=grammar))],
             [(f"r{i}", p, _greedy(6)) for i, p in enumerate(prompts[2:])]]
    expected = _alone(make_engine, pair[0], spec, overlap, waves)
    engine, stand_in = _graphed_or_not(make_engine, monkeypatch, pair[0], graphs, spec=spec,
                                       enable_overlap=overlap, prefill_interleave_tokens=BUDGET)
    planned, decoded = _record_mixed(engine)
    _assert_outputs_equal(_outputs(engine, waves), expected)
    assert_no_leaks(engine)
    assert decoded >= {"g0", "g1"}
    keys = [k for k, _ in planned if k is not None]
    assert keys and all(sum(k is not None for k in step_keys) <= 2 for step_keys in keys)
    if graphs and shape is not TREE:  # (a tree's verify rows run eagerly)
        worker = engine.core.worker
        assert any(g is worker.mixed_graphs for g, _, _ in stand_in.replays)
        constrained_wraps = {id(g) for (_, constrained), g in worker.mixed_wrap_graphs.items() if constrained}
        assert bool(constrained_wraps) == bool(shape)
        assert any(id(g) in constrained_wraps for g, _, _ in stand_in.replays) == bool(shape)


@pytest.mark.parametrize("overlap,graphs", [(False, False), (True, True)], ids=["normal", "overlap-graphs"])
@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_penalised_and_scored_requests_decode_in_mixed_steps(pair, make_engine, monkeypatch, overlap, graphs,
                                                              shape):
    """Requests with repeat penalties, logprobs with top alternatives, and prompt logprobs are
    prefilled alone, then decode as rows of mixed steps that carry prompts arriving one a
    step: every output (tokens, logprobs, top alternatives, prompt logprobs, finish) equals
    its request run alone; no KV leaks."""
    spec = SpecConfig(algorithm="eagle", draft_model=pair[1], **shape) if shape else None
    prompts = random_prompts(9, seed=47, min_len=6, max_len=30)
    waves = [[("pen", prompts[0], SamplingParams(max_new_tokens=60, temperature=0.0, repetition_penalty=1.5,
                                                 presence_penalty=1.5, frequency_penalty=1.0, ignore_eos=True)),
              ("lp", prompts[1], _greedy(60, logprobs=True, top_logprobs=3)),
              ("plp", prompts[2], _greedy(60, prompt_logprobs=2))],
             [(f"r{i}", p, _greedy(6)) for i, p in enumerate(prompts[3:])]]
    expected = _alone(make_engine, pair[0], spec, overlap, waves)
    engine, _ = _graphed_or_not(make_engine, monkeypatch, pair[0], graphs, spec=spec, enable_overlap=overlap,
                                prefill_interleave_tokens=BUDGET)
    _, decoded = _record_mixed(engine)
    _assert_outputs_equal(_outputs(engine, waves), expected)
    assert_no_leaks(engine)
    assert decoded >= {"pen", "lp", "plp"}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [None, CHAIN, dict(num_steps=2, topk=2, num_draft_tokens=4)],
                         ids=["plain", "chain", "tree"])
def test_outputs_equal_the_rule_off_under_retraction(pair, make_engine, overlap, shape):
    spec = SpecConfig(algorithm="eagle", draft_model=pair[1], **shape) if shape else None
    prompts = random_prompts(8, seed=31, min_len=10, max_len=30)
    arrivals = [(i // 2, f"r{i}", p, _greedy(40)) for i, p in enumerate(prompts)]
    results = {}
    budget = 32  # the prompts ride fast enough to fill the pool while four verify rows decode
    for rule in (0, budget):
        engine = make_engine(pair[0], spec=spec, enable_overlap=overlap, max_total_tokens=260,
                             prefill_interleave_tokens=rule)
        steps = record_steps(engine)
        results[rule] = drive(engine, arrivals)
        assert engine.metrics.num_retractions > 0
        assert_no_leaks(engine)
        if rule:
            assert_decode_fair(steps, rule)
            assert engine.metrics.num_mixed_steps > 0
    assert results[budget] == results[0]


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
    assert not config().mixed_steps and config("--mixed-steps").mixed_steps
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--prefill-interleave-tokens", "-1"])
    assert exit_info.value.code == 2
    assert "prefill_interleave_tokens: must be an integer >= 0" in capsys.readouterr().err
