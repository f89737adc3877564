"""Quantized checkpoints: which formats the engine serves (config), and the FP8 weight
representation every kernel and the reference agree on (fp8)."""
