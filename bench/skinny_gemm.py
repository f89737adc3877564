"""The skinny GEMM against cuBLAS at the decode shapes of the models we bench (Llama, DeepSeek-V2-Lite, Qwen3-MoE): microseconds and % of copy bandwidth.

    python bench/skinny_gemm.py --out bench_skinny_gemm.json
    python bench/skinny_gemm.py --sweep --rows 1,4,16 --out bench_skinny_gemm_sweep.json

For each weight of Llama-3.1-8B and Llama-3.2-1B (bf16, one rank) and each M (rows: decode
batch size), the kernels run as the engine runs them, replayed from one CUDA graph of at least
20 calls: cuBLAS is F.linear (for gate_up F.linear, then the fused silu_and_mul kernel it
replaces), the skinny kernel runs with `default_config` (what the engine uses). The calls cycle
through enough copies of the weight (>= 128 MiB together) that none is still in L2 when it is
read again, so a row is a read of the weight from HBM: `copy%` is weight bytes / time over the
device-to-device copy bandwidth measured in this run (bench/one_batch.py's bs=1 limit).
`--qkv-rope` times the q/k/v weights instead as the engine's decode runs them, with RoPE and
the KV store in the epilogue (`skinny_qkv_rope`), in the engine's config with and without an
L2 weight prefetch before the wait, and another tiling (`qkv_rope_variants`):

    python bench/skinny_gemm.py --qkv-rope --shapes 8b.qkv,1b.qkv --rows 1,16

`--sweep` also searches launch configs per (shape, M) and prints the best of each: the numbers
to retune `default_config` and `prefers_skinny` (engine/layers/skinny_gemm.py) from. The search
is a coordinate descent from the default config (one parameter at a time over `SWEEP_AXES`,
keeping the best, `--sweep-rounds` passes), about 25 configs per (shape, M) a pass; each new
config compiles once (about a second), so split a long sweep over several runs with
`--shapes` / `--rows`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from one_batch import copy_bandwidth  # bench/ is this script's folder
from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.layers.rotary import RotaryEmbedding
from specserve.engine.layers.skinny_gemm import (
    PARTIAL_CAPACITY, QKV_ROPE_WEIGHT_PREFETCH_BYTES, SkinnyConfig, _qkv_rope_config,
    default_config, rule_config, skinny_gemm, skinny_qkv_rope)

SHAPES = {  # name: (N, K) of the weight; gate_up is the fused [2I, K] gate/up weight
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192),
    # DeepSeek-V2-Lite (q and kv_a in one weight; the dense first layer's MLP), Qwen3-30B-A3B.
    "v2l.q_kv_a": (3648, 2048), "v2l.o": (2048, 2048), "v2l.gate_up": (21888, 2048), "v2l.down": (2048, 10944),
    "q3moe.qkv": (5120, 2048), "q3moe.o": (2048, 4096),
    # One rank's shard at tensor parallelism (qkv/gate_up split by rows, o/down by columns).
    "8b.tp2.qkv": (3072, 4096), "8b.tp2.o": (4096, 2048), "8b.tp2.gate_up": (14336, 4096), "8b.tp2.down": (4096, 7168),
    "8b.tp4.qkv": (1536, 4096), "8b.tp4.o": (4096, 1024), "8b.tp4.gate_up": (7168, 4096), "8b.tp4.down": (4096, 3584),
    "70b.tp4.qkv": (2560, 8192), "70b.tp4.o": (8192, 2048), "70b.tp4.gate_up": (14336, 8192),
    "70b.tp4.down": (8192, 7168),
}
# (query heads, KV heads, head dim) of the q/k/v weights `--qkv-rope` times with RoPE.
QKV_HEADS = {"8b.qkv": (32, 8, 128), "1b.qkv": (32, 8, 64), "8b.tp2.qkv": (16, 4, 128),
             "8b.tp4.qkv": (8, 2, 128)}
ROTATION_BYTES = 128 << 20   # weight copies cycled through: more than an H100/H200's 50 MiB L2
MIN_CALLS = 20               # calls per graph
SWEEP_AXES = {"block_n": (16, 32, 64, 128, 256), "block_k": (32, 64, 128, 256, 512),
              "split_k": (1, 2, 4, 8, 16, 32), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5, 6),
              "dot": (True, False)}
MAX_NODOT_REGS = 128         # fp32 accumulator values per thread of the multiply-and-sum path


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


def skinny_op(silu: bool, config: Optional[SkinnyConfig] = None):
    return lambda x, w: skinny_gemm(x, w, silu_mul=silu, config=config)


def config_name(c: SkinnyConfig) -> str:
    return (f"n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"
            f"{'' if c.dot else ' nodot'}")


def launchable(c: SkinnyConfig, m: int, n: int, k: int, silu: bool) -> bool:
    """Configs worth timing: every split gets K, the partials fit the workspace, and the
    multiply-and-sum path's [M, BLOCK_N, BLOCK_K] accumulators fit in registers."""
    halves = 2 if silu else 1
    m_pad = 1 << (m - 1).bit_length()
    return (k // c.split_k >= c.block_k and c.split_k * m * n * halves <= PARTIAL_CAPACITY
            and (c.dot or m_pad * c.block_n * c.block_k * halves <= MAX_NODOT_REGS * 32 * c.num_warps))


def sweep(start: SkinnyConfig, m: int, n: int, k: int, silu: bool, rounds: int,
          time_config: Callable[[SkinnyConfig], Optional[float]],
          axes: Optional[dict[str, tuple]] = None) -> dict[SkinnyConfig, float]:
    """Coordinate descent over `axes` (SWEEP_AXES) from `start`: every config timed (seconds)."""
    timed: dict[SkinnyConfig, float] = {}
    best = start
    for _ in range(rounds):
        for field, values in (axes or SWEEP_AXES).items():
            for value in values:
                c = best._replace(**{field: value})
                if c in timed or not launchable(c, m, n, k, silu):
                    continue
                seconds = time_config(c)
                if seconds is None:
                    continue
                timed[c] = seconds
                if best not in timed or seconds < timed[best]:
                    best = c
    return timed


def qkv_rope_variants(m: int, n: int, k: int, head_dim: int,
                      device) -> dict[str, tuple[SkinnyConfig, int]]:
    """`skinny_qkv_rope`'s (config, weight prefetch bytes) to time for a weight [n, k]: the
    engine's (`_qkv_rope_config`, `QKV_ROPE_WEIGHT_PREFETCH_BYTES`), with 1 and 2 KiB of
    each weight row prefetched into the L2 before the wait, and the rule over 16-column pairs
    (32 weight rows a program, as the plain GEMM's 32-column tiles: no split-K at the 8B
    shape), without and with the 1 KiB prefetch."""
    engine = _qkv_rope_config(m, n, k, head_dim, device)
    pairs16 = rule_config(m, n // 2, k, True, device, block_n=16)
    return {f"engine (prefetch {QKV_ROPE_WEIGHT_PREFETCH_BYTES})": (engine, QKV_ROPE_WEIGHT_PREFETCH_BYTES),
            "engine prefetch 1024": (engine, 1024), "engine prefetch 2048": (engine, 2048),
            "pairs16 prefetch 0": (pairs16, 0), "pairs16 prefetch 1024": (pairs16, 1024)}


def qkv_rope_rows(name: str, m: int, device, bandwidth: float) -> list[dict]:
    """The q/k/v projection with RoPE and the KV store (`skinny_qkv_rope`, the engine's
    decode q/k/v kernel) in its `qkv_rope_variants`, beside the plain skinny GEMM of the same
    weight: microseconds and % of copy bandwidth."""
    n, k = SHAPES[name]
    heads, kv_heads, dim = QKV_HEADS[name]
    scene = Scene(n, k, m, device)
    rotary = RotaryEmbedding(dim, 8192, 500000.0, None).to(device)
    positions = torch.arange(m, device=device) * 97 + 130
    loc = torch.randperm(4 * m, device=device)[:m]
    k_cache = torch.zeros(4 * m, kv_heads, dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    variants = {"plain skinny (no rope)": None, **qkv_rope_variants(m, n, k, dim, device)}
    rows = []
    for variant, setting in variants.items():
        if setting is None:
            op = skinny_op(False)
            config = default_config(m, n, k, False, device)
        else:
            config, prefetch = setting
            op = (lambda x, w, c=config, p=prefetch: skinny_qkv_rope(
                x, w, None, heads, kv_heads, positions, rotary.cos, rotary.sin, k_cache,
                v_cache, loc, config=c, weight_prefetch_bytes=p))
        seconds = time_per_call(scene.calls(op))
        rows.append(dict(shape=name, n=n, k=k, m=m, kernel=f"qkv_rope {variant}", us=seconds * 1e6,
                         weight_GBps=scene.weight_bytes / seconds / 1e9,
                         fraction_of_copy=scene.weight_bytes / seconds / bandwidth,
                         config=config._asdict()))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def print_tables(rows: list[dict], swept: list[dict]) -> None:
    """The two tables of engine/layers/skinny_gemm.py, from this run: the best config per
    (shape, M), and per weight the largest M up to which the skinny kernel (at its best config)
    beats cuBLAS."""
    best: dict[tuple[str, int], dict] = {}
    for r in swept:
        key = (r["shape"], r["m"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nTUNED_CONFIGS = {")
    for (name, m), r in best.items():
        n_out = r["n"] // 2 if name.endswith("gate_up") else r["n"]
        print(f"    ({m}, {n_out}, {r['k']}, {name.endswith('gate_up')}): "
              f"SkinnyConfig({', '.join(f'{f}={v}' for f, v in r['config'].items())}),  "
              f"# {name}: {r['us']:.2f} us")
    print("}")
    cublas = {(r["shape"], r["m"]): r["us"] for r in rows if r["kernel"] == "cublas"}
    print("SKINNY_MAX_ROWS = {  # only weights where cuBLAS wins at some M")
    for name in dict.fromkeys(name for name, _ in best):
        ms = sorted(m for shape, m in best if shape == name)
        wins = [m for m in ms if best[name, m]["us"] < cublas.get((name, m), float("inf"))]
        loses = [m for m in ms if m not in wins]
        if loses:
            limit = max([m for m in wins if m < min(loses)], default=0)
            print(f"    {SHAPES[name]}: {limit},  # {name}: cuBLAS faster at M = {loses}")
    print("}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8,16", help="M values (decode batch sizes)")
    ap.add_argument("--sweep", action="store_true", help="also search launch configs per shape and M")
    ap.add_argument("--sweep-rounds", type=int, default=2)
    ap.add_argument("--qkv-rope", action="store_true",
                    help="only the q/k/v weights among --shapes, timed with RoPE and the KV store "
                         "(skinny_qkv_rope) in the engine's config, with and without a weight "
                         "prefetch, and another tiling (`qkv_rope_variants`)")
    ap.add_argument("--out", default="bench_skinny_gemm.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows, swept = [], []
    if args.qkv_rope:
        for name, m in itertools.product([s for s in args.shapes.split(",") if s in QKV_HEADS],
                                         (int(r) for r in args.rows.split(","))):
            rows += qkv_rope_rows(name, m, device, bandwidth)
        print(f"\n{torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e9:.0f} GB/s")
        print(f"{'shape':12} {'M':>3} {'kernel':34} {'us':>8} {'copy%':>6}  config")
        for r in rows:
            print(f"{r['shape']:12} {r['m']:3} {r['kernel']:34} {r['us']:8.2f} "
                  f"{100 * r['fraction_of_copy']:6.1f}  {config_name(SkinnyConfig(**r['config']))}")
        json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
                   "date": time.strftime("%Y-%m-%d"), "rows": rows}, open(args.out, "w"), indent=1)
        return
    for name, m in itertools.product(args.shapes.split(","), (int(r) for r in args.rows.split(","))):
        n, k = SHAPES[name]
        silu = name.endswith("gate_up")
        n_out = n // 2 if silu else n
        scene = Scene(n, k, m, device)

        def record(kernel: str, op, config: Optional[SkinnyConfig]) -> Optional[float]:
            try:
                seconds = time_per_call(scene.calls(op))
            except Exception as e:  # a swept config the compiler refuses (shared memory)
                print(f"{name} m={m} {kernel}: {type(e).__name__}: {str(e)[:120]}")
                return None
            row = dict(shape=name, n=n, k=k, m=m, kernel=kernel, us=seconds * 1e6,
                       weight_GBps=scene.weight_bytes / seconds / 1e9,
                       fraction_of_copy=scene.weight_bytes / seconds / bandwidth,
                       config=None if config is None else config._asdict())
            (rows if kernel in ("cublas", "skinny") else swept).append(row)
            print(json.dumps(row), flush=True)
            return seconds

        default = default_config(m, n_out, k, silu, device)
        record("cublas", cublas_op(silu), None)
        record("skinny", skinny_op(silu), default)
        if args.sweep:
            sweep(default, m, n_out, k, silu, args.sweep_rounds,
                  lambda c: record(f"sweep {config_name(c)}", skinny_op(silu, c), c))
        del scene
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows,
              "swept": swept}
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"\n{result['device']}  copy bandwidth {bandwidth / 1e9:.0f} GB/s  (bf16, one weight read per call)")
    by_key = {(r["shape"], r["m"], r["kernel"]): r for r in rows}
    if swept:
        print(f"\nbest swept configs (3 per shape and M)\n{'shape':12} {'M':>3} {'us':>8} {'copy%':>6} "
              f"{'vs cuBLAS':>9}  config")
        for name, m in dict.fromkeys((r["shape"], r["m"]) for r in swept):
            cub = by_key.get((name, m, "cublas"))
            for r in sorted((r for r in swept if (r["shape"], r["m"]) == (name, m)), key=lambda r: r["us"])[:3]:
                ratio = f"{cub['us'] / r['us']:9.2f}" if cub else f"{'-':>9}"
                print(f"{name:12} {m:3} {r['us']:8.2f} {100 * r['fraction_of_copy']:6.1f} {ratio}  "
                      f"{r['kernel'][len('sweep '):]}")
    if swept:
        print_tables(rows, swept)
    print(f"\n{'shape':12} {'N':>6} {'K':>6} {'M':>3} {'cuBLAS us':>10} {'copy%':>6} {'skinny us':>10} "
          f"{'copy%':>6} {'speedup':>8}  default config")
    for name, m in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        cub, sk = by_key.get((name, m, "cublas")), by_key.get((name, m, "skinny"))
        if cub is None or sk is None:
            continue
        print(f"{name:12} {cub['n']:6} {cub['k']:6} {m:3} {cub['us']:10.2f} {100 * cub['fraction_of_copy']:6.1f} "
              f"{sk['us']:10.2f} {100 * sk['fraction_of_copy']:6.1f} {cub['us'] / sk['us']:8.2f}  "
              f"{config_name(SkinnyConfig(**sk['config']))}")


if __name__ == "__main__":
    main()
