"""Attention backends by name, and the one place that turns the user's host-lengths override
(`EngineConfig.needs_cpu_seq_lens`) into what each backend declares."""
from __future__ import annotations

from typing import Optional

import torch

from specserve.engine.attention.base import AttentionBackend

# What a backend declares when the user leaves the override unset (None): torch-native and
# Triton build their metadata from host-known upper bounds; FlashInfer plans on exact host
# lengths so that it may split the KV. An override (True or False) applies to every backend:
# True forces host lengths, False opts FlashInfer into its sync-free plan.
_DEFAULT_NEEDS_CPU_SEQ_LENS = {"torch": False, "triton": False, "flashinfer": True}


def backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in _DEFAULT_NEEDS_CPU_SEQ_LENS:
        raise ValueError(f"attention_backend: unknown backend {name!r}")
    return name


def create_attention_backend(name: str, device: torch.device, *, num_heads: int, num_kv_heads: int,
                             head_dim: int, max_context_len: int, max_batch_size: int,
                             needs_cpu_seq_lens: Optional[bool], max_query_len: int = 1,
                             v_head_dim: Optional[int] = None,
                             kv_dtype: Optional[torch.dtype] = None) -> AttentionBackend:
    """`max_query_len`: the most new tokens per request of a forward that should reuse
    preallocated buffers (the speculative verify width), besides prefill.

    `v_head_dim` (MLA): V is narrower than K (the latent without the rope key) and read
    through the pool's `v_buffer` strides. Such a backend also preallocates the speculative
    verify mask (`get_verify_buffers_to_fill_after_draft`).

    `kv_dtype`: the pool's storage dtype when it is not the model's (an FP8 KV cache), for
    backends whose kernels are tuned per pool dtype (Triton)."""
    name = backend_name(name, device)
    needs = _DEFAULT_NEEDS_CPU_SEQ_LENS[name] if needs_cpu_seq_lens is None else needs_cpu_seq_lens
    mla = v_head_dim is not None and v_head_dim != head_dim
    if name == "torch":
        from specserve.engine.attention.torch_native import TorchNativeAttnBackend
        backend = TorchNativeAttnBackend(needs_cpu_seq_lens=needs)
    elif name == "triton":
        try:
            from specserve.engine.attention.triton.backend import TritonAttnBackend
        except ImportError as e:
            raise ValueError(f"attention_backend: triton is not available ({e}); "
                             "install specserve[triton] or use 'torch'") from e
        backend = TritonAttnBackend(num_heads, num_kv_heads, head_dim, max_context_len, device,
                                    max_batch_size=max_batch_size, max_query_len=max_query_len,
                                    needs_cpu_seq_lens=needs, v_head_dim=v_head_dim,
                                    kv_dtype=kv_dtype)
    elif mla:
        raise ValueError("attention_backend: flashinfer does not support MLA models "
                         "(DeepSeek); use 'triton' or 'torch'")
    else:
        return _flashinfer(num_heads, num_kv_heads, head_dim, device, sync_free=not needs,
                           max_context_len=max_context_len, max_query_len=max_query_len)
    if mla and max_query_len > 1:
        backend.preallocate_verify_mask(max_batch_size, max_query_len, device)
    return backend


def _flashinfer(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                sync_free: bool, max_context_len: int, max_query_len: int) -> AttentionBackend:
    from specserve.engine.attention.flashinfer import FlashInferAttnBackend
    try:
        return FlashInferAttnBackend(num_heads, num_kv_heads, head_dim, device, sync_free=sync_free,
                                     max_context_len=max_context_len, max_query_len=max_query_len)
    except ImportError as e:
        raise ValueError("attention_backend: flashinfer needs "
                         "`pip install specserve[flashinfer]` (flashinfer-python 0.5.3; "
                         f"importing it failed: {e})") from e
