"""The attention kernels' launches over an FP8 KV pool, compiled for an H100 without one
(tests/sm90_compile.py): what `TritonAttnBackend` launches on an sm_90 device with an FP8
pool (`default_decode_config` / `default_extend_config` as on CUDA, the FP8 decode config
with its "bits" conversion), taken from the launchers themselves on the CPU (the kernels
swapped for recorders, as tests/int4_sm90_launches.py does: nothing runs, the arguments are
the real ones), one compile per distinct specialisation. Shapes: Llama-8B, Qwen3-30B-A3B,
a group of 7 (Qwen2.5-7B), multi-head (group 1), head_dim 64 and 256, and MLA with 16
(V2-Lite) and 128 (V3) heads; queries bf16, fp16 and fp32; decode at 1, some and the most
splits; split extends (verify, short prefill tails) of every power-of-two width up to
`SPLIT_EXTEND_MAX_TOKENS`, causal and tree-masked; long extends.

Each launch must compile, fit an H100's shared memory, wait for its predecessor (PDL), and
convert FP8 tiles as its `FP8_CONVERT` says (no f16 -> bf16 conversion with "bits"). The
compile test (tests/test_fp8_kv_cache.py) compiles a few under this venv's Triton; the GPU
machines' Triton is older (3.6), so before a GPU run compile these under a scratch venv
holding that version (docs/architecture.md, INT4, says how to make one):

    python tests/fp8_kv_sm90_launches.py [--all] [--jobs N]   # exit 1 naming every failure

Without `--all`, a covering few (every value each argument takes, every pair of constexpr
values); with it, every distinct launch. `--jobs`: compiles in that many processes."""
from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import sys
import time
from typing import Iterator, Optional

import torch

from specserve.engine.attention.triton import kernels as A
from specserve.engine.attention.triton.backend import SPLIT_EXTEND_MAX_TOKENS
from specserve.engine.kvcache.fp8 import FP8_KV_DTYPE
from specserve.engine.layers.int4_shared_memory import H100_SHARED_MEMORY

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_sm90_launches import Launch, _Recorder, covering, unique_launches  # noqa: E402

# (query heads, KV heads, key dims, value dims or None: the key's)
SHAPES = {"llama-8b": (32, 8, 128, None), "qwen3-30b-a3b": (32, 4, 128, None),
          "group-7": (28, 4, 128, None), "mha": (32, 32, 128, None),
          "head-64": (32, 8, 64, None), "head-256": (16, 8, 256, None),
          "mla-16": (16, 1, 576, 512), "mla-128": (128, 1, 576, 512)}
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONTEXTS = (200, 1000, 131072)  # one split, a few, the most
LONG_EXTENDS = (SPLIT_EXTEND_MAX_TOKENS + 1, 4096)
KERNELS = ("_decode_kernel", "_short_extend_kernel", "_extend_attention_kernel")
SM90 = torch.device("cuda")  # only for choosing configs: nothing is allocated on it


@contextlib.contextmanager
def _recording() -> Iterator[list]:
    launches: list = []
    kernels = {name: getattr(A, name) for name in KERNELS}
    for name, kernel in kernels.items():
        setattr(A, name, _Recorder(kernel, launches))
    real_capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    try:
        yield launches
    finally:
        torch.cuda.get_device_capability = real_capability
        for name, kernel in kernels.items():
            setattr(A, name, kernel)


def _pool(num_kv_heads: int, key_dim: int, value_dim: Optional[int]):
    """K and V buffers of an FP8 pool (a few slots; strides as the engine's), V a view of
    the key's leading dims for MLA."""
    k = torch.empty(4, num_kv_heads, key_dim, dtype=FP8_KV_DTYPE)
    if value_dim is not None:
        return k, k[..., :value_dim]
    return k, torch.empty_like(k)


def engine_launches() -> list[Launch]:
    """Every distinct launch of the three attention kernels over an FP8 pool (see above)."""
    i64, i32 = torch.int64, torch.int32
    with _recording() as launches:
        for (heads, kv_heads, key_dim, value_dim), dtype in itertools.product(SHAPES.values(),
                                                                            QUERY_DTYPES):
            out_dim = value_dim or key_dim
            k, v = _pool(kv_heads, key_dim, value_dim)
            decode = A.default_decode_config(key_dim, SM90, value_dim, FP8_KV_DTYPE)
            extend = A.default_extend_config(key_dim, SM90, value_dim)
            scales = dict(k_scale=0.5, v_scale=0.25)
            for context in CONTEXTS:
                splits = min(decode.max_kv_splits, -(-context // decode.min_kv_split_len))
                scratch = lambda rows: (torch.empty(rows, heads, splits, out_dim),  # noqa: E731
                                        torch.empty(rows, heads, splits),
                                        torch.zeros(rows * heads, dtype=i32))
                q = torch.empty(2, heads, key_dim, dtype=dtype)
                A.decode_attention(q, k, v, torch.empty(2, heads, out_dim, dtype=dtype),
                                   torch.zeros(3, dtype=i64), torch.zeros(2, dtype=i32),
                                   *scratch(2), 0.1, decode, **scales)
                for width, masked in itertools.product(
                        (2 ** i for i in range(SPLIT_EXTEND_MAX_TOKENS.bit_length())),
                        (False, True)):
                    q = torch.empty(2 * width, heads, key_dim, dtype=dtype)
                    mask = torch.ones(2, width, width, dtype=torch.bool) if masked else None
                    A.short_extend_attention(
                        q, k, v, torch.empty(2 * width, heads, out_dim, dtype=dtype),
                        torch.zeros(3, dtype=i64), torch.zeros(3, dtype=i64),
                        torch.zeros(2, dtype=i32), torch.zeros(2 * width, dtype=i64), width,
                        0.1, *scratch(2 * width), custom_mask=mask, config=decode, **scales)
            for width in LONG_EXTENDS:
                q = torch.empty(width, heads, key_dim, dtype=dtype)
                A.extend_attention(q, k, v, torch.empty(width, heads, out_dim, dtype=dtype),
                                   torch.zeros(2, dtype=i64), torch.zeros(2, dtype=i64),
                                   torch.zeros(2, dtype=i32), torch.zeros(width, dtype=i64),
                                   width, 0.1, config=extend, **scales)
    return unique_launches(launches)


def compile_and_check(launch: Launch) -> int:
    """Compiles `launch` for sm_90 and checks it: shared memory within an H100's, the PDL
    wait, and the FP8 tiles converted as `FP8_CONVERT` says where the queries are bf16 (fp16
    and fp32 queries take Triton's conversion either way). Returns the shared memory."""
    from sm90_compile import compile_sm90_kernel

    compiled = compile_sm90_kernel(launch.kernel, launch.args, launch.num_warps,
                                   launch.num_stages)
    ptx, shared = compiled.asm["ptx"], compiled.metadata.shared
    assert shared <= H100_SHARED_MEMORY, \
        f"shared memory {shared} bytes: more than an H100's {H100_SHARED_MEMORY}"
    assert "griddepcontrol.wait" in ptx, "no PDL wait"
    if launch.args["q"].dtype == torch.bfloat16:
        if launch.args["FP8_CONVERT"] == "bits":
            assert "mul.rn.bf16x2" in ptx and "cvt.bf16.f16" not in ptx, "not converted by bits"
        else:
            assert "cvt.rn.f16x2.e4m3x2" in ptx, "not converted by Triton"
    return shared


_CHOSEN: list[Launch] = []  # what the compiling processes (forked) compile, by index


def _failure(index: int) -> Optional[str]:
    """None if `_CHOSEN[index]` compiles and passes its checks, else what went wrong."""
    launch = _CHOSEN[index]
    try:
        compile_and_check(launch)
    except Exception as e:  # every failure named, then the count
        message = str(e).strip().splitlines()
        return f"FAILED {launch.name()}: {type(e).__name__}: {message[-1] if message else ''}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true",
                        help="every distinct launch, not a covering few")
    parser.add_argument("--jobs", type=int, default=1, help="compiling processes")
    args = parser.parse_args()
    import triton

    launches = engine_launches()
    _CHOSEN[:] = launches if args.all else covering(launches)
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(_CHOSEN)} of "
          f"{len(launches)} distinct launches", flush=True)
    start, failed = time.perf_counter(), 0
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for i, failure in enumerate(pool.imap(_failure, range(len(_CHOSEN)))):
            if failure:
                failed += 1
                print(failure, flush=True)
            if (i + 1) % 25 == 0:
                print(f"{i + 1} done, {failed} failed, {time.perf_counter() - start:.0f} s",
                      flush=True)
    print(f"compiled: {len(_CHOSEN) - failed} passed, {failed} failed "
          f"in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
