"""The skinny GEMM (engine/layers/skinny_gemm.py) against torch: F.linear, with a bias, and
silu_and_mul(F.linear(..)) for the fused gate/up weight; split-K reduced in the kernel with its
counters left at zero. The interpreter on the CPU (small shapes; fp32 through tl.dot, whose
interpreted 16-bit dot is wrong, and fp16/bf16 through the multiply-and-sum path), then real Llama shapes
in bf16 on a GPU, in a CUDA graph too."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from helpers import hf_greedy, make_predictable_pair, make_tiny_checkpoint, random_prompts  # noqa: E402

from specserve.engine import EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from specserve.engine.layers import skinny_gemm as skinny_module  # noqa: E402
from specserve.engine.layers.activation import silu_and_mul  # noqa: E402
from specserve.engine.layers.parallel import (  # noqa: E402
    ColumnParallelLinear, RowParallelLinear, set_skinny_gemm)
from specserve.engine.layers.rotary import RotaryEmbedding  # noqa: E402
from specserve.engine.layers.skinny_gemm import (  # noqa: E402
    MAX_ROWS, PARTIAL_CAPACITY, SkinnyConfig, SkinnyWorkspace, can_fuse_qkv_rope, can_use,
    default_config, skinny_gemm, skinny_qkv_rope, workspace_for)
from specserve.engine.models.llama import MLP  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, K = 70, 200  # neither a multiple of the 32-wide test tiles


def _workspace() -> SkinnyWorkspace:
    return SkinnyWorkspace(DEVICE, partial_capacity=1 << 16, counter_capacity=64)


def _operands(m: int, n_rows: int, dtype: torch.dtype, seed: int):
    """Small integers over powers of two: every sum is exact in fp32 in any order, so the
    kernel and torch agree to the bit and only the epilogue's roundings are tested."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (m, K), generator=gen) / 8
    w = torch.randint(-4, 5, (n_rows, K), generator=gen) / 16
    b = torch.randint(-8, 9, (n_rows,), generator=gen) / 4
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _reference(x, w, b, silu: bool) -> torch.Tensor:
    """The unfused path: the GEMM summed exactly and rounded once to the activation dtype."""
    y = F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)
    return silu_and_mul(y) if silu else y


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dot", [True, False])
def test_fp32_matches_torch(m, split_k, dot):
    x, w, b = _operands(m, N, torch.float32, seed=m)
    gen = torch.Generator().manual_seed(m + 100)
    x = x + torch.randn(x.shape, generator=gen).to(DEVICE)  # also sums that do round
    config = SkinnyConfig(block_n=32, block_k=32, split_k=split_k, num_warps=4, num_stages=1, dot=dot)
    ws = _workspace()
    torch.testing.assert_close(skinny_gemm(x, w, config=config, workspace=ws), F.linear(x, w),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(skinny_gemm(x, w, b, config=config, workspace=ws), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)
    assert not ws.arrivals.any()


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_epilogue_fp32(m, split_k, bias):
    x, w, b = _operands(m, 2 * N, torch.float32, seed=7 * m)
    config = SkinnyConfig(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=1, dot=True)
    out = skinny_gemm(x, w, b if bias else None, silu_mul=True, config=config, workspace=_workspace())
    assert out.shape == (m, N)
    torch.testing.assert_close(out, _reference(x, w, b if bias else None, silu=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 7])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("epilogue", ["plain", "bias", "silu_mul"])
def test_16bit_roundings_are_the_unfused_paths(m, split_k, epilogue):
    """Bit-exact in fp16 where the sums are exact: the output, the bias add and SiLU-and-mul
    round where F.linear and silu_and_mul round (the multiply-and-sum path: the interpreter's
    16-bit tl.dot is wrong). bf16 only to a rounding: the interpreter truncates fp32 to bf16
    (a GPU rounds to nearest even; the gpu tests check bf16)."""
    silu = epilogue == "silu_mul"
    config = SkinnyConfig(block_n=32, block_k=32, split_k=split_k, num_warps=4, num_stages=1, dot=False)
    for dtype in (torch.float16, torch.bfloat16):
        x, w, b = _operands(m, 2 * N if silu else N, dtype, seed=11 * m + split_k)
        b = b if epilogue != "plain" else None
        out = skinny_gemm(x, w, b, silu_mul=silu, config=config, workspace=_workspace())
        assert out.dtype == dtype
        if dtype == torch.float16:
            assert torch.equal(out, _reference(x, w, b, silu))
        else:
            torch.testing.assert_close(out, _reference(x, w, b, silu), rtol=3e-2, atol=1e-2)  # 3 roundings


def test_split_k_leaves_counters_zero_and_repeats_exactly():
    x, w, _ = _operands(4, 2 * N, torch.float32, seed=3)
    x = x + torch.randn_like(x)
    ws = _workspace()
    config = SkinnyConfig(block_n=32, block_k=32, split_k=5, num_warps=4, num_stages=1, dot=True)
    first = skinny_gemm(x, w, silu_mul=True, config=config, workspace=ws)
    assert not ws.arrivals.any()
    second = skinny_gemm(x, w, silu_mul=True, config=config, workspace=ws)
    assert torch.equal(first, second)
    plain = skinny_gemm(x, w, config=config, workspace=ws)  # another shape in the same scratch
    torch.testing.assert_close(plain, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert not ws.arrivals.any()


def test_leading_dims_and_strided_rows():
    x, w, _ = _operands(6, N, torch.float32, seed=5)
    wide = torch.cat([x, x], dim=-1)[:, :K]  # rows with a stride of 2K
    config = SkinnyConfig(block_n=64, block_k=64, split_k=2, num_warps=4, num_stages=1, dot=True)
    out = skinny_gemm(wide.view(2, 3, K), w, config=config, workspace=_workspace())
    assert out.shape == (2, 3, N)
    torch.testing.assert_close(out, F.linear(x, w).view(2, 3, N), rtol=0, atol=0)


def test_default_configs_fill_the_machine_within_the_workspace():
    for m, n, k, silu in [(1, 6144, 4096, False), (16, 4096, 14336, False), (1, 2048, 2048, False),
                          (4, 14336, 4096, True), (16, 8192, 2048, True), (1, 70, 200, False)]:
        config = default_config(m, n, k, silu, torch.device("cpu"))
        tiles = -(-n // config.block_n)
        assert 1 <= config.split_k <= 16 and config.split_k & (config.split_k - 1) == 0
        assert config.split_k * m * n * (2 if silu else 1) <= PARTIAL_CAPACITY
        # K is split only while there are fewer programs than SMs (132 off CUDA), and never
        # below 512 of K a program.
        assert config.split_k == 1 or tiles * config.split_k // 2 < 132
        assert config.split_k == 1 or k // config.split_k >= 512
        assert (tiles * config.split_k >= 132 or k // (2 * config.split_k) < 512
                or 2 * config.split_k * m * n * (2 if silu else 1) > PARTIAL_CAPACITY)
        assert config.dot  # tl.dot measured faster than multiply-and-sum at every M
    assert default_config(1, 2048, 2048, False, torch.device("cpu")).split_k > 1  # 64 tiles alone


def test_measured_tables_override_the_rules(monkeypatch):
    tuned = SkinnyConfig(block_n=128, block_k=256, split_k=2, num_warps=8, num_stages=3, dot=False)
    cpu = torch.device("cpu")
    monkeypatch.setitem(skinny_module.TUNED_CONFIGS, (4, 2048, 8192, False), tuned)
    monkeypatch.setitem(skinny_module.SKINNY_MAX_ROWS, (2048, 8192), 4)
    default_config.cache_clear()
    try:
        assert default_config(4, 2048, 8192, False, cpu) == tuned
        assert default_config(5, 2048, 8192, False, cpu) != tuned
    finally:
        default_config.cache_clear()
    assert skinny_module.prefers_skinny(4, 2048, 8192) and not skinny_module.prefers_skinny(5, 2048, 8192)
    assert skinny_module.prefers_skinny(MAX_ROWS, 2048, 2048)
    assert not skinny_module.prefers_skinny(MAX_ROWS + 1, 2048, 2048)


def test_fp8_weights_have_their_own_measured_table(monkeypatch):
    """FP8_TUNED_CONFIGS serves FP8 weights only; a 16-bit weight of the shape keeps its own."""
    fp8_tuned = SkinnyConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=8, fp8_wide=True)
    cpu = torch.device("cpu")
    monkeypatch.setitem(skinny_module.FP8_TUNED_CONFIGS, (1, 6144, 4096, False), fp8_tuned)
    default_config.cache_clear()
    try:
        assert default_config(1, 6144, 4096, False, cpu, fp8=True) == fp8_tuned
        assert default_config(1, 6144, 4096, False, cpu) != fp8_tuned
        assert default_config(2, 6144, 4096, False, cpu, fp8=True) != fp8_tuned
    finally:
        default_config.cache_clear()


def test_bad_shapes_are_refused():
    x, w, _ = _operands(MAX_ROWS + 1, N, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="rows"):
        skinny_gemm(x, w, workspace=_workspace())
    with pytest.raises(AssertionError, match="silu_mul"):
        skinny_gemm(x[:2], w[:-1], silu_mul=True, workspace=_workspace())
    assert not can_use(x[:2].cpu(), w.cpu())  # CPU tensors keep F.linear


# The Triton compiler checks more than the interpreter (which ran the code after a constexpr
# branch's `return` only when the branch was not taken). Compiled here for an H100 without one,
# in a child process without TRITON_INTERPRET; pointers and ints marked 16-divisible as the
# launcher's specialization marks real shapes.
_COMPILE_FOR_SM90 = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.engine.layers.skinny_gemm import _Fp8Args, _skinny_gemm_kernel, default_config
import torch
cpu = torch.device("cpu")
for m, n, k, bias, silu, dtype in [(1, 14336, 4096, False, True, "bf16"), (1, 2048, 2048, False, False, "bf16"),
                                   (16, 8192, 2048, False, True, "bf16"), (4, 3072, 2048, True, False, "fp16"),
                                   (3, 2048, 8192, False, False, "fp32"), (1, 100, 200, True, False, "bf16")]:
    c = default_config(m, n, k, silu, cpu)
    sig = dict(x=f"*{dtype}", w=f"*{dtype}", bias=f"*{dtype}", y=f"*{dtype}", partials="*fp32",
               arrivals="*i32", M="i32", n_cols="i32", K="i32", k_per_split="i32", stride_xm="i32",
               stride_wn="i32", stride_ym="i32",
               fp8=_Fp8Args("*fp32", "*fp32", "i32", "i32", "i32", "i32"))
    consts = dict(BLOCK_M=max(16, triton.next_power_of_2(m)) if c.dot else triton.next_power_of_2(m),
                  BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k, HAS_BIAS=bias, SILU_MUL=silu,
                  DOT=c.dot, EVEN_K=k % c.block_k == 0, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                  FP8_WEIGHT=False, SCALE_COLS=0, FP8_ACT=False, FP8_CONVERT="cast", FP8_F16=False,
                  W_LEFT=False, PDL=True)
    names = list(sig) + list(consts)
    sig.update({name: "constexpr" for name in consts})
    aligned = [name for name in ("x", "w", "bias", "y", "partials", "arrivals", "stride_xm", "stride_wn",
                                 "stride_ym") + (("n_cols", "K", "k_per_split") if n % 16 == 0 else ())]
    src = ASTSource(fn=_skinny_gemm_kernel, signature=sig,
                    constexprs={(names.index(name),): v for name, v in consts.items()},
                    attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
    ptx = kernel.asm["ptx"]
    # programmatic dependent launch (engine/pdl.py): the wait, and the early signal after the loop
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    if n % 16 == 0:  # real shapes: 16-byte weight loads (through cp.async on the dot path;
        # tensor cores for 16-bit operands, exact fp32 runs on FMAs)
        assert ("cp.async" in ptx and ("mma" in ptx or dtype == "fp32")) if c.dot \
            else "ld.global.v4" in ptx, (m, n, k, c)
    print("compiled", m, n, k, c.split_k, c.dot)
"""


def test_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 6


# --- q/k/v projection with RoPE and the KV store in the epilogue ---------------------------------

Q_HEADS, KV_HEADS, HEAD_DIM, SLOTS = 4, 2, 16, 12


def _qkv_rope_reference(x, w, b, positions, rotary, loc):
    """The unfused path: the projection rounded once, the torch RoPE, k and v stored at loc."""
    qkv = F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)
    q, k, v = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q, k = rotary(positions, q.reshape(-1, Q_HEADS, HEAD_DIM), k.reshape(-1, KV_HEADS, HEAD_DIM))
    k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=x.dtype, device=x.device)
    v_cache = torch.zeros_like(k_cache)
    k_cache[loc], v_cache[loc] = k, v.reshape(-1, KV_HEADS, HEAD_DIM)
    return q, k_cache, v_cache


@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_rope_is_the_projection_then_rope_and_store(m, split_k, with_bias):
    """fp32 through tl.dot, fp16 bit-exact through multiply-and-sum (sums exact, as above):
    q returned rotated, k rotated and v stored at their slots, no other slot touched, the
    counters left at zero; a tile is a quarter head (block_n 4 of half 8)."""
    n_rows = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([5, 63, 0, 17, 40][:m], device=DEVICE)
    loc = torch.tensor([7, 2, 11, 0, 5][:m], device=DEVICE)
    for dtype, dot in ((torch.float32, True), (torch.float16, False)):
        x, w, b = _operands(m, n_rows, dtype, seed=5 * m + split_k)
        if dtype == torch.float32:
            x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        b = b if with_bias else None
        config = SkinnyConfig(block_n=4, block_k=32, split_k=split_k, num_warps=4, num_stages=1,
                              dot=dot)
        workspace = _workspace()
        k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        q = skinny_qkv_rope(x, w, b, Q_HEADS, KV_HEADS, positions, rotary.cos, rotary.sin,
                            k_cache, v_cache, loc, config=config, workspace=workspace)
        expected = _qkv_rope_reference(x, w, b, positions, rotary, loc)
        for got, want in zip((q, k_cache, v_cache), expected):
            if dtype == torch.float16:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not workspace.arrivals.any()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split_k", [1, 3])
def test_qkv_rope_with_qk_norm_is_the_projection_then_norms_then_rope(m, split_k):
    """Qwen3's per-head q/k RMSNorm in the epilogue: the projection rounded once, each q and k
    head normalised by torch's RMSNorm (its own weights), then RoPE and the store. fp16
    through multiply-and-sum bit-exact where the sums of squares are exact (small integers
    over powers of two), fp32 through tl.dot close; a tile is half a head (block_n 8)."""
    from specserve.engine.layers.norm import RMSNorm

    n_rows = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([5, 63, 0][:m], device=DEVICE)
    loc = torch.tensor([7, 2, 11][:m], device=DEVICE)
    gen = torch.Generator().manual_seed(m)
    for dtype, dot in ((torch.float32, True), (torch.float16, False)):
        x, w, _ = _operands(m, n_rows, dtype, seed=7 * m + split_k)
        if dtype == torch.float32:
            x = x + torch.randn(x.shape, generator=gen).to(DEVICE)
        q_norm, k_norm = RMSNorm(HEAD_DIM, 1e-6), RMSNorm(HEAD_DIM, 1e-6)
        with torch.no_grad():
            q_norm.weight.copy_(torch.randint(1, 9, (HEAD_DIM,), generator=gen) / 4)
            k_norm.weight.copy_(torch.randint(1, 9, (HEAD_DIM,), generator=gen) / 4)
        q_norm, k_norm = q_norm.to(DEVICE, dtype), k_norm.to(DEVICE, dtype)
        config = SkinnyConfig(block_n=HEAD_DIM // 2, block_k=32, split_k=split_k, num_warps=4,
                              num_stages=1, dot=dot)
        workspace = _workspace()
        k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        q = skinny_qkv_rope(x, w, None, Q_HEADS, KV_HEADS, positions, rotary.cos, rotary.sin,
                            k_cache, v_cache, loc, config=config, workspace=workspace,
                            qk_norm=(q_norm.weight, k_norm.weight, 1e-6))
        qkv = F.linear(x.double(), w.double()).to(dtype)
        q_ref, k_ref, v_ref = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q_ref = q_norm(q_ref.reshape(-1, Q_HEADS, HEAD_DIM))
        k_ref = k_norm(k_ref.reshape(-1, KV_HEADS, HEAD_DIM))
        q_ref, k_ref = rotary(positions, q_ref, k_ref)
        k_want, v_want = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        k_want[loc], v_want[loc] = k_ref, v_ref.reshape(-1, KV_HEADS, HEAD_DIM)
        for got, want in zip((q, k_cache, v_cache), (q_ref, k_want, v_want)):
            if dtype == torch.float16:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not workspace.arrivals.any()
    with pytest.raises(AssertionError, match="half a head"):
        skinny_qkv_rope(x, w, None, Q_HEADS, KV_HEADS, positions, rotary.cos, rotary.sin,
                        k_cache, v_cache, loc, config=config._replace(block_n=4),
                        workspace=workspace, qk_norm=(q_norm.weight, k_norm.weight, 1e-6))


_COMPILE_QK_NORM_FOR_SM90 = """
import torch
from specserve.engine.layers import skinny_gemm as sk
from sm90_compile import compile_sm90_kernel, t

bf16, f32, i32, i64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
# Qwen3-30B-A3B's q/k/v (32 + 2 x 4 heads of 128, hidden 2048), its tp=2 half, and K = 512
# (no split: the widest K steps and most stages the rule gives, whose shared memory must fit
# in bf16, in fp32, and with 256-dim heads).
for m, heads, kv_heads, dim, k, dtype in [(1, 32, 4, 128, 2048, bf16), (16, 16, 2, 128, 2048, bf16),
                                          (1, 32, 4, 128, 512, bf16), (1, 32, 4, 128, 512, f32),
                                          (4, 8, 2, 256, 512, bf16)]:
    c = sk._qkv_rope_config(m, (heads + 2 * kv_heads) * dim, k, dim, torch.device("cpu"), True,
                            dtype.itemsize)
    assert c.block_n == dim // 2
    kernel = compile_sm90_kernel(sk._skinny_qkv_rope_kernel, dict(
        x=t(dtype), w=t(dtype), bias=t(dtype), q_out=t(dtype), k_cache=t(dtype), v_cache=t(dtype),
        loc=t(i64), positions=t(i64), cos=t(f32), sin=t(f32), q_norm_w=t(dtype),
        k_norm_w=t(dtype), partials=t(f32), arrivals=t(i32), M=m, K=k,
        k_per_split=k // c.split_k, stride_xm=k, stride_wn=k,
        fp8=sk._Fp8Args(t(f32), t(f32), 1, 1, 1, 1), k_scale_inv=1.0, v_scale_inv=1.0,
        norm_eps=1e-6, NUM_Q_HEADS=heads, NUM_KV_HEADS=kv_heads, HALF=dim // 2, KV_FP8=False,
        QK_NORM=True, BLOCK_M=16, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
        HAS_BIAS=False, DOT=c.dot, EVEN_K=True,
        DOT_PRECISION="ieee" if dtype == f32 else "tf32", FP8_WEIGHT=False, SCALE_COLS=0,
        FP8_ACT=False, FP8_CONVERT="cast", FP8_F16=False, W_LEFT=False, PDL=True), c.num_warps,
        c.num_stages)
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ("mma" in ptx or dtype == f32) and "rsqrt" in ptx
    assert kernel.metadata.shared <= sk.SHARED_MEMORY, (m, k, dtype, c, kernel.metadata.shared)
    print("compiled", m, heads, dim, k, dtype, c.split_k, c.block_k, kernel.metadata.shared)
"""


def test_qkv_rope_with_qk_norm_compiles_for_hopper():
    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_QK_NORM_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 5, done.stdout


def test_qkv_rope_needs_whole_tiles_in_half_a_head():
    x = torch.zeros(2, 64, device=DEVICE)
    w = torch.zeros((Q_HEADS + 2 * KV_HEADS) * 6, 64, device=DEVICE)  # head_dim 6: half 3
    cache = torch.zeros(SLOTS, KV_HEADS, 6, device=DEVICE)
    with pytest.raises(AssertionError, match="half a head"):
        skinny_qkv_rope(x, w, None, Q_HEADS, KV_HEADS, torch.zeros(2, dtype=torch.long),
                        torch.zeros(8, 6), torch.zeros(8, 6), cache, cache.clone(),
                        torch.zeros(2, dtype=torch.long))
    if DEVICE.type == "cuda":
        assert not can_fuse_qkv_rope(x, w, head_dim=6)


def _greedy_with_fused_qkv_rope(make_engine, monkeypatch, model: str,
                                **engine_kwargs) -> list[list[int]]:
    """Greedy tokens of an engine whose attention layers must take the fused q/k/v + RoPE
    kernel at decode (the test fails if none does). The spy goes in before the engine is
    built: a CUDA graph captures the kernel then, and replays run no Python."""
    prompts = random_prompts(3, seed=8, max_len=12)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    calls = []
    real = ColumnParallelLinear.forward_qkv_rope
    monkeypatch.setattr(ColumnParallelLinear, "forward_qkv_rope",
                        lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    engine = make_engine(model, **engine_kwargs)
    tokens = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=sampling)]
    assert calls, "the fused q/k/v + RoPE kernel never ran"
    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_fused_qkv_rope_matches_transformers(tmp_path, make_engine, monkeypatch, arch):
    """A tiny fp32 Llama, and a Qwen3 with its per-head q/k norms (head_dim 32 both), through
    the interpreter with the skinny kernels allowed on CPU tensors: q/k/v projection, (q/k
    norm,) RoPE and the KV store in one kernel at decode, the same greedy tokens as
    transformers, every KV slot freed after (make_engine checks)."""
    model = make_tiny_checkpoint(str(tmp_path), arch, hidden_size=128, intermediate_size=128)
    monkeypatch.setattr(skinny_module, "can_use", lambda x, w, scale=None: x.numel() // w.shape[1] <= MAX_ROWS)
    prompts = random_prompts(3, seed=8, max_len=12)
    assert _greedy_with_fused_qkv_rope(make_engine, monkeypatch, model) == hf_greedy(model, prompts, 6)


@pytest.mark.parametrize("arch,options", [("deepseek_v2", dict(q_lora_rank=16, yarn=True)),
                                          ("deepseek_v3", {})])
def test_deepseek_engine_through_the_skinny_gemm_matches_transformers(tmp_path, make_engine,
                                                                      monkeypatch, arch, options):
    """DeepSeek's MLA projections (uneven widths such as the 40-wide latent+rope projection)
    and its shared-expert MLPs through the skinny kernel (the interpreter, allowed on CPU
    tensors): transformers' greedy tokens. Counts the calls, so the path is really taken."""
    model = make_tiny_checkpoint(str(tmp_path), arch, num_layers=3, seed=7, **options)
    calls = []
    real = skinny_module.skinny_gemm
    monkeypatch.setattr(skinny_module, "can_use", lambda x, w, scale=None: x.numel() // w.shape[1] <= MAX_ROWS)
    monkeypatch.setattr(skinny_module, "skinny_gemm",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = random_prompts(2, seed=6, max_len=12)
    engine = make_engine(model)
    outs = engine.generate(prompt_token_ids=prompts,
                           sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    assert calls
    assert [o.token_ids for o in outs] == hf_greedy(model, prompts, 6)


# --- the layers' dispatch ------------------------------------------------------------------------

def _linears(model):
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def test_mlp_runs_the_fused_kernel_where_the_rule_picks_it(monkeypatch):
    """The Llama MLP through the skinny kernel (allowed on CPU tensors here, so the interpreter
    runs it): gate/up with the SiLU-and-mul epilogue, then down_proj; the same as cuBLAS's path."""
    torch.manual_seed(0)
    mlp = MLP(hidden_size=64, intermediate_size=96).to(DEVICE)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 64, device=DEVICE)
    set_skinny_gemm(mlp, False)
    expected = mlp(x)
    calls = []
    real = skinny_module.skinny_gemm
    monkeypatch.setattr(skinny_module, "can_use", lambda x, w, scale=None: x.shape[0] <= MAX_ROWS)
    monkeypatch.setattr(skinny_module, "skinny_gemm",
                        lambda *a, **kw: calls.append(kw.get("silu_mul", False)) or real(*a, **kw))
    assert torch.equal(mlp(x), expected)  # the switch is off: cuBLAS's path, no kernel
    assert calls == []
    set_skinny_gemm(mlp, True)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
    assert calls == [True, False]  # gate_up + SiLU-and-mul, then down_proj


def test_engine_config_switch_reaches_every_linear_layer(tiny_model, make_engine):
    with pytest.raises(ValueError, match="^skinny_gemm: must be True or False"):
        EngineConfig(skinny_gemm="no")
    engine = make_engine(tiny_model, skinny_gemm=False)
    layers = _linears(engine.core.runner.model)
    assert len(layers) == 8 and not any(m.skinny_gemm for m in layers)  # 2 x (qkv, o, gate_up, down)


# --- GPU: real shapes in bf16 ------------------------------------------------------------------

LLAMA_SHAPES = {  # (N, K) of this rank's weight; gate_up is the fused [2I, K] weight
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192),
}


def _gpu_operands(m, n, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    return x, w


def _torch_path(x, w, b, silu):
    y = F.linear(x, w, b)
    return silu_and_mul(y) if silu else y


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(LLAMA_SHAPES))
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
def test_gpu_llama_shapes_bf16(shape, m):
    n, k = LLAMA_SHAPES[shape]
    silu = shape.endswith("gate_up")
    x, w = _gpu_operands(m, n, k, seed=m)
    b = (torch.randn(n, device="cuda") * 0.1).bfloat16() if shape.endswith("qkv") else None
    out = skinny_gemm(x, w, b, silu_mul=silu)
    # Against the fp32 GEMM rounded once (the kernel's sums differ only in order: a rounding
    # of bf16 apart at most, a few with SiLU-and-mul), and against torch's bf16 path (cuBLAS
    # may reduce split-K partials in bf16: a little more).
    exact = _reference(x, w, b, silu)
    torch.testing.assert_close(out, exact, rtol=2e-2 if silu else 1e-2, atol=1e-2)
    torch.testing.assert_close(out, _torch_path(x, w, b, silu), rtol=3e-2, atol=2e-2)
    assert torch.equal(out, skinny_gemm(x, w, b, silu_mul=silu))  # deterministic split-K


@pytest.mark.gpu
@pytest.mark.parametrize("dot", [True, False])
def test_gpu_fp32_is_exact_fp32(dot):
    x, w = _gpu_operands(4, 2048, 8192, seed=0)
    x, w = x.float(), w.float()
    config = default_config(4, 2048, 8192)._replace(dot=dot, num_warps=8)
    assert config.split_k > 1
    # fp32 sums in two orders (TF32 would be ~1e-3 off)
    torch.testing.assert_close(skinny_gemm(x, w, config=config), F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_new_inputs():
    """A graph of several skinny GEMMs sharing the device workspace (split-K on), replayed with
    new inputs: the counters are zero at every replay's start."""
    m = 4
    layers = [LLAMA_SHAPES[s] for s in ("1b.qkv", "1b.o", "1b.gate_up", "1b.down")]
    weights = [_gpu_operands(1, n, k, seed=i)[1] for i, (n, k) in enumerate(layers)]
    static_x = [torch.zeros(m, k, device="cuda", dtype=torch.bfloat16) for _, k in layers]
    silu = [False, False, True, False]

    def run():
        return [skinny_gemm(x, w, silu_mul=s) for x, w, s in zip(static_x, weights, silu)]

    assert any(default_config(m, w.shape[0], w.shape[1]).split_k > 1 for w in weights)
    run()  # compiles the kernels and makes the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    for seed in range(3):
        for i, x in enumerate(static_x):
            x.copy_(_gpu_operands(m, 1, x.shape[1], seed=100 * seed + i)[0])
        graph.replay()
        for x, w, s, out in zip(static_x, weights, silu, static_out):
            torch.testing.assert_close(out, _reference(x, w, None, s), rtol=2e-2, atol=1e-2)
            assert torch.equal(out, skinny_gemm(x, w, silu_mul=s))  # eager gives the same bits
        assert not workspace_for(static_x[0].device).arrivals.any()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_engine_greedy_same_with_and_without(tiny_model, make_engine, graphs):
    """fp32 engine on the GPU: the skinny path (exact fp32 dot) gives the greedy tokens of
    cuBLAS's path and of transformers."""
    prompts = random_prompts(6, seed=3, max_len=30)
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for skinny in (True, False):
        engine = make_engine(tiny_model, device="cuda", attention_backend="triton", cuda_graph=graphs,
                             skinny_gemm=skinny)
        assert all(m.skinny_gemm == skinny for m in _linears(engine.core.runner.model))
        outs[skinny] = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=sampling)]
    assert outs[True] == outs[False] == hf_greedy(tiny_model, prompts, sampling.max_new_tokens)


@pytest.mark.gpu
def test_gpu_spec_engine_with_skinny_matches_plain(tmp_path, make_engine):
    target, head = make_predictable_pair(str(tmp_path))
    prompts = random_prompts(6, seed=4, max_len=30)
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = make_engine(target, device="cuda", attention_backend="torch", cuda_graph=False,
                        skinny_gemm=False)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling=sampling)]
    engine = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=True,
                         spec=SpecConfig(algorithm="eagle", draft_model=head, num_steps=3, topk=1,
                                         num_draft_tokens=4))
    assert all(m.skinny_gemm for m in _linears(engine.core.draft_runner.model))
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=sampling)] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_engine_with_fused_qkv_rope_matches_transformers(tmp_path, make_engine, monkeypatch,
                                                             graphs, arch):
    """Llama with head_dim 64 (the rule's 32-column tiles in half a head), Qwen3 with head_dim
    32 and its q/k norms (16-column tiles: half a head), fp32 on the GPU, with and without
    CUDA graphs: the fused q/k/v (+ q/k norm) + RoPE + KV store kernel gives transformers'
    tokens."""
    model = make_tiny_checkpoint(str(tmp_path), arch, hidden_size=256, intermediate_size=256)
    prompts = random_prompts(3, seed=8, max_len=12)
    tokens = _greedy_with_fused_qkv_rope(make_engine, monkeypatch, model, device="cuda",
                                         attention_backend="triton", cuda_graph=graphs)
    assert tokens == hf_greedy(model, prompts, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_qkv_rope_with_qk_norm_qwen3_30b_shape_in_a_graph(m):
    """Qwen3-30B-A3B's q/k/v (32 + 2 x 4 heads of 128, hidden 2048) in bf16 with its q/k
    norms, replayed from a CUDA graph: the unfused CUDA path's q and K/V (cuBLAS, the norm
    kernels, `rope_and_store_kv`) up to the GEMM's summation order."""
    from specserve.engine.layers.norm import RMSNorm

    heads, kv_heads, dim, hidden = 32, 4, 128, 2048
    x, w = _gpu_operands(m, (heads + 2 * kv_heads) * dim, hidden, seed=m)
    q_norm, k_norm = RMSNorm(dim, 1e-6).cuda().bfloat16(), RMSNorm(dim, 1e-6).cuda().bfloat16()
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    rotary = RotaryEmbedding(dim, 4096, 1e6, None).cuda()
    positions = torch.arange(m, device="cuda") * 37 + 5
    loc = torch.randperm(64, device="cuda")[:m]
    caches = [torch.zeros(64, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    norms = (q_norm.weight, k_norm.weight, 1e-6)
    skinny_qkv_rope(x, w, None, heads, kv_heads, positions, rotary.cos, rotary.sin, caches[0],
                    caches[1], loc, qk_norm=norms)  # the workspace, before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = skinny_qkv_rope(x, w, None, heads, kv_heads, positions, rotary.cos, rotary.sin,
                            caches[0], caches[1], loc, qk_norm=norms)
    graph.replay()
    q_ref, k_ref, v_ref = F.linear(x, w).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q_ref = q_norm(q_ref.reshape(m, heads, dim))
    k_ref = k_norm(k_ref.reshape(m, kv_heads, dim))
    q_ref = rotary.rotate_and_store_kv(positions, q_ref, k_ref, v_ref.reshape(m, kv_heads, dim),
                                       caches[2], caches[3], loc)
    torch.cuda.synchronize()
    for got, want in zip((q, caches[0], caches[1]), (q_ref, caches[2], caches[3])):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert not workspace_for(x.device).arrivals.any()
