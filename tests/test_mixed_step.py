"""Mixed steps (runtime/mixed_step.py, scheduler/mixed_batch.py): a request that arrives while
others decode rides in their step's forward (decode or verify rows and its prompt chunks in one
target forward), and every request's output equals that request run alone: plain, chain and
tree, both loops, the prefix cache on and off, greedy and seeded sampling, n > 1, chunked long
prompts; no KV leak. Requests that cannot ride keep extends of their own."""
from __future__ import annotations

import functools

import pytest

from helpers import (assert_no_leaks, drive, graphed_engine, make_eagle3_head, make_predictable_pair,
                     random_prompts, record_steps)

from specserve.engine import GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.forward_batch import ForwardMode
from specserve.engine.scheduler.mixed_batch import rides_mixed
from specserve.engine.scheduler.schedule_batch import Req

SHAPES = {"plain": None, "chain": dict(num_steps=3, topk=1, num_draft_tokens=4),
          "tree": dict(num_steps=2, topk=2, num_draft_tokens=4)}
BUDGET = 32  # small enough that the long prompt takes several mixed steps
_REFERENCES: dict = {}


@pytest.fixture
def make_engine(make_engine):
    """This module's engines mix prompts into decode steps (off by default) unless a test says
    otherwise."""
    return functools.partial(make_engine, mixed_steps=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def _greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


def _sampled(max_new: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.9, seed=seed, ignore_eos=True, **kw)


def _arrivals():
    """Two requests decode from the start; the others arrive while they decode: a long prompt
    (chunked over several mixed steps), seeded sampling with a filter, n = 2, a prompt that
    starts with a running request's prompt (a cached prefix with the cache on), a stop token."""
    p = random_prompts(6, seed=41, min_len=4, max_len=14)
    long = random_prompts(1, seed=42, min_len=90, max_len=90)[0]
    return [(0, "d0", p[0], _greedy(28)), (0, "d1", p[1], _sampled(28, seed=5)),
            (2, "long", long, _greedy(6)), (3, "s", p[2], _sampled(8, seed=9, top_k=20)),
            (4, "n2", p[3], _sampled(6, seed=11, n=2)), (6, "warm", p[0] + p[4], _greedy(6)),
            (7, "stop", p[5], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[7, 9]))]


def _spec(pair, mode: str):
    shape = SHAPES[mode]
    return None if shape is None else SpecConfig(algorithm="eagle", draft_model=pair[1], **shape)


def alone(pair, make_engine, mode: str) -> dict:
    """Each request of `_arrivals` run alone (no prompt ever rides), once per mode."""
    if mode not in _REFERENCES:
        engine = make_engine(pair[0], spec=_spec(pair, mode), enable_overlap=False, enable_prefix_cache=False,
                             prefill_interleave_tokens=0)
        results, accepted = {}, {}
        for _, rid, prompt, params in _arrivals():
            results.update(drive(engine, [(0, rid, prompt, params)], accepted=accepted))
        assert engine.metrics.num_mixed_steps == 0
        _REFERENCES[mode] = results, accepted
    return _REFERENCES[mode]


def _rode(steps, rid: str) -> list:
    """The steps that ran chunks of `rid`'s prompt."""
    return [s for s in steps if (rid, 0) in s.reqs and (s.extend or s.mixed)]


def _prefilled(steps, rid: str) -> int:
    """The prompt tokens those steps computed for `rid` (a cached prefix is not computed)."""
    return sum(end - start for s in _rode(steps, rid) for start, end in [s.chunks[s.reqs.index((rid, 0))]])


@pytest.mark.parametrize("cache", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("mode", list(SHAPES))
def test_arrivals_ride_with_decode_rows_and_outputs_equal_each_alone(pair, make_engine, mode, overlap, cache):
    expected, expected_accepted = alone(pair, make_engine, mode)
    engine = make_engine(pair[0], spec=_spec(pair, mode), enable_overlap=overlap, enable_prefix_cache=cache,
                         prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    accepted = {}
    assert drive(engine, _arrivals(), accepted=accepted) == expected
    # The drafts too: each chunk's draft-extend left the draft state a prefill alone leaves.
    assert accepted == expected_accepted
    # Every arrival's prompt rode in decode steps' forwards: no extend of its own while others
    # decoded (the first two met an idle engine).
    assert not any(s.extend and s.decoding for s in steps)
    for rid in ("long", "s", "n2", "warm", "stop"):
        assert _rode(steps, rid) and all(s.mixed for s in _rode(steps, rid)), rid
    assert len(_rode(steps, "long")) >= 3 and _prefilled(steps, "long") == 90
    row_tokens = engine.core.worker.mixed_row_tokens()
    assert row_tokens == (1 if mode == "plain" else SHAPES[mode]["num_draft_tokens"])
    assert all(s.computed <= BUDGET for s in steps if s.mixed)  # the cap (no graphs: none to fill)
    assert engine.metrics.num_mixed_steps == sum(s.mixed for s in steps) > 0
    warm = len(_arrivals()[5][2])
    # "warm" computes only what d0's cached prompt does not cover, with the cache.
    assert (_prefilled(steps, "warm") < warm) if cache else (_prefilled(steps, "warm") == warm)
    if mode != "plain":
        assert engine.metrics.mean_accept_length > 1.3
    assert_no_leaks(engine)


@pytest.mark.parametrize("algorithm", ["ngram", "suffix"])
def test_copied_drafts_ride_too(pair, make_engine, algorithm):
    """The mixed step is the verifier's, whatever drafts: n-gram and suffix drafts (no draft
    model, the chunks' tokens written into its table) give each request's output alone."""
    spec = SpecConfig(algorithm=algorithm, num_steps=3, num_draft_tokens=4)
    reference = make_engine(pair[0], spec=spec, enable_overlap=False, enable_prefix_cache=False,
                            prefill_interleave_tokens=0)
    expected = {}
    for _, rid, prompt, params in _arrivals():
        expected.update(drive(reference, [(0, rid, prompt, params)]))
    engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=BUDGET)
    assert drive(engine, _arrivals()) == expected
    assert engine.metrics.num_mixed_steps > 0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_overlap_under_random_forward_delays(pair, make_engine, monkeypatch, mode):
    """Seeded sleeps around every forward reorder host and device progress in the overlap loop."""
    expected, _ = alone(pair, make_engine, mode)
    monkeypatch.setenv("SPECSERVE_FORWARD_DELAY", "5:3")
    engine = make_engine(pair[0], spec=_spec(pair, mode), enable_overlap=True, prefill_interleave_tokens=BUDGET)
    assert drive(engine, _arrivals()) == expected
    assert engine.metrics.num_mixed_steps > 0


@pytest.mark.parametrize("mode", list(SHAPES))
def test_graphed_decode_steps_and_graphed_mixed_steps_interleave(pair, make_engine, monkeypatch, mode):
    """With (CPU stand-in) CUDA graphs the decode steps between arrivals replay theirs and the
    mixed steps the mixed forwards' (runtime/captured_mixed.py; tree verify rows run eagerly);
    the outputs stay those of each request alone."""
    expected, _ = alone(pair, make_engine, mode)
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=_spec(pair, mode),
                                    prefill_interleave_tokens=BUDGET)
    graphs.replays.clear()
    assert drive(engine, _arrivals()) == expected
    assert engine.metrics.num_mixed_steps > 0
    worker = engine.core.worker
    assert any(g is worker.graphs or g in worker.sampled_graphs.values() for g, _, _ in graphs.replays)
    mixed_replays = sum(g is worker.mixed_graphs and part == 0 for g, _, part in graphs.replays)
    assert mixed_replays == (0 if mode == "tree" else engine.metrics.num_mixed_steps)
    assert_no_leaks(engine)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_an_eagle3_head_reads_the_chunks_features(pair, make_engine, tmp_path, mode):
    """EAGLE-3 (the bench's head) drafts from several target layers' features: each part's
    draft-extend reads its own rows of them."""
    head = make_eagle3_head(str(tmp_path / "head"), target_layers=2)
    spec = SpecConfig(algorithm="eagle3", draft_model=head, **SHAPES[mode])
    arrivals = _arrivals()[:4]
    expected = {}
    alone_engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=0)
    for _, rid, prompt, params in arrivals:
        expected.update(drive(alone_engine, [(0, rid, prompt, params)]))
    engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=BUDGET)
    assert drive(engine, arrivals) == expected
    assert engine.metrics.num_mixed_steps > 0


@pytest.mark.parametrize("mode", ["plain", "chain", "tree"])
def test_triton_mixed_forward_matches_torch_native(pair, make_engine, mode):
    """The Triton backend (interpreter, small shapes) runs the mixed forward's ragged layout:
    the verify rows' tree mask next to causal chunks."""
    arrivals = [(0, "d0", random_prompts(1, seed=51, max_len=8)[0], _greedy(10)),
                (2, "a", random_prompts(1, seed=52, min_len=20, max_len=20)[0], _greedy(4))]
    outs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(pair[0], spec=_spec(pair, mode), attention_backend=backend,
                             prefill_interleave_tokens=16, max_context_len=64)
        outs[backend] = drive(engine, arrivals)
        assert engine.metrics.num_mixed_steps > 0
    assert outs["triton"] == outs["torch"]


def test_requests_that_cannot_ride_get_extends_of_their_own(pair, make_engine):
    """A request asking for logprobs arrives while others decode: it is prefilled in an extend
    of its own (then a decode step is owed); then it decodes in the mixed steps that carry the
    prompts arriving meanwhile (none waits for an extend of its own); its outputs and the
    others' stay exact."""
    expected, _ = alone(pair, make_engine, "chain")
    engine = make_engine(pair[0], spec=_spec(pair, "chain"), prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    arrivals = _arrivals()
    scored = (1, "lp", random_prompts(1, seed=61, max_len=10)[0],
              SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, logprobs=True))
    got = drive(engine, arrivals + [scored])
    assert {k: v for k, v in got.items() if k[0] != "lp"} == expected
    own = _rode(steps, "lp")
    assert len(own) == 1 and own[0].extend and own[0].decoding
    i = steps.index(own[0])
    assert not steps[i + 1].extend and not steps[i + 1].mixed  # the decode step owed
    # The prompts that arrived while "lp" decoded rode with it.
    assert any(s.mixed for s in steps[i + 1:]) and not any(s.extend and s.decoding for s in steps[i + 1:])


@pytest.mark.parametrize("field,value", [
    ("grammar", GrammarSpec("regex", "[a-c]+")), ("repetition_penalty", 1.2), ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5), ("logprobs", True), ("top_logprobs", 2), ("prompt_logprobs", 0)])
def test_what_cannot_ride(field, value):
    """What keeps a request's prefill out of mixed steps' chunks (every request decodes in
    them: tests/test_scheduler_interleave.py)."""
    def req(**kw):
        return Req("r", [1, 2, 3], SamplingParams(**kw), 0, frozenset())

    assert rides_mixed(req(temperature=0.7, top_p=0.9, min_p=0.1, top_k=5, seed=3, n=2, min_new_tokens=2,
                           logit_bias=((4, 1.0),), stop_token_ids=(5,)))
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    assert not rides_mixed(req(**{field: value}, **extra))


def test_a_mixed_decision_lists_decode_rows_first(pair, make_engine):
    engine = make_engine(pair[0], spec=_spec(pair, "chain"), prefill_interleave_tokens=BUDGET)
    policy = engine.core.scheduler.policy
    decisions = []
    schedule = policy.schedule

    def keep(nothing_in_flight):
        decision = schedule(nothing_in_flight)
        decisions.append(decision)
        return decision

    policy.schedule = keep
    drive(engine, _arrivals()[:3])
    mixed = [d for d in decisions if d is not None and d.mode is ForwardMode.MIXED]
    assert mixed
    for d in mixed:
        assert d.decode_reqs == d.reqs[:d.num_decode] and d.extend_reqs == d.reqs[d.num_decode:]
        assert len(d.chunks) == len(d.samples) == len(d.extend_reqs) > 0
        assert not any(r.is_prefilling for r in d.decode_reqs)


def test_a_mixed_step_builds_only_its_chunks_sampling(pair, make_engine, monkeypatch):
    """The decode rows' SamplingInfo is the one their decode steps reuse (cached while the rows
    stay): a mixed step builds its chunks' alone, none of its whole batch (which also evicted
    the decode rows' from the cache)."""
    from specserve.engine.layers import sampler

    engine = make_engine(pair[0], spec=_spec(pair, "chain"), prefill_interleave_tokens=BUDGET)
    built = []
    build = sampler.SamplingInfo.build
    monkeypatch.setattr(sampler.SamplingInfo, "build", staticmethod(
        lambda params, *args: built.append(len(params)) or build(params, *args)))
    prompts = random_prompts(4, seed=81, min_len=20, max_len=30)
    arrivals = [(0, "d", prompts[0], _greedy(40))] + [(4 + i, f"a{i}", p, _greedy(1))
                                                   for i, p in enumerate(prompts[1:])]
    steps = record_steps(engine)
    built.clear()
    drive(engine, arrivals)
    mixed = sum(s.mixed for s in steps)
    assert mixed >= 3
    # Per mixed step its chunks' (one row each here); the decode rows' once per batch change.
    assert built.count(1) >= mixed and max(built) == 1


def test_a_request_that_cannot_ride_is_not_passed_over_by_the_prefix_order(pair, make_engine):
    """With the prefix cache, admission takes the longest cached prefix first: a request that
    cannot ride (logprobs) may come first there although it arrived last. The mixed step stops
    at it and the next step is an extend that takes it, while the others still decode."""
    base = random_prompts(1, seed=71, min_len=40, max_len=40)[0]
    engine = make_engine(pair[0], spec=_spec(pair, "chain"), prefill_interleave_tokens=BUDGET)
    engine.generate(prompt_token_ids=[base], sampling=_greedy(2))  # caches `base`
    steps = record_steps(engine)
    fresh = random_prompts(1, seed=72, min_len=20, max_len=20)[0]
    scored = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    got = drive(engine, [(0, "d", random_prompts(1, seed=73, max_len=6)[0], _greedy(40)),
                         (3, "fresh", fresh, _greedy(4)), (3, "scored", base + [5, 6], scored)])
    own = _rode(steps, "scored")
    assert len(own) == 1 and own[0].extend and own[0].decoding  # taken while "d" decoded
    assert len(got[("scored", 0)][0]) == 4 and len(got[("fresh", 0)][0]) == 4


@pytest.mark.parametrize("victim", ["long", "d0"], ids=["riding-chunk", "decode-row"])
@pytest.mark.parametrize("mode", ["plain", "tree"])
def test_an_abort_during_mixed_steps_frees_its_kv(pair, make_engine, mode, victim):
    """Aborted while its prompt rides in chunks (or while it decodes next to riding chunks),
    with a step in flight: its KV is freed, the others' outputs stay each one's alone."""
    expected, _ = alone(pair, make_engine, mode)
    engine = make_engine(pair[0], spec=_spec(pair, mode), prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    arrivals = _arrivals() + [(3, "one", random_prompts(1, seed=81, max_len=9)[0], _greedy(1))]
    tokens, finished = {}, {}
    for step in range(400):
        for at, rid, prompt, params in arrivals:
            if at == step:
                engine.add_request(rid, prompt, params)
        if step == 4:
            assert any(s.mixed and ("long", 0) in s.reqs for s in steps)  # "long" is riding
            assert engine.core.scheduler.reqs[("long", 0)].is_prefilling  # ... not done yet
            engine.abort(victim)
        for out in engine.step():
            tokens.setdefault((out.rid, out.index), []).extend(out.new_token_ids)
            if out.finished:
                finished[(out.rid, out.index)] = out.finish_reason
        if not engine.has_unfinished():
            break
    assert finished.pop((victim, 0)) == "abort"
    assert len(tokens.pop(("one", 0))) == 1 and finished.pop(("one", 0)) == "length"
    assert {k: (tokens[k], finished[k]) for k in finished} == {k: v for k, v in expected.items() if k[0] != victim}
    assert_no_leaks(engine)
