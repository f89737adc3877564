"""How many SMs a device has, for the kernels that size their grids by it."""
from __future__ import annotations

import functools

import torch


@functools.cache  # asked at every eager launch of the kernels that use it
def num_sms(device: torch.device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H100's count, so CPU tests see the GPU's grids and configs
