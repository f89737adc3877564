"""E17 sampling fields and outputs: presence/frequency penalties, logit_bias, top_logprobs and
prompt logprobs; exact under speculation (chain and tree, both loops), checked against
transformers and against the target's exact distribution."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import make_predictable_pair, pair_chisquare_pvalue, random_prompts

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.config import sequence_seed

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
SHAPES = [CHAIN, TREE]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def _spec(head, **shape):
    return SpecConfig(algorithm="eagle", draft_model=head, **shape)


def _hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len, vocab] over one sequence."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _penalised_params(bias_tokens):
    """One request per rule (and one with all of them), greedy."""
    common = dict(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    return [SamplingParams(presence_penalty=1.5, **common),
            SamplingParams(frequency_penalty=0.7, **common),
            SamplingParams(logit_bias={bias_tokens[0]: 4.0, bias_tokens[1]: -100.0}, **common),
            SamplingParams(presence_penalty=-0.5, frequency_penalty=1.1, repetition_penalty=1.2,
                           logit_bias={bias_tokens[2]: 2.5}, **common)]


def _reference_greedy(logits_of, prompt, params: SamplingParams) -> list[int]:
    """Greedy decoding with the OpenAI penalties and logit_bias applied by hand to full
    forwards (no KV cache, no engine code)."""
    out: list[int] = []
    for _ in range(params.max_new_tokens):
        logits = logits_of(prompt + out)[-1].clone()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + out] = True
        pen = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0]).float()
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        for token, bias in params.logit_bias:
            logits[token] += bias
        out.append(int(logits.argmax()))
    return out


def test_penalties_and_bias_match_a_reference(pair, make_engine):
    """Plain decoding with each rule equals the rule applied by hand to full forwards, and
    every rule changes the output (so the comparisons below are not vacuous)."""
    prompts = random_prompts(4, seed=21, min_len=3, max_len=12)
    engine = make_engine(pair[0])
    unbiased = engine.generate(prompt_token_ids=prompts, sampling=SamplingParams(
        max_new_tokens=30, temperature=0.0, ignore_eos=True))
    # Bias the token greedy decoding picks most, and ban its first token.
    favourite = max(set(unbiased[2].token_ids), key=unbiased[2].token_ids.count)
    bias_tokens = [7, unbiased[2].token_ids[0], favourite]
    params = _penalised_params(bias_tokens)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    for prompt, p, out, plain in zip(prompts, params, outs, unbiased):
        assert out.token_ids == _reference_greedy(engine.prompt_logits, prompt, p)
        assert out.token_ids != plain.token_ids
    assert bias_tokens[1] not in outs[2].token_ids


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree"])
def test_penalties_and_bias_greedy_parity_under_speculation(pair, make_engine, shape, overlap):
    """Each draft node sees the output counts of its own ancestors: speculative output equals
    plain decoding's token for token, with a batch that mixes the rules and plain requests."""
    prompts = random_prompts(6, seed=22, min_len=2, max_len=16)
    params = _penalised_params([7, 11, 13]) + [
        SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)] * 2
    plain = make_engine(pair[0], enable_overlap=overlap).generate(prompt_token_ids=prompts, sampling=params)
    engine = make_engine(pair[0], enable_overlap=overlap, spec=_spec(pair[1], **shape))
    spec = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.metrics.mean_accept_length > 1.2  # drafts were accepted under the penalties


@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree"])
def test_penalties_and_bias_seeded_parity_under_speculation(pair, make_engine, shape):
    prompts = random_prompts(4, seed=23, max_len=16)
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, seed=40 + i, presence_penalty=0.8,
                             frequency_penalty=0.4 * i, logit_bias={5 + i: 3.0}, top_p=0.95,
                             logprobs=True, top_logprobs=3, ignore_eos=True) for i in range(4)]
    plain = make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=params)
    spec = make_engine(pair[0], spec=_spec(pair[1], **shape)).generate(prompt_token_ids=prompts,
                                                                         sampling=params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)
        assert [[t for t, _ in top] for top in s.top_logprobs] == [[t for t, _ in top] for top in p.top_logprobs]


def _joint_pvalue(engine, prompt, outs, vocab, penalties):
    """Chi-square p-value of the (2nd, 3rd) generated tokens against the exact joint
    distribution of the target under the presence/frequency penalties (mixed over the first
    token); `penalties` = (presence, frequency)."""
    presence, frequency = penalties

    def dist(ids):
        logits = engine.prompt_logits(ids)[-1].double()
        counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.int64), minlength=vocab).double()
        return torch.softmax(logits - frequency * counts - presence * (counts > 0), -1)

    return pair_chisquare_pvalue(dist, prompt, outs, vocab)


@pytest.mark.parametrize("shape", [CHAIN, dict(num_steps=2, topk=3, num_draft_tokens=5)], ids=["chain", "tree"])
def test_speculative_sampling_with_penalties_keeps_the_distribution(tmp_path, make_engine, shape):
    """3000 seeded requests on a 12-token vocabulary with presence and frequency penalties:
    the generated pairs follow the penalised target distribution. Power: the same samples
    reject the distribution without the penalties, and a wrong acceptance rule is rejected."""
    target, head = make_predictable_pair(str(tmp_path), vocab_size=12, attn_scale=0.5)
    prompt, n, penalties = [5, 7, 3], 3000, (1.0, 0.8)
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s, presence_penalty=penalties[0],
                             frequency_penalty=penalties[1], ignore_eos=True) for s in range(n)]
    engine = make_engine(target, spec=_spec(head, **shape), max_running_requests=64)
    outs = engine.generate(prompt_token_ids=[prompt] * n, sampling=params)
    assert engine.metrics.mean_accept_length > 1.1
    assert _joint_pvalue(engine, prompt, outs, 12, penalties) > 1e-3
    assert _joint_pvalue(engine, prompt, outs, 12, (0.0, 0.0)) < 1e-6
    wrong = make_engine(target, spec=SpecConfig(algorithm="eagle", draft_model=head, bench_force_accept_len=2),
                        max_running_requests=64)
    wrong_outs = wrong.generate(prompt_token_ids=[prompt] * n, sampling=params)
    assert _joint_pvalue(wrong, prompt, wrong_outs, 12, penalties) < 1e-6


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_top_logprobs_equal_transformers(pair, make_engine, spec, overlap):
    """Every generated token's logprob and its top-5 alternatives are transformers'
    log-softmax at that position (fp32), accepted drafts included."""
    prompts = random_prompts(3, seed=24, min_len=2, max_len=20)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
    engine = make_engine(pair[0], enable_overlap=overlap,
                         spec=None if spec is None else _spec(pair[1], **spec))
    for prompt, out in zip(prompts, engine.generate(prompt_token_ids=prompts, sampling=params)):
        expected = torch.log_softmax(_hf_logits(pair[0], prompt + out.token_ids)[len(prompt) - 1:-1], -1)
        top, top_ids = expected.topk(5, -1)
        assert len(out.top_logprobs) == len(out.token_ids)
        assert [[t for t, _ in pos] for pos in out.top_logprobs] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([[lp for _, lp in pos] for pos in out.top_logprobs]), top,
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(out.logprobs),
                                   expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)


def test_logprobs_are_of_the_penalised_distribution(pair, make_engine):
    """Documented: logprobs come after penalties and bias, before temperature and truncation."""
    prompt = random_prompts(1, seed=25, min_len=5, max_len=5)[0]
    params = SamplingParams(max_new_tokens=6, temperature=0.5, top_k=3, seed=1, logit_bias={9: 5.0},
                            frequency_penalty=0.9, logprobs=True, top_logprobs=2, ignore_eos=True)
    engine = make_engine(pair[0])
    out = engine.generate(prompt_token_ids=[prompt], sampling=params)[0]
    for i, token in enumerate(out.token_ids):
        logits = engine.prompt_logits(prompt + out.token_ids[:i])[-1].clone()
        logits[9] += 5.0
        logits -= 0.9 * torch.bincount(torch.tensor(out.token_ids[:i], dtype=torch.int64),
                                       minlength=logits.shape[0]).float()
        expected = torch.log_softmax(logits, -1)
        assert out.logprobs[i] == pytest.approx(float(expected[token]), abs=1e-4)
        assert [t for t, _ in out.top_logprobs[i]] == expected.topk(2).indices.tolist()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
@pytest.mark.parametrize("chunk", [0, 5], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(pair, make_engine, spec, overlap, chunk):
    """Prompt tokens 1.. get transformers' log-softmax of the position before (fp32), with
    their top-k, whether the prompt is prefilled at once or in chunks of 5."""
    prompts = random_prompts(3, seed=26, min_len=1, max_len=23)
    params = [SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=k, ignore_eos=True)
              for k in (0, 3, 4)]
    engine = make_engine(pair[0], enable_overlap=overlap, chunked_prefill_size=chunk,
                         spec=None if spec is None else _spec(pair[1], **spec))
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    for prompt, p, out in zip(prompts, params, outs):
        expected = torch.log_softmax(_hf_logits(pair[0], prompt)[:-1], -1)
        assert len(out.prompt_logprobs) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs),
                                   expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].reshape(-1),
                                   atol=1e-4, rtol=1e-4)
        if p.prompt_logprobs:
            top, top_ids = expected.topk(p.prompt_logprobs, -1)
            assert [[t for t, _ in pos] for pos in out.prompt_top_logprobs] == top_ids.tolist()
            torch.testing.assert_close(
                torch.tensor([[lp for _, lp in pos] for pos in out.prompt_top_logprobs]).reshape(top.shape),
                top, atol=1e-4, rtol=1e-4)
        else:
            assert out.prompt_top_logprobs is None


def test_prompt_logprobs_survive_retraction(pair, make_engine):
    """A request retracted and prefilled again scores each prompt token once."""
    prompts = random_prompts(6, seed=27, min_len=20, max_len=40)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    engine = make_engine(pair[0], max_total_tokens=200, chunked_prefill_size=16)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert engine.metrics.num_retractions > 0
    reference = make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=params)
    for out, ref, prompt in zip(outs, reference, prompts):
        assert len(out.prompt_logprobs) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs), torch.tensor(ref.prompt_logprobs),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs,field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(logit_bias={3: float("inf")}), "logit_bias"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_bad_sampling_fields_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(pair, make_engine):
    engine = make_engine(pair[0])
    vocab = engine.info.vocab_size
    with pytest.raises(ValueError, match="^logit_bias: token id"):
        engine.add_request("r", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished()


# --- n > 1: sequences sharing the prompt's KV ---------------------------------------------------
def _independent(engine, prompt, params: SamplingParams):
    """The n sequences as n separate requests with the documented seeds (seed + i; greedy
    requests have none)."""
    singles = [dataclasses.replace(params, n=1, seed=None if params.seed is None else sequence_seed(params.seed, i))
               for i in range(params.n)]
    return [o.token_ids for o in engine.generate(prompt_token_ids=[prompt] * params.n, sampling=singles)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_n_sequences_equal_independent_requests(pair, make_engine, spec, overlap):
    prompts = random_prompts(2, seed=28, min_len=9, max_len=30) + [[17]]  # and a one-token prompt
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=2**63 - 2, n=4, presence_penalty=0.5,
                             ignore_eos=True),
              SamplingParams(max_new_tokens=15, temperature=0.0, n=3, frequency_penalty=0.4, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=1.0, seed=9, n=2, ignore_eos=True)]
    engine = make_engine(pair[0], enable_overlap=overlap, chunked_prefill_size=8,
                         spec=None if spec is None else _spec(pair[1], **spec))
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.index for o in outs] == [0, 1, 2, 3, 0, 1, 2, 0, 1]
    got = [o.token_ids for o in outs]
    assert got[:4] == _independent(engine, prompts[0], params[0])
    assert len(set(map(tuple, got[:4]))) > 1  # the sequences differ: seeds are per sequence
    assert got[4:7] == _independent(engine, prompts[1], params[1])
    assert got[7:] == _independent(engine, prompts[2], params[2])
    assert all(o.prompt_tokens == len(prompts[0]) for o in outs[:4])


def _step_until(engine, done):
    outs = {}
    while not done(outs):
        for out in engine.step():
            outs.setdefault(out.index, []).append(out)
    return outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("spec", [None, CHAIN], ids=["plain", "chain"])
def test_n_holds_the_prompt_kv_once_and_frees_it_with_the_last_sequence(pair, make_engine, spec, overlap):
    prompt = random_prompts(1, seed=29, min_len=30, max_len=30)[0]
    # The shared prefix's own reference counts: with the prefix cache on (the default) the
    # cache holds it instead (tests/test_prefix_cache.py).
    engine = make_engine(pair[0], enable_overlap=overlap, spec=None if spec is None else _spec(pair[1], **spec),
                         enable_prefix_cache=False)
    alloc, scheduler = engine.core.allocator, engine.core.scheduler
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=200, temperature=0.0, n=4, ignore_eos=True))
    _step_until(engine, lambda outs: len(outs) == 4)
    reqs = [scheduler.reqs[("r", i)] for i in range(4)]
    shared = reqs[0].shared
    assert all(r.shared is shared and r.owns_share for r in reqs) and shared.owners == 4
    # The prompt's first 29 tokens once, then each sequence's own slots (its last prompt
    # token, outputs and the step's reservation).
    own = sum(r.kv_allocated_len - shared.length for r in reqs)
    assert alloc.num_slots - alloc.num_free == shared.length + own
    assert own < 4 * 20 < 3 * shared.length
    rows = engine.core.req_to_token.table
    assert all(torch.equal(rows[r.row, :shared.length], shared.slots) for r in reqs)
    engine.abort("r", 1)
    engine.abort("r", 2)
    engine.step()
    assert shared.owners == 2 and shared.live
    engine.abort("r", 0)
    engine.step()
    assert shared.owners == 1 and shared.live and scheduler.num_running == 1
    engine.abort("r")
    scheduler.drain()
    assert not shared.live and alloc.num_free == alloc.num_slots


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_aborting_one_sequence_leaves_the_others_running(pair, make_engine, spec, overlap):
    prompt = random_prompts(1, seed=30, min_len=12, max_len=12)[0]
    params = SamplingParams(max_new_tokens=25, temperature=0.8, seed=77, n=3, ignore_eos=True)
    engine = make_engine(pair[0], enable_overlap=overlap, spec=None if spec is None else _spec(pair[1], **spec))
    expected = _independent(engine, prompt, params)
    engine.add_request("r", prompt, params)
    _step_until(engine, lambda outs: len(outs) == 3)
    engine.abort("r", 1)
    outs = _step_until(engine, lambda outs: all(o[-1].finished for o in outs.values()) and len(outs) == 3)
    assert outs[1][-1].finish_reason == "abort" and len(outs[1]) == 1
    for i in (0, 2):
        assert [t for o in outs[i] for t in o.new_token_ids] != []
        assert outs[i][-1].finish_reason == "length"
    assert engine.generate(prompt_token_ids=[prompt], sampling=params)[0].token_ids == expected[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_n_under_retraction_stays_exact(pair, make_engine, overlap):
    """A small pool retracts sequences (the prompt's creator too) and the prefix dies and is
    created again; every sequence still equals its independent request, nothing leaks."""
    prompts = random_prompts(2, seed=31, min_len=20, max_len=30)
    params = SamplingParams(max_new_tokens=40, temperature=0.7, seed=5, n=3, frequency_penalty=0.3,
                            prompt_logprobs=1, ignore_eos=True)
    engine = make_engine(pair[0], enable_overlap=overlap, max_total_tokens=180, chunked_prefill_size=16)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert engine.metrics.num_retractions > 0
    reference = make_engine(pair[0])
    for k, prompt in enumerate(prompts):
        assert [o.token_ids for o in outs[3 * k:3 * k + 3]] == _independent(reference, prompt, params)
        scored = reference.generate(prompt_token_ids=[prompt], sampling=dataclasses.replace(params, n=1))[0]
        for o in outs[3 * k:3 * k + 3]:  # every sequence gets the prompt's scores
            assert len(o.prompt_logprobs) == len(prompt) - 1
            torch.testing.assert_close(torch.tensor(o.prompt_logprobs), torch.tensor(scored.prompt_logprobs),
                                       atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("value", [0, 65, True, 2.0])
def test_bad_n_is_named(value):
    with pytest.raises(ValueError, match="^n:"):
        SamplingParams(n=value)
