"""Engine-level parity between attention backends (Triton runs in the interpreter on the CPU)."""
from __future__ import annotations

import pytest

from helpers import make_predictable_pair, random_prompts

from specserve.engine import SamplingParams, SpecConfig

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def generate_per_backend(make_engine, target, spec_cfg, prompts, params, max_context_len):
    """Greedy outputs of the same requests on the torch-native and the Triton backend."""
    outs, engines = {}, {}
    for backend in ("torch", "triton"):
        engines[backend] = make_engine(target, attention_backend=backend, spec=spec_cfg,
                                       max_context_len=max_context_len)
        outs[backend] = [o.token_ids for o in engines[backend].generate(prompt_token_ids=prompts,
                                                                         sampling=params)]
    return outs, engines


@pytest.mark.parametrize("spec", [None, dict(num_steps=3, topk=1, num_draft_tokens=4),
                                  dict(num_steps=2, topk=2, num_draft_tokens=4)], ids=["plain", "chain", "tree"])
def test_triton_engine_matches_torch_native(pair, make_engine, spec):
    target, head = pair
    prompts = random_prompts(3, seed=6, max_len=12)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs, engines = generate_per_backend(make_engine, target, spec_cfg, prompts, params, 64)
    assert outs["triton"] == outs["torch"]
    assert not make_engine(target, attention_backend="triton").core.needs_cpu_seq_lens


@pytest.mark.parametrize("spec", [dict(num_steps=3, topk=1, num_draft_tokens=4),
                                  dict(num_steps=3, topk=2, num_draft_tokens=6)], ids=["chain", "tree"])
def test_triton_split_verify_matches_torch_native_on_long_prompts(pair, make_engine, spec):
    """Prompts long enough that verify and draft-extend run split over the prefix (the
    interpreter's splits are 64 tokens; 150 keys make 3), next to a short one in the batch."""
    target, head = pair
    prompts = random_prompts(1, seed=8, min_len=140, max_len=150) + random_prompts(1, seed=9, max_len=5)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    spec_cfg = SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs, engines = generate_per_backend(make_engine, target, spec_cfg, prompts, params, 200)
    for engine in engines.values():
        assert engine.metrics.mean_accept_length > 1.5  # really verifying several drafts
    assert outs["triton"] == outs["torch"]


@pytest.fixture(scope="module")
def deepseek_pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("ds_pair")), arch="deepseek_v3",
                                 num_layers=3)


@pytest.mark.parametrize("spec", [None, dict(num_steps=3, topk=2, num_draft_tokens=6)],
                         ids=["plain", "tree"])
def test_triton_mla_engine_matches_torch_native(deepseek_pair, make_engine, spec):
    """DeepSeek's MLA through the Triton kernels (one KV head, a 32 + 8 latent || rope key
    whose rope block is padded to the 16 dims tl.dot takes, the latent read as a view of the
    key) against the torch backend."""
    target, head = deepseek_pair
    prompts = random_prompts(3, seed=10, max_len=12)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs, engines = generate_per_backend(make_engine, target, spec_cfg, prompts, params, 64)
    assert outs["triton"] == outs["torch"]
    attn = engines["triton"].core.runner.attn_backend
    assert (attn.num_kv_heads, attn.head_dim, attn.v_head_dim) == (1, 40, 32)
