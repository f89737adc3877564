"""DeepSeek-V3's multi-token-prediction module ("NextN", MTP) as an EAGLE-1-style draft.

The checkpoint stores it after the last decoder layer, as `model.layers.{num_hidden_layers}.*`
(or `model.layers.0.*` in a folder exported on its own with num_hidden_layers 1, SGLang's
layout): `enorm`, `hnorm`, `eh_proj`, one MLA + MoE decoder layer, `shared_head.norm`, and
optionally `embed_tokens` and `shared_head.head`, which DeepSeek-V3 shares with the trunk
(the target's are used when they are absent or equal). A checkpoint with several modules
(num_nextn_predict_layers > 1) drafts with the first, chained like EAGLE's steps.

Forward, for the draft row at position p (feature of token p, token p + 1), as EAGLE-1:
    x = eh_proj(cat(enorm(embed(t)), hnorm(feature)))
    x, residual = decoder layer(x)
    out = shared_head.norm(x + residual)
`out` is both the input of `shared_head.head` (the logits) and the feature of the next draft
step. The first feature is the target's final (normed) hidden state, as for EAGLE-1 heads.
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import torch
from torch import nn

from specserve.engine.forward_batch import ForwardBatch
from specserve.engine.grammar.bitmask import apply_token_bitmask
from specserve.engine.layers.norm import RMSNorm
from specserve.engine.layers.parallel import SINGLE, ParallelLMHead, TensorParallel, VocabParallelEmbedding
from specserve.engine.layers.rotary import RotaryEmbedding
from specserve.engine.layers.sampler import draft_topk
from specserve.engine.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM, DeepseekMoE, MLAAttention
from specserve.engine.models.llama import MLP
from specserve.engine.models.loader import (
    CheckpointReader, init_dummy_weights, load_module_weights, use_fp8_everywhere)
from specserve.engine.models.model_config import DEEPSEEK_ARCHITECTURES, ModelConfig


class NextNDecoderLayer(DeepseekDecoderLayer):
    """The module's decoder block: layer 0 of the draft's own one-layer MLA pool, and MoE
    whenever the model has routed experts (the checkpoint places it past every dense layer)."""

    def make_attention(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                       tp: TensorParallel) -> nn.Module:
        return MLAAttention(cfg, 0, rotary, tp)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> nn.Module:
        return DeepseekMoE(cfg, tp) if cfg.moe is not None else MLP(cfg.hidden_size, cfg.intermediate_size, tp)


class NextNHead(nn.Module):
    """The MTP module over the target's (or its own) embedding and LM head."""

    uses_aux_hidden = False

    def __init__(self, cfg: ModelConfig, max_position: int, embed_tokens: nn.Module, lm_head: nn.Module,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        # Registered first: the EAGLE worker reads the hidden dtype from the first parameter
        # (the router's correction bias, further down, stays fp32).
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        rotary = DeepseekForCausalLM.make_rotary(cfg, max_position)
        self.decoder = NextNDecoderLayer(cfg, cfg.num_layers, rotary, tp)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.shared_head.head = lm_head
        self.embed_tokens = embed_tokens

    @property
    def attention(self) -> MLAAttention:
        return self.decoder.self_attn

    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(fb.input_ids)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden_in)], dim=-1))
        x, residual = self.decoder(x, None, fb.positions, fb)
        out, _ = self.shared_head.norm(x, residual)
        return out

    def topk(self, hidden: torch.Tensor, k: int, with_probs: bool = True, bitmask=None):
        """(probabilities [n, k] or None, token ids [n, k]) of the draft's next token;
        `bitmask` (packed) bans tokens (structured outputs)."""
        logits = self.shared_head.head(hidden)
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        return draft_topk(logits, k, with_probs)


class NextNLayout(NamedTuple):
    """Where a checkpoint keeps its NextN module."""

    config: ModelConfig   # the module's shapes (the folder's config.json)
    prefix: str           # "model.layers.{i}." of its tensors
    has_embed: bool       # its own embed_tokens / shared_head.head are stored
    has_head: bool


def read_nextn_layout(path: str, dummy: bool = False) -> NextNLayout:
    """The NextN module of the checkpoint at `path`; ValueError naming spec.draft_model when it
    has none. `dummy` (random weights): only config.json is read."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    # SGLang's standalone export names the architecture DeepseekV3ForCausalLMNextN.
    arch = next((a.removesuffix("NextN") for a in archs if a.removesuffix("NextN") in DEEPSEEK_ARCHITECTURES),
                None)
    if arch is None:
        raise ValueError(f"spec.draft_model: NextN drafting reads DeepSeek-V3-format checkpoints; "
                         f"{path} is {archs!r}")
    count = raw.get("num_nextn_predict_layers")
    if not count:
        raise ValueError(f"spec.draft_model: {path} has no NextN (multi-token prediction) module: "
                         f"config.json num_nextn_predict_layers is {count!r}")
    try:
        cfg = ModelConfig.from_dict(dict(raw, architectures=[arch]))
    except ValueError as e:  # the folder's config, not the target's: name the spec field
        raise ValueError(f"spec.draft_model: {path}: {e}") from e
    prefix = f"model.layers.{cfg.num_layers}."
    if dummy:
        return NextNLayout(cfg, prefix, False, False)
    reader = CheckpointReader(path)
    candidates = [cfg.num_layers] + ([0] if cfg.num_layers == 1 else [])
    layer = next((i for i in candidates if f"model.layers.{i}.eh_proj.weight" in reader), None)
    if layer is None:
        raise ValueError(f"spec.draft_model: {path} has no NextN weights (no {prefix}eh_proj.weight) "
                         f"although config.json sets num_nextn_predict_layers={count}")
    prefix = f"model.layers.{layer}."
    return NextNLayout(cfg, prefix, prefix + "embed_tokens.weight" in reader,
                       prefix + "shared_head.head.weight" in reader)


def load_nextn_head(path: str, target_model: nn.Module, max_position: int, dtype: torch.dtype,
                    device: torch.device, dummy: bool = False,
                    fp8_block: Optional[tuple[int, int]] = None) -> NextNHead:
    """Build and load the NextN module of `path` on the target's tensor-parallel group
    (`fp8_block`: random FP8 weights in those blocks, with `dummy`)."""
    layout = read_nextn_layout(path, dummy)
    cfg, target = layout.config, target_model.config
    for key in ("hidden_size", "vocab_size"):
        if getattr(cfg, key) != getattr(target, key):
            raise ValueError(f"spec.draft_model: NextN {key} {getattr(cfg, key)} != target {key} "
                             f"{getattr(target, key)}")
    tp = target_model.tp
    with torch.device(device):
        embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if layout.has_embed \
            else target_model.embed_tokens
        head_out = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp) if layout.has_head \
            else target_model.lm_head
        head = NextNHead(cfg, max_position, embed, head_out, tp).to(dtype)
    if dummy:  # benchmarks: random weights for the module's own parts, the target's vocabulary ends
        if fp8_block is not None:  # an FP8 target's module is FP8 too, as DeepSeek-V3 ships it
            use_fp8_everywhere(head.decoder, fp8_block)
        for part in (head.eh_proj, head.decoder):
            init_dummy_weights(part, seed=1)
        return head.eval()
    shared = {name for name, own in (("embed_tokens.weight", layout.has_embed),
                                     ("shared_head.head.weight", layout.has_head)) if not own}
    load_module_weights(head, CheckpointReader(path), lambda name: layout.prefix + name.removeprefix("decoder."),
                        optional=lambda name: name in shared, quant=cfg.quantization)
    # DeepSeek-V3 stores copies of the trunk's embedding and head here: keep one of each.
    if layout.has_embed and _same(head.embed_tokens, target_model.embed_tokens):
        head.embed_tokens = target_model.embed_tokens
    if layout.has_head and _same(head.shared_head.head, target_model.lm_head):
        head.shared_head.head = target_model.lm_head
    return head.eval()


def _same(mine: nn.Module, target: nn.Module) -> bool:
    return (mine.weight.shape == target.weight.shape and mine.weight.dtype == target.weight.dtype
            and torch.equal(mine.weight, target.weight))
