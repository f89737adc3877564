"""EAGLE speculative decoding: exact parity with plain decoding, chain and tree, both loops."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import (make_eagle3_head, make_predictable_pair, make_tiny_checkpoint, pair_chisquare_pvalue,
                     random_prompts, run_aborting)

from specserve.engine import SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
GREEDY_LONG = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
TREES = [dict(num_steps=3, topk=2, num_draft_tokens=6), dict(num_steps=4, topk=4, num_draft_tokens=8),
         dict(num_steps=2, topk=8, num_draft_tokens=10)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target + EAGLE-1 head with real partial acceptance."""
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory):
    """A 3-layer random target and a random EAGLE-3 head in the public layout."""
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny_checkpoint(str(root / "target"), "llama", num_layers=3, seed=5)
    return target, make_eagle3_head(str(root / "head"), target_layers=3)


def _spec(head, algorithm="eagle", **shape):
    return SpecConfig(algorithm=algorithm, draft_model=head, **(shape or CHAIN))


def _staggered(engine, prompts, params, seed=0):
    """Requests arrive over the first steps; returns {index: (tokens, finish_reason)}."""
    rng = random.Random(seed)
    arrivals = sorted((rng.randrange(0, 6), i) for i in range(len(prompts)))
    results, outs, step = {}, {}, 0
    while len(results) < len(prompts):
        for arrive, i in arrivals:
            if arrive == step:
                engine.add_request(str(i), prompts[i], params[i] if isinstance(params, list) else params)
        for out in engine.step():
            outs.setdefault(int(out.rid), []).extend(out.new_token_ids)
            if out.finished:
                results[int(out.rid)] = (outs[int(out.rid)], out.finish_reason)
        step += 1
    return results


@pytest.fixture(scope="module")
def reference(pair):
    """Plain decoding of the predictable target (computed once)."""
    from specserve.engine import Engine, EngineConfig

    prompts = random_prompts(32, seed=3, max_len=24)
    params = [SamplingParams(max_new_tokens=[1, 2, 3, 33][i % 4], temperature=0.0, ignore_eos=True)
              for i in range(32)]
    with Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    return prompts, params, [o.token_ids for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("needs_cpu", [True, False])
@pytest.mark.parametrize("shape", [CHAIN, TREES[0]], ids=["chain", "tree"])
def test_greedy_parity_batch_32_staggered(pair, reference, make_engine, overlap, needs_cpu, shape):
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair[1], **shape), enable_overlap=overlap,
                         needs_cpu_seq_lens=needs_cpu)
    got = _staggered(engine, prompts, params)
    assert [got[i][0] for i in range(len(prompts))] == expected
    assert engine.metrics.mean_accept_length > 1.5  # really speculating


@pytest.mark.parametrize("shape", TREES + [dict(num_steps=5, topk=1, num_draft_tokens=6)])
@pytest.mark.parametrize("overlap", [False, True])
def test_tree_shapes_match_plain_decoding(pair, reference, make_engine, shape, overlap):
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair[1], **shape), enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=prompts[:8], sampling=params[:8])
    assert [o.token_ids for o in outs] == expected[:8]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_eagle3_public_format_parity(eagle3_pair, make_engine, batch_size):
    target, head = eagle3_pair
    prompts = random_prompts(batch_size, seed=8)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = make_engine(target).generate(prompt_token_ids=prompts, sampling=params)
    for shape in (CHAIN, TREES[0]):
        spec = make_engine(target, spec=_spec(head, "eagle3", **shape)).generate(
            prompt_token_ids=prompts, sampling=params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert all(o.num_verify_steps > 0 for o in spec)


def test_eagle3_head_with_own_embedding_loads(tmp_path, eagle3_pair, make_engine):
    target, _ = eagle3_pair
    head = make_eagle3_head(str(tmp_path / "h"), target_layers=3, with_embed=True)
    engine = make_engine(target, spec=_spec(head, "eagle3"))
    assert engine.core.draft_runner.model.embed_tokens.weight.data_ptr() != \
        engine.core.runner.model.embed_tokens.weight.data_ptr()
    assert engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(max_new_tokens=5))[0].token_ids


def test_stop_inside_an_accepted_run(pair, reference, make_engine):
    """A stop token in the middle of a multi-token accept cuts exactly there."""
    prompts, _, expected = reference
    i = next(i for i in range(3, 32, 4) if len(set(expected[i][:20])) > 5)
    stop = expected[i][10]
    cut = expected[i].index(stop) + 1
    engine = make_engine(pair[0], spec=_spec(pair[1]))
    params = SamplingParams(max_new_tokens=33, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
    out = engine.generate(prompt_token_ids=[prompts[i]], sampling=params)[0]
    assert out.token_ids == expected[i][:cut] and out.finish_reason == "stop"
    assert out.accept_length > 1.0
    short = engine.generate(prompt_token_ids=[prompts[i]], sampling=SamplingParams(
        max_new_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert short.token_ids == expected[i][:7] and short.finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [CHAIN, TREES[1]], ids=["chain", "tree"])
def test_retraction_and_abort_mid_speculation(pair, reference, make_engine, overlap, shape):
    prompts, params, expected = reference
    engine = make_engine(pair[0], spec=_spec(pair[1], **shape), enable_overlap=overlap,
                         max_total_tokens=260)
    long_ids = [i for i in range(32) if params[i].max_new_tokens == 33][:6]
    for i in long_ids:
        engine.add_request(str(i), prompts[i], params[i])
    engine.add_request("gone", prompts[0], params[3])
    outs, reasons = run_aborting(engine, "gone", abort_at_step=4)
    assert reasons.pop("gone") == "abort"
    assert engine.metrics.num_retractions > 0
    assert {rid: outs[rid] for rid in reasons} == {str(i): expected[i] for i in long_ids}


def test_seeded_sampling_matches_plain_decoding(pair, make_engine):
    """Acceptance compares drafts with the target's own (seed, position)-keyed sample, so a
    seeded request samples exactly what plain decoding samples."""
    prompts = random_prompts(6, seed=4)
    params = [SamplingParams(max_new_tokens=30, temperature=t, top_p=p, top_k=k, seed=100 + i, ignore_eos=True)
              for i, (t, p, k) in enumerate([(0.8, 1.0, 0), (1.0, 0.9, 0), (0.6, 1.0, 20)] * 2)]
    plain = make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=params)
    for shape in (CHAIN, TREES[0]):
        spec = make_engine(pair[0], spec=_spec(pair[1], **shape)).generate(prompt_token_ids=prompts, sampling=params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def _joint_pvalue(engine, prompt, outs, vocab):
    """Chi-square p-value of the (2nd, 3rd) generated token pairs against the target's exact
    joint distribution (mixed over the first token)."""
    return pair_chisquare_pvalue(lambda ids: torch.softmax(engine.prompt_logits(ids)[-1], -1).double(),
                                 prompt, outs, vocab)


@pytest.mark.parametrize("shape", [CHAIN, dict(num_steps=2, topk=3, num_draft_tokens=5)], ids=["chain", "tree"])
def test_speculative_sampling_preserves_the_target_distribution(tmp_path, make_engine, shape):
    """Chi-square on a 12-token vocabulary over 3000 seeds. The same test rejects a wrong
    rule (accepting the first draft blindly) by a wide margin, so it has the power to fail."""
    target, head = make_predictable_pair(str(tmp_path), vocab_size=12, attn_scale=0.5)
    prompt, n = [5, 7, 3], 3000
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    engine = make_engine(target, spec=_spec(head, **shape), max_running_requests=64)
    outs = engine.generate(prompt_token_ids=[prompt] * n, sampling=params)
    assert engine.metrics.mean_accept_length > 1.1
    assert _joint_pvalue(engine, prompt, outs, 12) > 1e-3
    wrong = make_engine(target, spec=SpecConfig(algorithm="eagle", draft_model=head, bench_force_accept_len=2),
                        max_running_requests=64)
    assert _joint_pvalue(wrong, prompt, wrong.generate(prompt_token_ids=[prompt] * n, sampling=params), 12) < 1e-6


def test_tree_compaction_leaves_chain_kv(pair, make_engine):
    """After verify + compaction, the target KV of every committed position equals what a
    plain prefill of the same tokens writes."""
    from specserve.engine import Engine, EngineConfig

    prompt = random_prompts(1, seed=11, min_len=8, max_len=8)[0]
    engine = make_engine(pair[0], spec=_spec(pair[1], **TREES[1]), enable_overlap=False)
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True))
    produced = []
    while len(produced) < 20:
        for out in engine.step():
            produced += out.new_token_ids
    req = engine.core.scheduler.reqs[("r", 0)]
    committed = req.kv_committed_len
    assert req.num_verify_steps < len(produced)  # several tokens per verify: paths were moved
    slots = engine.core.req_to_token.table[req.row, :committed]
    ours_k = engine.core.kv_pool.k_buffer[1][slots].clone()
    ours_v = engine.core.kv_pool.v_buffer[1][slots].clone()
    engine.abort("r")
    engine.step()
    ref = Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None))
    tokens = (prompt + produced)[:committed]
    ref.prompt_logits(tokens)
    row_slots = torch.arange(1, committed + 1)  # a fresh allocator hands out slots 1..n
    torch.testing.assert_close(ours_k, ref.core.kv_pool.k_buffer[1][row_slots], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_v, ref.core.kv_pool.v_buffer[1][row_slots], atol=1e-5, rtol=1e-5)
    ref.shutdown()


def test_bench_force_accept_len(pair, make_engine):
    engine = make_engine(pair[0], spec=SpecConfig(algorithm="eagle", draft_model=pair[1], num_steps=3, topk=1,
                                                  num_draft_tokens=4, bench_force_accept_len=3))
    out = engine.generate(prompt_token_ids=[[5, 6]], sampling=SamplingParams(max_new_tokens=31, temperature=0.0,
                                                                              ignore_eos=True))[0]
    assert out.num_verify_steps == 10 and out.accept_length == pytest.approx(3.1)


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_steps=3, topk=1, num_draft_tokens=5), "spec.num_draft_tokens"),
    (dict(num_steps=0), "spec.num_steps"),
    (dict(topk=0), "spec.topk"),
    (dict(num_steps=2, topk=2, num_draft_tokens=9), "spec.num_draft_tokens"),
    (dict(algorithm="medusa"), "spec.algorithm"),
])
def test_spec_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SpecConfig(**kwargs)


def test_draft_mismatch_is_refused(tmp_path, eagle3_pair):
    from specserve.engine import Engine, EngineConfig

    target, _ = eagle3_pair
    head = make_eagle3_head(str(tmp_path / "h"), vocab_size=500)
    with pytest.raises(ValueError, match="spec.draft_model: draft vocab_size 500"):
        Engine(EngineConfig(model=target, device="cpu", spec=_spec(head, "eagle3")))
    with pytest.raises(ValueError, match="spec.draft_model: required"):
        Engine(EngineConfig(model=target, device="cpu", spec=SpecConfig()))


@pytest.mark.parametrize("overlap", [False, True])
def test_context_limit_inside_an_accepted_run(pair, make_engine, overlap):
    """A speculative request stops exactly at max_context_len, as plain decoding does."""
    prompt = random_prompts(1, seed=5, min_len=30, max_len=30)[0]
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    plain = make_engine(pair[0], max_context_len=41).generate(prompt_token_ids=[prompt], sampling=params)[0]
    for shape in (CHAIN, TREES[1]):
        spec = make_engine(pair[0], max_context_len=41, enable_overlap=overlap,
                           spec=_spec(pair[1], **shape)).generate(prompt_token_ids=[prompt], sampling=params)[0]
        assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 11
        assert spec.finish_reason == plain.finish_reason == "length"


@pytest.mark.parametrize("shape", [CHAIN, TREES[0]], ids=["chain", "tree"])
def test_overlap_spec_under_random_forward_delays(pair, reference, make_engine, monkeypatch, shape):
    """Seeded sleeps around every forward reorder host and device progress in the overlap loop."""
    prompts, params, expected = reference
    monkeypatch.setenv("SPECSERVE_FORWARD_DELAY", "7:3")
    engine = make_engine(pair[0], spec=_spec(pair[1], **shape), enable_overlap=True, max_total_tokens=400)
    got = _staggered(engine, prompts[:16], params[:16], seed=3)
    assert [got[i][0] for i in range(16)] == expected[:16]


@pytest.mark.parametrize("shape", [CHAIN, TREES[0]], ids=["chain", "tree"])
def test_per_token_rules_match_plain_decoding(pair, make_engine, shape):
    """Repetition penalty (drafted ancestors count as context), min_new_tokens with stop ids,
    and logprobs: speculative output equals plain decoding's, logprobs included."""
    prompts = random_prompts(4, seed=9, max_len=20)
    plain_ref = make_engine(pair[0]).generate(prompt_token_ids=prompts[:1], sampling=GREEDY_LONG)[0].token_ids
    stop = plain_ref[3]
    params = [SamplingParams(max_new_tokens=30, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[stop], min_new_tokens=12,
                             ignore_eos=True),
              SamplingParams(max_new_tokens=30, temperature=0.7, seed=5, repetition_penalty=1.2, logprobs=True,
                             ignore_eos=True),
              SamplingParams(max_new_tokens=30, temperature=0.0, logprobs=True, ignore_eos=True)]
    batch = [prompts[1], prompts[0], prompts[2], prompts[3]]
    plain = make_engine(pair[0]).generate(prompt_token_ids=batch, sampling=params)
    spec = make_engine(pair[0], spec=_spec(pair[1], **shape)).generate(prompt_token_ids=batch, sampling=params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) >= 12 for o in spec[1:2]) and stop not in spec[1].token_ids[:12]
    for s, p in zip(spec[2:], plain[2:]):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)

