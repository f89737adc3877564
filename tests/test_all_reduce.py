"""The tensor-parallel all-reduce by message size (engine/layers/all_reduce.py): the size rule,
where it stays off, and on GPUs (2 and 4 ranks) sums equal to torch.distributed.all_reduce's
for every algorithm, dtype and size, eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import make_predictable_pair, random_prompts, tp_placement

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


# --- rendezvous after earlier engines in the process (layers/symmetric_memory.py) ---------------
def _rendezvous_rank(rank: int, world: int, store_path: str, earlier: list, results) -> None:
    """One gloo rank whose process made earlier[rank] rendezvous before; torch's rendezvous and
    allocation (CUDA only) are replaced by recorders of the group each rendezvous went to."""
    from specserve.engine.layers import symmetric_memory

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        groups = []
        symmetric_memory._torch_rendezvous = lambda buffer, group: groups.append(
            dist.get_process_group_ranks(group))
        symmetric_memory.empty = lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8)
        symmetric_memory._rendezvous_count = earlier[rank]
        group = dist.new_group(list(range(world)))
        for _ in range(2):  # the first catches up, the second finds every rank level
            symmetric_memory.rendezvous(torch.empty(16, dtype=torch.uint8), group)
        results[rank] = (groups, symmetric_memory._rendezvous_count)
    finally:
        dist.destroy_process_group()


def test_rendezvous_brings_every_process_to_the_same_count(tmp_path):
    """A rank whose process made fewer rendezvous (a fresh follower beside a rank 0 that served an
    earlier engine) first rendezvouses alone as often as it lags; then all rendezvous together."""
    world, earlier = 3, [2, 0, 1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rendezvous_rank, args=(world, str(tmp_path / "store"), earlier, results), nprocs=world)
        results = dict(results)
    everyone = [0, 1, 2]
    assert results == {0: ([everyone, everyone], 4),
                       1: ([[1], [1], everyone, everyone], 4),
                       2: ([[2], everyone, everyone], 4)}


# --- the one-shot row kernel in Triton's interpreter: every rank's push, then every rank's reduce --
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on machines without CUDA")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_shot_rows_in_the_interpreter(world, dtype):
    """Several calls of different row counts (the epochs and the slot parity advance per row),
    with and without the residual add and norm: every rank gets the same bits, those of the
    unfused path (the sum rounded once, then layers/fused.py's add_rmsnorm)."""
    from specserve.engine.layers.fused import add_rmsnorm
    from specserve.engine.layers.one_shot import OneShotBuffers

    slot_bytes, cols = 4 * 24 * dtype.itemsize, 24  # 4 rows a slot
    data_bytes, num_flags = OneShotBuffers.sizes(world, slot_bytes, min_row_bytes=cols * dtype.itemsize)
    data = [torch.zeros(data_bytes, dtype=torch.uint8) for _ in range(world)]
    flags = [torch.zeros(num_flags, dtype=torch.int32) for _ in range(world)]
    buffer_ptrs = torch.tensor([d.data_ptr() for d in data], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    ranks = [OneShotBuffers(world, r, data[r], flags[r], buffer_ptrs, flag_ptrs, slot_bytes) for r in range(world)]
    gen = torch.Generator().manual_seed(world)
    weight = torch.rand(cols, generator=gen).to(dtype)
    for call, rows in enumerate([3, 1, 4, 2, 3]):
        assert all(r.rows_fit(torch.empty(rows, cols, dtype=dtype)) for r in ranks)
        parts = [torch.randn(rows, cols, generator=gen).to(dtype) for _ in range(world)]
        residual = torch.randn(rows, cols, generator=gen).to(dtype)
        total = sum(p.float() for p in parts).to(dtype)  # rank order, fp32, rounded once
        fused = call % 2 == 0
        for r in ranks:
            r.run(parts[r.rank], residual if fused else None, weight, 1e-6, push=True, reduce=False)
        outs = [r.run(parts[r.rank], residual if fused else None, weight, 1e-6, push=False, reduce=True)
                for r in ranks]
        for out in outs:
            if fused:
                want_out, want_res = add_rmsnorm(total, residual, weight, 1e-6)
                assert torch.equal(out[0], want_out) and torch.equal(out[1], want_res)
            else:
                assert torch.equal(out, total)
    assert [r.epochs.tolist() for r in ranks] == [[5, 4, 3, 1]] * world  # calls each row ran in
    assert not ranks[0].rows_fit(torch.empty(5, cols, dtype=dtype))  # more rows than a slot holds


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
        _check_add_rmsnorm(reducer, group, device, rank, world, failures)
    except BaseException as e:  # reported by the parent
        failures.append(f"rank {rank}: {e!r}")
        raise
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()


def _check_add_rmsnorm(reducer, group, device, rank: int, world: int, failures) -> None:
    """The fused kernel's (normed, residual) equal NCCL's sum then add_rmsnorm, eagerly and
    replayed from a graph, for decode-sized row counts of the 8B shape."""
    from specserve.engine.layers.fused import add_rmsnorm

    for rows in (1, 5, 64):
        shared = torch.Generator(device=device).manual_seed(rows)  # the same on every rank
        residual = torch.randn(rows, 4096, generator=shared, device=device).to(torch.bfloat16)
        weight = torch.rand(4096, generator=shared, device=device).to(torch.bfloat16)
        own = torch.Generator(device=device).manual_seed(100 * rank + rows)
        x = torch.randint(-8, 8, (rows, 4096), generator=own, device=device).to(torch.bfloat16)
        total = x.clone()
        dist.all_reduce(total, group=group)
        want = add_rmsnorm(total, residual, weight, 1e-5)
        got = reducer.add_rmsnorm(x.clone(), residual, weight, 1e-5)
        if got is None or not all(map(torch.equal, got, want)):
            failures.append(f"rank {rank} add_rmsnorm eager rows={rows}")
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = reducer.add_rmsnorm(static, residual, weight, 1e-5)
        for replay in range(3):
            static.copy_(x + replay)
            graph.replay()
            shifted = add_rmsnorm((total.float() + world * replay).to(torch.bfloat16), residual, weight, 1e-5)
            if not all(map(torch.equal, out, shifted)):
                failures.append(f"rank {rank} add_rmsnorm graph rows={rows} replay={replay}")
        torch.cuda.synchronize(device)
        del graph


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


@pytest.mark.gpu
@pytest.mark.timeout(240, method="thread")  # a hang dumps every thread's stack and ends the run
def test_gpu_second_custom_all_reduce_engine_in_one_process(tmp_path):
    """Two tp=2 engines with the custom all-reduce, one after the other in this process: rank 0
    runs here both times (with torch's symmetric-memory state from the first), each engine's
    follower is a new process. Both start and give tp=1's greedy tokens; the second used to hang
    in its first rendezvous (layers/symmetric_memory.py)."""
    from specserve.engine import Engine, EngineConfig, SamplingParams

    tp, placement = tp_placement(("cuda", 2))
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    target, _ = make_predictable_pair(str(tmp_path))
    prompts = random_prompts(4, seed=23, max_len=30)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    def run(**overrides) -> tuple[bool, list]:
        """(whether the engine's all-reduce is ours, its tokens); the engine is shut down."""
        config = EngineConfig(model=target, dtype="float32", spec=None, max_total_tokens=4096,
                              max_running_requests=8, **placement, **overrides)
        with Engine(config) as engine:
            tp_group = engine.core.tp_group
            custom = tp_group is not None and isinstance(tp_group.model.reducer, SymmetricAllReduce)
            return custom, [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=greedy)]

    _, want = run(tp_size=1)
    for engine_number in (1, 2):
        custom, tokens = run(tp_size=tp, custom_all_reduce=True)
        assert custom, f"engine {engine_number} runs without the custom all-reduce"
        assert tokens == want, f"engine {engine_number}"
