"""The most bytes a block of tensor code holds at once, measured without a GPU: every tensor an op
creates is counted from its creation until its storage is freed (a view or an in-place result
counts once; what existed before the block, inputs included, not at all). Run on the meta
device, a 2048 x 128k measurement allocates nothing."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._tracked:
                continue
            self._tracked.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._tracked.discard(key)
