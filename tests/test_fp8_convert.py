"""engine/layers/fp8_convert.py: the integer rounding to bf16 against torch's conversion, bit
for bit (in the interpreter: the Triton function itself), the `fp8_convert` values the configs
take and the device default. The e4m3 byte moves ("bits") are PTX: compiled for sm_90 in
tests/test_fp8_kernels.py and tests/test_fp8_kv_cache.py, run on a GPU here and there
(`-m gpu`)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specserve.engine.layers import skinny_gemm as skinny_module  # noqa: E402
from specserve.engine.layers.fp8_convert import (  # noqa: E402
    WEIGHT_FP8_CONVERT, check_fp8_convert, e4m3_to_f32, has_sm90_conversions, round_to_bf16)
from specserve.engine.layers.skinny_gemm import SkinnyConfig, skinny_gemm  # noqa: E402
from specserve.engine.layers.fp8_weight import FP8_DTYPE, WeightScale  # noqa: E402

BLOCK = 4096


@triton.jit
def _round_kernel(src, dst, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, round_to_bf16(tl.load(src + offs)))


def _rounded(values: torch.Tensor) -> torch.Tensor:
    padded = torch.nn.functional.pad(values, (0, -values.numel() % BLOCK))
    out = torch.empty_like(padded)
    _round_kernel[(padded.numel() // BLOCK,)](padded, out, BLOCK=BLOCK)
    return out[:values.numel()]


def _finite_fp32_bits() -> torch.Tensor:
    """fp32 bit patterns, both signs: random ones over every exponent (subnormals and the
    largest finite values included); exact ties (low 16 bits 0x8000) with an even and an odd
    kept bit, one below and one above a tie, all around bf16's subnormal/normal boundary and
    at the top, where rounding carries into the exponent or into infinity; zeros."""
    gen = torch.Generator().manual_seed(0)
    random = torch.randint(0, 1 << 31, (1 << 16,), generator=gen, dtype=torch.int64)
    kept = torch.randint(0, 1 << 15, (1 << 12,), generator=gen, dtype=torch.int64) << 16
    edges = torch.tensor([0x0000_0000, 0x0001_0000, 0x007F_0000, 0x0080_0000, 0x3F7F_0000,
                          0x7F00_0000, 0x7F7E_0000, 0x7F7F_0000])
    heads = torch.cat([kept, edges])
    lows = torch.tensor([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0001, 0x0000])
    near_ties = (heads[:, None] | lows[None, :]).flatten()
    magnitudes = torch.cat([random, near_ties])
    magnitudes = magnitudes[(magnitudes & 0x7F80_0000) != 0x7F80_0000]  # no inf / NaN inputs
    patterns = torch.cat([magnitudes, magnitudes | (1 << 31)])
    return (patterns - ((patterns >> 31) << 32)).to(torch.int32)  # the same 32 bits, signed


def test_round_to_bf16_is_torchs_conversion_bit_for_bit():
    values = _finite_fp32_bits().view(torch.float32)
    expected = values.to(torch.bfloat16).to(torch.float32)
    got = _rounded(values)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    # The cases the patterns were made for are there: ties both ways, subnormal results,
    # results that carried into infinity.
    low = values.view(torch.int32) & 0xFFFF
    assert bool((low == 0x8000).any()) and bool((got.abs() < 2.0 ** -126).logical_and(got != 0).any())
    assert bool(got.isinf().any()) and not bool(values.isinf().any())


def test_fp8_convert_values_are_checked_by_name():
    assert [check_fp8_convert(v) for v in ("cast", "bits")] == ["cast", "bits"]
    with pytest.raises(ValueError, match="^fp8_convert: must be one of cast, bits, got 'bit'$"):
        check_fp8_convert("bit")


def test_bits_is_opt_in_and_only_where_the_device_has_it(monkeypatch):
    """The weight GEMMs default to "cast" until a GPU run times "bits"; "bits" needs compiled
    kernels on sm_90 or newer."""
    assert WEIGHT_FP8_CONVERT == "cast"
    for capability, expected in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert has_sm90_conversions(torch.device("cuda")) is expected
    assert not has_sm90_conversions(torch.device("cpu"))


def _fp8_case():
    w8 = (torch.arange(64 * 32).reshape(64, 32) % 7 - 3).float().to(FP8_DTYPE)
    return torch.ones(1, 32), w8, WeightScale(torch.full((1, 1), 0.5), 64, 32)


@pytest.mark.parametrize("value,message", [
    ("bit", "^fp8_convert: must be one of cast, bits, got 'bit'$"),
    ("bits", "^fp8_convert: 'bits' needs compiled kernels on sm_90 or newer, not cpu$")])
def test_skinny_gemm_refuses_a_conversion_it_cannot_run(value, message):
    if torch.cuda.is_available():
        pytest.skip("the CPU's interpreter refuses 'bits'")
    x, w8, scale = _fp8_case()
    config = SkinnyConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=1,
                          fp8_convert=value)
    with pytest.raises(ValueError, match=message):
        skinny_gemm(x, w8, config=config, scale=scale)


def test_skinny_gemm_takes_the_device_default_and_cast(monkeypatch):
    """None (the default) runs WEIGHT_FP8_CONVERT, "cast", as an explicit "cast" does, both
    launching with FP8_CONVERT="cast"."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's device")
    seen = []
    real = skinny_module._skinny_gemm_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["FP8_CONVERT"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(skinny_module, "_skinny_gemm_kernel", Recorder())
    x, w8, scale = _fp8_case()
    config = SkinnyConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=1)
    outs = [skinny_gemm(x, w8, config=config._replace(fp8_convert=c), scale=scale)
            for c in (None, "cast")]
    assert seen == ["cast", "cast"] and torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], x @ (w8.float() * 0.5).T)


@triton.jit
def _widen_kernel(src, dst, FP8_CONVERT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(dst + offs, e4m3_to_f32(tl.load(src + offs), FP8_CONVERT))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_convert", ["cast", "bits"])
def test_every_e4m3_code_widens_to_its_fp32_value_gpu(fp8_convert):
    """`e4m3_to_f32`, the W8A16 kernels' conversion: every code to its value (the NaN codes
    0x7F and 0xFF read as +-480 by bits: checkpoints hold none), four codes an asm call."""
    if fp8_convert == "bits" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bf16x2 multiply needs sm_90")
    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device="cuda")
    _widen_kernel[(1,)](codes.view(FP8_DTYPE), out, FP8_CONVERT=fp8_convert, num_warps=1)
    expected = codes.view(FP8_DTYPE).float()
    nan = expected.isnan()
    assert torch.equal(out[~nan], expected[~nan])
    if fp8_convert == "bits":
        assert out[nan].tolist() == [480.0, -480.0]
