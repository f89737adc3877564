"""The W4A16 kernels (engine/layers/int4_gemm.py) against the torch reference.

In the interpreter on the CPU (small shapes; N not a multiple of the column tile, group sizes
32, 64 and one group over K, interleaves of 16 and 32 words): the decode kernel on tl.dot in
fp32 (exact operands: the interpreter's bf16 dot is wrong), both operand orders, and on
multiply-and-sum in fp16 (its fma dequantisation of 16-bit scales and the plain one of fp32
scales), split-K on and off (its arrival counters left at zero), with a bias and with the
SiLU-and-mul epilogue; the bf16 rounding by integer ops bit for bit; its mid-M row tiles; the
dequantise kernel of the large-M path bit for bit at every interleave; the pack/unpack round
trip and layout; the layout rules and refusals.
Marked `gpu`: Llama-8B shapes in bf16, against the reference and inside a CUDA graph.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from specserve.engine.layers.activation import silu_and_mul  # noqa: E402
from specserve.engine.layers.int4_gemm import (  # noqa: E402
    Int4Weight, W4Config, default_w4_config, dequantize_int4, dequantize_int4_gpu,
    fit_shared_memory, int4_linear, int4_linear_reference, int4_linear_silu_and_mul,
    interleave_for, pack_rows, plane_groups, split_for, unpack_rows, w4a16_gemm)
from specserve.engine.layers.int4_shared_memory import (  # noqa: E402
    H100_SHARED_MEMORY, Operands, shared_memory_need)
from specserve.engine.layers.skinny_gemm import SkinnyWorkspace  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, K = 72, 256


def int4_weight(n: int, k: int, group: int, seed: int, scale_dtype=torch.float16,
                interleave: int = 16, scales: torch.Tensor | None = None) -> Int4Weight:
    """Random codes, zero points and scales (powers of two over 1/64..1/8 unless given: products
    with small-integer activations are exact, so only roundings differ)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if scales is None:
        scales = (2.0 ** -torch.randint(3, 7, (n, groups), generator=gen)).to(scale_dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
    return Int4Weight(pack_rows(codes, interleave).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
                      group, interleave)


def _workspace() -> SkinnyWorkspace:
    return SkinnyWorkspace(DEVICE, partial_capacity=1 << 16, counter_capacity=64)


def rows(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (m, k), generator=gen).to(dtype).to(DEVICE)


@pytest.fixture
def rules_only(monkeypatch):
    """The module's rules, whatever tuned tables this checkout has installed."""
    from specserve.engine.layers import int4_gemm

    monkeypatch.setattr(int4_gemm, "TUNED_INTERLEAVE", {})
    monkeypatch.setattr(int4_gemm, "TUNED_W4_CONFIGS", {})
    default_w4_config.cache_clear()
    yield
    default_w4_config.cache_clear()


def test_pack_unpack_round_trip_and_dequantize():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    packed = pack_rows(codes)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert torch.equal(unpack_rows(packed), codes)
    assert int(packed[0, 0]) & 0xF == int(codes[0, 0]) and (int(packed[0, 0]) >> 28) & 0xF == int(codes[0, 7])
    w = Int4Weight(packed, torch.full((5, 2), 0.5), torch.full((5, 2), 3, dtype=torch.uint8), 32)
    torch.testing.assert_close(dequantize_int4(w), (codes.float() - 3) * 0.5, rtol=0, atol=0)


def test_interleaved_layout():
    """Interleave W: code 8 W b + W j + w at bits 4 j of word W b + w; the round trip and the
    dequantised weight do not depend on W."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 128), generator=gen, dtype=torch.uint8)
    packed = pack_rows(codes, 4)
    assert packed.shape == (3, 16) and torch.equal(unpack_rows(packed, 4), codes)
    for k in (0, 5, 37, 127):
        b, r = divmod(k, 32)
        j, w = divmod(r, 4)
        assert (int(packed[1, 4 * b + w]) >> (4 * j)) & 0xF == int(codes[1, k])
    scales, zeros = torch.rand(3, 4).half(), torch.randint(0, 16, (3, 4), dtype=torch.uint8)
    assert torch.equal(dequantize_int4(Int4Weight(packed, scales, zeros, 32, 4)),
                       dequantize_int4(Int4Weight(pack_rows(codes), scales, zeros, 32)))


def test_layout_rules(rules_only):
    """A plane lies in one group; K is whole blocks; the rule's interleave is the widest such
    power of two up to 32."""
    assert [plane_groups(128, 4096, words) for words in (16, 32, 128)] == [8, 4, 1]
    assert plane_groups(4096, 4096, 128) == 8          # one group over K
    assert plane_groups(32, 4096, 64) == 0             # a plane of 64 crosses groups of 32
    assert plane_groups(128, 96 * 8, 128) == 0         # K not whole blocks of 1024
    assert plane_groups(96, 768, 32) == 0              # blocks of 256 over groups of 96
    assert interleave_for(4096, 4096, 128) == 32
    assert interleave_for(4096, 3584, 128) == 32 and interleave_for(64, 96, 32) == 4
    assert interleave_for(64, 4096, 32) == 32 and interleave_for(64, 4096, 16) == 16


@pytest.mark.parametrize("group", [32, 64, K], ids=["g32", "g64", "per-channel"])
@pytest.mark.parametrize("interleave", [16, 32])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("m,w_left", [(1, False), (5, True)], ids=["m1", "m5-w-left"])
def test_decode_kernel_on_dot_equals_the_reference(group, interleave, split_k, m, w_left):
    """fp32 on tl.dot, either operand order: blocks inside one group or spanning 2 or 4 whole
    groups (a scale and zero a group, shared by its planes); split-K; a bias."""
    w = int4_weight(N, K, group, seed=group + m, interleave=interleave)
    x = rows(m, K, seed=m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    config = W4Config(block_n=32, split_k=split_k, num_warps=4, num_stages=2, w_left=w_left)
    workspace = _workspace()
    out = w4a16_gemm(x, w, bias, config=config, workspace=workspace)
    torch.testing.assert_close(out, int4_linear_reference(x, w, bias), rtol=0, atol=1e-5)
    assert not workspace.arrivals.any()  # ready for the next launch (and graph replay)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("epilogue", ["plain", "bias", "silu_mul"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["fp16-scales", "fp32-scales"])
def test_decode_kernel_fp16_roundings_equal_the_reference(split_k, epilogue, scale_dtype):
    """Multiply-and-sum in fp16: the dequantised weight (by the fma of 16-bit scales, or
    (q - z) s of fp32 ones) rounded to fp16 as the reference rounds it, exact sums, one
    rounding of the output (bias added in fp32 first), then for the fused gate/up weight
    silu_and_mul's roundings."""
    silu = epilogue == "silu_mul"
    n_rows = 2 * N if silu else N
    w = int4_weight(n_rows, K, 32, seed=9, scale_dtype=scale_dtype)
    x = rows(3, K, seed=4, dtype=torch.float16)
    bias = (torch.randint(-8, 9, (n_rows,)) / 4).to(DEVICE, torch.float16) if epilogue == "bias" else None
    config = W4Config(block_n=16, split_k=split_k, num_warps=4, num_stages=2, dot=False)
    out = w4a16_gemm(x, w, bias, silu_mul=silu, config=config, workspace=_workspace())
    reference = F.linear(x.double(), dequantize_int4(w, torch.float16).double(),
                         None if bias is None else bias.double()).to(torch.float16)
    assert torch.equal(out, silu_and_mul(reference) if silu else reference)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_bf16_rounding_by_integer_ops_is_the_reference_bit_for_bit(scale_dtype):
    """`round_bits`: scales with every significant bit set (the products (q - z) s need
    rounding to bf16, ties included), rows of x that pick one column each, so the output is
    one dequantised weight each, exactly representable: it must be the reference's."""
    gen = torch.Generator().manual_seed(7)
    scales = (torch.rand(N, K // 64, generator=gen) * 0.05 + 0.001).to(scale_dtype)
    w = int4_weight(N, K, 64, seed=8, scales=scales)
    picks = torch.tensor([0, 3, 17, 64, 130, 255])
    x = F.one_hot(picks, K).to(torch.bfloat16).to(DEVICE)
    config = W4Config(block_n=32, split_k=2, num_warps=4, num_stages=2, dot=False, round_bits=True)
    out = w4a16_gemm(x, w, config=config, workspace=_workspace())
    expected = dequantize_int4(w, torch.bfloat16)[:, picks.to(DEVICE)].t()
    assert not torch.equal(expected.float(), dequantize_int4(w)[:, picks.to(DEVICE)].t())  # rounded
    assert torch.equal(out, expected)


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu_mul"])
def test_mid_m_row_tiles_equal_the_reference(silu):
    """70 rows (two row tiles of 64, the second partial), fp32 on tl.dot, K not split, a bias."""
    n_rows = 2 * N if silu else N
    w = int4_weight(n_rows, K, 32, seed=21, interleave=32)
    x = rows(70, K, seed=22) / 16  # gates of a few units: the interpreter's exp stays finite
    bias = torch.randn(n_rows, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    config = W4Config(block_n=32, split_k=1, num_warps=4, num_stages=2)
    out = w4a16_gemm(x, w, bias, silu_mul=silu, config=config)
    reference = int4_linear_reference(x, w, bias)
    torch.testing.assert_close(out, silu_and_mul(reference) if silu else reference, rtol=1e-5, atol=1e-4)


MID_K = 1024  # 8 blocks of 128 codes a row at interleave 16: a split of 4 gets two each


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("m,block_m", [(17, 0), (70, 32), (70, 128)],
                         ids=["m17-rule-tiles", "m70-tiles-of-32", "m70-one-tile-of-128"])
@pytest.mark.parametrize("split_k", [4])  # (2 ran as well: the same merge, half the partials)
def test_mid_m_split_k_equals_the_reference_and_the_unsplit_result(silu, m, block_m, split_k):
    """Mid M with K split over row tiles of the rule's (64, one partial tile), 32 (three, the
    last partial) and 128 (one covering all rows), fp32 on tl.dot with a bias: exact operands
    (small-integer rows, power-of-two scales), so the split result is the unsplit one bit for
    bit and the reference; every (column tile, row tile) counter back at zero."""
    n_rows = 2 * N if silu else N
    w = int4_weight(n_rows, MID_K, 64, seed=31 + m, interleave=16)
    x = rows(m, MID_K, seed=32) / 16  # gates of a few units: the interpreter's exp stays finite
    bias = (torch.randint(-8, 9, (n_rows,), generator=torch.Generator().manual_seed(33)) / 4).to(DEVICE)
    config = W4Config(block_n=32, split_k=split_k, num_warps=4, num_stages=2, block_m=block_m)
    workspace = _workspace()
    out = w4a16_gemm(x, w, bias, silu_mul=silu, config=config, workspace=workspace)
    assert not workspace.arrivals.any()
    unsplit = w4a16_gemm(x, w, bias, silu_mul=silu, config=config._replace(split_k=1))
    assert torch.equal(out, unsplit)
    reference = int4_linear_reference(x, w, bias)
    torch.testing.assert_close(out, silu_and_mul(reference) if silu else reference, rtol=1e-5, atol=1e-4)


class _Checkpoint(dict):
    """A checkpoint reader over a dict of tensors (`get`, `in`), as the loader reads one."""

    def get(self, key):
        return self[key]


def _loaded_int4_weight(fmt: str, n: int, k: int, group: int, seed: int) -> Int4Weight:
    """A random weight quantized by the test quantizer (tests/int4_quantizer.py) into AWQ's
    or GPTQ's tensors and loaded by the INT4 method (quantization/int4.py) into the kernels'
    form: AWQ asymmetric, GPTQ symmetric (zeros stored as 7, loaded as 8)."""
    from int4_quantizer import awq_tensors, gptq_tensors, quant_config, quantize_groups
    from torch import nn

    from specserve.engine.layers.linear_method import PartSlice
    from specserve.engine.quantization.config import parse_quantization_config
    from specserve.engine.quantization.int4 import Int4LinearMethod

    sym = fmt == "gptq"
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, z, s = quantize_groups(dense, group, sym)
    tensors = awq_tensors(q, z, s) if fmt == "awq" else gptq_tensors(q, z, s, group)
    method = Int4LinearMethod(parse_quantization_config(quant_config(fmt, group, sym)))
    layer = nn.Linear(k, n, bias=False)
    method.create_weights(layer)
    method.load_weights(layer, _Checkpoint({f"w.{name}": t for name, t in tensors.items()}),
                        [PartSlice("w.weight", 0, 0, n)])
    w = method.weight(layer)
    w = w._replace(qweight=pack_rows(unpack_rows(w.qweight, w.interleave), 16), interleave=16)
    return w._replace(qweight=w.qweight.to(DEVICE), scales=w.scales.to(DEVICE), zeros=w.zeros.to(DEVICE))


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_mid_m_split_k_on_awq_and_gptq_weights(fmt, silu):
    """Weights as AWQ and GPTQ checkpoints store them, loaded as the engine loads them: 40
    rows (row tiles of 32, the second partial), K split in 4, equal the reference and the
    unsplit kernel within fp32 sums' roundings (real scales: the sums are not exact)."""
    n_rows = 2 * N if silu else N
    w = _loaded_int4_weight(fmt, n_rows, MID_K, 128, seed=41)
    x = torch.randn(40, MID_K, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    config = W4Config(block_n=32, split_k=4, num_warps=4, num_stages=2, block_m=32)
    out = w4a16_gemm(x, w, silu_mul=silu, config=config, workspace=_workspace())
    unsplit = w4a16_gemm(x, w, silu_mul=silu, config=config._replace(split_k=1))
    reference = int4_linear_reference(x, w)
    torch.testing.assert_close(out, silu_and_mul(reference) if silu else reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, unsplit, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_dispatch_on_the_cpu_is_the_unfused_reference():
    w = int4_weight(2 * N, K, 64, seed=2)
    x = torch.randn(4, K).to(DEVICE)
    if DEVICE.type == "cpu":
        assert torch.equal(int4_linear_silu_and_mul(x, w), silu_and_mul(int4_linear_reference(x, w)))


@pytest.mark.parametrize("interleave,group,k", [(1, 32, K), (4, 32, K), (32, 32, K), (32, K, K),
                                                (16, 128, 512), (4, 48, 384)],
                         ids=["plain", "w4", "w32-g32", "w32-per-channel", "w16-g128", "odd-group"])
def test_dequantize_kernel_is_the_reference_bit_for_bit(interleave, group, k):
    """Every interleave, blocks spanning groups, groups spanning blocks, one group over K, and
    a group size no block aligns with (48: a scale load per plane)."""
    w = int4_weight(N, k, group, seed=5, interleave=interleave)
    assert torch.equal(dequantize_int4_gpu(w, torch.float16, block_n=32, block_words=16),
                       dequantize_int4(w, torch.float16))


def test_configs_and_refusals(rules_only):
    cpu = torch.device("cpu")
    config = default_w4_config(1, 1024, 4096, 128, device=cpu)
    assert config.split_k > 1 and 4096 // config.split_k >= 1024  # few tiles: K is split
    assert default_w4_config(1, 14336, 4096, 128, True, device=cpu).split_k == 1
    # decode sizes dequantise in pairs (PAIRED_DEQUANT), row tiles do not
    assert default_w4_config(1, 6144, 4096, 128, device=cpu) == W4Config(
        128, 4, 4, 4, w_left=True, paired_dequant=True)
    assert default_w4_config(64, 6144, 4096, 128, device=cpu) == W4Config(64, 2, 4, 4)
    with pytest.raises(AssertionError, match="must lie in one group of 48"):
        w4a16_gemm(rows(1, 384, 0), int4_weight(N, 384, 48, 0), config=W4Config(32, 1, 4, 2))
    with pytest.raises(AssertionError, match="tl.dot takes planes of at least 16"):
        w4a16_gemm(rows(1, K, 0), int4_weight(N, K, 32, 0, interleave=4), config=W4Config(32, 1, 4, 2))
    with pytest.raises(AssertionError, match="blocks of 256 tile K = 384"):
        w4a16_gemm(rows(1, 384, 0), int4_weight(N, 256, 32, 0, interleave=32)._replace(
            qweight=torch.zeros(N, 48, dtype=torch.int32, device=DEVICE),
            scales=torch.ones(N, 12, dtype=torch.float16, device=DEVICE),
            zeros=torch.zeros(N, 12, dtype=torch.uint8, device=DEVICE)))


def test_mid_m_rule_splits_k_while_the_programs_of_all_row_tiles_are_fewer_than_the_sms(rules_only):
    """The rule above 16 rows (an H100's 132 SMs on the CPU): 64-column tiles, row tiles of 64,
    K doubled while column tiles times row tiles times splits are under 132, slices at least
    1024 deep and the partials within the workspace."""
    cpu = torch.device("cpu")

    def split(m, n, k, paired=False):
        return default_w4_config(m, n, k, 128, paired, cpu).split_k

    # 8B shards: qkv 96 column tiles, o 64, down 64 (K 14336), gate/up 224 pairs
    assert [split(m, 6144, 4096) for m in (32, 64, 128, 256)] == [2, 2, 1, 1]
    assert [split(m, 4096, 4096) for m in (32, 64, 128, 256)] == [4, 4, 2, 1]
    assert [split(m, 4096, 14336) for m in (32, 64, 128, 256)] == [4, 4, 2, 1]
    assert [split(m, 14336, 4096, True) for m in (32, 64, 128, 256)] == [1, 1, 1, 1]
    assert default_w4_config(64, 4096, 4096, 128, device=cpu) == W4Config(64, 4, 4, 4)
    # row tiles of all 256 rows: fewer programs, more splits, up to the workspace's partials
    assert split_for(256, 6144, 4096, False, 64, cpu, block_m=256) == 2
    assert split_for(256, 4096, 14336, False, 64, cpu, block_m=256) == 4  # 4 x 256 x 4096: all of it
    assert split_for(256, 14336, 4096, True, 128, cpu, block_m=256) == 1  # 2 x 256 x 28672: over
    assert split_for(256, 4096, 1024, False, 64, cpu, block_m=256) == 1   # slices under 1024
    assert split_for(64, 4096, 4096, False, 64, cpu, block_m=16) == 1     # 256 programs already


def test_mid_m_tuned_configs_serve_mid_m_only(rules_only, monkeypatch):
    """A config measured at 64 rows serves 17-64 rows, one at 256 serves 65-256; neither serves
    decode sizes (whose measured configs pad one row tile) and a decode config not mid M."""
    from specserve.engine.layers import int4_gemm

    cpu = torch.device("cpu")
    monkeypatch.setattr(int4_gemm, "PAIRED_DEQUANT", False)  # the tables as they stand
    at_16, at_64, at_256 = W4Config(64, 4, 4, 4), W4Config(128, 2, 8, 3, block_m=32), \
        W4Config(64, 1, 4, 2, w_left=True, block_m=128)
    for m, config in ((16, at_16), (64, at_64), (256, at_256)):
        monkeypatch.setitem(int4_gemm.TUNED_W4_CONFIGS, (m, 4096, 4096, 128, False), config._asdict())
    default_w4_config.cache_clear()
    assert [default_w4_config(m, 4096, 4096, 128, device=cpu) for m in (1, 16, 17, 64, 65, 256)] == \
        [at_16, at_16, at_64, at_64, at_256, at_256]
    monkeypatch.delitem(int4_gemm.TUNED_W4_CONFIGS, (64, 4096, 4096, 128, False))
    monkeypatch.delitem(int4_gemm.TUNED_W4_CONFIGS, (256, 4096, 4096, 128, False))
    default_w4_config.cache_clear()
    assert default_w4_config(17, 4096, 4096, 128, device=cpu) == W4Config(64, 4, 4, 4)  # the rule


def test_mid_m_refusals_and_named_row_tiles():
    """A row tile must be one of 16-256 (a power of two tl.dot takes); mid M runs on tl.dot; a
    split whose partials overrun the workspace is refused; a named row tile is the only one
    tried, and up to 16 rows it is unused (one tile of the rows)."""
    cpu = torch.device("cpu")
    w, x = int4_weight(N, K, 32, seed=0, interleave=32), rows(40, K, seed=0)
    with pytest.raises(AssertionError, match="block_m 48: 0 .* or one of"):
        w4a16_gemm(x, w, config=W4Config(32, 1, 4, 2, block_m=48))
    with pytest.raises(AssertionError, match="more than 16 rows: row tiles on tl.dot"):
        w4a16_gemm(x, w, config=W4Config(16, 1, 4, 2, dot=False))
    with pytest.raises(AssertionError, match="split-K 4 at 40 rows: partials over"):
        w4a16_gemm(x, w, config=W4Config(32, 4, 4, 2),
                   workspace=SkinnyWorkspace(DEVICE, partial_capacity=4 * 40 * N - 1))
    ops = Operands(128, 8, 4, 2, False)  # fp32 rows at W = 128: 64-row tiles never fit
    named = W4Config(64, 1, 4, 4, block_m=64)
    assert fit_shared_memory(named, 70, ops, cpu) is None
    assert fit_shared_memory(named._replace(block_m=0), 70, ops, cpu)[1] == 32
    assert fit_shared_memory(W4Config(64, 1, 4, 4, block_m=128), 5, ops, cpu)[1] == 16


def test_the_h100_launches_that_overran_its_shared_memory_are_fitted(rules_only):
    """The H100's failures (triton 3.6, `metadata.shared` in bytes, of its 232448): the 8B AWQ
    engine's qkv at 64 rows, the rule's mid-M config at the tuned W = 64 (319488), and the
    GPU test's gate/up at W = 128 and 4 stages (294912; weight on the left 327680). The model
    is at least each; the engine's fitting keeps the 64-row tile at fewer stages, then takes
    smaller row tiles (W = 128: 64 rows fit at no stage count); a config given as it stands
    keeps its stages."""
    cpu = torch.device("cpu")
    qkv_w64 = Operands(words=64, groups_per_step=4, x_bytes=2, scale_bytes=2, paired=False)
    rule = default_w4_config(64, 6144, 4096, 128, device=cpu)
    assert shared_memory_need(qkv_w64, 64, rule.block_n, rule.dot, rule.w_left, 4) >= 319488
    assert fit_shared_memory(rule, 64, qkv_w64, cpu) == (rule._replace(num_stages=2), 64)
    assert fit_shared_memory(rule, 64, qkv_w64, cpu, lower_stages=False) == (rule, 32)
    qkv_w128 = qkv_w64._replace(words=128, groups_per_step=8)
    assert fit_shared_memory(rule, 17, qkv_w128, cpu) == (rule._replace(num_stages=3), 32)

    gate_up_w128 = Operands(words=128, groups_per_step=8, x_bytes=2, scale_bytes=2, paired=True)
    for w_left, measured in ((False, 294912), (True, 327680)):
        config = W4Config(block_n=64, split_k=2, num_warps=4, num_stages=4, w_left=w_left)
        assert shared_memory_need(gate_up_w128, 16, 64, True, w_left, 4) >= measured
        assert fit_shared_memory(config, 1, gate_up_w128, cpu, lower_stages=False) is None
        fitted, block_m = fit_shared_memory(config, 1, gate_up_w128, cpu)
        assert block_m == 16 and 2 <= fitted.num_stages < 4
        assert shared_memory_need(gate_up_w128, 16, 64, True, w_left, fitted.num_stages) \
            <= H100_SHARED_MEMORY
    with pytest.raises(AssertionError, match="one stage"):
        shared_memory_need(gate_up_w128, 16, 64, True, False, 1)


def test_a_given_config_that_overruns_the_shared_memory_is_refused_before_launch():
    w = int4_weight(N, 1024, 128, seed=3, interleave=128)
    config = W4Config(block_n=128, split_k=1, num_warps=4, num_stages=4)
    with pytest.raises(AssertionError, match="more shared memory than the device's 232448"):
        w4a16_gemm(rows(1, 1024, 0), w, config=config)


def test_mid_m_rows_take_smaller_row_tiles_where_64_do_not_fit(rules_only):
    """fp32 rows at W = 128: 64-row tiles do not fit at any stage count, 32-row ones do (three
    of them for 70 rows; the rule's config, as the engine launches it): the reference."""
    w = int4_weight(N, 1024, 128, seed=24, interleave=128)
    x = rows(70, 1024, seed=25)
    ops = Operands(128, 8, 4, 2, False)
    config = default_w4_config(70, N, 1024, 128, device=torch.device("cpu"))
    assert fit_shared_memory(config, 70, ops, torch.device("cpu"))[1] == 32
    torch.testing.assert_close(w4a16_gemm(x, w), int4_linear_reference(x, w), rtol=1e-5, atol=1e-4)


def test_int4_linear_on_the_cpu_is_the_reference():
    w = int4_weight(N, K, 32, seed=1)
    x = torch.randn(20, K)
    if DEVICE.type == "cpu":
        assert torch.equal(int4_linear(x, w), int4_linear_reference(x, w))


# --- on a GPU --------------------------------------------------------------------------------
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _gpu_weight(n: int, k: int, seed: int) -> Int4Weight:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.uint8)
    scales = (torch.rand((n, k // 128), generator=gen, device="cuda") * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (n, k // 128), generator=gen, device="cuda", dtype=torch.uint8)
    interleave = interleave_for(n, k, 128)
    return Int4Weight(pack_rows(codes, interleave), scales, zeros, 128, interleave)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 300])
def test_gpu_int4_llama_shapes(shape, m):
    """bf16: the decode kernel (m <= 16, split-K; gate/up with its SiLU-and-mul epilogue), its
    row tiles (64: K split by the rule but on gate/up; 256) and the dequantise + cuBLAS path
    (300) against the reference within bf16 roundings; deterministic; the same inside a CUDA
    graph."""
    n, k = LLAMA_8B[shape]
    silu = shape == "gate_up"
    w = _gpu_weight(n, k, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    run = (lambda: int4_linear_silu_and_mul(x, w)) if silu else (lambda: int4_linear(x, w))
    out = run()
    ref = (x.float() @ dequantize_int4(w, torch.bfloat16).float().t()).bfloat16()
    ref = silu_and_mul(ref) if silu else ref
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(out, run())  # deterministic split-K
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.gpu
@pytest.mark.parametrize("w_left", [False, True], ids=["x-left", "w-left"])
@pytest.mark.parametrize("shape", ["qkv", "gate_up"])
def test_gpu_int4_mid_m_row_tiles_and_split_k(shape, w_left):
    """100 rows (uneven) at the engine's layout, every row tile of 16-128 that fits the shared
    memory (at the most stages from 4 that do), K whole and split in 4, either operand on
    the left: within bf16 roundings of the reference and of the unsplit result; the
    split launch deterministic (its counters reset)."""
    n, k = LLAMA_8B[shape]
    silu = shape == "gate_up"
    w = _gpu_weight(n, k, seed=100)
    x = torch.randn(100, k, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ dequantize_int4(w, torch.bfloat16).float().t()).bfloat16()
    ref = silu_and_mul(ref) if silu else ref
    ops = Operands(w.interleave, 8 // plane_groups(128, k, w.interleave), 2, 2, silu)
    # The device's shared workspace holds what the rule splits; a split of the 8B's gate/up
    # at 100 rows (which the rule never picks) needs partials of its own.
    workspace = SkinnyWorkspace(torch.device("cuda"), partial_capacity=4 * 100 * n)
    ran = 0
    for block_m in (16, 32, 64, 128):
        fit = fit_shared_memory(W4Config(64, 1, 4, 4, w_left=w_left, block_m=block_m), 100, ops,
                                torch.device("cuda"))
        if fit is None:
            continue
        split_config = fit[0]._replace(split_k=4)
        unsplit = w4a16_gemm(x, w, silu_mul=silu, config=fit[0])
        split = w4a16_gemm(x, w, silu_mul=silu, config=split_config, workspace=workspace)
        torch.testing.assert_close(unsplit.float(), ref.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(split.float(), unsplit.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(split, w4a16_gemm(x, w, silu_mul=silu, config=split_config,
                                             workspace=workspace))
        ran += 1
    assert ran >= 2


VARIANTS = {"dot": {}, "w_left": dict(w_left=True), "fma": dict(dot=False),
            "fma_bits": dict(dot=False, round_bits=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [16, 32, 64, 128])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m", [1, 2, 16])
def test_gpu_int4_variants_and_layouts(interleave, variant, m):
    """Every product variant at every interleave the sweep tries (multiply-and-sum at up to 2
    rows, as the sweep), 8B gate/up with SiLU-and-mul and split-K, in bf16, at 4 stages or the
    most that fit the shared memory (W = 128: fewer): within bf16 roundings of the reference;
    the bf16 weight rounding bit for bit (one-hot rows)."""
    if variant.startswith("fma") and m > 2:
        pytest.skip("the sweep times multiply-and-sum at up to 2 rows")
    n, k = LLAMA_8B["gate_up"]
    base = _gpu_weight(n, k, seed=interleave)
    w = base._replace(qweight=pack_rows(unpack_rows(base.qweight, base.interleave), interleave),
                      interleave=interleave)
    config = W4Config(block_n=32 if variant.startswith("fma") else 64, split_k=2, num_warps=4,
                      num_stages=4, **VARIANTS[variant])
    per_group = plane_groups(128, k, interleave)
    config, _ = fit_shared_memory(config, m, Operands(interleave, 8 // per_group, 2, 2, True),
                                  torch.device("cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = w4a16_gemm(x, w, silu_mul=True, config=config)
    ref = silu_and_mul((x.float() @ dequantize_int4(w, torch.bfloat16).float().t()).bfloat16())
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    picks = torch.arange(m, device="cuda") * 97
    one_hot = F.one_hot(picks, k).to(torch.bfloat16)
    config, _ = fit_shared_memory(config, m, Operands(interleave, 8 // per_group, 2, 2, False),
                                  torch.device("cuda"))
    exact = w4a16_gemm(one_hot, w, config=config)
    assert torch.equal(exact, dequantize_int4(w, torch.bfloat16)[:, picks].t())


@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [64, 128])
@pytest.mark.parametrize("shape", ["qkv", "gate_up"])
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_gpu_int4_wide_layouts_launch_as_the_engine_does(interleave, shape, m):
    """The layouts a tuned table may give a weight (the H100's put W = 64 on qkv, o and down),
    at every kind of row tile, through the engine's entry (the rule's configs fitted to the
    shared memory; the 8B AWQ engine failed at 64 rows with W = 64): within bf16 roundings."""
    n, k = LLAMA_8B[shape]
    silu = shape == "gate_up"
    base = _gpu_weight(n, k, seed=m)
    w = base._replace(qweight=pack_rows(unpack_rows(base.qweight, base.interleave), interleave),
                      interleave=interleave)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = int4_linear_silu_and_mul(x, w) if silu else int4_linear(x, w)
    ref = (x.float() @ dequantize_int4(w, torch.bfloat16).float().t()).bfloat16()
    torch.testing.assert_close(out.float(), (silu_and_mul(ref) if silu else ref).float(),
                               rtol=2e-2, atol=2e-2)


# --- compiled for Hopper (no GPU needed) -----------------------------------------------------------

# That Triton compiles the W4A16 kernels for an H100 (the unpacking reshape, bf16 tensor cores),
# in a child process without TRITON_INTERPRET: the launches the engine and the sweep make, taken
# from the launching functions (tests/int4_sm90_launches.py), as few as take every value of every
# argument and every pair of code-path values they combine (`code_path`), and per way of staging operands the one of most shared memory
# by the model the launches are fitted by: each within an H100's shared memory and the model's
# (a launch over it compiles and fails only when loaded). This venv's Triton only: before a GPU
# run, compile all of them under the GPU machines' Triton as well (docs/architecture.md, INT4).
_COMPILE_INT4_FOR_SM90 = """
from int4_sm90_launches import (
    code_path, compile_all, covering, engine_launches, sweep_launches, tightest, unique_launches)
launches = engine_launches() + sweep_launches()
launches = unique_launches(covering(launches, code_path) + tightest(launches))
for launch, shared in zip(launches, compile_all(launches)):
    print("compiled", launch.name(), "shared", shared)
print(len(launches), "launches")
"""


def test_int4_kernels_compile_for_hopper():
    import subprocess
    import sys

    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_INT4_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled ")]
    assert done.stdout.endswith(f"\n{len(compiled)} launches\n") and len(compiled) > 20
    for part in ("DOT=True W_LEFT=True", "DOT=True W_LEFT=False", "FMA_DEQUANT=False",
                 "DOT=False W_LEFT=False FMA_DEQUANT=True ROUND_BITS=False",
                 "DOT=False W_LEFT=False FMA_DEQUANT=True ROUND_BITS=True", "SILU_MUL=True",
                 "HAS_BIAS=True", "BLOCK_M=64", "PLANES_PER_GROUP=1", "PLANES_PER_GROUP=2",
                 "PLANES_PER_GROUP=4", "PLANES_PER_GROUP=8", "_dequantize_kernel", "BLOCK_M=32",
                 "BLOCK_M=128", "BLOCK_M=256",  # mid M: wide tiles
                 "PAIRED=asm"):  # the decode sizes' paired dequantisation (int4_gemm.PAIRED_DEQUANT)
        assert any(part in line for line in compiled), part
    assert any(re.search(r"SPLIT_K=[2-9]\d* BLOCK_M=(32|64) ", line) for line in compiled), \
        "split-K over mid-M row tiles"
    # the launches nearest the limit were among them
    assert max(int(line.rsplit(" ", 1)[1]) for line in compiled) > H100_SHARED_MEMORY * 3 // 4
