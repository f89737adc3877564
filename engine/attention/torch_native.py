"""Torch-native attention: runs anywhere (the CPU reference and fallback on CUDA).

Each request's keys are gathered from the pool through its `kv_rows` row into a padded
[bs, width, ...] tensor and attended with one masked SDPA call. The width is
`fb.max_seq_len`: exact when host lengths are known, otherwise the scheduler's host-known
upper bound, which is why this backend can run with `needs_cpu_seq_lens = False` too.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from specserve.engine.attention.base import AttentionBackend
from specserve.engine.forward_batch import ForwardBatch
from specserve.engine.kvcache.fp8 import dequantize


class _Metadata(NamedTuple):
    kv_indices: torch.Tensor   # [bs, width] KV slots
    mask: torch.Tensor         # [bs, 1, max_q, width] bool: query may see key
    token_rows: torch.Tensor   # [num_tokens] flat index into the padded [bs * max_q] queries


class TorchNativeAttnBackend(AttentionBackend):
    supports_device_extend_lens = True  # the token layout from the device lengths then
    supports_mixed_forward = True

    def __init__(self, needs_cpu_seq_lens: bool):
        self.needs_cpu_seq_lens = needs_cpu_seq_lens

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        bs, max_q = fb.batch_size, fb.max_extend_len
        width = fb.max_seq_len
        kv_indices = fb.kv_rows.padded(width)
        # Request b owns rows b*max_q + [0, extend_len_b): a host-known layout, or (device
        # lengths under the bound max_q) one built on the device.
        if fb.extend_lens is None:
            extend = torch.tensor(fb.extend_lens_cpu, dtype=torch.int64)
            extend_dev = extend.to(device, non_blocking=True)  # a blocking copy would sync
        else:
            extend = extend_dev = fb.extend_lens
        num_tokens = fb.num_tokens
        batch_of_token = torch.repeat_interleave(torch.arange(bs, device=extend.device), extend,
                                                 output_size=num_tokens)
        starts = torch.cumsum(extend, 0) - extend
        local = torch.arange(num_tokens, device=extend.device) - starts[batch_of_token]
        token_rows = (batch_of_token * max_q + local).to(device, non_blocking=True)

        prefix = fb.prefix_lens.view(bs, 1, 1)
        q_idx = torch.arange(max_q, device=device).view(1, max_q, 1)
        key = torch.arange(width, device=device).view(1, 1, width)
        new_k = key - prefix  # index of the key among this forward's new tokens
        if fb.custom_mask is not None:
            in_new = (new_k >= 0) & (new_k < max_q)
            gathered = torch.gather(fb.custom_mask, 2, new_k.clamp(0, max_q - 1).expand(bs, max_q, width))
            sees_new = in_new & gathered
        else:
            sees_new = (new_k >= 0) & (new_k <= q_idx)
        extend_dev = extend_dev.view(bs, 1, 1)
        mask = ((new_k < 0) | sees_new) & (new_k < extend_dev)
        # Padding queries (q >= extend_len) see key 0 only, so softmax stays finite.
        mask = mask | ((q_idx >= extend_dev) & (key == 0))
        fb.attn_metadata = _Metadata(kv_indices, mask.unsqueeze(1), token_rows)

    def forward(self, q, k, v, layer_id, fb, scale):
        if k is not None:
            fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        md: _Metadata = fb.attn_metadata
        bs, max_q = fb.batch_size, fb.max_extend_len
        num_heads, head_dim = q.shape[1], q.shape[2]
        pool = fb.kv_pool
        # [bs, W, Hk, D] in q's dtype (an FP8 pool's values times their scale)
        keys = dequantize(pool.k_buffer[layer_id][md.kv_indices], pool.scales.k[layer_id], q.dtype)
        values = dequantize(pool.v_buffer[layer_id][md.kv_indices], pool.scales.v[layer_id],
                            q.dtype)
        group = num_heads // keys.shape[2]
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [bs, H, W, D]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)  # [.., Dv]
        padded_q = q.new_zeros(bs * max_q, num_heads, head_dim)
        padded_q[md.token_rows] = q
        padded_q = padded_q.view(bs, max_q, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(padded_q, keys, values, attn_mask=md.mask, scale=scale)
        # MLA reads V (the latent) narrower than K (latent || rope): the output is V's width.
        out = out.transpose(1, 2).reshape(bs * max_q, num_heads * values.shape[-1])
        return out[md.token_rows]
