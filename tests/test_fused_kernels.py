"""Fused decoder-layer kernels (RMSNorm + residual, RoPE, SiLU-and-mul) against the torch ops
they replace, in the Triton interpreter on the CPU (and on the GPU under -m gpu)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.engine.layers import fused  # noqa: E402
from specserve.engine.layers.activation import silu_and_mul  # noqa: E402
from specserve.engine.layers.norm import RMSNorm  # noqa: E402
from specserve.engine.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _torch_norm(norm, x, residual):
    """The unfused path (forced, whatever the device)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    out = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)
    return out if residual is None else (out, residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_add_rmsnorm(dtype, with_residual, strided):
    """strided: x a view of the first columns of wider rows (MLA's q LoRA part of its fused
    q/kv_a projection), read in place."""
    if dtype is torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("the interpreter computes bf16 differently; checked on the GPU")
    device = DEVICES[-1]
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = torch.randn(7, 136 if strided else 96, generator=g).to(device, dtype)[:, :96]
    assert x.is_contiguous() != strided
    res = torch.randn(7, 96, generator=g).to(device, dtype) if with_residual else None
    got = fused.add_rmsnorm(x, res, norm.weight, norm.eps)
    want = _torch_norm(norm, x, res)
    for a, b in zip(got if with_residual else [got], want if with_residual else [want]):
        torch.testing.assert_close(a, b, atol=1e-5 if dtype is torch.float32 else 1e-2, rtol=1e-5)


def test_rope_matches_torch():
    device = DEVICES[-1]
    rot = RotaryEmbedding(32, 128, 10000.0, None).to(device)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, (6 + 2 + 2) * 32, generator=g).to(device)
    q, k, _ = qkv.split([6 * 32, 2 * 32, 2 * 32], dim=-1)
    q, k = q.view(9, 6, 32), k.view(9, 2, 32)  # strided views, as the model passes them
    positions = torch.randint(0, 128, (9,), generator=g).to(device)
    got = fused.rope(positions, q, k, rot.cos, rot.sin)
    cos, sin = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)

    def ref(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    torch.testing.assert_close(got[0], ref(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref(k), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_kv_matches_rope_then_store(dtype):
    """The fused store writes exactly what RoPE followed by the pool's set_kv writes, to the
    given slots only (v copied as is, heads of a strided qkv view)."""
    device = DEVICES[-1]
    rot = RotaryEmbedding(32, 128, 10000.0, None).to(device)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, (6 + 2 + 2) * 32, generator=g).to(device, dtype)
    q, k, v = qkv.split([6 * 32, 2 * 32, 2 * 32], dim=-1)
    q, k, v = q.view(9, 6, 32), k.view(9, 2, 32), v.view(9, 2, 32)
    positions = torch.randint(0, 128, (9,), generator=g).to(device)
    loc = (torch.randperm(20, generator=g)[:9] + 1).to(device)
    caches = [torch.zeros(21, 2, 32, dtype=dtype, device=device) for _ in range(4)]
    q_fused = fused.rope_and_store_kv(positions, q, k, v, rot.cos, rot.sin, caches[0], caches[1], loc)
    q_ref, k_ref = fused.rope(positions, q, k, rot.cos, rot.sin)
    caches[2][loc], caches[3][loc] = k_ref, v
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_silu_and_mul_matches_torch():
    device = DEVICES[-1]
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(device)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert silu_and_mul(x).shape == (5, 1500)
