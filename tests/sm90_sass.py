"""What the skinny GEMM's inner loop executes on an H100, counted without one: the kernel
compiled for sm_90 (tests/sm90_compile.py), its cubin disassembled by the nvdisasm Triton
ships, and the body of the loop (the longest backward branch) counted by opcode. Per weight:
the loop's instructions times the warps, over the weight elements a step reads, the number
docs/benchmarks.md ("FP8 W8A16: instructions a weight") compares; and the loop's global loads,
cp.async (LDGSTS: pipelined over the stages) or plain (LDG).

    python tests/sm90_sass.py    # the table for Llama 8B's o_proj at M = 1
    python tests/sm90_sass.py w4a16    # the W4A16 kernel's: 8B o and gate/up at M = 1

(under the GPU machines' Triton, 3.6, as the table was made, or this venv's)."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import torch

from sm90_compile import compile_sm90_kernel, t


def nvdisasm() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def loop_opcodes(compiled) -> collections.Counter:
    """Opcodes of the longest backward branch's body in `compiled`'s SASS (predicates and
    operands dropped, modifiers kept: LDS.U16, HGMMA.64...)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        lines = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)) and labels.get(m.group(1), i) < i]
    assert loops, "no loop in the kernel"
    first, last = max(loops, key=lambda span: span[1] - span[0])
    opcodes = (re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
               for line in lines[first:last + 1])
    return collections.Counter(m.group(1) for m in opcodes if m)


def skinny_fp8_launch(m: int, n_rows: int, k: int, silu: bool, config, convert: str = "cast"):
    """(the compiled skinny GEMM for an FP8 weight with 128x128 scale blocks and bf16 x at
    `config` (before `fp8_weight_config`), that config after it)."""
    from specserve.engine.layers import skinny_gemm as sk

    f32 = torch.float32
    c = sk.fp8_weight_config(config, 128, k)
    n_cols = n_rows // 2 if silu else n_rows
    args = dict(x=t(torch.bfloat16), w=t(torch.float8_e4m3fn), bias=t(torch.bfloat16),
                y=t(torch.bfloat16), partials=t(f32), arrivals=t(torch.int32), M=m, n_cols=n_cols,
                K=k, k_per_split=k // c.split_k, stride_xm=k, stride_wn=k, stride_ym=n_cols,
                fp8=sk._Fp8Args(t(f32), t(f32), k // 128, k // 128, 128, 128),
                BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                SPLIT_K=c.split_k, HAS_BIAS=False, SILU_MUL=silu, DOT=True, EVEN_K=True,
                DOT_PRECISION="tf32", FP8_WEIGHT=True, SCALE_COLS=sk.scale_columns(128, k, c.block_k),
                FP8_ACT=False, FP8_CONVERT=convert, FP8_F16=c.fp8_f16, W_LEFT=c.w_left, PDL=True)
    return compile_sm90_kernel(sk._skinny_gemm_kernel, args, c.num_warps, c.num_stages), c


def global_loads(opcodes: collections.Counter) -> str:
    """The loop's loads from global memory: cp.async ones (LDGSTS, which the stages pipeline)
    and plain ones (LDG, which an iteration issues for itself)."""
    loads = sorted((op, n) for op, n in opcodes.items() if op.startswith("LDG") and op != "LDGDEPBAR")
    return "loads " + (", ".join(f"{op} {n}" for op, n in loads) or "none")


def per_weight(opcodes: collections.Counter, config, silu: bool) -> float:
    """Warp instructions a weight element: the loop's per thread, times the warps, over a
    step's weight elements (both tiles of a pair)."""
    return sum(opcodes.values()) * config.num_warps / (config.block_n * config.block_k * (2 if silu else 1))


def w4a16_launch(m: int, n_rows: int, k: int, silu: bool, config, dtype=torch.bfloat16,
                 scale_dtype=None):
    """(the compiled W4A16 kernel for a group-128 weight [n_rows, k] at the engine's interleave,
    x of `dtype` and scales of `scale_dtype` (default: dtype), at `config` as `w4a16_gemm`
    launches it (on CUDA: the paired dequantisation's inline asm), that launch)."""
    from int4_sm90_launches import _recording, _weight

    from specserve.engine.layers import int4_gemm as g

    w = _weight(n_rows, k, 128, g.interleave_for(n_rows, k, 128), scale_dtype or dtype)
    with _recording() as launches:
        g.w4a16_gemm(torch.empty(m, k, dtype=dtype), w, silu_mul=silu, config=config)
    launch, = launches
    return compile_sm90_kernel(launch.kernel, launch.args, launch.num_warps, launch.num_stages), launch


def w4_per_weight(opcodes: collections.Counter, launch) -> float:
    """Warp instructions a weight element of the W4A16 loop: a step reads 8 * WORDS codes of
    each of BLOCK_N rows (both tiles of a gate/up pair)."""
    a = launch.args
    weights = a["BLOCK_N"] * 8 * a["WORDS"] * (2 if a["SILU_MUL"] else 1)
    return sum(opcodes.values()) * launch.num_warps / weights


def w4a16_main() -> None:
    from specserve.engine.layers import int4_gemm as g

    import triton

    print(f"triton {triton.__version__}: W4A16 (group 128, bf16 x and scales; AWQ: fp16 scales), "
          "M = 1, sm_90: warp instructions a weight of the compiled loop")
    for shape, (n_rows, k), silu in (("o", (4096, 4096), False), ("gate_up", (28672, 4096), True)):
        today = g.default_w4_config(1, n_rows // 2 if silu else n_rows, k, 128, silu)
        paired = today._replace(paired_dequant=True)
        f16 = torch.float16
        variants = {"today (tuned)": (today, None), "today, AWQ": (today, f16),
                    "paired": (paired, None), "paired, AWQ": (paired, f16),
                    "paired, weight left": (paired._replace(w_left=True), None),
                    "paired, 128 columns": (paired._replace(block_n=128), None),
                    "paired, 8 warps": (paired._replace(num_warps=8), None)}
        for name, (config, scale_dtype) in variants.items():
            compiled, launch = w4a16_launch(1, n_rows, k, silu, config, scale_dtype=scale_dtype)
            opcodes = loop_opcodes(compiled)
            top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(6))
            print(f"{shape:8} W{launch.args['WORDS']:<3} {name:22} n{launch.args['BLOCK_N']:<3} "
                  f"{w4_per_weight(opcodes, launch):.3f}  ({top}; {global_loads(opcodes)})", flush=True)


def main() -> None:
    from specserve.engine.layers import skinny_gemm as sk

    cpu = torch.device("cpu")
    rule = sk.default_config(1, 4096, 4096, False, cpu)._replace(fp8_wide=False)
    f16 = sk.fp8_f16_config(1, 4096, 4096, False, cpu)
    variants = {"W8A16 cast": (rule, "cast"), "W8A16 bits": (rule, "bits"),
                "W8A16 wide": (rule._replace(fp8_wide=True), "cast"),
                "W8A16 weight left, 128 rows": (rule._replace(block_n=128, w_left=True), "cast"),
                "fp16 products, x left, 64 rows": (f16._replace(block_n=64, w_left=False), "cast"),
                "fp16 products, weight left, 128 rows": (f16, "cast"),
                "fp16 products, weight left, 256 rows, 8 warps": (f16._replace(block_n=256, num_warps=8),
                                                                   "cast")}
    import triton

    print(f"triton {triton.__version__}: Llama 8B o_proj (4096x4096), M = 1, sm_90")
    for name, (config, convert) in variants.items():
        compiled, c = skinny_fp8_launch(1, 4096, 4096, False, config, convert)
        opcodes = loop_opcodes(compiled)
        top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(6))
        print(f"{name:48} {per_weight(opcodes, c, False):.3f}  ({top}; {global_loads(opcodes)})", flush=True)


if __name__ == "__main__":
    import sys

    w4a16_main() if sys.argv[1:] == ["w4a16"] else main()
