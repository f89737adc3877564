"""The fused MLA decode kernels (engine/layers/mla_decode.py) against `MLAAttention`'s torch
path: the latent norm + RoPE + pool store kernel and the per-head matmul, in the interpreter on
the CPU (tiny shapes), the DeepSeek engine through them and the fused router (transformers'
greedy tokens, a spec verify of tree drafts), and compiled for an H100."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from fp8_quantizer import quantize_checkpoint  # noqa: E402
from helpers import (  # noqa: E402
    cached_checkpoints, hf_greedy, make_predictable_pair, make_tiny_checkpoint, random_prompts)
from test_fp8_kv_cache import exact_fp8_casts  # noqa: E402,F401 (a fixture)

from specserve.engine import SamplingParams, SpecConfig  # noqa: E402
from specserve.engine.kvcache.fp8 import FP8_KV_DTYPE, to_pool  # noqa: E402
from specserve.engine.layers import mla_decode, moe  # noqa: E402
from specserve.engine.layers.moe_router import MAX_ROUTER_TOKENS, router_softmax_topk  # noqa: E402
from specserve.engine.layers.norm import RMSNorm  # noqa: E402
from specserve.engine.layers.rotary import RotaryEmbedding  # noqa: E402
from specserve.engine.layers.skinny_gemm import MAX_ROWS  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, NOPE, ROPE, LATENT, V_DIM, SLOTS = 3, 16, 8, 32, 16, 20


def _rope_norm_reference(q, kv, positions, rotary, norm, interleave):
    """The torch path of `MLAAttention.forward`: the latent's norm, the reorder, RoPE."""
    q_pe = q[..., q.shape[-1] - ROPE:]
    latent, k_pe = kv.split([norm.weight.shape[0], ROPE], dim=-1)
    k_pe = k_pe.view(-1, 1, ROPE)
    if interleave:
        q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
        k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
    q_pe, k_pe = rotary(positions, q_pe.contiguous(), k_pe.contiguous())
    return q_pe, norm(latent.contiguous()), k_pe[:, 0]


def _kv_b(gen, dtype, nope=NOPE, v_dim=V_DIM, latent=LATENT):
    """W_UK [H, nope, latent] and W_UV [H, v, latent]: views of a kv_b weight, as the model's."""
    kv_b = (torch.randn(HEADS * (nope + v_dim), latent, generator=gen) * 0.2).to(DEVICE, dtype)
    w = kv_b.view(HEADS, nope + v_dim, latent)
    return w[:, :nope], w[:, nope:]


def _bmm(a, b, dtype):  # the torch path's bmm, in fp32 and rounded once
    return torch.bmm(a.float(), b.float()).to(dtype)


def _matmul_tol(dtype):  # fp32 to its rounding, fp16 within a unit of the last place
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nope, latent", [(NOPE, LATENT), (144, 80)])
def test_absorb_query_is_the_torch_path(num_tokens, interleave, dtype, nope, latent):
    """q_nope x W_UK (a transposed view of kv_b's weight) in the absorbed query's latent part,
    q's rope part written rotated after it, the normed latent and the rotated rope key at the
    token's slot, no other slot written; the RoPE bits exact (fp16 too), the norm to the last
    bits of torch's mean, the product to torch.bmm's rounding. (144, 80): a product past one
    K step and several uneven column tiles, a latent below its power-of-two block."""
    gen = torch.Generator().manual_seed(num_tokens + 2 * interleave)
    rotary = RotaryEmbedding(ROPE, 64, 10000.0, None).to(DEVICE)
    norm = RMSNorm(latent, 1e-6)
    norm.weight.data = torch.rand(latent, generator=gen) + 0.5
    norm = norm.to(DEVICE, dtype)
    w_uk, _ = _kv_b(gen, dtype, nope=nope, latent=latent)
    q = torch.randn(num_tokens, HEADS, nope + ROPE, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(num_tokens, latent + ROPE, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    loc = (torch.randperm(SLOTS - 1, generator=gen)[:num_tokens] + 1).to(DEVICE)
    pool = torch.zeros(SLOTS, 1, latent + ROPE, dtype=dtype, device=DEVICE)
    q_abs = torch.full((num_tokens, HEADS, latent + ROPE), 7.0, dtype=dtype, device=DEVICE)
    mla_decode.absorb_query(q, kv, w_uk, q_abs, pool, loc, positions, rotary.cos, rotary.sin,
                            norm.weight, norm.eps, interleave)
    q_pe, normed, k_pe = _rope_norm_reference(q, kv, positions, rotary, norm, interleave)
    assert torch.equal(q_abs[..., latent:], q_pe)
    expected = _bmm(q[..., :nope].transpose(0, 1), w_uk, dtype).transpose(0, 1)
    torch.testing.assert_close(q_abs[..., :latent], expected, **_matmul_tol(dtype))
    assert torch.equal(pool[loc, 0, latent:], k_pe)
    torch.testing.assert_close(pool[loc, 0, :latent], normed, atol=1e-6,
                               rtol=2e-3 if dtype == torch.float16 else 1e-6)
    untouched = torch.ones(SLOTS, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert not pool[untouched].any()


def test_absorb_query_into_an_fp8_pool(exact_fp8_casts):
    """An FP8 pool holds what `set_mla_kv` stores: the values over the layer's scale, clamped
    and rounded to e4m3."""
    gen = torch.Generator().manual_seed(9)
    rotary = RotaryEmbedding(ROPE, 64, 10000.0, None).to(DEVICE)
    norm = RMSNorm(LATENT, 1e-6).to(DEVICE)
    w_uk, _ = _kv_b(gen, torch.float32)
    q = torch.randn(3, HEADS, NOPE + ROPE, generator=gen).to(DEVICE)
    kv = (torch.randn(3, LATENT + ROPE, generator=gen) * 30).to(DEVICE)
    positions, loc = torch.tensor([0, 5, 63], device=DEVICE), torch.tensor([4, 1, 9], device=DEVICE)
    pool = torch.zeros(SLOTS, 1, LATENT + ROPE, dtype=FP8_KV_DTYPE, device=DEVICE)
    q_abs = torch.empty(3, HEADS, LATENT + ROPE, device=DEVICE)
    mla_decode.absorb_query(q, kv, w_uk, q_abs, pool, loc, positions, rotary.cos, rotary.sin,
                            norm.weight, norm.eps, True, kv_scale=0.05)
    _, latent, k_pe = _rope_norm_reference(q, kv, positions, rotary, norm, True)
    expected = to_pool(torch.cat([latent, k_pe], -1), FP8_KV_DTYPE, 0.05)
    assert torch.equal(pool[loc, 0].float(), expected.float())


@pytest.mark.parametrize("num_tokens", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_matmul_is_the_value_product(num_tokens, dtype):
    """The attention output times W_UV^T (a view of kv_b's weight) into o_proj's input, with
    dims past one K step and column tile (40 heads' worth of tiles, uneven K): torch.bmm's
    values (one rounding of each fp32 sum)."""
    gen = torch.Generator().manual_seed(num_tokens)
    latent, v_dim = 160, 40
    _, w_uv = _kv_b(gen, dtype, nope=48, v_dim=v_dim, latent=latent)
    attn = torch.randn(num_tokens, HEADS * latent, generator=gen).to(DEVICE, dtype)
    o_in = torch.empty(num_tokens, HEADS, v_dim, dtype=dtype, device=DEVICE)
    mla_decode.head_matmul(attn.view(num_tokens, HEADS, latent), w_uv, o_in)
    expected = _bmm(attn.view(num_tokens, HEADS, latent).transpose(0, 1), w_uv.transpose(1, 2), dtype)
    torch.testing.assert_close(o_in, expected.transpose(0, 1), **_matmul_tol(dtype))


def test_head_matmul_refuses_more_than_decode_rows():
    w = torch.zeros(HEADS, 16, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="rows"):
        mla_decode.head_matmul(torch.zeros(MAX_ROWS + 1, HEADS, 16, device=DEVICE), w,
                               torch.zeros(MAX_ROWS + 1, HEADS, 16, device=DEVICE))


# --- the engine through the fused path ------------------------------------------------------------
CONFIGS = {
    "v2": ("deepseek_v2", {}),
    # the fused router too, writing two shared slots a token
    "v2-greedy-routing": ("deepseek_v2", dict(group_limited=False, shared_experts=2)),
    "v3-qlora-neox": ("deepseek_v3", dict(q_lora_rank=16, rope_interleave=False, yarn=True)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return cached_checkpoints(tmp_path_factory, CONFIGS)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused MLA kernels, the fused router and the decode experts kernels (16-bit experts,
    shared slots included) allowed on CPU tensors (the interpreter runs them); returns the
    token counts of the MLA forwards, of the routings and of the expert runs that took them,
    so a test fails if none does."""
    from specserve.engine.layers.moe_decode import MAX_DECODE_TOKENS, decode_fused_experts
    from specserve.engine.models import deepseek

    mla_calls, router_calls, expert_calls = [], [], []
    monkeypatch.setattr(mla_decode, "can_fuse",
                        lambda x: 1 <= x.shape[0] <= MAX_ROWS and not mla_calls.append(x.shape[0]))

    def can_fuse_router(x, scoring, num_groups):
        fuses = scoring == "softmax" and num_groups == 1 and 1 <= x.shape[0] <= MAX_ROUTER_TOKENS
        return fuses and not router_calls.append(x.shape[0])

    monkeypatch.setattr(moe, "can_fuse_router", can_fuse_router)
    monkeypatch.setattr(moe, "_router_softmax_topk", router_softmax_topk)

    def run_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None):
        if w13_scale is not None or x.shape[0] > MAX_DECODE_TOKENS:
            return moe.run_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        expert_calls.append(x.shape[0])
        return decode_fused_experts(x, w13, w2, topk_weights, topk_ids)

    monkeypatch.setattr(deepseek, "run_experts", run_experts)
    return mla_calls, router_calls, expert_calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_through_the_fused_kernels_matches_transformers(checkpoints, make_engine,
                                                               fused_on_cpu, name):
    """Interleaved and neox rope, q LoRA, YaRN: transformers' greedy tokens with every decode
    step's MLA (its fused q/kv_a projection split into views) and experts (routed and shared
    slots) through the fused kernels, and with greedy softmax routing the fused router."""
    path = checkpoints(name)
    prompts = random_prompts(2, seed=4, max_len=12)
    engine = make_engine(path)
    outs = engine.generate(prompt_token_ids=prompts,
                           sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    mla_calls, router_calls, expert_calls = fused_on_cpu
    assert mla_calls and expert_calls and bool(router_calls) == (name == "v2-greedy-routing")
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 6)


def test_fp8_checkpoint_through_the_fused_kernels(tmp_path, make_engine, fused_on_cpu):
    """An FP8 DeepSeek checkpoint (block scales): FP8 projections, W_UK and W_UV from the
    dequantised kv_b_proj; the dequantised model's greedy tokens in transformers."""
    src = make_tiny_checkpoint(str(tmp_path / "bf16"), "deepseek_v3", seed=7, num_layers=3)
    fp8 = quantize_checkpoint(src, str(tmp_path / "fp8"), "block", (16, 16),
                              reference=str(tmp_path / "ref"))
    prompts = random_prompts(2, seed=6, max_len=12)
    outs = make_engine(fp8).generate(prompt_token_ids=prompts,
                                     sampling=SamplingParams(max_new_tokens=6, temperature=0.0,
                                                             ignore_eos=True))
    assert fused_on_cpu[0]
    assert [o.token_ids for o in outs] == hf_greedy(str(tmp_path / "ref"), prompts, 6)


def test_tree_verify_through_the_fused_kernels(tmp_path, make_engine, fused_on_cpu):
    """Speculative decoding with tree drafts (verify forwards of several tokens at tree
    positions under a custom mask) through the fused kernels: the plain engine's tokens."""
    target, draft = make_predictable_pair(str(tmp_path), arch="deepseek_v3", num_layers=3)
    prompts = random_prompts(2, seed=5, max_len=16)
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids
             for o in make_engine(target).generate(prompt_token_ids=prompts, sampling=sampling)]
    spec = make_engine(target, spec=SpecConfig(algorithm="eagle", draft_model=draft, num_steps=3,
                                               topk=2, num_draft_tokens=6))
    assert [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling=sampling)] == plain
    assert spec.metrics.mean_accept_length > 1.3  # really verifying drafts
    assert any(n > 2 for n in fused_on_cpu[0])  # a verify of several tokens a request was fused


# --- compiled for an H100 ------------------------------------------------------------------------
_COMPILE_FOR_SM90 = """
import torch
from specserve.engine.layers import mla_decode as M
from sm90_compile import compile_sm90, t

bf16, f32, i64, fp8 = torch.bfloat16, torch.float32, torch.int64, torch.float8_e4m3fn
# V2-Lite: 16 heads of 128 + 64 dims, a 512 latent, the pool's 576-dim rows.
for pool in (bf16, fp8):
    ptx = compile_sm90(M._absorb_query_kernel, dict(
        q=t(bf16), kv=t(bf16), q_out=t(bf16), pool=t(pool), loc=t(i64), positions=t(i64),
        cos=t(f32), sin=t(f32), norm_weight=t(bf16), eps=1e-6, scale_inv=1.0, w_uk=t(bf16),
        num_tokens=1, num_heads=16, n_tiles=16, stride_q_tok=3072, stride_q_head=192,
        stride_kv_tok=576, stride_qo_tok=9216, stride_qo_head=576, stride_pool_slot=576,
        stride_wh=131072, stride_wn=1, stride_wk=512, LATENT=512,
        NOPE=128, HALF=32, INTERLEAVE=True, BLOCK_LATENT=512, BLOCK_H=16, KV_FP8=pool == fp8,
        BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, DOT_PRECISION="tf32", PDL=True), 4, 3)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx and "mma" in ptx
    assert pool == bf16 or "cvt.rn.satfinite.e4m3x2.f32" in ptx
    print("compiled absorb_query", pool)
# W_UV (the latent along K contiguous).
ptx = compile_sm90(M._head_matmul_kernel, dict(
    N=128, K=512, stride_xm=8192, stride_xh=512, stride_wh=131072, stride_wn=512, stride_wk=1,
    stride_ym=2048, stride_yh=128, x=t(bf16), w=t(bf16), y=t(bf16), M=1, BLOCK_M=16,
    BLOCK_N=32, BLOCK_K=128, DOT_PRECISION="tf32", PDL=True), 4, 3)
assert "griddepcontrol.wait" in ptx and "mma" in ptx
print("compiled head_matmul w_uv")
"""


def test_kernels_compile_for_hopper():
    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 3
