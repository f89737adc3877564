"""KV cache pools: reserved row and slot, allocator bookkeeping, all-layer moves."""
from __future__ import annotations

import pytest
import torch

from specserve.engine.kvcache.pools import ReqToTokenPool, TokenSlotAllocator, TokenToKVPool


def test_req_to_token_pool_reserves_row_zero():
    pool = ReqToTokenPool(3, 8, torch.device("cpu"))
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3] and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.alloc()
    pool.free(rows[1])
    assert pool.alloc() == rows[1]


def test_allocator_hands_out_each_slot_once_and_never_slot_zero():
    alloc = TokenSlotAllocator(10, torch.device("cpu"))
    a, b = alloc.alloc(4), alloc.alloc(6)
    assert alloc.num_free == 0 and 0 not in torch.cat([a, b]).tolist()
    assert sorted(torch.cat([a, b]).tolist()) == list(range(1, 11))
    with pytest.raises(RuntimeError, match="1 slots wanted, 0 free"):
        alloc.alloc(1)
    alloc.free(a[1:3])
    alloc.free(b[:1])
    assert alloc.num_free == 3
    again = alloc.alloc(3)  # merges the pending frees
    assert sorted(again.tolist()) == sorted(a[1:3].tolist() + b[:1].tolist())


def test_move_kv_cache_moves_every_layer_and_tolerates_overlap():
    pool = TokenToKVPool(8, 3, 2, 4, torch.float32, torch.device("cpu"))
    for layer in range(3):
        pool.k_buffer[layer].copy_(torch.arange(9.0).view(9, 1, 1).expand(9, 2, 4) + 100 * layer)
        pool.v_buffer[layer].copy_(-pool.k_buffer[layer])
    # Path compaction: slots 5, 7 move to 3, 4 while 3's old value moves to 5 (a cycle).
    tgt, src = torch.tensor([3, 4, 5]), torch.tensor([5, 7, 3])
    pool.move_kv_cache(tgt, src)
    for layer in range(3):
        assert pool.k_buffer[layer][:, 0, 0].tolist()[3:6] == [5.0 + 100 * layer, 7.0 + 100 * layer,
                                                                3.0 + 100 * layer]
        assert torch.equal(pool.v_buffer[layer], -pool.k_buffer[layer])
