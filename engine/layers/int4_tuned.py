"""Measured W4A16 decode configs (engine/layers/int4_gemm.py reads them), written by
`python bench/fp8_gemm.py --install-int4 SWEEP.json` from an H100 sweep
(`bench/fp8_gemm.py --sweep --variants w4a16`); shapes not listed take the module's rules.

TUNED_INTERLEAVE: (N, K, group_size) of a weight -> its interleave (words a block) at load.
TUNED_W4_CONFIGS: (M, output columns, K, group_size, paired) -> the fields of a W4Config.
"""
from __future__ import annotations

# NVIDIA H100 80GB HBM3 sweep (bench/int4_sweep.py); the decode-sized rows (M 1 and 16) then
# re-timed with paired dequantisation (int4_gemm.PAIRED_DEQUANT, on: bench/fp8_gemm.py --variants
# w4a16, the w4a16_paired rows on AWQ's fp16 scales; 2026-11-28), where the split-K moved for
# qkv at M 1 (4 -> 2) and gate/up (1 -> 2), the times in the comments are the paired kernel's.
TUNED_INTERLEAVE: dict[tuple[int, int, int], int] = {
    (4096, 4096, 128): 64,
    (4096, 14336, 128): 64,
    (6144, 4096, 128): 64,
    (28672, 4096, 128): 16,
}

TUNED_W4_CONFIGS: dict[tuple[int, int, int, int, bool], dict] = {
    (1, 4096, 4096, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired 9.5 us, 31 %
    (1, 4096, 14336, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired 24.1 us, 43 %
    (1, 6144, 4096, 128, False): {'block_n': 64, 'split_k': 2, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired 14.4 us, 31 %
    (1, 14336, 4096, 128, True): {'block_n': 64, 'split_k': 2, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired, SiLU-and-mul 45.4 us, 46 %
    (16, 4096, 4096, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired 10.0 us, 30 %
    (16, 4096, 14336, 128, False): {'block_n': 64, 'split_k': 4, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired 25.6 us, 41 %
    (16, 6144, 4096, 128, False): {'block_n': 32, 'split_k': 2, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired 13.7 us, 33 %
    (16, 14336, 4096, 128, True): {'block_n': 64, 'split_k': 2, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': False},  # paired, SiLU-and-mul 48.0 us, 44 %
    (64, 4096, 4096, 128, False): {'block_n': 128, 'split_k': 4, 'num_warps': 8, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 64},  # 17.9 us, 19 %
    (64, 4096, 14336, 128, False): {'block_n': 64, 'split_k': 2, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': False, 'block_m': 64},  # 63.0 us, 18 %
    (64, 6144, 4096, 128, False): {'block_n': 64, 'split_k': 2, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 27.7 us, 18 %
    (64, 14336, 4096, 128, True): {'block_n': 64, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 64},  # 79.5 us, 27 %
    (256, 4096, 4096, 128, False): {'block_n': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 54.4 us, 8 %
    (256, 4096, 14336, 128, False): {'block_n': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 192.7 us, 7 %
    (256, 6144, 4096, 128, False): {'block_n': 64, 'split_k': 1, 'num_warps': 4, 'num_stages': 2, 'dot': True, 'round_bits': False, 'w_left': True, 'block_m': 32},  # 80.4 us, 8 %
}
