"""Structured outputs across tensor-parallel ranks (docs/architecture.md, "Structured outputs
at tp > 1"): only rank 0 runs the grammar process, and every rank applies rank 0's masks.

Rank 0 waits for the masks on its channel and broadcasts them over the model group, inside the
forward and in stream order (a CUDA graph captures the broadcast; no host waits); the other
ranks receive them at the same point. So every rank's masked logits, and all that follows from
them, are rank 0's bit for bit. Broadcasting the sampled tokens alone (as unconstrained steps
do) would not be enough: a masked draft level's tokens are the input of the next draft forward,
whose all-reduces would sum partials of different inputs if the ranks drafted differently.

The scheduler's decisions that read the service are rank 0's on every rank (scheduler.py), so
a follower needs no matchers and no process: `FollowerGrammars` only stands where the service
would, and its channel receives.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from specserve.engine.grammar.channel import ChannelLayout, DeviceChannel
from specserve.engine.grammar.process import GrammarState


class BroadcastMasks:
    """A DeviceChannel for one rank of a tp group (`tp`: the model group's TensorParallel).
    Rank 0 wraps its own channel and broadcasts each answer; a follower (`local` None) only
    receives, and its signals go nowhere (the grammar process reads rank 0's)."""

    def __init__(self, tp, local: Optional[DeviceChannel], layout: ChannelLayout, device: torch.device):
        self.tp = tp
        self.local = local
        self._masks = None if local is not None else torch.full(
            (layout.rows, layout.width), -1, dtype=torch.int32, device=device)

    def signal(self, *tensors: torch.Tensor) -> None:
        if self.local is not None:
            self.local.signal(*tensors)

    def masks(self, n: int) -> torch.Tensor:
        return self.tp.broadcast(self.local.masks(n) if self.local is not None else self._masks[:n])

    def captured(self):
        return self.local.captured() if self.local is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


class FollowerGrammars:
    """A follower rank's GrammarService: what the scheduler and the workers call, with nothing
    behind it but the receiving channel. Whether a grammar compiled, failed or lost its process
    reaches this rank as rank 0's news (tp.py GrammarNews)."""

    restartable = False
    dead = False  # never read for a decision: the scheduler takes rank 0's (Scheduler.rank0_value)

    def __init__(self, device: BroadcastMasks):
        self.device = device

    def add(self, key, spec, stop_ids) -> GrammarState:
        return GrammarState()

    def plan(self, kind: str, rows: int, keys) -> None:
        pass

    def drop(self, key) -> None:
        pass

    def close(self) -> None:
        self.device.close()
