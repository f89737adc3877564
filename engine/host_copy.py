"""Host values copied to the device without holding the host: from pinned memory on CUDA.

From pageable memory the driver stages every copy through a pinned buffer of its own on the
host's time, and a copy queued behind a stream wait can hold the host until the wait passes:
on an H100 a mixed step's 17 pageable copies kept the GPU idle ~11 ms of a 24.7 ms step
(docs/benchmarks.md, thirteenth round). The pinned source comes from PyTorch's caching host
allocator, which keeps a block until the copies reading it are done.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: Union[str, torch.device]) -> torch.Tensor:
    """`values` as a tensor of `dtype` on `device`, copied asynchronously (pinned on CUDA)."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
