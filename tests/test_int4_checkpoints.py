"""INT4 (AWQ, GPTQ) checkpoints and online FP8, served as published: each tiny checkpoint written
in its tool's on-disk layout (tests/int4_quantizer.py) gives the logits and greedy tokens of
the model its codes, zero points and scales stand for (the dequantized copy, run by
transformers in fp32); speculation and tensor parallelism keep their parities; every format,
flag and layout the engine does not serve is refused by name.

Tolerance: on the CPU the engine dequantises in fp32 exactly as the reference was written, so
logits differ only by summation order (test_models.py's 2e-4).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from fp8_quantizer import quantize_rows
from helpers import hf_greedy, hf_logits, make_predictable_pair, make_tiny_checkpoint, random_prompts
from int4_quantizer import quantize_checkpoint
from safetensors.torch import load_file, save_file

from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
# (arch, format, group size, sym)
CASES = [("llama", "awq", 32, False), ("llama", "gptq", 32, True), ("llama", "gptq", 64, False),
         ("llama", "gptq_v2", 32, False), ("mistral", "gptq", -1, True), ("qwen2", "awq", 64, False),
         ("qwen3", "awq", 32, False)]


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    """(arch, format, group, sym) -> (INT4 checkpoint, dequantized reference), made once."""
    made, sources = {}, {}

    def get(arch: str, fmt: str, group: int = 32, sym: bool = False):
        key = (arch, fmt, group, sym)
        if key not in made:
            if arch not in sources:
                sources[arch] = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=7)
            root = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            made[key] = (quantize_checkpoint(sources[arch], str(root / "q"), fmt, group, sym,
                                             reference=str(root / "ref")), str(root / "ref"))
        return made[key]

    return get


@pytest.mark.parametrize("arch,fmt,group,sym", CASES, ids=[f"{a}-{f}-g{g}{'-sym' if s else ''}" for a, f, g, s in CASES])
def test_logits_match_dequantized_reference(int4, make_engine, arch, fmt, group, sym):
    path, ref = int4(arch, fmt, group, sym)
    engine = make_engine(path)
    attn = engine.core.runner.model.layers[0].self_attn
    assert attn.qkv_proj.qweight.dtype == torch.int32 and not hasattr(attn.qkv_proj, "weight")
    k_o = attn.num_heads * attn.head_dim
    assert attn.o_proj.qweight.shape == (64, k_o // 8)  # packed along K, not dequantised at load
    method = fmt.removesuffix("_v2")
    expected_name = f"int4 {method} ({'per-channel' if group < 0 else f'group {group}'}{', sym' if sym else ''})"
    assert engine.core.weight_format == expected_name
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(ref, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt,sym", [("awq", False), ("gptq", True)])
def test_greedy_matches_dequantized_generate(int4, make_engine, fmt, sym):
    path, ref = int4("llama", fmt, 32, sym)
    prompts = random_prompts(3, seed=5, max_len=20)
    outs = make_engine(path).generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(ref, prompts, GREEDY.max_new_tokens)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_chain_spec_equals_plain_on_an_int4_target(tmp_path, make_engine, fmt):
    target, head = make_predictable_pair(str(tmp_path))
    path = quantize_checkpoint(target, str(tmp_path / fmt), fmt, 32, sym=fmt == "gptq")
    prompts = random_prompts(4, seed=3, max_len=24)
    expected = [o.token_ids for o in make_engine(path).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    engine = make_engine(path, spec=SpecConfig(algorithm="eagle", draft_model=head, **CHAIN))
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected
    assert engine.metrics.mean_accept_length > 1.3  # really speculating


@pytest.mark.parametrize("fmt,sym", [("awq", False), ("gptq", True)])
def test_tp2_matches_tp1_with_int4_shards(int4, make_engine, fmt, sym):
    path, _ = int4("llama", fmt, 32, sym)
    prompts = random_prompts(3, seed=9, max_len=20)
    outs = [[o.token_ids for o in make_engine(path, tp_size=tp).generate(prompt_token_ids=prompts, sampling=GREEDY)]
            for tp in (1, 2)]
    assert outs[0] == outs[1]


def test_tp_slice_through_a_group_is_refused(int4):
    path, _ = int4("llama", "awq", 64)  # o_proj's 64 inputs split in 32s: cuts a 64 group
    with pytest.raises(ValueError, match="cut an INT4 group of 64; choose a tp_size"):
        Engine(EngineConfig(model=path, device="cpu", dtype="float32", spec=None, tp_size=2))


# --- refusals -----------------------------------------------------------------------------
def _set_quantization_config(path: str, qc: dict) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=qc), f)


def _copy_with_config(src: str, dst, **quant) -> str:
    path = str(shutil.copytree(src, dst))
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    _set_quantization_config(path, dict(qc, **quant))
    return path


UNSUPPORTED = [("gptq", {"desc_act": True}, "gptq desc_act true"),
               ("gptq", {"bits": 8}, "gptq bits 8"),
               ("awq", {"bits": 3}, "awq bits 3"),
               ("gptq", {"group_size": 100}, "gptq group_size 100"),
               ("awq", {"version": "gemv"}, "awq version 'gemv'"),
               ("awq", {"zero_point": False}, "awq zero_point false"),
               ("gptq", {"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin'"),
               ("gptq", {"lm_head": True}, "gptq lm_head true")]


@pytest.mark.parametrize("fmt,change,message", UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_int4_configs_are_refused_by_name(int4, tmp_path, fmt, change, message):
    path = _copy_with_config(int4("llama", fmt, 32, fmt == "gptq")[0], tmp_path / "m", **change)
    with pytest.raises(ValueError, match=f"quantization_config {message}.*supported:"):
        Engine(EngineConfig(model=path, device="cpu", spec=None))


def test_act_order_g_idx_is_refused(int4, tmp_path):
    """A GPTQ checkpoint whose g_idx is not k // group_size is act-order, whatever its config says."""
    path = shutil.copytree(int4("llama", "gptq", 32, True)[0], tmp_path / "m")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    key = "model.layers.0.self_attn.o_proj.g_idx"
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="g_idx is not k // group_size.*desc_act true is not supported"):
        Engine(EngineConfig(model=str(path), device="cpu", spec=None))


def test_int4_moe_experts_are_refused(tmp_path):
    src = make_tiny_checkpoint(str(tmp_path / "bf16"), "qwen3_moe", seed=3)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    from int4_quantizer import awq_tensors, quantize_groups

    # The quantizer only writes dense projections; quantize one expert as AWQ would.
    for key in [k for k in tensors if ".mlp.experts.0." in k and k.endswith(".weight")]:
        q, z, s = quantize_groups(tensors.pop(key), 32, False)
        tensors.update({key[:-len("weight")] + n: v for n, v in awq_tensors(q, z, s).items()})
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    _set_quantization_config(src, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    with pytest.raises(ValueError, match="INT4 MoE experts are not supported"):
        Engine(EngineConfig(model=src, device="cpu", spec=None))


def test_int4_with_mla_is_refused(tmp_path):
    src = make_tiny_checkpoint(str(tmp_path / "ds"), "deepseek_v2", seed=3)
    _set_quantization_config(src, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="quantization: int4 gptq .* not supported with MLA"):
        Engine(EngineConfig(model=src, device="cpu", spec=None))


@pytest.mark.parametrize("flag,fmt,message", [
    ("awq", None, "'awq' needs a awq checkpoint, but .* has no quantization_config"),
    ("gptq", "awq", r"'gptq' does not match .*int4 awq \(group 32\)"),
    ("fp8", "awq", r"'fp8' does not match .*int4 awq"),
    ("awq", "gptq", r"'awq' does not match .*int4 gptq")])
def test_flag_must_match_the_checkpoint(int4, tiny_model, flag, fmt, message):
    path = tiny_model if fmt is None else int4("llama", fmt, 32, fmt == "gptq")[0]
    with pytest.raises(ValueError, match=f"quantization: {message}"):
        Engine(EngineConfig(model=path, device="cpu", spec=None, quantization=flag))


def test_unknown_quantization_flag_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization.*must be one of auto, fp8, awq, gptq.*'bitsandbytes'"):
        EngineConfig(quantization="bitsandbytes")


# --- online FP8: --quantization fp8 on a 16-bit checkpoint ---------------------------------
def _per_channel_reference(src: str, dst: str, lm_head: bool = False) -> str:
    """The model online FP8 stands for: every decoder linear weight (and with `lm_head` the LM
    head) quantized per output row (scale amax / 448) and multiplied back out in fp32
    (tests/fp8_quantizer.py's quantize_rows)."""
    os.makedirs(dst)
    tensors = {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if (name.endswith("_proj.weight") and "layers." in name) or (lm_head and name == "lm_head.weight"):
            q, s = quantize_rows(w)
            w = q.float() * s
        tensors[name] = w.float()
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


def test_online_fp8_matches_the_per_channel_reference(tiny_model, make_engine, tmp_path):
    engine = make_engine(tiny_model, quantization="fp8")
    layer = engine.core.runner.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight_scale.scale_block == (1, 128)  # one scale per output row
    assert engine.core.runner.model.lm_head.weight.dtype == torch.float32  # the LM head stays
    assert engine.core.weight_format == "fp8 (per-channel, quantized at load)"
    ref = _per_channel_reference(tiny_model, str(tmp_path / "ref"))
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(ref, ids), atol=2e-4, rtol=1e-4)


def test_online_fp8_with_the_lm_head(tiny_model, make_engine, tmp_path):
    engine = make_engine(tiny_model, quantization="fp8", quantize_lm_head=True)
    model = engine.core.runner.model
    assert model.lm_head.weight.dtype == torch.float8_e4m3fn
    assert model.embed_tokens.weight.dtype == torch.float32  # untied: the embedding stays
    assert engine.core.weight_format == "fp8 (per-channel, quantized at load, LM head too)"
    ref = _per_channel_reference(tiny_model, str(tmp_path / "ref"), lm_head=True)
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(engine.prompt_logits(ids), hf_logits(ref, ids), atol=2e-4, rtol=1e-4)


def test_quantize_lm_head_needs_online_fp8(tiny_model, tmp_path):
    from fp8_quantizer import quantize_checkpoint as quantize_fp8

    with pytest.raises(ValueError, match="quantize_lm_head.*needs quantization 'fp8'"):
        EngineConfig(model=tiny_model, quantize_lm_head=True)
    fp8 = quantize_fp8(tiny_model, str(tmp_path / "fp8"), "ct-channel")  # already FP8: not online
    with pytest.raises(ValueError, match=r"quantize_lm_head: .* stored as fp8 \(per-channel\)"):
        Engine(EngineConfig(model=fp8, device="cpu", spec=None, quantization="fp8", quantize_lm_head=True))


@pytest.mark.parametrize("lm_head", [False, True], ids=["linear-layers", "with-lm-head"])
def test_online_fp8_tp2_matches_tp1(tiny_model, make_engine, tmp_path, lm_head):
    """A row-parallel rank's slice is scaled by its whole row's amax: tp=2 gives tp=1's tokens
    (with the LM head: an odd vocabulary, so the last rank's shard has a zero padding row)."""
    model = make_tiny_checkpoint(str(tmp_path / "odd"), "llama", vocab_size=321) if lm_head else tiny_model
    prompts = random_prompts(3, seed=9, max_len=20)
    outs = [[o.token_ids for o in make_engine(model, quantization="fp8", quantize_lm_head=lm_head,
                                              tp_size=tp).generate(prompt_token_ids=prompts, sampling=GREEDY)]
            for tp in (1, 2)]
    assert outs[0] == outs[1]


def test_int4_and_online_fp8_served_through_grpc_and_http(int4, tiny_model):
    import httpx
    from server_harness import ServerProcess, free_port

    for model, args, weight_dtype in ((int4("llama", "awq", 32)[0], (), "int4 awq (group 32)"),
                                      (tiny_model, ("--quantization", "fp8"),
                                       "fp8 (per-channel, quantized at load)")):
        server = ServerProcess(model, "--http-port", str(free_port()), *args)
        try:
            http_url = server.http_url
            with server.client() as client:
                assert client.model_info().weight_dtype == weight_dtype
                result = client.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=4, temperature=0,
                                         ignore_eos=True)
                assert len(result.token_ids) == 4
            assert httpx.get(http_url + "/v1/models").json()["data"][0]["weight_dtype"] == weight_dtype
        finally:
            assert server.stop() == 0


def test_missing_int4_tensor_is_named(int4, tmp_path):
    path = shutil.copytree(int4("llama", "awq", 32)[0], tmp_path / "m")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.down_proj.qzeros'"):
        Engine(EngineConfig(model=str(path), device="cpu", spec=None))


@pytest.mark.parametrize("flag", ["awq", "gptq"])
def test_random_int4_weights_for_benchmarks(tiny_model, make_engine, flag):
    engine = make_engine(tiny_model, load_format="dummy", quantization=flag)
    down = engine.core.runner.model.layers[0].mlp.down_proj
    assert down.qweight.dtype == torch.int32 and down.group_size == 128
    assert engine.core.runner.model.lm_head.weight.dtype == torch.float32  # the LM head stays
    assert engine.core.weight_format == f"int4 {flag} (group 128{', sym' if flag == 'gptq' else ''})"
    out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_new_tokens


# --- on a GPU: the W4A16 kernels in the engine, under CUDA graphs ------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, CHAIN], ids=["plain", "chain"])
def test_gpu_int4_graphs_match_eager_and_spec_matches_plain(int4, make_engine, tmp_path, spec):
    """fp32 activations on CUDA: the decode kernel and the dequantise + cuBLAS prefill read the
    INT4 weights; graphs replay exactly what eager runs, and speculation keeps plain's tokens."""
    path, _ = int4("llama", "gptq", 32, True)
    prompts = random_prompts(6, seed=17, max_len=40)
    spec_cfg = None
    if spec is not None:
        from helpers import make_eagle3_head
        spec_cfg = SpecConfig(algorithm="eagle3", draft_model=make_eagle3_head(str(tmp_path / "head"), target_layers=2),
                              **spec)
    kwargs = dict(device="cuda", attention_backend="triton", max_total_tokens=4096, max_running_requests=8)
    outs = [[o.token_ids for o in make_engine(path, cuda_graph=graphs, spec=s, **kwargs).generate(
        prompt_token_ids=prompts, sampling=GREEDY)] for graphs, s in ((False, spec_cfg), (True, spec_cfg), (True, None))]
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_gpu_bf16_logits_close_to_the_dequantized_model(int4, make_engine, fmt):
    """bf16 activations: the INT4 kernels against the dequantized weights run by the same
    engine in bf16 (cuBLAS): a 64-token prefill (dequantise + cuBLAS) and a 5-token one (the
    decode kernel), each within bf16 roundings over a model."""
    path, ref = int4("llama", fmt, 32, fmt == "gptq")
    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    kw = dict(device="cuda", dtype="bfloat16", max_total_tokens=4096, max_running_requests=4)
    ours, theirs = make_engine(path, **kw), make_engine(ref, **kw)
    for prompt in (ids, ids[:5]):
        a, b = ours.prompt_logits(prompt).float(), theirs.prompt_logits(prompt).float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("lm_head", [False, True], ids=["linear-layers", "with-lm-head"])
def test_gpu_online_fp8_graphs_match_eager_and_spec_matches_plain(tiny_model, make_engine, tmp_path, lm_head):
    """fp32 on CUDA: the online FP8 weights through the skinny GEMM (the LM head's too with
    `quantize_lm_head`); graphs replay what eager runs, chain speculation keeps plain's tokens."""
    from helpers import make_eagle3_head

    prompts = random_prompts(6, seed=17, max_len=40)
    spec = SpecConfig(algorithm="eagle3", draft_model=make_eagle3_head(str(tmp_path / "head"), target_layers=2),
                      **CHAIN)
    kwargs = dict(device="cuda", attention_backend="triton", max_total_tokens=4096, max_running_requests=8,
                  quantization="fp8", quantize_lm_head=lm_head)
    outs = [[o.token_ids for o in make_engine(tiny_model, cuda_graph=graphs, spec=s, **kwargs).generate(
        prompt_token_ids=prompts, sampling=GREEDY)] for graphs, s in ((False, spec), (True, spec), (True, None))]
    assert outs[0] == outs[1] == outs[2]
