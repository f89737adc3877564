"""The W4A16 decode kernel's sweep (run by `bench/fp8_gemm.py --sweep`) and the installer of
its results as engine/layers/int4_tuned.py.

Per weight shape, the layout is one choice for every M (the codes are interleaved at load):
the smallest M swept picks it. A search per (shape, M) in two stages, about 19 configs at
M = 1, 9 up to 16 rows and 14 above (Triton compiles each new one once, a second or two; the
four 8B shapes at M = 1 and 16 should take about 4 minutes on an H100, at 1, 16, 64 and 256
about 10):

1. every interleave W (16, 32, 64, 128 words: K steps of 128 to 1024 codes) times every
   product variant (tl.dot, tl.dot with the weight on the left, multiply-and-sum with the
   bf16 rounding by a conversion or by integer ops; multiply-and-sum only at M <= 2, where
   its accumulators fit, and W <= 32: compiled, it takes 9-11 instructions a weight element
   against tl.dot's 5.4-6.3), each at the rule's tiles (128 columns, 64 with the
   gate/up pair, for the weight on the left; 64 for x on the left; 32 for multiply-and-sum)
   and split, at 4 stages or the most that fit the shared memory (at W = 128 4 stages do
   not); above the smallest M only the chosen W;
2. from the best, one axis at a time (keeping the best so far): column tiles of 16 to 128
   (with the rule's split for them), above MAX_ROWS row tiles of 16 to 256 rows up to M
   rounded up (with the rule's split for them: a row tile of all M dequantises each weight
   element once, fewer row tiles want more splits), split-K halved and doubled (at every
   M: the mid-M kernel splits K as the decode one does), 8 warps, 6 stages;
3. occupancy: from the best, 2 and 3 stages (at 4 stages a decode program's tiles fill most
   of an SM's shared memory, so one program of 4 warps runs an SM: one warp a scheduler to
   hide the dequantisation's latencies), at 4 and 8 warps, split-K 1, 2 and 4 times the
   best's (12 configs).

A config is timed only where it fits the shared memory as it stands (`launchable`): the
engine launches a tuned config as measured.

    python bench/fp8_gemm.py --sweep --variants w4a16 --shapes 8b.qkv,8b.o,8b.gate_up,8b.down \\
        --rows 1,16,64,256 --no-moe --int4-tuned int4_tuned.json
    python bench/fp8_gemm.py --install-int4 int4_tuned.json   # writes engine/layers/int4_tuned.py

`--sweep-paired-dequant` searches the paired dequantisation's configs instead (tl.dot alone;
the installed entries carry `paired_dequant`).

The fused gate/up weight is swept as the engine runs it: with the SiLU-and-mul epilogue
(paired columns), so its table key is (M, I, K, group, True).
"""
from __future__ import annotations

import itertools
import json
import pathlib
import runpy
from typing import Callable, Optional

import torch

from specserve.engine.layers.int4_gemm import (
    MAX_ROWS, PACK, ROW_TILES, Int4Weight, W4Config, fit_shared_memory, pack_rows, plane_groups,
    split_for, unpack_rows)
from specserve.engine.layers.int4_shared_memory import Operands
from specserve.engine.layers.skinny_gemm import PARTIAL_CAPACITY, _scratch_values

INTERLEAVES = (16, 32, 64, 128)
OCCUPANCY_STAGES = (2, 3)  # stage 3 of the search (module docstring)
FMA_MAX_ROWS = 2  # multiply-and-sum candidates up to this M
FMA_MAX_INTERLEAVE = 32  # and this interleave (see the module docstring)
MAX_FMA_ACCUMULATORS = 128  # fp32 accumulators a thread of the multiply-and-sum path may hold
TUNED_MODULE = pathlib.Path(__file__).resolve().parents[1] / "engine" / "layers" / "int4_tuned.py"


def relayout(w: Int4Weight, interleave: int) -> Int4Weight:
    """The same weight with its codes interleaved in blocks of 8 * interleave."""
    codes = unpack_rows(w.qweight, w.interleave)
    return w._replace(qweight=pack_rows(codes, interleave), interleave=interleave)


def sweep_operands(k: int, group: int, paired: bool, interleave: int) -> Operands:
    """The operands as the sweep times them (bf16 activations, fp16 scales: AWQ's)."""
    return Operands(interleave, PACK // plane_groups(group, k, interleave), 2, 2, paired)


def launchable(c: W4Config, m: int, n_cols: int, k: int, group: int, paired: bool,
               interleave: int, device: torch.device = torch.device("cuda")) -> bool:
    """Configs worth timing: every split gets whole blocks and its partials fit the workspace,
    the multiply-and-sum path's accumulators ([M, block_n, W], twice with the gate/up pair)
    fit in registers (above MAX_ROWS: tl.dot only), a row tile is named only above MAX_ROWS
    and no larger than M rounded up to a power of two, and the launch fits the device's
    shared memory as it stands (`fit_shared_memory`: the engine launches a tuned config with
    its stages, so a config that does not fit is never timed)."""
    m_pad = 1 << (m - 1).bit_length()
    halves = 2 if paired else 1
    fma_fits = (m <= MAX_ROWS and m_pad * c.block_n * interleave * halves
                <= MAX_FMA_ACCUMULATORS * 32 * c.num_warps)
    return (k // c.split_k >= 8 * interleave and c.block_n <= max(16, n_cols)
            and _scratch_values(c.split_k, m, n_cols, paired) <= PARTIAL_CAPACITY
            and (c.block_m == 0 or (m > MAX_ROWS and c.block_m in ROW_TILES and c.block_m <= m_pad))
            and (c.dot or fma_fits)
            and fit_shared_memory(c, m, sweep_operands(k, group, paired, interleave), device,
                                  lower_stages=False) is not None)


def _variants(m: int, words: int, paired: bool, paired_dequant: bool = False) -> list[dict]:
    """The product variants of stage 1, each at the column tile the rule gives it (with
    `paired_dequant` tl.dot's alone, dequantising two weights an instruction)."""
    dots = [dict(block_n=64 if paired else 128, dot=True, w_left=True), dict(block_n=64, dot=True)]
    if paired_dequant:
        return [dict(variant, paired_dequant=True) for variant in dots]
    if m > FMA_MAX_ROWS or words > FMA_MAX_INTERLEAVE:
        return dots
    return dots + [dict(block_n=32, dot=False), dict(block_n=32, dot=False, round_bits=True)]


def _with_tile(c: W4Config, m: int, n_cols: int, k: int, group: int, paired: bool,
               block_n: int, words: int, device: torch.device) -> W4Config:
    """c at column tile `block_n` with the rule's split for it (and c's row tile), and its
    stages lowered where the tile does not fit the shared memory at interleave `words` (wide
    interleaves at 4 stages do not: they are timed at the most that fit). Above MAX_ROWS the
    row tile the fit takes is named in the config, so the engine runs a tuned config on the
    row tile it was timed on (its own fit of an unnamed one may keep a larger tile at fewer
    stages)."""
    c = c._replace(block_n=block_n,
                   split_k=split_for(m, n_cols, k, paired, block_n, device, c.block_m))
    fit = fit_shared_memory(c, m, sweep_operands(k, group, paired, words), device)
    if fit is None:
        return c
    return fit[0]._replace(block_m=fit[1]) if m > MAX_ROWS else fit[0]


def search(m: int, n_cols: int, k: int, group: int, paired: bool, interleaves: tuple[int, ...],
           time_config: Callable[[W4Config, int], Optional[float]],
           device: torch.device = torch.device("cuda"),
           paired_dequant: bool = False) -> dict[tuple[W4Config, int], float]:
    """The two-stage search: {(config, interleave): seconds} of every config timed (None from
    `time_config`: the compiler refused it); with `paired_dequant` of the paired
    dequantisation's configs (`W4Config.paired_dequant`, tl.dot) alone."""
    timed: dict[tuple[W4Config, int], float] = {}

    def trial(c: W4Config, words: int) -> None:
        if (c, words) in timed or not launchable(c, m, n_cols, k, group, paired, words, device):
            return
        seconds = time_config(c, words)
        if seconds is not None:
            timed[c, words] = seconds

    base = W4Config(block_n=64, split_k=1, num_warps=4, num_stages=4)
    for words in interleaves:
        if not plane_groups(group, k, words):
            continue
        for variant in _variants(m, words, paired, paired_dequant):
            trial(_with_tile(base._replace(**variant), m, n_cols, k, group, paired,
                             variant["block_n"], words, device), words)
    if not timed:
        return timed
    words = min(timed, key=timed.get)[1]

    def best() -> W4Config:
        return min((c for c, w in timed if w == words), key=lambda c: timed[c, words])

    for block_n in (16, 32, 64, 128):  # each axis from the best so far
        trial(_with_tile(best(), m, n_cols, k, group, paired, block_n, words, device), words)
    if m > MAX_ROWS:
        start = best()
        for block_m in ROW_TILES:
            trial(_with_tile(start._replace(block_m=block_m), m, n_cols, k, group, paired,
                             start.block_n, words, device), words)
    start = best()
    for split in (start.split_k // 2, start.split_k * 2):
        if split >= 1:
            trial(start._replace(split_k=split), words)
    trial(best()._replace(num_warps=8), words)
    trial(best()._replace(num_stages=6), words)
    start = best()
    for stages, warps, split in itertools.product(OCCUPANCY_STAGES, (4, 8), (1, 2, 4)):
        trial(start._replace(num_stages=stages, num_warps=warps, split_k=start.split_k * split), words)
    return timed


def config_name(c: W4Config, words: int) -> str:
    kind = ("dot-wleft" if c.w_left else "dot") if c.dot else ("fma-bits" if c.round_bits else "fma")
    kind += "-paired" if c.paired_dequant else ""
    rows = f" m{c.block_m}" if c.block_m else ""
    return f"W{words} {kind} n{c.block_n}{rows} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def write_json(path: str, device: str, best: dict[tuple, dict]) -> None:
    """best: (m, n_cols, k, group, paired, n_rows) -> {config, interleave, us, fraction_of_copy}."""
    layouts, configs = {}, []
    for (m, n_cols, k, group, paired, n_rows), r in sorted(best.items()):
        layouts.setdefault((n_rows, k, group), r["interleave"])
        configs.append(dict(key=[m, n_cols, k, group, paired], config=r["config"],
                            interleave=r["interleave"], us=r["us"],
                            fraction_of_copy=r["fraction_of_copy"]))
    with open(path, "w") as f:
        json.dump(dict(device=device, interleave=[[*key, w] for key, w in layouts.items()],
                       configs=configs), f, indent=1)


def tuned_tables(sweep: dict) -> tuple[dict, dict]:
    """A sweep JSON's tables as engine/layers/int4_tuned.py holds them: {(N, K, group):
    interleave} and {(M, output columns, K, group, paired): the JSON's entry} (configs measured
    at another interleave than their weight's layout are left out: the layout is per weight)."""
    layouts = {tuple(entry[:3]): entry[3] for entry in sweep["interleave"]}
    configs = {}
    for entry in sweep["configs"]:
        m, n_cols, k, group, paired = entry["key"]
        if layouts.get((2 * n_cols if paired else n_cols, k, group)) == entry["interleave"]:
            configs[m, n_cols, k, group, bool(paired)] = entry
    return layouts, configs


def weight_key(config_key: tuple) -> tuple[int, int, int]:
    """(N, K, group) of the weight a TUNED_W4_CONFIGS key (M, output columns, K, group, paired)
    is measured on."""
    _, n_cols, k, group, paired = config_key
    return (2 * n_cols if paired else n_cols, k, group)


def merged_tables(sweep: dict, layouts: dict, configs: dict) -> tuple[dict, dict]:
    """The tables after a sweep JSON is installed over `layouts` and `configs` (the installed
    ones: {(N, K, group): interleave}, {key: anything}): the sweep's layouts and configs
    (`tuned_tables`) replace those at their keys; an installed config stays where the sweep
    measured none at its key and its weight's layout is unchanged (a sweep of mid M alone
    keeps the decode configs)."""
    new_layouts, new_configs = tuned_tables(sweep)
    merged = {**layouts, **new_layouts}
    kept = {key: value for key, value in configs.items() if key not in new_configs
            and layouts.get(weight_key(key)) == merged.get(weight_key(key))}
    return merged, {**kept, **new_configs}


def install(path: str, module: pathlib.Path = TUNED_MODULE) -> str:
    """Writes the sweep's tables merged over the module's (`merged_tables`) into
    engine/layers/int4_tuned.py: a config kept from the module keeps its line."""
    with open(path) as f:
        sweep = json.load(f)
    text = module.read_text()
    installed = runpy.run_path(str(module))
    old_lines = {key: line for line in text.splitlines(keepends=True)
                 for key in installed["TUNED_W4_CONFIGS"] if line.startswith(f"    {key!r}: ")}
    layouts, configs = merged_tables(sweep, installed["TUNED_INTERLEAVE"], old_lines)
    lines = [f"    {tuple(key)!r}: {words},\n" for key, words in layouts.items()]
    config_lines = []
    for key, entry in sorted(configs.items()):
        if isinstance(entry, str):  # kept: the module's own line
            config_lines.append(entry)
            continue
        fields = W4Config(**entry["config"])._asdict()
        config_lines.append(f"    {key!r}: {fields!r},"
                            f"  # {entry['us']:.1f} us, {100 * entry['fraction_of_copy']:.0f} %\n")
    marker = "from __future__ import annotations\n\n"
    head = text[:text.index(marker) + len(marker)]
    module.write_text(
        head + f"# {sweep['device']} sweep (bench/int4_sweep.py)\n"
        + "TUNED_INTERLEAVE: dict[tuple[int, int, int], int] = {\n" + "".join(lines) + "}\n\n"
        + "TUNED_W4_CONFIGS: dict[tuple[int, int, int, int, bool], dict] = {\n"
        + "".join(config_lines) + "}\n")
    return str(module)
