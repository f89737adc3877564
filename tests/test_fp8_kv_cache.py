"""The FP8 KV cache (`EngineConfig.kv_cache_dtype="fp8_e4m3"`, engine/kvcache/fp8.py).

Kernels (the Triton interpreter on the CPU, compiled under -m gpu): decode, extend, short
extend (verify) and MLA reading an FP8 pool with non-unit scales against the torch reference
over the dequantised pool; the RoPE+store kernel and the skinny q/k/v+RoPE epilogue store the
bits the pool's own `set_kv` stores; on a GPU (sm_90) the "bits" conversion of FP8 tiles is
exact for every code and gives the dots what "cast" does. Launch parameters: an FP8 pool gets
its own decode config on sm_90, the builder passing the target pool's dtype through the
factory. Pools: quantise, saturate, move bytes. Engines: FP8-KV
speculative decoding equals FP8-KV plain decoding token for token (chain, tree, both loops),
a radix hit equals a prefill, Triton equals torch with FP8 pools (Llama and MLA), two
tensor-parallel ranks equal one, checkpoint scales are read and used, and every engine frees
every slot (make_engine). Parity is within FP8-KV modes: FP8 KV is not expected to give the
tokens of an fp32 KV.
"""
from __future__ import annotations

import itertools
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from helpers import (cached_prefix_slots, make_predictable_pair, make_tiny_checkpoint,  # noqa: E402
                     random_prompts, steady_state_steps)
from test_triton_kernels import (  # noqa: E402
    BACKEND_CASES, LAYER_ID, MLA_DECODE, MLA_KEY_DIM, MLA_LATENT, NUM_LAYERS, SMALL_DECODE,
    SMALL_EXTEND, build_forward_batch, make_mla_scene, make_scene, random_qkv, random_tree_mask,
    scene_kv_indices, scene_reference)

from specserve.engine import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from specserve.engine.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from specserve.engine.attention.triton.backend import TritonAttnBackend  # noqa: E402
from specserve.engine.attention.triton import kernels as triton_kernels  # noqa: E402
from specserve.engine.attention.triton.kernels import (  # noqa: E402
    DecodeConfig, decode_attention, default_decode_config, extend_attention,
    short_extend_attention)
from specserve.engine.kvcache.fp8 import (  # noqa: E402
    FP8_KV_DTYPE, FP8_MAX, KVScales, dequantize, load_kv_scales, quantize, resolve_kv_scales)
from specserve.engine.kvcache.pools import MLATokenToKVPool, TokenToKVPool  # noqa: E402
from specserve.engine.layers.fp8_convert import fp8_tile  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K_SCALE, V_SCALE = 0.011, 0.023  # randn / 0.011 spans most of e4m3's +-448
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
FP8 = "fp8_e4m3"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def exact_fp8_casts(monkeypatch):
    """Triton's interpreter (3.x) rounds fp32 -> e4m3 wrongly where the rounding carries into
    the exponent (127.9 becomes 64, not 128); a GPU's cvt.rn.satfinite rounds to nearest
    even, as torch does. Cast through torch there, so the interpreter stores the GPU's bits."""
    if DEVICE.type == "cuda":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return x.to(FP8_KV_DTYPE).view(torch.uint8).numpy().reshape(data.shape)
        return real(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8_KV_DTYPE else x


# --- scales, pools, config ----------------------------------------------------------------------
class DictReader(dict):
    """A checkpoint as `load_kv_scales` reads it (CheckpointReader's `in` and `get`)."""

    def get(self, key):
        return self[key]


@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("kv_scale", "kv_scale"),
                                   ("k_proj.output_scale", "v_proj.output_scale")])
def test_load_kv_scales_reads_the_common_layouts(names):
    reader = DictReader()
    for i in range(3):
        reader[f"model.layers.{i}.self_attn.{names[0]}"] = torch.tensor(0.5 + i)
        reader[f"model.layers.{i}.self_attn.{names[1]}"] = torch.tensor([0.25 + i])
    scales = load_kv_scales(reader, 3)
    if names[0] == names[1]:  # one tensor (the last written) for both
        assert scales.k == scales.v == (0.25, 1.25, 2.25)
    else:
        assert scales.k == (0.5, 1.5, 2.5) and scales.v == (0.25, 1.25, 2.25)


def test_load_kv_scales_none_partial_and_per_channel(caplog):
    assert load_kv_scales(DictReader(), 2) is None
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        assert resolve_kv_scales(DictReader(), 2) == KVScales.ones(2)
    assert "no KV scales" in caplog.text
    partial = DictReader({"model.layers.0.self_attn.k_scale": torch.tensor(1.0),
                          "model.layers.0.self_attn.v_scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="^kv_cache_dtype: .* none for layer 1"):
        load_kv_scales(partial, 2)
    wide = DictReader({"model.layers.0.self_attn.k_scale": torch.ones(4),
                       "model.layers.0.self_attn.v_scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="only per-tensor"):
        load_kv_scales(wide, 1)
    with pytest.raises(ValueError, match="finite and positive"):
        KVScales((1.0, 0.0), (1.0, 1.0))


def test_config_validates_and_refuses_flashinfer():
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="^kv_cache_dtype: must be one of auto, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="^kv_cache_dtype: fp8_e4m3 is not supported by the "
                                         "flashinfer"):
        EngineConfig(kv_cache_dtype=FP8, attention_backend="flashinfer")
    from specserve.cli import build_parser, engine_config_from_args
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", FP8])
    assert engine_config_from_args(args).kv_cache_dtype == FP8


def test_pool_quantises_saturates_and_moves_bytes():
    scales = KVScales((0.5, K_SCALE), (2.0, V_SCALE))
    pool = TokenToKVPool(8, 2, 2, 4, FP8_KV_DTYPE, torch.device("cpu"), scales)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    k[0, 0, 0] = 1e4  # saturates at 448 * scale, no NaN
    loc = torch.tensor([2, 5, 7])
    pool.set_kv(1, loc, k, v)
    assert pool.k_all.dtype == FP8_KV_DTYPE and not pool.k_all[0].view(torch.uint8).any()
    k_read = dequantize(pool.k_buffer[1][loc], K_SCALE, torch.float32)
    assert k_read[0, 0, 0] == FP8_MAX * K_SCALE
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of the value, or of 0.
    torch.testing.assert_close(k_read[1:], k[1:], rtol=1 / 16, atol=K_SCALE * 2 ** -9)
    torch.testing.assert_close(dequantize(pool.v_buffer[1][loc], V_SCALE, torch.float32), v,
                               rtol=1 / 16, atol=V_SCALE * 2 ** -9)
    assert torch.equal(bits(pool.k_buffer[1][loc]), bits(quantize(k, K_SCALE)))
    before = pool.k_all.view(torch.uint8).clone(), pool.v_all.view(torch.uint8).clone()
    pool.move_kv_cache(torch.tensor([1, 3]), torch.tensor([5, 2]))
    assert torch.equal(pool.k_all.view(torch.uint8)[:, [1, 3]], before[0][:, [5, 2]])
    assert torch.equal(pool.v_all.view(torch.uint8)[:, [1, 3]], before[1][:, [5, 2]])


def test_mla_pool_one_scale_for_latent_and_rope():
    pool = MLATokenToKVPool(6, 1, 8, 4, FP8_KV_DTYPE, torch.device("cpu"),
                            KVScales((K_SCALE,), (1.0,)))
    assert pool.scales.v == pool.scales.k == (K_SCALE,)  # V is a view of K: the same bytes
    g = torch.Generator().manual_seed(1)
    latent, rope = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
    pool.set_mla_kv(0, torch.tensor([1, 4]), latent, rope)
    stored = pool.k_buffer[0][[1, 4], 0]
    assert torch.equal(bits(stored), bits(quantize(torch.cat([latent, rope], -1), K_SCALE)))
    assert torch.equal(bits(pool.v_buffer[0][[1, 4], 0]), bits(stored[:, :8]))
    pool.set_kv(0, torch.tensor([2]), torch.cat([latent, rope], -1)[:1, None], None)
    assert torch.equal(bits(pool.k_buffer[0][2]), bits(stored[:1]))
    pool.move_kv_cache(torch.tensor([5]), torch.tensor([4]))
    assert torch.equal(bits(pool.kv_all[:, 5]), bits(pool.kv_all[:, 4]))


def test_fp8_pool_gets_twice_the_slots_of_bf16():
    from specserve.engine.builder import _num_kv_slots
    from specserve.engine.models.model_config import ModelConfig

    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=256,
                                     intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=320, max_position_embeddings=512))

    class Layer:
        num_kv_heads = 2

    slots = [_num_kv_slots(EngineConfig(), cfg, Layer, torch.bfloat16, kv_dtype,
                           torch.device("cpu"), 1, None, 10 ** 12, 1, 0, constrained=False)
             for kv_dtype in (torch.bfloat16, FP8_KV_DTYPE)]
    assert abs(slots[1] - 2 * slots[0]) <= 1


# --- attention kernels over an FP8 pool -------------------------------------------------------
def fp8_scene(scene, k_scale=K_SCALE, v_scale=V_SCALE, mla_latent=None):
    """(the scene with FP8 buffers, the scene with their dequantised values: the reference)."""
    k8 = quantize(scene.k_buffer, k_scale)
    k_ref = dequantize(k8, k_scale, torch.float32)
    if mla_latent is not None:  # one buffer, one scale; V its latent view
        return (scene._replace(k_buffer=k8, v_buffer=k8[..., :mla_latent]),
                scene._replace(k_buffer=k_ref, v_buffer=k_ref[..., :mla_latent]))
    v8 = quantize(scene.v_buffer, v_scale)
    return (scene._replace(k_buffer=k8, v_buffer=v8),
            scene._replace(k_buffer=k_ref, v_buffer=dequantize(v8, v_scale, torch.float32)))


@pytest.mark.parametrize("num_kv_heads,group_size,head_dim", [(2, 2, 16), (1, 3, 24)])
@pytest.mark.parametrize("max_kv_splits", [1, 4])
def test_decode_reads_fp8(num_kv_heads, group_size, head_dim, max_kv_splits):
    gen = torch.Generator().manual_seed(31)
    num_heads = num_kv_heads * group_size
    scene, ref = fp8_scene(make_scene([0, 63, 17], [1] * 3, num_kv_heads, head_dim, gen))
    q = torch.randn(3, num_heads, head_dim, generator=gen).to(DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
    partial_out = torch.empty(3, num_heads, max_kv_splits, head_dim, device=DEVICE)
    partial_lse = torch.empty(3, num_heads, max_kv_splits, device=DEVICE)
    arrivals = torch.zeros(3 * num_kv_heads, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    outs = []
    for k_scale, v_scale in ((K_SCALE, V_SCALE), (1.0, 1.0)):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                         partial_out, partial_lse, arrivals, scale, SMALL_DECODE,
                         k_scale=k_scale, v_scale=v_scale)
        outs.append(out)
    torch.testing.assert_close(outs[0], scene_reference(ref, q, scale), atol=1e-4, rtol=1e-4)
    assert not arrivals.any()
    assert not torch.allclose(outs[0], outs[1], atol=1e-2)  # the scales are applied


@pytest.mark.parametrize("use_custom_mask", [False, True])
def test_extend_reads_fp8(use_custom_mask):
    gen = torch.Generator().manual_seed(32)
    extend_lens = [21, 1, 6]
    scene, ref = fp8_scene(make_scene([0, 30, 9], extend_lens, 2, 16, gen))
    q = torch.randn(sum(extend_lens), 4, 16, generator=gen).to(DEVICE)
    mask = random_tree_mask(3, 21, gen).to(DEVICE) if use_custom_mask else None
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr, kv_indices,
                     scene.new_slots, 21, 0.25, custom_mask=mask, config=SMALL_EXTEND,
                     k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, scene_reference(ref, q, 0.25, mask), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_kv_splits", [1, 4])
def test_short_extend_reads_fp8(max_kv_splits):
    """Tree verify: 1-8 new tokens under a custom mask over prefixes of up to 4 splits."""
    gen = torch.Generator().manual_seed(33)
    extend_lens = [4, 8, 1, 5]
    scene, ref = fp8_scene(make_scene([0, 70, 9, 33], extend_lens, 1, 32, gen))
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, 4, 32, generator=gen).to(DEVICE)
    mask = random_tree_mask(4, 8, gen).to(DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    arrivals = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    short_extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr,
                           kv_indices, scene.new_slots, 8, 0.2,
                           torch.empty(num_tokens, 4, max_kv_splits, 32, device=DEVICE),
                           torch.empty(num_tokens, 4, max_kv_splits, device=DEVICE), arrivals,
                           custom_mask=mask, config=SMALL_DECODE, k_scale=K_SCALE,
                           v_scale=V_SCALE)
    torch.testing.assert_close(out, scene_reference(ref, q, 0.2, mask), atol=1e-4, rtol=1e-4)
    assert not arrivals.any()


@pytest.mark.parametrize("kernel", ["decode", "short_extend", "extend"])
def test_mla_reads_fp8(kernel):
    """MLA's latent || rope pool in FP8: one scale, the value a view of the key's bytes."""
    gen = torch.Generator().manual_seed(34)
    num_heads = 32
    extend_lens = [1, 1, 1] if kernel == "decode" else [4, 8, 3]
    scene, ref = fp8_scene(make_mla_scene([0, 63, 17], extend_lens, gen), v_scale=K_SCALE,
                           mla_latent=MLA_LATENT)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, MLA_KEY_DIM, generator=gen).to(DEVICE)
    out = torch.full((num_tokens, num_heads, MLA_LATENT), float("nan"), device=DEVICE)
    scale, scales = MLA_KEY_DIM ** -0.5, dict(k_scale=K_SCALE, v_scale=K_SCALE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=kernel == "decode")
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    mask = random_tree_mask(3, 8, gen).to(DEVICE) if kernel == "short_extend" else None
    splits = (torch.empty(num_tokens, num_heads, 4, MLA_LATENT, device=DEVICE),
              torch.empty(num_tokens, num_heads, 4, device=DEVICE),
              torch.zeros(3 * num_heads, dtype=torch.int32, device=DEVICE))
    if kernel == "decode":
        decode_attention(q, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices, *splits,
                         scale, MLA_DECODE, **scales)
    elif kernel == "short_extend":
        short_extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr,
                               kv_indices, scene.new_slots, 8, scale, *splits, custom_mask=mask,
                               config=MLA_DECODE, **scales)
    else:
        extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr,
                         kv_indices, scene.new_slots, 8, scale, config=SMALL_EXTEND, **scales)
    torch.testing.assert_close(out, scene_reference(ref, q, scale, mask), atol=1e-4, rtol=1e-4)


def fp8_forward_batch(case_name: str, backend, gen: torch.Generator, dtype=torch.float32,
                      device=DEVICE):
    """`build_forward_batch`'s scene in an FP8 pool with non-unit scales per layer."""
    fb, _ = build_forward_batch(BACKEND_CASES[case_name], backend, 2, 16, 64, gen, dtype, device)
    src = fb.kv_pool
    scales = KVScales((0.5, K_SCALE), (0.25, V_SCALE))
    pool = TokenToKVPool(src.num_slots, NUM_LAYERS, 2, 16, FP8_KV_DTYPE, device, scales)
    slots = torch.arange(1, src.num_slots + 1, device=device)
    for layer in range(NUM_LAYERS):
        pool.set_kv(layer, slots, src.k_buffer[layer][slots], src.v_buffer[layer][slots])
    fb.kv_pool = pool
    return fb


@pytest.mark.parametrize("case_name", ["extend", "decode", "target_verify", "draft_extend"])
def test_triton_backend_matches_torch_native_on_fp8_pools(case_name):
    """Both backends store the new tokens quantised and read the pool dequantised."""
    gen = torch.Generator().manual_seed(35)
    backend = TritonAttnBackend(4, 2, 16, 64, DEVICE, decode_config=SMALL_DECODE,
                                extend_config=SMALL_EXTEND)
    fb = fp8_forward_batch(case_name, backend, gen)
    q, k, v = random_qkv(fb.num_tokens, 4, 2, 16, gen)
    native = TorchNativeAttnBackend(needs_cpu_seq_lens=False)
    native.init_forward_metadata(fb)
    expected = native.forward(q, k, v, LAYER_ID, fb, 0.25)
    stored = fb.kv_pool.k_all.view(torch.uint8).clone()
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(q, k, v, LAYER_ID, fb, 0.25), expected,
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(fb.kv_pool.k_all.view(torch.uint8), stored)  # the same bits stored


# --- launch parameters per pool dtype -------------------------------------------------------
@pytest.fixture
def fake_capability(monkeypatch):
    """Sets the compute capability `torch.cuda` reports (no GPU needed to choose configs)."""
    def set_capability(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return set_capability


def test_fp8_pools_get_their_own_decode_config(fake_capability):
    """On sm_90 an FP8 pool with Llama-like heads gets the FP8 config (the "bits" conversion,
    its own tiles and splits); other FP8 heads only the conversion; bf16 pools, older GPUs
    (no bf16x2 multiply) and the interpreter keep the 16-bit pool's config."""
    cuda, fp8 = torch.device("cuda"), FP8_KV_DTYPE
    fake_capability((9, 0))
    bf16_config = default_decode_config(128, cuda)
    assert bf16_config == default_decode_config(128, cuda, kv_dtype=torch.bfloat16)
    assert (bf16_config.fp8_convert, bf16_config.max_kv_splits) == ("cast", 16)
    fp8_config = default_decode_config(128, cuda, kv_dtype=fp8)
    assert fp8_config == triton_kernels._FP8_DECODE_CONFIG and fp8_config.fp8_convert == "bits"
    assert fp8_config != bf16_config
    assert default_decode_config(64, cuda, kv_dtype=fp8) == fp8_config
    for head_dim, v_head_dim in ((256, None), (576, 512)):  # large heads, MLA
        base = default_decode_config(head_dim, cuda, v_head_dim)
        assert default_decode_config(head_dim, cuda, v_head_dim, fp8) == \
            base._replace(fp8_convert="bits")
    fake_capability((8, 9))
    assert default_decode_config(128, cuda, kv_dtype=fp8) == bf16_config
    assert default_decode_config(128, DEVICE, kv_dtype=fp8) == default_decode_config(128, DEVICE)


@pytest.mark.parametrize("kernel", ["decode", "short_extend"])
def test_unknown_fp8_convert_is_refused(kernel):
    scene, _ = fp8_scene(make_scene([5], [1], 1, 16, torch.Generator().manual_seed(36)))
    q = torch.randn(1, 2, 16, device=DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=kernel == "decode")
    splits = (torch.empty(1, 2, 2, 16, device=DEVICE), torch.empty(1, 2, 2, device=DEVICE),
              torch.zeros(2, dtype=torch.int32, device=DEVICE))
    config = SMALL_DECODE._replace(fp8_convert="bit")
    with pytest.raises(ValueError, match="^fp8_convert: must be one of cast, bits,"):
        if kernel == "decode":
            decode_attention(q, scene.k_buffer, scene.v_buffer, torch.empty_like(q), kv_indptr,
                             kv_indices, *splits, 0.25, config)
        else:
            short_extend_attention(q, scene.k_buffer, scene.v_buffer, torch.empty_like(q),
                                   torch.tensor([0, 1], device=DEVICE), kv_indptr, kv_indices,
                                   scene.new_slots, 1, 0.25, *splits, config=config)


def test_backend_takes_the_pool_dtype_and_config_splits(monkeypatch):
    """The factory hands the pool's dtype to the Triton backend, which sizes its split
    scratch by its config's `max_kv_splits` (as far as its contexts reach)."""
    from specserve.engine.attention.factory import create_attention_backend

    monkeypatch.setattr(triton_kernels, "has_sm90_conversions", lambda device: True)
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=16, max_batch_size=2,
              needs_cpu_seq_lens=None)
    fp8 = create_attention_backend("triton", DEVICE, max_context_len=32768,
                                   kv_dtype=FP8_KV_DTYPE, **kw)
    assert fp8.decode_config == triton_kernels._FP8_DECODE_CONFIG
    assert (fp8.max_kv_splits == fp8._partial_out_buf.shape[2]
            == triton_kernels._FP8_DECODE_CONFIG.max_kv_splits)
    short = create_attention_backend("triton", DEVICE, max_context_len=1000,
                                     kv_dtype=FP8_KV_DTYPE, **kw)
    assert short.max_kv_splits == 4  # cdiv(1000, 256)
    plain = create_attention_backend("triton", DEVICE, max_context_len=32768, **kw)
    assert plain.decode_config.fp8_convert == "cast" and plain.max_kv_splits == 16
    config = DecodeConfig(block_n=16, min_kv_split_len=32, num_warps=4, num_stages=1,
                          max_kv_splits=5)
    assert TritonAttnBackend(4, 2, 16, 4096, DEVICE, max_batch_size=2,
                             decode_config=config).max_kv_splits == 5


def test_builder_passes_the_target_pool_dtype_only(pair, make_engine, monkeypatch):
    """The target's backend is told its pool is FP8; the draft's pool keeps the model dtype."""
    from specserve.engine import builder

    kv_dtypes = []
    real = builder.create_attention_backend
    monkeypatch.setattr(builder, "create_attention_backend",
                        lambda *a, **kw: kv_dtypes.append(kw.get("kv_dtype")) or real(*a, **kw))
    target, head = pair
    make_engine(target, kv_cache_dtype=FP8, max_context_len=64,
                spec=SpecConfig(algorithm="eagle", draft_model=head, **CHAIN))
    assert kv_dtypes == [FP8_KV_DTYPE, None]


# --- store kernels ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_and_store_kv_quantises_as_set_kv(dtype, exact_fp8_casts):
    from specserve.engine.layers import fused
    from specserve.engine.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(32, 128, 10000.0, None).to(DEVICE)
    g = torch.Generator().manual_seed(36)
    qkv = (torch.randn(9, (6 + 2 + 2) * 32, generator=g) * 3).to(DEVICE, dtype)
    q, k, v = qkv.split([6 * 32, 2 * 32, 2 * 32], dim=-1)
    q, k, v = q.view(9, 6, 32), k.view(9, 2, 32), v.view(9, 2, 32)
    positions = torch.randint(0, 128, (9,), generator=g).to(DEVICE)
    loc = (torch.randperm(20, generator=g)[:9] + 1).to(DEVICE)
    pools = [TokenToKVPool(20, 1, 2, 32, FP8_KV_DTYPE, DEVICE, KVScales((K_SCALE,), (V_SCALE,)))
             for _ in range(2)]
    q_fused = fused.rope_and_store_kv(positions, q, k, v, rot.cos, rot.sin, pools[0].k_all[0],
                                      pools[0].v_all[0], loc, K_SCALE, V_SCALE)
    q_ref, k_ref = fused.rope(positions, q, k, rot.cos, rot.sin)
    pools[1].set_kv(0, loc, k_ref, v)
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(bits(pools[0].k_all), bits(pools[1].k_all))
    assert torch.equal(bits(pools[0].v_all), bits(pools[1].v_all))
    assert (pools[0].k_all.float().abs() == FP8_MAX).any()  # the clamp is exercised


@pytest.mark.parametrize("m,split_k", [(1, 1), (5, 3)])
def test_skinny_qkv_rope_quantises_as_set_kv(m, split_k, exact_fp8_casts):
    """fp16 through multiply-and-sum (exact sums, test_skinny_gemm's operands), so the stored
    fp8 bits must equal the unfused projection, RoPE and `set_kv`'s."""
    from test_skinny_gemm import (KV_HEADS, HEAD_DIM, Q_HEADS, SLOTS, _operands,
                                  _qkv_rope_reference, _workspace)

    from specserve.engine.layers.rotary import RotaryEmbedding
    from specserve.engine.layers.skinny_gemm import SkinnyConfig, skinny_qkv_rope

    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([5, 63, 0, 17, 40][:m], device=DEVICE)
    loc = torch.tensor([7, 2, 11, 0, 5][:m], device=DEVICE)
    x, w, b = _operands(m, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, torch.float16, seed=m)
    config = SkinnyConfig(block_n=4, block_k=32, split_k=split_k, num_warps=4, num_stages=1,
                          dot=False)
    k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=FP8_KV_DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    scales = (0.01, 0.02)
    q = skinny_qkv_rope(x, w, b, Q_HEADS, KV_HEADS, positions, rotary.cos, rotary.sin, k_cache,
                        v_cache, loc, config=config, workspace=_workspace(), k_scale=scales[0],
                        v_scale=scales[1])
    q_ref, k_ref, v_ref = _qkv_rope_reference(x, w, b, positions, rotary, loc)
    assert torch.equal(q, q_ref)
    for got, want, scale in ((k_cache, k_ref, scales[0]), (v_cache, v_ref, scales[1])):
        assert torch.equal(bits(got), bits(quantize(want, scale)))


# The Triton compiler checks what the interpreter does not (a variable two branches assign
# with different pointer types, as the skinny epilogue's q and FP8 K stores would). Every kernel
# that touches an FP8 pool is compiled here for an H100 without one, in a child process
# without TRITON_INTERPRET, at the 8B (and V2-Lite MLA) shapes.
_COMPILE_FP8_FOR_SM90 = """
import torch
from specserve.engine.attention.triton import kernels as A
from specserve.engine.layers import fused, skinny_gemm as sk
from sm90_compile import compile_sm90, t

bf16, f32, i32, i64, u8, fp8 = (torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8,
                                torch.float8_e4m3fn)
# One layer's launch arguments by name (strides of the 8B shape: 8 KV heads of 128 dims).
attn = dict(q=t(bf16), out=t(bf16), k_buffer=t(fp8), v_buffer=t(fp8), kv_indptr=t(i64),
            kv_indices=t(i32), partial_out=t(f32), partial_lse=t(f32), arrivals=t(i32),
            qo_indptr=t(i64), new_token_slots=t(i64), custom_mask=t(u8), sm_scale_log2=0.1,
            v_scale=0.02, stride_q_tok=4096, stride_q_head=128, stride_o_tok=4096,
            stride_o_head=128, stride_k_slot=1024, stride_k_head=128, stride_v_slot=1024,
            stride_v_head=128, stride_mask_req=64, stride_mask_row=8, stride_po_tok=65536,
            stride_po_head=2048, stride_po_split=128, stride_pl_tok=512, stride_pl_head=16,
            MAX_KV_SPLITS=16, MIN_KV_SPLIT_LEN=32, DOT_PRECISION="tf32", PDL=True, NUM_KV_HEADS=8)
llama = dict(attn, MAIN_DIM=128, ROPE_DIM=0, BLOCK_D=128, BLOCK_DPE=1, VALUES="key_strides")
# V2-Lite's MLA: one latent || rope head (576 dims), the latent a view of it.
mla = dict(attn, MAIN_DIM=512, ROPE_DIM=64, BLOCK_D=512, BLOCK_DPE=64, VALUES="key_prefix",
           stride_k_slot=576, stride_k_head=576, stride_v_slot=576, stride_v_head=576)
# What an H100 launches decode and verify with over an FP8 pool.
fp8_config = A._FP8_DECODE_CONFIG
tuned = dict(BLOCK_N=fp8_config.block_n, MAX_KV_SPLITS=fp8_config.max_kv_splits,
             FP8_CONVERT=fp8_config.fp8_convert)
ptx = {
    "decode bits": compile_sm90(A._decode_kernel, dict(
        llama, GROUP_SIZE=4, BLOCK_H=16, HEAD_BLOCKS=1, **tuned), fp8_config.num_warps,
        fp8_config.num_stages),
    "mla decode bits": compile_sm90(A._decode_kernel, dict(
        mla, GROUP_SIZE=16, BLOCK_H=16, HEAD_BLOCKS=1, BLOCK_N=32, FP8_CONVERT="bits"), 4, 2),
    "verify bits": compile_sm90(A._short_extend_kernel, dict(
        llama, GROUP_SIZE=4, HEADS_PER_TILE=4, HEAD_BLOCKS=1, TOKEN_BLOCKS=1, BLOCK_M=32,
        USE_CUSTOM_MASK=True, **tuned), fp8_config.num_warps, fp8_config.num_stages),
    "decode cast": compile_sm90(A._decode_kernel, dict(
        llama, GROUP_SIZE=4, BLOCK_H=16, HEAD_BLOCKS=1, BLOCK_N=128, FP8_CONVERT="cast"), 4, 3),
    "extend cast": compile_sm90(A._extend_attention_kernel, dict(
        llama, GROUP_SIZE=4, HEADS_PER_TILE=4, HEAD_BLOCKS=1, BLOCK_M=128, BLOCK_N=64,
        USE_CUSTOM_MASK=False, FP8_CONVERT="cast"), 8, 2),
    "rope store": compile_sm90(fused._rope_kernel, dict(
        q_ptr=t(bf16), k_ptr=t(bf16), v_ptr=t(bf16), q_out_ptr=t(bf16), k_out_ptr=t(fp8),
        v_out_ptr=t(fp8), loc_ptr=t(i64), pos_ptr=t(i64), cos_ptr=t(f32), sin_ptr=t(f32),
        q_stride=6144, k_stride=6144, v_stride=6144, num_q_heads=32, num_k_heads=8,
        k_scale_inv=50.0, v_scale_inv=40.0, STORE_KV=True, KV_FP8=True, HALF=64, BLOCK_H=32,
        PDL=True), 4, 1),
}
c = sk.default_config(1, 3072, 4096, True, torch.device("cpu"))
c = c._replace(block_n=min(c.block_n, 64))  # within half a head, as _qkv_rope_config cuts it
ptx["skinny qkv store"] = compile_sm90(sk._skinny_qkv_rope_kernel, dict(
    x=t(bf16), w=t(bf16), bias=t(bf16), q_out=t(bf16), k_cache=t(fp8), v_cache=t(fp8),
    loc=t(i64), positions=t(i64), cos=t(f32), sin=t(f32), q_norm_w=t(bf16), k_norm_w=t(bf16),
    partials=t(f32), arrivals=t(i32), M=1,
    K=4096, k_per_split=4096 // c.split_k, stride_xm=4096, stride_wn=4096,
    fp8=sk._Fp8Args(t(f32), t(f32), 32, 32, 128, 128), k_scale_inv=50.0, v_scale_inv=40.0,
    norm_eps=1e-6, NUM_Q_HEADS=32, NUM_KV_HEADS=8, HALF=64, KV_FP8=True, QK_NORM=False, BLOCK_M=16, BLOCK_N=c.block_n,
    BLOCK_K=c.block_k, SPLIT_K=c.split_k, HAS_BIAS=False, DOT=c.dot, EVEN_K=True,
    DOT_PRECISION="tf32", FP8_WEIGHT=False, SCALE_COLS=0, FP8_ACT=False, FP8_CONVERT="cast",
    FP8_F16=False, W_LEFT=False, PDL=True),
    c.num_warps, c.num_stages)
for name, text in ptx.items():
    # Loads convert e4m3 pairs to f16 then to the query's bf16 ("cast") or by moving bits and
    # one bf16x2 multiply a pair, with no f16 -> bf16 conversion ("bits"); stores round to
    # nearest even with saturation, as torch's cast of a clamped value does (the interpreter
    # tests' bits).
    if "store" in name:
        assert "cvt.rn.satfinite.e4m3x2.f32" in text, name
    elif "bits" in name:
        assert "mul.rn.bf16x2" in text and "cvt.bf16.f16" not in text, name
    else:
        assert "cvt.rn.f16x2.e4m3x2" in text and "mul.rn.bf16x2" not in text, name
    assert "griddepcontrol.wait" in text, name  # programmatic dependent launch (engine/pdl.py)
    print("compiled", name)
"""


def test_fp8_kernels_compile_for_hopper():
    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_FP8_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 7


# --- engines -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("fp8_pair")))


@pytest.fixture(scope="module")
def deepseek_pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("fp8_ds_pair")), arch="deepseek_v3",
                                 num_layers=2)


def _generate(engine, prompts, params):
    return [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_fp8_spec_equals_fp8_plain(pair, make_engine, shape, overlap):
    target, head = pair
    prompts = random_prompts(5, seed=41, max_len=20)
    params = [greedy(n) for n in (16, 9, 16, 3, 12)]
    plain = make_engine(target, kv_cache_dtype=FP8, enable_overlap=overlap)
    assert plain.core.kv_pool.k_all.dtype == FP8_KV_DTYPE
    assert plain.info.kv_cache_dtype == "float8_e4m3fn"
    spec = make_engine(target, kv_cache_dtype=FP8, enable_overlap=overlap,
                       spec=SpecConfig(algorithm="eagle", draft_model=head, **shape))
    assert spec.core.kv_pool.k_all.dtype == FP8_KV_DTYPE
    assert spec.core.draft_runner.kv_pool.k_all.dtype == torch.float32  # drafts: model dtype
    assert _generate(spec, prompts, params) == _generate(plain, prompts, params)
    assert spec.metrics.mean_accept_length > 1.3  # really speculating


@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_fp8_radix_hit_equals_prefill(pair, make_engine, shape):
    """A follow-up served from the prefix cache gives the tokens a cold engine gives, and the
    cached target KV (FP8 bits, some written by decode steps) is the cold prefill's."""
    target, head = pair
    spec = None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)
    prompt = random_prompts(1, seed=42, min_len=20, max_len=20)[0]
    warm = make_engine(target, kv_cache_dtype=FP8, spec=spec)
    answer = _generate(warm, [prompt], greedy(10))[0]
    follow_up = prompt + answer + [5, 6, 7]
    hit = warm.generate(prompt_token_ids=[follow_up], sampling=greedy(8))[0]
    assert hit.cached_tokens >= len(prompt) + len(answer) - 2
    cold = make_engine(target, kv_cache_dtype=FP8, spec=spec, enable_prefix_cache=False)
    assert hit.token_ids == _generate(cold, [follow_up], greedy(8))[0]
    fresh = make_engine(target, kv_cache_dtype=FP8, spec=spec)
    fresh.generate(prompt_token_ids=[follow_up], sampling=greedy(1))
    stored = [e.core.kv_pool.k_all[:, cached_prefix_slots(e, follow_up)] for e in (warm, fresh)]
    # Decode-written and prefill-written K agree to fp32 rounding before quantisation, so at
    # most a rare element lands one fp8 step apart.
    same = (bits(stored[0]) == bits(stored[1])).float().mean()
    assert same > 0.99, same
    torch.testing.assert_close(stored[0].float(), stored[1].float(), rtol=0.13, atol=2 ** -9)


@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_fp8_triton_engine_matches_torch(pair, make_engine, shape):
    """The Triton decode, verify and extend kernels (interpreter) read the FP8 pool as the
    torch backend does: the same greedy tokens."""
    target, head = pair
    spec = None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)
    prompts = random_prompts(2, seed=43, max_len=12)  # the interpreter is slow: two suffice
    outs = [_generate(make_engine(target, kv_cache_dtype=FP8, spec=spec, attention_backend=b,
                                  max_context_len=64), prompts, greedy(8))
            for b in ("torch", "triton")]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("backend,shape", [("torch", TREE), ("triton", None)])
def test_fp8_mla(deepseek_pair, make_engine, backend, shape):
    """DeepSeek's latent pool in FP8: tree speculation equals plain decoding (torch), and the
    Triton MLA kernels equal the torch backend."""
    target, head = deepseek_pair
    prompts = random_prompts(3, seed=44, max_len=12)
    ref = make_engine(target, kv_cache_dtype=FP8, max_context_len=64)
    assert ref.core.kv_pool.kv_all.dtype == FP8_KV_DTYPE
    spec = None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)
    other = make_engine(target, kv_cache_dtype=FP8, max_context_len=64, spec=spec,
                        attention_backend=backend)
    assert _generate(other, prompts, greedy(8)) == _generate(ref, prompts, greedy(8))


def test_fp8_nextn_equals_fp8_plain(tmp_path, make_engine):
    """DeepSeek-V3's NextN module drafting over an FP8 target pool (its own one-layer latent
    pool keeps the model dtype): tree speculation equals plain decoding."""
    from test_nextn import make_deepseek_v3_with_nextn

    target = make_deepseek_v3_with_nextn(str(tmp_path), predicts=True, attn_scale=0.3)
    prompts = random_prompts(3, seed=47, max_len=16)
    plain = make_engine(target, kv_cache_dtype=FP8)
    spec = make_engine(target, kv_cache_dtype=FP8, spec=SpecConfig(algorithm="nextn", **TREE))
    assert spec.core.draft_runner.kv_pool.kv_all.dtype == torch.float32
    assert _generate(spec, prompts, greedy(12)) == _generate(plain, prompts, greedy(12))
    assert spec.metrics.mean_accept_length > 1.3


def test_fp8_tp2_equals_tp1(pair, make_engine):
    target, _ = pair
    prompts = random_prompts(3, seed=45, max_len=20)
    outs = [_generate(make_engine(target, kv_cache_dtype=FP8, tp_size=tp), prompts, greedy(10))
            for tp in (1, 2)]
    assert outs[0] == outs[1]


def test_checkpoint_kv_scales_are_read_and_used(tmp_path, make_engine):
    """k_scale / v_scale tensors of the checkpoint become the pool's scales: layer 0's stored
    K/V (computed from the same inputs as an fp32-KV engine's) is that K/V quantised with them."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(str(tmp_path), "llama")
    file = f"{path}/model.safetensors"
    weights = load_file(file)
    scales = KVScales((0.03125, 0.046875), (0.015625, 0.0625))  # exact in fp32
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scales.k[i])
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(scales.v[i])
    save_file(weights, file, metadata={"format": "pt"})
    prompt = random_prompts(1, seed=46, min_len=16, max_len=16)[0]
    engines = [make_engine(path, kv_cache_dtype=dtype) for dtype in (FP8, "auto")]
    for engine in engines:
        engine.generate(prompt_token_ids=[prompt], sampling=greedy(2))
    fp8, full = (e.core.kv_pool for e in engines)
    assert fp8.scales == scales
    slots = cached_prefix_slots(engines[0], prompt)
    assert torch.equal(slots, cached_prefix_slots(engines[1], prompt))
    for stored, full_kv, scale in ((fp8.k_buffer[0], full.k_buffer[0], scales.k[0]),
                                   (fp8.v_buffer[0], full.v_buffer[0], scales.v[0])):
        assert torch.equal(bits(stored[slots]), bits(quantize(full_kv[slots], scale)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors needs the "
                    "interpreter (no CUDA); the gpu test below takes the kernel on CUDA")
def test_fp8_engine_through_the_fused_qkv_rope_store(tmp_path, make_engine, monkeypatch,
                                                    exact_fp8_casts):
    """Decode's K/V stored into the FP8 pool by the skinny q/k/v+RoPE epilogue (interpreter,
    allowed on CPU tensors) give the tokens of the torch path's `set_kv`."""
    from test_skinny_gemm import MAX_ROWS, _greedy_with_fused_qkv_rope, skinny_module

    model = make_tiny_checkpoint(str(tmp_path), "llama", hidden_size=128, intermediate_size=128)
    want = _generate(make_engine(model, kv_cache_dtype=FP8), random_prompts(3, seed=8, max_len=12),
                     greedy(6))
    monkeypatch.setattr(skinny_module, "can_use",
                        lambda x, w, scale=None: x.numel() // w.shape[1] <= MAX_ROWS)
    assert _greedy_with_fused_qkv_rope(make_engine, monkeypatch, model, kv_cache_dtype=FP8) == want


def test_fp8_checkpoint_with_kv_scales_spec_equals_plain(pair, tmp_path, make_engine):
    """FP8 weights and an FP8 KV cache together, as a ModelOpt-style checkpoint ships them
    (block-wise weights plus per-layer k_scale / v_scale): the scales are read, and chain
    speculation equals plain decoding."""
    from safetensors.torch import load_file, save_file
    from fp8_quantizer import quantize_checkpoint

    target, head = pair
    fp8_target = quantize_checkpoint(target, str(tmp_path / "fp8"), "block", (16, 32))
    file = f"{fp8_target}/model.safetensors"
    weights = load_file(file)
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.0625)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.03125)
    save_file(weights, file, metadata={"format": "pt"})
    prompts = random_prompts(4, seed=48, max_len=20)
    plain = make_engine(fp8_target, kv_cache_dtype=FP8)
    assert plain.core.kv_pool.scales == KVScales((0.0625,) * 2, (0.03125,) * 2)
    assert plain.info.weight_dtype.startswith("fp8")
    spec = make_engine(fp8_target, kv_cache_dtype=FP8,
                       spec=SpecConfig(algorithm="eagle", draft_model=head, **CHAIN))
    assert _generate(spec, prompts, greedy(12)) == _generate(plain, prompts, greedy(12))
    assert spec.metrics.mean_accept_length > 1.3


# --- GPU: compiled kernels, CUDA graphs ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, FP8_KV_DTYPE], ids=["bf16-config", "fp8-config"])
@pytest.mark.parametrize("case_name", ["decode", "target_verify", "extend"])
def test_triton_backend_bf16_fp8_pool_gpu(case_name, kv_dtype):
    """Compiled kernels with bf16 queries over an FP8 pool, against the torch backend, with
    the 16-bit pool's launch config ("cast") and the FP8 pool's ("bits" on sm_90)."""
    gen = torch.Generator().manual_seed(50)
    backend = TritonAttnBackend(4, 2, 16, 64, DEVICE, kv_dtype=kv_dtype)
    fb = fp8_forward_batch(case_name, backend, gen, torch.bfloat16)
    q, k, v = random_qkv(fb.num_tokens, 4, 2, 16, gen, torch.bfloat16)
    native = TorchNativeAttnBackend(needs_cpu_seq_lens=False)
    native.init_forward_metadata(fb)
    expected = native.forward(q, k, v, LAYER_ID, fb, 0.25)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(q, k, v, LAYER_ID, fb, 0.25), expected,
                               atol=2e-2, rtol=2e-2)


@triton.jit
def _kv_tile_kernel(src, dst, FP8_CONVERT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(dst + offs, fp8_tile(tl.load(src + offs), tl.bfloat16, FP8_CONVERT))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_convert", ["cast", "bits"])
def test_fp8_tile_conversions_are_exact_gpu(fp8_convert):
    """Every e4m3 code converts to its bf16 value every way (the NaN codes 0x7F and 0xFF read
    as +-480 by bits: the pool's writers never store them)."""
    if fp8_convert != "cast" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bf16x2 multiply needs sm_90")
    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    out = torch.empty(256, dtype=torch.bfloat16, device="cuda")
    # One warp: 8 codes a thread, whole 4-byte packs as in the attention tiles.
    _kv_tile_kernel[(1,)](codes.view(FP8_KV_DTYPE), out, FP8_CONVERT=fp8_convert, num_warps=1)
    expected = codes.view(FP8_KV_DTYPE).to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(out[~nan], expected[~nan])
    if fp8_convert != "cast":
        assert out[nan].tolist() == [480.0, -480.0]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["decode", "short_extend"])
def test_fp8_bits_equal_cast_gpu(kernel):
    """At the 8B shape over a 2k-token FP8 prefix, the bit conversions give the dots the
    operands "cast" does: the same output, bit for bit, under the same launch config."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bf16x2 multiply needs sm_90")
    gen = torch.Generator(device="cuda").manual_seed(52)
    bs, prefix, extend, heads, kv_heads = 2, 2048, 4 if kernel == "short_extend" else 1, 32, 8
    slots = torch.randperm(bs * (prefix + extend), device="cuda", generator=gen) + 1
    k = quantize(torch.randn(slots.numel() + 1, kv_heads, 128, device="cuda", generator=gen),
                 K_SCALE)
    v = quantize(torch.randn(k.shape, device="cuda", generator=gen), V_SCALE)
    q = torch.randn(bs * extend, heads, 128, device="cuda", generator=gen).bfloat16()
    table = slots.view(bs, prefix + extend)
    config = default_decode_config(128, q.device, kv_dtype=FP8_KV_DTYPE)
    outs = []
    for convert in ("bits", "cast"):
        out = torch.empty_like(q)
        splits = (torch.empty(bs * extend, heads, config.max_kv_splits, 128, device="cuda"),
                  torch.empty(bs * extend, heads, config.max_kv_splits, device="cuda"),
                  torch.zeros(bs * kv_heads, dtype=torch.int32, device="cuda"))
        c = config._replace(fp8_convert=convert)
        if kernel == "decode":
            kv_indptr = torch.arange(0, bs + 1, device="cuda") * (prefix + 1)
            kv_indices = table[:, :prefix + 1].reshape(-1).int()
            decode_attention(q, k, v, out, kv_indptr, kv_indices, *splits, 0.088, c,
                             k_scale=K_SCALE, v_scale=V_SCALE)
        else:
            kv_indptr = torch.arange(0, bs + 1, device="cuda") * prefix
            kv_indices = table[:, :prefix].reshape(-1).int()
            qo_indptr = torch.arange(0, bs + 1, device="cuda") * extend
            short_extend_attention(q, k, v, out, qo_indptr, kv_indptr, kv_indices,
                                   table[:, prefix:].reshape(-1), extend, 0.088, *splits,
                                   config=c, k_scale=K_SCALE, v_scale=V_SCALE)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """head_dim 32: half a head is a whole 16-column tile, so decode takes the skinny q/k/v +
    RoPE kernel on CUDA (and the RoPE+store kernel elsewhere)."""
    return make_predictable_pair(str(tmp_path_factory.mktemp("fp8_wide")), hidden_size=128,
                                 intermediate_size=128)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_fp8_spec_equals_plain_cuda_graphs_gpu(wide_pair, make_engine, monkeypatch, shape,
                                               overlap):
    """On CUDA with graphs (Triton kernels; the RoPE+store kernel and the skinny q/k/v
    epilogue storing FP8): speculative = plain, token for token; no host sync in the steady
    state. The spy goes in before the engines are built (graphs capture the kernel)."""
    from specserve.engine.layers.parallel import ColumnParallelLinear

    calls = []
    real = ColumnParallelLinear.forward_qkv_rope
    monkeypatch.setattr(ColumnParallelLinear, "forward_qkv_rope",
                        lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    target, head = wide_pair
    prompts = random_prompts(5, seed=51, max_len=40)
    # fp32 activations: bf16 rounds verify's (wider) GEMMs differently from decode's, and the
    # FP8 store then magnifies that into different tokens; the comparison is of the paths.
    kw = dict(device="cuda", dtype="float32", kv_cache_dtype=FP8, enable_overlap=overlap,
              cuda_graph=True, max_total_tokens=4096)
    plain = make_engine(target, **kw)
    spec = make_engine(target, spec=SpecConfig(algorithm="eagle", draft_model=head, **shape), **kw)
    assert plain.core.uses_cuda_graphs and spec.core.uses_cuda_graphs and calls
    assert plain.core.kv_pool.k_all.dtype == FP8_KV_DTYPE
    assert _generate(spec, prompts, greedy(24)) == _generate(plain, prompts, greedy(24))
    assert spec.metrics.mean_accept_length > 1.3
    steady_state_steps(spec, prompts[0])
