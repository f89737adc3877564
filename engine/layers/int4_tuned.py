"""Measured W4A16 decode configs (engine/layers/int4_gemm.py reads them), written by
`python bench/fp8_gemm.py --install-int4 SWEEP.json` from an H100 sweep
(`bench/fp8_gemm.py --sweep --variants w4a16`); shapes not listed take the module's rules.

TUNED_INTERLEAVE: (N, K, group_size) of a weight -> its interleave (words a block) at load.
TUNED_W4_CONFIGS: (M, output columns, K, group_size, paired) -> the fields of a W4Config.
"""
from __future__ import annotations

TUNED_INTERLEAVE: dict[tuple[int, int, int], int] = {}

TUNED_W4_CONFIGS: dict[tuple[int, int, int, int, bool], dict] = {}
