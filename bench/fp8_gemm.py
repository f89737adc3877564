"""FP8- and INT4-weight GEMMs against bf16 at Llama-8B and DeepSeek-V3 shapes: microseconds,
GB/s, % of copy bandwidth, TFLOP/s, and each quantized variant's error.

    python bench/fp8_gemm.py --out bench_fp8_gemm.json
    python bench/fp8_gemm.py --shapes 8b.qkv,8b.down --rows 1,16 --no-moe --out quick.json
    python bench/fp8_gemm.py --variants w8a16 --shapes 8b.qkv,8b.o,8b.gate_up,8b.down \
        --rows 1,4,16 --no-moe --out fp8_convert.json   # "bits" against "cast", beside bf16
    python bench/fp8_gemm.py --sweep --shapes 8b.qkv --rows 1,16 --no-moe --out sweep.json
    python bench/fp8_gemm.py --sweep --variants w4a16 --shapes 8b.qkv,8b.o,8b.gate_up,8b.down \
        --rows 1,16 --no-moe --int4-tuned int4_tuned.json      # then --install-int4 int4_tuned.json

Dense weights (one rank, 128x128 FP8 blocks as DeepSeek-style checkpoints have them), for each
M (rows: decode batch sizes up to 16, prefill chunks above), the variants that apply:

- `cublas_bf16`     F.linear on the bf16 weight (the FP8 weight dequantised)
- `skinny_bf16`     the 16-bit skinny GEMM on that weight (M <= 16)
- `w8a16_skinny`    the skinny GEMM reading the FP8 weight and its scales (M <= 16; the engine's,
                    its e4m3 values converted by Triton, `fp8_convert` "cast")
- `w8a16_skinny_bits` the same with `SkinnyConfig.fp8_convert="bits"` (sm_90: byte moves and one
                    bf16x2 multiply a pair, the same output bit for bit): if it leads, make it
                    the default (`fp8_convert.WEIGHT_FP8_CONVERT`)
- `w8a16_skinny_wide` the same with `SkinnyConfig.fp8_wide`: K steps of the 16-bit step's bytes
                    (512 FP8 columns over four 128-blocks, scales broadcast in registers); the
                    rule's since an H100 run (`skinny_gemm.FP8_WIDE_STEPS`), so now the same as
                    `w8a16_skinny`; `w8a16_skinny_wide_bits` with "bits"
- `w8a16_f16`       the skinny GEMM on fp16 products (`SkinnyConfig.fp8_f16`: e4m3 -> fp16 in
                    one conversion a pair, x scaled into fp16 by a power of two a row, scales
                    after each step's dot) with the weight on the left (`w_left`: wgmma takes it
                    from registers), `fp8_f16_config`'s tiles of 128 rows: if it leads, set
                    `skinny_gemm.FP8_F16_PRODUCTS = True`. Around it: `_n64` (64-row tiles),
                    `_n256` (256-row tiles in 8 warps: half the x work a weight),
                    `_w8` (8 warps), `_split_x2` and `_split_half` (the rule's split-K doubled and
                    halved), `_stages6`, `_xleft`
                    (x on the left over 64 columns)
- `w8a8_skinny`     its `fp8_activations` option: x quantised per 128-column group, FP8 dot
- `w8a8_triton`     the large-M block-scaled kernel, quantiser included (`fp8_matmul` on CUDA)
- `scaled_mm_block` torch._scaled_mm with 1x128 activation and 128x128 weight scales, the
                    quantiser included (where this torch/cuBLAS supports it)
- `scaled_mm_row`   torch._scaled_mm rowwise: the weight re-quantised per channel, x per token
                    in torch (another checkpoint format: its error is not comparable)
- `w4a16_kernel`    INT4 (group 128, AWQ/GPTQ's usual) by the W4A16 kernel (layers/int4_gemm.py:
                    split-K at M <= 16, row tiles of 64 up to 256; the engine's there); its
                    error is against its own dequantised weight
- `w4a16_dequant`   INT4 by the dequantise kernel, then cuBLAS (the engine's above 256 rows)
- `w4a16_paired`    the W4A16 kernel at the engine's config with `W4Config.paired_dequant`
                    (two weights a 32-bit instruction; M <= 16; fp16 scales, AWQ's, with bf16
                    x: each scale split in two bf16 parts, three x2 fmas a pair): if it leads,
                    set `int4_gemm.PAIRED_DEQUANT = True`. Around it: `_swapped` (the other
                    operand on the left, at its tiles), `_wleft_n128` and `_n128`
                    (128-column tiles, the weight or x on the left), `_split_x2` and
                    `_split_half` (the split-K doubled and halved), `_w8` (8 warps),
                    `_bf16_scales` (the engine's config on bf16 scales, the same bytes: two
                    fmas a pair). On gate/up also `w4a16_kernel_silu` and `w4a16_paired*_silu`:
                    the fused weight with its SiLU-and-mul epilogue, as the engine runs it

Each variant runs as the engine runs it, replayed from one CUDA graph of at least 20 calls
cycling through enough weight copies (>= 128 MiB) that none is in L2 when read again (see
bench/skinny_gemm.py). Bytes = weight + scales + x + y; `copy%` is GB/s over the device copy
bandwidth measured in this run. `err` is the relative (Frobenius) error of one call's output
against the fp32 product of x and the dequantised FP8 weight (the bf16 variants: against the
same, i.e. their own rounding); W8A16 and W8A8 are compared at equal accuracy by it.

The MoE part: DeepSeek-V3's routed experts (256 experts, top-8, hidden 7168, intermediate
2048; 11 GB in FP8), the Triton fused MoE with bf16 experts against FP8 (W8A16) experts, new
random routing each call; bytes are the experts a call touches.

A variant that fails prints its error and the rest go on. The last table summarises.
`--variants` keeps the variants named by prefix (and the bf16 ones, to compare with).
`--sweep` (long: split it over runs with --shapes/--rows) also searches, at M <= 16, W8A16
skinny configs (bench/skinny_gemm.py's coordinate descent from the default), and at M <= 256
W4A16 kernel configs and layouts (bench/int4_sweep.py's two stages; row tiles above 16 rows),
and prints the best three per shape and
M. The W4A16 winners are printed as a table beside bf16 and the rule, and written as JSON
(`--int4-tuned`); `--install-int4 JSON` writes them into engine/layers/int4_tuned.py, the
kernel's tuned tables.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F

import int4_sweep  # bench/ is this script's folder
from one_batch import copy_bandwidth
from skinny_gemm import MIN_CALLS, ROTATION_BYTES, config_name, sweep, time_per_call
from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.layers.fused_moe_triton import fused_experts
from specserve.engine.layers.skinny_gemm import (
    MAX_ROWS, default_config, fp8_f16_config, fp8_weight_config, skinny_gemm)
from specserve.engine.layers.fp8_weight import (
    FP8_DTYPE, FP8_MAX, WeightScale, dequantize, expand_scale, scale_grid_shape)
from specserve.engine.layers.fp8_gemm import block_scaled_matmul, quantize_activations
from specserve.engine.layers.int4_gemm import (
    PACK, TILED_MAX_ROWS, Int4Weight, default_w4_config, dequantize_int4, dequantize_int4_gpu,
    fit_shared_memory, interleave_for, pack_rows, plane_groups, split_for, w4a16_gemm)
from specserve.engine.layers.int4_shared_memory import Operands

SHAPES = {  # name: (N, K) of the weight
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    # DeepSeek-V3: a shared expert's (and each routed expert's) gate/up and down, the MLA q_b
    "v3.expert_gate_up": (4096, 7168), "v3.expert_down": (7168, 2048), "v3.q_b": (24576, 1536),
    # Llama 70B at tp=2: one rank's fused q/k/v (64 + 2 x 8 heads of 128, halved), o, gate/up, down
    "70b_tp2.qkv": (5120, 8192), "70b_tp2.o": (8192, 4096), "70b_tp2.gate_up": (28672, 8192),
    "70b_tp2.down": (8192, 14336),
}
BLOCK = (128, 128)
INT4_GROUP = 128
MOE = dict(experts=256, top_k=8, hidden=7168, inter=2048)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, WeightScale]:
    """w [N, K] -> FP8 in (block_n, block_k) blocks, scale = amax / 448."""
    n, k = w.shape
    gn, gk = scale_grid_shape(n, k, *block)
    padded = F.pad(w.float(), (0, gk * block[1] - k, 0, gn * block[0] - n))
    amax = padded.view(gn, block[0], gk, block[1]).abs().amax(dim=(1, 3))
    scale = WeightScale(amax.clamp(min=1e-12) / FP8_MAX, *block)
    return (w.float() / expand_scale(scale, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (token or channel) scales [rows, 1] in torch: _scaled_mm's rowwise operands."""
    s = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


class Weights:
    """Copies of one FP8 weight (and its bf16 dequantisation) cycled through by the calls."""

    def __init__(self, n: int, k: int, device, with_rowwise: bool):
        copies = max(1, -(-ROTATION_BYTES // (n * k)))  # FP8 bytes; bf16 copies are twice that
        self.fp8, self.bf16, self.rowwise = [], [], []
        for _ in range(copies):
            w8, scale = quantize_blocks(torch.randn(n, k, device=device) * 0.02, BLOCK)
            self.fp8.append((w8, scale))
            self.bf16.append(dequantize(w8, scale, torch.bfloat16))
            if with_rowwise:
                w8_row, s_row = quantize_rows_torch(self.bf16[-1])
                self.rowwise.append((w8_row.t(), s_row.t().contiguous()))  # [K, N] column-major
        # INT4 copies: half FP8's bytes each, so twice as many rotate through L2.
        self.int4 = [random_int4(n, k, device) for _ in range(2 * copies)]
        self._int4_layouts = {self.int4[0].interleave: self.int4}
        # the same with bf16 scales (`w4a16_paired_bf16_scales`: no split scales)
        self.int4_bf16_scales = [w._replace(scales=w.scales.bfloat16()) for w in self.int4]
        self.n, self.k = n, k
        self.scale_bytes = self.fp8[0][1].values.numel() * 4
        self.int4_extra_bytes = n * (k // INT4_GROUP) * 3  # fp16 scales and uint8 zeros

    def int4_at(self, interleave: int) -> list[Int4Weight]:
        """The INT4 copies with their codes interleaved in blocks of 8 * interleave (made once)."""
        if interleave not in self._int4_layouts:
            self._int4_layouts[interleave] = [int4_sweep.relayout(w, interleave) for w in self.int4]
        return self._int4_layouts[interleave]


def random_int4(n: int, k: int, device) -> Int4Weight:
    """Random codes, zero points and scales of a weight of std ~0.02 in group-128 INT4, in the
    layout the loader gives it (`interleave_for`)."""
    codes = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
    groups = k // INT4_GROUP
    words = interleave_for(n, k, INT4_GROUP)
    return Int4Weight(pack_rows(codes, words), torch.full((n, groups), 0.0043, device=device).half(),
                      torch.randint(6, 10, (n, groups), device=device, dtype=torch.uint8), INT4_GROUP,
                      words)


def dense_variants(m: int, n: int, k: int, gate_up: bool = False) -> dict[str, tuple[str, Callable]]:
    """name -> (weight kind, op(x, weight)) for the variants that apply at this M (`gate_up`: the
    W4A16 kernel's `_silu` variants too, the fused weight with its epilogue)."""
    ops: dict[str, tuple[str, Callable]] = {"cublas_bf16": ("bf16", lambda x, w: F.linear(x, w))}
    if m <= MAX_ROWS:
        w8a8 = fp8_weight_config(default_config(m, n, k, False, torch.device("cuda"))
                                 ._replace(fp8_activations=True), BLOCK[1], k)
        ops["skinny_bf16"] = ("bf16", lambda x, w: skinny_gemm(x, w))
        ops["w8a16_skinny"] = ("fp8", lambda x, w: skinny_gemm(x, w[0], scale=w[1]))
        bits = default_config(m, n, k, False, torch.device("cuda"), fp8=True)._replace(fp8_convert="bits")
        ops["w8a16_skinny_bits"] = ("fp8", lambda x, w: skinny_gemm(x, w[0], config=bits, scale=w[1]))
        wide = default_config(m, n, k, False, torch.device("cuda"))._replace(fp8_wide=True)
        ops["w8a16_skinny_wide"] = ("fp8", lambda x, w: skinny_gemm(x, w[0], config=wide, scale=w[1]))
        wide_bits = wide._replace(fp8_convert="bits")
        ops["w8a16_skinny_wide_bits"] = ("fp8", lambda x, w: skinny_gemm(x, w[0], config=wide_bits,
                                                                          scale=w[1]))
        for name, config in f16_configs(m, n, k).items():
            ops[name] = ("fp8", lambda x, w, c=config: skinny_gemm(x, w[0], config=c, scale=w[1]))
        ops["w8a8_skinny"] = ("fp8", lambda x, w: skinny_gemm(x, w[0], config=w8a8, scale=w[1]))
    if m <= TILED_MAX_ROWS:
        ops["w4a16_kernel"] = ("int4", lambda x, w: w4a16_gemm(x, w))
    if m <= MAX_ROWS:
        paired = w4_paired_configs(m, n, k)
        for name, config in paired.items():
            ops[name] = ("int4", lambda x, w, c=config: w4a16_gemm(x, w, config=c))
        if "w4a16_paired" in paired:
            ops["w4a16_paired_bf16_scales"] = ("int4_bf16_scales", lambda x, w: w4a16_gemm(
                x, w, config=paired["w4a16_paired"]))
        if gate_up:  # as the engine runs it; `_silu` variants' err: against silu_and_mul
            ops["w4a16_kernel_silu"] = ("int4", lambda x, w: w4a16_gemm(x, w, silu_mul=True))
            for name, config in w4_paired_configs(m, n, k, silu=True).items():
                ops[name + "_silu"] = ("int4", lambda x, w, c=config: w4a16_gemm(
                    x, w, silu_mul=True, config=c))
    if m > MAX_ROWS:
        ops["w4a16_dequant"] = ("int4", lambda x, w: F.linear(x, dequantize_int4_gpu(w, x.dtype)))
    ops["w8a8_triton"] = ("fp8", lambda x, w: block_scaled_matmul(x, w[0], w[1]))
    ops["scaled_mm_block"] = ("fp8", scaled_mm_block)
    ops["scaled_mm_row"] = ("rowwise", scaled_mm_row)
    return ops


def f16_configs(m: int, n: int, k: int) -> dict:
    """The fp16-product variants (`w8a16_f16*`): the rule's config and its neighbours."""
    cuda = torch.device("cuda")
    rule = fp8_f16_config(m, n, k, False, cuda)
    return {"w8a16_f16": rule,
            "w8a16_f16_n64": fp8_f16_config(m, n, k, False, cuda, block_n=64),
            "w8a16_f16_n256": fp8_f16_config(m, n, k, False, cuda, block_n=256)._replace(num_warps=8),
            "w8a16_f16_w8": rule._replace(num_warps=8),
            "w8a16_f16_split_x2": rule._replace(split_k=2 * rule.split_k),
            "w8a16_f16_split_half": rule._replace(split_k=max(1, rule.split_k // 2)),
            "w8a16_f16_stages6": rule._replace(num_stages=6),
            "w8a16_f16_xleft": fp8_f16_config(m, n, k, False, cuda, block_n=64)._replace(w_left=False)}


def scaled_mm_block(x: torch.Tensor, w) -> torch.Tensor:
    """cuBLAS's blockwise FP8 GEMM: scale_a [M, K/128] (column-major, as cuBLAS reads it),
    scale_b [K/128, N/128] (the weight grid transposed)."""
    w8, scale = w
    x8, x_scales = quantize_activations(x)
    return torch._scaled_mm(x8, w8.t(), scale_a=x_scales.t().contiguous().t(),
                            scale_b=scale.values.t(), out_dtype=torch.bfloat16)


def scaled_mm_row(x: torch.Tensor, w) -> torch.Tensor:
    w8_t, s_w = w
    x8, s_x = quantize_rows_torch(x)
    return torch._scaled_mm(x8, w8_t, scale_a=s_x, scale_b=s_w, out_dtype=torch.bfloat16)


def w4_paired_configs(m: int, n: int, k: int, silu: bool = False,
                      cuda: torch.device = torch.device("cuda")) -> dict:
    """The paired-dequantisation variants (`w4a16_paired*`): the engine's config paired and its
    neighbours (`silu`: of the fused gate/up weight [n, k] with its SiLU-and-mul epilogue, as
    the engine runs it), each fitted to the shared memory at the weight's layout (stages
    lowered); a neighbour equal to one before it is left out."""
    words = interleave_for(n, k, INT4_GROUP)
    ops = Operands(words, PACK // plane_groups(INT4_GROUP, k, words), 2, 2, silu)
    n_cols = n // 2 if silu else n
    base = default_w4_config(m, n_cols, k, INT4_GROUP, silu, cuda)._replace(paired_dequant=True)
    n128 = base._replace(block_n=128, split_k=split_for(m, n_cols, k, silu, 128, cuda))
    configs = {"w4a16_paired": base, "w4a16_paired_swapped": base._replace(w_left=not base.w_left),
               "w4a16_paired_wleft_n128": n128._replace(w_left=True),
               "w4a16_paired_n128": n128._replace(w_left=False),
               "w4a16_paired_split_x2": base._replace(split_k=2 * base.split_k),
               "w4a16_paired_split_half": base._replace(split_k=max(1, base.split_k // 2)),
               "w4a16_paired_w8": base._replace(num_warps=8)}
    fitted = {}
    for name, config in configs.items():
        fit = fit_shared_memory(config, m, ops, cuda)
        if fit is not None and fit[0] not in fitted.values():
            fitted[name] = fit[0]
    return fitted


def bench_dense(args, bandwidth: float, rows: list[dict]) -> None:
    device = torch.device("cuda")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weights = Weights(n, k, device, with_rowwise=True)
        for m in (int(r) for r in args.rows.split(",")):
            num_calls = max(MIN_CALLS, len(weights.fp8))
            num_inputs = max(1, min(num_calls, ROTATION_BYTES // (m * k * 2)))
            inputs = [torch.randn(m, k, device=device).bfloat16() for _ in range(num_inputs)]
            x0 = inputs[0]
            reference = x0.float() @ dequantize(*weights.fp8[0], torch.float32).t()
            int4_references = {kind: x0.float() @ dequantize_int4(getattr(weights, kind)[0],
                                                                  torch.bfloat16).float().t()
                               for kind in ("int4", "int4_bf16_scales")}
            for variant, (kind, op) in dense_variants(m, n, k, name.endswith("gate_up")).items():
                if not selected(args, variant):
                    continue
                pool = {"bf16": weights.bf16, "fp8": weights.fp8, "rowwise": weights.rowwise,
                        "int4": weights.int4, "int4_bf16_scales": weights.int4_bf16_scales}[kind]
                int4 = kind.startswith("int4")
                weight_bytes = n * k * (2 if kind == "bf16" else 0.5 if int4 else 1)
                extra = weights.int4_extra_bytes if int4 else {
                    "fp8": weights.scale_bytes, "rowwise": 4 * n}.get(kind, 0)
                calls = [lambda i=i: op(inputs[i % num_inputs], pool[i % len(pool)])
                         for i in range(num_calls)]
                row = dict(part="dense", shape=name, n=n, k=k, m=m, variant=variant)
                try:
                    ref = int4_references[kind] if int4 else reference
                    if variant.endswith("_silu"):
                        ref = silu_and_mul(ref.bfloat16()).float()
                    err = float((op(x0, pool[0]).float() - ref).norm() / ref.norm())
                    seconds = time_per_call(calls)
                except Exception as e:  # an unsupported variant (torch build, device): go on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(json.dumps(row), flush=True)
                    if args.verbose:
                        traceback.print_exc()
                    continue
                total = weight_bytes + extra + m * k * 2 + m * n * (1 if variant.endswith("_silu") else 2)
                row.update(us=seconds * 1e6, GBps=total / seconds / 1e9,
                           fraction_of_copy=total / seconds / bandwidth,
                           TFLOPs=2 * m * n * k / seconds / 1e12, rel_err=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.sweep and m <= MAX_ROWS and selected(args, "w8a16"):
                sweep_w8a16(args, name, m, weights, inputs, num_calls, bandwidth, rows)
            if args.sweep and m <= TILED_MAX_ROWS and selected(args, "w4a16"):  # mid M too
                sweep_w4a16(args, name, m, weights, inputs, num_calls, bandwidth, rows)
            del inputs
        del weights
        torch.cuda.empty_cache()


# The W8A16 search's axes: the skinny GEMM's, and the FP8 options (wide K steps over whole
# scale blocks; deeper pipelines, the FP8 step being half the 16-bit step's bytes; fp16
# products and the weight on the left, whose tiles run to 256 rows).
W8A16_AXES = {"block_n": (16, 32, 64, 128, 256), "block_k": (64, 128, 256, 512),
              "split_k": (1, 2, 4, 8, 16), "num_warps": (2, 4, 8), "num_stages": (3, 4, 6, 8),
              "fp8_wide": (False, True), "fp8_f16": (False, True), "w_left": (False, True)}


def sweep_w8a16(args, name: str, m: int, weights: Weights, inputs: list[torch.Tensor],
                num_calls: int, bandwidth: float, rows: list[dict]) -> None:
    """The W8A16 skinny GEMM's coordinate descent over W8A16_AXES from the rule's config, gate/up
    as the engine runs it (SiLU-and-mul); each config checked against the reference before
    timed. Prints the best three and the winner as an FP8_TUNED_CONFIGS line
    (engine/layers/skinny_gemm.py; the config before `fp8_weight_config`, which the kernel
    applies)."""
    n, k = weights.n, weights.k
    paired = name.endswith("gate_up")
    n_cols = n // 2 if paired else n
    total = n * k + weights.scale_bytes + m * k * 2 + m * n_cols * 2
    x0, (w0, s0) = inputs[0], weights.fp8[0]
    expected = (x0.float() @ dequantize(w0, s0, torch.bfloat16).float().t()).bfloat16()
    expected = silu_and_mul(expected) if paired else expected

    def time_config(c) -> float | None:
        label = f"sweep {w8a16_name(c)}"
        try:
            out = skinny_gemm(x0, w0, silu_mul=paired, config=c, scale=s0)
        except Exception as e:  # the compiler's refusal (shared memory, registers)
            print(f"{name} m={m} {label}: {type(e).__name__}: {str(e)[:120]}")
            return None
        if not torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2):
            print(f"{name} m={m} {label}: WRONG RESULT, left out")
            return None
        calls = [lambda i=i: skinny_gemm(inputs[i % len(inputs)], weights.fp8[i % len(weights.fp8)][0],
                                         silu_mul=paired, config=c,
                                         scale=weights.fp8[i % len(weights.fp8)][1])
                 for i in range(num_calls)]
        return _record_sweep(rows, name, m, n, k, label, c, calls, total, bandwidth)

    # Two descents: from the rule's dequantising config and from the fp16-product rule's
    # (one axis at a time would not reach the latter's wide weight-on-the-left tiles).
    timed = {}
    for start in (default_config(m, n_cols, k, paired, torch.device("cuda"), fp8=True),
                  fp8_f16_config(m, n_cols, k, paired, torch.device("cuda"))):
        timed.update(sweep(start, m, n_cols, k, paired, args.sweep_rounds, time_config, W8A16_AXES))
    ranked = sorted(timed.items(), key=lambda item: item[1])
    for c, seconds in ranked[:3]:
        print(f"best w8a16 {name} m={m}: {seconds * 1e6:.2f} us {100 * total / seconds / bandwidth:.0f}%  "
              f"{w8a16_name(c)}", flush=True)
    if ranked:
        c, seconds = ranked[0]
        args.fp8_best.append(f"    {(m, n_cols, k, paired)!r}: {c!r},  # {name}: {seconds * 1e6:.1f} us, "
                             f"{100 * total / seconds / bandwidth:.0f} %")


def w8a16_name(c) -> str:
    """A swept W8A16 config's name: the skinny GEMM's and its FP8 options."""
    options = [flag for flag, on in (("wide", c.fp8_wide), ("f16", c.fp8_f16), ("w_left", c.w_left)) if on]
    return " ".join([config_name(c), *options])


def _record_sweep(rows: list[dict], name: str, m: int, n: int, k: int, label: str, config,
                  calls: list, total: int, bandwidth: float) -> float | None:
    """Seconds a call of one swept config (`label` names it) takes (its row appended), or None
    where the compiler refuses the config (shared memory)."""
    try:
        seconds = time_per_call(calls)
    except Exception as e:
        print(f"{name} m={m} {label}: {type(e).__name__}: {str(e)[:120]}")
        return None
    rows.append(dict(part="sweep", shape=name, n=n, k=k, m=m, variant=label,
                     config=config._asdict(), us=seconds * 1e6, GBps=total / seconds / 1e9,
                     fraction_of_copy=total / seconds / bandwidth))
    return seconds


def sweep_w4a16(args, name: str, m: int, weights: Weights, inputs: list[torch.Tensor],
                num_calls: int, bandwidth: float, rows: list[dict]) -> None:
    """The W4A16 kernel's search (bench/int4_sweep.py) at this shape and M: gate/up as the
    engine runs it (SiLU-and-mul); the layout is the one the smallest M swept chose, and
    above MAX_ROWS without one the installed layout (`interleave_for`: decode chooses it, so a
    sweep of mid M alone keeps the decode configs measured at it)."""
    n, k = weights.n, weights.k
    paired = name.endswith("gate_up")
    n_cols = n // 2 if paired else n
    total = n * k // 2 + weights.int4_extra_bytes + m * k * 2 + m * n_cols * 2

    x0 = inputs[0]
    expected = (x0.float() @ dequantize_int4(weights.int4[0], torch.bfloat16).float().t()).bfloat16()
    expected = silu_and_mul(expected) if paired else expected

    def time_config(c, words: int) -> float | None:
        pool = weights.int4_at(words)
        try:  # a config must compute the product before its time counts
            out = w4a16_gemm(x0, pool[0], silu_mul=paired, config=c)
        except Exception as e:  # the compiler's refusal (shared memory, registers)
            print(f"{name} m={m} {int4_sweep.config_name(c, words)}: {type(e).__name__}: {str(e)[:120]}")
            return None
        if not torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2):
            print(f"{name} m={m} {int4_sweep.config_name(c, words)}: WRONG RESULT "
                  f"(max error {(out.float() - expected.float()).abs().max().item():.3g}), left out")
            return None
        calls = [lambda i=i: w4a16_gemm(inputs[i % len(inputs)], pool[i % len(pool)],
                                        silu_mul=paired, config=c)
                 for i in range(num_calls)]
        return _record_sweep(rows, name, m, n, k, f"sweep w4a16 {int4_sweep.config_name(c, words)}", c,
                             calls, total, bandwidth)

    chosen = args.int4_layouts.get(name) or (weights.int4[0].interleave if m > MAX_ROWS else None)
    timed = int4_sweep.search(m, n_cols, k, INT4_GROUP, paired,
                              (chosen,) if chosen else int4_sweep.INTERLEAVES, time_config,
                              paired_dequant=args.sweep_paired_dequant)
    if not timed:
        return
    ranked = sorted(timed.items(), key=lambda item: item[1])
    for (c, words), seconds in ranked[:3]:
        print(f"best w4a16 {name} m={m}: {seconds * 1e6:.2f} us  {int4_sweep.config_name(c, words)}",
              flush=True)
    (c, words), seconds = ranked[0]
    args.int4_layouts.setdefault(name, words)
    args.int4_best[(m, n_cols, k, INT4_GROUP, paired, n)] = dict(
        shape=name, config=c._asdict(), interleave=words, us=seconds * 1e6,
        fraction_of_copy=total / seconds / bandwidth, name=int4_sweep.config_name(c, words))


def print_int4_table(args, rows: list[dict]) -> None:
    """The best W4A16 config per (shape, M) beside the engine's bf16 GEMM (the skinny one up to
    16 rows, cuBLAS above) and the default."""
    print(f"\n{'shape':12} {'M':>3} {'bf16 us':>8} {'%':>4} {'w4 rule us':>10} {'%':>4} "
          f"{'w4 best us':>10} {'%':>4}  best config")
    for (m, _, _, _, _, _), best in sorted(args.int4_best.items(), key=lambda kv: (kv[1]["shape"], kv[0][0])):
        def cell(variant: str) -> str:
            r = next((r for r in rows if (r["shape"], r["m"], r["variant"]) == (best["shape"], m, variant)
                      and "us" in r), None)
            return f"{'-':>8} {'-':>4}" if r is None else f"{r['us']:8.1f} {100 * r['fraction_of_copy']:4.0f}"
        bf16 = "skinny_bf16" if m <= MAX_ROWS else "cublas_bf16"  # the engine's bf16 at this M
        print(f"{best['shape']:12} {m:3} {cell(bf16)} {cell('w4a16_kernel'):>15} "
              f"{best['us']:10.1f} {100 * best['fraction_of_copy']:4.0f}  {best['name']}")


def print_w4_paired_table(rows: list[dict]) -> None:
    """Per (shape, M): bf16 (the skinny GEMM), the W4A16 kernel today, and the fastest paired
    variant (plain, and for gate/up as the engine runs it, with SiLU-and-mul)."""
    print(f"\n{'shape':16} {'M':>3} {'bf16 us':>7} {'%':>4} {'w4 us':>7} {'%':>4} "
          f"{'paired':>7} {'%':>4}  fastest paired")
    for shape, m in dict.fromkeys((r["shape"], r["m"]) for r in rows if "us" in r):
        timed = {r["variant"]: r for r in rows if (r["shape"], r["m"]) == (shape, m) and "us" in r}
        for suffix in ("", "_silu"):
            paired = [r for v, r in timed.items() if v.startswith("w4a16_paired")
                      and v.endswith("_silu") == bool(suffix)]
            if not paired:
                continue
            best = min(paired, key=lambda r: r["us"])
            cells = [timed.get(v) for v in ("skinny_bf16", "w4a16_kernel" + suffix)] + [best]
            print(f"{shape + suffix:16} {m:3} " + " ".join(
                f"{'-':>7} {'-':>4}" if r is None else f"{r['us']:7.1f} {100 * r['fraction_of_copy']:4.0f}"
                for r in cells) + f"  {best['variant']}")


def selected(args, variant: str) -> bool:
    """--variants: the named variants (by prefix), and the 16-bit ones to compare with."""
    return (not args.variants or variant in ("cublas_bf16", "skinny_bf16")
            or any(variant.startswith(v) for v in args.variants.split(",")))


def random_fp8_experts(e: int, n: int, k: int, device) -> tuple[torch.Tensor, WeightScale]:
    """Random FP8 experts (values of a unit normal, 128x128 scales about 0.02 / 3), made one
    expert at a time (the fp32 of all of them would not fit)."""
    w8 = torch.empty(e, n, k, dtype=FP8_DTYPE, device=device)
    for i in range(e):
        w8[i] = torch.randn(n, k, device=device, dtype=torch.bfloat16).to(FP8_DTYPE)
    grid = scale_grid_shape(n, k, *BLOCK)
    values = (0.5 + torch.rand(e, *grid, device=device)) * 0.02 / 3
    return w8, WeightScale(values, *BLOCK)


def bench_moe(args, bandwidth: float, rows: list[dict]) -> None:
    device = torch.device("cuda")
    e, top_k, hidden, inter = (MOE[key] for key in ("experts", "top_k", "hidden", "inter"))
    w13, s13 = random_fp8_experts(e, 2 * inter, hidden, device)
    w2, s2 = random_fp8_experts(e, hidden, inter, device)
    # The bf16 experts are the FP8 ones dequantised (one expert at a time, for memory).
    b13 = torch.empty(w13.shape, dtype=torch.bfloat16, device=device)
    b2 = torch.empty(w2.shape, dtype=torch.bfloat16, device=device)
    for i in range(e):
        b13[i] = dequantize(w13[i], s13._replace(values=s13.values[i]), torch.bfloat16)
        b2[i] = dequantize(w2[i], s2._replace(values=s2.values[i]), torch.bfloat16)
    expert_bytes = 3 * inter * hidden
    scale_bytes = (s13.values[0].numel() + s2.values[0].numel()) * 4
    variants = {"moe_bf16": lambda x, w, ids: fused_experts(x, b13, b2, w, ids),
                "moe_w8a16": lambda x, w, ids: fused_experts(x, w13, w2, w, ids, w13_scale=s13,
                                                             w2_scale=s2)}
    for m in (int(r) for r in args.rows.split(",")):
        routings = []
        for _ in range(MIN_CALLS):
            ids = torch.rand(m, e, device=device).topk(top_k, dim=1).indices
            routings.append((torch.randn(m, hidden, device=device).bfloat16(),
                             torch.rand(m, top_k, device=device).softmax(-1), ids))
        touched = sum(len(torch.unique(ids)) for *_, ids in routings) / len(routings)
        reference = variants["moe_bf16"](*routings[0]).float()
        for variant, op in variants.items():
            row = dict(part="moe", shape="v3.routed_experts", m=m, variant=variant, experts_touched=touched)
            try:
                err = float((op(*routings[0]).float() - reference).norm() / reference.norm())
                seconds = time_per_call([lambda r=r: op(*r) for r in routings])
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                print(json.dumps(row), flush=True)
                continue
            per_expert = expert_bytes * (2 if variant == "moe_bf16" else 1)
            total = touched * (per_expert + (scale_bytes if variant != "moe_bf16" else 0)) + 2 * m * hidden * 2
            row.update(us=seconds * 1e6, GBps=total / seconds / 1e9, fraction_of_copy=total / seconds / bandwidth,
                       TFLOPs=2 * m * top_k * expert_bytes / seconds / 1e12, rel_err_vs_bf16=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
    del w13, w2, b13, b2
    torch.cuda.empty_cache()


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(f"\n{torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e9:.0f} GB/s  "
          f"(err: relative to the fp32 product with the dequantised FP8 weight; MoE: to bf16 experts)")
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"{'shape':18} {'M':>5}  " + "  ".join(f"{v:>22}" for v in variants))
    for shape, m in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        cells = []
        for v in variants:
            r = next((r for r in rows if (r["shape"], r["m"], r["variant"]) == (shape, m, v)), None)
            err = None if r is None else r.get("rel_err", r.get("rel_err_vs_bf16"))
            cells.append(f"{'-':>22}" if r is None else
                         f"{r['us']:8.1f}us {100 * r['fraction_of_copy']:4.0f}% {err:6.1e}")
        print(f"{shape:18} {m:5}  " + "  ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,4,16,64,512,4096", help="M values")
    ap.add_argument("--no-moe", action="store_true", help="skip DeepSeek-V3's routed experts")
    ap.add_argument("--sweep", action="store_true",
                    help="also search W8A16 skinny and W4A16 decode configs (M <= 16)")
    ap.add_argument("--sweep-rounds", type=int, default=1)
    ap.add_argument("--sweep-paired-dequant", action="store_true",
                    help="the W4A16 sweep times paired-dequantisation configs (W4Config.paired_dequant)")
    ap.add_argument("--variants", default="",
                    help="comma-separated variant prefixes (e.g. w4a16); the bf16 ones always run")
    ap.add_argument("--int4-tuned", default="int4_tuned.json",
                    help="where --sweep writes the best W4A16 configs (for --install-int4)")
    ap.add_argument("--install-int4", metavar="JSON",
                    help="write a --int4-tuned file into engine/layers/int4_tuned.py and exit")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of failing variants")
    ap.add_argument("--out", default="bench_fp8_gemm.json")
    args = ap.parse_args()
    if args.install_int4:
        print("wrote", int4_sweep.install(args.install_int4))
        return
    args.int4_layouts, args.int4_best, args.fp8_best = {}, {}, []
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows: list[dict] = []
    started = time.time()
    bench_dense(args, bandwidth, rows)
    if not args.no_moe:
        try:
            bench_moe(args, bandwidth, rows)
        except Exception as e:  # e.g. out of memory on a smaller card
            print(f"moe: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "seconds": time.time() - started, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table([r for r in rows if r["part"] != "sweep"], bandwidth)
    if any(r["variant"].startswith("w4a16_paired") for r in rows):
        print_w4_paired_table([r for r in rows if r["part"] == "dense"])
    if args.fp8_best:
        print("\nFP8_TUNED_CONFIGS entries (engine/layers/skinny_gemm.py):\n" + "\n".join(args.fp8_best))
    if args.int4_best:
        print_int4_table(args, rows)
        int4_sweep.write_json(args.int4_tuned, torch.cuda.get_device_name(), args.int4_best)
        print(f"wrote {args.int4_tuned}: install with "
              f"python bench/fp8_gemm.py --install-int4 {args.int4_tuned}")


if __name__ == "__main__":
    main()
