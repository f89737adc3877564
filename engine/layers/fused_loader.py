"""`fused` is the Triton kernel module on machines with a GPU and triton, else None.

The CPU path (tests, CI) uses the plain torch ops; tests run the kernels themselves under
the Triton interpreter against those ops.
"""
import torch

fused = None
if torch.cuda.is_available():
    try:
        from specserve.engine.layers import fused
    except ImportError:  # no triton: the torch ops run on the GPU too
        fused = None
