"""The tensor-parallel all-reduce alone: NCCL against the symmetric-memory one- and two-shot
algorithms (engine/layers/all_reduce.py) by message size, bf16, each replayed from a CUDA graph
of many calls (what decode steps do), on 2..N GPUs of this host.

    python bench/allreduce.py --world-sizes 2,4 --out docs/bench/allreduce.json

Prints microseconds per call and the algorithm the engine's size rule picks; keep NCCL's
NVLS off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1) as on every lent machine.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KB = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CALLS_PER_GRAPH = 64
REPLAYS = 20


def _time_graph(fn, x: torch.Tensor) -> float:
    """Microseconds per call of fn(x), CALLS_PER_GRAPH calls captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (REPLAYS * CALLS_PER_GRAPH)


def _rank(rank: int, world: int, store_path: str, rows) -> None:
    from specserve.engine.layers.all_reduce import (AllReduceSizes, Algorithm,
                                                    SymmetricAllReduce)

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(world)))
    top = max(SIZES_KB) * 1024
    one_shot = SymmetricAllReduce(group, torch.device("cuda", rank), AllReduceSizes(top, top))
    two_shot = SymmetricAllReduce(group, torch.device("cuda", rank), AllReduceSizes(0, top))
    engine_rule = AllReduceSizes()
    for kb in SIZES_KB:
        x = torch.ones(kb * 1024 // 2, dtype=torch.bfloat16, device="cuda")
        times = {"nccl": _time_graph(lambda t: dist.all_reduce(t, group=group), x),
                 "one_shot": _time_graph(one_shot, x), "two_shot": _time_graph(two_shot, x)}
        if rank == 0:
            picked = engine_rule.algorithm(kb * 1024)
            rows.append(dict(world=world, kb=kb, **{f"{k}_us": v for k, v in times.items()},
                             engine=picked.value,
                             engine_us=times["nccl" if picked is Algorithm.NCCL else picked.value],
                             device=torch.cuda.get_device_name()))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2")
    ap.add_argument("--out", default="bench_allreduce.json")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    rows: list = []
    with mp.Manager() as manager:
        shared = manager.list()
        for world in (int(w) for w in args.world_sizes.split(",")):
            if torch.cuda.device_count() < world:
                print(f"skipping {world} ranks: {torch.cuda.device_count()} GPUs")
                continue
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), shared), nprocs=world)
        rows = list(shared)
    print(f"{'ranks':>5} {'KB':>6} {'nccl us':>8} {'1-shot':>8} {'2-shot':>8} {'engine':>9} "
          f"{'vs nccl':>8}")
    for r in rows:
        print(f"{r['world']:>5} {r['kb']:>6} {r['nccl_us']:>8.1f} {r['one_shot_us']:>8.1f} "
              f"{r['two_shot_us']:>8.1f} {r['engine']:>9} {r['nccl_us'] / r['engine_us']:>7.2f}x")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
