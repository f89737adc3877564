"""e4m3 values into bf16 or fp32 ones inside Triton kernels, and the config values that choose how:
shared by the FP8 KV attention kernels (engine/attention/triton/kernels.py,
`DecodeConfig.fp8_convert`) and the W8A16 weight kernels (engine/layers/skinny_gemm.py,
`SkinnyConfig.fp8_convert`).

- "cast": Triton's conversions (`tile.to(dtype)`: e4m3x2 -> f16x2 on the conversion pipe, then
  one f16 -> bf16 or f32 conversion a value).
- "bits": `fp8_tile`'s byte moves and masks, then one bf16x2 multiply a pair (sm_90 and newer,
  compiled only: the interpreter runs no PTX). Exact for every e4m3 code but the two NaNs, which
  read as +-480 (KV pools clamp to +-448 before they store; checkpoints hold no NaN weights).

`e4m3_to_f32` widens a tile to fp32 either way; `round_to_bf16` rounds fp32 values to bf16
precision with integer operations, keeping them fp32 (`v.to(bf16).to(f32)` without two
conversions).
"""
from __future__ import annotations


import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None

FP8_CONVERTS = ("cast", "bits")  # the `fp8_convert` fields' values


def check_fp8_convert(value: str) -> str:
    """`value` if it names a conversion, else a ValueError naming the field."""
    if value not in FP8_CONVERTS:
        raise ValueError(f"fp8_convert: must be one of {', '.join(FP8_CONVERTS)}, got {value!r}")
    return value


def has_sm90_conversions(device: torch.device) -> bool:
    """Whether `device` runs compiled kernels that may use sm_90's bf16x2 multiply ("bits")."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


# The FP8 weight GEMMs' conversion where their config names none. "bits" is opt-in
# (`SkinnyConfig.fp8_convert`) until an H100 run shows it bit-equal to "cast" and faster: its
# GPU tests (tests/test_fp8_kernels.py, test_fp8_checkpoints.py) and bench/fp8_gemm.py's
# w8a16_skinny / w8a16_skinny_bits rows are written, not yet run.
WEIGHT_FP8_CONVERT = "cast"


def _e4m3x4_asm(source: str, outputs: tuple[str, str], tail: str = "") -> str:
    """PTX taking four e4m3 bytes (one 32-bit register, `source`) to their four bf16 values,
    exactly, without the conversion pipe: each byte s.eeee.mmm goes to the top byte of a
    16-bit half (prmt), its magnitude moves down 4 bits (bf16's exponent field is 8 bits
    to e4m3's 4) and its sign back on top (lop3: b | (a & 0x80008000)), which is the value
    times 2**-120 as a bf16 (normal or, for e4m3's subnormals, subnormal); one bf16x2
    multiply by 2**120 (0x7B80) makes it exact, into the two registers `outputs` (values
    0 and 1, then 2 and 3; low halves first), then `tail`. The two NaN codes (0x7F, 0xFF)
    read as +-480."""
    return f"""{{
.reg .b32 a<2>, b<2>, s;
mov.b32 s, 0x7B807B80;
prmt.b32 a0, 0, {source}, 0x5040;
prmt.b32 a1, 0, {source}, 0x7060;
and.b32 b0, a0, 0x7FFF7FFF;
and.b32 b1, a1, 0x7FFF7FFF;
shr.b32 b0, b0, 4;
shr.b32 b1, b1, 4;
lop3.b32 b0, b0, a0, 0x80008000, 0xF8;
lop3.b32 b1, b1, a1, 0x80008000, 0xF8;
mul.rn.bf16x2 {outputs[0]}, b0, s;
mul.rn.bf16x2 {outputs[1]}, b1, s;
{tail}}}"""


if triton is not None:
    _E4M3X4_TO_BF16 = tl.constexpr(_e4m3x4_asm("$2", ("$0", "$1")))
    # The same four values as fp32 (a bf16 value's bits are the top half of its fp32's): the
    # low half of a pair shifted up, the high half masked, in the asm rather than by Triton,
    # which takes each half out of its pair first (up to two operations a value, not one).
    _E4M3X4_TO_F32 = tl.constexpr(_e4m3x4_asm("$4", ("b0", "b1"), """shl.b32 $0, b0, 16;
and.b32 $1, b0, 0xFFFF0000;
shl.b32 $2, b1, 16;
and.b32 $3, b1, 0xFFFF0000;
"""))

    @triton.jit
    def fp8_tile(tile, dtype: tl.constexpr, FP8_CONVERT: tl.constexpr):
        """A loaded tile in `dtype`, by FP8_CONVERT ("bits" only for an e4m3 tile into bf16;
        everything else is cast). Every e4m3 value is a bf16/fp16/fp32 value, so every way
        is exact."""
        if FP8_CONVERT == "cast" or tile.dtype != tl.float8e4nv or dtype != tl.bfloat16:
            return tile.to(dtype)
        else:  # "bits"
            return tl.inline_asm_elementwise(_E4M3X4_TO_BF16, "=r,=r,r",
                                             [tile.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                             is_pure=True, pack=4)

    @triton.jit
    def round_to_bf16(v):
        """fp32 `v` rounded to the nearest bf16 value, ties to even, still fp32: what
        `v.to(bf16).to(f32)` gives for finite v, in integer operations on the bits (add half
        an ulp of bf16 less one, plus the kept last bit, then clear the 16 dropped bits;
        subnormals round as normals do, and a carry out of the largest finite values gives
        the infinity the conversion gives). NaN is not kept (no product of finite values is
        one)."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_to_f32(tile, FP8_CONVERT: tl.constexpr):
        """An e4m3 tile in fp32, exactly: "cast" by Triton's conversion, "bits" by `fp8_tile`'s
        byte moves into bf16, widened to fp32 by a shift or a mask of its bits."""
        if FP8_CONVERT == "bits":
            return tl.inline_asm_elementwise(_E4M3X4_TO_F32, "=r,=r,=r,=r,r",
                                             [tile.to(tl.uint8, bitcast=True)], dtype=tl.float32,
                                             is_pure=True, pack=4)
        else:
            return tile.to(tl.float32)
