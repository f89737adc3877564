"""The custom all-reduce's torch symmetric memory (torch.distributed._symmetric_memory), safe for
a later tensor-parallel engine in the same process.

Rank 0 of a tp engine runs in the process that starts it, the other ranks in processes spawned
for that engine alone. Two things torch keeps per process (2.11, the GPU machines' torch) would
make a second engine there hang in its first rendezvous:

* The keys of a rendezvous's store exchange carry a counter of the process's exchanges: the
  CUDA backend keeps one `StoreExchange("CUDASymmetricMemory")` per process (symm_mem/
  CUDASymmetricMemory.cu), whose `all_gather` names its keys `<prefix>/<seq_id_>/<rank>` and
  then increments `seq_id_` (symm_mem/CUDASymmetricMemoryUtils.hpp); every rendezvous of a new
  buffer runs two (the requests, then a barrier: `make_peer_alloc_info`). After one engine,
  rank 0's counter is ahead of its new followers' (zero): each side waits for keys the other
  never writes (pytorch#196082; later torch keys the counter on the group's store, #196350).
  `rendezvous` below first brings every rank's process to the same number of rendezvous: a rank
  that is behind rendezvouses alone, on a group of itself, as often as it lags.
* A buffer's rendezvous is cached on its allocation under the group's *name*
  (`block->symm_mems`), c10d names groups "0", "1", ... again after `destroy_process_group`,
  and `symm_mem.empty` takes buffers from a per-device pool that keeps freed allocations: a
  later engine's buffer could come back with the earlier engine's peers still mapped, and skip
  the exchange. `empty` below allocates outside that pool, so an allocation, and its cached
  rendezvous, go when its tensor does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Buffers this process has rendezvoused through `rendezvous` (every symmetric-memory rendezvous
# of ours goes through it): torch's exchange counter advances by the same amount for each, alone
# or in a group (the same exchanges, each over the group's ranks), so equal counts name the same
# keys.
_rendezvous_count = 0


def empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A symmetric buffer of nbytes (uint8) outside torch's implicit pool (see above)."""
    from torch._C._distributed_c10d import _SymmetricMemory

    return _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)


def rendezvous(buffer: torch.Tensor, group: dist.ProcessGroup):
    """torch's rendezvous of a new buffer from `empty` over the group (collective: every rank
    calls it), after every rank's process has caught up with the one that made the most."""
    global _rendezvous_count
    _catch_up(group, buffer.device)
    handle = _torch_rendezvous(buffer, group)
    _rendezvous_count += 1
    return handle


def _catch_up(group: dist.ProcessGroup, device: torch.device) -> None:
    global _rendezvous_count
    counts = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, _rendezvous_count, group=group)
    if len(set(counts)) == 1:  # fresh processes, or ones that made the same rendezvous
        return
    # new_group is collective over the world (a tp engine's world is its group): every rank
    # makes every rank's group of one, then uses its own.
    alone = [dist.new_group([r], backend="gloo") for r in dist.get_process_group_ranks(group)]
    own = alone[dist.get_rank(group)]
    while _rendezvous_count < max(counts):
        _torch_rendezvous(empty(1, device), own)  # freed at once: the next is a new allocation
        _rendezvous_count += 1


def _torch_rendezvous(buffer: torch.Tensor, group: dist.ProcessGroup):
    from torch.distributed import _symmetric_memory as symm_mem

    return symm_mem.rendezvous(buffer, group)
