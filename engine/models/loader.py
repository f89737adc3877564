"""Loads Hugging Face safetensors checkpoints (single file or sharded) into our modules.

Our modules fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; each fused
parameter is assembled from its checkpoint parts, so nothing is materialised twice.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from torch import nn

# our fused name part -> checkpoint parts, concatenated along dim 0 in this order
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class CheckpointReader:
    """Lazy tensor access over every safetensors file of a checkpoint folder."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"model: no *.safetensors files in {path}")
        self._where: dict[str, str] = {}
        self._handles = {}
        for name in files:
            handle = safe_open(os.path.join(path, name), framework="pt")
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def get_shard(self, key: str, dim: int, start: int, end: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, end) of a tensor, reading only those."""
        view = self._handles[self._where[key]].get_slice(key)
        return view[start:end] if dim == 0 else view[:, start:end]


def load_module_weights(module: nn.Module, reader: CheckpointReader,
                        to_checkpoint_name: Callable[[str], str],
                        optional: Callable[[str], bool] = lambda name: False) -> None:
    """Fill every parameter of `module` from the checkpoint.

    `to_checkpoint_name` maps our (unfused) parameter name to the checkpoint key; parameters
    for which `optional(name)` is True may be absent (e.g. a tied lm_head). A missing
    tensor or a shape mismatch is an error that names it.
    """
    for name, param in module.named_parameters(remove_duplicate=True):
        if hasattr(param, "stacked_experts"):
            _load_stacked_experts(param, reader, to_checkpoint_name(name))
            continue
        parts = _checkpoint_parts(name)
        keys = [to_checkpoint_name(p) for p in parts]
        missing = [k for k in keys if k not in reader]
        if missing:
            if optional(name):
                continue
            raise ValueError(f"model: checkpoint is missing tensor {missing[0]!r} (for {name})")
        shards = getattr(param, "shards", None)
        if shards is None:
            pieces = [reader.get(k) for k in keys]
        else:  # tensor parallelism: only this rank's slice of each part
            pieces = [reader.get_shard(k, *shard) for k, shard in zip(keys, shards)]
        tensor = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        padded_vocab = shards is not None and tensor.shape[0] < param.shape[0] and tensor.shape[1:] == param.shape[1:]
        if tensor.shape != param.shape and not padded_vocab:
            raise ValueError(f"model: tensor {keys[0]!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)} for {name}")
        with torch.no_grad():
            param.zero_()  # a vocabulary shard's padding rows stay zero
            param[:tensor.shape[0]].copy_(tensor.to(param.dtype))


def _load_stacked_experts(param: nn.Parameter, reader: CheckpointReader, key: str) -> None:
    """[E, ...] from the checkpoint's per-expert tensors `<prefix>.<e>.<part>.weight`: each
    expert's parts (this rank's slice of each) concatenated along dim 0 (gate rows, up rows)."""
    num_experts, parts = param.stacked_experts
    prefix = key.rsplit(".", 1)[0]
    with torch.no_grad():
        for e in range(num_experts):
            pieces = []
            for part, dim, start, end in parts:
                k = f"{prefix}.{e}.{part}.weight"
                if k not in reader:
                    raise ValueError(f"model: checkpoint is missing tensor {k!r}")
                pieces.append(reader.get_shard(k, dim, start, end))
            tensor = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            if tensor.shape != param.shape[1:]:
                raise ValueError(f"model: tensor {prefix}.{e}.{parts[0][0]}.weight gives shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(param.shape[1:])}")
            param[e].copy_(tensor.to(param.dtype))


def _checkpoint_parts(name: str) -> list[str]:
    for fused, parts in FUSED_PARTS.items():
        if f".{fused}." in name:
            return [name.replace(f".{fused}.", f".{p}.") for p in parts]
    return [name]


def load_llama(model: nn.Module, path: str) -> None:
    """Our LlamaForCausalLM (and DeepseekForCausalLM) names are HF's without the `model.`
    prefix on the trunk."""
    reader = CheckpointReader(path)

    def to_hf(name: str) -> str:
        return name if name.startswith("lm_head.") else "model." + name

    # A tied lm_head shares embed_tokens' parameter, so named_parameters() never yields it.
    load_module_weights(model, reader, to_hf)


def init_dummy_weights(module: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks on model shapes that are not on disk (norms stay 1)."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.02, generator=gen)
