"""The FP8-weight kernels against the reference (engine/layers/fp8_weight.py): the skinny GEMM
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

from specserve.engine.layers import skinny_gemm as skinny_module  # noqa: E402
from specserve.engine.layers.activation import silu_and_mul  # noqa: E402
from specserve.engine.layers.rotary import RotaryEmbedding  # noqa: E402
from specserve.engine.layers.skinny_gemm import (  # noqa: E402
    SkinnyConfig, SkinnyWorkspace, default_config, fp8_weight_config, scale_columns, skinny_gemm,
    skinny_qkv_rope, workspace_for)
from specserve.engine.layers.fp8_weight import (  # noqa: E402
    FP8_DTYPE, WeightScale, dequantize, fp8_linear_reference, scale_grid_shape)
from specserve.engine.layers.fp8_gemm import (  # noqa: E402
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
    for m in (1, 16):
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
    for m, split_k in ((1, 1), (7, 3)):
        x = sparse_rows(m, K, torch.float16, seed=m)
        out = skinny_gemm(x, w8, bias, silu_mul=silu, config=config(split_k=split_k, dot=False),
                          workspace=_workspace(), scale=scale)
        assert out.dtype == torch.float16
        assert torch.equal(out, exact_reference(x, w8, scale, bias, silu))


def test_fp8_configs_take_whole_scale_blocks():
    """K steps cut to the widest power of two dividing a k-block (one scale per row a step);
    a step already inside a block, or one k-block over all of K, keeps the config's."""
    base = config(block_k=256)._replace(num_stages=3)
    assert fp8_weight_config(base, 128, 4096)[1:5] == (128, 1, 4, 6)  # K in flight kept: 2x stages
    assert fp8_weight_config(base, 4096, 4096).block_k == 256      # per-channel / per-tensor
    assert fp8_weight_config(config(block_k=64), 128, 4096).block_k == 64
    assert fp8_weight_config(base, 48, 4096).block_k == 16
    assert fp8_weight_config(base, 24, 4096).block_k == 256        # 8 < 16: per-element scales
    w8a8 = fp8_weight_config(base._replace(fp8_activations=True), 4096, 4096)
    assert (w8a8.block_k, w8a8.block_n) == (ACT_GROUP, 64)


def test_fp8_wide_steps_config():
    """`fp8_wide`: K steps twice the 16-bit config's, at its stages, where they lie in one
    k-block or span whole power-of-two k-blocks; else the narrow rule."""
    wide = config(block_k=256)._replace(num_stages=3, fp8_wide=True)
    assert fp8_weight_config(wide, 128, 4096)[1:5] == (512, 1, 4, 3)     # four 128-blocks a step
    assert fp8_weight_config(wide, 4096, 4096).block_k == 512            # one k-block over K
    assert fp8_weight_config(wide, 1024, 4096).block_k == 512            # inside one k-block
    assert fp8_weight_config(wide, 48, 4096).block_k == 16               # 48 is no power of two
    assert scale_columns(128, 4096, 512) == 4 and scale_columns(128, 4096, 64) == 1
    assert scale_columns(24, 4096, 32) == 0                              # per element


WIDE_BLOCKS = {"16x32": (16, 32), "1x16": (1, 16), "1x128": (1, 128), "channel": (1, K)}


@pytest.mark.parametrize("block", list(WIDE_BLOCKS))
@pytest.mark.parametrize("epilogue", ["plain", "bias", "silu_mul"])
def test_skinny_fp8_wide_steps_round_as_the_reference(block, epilogue):
    """Wide K steps (64 or 128 columns over 16- or 32-wide k-blocks: 2 to 8 scales a row a
    step, broadcast in registers) give the narrow steps' results: fp16 bit for bit through
    multiply-and-sum, fp32 through tl.dot; split-K on and off, K's tail partial."""
    silu = epilogue == "silu_mul"
    n_rows = 2 * N if silu else N
    w8, scale = fp8_weight(n_rows, K, WIDE_BLOCKS[block], seed=13)
    for dtype, dot in ((torch.float16, False), (torch.float32, True)):
        bias = (torch.randint(-8, 9, (n_rows,)) / 4).to(DEVICE, dtype) if epilogue == "bias" else None
        for m, split_k, block_k in ((1, 1, 32), (5, 2, 64)):
            cfg = config(block_k=block_k, split_k=split_k, dot=dot)._replace(fp8_wide=True)
            assert fp8_weight_config(cfg, scale.block_k, K).block_k == 2 * block_k
            x = sparse_rows(m, K, dtype, seed=m) if dtype == torch.float16 else dense_rows(m, K, seed=m)
            out = skinny_gemm(x, w8, bias, silu_mul=silu, config=cfg, workspace=_workspace(), scale=scale)
            if dtype == torch.float16:
                assert torch.equal(out, exact_reference(x, w8, scale, bias, silu))
            else:
                ref = fp8_linear_reference(x, w8, scale, bias)
                torch.testing.assert_close(out, silu_and_mul(ref) if silu else ref, rtol=1e-5, atol=1e-4)


def test_skinny_fp8_qkv_rope_wide_steps():
    """The q/k/v + RoPE epilogue with wide K steps over 16x32 blocks (fp16, bit for bit)."""
    n_rows = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(DEVICE)
    positions, loc = torch.tensor([5, 63], device=DEVICE), torch.tensor([7, 2], device=DEVICE)
    w8, scale = fp8_weight(n_rows, K, (16, 32), seed=14)
    x = sparse_rows(2, K, torch.float16, seed=2)
    k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    cfg = config(block_n=4, block_k=32, split_k=2, dot=False)._replace(fp8_wide=True)
    q = skinny_qkv_rope(x, w8, None, Q_HEADS, KV_HEADS, positions, rotary.cos, rotary.sin, k_cache,
                        v_cache, loc, config=cfg, workspace=_workspace(), scale=scale)
    expected = _qkv_rope_reference(x, dequantize(w8, scale, torch.float16), None, positions, rotary, loc)
    for got, want in zip((q, k_cache, v_cache), expected):
        assert torch.equal(got, want)


# --- fp16 products (`fp8_f16`) and the weight on the left of tl.dot (`w_left`) -----------------

def exact_product(x: torch.Tensor, w8: torch.Tensor, scale: WeightScale,
                  bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """x times the FP8 weight times its scales exactly (float64, no rounding of the dequantised
    weight), rounded once to x's dtype; then silu_and_mul's roundings: what fp16 products
    compute, up to their fp32 sums."""
    w = dequantize(w8, scale, torch.float64)
    y = F.linear(x.double(), w, None if bias is None else bias.double()).to(x.dtype)
    return silu_and_mul(y) if silu else y


def assert_rows_close(out: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """|out - expected| within rtol of each element, or of 2^-10 of its row's largest (sums
    near zero cancel: their relative error is fp32's relative to the terms)."""
    out, expected = out.double(), expected.double()
    scale = expected.abs() + expected.abs().amax(dim=-1, keepdim=True) * 2 ** -10
    assert torch.isfinite(out).all()
    assert ((out - expected).abs() <= rtol * scale).all(), float(((out - expected).abs() / scale).max())


F16_BLOCKS = {"128x128": (128, 128), "1x128": (1, 128), "16x32": (16, 32), "channel": (1, K),
              "tensor": (N, K)}
# Row magnitudes 2^-14 to 2^8 in fp16 (2^-14 rows are partly subnormal there) and 2^-30 to
# 2^20 in bf16 (beyond fp16's range both ways): each row's own power of two keeps it exact.
ROW_SCALES = {torch.float16: (1.0, 2.0 ** -14, 2.0 ** 8, 2.0 ** -3, 4.0),
              torch.bfloat16: (1.0, 2.0 ** -30, 2.0 ** 20, 2.0 ** -3, 2.0 ** 12)}


def wide_range_rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    scales = torch.tensor(ROW_SCALES[dtype][:m])[:, None]
    return (dense_rows(m, k, seed).cpu() * scales).to(DEVICE, dtype)


# Every scale block with the paired SiLU epilogue (the scales' widest use), either operand on the
# left; the plain and bias epilogues once each side (the full product ran 30 cases, 24 s of CI).
F16_CASES = ([(block, "silu_mul", w_left) for block in F16_BLOCKS for w_left in (False, True)]
             + [("128x128", "plain", False), ("1x128", "bias", True)])


@pytest.mark.parametrize("block,epilogue,w_left", F16_CASES)
def test_skinny_fp8_f16_products(block, epilogue, w_left):
    """`fp8_f16`: the exact product of x and the scaled FP8 weight, rounded once (not the
    reference's rounding of the weight to x's dtype), for rows whose magnitudes lie 2^22
    (fp16) and 2^50 (bf16) apart; fp16 within an ulp where fp32's sums meet a rounding tie,
    bf16 within the interpreter's truncations (an ulp each); split-K on and off, K's tail partial
    (200 = 6 steps of 32 and 8), either operand on the left."""
    silu = epilogue == "silu_mul"
    n_rows = 2 * N if silu else N
    w8, scale = fp8_weight(n_rows, K, F16_BLOCKS[block] if block != "tensor" else (n_rows, K), seed=21)
    # bf16: an ulp a rounding the interpreter truncates (SiLU-and-mul's four: 4 ulps)
    for dtype, rtol in ((torch.float16, 2 ** -10), (torch.bfloat16, 2 ** -7 * (4 if silu else 1))):
        bias = (torch.randint(-8, 9, (n_rows,)) / 4).to(DEVICE, dtype) if epilogue == "bias" else None
        for m, split_k in ((1, 1), (5, 3)):
            x = wide_range_rows(m, K, dtype, seed=30 + m)
            if silu and dtype == torch.float16:
                x = x * 2 ** -8  # gate times up within fp16's range
            cfg = config(block_n=16, split_k=split_k)._replace(fp8_f16=True, w_left=w_left)
            assert fp8_weight_config(cfg, scale.block_k, K).fp8_f16
            ws = _workspace()
            out = skinny_gemm(x, w8, bias, silu_mul=silu, config=cfg, workspace=ws, scale=scale)
            assert out.dtype == dtype and not ws.arrivals.any()
            assert_rows_close(out, exact_product(x, w8, scale, bias, silu), rtol)


def test_fp8_f16_configs():
    """fp16 products need K steps inside one k-block (a 16x24 grid's k-blocks are no whole
    number of steps: dropped, the dequantising path runs), take precedence over wide steps,
    give way to FP8 activations, and keep fp32 activations on the dequantising path; without
    tl.dot they are refused."""
    f16 = config(block_k=32)._replace(fp8_f16=True)
    assert not fp8_weight_config(f16, 24, K).fp8_f16
    assert fp8_weight_config(f16, 16, K).fp8_f16 and fp8_weight_config(f16, K, K).fp8_f16
    wide = config(block_k=256)._replace(num_stages=3, fp8_wide=True, fp8_f16=True)
    assert fp8_weight_config(wide, 128, 4096).block_k == 128  # one k-block a step, not 512
    assert not fp8_weight_config(f16._replace(fp8_activations=True), 128, K).fp8_f16  # W8A8's own
    plain = config(block_k=32)
    for grid, x in (((16, 24), wide_range_rows(2, K, torch.float16, seed=1)),
                    ((1, 128), dense_rows(3, K, seed=2))):  # fp32 activations
        w8, scale = fp8_weight(N, K, grid, seed=22)
        assert torch.equal(skinny_gemm(x, w8, config=f16, workspace=_workspace(), scale=scale),
                           skinny_gemm(x, w8, config=plain, workspace=_workspace(), scale=scale))
    w8, scale = fp8_weight(N, K, (1, 128), seed=22)
    with pytest.raises(AssertionError, match="fp16 products need tl.dot"):
        skinny_gemm(dense_rows(1, K, seed=3).half(), w8, config=f16._replace(dot=False),
                    workspace=_workspace(), scale=scale)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_skinny_fp8_weight_on_the_left_rounds_as_the_reference(block):
    """`w_left` (W x^T on tl.dot) on the dequantising path: fp16 bit for bit (exact sums:
    the interpreter's fp16 dot sums in fp32), with SiLU-and-mul and split-K too; a 16-bit
    weight in fp32 as F.linear."""
    for silu, m, split_k in ((False, 1, 1), (True, 5, 3)):
        n_rows = 2 * N if silu else N
        w8, scale = fp8_weight(n_rows, K, BLOCKS[block] if block != "tensor" else (n_rows, K), seed=23)
        x = sparse_rows(m, K, torch.float16, seed=m)
        cfg = config(block_n=16, split_k=split_k)._replace(w_left=True)
        out = skinny_gemm(x, w8, silu_mul=silu, config=cfg, workspace=_workspace(), scale=scale)
        assert torch.equal(out, exact_reference(x, w8, scale, silu=silu))
    w, x = dense_rows(N, K, seed=4), dense_rows(3, K, seed=5)
    out = skinny_gemm(x, w, config=config(block_n=16)._replace(w_left=True), workspace=_workspace())
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("w_left", [False, True])
def test_skinny_fp8_qkv_rope_f16_products(w_left):
    """The q/k/v + RoPE + KV-store epilogue on fp16 products (its tiles transposed with the
    weight on the left): the exact projection, torch RoPE (fp16: an ulp or two of RoPE's
    sums of products), k and v at their slots, split-K on."""
    n_rows = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(DEVICE)
    positions, loc = torch.tensor([5, 63, 0], device=DEVICE), torch.tensor([7, 2, 11], device=DEVICE)
    w8, scale = fp8_weight(n_rows, K, (1, 128), seed=24)
    x = wide_range_rows(5, K, torch.float16, seed=25)[[0, 3, 4]]  # outputs within fp16's range
    k_cache = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    cfg = config(block_n=8, split_k=2)._replace(fp8_f16=True, w_left=w_left)
    q = skinny_qkv_rope(x, w8, None, Q_HEADS, KV_HEADS, positions, rotary.cos, rotary.sin, k_cache,
                        v_cache, loc, config=cfg, workspace=_workspace(), scale=scale)
    expected = _qkv_rope_reference(x, dequantize(w8, scale, torch.float64), None, positions, rotary, loc)
    for got, want in zip((q, k_cache, v_cache), expected):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))


def test_fp8_f16_rule(monkeypatch):
    """`FP8_F16_PRODUCTS` makes `fp8_f16_config` the FP8 weights' rule (the q/k/v + RoPE
    projection's too, its tiles within half a head; with the q/k norm exactly half a head):
    128 weight rows a program on the left, K split over them; 16-bit weights keep theirs.
    The rule's default launch computes the exact product."""
    cpu = torch.device("cpu")
    sixteen = default_config(1, 4096, 4096, False, cpu)
    monkeypatch.setattr(skinny_module, "FP8_F16_PRODUCTS", True)
    default_config.cache_clear()
    skinny_module._qkv_rope_config.cache_clear()
    try:
        o = default_config(1, 4096, 4096, False, cpu, fp8=True)
        assert o == skinny_module.fp8_f16_config(1, 4096, 4096, False, cpu)
        assert (o.block_n, o.block_k, o.split_k, o.fp8_f16, o.w_left) == (128, 128, 8, True, True)
        gate_up = default_config(1, 14336, 4096, True, cpu, fp8=True)
        assert (gate_up.block_n, gate_up.split_k, gate_up.fp8_f16) == (64, 1, True)
        assert default_config(1, 4096, 4096, False, cpu) == sixteen
        qkv = skinny_module._qkv_rope_config(1, 6144, 4096, 128, cpu, fp8=True)
        assert (qkv.block_n, qkv.fp8_f16, qkv.w_left) == (64, True, True)
        normed = skinny_module._qkv_rope_config(1, 5120, 2048, 128, cpu, True, fp8=True)
        assert (normed.block_n, normed.fp8_f16) == (64, True)
        assert not skinny_module._qkv_rope_config(1, 6144, 4096, 128, cpu).fp8_f16
        w8, scale = fp8_weight(N, 256, (128, 128), seed=26)
        x = wide_range_rows(2, 256, torch.float16, seed=27)
        assert_rows_close(skinny_gemm(x, w8, workspace=_workspace(), scale=scale),
                          exact_product(x, w8, scale), 2 ** -10)
    finally:
        default_config.cache_clear()
        skinny_module._qkv_rope_config.cache_clear()


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


@pytest.mark.parametrize("m,split_k", [(1, 1), (3, 3)])
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


def test_fp8_layers_take_the_skinny_kernels(monkeypatch):
    """FP8 ColumnParallelLinear/RowParallelLinear layers (with `Fp8LinearMethod`) through the skinny
    kernels (allowed on CPU tensors here): forward, gate/up with SiLU-and-mul, and the fused
    q/k/v + RoPE + KV store, each the reference's result; the kernels really run."""
    from specserve.engine.layers import linear_method
    from specserve.engine.layers.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear
    from specserve.engine.quantization.fp8 import Fp8LinearMethod

    calls = []
    real_gemm, real_qkv = skinny_module.skinny_gemm, skinny_module.skinny_qkv_rope
    monkeypatch.setattr(skinny_module, "can_use",
                        lambda x, w, scale=None: x.numel() // w.shape[1] <= skinny_module.MAX_ROWS)
    monkeypatch.setattr(skinny_module, "skinny_gemm",
                        lambda *a, **kw: calls.append(("gemm", kw["scale"] is not None)) or real_gemm(*a, **kw))
    monkeypatch.setattr(linear_method, "skinny_qkv_rope",  # (imported there by name)
                        lambda *a, **kw: calls.append(("qkv", kw["scale"] is not None)) or real_qkv(*a, **kw))

    def fp8_layer(layer, block, seed):
        layer.use_method(Fp8LinearMethod(block))
        w8, scale = fp8_weight(*layer.weight.shape, block, seed=seed)
        layer.weight.data.copy_(w8)
        layer.weight_scale.data.copy_(scale.values)
        return layer.to(DEVICE)

    x = dense_rows(3, 64, seed=20)
    up = fp8_layer(ColumnParallelLinear(64, [(0, 48), (48, 96)], bias=False), (16, 32), seed=21)
    down = fp8_layer(RowParallelLinear(48, 64, SINGLE), (1, 48), seed=22)
    torch.testing.assert_close(up(x), fp8_linear_reference(x, up.weight, up.scale), rtol=1e-5, atol=1e-4)
    hidden = up.forward_silu_and_mul(x)
    torch.testing.assert_close(hidden, silu_and_mul(fp8_linear_reference(x, up.weight, up.scale)),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(down(hidden), fp8_linear_reference(hidden, down.weight, down.scale),
                               rtol=1e-5, atol=1e-4)

    head_dim = 32  # 2 q heads, 1 KV head: half a head is a whole 16-column tile
    qkv = fp8_layer(ColumnParallelLinear(64, [(0, 64), (64, 96), (96, 128)], bias=False), (128, 128), seed=23)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)
    positions, loc = torch.tensor([3, 9, 60], device=DEVICE), torch.tensor([4, 0, 7], device=DEVICE)
    assert qkv.fuses_qkv_rope(x, head_dim)
    k_cache = torch.zeros(8, 1, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = qkv.forward_qkv_rope(x, 2, 1, rotary, positions, k_cache, v_cache, loc)
    ref = fp8_linear_reference(x, qkv.weight, qkv.scale)
    ref_q, ref_k = rotary(positions, ref[:, :64].reshape(3, 2, head_dim), ref[:, 64:96].reshape(3, 1, head_dim))
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(k_cache[loc], ref_k, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(v_cache[loc], ref[:, 96:].reshape(3, 1, head_dim), rtol=1e-5, atol=1e-4)
    assert calls == [("gemm", True)] * 3 + [("qkv", True)]


# --- activation quantiser and the large-M W8A8 GEMM ---------------------------------------------

def test_activation_quantiser_matches_torch():
    """Per token per 128-column group (a partial last group, an all-zero group): scales to the
    bit; the FP8 values to the bit where they are exact (x = e4m3 values times a power of two,
    the group's largest 448 times it). Random inputs are checked on a GPU (the interpreter
    rounds fp32 to FP8 wrongly near powers of two)."""
    gen = torch.Generator().manual_seed(9)
    k = 300
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = dense_rows(5, k, seed=3).to(dtype)
        x[2, 128:256] = 0
        x8, scales = quantize_activations(x)
        ref8, ref_scales = quantize_activations_reference(x)
        assert x8.shape == (5, k) and x8.dtype == FP8_DTYPE and scales.shape == (5, 3)
        assert torch.equal(scales, ref_scales)
        assert not x8[2, 128:256].float().any()
        values = (torch.randn(5, k, generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE).float()
        values[:, ::ACT_GROUP] = 448.0  # every group's largest: the scale is a power of two
        exact = (values * 2.0 ** -torch.randint(-4, 5, (5, 1), generator=gen)).to(DEVICE, dtype)
        x8, scales = quantize_activations(exact)
        assert torch.equal(x8.float(), quantize_activations_reference(exact)[0].float())
        assert torch.equal(x8.float() * scales.repeat_interleave(ACT_GROUP, 1)[:, :k], exact.float())


SMALL_SCALED = BlockScaledConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, group_m=2)


@pytest.mark.parametrize("block", ["128x128", "1x128", "channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_scaled_matmul_matches_quantised_reference(block, dtype):
    """M, N, K no multiples of the tiles (masked tails, the row-tile groups' ragged end), with a
    bias: the product of the quantised operands in float64, within fp32 sums (fp16: within
    one rounding of the output)."""
    m = 37
    w8, scale = fp8_weight(N, K, BLOCKS[block], seed=11)
    x = dense_rows(m, K, seed=12).to(dtype)
    bias = dense_rows(1, N, seed=13)[0].to(dtype)
    out = block_scaled_matmul(x, w8, scale, bias, config=SMALL_SCALED)
    assert out.dtype == dtype and out.shape == (m, N)
    expected = w8a8_reference(*quantize_activations(x), w8, scale, bias, dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, expected, **tol)
    assert block_scaled_matmul(x[:0], w8, scale, config=SMALL_SCALED).shape == (0, N)


def test_block_scaled_matmul_refuses_steps_across_k_blocks():
    w8, scale = fp8_weight(N, K, (16, 24), seed=14)
    with pytest.raises(AssertionError, match="k-block"):
        block_scaled_matmul(dense_rows(2, K, seed=0), w8, scale, config=SMALL_SCALED)


# --- fused MoE with FP8 experts ---------------------------------------------------------------------

def _moe_case(case: str, num_experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) for 9 tokens, top-2."""
    if case == "random":
        ids = torch.rand(9, num_experts, generator=gen).topk(2, dim=1).indices
    elif case == "one_expert":  # every token's first choice is expert 1; 3 experts get nothing
        ids = torch.stack([torch.full((9,), 1), torch.tensor([0, 2] * 4 + [0])], dim=1)
    else:  # "repeats": a token picking one expert twice, the rest on two experts
        ids = torch.tensor([[3, 3]] + [[0, 3]] * 8)
    return torch.rand(9, 2, generator=gen).softmax(-1).to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("case", ["random", "one_expert", "repeats"])
@pytest.mark.parametrize("block", [(128, 128), (16, 24), (1, 128)])
def test_fused_moe_fp8_matches_torch_path(case, block):
    """The Triton grouped GEMM with FP8 experts against the torch path with the same scales
    (fp32): hidden 40, intermediate 24 (16-wide tiles; a 16-row scale block spans the gate/up
    boundary), 16x24 blocks gather one scale per element."""
    from specserve.engine.layers.fused_moe_triton import MoEConfig, fused_experts
    from specserve.engine.layers.moe import fused_experts as torch_fused_experts

    num_experts, hidden, inter = 6, 40, 24
    gen = torch.Generator().manual_seed(15)
    w13, w13_scale = fp8_weight(2 * inter, hidden, block, seed=16, experts=(num_experts,))
    w2, w2_scale = fp8_weight(hidden, inter, block, seed=17, experts=(num_experts,))
    x = dense_rows(9, hidden, seed=18)
    topk_weights, topk_ids = _moe_case(case, num_experts, gen)
    small = MoEConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, small, w13_scale=w13_scale, w2_scale=w2_scale)
    expected = torch_fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    # The same dequantised weights; fp32 sums in other orders and another sigmoid: errors of
    # fp32's order relative to the terms' size (outputs up to ~1e3), not to a cancelled sum.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


# --- compiled for Hopper (no GPU needed) -----------------------------------------------------------

# What the interpreter cannot show: that Triton compiles the FP8 paths for an H100 (FP8
# conversions, FP8 tensor-core products). Each kernel is compiled in a child process without
# TRITON_INTERPRET from its real launch arguments (every parameter by name; pointers, and ints
# that are multiples of 16, marked 16-divisible as the launcher marks real shapes).
_COMPILE_FP8_FOR_SM90 = """
import torch
from specserve.engine.layers import fused_moe_triton as moe, skinny_gemm as sk
from specserve.engine.layers import fp8_gemm as q
from specserve.engine.layers.fp8_weight import FP8_DTYPE
from sm90_compile import compile_sm90, compile_sm90_kernel, t

bf16, f32, i32, fp8 = torch.bfloat16, torch.float32, torch.int32, FP8_DTYPE
cpu = torch.device("cpu")

def skinny(m, n_rows, k, silu, act, uniform, qkv=False, qk_norm=False, wide=False, convert="bits",
           dot=True, f16=False, **fields):
    n_cols = n_rows // 2 if silu or qkv else n_rows
    if f16:  # fp16 products: the rule's tiles (64 columns of each half of a pair)
        c = sk.fp8_f16_config(m, n_cols, k, silu or qkv, cpu, 64 if qkv else 0)._replace(**fields)
    else:
        c = (sk._qkv_rope_config(m, n_rows, k, 128, cpu, qk_norm) if qkv
             else sk.default_config(m, n_cols, k, silu, cpu))._replace(fp8_activations=act, fp8_wide=wide,
                                                                       **fields)
    c = sk.fp8_weight_config(c, 128 if uniform else 24, k)
    x = t(fp8 if act else bf16)
    fp8_args = sk._Fp8Args(t(f32), t(f32), k // 128, k // 128, 128, 128 if uniform else 24)
    args = dict(x=x, w=t(fp8), bias=t(bf16), y=t(bf16), q_out=t(bf16), k_cache=t(bf16), v_cache=t(bf16),
                loc=t(torch.int64), positions=t(torch.int64), cos=t(f32), sin=t(f32),
                q_norm_w=t(bf16), k_norm_w=t(bf16), norm_eps=1e-6, QK_NORM=qk_norm, partials=t(f32),
                arrivals=t(i32), M=m, n_cols=n_cols, K=k, k_per_split=k // c.split_k, stride_xm=k,
                stride_wn=k, stride_ym=n_cols, fp8=fp8_args, BLOCK_M=16 if dot else 1,
                BLOCK_N=c.block_n, BLOCK_K=c.block_k if dot else 32, SPLIT_K=c.split_k,
                HAS_BIAS=False, SILU_MUL=silu, DOT=dot,
                EVEN_K=k % c.block_k == 0, DOT_PRECISION="tf32", FP8_WEIGHT=True,
                SCALE_COLS=sk.scale_columns(128 if uniform else 24, k, c.block_k),
                FP8_ACT=act, FP8_CONVERT=convert, FP8_F16=c.fp8_f16, W_LEFT=c.w_left, PDL=True,
                NUM_Q_HEADS=32, NUM_KV_HEADS=8, HALF=64, k_scale_inv=1.0, v_scale_inv=1.0, KV_FP8=False)
    kernel = sk._skinny_qkv_rope_kernel if qkv else sk._skinny_gemm_kernel
    compiled = compile_sm90_kernel(kernel, args, c.num_warps, c.num_stages)
    assert compiled.metadata.shared <= 232448, ("shared memory over an H100's", c)
    return compiled.asm["ptx"]

def check(name, ptx, *needles, absent=()):
    assert "griddepcontrol.wait" in ptx or name.startswith("moe"), name
    for needle in needles:
        assert needle in ptx, (name, needle)
    for needle in absent:
        assert needle not in ptx, (name, needle)
    print("compiled", name)

# W8A16, bf16 tensor cores. "bits" (the sm_90 default): e4m3 -> bf16 by byte moves and a bf16x2
# multiply, none of Triton's e4m3 -> f16 -> f32 conversions (per-row scales, then per-element)
CAST = ("cvt.rn.f16x2.e4m3x2", "cvt.f32.f16")
check("w8a16 gate_up", skinny(1, 28672, 4096, True, False, True), "mul.rn.bf16x2", "mma", absent=CAST)
check("w8a16 per-element", skinny(16, 6144, 4096, False, False, False), "mul.rn.bf16x2", "mma",
      absent=CAST)
check("w8a16 qkv_rope", skinny(1, 6144, 4096, False, False, True, qkv=True), "mul.rn.bf16x2", "mma",
      absent=CAST)
check("w8a16 gate_up cast", skinny(1, 28672, 4096, True, False, True, convert="cast"), *CAST, "mma",
      absent=("mul.rn.bf16x2",))
# Wide steps: 512 FP8 columns a step over four 128-column k-blocks (scales broadcast)
check("w8a16 wide gate_up", skinny(1, 28672, 4096, True, False, True, wide=True), "mul.rn.bf16x2",
      "mma", absent=CAST)
check("w8a16 wide down", skinny(16, 4096, 14336, False, False, True, wide=True), "mul.rn.bf16x2",
      "mma", absent=CAST)
# Qwen3-30B-A3B's q/k/v (32 + 2 x 4 heads of 128) with its per-head q/k norm
check("w8a16 qkv_rope qk_norm", skinny(1, 5120, 2048, False, False, True, qkv=True, qk_norm=True),
      "mul.rn.bf16x2", "mma", "rsqrt", absent=CAST)
# Multiply-and-sum (no dot): with "bits" the products are rounded to bf16 by integer operations
# and summed as they are, so no weight is converted to bf16 pairs (cast's rounding) and back
# (the epilogue's M = 1 rounds its one row with unpaired conversions).
down = dict(m=1, n_rows=4096, k=14336, silu=False, act=False, uniform=True, dot=False)
assert "cvt.rn.bf16x2.f32" in skinny(**down, convert="cast")
check("w8a16 multiply-and-sum", skinny(**down), "mul.rn.bf16x2",
      absent=CAST + ("cvt.rn.bf16x2.f32",))
# fp16 products: e4m3 -> fp16 by the conversion pipe, never widened to fp32; the weight on the
# left of wgmma (f16 operands), or x on the left (mma.sync)
F16 = ("cvt.rn.f16x2.e4m3x2", "wgmma", ".f32.f16.f16")
WIDENED = ("cvt.f32.f16", "mul.rn.bf16x2")
check("w8a16 f16 o", skinny(1, 4096, 4096, False, False, True, f16=True), *F16, absent=WIDENED)
check("w8a16 f16 gate_up", skinny(16, 28672, 4096, True, False, True, f16=True), *F16, absent=WIDENED)
check("w8a16 f16 o 256 rows 8 warps", skinny(16, 4096, 4096, False, False, True, f16=True, block_n=256,
                                            num_warps=8), *F16, absent=WIDENED)
check("w8a16 f16 down 8 warps 6 stages", skinny(4, 4096, 14336, False, False, True, f16=True,
                                                num_warps=8, num_stages=6), *F16, absent=WIDENED)
check("w8a16 f16 qkv_rope", skinny(1, 6144, 4096, False, False, True, qkv=True, f16=True), *F16,
      absent=WIDENED)
check("w8a16 f16 qkv_rope qk_norm", skinny(1, 5120, 2048, False, False, True, qkv=True, qk_norm=True,
                                           f16=True), *F16, "rsqrt", absent=WIDENED)
check("w8a16 f16 x left", skinny(16, 4096, 4096, False, False, True, f16=True, block_n=64,
                                 w_left=False), "cvt.rn.f16x2.e4m3x2", "mma.sync", ".f32.f16.f16",
      absent=WIDENED + ("wgmma",))
# The dequantising path with the weight on the left: wgmma on bf16 ("bits")
check("w8a16 w_left", skinny(1, 4096, 4096, False, False, True, block_n=128, w_left=True),
      "mul.rn.bf16x2", "wgmma", absent=CAST)
# W8A8: FP8 tensor-core products
check("w8a8 skinny", skinny(4, 6144, 4096, False, True, True), "wgmma", "e4m3.e4m3")
for m in (64, 4096):
    c = q.default_block_scaled_config(m)
    ptx = compile_sm90(q._block_scaled_gemm_kernel, dict(
        x8=t(fp8), x_scales=t(f32), w=t(fp8), w_scale=t(f32), bias=t(bf16), y=t(bf16), M=m, N=4096,
        K=14336, stride_xm=14336, stride_xsm=112, stride_wn=14336, stride_wsn=112, scale_block_n=128,
        scale_block_k=128, HAS_BIAS=False, EVEN_K=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, GROUP_M=c.group_m, PDL=True), c.num_warps, c.num_stages)
    check(f"block-scaled m={m}", ptx, "wgmma", "e4m3.e4m3")
check("quantiser", compile_sm90(q._quantize_groups_kernel, dict(
    x=t(bf16), x8=t(fp8), scales=t(f32), K=4096, num_groups=32, stride_xm=4096, stride_sm=32,
    stride_sg=1, GROUP=128,
    GROUPS_PER_PROGRAM=8, MIN_AMAX=1e-12, FP8_MAX_VALUE=448.0, PDL=True), 4, 1), "div.rn.f32")
c = moe.MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
check("moe gated w8a16", compile_sm90(moe._grouped_gemm_kernel, dict(
    a=t(bf16), w=t(fp8), out=t(bf16), sorted_entries=t(i32), block_experts=t(i32), num_padded=t(i32),
    topk_weights=t(f32), num_entries=64, N=2048, K=7168, stride_a_row=7168, stride_w_expert=4096 * 7168,
    stride_w_n=7168, stride_w_k=1, stride_out_row=2048,
    fp8=moe._ExpertScales(t(f32), 32 * 56, 56, 128, 128), ENTRIES_PER_A_ROW=8, GATED=True,
    WEIGHTED=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32", FP8_WEIGHT=True,
    K_UNIFORM=True), c.num_warps, c.num_stages), "e4m3", "mma")
"""


def test_fp8_kernels_compile_for_hopper():
    import subprocess
    import sys

    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_FP8_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 21


# The loop an H100 runs (tests/sm90_sass.py: the compiled loop's SASS, counted): fp16 products
# with the weight on the left take under 0.6 of the dequantising loop's instructions a weight
# (0.44 at o_proj), never widen the weight to fp32 nor pack it to bf16, and run on wgmma.
_COUNT_FP8_LOOPS = """
import torch
from specserve.engine.layers import skinny_gemm as sk
from sm90_sass import loop_opcodes, per_weight, skinny_fp8_launch

cpu = torch.device("cpu")
for name, (n, k, silu) in {"o": (4096, 4096, False), "gate_up": (28672, 4096, True)}.items():
    n_cols = n // 2 if silu else n
    dequantising = sk.default_config(1, n_cols, k, silu, cpu)._replace(fp8_wide=False)
    (old, old_c), (new, new_c) = (skinny_fp8_launch(1, n, k, silu, c)
                                  for c in (dequantising, sk.fp8_f16_config(1, n_cols, k, silu, cpu)))
    old_ops, new_ops = loop_opcodes(old), loop_opcodes(new)
    ratio = per_weight(new_ops, new_c, silu) / per_weight(old_ops, old_c, silu)
    assert ratio < 0.6, (name, ratio)
    assert old_ops["HADD2.F32"] and not new_ops["HADD2.F32"] and not new_ops["F2FP.BF16.F32.PACK_AB"]
    assert any(op.startswith("HGMMA") for op in new_ops), new_ops
    print("counted", name, round(ratio, 2))
"""


def test_fp16_products_take_under_0_6_of_the_loop_instructions():
    import subprocess
    import sys

    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COUNT_FP8_LOOPS], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("counted") == 2


# --- GPU: real shapes in bf16, 128x128 blocks --------------------------------------------------------

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def quantize_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, WeightScale]:
    """A checkpoint's FP8 form of w [..., N, K]: per (block_n, block_k) block, scale = amax / 448."""
    from specserve.engine.layers.fp8_weight import expand_scale

    n, k = w.shape[-2:]
    gn, gk = scale_grid_shape(n, k, *block)
    padded = F.pad(w.float(), (0, gk * block[1] - k, 0, gn * block[0] - n))
    blocks = padded.view(*w.shape[:-2], gn, block[0], gk, block[1])
    scale = WeightScale(blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448, *block)
    w8 = (w.float() / expand_scale(scale, n, k)).clamp(-448, 448).to(FP8_DTYPE)
    return w8, scale


def _gpu_fp8_weight(n: int, k: int, seed: int, block=(128, 128)):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.02, block)


def _gpu_rows(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, device="cuda", generator=gen).bfloat16()


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_skinny_fp8_llama_shapes(shape, m):
    """W8A16 (the rule's: fp16 products too where FP8_F16_PRODUCTS) against the reference's bf16
    weight summed exactly (a bf16 rounding apart, a few with SiLU-and-mul); the dequantising
    kernel against the 16-bit skinny kernel on that weight with the same config (the same
    products in the same order); the W8A8 option against the product of its quantised
    operands, and within FP8's error of the reference."""
    n, k = LLAMA_8B[shape]
    silu = shape == "gate_up"
    w8, scale = _gpu_fp8_weight(n, k, seed=m)
    x = _gpu_rows(m, k, seed=100 + m)
    out = skinny_gemm(x, w8, silu_mul=silu, scale=scale)
    tol = dict(rtol=2e-2 if silu else 1e-2, atol=1e-2)
    torch.testing.assert_close(out, exact_reference(x, w8, scale, silu=silu), **tol)
    config = fp8_weight_config(default_config(m, n // 2 if silu else n, k, silu, x.device), 128, k)
    sixteen = skinny_gemm(x, dequantize(w8, scale, torch.bfloat16), silu_mul=silu, config=config)
    dequantising = skinny_gemm(x, w8, silu_mul=silu, config=config, scale=scale)
    torch.testing.assert_close(dequantising, sixteen, rtol=1e-2, atol=1e-3)
    assert torch.equal(out, skinny_gemm(x, w8, silu_mul=silu, scale=scale))  # deterministic split-K
    if not silu:
        w8a8 = skinny_gemm(x, w8, config=config._replace(fp8_activations=True), scale=scale)
        torch.testing.assert_close(w8a8, w8a8_reference(*quantize_activations(x), w8, scale,
                                                        dtype=torch.bfloat16), rtol=1e-2, atol=1e-2)
        assert _relative_error(w8a8, fp8_linear_reference(x, w8, scale)) < 0.04


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["128x128", "channel"])
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_skinny_fp8_bits_equal_cast(shape, m, scales):
    """On sm_90 the "bits" conversion (the default there) gives the same output as "cast", bit
    for bit, under the same config: the default steps, wide steps, and (at M <= 4) the
    multiply-and-sum path, whose "bits" rounding is integer operations."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bf16x2 multiply needs sm_90")
    n, k = LLAMA_8B[shape]
    silu = shape == "gate_up"
    w8, scale = _gpu_fp8_weight(n, k, seed=10 + m, block=(128, 128) if scales == "128x128" else (1, k))
    x = _gpu_rows(m, k, seed=110 + m)
    base = default_config(m, n // 2 if silu else n, k, silu, x.device, fp8=True)
    configs = [base, base._replace(fp8_wide=True)]
    if m <= 4:
        configs.append(base._replace(dot=False, block_k=64, fp8_wide=False))  # accumulators in registers
    for config in configs:
        bits, cast = (skinny_gemm(x, w8, silu_mul=silu, config=config._replace(fp8_convert=c),
                                  scale=scale) for c in ("bits", "cast"))
        assert torch.equal(bits, cast), config
    assert torch.equal(skinny_gemm(x, w8, silu_mul=silu, scale=scale),  # the default: "bits"
                       skinny_gemm(x, w8, silu_mul=silu, config=base._replace(fp8_convert="bits"),
                                   scale=scale))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_skinny_fp8_qkv_rope_bits_equal_cast(m):
    """The fused q/k/v + RoPE + KV store of Llama 8B: "bits" writes what "cast" writes."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bf16x2 multiply needs sm_90")
    rotary = RotaryEmbedding(128, 4096, 500000.0, None).to("cuda")
    w8, scale = _gpu_fp8_weight(6144, 4096, seed=13)
    x = _gpu_rows(m, 4096, seed=14)
    positions = torch.arange(m, device="cuda") * 37
    loc = torch.arange(m, device="cuda") * 3
    config = skinny_module._qkv_rope_config(m, 6144, 4096, 128, x.device)
    outs = []
    for convert in ("bits", "cast"):
        k_cache = torch.zeros(64, 8, 128, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        q = skinny_qkv_rope(x, w8, None, 32, 8, positions, rotary.cos, rotary.sin, k_cache, v_cache,
                            loc, config=config._replace(fp8_convert=convert), scale=scale)
        outs.append((q, k_cache, v_cache))
    for bits, cast in zip(*outs):
        assert torch.equal(bits, cast)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_skinny_fp8_qkv_rope_llama_8b(m):
    """Llama 8B's q/k/v (32 q heads, 8 KV heads of 128) from an FP8 weight: q, k and v as the
    16-bit fused kernel makes them from the dequantised weight with the same config."""
    rotary = RotaryEmbedding(128, 4096, 500000.0, None).to("cuda")
    w8, scale = _gpu_fp8_weight(6144, 4096, seed=3)
    x = _gpu_rows(m, 4096, seed=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    positions = torch.randint(0, 4096, (m,), device="cuda", generator=gen)
    loc = torch.randperm(64, device="cuda", generator=gen)[:m]
    config = fp8_weight_config(skinny_module._qkv_rope_config(m, 6144, 4096, 128, x.device), 128, 4096)
    outs = []
    for weight, sc in ((w8, scale), (dequantize(w8, scale, torch.bfloat16), None)):
        k_cache = torch.zeros(64, 8, 128, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        q = skinny_qkv_rope(x, weight, None, 32, 8, positions, rotary.cos, rotary.sin, k_cache,
                            v_cache, loc, config=config, scale=sc)
        outs.append((q, k_cache, v_cache))
    for got, want in zip(*outs):  # RoPE's differences of products: a few bf16 steps at worst
        torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_skinny_fp8_f16_llama_shapes(shape, m):
    """fp16 products (`fp8_f16_config`'s rule and bench/fp8_gemm.py's neighbours: 8 warps, x on
    the left over 64 columns) against the exact product of x and the scaled FP8 weight: within
    a bf16 rounding of it, closer to it than the dequantising kernel (which rounds the weight
    to bf16 first), and deterministic (split-K)."""
    n, k = LLAMA_8B[shape]
    silu = shape == "gate_up"
    n_cols = n // 2 if silu else n
    w8, scale = _gpu_fp8_weight(n, k, seed=20 + m)
    x = _gpu_rows(m, k, seed=120 + m)
    expected = exact_product(x, w8, scale, silu=silu)
    dequantising = skinny_gemm(x, w8, silu_mul=silu, config=default_config(m, n_cols, k, silu, x.device),
                               scale=scale)
    rule = skinny_module.fp8_f16_config(m, n_cols, k, silu, x.device)
    narrow = skinny_module.fp8_f16_config(m, n_cols, k, silu, x.device, block_n=64)
    for config in (rule, rule._replace(num_warps=8), narrow._replace(w_left=False)):
        out = skinny_gemm(x, w8, silu_mul=silu, config=config, scale=scale)
        torch.testing.assert_close(out, expected, rtol=2e-2 if silu else 1e-2, atol=1e-2)
        assert _relative_error(out, expected) < _relative_error(dequantising, expected), config
        assert torch.equal(out, skinny_gemm(x, w8, silu_mul=silu, config=config, scale=scale))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_skinny_fp8_qkv_rope_f16_llama_8b(m):
    """Llama 8B's fused q/k/v + RoPE + KV store on fp16 products (64 columns of each half of a
    head, the weight on the left): q, k and v as the 16-bit fused kernel makes them from the
    dequantised weight, within RoPE's bf16 steps."""
    rotary = RotaryEmbedding(128, 4096, 500000.0, None).to("cuda")
    w8, scale = _gpu_fp8_weight(6144, 4096, seed=23)
    x = _gpu_rows(m, 4096, seed=24)
    positions = torch.arange(m, device="cuda") * 53
    loc = torch.arange(m, device="cuda") * 2
    f16 = skinny_module.fp8_f16_config(m, 3072, 4096, True, x.device, block_n=64)
    sixteen = skinny_module._qkv_rope_config(m, 6144, 4096, 128, x.device)
    outs = []
    for weight, sc, config in ((w8, scale, f16), (dequantize(w8, scale, torch.bfloat16), None, sixteen)):
        k_cache = torch.zeros(64, 8, 128, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        q = skinny_qkv_rope(x, weight, None, 32, 8, positions, rotary.cos, rotary.sin, k_cache,
                            v_cache, loc, config=config, scale=sc)
        outs.append((q, k_cache, v_cache))
    # Two roundings apart (the product's, and the dequantised weight's in the 16-bit path),
    # each through RoPE's bf16 steps: a bf16 step of values near 2-4 is 0.0156 (the H100 saw 9
    # of 65,536 values one such step apart at 16 rows).
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_activation_quantiser_is_torchs():
    x = _gpu_rows(64, 14336 + 40, seed=5) * 3
    x8, scales = quantize_activations(x)
    ref8, ref_scales = quantize_activations_reference(x)
    assert torch.equal(scales, ref_scales) and torch.equal(x8.float(), ref8.float())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [17, 512, 4096])
def test_gpu_block_scaled_matmul_llama_shapes(shape, m):
    """The large-M W8A8 GEMM, through `fp8_matmul` (and `linear` above the skinny range; on
    Hopper cuBLAS's blockwise FP8 GEMM) and the Triton kernel: the product of the quantised
    operands within a bf16 rounding; within FP8's error of the reference."""
    from specserve.engine.layers.skinny_gemm import linear
    from specserve.engine.layers.fp8_gemm import (
        block_scaled_matmul, fp8_matmul, runs_block_scaled, runs_cublas_blockwise)

    n, k = LLAMA_8B[shape]
    w8, scale = _gpu_fp8_weight(n, k, seed=6)
    x = _gpu_rows(m, k, seed=7)
    assert runs_block_scaled(x, w8, scale)
    assert runs_cublas_blockwise(x, w8, scale) == (torch.cuda.get_device_capability() == (9, 0))
    out = fp8_matmul(x, w8, scale)
    expected = w8a8_reference(*quantize_activations(x), w8, scale, dtype=torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(block_scaled_matmul(x, w8, scale), expected, rtol=1e-2, atol=1e-2)
    assert _relative_error(out, fp8_linear_reference(x, w8, scale)) < 0.04
    assert torch.equal(linear(x, w8, None, True, scale), out)


@pytest.mark.gpu
def test_gpu_fused_moe_fp8_deepseek_shape():
    """256 experts top-8, hidden 2048 (scaled from 7168), intermediate 2048, 128x128 blocks:
    the kernel against the torch path with the same scales."""
    from specserve.engine.layers.fused_moe_triton import fused_experts
    from specserve.engine.layers.moe import fused_experts as torch_fused_experts

    gen = torch.Generator(device="cuda").manual_seed(8)
    num_experts, hidden, inter = 256, 2048, 2048
    w13, w13_scale = quantize_weight(torch.randn(num_experts, 2 * inter, hidden, device="cuda",
                                                 generator=gen) * hidden ** -0.5, (128, 128))
    w2, w2_scale = quantize_weight(torch.randn(num_experts, hidden, inter, device="cuda",
                                               generator=gen) * inter ** -0.5, (128, 128))
    for tokens in (1, 16, 300):
        x = _gpu_rows(tokens, hidden, seed=tokens)
        topk_ids = torch.rand(tokens, num_experts, device="cuda", generator=gen).topk(8, dim=1).indices
        topk_weights = torch.rand(tokens, 8, device="cuda", generator=gen).softmax(-1)
        out = fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale)
        expected = torch_fused_experts(x.float(), w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        assert _relative_error(out, expected) < 0.02  # bf16 activations against fp32 ones


@pytest.mark.gpu
def test_gpu_fp8_kernels_in_a_cuda_graph():
    """W8A16 skinny GEMMs (split-K on) and the fused q/k/v + RoPE, the W8A8 option, the large-M
    kernel with its quantiser, FP8 experts: captured once and replayed with new inputs:
    eager's bits every replay, counters at zero."""
    from specserve.engine.layers.fused_moe_triton import fused_experts
    from specserve.engine.layers.fp8_gemm import fp8_matmul

    weights = {name: _gpu_fp8_weight(n, k, seed=i) for i, (name, (n, k)) in enumerate(LLAMA_8B.items())}
    small = {name: torch.zeros(4, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in LLAMA_8B.items()}
    large = torch.zeros(300, 4096, device="cuda", dtype=torch.bfloat16)
    w8a8 = SkinnyConfig(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=3, fp8_activations=True)
    rotary = RotaryEmbedding(128, 4096, 500000.0, None).to("cuda")
    positions = torch.tensor([5, 900, 17, 4000], device="cuda")
    loc = torch.tensor([3, 0, 9, 6], device="cuda")
    k_cache = torch.zeros(16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    gen = torch.Generator(device="cuda").manual_seed(30)
    w13, w13_scale = quantize_weight(torch.randn(16, 2 * 1408, 2048, device="cuda", generator=gen) * 0.02, (128, 128))
    w2, w2_scale = quantize_weight(torch.randn(16, 2048, 1408, device="cuda", generator=gen) * 0.02, (128, 128))
    moe_x = torch.zeros(6, 2048, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.zeros(6, 4, device="cuda", dtype=torch.int64)
    topk_weights = torch.zeros(6, 4, device="cuda")

    def run():
        outs = [skinny_gemm(small[name], w8, silu_mul=name == "gate_up", scale=scale)
                for name, (w8, scale) in weights.items()]
        outs.append(skinny_qkv_rope(small["qkv"], weights["qkv"][0], None, 32, 8, positions,
                                    rotary.cos, rotary.sin, k_cache, v_cache, loc,
                                    scale=weights["qkv"][1]))
        outs.append(skinny_gemm(small["o"], weights["o"][0], config=w8a8, scale=weights["o"][1]))
        outs.append(fp8_matmul(large, *weights["qkv"]))
        outs.append(fused_experts(moe_x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                  w2_scale=w2_scale))
        return outs

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    for seed in range(3):
        for i, x in enumerate([*small.values(), large, moe_x]):
            x.copy_(_gpu_rows(x.shape[0], x.shape[1], seed=10 * seed + i))
        topk_ids.copy_(torch.rand(6, 16, device="cuda", generator=gen).topk(4, dim=1).indices)
        topk_weights.copy_(torch.rand(6, 4, device="cuda", generator=gen).softmax(-1))
        graph.replay()
        replayed = [out.clone() for out in static_out] + [k_cache[loc].clone(), v_cache[loc].clone()]
        eager = run() + [k_cache[loc], v_cache[loc]]
        for got, want in zip(replayed, eager):
            assert torch.equal(got, want)
        assert not workspace_for(large.device).arrivals.any()
