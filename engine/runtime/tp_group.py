"""Tensor-parallel ranks: process-group set-up and the control channel.

Every rank runs the same engine, scheduler included, in lock step (SPMD): rank 0 receives
requests and aborts, and at the start of each step broadcasts them to the other ranks over a
gloo group, so every scheduler makes the same decisions and every rank launches the same
forwards. Model collectives use their own group (NCCL on GPUs, gloo on the CPU); on the CPU
they run on the forward thread, which is why control messages need a group of their own.
Tokens are sampled on every rank and then broadcast from rank 0 (see the workers), so the
ranks never disagree about what was generated.
"""
from __future__ import annotations

import socket
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from specserve.engine.layers.parallel import TensorParallel


class Stop(NamedTuple):
    """Rank 0's last control message: it is shutting down, and so are the followers."""


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class TPGroup:
    def __init__(self, size: int, rank: int, init_method: str, device: torch.device,
                 local_ranks: bool = True):
        backend = "nccl" if device.type == "cuda" else "gloo"
        if local_ranks and device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tp_size: {size} ranks but only {torch.cuda.device_count()} GPUs")
        dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank)
        self.model = TensorParallel(size, rank, dist.new_group(list(range(size)), backend=backend))
        self.control = dist.new_group(list(range(size)), backend="gloo")
        self.rank = rank

    def exchange(self, ops: list[Any]) -> list[Any]:
        """Rank 0's control messages for this step, on every rank."""
        box = [ops if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        dist.destroy_process_group()
