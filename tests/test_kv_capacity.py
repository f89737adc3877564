"""A small KV pool: a request that cannot fit is refused or ends cleanly, never leaks slots or
wedges the engine, and admission counts the speculative reservation ([E11] faults 1, 2, 11)."""
from __future__ import annotations

import pytest

from helpers import assert_no_leaks, make_predictable_pair, random_prompts

from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig

SHAPES = {"plain": None,
          "chain": dict(num_steps=3, topk=1, num_draft_tokens=4),   # reserves 8 slots a step
          "tree": dict(num_steps=3, topk=4, num_draft_tokens=7)}    # reserves 24
MAX_NEW = 12
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# Around every shape's context cap on a 40-slot pool (plain 40, chain 33, tree 17).
PROMPT_LENS = (9, 12, 15, 16, 17, 18, 25, 30, 32, 33, 34, 39, 40, 41)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def prompts():
    return {n: random_prompts(1, seed=n, min_len=n, max_len=n)[0] for n in PROMPT_LENS}


@pytest.fixture(scope="module")
def reference(pair, prompts):
    """Plain greedy decoding on a roomy pool: the tokens every capped run must reproduce."""
    with Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=list(prompts.values()), sampling=GREEDY)
    return {n: o.token_ids for n, o in zip(prompts, outs)}


def _spec(pair, shape: str):
    return None if SHAPES[shape] is None else SpecConfig(algorithm="eagle", draft_model=pair[1],
                                                         **SHAPES[shape])


def _run_one(engine, rid: str, prompt: list[int], sampling: SamplingParams):
    engine.add_request(rid, prompt, sampling)
    tokens, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                reason = out.finish_reason
    return tokens, reason


@pytest.mark.parametrize("chunked_prefill_size", [0, 8])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_requests_around_the_pool_limit(pair, prompts, reference, make_engine, shape, overlap,
                                        chunked_prefill_size):
    """Each request alone on a 40-slot pool: refused up front when its prompt leaves no room,
    otherwise exact and cut by "length" at the context the pool allows; no slot is ever lost,
    and the engine keeps serving."""
    engine = make_engine(pair[0], spec=_spec(pair, shape), enable_overlap=overlap,
                         max_total_tokens=40, chunked_prefill_size=chunked_prefill_size)
    context = engine.max_context_len
    step_slots = 1 if SHAPES[shape] is None else engine.spec_config.kv_reserve_per_request
    assert context == 40 - step_slots + 1  # one request's peak KV fits the pool exactly
    for n, prompt in prompts.items():
        if n >= context:
            with pytest.raises(ValueError, match=r"^prompt_token_ids: .*max_context_len=\d+ "
                                                 r"\(capped by the 40-slot KV pool\)"):
                engine.add_request(f"r{n}", prompt, GREEDY)
        else:
            tokens, reason = _run_one(engine, f"r{n}", prompt, GREEDY)
            assert reason == "length"
            assert tokens == reference[n][:min(MAX_NEW, context - n)]
        assert_no_leaks(engine)
    assert _run_one(engine, "after", prompts[9][:4], GREEDY)[0] == \
        _run_one(engine, "again", prompts[9][:4], GREEDY)[0]
    assert engine.metrics.num_retractions == 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_issue_repro_sixteen_slots(pair, prompts, make_engine, shape, overlap):
    """The reported sequence on a 16-slot pool (prompts of 9, 12, 15 tokens): refused with the
    reason, or no engine at all when one step's reservation exceeds the pool."""
    if shape == "tree":
        with pytest.raises(ValueError, match=r"^max_total_tokens: 16 KV slots cannot hold one "
                                             r"request \(a decode step reserves 24 slots"):
            make_engine(pair[0], spec=_spec(pair, shape), max_total_tokens=16)
        return
    engine = make_engine(pair[0], spec=_spec(pair, shape), enable_overlap=overlap,
                         max_total_tokens=16)
    for n in (9, 12, 15):
        with pytest.raises(ValueError, match=r"^prompt_token_ids"):
            engine.add_request(f"r{n}", prompts[n], SamplingParams(max_new_tokens=4))
        assert_no_leaks(engine)
    tokens, reason = _run_one(engine, "fits", prompts[9][:5], SamplingParams(max_new_tokens=4))
    assert reason in ("length", "stop") and tokens
    assert_no_leaks(engine)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_default_pool_counts_the_speculative_reservation(pair, prompts, reference, make_engine,
                                                         shape, overlap):
    """One row, a 40-token context and a 20-token prompt: speculation finishes what plain
    decoding finishes (the default pool used to be rows x context, short of the reservation)."""
    prompt = prompts[25][:20]
    sampling = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    plain = make_engine(pair[0], max_running_requests=1, max_context_len=40)
    expected, reason = _run_one(plain, "plain", prompt, sampling)
    assert reason == "length" and len(expected) == 20
    engine = make_engine(pair[0], spec=_spec(pair, shape), enable_overlap=overlap,
                         max_running_requests=1, max_context_len=40)
    assert engine.max_context_len == 40
    assert _run_one(engine, "spec", prompt, sampling) == (expected, "length")


@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_retractions_stay_close_to_plain(pair, make_engine, overlap):
    """Six long requests on a 150-slot pool: admission leaves room for every running
    request's speculative reservation, so speculation retracts about as often as plain
    decoding (it retracted 18 times for a tree against 4 before) and stays exact."""
    batch = random_prompts(6, seed=3, max_len=24)
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    plain = make_engine(pair[0], max_total_tokens=150, enable_overlap=overlap)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=batch, sampling=sampling)]
    assert plain.metrics.num_retractions > 0  # the pool really is tight
    for shape in ("chain", "tree"):
        engine = make_engine(pair[0], spec=_spec(pair, shape), max_total_tokens=150,
                             enable_overlap=overlap)
        outs = engine.generate(prompt_token_ids=batch, sampling=sampling)
        assert [o.token_ids for o in outs] == expected
        assert engine.metrics.num_retractions <= plain.metrics.num_retractions + 2, shape
        assert_no_leaks(engine)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_accepted_drafts_count_only_kept_tokens(pair, make_engine, shape):
    """A verify cut by max_new_tokens or a stop id counts only the drafts that were emitted:
    every output token but the prefill's is an accepted draft or one verify's own token,
    and only the last verify may lose its own token to the cut."""
    engine = make_engine(pair[0], spec=_spec(pair, shape))
    batch = random_prompts(24, seed=11, max_len=16)
    params = [SamplingParams(max_new_tokens=1 + i % 7, temperature=0.0, ignore_eos=i % 2 == 0)
              for i in range(len(batch))]
    outs = engine.generate(prompt_token_ids=batch, sampling=params)
    assert sum(o.num_accepted_drafts for o in outs) > 0
    for out in outs:
        completion, steps = len(out.token_ids), out.num_verify_steps
        assert completion - 1 - steps <= out.num_accepted_drafts <= completion - steps
