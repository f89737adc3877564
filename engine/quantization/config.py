"""A checkpoint's `quantization_config`, parsed into a scheme the engine implements (FP8
weights with per-block, per-channel or per-tensor scales; INT4 weights with group-wise scales
and zero points), or refused by name; and `--quantization`, checked against it.

Formats served, as their tools write them:
- `quant_method: "fp8"` with `weight_block_size` [bn, bk] (DeepSeek-V3/R1, transformers'
  FineGrainedFP8): float8_e4m3fn weights, `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] fp32
  (multiplied in despite the name: W = W_fp8 * scale_inv), dynamic activations.
- `quant_method: "fp8"` without a block size: a per-tensor `weight_scale` (and, with
  `activation_scheme: "static"`, an `input_scale`).
- `quant_method: "compressed-tensors"`, `format: "float-quantized"` (llm-compressor's FP8,
  FP8_DYNAMIC and FP8_BLOCK schemes): 8-bit float weights, strategy tensor / channel / block,
  `weight_scale` ([1], [N, 1] or [ceil(N/bn), ceil(K/bk)]).
- `quant_method: "awq"` (AutoAWQ, `version: "gemm"`): 4-bit weights packed eight to an int32
  along the output features in AWQ's interleaved order, `qzeros`, fp16 `scales` per group of
  `group_size` input features (`Int4Config`, quantization/int4.py).
- `quant_method: "gptq"` (AutoGPTQ / GPTQModel, `desc_act: false`): 4-bit weights packed eight
  to an int32 along the input features, zero points stored minus one (`checkpoint_format`
  "gptq"; "gptq_v2" stores them as they are), sym or asym.

Activations stay 16-bit (W8A16, W4A16): every kernel dequantises the weight tile it reads. Static
`input_scale`s are therefore read as part of the checkpoint and not applied (as vLLM's W8A16
path does on GPUs without FP8 matrix units): the product is the dequantised weight's, which is
closer to the unquantised model than the calibrated W8A8 one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

from specserve.engine.config import QUANTIZATION_FLAGS

SUPPORTED = ("fp8 (block-wise, DeepSeek-V3 style, or per-tensor), compressed-tensors "
             "float-quantized FP8 (per-tensor, per-channel or block-wise weights), awq (4-bit, "
             "version gemm) and gptq (4-bit, desc_act false)")
INT4_GROUP_SIZES = (32, 64, 128, -1)  # -1: one group over all of K (per channel)
DUMMY_INT4_GROUP = 128  # random INT4 weights: the published checkpoints' usual groups
# `--quantization` values (engine/config.py): "auto" serves the checkpoint as stored; the
# others must match it, except "fp8", which quantizes a 16-bit checkpoint at load.


class UnsupportedQuantization(ValueError):
    """A checkpoint whose quantization the engine does not implement."""


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's quantized linear weights are stored.

    granularity: "block" (scale per weight_block tile), "channel" (per output row) or
    "tensor" (one per checkpoint tensor). scale_name: the tensor beside `<module>.weight`
    that holds the scales. ignored: module-name patterns the tool left in 16 bits (the
    checkpoint's weight dtypes decide in the end; these are only reported)."""

    method: str                               # "fp8" | "compressed-tensors"
    granularity: str                          # "block" | "channel" | "tensor"
    weight_block: Optional[tuple[int, int]]   # (bn, bk) for "block"
    scale_name: str                           # "weight_scale_inv" | "weight_scale"
    activation_scheme: str                    # "dynamic" | "static" | "none" (not applied: W8A16)
    ignored: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """What GetModelInfo and the logs call the weight format."""
        if self.granularity == "block":
            return f"fp8 (block {self.weight_block[0]}x{self.weight_block[1]})"
        return f"fp8 (per-{self.granularity})"

    def ignores(self, hf_module: str) -> bool:
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], hf_module):
                    return True
            elif hf_module == pattern or hf_module.endswith("." + pattern):
                return True
        return False


@dataclass(frozen=True)
class Int4Config:
    """4-bit integer weights (W4A16): W[n, k] = (q[k, n] - zero[g, n]) * scale[g, n] with
    g = k // group_size (group_size = K when the config says -1).

    zero_offset: what the stored zero points lack (GPTQ's "gptq" format stores zero - 1);
    zero_point False: symmetric, no qzeros read (AWQ without zero points is refused, GPTQ's
    sym checkpoints still store qzeros = 8 - 1)."""

    method: str                 # "awq" | "gptq"
    group_size: int             # > 0, or -1 for one group over all of K
    sym: bool
    zero_offset: int            # added to the stored zero points
    ignored: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        group = "per-channel" if self.group_size < 0 else f"group {self.group_size}"
        return f"int4 {self.method} ({group}{', sym' if self.sym else ''})"


@dataclass(frozen=True)
class OnlineFp8Config:
    """`--quantization fp8` on a 16-bit checkpoint: every linear layer quantized at load, one
    scale per output row (quantization/fp8.py); with `lm_head` the untied LM head too."""

    lm_head: bool = False
    online = True

    @property
    def name(self) -> str:
        return f"fp8 (per-channel, quantized at load{', LM head too' if self.lm_head else ''})"
Scheme = Union[QuantConfig, Int4Config, OnlineFp8Config]


def resolve_quantization(flag: str, checkpoint: Optional[Scheme], model: str, mla: bool = False,
                         dummy: bool = False, lm_head: bool = False) -> Optional[Scheme]:
    """The scheme served for `--quantization flag` and the checkpoint's own: the checkpoint's
    ("auto", or a flag naming it), online FP8 ("fp8" on a 16-bit checkpoint; random weights:
    block-wise FP8), random INT4 weights (awq / gptq with `dummy`), or refused by name when
    they disagree or the model cannot take it (INT4 with MLA). `lm_head`: online FP8
    quantizes the LM head too."""
    scheme = _resolve(flag, checkpoint, model, dummy)
    if lm_head:
        if not isinstance(scheme, OnlineFp8Config):
            raise UnsupportedQuantization(f"quantize_lm_head: quantizes a 16-bit checkpoint's LM "
                                          f"head at load; {model} is stored as {scheme.name}")
        scheme = OnlineFp8Config(lm_head=True)
    if isinstance(scheme, Int4Config) and mla:
        raise UnsupportedQuantization(f"quantization: {scheme.name} is not supported with MLA "
                                      f"attention (DeepSeek)")
    return scheme


def _resolve(flag: str, checkpoint: Optional[Scheme], model: str, dummy: bool) -> Optional[Scheme]:
    if flag not in QUANTIZATION_FLAGS:
        raise UnsupportedQuantization(f"quantization: {flag!r} is not supported; supported: "
                                      f"{', '.join(QUANTIZATION_FLAGS)}")
    if flag == "auto":
        return checkpoint
    if checkpoint is None:
        if flag == "fp8":
            return OnlineFp8Config()
        if dummy:  # random INT4 weights for the benchmarks' rows, in the common layout
            return Int4Config(flag, DUMMY_INT4_GROUP, sym=flag == "gptq", zero_offset=0)
        raise UnsupportedQuantization(f"quantization: {flag!r} needs a {flag} checkpoint, but "
                                      f"{model} has no quantization_config (a 16-bit checkpoint; "
                                      f"only 'fp8' quantizes at load)")
    stored = "fp8" if isinstance(checkpoint, QuantConfig) else checkpoint.method
    if stored != flag:
        raise UnsupportedQuantization(f"quantization: {flag!r} does not match {model}'s "
                                      f"quantization_config ({checkpoint.name}); use 'auto' or {stored!r}")
    return checkpoint


def parse_quantization_config(qc: Optional[dict]) -> Optional[Scheme]:
    """None for an unquantized checkpoint; else the scheme, or UnsupportedQuantization naming
    `quantization_config` and what is supported."""
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise _refuse(f"is {type(qc).__name__}, not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    raise _refuse(f"quant_method {method!r} is not supported")


def _refuse(why: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"model: quantization_config {why}; supported: {SUPPORTED}")


def _hf_fp8(qc: dict) -> QuantConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fmt {fmt!r} is not supported (e4m3 is)")
    activation = qc.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise _refuse(f"activation_scheme {activation!r} is not supported")
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", "tensor", None, "weight_scale", activation, ignored)
    block = _block(block, "weight_block_size")
    if activation != "dynamic":
        raise _refuse("block-wise fp8 with static activation scales is not supported")
    return QuantConfig("fp8", "block", block, "weight_scale_inv", activation, ignored)


def _block(value, what: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise _refuse(f"{what} {value!r} is not two positive integers")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict) -> QuantConfig:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r} is not supported (float-quantized is)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"compressed-tensors with {len(groups)} config_groups is not supported (one is)")
    group = next(iter(groups.values()))
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise _refuse(f"compressed-tensors targets {targets!r} are not supported (['Linear'] is)")
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise _refuse(f"compressed-tensors weights of type {weights.get('type')!r} with "
                      f"{weights.get('num_bits')} bits are not supported (8-bit float is)")
    if weights.get("dynamic") or weights.get("symmetric") is False:
        raise _refuse("compressed-tensors dynamic or asymmetric weight scales are not supported")
    strategy = weights.get("strategy")
    activations = group.get("input_activations")
    if activations:
        if activations.get("type") != "float" or activations.get("num_bits") != 8:
            raise _refuse("compressed-tensors input activations other than 8-bit float are not supported")
        activation = "dynamic" if activations.get("dynamic") else "static"
    else:
        activation = "none"
    if group.get("output_activations"):
        raise _refuse("compressed-tensors output activation quantization is not supported")
    ignored = tuple(qc.get("ignore") or ())
    if strategy == "block":
        block = _block(weights.get("block_structure"), "weights.block_structure")
        return QuantConfig("compressed-tensors", "block", block, "weight_scale", activation, ignored)
    if strategy in ("channel", "tensor"):
        return QuantConfig("compressed-tensors", strategy, None, "weight_scale", activation, ignored)
    raise _refuse(f"compressed-tensors weight strategy {strategy!r} is not supported "
                  f"(tensor, channel and block are)")


def _int4_common(qc: dict, method: str) -> int:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} bits {bits!r} is not supported (4 is)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in INT4_GROUP_SIZES:
        raise _refuse(f"{method} group_size {group!r} is not supported "
                      f"({', '.join(map(str, INT4_GROUP_SIZES))} are)")
    return group


def _awq(qc: dict) -> Int4Config:
    group = _int4_common(qc, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {version!r} is not supported (gemm is)")
    if qc.get("zero_point", True) is not True:
        raise _refuse("awq zero_point false is not supported (true is)")
    ignored = tuple(qc.get("modules_to_not_convert") or ())
    return Int4Config("awq", group, sym=False, zero_offset=0, ignored=ignored)


def _gptq(qc: dict) -> Int4Config:
    group = _int4_common(qc, "gptq")
    if qc.get("desc_act", False):
        raise _refuse("gptq desc_act true (activation-order groups) is not supported (false is)")
    if qc.get("lm_head", False):
        raise _refuse("gptq lm_head true (a quantized LM head) is not supported (false is)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r} is not supported (gptq and gptq_v2 are)")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise _refuse(f"gptq sym {sym!r} is not true or false")
    ignored = tuple(qc.get("modules_to_not_convert") or ())
    return Int4Config("gptq", group, sym=sym, zero_offset=1 if fmt == "gptq" else 0, ignored=ignored)
