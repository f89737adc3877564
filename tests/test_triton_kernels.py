"""Triton attention kernels and TritonAttnBackend against a torch reference.

Without a GPU the kernels run in the Triton interpreter on the CPU (tiny shapes, fp32: the
interpreter's bf16 `tl.dot` is wrong). With a GPU the same tests run compiled, and the
`gpu`-marked tests add real model shapes in bf16.
"""
import os

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere: kernels are bound to the interpreter
    # when their module is decorated.
    os.environ["TRITON_INTERPRET"] = "1"

import itertools  # noqa: E402
from typing import NamedTuple, Optional  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from specserve.engine.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from specserve.engine.attention.triton.backend import TritonAttnBackend  # noqa: E402
from specserve.engine.attention.triton.kernels import (  # noqa: E402
    DecodeConfig, ExtendConfig, decode_attention, decode_stages, extend_attention,
    fill_kv_indices, default_split_programs, short_extend_attention, short_extend_tiling)
from specserve.engine.kvcache.pools import ReqToTokenPool, TokenToKVPool  # noqa: E402
from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Small tiles so that the tiny test sequences still span several loop iterations, KV splits
# and query blocks (16 is the smallest tile tl.dot accepts on a GPU). A query block covers
# 32 // group tokens, more than one key tile when the group is small.
SMALL_DECODE = DecodeConfig(block_n=16, min_kv_split_len=16, num_warps=4, num_stages=1)
# Splits of 8 tokens (a multiple of 8, not of the tile) under 16-token tiles: a split's only
# tile is partly masked, as the H100 default's 32-token splits under 128-token tiles.
SUBTILE_SPLITS = SMALL_DECODE._replace(min_kv_split_len=8)
SMALL_EXTEND = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------
# Reference and test scenes
# ---------------------------------------------------------------------------------------------

def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention in fp32. q: [E, H, D]; keys, values: [L, KVH, D];
    visible: [E, L] bool. Returns [E, H, D] fp32."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def random_tree_mask(bs: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """[bs, width, width] random visibility where every token sees at least itself."""
    mask = torch.rand(bs, width, width, generator=generator) < 0.5
    return mask | torch.eye(width, dtype=torch.bool)


class Scene(NamedTuple):
    """Requests laid out in a KV pool the way the scheduler does it: request b owns table row
    `rows[b]`, whose first prefix + extend entries are its (scattered) slots."""

    table: torch.Tensor          # [num_rows + 1, width] int64
    rows: torch.Tensor           # [bs] int64
    prefix_lens: torch.Tensor    # [bs] int64
    extend_lens: list[int]
    new_slots: torch.Tensor      # [num_new_tokens] int64, the rows' entries after the prefix
    k_buffer: torch.Tensor       # [num_slots + 1, num_kv_heads, head_dim]
    v_buffer: torch.Tensor


def make_scene(prefix_lens: list[int], extend_lens: list[int], num_kv_heads: int,
               head_dim: int, generator: torch.Generator, dtype=torch.float32,
               device=DEVICE, table_width: Optional[int] = None) -> Scene:
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(seq_lens) + 16
    width = table_width or max(seq_lens) + 8
    # Entries past a request's length hold other valid slots: reading too far gives wrong K/V.
    table = torch.randint(1, num_slots + 1, (2 * bs + 1, width), generator=generator)
    rows = torch.randperm(2 * bs, generator=generator)[:bs] + 1
    slots = torch.randperm(num_slots, generator=generator) + 1  # slot 0 is the dummy
    offsets = [0, *itertools.accumulate(seq_lens)]
    for b in range(bs):
        table[rows[b], :seq_lens[b]] = slots[offsets[b]:offsets[b + 1]]
    new_slots = torch.cat([table[rows[b], prefix_lens[b]:seq_lens[b]] for b in range(bs)])
    shape = (num_slots + 1, num_kv_heads, head_dim)
    return Scene(
        table=table.to(device), rows=rows.to(device),
        prefix_lens=torch.tensor(prefix_lens, device=device), extend_lens=list(extend_lens),
        new_slots=new_slots.to(device),
        k_buffer=torch.randn(shape, generator=generator).to(device, dtype),
        v_buffer=torch.randn(shape, generator=generator).to(device, dtype))


def scene_reference(scene: Scene, q: torch.Tensor, scale: float,
                    custom_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expected output of every new token, K/V gathered through the table rows."""
    outputs, start = [], 0
    for b, extend_len in enumerate(scene.extend_lens):
        prefix_len = int(scene.prefix_lens[b])
        slots = scene.table[scene.rows[b], :prefix_len + extend_len]
        new_visible = (custom_mask[b, :extend_len, :extend_len].to(q.device)
                       if custom_mask is not None else
                       torch.ones(extend_len, extend_len, dtype=torch.bool,
                                  device=q.device).tril())
        visible = torch.cat([torch.ones(extend_len, prefix_len, dtype=torch.bool,
                                        device=q.device), new_visible], dim=1)
        outputs.append(reference_attention(q[start:start + extend_len], scene.k_buffer[slots],
                                           scene.v_buffer[slots], visible, scale))
        start += extend_len
    return torch.cat(outputs)


def scene_kv_indices(scene: Scene, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    bs = len(scene.extend_lens)
    bound = bs * int(scene.table.shape[1])
    kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=scene.table.device)
    kv_indices = torch.empty(bound, dtype=torch.int32, device=scene.table.device)
    fill_kv_indices(scene.table, scene.rows, scene.prefix_lens, kv_indptr, kv_indices,
                    decode_token_slots=scene.new_slots if decode else None)
    return kv_indptr, kv_indices


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_decode_token", [False, True])
@pytest.mark.parametrize("prefix_lens", [[0, 37, 5, 16],
                                         # more requests than one block of the offsets' sums
                                         [(7 * i) % 5 for i in range(300)]])
def test_fill_kv_indices(with_decode_token, prefix_lens):
    gen = torch.Generator().manual_seed(0)
    bs = len(prefix_lens)
    scene = make_scene(prefix_lens, [1] * bs, num_kv_heads=1, head_dim=16, generator=gen)
    kv_indptr = torch.full((bs + 1,), -7, dtype=torch.int64, device=DEVICE)
    kv_indices = torch.full((sum(prefix_lens) + bs + 50,), -1, dtype=torch.int32, device=DEVICE)
    fill_kv_indices(scene.table, scene.rows, scene.prefix_lens, kv_indptr, kv_indices,
                    decode_token_slots=scene.new_slots if with_decode_token else None,
                    block=16)  # 37 entries: three loop iterations, the last one partial

    kv_lens = [p + with_decode_token for p in prefix_lens]
    expected_indptr = [0, *itertools.accumulate(kv_lens)]
    assert kv_indptr.tolist() == expected_indptr
    for b, row in enumerate(scene.rows.tolist()):
        segment = kv_indices[expected_indptr[b]:expected_indptr[b + 1]]
        # With the decode token the table row holds it right after the prefix.
        assert segment.tolist() == scene.table[row, :kv_lens[b]].tolist()
    assert (kv_indices[expected_indptr[-1]:] == -1).all()


def test_fill_kv_indices_compiles_once_whatever_the_table_width_and_offsets():
    """The request table's row stride and the per-request vectors are not specialised on (a
    served run recompiled the kernel mid-way, most likely for a snapshot width the warm-up had
    not met), nor the extend kernels' new-token slots and mask strides: the kernels' arguments
    by those names are marked so, and a table of another width, rows at an odd offset, still
    fill the same lists."""
    from specserve.engine.attention.triton import kernels

    def unspecialized(kernel) -> set[str]:
        # (the interpreter keeps the decorator's arguments; the JIT marks its parameters)
        names = set(kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else
                    (p.name for p in kernel.params if p.do_not_specialize))
        assert names <= set(kernel.arg_names)
        return names

    assert unspecialized(kernels._fill_kv_indices_kernel) == set(kernels.FILL_KV_UNSPECIALIZED)
    # the extend kernels' new-token slots (views at any offset) and tree-mask strides alike
    for kernel in (kernels._extend_attention_kernel, kernels._short_extend_kernel):
        assert unspecialized(kernel) == set(kernels.EXTEND_UNSPECIALIZED)
    for width in (32, 33):
        table = torch.arange(3 * width, device=DEVICE).view(3, width)
        rows = torch.tensor([7, 2, 1], device=DEVICE)[1:]  # a view at an 8-byte offset
        prefix = torch.tensor([0, 5, 3], device=DEVICE)[1:]
        indptr = torch.empty(3, dtype=torch.int64, device=DEVICE)
        indices = torch.empty(8, dtype=torch.int32, device=DEVICE)
        fill_kv_indices(table, rows, prefix, indptr, indices)
        assert indptr.tolist() == [0, 5, 8]
        assert indices.tolist() == [*range(2 * width, 2 * width + 5), *range(width, width + 3)]


@pytest.mark.gpu
@gpu
def test_fill_kv_indices_compiles_one_kernel_for_every_width_and_offset_gpu():
    """On a GPU (its JIT specialises, the interpreter does not): tables of widths 32, 33 and
    47 (row strides 16-divisible or not) and request vectors at 0- and 8-byte offsets leave
    one compiled kernel (Triton's per-device cache, the first element of its entry)."""
    from specserve.engine.attention.triton import kernels

    kernel = kernels._fill_kv_indices_kernel
    device = torch.cuda.current_device()
    before = len(kernel.device_caches[device][0])
    for width, offset in itertools.product((32, 33, 47), (0, 1)):
        table = torch.arange(3 * width, device=DEVICE).view(3, width)
        rows = torch.tensor([7, 2, 1], device=DEVICE)[offset:offset + 2]
        prefix = torch.tensor([4, 5, 3], device=DEVICE)[offset:offset + 2]
        fill_kv_indices(table, rows, prefix, torch.empty(3, dtype=torch.int64, device=DEVICE),
                        torch.empty(16, dtype=torch.int32, device=DEVICE))
    torch.cuda.synchronize()
    assert len(kernel.device_caches[device][0]) - before <= 1


def test_fill_kv_indices_reads_decode_slots_as_consecutive_values():
    """A column of the slot table is refused for two requests (its values are a row apart) and
    taken for one (a one-element view: bench/attention_kernels.py's bs=1 decode)."""
    table = torch.arange(2 * 9, dtype=torch.int32, device=DEVICE).view(2, 9)
    prefix = torch.tensor([3, 5], device=DEVICE)
    indptr = torch.empty(3, dtype=torch.int64, device=DEVICE)
    indices = torch.full((20,), -1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError):
        fill_kv_indices(table, torch.arange(2, device=DEVICE), prefix, indptr, indices,
                        decode_token_slots=table[:, 8])
    fill_kv_indices(table, torch.tensor([1], device=DEVICE), prefix[1:], indptr, indices,
                    decode_token_slots=table[1:, 8])
    assert indices[:7].tolist() == [9, 10, 11, 12, 13, 17, -1]


@pytest.mark.parametrize("num_kv_heads,group_size,head_dim", [(2, 1, 32), (2, 2, 16),
                                                               (1, 4, 32), (2, 3, 24)])
@pytest.mark.parametrize("max_kv_splits", [1, 4])
@pytest.mark.parametrize("config", [SMALL_DECODE, SUBTILE_SPLITS], ids=["tile-splits", "subtile-splits"])
def test_decode_attention(num_kv_heads, group_size, head_dim, max_kv_splits, config):
    gen = torch.Generator().manual_seed(1)
    num_heads = num_kv_heads * group_size
    prefix_lens = [0, 63, 17, 40]  # 1 to 64 keys: 1 to 4 splits of 16
    scene = make_scene(prefix_lens, [1] * 4, num_kv_heads, head_dim, gen)
    q = torch.randn(4, num_heads, head_dim, generator=gen).to(DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
    partial_out = torch.empty(4, num_heads, max_kv_splits, head_dim, device=DEVICE)
    partial_lse = torch.empty(4, num_heads, max_kv_splits, device=DEVICE)
    arrivals = torch.zeros(4 * num_kv_heads, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    outputs = []
    # The merge leaves its counters at zero: the next launch is the same, a program a split
    # (the default here), one program running every split of its tile, or 3 programs.
    for split_programs in (None, 1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                         partial_out, partial_lse, arrivals, scale, config,
                         split_programs=split_programs)
        torch.testing.assert_close(out, scene_reference(scene, q, scale), atol=1e-4, rtol=1e-4)
        assert not arrivals.any()
        outputs.append(out)
    assert all(torch.equal(outputs[0], o) for o in outputs[1:])


def test_decode_attention_is_batch_invariant():
    """A request's split layout depends on its own length only, so its output is bitwise the
    same alone or in a batch (what greedy parity between batch sizes relies on)."""
    gen = torch.Generator().manual_seed(9)
    scene = make_scene([50, 7, 33], [1] * 3, num_kv_heads=2, head_dim=16, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen).to(DEVICE)
    partial_out = torch.empty(3, 4, 4, 16, device=DEVICE)
    partial_lse = torch.empty(3, 4, 4, device=DEVICE)
    arrivals = torch.zeros(3 * 2, dtype=torch.int32, device=DEVICE)

    def run_first(bs: int) -> torch.Tensor:
        kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=DEVICE)
        kv_indices = torch.empty(bs * 64, dtype=torch.int32, device=DEVICE)
        fill_kv_indices(scene.table, scene.rows[:bs], scene.prefix_lens[:bs], kv_indptr,
                        kv_indices, decode_token_slots=scene.new_slots[:bs])
        out = torch.empty_like(q[:bs])
        decode_attention(q[:bs], scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                         partial_out, partial_lse, arrivals, 0.25, SMALL_DECODE)
        return out

    assert torch.equal(run_first(3)[0], run_first(1)[0])


@pytest.mark.parametrize("num_kv_heads,group_size,head_dim", [(2, 1, 32), (2, 2, 16),
                                                               (1, 4, 32), (2, 3, 24)])
@pytest.mark.parametrize("use_custom_mask", [False, True])
def test_extend_attention(num_kv_heads, group_size, head_dim, use_custom_mask):
    gen = torch.Generator().manual_seed(2)
    num_heads = num_kv_heads * group_size
    prefix_lens = [0, 30, 9]
    extend_lens = [21, 1, 6]  # ragged; the first request spans several key tiles
    scene = make_scene(prefix_lens, extend_lens, num_kv_heads, head_dim, gen)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE)
    custom_mask = random_tree_mask(3, 21, gen).to(DEVICE) if use_custom_mask else None
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr, kv_indices,
                     scene.new_slots, max(extend_lens), scale, custom_mask=custom_mask,
                     config=SMALL_EXTEND)
    expected = scene_reference(scene, q, scale, custom_mask)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_kv_heads,group_size,head_dim", [(2, 1, 32), (1, 4, 32), (2, 3, 24),
                                                               (1, 8, 16)])
@pytest.mark.parametrize("use_custom_mask", [False, True])
@pytest.mark.parametrize("max_kv_splits", [1, 4])
@pytest.mark.parametrize("config", [SMALL_DECODE, SUBTILE_SPLITS], ids=["tile-splits", "subtile-splits"])
def test_short_extend_attention(num_kv_heads, group_size, head_dim, use_custom_mask,
                                max_kv_splits, config):
    """Ragged 1-8-token extends over prefixes from none to several splits long (SMALL_DECODE:
    16-token splits, so 70 keys span 4 of them and, with one split allowed, 5 key tiles)."""
    gen = torch.Generator().manual_seed(12)
    num_heads = num_kv_heads * group_size
    prefix_lens = [0, 70, 9, 33, 16]
    extend_lens = [4, 8, 1, 5, 3]
    scene = make_scene(prefix_lens, extend_lens, num_kv_heads, head_dim, gen)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE)
    custom_mask = random_tree_mask(5, 8, gen).to(DEVICE) if use_custom_mask else None
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    partial_out = torch.full((num_tokens + 3, num_heads, max_kv_splits, head_dim), float("nan"),
                             device=DEVICE)
    partial_lse = torch.full((num_tokens + 3, num_heads, max_kv_splits), float("nan"),
                             device=DEVICE)
    arrivals = torch.zeros(5 * num_kv_heads, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    for _ in range(2):  # the arrival counters are back at zero for the next launch
        short_extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr,
                               kv_indices, scene.new_slots, max(extend_lens), scale, partial_out,
                               partial_lse, arrivals, custom_mask=custom_mask,
                               config=config)
        torch.testing.assert_close(out, scene_reference(scene, q, scale, custom_mask),
                                   atol=1e-4, rtol=1e-4)
        assert not arrivals.any()


@pytest.mark.parametrize("use_custom_mask", [False, True])
def test_short_extend_token_blocks(use_custom_mask):
    """Tiles of 16 rows (`block_h`): a group of 4 heads takes 4 tokens a tile, so the longest
    request's 8 tokens take two token blocks, and the second reads nothing for the shorter
    requests (1, 3 and 4 tokens); split over the prefix, merged by the last split, the same
    bits whether each split has a program of its own or a program runs several in turn."""
    gen = torch.Generator().manual_seed(14)
    prefix_lens, extend_lens = [70, 9, 33, 0, 40], [8, 1, 3, 5, 4]
    scene = make_scene(prefix_lens, extend_lens, 2, 16, gen)
    config = SMALL_DECODE._replace(block_h=16)
    tiling = short_extend_tiling(4, max(extend_lens), config)
    assert tiling == (4, 1, 16, 2)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, 8, 16, generator=gen).to(DEVICE)
    custom_mask = random_tree_mask(5, 8, gen).to(DEVICE) if use_custom_mask else None
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    partial_out = torch.full((num_tokens, 8, 4, 16), float("nan"), device=DEVICE)
    partial_lse = torch.full((num_tokens, 8, 4), float("nan"), device=DEVICE)
    arrivals = torch.zeros(5 * 2 * tiling.tiles_per_kv_head, dtype=torch.int32, device=DEVICE)
    outputs = []
    for split_programs in (4, 1, 3):  # the 70-token prefix has 4 splits of 16 tokens
        short_extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr,
                               kv_indices, scene.new_slots, max(extend_lens), 0.25, partial_out,
                               partial_lse, arrivals, custom_mask=custom_mask, config=config,
                               split_programs=split_programs)
        assert not arrivals.any()
        outputs.append(out.clone())
    torch.testing.assert_close(outputs[0], scene_reference(scene, q, 0.25, custom_mask),
                               atol=1e-4, rtol=1e-4)
    assert all(torch.equal(o, outputs[0]) for o in outputs[1:])


def test_short_extend_grid():
    """A verify row's tokens in a bucket sized for longer chunks: the 8B shape's group of 4
    fills each 64-row tile with 16 tokens, so a 4-token row runs one tile per KV head, not one
    per head; MLA's 16 heads (16-row tiles) take a token a tile; a 128-head group is sliced.
    Splits get programs of their own only while the batch's tiles leave the GPU room."""
    h100 = DecodeConfig(block_n=128, min_kv_split_len=256, num_warps=4, num_stages=3)
    assert short_extend_tiling(4, 64, h100) == (4, 1, 64, 4)
    assert short_extend_tiling(4, 4, h100) == (4, 1, 16, 1)
    mla = h100._replace(block_h=16)
    assert short_extend_tiling(16, 4, mla) == (16, 1, 16, 4)
    assert short_extend_tiling(16, 64, mla) == (16, 1, 64, 16)
    assert short_extend_tiling(128, 64, mla) == (64, 2, 64, 64)
    assert default_split_programs(8, 16, torch.device("cpu")) == 16  # bs 1: a program a split
    assert default_split_programs(60 * 8, 16, torch.device("cpu")) == 2  # 60 verify rows
    assert default_split_programs(68 * 8 * 4, 16, torch.device("cpu")) == 1  # mixed, T 256
    for group, tokens, config in itertools.product((1, 3, 4, 8, 16, 128), (1, 2, 4, 7, 64),
                                                   (h100, mla)):
        tiling = short_extend_tiling(group, tokens, config)
        assert tiling.tiles_per_kv_head <= triton.next_power_of_2(group)  # the backend's counters
        tokens_per_tile = tiling.block_m // tiling.heads_per_tile
        assert tiling.token_blocks * tokens_per_tile >= tokens
        assert tiling.head_blocks * tiling.heads_per_tile >= group


def test_short_extend_attention_is_batch_invariant():
    """A request's splits depend on its own prefix only: alone or in a batch, the same bits."""
    gen = torch.Generator().manual_seed(13)
    scene = make_scene([50, 7, 33], [4, 4, 4], num_kv_heads=2, head_dim=16, generator=gen)
    q = torch.randn(12, 4, 16, generator=gen).to(DEVICE)
    partial_out = torch.empty(12, 4, 4, 16, device=DEVICE)
    partial_lse = torch.empty(12, 4, 4, device=DEVICE)
    arrivals = torch.zeros(3 * 2, dtype=torch.int32, device=DEVICE)

    def run_first(bs: int) -> torch.Tensor:
        kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=DEVICE)
        kv_indices = torch.empty(bs * 64, dtype=torch.int32, device=DEVICE)
        fill_kv_indices(scene.table, scene.rows[:bs], scene.prefix_lens[:bs], kv_indptr, kv_indices)
        qo_indptr = torch.arange(0, 4 * bs + 1, 4, device=DEVICE)
        out = torch.empty_like(q[:4 * bs])
        short_extend_attention(q[:4 * bs], scene.k_buffer, scene.v_buffer, out, qo_indptr,
                               kv_indptr, kv_indices, scene.new_slots[:4 * bs], 4, 0.25,
                               partial_out, partial_lse, arrivals, config=SMALL_DECODE)
        return out

    assert torch.equal(run_first(3)[:4], run_first(1))


def test_extend_attention_custom_mask_is_applied():
    """A custom mask that hides a key must change the output relative to causal (guards
    against the mask being ignored where causal and custom happen to agree)."""
    gen = torch.Generator().manual_seed(3)
    scene = make_scene([4], [3], num_kv_heads=1, head_dim=16, generator=gen)
    q = torch.randn(3, 2, 16, generator=gen).to(DEVICE)
    # Chain 0 <- 2 (token 2 skips token 1): a tree, not a prefix of the causal pattern.
    custom_mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool,
                               device=DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, 3], device=DEVICE)
    outputs = []
    for mask in (None, custom_mask):
        out = torch.empty_like(q)
        extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr,
                         kv_indices, scene.new_slots, 3, 0.25, custom_mask=mask,
                         config=SMALL_EXTEND)
        outputs.append(out)
    torch.testing.assert_close(outputs[1], scene_reference(scene, q, 0.25, custom_mask),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outputs[0][:2], outputs[1][:2])
    assert not torch.allclose(outputs[0][2], outputs[1][2], atol=1e-3)


# ---------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------

NUM_LAYERS, LAYER_ID = 2, 1


class BackendCase(NamedTuple):
    mode: ForwardMode
    prefix_lens: list[int]
    extend_lens: list[int]
    tree_mask: bool
    exact_max_seq_len: bool  # False: the GPU-only path passes an upper bound
    kv_override: bool = False  # tree drafting: per-request slot lists instead of req_to_token


BACKEND_CASES = {
    "extend": BackendCase(ForwardMode.EXTEND, [0, 21, 7], [9, 1, 14], False, True),
    # 70 new tokens: more than a split extend takes (the long kernel).
    "long_extend": BackendCase(ForwardMode.EXTEND, [0, 12], [70, 33], False, True),
    "decode": BackendCase(ForwardMode.DECODE, [0, 44, 19], [1, 1, 1], False, False),
    "target_verify": BackendCase(ForwardMode.TARGET_VERIFY, [3, 30, 12], [4, 4, 4], True, False),
    "draft_extend": BackendCase(ForwardMode.DRAFT_EXTEND, [5, 40, 17], [3, 3, 3], False, False),
    "tree_draft_decode": BackendCase(ForwardMode.DECODE, [9, 0, 33, 20], [1] * 4, False, False,
                                     kv_override=True),
}


def build_forward_batch(case: BackendCase, backend: TritonAttnBackend, num_kv_heads: int,
                        head_dim: int, max_context_len: int, gen: torch.Generator,
                        dtype=torch.float32, device=DEVICE) -> tuple[ForwardBatch, Scene]:
    """A ForwardBatch over pools that hold the scene's prefix K/V (new slots still empty)."""
    scene = make_scene(case.prefix_lens, case.extend_lens, num_kv_heads, head_dim, gen, dtype,
                       device, table_width=max_context_len + 8)
    num_rows, width = scene.table.shape[0] - 1, scene.table.shape[1]
    req_to_token = ReqToTokenPool(num_rows, width, device)
    req_to_token.table.copy_(scene.table)
    kv_pool = TokenToKVPool(scene.k_buffer.shape[0] - 1, NUM_LAYERS, num_kv_heads, head_dim,
                            dtype, device)
    prefix_slots = torch.cat([scene.table[scene.rows[b], :p]
                              for b, p in enumerate(case.prefix_lens)])
    for layer in range(NUM_LAYERS):
        kv_pool.set_kv(layer, prefix_slots, scene.k_buffer[prefix_slots],
                       scene.v_buffer[prefix_slots])
    bs, num_tokens = len(case.extend_lens), sum(case.extend_lens)
    seq_lens = [p + e for p, e in zip(case.prefix_lens, case.extend_lens)]
    fb = ForwardBatch(
        mode=case.mode,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(case.prefix_lens, seq_lens)]
                            ).to(device),
        # As the tree drafter builds it for a KV override: row b is branch b's own slot list.
        kv_rows=KVRows.by_batch_index(scene.table[scene.rows].clone()) if case.kv_override
        else KVRows(req_to_token.table, scene.rows),
        prefix_lens=scene.prefix_lens,
        extend_lens_cpu=list(case.extend_lens), out_cache_loc=scene.new_slots,
        kv_pool=kv_pool, attn_backend=backend,
        seq_lens_cpu=seq_lens if case.exact_max_seq_len else None,
        max_seq_len=max(seq_lens) if case.exact_max_seq_len else max_context_len,
        custom_mask=(random_tree_mask(bs, max(case.extend_lens), gen).to(device)
                     if case.tree_mask else None))
    return fb, scene


def slot_lists_read_at_init(fb: ForwardBatch) -> torch.Tensor:
    return fb.kv_rows.table


def random_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
               gen: torch.Generator, dtype=torch.float32, device=DEVICE):
    return [torch.randn(num_tokens, heads, head_dim, generator=gen).to(device, dtype)
            for heads in (num_heads, num_kv_heads, num_kv_heads)]


def run_backend_case(case: BackendCase, num_heads: int, num_kv_heads: int, head_dim: int,
                     max_context_len: int, max_batch_size: int, gen: torch.Generator,
                     dtype=torch.float32, device=DEVICE, decode_config=None, extend_config=None):
    """One layer through the backend. Returns (output, expected fp32, fb, k, v)."""
    backend = TritonAttnBackend(num_heads, num_kv_heads, head_dim, max_context_len, device,
                                max_batch_size=max_batch_size, decode_config=decode_config,
                                extend_config=extend_config)
    fb, scene = build_forward_batch(case, backend, num_kv_heads, head_dim, max_context_len, gen,
                                    dtype, device)
    num_tokens = fb.num_tokens
    q, k, v = random_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen, dtype, device)
    scale = head_dim ** -0.5
    # The reference sees the new tokens' K/V where the scene's table rows point.
    scene.k_buffer[scene.new_slots] = k
    scene.v_buffer[scene.new_slots] = v
    expected = scene_reference(scene, q, scale, fb.custom_mask)

    backend.init_forward_metadata(fb)
    # Past init_forward_metadata the scheduler may rewrite req_to_token (base.py): the
    # forward must not read it again.
    slot_lists_read_at_init(fb).random_(1, scene.k_buffer.shape[0])
    out = backend.forward(q, k, v, LAYER_ID, fb, scale)
    return out, expected.reshape(num_tokens, -1), fb, k, v


@pytest.mark.parametrize("case_name", list(BACKEND_CASES))
@pytest.mark.parametrize("max_batch_size", [8, 2])  # 2 < bs: buffers allocated per forward
def test_backend_matches_reference(case_name, max_batch_size):
    case = BACKEND_CASES[case_name]
    gen = torch.Generator().manual_seed(4)
    out, expected, fb, k, v = run_backend_case(
        case, num_heads=4, num_kv_heads=2, head_dim=16, max_context_len=96,
        max_batch_size=max_batch_size, gen=gen, decode_config=SMALL_DECODE,
        extend_config=SMALL_EXTEND)
    assert fb.attn_metadata.is_decode == (case.mode == ForwardMode.DECODE)
    assert fb.attn_metadata.split_extend == (case.mode != ForwardMode.DECODE
                                             and case_name != "long_extend")
    assert out.shape == (fb.num_tokens, 4 * 16)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # The new tokens' K/V were stored in the forward's layer only.
    torch.testing.assert_close(fb.kv_pool.k_buffer[LAYER_ID][fb.out_cache_loc], k)
    torch.testing.assert_close(fb.kv_pool.v_buffer[LAYER_ID][fb.out_cache_loc], v)
    assert not fb.kv_pool.k_buffer[0][fb.out_cache_loc].any()


@pytest.mark.parametrize("case_name", list(BACKEND_CASES))
def test_backend_matches_torch_native(case_name):
    case = BACKEND_CASES[case_name]
    gen = torch.Generator().manual_seed(10)
    backend = TritonAttnBackend(4, 2, 16, 64, DEVICE, decode_config=SMALL_DECODE,
                                extend_config=SMALL_EXTEND)
    fb, _ = build_forward_batch(case, backend, 2, 16, 64, gen)
    q, k, v = random_qkv(fb.num_tokens, 4, 2, 16, gen)
    native = TorchNativeAttnBackend(needs_cpu_seq_lens=False)
    native.init_forward_metadata(fb)
    expected = native.forward(q, k, v, LAYER_ID, fb, 0.25)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(q, k, v, LAYER_ID, fb, 0.25), expected,
                               atol=1e-4, rtol=1e-4)


def test_backend_width_one_draft_extend_uses_decode_kernels():
    case = BackendCase(ForwardMode.DRAFT_EXTEND, [6, 0], [1, 1], False, False)
    out, expected, fb, _, _ = run_backend_case(
        case, num_heads=2, num_kv_heads=1, head_dim=16, max_context_len=32, max_batch_size=4,
        gen=torch.Generator().manual_seed(5), decode_config=SMALL_DECODE,
        extend_config=SMALL_EXTEND)
    assert fb.attn_metadata.is_decode
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_backend_rejects_unset_max_seq_len():
    case = BACKEND_CASES["extend"]
    backend = TritonAttnBackend(4, 2, 16, 64, DEVICE)
    fb, _ = build_forward_batch(case, backend, 2, 16, 64, torch.Generator().manual_seed(6))
    fb.max_seq_len = 0  # the dataclass default
    with pytest.raises(ValueError, match="max_seq_len"):
        backend.init_forward_metadata(fb)


def test_backend_empty_batch():
    backend = TritonAttnBackend(4, 2, 16, 64, DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=empty, positions=empty,
                      kv_rows=KVRows(ReqToTokenPool(2, 8, DEVICE).table, empty), prefix_lens=empty,
                      extend_lens_cpu=[], out_cache_loc=empty,
                      kv_pool=TokenToKVPool(8, 1, 2, 16, torch.float32, DEVICE),
                      attn_backend=backend)
    backend.init_forward_metadata(fb)
    q = torch.zeros(0, 4, 16, device=DEVICE)
    kv = torch.zeros(0, 2, 16, device=DEVICE)
    assert backend.forward(q, kv, kv, 0, fb, 0.25).shape == (0, 64)


# ---------------------------------------------------------------------------------------------
# Real shapes on a GPU (bf16, compiled kernels, default launch configs)
# ---------------------------------------------------------------------------------------------

GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, GPU_MAX_CONTEXT = 32, 8, 128, 4096


def real_shape_cases(max_context: int) -> dict[str, BackendCase]:
    """Each forward mode with one request filling `max_context` and a ragged rest."""
    return {
        "decode": BackendCase(ForwardMode.DECODE, [max_context - 1, 1000, 0, 2999, 4000, 17],
                              [1] * 6, False, False),
        "extend": BackendCase(ForwardMode.EXTEND, [3584, 0, 1000], [512, 300, 77], False, True),
        "target_verify": BackendCase(ForwardMode.TARGET_VERIFY, [max_context - 8, 100, 2048, 0],
                                     [8] * 4, True, False),
        "draft_extend": BackendCase(ForwardMode.DRAFT_EXTEND, [max_context - 4, 1, 3000], [4] * 3,
                                    False, False),
    }


GPU_CASES = real_shape_cases(GPU_MAX_CONTEXT)


def forward_without_host_sync(backend, fb, q, k, v) -> torch.Tensor:
    """Metadata and attention for a steady-state step, with any wait on the device an error
    (the first forward compiles, outside the checked region)."""
    backend.init_forward_metadata(fb)
    backend.forward(q, k, v, LAYER_ID, fb, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, LAYER_ID, fb, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case_name", list(GPU_CASES))
def test_backend_real_shapes_bf16_gpu(case_name):
    gen = torch.Generator().manual_seed(7)
    out, expected, _, _, _ = run_backend_case(
        GPU_CASES[case_name], GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, GPU_MAX_CONTEXT,
        max_batch_size=8, gen=gen, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case_name", ["decode", "target_verify"])
def test_backend_has_no_host_sync_gpu(case_name):
    """Metadata and attention for a steady-state step must not wait on the device."""
    case = GPU_CASES[case_name]
    backend = TritonAttnBackend(GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, GPU_MAX_CONTEXT, DEVICE,
                                max_batch_size=8)
    fb, _ = build_forward_batch(case, backend, GPU_KV_HEADS, GPU_HEAD_DIM, GPU_MAX_CONTEXT,
                                torch.Generator().manual_seed(8), torch.bfloat16)
    qkv = random_qkv(fb.num_tokens, GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM,
                     torch.Generator().manual_seed(9), torch.bfloat16)
    forward_without_host_sync(backend, fb, *qkv)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [
    BackendCase(ForwardMode.TARGET_VERIFY, [32760, 5000], [8, 8], True, False),
    BackendCase(ForwardMode.DRAFT_EXTEND, [32764, 3], [4, 4], False, False)],
    ids=["tree_verify", "draft_extend"])
def test_split_extend_at_32k_context_gpu(case):
    out, expected, fb, _, _ = run_backend_case(
        case, GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, 32768 + 16, max_batch_size=4,
        gen=torch.Generator().manual_seed(14), dtype=torch.bfloat16)
    assert fb.attn_metadata.split_extend
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_split_extend_merge_is_deterministic_gpu():
    """The last split to arrive merges every split in index order, whichever arrives last: a
    race on the partials or the counters would show up as a changed bit over many launches."""
    case = BackendCase(ForwardMode.TARGET_VERIFY, [20000, 9000, 4100, 31000], [8] * 4, True, False)
    backend = TritonAttnBackend(GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, 32768, DEVICE,
                                max_batch_size=4, max_query_len=8)
    fb, _ = build_forward_batch(case, backend, GPU_KV_HEADS, GPU_HEAD_DIM, 32768,
                                torch.Generator().manual_seed(15), torch.bfloat16)
    q, k, v = random_qkv(fb.num_tokens, GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM,
                        torch.Generator().manual_seed(16), torch.bfloat16)
    backend.init_forward_metadata(fb)
    first = backend.forward(q, k, v, LAYER_ID, fb, 0.1)
    for _ in range(50):
        assert torch.equal(backend.forward(q, k, v, LAYER_ID, fb, 0.1), first)
    assert not backend._arrivals_buf.any()


# ---------------------------------------------------------------------------------------------
# MLA (absorbed form): one KV head, key = latent || rope, value = a view of the latent
# ---------------------------------------------------------------------------------------------

# Tiny MLA dims: a 32-dim latent and a 16-dim rope key (real: 512 + 64).
MLA_LATENT, MLA_ROPE = 32, 16
MLA_KEY_DIM = MLA_LATENT + MLA_ROPE
# Slices of 16 query heads per program (the MLA default), so 32 and more heads use several.
MLA_DECODE = SMALL_DECODE._replace(block_h=16)


def make_mla_scene(prefix_lens: list[int], extend_lens: list[int], generator: torch.Generator,
                   latent: int = MLA_LATENT, rope: int = MLA_ROPE, dtype=torch.float32,
                   device=DEVICE, table_width: Optional[int] = None,
                   separate_values: bool = False) -> Scene:
    """A one-KV-head scene whose values are the keys' first `latent` dims, as the MLA pool
    hands them out (a strided view); `separate_values` gives them their own buffer instead,
    a slice of a wider one, so the kernels must use the value buffer's own strides."""
    scene = make_scene(prefix_lens, extend_lens, 1, latent + rope, generator, dtype, device,
                       table_width)
    if separate_values:
        wider = torch.randn(scene.k_buffer.shape[0], 1, latent + 8, generator=generator)
        return scene._replace(v_buffer=wider.to(device, dtype)[..., 4:4 + latent])
    return scene._replace(v_buffer=scene.k_buffer[..., :latent])


@pytest.mark.parametrize("num_heads", [1, 32])
@pytest.mark.parametrize("max_kv_splits", [1, 4])
@pytest.mark.parametrize("separate_values", [False, True])
def test_mla_decode_attention(num_heads, max_kv_splits, separate_values):
    gen = torch.Generator().manual_seed(20)
    prefix_lens = [0, 63, 17, 40]
    scene = make_mla_scene(prefix_lens, [1] * 4, gen, separate_values=separate_values)
    q = torch.randn(4, num_heads, MLA_KEY_DIM, generator=gen).to(DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
    out = torch.full((4, num_heads, MLA_LATENT), float("nan"), device=DEVICE)
    partial_out = torch.empty(4, num_heads, max_kv_splits, MLA_LATENT, device=DEVICE)
    partial_lse = torch.empty(4, num_heads, max_kv_splits, device=DEVICE)
    # One counter per (request, slice of the 16-head tiles).
    arrivals = torch.zeros(4 * -(-num_heads // 16), dtype=torch.int32, device=DEVICE)
    scale = MLA_KEY_DIM ** -0.5
    decode_attention(q, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                     partial_out, partial_lse, arrivals, scale, MLA_DECODE)
    assert not arrivals.any()
    torch.testing.assert_close(out, scene_reference(scene, q, scale), atol=1e-4, rtol=1e-4)


def test_mla_rope_dims_change_the_scores():
    """The rope block is part of the key: zeroing the query's rope dims changes the output
    (guards against the rope block being dropped, which a reference with a zero rope part
    would not notice)."""
    gen = torch.Generator().manual_seed(21)
    scene = make_mla_scene([30], [1], gen)
    q = torch.randn(1, 16, MLA_KEY_DIM, generator=gen).to(DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
    outputs = []
    for query in (q, torch.cat([q[..., :MLA_LATENT], torch.zeros_like(q[..., MLA_LATENT:])], -1)):
        out = torch.empty(1, 16, MLA_LATENT, device=DEVICE)
        decode_attention(query, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                         torch.empty(1, 16, 2, MLA_LATENT, device=DEVICE),
                         torch.empty(1, 16, 2, device=DEVICE),
                         torch.zeros(1, dtype=torch.int32, device=DEVICE), 0.3, MLA_DECODE)
        torch.testing.assert_close(out, scene_reference(scene, query, 0.3), atol=1e-4, rtol=1e-4)
        outputs.append(out)
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-3)


@pytest.mark.parametrize("use_custom_mask", [False, True])
@pytest.mark.parametrize("max_kv_splits", [1, 4])
def test_mla_short_extend_attention(use_custom_mask, max_kv_splits):
    """8 heads and up to 8 new tokens: tiles of the 8 heads x 2 tokens, 4 token blocks."""
    gen = torch.Generator().manual_seed(22)
    num_heads, prefix_lens, extend_lens = 8, [0, 70, 9, 33], [4, 8, 1, 5]
    scene = make_mla_scene(prefix_lens, extend_lens, gen)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, MLA_KEY_DIM, generator=gen).to(DEVICE)
    custom_mask = random_tree_mask(4, 8, gen).to(DEVICE) if use_custom_mask else None
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    out = torch.full((num_tokens, num_heads, MLA_LATENT), float("nan"), device=DEVICE)
    partial_out = torch.full((num_tokens, num_heads, max_kv_splits, MLA_LATENT), float("nan"),
                             device=DEVICE)
    partial_lse = torch.full((num_tokens, num_heads, max_kv_splits), float("nan"), device=DEVICE)
    arrivals = torch.zeros(4 * num_heads, dtype=torch.int32, device=DEVICE)
    scale = MLA_KEY_DIM ** -0.5
    for _ in range(2):  # the arrival counters are back at zero for the next launch
        short_extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr,
                               kv_indices, scene.new_slots, max(extend_lens), scale, partial_out,
                               partial_lse, arrivals, custom_mask=custom_mask,
                               config=MLA_DECODE)
        torch.testing.assert_close(out, scene_reference(scene, q, scale, custom_mask),
                                   atol=1e-4, rtol=1e-4)
        assert not arrivals.any()


@pytest.mark.parametrize("use_custom_mask", [False, True])
def test_mla_extend_attention(use_custom_mask):
    """64 heads against 32-row tiles: each program takes one token and half of the group."""
    gen = torch.Generator().manual_seed(23)
    num_heads, prefix_lens, extend_lens = 64, [0, 30], [13, 6]
    scene = make_mla_scene(prefix_lens, extend_lens, gen, separate_values=use_custom_mask)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, MLA_KEY_DIM, generator=gen).to(DEVICE)
    custom_mask = random_tree_mask(2, 13, gen).to(DEVICE) if use_custom_mask else None
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=False)
    qo_indptr = torch.tensor([0, *itertools.accumulate(extend_lens)], device=DEVICE)
    out = torch.full((num_tokens, num_heads, MLA_LATENT), float("nan"), device=DEVICE)
    scale = MLA_KEY_DIM ** -0.5
    extend_attention(q, scene.k_buffer, scene.v_buffer, out, qo_indptr, kv_indptr, kv_indices,
                     scene.new_slots, max(extend_lens), scale, custom_mask=custom_mask,
                     config=SMALL_EXTEND)
    torch.testing.assert_close(out, scene_reference(scene, q, scale, custom_mask),
                               atol=1e-4, rtol=1e-4)


def run_mla_backend_case(case: BackendCase, num_heads: int, latent: int, rope: int,
                         max_context_len: int, gen: torch.Generator, dtype=torch.float32,
                         device=DEVICE, decode_config=None, extend_config=None,
                         max_batch_size: int = 8):
    """One MLA layer through the backend, as the DeepSeek model drives it: the caller stores
    latent || rope at the new slots and calls forward with k = v = None. Returns (output,
    expected fp32, fb)."""
    key_dim = latent + rope
    backend = TritonAttnBackend(num_heads, 1, key_dim, max_context_len, device,
                                max_batch_size=max_batch_size, decode_config=decode_config,
                                extend_config=extend_config, v_head_dim=latent)
    fb, scene = build_forward_batch(case, backend, 1, key_dim, max_context_len, gen, dtype,
                                    device)
    # The MLA pool's value buffer is the latent part of its key buffer.
    fb.kv_pool.v_buffer = [k_buffer[..., :latent] for k_buffer in fb.kv_pool.k_buffer]
    scene = scene._replace(v_buffer=scene.k_buffer[..., :latent])
    num_tokens = fb.num_tokens
    q = torch.randn(num_tokens, num_heads, key_dim, generator=gen).to(device, dtype)
    new_kv = torch.randn(num_tokens, 1, key_dim, generator=gen).to(device, dtype)
    scene.k_buffer[scene.new_slots] = new_kv
    fb.kv_pool.k_buffer[LAYER_ID][fb.out_cache_loc] = new_kv
    scale = key_dim ** -0.5
    expected = scene_reference(scene, q, scale, fb.custom_mask)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, None, None, LAYER_ID, fb, scale)
    return out, expected.reshape(num_tokens, -1), fb


@pytest.mark.parametrize("case_name", ["extend", "long_extend", "decode", "target_verify",
                                       "draft_extend"])
def test_mla_backend_matches_reference(case_name):
    case = BACKEND_CASES[case_name]
    out, expected, fb = run_mla_backend_case(
        case, num_heads=16, latent=MLA_LATENT, rope=MLA_ROPE, max_context_len=96,
        gen=torch.Generator().manual_seed(24), decode_config=MLA_DECODE,
        extend_config=SMALL_EXTEND)
    # Every extend of up to 64 new tokens runs split over the prefix with a group of 16 heads
    # (the tile takes a slice of it); the 70-token extend does not.
    assert fb.attn_metadata.split_extend == (case.mode != ForwardMode.DECODE
                                             and case_name != "long_extend")
    assert out.shape == (fb.num_tokens, 16 * MLA_LATENT)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_mla_backend_rejects_wider_values():
    with pytest.raises(ValueError, match="v_head_dim"):
        TritonAttnBackend(16, 1, 48, 64, DEVICE, v_head_dim=64)


MLA_GPU_CASES = real_shape_cases(8192)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads", [128, 16])  # V3 / V2 (128 heads), V2-Lite (16)
@pytest.mark.parametrize("case_name", list(MLA_GPU_CASES))
def test_mla_backend_real_shapes_bf16_gpu(case_name, num_heads):
    out, expected, _ = run_mla_backend_case(
        MLA_GPU_CASES[case_name], num_heads, latent=512, rope=64, max_context_len=8192 + 16,
        gen=torch.Generator().manual_seed(25), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_mla_decode_at_32k_context_gpu():
    case = BackendCase(ForwardMode.DECODE, [32767, 20000], [1, 1], False, False)
    out, expected, _ = run_mla_backend_case(
        case, 128, latent=512, rope=64, max_context_len=32768 + 16,
        gen=torch.Generator().manual_seed(26), dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case_name", ["decode", "target_verify"])
def test_mla_backend_has_no_host_sync_gpu(case_name):
    """MLA's metadata and attention for a steady-state step must not wait on the device."""
    case = MLA_GPU_CASES[case_name]
    backend = TritonAttnBackend(128, 1, 576, 8192 + 16, DEVICE, max_batch_size=8,
                                max_query_len=8, v_head_dim=512)
    fb, _ = build_forward_batch(case, backend, 1, 576, 8192 + 16,
                                torch.Generator().manual_seed(27), torch.bfloat16)
    fb.kv_pool.v_buffer = [k_buffer[..., :512] for k_buffer in fb.kv_pool.k_buffer]
    q = torch.randn(fb.num_tokens, 128, 576, device=DEVICE, dtype=torch.bfloat16)
    out = forward_without_host_sync(backend, fb, q, None, None)
    assert out.shape == (fb.num_tokens, 128 * 512)


@pytest.mark.parametrize("max_context_len, expected", [(96, 3), (4096, 16), (33, 2)])
def test_backend_sizes_its_splits_by_the_context(max_context_len, expected):
    """Without `max_kv_splits` the backend keeps only the splits a sequence of at most
    max_context_len tokens can get (cdiv by the split length, at most 16): a grid of
    unreachable splits would be programs that exit at once; a given count is kept."""
    config = DecodeConfig(block_n=16, min_kv_split_len=32, num_warps=4, num_stages=1, block_h=16)
    backend = TritonAttnBackend(4, 2, 16, max_context_len, DEVICE, max_batch_size=2,
                                decode_config=config)
    assert backend.max_kv_splits == expected
    assert backend._partial_out_buf.shape[2] == expected
    assert TritonAttnBackend(4, 2, 16, 96, DEVICE, max_batch_size=2, decode_config=config,
                             max_kv_splits=16).max_kv_splits == 16


@pytest.mark.parametrize("tokens", [-128, 3, 96])
def test_decode_prefetch_must_be_a_power_of_two(tokens):
    """`DecodeConfig.prefetch_tokens` (0 or a power of two) is checked before any launch."""
    gen = torch.Generator().manual_seed(4)
    scene = make_scene([20], [1], num_kv_heads=2, head_dim=16, generator=gen)
    q = torch.randn(1, 4, 16, generator=gen).to(DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
    with pytest.raises(ValueError, match="prefetch_tokens"):
        decode_attention(q, scene.k_buffer, scene.v_buffer, torch.empty_like(q), kv_indptr,
                         kv_indices, torch.empty(1, 4, 2, 16, device=DEVICE),
                         torch.empty(1, 4, 2, device=DEVICE),
                         torch.zeros(2, dtype=torch.int32, device=DEVICE), 0.25,
                         SMALL_DECODE._replace(prefetch_tokens=tokens))


def test_one_wave_decode_launches_take_their_own_stages(monkeypatch):
    """`DecodeConfig.one_wave_stages`: a decode whose programs fit one wave at a program an SM
    (bs=1 of 8 KV heads in 16 splits: 128 of the 132 SMs the CPU assumes) launches in them;
    a wider grid (bs=2: 256), an fp32 pool and a config without them keep `num_stages`; the
    result is the same either way (bit for bit on a GPU: `test_one_wave_stages_change_no_result_gpu`)."""
    from specserve.engine.attention.triton import kernels

    h100 = DecodeConfig(block_n=128, min_kv_split_len=256, num_warps=4, num_stages=3,
                        one_wave_stages=5)
    cpu = torch.device("cpu")
    assert decode_stages(h100, 128, cpu) == 5 and decode_stages(h100, 133, cpu) == 3
    assert decode_stages(h100._replace(one_wave_stages=0), 1, cpu) == 3
    assert decode_stages(h100, 1, cpu, kv_bytes=1) == 5
    assert decode_stages(h100, 1, cpu, kv_bytes=4) == 3  # fp32 pools: two buffers overflow
    launched = []
    kernel = kernels._decode_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((grid, kwargs["num_stages"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernels, "_decode_kernel", Recorder())
    config = SMALL_DECODE._replace(num_stages=2, one_wave_stages=5)
    gen = torch.Generator().manual_seed(3)
    for bs, dtype in ((1, torch.float16), (2, torch.float16), (1, torch.float32)):
        scene = make_scene([300] * bs, [1] * bs, num_kv_heads=8, head_dim=16, generator=gen,
                           dtype=dtype)
        q = torch.randn(bs, 8, 16, generator=gen).to(DEVICE, dtype)
        kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
        out = torch.empty_like(q)
        decode_attention(q, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                         torch.empty(bs, 8, 16, 16, device=DEVICE),
                         torch.empty(bs, 8, 16, device=DEVICE),
                         torch.zeros(bs * 8, dtype=torch.int32, device=DEVICE), 0.25, config)
        torch.testing.assert_close(out.float(), scene_reference(scene, q, 0.25), atol=2e-3,
                                   rtol=2e-3)
    assert [(grid[0] * grid[1] * grid[2], stages) for grid, stages in launched] == \
        [(128, 5), (256, 2), (128, 2)]


@pytest.mark.gpu
@gpu
def test_one_wave_stages_change_no_result_gpu():
    """The 8B bs=1 decode at 8k tokens (the bf16 default: one wave, five stages) equals the
    same launch in three stages bit for bit."""
    from specserve.engine.attention.triton.kernels import default_decode_config

    config = default_decode_config(128, DEVICE)
    assert config.one_wave_stages == 5 and config.num_stages == 3
    gen = torch.Generator().manual_seed(4)
    scene = make_scene([8192], [1], num_kv_heads=8, head_dim=128, generator=gen,
                       dtype=torch.bfloat16)
    q = torch.randn(1, 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
    outputs = []
    for c in (config, config._replace(one_wave_stages=0)):
        out = torch.empty_like(q)
        decode_attention(q, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                         torch.empty(1, 32, 16, 128, device=DEVICE),
                         torch.empty(1, 32, 16, device=DEVICE),
                         torch.zeros(32, dtype=torch.int32, device=DEVICE), 0.088, c)
        outputs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0].float(), scene_reference(scene, q, 0.088),
                               atol=2e-2, rtol=2e-2)


def test_decode_prefetch_changes_no_result():
    """A config with the L2 prefetch gives the same output, bit for bit, as without it (on the
    CPU the launcher leaves the hint out: the interpreter runs no inline PTX; on a GPU the
    prefetched kernel runs)."""
    gen = torch.Generator().manual_seed(5)
    # (the 10-token sequence is prefetched: at most prefetch_tokens; the others are not)
    scene = make_scene([63, 9, 40], [1] * 3, num_kv_heads=2, head_dim=16, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen).to(DEVICE)
    kv_indptr, kv_indices = scene_kv_indices(scene, decode=True)
    outputs = []
    for config in (SMALL_DECODE, SMALL_DECODE._replace(prefetch_tokens=16)):
        out = torch.empty_like(q)
        decode_attention(q, scene.k_buffer, scene.v_buffer, out, kv_indptr, kv_indices,
                         torch.empty(3, 4, 4, 16, device=DEVICE), torch.empty(3, 4, 4, device=DEVICE),
                         torch.zeros(6, dtype=torch.int32, device=DEVICE), 0.25, config)
        outputs.append(out)
    torch.testing.assert_close(outputs[0], scene_reference(scene, q, 0.25), atol=1e-4, rtol=1e-4)
    assert torch.equal(outputs[0], outputs[1])
