"""Tensor parallelism: the rank's view of the group, and the layers that split across it.

Megatron-style: column-parallel layers split their output features (q/k/v by heads, gate/up
by rows), row-parallel layers split their input features and all-reduce the output; the
embedding and the LM head split the vocabulary. With one rank every layer is a plain layer
and no collective runs. Each parameter records which slice of the checkpoint tensor it holds
(`param.shards`), so the loader reads only that slice.

The linear layers run decode-sized batches (<= 16 rows) on CUDA through the Triton skinny GEMM
(engine/layers/skinny_gemm.py) where its per-shape rule picks it; `set_skinny_gemm` turns that
off in a model (EngineConfig.skinny_gemm, for an A/B in one process).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specserve.engine.layers.linear_method import UNQUANTIZED, LinearMethod


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0
    group: Any = None  # the process group of model collectives (None with one rank)
    # The all-reduce by message size (layers/all_reduce.py); None: NCCL (gloo) for every call.
    reducer: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: `x` itself, reduced in place, or a new tensor."""
        if self.size == 1:
            return x
        if self.reducer is not None:
            return self.reducer(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module):
        """norm(sum over the ranks of x, residual): (normed, new residual), in one kernel where
        the reducer has one (layers/one_shot.py) and the rows fit it, else the all-reduce and
        then the norm."""
        add_rmsnorm = getattr(self.reducer, "add_rmsnorm", None)
        fused = add_rmsnorm(x, residual, norm.weight, norm.eps) if add_rmsnorm is not None else None
        return fused if fused is not None else norm(self.all_reduce(x), residual)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's value everywhere: sampling and acceptance are decided once."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly."""
        if n % self.size:
            raise ValueError(f"tp_size: {self.size} does not divide {what} ({n})")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per


SINGLE = TensorParallel()


def _mark(param: nn.Parameter, shards: list[tuple[int, int, int]]) -> None:
    """shards: per checkpoint part, (dim, start, end) of the slice this rank loads."""
    param.shards = shards


class QuantizableLinear(nn.Module):
    """A linear layer whose weight is held and applied by its `method` (layers/linear_method.py):
    16-bit as built, or a quantization format's the loader sets with `use_method`."""

    skinny_gemm = True  # see set_skinny_gemm

    def __init__(self):
        super().__init__()
        self.method: LinearMethod = UNQUANTIZED

    def use_method(self, method: LinearMethod) -> None:
        """Hold the weight in `method`'s format (its parameters replace the 16-bit weight)."""
        self.method = method
        method.create_weights(self)

    def after_loading(self) -> None:
        self.method.after_loading(self)

    @property
    def scale(self):
        """The FP8 scale grid (layers/fp8_weight.py) of an FP8 weight, else None."""
        return self.method.fp8_scale(self)


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T with W's rows split; `parts` are the fused checkpoint tensors' row ranges
    this rank holds (e.g. its q heads, its k heads, its v heads)."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool):
        super().__init__()
        out = sum(end - start for start, end in parts)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        _mark(self.weight, [(0, s, e) for s, e in parts])
        if self.bias is not None:
            _mark(self.bias, [(0, s, e) for s, e in parts])

    def forward(self, x):
        return self.method.apply(self, x, self.bias)

    def fuses_qkv_rope(self, x: torch.Tensor, head_dim: int, qk_norm: bool = False) -> bool:
        """Whether `forward_qkv_rope` runs here (the skinny GEMM with its RoPE epilogue, and
        with `qk_norm` the per-head q/k RMSNorm before it)."""
        return self.method.fuses_qkv_rope(self, x, head_dim, qk_norm)

    def forward_qkv_rope(self, x: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                         rotary: nn.Module, positions: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, loc: torch.Tensor, k_scale: float = 1.0,
                         v_scale: float = 1.0,
                         qk_norm: Optional[tuple[nn.Module, nn.Module]] = None) -> torch.Tensor:
        """For a q/k/v layer (its q heads, k heads, v heads) where `fuses_qkv_rope`: the
        projection, RoPE of q and k (after the per-head RMSNorms `qk_norm`, q's and k's, where
        given), and k and v stored at `loc` (with an FP8 pool's scales), in one kernel;
        returns q."""
        norms = None
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            assert q_norm.eps == k_norm.eps
            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
        return self.method.apply_qkv_rope(
            self, x, self.bias, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            positions=positions, cos=rotary.cos, sin=rotary.sin, k_cache=k_cache, v_cache=v_cache,
            loc=loc, k_scale=k_scale, v_scale=v_scale, qk_norm=norms)

    def forward_silu_and_mul(self, x):
        """silu_and_mul(self(x)) for a gate/up layer (its gate rows, then its up rows): one
        kernel where the skinny GEMM runs."""
        return self.method.apply_silu_and_mul(self, x, self.bias)


class RowParallelLinear(QuantizableLinear):
    """y = all_reduce(x_local W_local^T): the input features are split. With `reduce` off the
    layer returns this rank's partial sum, and the caller reduces it (fused with what follows:
    TensorParallel.all_reduce_add_rmsnorm)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel):
        super().__init__()
        start, end = tp.split(in_features, "the input features of a row-parallel layer")
        self.weight = nn.Parameter(torch.empty(out_features, end - start))
        _mark(self.weight, [(1, start, end)])
        self.tp = tp
        self.reduce = True

    def forward(self, x):
        y = self.method.apply(self, x, None)
        return self.tp.all_reduce(y) if self.reduce else y


def set_skinny_gemm(model: nn.Module, enabled: bool) -> None:
    """Whether the model's linear layers may use the skinny GEMM (else cuBLAS everywhere)."""
    for module in model.modules():
        if isinstance(module, QuantizableLinear):
            module.skinny_gemm = enabled


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds its vocabulary range; the others contribute zeros to the all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        super().__init__()
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        _mark(self.weight, [(0, self.start, end)])  # the last rank's tail stays zero padding
        self.tp = tp

    def forward(self, ids):
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(QuantizableLinear):
    """Logits over the rank's vocabulary range, gathered so every rank holds all of them. A
    16-bit head runs cuBLAS (F.linear) at every size; a quantized one (online FP8 with
    `quantize_lm_head`) its method."""

    def __init__(self, dim: int, vocab_size: int, tp: TensorParallel):
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        _mark(self.weight, [(0, start, min(start + self.per_rank, vocab_size))])
        self.tp = tp

    def forward(self, x):
        local = F.linear(x, self.weight) if self.method is UNQUANTIZED else self.method.apply(self, x, None)
        logits = self.tp.all_gather_last_dim(local.float())
        return logits[..., :self.vocab_size]


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """The KV heads this rank holds: a split, or one replicated head when heads < ranks."""
    if num_kv_heads >= tp.size:
        return tp.split(num_kv_heads, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"tp_size: {tp.size} is not a multiple of num_key_value_heads ({num_kv_heads})")
    head = tp.rank * num_kv_heads // tp.size
    return head, head + 1
