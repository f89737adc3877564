"""EAGLE draft heads (EAGLE-1 and EAGLE-3) in their public checkpoint formats.

Both read target features and a token per row and return the draft's pre-norm hidden state,
which feeds the next draft step. `topk` maps the head's output to target token ids.

EAGLE-1: x = fc(cat(embed(t), feature)) -> one decoder layer without input norm ->
hidden (no final norm); logits from the *target's* lm_head. Features: the target's final
(normed) hidden state.
EAGLE-3: h = fc(cat(aux_low, aux_mid, aux_high)) for target features (own hidden states
skip fc); one decoder layer whose attention reads cat(input_layernorm(embed(t)),
hidden_norm(h)); logits = lm_head(norm(x)) over a draft vocabulary mapped by d2t.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from specserve.engine.grammar.bitmask import apply_token_bitmask
from specserve.engine.layers.norm import RMSNorm
from specserve.engine.layers.rotary import RotaryEmbedding
from specserve.engine.layers.sampler import draft_topk
from specserve.engine.models.llama import MLP, Attention
from specserve.engine.models.loader import CheckpointReader, init_dummy_weights, load_module_weights
from specserve.engine.models.model_config import ModelConfig
from specserve.engine.quantization.config import parse_quantization_config
from specserve.engine.forward_batch import ForwardBatch

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHS = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def _as_llama_config(raw: dict) -> ModelConfig:
    return ModelConfig.from_dict(dict(raw, architectures=["LlamaForCausalLM"]))


def aux_layers_from_config(raw: dict, target_layers: int) -> tuple[int, ...]:
    """Target layers whose output residual stream feeds EAGLE-3's fc (0-based, ascending).

    Checkpoints store ids in two conventions: "output of layer X" (SGLang/SpecForge; the
    default list starts at 1) and "input of layer X" (vLLM/speculators; starts at 2). An id
    list starting at 2 is read as input-of-layer and shifted by one.
    """
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or \
        (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return (1, target_layers // 2 - 1, target_layers - 4)
    ids = [i - 1 for i in ids] if ids[0] == 2 else list(ids)
    if any(not 0 <= i < target_layers for i in ids):
        raise ValueError(f"spec.draft_model: aux hidden layer ids {ids} outside the target's "
                         f"{target_layers} layers")
    return tuple(ids)


class Eagle3Head(nn.Module):
    uses_aux_hidden = True

    def __init__(self, raw: dict, target: ModelConfig, max_position: int):
        super().__init__()
        unsupported = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm") if raw.get(k)]
        if unsupported or (raw.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise ValueError(f"spec.draft_model: unsupported EAGLE-3 variant flags {unsupported or ['use_aux_hidden_state=false']}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError("spec.draft_model: only one-layer EAGLE-3 heads are supported")
        cfg = _as_llama_config(raw)
        self.config = cfg
        h = cfg.hidden_size
        target_h = raw.get("target_hidden_size") or target.hidden_size
        if target_h != target.hidden_size:
            raise ValueError(f"spec.draft_model: target_hidden_size {target_h} != target hidden size "
                             f"{target.hidden_size}")
        self.aux_layers = aux_layers_from_config(raw, target.num_layers)
        self.draft_vocab_size = raw.get("draft_vocab_size") or cfg.vocab_size
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(target.vocab_size, h)
        self.fc = nn.Linear(len(self.aux_layers) * target_h, h, bias=bool(raw.get("bias", False)))
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.midlayer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.midlayer.self_attn = Attention(cfg, 0, rotary, 2 * h)
        self.midlayer.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.midlayer.mlp = MLP(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("hot_token_ids", torch.arange(self.draft_vocab_size), persistent=False)

    @property
    def feature_size(self) -> int:
        """The width of the target features a draft row reads."""
        return self.fc.in_features

    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> torch.Tensor:
        h, x = self._attention_input(fb, hidden_in)
        x = h + self.midlayer.self_attn(x, fb.positions, fb)
        return x + self.midlayer.mlp(self.midlayer.post_attention_layernorm(x))

    def store_kv(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> None:
        """The draft KV of the rows alone (what `forward` stores): fc, the norms and the K/V
        projection, without the attention, the MLP or the output."""
        _, x = self._attention_input(fb, hidden_in)
        self.midlayer.self_attn.store_kv(x, fb.positions, fb)

    def _attention_input(self, fb: ForwardBatch, hidden_in: torch.Tensor):
        h = self.fc(hidden_in) if hidden_in.shape[-1] != self.fc.out_features else hidden_in
        m = self.midlayer
        return h, torch.cat([m.input_layernorm(self.embed_tokens(fb.input_ids)), m.hidden_norm(h)], dim=-1)

    def topk(self, hidden: torch.Tensor, k: int, with_probs: bool = True, bitmask=None):
        """(probabilities [n, k] or None, target token ids [n, k]) of the draft's next token;
        `bitmask` (packed, over the target vocabulary) bans tokens (structured outputs)."""
        logits = self.lm_head(self.norm(hidden))
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask, self.hot_token_ids)
        p, idx = draft_topk(logits, k, with_probs)
        return p, self.hot_token_ids[idx]


class Eagle1Head(nn.Module):
    uses_aux_hidden = False

    def __init__(self, raw: dict, target: ModelConfig, max_position: int, target_lm_head: nn.Linear):
        super().__init__()
        cfg = _as_llama_config(raw)
        self.config = cfg
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError("spec.draft_model: only one-layer EAGLE heads are supported")
        h = cfg.hidden_size
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(target.vocab_size, h)
        # SafeAILab's default when the key is absent is a biased fc.
        self.fc = nn.Linear(2 * h, h, bias=bool(raw.get("bias", True)))
        self.layers = nn.ModuleList([nn.Module()])
        layer = self.layers[0]
        layer.self_attn = Attention(cfg, 0, rotary, h)
        layer.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        layer.mlp = MLP(h, cfg.intermediate_size)
        self.target_lm_head = [target_lm_head]  # a list: not registered, not loaded

    @property
    def feature_size(self) -> int:
        """The width of the target features a draft row reads (its hidden size)."""
        return self.config.hidden_size

    def forward(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> torch.Tensor:
        x = self._attention_input(fb, hidden_in)
        layer = self.layers[0]
        x = x + layer.self_attn(x, fb.positions, fb)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def store_kv(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> None:
        """The draft KV of the rows alone (what `forward` stores)."""
        self.layers[0].self_attn.store_kv(self._attention_input(fb, hidden_in), fb.positions, fb)

    def _attention_input(self, fb: ForwardBatch, hidden_in: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embed_tokens(fb.input_ids), hidden_in], dim=-1))

    def topk(self, hidden: torch.Tensor, k: int, with_probs: bool = True, bitmask=None):
        logits = self.target_lm_head[0](hidden)
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        return draft_topk(logits, k, with_probs)


def load_draft_head(path: str, algorithm: str, target_model: nn.Module, max_position: int,
                    dtype: torch.dtype, device: torch.device, dummy: bool = False) -> nn.Module:
    """Build and load an EAGLE head; the target's embedding is shared when the file has none."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    target: ModelConfig = target_model.config
    for key, mine in (("hidden_size", target.hidden_size),):
        if algorithm == "eagle" and raw.get(key) != mine:
            raise ValueError(f"spec.draft_model: draft {key} {raw.get(key)} != target {key} {mine}")
    if raw.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"spec.draft_model: draft vocab_size {raw.get('vocab_size')} != target "
                         f"vocab_size {target.vocab_size}")
    with torch.device(device):
        if algorithm == "eagle3":
            head = Eagle3Head(raw, target, max_position)
        else:
            head = Eagle1Head(raw, target, max_position, target_model.lm_head)
    head.to(dtype)
    if dummy:  # benchmarks: random weights, the target's embedding
        init_dummy_weights(head, seed=1)
        head.embed_tokens = target_model.embed_tokens
        return head.eval()
    reader = CheckpointReader(path)
    has_embed = "embed_tokens.weight" in reader
    if not has_embed:  # share the target's (vocabulary-parallel) embedding module
        head.embed_tokens = target_model.embed_tokens
    load_module_weights(head, reader, lambda name: name,
                        optional=lambda name: name == "embed_tokens.weight" and not has_embed,
                        quant=parse_quantization_config(raw.get("quantization_config")))
    if algorithm == "eagle3" and "d2t" in reader:
        d2t = reader.get("d2t").to(device=device, dtype=torch.int64)
        head.hot_token_ids = torch.arange(d2t.shape[0], device=device) + d2t
    return head.eval()
