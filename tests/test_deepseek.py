"""DeepSeek-V2/V3 (MLA + MoE): parity with transformers, speculative decoding on a DeepSeek
target, the MLA KV pool and its verify-mask contract, tensor parallelism (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

from helpers import (TP_PLACEMENTS, cached_checkpoints, deepseek_config, hf_greedy, hf_logits, make_eagle3_head,
                     make_predictable_pair, random_prompts, tp_placement)

from specserve.engine import SamplingParams, SpecConfig

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)



# (arch, options): q LoRA on/off, dense-first layers, one or two shared experts (slots of the
# expert stacks), greedy and group-limited
# routing, sigmoid + correction bias (V3), YaRN with mscale, V3's non-interleaved RoPE.
CONFIGS = {
    "v2": ("deepseek_v2", {}),
    "v2-qlora-yarn": ("deepseek_v2", dict(q_lora_rank=16, yarn=True, shared_experts=2)),
    "v2-greedy-routing-no-shared": ("deepseek_v2", dict(group_limited=False, shared_experts=0,
                                                        first_k_dense=0)),
    "v3": ("deepseek_v3", {}),
    "v3-qlora-yarn": ("deepseek_v3", dict(q_lora_rank=16, yarn=True)),
    "v3-neox-rope-2-dense": ("deepseek_v3", dict(rope_interleave=False, first_k_dense=2,
                                                 num_groups=2, topk_groups=1)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return cached_checkpoints(tmp_path_factory, CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, make_engine, name):
    path = checkpoints(name)
    ids = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = make_engine(path)
    cfg = engine.core.model_config
    assert cfg.mla is not None and cfg.moe is not None
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(path, ids), atol=2e-4, rtol=1e-4)


def test_config_is_read(checkpoints, make_engine):
    cfg = make_engine(checkpoints("v3-qlora-yarn")).core.model_config
    assert cfg.architecture == "DeepseekV3ForCausalLM"
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) == (16, 32, 8)
    assert cfg.moe.scoring == "sigmoid" and cfg.moe.has_correction_bias and cfg.moe.norm_topk_prob
    assert (cfg.moe.num_groups, cfg.moe.topk_groups, cfg.moe.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    v2 = make_engine(checkpoints("v2")).core.model_config
    assert v2.moe.scoring == "softmax" and not v2.moe.has_correction_bias


def test_routing_matters(checkpoints, make_engine):
    """The test checkpoints route apart: a different expert choice changes the logits."""
    engine = make_engine(checkpoints("v3"))
    ids = list(range(3, 40))
    before = engine.prompt_logits(ids)
    router = engine.core.runner.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
    assert not torch.allclose(engine.prompt_logits(ids), before, atol=1e-3)


@pytest.mark.parametrize("name", ["v2-qlora-yarn", "v3"])
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_matches_transformers_generate(checkpoints, make_engine, name, overlap):
    path = checkpoints(name)
    prompts = random_prompts(4, seed=6, max_len=30)
    expected = hf_greedy(path, prompts, 12)  # min_new_tokens: transformers never picks EOS
    engine = make_engine(path, enable_overlap=overlap, chunked_prefill_size=16)
    outs = engine.generate(prompt_token_ids=prompts,
                           sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert not any(2 in o.token_ids for o in outs)


def test_kv_pool_is_latent_and_rope(checkpoints, make_engine):
    from specserve.engine.kvcache.pools import MLATokenToKVPool

    pool = make_engine(checkpoints("v2")).core.kv_pool
    assert isinstance(pool, MLATokenToKVPool)
    assert pool.kv_all.shape[0] == 3 and pool.kv_all.shape[2:] == (1, 32 + 8)
    k, v = pool.k_buffer[1], pool.v_buffer[1]
    assert v.shape[-1] == 32 and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()


# --- routing and experts against transformers' modules ----------------------------------
@pytest.mark.parametrize("arch,opts", [
    ("deepseek_v2", dict(group_limited=False)), ("deepseek_v2", {}),
    ("deepseek_v3", {}), ("deepseek_v3", dict(num_groups=1, topk_groups=1))])
def test_router_and_experts_match_transformers(arch, opts):
    import transformers as tf

    from specserve.engine.layers.moe import fused_experts
    from specserve.engine.models.deepseek import Router
    from specserve.engine.models.model_config import ModelConfig

    hf_cfg = deepseek_config(
        arch, vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, num_experts=16, **opts)
    torch.manual_seed(0)
    v3 = arch == "deepseek_v3"
    module = (tf.models.deepseek_v3.modeling_deepseek_v3 if v3 else tf.models.deepseek_v2.modeling_deepseek_v2)
    hf_router = (module.DeepseekV3TopkRouter if v3 else module.DeepseekV2TopkRouter)(hf_cfg)
    hf_experts = (module.DeepseekV3Experts if v3 else module.DeepseekV2Experts)(hf_cfg)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5)
        if v3:
            hf_router.e_score_correction_bias.normal_(0, 0.3)
        hf_experts.gate_up_proj.normal_(0, 0.1)
        hf_experts.down_proj.normal_(0, 0.1)
    cfg = ModelConfig.from_dict(dict(hf_cfg.to_dict(), architectures=[
        "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"]))
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(hf_router.weight)
        if v3:
            router.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    x = torch.randn(50, 64)
    _, ref_w, ref_ids = hf_router(x)
    weights, ids = router(x)
    # Then the shared expert's slot (id E, weight 1.0: routed_scaling_factor is not applied).
    top_k, num_experts = cfg.moe.top_k, cfg.moe.num_experts
    assert (ids[:, top_k:] == num_experts).all() and (weights[:, top_k:] == 1.0).all()
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))
    out = fused_experts(x, hf_experts.gate_up_proj.data, hf_experts.down_proj.data, weights, ids)
    torch.testing.assert_close(out, hf_experts(x, ref_ids, ref_w), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens", [5, 40], ids=["decode-slots", "dense-shared"])
def test_moe_block_with_shared_slots_matches_transformers(tokens):
    """DeepSeekMoE with two shared experts, which live as the expert stacks' last slots: read
    with the routed experts at decode sizes, as a dense MLP past them; both equal transformers'
    block (routed_scaling_factor applied to the routed experts only)."""
    import transformers as tf

    from specserve.engine.layers.moe_decode import MAX_DECODE_TOKENS
    from specserve.engine.models.deepseek import DeepseekMoE
    from specserve.engine.models.model_config import ModelConfig

    hf_cfg = deepseek_config("deepseek_v2", vocab_size=32, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                             num_experts=16, shared_experts=2, group_limited=False)
    torch.manual_seed(1)
    hf_moe = tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(hf_cfg)
    for p in hf_moe.parameters():
        p.data.normal_(0, 0.1)
    cfg = ModelConfig.from_dict(dict(hf_cfg.to_dict(), architectures=["DeepseekV2ForCausalLM"]))
    moe = DeepseekMoE(cfg)
    E, I = cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    shared = hf_moe.shared_experts
    with torch.no_grad():
        moe.gate.weight.copy_(hf_moe.gate.weight)
        moe.experts.w13[:E] = hf_moe.experts.gate_up_proj
        moe.experts.w2[:E] = hf_moe.experts.down_proj
        for j in range(2):
            rows = slice(j * I, (j + 1) * I)
            moe.experts.w13[E + j] = torch.cat([shared.gate_proj.weight[rows], shared.up_proj.weight[rows]])
            moe.experts.w2[E + j] = shared.down_proj.weight[:, rows]
    assert (tokens > MAX_DECODE_TOKENS) == (tokens == 40)
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf_moe(x[None])[0], atol=1e-5, rtol=1e-4)


# --- the MLA pool ------------------------------------------------------------------------
def test_mla_move_kv_cache_overlapping():
    from specserve.engine.kvcache.pools import MLATokenToKVPool

    pool = MLATokenToKVPool(10, 3, 4, 2, torch.float32, torch.device("cpu"))
    pool.kv_all.copy_(torch.randn_like(pool.kv_all))
    before = pool.kv_all.clone()
    tgt = torch.tensor([2, 3, 4, 5])
    src = torch.tensor([3, 5, 2, 9])  # sources that are also targets, in both directions
    pool.move_kv_cache(tgt, src)
    expected = before.clone()
    expected[:, tgt] = before[:, src]
    assert torch.equal(pool.kv_all, expected)
    assert torch.equal(pool.v_buffer[2][5], before[2, 9, :, :4])  # V still views the latent


def test_mla_pool_stores_latent_then_rope():
    from specserve.engine.kvcache.pools import MLATokenToKVPool

    pool = MLATokenToKVPool(6, 2, 4, 2, torch.float32, torch.device("cpu"))
    latent, rope = torch.randn(2, 4), torch.randn(2, 2)
    pool.set_mla_kv(1, torch.tensor([3, 5]), latent, rope)
    assert torch.equal(pool.k_buffer[1][[3, 5], 0], torch.cat([latent, rope], dim=1))
    assert torch.equal(pool.v_buffer[1][[3, 5], 0], latent)
    assert not pool.k_buffer[0].any()  # other layers untouched
    k = torch.randn(1, 1, 6)
    pool.set_kv(0, torch.tensor([2]), k, k[..., :4])
    assert torch.equal(pool.k_buffer[0][2], k[0]) and torch.equal(pool.v_buffer[0][2], k[0, :, :4])


def test_mla_pool_zero_layers_and_bytes():
    from specserve.engine.kvcache.pools import MLATokenToKVPool

    pool = MLATokenToKVPool(4, 0, 4, 2, torch.float32, torch.device("cpu"))
    pool.move_kv_cache(torch.tensor([1]), torch.tensor([2]))  # nothing to move, no error
    assert MLATokenToKVPool.bytes_per_slot(27, 512, 64, torch.bfloat16) == 27 * 576 * 2


# --- speculative decoding on a DeepSeek target -------------------------------------------
@pytest.fixture(scope="module")
def ds_pair(tmp_path_factory):
    """A predictable DeepSeek-V3 target (attention and experts scaled down) + EAGLE-1 head."""
    return make_predictable_pair(str(tmp_path_factory.mktemp("ds_pair")), arch="deepseek_v3", num_layers=3)


@pytest.fixture(scope="module")
def ds_reference(ds_pair):
    from specserve.engine import Engine, EngineConfig

    prompts = random_prompts(8, seed=3, max_len=24)
    params = [SamplingParams(max_new_tokens=[1, 3, 25, 18][i % 4], temperature=0.0, ignore_eos=True)
              for i in range(8)]
    with Engine(EngineConfig(model=ds_pair[0], device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    return prompts, params, [o.token_ids for o in outs]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("overlap,needs_cpu", [(True, False), (False, True)],
                         ids=["overlap-gpu-lengths", "normal-host-lengths"])
def test_spec_equals_plain(ds_pair, ds_reference, make_engine, shape, overlap, needs_cpu):
    prompts, params, expected = ds_reference
    engine = make_engine(ds_pair[0], spec=SpecConfig(algorithm="eagle", draft_model=ds_pair[1], **shape),
                         enable_overlap=overlap, needs_cpu_seq_lens=needs_cpu)
    assert engine.core.needs_cpu_seq_lens is needs_cpu
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == expected
    assert engine.metrics.mean_accept_length > 1.3  # really speculating


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_eagle3_head_on_deepseek_target(tmp_path, checkpoints, make_engine, shape):
    target = checkpoints("v2")
    head = make_eagle3_head(str(tmp_path / "head"), target_layers=3)
    prompts = random_prompts(3, seed=8, max_len=20)
    expected = [o.token_ids for o in make_engine(target).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    engine = make_engine(target, spec=SpecConfig(algorithm="eagle3", draft_model=head, **shape))
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected


def test_mla_backend_declares_no_host_lengths(ds_pair, make_engine):
    from specserve.engine.attention.base import decide_needs_cpu_seq_lens

    engine = make_engine(ds_pair[0], spec=SpecConfig(algorithm="eagle", draft_model=ds_pair[1], **TREE))
    attn = engine.core.runner.attn_backend
    assert attn.needs_cpu_seq_lens is False
    assert not decide_needs_cpu_seq_lens([attn, engine.core.draft_runner.attn_backend])
    assert engine.core.needs_cpu_seq_lens is False
    mask, other = attn.get_verify_buffers_to_fill_after_draft()
    assert other is None and mask.shape[1:] == (6, 6) and mask.dtype == torch.bool
    # A non-MLA backend hands out nothing (verify builds its mask as before).
    assert engine.core.draft_runner.attn_backend.get_verify_buffers_to_fill_after_draft() == [None, None]


def test_verify_mask_buffer_filled_in_place(ds_pair, make_engine, monkeypatch):
    from specserve.engine.forward_batch import ForwardMode
    from specserve.engine.spec import tree as tree_ops

    engine = make_engine(ds_pair[0], spec=SpecConfig(algorithm="eagle", draft_model=ds_pair[1], **TREE),
                         enable_overlap=False)
    attn = engine.core.runner.attn_backend
    buffer = attn.get_verify_buffers_to_fill_after_draft()[0]
    trees, seen = [], []
    build_tree = tree_ops.build_tree

    def recording_build_tree(*args, **kwargs):
        trees.append(build_tree(*args, **kwargs))
        return trees[-1]

    init = attn.init_forward_metadata

    def recording_init(fb):
        if fb.mode is ForwardMode.TARGET_VERIFY:
            seen.append((fb.custom_mask.data_ptr(), fb.custom_mask.clone()))
        return init(fb)

    monkeypatch.setattr(tree_ops, "build_tree", recording_build_tree)
    monkeypatch.setattr(attn, "init_forward_metadata", recording_init)
    engine.generate(prompt_token_ids=random_prompts(3, seed=4, max_len=20), sampling=GREEDY)
    assert len(seen) >= 3 and len(seen) == len(trees)
    for (ptr, mask), tree in zip(seen, trees):
        assert ptr == buffer.data_ptr()  # the same buffer every iteration, not a new tensor
        assert torch.equal(mask, tree.mask)
    assert any(not torch.equal(a[1], seen[0][1]) for a in seen[1:])  # really refilled
    assert attn.get_verify_buffers_to_fill_after_draft()[0] is buffer


def test_tree_compaction_keeps_prefill_latents(ds_pair, make_engine):
    """Every committed position's latent || rope KV after tree verify + compaction equals what
    a plain prefill of the same tokens writes."""
    engine = make_engine(ds_pair[0], spec=SpecConfig(algorithm="eagle", draft_model=ds_pair[1], **TREE),
                         enable_overlap=False)
    prompt = random_prompts(1, seed=9, max_len=20)[0]
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    core = engine.core
    req = core.scheduler.reqs[("r", 0)]
    n = req.kv_committed_len
    assert n > len(prompt) + 4 and core.scheduler.metrics.mean_accept_length > 1.3
    tokens = (req.prompt_ids + req.output_ids)[:n]
    spec_kv = core.kv_pool.kv_all[:, core.req_to_token.table[req.row, :n]].clone()
    engine.abort("r")

    plain = make_engine(ds_pair[0], enable_overlap=False)
    plain.add_request("p", tokens, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    plain.step()
    preq = plain.core.scheduler.reqs[("p", 0)]
    assert preq.kv_committed_len >= n
    plain_kv = plain.core.kv_pool.kv_all[:, plain.core.req_to_token.table[preq.row, :n]]
    torch.testing.assert_close(spec_kv, plain_kv, atol=1e-5, rtol=1e-5)
    plain.abort("p")


# --- tensor parallelism ------------------------------------------------------------------
@pytest.mark.parametrize("placement", TP_PLACEMENTS)
@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_tp_matches_tp1(ds_pair, make_engine, spec, placement):
    size, device = tp_placement(placement)
    target, head = ds_pair
    prompts = random_prompts(4, seed=13, max_len=30)
    params = [GREEDY, SamplingParams(max_new_tokens=12, temperature=0.9, seed=4, ignore_eos=True),
              GREEDY, SamplingParams(max_new_tokens=3, temperature=0.0)]
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = []
    for tp in (1, size):
        engine = make_engine(target, tp_size=tp, spec=spec_cfg, **device)
        outs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)])
        if tp == 2:
            model = engine.core.runner.model
            assert model.layers[0].self_attn.num_heads == 2
            # 8 routed experts and the shared one's slot, half of each; this rank's 2 q heads
            # (24 rows each) beside the replicated kv_a rows (32 latent + 8 rope) in one layer
            assert model.layers[1].mlp.experts.w13.shape == (9, 32, 64)
            assert model.layers[0].self_attn.q_kv_a_proj.weight.shape == (2 * 24 + 40, 64)
    assert outs[0] == outs[1]


def test_tp_must_divide_moe_intermediate(checkpoints):
    from specserve.engine.builder import check_tp_divides
    from specserve.engine.models.model_config import ModelConfig

    cfg = ModelConfig.from_dir(checkpoints("v2"))
    check_tp_divides(cfg, 2)
    with pytest.raises(ValueError, match="^tp_size: 3 does not divide"):
        check_tp_divides(cfg, 3)


# --- bad input -----------------------------------------------------------------------------
def test_flashinfer_refuses_mla():
    from specserve.engine.attention.factory import create_attention_backend

    with pytest.raises(ValueError, match="^attention_backend: flashinfer does not support MLA"):
        create_attention_backend("flashinfer", torch.device("cpu"), num_heads=4, num_kv_heads=1, head_dim=40,
                                 v_head_dim=32, max_context_len=64, max_batch_size=2,
                                 needs_cpu_seq_lens=None)


def test_unsupported_deepseek_options_are_named():
    from specserve.engine.models.model_config import ModelConfig

    base = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "kv_lora_rank": 4,
            "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 4}
    assert ModelConfig.from_dict(base).mla.qk_head_dim == 4
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_dict(dict(base, attention_bias=True))
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_dict(dict(base, topk_method="group_limited_greedy", n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="scoring_func"):
        ModelConfig.from_dict(dict(base, scoring_func="sigmoid"))
    with pytest.raises(ValueError, match="quantization_config quant_method 'mxfp4'"):
        ModelConfig.from_dict(dict(base, quantization_config={"quant_method": "mxfp4"}))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_gpu_graphs_match_eager(ds_pair, make_engine, spec):
    """Triton MLA (TritonAttnBackend with v_head_dim) and the fused MoE under CUDA graphs."""
    target, head = ds_pair
    prompts = random_prompts(6, seed=17, max_len=40)
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    outs = [[o.token_ids for o in make_engine(target, device="cuda", attention_backend="triton",
                                              cuda_graph=graphs, spec=spec_cfg, max_total_tokens=4096,
                                              max_running_requests=8).generate(prompt_token_ids=prompts,
                                                                               sampling=GREEDY)]
            for graphs in (False, True)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_prefix_cache_over_the_latent_pool(ds_pair, ds_reference, make_engine, shape):
    """Cached prefixes (MLA's latent + rope KV, and the draft's) give the uncached outputs."""
    prompts, params, expected = ds_reference
    follow_ups = [p + e + [7] for p, e in zip(prompts[:4], expected[:4])]
    spec = None if shape is None else SpecConfig(algorithm="eagle", draft_model=ds_pair[1], **shape)
    outs = {}
    for cached in (False, True):
        engine = make_engine(ds_pair[0], spec=spec, enable_prefix_cache=cached)
        first = engine.generate(prompt_token_ids=prompts, sampling=params)
        second = engine.generate(prompt_token_ids=follow_ups, sampling=params[:4])
        outs[cached] = [o.token_ids for o in first + second]
        assert all((o.cached_tokens >= len(p)) == cached for o, p in zip(second, prompts))
    assert outs[True] == outs[False] and outs[True][:len(prompts)] == expected
