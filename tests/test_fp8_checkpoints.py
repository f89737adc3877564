"""FP8 checkpoints served as published: each format's tiny checkpoint (tests/fp8_quantizer.py)
gives the logits and greedy tokens of the model its FP8 values and scales stand for (the
dequantized copy, run by transformers in fp32), its layers hold FP8 weights, speculation and
tensor parallelism keep their parities, and every format the engine does not serve is refused
by name.

Tolerance: on the CPU the engine dequantises in fp32 exactly as the reference was written (the
same products of FP8 values and fp32 scales), so the logits differ only by summation order,
as for 16-bit checkpoints (test_models.py's 2e-4).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from fp8_quantizer import FP8, quantize_checkpoint
from helpers import (TP_PLACEMENTS, hf_greedy, hf_logits, make_predictable_pair, make_tiny_checkpoint, random_prompts,
                     tp_placement)

from specserve.engine import SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

# (format, block): blocks that divide the tiny shapes, blocks that do not (fused q/k/v and
# gate/up then need one scale row per output row), and a block larger than every weight.
LLAMA_CASES = [("block", (128, 128)), ("block", (16, 32)), ("block", (24, 40)), ("ct-block", (16, 32)),
               ("ct-channel", None), ("ct-tensor", None), ("hf-tensor", None)]



@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(arch, format, block) -> (FP8 checkpoint, dequantized reference), made once."""
    made, sources = {}, {}

    def get(arch: str, fmt: str, block=None, **opts):
        key = (arch, fmt, block, tuple(sorted(opts.items())))
        if key not in made:
            src_key = (arch, tuple(sorted(opts.items())))
            if src_key not in sources:
                sources[src_key] = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=7,
                                                        num_layers=3 if arch.startswith("deepseek") else 2,
                                                        **opts)
            root = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            made[key] = (quantize_checkpoint(sources[src_key], str(root / "fp8"), fmt, block or (128, 128),
                                             reference=str(root / "ref")), str(root / "ref"))
        return made[key]

    return get


@pytest.mark.parametrize("fmt,block", LLAMA_CASES, ids=[f"{f}-{b}" for f, b in LLAMA_CASES])
def test_llama_logits_match_dequantized_reference(quantized, make_engine, fmt, block):
    fp8, ref = quantized("llama", fmt, block)
    engine = make_engine(fp8)
    attn = engine.core.runner.model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == FP8 and attn.o_proj.weight.dtype == FP8  # not dequantized at load
    # q/k/v fused keep the blocks only where each part fills whole block rows
    expected_block = {(128, 128): (1, 128), (16, 32): (16, 32), (24, 40): (1, 40), None: (1, 64)}[block]
    assert attn.qkv_proj.weight_scale.scale_block == expected_block
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(ref, ids), atol=2e-4, rtol=1e-4)


def test_llama_greedy_matches_dequantized_generate(quantized, make_engine):
    fp8, ref = quantized("llama", "block", (24, 40))
    prompts = random_prompts(3, seed=5, max_len=20)
    outs = make_engine(fp8).generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(ref, prompts, GREEDY.max_new_tokens)


DEEPSEEK_CASES = [("deepseek_v3", "block", (16, 16), {}), ("deepseek_v3", "block", (24, 24), {"q_lora_rank": 16}),
                  ("deepseek_v2", "ct-channel", None, {}), ("deepseek_v2", "hf-tensor", None, {"q_lora_rank": 16})]


@pytest.mark.parametrize("arch,fmt,block,opts", DEEPSEEK_CASES, ids=[f"{a}-{f}-{b}" for a, f, b, _ in DEEPSEEK_CASES])
def test_deepseek_logits_match_dequantized_reference(quantized, make_engine, arch, fmt, block, opts):
    fp8, ref = quantized(arch, fmt, block, **opts)
    engine = make_engine(fp8)
    model = engine.core.runner.model
    experts = model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays as stored
    # (24, 24) cuts the 32-row gate and up parts mid-block: one scale row per output row.
    assert experts.w13_scale.scale_block == {(16, 16): (16, 16), (24, 24): (1, 24), None: (1, 64)}[block]
    # q (96 rows: 4 heads of 24) or the 16-row q LoRA, then kv_a, in one FP8 layer: the blocks
    # kept where q's rows fill whole blocks, else one scale row per output row.
    attn = model.layers[0].self_attn
    fused = attn.q_kv_a_proj if opts.get("q_lora_rank") is None else attn.q_a_kv_a_proj
    assert fused.weight.dtype == FP8
    assert fused.weight_scale.scale_block == {(16, 16): (16, 16), (24, 24): (1, 24), None: (1, 64)}[block]
    ids = torch.randint(3, 300, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(ref, ids), atol=2e-4, rtol=1e-4)


def test_deepseek_greedy_matches_dequantized_generate(quantized, make_engine):
    fp8, ref = quantized("deepseek_v3", "block", (16, 16))
    prompts = random_prompts(2, seed=6, max_len=24)
    outs = make_engine(fp8).generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(ref, prompts, GREEDY.max_new_tokens)


# --- speculation and tensor parallelism over FP8 targets -----------------------------------
@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """make_predictable_pair's target in block-wise FP8 beside its 16-bit EAGLE-1 head."""
    root = tmp_path_factory.mktemp("fp8-pair")
    target, head = make_predictable_pair(str(root))
    return quantize_checkpoint(target, str(root / "fp8"), "block", (16, 32)), head


@pytest.fixture(scope="module")
def fp8_plain(fp8_pair):
    from specserve.engine import Engine, EngineConfig

    prompts = random_prompts(6, seed=3, max_len=24)
    params = [SamplingParams(max_new_tokens=[1, 4, 20][i % 3], temperature=0.0, ignore_eos=True) for i in range(6)]
    with Engine(EngineConfig(model=fp8_pair[0], device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    return prompts, params, [o.token_ids for o in outs]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_spec_equals_plain_on_an_fp8_target(fp8_pair, fp8_plain, make_engine, shape, overlap):
    prompts, params, expected = fp8_plain
    engine = make_engine(fp8_pair[0], spec=SpecConfig(algorithm="eagle", draft_model=fp8_pair[1], **shape),
                         enable_overlap=overlap)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert engine.metrics.mean_accept_length > 1.3  # really speculating
    assert engine.core.draft_runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_nextn_on_an_fp8_deepseek_equals_plain(tmp_path, make_engine, overlap):
    from test_nextn import make_deepseek_v3_with_nextn

    src = make_deepseek_v3_with_nextn(str(tmp_path / "bf16"), predicts=True, attn_scale=0.3)
    fp8 = quantize_checkpoint(src, str(tmp_path / "fp8"), "block", (16, 16))
    prompts = random_prompts(4, seed=4, max_len=20)
    expected = [o.token_ids for o in make_engine(fp8).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    engine = make_engine(fp8, spec=SpecConfig(algorithm="nextn", **CHAIN), enable_overlap=overlap)
    assert engine.core.draft_runner.model.decoder.mlp.experts.w13.dtype == FP8  # the module is FP8 too
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected
    assert engine.metrics.mean_accept_length > 1.3


# Blocks that tp=4 splits whole (16 query rows, 16 o_proj inputs, DeepSeek experts of 32
# columns in 8s); a split through a block is refused (below).
@pytest.mark.parametrize("placement", TP_PLACEMENTS)
@pytest.mark.parametrize("arch,block", [("llama", (16, 8)), ("deepseek_v3", (8, 8))])
def test_tp_matches_tp1_with_fp8_shards(quantized, make_engine, arch, block, placement):
    size, device = tp_placement(placement)
    fp8, _ = quantized(arch, "block", block)
    prompts = random_prompts(3, seed=9, max_len=20)
    outs = [[o.token_ids for o in make_engine(fp8, tp_size=tp, **device).generate(prompt_token_ids=prompts,
                                                                                  sampling=GREEDY)]
            for tp in (1, size)]
    assert outs[0] == outs[1]


def test_tp_slice_through_a_scale_block_is_refused(quantized):
    from specserve.engine import Engine, EngineConfig

    fp8, _ = quantized("llama", "block", (24, 40))  # o_proj's 64 inputs split in 32s: cuts a 40 block
    with pytest.raises(ValueError, match="tp_size"):
        Engine(EngineConfig(model=fp8, device="cpu", dtype="float32", spec=None, tp_size=2))


# --- refusals -----------------------------------------------------------------------------
def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    with open(file, "w") as f:
        json.dump(config, f)


UNSUPPORTED = [
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                 "strategy": "group"}}}}, "4 bits"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "static activation"),
]


@pytest.mark.parametrize("qc,message", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unsupported_quantization_is_refused_by_name(tiny_model, tmp_path, qc, message):
    import shutil

    from specserve.engine import Engine, EngineConfig

    path = shutil.copytree(tiny_model, tmp_path / "m")
    _edit_config(path, quantization_config=qc)
    with pytest.raises(ValueError, match=f"quantization_config.*{message}.*supported:"):
        Engine(EngineConfig(model=str(path), device="cpu", spec=None))


def test_fp8_tensors_without_quantization_config_are_refused(quantized):
    import shutil

    from specserve.engine import Engine, EngineConfig

    fp8, _ = quantized("llama", "block", (16, 32))
    path = shutil.copytree(fp8, fp8 + "-noconfig")
    _edit_config(path, quantization_config=None)
    with pytest.raises(ValueError, match="is float8 but config.json has no quantization_config"):
        Engine(EngineConfig(model=str(path), device="cpu", spec=None))


def test_fp8_tensor_for_a_16_bit_layer_is_refused(tmp_path, quantized):
    """A draft head whose fc (a plain linear layer) is FP8 is refused, never cast."""
    from safetensors.torch import load_file, save_file

    from specserve.engine import Engine, EngineConfig

    fp8, _ = quantized("llama", "block", (16, 32))
    _, head = make_predictable_pair(str(tmp_path))
    weights = load_file(os.path.join(head, "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"].to(FP8)
    save_file(weights, os.path.join(head, "model.safetensors"))
    with pytest.raises(ValueError, match="'fc.weight' is float8"):
        Engine(EngineConfig(model=fp8, device="cpu", spec=SpecConfig(algorithm="eagle", draft_model=head)))


def test_random_fp8_weights_for_benchmarks(tiny_model, make_engine):
    engine = make_engine(tiny_model, load_format="dummy", quantization="fp8")
    layer = engine.core.runner.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.dtype == FP8
    assert layer.mlp.gate_up_proj.weight_scale.scale_block == (128, 128)
    assert engine.core.runner.model.lm_head.weight.dtype == torch.float32  # the LM head stays
    out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_new_tokens


# --- served through both fronts -------------------------------------------------------------
@pytest.mark.parametrize("fmt,block,weight_dtype", [("block", (16, 32), "fp8 (block 16x32)"),
                                                    ("ct-channel", None, "fp8 (per-channel)")])
def test_served_through_grpc_and_http(quantized, make_engine, fmt, block, weight_dtype):
    import httpx
    from server_harness import ServerProcess, free_port

    fp8, _ = quantized("llama", fmt, block)
    prompt = random_prompts(1, seed=11, max_len=16)[0]
    expected = make_engine(fp8).generate(prompt_token_ids=[prompt], sampling=GREEDY)[0].token_ids
    server = ServerProcess(fp8, "--http-port", str(free_port()))
    try:
        http_url = server.http_url
        with server.client() as client:
            info = client.model_info()
            assert (info.weight_dtype, info.kv_cache_dtype, info.dtype) == (weight_dtype, "float32", "float32")
            result = client.generate(prompt_token_ids=prompt, max_new_tokens=GREEDY.max_new_tokens,
                                     temperature=0, ignore_eos=True)
            assert list(result.token_ids) == expected
        models = httpx.get(http_url + "/v1/models").json()["data"][0]
        assert (models["weight_dtype"], models["kv_cache_dtype"]) == (weight_dtype, "float32")
        body = httpx.post(http_url + "/v1/completions", json={
            "model": os.path.basename(fp8), "prompt": prompt, "max_tokens": GREEDY.max_new_tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == GREEDY.max_new_tokens
    finally:
        assert server.stop() == 0


def test_fp8_eagle_head_beside_an_fp8_target(fp8_pair, fp8_plain, make_engine, tmp_path):
    """An EAGLE-1 head may be FP8 too (its decoder layer; fc and the embedding stay 16-bit)."""
    head = quantize_checkpoint(fp8_pair[1], str(tmp_path / "head"), "ct-channel")
    prompts, params, expected = fp8_plain
    engine = make_engine(fp8_pair[0], spec=SpecConfig(algorithm="eagle", draft_model=head, **CHAIN))
    layer = engine.core.draft_runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8 and engine.core.draft_runner.model.fc.weight.dtype != FP8
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert engine.metrics.mean_accept_length > 1.3


# --- on a GPU: the kernels that read FP8 weights, under CUDA graphs -----------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("arch,block", [("llama", (16, 32)), ("deepseek_v3", (16, 16))])
@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_gpu_fp8_graphs_match_eager_and_spec_matches_plain(quantized, make_engine, tmp_path, arch, block, spec):
    """fp32 activations on CUDA: the skinny GEMM, the large-M path and the fused MoE read FP8
    weights; graphs replay exactly what eager runs, and speculation keeps plain's tokens."""
    fp8, _ = quantized(arch, "block", block)
    prompts = random_prompts(6, seed=17, max_len=40)
    head = None
    if spec is not None:
        from helpers import make_eagle3_head
        head = make_eagle3_head(str(tmp_path / "head"), target_layers=3 if arch.startswith("deepseek") else 2)
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle3", draft_model=head, **spec)
    kwargs = dict(device="cuda", attention_backend="triton", max_total_tokens=4096, max_running_requests=8)
    outs = [[o.token_ids for o in make_engine(fp8, cuda_graph=graphs, spec=s, **kwargs).generate(
        prompt_token_ids=prompts, sampling=GREEDY)] for graphs, s in ((False, spec_cfg), (True, spec_cfg), (True, None))]
    assert outs[0] == outs[1] == outs[2]


GPU_BF16_CASES = [("llama", "block", (16, 32), {}), ("llama", "ct-channel", None, {}),
                  ("deepseek_v3", "block", (16, 16), {}),
                  # 128x128 blocks: K / 128 = 2 (the Triton W8A8 kernel; cuBLAS needs a multiple
                  # of 4, see runs_cublas_blockwise) and 4 or 8 (cuBLAS's blockwise GEMM)
                  ("llama", "block", (128, 128), dict(hidden_size=256, intermediate_size=1024)),
                  ("llama", "block", (128, 128), dict(hidden_size=512, intermediate_size=1024))]


@pytest.mark.gpu
@pytest.mark.parametrize("arch,fmt,block,opts", GPU_BF16_CASES,
                         ids=[f"{a}-{f}-{b}-{o.get('hidden_size', 64)}" for a, f, b, o in GPU_BF16_CASES])
def test_gpu_bf16_logits_close_to_the_dequantized_model(quantized, make_engine, arch, fmt, block, opts):
    """bf16 activations: the FP8 kernels against the dequantized weights run by the same engine
    in bf16 (cuBLAS). Up to 16 rows the skinny GEMM dequantises the weight tile (W8A16: bf16
    rounding, 1e-3..1e-2 relative over a model); a 64-token prefill runs W8A8, its activations
    quantised per 128-column group (~2.6 % per GEMM, measured in fp64 on the CPU): 6e-2."""
    fp8, ref = quantized(arch, fmt, block, **opts)
    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=4096, max_running_requests=4)
    ours, theirs = make_engine(fp8, **kw), make_engine(ref, **kw)
    for prompt, tolerance in ((ids, 6e-2), (ids[:5], 2e-2)):
        a, b = ours.prompt_logits(prompt).float(), theirs.prompt_logits(prompt).float()
        assert ((a - b).norm() / b.norm()).item() < tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block", [("block", (128, 128)), ("ct-channel", None)])
def test_gpu_f16_products_logits_close_to_the_dequantized_model(quantized, make_engine, monkeypatch,
                                                               fmt, block):
    """The FP8 rule on fp16 products (`skinny_gemm.FP8_F16_PRODUCTS`, the exact product of the
    scaled FP8 weight: no bf16 rounding of it) against the dequantized model in bf16, as close
    as the dequantising kernel is, and every skinny launch of the engine took them."""
    from specserve.engine.layers import skinny_gemm

    fp8, ref = quantized("llama", fmt, block, hidden_size=512, intermediate_size=1024)
    ids = torch.randint(3, 300, (5,), generator=torch.Generator().manual_seed(4)).tolist()
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=4096, max_running_requests=4)
    real, planned = skinny_gemm._plan, []

    def recorded(*args, **kwargs):
        launch = real(*args, **kwargs)
        planned.append(launch.meta)
        return launch

    monkeypatch.setattr(skinny_gemm, "_plan", recorded)
    monkeypatch.setattr(skinny_gemm, "FP8_F16_PRODUCTS", True)
    skinny_gemm.default_config.cache_clear()
    skinny_gemm._qkv_rope_config.cache_clear()
    try:
        a = make_engine(fp8, **kw).prompt_logits(ids).float()
    finally:
        skinny_gemm.default_config.cache_clear()
        skinny_gemm._qkv_rope_config.cache_clear()
    b = make_engine(ref, **kw).prompt_logits(ids).float()
    fp8_launches = [meta for meta in planned if meta["FP8_WEIGHT"]]
    assert fp8_launches and all(meta["FP8_F16"] and meta["W_LEFT"] for meta in fp8_launches)
    assert ((a - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block", [("block", (128, 128)), ("ct-channel", None)])
def test_gpu_bits_conversion_keeps_the_greedy_tokens(quantized, make_engine, monkeypatch, fmt, block):
    """bf16 on sm_90: the skinny GEMM's default FP8 conversion ("bits") and "cast" (what older
    GPUs run) generate the same greedy tokens, CUDA graphs on; each engine ran the one it names."""
    from specserve.engine.layers import skinny_gemm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bf16x2 multiply needs sm_90")
    fp8, _ = quantized("llama", fmt, block, hidden_size=512, intermediate_size=1024)
    prompts = random_prompts(6, seed=23, max_len=40)
    real, ran = skinny_gemm._fp8_convert, []

    def recorded(config, device):
        ran.append(real(config, device))
        return ran[-1]

    monkeypatch.setattr(skinny_gemm, "_fp8_convert", recorded)
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=4096, max_running_requests=8)
    tokens = {}
    for convert in ("bits", "cast"):
        monkeypatch.setattr(skinny_gemm, "WEIGHT_FP8_CONVERT", convert)
        ran.clear()
        engine = make_engine(fp8, **kw)
        tokens[convert] = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)]
        assert set(ran) == {convert}
    assert tokens["bits"] == tokens["cast"]


def test_missing_scale_tensor_is_named(tmp_path, quantized):
    import shutil

    from safetensors.torch import load_file, save_file

    from specserve.engine import Engine, EngineConfig

    fp8, _ = quantized("llama", "block", (16, 32))
    path = shutil.copytree(fp8, tmp_path / "m")
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.down_proj.weight_scale_inv'"):
        Engine(EngineConfig(model=str(path), device="cpu", spec=None))
