"""The Triton attention kernels alone: KV streamed per second against the copy bandwidth.

    python bench/attention_kernels.py --contexts 8192,32768 --batch-sizes 1,4 --out out.json

One layer of an 8B-shaped model (32 query heads, 8 KV heads, head_dim 128, bf16; `--kv-heads 4`:
Qwen3-30B-A3B's) over a pool holding every request's context in scattered slots (`--slots
contiguous`: consecutive ones, as a fresh pool gives a long prompt), a launch per
pool over copies of it that together outsize the L2 (`POOL_BYTES`), as the engine's layers do. Rows: plain decode, a 4-token chain
verify and an 8-token tree verify, each with the backend's default launch configs, plus a
sweep of decode configs (`--sweep`) to choose the defaults from, and the decode and chain
verify on given numbers of programs a tile's splits run on (`--split-programs 1,2,4,16`).
Kernels are replayed from a CUDA graph, as the engine runs them: timed with eager launches, a short decode measures the
host's launch cost (about 70 us for the two kernels), not the kernels. `--prefetch` adds each
default decode with its L2 prefetch (`DecodeConfig.prefetch_tokens`) flipped; with PDL each
launch's prefetch overlaps the launch before it, as in the engine it overlaps the q/k/v
kernel's tail. The 8B bs=1 step's short-context decode and its configs:

    python bench/attention_kernels.py --contexts 160,8192,32768 --batch-sizes 1,16 --prefetch
    python bench/attention_kernels.py --contexts 160 --batch-sizes 1 --sweep --sweep-splits 16 \
        --sweep-block-n 64,128 --sweep-stages 2,3 --sweep-min-split 64,256 --sweep-prefetch 0,128
`--kv-dtypes bf16,fp8` times every row over a bf16 and an FP8 pool (`kv_cache_dtype="fp8_e4m3"`:
half the bytes, non-unit scales), each with its pool's default configs; the sweep then picks
configs for each (FP8 also over `--sweep-fp8-convert`, how its tiles become bf16).

    python bench/attention_kernels.py --fp8-sweep --out fp8_sweep.json

is the FP8 decode's sweep at 32k tokens, bs 1 and 16 (about 100 rows, 50 compiles): the FP8
pool's default, its old config (the bf16 pool's: "cast" conversion, 3 stages, 16 splits),
the default with each of those back ("-cast", "-st3", "-s16"), and every FP8 candidate in 5
stages (64-, 128- and 256-token tiles, 4 and 8 warps, 16/32/64 splits, "cast" and "bits"),
beside the bf16 pool's default and its 128-token, 4-warp candidates in 5 stages
(Triton 3.6 double-buffers K and V from 5 stages on, for either pool), plus both verifies;
each decode row with its speed against the bf16 pool's default decode.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton.testing

from specserve.engine.attention.triton.kernels import (
    DecodeConfig, decode_attention, default_decode_config, fill_kv_indices, short_extend_attention)
from specserve.engine.kvcache.fp8 import FP8_KV_DTYPE, quantize

HEADS, HEAD_DIM = 32, 128
KV_HEADS = 8  # --kv-heads sets it
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_KV_DTYPE}
FP8_SCALE = 1 / 64  # randn / scale stays within e4m3's +-448; not 1.0, so the scaling runs
# Each timed launch reads a pool of its own, cycling over enough pools to hold this many bytes
# (five times an H100's 50 MB L2): in the engine the layers' pools follow each other between
# GEMMs, so no launch finds its KV in the L2. One pool replayed would: a bs=1, 32k FP8 pool
# is 67 MB, and its decode timed 43 us a layer here against 64 in the engine's profile.
POOL_BYTES = 256 << 20
# How the requests' slots lie in the pool: "random" (a long-running server's free list) or
# "contiguous" (a fresh pool's allocator hands a prompt consecutive slots: the engine's 32k rows).
SLOTS = "random"  # --slots sets it


def copy_bandwidth(device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    seconds = triton.testing.do_bench(lambda: torch.empty_like(src).copy_(src), rep=200) / 1000
    return 2 * (1 << 30) / seconds


def scene(bs: int, context: int, extend: int, device, kv_dtype: torch.dtype):
    """Pools (K and V, as many as POOL_BYTES asks), slot table, device offsets and the kernels'
    scales for `bs` requests of `context` cached tokens."""
    num_slots = bs * (context + extend) + 1
    k = torch.randn(num_slots, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scales = {}
    if kv_dtype == FP8_KV_DTYPE:
        k, v = quantize(k, FP8_SCALE), quantize(v, FP8_SCALE)
        scales = dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    copies = -(-POOL_BYTES // (2 * k.numel() * k.element_size()))
    pools = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
    order = (torch.randperm(num_slots - 1, device=device) if SLOTS == "random"
             else torch.arange(num_slots - 1, device=device))
    table = (order + 1).view(bs, context + extend)
    rows = torch.arange(bs, device=device)
    prefix = torch.full((bs,), context, device=device)
    return pools, table, rows, prefix, scales


def graph_seconds(fn) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph (the host's launch cost untimed).
    Triton's `do_bench_cudagraph` runs and captures `fn` on a stream of its own, which does not
    wait for the current one: the inputs `fn` reads, made on the current stream, must be
    complete first. Without the synchronize, verify rows whose 1 GB pool was still being
    filled read unwritten slot indices, an illegal address (H200, 8192 x 64 and 32768 x 16,
    the bench's only failures; never under CUDA_LAUNCH_BLOCKING=1)."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200) / 1000


def time_per_pool(launch, pools) -> float:
    """Seconds one `launch(k, v)` takes, replayed from a CUDA graph over every pool in turn."""
    def run():
        for k, v in pools:
            launch(k, v)
    return graph_seconds(run) / len(pools)


def time_decode(bs, context, config: DecodeConfig, max_kv_splits: int, device,
                kv_dtype: torch.dtype, split_programs: int = None) -> float:
    """Seconds a decode of `bs` requests over `context` tokens takes with `config`, its split
    scratch (so its splits) sized `max_kv_splits`."""
    pools, table, rows, prefix, scales = scene(bs, context, 1, device, kv_dtype)
    kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=device)
    kv_indices = torch.empty(bs * (context + 1), dtype=torch.int32, device=device)
    fill_kv_indices(table, rows, prefix, kv_indptr, kv_indices,
                    decode_token_slots=table[:, context].contiguous())
    q = torch.randn(bs, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    po = torch.empty(bs, HEADS, max_kv_splits, HEAD_DIM, device=device)
    pl = torch.empty(bs, HEADS, max_kv_splits, device=device)
    arrivals = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device=device)
    return time_per_pool(lambda k, v: decode_attention(
        q, k, v, out, kv_indptr, kv_indices, po, pl, arrivals, 0.088, config,
        split_programs=split_programs, **scales), pools)


def time_verify(bs, context, extend: int, tree: bool, config: DecodeConfig, max_kv_splits: int,
                device, kv_dtype: torch.dtype, split_programs: int = None) -> float:
    pools, table, rows, prefix, scales = scene(bs, context, extend, device, kv_dtype)
    kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=device)
    kv_indices = torch.empty(bs * context, dtype=torch.int32, device=device)
    fill_kv_indices(table, rows, prefix, kv_indptr, kv_indices)
    qo_indptr = torch.arange(0, (bs + 1) * extend, extend, device=device)
    new_slots = table[:, context:].reshape(-1)
    q = torch.randn(bs * extend, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    po = torch.empty(bs * extend, HEADS, max_kv_splits, HEAD_DIM, device=device)
    pl = torch.empty(bs * extend, HEADS, max_kv_splits, device=device)
    arrivals = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device=device)
    mask = torch.ones(bs, extend, extend, dtype=torch.bool, device=device).tril() if tree else None
    return time_per_pool(lambda k, v: short_extend_attention(
        q, k, v, out, qo_indptr, kv_indptr, kv_indices, new_slots, extend, 0.088, po, pl,
        arrivals, custom_mask=mask, config=config, split_programs=split_programs, **scales),
        pools)


def main():
    global KV_HEADS, SLOTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-kv-splits", type=int, default=None,
                    help="splits of the default rows (default: their config's)")
    ap.add_argument("--sweep", action="store_true", help="also time decode launch configs")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="the FP8 decode's sweep at 32k, bs 1 and 16 (sets the options below)")
    ap.add_argument("--sweep-fp8-convert", default="cast,bits",
                    help="DecodeConfig.fp8_convert values (FP8 pools only)")
    ap.add_argument("--sweep-block-n", default="32,64,128")
    ap.add_argument("--sweep-splits", default="16,32,64")
    ap.add_argument("--sweep-stages", default="2,3,4")
    ap.add_argument("--sweep-warps", default="4,8")
    ap.add_argument("--sweep-min-split", default="256",
                    help="DecodeConfig.min_kv_split_len values (tokens a split, at least)")
    ap.add_argument("--sweep-prefetch", default="0",
                    help="DecodeConfig.prefetch_tokens values (the L2 prefetch before the wait)")
    ap.add_argument("--prefetch", action="store_true",
                    help="also time each default decode with its L2 prefetch flipped (off where "
                         "the default has it, else on for sequences of one split)")
    ap.add_argument("--split-programs", default="",
                    help="also time the default decode and chain verify with these many "
                         "programs a tile's splits run on (comma list; the default: "
                         "default_split_programs's choice)")
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS, help="of the 32 query heads")
    ap.add_argument("--slots", default=SLOTS, choices=["random", "contiguous"],
                    help="the requests' KV slots: scattered over the pool, or consecutive")
    ap.add_argument("--kv-dtypes", default="bf16", help="comma list of: " + ", ".join(KV_DTYPES))
    ap.add_argument("--out", default="bench_attention_kernels.json")
    if ap.parse_known_args()[0].fp8_sweep:  # its defaults; options given still win
        ap.set_defaults(sweep=True, contexts="32768", batch_sizes="1,16", kv_dtypes="bf16,fp8",
                        sweep_block_n="64,128,256", sweep_splits="16,32,64", sweep_stages="5",
                        sweep_warps="4,8", sweep_min_split="256",
                        sweep_fp8_convert="cast,bits")
    args = ap.parse_args()
    KV_HEADS, SLOTS = args.kv_heads, args.slots
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows = []
    for context, bs, kv_name in itertools.product((int(c) for c in args.contexts.split(",")),
                                                  (int(b) for b in args.batch_sizes.split(",")),
                                                  args.kv_dtypes.split(",")):
        kv_dtype = KV_DTYPES[kv_name]
        kv_bytes_per_token = 2 * KV_HEADS * HEAD_DIM * kv_dtype.itemsize  # K and V of one token
        default = default_decode_config(HEAD_DIM, device, kv_dtype=kv_dtype)
        splits = args.max_kv_splits or default.max_kv_splits
        kernels = {"decode": lambda: time_decode(bs, context, default, splits, device, kv_dtype),
                   "verify-chain-4": lambda: time_verify(bs, context, 4, False, default, splits,
                                                         device, kv_dtype),
                   "verify-tree-8": lambda: time_verify(bs, context, 8, True, default, splits,
                                                        device, kv_dtype)}
        for programs in (int(p) for p in args.split_programs.split(",") if p):
            # (the number of splits: a program a split, the grid before split programs)
            kernels[f"decode sp{programs}"] = (lambda n=programs: time_decode(
                bs, context, default, splits, device, kv_dtype, n))
            kernels[f"verify-chain-4 sp{programs}"] = (lambda n=programs: time_verify(
                bs, context, 4, False, default, splits, device, kv_dtype, n))
        if kv_name == "fp8":
            # What FP8 pools ran before they had configs of their own: the bf16 pool's; and
            # the default with each of its changes from that undone.
            old = default_decode_config(HEAD_DIM, device)
            undone = {"bf16-config": old,
                      "-cast": default._replace(fp8_convert=old.fp8_convert),
                      f"-st{old.num_stages}": default._replace(num_stages=old.num_stages),
                      f"-s{old.max_kv_splits}": default._replace(max_kv_splits=old.max_kv_splits)}
            for name, config in undone.items():
                if config != default:
                    kernels[f"decode {name}"] = (lambda c=config: time_decode(
                        bs, context, c, c.max_kv_splits, device, kv_dtype))
        if args.prefetch:
            flipped = default._replace(prefetch_tokens=0 if default.prefetch_tokens else
                                       1 << (default.min_kv_split_len - 1).bit_length())
            kernels[f"decode prefetch{flipped.prefetch_tokens}"] = (
                lambda c=flipped: time_decode(bs, context, c, splits, device, kv_dtype))
        if args.sweep:
            grid = [[int(x) for x in getattr(args, f"sweep_{name}").split(",")]
                    for name in ("block_n", "splits", "stages", "warps", "min_split", "prefetch")]
            if args.fp8_sweep and kv_name != "fp8":  # the bf16 pool's tiles and warps
                grid[0], grid[3] = [default.block_n], [default.num_warps]
            converts = args.sweep_fp8_convert.split(",") if kv_name == "fp8" else ["cast"]
            for (block_n, max_splits, stages, warps, min_split, prefetch), convert in \
                    itertools.product(itertools.product(*grid), converts):
                config = DecodeConfig(block_n=block_n, min_kv_split_len=min_split,
                                      num_warps=warps, num_stages=stages,
                                      max_kv_splits=max_splits, fp8_convert=convert,
                                      prefetch_tokens=prefetch)
                name = (f"decode n{block_n} s{max_splits} st{stages} w{warps} m{min_split}"
                        + (f" p{prefetch}" if prefetch else ""))
                kernels[name + (f" {convert}" if kv_name == "fp8" else "")] = \
                    (lambda c=config: time_decode(bs, context, c, c.max_kv_splits, device,
                                                  kv_dtype))
        for name, run in kernels.items():
            try:
                seconds = run()
            except Exception as e:  # a sweep config the compiler refuses (shared memory)
                print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            kv_read = bs * context * kv_bytes_per_token
            rows.append(dict(kernel=f"{name} [{kv_name}]", kv_dtype=kv_name, context=context,
                             batch_size=bs, us=seconds * 1e6,
                             kv_GBps=kv_read / seconds / 1e9,
                             fraction_of_copy=kv_read / seconds / bandwidth))
            print(json.dumps(rows[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "slots": SLOTS, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"\n{result['device']}  copy bandwidth {bandwidth / 1e9:.0f} GB/s (one layer)")
    # "x bf16": the bf16 pool's default decode's time over the row's (same context and bs)
    bf16_decode = {(r["context"], r["batch_size"]): r["us"] for r in rows
                   if r["kernel"] == "decode [bf16]"}
    print(f"{'kernel':48} {'ctx':>6} {'bs':>3} {'us':>8} {'KV GB/s':>8} {'copy%':>6} {'x bf16':>6}")
    for r in sorted(rows, key=lambda r: (r["context"], r["batch_size"], r["us"])):
        base = bf16_decode.get((r["context"], r["batch_size"]))
        ratio = f"{base / r['us']:6.2f}" if base and r["kernel"].startswith("decode") else ""
        print(f"{r['kernel']:48} {r['context']:6} {r['batch_size']:3} {r['us']:8.1f} "
              f"{r['kv_GBps']:8.0f} {100 * r['fraction_of_copy']:6.1f} {ratio:>6}")
    for (context, bs, kv_name), group in itertools.groupby(
            sorted((r for r in rows if r["kernel"].startswith("decode")),
                   key=lambda r: (r["context"], r["batch_size"], r["kv_dtype"], r["us"])),
            key=lambda r: (r["context"], r["batch_size"], r["kv_dtype"])):
        print(f"fastest {kv_name} decode at {context} tokens, bs {bs}: {next(group)['kernel']}")


if __name__ == "__main__":
    main()
