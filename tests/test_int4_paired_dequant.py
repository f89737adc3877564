"""The W4A16 kernel's paired dequantisation (`W4Config.paired_dequant`, layers/int4_gemm.py's
`_paired_planes`: two weights a 32-bit instruction) against the reference, bit for bit.

In the interpreter on the CPU (its pure-Triton form, the same 16-bit values as the inline asm):
the pair planes alone (a test kernel around the kernel's helpers) for bf16, fp16, and bf16 with
fp16 scales (AWQ's: split in two bf16 parts), every code and zero point 0..15, scales whose
products round (ties included), are subnormal, overflow or are negative; the whole kernel in
fp16 (the interpreter's bf16 tl.dot is wrong) at group sizes 32, 64 and 128, interleaves 16 and
32, either operand on the left, split-K, a bias, the SiLU-and-mul pair and mid-M row tiles;
where the pairing is not exact (fp32 activations, bf16 scales with fp16 x) the kernel takes its
fma dequantisation, and a paired multiply-and-sum config is refused; the default switch.
Marked `gpu`: the inline asm on the same edge cases and on the Llama-8B shapes at 1, 4 and 16
rows (bf16, fp16, bf16 with fp16 scales), in a CUDA graph too. Compiled for sm_90 without a GPU
(a child process): the asm's 16-bit x2 instructions, fewer instructions a weight in the loop
than today's config, the shared memory within the model's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specserve.engine.layers import int4_gemm  # noqa: E402
from specserve.engine.layers.activation import silu_and_mul  # noqa: E402
from specserve.engine.layers.int4_gemm import (  # noqa: E402
    Int4Weight, W4Config, _pair_terms, _paired_planes, dequantize_int4, int4_linear,
    int4_linear_silu_and_mul, interleave_for, pack_rows, paired_dequant_exact, w4a16_gemm)
from test_int4_kernels import DEVICE, _workspace, int4_weight, rows  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@triton.jit
def _pair_planes_kernel(qweight, scales, zeros, out, n_groups, group_size,
                        ROWS: tl.constexpr, WORDS: tl.constexpr, PAIRED: tl.constexpr):
    """Every pair plane of a [ROWS, 8 WORDS] weight (one block) stored in the pair planes'
    column order: out[r, 2 WORDS p + 2 w + h] is plane p + 4 h, column w."""
    offs_r = tl.arange(0, ROWS)
    packed = tl.load(qweight + offs_r[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    offs_out = tl.arange(0, 2 * WORDS)
    dtype = out.dtype.element_ty
    for p in tl.static_range(4):
        terms = _pair_terms(scales, zeros, offs_r, (p * WORDS) // group_size,
                            ((p + 4) * WORDS) // group_size, n_groups, dtype)
        pair = _paired_planes(packed, p, *terms, dtype, scales.dtype.element_ty != dtype, PAIRED)
        tl.store(out + offs_r[:, None] * 8 * WORDS + p * 2 * WORDS + offs_out[None, :], pair)


def _pair_planes(w: Int4Weight, dtype: torch.dtype, mode: str) -> torch.Tensor:
    """The dequantised weight [N, 8 W] by `_paired_planes`, back in the codes' column order."""
    n, k = w.shape
    words = w.interleave
    assert k == 8 * words, "one block a row"
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    _pair_planes_kernel[(1,)](w.qweight, w.scales, w.zeros, out, w.scales.shape[1], w.group_size,
                              ROWS=n, WORDS=words, PAIRED=mode)
    # column 2 W p + 2 w + h of out is code W (p + 4 h) + w
    p, w_, h = torch.meshgrid(torch.arange(4), torch.arange(words), torch.arange(2), indexing="ij")
    codes = (words * (p + 4 * h) + w_).reshape(-1).to(out.device)
    return torch.empty_like(out).index_copy_(1, codes, out)


def _edge_scales(dtype: torch.dtype, n: int, groups: int) -> torch.Tensor:
    """Scales [n, groups] whose products by q - z in -15..15 round (every mantissa bit set:
    products of odd q - z need more bits than the dtype has), round a tie to even (1 + eps:
    3 (1 + eps) has one bit too many, a 1), are subnormal, overflow, or are negative (-0.5:
    a zero product is -0), plus plain ones."""
    info = torch.finfo(dtype)
    special = torch.tensor([info.max / 4, info.max, info.tiny, info.tiny * 2 ** -3,
                            info.smallest_normal / 3, -0.3, -0.5, -info.max / 8, 1.0,
                            1 + info.eps], dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    full = torch.rand(n * groups, generator=gen, dtype=torch.float64) * 2 + 0.5
    full = (full.to(dtype).view(torch.int16) | 0x7F if dtype == torch.bfloat16
            else full.to(dtype).view(torch.int16) | 0x3FF).view(dtype)  # every mantissa bit
    full[:len(special)] = special.to(dtype)
    return full.view(n, groups)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the inf products
@pytest.mark.parametrize("mode", ["emulated", pytest.param("asm", marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float16)],
                         ids=["bf16", "fp16", "bf16-fp16-scales"])
@pytest.mark.parametrize("words,group", [(16, 128), (16, 32), (32, 64), (32, 32)],
                         ids=["one-group", "pairs-of-groups", "two-groups", "a-group-a-plane"])
def test_pair_planes_are_the_reference_bit_for_bit(mode, dtype, scale_dtype, words, group):
    """Every code (each row holds 0..15 in every plane) against every zero point (16 rows a
    zero each, per group), on scales whose products round (ties included), are subnormal,
    overflow (where the dtype's range allows: not with fp16 scales and bf16 x, whose scales
    are split in two) or are negative: `_paired_planes` equals `dequantize_int4` rounded to
    dtype, bit for bit (signed zeros and infinities included). Blocks in one group, two,
    four (a group per pair of planes) or eight."""
    device = torch.device("cuda" if mode == "asm" else "cpu")
    n, k = 64, 8 * words
    groups = k // group
    codes = (torch.arange(k)[None, :] + torch.arange(n)[:, None] * 5) % 16
    zeros = ((torch.arange(n)[:, None] + 3 * torch.arange(groups)[None, :]) % 16).to(torch.uint8)
    w = Int4Weight(pack_rows(codes, words).to(device), _edge_scales(scale_dtype, n, groups).to(device),
                   zeros.to(device), group, words)
    expected = dequantize_int4(w, dtype)
    assert (expected.view(torch.int16) == -32768).any()  # -0: q = z with a negative scale
    assert not torch.equal(expected.float(), dequantize_int4(w))  # rounded
    if scale_dtype == dtype:
        subnormal = (expected != 0) & (expected.abs() < torch.finfo(dtype).smallest_normal)
        assert expected.isinf().any() and subnormal.any()
    out = _pair_planes(w, dtype, mode)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_the_pairing_is_exact_for_16_bit_activations_and_scales_of_their_dtype_or_fp16():
    assert paired_dequant_exact(torch.bfloat16, torch.bfloat16)
    assert paired_dequant_exact(torch.float16, torch.float16)
    assert paired_dequant_exact(torch.bfloat16, torch.float16)  # AWQ's fp16 scales, bf16 x
    assert not paired_dequant_exact(torch.float16, torch.bfloat16)  # outside fp16's range
    assert not paired_dequant_exact(torch.float32, torch.float32)
    assert not paired_dequant_exact(torch.float32, torch.float16)


N, K = 72, 256
PAIRED = W4Config(block_n=32, split_k=1, num_warps=4, num_stages=2, paired_dequant=True)


PLAIN, BIAS, SILU = (1, 1, False, "plain"), (2, 5, True, "bias"), (4, 3, False, "silu_mul")


@pytest.mark.parametrize("group,interleave,split_k,m,w_left,epilogue", [
    (32, 32, *PLAIN), (128, 16, *PLAIN), (64, 16, *BIAS), (32, 16, *BIAS), (128, 32, *SILU),
    (32, 32, *SILU), (128, 16, *SILU)],
    ids=["g32-w32-m1", "g128-w16-m1", "g64-w16-m5-w-left-split2-bias",
         "g32-w16-m5-w-left-split2-bias", "g128-w32-m3-split4-silu-mul",
         "g32-w32-m3-split4-silu-mul", "g128-w16-m3-split4-silu-mul"])
def test_paired_kernel_fp16_equals_the_reference_bit_for_bit(group, interleave, split_k, m, w_left,
                                                             epilogue):
    """fp16 activations and scales (powers of two and small-integer rows: exact sums, so the
    output is the reference's bit for bit): a group a plane (group 32 at W = 32), a group per
    two planes, four, and one over the block (group 128 at W = 16), each plain, with split-K
    (its counters left at zero), a bias and x on the right, or the gate/up pair's
    SiLU-and-mul."""
    silu = epilogue == "silu_mul"
    n_rows = 2 * N if silu else N
    w = int4_weight(n_rows, K, group, seed=group + interleave, interleave=interleave)
    x = rows(m, K, seed=m, dtype=torch.float16) / (16 if silu else 1)
    bias = ((torch.randint(-8, 9, (n_rows,), generator=torch.Generator().manual_seed(3)) / 4)
            .to(DEVICE, torch.float16) if epilogue == "bias" else None)
    workspace = _workspace()
    out = w4a16_gemm(x, w, bias, silu_mul=silu, workspace=workspace,
                     config=PAIRED._replace(split_k=split_k, w_left=w_left))
    assert not workspace.arrivals.any()
    reference = F.linear(x.double(), dequantize_int4(w, torch.float16).double(),
                         None if bias is None else bias.double()).to(torch.float16)
    assert torch.equal(out, silu_and_mul(reference) if silu else reference)


def test_paired_kernel_rounds_each_weight_as_the_reference():
    """Scales with every mantissa bit set (the products round) and rows of x picking one column
    each: the output is one dequantised weight each, the reference's bit for bit."""
    w = int4_weight(N, K, 64, seed=8, interleave=32, scales=_edge_scales(torch.float16, N, K // 64)
                    .clamp(-4, 4))
    picks = torch.tensor([0, 3, 17, 64, 130, 255])
    x = F.one_hot(picks, K).to(torch.float16).to(DEVICE)
    out = w4a16_gemm(x, w, config=PAIRED._replace(split_k=2), workspace=_workspace())
    expected = dequantize_int4(w, torch.float16)[:, picks.to(DEVICE)].t()
    assert not torch.equal(expected.float(), dequantize_int4(w)[:, picks.to(DEVICE)].t())  # rounded
    assert torch.equal(out, expected)


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu_mul"])
def test_paired_kernel_mid_m_row_tiles(silu):
    """40 rows in row tiles of 32 (the second partial), K split in 2, fp16: bit for bit."""
    n_rows = 2 * N if silu else N
    w = int4_weight(n_rows, K, 32, seed=21, interleave=16)
    x = rows(40, K, seed=22, dtype=torch.float16) / 16
    out = w4a16_gemm(x, w, silu_mul=silu, workspace=_workspace(),
                     config=PAIRED._replace(split_k=2, block_m=32))
    reference = F.linear(x.double(), dequantize_int4(w, torch.float16).double()).to(torch.float16)
    assert torch.equal(out, silu_and_mul(reference) if silu else reference)


@pytest.mark.parametrize("x_dtype,scale_dtype", [(torch.float32, torch.float16),
                                                 (torch.float16, torch.bfloat16)],
                         ids=["fp32-rows", "bf16-scales-fp16-rows"])
def test_paired_config_where_not_exact_takes_the_fma_dequantisation(monkeypatch, x_dtype,
                                                                     scale_dtype):
    """Where the pairing would round (`paired_dequant_exact`), a paired config launches the
    kernel unpaired (PAIRED off) and still equals the reference."""
    launched = []
    kernel = int4_gemm._w4a16_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["PAIRED"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(int4_gemm, "_w4a16_kernel", Recorder())
    w = int4_weight(N, K, 64, seed=4, scale_dtype=scale_dtype)
    x = rows(2, K, seed=5, dtype=x_dtype)
    out = w4a16_gemm(x, w, config=PAIRED)
    reference = F.linear(x.double(), dequantize_int4(w, x_dtype).double()).to(x_dtype)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    w_exact = int4_weight(N, K, 64, seed=4, scale_dtype=torch.float16)
    w4a16_gemm(rows(2, K, seed=5, dtype=torch.float16), w_exact, config=PAIRED)
    assert launched == ["off", "asm" if DEVICE.type == "cuda" else "emulated"]


def test_the_default_switch_pairs_decode_configs_on_tl_dot_only(monkeypatch):
    """`PAIRED_DEQUANT` off: no default config pairs but a tuned one swept paired
    (`--sweep-paired-dequant`); on: the decode-sized ones (the rule's and a tuned one, up to
    16 rows) do, mid-M ones (not timed) and multiply-and-sum ones do not."""
    cpu = torch.device("cpu")

    def configs():
        int4_gemm.default_w4_config.cache_clear()
        return [int4_gemm.default_w4_config(m, n, 4096, 128, device=cpu) for m, n in
                ((1, 4096), (16, 1024), (64, 4096), (2, 999), (1, 998))]

    monkeypatch.setitem(int4_gemm.TUNED_W4_CONFIGS, (2, 999, 4096, 128, False),
                        W4Config(32, 1, 4, 2, dot=False)._asdict())
    monkeypatch.setitem(int4_gemm.TUNED_W4_CONFIGS, (1, 998, 4096, 128, False),
                        W4Config(64, 1, 4, 4, paired_dequant=True)._asdict())
    monkeypatch.setattr(int4_gemm, "PAIRED_DEQUANT", False)
    try:
        assert [c.paired_dequant for c in configs()] == [False] * 4 + [True]
        monkeypatch.setattr(int4_gemm, "PAIRED_DEQUANT", True)
        assert [c.paired_dequant for c in configs()] == [True, True, False, False, True]
    finally:
        int4_gemm.default_w4_config.cache_clear()


def test_a_paired_multiply_and_sum_config_is_refused():
    with pytest.raises(AssertionError, match="paired_dequant: on tl.dot only"):
        w4a16_gemm(rows(1, K, 0, torch.float16), int4_weight(N, K, 32, 0),
                   config=PAIRED._replace(dot=False))


# --- on a GPU --------------------------------------------------------------------------------
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _gpu_weight(n: int, k: int, dtype: torch.dtype, seed: int) -> Int4Weight:
    """Random codes and zero points, scales of `dtype` (most of their mantissa bits set), at
    the engine's layout."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.uint8)
    scales = (torch.rand((n, k // 128), generator=gen, device="cuda") * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // 128), generator=gen, device="cuda", dtype=torch.uint8)
    interleave = interleave_for(n, k, 128)
    return Int4Weight(pack_rows(codes, interleave), scales, zeros, 128, interleave)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float16)],
                         ids=["bf16", "fp16", "bf16-awq-fp16-scales"])
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_paired_asm_on_llama_shapes(shape, m, dtype, scale_dtype):
    """The inline asm at the engine's layout and config (paired): one-hot rows give every
    picked weight bit for bit; random rows within 16-bit roundings of the reference and of the
    unpaired kernel; deterministic; the same inside a CUDA graph."""
    n, k = LLAMA_8B[shape]
    silu = shape == "gate_up"
    w = _gpu_weight(n, k, scale_dtype, seed=m)
    config = int4_gemm.default_w4_config(m, n // 2 if silu else n, k, 128, silu)
    paired = config._replace(paired_dequant=True)
    picks = torch.arange(m, device="cuda") * 251 % k
    one_hot = F.one_hot(picks, k).to(dtype)
    weight = dequantize_int4(w, dtype)
    exact = w4a16_gemm(one_hot, w, config=paired)
    assert torch.equal(exact.view(torch.int16), weight[:, picks].t().contiguous().view(torch.int16))
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    run = lambda: w4a16_gemm(x, w, silu_mul=silu, config=paired)  # noqa: E731
    out = run()
    ref = (x.float() @ weight.float().t()).to(dtype)
    ref = silu_and_mul(ref) if silu else ref
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    unpaired = w4a16_gemm(x, w, silu_mul=silu, config=config)
    torch.testing.assert_close(out.float(), unpaired.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(out, run())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.gpu
@gpu
def test_gpu_engine_entry_with_the_paired_default(monkeypatch):
    """With the one-line switch on (`PAIRED_DEQUANT`), the engine's entries take the paired
    kernel: bf16 x with AWQ's fp16 scales at 1 row equals the reference within roundings."""
    monkeypatch.setattr(int4_gemm, "PAIRED_DEQUANT", True)
    int4_gemm.default_w4_config.cache_clear()
    try:
        for shape in ("o", "gate_up"):
            n, k = LLAMA_8B[shape]
            w = _gpu_weight(n, k, torch.float16, seed=3)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = int4_linear_silu_and_mul(x, w) if shape == "gate_up" else int4_linear(x, w)
            ref = (x.float() @ dequantize_int4(w, torch.bfloat16).float().t()).bfloat16()
            ref = silu_and_mul(ref) if shape == "gate_up" else ref
            torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    finally:
        int4_gemm.default_w4_config.cache_clear()


# --- compiled for Hopper (no GPU needed) -----------------------------------------------------------

_COMPILE_PAIRED_FOR_SM90 = """
import json
import torch
from int4_sm90_launches import modelled_shared_memory
from sm90_sass import loop_opcodes, w4_per_weight, w4a16_launch
from specserve.engine.layers.int4_gemm import W4Config

today = W4Config(64, 4, 4, 4)  # the H100's tuned o_proj config at M = 1
paired = today._replace(paired_dequant=True)
bf16, f16 = torch.bfloat16, torch.float16
for config, dtype, scale_dtype in ((today, bf16, bf16), (paired, bf16, bf16), (paired, f16, f16),
                                   (paired, bf16, f16)):
    compiled, launch = w4a16_launch(1, 4096, 4096, False, config, dtype, scale_dtype)
    ptx = compiled.asm["ptx"]
    print(json.dumps(dict(paired=launch.args["PAIRED"],
                          per_weight=w4_per_weight(loop_opcodes(compiled), launch),
                          bf16x2=ptx.count("fma.rn.bf16x2"), f16x2=ptx.count("fma.rn.f16x2"),
                          fits=compiled.metadata.shared <= modelled_shared_memory(launch))))
"""


def test_paired_kernel_compiles_for_hopper_with_fewer_instructions_a_weight():
    """8B o_proj at M = 1 on the H100's tuned tiles, compiled for sm_90 (this venv's Triton),
    bf16, fp16, and bf16 x with fp16 scales: each paired launch's PTX has its asm's x2 fmas
    (of its dtype, not the other's; three a pair with split scales, two else), its loop
    fewer warp instructions a weight than the unpaired one (tests/sm90_sass.py), and every
    launch's shared memory within the model's."""
    import json
    import subprocess
    import sys

    from sm90_compile import compile_env

    done = subprocess.run([sys.executable, "-c", _COMPILE_PAIRED_FOR_SM90], env=compile_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    today, bf16, f16, split = launches
    assert [r["paired"] for r in launches] == ["off", "asm", "asm", "asm"]
    assert [(r["bf16x2"] > 0, r["f16x2"] > 0) for r in launches] == \
        [(False, False), (True, False), (False, True), (True, False)]
    assert split["bf16x2"] * 2 == bf16["bf16x2"] * 3  # an fma more a pair: d tail
    assert all(r["fits"] for r in launches)
    assert max(r["per_weight"] for r in (bf16, f16, split)) < today["per_weight"]
