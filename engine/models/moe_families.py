"""Qwen3-MoE and Mixtral: Llama's trunk and attention (Qwen3-MoE with per-head q/k RMSNorm)
with routed experts in place of the dense MLP.

Both route by softmax over every expert, top-k, renormalised over the k (Qwen3-MoE when
norm_topk_prob, Mixtral always), with no shared experts: DeepSeek's MoE block (`DeepseekMoE`:
the fp32 `Router`, the stacked `Experts` run by `run_experts`) with those settings. Tensor
parallelism splits each expert's intermediate dim, as for DeepSeek. Qwen3-MoE keeps a dense
MLP (intermediate_size) on the layers `MoEConfig.is_moe_layer` excludes (mlp_only_layers,
decoder_sparse_step). Mixtral's checkpoints name the block `block_sparse_moe` and the expert
parts w1 (gate), w3 (up), w2 (down); the loader maps our names to those.
"""
from __future__ import annotations

from torch import nn

from specserve.engine.layers.parallel import TensorParallel
from specserve.engine.models.deepseek import HF_EXPERT_PARTS, DeepseekMoE, ExpertParts
from specserve.engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from specserve.engine.models.model_config import ModelConfig


class SparseMoeDecoderLayer(DecoderLayer):
    """Llama attention, then routed experts (or the dense MLP where the config says)."""

    expert_parts: ExpertParts = HF_EXPERT_PARTS

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> nn.Module:
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer_id):
            return DeepseekMoE(cfg, tp, self.expert_parts)
        return MLP(cfg.hidden_size, cfg.intermediate_size, tp)


class MixtralDecoderLayer(SparseMoeDecoderLayer):
    expert_parts = ExpertParts(gate="w1", up="w3", down="w2")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_class = SparseMoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MixtralDecoderLayer
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)


MOE_FAMILY_CLASSES = {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM, "MixtralForCausalLM": MixtralForCausalLM}
