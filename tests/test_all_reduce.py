"""The tensor-parallel all-reduce by message size (engine/layers/all_reduce.py): the size rule,
where it stays off, and on GPUs (2 and 4 ranks) sums equal to torch.distributed.all_reduce's
for every algorithm, dtype and size, eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.engine.layers.all_reduce import DTYPES as ALL_REDUCE_DTYPES
from specserve.engine.layers.all_reduce import (AllReduceSizes, Algorithm, SymmetricAllReduce,
                                                make_all_reduce)
from specserve.engine.layers.parallel import TensorParallel


def test_size_rule():
    sizes = AllReduceSizes(one_shot_max=1024, two_shot_max=4096)
    assert [sizes.algorithm(n) for n in (0, 1024, 1040, 4096, 4112)] == [
        Algorithm.ONE_SHOT, Algorithm.ONE_SHOT, Algorithm.TWO_SHOT, Algorithm.TWO_SHOT,
        Algorithm.NCCL]
    # Sizes the 16-byte vectors do not divide go to NCCL whatever their size.
    assert [sizes.algorithm(n) for n in (2, 14, 1030, 4094)] == [Algorithm.NCCL] * 4
    assert AllReduceSizes(one_shot_max=0, two_shot_max=0).algorithm(1) is Algorithm.NCCL
    with pytest.raises(ValueError, match="one_shot_max <= two_shot_max"):
        AllReduceSizes(one_shot_max=8192, two_shot_max=4096)


def test_off_without_cuda_or_when_disabled():
    cpu = torch.device("cpu")
    assert make_all_reduce(None, 2, cpu, enabled=True) is None
    assert make_all_reduce(None, 2, torch.device("cuda", 0), enabled=False) is None
    assert make_all_reduce(None, 1, torch.device("cuda", 0), enabled=True) is None


def test_tensor_parallel_uses_its_reducer_and_one_rank_none():
    calls = []

    def reducer(x):
        calls.append(x)
        return x * 2

    x = torch.ones(3)
    assert TensorParallel(2, 0, None, reducer).all_reduce(x).tolist() == [2.0, 2.0, 2.0]
    assert calls == [x]
    assert TensorParallel(1, 0, None, reducer).all_reduce(x) is x and len(calls) == 1


# --- GPUs ---------------------------------------------------------------------------------------
SIZES = (1, 7, 2048, 4096 * 3, 65536 + 5, 262144, 1 << 20, (1 << 22) + 3)  # elements
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float16: NCCL's, whatever the size


def _graph_case(reducer, x: torch.Tensor, want: torch.Tensor, world: int) -> bool:
    """reducer(x) replayed from a CUDA graph, the input refilled between replays; the graph is
    freed on return (a live graph holding a captured NCCL call stalls the group's teardown)."""
    device = x.device
    static = torch.zeros_like(x)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        reducer(static.clone())  # warm up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = reducer(static.clone())
    ok = True
    for replay in range(2):
        static.copy_(x + replay)
        graph.replay()
        ok &= torch.equal(out, want + world * replay)
    torch.cuda.synchronize(device)
    return ok


def _check_ranks(rank: int, world: int, store_path: str, failures) -> None:
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        device = torch.device("cuda", rank)
        group = dist.new_group(list(range(world)))
        reducer = make_all_reduce(group, world, device, enabled=True)
        assert isinstance(reducer, SymmetricAllReduce), "custom all-reduce did not start"
        seen = set()
        for dtype in DTYPES:
            for numel in SIZES:
                gen = torch.Generator(device=device).manual_seed(1000 * rank + numel)
                # Small integers: every summation order gives the same value in every dtype.
                x = torch.randint(-8, 8, (numel,), generator=gen, device=device).to(dtype)
                want = x.clone()
                dist.all_reduce(want, group=group)
                if dtype in ALL_REDUCE_DTYPES:
                    seen.add(reducer.sizes.algorithm(x.numel() * x.element_size()))
                if not torch.equal(reducer(x.clone()), want):
                    failures.append(f"rank {rank} eager {dtype} {numel}")
                if not _graph_case(reducer, x, want, world):
                    failures.append(f"rank {rank} graph {dtype} {numel}")
        assert seen == set(Algorithm), seen
    except BaseException as e:  # reported by the parent
        failures.append(f"rank {rank}: {e!r}")
        raise
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_equals_nccl_on_gpus(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with mp.Manager() as manager:
        failures = manager.list()
        mp.spawn(_check_ranks, args=(world, str(tmp_path / "store"), failures), nprocs=world)
        assert list(failures) == []
