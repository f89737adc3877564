"""The W4A16 sweep's search and installer (bench/int4_sweep.py) with a made-up timer, and the
kernel module's use of the installed tables (engine/layers/int4_gemm.py)."""
from __future__ import annotations

import pathlib
import runpy
import sys

import pytest
import torch

from specserve.engine.layers import int4_gemm
from specserve.engine.layers.int4_gemm import W4Config, pack_rows, unpack_rows, Int4Weight

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import int4_sweep  # noqa: E402

QKV = (6144, 4096)
CPU = torch.device("cpu")  # the rule counts an H100's SMs there


def fake_seconds(c: W4Config, words: int) -> float:
    """A made-up device: interleave 32, the weight-left dot, 128-column tiles, split-K 2 and
    6 stages are best; every other choice costs a little."""
    return (1.0 + 0.1 * (words != 32) + 0.1 * (not (c.dot and c.w_left))
            + 0.01 * (c.block_n != 128) + 0.01 * (c.num_stages != 6) + 0.001 * (c.split_k != 2))


def test_search_finds_the_best_layout_and_config_and_times_only_launchable_ones():
    n, k = QKV
    seen = []

    def time_config(c, words):
        seen.append((c, words))
        return fake_seconds(c, words)

    timed = int4_sweep.search(1, n, k, 128, False, int4_sweep.INTERLEAVES, time_config, CPU)
    best, words = min(timed, key=timed.get)
    assert (words, best) == (32, W4Config(block_n=128, split_k=2, num_warps=4, num_stages=6, w_left=True))
    assert len(seen) == len(set(seen)) == len(timed) <= 34  # each config once; a short search
    assert {w for _, w in seen} == set(int4_sweep.INTERLEAVES)
    assert any(not c.dot and c.round_bits for c, _ in seen)  # multiply-and-sum at M = 1
    assert all(int4_sweep.launchable(c, 1, n, k, 128, False, w, CPU) for c, w in seen)


def test_search_of_paired_dequantisation_times_paired_tl_dot_configs_alone():
    """`paired_dequant`: every config timed is on tl.dot and paired (no multiply-and-sum, even
    at M = 1), each launchable; the made-up device's best is found, paired, and named so."""
    n, k = QKV
    timed = int4_sweep.search(1, n, k, 128, False, int4_sweep.INTERLEAVES, fake_seconds, CPU,
                              paired_dequant=True)
    assert timed and all(c.dot and c.paired_dequant for c, _ in timed)
    assert all(int4_sweep.launchable(c, 1, n, k, 128, False, w, CPU) for c, w in timed)
    best, words = min(timed, key=timed.get)
    assert (words, best) == (32, W4Config(block_n=128, split_k=2, num_warps=4, num_stages=6,
                                          w_left=True, paired_dequant=True))
    assert int4_sweep.config_name(best, words) == "W32 dot-wleft-paired n128 s2 w4 st6"


def test_search_tries_fewer_stages_with_more_warps_and_splits():
    """Stage 3 (occupancy): a made-up device where 2 stages, 8 warps and 4x the split-K found
    by the first two stages win is found; the 12 combinations are each timed once."""
    n, k = QKV

    def occupancy_seconds(c: W4Config, words: int) -> float:
        won = (c.num_stages, c.num_warps, c.split_k) == (2, 8, 8)
        return fake_seconds(c, words) - 0.5 * won

    seen = []

    def time_config(c, words):
        seen.append((c, words))
        return occupancy_seconds(c, words)

    timed = int4_sweep.search(1, n, k, 128, False, (32,), time_config, CPU, paired_dequant=True)
    best, _ = min(timed, key=timed.get)
    assert (best.num_stages, best.num_warps, best.split_k, best.block_n) == (2, 8, 8, 128)
    assert len(seen) == len(set(seen))
    assert {(c.num_stages, c.num_warps) for c, _ in seen} >= {(2, 4), (2, 8), (3, 4), (3, 8)}


def test_search_above_two_rows_keeps_to_tl_dot_and_the_given_layout():
    n, k = QKV
    timed = int4_sweep.search(16, n, k, 128, False, (64,), fake_seconds, CPU)
    assert timed and all(c.dot and w == 64 for c, w in timed)


def test_search_at_mid_m_tries_row_tiles_and_split_k_on_tl_dot():
    """At 64 and 256 rows: tl.dot only, row tiles of 16 up to M (none wider) each named in its
    config, K split by the rule and halved/doubled, each config launchable (its partials
    within the workspace) and timed once; a made-up device whose best is a row tile of all M
    split 2 ways is found."""
    n, k = QKV

    def mid_seconds(c: W4Config, words: int) -> float:
        return fake_seconds(c, words) + 0.05 * (c.block_m != 256) + 0.02 * (c.split_k != 2)

    for m in (64, 256):
        seen = []

        def time_config(c, words):
            seen.append((c, words))
            return mid_seconds(c, words)

        timed = int4_sweep.search(m, n, k, 128, False, (16,), time_config, CPU)
        assert len(seen) == len(set(seen)) == len(timed) <= 42
        assert all(c.dot and c.block_m and int4_sweep.launchable(c, m, n, k, 128, False, 16, CPU)
                   for c, _ in seen)  # each on the row tile it names (the engine's then)
        tiles = {c.block_m for c, _ in seen} - {0}
        assert tiles == {t for t in (16, 32, 64, 128, 256) if t <= m}
        assert len({c.split_k for c, _ in seen}) >= 2
        if m == 256:
            best = min(timed, key=timed.get)[0]
            assert (best.block_m, best.split_k) == (256, 2)


def test_launchable_at_mid_m():
    n, k = QKV
    c = W4Config(block_n=64, split_k=2, num_warps=4, num_stages=3)
    assert int4_sweep.launchable(c, 64, n, k, 128, False, 16, CPU)
    assert not int4_sweep.launchable(c._replace(dot=False), 64, n, k, 128, False, 16, CPU)
    assert not int4_sweep.launchable(c._replace(block_m=128), 64, n, k, 128, False, 16, CPU)  # > M
    assert not int4_sweep.launchable(c._replace(block_m=32), 16, n, k, 128, False, 16, CPU)  # decode M
    assert not int4_sweep.launchable(c._replace(split_k=8), 256, n, k, 128, False, 16, CPU)  # partials
    assert int4_sweep.config_name(c._replace(block_m=32), 16) == "W16 dot n64 m32 s2 w4 st3"


def test_search_skips_layouts_whose_planes_cross_groups():
    timed = int4_sweep.search(1, 4096, 4096, 32, False, (16, 64), fake_seconds, CPU)
    assert timed and {w for _, w in timed} == {16}


def test_launchable_bounds_the_multiply_and_sum_accumulators():
    c = W4Config(block_n=128, split_k=1, num_warps=4, num_stages=3, dot=False)
    assert int4_sweep.launchable(c, 1, 4096, 4096, 128, False, 32, CPU)
    assert not int4_sweep.launchable(c, 16, 4096, 4096, 128, False, 32, CPU)
    assert not int4_sweep.launchable(c._replace(split_k=32), 1, 4096, 4096, 128, False, 32, CPU)


GATE_UP = (14336, 4096)  # output columns of each half, K


@pytest.mark.parametrize("w_left", [False, True])
def test_wide_layouts_are_timed_only_at_stages_that_fit_the_shared_memory(w_left):
    """The H100 sweep's refusals (OutOfResources): gate/up at W = 128 on 64-column tiles at 4
    stages needs 288 KB (x on the left) or 320 KB (the weight on the left) of the 227 KB. Not
    launchable as it stands; stage 1 times it at the most stages that fit; every config the
    search times fits."""
    n_cols, k = GATE_UP
    c = W4Config(block_n=64, split_k=1, num_warps=4, num_stages=4, w_left=w_left)
    assert not int4_sweep.launchable(c, 1, n_cols, k, 128, True, 128, CPU)
    assert int4_sweep.launchable(c, 1, n_cols, k, 128, True, 64, CPU)  # W = 64 fits at 4 stages
    lowered = int4_sweep._with_tile(c, 1, n_cols, k, 128, True, 64, 128, CPU)
    assert 2 <= lowered.num_stages < 4 and int4_sweep.launchable(lowered, 1, n_cols, k, 128, True, 128, CPU)
    seen = []

    def time_config(config, words):
        seen.append((config, words))
        return fake_seconds(config, words)

    timed = int4_sweep.search(1, n_cols, k, 128, True, (128,), time_config, CPU)
    assert timed and len(seen) == len(timed)
    assert all(int4_sweep.launchable(config, 1, n_cols, k, 128, True, 128, CPU) for config, _ in seen)
    assert any(config.num_stages < 4 for config, _ in seen)  # lowered, not left out


def test_relayout_keeps_the_codes():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 512), generator=gen, dtype=torch.uint8)
    w = Int4Weight(pack_rows(codes, 16), torch.ones(4, 4).half(), torch.zeros(4, 4, dtype=torch.uint8),
                   128, 16)
    moved = int4_sweep.relayout(w, 64)
    assert moved.interleave == 64 and torch.equal(unpack_rows(moved.qweight, 64), codes)


def _empty_tuned_module(tmp_path) -> pathlib.Path:
    """A copy of engine/layers/int4_tuned.py with empty tables."""
    text = int4_sweep.TUNED_MODULE.read_text()
    marker = "from __future__ import annotations\n\n"
    module = tmp_path / "int4_tuned.py"
    module.write_text(text[:text.index(marker) + len(marker)]
                      + "TUNED_INTERLEAVE: dict = {}\n\nTUNED_W4_CONFIGS: dict = {}\n")
    return module


def test_install_merges_a_mid_m_sweep_over_the_decode_configs(tmp_path):
    """A sweep of 64 and 256 rows installed over a decode sweep: the decode configs stay
    (same layout, keys not measured again, their lines as they were), the mid-M ones join; a
    later sweep that moves a weight's layout drops that weight's old configs only."""
    decode = {(1, 6144, 4096, 128, False, 6144): dict(config=W4Config(128, 4, 4, 4, w_left=True)._asdict(),
                                                      interleave=64, us=10.0, fraction_of_copy=0.5),
              (1, 4096, 4096, 128, False, 4096): dict(config=W4Config(64, 4, 4, 4)._asdict(),
                                                      interleave=64, us=8.0, fraction_of_copy=0.5)}
    mid = {(64, 6144, 4096, 128, False, 6144): dict(config=W4Config(64, 2, 4, 2, block_m=64)._asdict(),
                                                    interleave=64, us=20.0, fraction_of_copy=0.3)}
    moved = {(1, 4096, 4096, 128, False, 4096): dict(config=W4Config(32, 2, 4, 4)._asdict(),
                                                     interleave=16, us=7.0, fraction_of_copy=0.6)}
    module = _empty_tuned_module(tmp_path)
    for i, best in enumerate((decode, mid, moved)):
        int4_sweep.write_json(str(tmp_path / f"{i}.json"), "NVIDIA H100", best)
        int4_sweep.install(str(tmp_path / f"{i}.json"), module)
        if i == 1:
            assert "10.0 us, 50 %" in module.read_text()  # the decode line kept as written
    tables = runpy.run_path(str(module))
    assert tables["TUNED_INTERLEAVE"] == {(6144, 4096, 128): 64, (4096, 4096, 128): 16}
    configs = {key: W4Config(**fields) for key, fields in tables["TUNED_W4_CONFIGS"].items()}
    assert configs == {(1, 6144, 4096, 128, False): W4Config(128, 4, 4, 4, w_left=True),
                       (64, 6144, 4096, 128, False): W4Config(64, 2, 4, 2, block_m=64),
                       (1, 4096, 4096, 128, False): W4Config(32, 2, 4, 4)}


def test_json_install_round_trip(tmp_path):
    """The JSON the sweep writes, installed into a copy of int4_tuned.py: the layout per weight
    and the configs measured at it (one measured at another layout is left out)."""
    best = {
        (1, 6144, 4096, 128, False, 6144): dict(config=W4Config(128, 1, 4, 6, True, False, True)._asdict(),
                                                interleave=32, us=6.1, fraction_of_copy=0.87),
        (16, 6144, 4096, 128, False, 6144): dict(config=W4Config(64, 2, 8, 4)._asdict(),
                                                 interleave=32, us=7.0, fraction_of_copy=0.8),
        (1, 14336, 4096, 128, True, 28672): dict(config=W4Config(32, 1, 4, 3, False, True)._asdict(),
                                                 interleave=64, us=20.0, fraction_of_copy=0.85),
        (16, 14336, 4096, 128, True, 28672): dict(config=W4Config(64, 1, 4, 3)._asdict(),
                                                  interleave=16, us=25.0, fraction_of_copy=0.7),
    }
    path = tmp_path / "tuned.json"
    int4_sweep.write_json(str(path), "NVIDIA H100", best)
    module = _empty_tuned_module(tmp_path)
    int4_sweep.install(str(path), module)
    int4_sweep.install(str(path), module)  # again: the same file, not a second header
    assert module.read_text().count("TUNED_INTERLEAVE: dict") == 1
    tables = runpy.run_path(str(module))
    assert tables["TUNED_INTERLEAVE"] == {(6144, 4096, 128): 32, (28672, 4096, 128): 64}
    configs = tables["TUNED_W4_CONFIGS"]
    assert set(configs) == {(1, 6144, 4096, 128, False), (16, 6144, 4096, 128, False),
                            (1, 14336, 4096, 128, True)}
    assert W4Config(**configs[1, 6144, 4096, 128, False]) == W4Config(128, 1, 4, 6, True, False, True)


def test_the_kernel_module_takes_the_tuned_tables(monkeypatch):
    cpu = CPU
    monkeypatch.setattr(int4_gemm, "PAIRED_DEQUANT", False)  # the tables as they stand
    tuned = W4Config(128, 1, 8, 6, dot=True, w_left=True)
    monkeypatch.setitem(int4_gemm.TUNED_W4_CONFIGS, (1, 6144, 4096, 128, False), tuned._asdict())
    int4_gemm.default_w4_config.cache_clear()
    at_16 = W4Config(64, 2, 8, 4)
    monkeypatch.setitem(int4_gemm.TUNED_W4_CONFIGS, (16, 6144, 4096, 128, False), at_16._asdict())
    try:
        assert int4_gemm.default_w4_config(1, 6144, 4096, 128, False, cpu) == tuned
        # between measured M: the nearest measured M above (its config serves fewer rows)
        assert int4_gemm.default_w4_config(2, 6144, 4096, 128, False, cpu) == at_16
        assert int4_gemm.default_w4_config(16, 6144, 4096, 128, False, cpu) == at_16
        assert int4_gemm.default_w4_config(17, 6144, 4096, 128, False, cpu) != at_16  # row tiles
        assert int4_gemm.default_w4_config(2, 6144, 4096, 128, True, cpu) != at_16  # another shape
    finally:
        int4_gemm.default_w4_config.cache_clear()
    monkeypatch.setitem(int4_gemm.TUNED_INTERLEAVE, (6144, 4096, 128), 128)
    monkeypatch.setitem(int4_gemm.TUNED_INTERLEAVE, (4096, 4096, 32), 128)  # crosses groups: not taken
    assert int4_gemm.interleave_for(6144, 4096, 128) == 128
    assert int4_gemm.interleave_for(4096, 4096, 32) == 32


@pytest.mark.parametrize("bad", [{"block_n": 64, "oops": 1}])
def test_install_refuses_unknown_config_fields(tmp_path, bad):
    path = tmp_path / "bad.json"
    path.write_text('{"device": "x", "interleave": [[6144, 4096, 128, 32]], "configs": '
                    '[{"key": [1, 6144, 4096, 128, false], "config": %s, "interleave": 32, '
                    '"us": 1.0, "fraction_of_copy": 1.0}]}' % str(bad).replace("'", '"'))
    module = tmp_path / "int4_tuned.py"
    module.write_text(int4_sweep.TUNED_MODULE.read_text())
    with pytest.raises(TypeError):
        int4_sweep.install(str(path), module)


_CHECK_WITH_TABLES = """
import sys
import int4_sm90_launches as check
from specserve.engine.layers import int4_gemm
from specserve.engine.layers.int4_shared_memory import H100_SHARED_MEMORY
# The sweep's table alone (the module's own may hold 64-row configs of these shapes).
int4_gemm.TUNED_W4_CONFIGS.clear()
before = dict(int4_gemm.TUNED_W4_CONFIGS), dict(int4_gemm.TUNED_INTERLEAVE)
with check.tuned_tables_installed(sys.argv[1]):
    assert int4_gemm.interleave_for(6144, 4096, 128) == 64
    recorded = check.engine_launches(rows=(16, 64), groups=(128,))
assert (dict(int4_gemm.TUNED_W4_CONFIGS), dict(int4_gemm.TUNED_INTERLEAVE)) == before
decode = [launch for launch in recorded if launch.kernel.fn.__name__ == "_w4a16_kernel"]
# the tuned config at M = 16
assert any(launch.num_warps == 8 and launch.args["BLOCK_N"] == 16 and launch.args["WORDS"] == 64
           and launch.args["SPLIT_K"] == 4 for launch in decode)
# qkv at 64 rows and W = 64: 2 stages
assert any(launch.args["WORDS"] == 64 and launch.args["BLOCK_M"] == 64 and launch.args["HAS_BIAS"]
           and launch.num_stages == 2 for launch in decode)
assert all(check.modelled_shared_memory(launch) <= H100_SHARED_MEMORY for launch in decode)
print("checked", len(decode))
"""


def test_the_launch_check_takes_a_sweeps_tables(tmp_path):
    """tests/int4_sm90_launches.py --tuned: the engine's launches with a sweep's tables (the
    H100's put qkv at W = 64, where the rule's 64-row launch overran the shared memory): the
    tuned config at its M, the mid-M launch fitted, every launch within the limit by the
    model, the module's tables restored after (in a child process: the recorder reads the
    compiled kernels' parameters, which the interpreter's lack)."""
    import subprocess

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from sm90_compile import compile_env

    best = {(16, 6144, 4096, 128, False, 6144): dict(config=W4Config(16, 4, 8, 4)._asdict(),
                                                     interleave=64, us=7.0, fraction_of_copy=0.8)}
    path = tmp_path / "tuned.json"
    int4_sweep.write_json(str(path), "NVIDIA H100", best)
    done = subprocess.run([sys.executable, "-c", _CHECK_WITH_TABLES, str(path)], env=compile_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("checked ")
