"""Greedy parity with transformers' generate, scheduling features, sampling, and bad input."""
from __future__ import annotations

import pytest
import torch

from helpers import VOCAB, hf_greedy, random_prompts

from specserve.engine import SamplingParams

MAX_NEW = 32
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=7, min_len=1, max_len=60)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    return hf_greedy(tiny_model, prompts, MAX_NEW)


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_greedy_matches_transformers(tiny_model, make_engine, prompts, reference, overlap):
    engine = make_engine(tiny_model, enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)


def test_one_at_a_time_matches_transformers(tiny_model, make_engine, prompts, reference):
    engine = make_engine(tiny_model)
    for prompt, ref in zip(prompts, reference):
        assert engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)[0].token_ids == ref


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_matches_transformers(tiny_model, make_engine, prompts, reference, overlap):
    engine = make_engine(tiny_model, chunked_prefill_size=7, enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_keeps_results_exact(tiny_model, make_engine, prompts, reference, overlap):
    # 6 requests need up to ~92 slots each at the end; 130 slots force retractions.
    engine = make_engine(tiny_model, max_total_tokens=130, enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert engine.metrics.num_retractions > 0
    assert [o.token_ids for o in outs] == reference


def test_max_running_requests_is_respected(tiny_model, make_engine, prompts, reference):
    engine = make_engine(tiny_model, max_running_requests=2)
    seen = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.rid, []).extend(out.new_token_ids)
        seen.append(engine.load().num_running)
    assert max(seen) <= 2
    assert [done[f"r{i}"] for i in range(len(prompts))] == reference


def test_stop_tokens_and_eos(tiny_model, make_engine, prompts, reference):
    engine = make_engine(tiny_model)
    stop = reference[0][5]
    first = reference[0].index(stop)
    out = engine.generate(prompt_token_ids=[prompts[0]], sampling=SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.token_ids == reference[0][:first + 1]
    assert out.finish_reason == "stop" and out.matched_stop == stop
    # min_new_tokens bans the stop token until enough tokens exist.
    out = engine.generate(prompt_token_ids=[prompts[0]], sampling=SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop], min_new_tokens=first + 2,
        ignore_eos=True))[0]
    assert len(out.token_ids) >= first + 2 and stop not in out.token_ids[:first + 2]


def test_eos_stops_unless_ignored(tiny_model, make_engine, prompts, reference, tmp_path):
    """generation_config.json's EOS ends a request (the EOS token included) unless ignore_eos."""
    import json
    import shutil

    eos = reference[1][3]
    path = shutil.copytree(tiny_model, tmp_path / "model")
    json.dump({"eos_token_id": [eos, 2]}, open(path / "generation_config.json", "w"))
    engine = make_engine(str(path))
    out = engine.generate(prompt_token_ids=[prompts[1]], sampling=SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.matched_stop == eos
    assert out.token_ids == reference[1][:reference[1].index(eos) + 1]
    assert engine.generate(prompt_token_ids=[prompts[1]], sampling=GREEDY)[0].token_ids == reference[1]


def test_logprobs_are_the_models(tiny_model, make_engine, prompts, reference):
    engine = make_engine(tiny_model)
    out = engine.generate(prompt_token_ids=[prompts[2]], sampling=SamplingParams(
        max_new_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True))[0]
    logits = engine.prompt_logits(prompts[2] + out.token_ids[:-1])[len(prompts[2]) - 1:]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_repetition_penalty_matches_transformers(tiny_model, make_engine, prompts):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    ids = torch.tensor([prompts[3]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                         do_sample=False, repetition_penalty=1.5, pad_token_id=0)[0, ids.shape[1]:].tolist()
    engine = make_engine(tiny_model)
    out = engine.generate(prompt_token_ids=[prompts[3]], sampling=SamplingParams(
        max_new_tokens=20, temperature=0.0, repetition_penalty=1.5, ignore_eos=True))[0]
    assert out.token_ids == ref


def test_top_k_one_is_greedy(tiny_model, make_engine, prompts, reference):
    engine = make_engine(tiny_model)
    out = engine.generate(prompt_token_ids=[prompts[0]], sampling=SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0.8, top_k=1, seed=3, ignore_eos=True))[0]
    assert out.token_ids == reference[0]


SAMPLED = [SamplingParams(max_new_tokens=24, temperature=0.9, seed=11, ignore_eos=True),
           SamplingParams(max_new_tokens=24, temperature=1.3, top_p=0.8, seed=12, ignore_eos=True),
           SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, min_p=0.05, seed=13,
                          ignore_eos=True)]


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_is_independent_of_the_batch(tiny_model, make_engine, prompts, overlap):
    engine = make_engine(tiny_model, enable_overlap=overlap)
    alone = [engine.generate(prompt_token_ids=[prompts[i]], sampling=SAMPLED[i])[0].token_ids
             for i in range(3)]
    # Same requests among others, in another order.
    batch_prompts = [prompts[5], prompts[2], prompts[4], prompts[0], prompts[1]]
    batch_params = [SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True), SAMPLED[2],
                    GREEDY, SAMPLED[0], SAMPLED[1]]
    outs = engine.generate(prompt_token_ids=batch_prompts, sampling=batch_params)
    assert [outs[3].token_ids, outs[4].token_ids, outs[1].token_ids] == alone
    # Sampling really samples: different seeds differ, and not greedy.
    other = engine.generate(prompt_token_ids=[prompts[0]], sampling=SamplingParams(
        max_new_tokens=24, temperature=0.9, seed=99, ignore_eos=True))[0].token_ids
    assert other != alone[0]


def test_seeded_sampling_same_in_both_loops(tiny_model, make_engine, prompts):
    runs = []
    for overlap in (False, True):
        engine = make_engine(tiny_model, enable_overlap=overlap, max_total_tokens=90)
        runs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts[:3], sampling=SAMPLED)])
    assert runs[0] == runs[1]


def test_sampler_follows_the_distribution():
    """The hash-noise exponential race samples from the given probabilities."""
    from specserve.engine.layers.sampler import sample_from_probs

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(20000, 1)
    seeds = torch.full((20000,), 5, dtype=torch.int64)
    tokens = sample_from_probs(probs, seeds, torch.arange(20000))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=1.0), "min_p"),
    (dict(top_k=-3), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_new_tokens=5, max_new_tokens=2), "min_new_tokens"),
    (dict(seed=-1), "seed"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_bad_prompts_name_the_field(tiny_model, make_engine):
    engine = make_engine(tiny_model, max_context_len=64)
    with pytest.raises(ValueError, match="^prompt_token_ids: must not be empty"):
        engine.generate(prompt_token_ids=[[]], sampling=GREEDY)
    with pytest.raises(ValueError, match=f"^prompt_token_ids: token id {VOCAB}"):
        engine.generate(prompt_token_ids=[[5, VOCAB]], sampling=GREEDY)
    with pytest.raises(ValueError, match="^prompt_token_ids: token id -1"):
        engine.generate(prompt_token_ids=[[-1]], sampling=GREEDY)
    with pytest.raises(ValueError, match="^prompt_token_ids: prompt of 64 tokens"):
        engine.generate(prompt_token_ids=[[5] * 64], sampling=GREEDY)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        engine.generate(prompt_token_ids=[[5]], sampling=SamplingParams(stop_token_ids=[VOCAB]))
    # A bad request among good ones leaves nothing behind, and the engine keeps serving.
    with pytest.raises(ValueError):
        engine.generate(prompt_token_ids=[[5, 6], []], sampling=GREEDY)
    assert engine.generate(prompt_token_ids=[[5, 6]], sampling=SamplingParams(max_new_tokens=3))[0].token_ids


def test_context_limit_finishes_with_length(tiny_model, make_engine):
    engine = make_engine(tiny_model, max_context_len=20)
    out = engine.generate(prompt_token_ids=[[5] * 15], sampling=GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_kv(tiny_model, make_engine, prompts, overlap):
    engine = make_engine(tiny_model, enable_overlap=overlap)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    finished = {}
    for step in range(200):
        if step == 3:
            engine.abort("r1")
            engine.abort("r4")
        for out in engine.step():
            if out.finished:
                finished[out.rid] = out.finish_reason
        if not engine.has_unfinished():
            break
    assert finished["r1"] == finished["r4"] == "abort"
    assert all(finished[f"r{i}"] == "length" for i in (0, 2, 3, 5))


def test_text_prompts_and_max_new_tokens_one(tiny_model, make_engine):
    engine = make_engine(tiny_model)
    outs = engine.generate(prompts=["def add(a, b):", "class Stack:"],
                           sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
    assert all(len(o.token_ids) == 1 and isinstance(o.text, str) for o in outs)
    assert outs[0].text == engine.tokenizer.decode(outs[0].token_ids)
