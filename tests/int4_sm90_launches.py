"""The W4A16 kernels' launches compiled for an H100 without one (tests/sm90_compile.py): the
launches the engine makes (`engine_launches`) and every one the sweep may try
(`sweep_launches`), taken from the launching functions themselves on the CPU (the kernels
swapped for recorders: nothing runs, the arguments are the real ones), one compile per
distinct specialisation. Each must compile and fit an H100's shared memory: a launch that
does not compiles all the same and fails only when loaded on the device, so the compiled
`metadata.shared` is checked against the limit, and against the model the launching code
fits its configs by (layers/int4_shared_memory.py), which must never be below it.

The compile test (tests/test_int4_kernels.py) compiles a `covering` few of both (every
value, the code paths' pairwise: `code_path`), and the `tightest` (most shared memory by the model), under this venv's Triton. The GPU machines' Triton is older (3.6, where 3.9 here took a kernel 3.6
rejects), so before a GPU run compile all of them under a scratch venv holding that version:

    python tests/int4_sm90_launches.py [--sweep] [--tuned SWEEP.json]   # exit 1 naming every failure

(`--tuned`: the engine's launches with a sweep's tables, as `bench/fp8_gemm.py --install-int4`
would install them.)

(the commands: docs/architecture.md, INT4)."""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import sys
from typing import Iterator, NamedTuple

import torch

from specserve.engine.layers import int4_gemm as g
from specserve.engine.layers.int4_shared_memory import (
    H100_SHARED_MEMORY, Operands, shared_memory_need)

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Every M up to 16 (a tuned table may hold a config at any of them; multiply-and-sum tiles
# the rows' power of two), then row tiles of 64 (or fewer where they do not fit), K split at
# 17 and 64 rows, not at 256
ENGINE_ROWS = (*range(1, 17), 17, 64, 256)
GROUPS = (32, 64, 128, None)  # None: one group over K
SWEEP_ROWS = (1, 16, 64, 256)  # bench/fp8_gemm.py --sweep's --rows (device_session.sh's W4_ROWS)


class Launch(NamedTuple):
    """One kernel launch's compile inputs: its arguments by name, warps and stages."""

    kernel: object
    args: dict
    num_warps: int
    num_stages: int

    def key(self) -> tuple:
        """What the compiled code depends on: constexpr values, argument dtypes, which ints
        are 16-divisible (as `compile_sm90_kernel` marks them), warps and stages."""
        def part(param, v):
            if param.is_constexpr:
                return v
            if isinstance(v, torch.Tensor):
                return v.dtype
            return isinstance(v, int) and v > 0 and v % 16 == 0
        return (self.kernel.fn.__name__, self.num_warps, self.num_stages,
                *(part(p, self.args[n]) for n, p in zip(self.kernel.arg_names, self.kernel.params)))

    def constexprs(self) -> str:
        return " ".join(f"{n}={self.args[n]}" for n, p in zip(self.kernel.arg_names,
                                                               self.kernel.params) if p.is_constexpr)

    def name(self) -> str:
        return (f"{self.kernel.fn.__name__} warps={self.num_warps} stages={self.num_stages} "
                + self.constexprs())


class _Recorder:
    """Stands in for a kernel: `kernel[grid](...)` records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, launch_pdl=False, **kwargs):  # Triton's defaults
            named = dict(zip(self.kernel.arg_names, args), **kwargs)
            named["PDL"] = True  # as an H100 launches it (`pdl_enabled`)
            if named.get("PAIRED") == "emulated":  # (CPU tensors) as CUDA ones launch it
                named["PAIRED"] = "asm"
            self.launches.append(Launch(self.kernel, named, num_warps, num_stages))
        return launch


@contextlib.contextmanager
def _recording() -> Iterator[list]:
    launches: list = []
    kernels = {name: getattr(g, name) for name in ("_w4a16_kernel", "_dequantize_kernel")}
    for name, kernel in kernels.items():
        setattr(g, name, _Recorder(kernel, launches))
    try:
        yield launches
    finally:
        for name, kernel in kernels.items():
            setattr(g, name, kernel)


def _weight(n: int, k: int, group: int, interleave: int, scale_dtype=torch.float16) -> g.Int4Weight:
    groups = -(-k // group)
    return g.Int4Weight(torch.empty(n, k // g.PACK, dtype=torch.int32),
                        torch.empty(n, groups, dtype=scale_dtype),
                        torch.empty(n, groups, dtype=torch.uint8), group, interleave)


def unique_launches(launches: list) -> list[Launch]:
    return list({launch.key(): launch for launch in launches}.values())


def covering(launches: list[Launch], paired=None) -> list[Launch]:
    """A few of `launches` that between them take every value each of them takes of every
    argument's dtype or alignment, of every constexpr, warps and stages, and every pair of
    values they combine of the constexprs `paired(name, value)` maps to a value (None: that
    constexpr is covered value by value only; without `paired`, all of them, warps and
    stages by value) (greedy: most values new first)."""
    def values(launch: Launch) -> set:
        name = launch.kernel.fn.__name__
        consts = [(n, launch.args[n]) for n, p in zip(launch.kernel.arg_names, launch.kernel.params)
                  if p.is_constexpr] + [("warps", launch.num_warps), ("stages", launch.num_stages)]
        shaped = consts if paired is None else [
            (n, paired(n, v)) for n, v in consts if paired(n, v) is not None]
        return ({(name, i, v) for i, v in enumerate(launch.key()[1:])}
                | {(name, n, v) for n, v in consts}
                | {(name, a, b) for a, b in itertools.combinations(shaped, 2)})

    left = set().union(*map(values, launches))
    chosen = []
    while left:
        best = max(launches, key=lambda launch: len(values(launch) & left))
        chosen.append(best)
        left -= values(best)
    return chosen


# The constexprs that choose the W4A16 kernels' code paths: their values pairwise. Sizes (the
# column tile, the interleave's words, warps, stages) only size the same code: each of their
# values is compiled once and `tightest` takes the shared memory's extremes.
CODE_PATHS = ("HAS_BIAS", "SILU_MUL", "DOT", "W_LEFT", "FMA_DEQUANT", "ROUND_BITS",
              "DOT_PRECISION", "PLANES_PER_GROUP", "PAIRED")


def code_path(name: str, value):
    """`covering`'s `paired` for the W4A16 kernels: a code-path constexpr's value, split-K on or
    off, the row tile's kind (one padded tile, wgmma-sized, several wgmma row blocks)."""
    if name in CODE_PATHS:
        return value
    if name == "SPLIT_K":
        return value > 1
    if name == "BLOCK_M":
        return "decode" if value <= g.MAX_ROWS else "mid" if value <= 64 else "wide"
    return None


def _sweep():
    """bench/int4_sweep.py (bench/ is no package)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import int4_sweep

    return int4_sweep


@contextlib.contextmanager
def tuned_tables_installed(path: str) -> Iterator[None]:
    """The kernel module's tuned tables are a sweep JSON's installed over them
    (`merged_tables`, as `bench/fp8_gemm.py --install-int4` installs it) meanwhile."""
    with open(path) as f:
        layouts, configs = _sweep().merged_tables(json.load(f), dict(g.TUNED_INTERLEAVE),
                                                  dict(g.TUNED_W4_CONFIGS))
    tables = (g.TUNED_INTERLEAVE, layouts), (g.TUNED_W4_CONFIGS, {  # the sweep's: JSON entries
        key: entry.get("config", entry) for key, entry in configs.items()})
    saved = [dict(table) for table, _ in tables]
    for table, new in tables:
        table.clear()
        table.update(new)
    g.default_w4_config.cache_clear()
    try:
        yield
    finally:
        for (table, _), old in zip(tables, saved):
            table.clear()
            table.update(old)
        g.default_w4_config.cache_clear()


def engine_launches(rows=ENGINE_ROWS, groups=GROUPS) -> list[Launch]:
    """The engine's launches at the Llama-8B shapes, each group size, each interleave a weight
    may be loaded at (`interleave_for`'s, and any of the sweep's a tuned table may give it),
    `rows`, activations bf16/fp16/fp32 and 16/32-bit scales (the rule's configs, or this
    checkout's tuned ones, fitted to the shared memory as `int4_linear` takes them on CUDA:
    the decode kernel up to 256 rows), a bias, and the dequantise kernel of the large-M path
    at every interleave and output dtype."""
    dtypes = ((torch.bfloat16, torch.float16), (torch.float16, torch.float16),
              (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
              (torch.float32, torch.float16))
    with _recording() as launches:
        for name, (n, k) in LLAMA_8B.items():
            paired = name == "gate_up"
            for group in groups:
                group = group or k
                layouts = {g.interleave_for(n, k, group)} | {
                    words for words in _sweep().INTERLEAVES if g.plane_groups(group, k, words)}
                for words, (x_dtype, scale_dtype) in itertools.product(sorted(layouts), dtypes):
                    w = _weight(n, k, group, words, scale_dtype)
                    bias = torch.empty(n, dtype=x_dtype) if name == "qkv" else None
                    for m in rows:
                        g.w4a16_gemm(torch.empty(m, k, dtype=x_dtype), w, bias, silu_mul=paired)
        n, k = LLAMA_8B["o"]
        for words in (1, 2, 4, 8, 16, 32, 64, 128):
            for group in groups:
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    g.dequantize_int4_gpu(_weight(n, k, group or k, words), dtype)
    return unique_launches(launches)


def sweep_launches(rows=SWEEP_ROWS, group: int = 128) -> list[Launch]:
    """Every launch bench/int4_sweep.py's `search` may make at the Llama-8B shapes and `rows`
    (as bench/fp8_gemm.py runs it): each interleave and product variant of stage 1 at every
    point of stage 2's axes (column tiles, above MAX_ROWS row tiles, split-K halved and
    doubled, 8 warps, 6 stages), so whichever config stage 1 picks."""
    s = _sweep()
    cpu = torch.device("cpu")  # `split_for` on the CPU assumes an H100's 132 SMs
    with _recording() as launches:
        for name, (n, k) in LLAMA_8B.items():
            paired = name == "gate_up"
            n_cols = n // 2 if paired else n
            for words in s.INTERLEAVES:
                if not g.plane_groups(group, k, words):
                    continue
                w = _weight(n, k, group, words)
                for m in rows:
                    x = torch.empty(m, k, dtype=torch.bfloat16)
                    row_tiles = (0, *g.ROW_TILES) if m > g.MAX_ROWS else (0,)
                    for variant, block_n, block_m in itertools.product(
                            s._variants(m, words, paired), (16, 32, 64, 128), row_tiles):
                        tiled = s._with_tile(g.W4Config(64, 1, 4, 4, block_m=block_m)._replace(
                            **variant), m, n_cols, k, group, paired, block_n, words, cpu)
                        splits = {tiled.split_k, max(1, tiled.split_k // 2), 2 * tiled.split_k}
                        stage_counts = {tiled.num_stages, 4, 6}
                        for split, warps, stages in itertools.product(splits, (4, 8), stage_counts):
                            c = tiled._replace(split_k=split, num_warps=warps, num_stages=stages)
                            if s.launchable(c, m, n_cols, k, group, paired, words, cpu):
                                g.w4a16_gemm(x, w, silu_mul=paired, config=c)
    return unique_launches(launches)


def modelled_shared_memory(launch: Launch) -> int:
    """The decode kernel's shared memory by the model its launches are fitted by."""
    a = launch.args
    ops = Operands(a["WORDS"], g.PACK // a["PLANES_PER_GROUP"], a["x"].dtype.itemsize,
                   a["scales"].dtype.itemsize, a["SILU_MUL"])
    return shared_memory_need(ops, a["BLOCK_M"], a["BLOCK_N"], a["DOT"], a["W_LEFT"],
                              launch.num_stages)


def tightest(launches: list[Launch]) -> list[Launch]:
    """Per way the decode kernel stages its operands (tl.dot with either operand on the left,
    on tensor cores or not, a 64-row left operand (wgmma) or not, row tiles over 64 rows
    (mid M: several wgmma row blocks, or a wide right operand) or not; multiply-and-sum), the
    launch whose modelled shared memory is largest: where the model matters most."""
    def staging(launch: Launch) -> tuple:
        a = launch.args
        rows = a["BLOCK_N"] if a["W_LEFT"] else a["BLOCK_M"]
        return a["DOT"], a["W_LEFT"], a["DOT_PRECISION"], rows >= 64, a["BLOCK_M"] > 64
    best: dict[tuple, Launch] = {}
    for launch in launches:
        if launch.kernel.fn.__name__ == "_w4a16_kernel":
            key = staging(launch)
            if key not in best or modelled_shared_memory(launch) > modelled_shared_memory(best[key]):
                best[key] = launch
    return list(best.values())


def compile_and_check(launch: Launch) -> int:
    """Compiles `launch` for sm_90 and checks its PTX: tensor-core mma exactly with tl.dot on
    16-bit activations, the PDL wait, and no int-to-float conversion where the codes become
    floats by their bits; and its shared memory: within an H100's and, for the decode kernel,
    at most the model's (layers/int4_shared_memory.py). Returns the shared memory."""
    from sm90_compile import compile_sm90_kernel

    compiled = compile_sm90_kernel(launch.kernel, launch.args, launch.num_warps, launch.num_stages)
    ptx, shared = compiled.asm["ptx"], compiled.metadata.shared
    assert shared <= H100_SHARED_MEMORY, \
        f"shared memory {shared} bytes: more than an H100's {H100_SHARED_MEMORY}"
    assert "griddepcontrol.wait" in ptx, "no PDL wait"
    if launch.kernel.fn.__name__ == "_w4a16_kernel":
        modelled = modelled_shared_memory(launch)
        assert shared <= modelled, \
            f"shared memory {shared} bytes: more than the model's {modelled}"
        tensor_cores = launch.args["DOT"] and launch.args["DOT_PRECISION"] != "ieee"  # fp32 x: fma
        assert ("mma" in ptx) == tensor_cores, "tensor-core mma iff DOT on 16-bit operands"
        assert not launch.args["FMA_DEQUANT"] or "cvt.rn.f32.s32" not in ptx, \
            "an int-to-float conversion with FMA_DEQUANT"
    return shared


def compile_all(launches: list[Launch]) -> list[int]:
    """`compile_and_check` of every launch, in as many forked processes as the machine has
    cores (the compiles are CPU-bound and independent; a forked worker reads the launches from
    the parent's memory, so only indices and shared-memory sizes cross), in order."""
    global _LAUNCHES_TO_COMPILE
    _LAUNCHES_TO_COMPILE = launches
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        return pool.map(_compile_one, range(len(launches)), chunksize=1)


_LAUNCHES_TO_COMPILE: list[Launch] = []


def _compile_one(i: int) -> int:
    return compile_and_check(_LAUNCHES_TO_COMPILE[i])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true",
                        help="besides the engine's launches (about 1,000 compiles), every one "
                             "the sweep may try (about 1,500 more)")
    parser.add_argument("--tuned", help="a sweep's JSON: the engine's launches with its tables")
    args = parser.parse_args()
    import triton

    with tuned_tables_installed(args.tuned) if args.tuned else contextlib.nullcontext():
        engine = engine_launches()
    launches = unique_launches(engine + (sweep_launches() if args.sweep else []))
    # one launch of each set of constexprs first, then of each with other warps and stages,
    # then the rest (other argument alignments): a run cut short has compiled every code path
    def code(launch):
        return launch.kernel.fn.__name__, launch.constexprs()

    codes = {code(launch): launch for launch in reversed(launches)}
    tunings = {launch.name(): launch for launch in reversed(launches)}
    launches = sorted(launches, key=lambda launch: (codes[code(launch)] is not launch,
                                                    tunings[launch.name()] is not launch))
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(launches)} launches, "
          f"the first {len(codes)} one of each set of constexprs", flush=True)
    failed = 0
    for i, launch in enumerate(launches):
        try:
            compile_and_check(launch)
        except Exception as e:  # every failure named, then the count
            failed += 1
            message = str(e).strip().splitlines()
            print(f"FAILED {launch.name()}: {type(e).__name__}: {message[-1] if message else ''}",
                  flush=True)
        if (i + 1) % 50 == 0:
            print(f"{i + 1} done, {failed} failed", flush=True)
    print(f"compiled: {len(launches) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
