"""Loads Hugging Face safetensors checkpoints (single file or sharded) into our modules.

Our modules fuse q/k/v into `qkv_proj`, gate/up into `gate_up_proj` and MLA's projections of the
hidden state (q or q's LoRA down-projection, and kv_a) into one; each fused
parameter is assembled from its checkpoint parts, so nothing is materialised twice.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from specserve.engine.layers.linear_method import PartSlice
from specserve.engine.layers.parallel import ParallelLMHead, QuantizableLinear
from specserve.engine.models.checkpoint_dir import open_safetensors, safetensors_files
from specserve.engine.progress import progress
from specserve.engine.quantization.config import Int4Config, Scheme
from specserve.engine.quantization.fp8 import (
    Fp8LinearMethod, Fp8Target, is_fp8, load_scale, require_quant_config, scale_block)
from specserve.engine.quantization.int4 import Int4LinearMethod
from specserve.engine.quantization.methods import linear_method_for

# our fused name part -> checkpoint parts, concatenated along dim 0 in this order
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "q_kv_a_proj": ("q_proj", "kv_a_proj_with_mqa"),      # MLA without a q LoRA (V2-Lite)
    "q_a_kv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # MLA with one (V2, V3)
}


class CheckpointReader:
    """Lazy tensor access over every safetensors file of a checkpoint folder."""

    def __init__(self, path: str):
        files = safetensors_files(path)
        if not files:
            raise FileNotFoundError(f"model: no *.safetensors files in {path}")
        self.name = os.path.basename(os.path.normpath(path))  # for progress lines
        self._where: dict[str, str] = {}
        self._handles = {}
        for name in files:
            handle = open_safetensors(os.path.join(path, name), "pt")
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def dtype(self, key: str) -> str:
        """The stored dtype's safetensors name (e.g. "BF16", "F8_E4M3"), read from the header."""
        return self._handles[self._where[key]].get_slice(key).get_dtype()

    def shape(self, key: str) -> list[int]:
        return self._handles[self._where[key]].get_slice(key).get_shape()

    def get_shard(self, key: str, dim: int, start: int, end: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, end) of a tensor, reading only those."""
        view = self._handles[self._where[key]].get_slice(key)
        return view[start:end] if dim == 0 else view[:, start:end]


def load_module_weights(module: nn.Module, reader: CheckpointReader,
                        to_checkpoint_name: Callable[[str], str],
                        optional: Callable[[str], bool] = lambda name: False,
                        quant: Optional[Scheme] = None) -> None:
    """Fill every parameter of `module` from the checkpoint.

    `to_checkpoint_name` maps our (unfused) parameter name to the checkpoint key; parameters
    for which `optional(name)` is True may be absent (e.g. a tied lm_head). A missing
    tensor or a shape mismatch is an error that names it. Linear layers the checkpoint stores
    quantized (`quant` says how) take their format's method first, which loads its own
    tensors (layers/linear_method.py); an FP8 tensor for a layer that cannot hold one is
    refused, never converted.
    """
    _adopt_quantized_layers(module, reader, to_checkpoint_name, quant)
    params = list(module.named_parameters(remove_duplicate=True))
    for name, param in progress(params, len(params), f"loading {reader.name}", "tensors"):
        if getattr(param, "loaded_by_method", False):
            continue  # a quantized layer's tensors (FP8 experts: their scales) are loaded already
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
        _refuse_fp8_into_16_bits(reader, keys, param, name)
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
    finish_loading(module)


def _refuse_fp8_into_16_bits(reader: CheckpointReader, keys: list[str], param: nn.Parameter,
                             name: str) -> None:
    fp8 = [k for k in keys if is_fp8(reader, k)]
    if fp8 and param.dtype != torch.float8_e4m3fn:
        raise ValueError(f"model: checkpoint tensor {fp8[0]!r} is float8, but {name} is not a "
                         f"quantizable layer here; FP8 is served for the linear layers and experts")


def _adopt_quantized_layers(module: nn.Module, reader: CheckpointReader,
                            to_checkpoint_name: Callable[[str], str], quant: Optional[Scheme]) -> None:
    """Every linear layer the checkpoint stores quantized (or, with online FP8, every one) takes
    its format's method and loads its tensors; every expert stack stored in FP8 becomes FP8
    with its scale grids loaded."""
    for mod_name, sub in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(sub, QuantizableLinear):
            keys = [to_checkpoint_name(p) for p in _checkpoint_parts(prefix + "weight")]
            parts = [PartSlice(k, *shard) for k, shard in zip(keys, sub.weight.shards)]
            method = linear_method_for(quant, reader, parts, prefix.rstrip("."), sub)
            if method is not None:
                sub.use_method(method)
                method.load_weights(sub, reader, parts)
        elif hasattr(sub, "w13") and hasattr(sub, "use_fp8"):  # a stack of experts
            _adopt_fp8_experts(sub, prefix, reader, to_checkpoint_name, quant)


def _adopt_fp8_experts(sub: nn.Module, prefix: str, reader: CheckpointReader,
                       to_checkpoint_name: Callable[[str], str], quant: Optional[Scheme]) -> None:
    targets = [Fp8Target(f"{name}_scale", _slot_parts(getattr(sub, name), to_checkpoint_name(prefix + name)))
               for name in ("w13", "w2")]
    parts = [p for t in targets for expert in t.experts for p in expert]
    if any(p.key.removesuffix("weight") + "qweight" in reader for p in parts):
        raise ValueError(f"model: {prefix.rstrip('.')}: INT4 MoE experts are not supported "
                         f"(INT4 is served for the dense linear layers)")
    if not parts or not all(p.key in reader for p in parts):
        return  # reported when the weight is loaded
    fp8 = [is_fp8(reader, p.key) for p in parts]
    if not any(fp8):
        return
    if not all(fp8):
        raise ValueError(f"model: {prefix}: some checkpoint tensors are float8 and some not "
                         f"({[p.key for p in parts]}); one layer needs one format")
    quant = require_quant_config(quant, parts[0].key)
    # Each distinct pattern of tensor shapes and slices (an expert stack's routed experts
    # share one; its shared slots are other slices of the shared MLP's wider tensors).
    patterns = {tuple((tuple(reader.shape(p.key)), *p[1:]) for p in parts): parts
                for t in targets for parts in t.experts}
    blocks = {scale_block(parts, reader, quant, prefix.rstrip(".")) for parts in patterns.values()}
    # One grid form for both expert stacks: row scales wherever one needs them; per-row
    # (channel, tensor) scales span the wider stack's K, one column each.
    block = (min(b[0] for b in blocks), max(b[1] for b in blocks))
    sub.use_fp8(*block)
    with torch.no_grad():
        for t in targets:
            grid = torch.stack([load_scale(reader, expert, quant, block) for expert in t.experts])
            target = getattr(sub, t.scale_name)
            if grid.shape != target.shape:
                raise ValueError(f"model: {prefix}{t.scale_name}: checkpoint scales give shape "
                                 f"{tuple(grid.shape)}, expected {tuple(target.shape)}")
            target.copy_(grid)


def _slot_parts(param: nn.Parameter, key: str) -> list[list[PartSlice]]:
    """An expert stack's checkpoint slices, one list a slot: its `stacked_experts` mark names
    them relative to the MoE block (`experts.<e>.<part>`, `shared_experts.<part>`), and `key`
    is the stack's own checkpoint name (`<block>.experts.w13`)."""
    block = key.rsplit(".", 2)[0]
    return [[PartSlice(f"{block}.{name}.weight", dim, start, end) for name, dim, start, end in slot]
            for slot in param.stacked_experts]


def _load_stacked_experts(param: nn.Parameter, reader: CheckpointReader, key: str) -> None:
    """[slots, ...] from the checkpoint's tensors: each slot's parts (this rank's slice of
    each) concatenated along dim 0 (gate rows, up rows)."""
    with torch.no_grad():
        for e, parts in enumerate(_slot_parts(param, key)):
            missing = [p.key for p in parts if p.key not in reader]
            if missing:
                raise ValueError(f"model: checkpoint is missing tensor {missing[0]!r}")
            pieces = [reader.get_shard(*part) for part in parts]
            tensor = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            if tensor.dtype == torch.float8_e4m3fn and param.dtype != tensor.dtype:
                raise ValueError(f"model: checkpoint tensor {parts[0].key} is float8 "
                                 f"but the expert stack was not made FP8")
            if tensor.shape != param.shape[1:]:
                raise ValueError(f"model: tensor {parts[0].key} gives shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(param.shape[1:])}")
            param[e].copy_(tensor.to(param.dtype))


def _checkpoint_parts(name: str) -> list[str]:
    for fused, parts in FUSED_PARTS.items():
        if f".{fused}." in name:
            return [name.replace(f".{fused}.", f".{p}.") for p in parts]
    return [name]


def load_llama(model: nn.Module, path: str) -> None:
    """Our LlamaForCausalLM (and its subclasses') names are HF's without the `model.` prefix on
    the trunk, after the model's `checkpoint_renames`."""
    reader = CheckpointReader(path)

    def to_hf(name: str) -> str:
        for ours, theirs in model.checkpoint_renames:
            name = name.replace(ours, theirs)
        return name if name.startswith("lm_head.") else "model." + name

    # A tied lm_head shares embed_tokens' parameter, so named_parameters() never yields it.
    load_module_weights(model, reader, to_hf, quant=model.config.quantization)


DUMMY_STD = 0.02
DUMMY_FP8_SCALE = DUMMY_STD / 64  # random FP8 values of std 64 stand for weights of std 0.02
DUMMY_FP8_ROWS = 65536  # rows of an FP8 parameter drawn at a time
DUMMY_INT4_ZERO = 8
DUMMY_INT4_SCALE = DUMMY_STD / 4.6  # uniform codes 0..15 less 8 have a std of about 4.6


def init_dummy_weights(module: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks on model shapes that are not on disk (norms stay 1); FP8
    layers get FP8 values and a constant scale grid of the same magnitude, INT4 layers random
    codes, zero points 8 and constant scales."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if hasattr(param, "scale_block"):
                param.fill_(DUMMY_FP8_SCALE)
            elif param.dtype == torch.int32:  # INT4 codes, eight a word
                param.random_(-2 ** 31, 2 ** 31, generator=gen)
            elif param.dtype == torch.uint8:  # INT4 zero points
                param.fill_(DUMMY_INT4_ZERO)
            elif name.endswith(".scales"):  # INT4 scales
                param.fill_(DUMMY_INT4_SCALE)
            elif param.dtype == torch.float8_e4m3fn:  # in slices: fp32 values are 4x the bytes
                for part in param.view(-1, param.shape[-1]).split(DUMMY_FP8_ROWS):
                    values = torch.empty(part.shape, device=param.device).normal_(
                        0.0, DUMMY_STD / DUMMY_FP8_SCALE, generator=gen)
                    part.copy_(values.clamp(-448, 448).to(param.dtype))
            elif "norm" not in name:
                param.normal_(0.0, DUMMY_STD, generator=gen)
    finish_loading(module)


def use_fp8_everywhere(module: nn.Module, block: tuple[int, int]) -> None:
    """Every linear layer but the LM head, and every expert stack, in FP8 with `block` scales
    (random-weight benchmarks of FP8 shapes; a checkpoint's own layout comes from
    `load_module_weights`)."""
    for sub in module.modules():
        if isinstance(sub, QuantizableLinear) and not isinstance(sub, ParallelLMHead):
            sub.use_method(Fp8LinearMethod(block))
        elif hasattr(sub, "w13") and hasattr(sub, "use_fp8"):
            sub.use_fp8(*block)


def use_int4_everywhere(module: nn.Module, config: Int4Config) -> None:
    """Every linear layer but the LM head in INT4 (random-weight benchmarks of INT4 shapes)."""
    for sub in module.modules():
        if isinstance(sub, QuantizableLinear) and not isinstance(sub, ParallelLMHead):
            sub.use_method(Int4LinearMethod(config))


def finish_loading(module: nn.Module) -> None:
    """Layers that derive tensors from their weights (MLA's absorbed projections) make them."""
    for sub in module.modules():
        if hasattr(sub, "after_loading"):
            sub.after_loading()
