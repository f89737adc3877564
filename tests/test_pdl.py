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
    import subprocess
    import sys

    from sm90_compile import compile_env
    env = compile_env()
    if early is not None:
        env["SPECSERVE_PDL_EARLY"] = early
    done = subprocess.run([sys.executable, "-c", _COMPILE_ADD_RMSNORM], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == (["wait", "signal"] if early is None else ["wait"])
