"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) over the paged KV pool."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specserve.engine.layers.norm import RMSNorm
from specserve.engine.layers.parallel import (
    SINGLE, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TensorParallel,
    VocabParallelEmbedding, kv_head_range)
from specserve.engine.layers.rotary import RotaryEmbedding
from specserve.engine.models.model_config import ModelConfig
from specserve.engine.forward_batch import ForwardBatch


class Attention(nn.Module):
    """This rank's query heads and KV heads (all of them with one rank)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, in_features: int,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = hd = cfg.head_dim
        q_start, q_end = tp.split(cfg.num_heads, "num_attention_heads")
        kv_start, kv_end = kv_head_range(cfg.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads = q_end - q_start, kv_end - kv_start
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.qkv_proj = ColumnParallelLinear(
            in_features, [(q_start * hd, q_end * hd), (kv_start * hd, kv_end * hd), (kv_start * hd, kv_end * hd)],
            bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = hd ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self._project(x, positions, fb)
        return self.o_proj(fb.attn_backend.forward(q, k, v, self.layer_id, fb, self.scale))

    def store_kv(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> None:
        """The new tokens' K/V into the pool as `forward` stores them (the same projection and
        kernels, so the same values), without reading the pool or projecting the output."""
        _, k, v = self._project(x, positions, fb)
        if k is not None:
            fb.kv_pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)

    def _project(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch):
        """The rotated q, and k and v for the backend to store: None where a fused kernel has
        already written the new tokens' K/V to the pool."""
        pool, layer = fb.kv_pool, self.layer_id
        k_cache, v_cache = pool.k_buffer[layer], pool.v_buffer[layer]
        # The layer's scales (1.0 unless the pool is FP8), for the kernels that store K/V.
        scales = dict(k_scale=pool.scales.k[layer], v_scale=pool.scales.v[layer])
        qk_norm = None if self.q_norm is None else (self.q_norm, self.k_norm)
        if self.qkv_proj.fuses_qkv_rope(x, self.head_dim, qk_norm is not None):
            # One kernel: the projection with (q/k norm,) RoPE and the KV store in its epilogue.
            q = self.qkv_proj.forward_qkv_rope(x, self.num_heads, self.num_kv_heads, self.rotary,
                                               positions, k_cache, v_cache, fb.out_cache_loc,
                                               **scales, qk_norm=qk_norm)
            return q, None, None
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary.stores_kv:  # the new tokens' K/V go to the pool inside the RoPE kernel
            return self.rotary.rotate_and_store_kv(positions, q, k, v, k_cache, v_cache,
                                                   fb.out_cache_loc, **scales), None, None
        q, k = self.rotary(positions, q, k)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        start, end = tp.split(intermediate_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [(start, end), (start, end)], bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; subclasses (DeepSeek) choose other attention and MLPs."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.make_attention(cfg, layer_id, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, layer_id, tp)
        self.tp = tp
        self.partial_sums = False  # see defer_reduce

    def make_attention(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                       tp: TensorParallel) -> nn.Module:
        return Attention(cfg, layer_id, rotary, cfg.hidden_size, tp)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def can_defer_reduce(self) -> bool:
        """Whether this block's two all-reduces can move into the norms after them: Llama's own
        attention and MLP, each ending in one row-parallel layer."""
        return type(self.self_attn) is Attention and type(self.mlp) is MLP

    def defer_reduce(self) -> None:
        """o_proj and down_proj return their partial sums; the norm after each reduces it in
        the same kernel (TensorParallel.all_reduce_add_rmsnorm). The block then takes and
        returns the MLP's partial sum: the model reduces the last one (LlamaForCausalLM)."""
        self.self_attn.o_proj.reduce = self.mlp.down_proj.reduce = False
        self.partial_sums = True

    def add_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor):
        if self.partial_sums:
            return self.tp.all_reduce_add_rmsnorm(x, residual, norm)
        return norm(x, residual)

    def forward(self, x, residual, positions, fb):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.add_norm(self.input_layernorm, x, residual)
        x = self.self_attn(x, positions, fb)
        x, residual = self.add_norm(self.post_attention_layernorm, x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Returns final hidden states; logits are computed by the runner on the rows it needs.

    A forward's `fb.aux_hidden_layers` lists layers whose output residual stream (before the
    final norm) is also returned, concatenated in the listed order: the features an EAGLE-3
    head consumes.
    """

    layer_class = DecoderLayer  # a subclass with other blocks (DeepSeek) swaps these two
    # (ours, checkpoint's) substrings of parameter names where a checkpoint names a module
    # otherwise (Mixtral's block_sparse_moe); the loader applies them.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_position: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = cfg
        self.tp = tp
        rotary = self.make_rotary(cfg, max_position)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # With tensor parallelism every block's all-reduces move into the norms after them (one
        # kernel with the custom all-reduce): all blocks or none, since a block reduces its
        # predecessor's output.
        self.partial_sums = tp.size > 1 and all(layer.can_defer_reduce() for layer in self.layers)
        if self.partial_sums:
            for layer in self.layers:
                layer.defer_reduce()

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        x, residual = self.embed_tokens(fb.input_ids), None
        captured = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, fb.positions, fb)
            if i in fb.aux_hidden_layers:  # (a partial sum is reduced on a copy: x stays partial)
                captured[i] = (self.tp.all_reduce(x.clone()) if self.partial_sums else x) + residual
        if self.partial_sums:
            x, _ = self.tp.all_reduce_add_rmsnorm(x, residual, self.norm)
        else:
            x, _ = self.norm(x, residual)
        if not captured:
            return x, None
        return x, torch.cat([captured[i] for i in fb.aux_hidden_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary (gathered across ranks)."""
        return self.lm_head(hidden)
