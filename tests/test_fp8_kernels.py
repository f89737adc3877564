"""The FP8-weight kernels against the reference (engine/quantization/fp8.py): the skinny GEMM
reading FP8 weights with their scales (W8A16, and the W8A8 option) in its three epilogues, the
large-M W8A8 GEMM with its activation quantiser, and the fused MoE with FP8 experts.

In the interpreter on the CPU (small shapes; uneven N and K, scale blocks that are not whole
tiles): fp32 through tl.dot, and fp16 bit for bit through the multiply-and-sum path where
every sum is exact (sparse activations of powers of two), so that only the roundings are
compared: W8A16 dequantises the weight in fp32 and rounds it to the activation dtype as the
reference does. W8A8 is compared with the reference of its own quantised activations (exact
products summed in float64) and, loosely, with the unquantised reference. Marked `gpu`:
Llama-8B shapes with 128x128 blocks in bf16, in a CUDA graph too.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_skinny_gemm import (  # noqa: E402  (the 16-bit tests' q/k/v + RoPE reference)
    HEAD_DIM, KV_HEADS, Q_HEADS, SLOTS, _qkv_rope_reference)

from specserve.engine.layers.activation import silu_and_mul  # noqa: E402
from specserve.engine.layers.rotary import RotaryEmbedding  # noqa: E402
from specserve.engine.layers.skinny_gemm import (  # noqa: E402
    SkinnyConfig, SkinnyWorkspace, default_config, fp8_weight_config, skinny_gemm,
    skinny_qkv_rope, workspace_for)
from specserve.engine.quantization.fp8 import (  # noqa: E402
    FP8_DTYPE, WeightScale, dequantize, fp8_linear_reference, scale_grid_shape)
from specserve.engine.quantization.fp8_gemm import (  # noqa: E402
    ACT_GROUP, BlockScaledConfig, block_scaled_matmul, quantize_activations,
    quantize_activations_reference)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, K = 70, 200  # neither a multiple of the 32-wide test tiles nor of a 128 block
# (block_n, block_k) of the scale grid: DeepSeek's, 1x128, per-channel, per-tensor, and a
# 16x24 grid whose k-blocks are no whole number of 32- or 16-wide K steps (the per-element path).
BLOCKS = {"128x128": (128, 128), "1x128": (1, 128), "channel": (1, K), "tensor": (N, K),
          "16x24": (16, 24)}


def _workspace() -> SkinnyWorkspace:
    return SkinnyWorkspace(DEVICE, partial_capacity=1 << 16, counter_capacity=64)


def fp8_weight(n: int, k: int, block: tuple[int, int], seed: int,
               experts: tuple[int, ...] = ()) -> tuple[torch.Tensor, WeightScale]:
    """FP8 values of magnitude in [1, 2) (and zeros) and scales in [1/2, 1): the dequantised
    weight has about 11 significant bits (w8 * scale rounds in fp16) over a narrow exponent
    range, so that sums of a few of them times powers of two are exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    mag = 1 + torch.randint(0, 8, (*experts, n, k), generator=gen) / 8
    sign = torch.randint(-1, 2, (*experts, n, k), generator=gen)
    w8 = (mag * sign).to(FP8_DTYPE)
    grid = scale_grid_shape(n, k, *block)
    values = 0.5 + torch.rand((*experts, *grid), generator=gen) / 2
    return w8.to(DEVICE), WeightScale(values.to(DEVICE), *block)


def sparse_rows(m: int, k: int, dtype: torch.dtype, seed: int, per_row: int = 6) -> torch.Tensor:
    """Rows with a few entries of +-2^-1..2^-3: every sum against `fp8_weight`'s dequantised
    values is exact in fp32, in any order."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(m, k)
    for row in range(m):
        cols = torch.randperm(k, generator=gen)[:per_row]
        x[row, cols] = (2.0 ** -torch.randint(1, 4, (per_row,), generator=gen).float()
                        * (2 * torch.randint(0, 2, (per_row,), generator=gen) - 1))
    return x.to(DEVICE, dtype)


def dense_rows(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def exact_reference(x: torch.Tensor, w8: torch.Tensor, scale: WeightScale,
                    bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """The reference's weight (dequantised in fp32, rounded to x's dtype), the sum exact, the
    output rounded once; then silu_and_mul's roundings."""
    w = dequantize(w8, scale, x.dtype)
    y = F.linear(x.double(), w.double(), None if bias is None else bias.double()).to(x.dtype)
    return silu_and_mul(y) if silu else y


def w8a8_reference(x8: torch.Tensor, x_scales: torch.Tensor, w8: torch.Tensor, scale: WeightScale,
                   bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What W8A8 computes from x quantised per 128-column group (x8, x_scales): the dequantised
    activations times the dequantised weight in float64, rounded once to `dtype`."""
    x_deq = x8.double() * x_scales.double().repeat_interleave(ACT_GROUP, dim=1)[:, :x8.shape[1]]
    w = dequantize(w8, scale, torch.float64)
    return F.linear(x_deq, w, None if bias is None else bias.double()).to(dtype)


def config(block_n=32, block_k=32, split_k=1, dot=True, fp8_activations=False) -> SkinnyConfig:
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4,
                        num_stages=1, dot=dot, fp8_activations=fp8_activations)


# --- the skinny GEMM (W8A16) ----------------------------------------------------------------------

@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("split_k", [1, 3])
def test_skinny_fp8_fp32_matches_reference(block, split_k):
    """fp32 activations through tl.dot: the dequantised weight is the reference's to the bit
    (fp32 products of the same operands), the sums differ only in order."""
    w8, scale = fp8_weight(N, K, BLOCKS[block], seed=1)
    bias = dense_rows(1, N, seed=2)[0]
    ws = _workspace()
    for m in (1, 5, 16):
        x = dense_rows(m, K, seed=m)
        for b in (None, bias):
            out = skinny_gemm(x, w8, b, config=config(split_k=split_k), workspace=ws, scale=scale)
            torch.testing.assert_close(out, fp8_linear_reference(x, w8, scale, b), rtol=1e-5, atol=1e-4)
    assert not ws.arrivals.any()


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("epilogue", ["plain", "bias", "silu_mul"])
def test_skinny_fp8_fp16_rounds_as_the_reference(block, epilogue):
    """fp16 bit for bit (multiply-and-sum, exact sums): the weight dequantised in fp32 and
    rounded to fp16, the output (bias added in fp32) rounded once, SiLU-and-mul's roundings;
    split-K on and off, K steps of 32 (cut to 16 where a k-block is 48 wide: 16x24 gathers
    one scale per element)."""
    silu = epilogue == "silu_mul"
    n_rows = 2 * N if silu else N
    w8, scale = fp8_weight(n_rows, K, BLOCKS[block] if block != "tensor" else (n_rows, K), seed=3)
    bias = (torch.randint(-8, 9, (n_rows,)) / 4).to(DEVICE, torch.float16) if epilogue == "bias" else None
    for m, split_k in ((1, 1), (3, 3), (7, 1)):
        x = sparse_rows(m, K, torch.float16, seed=m)
        out = skinny_gemm(x, w8, bias, silu_mul=silu, config=config(split_k=split_k, dot=False),
                          workspace=_workspace(), scale=scale)
        assert out.dtype == torch.float16
        assert torch.equal(out, exact_reference(x, w8, scale, bias, silu))


def test_fp8_configs_take_whole_scale_blocks():
    """K steps cut to the widest power of two dividing a k-block (one scale per row a step);
    a step already inside a block, or one k-block over all of K, keeps the config's."""
    base = config(block_k=256)
    assert fp8_weight_config(base, 128, 4096).block_k == 128
    assert fp8_weight_config(base, 4096, 4096).block_k == 256      # per-channel / per-tensor
    assert fp8_weight_config(config(block_k=64), 128, 4096).block_k == 64
    assert fp8_weight_config(base, 48, 4096).block_k == 16
    assert fp8_weight_config(base, 24, 4096).block_k == 256        # 8 < 16: per-element scales
    assert fp8_weight_config(base._replace(fp8_activations=True), 4096, 4096).block_k == ACT_GROUP


def test_skinny_fp8_silu_mul_and_default_config_fp32():
    """gate/up with SiLU-and-mul under the rule's config (K split, 128x128 blocks), fp32."""
    w8, scale = fp8_weight(2 * N, 1024, (128, 128), seed=4)
    x = dense_rows(4, 1024, seed=5)
    cfg = default_config(4, N, 1024, True, DEVICE)
    assert cfg.split_k > 1
    out = skinny_gemm(x, w8, silu_mul=True, workspace=_workspace(), scale=scale)
    # Sums of 1024 terms of order 1 (results up to ~50) in two orders: fp32's 1e-6 of them.
    torch.testing.assert_close(out, silu_and_mul(fp8_linear_reference(x, w8, scale)), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("block", ["128x128", "channel", "1x128"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_skinny_w8a8_option(block, split_k):
    """`fp8_activations`: x quantised per 128-column group (two full groups and a partial one),
    FP8 products scaled per step: the product of the quantised operands within fp32 sums.
    (The interpreter rounds fp32 to FP8 wrongly near powers of two, so the quantised x is the
    kernel's own here; the quantiser is checked on its own, and against torch on a GPU.)"""
    k = 320
    w8, scale = fp8_weight(N, k, {"128x128": (128, 128), "channel": (1, k), "1x128": (1, 128)}[block], seed=6)
    ws = _workspace()
    for m in (1, 6):
        x = dense_rows(m, k, seed=10 + m)
        out = skinny_gemm(x, w8, config=config(split_k=split_k, fp8_activations=True), workspace=ws,
                          scale=scale)
        torch.testing.assert_close(out, w8a8_reference(*quantize_activations(x), w8, scale),
                                   rtol=1e-5, atol=1e-4)
    assert not ws.arrivals.any()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("block", ["128x128", "1x128", "16x24"])
def test_skinny_fp8_qkv_rope(m, split_k, block):
    """The q/k/v + RoPE + KV-store epilogue on an FP8 weight: the reference projection
    (dequantised weight), torch RoPE, k and v at their slots. fp32 through tl.dot; fp16 bit
    for bit through multiply-and-sum (exact sums); bias on for fp16."""
    n_rows = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([5, 63, 0][:m], device=DEVICE)
    loc = torch.tensor([7, 2, 11][:m], device=DEVICE)
    w8, scale = fp8_weight(n_rows, K, BLOCKS[block], seed=7)
    for dtype, dot in ((torch.float32, True), (torch.float16, False)):
        x = dense_rows(m, K, seed=m) if dtype == torch.float32 else sparse_rows(m, K, dtype, seed=m)
        b = (torch.randint(-8, 9, (n_rows,)) / 4).to(DEVICE, dtype) if dtype == torch.float16 else None
        workspace = _workspace()
        k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        q = skinny_qkv_rope(x, w8, b, Q_HEADS, KV_HEADS, positions, rotary.cos, rotary.sin, k_cache,
                            v_cache, loc, config=config(block_n=4, split_k=split_k, dot=dot),
                            workspace=workspace, scale=scale)
        expected = _qkv_rope_reference(x, dequantize(w8, scale, dtype), b, positions, rotary, loc)
        for got, want in zip((q, k_cache, v_cache), expected):
            if dtype == torch.float16:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert not workspace.arrivals.any()


def test_skinny_fp8_refuses_a_grid_that_does_not_cover_the_weight():
    w8, scale = fp8_weight(N, K, (1, 128), seed=8)
    with pytest.raises(AssertionError, match="does not cover"):
        skinny_gemm(dense_rows(1, K, seed=0), w8, scale=scale._replace(block_n=2), workspace=_workspace())
