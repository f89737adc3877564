"""The bundled demo pair through the engine: loading, held-out perplexity, output quality, and
real speculative acceptance (chain and tree) with exact parity to plain decoding."""
from __future__ import annotations

import pytest
import torch

from test_demo_models import (
    DEMO_PROMPTS, HELDOUT_PPL_MAX, MIN_ACCEPT_LENGTH, assert_nontrivial, heldout_ids, heldout_prompts,
    load_hf_target, load_tokenizer, perplexity)

from specserve.engine import SamplingParams, SpecConfig

GREEDY = SamplingParams(max_new_tokens=96, temperature=0.0)


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(heldout_ids(load_tokenizer()), num=8, length=48)


def test_default_engine_is_the_demo_pair_with_speculation(make_engine):
    engine = make_engine(None, spec="default")
    assert engine.core.model_path.endswith("demo-target")
    assert engine.spec_config is not None and engine.spec_config.draft_model.endswith("demo-draft")
    assert engine.spec_config.algorithm == "eagle3" and engine.core.model_config.architecture == "LlamaForCausalLM"


def test_engine_logits_and_heldout_perplexity(make_engine):
    engine = make_engine(None)
    ids = list(range(5, 200))
    with torch.no_grad():
        ref = load_hf_target()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.prompt_logits(ids), ref, atol=2e-4, rtol=1e-4)
    ppl = perplexity(lambda x: engine.prompt_logits(x[0].tolist()).unsqueeze(0), heldout_ids(load_tokenizer()))
    assert ppl < HELDOUT_PPL_MAX


@pytest.mark.parametrize("prompt", DEMO_PROMPTS)
def test_demo_outputs_are_nontrivial(make_engine, prompt):
    engine = make_engine(None, spec="default")
    out = engine.generate(prompts=[prompt], sampling=SamplingParams(max_new_tokens=32, temperature=0.0))[0]
    assert_nontrivial(out.token_ids, what=prompt)
    assert out.text.strip()


def test_acceptance_floor_chain_and_tree(make_engine, prompts):
    """Chain 3/1/4 on held-out code reaches the floor; a 5/4/8 tree accepts more; both are
    token for token plain decoding."""
    plain = [o.token_ids for o in make_engine(None).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    accept = {}
    for name, shape in (("chain", dict(num_steps=3, topk=1, num_draft_tokens=4)),
                        ("tree", dict(num_steps=5, topk=4, num_draft_tokens=8))):
        engine = make_engine(None, spec=SpecConfig(**shape))
        outs = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
        assert [o.token_ids for o in outs] == plain
        accept[name] = sum(len(o.token_ids) for o in outs) / sum(o.num_verify_steps for o in outs)
    assert accept["chain"] >= MIN_ACCEPT_LENGTH
    assert accept["tree"] > accept["chain"]
