"""Triton attention: kernels (kernels.py) and the AttentionBackend built on them (backend.py)."""
