"""DeepSeek-V2 / V3 decoders: multi-head latent attention (MLA) and routed experts (MoE).

MLA runs in the absorbed form in every forward mode: the pool keeps one vector per token,
the normed KV latent (kv_lora_rank) then the rotated rope key, and attention is MQA with that
single KV head. q_nope is absorbed through W_UK (q_nope . k_nope = (q_nope W_UK) . latent),
so each query head is (q_nope W_UK) || q_rope against the key latent || k_rope, the value is
the latent itself, and W_UV maps each head's latent output to its v_head_dim output. W_UK and
W_UV are views of the checkpoint's kv_b_proj. Tensor parallelism splits the heads (q, kv_b,
o_proj) and every expert's intermediate dimension; the latent path is replicated.
Decode-sized forwards on CUDA run the same math in fewer launches (`MLAAttention._forward_fused`,
engine/layers/mla_decode.py; docs/architecture.md, "The fused MLA decode step").
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from specserve.engine.forward_batch import ForwardBatch
from specserve.engine.layers import mla_decode
from specserve.engine.quantization.fp8 import fp8_parameter, scale_parameter, weight_scale
from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.layers.moe import route, run_experts
from specserve.engine.layers.moe_decode import MAX_DECODE_TOKENS
from specserve.engine.layers.norm import RMSNorm
from specserve.engine.layers.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel
from specserve.engine.layers.rotary import RotaryEmbedding, yarn_mscale
from specserve.engine.layers.skinny_gemm import linear
from specserve.engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from specserve.engine.models.model_config import ModelConfig
from specserve.engine.layers.fp8_weight import dequantize


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (as transformers)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return scale


class MLAAttention(nn.Module):
    """This rank's query heads over the shared latent KV (one KV head in the pool)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        mla = cfg.mla
        self.layer_id = layer_id
        self.mla = mla
        start, end = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_heads = end - start
        qk, hidden = mla.qk_head_dim, cfg.hidden_size
        # q's first projection and kv_a both read x: one layer (one skinny GEMM launch at
        # decode) of their rows concatenated, this rank's q heads (or the replicated q LoRA
        # down-projection) then the replicated kv_a rows; `forward` splits the output.
        kv_a = (0, mla.kv_lora_rank + mla.qk_rope_head_dim)
        if mla.q_lora_rank is None:
            self.q_kv_a_proj = ColumnParallelLinear(hidden, [(start * qk, end * qk), kv_a], bias=False)
        else:
            self.q_a_kv_a_proj = ColumnParallelLinear(hidden, [(0, mla.q_lora_rank), kv_a], bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [(start * qk, end * qk)], bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        per_head = mla.qk_nope_head_dim + mla.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, [(start * per_head, end * per_head)],
                                              bias=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * mla.v_head_dim, hidden, tp)
        self.rotary = rotary
        self.scale = mla_softmax_scale(cfg)
        self.kv_b_dense = None  # kv_b_proj's weight in 16 bits when the checkpoint's is FP8

    def after_loading(self) -> None:
        """The absorbed products read W_UK and W_UV as batched matrices (no skinny GEMM), so an
        FP8 kv_b_proj is kept dequantised for them, as SGLang does: a small matrix
        (kv_lora_rank x heads x (nope + v)), a few percent of a layer."""
        scale = self.kv_b_proj.scale
        if scale is not None:
            self.kv_b_dense = dequantize(self.kv_b_proj.weight, scale, self.kv_a_layernorm.weight.dtype)

    @property
    def kv_head_dim(self) -> int:
        """What the pool stores per token: latent || rope key (the MQA key width)."""
        return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, latent] and W_UV [H, v, latent]: views of kv_b_proj's weight."""
        m = self.mla
        w = self.kv_b_proj.weight if self.kv_b_dense is None else self.kv_b_dense
        w = w.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def _rope(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor):
        if self.mla.rope_interleave:  # pairs (x0, x1), ... -> halves: the neox rotation applies
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        return self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        m, T, H = self.mla, x.shape[0], self.num_heads
        if m.q_lora_rank is None:
            q, kv = self.q_kv_a_proj(x).split([H * m.qk_head_dim, self.kv_head_dim], dim=-1)
        else:
            q_a, kv = self.q_a_kv_a_proj(x).split([m.q_lora_rank, self.kv_head_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        if mla_decode.can_fuse(x):
            return self._forward_fused(q.view(T, H, m.qk_head_dim), kv, positions, fb)
        q_nope, q_pe = q.view(T, H, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self._rope(positions, q_pe, k_pe.view(T, 1, m.qk_rope_head_dim))
        fb.kv_pool.set_mla_kv(self.layer_id, fb.out_cache_loc, latent, k_pe[:, 0])
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)       # [T, H, latent]
        out = fb.attn_backend.forward(torch.cat([q_latent, q_pe], dim=-1), None, None,
                                      self.layer_id, fb, self.scale)             # [T, H * latent]
        out = torch.bmm(out.view(T, H, m.kv_lora_rank).transpose(0, 1), w_uv.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(T, H * m.v_head_dim))

    def _forward_fused(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                       fb: ForwardBatch) -> torch.Tensor:
        """`forward` for decode-sized batches from q [T, H, qk_head_dim] and the kv_a
        projection [T, latent + rope], in two launches besides the projections and the
        attention (engine/layers/mla_decode.py): the absorbed query (q_nope x W_UK) with the
        latent's norm, both RoPEs and the pool store in one; o_proj's input from the
        attention's output (x W_UV^T) in the other."""
        m, T, H = self.mla, q.shape[0], self.num_heads
        q_abs = q.new_empty(T, H, self.kv_head_dim)
        w_uk, w_uv = self._absorbed_weights()
        mla_decode.absorb_query(
            q, kv, w_uk, q_abs, fb.kv_pool.k_buffer[self.layer_id], fb.out_cache_loc, positions,
            self.rotary.cos, self.rotary.sin, self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps, m.rope_interleave, fb.kv_pool.scales.k[self.layer_id])
        out = fb.attn_backend.forward(q_abs, None, None, self.layer_id, fb, self.scale)
        o_in = q.new_empty(T, H, m.v_head_dim)
        mla_decode.head_matmul(out.view(T, H, m.kv_lora_rank), w_uv, o_in)
        return self.o_proj(o_in.view(T, H * m.v_head_dim))


class Router(nn.Module):
    """Router logits in fp32. The weight (and V3's correction bias) stay fp32 whatever the
    model's dtype: a 16-bit checkpoint's values convert exactly, and a decode step then reads
    the weight as it is instead of casting it at every layer (a launch and a copy each)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts)) \
            if moe.has_correction_bias else None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for param in (self.weight, self.e_score_correction_bias):
            if param is not None and param.dtype != torch.float32:
                param.data = param.data.float()
        return self

    def forward(self, x: torch.Tensor, with_shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) [T, k (+ the shared slots, weight 1.0, with `with_shared`)]."""
        moe = self.moe
        return route(x, self.weight, top_k=moe.top_k, scoring=moe.scoring, num_groups=moe.num_groups,
                     topk_groups=moe.topk_groups, norm_topk_prob=moe.norm_topk_prob,
                     routed_scaling_factor=moe.routed_scaling_factor,
                     correction_bias=self.e_score_correction_bias,
                     num_shared=moe.num_shared_experts if with_shared else 0)


class ExpertParts(NamedTuple):
    """A checkpoint's names for an expert's three projections (`<experts>.<e>.<name>.weight`)."""

    gate: str
    up: str
    down: str


HF_EXPERT_PARTS = ExpertParts("gate_proj", "up_proj", "down_proj")  # DeepSeek, Qwen3-MoE


class Experts(nn.Module):
    """Every routed expert's weights, stacked, then `num_shared` slots holding the shared
    experts' MLP cut into experts of the routed size (slot E + j: the MLP's intermediate units
    [j*I, (j+1)*I), which every token picks with weight 1.0: `Router`); this rank's slice of
    each slot's intermediate dim, so one all-reduce sums routed and shared parts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 parts: ExpertParts = HF_EXPERT_PARTS, num_shared: int = 0):
        super().__init__()
        start, end = tp.split(intermediate_size, "moe_intermediate_size")
        slots = num_experts + num_shared
        self.w13 = nn.Parameter(torch.empty(slots, 2 * (end - start), hidden_size))
        self.w2 = nn.Parameter(torch.empty(slots, hidden_size, end - start))
        # The loader assembles them from the checkpoint's tensors: per slot, (name relative to
        # the MoE block, dim, start, end) of each part (parallel.py's `shards` convention).
        rows = [(f"experts.{e}", 0) for e in range(num_experts)]
        rows += [("shared_experts", j * intermediate_size) for j in range(num_shared)]
        self.w13.stacked_experts = [[(f"{name}.{parts.gate}", 0, at + start, at + end),
                                     (f"{name}.{parts.up}", 0, at + start, at + end)] for name, at in rows]
        self.w2.stacked_experts = [[(f"{name}.{parts.down}", 1, at + start, at + end)] for name, at in rows]
        self.w13_scale = self.w2_scale = None
        self.num_experts, self.num_shared = num_experts, num_shared

    def use_fp8(self, block_n: int, block_k: int) -> None:
        """FP8 experts (the loader calls it when the checkpoint's are): both stacks."""
        self.w13, self.w2 = fp8_parameter(self.w13), fp8_parameter(self.w2)
        self.w13_scale = scale_parameter(self.w13, block_n, block_k)
        self.w2_scale = scale_parameter(self.w2, block_n, block_k)

    def forward(self, x, topk_weights, topk_ids):
        """sum_k topk_weights * expert(x) over the routing's entries (`run_experts`)."""
        return run_experts(x, self.w13, self.w2, topk_weights, topk_ids,
                           weight_scale(self.w13_scale), weight_scale(self.w2_scale))

    @property
    def runs_shared_dense(self) -> bool:
        """16-bit shared slots can run as a dense MLP (`add_shared`); FP8 ones stay slots."""
        return self.num_shared > 0 and self.w13_scale is None

    def add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += the shared slots' MLP of x, as dense GEMMs: every slot's gate/up rows in one
        (the slots are contiguous in the stack), then each slot's down projection accumulated
        into `out` by the GEMM itself (no add launches)."""
        E, S = self.num_experts, self.num_shared
        gate_up = linear(x, self.w13[E:].flatten(0, 1), skinny=False)
        h = silu_and_mul(gate_up.view(x.shape[0], S, -1))   # [T, S, I]
        for j in range(S):
            out.addmm_(h[:, j], self.w2[E + j].t())
        return out


class DeepseekMoE(nn.Module):
    """Router and experts: routed(x) + shared_experts(x) with the shared experts as the
    stacks' last slots (Qwen3-MoE and Mixtral have none, and their checkpoints may name the
    expert parts otherwise: `parts`)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, parts: ExpertParts = HF_EXPERT_PARTS):
        super().__init__()
        moe = cfg.moe
        self.tp = tp
        self.gate = Router(cfg)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size, tp, parts,
                               moe.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.runs_shared_dense and x.shape[0] > MAX_DECODE_TOKENS:
            # Every token picks the shared slots: in the grouped kernel each of their row blocks
            # would read their weights again (a verify step's 256 tokens: 8 times); a dense
            # GEMM reads them about once. Decode-sized batches read them as slots of the
            # routed kernels, in the same launches.
            out = self.experts.add_shared(x, self.experts(x, *self.gate(x, with_shared=False)))
        else:
            out = self.experts(x, *self.gate(x))
        return self.tp.all_reduce(out)


class DeepseekDecoderLayer(DecoderLayer):
    """One MLA + (dense MLP or MoE) block in the pre-norm residual form (reusable: NextN)."""

    def make_attention(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                       tp: TensorParallel) -> nn.Module:
        return MLAAttention(cfg, layer_id, rotary, tp)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> nn.Module:
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer_id):
            return DeepseekMoE(cfg, tp)
        return MLP(cfg.hidden_size, cfg.intermediate_size, tp)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2/V3: Llama's trunk (embedding, residual stream, EAGLE-3 features, final
    norm, LM head) over DeepSeek decoder layers."""

    layer_class = DeepseekDecoderLayer

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_position: int) -> RotaryEmbedding:
        if cfg.mla is None:
            raise ValueError(f"model: {cfg.architecture} is not an MLA architecture")
        return RotaryEmbedding(cfg.mla.qk_rope_head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
