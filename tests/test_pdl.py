"""Programmatic dependent launch (engine/pdl.py): where it is on, and that a graph of
PDL-launched kernels computes what the same kernels launched plainly do."""
from __future__ import annotations

import pytest
import torch

from specserve.engine import pdl


@pytest.fixture(autouse=True)
def fresh_pdl_cache():
    pdl.pdl_enabled.cache_clear()
    yield
    pdl.pdl_enabled.cache_clear()


def test_off_the_gpu_kernels_launch_plainly():
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


def test_the_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("SPECSERVE_PDL", "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}


def _decode_chain(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, steps: int) -> torch.Tensor:
    """A few layers' worth of the decode step's Triton kernels back to back: RMSNorm (with
    the residual), the skinny gate/up GEMM with SiLU-and-mul, the skinny down GEMM (split-K),
    then the greedy argmax of the result."""
    from specserve.engine.layers import fused
    from specserve.engine.layers.argmax import argmax_last_dim
    from specserve.engine.layers.skinny_gemm import skinny_gemm
    for _ in range(steps):
        h, residual = fused.add_rmsnorm(x, residual, norm_weight, 1e-5)
        x = skinny_gemm(skinny_gemm(h, gate_up, silu_mul=True), down)
    return argmax_last_dim(x.float() + residual.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_of_pdl_kernels_matches_plain_launches(monkeypatch):
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    assert pdl.pdl_enabled(device)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter = 2048, 4096
    x = torch.randn(4, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = torch.rand(hidden, device=device, generator=gen, dtype=torch.bfloat16)
    gate_up = torch.randn(2 * inter, hidden, device=device, generator=gen, dtype=torch.bfloat16) / 64
    down = torch.randn(hidden, inter, device=device, generator=gen, dtype=torch.bfloat16) / 64

    _decode_chain(x, residual, norm_weight, gate_up, down, steps=8)  # compiled, workspace made
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = _decode_chain(x, residual, norm_weight, gate_up, down, steps=8)
    for seed in range(3):  # new inputs each replay, through the captured addresses
        x.copy_(torch.randn(x.shape, device=device, generator=gen.manual_seed(seed + 1)))
        graph.replay()
        monkeypatch.setenv("SPECSERVE_PDL", "0")
        pdl.pdl_enabled.cache_clear()
        plain = _decode_chain(x, residual, norm_weight, gate_up, down, steps=8)
        monkeypatch.delenv("SPECSERVE_PDL")
        pdl.pdl_enabled.cache_clear()
        assert torch.equal(graph_out, plain)


def _compile_in_child(script: str, env: dict[str, str]) -> str:
    """`script`'s stdout, run in a child with sm90_compile's environment plus `env` (the PDL
    switches are read once, at import)."""
    import subprocess
    import sys

    from sm90_compile import compile_env
    done = subprocess.run([sys.executable, "-c", script], env={**compile_env(), **env},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


_COMPILE_ADD_RMSNORM = """
from specserve.engine.layers import fused
from sm90_compile import compile_sm90, t
import torch
ptx = compile_sm90(fused._add_rmsnorm_kernel, dict(
    x_ptr=t(torch.bfloat16), res_ptr=t(torch.bfloat16), w_ptr=t(torch.bfloat16),
    out_ptr=t(torch.bfloat16), res_out_ptr=t(torch.bfloat16), n_cols=2048, stride_x=2048,
    eps=1e-6, HAS_RESIDUAL=True, BLOCK=2048, PDL=True), 4, 1)
print("wait" if "griddepcontrol.wait" in ptx else "", "signal" if "launch_dependents" in ptx else "")
"""


@pytest.mark.parametrize("early", [None, "0"])
def test_early_signals_compile_in_unless_switched_off(early):
    """A latency-bound kernel signals its dependents right after its wait; with
    SPECSERVE_PDL_EARLY=0 it only waits."""
    stdout = _compile_in_child(_COMPILE_ADD_RMSNORM, {} if early is None else {"SPECSERVE_PDL_EARLY": early})
    assert stdout.split() == (["wait", "signal"] if early is None else ["wait"])


_COMPILE_EARLY_READS = """
import torch
from int4_sm90_launches import _Recorder
from sm90_compile import compile_sm90
from specserve.engine.attention.triton import kernels as A
from specserve.engine.layers import fused, skinny_gemm as sk
from specserve.engine.layers.rotary import RotaryEmbedding

bf16, i32, i64 = torch.bfloat16, torch.int32, torch.int64
cuda = torch.device("cuda")  # only for choosing configs: nothing is allocated on it


def recorded(module, name, launch):
    \"\"\"The arguments `launch()` passes to `module.name` (the real launcher's, on the CPU).\"\"\"
    launches, kernel = [], getattr(module, name)
    setattr(module, name, _Recorder(kernel, launches))
    try:
        launch()
    finally:
        setattr(module, name, kernel)
    return launches[0]


def lines(ptx, pattern):
    return [i for i, line in enumerate(ptx.splitlines()) if pattern in line]


def report(name, launch, **overrides):
    \"\"\"Compiles a recorded launch for sm_90 (with `overrides`: what an H100 launch sets
    that a CPU one does not) and prints: loads before the wait, prefetches, all of them
    before the wait, loads before the first mma, whether it signals its dependents.\"\"\"
    ptx = compile_sm90(launch.kernel, {**launch.args, **overrides}, launch.num_warps,
                       launch.num_stages)
    wait = lines(ptx, "griddepcontrol.wait")
    assert len(wait) == 1, wait
    loads, mma = lines(ptx, "ld.global"), lines(ptx, "mma")
    prefetches = lines(ptx, "prefetch.global.L2")
    print(name, sum(i < wait[0] for i in loads), len(prefetches),
          all(i < wait[0] for i in prefetches), sum(i < (mma or [0])[0] for i in loads),
          bool(lines(ptx, "launch_dependents")))


# Llama-8B's shapes at bs=1.
x = torch.empty(1, 4096, dtype=bf16)
report("norm", recorded(fused, "_add_rmsnorm_kernel", lambda: fused.add_rmsnorm(
    x, torch.empty_like(x), torch.empty(4096, dtype=bf16), 1e-6)))
k_cache = torch.empty(8, 8, 128, dtype=bf16)
rotary = RotaryEmbedding(128, 64, 500000.0, None)
report("qkv", recorded(sk, "_skinny_qkv_rope_kernel", lambda: sk.skinny_qkv_rope(
    x, torch.empty(6144, 4096, dtype=bf16), None, 32, 8, torch.zeros(1, dtype=i64), rotary.cos,
    rotary.sin, k_cache, torch.empty_like(k_cache), torch.zeros(1, dtype=i64),
    weight_prefetch_bytes=1024)), PREFETCH_LINES=1024 // sk.L2_LINE_BYTES)
config = A.default_decode_config(128, cuda)  # the H100's
report("decode", recorded(A, "_decode_kernel", lambda: A.decode_attention(
    torch.empty(1, 32, 128, dtype=bf16), k_cache, torch.empty_like(k_cache),
    torch.empty(1, 32, 128, dtype=bf16), torch.zeros(2, dtype=i64), torch.zeros(1, dtype=i32),
    torch.empty(1, 32, 16, 128), torch.empty(1, 32, 16), torch.zeros(8, dtype=i32), 0.1,
    config)), **A.decode_prefetch_meta(config, k_cache, cuda))
"""


@pytest.mark.parametrize("early_reads", [None, "0"])
def test_early_reads_come_before_the_wait_unless_switched_off(early_reads):
    """Compiled for sm_90 (engine/pdl.py's early reads): the RMSNorm loads its weight before
    its wait; the 8B q/k/v kernel, asked for a weight prefetch, prefetches its first weight
    lines into the L2 before it, and loads the RoPE epilogue's inputs before its main loop;
    the 8B decode attention (the H100 config) loads its KV indices and prefetches a short
    sequence's K/V before it. With SPECSERVE_PDL_EARLY_READS=0 nothing is read before the wait
    and nothing prefetched. Either way the RMSNorm and the decode signal their dependents early
    and the q/k/v kernel does not (engine/pdl.py: the decode's long-context programs let in
    during its merge cost more than the release saves)."""
    stdout = _compile_in_child(_COMPILE_EARLY_READS,
                               {} if early_reads is None else {"SPECSERVE_PDL_EARLY_READS": early_reads})
    rows = {name: [int(v) if v.isdigit() else v == "True" for v in values]
            for name, *values in (line.split() for line in stdout.splitlines())}
    assert set(rows) == {"norm", "qkv", "decode"}
    # (loads before the wait, prefetches, all of them before the wait, loads before the mma,
    # signals)
    assert [rows[name][4] for name in ("norm", "qkv", "decode")] == [True, False, True]
    if early_reads is None:
        assert rows["norm"][0] > 0 and rows["norm"][1] == 0
        assert rows["qkv"][0] == 0 and rows["qkv"][1] > 0 and rows["qkv"][2]
        assert rows["qkv"][3] >= 6  # positions, KV slots and the four cos/sin halves
        assert rows["decode"][0] > 0 and rows["decode"][1] > 0 and rows["decode"][2]
    else:
        for name in ("norm", "qkv", "decode"):
            assert rows[name][:2] == [0, 0], (name, rows[name])
        assert rows["qkv"][3] >= 6


def _attention_chain(x, residual, norm_weight, qkv_weight, o_weight, rotary, step, pool,
                     config) -> torch.Tensor:
    """A decode layer's attention half as the engine launches it: the KV indices (before
    the first layer), RMSNorm, the q/k/v kernel (RoPE, the new tokens' K/V into the pool;
    here with a 1 KiB weight prefetch, off in the engine by default), the decode attention
    over the pool, o_proj."""
    from specserve.engine.attention.triton.kernels import decode_attention, fill_kv_indices
    from specserve.engine.layers import fused
    from specserve.engine.layers.skinny_gemm import skinny_gemm, skinny_qkv_rope
    k_cache, v_cache, kv_indptr, kv_indices, partial_out, partial_lse, arrivals = pool
    table, rows, prefix_lens, new_slots = step
    heads, dim = partial_out.shape[1], k_cache.shape[-1]
    fill_kv_indices(table, rows, prefix_lens, kv_indptr, kv_indices, decode_token_slots=new_slots)
    h, _ = fused.add_rmsnorm(x, residual, norm_weight, 1e-5)
    q = skinny_qkv_rope(h, qkv_weight, None, heads, k_cache.shape[1], prefix_lens, rotary.cos,
                        rotary.sin, k_cache, v_cache, new_slots, weight_prefetch_bytes=1024)
    out = torch.empty_like(q)
    decode_attention(q, k_cache, v_cache, out, kv_indptr, kv_indices, partial_out, partial_lse,
                     arrivals, dim ** -0.5, config)
    return skinny_gemm(out.view(-1, heads * dim), o_weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefix_lens", [[150], [150, 700, 3000]], ids=["one-split", "splits"])
def test_gpu_attention_chain_with_early_reads_matches_plain_launches(monkeypatch, prefix_lens):
    """The 8B attention half in a CUDA graph with PDL and the early reads (the q/k/v weight
    prefetch, the decode's KV indices and K/V prefetch: prefetched at 150 tokens, not at 700
    and 3000) is bit for bit the same kernels
    launched plainly, the decode seeing the new token's K/V that the kernel just before it
    wrote; and the decode's prefetch changes nothing."""
    from specserve.engine.attention.triton.kernels import default_decode_config
    from specserve.engine.layers.rotary import RotaryEmbedding

    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, dim, hidden, bs = 32, 8, 128, 4096, len(prefix_lens)
    num_slots = sum(prefix_lens) + bs + 1
    slots = torch.randperm(num_slots - 1, device=device, generator=gen) + 1
    table = torch.zeros(bs, max(prefix_lens) + 1, dtype=torch.int64, device=device)
    start = 0
    for b, n in enumerate(prefix_lens):  # a request's prefix, then its new token's slot
        table[b, :n + 1] = slots[start:start + n + 1]
        start += n + 1
    prefix = torch.tensor(prefix_lens, device=device)
    step = (table, torch.arange(bs, device=device), prefix, table[torch.arange(bs), prefix])
    config = default_decode_config(dim, device)
    assert config.prefetch_tokens > 0
    pool = (torch.randn(num_slots, kv_heads, dim, device=device, generator=gen).bfloat16(),
            torch.randn(num_slots, kv_heads, dim, device=device, generator=gen).bfloat16(),
            torch.empty(bs + 1, dtype=torch.int64, device=device),
            torch.empty(bs * (max(prefix_lens) + 1), dtype=torch.int32, device=device),
            torch.empty(bs, heads, config.max_kv_splits, dim, device=device),
            torch.empty(bs, heads, config.max_kv_splits, device=device),
            torch.zeros(bs * kv_heads, dtype=torch.int32, device=device))
    x = torch.randn(bs, hidden, device=device, generator=gen).bfloat16()
    residual = torch.randn_like(x)
    norm_weight = torch.rand(hidden, device=device, generator=gen).bfloat16() + 0.5
    qkv_weight = (torch.randn((heads + 2 * kv_heads) * dim, hidden, device=device,
                              generator=gen) / 64).bfloat16()
    o_weight = (torch.randn(hidden, heads * dim, device=device, generator=gen) / 64).bfloat16()
    rotary = RotaryEmbedding(dim, 8192, 500000.0, None).to(device)
    args = (residual, norm_weight, qkv_weight, o_weight, rotary, step, pool)

    _attention_chain(x, *args, config)  # compiled, the skinny workspace made
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = _attention_chain(x, *args, config)
    for seed in range(3):  # new inputs each replay: new q and new-token K/V
        x.copy_(torch.randn(x.shape, device=device, generator=gen.manual_seed(seed + 1)))
        graph.replay()
        monkeypatch.setenv("SPECSERVE_PDL", "0")
        pdl.pdl_enabled.cache_clear()
        plain = _attention_chain(x, *args, config)
        unfetched = _attention_chain(x, *args, config._replace(prefetch_tokens=0))
        monkeypatch.delenv("SPECSERVE_PDL")
        pdl.pdl_enabled.cache_clear()
        assert torch.equal(graph_out, plain)
        assert torch.equal(unfetched, plain)
