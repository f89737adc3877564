"""Qwen3-MoE and Mixtral: parity with transformers (routing with and without renormalisation,
top-1/top-2 of 4/8 experts, Qwen3-MoE's dense layers by decoder_sparse_step and
mlp_only_layers), speculative decoding on them (EAGLE-1 predictable pairs, EAGLE-3 heads),
tensor parallelism over the experts' intermediate dims, FP8 experts, refusals (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch
from fp8_quantizer import FP8, quantize_checkpoint
from helpers import (TP_PLACEMENTS, cached_checkpoints, hf_greedy, hf_logits, make_eagle3_head, make_predictable_pair,
                     moe_family_config, random_prompts, tp_placement)

from specserve.engine import SamplingParams, SpecConfig

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)

# name -> (arch, options, which of the 3 layers are MoE)
CONFIGS = {
    "qwen3-8x2-normed": ("qwen3_moe", dict(num_experts=8, top_k=2, norm_topk_prob=True), [1, 1, 1]),
    "qwen3-4x2-unnormed-step2": ("qwen3_moe", dict(num_experts=4, top_k=2, norm_topk_prob=False,
                                                    sparse_step=2), [0, 1, 0]),
    "qwen3-8x1-mlp-only-0": ("qwen3_moe", dict(num_experts=8, top_k=1, mlp_only_layers=(0,)), [0, 1, 1]),
    "mixtral-8x2": ("mixtral", dict(num_experts=8, top_k=2), [1, 1, 1]),
    "mixtral-4x1": ("mixtral", dict(num_experts=4, top_k=1), [1, 1, 1]),
}



@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return cached_checkpoints(tmp_path_factory, CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, make_engine, name):
    from specserve.engine.models.deepseek import DeepseekMoE

    path = checkpoints(name)
    engine = make_engine(path)
    model = engine.core.runner.model
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in model.layers] == [bool(m) for m in CONFIGS[name][2]]
    ids = torch.randint(3, 300, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(path, ids), atol=2e-4, rtol=1e-4)


def test_config_is_read(checkpoints, make_engine):
    from specserve.engine.models.moe_families import MixtralForCausalLM, Qwen3MoeForCausalLM

    engine = make_engine(checkpoints("qwen3-4x2-unnormed-step2"))
    cfg = engine.core.model_config
    assert isinstance(engine.core.runner.model, Qwen3MoeForCausalLM) and cfg.qk_norm
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.moe_intermediate_size) == (4, 2, 32)
    assert cfg.moe.scoring == "softmax" and not cfg.moe.norm_topk_prob and cfg.moe.sparse_step == 2
    assert cfg.moe.num_shared_experts == 0 and cfg.moe.routed_scaling_factor == 1.0
    mixtral = make_engine(checkpoints("mixtral-4x1"))
    cfg = mixtral.core.model_config
    assert isinstance(mixtral.core.runner.model, MixtralForCausalLM) and not cfg.qk_norm
    assert cfg.moe.norm_topk_prob and cfg.moe.moe_intermediate_size == cfg.intermediate_size == 128


def test_routing_matters(checkpoints, make_engine):
    """The test checkpoints route apart: another expert choice changes the logits."""
    engine = make_engine(checkpoints("mixtral-8x2"))
    ids = list(range(3, 40))
    before = engine.prompt_logits(ids)
    router = engine.core.runner.model.layers[1].mlp.gate
    with torch.no_grad():
        router.weight.copy_(router.weight.roll(1, dims=0))
    assert not torch.allclose(engine.prompt_logits(ids), before, atol=1e-3)


@pytest.mark.parametrize("name,overlap", [(name, i % 2 == 0) for i, name in enumerate(CONFIGS)])
def test_greedy_matches_transformers_generate(checkpoints, make_engine, name, overlap):
    path = checkpoints(name)
    prompts = random_prompts(3, seed=6, max_len=30)
    expected = hf_greedy(path, prompts, 12)
    engine = make_engine(path, enable_overlap=overlap, chunked_prefill_size=16)
    outs = engine.generate(prompt_token_ids=prompts,
                           sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("name", ["qwen3-4x2-unnormed-step2", "mixtral-4x1"])
def test_engine_through_the_decode_kernels_matches_transformers(checkpoints, make_engine, monkeypatch, name):
    """The decode experts kernel (steps of at most 16 tokens, its combine adding no residual:
    these families have no shared experts) and the Triton routers (the fused gemv + top-k at
    most 16 tokens, the softmax top-k of the torch gemv's logits above), run by the
    interpreter on CPU tensors in place of the torch paths that CPU engines take (CUDA engines
    dispatch to them in run_experts and route): transformers' greedy tokens. Counts the
    calls, so the kernels really ran."""
    from specserve.engine.layers import moe
    from specserve.engine.layers.moe import fused_experts
    from specserve.engine.layers.moe_decode import MAX_DECODE_TOKENS, decode_fused_experts
    from specserve.engine.layers.moe_router import MAX_ROUTER_TOKENS, router_softmax_topk, softmax_topk
    from specserve.engine.models import deepseek

    calls = {"experts": 0, "router": 0, "fused router": 0}

    def run_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None):
        if x.shape[0] > MAX_DECODE_TOKENS:
            return fused_experts(x, w13, w2, topk_weights, topk_ids)
        calls["experts"] += 1
        return decode_fused_experts(x, w13, w2, topk_weights, topk_ids)

    def select_experts(logits, *, top_k, norm_topk_prob, routed_scaling_factor, **ungrouped_softmax):
        calls["router"] += 1
        return softmax_topk(logits, top_k, norm_topk_prob, routed_scaling_factor)

    def fused_router(*args):
        calls["fused router"] += 1
        return router_softmax_topk(*args)

    monkeypatch.setattr(deepseek, "run_experts", run_experts)
    monkeypatch.setattr(moe, "select_experts", select_experts)
    monkeypatch.setattr(moe, "_router_softmax_topk", fused_router)
    monkeypatch.setattr(moe, "can_fuse_router", lambda x, *_: x.shape[0] <= MAX_ROUTER_TOKENS)
    path = checkpoints(name)
    prompts = random_prompts(2, seed=6, max_len=30)  # prefills past 16 tokens: the torch gemv
    outs = make_engine(path).generate(prompt_token_ids=prompts,
                                      sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    assert calls["experts"] and calls["router"] and calls["fused router"]
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 6)


@pytest.mark.parametrize("arch,opts", [
    ("qwen3_moe", dict(norm_topk_prob=False)), ("qwen3_moe", dict(norm_topk_prob=True, top_k=3)),
    ("mixtral", {}), ("mixtral", dict(top_k=1))])
def test_router_and_experts_match_transformers(arch, opts):
    """The router's weights and ids and the experts' output equal transformers' modules'."""
    import transformers as tf

    from specserve.engine.layers.moe import fused_experts
    from specserve.engine.models.deepseek import Router
    from specserve.engine.models.model_config import ModelConfig

    hf_cfg = moe_family_config(arch, vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               num_experts=16, **opts)
    module = tf.models.mixtral.modeling_mixtral if arch == "mixtral" else tf.models.qwen3_moe.modeling_qwen3_moe
    prefix = "Mixtral" if arch == "mixtral" else "Qwen3Moe"
    torch.manual_seed(0)
    hf_router, hf_experts = getattr(module, prefix + "TopKRouter")(hf_cfg), getattr(module, prefix + "Experts")(hf_cfg)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5)
        hf_experts.gate_up_proj.normal_(0, 0.1)
        hf_experts.down_proj.normal_(0, 0.1)
    arch_name = "MixtralForCausalLM" if arch == "mixtral" else "Qwen3MoeForCausalLM"
    router = Router(ModelConfig.from_dict(dict(hf_cfg.to_dict(), architectures=[arch_name])))
    with torch.no_grad():
        router.weight.copy_(hf_router.weight)
    x = torch.randn(50, 64)
    _, ref_w, ref_ids = hf_router(x)
    weights, ids = router(x)
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))
    out = fused_experts(x, hf_experts.gate_up_proj.data, hf_experts.down_proj.data, weights, ids)
    torch.testing.assert_close(out, hf_experts(x, ref_ids, ref_w), atol=1e-6, rtol=1e-5)
    assert router.to(torch.bfloat16).weight.dtype == torch.float32  # read as is, never cast per step


# --- speculative decoding on the MoE families ----------------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """arch -> a predictable target (attention and experts scaled down) + EAGLE-1 head, and the
    plain engine's outputs on it."""
    from specserve.engine import Engine, EngineConfig

    made = {}

    def get(arch):
        if arch not in made:
            pair = make_predictable_pair(str(tmp_path_factory.mktemp(arch)), arch=arch, num_layers=3,
                                         **dict(qwen3_moe=dict(sparse_step=2), mixtral={})[arch])
            prompts = random_prompts(6, seed=3, max_len=24)
            params = [SamplingParams(max_new_tokens=[1, 3, 20][i % 3], temperature=0.0, ignore_eos=True)
                      for i in range(6)]
            with Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None)) as engine:
                outs = engine.generate(prompt_token_ids=prompts, sampling=params)
            made[arch] = pair, prompts, params, [o.token_ids for o in outs]
        return made[arch]

    return get


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("arch,overlap", [("qwen3_moe", True), ("mixtral", False)])
def test_spec_equals_plain(pairs, make_engine, arch, overlap, shape):
    (target, head), prompts, params, expected = pairs(arch)
    engine = make_engine(target, spec=SpecConfig(algorithm="eagle", draft_model=head, **shape),
                         enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == expected
    assert engine.metrics.mean_accept_length > 1.3  # really speculating


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("name", ["qwen3-4x2-unnormed-step2", "mixtral-8x2"])
def test_eagle3_head_on_moe_target(tmp_path, checkpoints, make_engine, name, shape):
    target = checkpoints(name)
    head = make_eagle3_head(str(tmp_path / "head"), target_layers=3)
    prompts = random_prompts(3, seed=8, max_len=20)
    expected = [o.token_ids for o in make_engine(target).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    engine = make_engine(target, spec=SpecConfig(algorithm="eagle3", draft_model=head, **shape))
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected


# --- tensor parallelism --------------------------------------------------------------------
@pytest.mark.parametrize("placement", TP_PLACEMENTS)
@pytest.mark.parametrize("arch,spec", [("qwen3_moe", None), ("mixtral", TREE)], ids=["qwen3-plain", "mixtral-tree"])
def test_tp_matches_tp1(pairs, make_engine, arch, spec, placement):
    size, device = tp_placement(placement)
    (target, head), prompts, _, _ = pairs(arch)
    params = [GREEDY, SamplingParams(max_new_tokens=10, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_new_tokens=3, temperature=0.0)]
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = []
    for tp in (1, size):
        engine = make_engine(target, tp_size=tp, spec=spec_cfg, **device)
        outs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts[:3], sampling=params)])
        if tp == 2:
            experts = engine.core.runner.model.layers[1].mlp.experts
            inter = 32 if arch == "qwen3_moe" else 128
            assert experts.w13.shape == (8, inter, 64) and experts.w2.shape == (8, 64, inter // 2)
    assert outs[0] == outs[1]


# --- FP8 experts -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3-4x2-unnormed-step2", "mixtral-4x1"])
def test_fp8_experts_match_dequantized_reference(checkpoints, make_engine, tmp_path, name):
    """Block-wise FP8 experts (Mixtral's w1/w3/w2 parts too) load as FP8 stacks with their
    scales and give the dequantized model's logits."""
    ref = str(tmp_path / "ref")
    fp8 = quantize_checkpoint(checkpoints(name), str(tmp_path / "fp8"), "block", (16, 16), reference=ref)
    engine = make_engine(fp8)
    experts = engine.core.runner.model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8 and experts.w13_scale.scale_block == (16, 16)
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(ref, ids), atol=2e-4, rtol=1e-4)


# --- refusals ----------------------------------------------------------------------------------
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8,
             "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 4,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("base,extra,message", [
    (QWEN3_MOE, dict(shared_expert_intermediate_size=16), "shared_expert_intermediate_size"),
    (QWEN3_MOE, dict(attention_bias=True), "attention_bias"),
    (QWEN3_MOE, dict(hidden_act="gelu"), "hidden_act"),
    (QWEN3_MOE, dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (MIXTRAL, dict(hidden_act="gelu"), "hidden_act"),
    (MIXTRAL, dict(mlp_bias=True), "mlp_bias"),
])
def test_unsupported_options_are_named(base, extra, message):
    from specserve.engine.models.model_config import ModelConfig

    ModelConfig.from_dict(base)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(dict(base, **extra))


def test_sliding_window_caps_the_context_as_for_mistral():
    """Exact without a windowed kernel: no sequence grows past Mixtral's window; Qwen3-MoE's
    applies only with use_sliding_window (its default is off)."""
    from specserve.engine.models.model_config import ModelConfig

    assert ModelConfig.from_dict(dict(MIXTRAL, sliding_window=64)).max_position_embeddings == 64
    assert ModelConfig.from_dict(dict(MIXTRAL, sliding_window=None)).max_position_embeddings == 2048
    qwen = dict(QWEN3_MOE, sliding_window=64, max_position_embeddings=4096)
    assert ModelConfig.from_dict(dict(qwen, use_sliding_window=False)).max_position_embeddings == 4096
    assert ModelConfig.from_dict(dict(qwen, use_sliding_window=True)).max_position_embeddings == 64


def test_qwen3_moe_without_experts_is_dense():
    from specserve.engine.models.model_config import ModelConfig

    assert ModelConfig.from_dict(dict(QWEN3_MOE, num_experts=0)).moe is None


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gpu_graphs_match_eager(pairs, make_engine, arch, spec):
    """The Triton MoE kernels (the decode kernel at small batches) under CUDA graphs."""
    (target, head), prompts, _, _ = pairs(arch)
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = [[o.token_ids for o in make_engine(target, device="cuda", attention_backend="triton",
                                              cuda_graph=graphs, spec=spec_cfg, max_total_tokens=4096,
                                              max_running_requests=8).generate(prompt_token_ids=prompts,
                                                                               sampling=GREEDY)]
            for graphs in (False, True)]
    assert outs[0] == outs[1]
