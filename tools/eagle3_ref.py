"""Reference EAGLE-3 draft head in plain torch, in the public checkpoint layout.

Follows docs/reference/eagle-formats.md (shared): tensor inventory §2.3, d2t/t2d §2.4, aux-layer
convention §2.5, forward §2.6, training-time-test attention §2.7. `tools/train_demo.py` trains the
demo head with it; `tests/test_demo_models.py` uses it to check the shipped checkpoint. The engine
has its own implementation of the same forward; this file is the oracle it can be compared with.

Forward of one draft row (H = hidden size, Vd = draft vocab):
    h        = fc(cat(aux_low, aux_mid, aux_high))          first step only; later: previous h_prenorm
    x        = cat(input_layernorm(embed(token)), hidden_norm(h))                   [2H]
    h        = h + o_proj(attn(q_proj(x), k_proj(x), v_proj(x), rope(position)))   residual = UN-normed h
    h        = h + mlp(post_attention_layernorm(h))
    h_prenorm = h;   logits = lm_head(norm(h))   (draft ids; target id = d + d2t[d])
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 default capture layers, "output of decoder layer X" (0-based): (1, N//2-1, N-4).

    This is the SGLang/SpecForge convention (first id 1). In Hugging Face `output_hidden_states`
    numbering (index 0 = embeddings) the same states are hidden_states[X + 1]; in the vLLM
    "capture before layer" convention they are (2, N//2, N-3).
    """
    n = num_target_layers
    layers = (1, n // 2 - 1, n - 4)
    assert n >= 6 and layers[0] < layers[1] < layers[2] < n - 1, f"too few target layers: {n}"
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int             # target vocab V (size of t2d and of the shared embedding)
    draft_vocab_size: int       # Vd (rows of lm_head, size of d2t)
    aux_layer_ids: tuple[int, int, int]  # outputs of these target decoder layers (0-based)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None

    def to_hf_dict(self, torch_dtype: str) -> dict:
        """config.json in the SGLang/SpecForge EAGLE-3 layout (eagle-formats.md §2.2)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Eagle3Config":
        assert d.get("architectures") == [ARCHITECTURE], d.get("architectures")
        assert d.get("num_hidden_layers", 1) == 1
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "target_hidden_size"):
            assert not d.get(flag), f"variant flag {flag} is not supported by this reference"
        rope = d.get("rope_parameters") or {}
        nh = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_attention_heads=nh, num_key_value_heads=d.get("num_key_value_heads", nh),
            head_dim=d.get("head_dim") or d["hidden_size"] // nh,
            vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size", d["vocab_size"]),
            aux_layer_ids=tuple(d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"))


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, multiply by the weight in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """Llama (non-interleaved, rotate-half) RoPE tables for integer positions [..., T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, hd]; cos/sin: [B, T, hd]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)   # input is cat(emb, hidden): 2H
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)   # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)       # on the hidden stream
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class KV(NamedTuple):
    k: torch.Tensor  # [B, nkv, S, hd] (rope applied)
    v: torch.Tensor


class DraftOut(NamedTuple):
    logits: torch.Tensor     # [B, T, Vd] over draft ids
    h_prenorm: torch.Tensor  # [B, T, H] recurrent state for the next draft step
    kv: KV                   # this call's keys/values (prefix included for extend/decode)


class Eagle3Head(nn.Module):
    """State-dict keys are exactly the public EAGLE-3 names: fc.weight, midlayer.*, norm.weight,
    lm_head.weight, d2t, t2d. The token embedding is the target's (passed in as `embeds`)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    # ---- vocab mapping (eagle-formats.md §2.4) ----
    def set_draft_vocab(self, used_target_ids: torch.Tensor) -> None:
        """used_target_ids: the Vd target ids of the draft vocab. d2t is an OFFSET: t = d + d2t[d]."""
        used = torch.sort(used_target_ids.to(torch.long)).values
        assert used.numel() == self.cfg.draft_vocab_size and used.unique().numel() == used.numel()
        self.d2t.copy_(used.to(self.d2t.device) - torch.arange(used.numel(), device=self.d2t.device))
        self.t2d.zero_()
        self.t2d[used.to(self.t2d.device)] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_vocab_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- pieces of the forward ----
    def _qkv(self, embeds, h, positions):
        cfg, attn = self.cfg, self.midlayer.self_attn
        b, t, _ = h.shape
        embeds = embeds.to(h.dtype)
        x = torch.cat([self.midlayer.input_layernorm(embeds), self.midlayer.hidden_norm(h)], dim=-1)
        q = attn.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _expand_kv(self, x):
        """GQA: query head j reads kv head j // (nh / nkv)."""
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        return x if rep == 1 else x.repeat_interleave(rep, dim=1)

    def _finish(self, h, attn_out):
        """attn_out [B, nh, T, hd] -> residual (un-normed h) + o_proj, then the MLP block."""
        b, _, t, _ = attn_out.shape
        x = h + self.midlayer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        x = x + self.midlayer.mlp(self.midlayer.post_attention_layernorm(x))
        return x

    def compute_logits(self, h_prenorm):
        return self.lm_head(self.norm(h_prenorm))

    def _attend(self, q, k, v, mask):
        """Plain attention; scale 1/sqrt(hd); softmax in fp32. mask: bool [.., Tq, Tk], True = keep."""
        scores = torch.matmul(q, self._expand_kv(k).transpose(-1, -2)).float()
        scores = scores / math.sqrt(self.cfg.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        return torch.matmul(probs, self._expand_kv(v))

    # ---- inference-style API (what an engine does) ----
    def extend(self, aux: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
               prefix: Optional[KV] = None) -> DraftOut:
        """First draft step over target-processed rows ("draft extend"), causal over prefix + rows.

        aux: [B, T, 3H] target features of positions p; embeds: target embedding of the token at
        p+1 (the shifted ids, last row = the token the target just produced); positions: [B, T] = p.
        """
        return self._rows(self.fc(aux), embeds, positions, prefix)

    def decode(self, h_prev: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
               prefix: KV) -> DraftOut:
        """Later chain steps: h_prev is the parent's h_prenorm (fc skipped), embeds = embedding of
        the parent's drafted token (as a target id), positions = parent position + 1."""
        return self._rows(h_prev, embeds, positions, prefix)

    def _rows(self, h, embeds, positions, prefix):
        q, k, v = self._qkv(embeds, h, positions)
        if prefix is not None:
            k, v = torch.cat([prefix.k, k], dim=2), torch.cat([prefix.v, v], dim=2)
        tq, tk = q.shape[2], k.shape[2]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        out = self._finish(h, self._attend(q, k, v, mask))
        return DraftOut(self.compute_logits(out), out, KV(k, v))

    # ---- training-time test (eagle-formats.md §2.7) ----
    def ttt_forward(self, aux: torch.Tensor, step_embeds: Sequence[torch.Tensor],
                    positions: torch.Tensor) -> list[torch.Tensor]:
        """Unrolled training forward: returns the logits of each step.

        Step k (0-based) row i reads token t_{i+1+k} (step_embeds[k]) at position p_i + k; step 0
        takes fc(aux_i), step k>0 takes step k-1's h_prenorm of the same row. The query of row i
        sees the step-0 keys of rows <= i (causal) and its own row's keys of steps 1..k only.
        """
        t = aux.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=aux.device).tril()
        h = self.fc(aux)
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        k0 = v0 = None
        extra_k, extra_v, step_logits = [], [], []
        for step, embeds in enumerate(step_embeds):
            q, k, v = self._qkv(embeds, h, positions + step)
            if step == 0:
                k0, v0 = self._expand_kv(k), self._expand_kv(v)
            else:
                extra_k.append(self._expand_kv(k))
                extra_v.append(self._expand_kv(v))
            scores = torch.matmul(q, k0.transpose(-1, -2)).float() * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = [(q * ek).sum(-1, keepdim=True).float() * scale for ek in extra_k]
            probs = torch.cat([scores] + diag, dim=-1).softmax(-1).to(v0.dtype)
            out = torch.matmul(probs[..., :t], v0)
            for j, ev in enumerate(extra_v):
                out = out + probs[..., t + j:t + j + 1] * ev
            h = self._finish(h, out)
            step_logits.append(self.compute_logits(h))
        return step_logits


# ---- checkpoint I/O ----
def save_head(head: Eagle3Head, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors; float tensors in `dtype`, d2t int64, t2d bool."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, tensor in head.state_dict().items():
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).replace("torch.", "")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(head.cfg.to_hf_dict(dtype_name), f, indent=2)
        f.write("\n")


EXPECTED_KEYS = (
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d")


def load_head(path: str, device="cpu", dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Strict load: every expected key present with the expected shape, nothing extra."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = Eagle3Config.from_hf_dict(json.load(f))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert set(tensors) == set(EXPECTED_KEYS), sorted(set(tensors) ^ set(EXPECTED_KEYS))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    head = Eagle3Head(cfg)
    head.load_state_dict(tensors, strict=True)
    return head.to(device=device, dtype=dtype).eval()   # .to(dtype) leaves int/bool buffers alone


# ---- target side: logits plus the three aux hidden states ----
class TargetOut(NamedTuple):
    logits: torch.Tensor  # [B, T, V]
    aux: torch.Tensor     # [B, T, 3H] = cat(out of layer a0, a1, a2), residual stream, pre-norm


def target_forward(target: nn.Module, input_ids: torch.Tensor,
                   aux_layer_ids: Sequence[int]) -> TargetOut:
    """Runs a Hugging Face Llama and captures the OUTPUTS of decoder layers `aux_layer_ids`
    (0-based, residual stream before the final norm) with forward hooks."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for idx in aux_layer_ids:
        def hook(_module, _inputs, output, idx=idx):
            captured[idx] = output[0] if isinstance(output, tuple) else output
        hooks.append(target.model.layers[idx].register_forward_hook(hook))
    try:
        logits = target(input_ids=input_ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return TargetOut(logits, torch.cat([captured[i] for i in aux_layer_ids], dim=-1))


# ---- greedy decoding, plain and speculative (chain), full recompute: an oracle, not fast ----
class TargetRunner:
    """Callable target: token ids [B, T] -> TargetOut (logits + aux features)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]):
        self.model = model
        self.aux_layer_ids = tuple(aux_layer_ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, input_ids: torch.Tensor) -> TargetOut:
        return target_forward(self.model, input_ids, self.aux_layer_ids)


@torch.no_grad()
def greedy_generate(target: TargetRunner, prompt: Sequence[int], max_new_tokens: int,
                    eos_token_id: Optional[int] = None) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        tok = int(target(torch.tensor([seq], device=target.device)).logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok == eos_token_id:
            break
    return out


class SpecResult(NamedTuple):
    tokens: list[int]          # generated tokens (equal to plain greedy decoding)
    accept_lengths: list[int]  # per verify: accepted drafts + 1 (the bonus token)


@torch.no_grad()
def chain_speculative_greedy(target: TargetRunner, head: Eagle3Head, embed: nn.Module,
                             prompt: Sequence[int], max_new_tokens: int, num_steps: int = 3,
                             eos_token_id: Optional[int] = None) -> SpecResult:
    """EAGLE-3 chain drafting (topk=1) with greedy verification, one target forward per verify.

    Invariant at the top of the loop: `seq` = committed tokens, the last one (the bonus token) not
    yet read by the target; `aux` = target features of positions 0..len(seq)-2.
    """
    device, dtype = target.device, next(head.parameters()).dtype
    first = target(torch.tensor([list(prompt)], device=device))
    seq = list(prompt) + [int(first.logits[0, -1].argmax())]
    aux = first.aux
    out, accept = [seq[-1]], []
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        n = len(seq)
        # draft extend: row p pairs (feature of position p, token p+1) at position p
        shifted = torch.tensor([seq[1:]], device=device)
        positions = torch.arange(n - 1, device=device)[None]
        step = head.extend(aux.to(dtype), embed(shifted), positions)
        drafts = []
        for depth in range(num_steps):
            tok = int(head.draft_to_target(step.logits[0, -1].argmax()))
            drafts.append(tok)
            if depth + 1 < num_steps:   # parent row at position n-2+depth, child one further
                step = head.decode(step.h_prenorm[:, -1:], embed(torch.tensor([[tok]], device=device)),
                                   torch.tensor([[n - 1 + depth]], device=device), step.kv)
        # verify: the target reads the bonus token and the drafts in one forward
        ver = target(torch.tensor([seq + drafts], device=device))
        greedy = ver.logits[0, n - 1:].argmax(-1).tolist()   # greedy[j] follows seq + drafts[:j]
        accepted = 0
        while accepted < num_steps and drafts[accepted] == greedy[accepted]:
            accepted += 1
        new = drafts[:accepted] + [greedy[accepted]]
        if eos_token_id in new:
            new = new[:new.index(eos_token_id) + 1]
        new = new[:max_new_tokens - len(out)]
        accept.append(accepted + 1)
        seq += new
        out += new
        aux = ver.aux[:, :len(seq) - 1]
    return SpecResult(out, accept)
