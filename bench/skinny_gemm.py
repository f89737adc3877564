"""The skinny GEMM against cuBLAS at Llama's decode shapes: microseconds and % of copy bandwidth.

    python bench/skinny_gemm.py --out bench_skinny_gemm.json
    python bench/skinny_gemm.py --sweep --rows 1,4,16 --out bench_skinny_gemm_sweep.json

For each weight of Llama-3.1-8B and Llama-3.2-1B (bf16, one rank) and each M (rows: decode
batch size), the kernels run as the engine runs them, replayed from one CUDA graph of at least
20 calls: cuBLAS is F.linear (for gate_up F.linear, then the fused silu_and_mul kernel it
replaces), the skinny kernel runs with `default_config` (what the engine uses). The calls cycle
through enough copies of the weight (>= 128 MiB together) that none is still in L2 when it is
read again, so a row is a read of the weight from HBM: `copy%` is weight bytes / time over the
device-to-device copy bandwidth measured in this run (bench/one_batch.py's bs=1 limit).
`--sweep` also times a grid of launch configs per (shape, M) and prints the best of each: the
numbers to retune `default_config` and `prefers_skinny` (engine/layers/skinny_gemm.py) from.
Each swept config compiles once (about a second): sweep a few shapes or rows per run, e.g.
`--sweep --shapes 1b.qkv,1b.o --rows 1,4,16`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from one_batch import copy_bandwidth  # bench/ is this script's folder
from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.layers.skinny_gemm import (
    PARTIAL_CAPACITY, SkinnyConfig, default_config, skinny_gemm)

SHAPES = {  # name: (N, K) of the weight; gate_up is the fused [2I, K] gate/up weight
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192),
}
ROTATION_BYTES = 128 << 20   # weight copies cycled through: more than an H100/H200's 50 MiB L2
MIN_CALLS = 20               # calls per graph


def time_per_call(calls: list[Callable[[], object]], replays: int = 30) -> float:
    """Seconds per call: the calls captured in one CUDA graph, the median replay / len(calls)."""
    for call in calls:  # compiles, and makes the skinny workspace outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del graph
    return statistics.median(times) / len(calls)


class Scene:
    """Weight copies and inputs for one (shape, M): call i reads copy i % copies."""

    def __init__(self, n: int, k: int, m: int, device):
        weight_bytes = n * k * 2
        copies = max(1, -(-ROTATION_BYTES // weight_bytes))
        self.weights = [(torch.randn(n, k, device=device) * 0.02).bfloat16() for _ in range(copies)]
        self.num_calls = max(MIN_CALLS, copies)
        self.inputs = [torch.randn(m, k, device=device).bfloat16() for _ in range(self.num_calls)]
        self.weight_bytes = weight_bytes

    def calls(self, op: Callable[[torch.Tensor, torch.Tensor], object]) -> list[Callable[[], object]]:
        return [lambda i=i: op(self.inputs[i], self.weights[i % len(self.weights)])
                for i in range(self.num_calls)]


def cublas_op(silu: bool):
    if silu:
        return lambda x, w: silu_and_mul(F.linear(x, w))
    return F.linear


def skinny_op(silu: bool, config=None):
    return lambda x, w: skinny_gemm(x, w, silu_mul=silu, config=config)


def sweep_configs(args, m: int, n: int, k: int, silu: bool) -> list[SkinnyConfig]:
    grid = [[int(v) for v in getattr(args, f"sweep_{name}").split(",")]
            for name in ("block_n", "block_k", "splits", "warps", "stages")]
    dots = (True, False) if m <= args.sweep_nodot_rows else (True,)
    return [SkinnyConfig(block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=st, dot=d)
            for bn, bk, s, w, st, d in itertools.product(*grid, dots)
            if k // s >= bk and s * m * n * (2 if silu else 1) <= PARTIAL_CAPACITY]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8,16", help="M values (decode batch sizes)")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    ap.add_argument("--sweep-block-n", default="32,64,128")
    ap.add_argument("--sweep-block-k", default="128,256")
    ap.add_argument("--sweep-splits", default="1,2,4,8,16")
    ap.add_argument("--sweep-warps", default="4")
    ap.add_argument("--sweep-stages", default="3,4")
    ap.add_argument("--sweep-nodot-rows", type=int, default=2,
                    help="also sweep the multiply-and-sum path (dot=False) for M up to this")
    ap.add_argument("--out", default="bench_skinny_gemm.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows, best = [], []
    for name, m in itertools.product(args.shapes.split(","), (int(r) for r in args.rows.split(","))):
        n, k = SHAPES[name]
        silu = name.endswith("gate_up")
        scene = Scene(n, k, m, device)
        config = default_config(m, n // 2 if silu else n, k, silu, device)
        kernels = {"cublas": cublas_op(silu), "skinny": skinny_op(silu)}
        if args.sweep:
            for c in sweep_configs(args, m, n // 2 if silu else n, k, silu):
                kernels[f"skinny n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} "
                        f"st{c.num_stages}{'' if c.dot else ' nodot'}"] = skinny_op(silu, c)
        shape_rows = []
        for kernel, op in kernels.items():
            try:
                seconds = time_per_call(scene.calls(op))
            except Exception as e:  # a sweep config the compiler refuses (shared memory)
                print(f"{name} m={m} {kernel}: {type(e).__name__}: {str(e)[:120]}")
                continue
            shape_rows.append(dict(shape=name, n=n, k=k, m=m, kernel=kernel, us=seconds * 1e6,
                                   weight_GBps=scene.weight_bytes / seconds / 1e9,
                                   fraction_of_copy=scene.weight_bytes / seconds / bandwidth,
                                   config=config._asdict() if kernel == "skinny" else None))
            print(json.dumps(shape_rows[-1]), flush=True)
        rows += [r for r in shape_rows if r["kernel"] in ("cublas", "skinny")]
        if args.sweep:
            swept = [r for r in shape_rows if r["kernel"] not in ("cublas", "skinny")]
            best.extend(sorted(swept, key=lambda r: r["us"])[:3])
        del scene
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows,
              "sweep_best": best}
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"\n{result['device']}  copy bandwidth {bandwidth / 1e9:.0f} GB/s  (bf16, one weight read per call)")
    if best:
        print(f"\nbest swept configs (3 per shape and M)\n{'shape':12} {'M':>3} {'us':>8} {'copy%':>6}  config")
        for r in best:
            print(f"{r['shape']:12} {r['m']:3} {r['us']:8.2f} {100 * r['fraction_of_copy']:6.1f}  {r['kernel']}")
    print(f"\n{'shape':12} {'N':>6} {'K':>6} {'M':>3} {'cuBLAS us':>10} {'copy%':>6} {'skinny us':>10} "
          f"{'copy%':>6} {'speedup':>8}  default config")
    by_key = {(r["shape"], r["m"], r["kernel"]): r for r in rows}
    for name, m in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        cub, sk = by_key.get((name, m, "cublas")), by_key.get((name, m, "skinny"))
        if cub is None or sk is None:
            continue
        c = SkinnyConfig(**sk["config"])
        print(f"{name:12} {cub['n']:6} {cub['k']:6} {m:3} {cub['us']:10.2f} {100 * cub['fraction_of_copy']:6.1f} "
              f"{sk['us']:10.2f} {100 * sk['fraction_of_copy']:6.1f} {cub['us'] / sk['us']:8.2f}  "
              f"n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"
              f"{'' if c.dot else ' nodot'}")


if __name__ == "__main__":
    main()
