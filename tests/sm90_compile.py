"""Compiling Triton kernels for an H100 on a machine without one (what the interpreter cannot
show: that the compiler accepts the code and what PTX it makes). Imported by the child
processes of the compile tests, which run without TRITON_INTERPRET (`compile_env`)."""
from __future__ import annotations

import os

import torch

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
         torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
         torch.float8_e4m3fn: "fp8e4nv"}


def compile_env() -> dict:
    """The test process's environment for a compiling child: no interpreter, this folder
    importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def t(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """A stand-in tensor argument (only its dtype matters)."""
    return torch.empty(shape or (1,), dtype=dtype)


def compile_sm90(kernel, args: dict, num_warps: int, num_stages: int) -> str:
    """PTX of `compile_sm90_kernel`."""
    return compile_sm90_kernel(kernel, args, num_warps, num_stages).asm["ptx"]


def compile_sm90_kernel(kernel, args: dict, num_warps: int, num_stages: int):
    """The compiled `kernel` for sm_90 (its PTX in .asm, its shared memory in .metadata) from
    its launch arguments by name (constexprs with defaults may be left out): tensors are
    pointers of their dtype, Python floats fp32, other scalars i32; pointers and ints that are
    positive multiples of 16 are marked 16-divisible, as the launcher marks real shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = {}, {}, {}

    def mark(path, v):
        if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0 and v > 0):
            attrs[path] = [["tt.divisibility", 16]]
        if isinstance(v, tuple):
            for j, e in enumerate(v):
                mark(path + (j,), e)

    def ty(v):
        if isinstance(v, torch.Tensor):
            return "*" + TYPES[v.dtype]
        if isinstance(v, tuple):
            return type(v)(*(ty(e) for e in v))
        return "fp32" if isinstance(v, float) else "i32"

    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        if param.is_constexpr:
            # (a constexpr the caller leaves out takes its default, as at a launch)
            sig[name] = "constexpr"
            consts[(i,)] = args[name] if name in args or not param.has_default else param.default
        else:
            sig[name] = ty(args[name])
            mark((i,), args[name])
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))
