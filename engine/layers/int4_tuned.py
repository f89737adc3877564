"""Measured W4A16 decode configs (engine/layers/int4_gemm.py reads them), written by
`python bench/fp8_gemm.py --install-int4 SWEEP.json` from an H100 sweep
(`bench/fp8_gemm.py --sweep --variants w4a16`); shapes not listed take the module's rules.

TUNED_INTERLEAVE: (N, K, group_size) of a weight -> its interleave (words a block) at load.
TUNED_W4_CONFIGS: (M, output columns, K, group_size, paired) -> the fields of a W4Config.
"""
from __future__ import annotations

# NVIDIA H100 80GB HBM3 sweep (bench/int4_sweep.py)
TUNED_INTERLEAVE: dict[tuple[int, int, int], int] = {
    (4096, 4096, 128): 64,
    (4096, 14336, 128): 64,
    (6144, 4096, 128): 64,
    (28672, 4096, 128): 16,
}

TUNED_W4_CONFIGS: dict[tuple[int, int, int, int, bool], dict] = {
    (1, 4096, 4096, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 10.4 us, 29 %
    (1, 4096, 14336, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 27.5 us, 39 %
    (1, 6144, 4096, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 16.6 us, 27 %
    (1, 14336, 4096, 128, True): {'block_n': 64, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 49.7 us, 43 %
    (16, 4096, 4096, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 11.0 us, 28 %
    (16, 4096, 14336, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 27.8 us, 39 %
    (16, 6144, 4096, 128, False): {'block_n': 32, 'split_k': 2, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 15.3 us, 30 %
    (16, 14336, 4096, 128, True): {'block_n': 64, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # 52.5 us, 41 %
    (64, 4096, 4096, 128, False): {'block_n': 128, 'split_k': 4, 'num_warps': 8, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 64},  # 17.9 us, 19 %
    (64, 4096, 14336, 128, False): {'block_n': 64, 'split_k': 2, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': False, 'block_m': 64},  # 63.0 us, 18 %
    (64, 6144, 4096, 128, False): {'block_n': 64, 'split_k': 2, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 27.7 us, 18 %
    (64, 14336, 4096, 128, True): {'block_n': 64, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 64},  # 79.5 us, 27 %
    (256, 4096, 4096, 128, False): {'block_n': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 54.4 us, 8 %
    (256, 4096, 14336, 128, False): {'block_n': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 192.7 us, 7 %
    (256, 6144, 4096, 128, False): {'block_n': 64, 'split_k': 1, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 80.4 us, 8 %
}
