"""Writes FP8 checkpoints from 16/32-bit ones as the published tools do, for the tests.

Formats (`FORMATS`):
- "block": DeepSeek-V3 / transformers FineGrainedFP8: per (bn x bk) block s = amax / 448,
  W_fp8 = W / s, `weight_scale_inv` = s [ceil(N/bn), ceil(K/bk)]; quant_method "fp8" with
  weight_block_size.
- "ct-block": llm-compressor's FP8_BLOCK scheme, the same grid stored as `weight_scale`.
- "ct-channel": llm-compressor's FP8_DYNAMIC: per output row s = amax / 448 ([N, 1]
  `weight_scale`), dynamic per-token activations.
- "ct-tensor": llm-compressor's FP8 (static): one scale per tensor ([1]) and a static
  `input_scale` [1].
- "hf-tensor": quant_method "fp8" without a block size: a scalar `weight_scale`.
Every linear weight of the decoder layers (attention, MLP, MLA projections, experts, shared
experts; a NextN module's too) is quantized; embeddings, norms, routers, eh_proj and the LM
head stay as they were, as in DeepSeek-V3's release. `dequantized_copy` writes the same model
with the FP8 values multiplied back out in fp32: the reference the engine must match.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
             "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "w1", "w2", "w3")  # Mixtral's experts: w1/w3/w2
FORMATS = ("block", "ct-block", "ct-channel", "ct-tensor", "hf-tensor")


def quantizes(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED and "layers." in name


def quantize_block(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    n, k = q.shape
    if block is None:  # per row [N, 1] or per tensor
        return q.float() * scale.float().reshape(-1, 1) if scale.numel() > 1 else q.float() * scale.float()
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * full


def _config(fmt: str, block: tuple[int, int]) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    if fmt == "hf-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": {"ct-block": "block", "ct-channel": "channel", "ct-tensor": "tensor"}[fmt]}
    if fmt == "ct-block":
        weights["block_structure"] = list(block)
    acts = {"num_bits": 8, "type": "float", "symmetric": True,
            "dynamic": fmt != "ct-tensor", "strategy": "tensor" if fmt == "ct-tensor" else "token"}
    if fmt == "ct-block":
        acts.update(strategy="group", group_size=block[1])
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


def quantize_checkpoint(src: str, dst: str, fmt: str, block: tuple[int, int] = (128, 128),
                        reference: str | None = None) -> str:
    """Write `src` (safetensors, one file) quantized in `fmt` to `dst`; with `reference`, also
    the dequantized fp32 model there (same config without quantization_config)."""
    assert fmt in FORMATS, fmt
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, ref = {}, {}
    for name, w in tensors.items():
        if not quantizes(name):
            out[name] = w
            ref[name] = w.float()
            continue
        base = name[:-len("weight")]
        if fmt in ("block", "ct-block"):
            q, s = quantize_block(w, *block)
            out[base + ("weight_scale_inv" if fmt == "block" else "weight_scale")] = s
            ref[name] = dequantize(q, s, block)
        elif fmt == "ct-channel":
            q, s = quantize_rows(w)
            out[base + "weight_scale"] = s
            ref[name] = dequantize(q, s, None)
        else:
            q, s = quantize_tensor(w)
            out[base + "weight_scale"] = s.reshape(1) if fmt == "ct-tensor" else s.reshape(())
            if fmt == "ct-tensor":
                out[base + "input_scale"] = torch.tensor([0.05])
            ref[name] = dequantize(q, s, None)
        out[name] = q
    return write_quantized(src, dst, out, _config(fmt, block), ref, reference)


def write_quantized(src: str, dst: str, tensors: dict, quantization_config: dict, ref: dict,
                    reference: str | None) -> str:
    """`tensors` as `dst`'s checkpoint (src's config with `quantization_config`, src's
    tokenizer files); with `reference`, `ref` there as a plain fp32 checkpoint."""
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    _copy_side_files(src, dst)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=quantization_config), f)
    if reference is not None:
        os.makedirs(reference, exist_ok=True)
        save_file(ref, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
        _copy_side_files(src, reference)
        with open(os.path.join(reference, "config.json"), "w") as f:
            json.dump(dict(config, torch_dtype="float32"), f)
    return dst


def _copy_side_files(src: str, dst: str) -> None:
    for name in os.listdir(src):
        if name != "config.json" and not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
