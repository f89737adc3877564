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

from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from specserve.engine.layers.all_reduce import make_all_reduce
from specserve.engine.layers.parallel import TensorParallel


class Stop(NamedTuple):
    """Rank 0's last control message: it is shutting down, and so are the followers."""


class RankState(NamedTuple):
    """What one rank's scheduler holds. Every rank's must equal rank 0's: they make the same
    decisions (gathered at shutdown, where a difference means the ranks diverged)."""
    num_requests: int
    free_rows: int
    held_slots: int   # KV slots requests hold (cached prefixes nobody pins left out)


RENDEZVOUS_TIMEOUT = timedelta(minutes=5)  # a rank's wait for the others to join


class Rendezvous:
    """Where a tensor-parallel group's ranks meet: a TCPStore server on a port the OS picks,
    held by the process that starts the ranks for as long as they run. Every rank, 0 included,
    joins as a client (`TPGroup`). Picking a free port, releasing it and letting rank 0 bind it
    later left a window in which another process could take the port (seen in CI); here the
    port is never released."""

    def __init__(self, host: str = "127.0.0.1"):
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=RENDEZVOUS_TIMEOUT)
        self.init_method = f"tcp://{host}:{self._store.port}"


class TPGroup:
    def __init__(self, size: int, rank: int, init_method: str, device: torch.device,
                 local_ranks: bool = True, custom_all_reduce: bool = False):
        backend = "nccl" if device.type == "cuda" else "gloo"
        if local_ranks and device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tp_size: {size} ranks but only {torch.cuda.device_count()} GPUs")
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group(backend, store=store, world_size=size, rank=rank)
        group = dist.new_group(list(range(size)), backend=backend)
        self.model = TensorParallel(size, rank, group,
                                    make_all_reduce(group, size, device, custom_all_reduce))
        self.control = dist.new_group(list(range(size)), backend="gloo")
        self.rank = rank

    def exchange(self, value: Any) -> Any:
        """Rank 0's value on every rank (the others pass anything): its control messages at the
        start of each step, and what the scheduler takes from rank 0 alone (scheduler.py)."""
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, value: Any) -> Optional[list]:
        """Every rank's value, in rank order, on rank 0 (None on the others)."""
        out = [None] * dist.get_world_size(self.control) if self.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self.control)
        return out

    def close(self) -> None:
        dist.destroy_process_group()
