"""FlashInferAttnBackend (engine/attention/flashinfer.py) against TorchNativeAttnBackend.

CPU (CI): the device metadata (KV slot lists, packed tree masks), the backend's planning and
plumbing over a stand-in for FlashInfer's two wrappers that computes attention from exactly
the buffers FlashInfer's kernels read, the needs_cpu_seq_lens decision and the registry.
GPU (`-m gpu`, needs flashinfer-python 0.5.3): every forward mode on both paths at small and
real shapes in bf16 and fp16 (FlashInfer has no fp32 kernels), no host sync on the sync-free
path, back-to-back plans while the GPU lags, and engine-level greedy and speculative parity.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from typing import NamedTuple

import pytest
import torch

from helpers import make_predictable_pair, random_prompts, steady_state_steps

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.attention.base import decide_needs_cpu_seq_lens
from specserve.engine.attention.flashinfer import (
    FlashInferAttnBackend, build_kv_indices, host_offsets, pack_custom_mask)
from specserve.engine.attention.torch_native import TorchNativeAttnBackend
from specserve.engine.kvcache.pools import ReqToTokenPool, TokenToKVPool
from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows
from specserve.engine.attention.factory import create_attention_backend

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
# Not a module-level importorskip: the CPU tests below must run where flashinfer is absent.
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
NUM_LAYERS, LAYER_ID = 2, 1


# ---------------------------------------------------------------------------------------------
# Scenes: pools holding random prefix K/V, and a ForwardBatch over them
# ---------------------------------------------------------------------------------------------

class Case(NamedTuple):
    mode: ForwardMode
    prefix_lens: list[int]
    extend_lens: list[int]
    tree_mask: bool = False
    kv_override: bool = False  # tree drafting: per-request slot rows instead of req_to_token


CASES = {
    "extend": Case(ForwardMode.EXTEND, [0, 21, 7], [9, 1, 14]),
    "decode": Case(ForwardMode.DECODE, [0, 44, 19], [1, 1, 1]),
    "target_verify": Case(ForwardMode.TARGET_VERIFY, [3, 30, 12], [4, 4, 4], tree_mask=True),
    "draft_extend": Case(ForwardMode.DRAFT_EXTEND, [5, 40, 17], [3, 3, 3]),
    "tree_draft_decode": Case(ForwardMode.DECODE, [9, 0, 33, 20], [1] * 4, kv_override=True),
}
REAL_CASES = {  # 4k contexts: long enough for FlashInfer to split the KV when it may
    "decode": Case(ForwardMode.DECODE, [4095, 1000, 0, 2999, 4000, 17], [1] * 6),
    "extend": Case(ForwardMode.EXTEND, [3584, 0, 1000], [512, 300, 77]),
    "target_verify": Case(ForwardMode.TARGET_VERIFY, [4088, 100, 2048, 0], [8] * 4,
                          tree_mask=True),
    "draft_extend": Case(ForwardMode.DRAFT_EXTEND, [4092, 1, 3000], [4] * 3),
    "tree_draft_decode": Case(ForwardMode.DECODE, [4000, 0, 2500, 70], [1] * 4,
                              kv_override=True),
}
# (sync_free, host lengths given): the synced path with and without seq_lens_cpu (tree-draft
# steps never carry them) and the sync-free path, which ignores them when they are there.
PATHS = {"synced": (False, True), "synced_no_host_lens": (False, False),
         "sync_free": (True, False), "sync_free_given_host_lens": (True, True)}


def random_tree_mask(bs: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, width, width] random visibility where every token sees at least itself."""
    return (torch.rand(bs, width, width, generator=gen) < 0.5) | torch.eye(width, dtype=torch.bool)


def build_batch(case: Case, num_kv_heads: int, head_dim: int, bound: int, gen: torch.Generator,
                dtype: torch.dtype, device: torch.device, host_lens: bool) -> ForwardBatch:
    """Pools with the prefixes' K/V in every layer (new slots empty) and the batch's view.

    Slots are a random permutation, so no request's KV is contiguous; `bound` is the host
    upper bound the GPU-only path passes as max_seq_len (the table width too)."""
    bs = len(case.prefix_lens)
    seq_lens = [p + e for p, e in zip(case.prefix_lens, case.extend_lens)]
    num_slots = sum(seq_lens) + 8
    perm = (torch.randperm(num_slots, generator=gen) + 1).tolist()
    req_to_token = ReqToTokenPool(bs + 1, bound, device)
    rows = torch.randperm(bs, generator=gen) + 1  # row 0 is the padding row
    new_slots = []
    for b, (p, e) in enumerate(zip(case.prefix_lens, case.extend_lens)):
        slots = [perm.pop() for _ in range(p + e)]
        req_to_token.table[rows[b], :p + e] = torch.tensor(slots, device=device)
        new_slots += slots[p:]
    kv_pool = TokenToKVPool(num_slots, NUM_LAYERS, num_kv_heads, head_dim, dtype, device)
    for layer in range(NUM_LAYERS):
        kv_pool.k_buffer[layer].copy_(torch.randn(kv_pool.k_buffer[layer].shape, generator=gen))
        kv_pool.v_buffer[layer].copy_(torch.randn(kv_pool.v_buffer[layer].shape, generator=gen))
        kv_pool.k_buffer[layer][new_slots] = 0
        kv_pool.v_buffer[layer][new_slots] = 0
    num_tokens = sum(case.extend_lens)
    rows = rows.to(device)
    fb = ForwardBatch(
        mode=case.mode, input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(case.prefix_lens, seq_lens)]
                            ).to(device),
        # As the tree drafter builds it for a KV override: row b is branch b's slot list.
        kv_rows=KVRows.by_batch_index(req_to_token.table[rows].clone()) if case.kv_override
        else KVRows(req_to_token.table, rows),
        prefix_lens=torch.tensor(case.prefix_lens, device=device),
        extend_lens_cpu=list(case.extend_lens),
        out_cache_loc=torch.tensor(new_slots, dtype=torch.int64, device=device), kv_pool=kv_pool,
        seq_lens_cpu=seq_lens if host_lens else None,
        max_seq_len=max(seq_lens) if host_lens else bound,
        custom_mask=(random_tree_mask(bs, max(case.extend_lens), gen).to(device)
                     if case.tree_mask else None))
    return fb


def run_against_native(backend: FlashInferAttnBackend, fb: ForwardBatch, num_heads: int,
                       gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer through `backend` and through TorchNative in fp32 over the same pool."""
    num_kv_heads, head_dim = fb.kv_pool.k_buffer[0].shape[1:]
    dtype, device = fb.kv_pool.k_buffer[0].dtype, fb.kv_pool.k_buffer[0].device
    q, k, v = [torch.randn(fb.num_tokens, h, head_dim, generator=gen).to(device, dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads)]
    scale = head_dim ** -0.5
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    # Past init_forward_metadata the scheduler may rewrite the slot tables (base.py).
    table = fb.kv_rows.table
    saved = table.clone()
    table.random_(1, fb.kv_pool.k_buffer[0].shape[0])
    out = backend.forward(q, k, v, LAYER_ID, fb, scale)
    table.copy_(saved)
    torch.testing.assert_close(fb.kv_pool.k_buffer[LAYER_ID][fb.out_cache_loc], k)
    native = TorchNativeAttnBackend(needs_cpu_seq_lens=False)
    native.init_forward_metadata(fb)
    # fp32 queries: the reference upcasts the 16-bit pool, so it is exact on the same K/V.
    expected = native.forward(q.float(), k.float(), v.float(), LAYER_ID, fb, scale)
    return out, expected


# ---------------------------------------------------------------------------------------------
# Device metadata (CPU)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_build_kv_indices_lists_prefix_then_new_slots(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, width = 5, 24
    prefix = torch.randint(0, 16, (bs,), generator=gen)
    extend = torch.randint(1, 8, (bs,), generator=gen).tolist()
    table = torch.randint(1, 1000, (bs + 3, width), generator=gen)
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    new = torch.randint(1000, 2000, (sum(extend),), generator=gen)
    qo_indptr = host_offsets(extend)
    kv_indptr = host_offsets((prefix + torch.tensor(extend)).tolist())
    got = build_kv_indices(table, rows, prefix, new, qo_indptr, kv_indptr, bs * width)
    expected = torch.cat([torch.cat([table[rows[b], :prefix[b]],
                                     new[qo_indptr[b]:qo_indptr[b + 1]]]) for b in range(bs)])
    assert got.dtype == torch.int32 and got.shape == (bs * width,)
    assert torch.equal(got[:kv_indptr[-1]], expected.int())


def unpack_mask(packed: torch.Tensor, mask_indptr: torch.Tensor, b: int, rows: int,
                cols: int) -> torch.Tensor:
    """Request b's [rows, cols] bool matrix as FlashInfer's kernel reads it."""
    offsets = torch.arange(rows * cols)
    byte = packed[mask_indptr[b] + offsets // 8].int()
    return ((byte >> (offsets % 8)) & 1).bool().view(rows, cols)


@pytest.mark.parametrize("extend_lens,prefix_lens", [
    ([4, 4, 4], [3, 30, 0]),         # verify shapes, a request without prefix
    ([8, 8], [1, 13]),               # rows longer than a byte, unaligned row starts
    ([1, 3, 16, 2], [0, 5, 7, 64]),  # ragged widths
])
def test_pack_custom_mask_matches_semantics(extend_lens, prefix_lens):
    gen = torch.Generator().manual_seed(len(prefix_lens))
    bs, width = len(extend_lens), max(extend_lens)
    mask = random_tree_mask(bs, width, gen)
    prefix, extend = torch.tensor(prefix_lens), torch.tensor(extend_lens)
    bound = sum((e * 100 + 7) // 8 for e in extend_lens)  # as from a host bound of 100 keys
    packed, mask_indptr = pack_custom_mask(mask, prefix, extend, bound)
    assert packed.shape == (bound + 1,) and packed.dtype == torch.uint8
    assert mask_indptr.tolist() == host_offsets([(e * (p + e) + 7) // 8 for p, e in
                                                 zip(prefix_lens, extend_lens)]).tolist()
    for b, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        expected = torch.cat([torch.ones(e, p, dtype=torch.bool), mask[b, :e, :e]], dim=1)
        assert torch.equal(unpack_mask(packed, mask_indptr, b, e, p + e), expected)


# ---------------------------------------------------------------------------------------------
# A stand-in for FlashInfer 0.5.3's wrappers (CPU)
# ---------------------------------------------------------------------------------------------

class _FakeWrapper:
    """What the real wrappers do with plan()'s arguments, and a kernel made of torch ops.

    plan() stores the host arrays as the "device" buffers run() reads, as FlashInfer does
    (for a packed custom mask, with the bit offsets of the planned lengths, as FlashInfer's
    packed path computes them). run() attends per request over those buffers with
    FlashInfer's masking rules (causal aligned to the end of the keys; custom bits at byte
    `mask_indptr[b]`, row-major over [qo_len, kv_len]) and refuses what the real kernels get
    wrong: a split-KV plan whose lengths differ from the device kv_indptr (module docstring).
    """

    def __init__(self, float_workspace_buffer, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD"
        self._int_workspace_buffer = torch.empty(64, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.empty(64, dtype=torch.uint8)
        self._sm_scale = None
        self.plans = []

    def _store(self, qo_indptr, paged_kv_indptr, paged_kv_indices, may_split):
        self._qo_indptr_buf = qo_indptr.clone()
        self._paged_kv_indptr_buf = paged_kv_indptr.clone()
        self._paged_kv_indices_buf = paged_kv_indices
        self._planned_kv_lens = (paged_kv_indptr[1:] - paged_kv_indptr[:-1]).tolist()
        self._may_split = may_split

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = (c.squeeze(1).float() for c in paged_kv_cache)
        kv_indptr = self._paged_kv_indptr_buf
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        if self._may_split and kv_lens != self._planned_kv_lens:
            raise AssertionError(f"split-KV plan over lengths {self._planned_kv_lens}, "
                                 f"device lengths {kv_lens}")
        scale = self._sm_scale if self._sm_scale is not None else q.shape[-1] ** -0.5
        group = q.shape[1] // k_cache.shape[1]
        out = torch.empty_like(q)
        for b, kv_len in enumerate(kv_lens):
            q_lo, q_hi = self._qo_indptr_buf[b].item(), self._qo_indptr_buf[b + 1].item()
            slots = self._paged_kv_indices_buf[kv_indptr[b]:kv_indptr[b + 1]].long()
            keys = k_cache[slots].repeat_interleave(group, 1)
            values = v_cache[slots].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].float(), keys) * scale
            out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", scores.masked_fill(
                ~self._visible(b, q_hi - q_lo, kv_len), float("-inf")).softmax(-1), values)
        return out

    def _visible(self, b, qo_len, kv_len):
        return torch.ones(qo_len, kv_len, dtype=torch.bool)


class _FakeDecodeWrapper(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, q_data_type, kv_data_type, non_blocking=True):
        assert page_size == 1 and torch.equal(last_page_len, torch.ones_like(last_page_len))
        self.plans.append(dict(indptr=indptr.clone()))
        self._store(torch.arange(len(last_page_len) + 1, dtype=torch.int32), indptr, indices,
                    may_split=True)  # the decode plan always may split


class _FakePrefillWrapper(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, packed_custom_mask=None,
             causal=False, q_data_type, kv_data_type, disable_split_kv=False,
             non_blocking=True):
        assert page_size == 1
        self.plans.append(dict(indptr=paged_kv_indptr.clone(), disable_split_kv=disable_split_kv,
                               causal=causal, masked=packed_custom_mask is not None))
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, may_split=not disable_split_kv)
        self._causal = causal
        self._custom_mask_buf = packed_custom_mask
        kv_lens = paged_kv_indptr[1:] - paged_kv_indptr[:-1]
        self._mask_indptr_buf = host_offsets(((qo_indptr[1:] - qo_indptr[:-1]) * kv_lens).tolist())

    def _visible(self, b, qo_len, kv_len):
        if self._custom_mask_buf is not None:
            return unpack_mask(self._custom_mask_buf, self._mask_indptr_buf, b, qo_len, kv_len)
        if self._causal:
            return torch.ones(qo_len, kv_len, dtype=torch.bool).tril(kv_len - qo_len)
        return super()._visible(b, qo_len, kv_len)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.__version__ = "0.5.3"
    module.BatchDecodeWithPagedKVCacheWrapper = _FakeDecodeWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = _FakePrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case_name", list(CASES))
def test_backend_on_fake_flashinfer_matches_torch_native(fake_flashinfer, case_name, path):
    case, (sync_free, host_lens) = CASES[case_name], PATHS[path]
    gen = torch.Generator().manual_seed(3)
    backend = FlashInferAttnBackend(4, 2, 64, "cpu", sync_free=sync_free, workspace_bytes=64)
    fb = build_batch(case, 2, 64, bound=64, gen=gen, dtype=torch.bfloat16,
                     device=torch.device("cpu"), host_lens=host_lens)
    out, expected = run_against_native(backend, fb, 4, gen)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)

    exact = host_lens and not sync_free
    seq_lens = [p + e for p, e in zip(case.prefix_lens, case.extend_lens)]
    is_decode = case.mode == ForwardMode.DECODE
    used, idle = (backend._decode, backend._prefill) if exact and is_decode else \
        (backend._prefill, backend._decode)
    assert len(used.plans) == 1 and not idle.plans
    plan = used.plans[0]
    # The plan saw the exact lengths, or the host bound max_seq_len for every request.
    planned = seq_lens if exact else [fb.max_seq_len] * len(seq_lens)
    assert plan["indptr"].tolist() == host_offsets(planned).tolist()
    if used is backend._prefill:
        assert plan["disable_split_kv"] == (not exact)
        assert plan["masked"] == case.tree_mask and plan["causal"] == (not case.tree_mask)


@pytest.mark.parametrize("case_name", ["decode", "target_verify", "draft_extend"])
def test_sync_free_plan_at_the_bound_is_made_once_and_kept(fake_flashinfer, case_name):
    """What CUDA graphs rely on: forwards at the max_context_len bound with one query length
    reuse one plan (made before capture), yet each attends over its own slots, lengths and
    tree mask; forwards below the bound plan afresh on the shared wrapper."""
    case = CASES[case_name]
    gen = torch.Generator().manual_seed(11)
    backend = FlashInferAttnBackend(4, 2, 64, "cpu", sync_free=True, max_context_len=64,
                                    max_query_len=4, workspace_bytes=64)
    assert backend.supports_cuda_graphs
    kept = None
    for prefix_shift in (0, 5, 2):  # different lengths, slots and masks each time
        shifted = case._replace(prefix_lens=[p + prefix_shift for p in case.prefix_lens])
        fb = build_batch(shifted, 2, 64, bound=64, gen=gen, dtype=torch.bfloat16,
                         device=torch.device("cpu"), host_lens=False)
        out, expected = run_against_native(backend, fb, 4, gen)
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
        assert list(backend._kept_plans) == [(len(case.prefix_lens), case.extend_lens[0],
                                              case.tree_mask)]
        kept = kept or backend._kept_plans[next(iter(backend._kept_plans))]
        assert backend._kept_plans[next(iter(backend._kept_plans))] is kept
    assert len(kept.plans) == 1 and not backend._prefill.plans and not backend._decode.plans

    below = build_batch(case, 2, 64, bound=64, gen=gen, dtype=torch.bfloat16,
                        device=torch.device("cpu"), host_lens=False)
    below.max_seq_len = 63  # an eager forward's own bound
    run_against_native(backend, below, 4, gen)
    assert len(backend._prefill.plans) == 1 and len(kept.plans) == 1


def test_only_the_sync_free_plan_supports_cuda_graphs(fake_flashinfer):
    assert not FlashInferAttnBackend(4, 2, 64, "cpu", max_context_len=64).supports_cuda_graphs
    assert not FlashInferAttnBackend(4, 2, 64, "cpu", sync_free=True).supports_cuda_graphs
    wide = build_batch(CASES["extend"], 2, 64, bound=64, gen=torch.Generator().manual_seed(1),
                       dtype=torch.bfloat16, device=torch.device("cpu"), host_lens=False)
    backend = FlashInferAttnBackend(4, 2, 64, "cpu", sync_free=True, max_context_len=64,
                                    max_query_len=4, workspace_bytes=64)
    backend.init_forward_metadata(wide)  # ragged prefill at the bound: planned, not kept
    assert not backend._kept_plans and len(backend._prefill.plans) == 1


def test_backend_refuses_a_forward_whose_plan_was_replaced(fake_flashinfer):
    gen = torch.Generator().manual_seed(5)
    backend = FlashInferAttnBackend(4, 2, 64, "cpu")
    first, second = (build_batch(CASES[name], 2, 64, 64, gen, torch.bfloat16, torch.device("cpu"),
                                 host_lens=True) for name in ("extend", "decode"))
    backend.init_forward_metadata(first)
    backend.init_forward_metadata(second)
    q = torch.zeros(first.num_tokens, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(first.num_tokens, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="replaced"):
        backend.forward(q, kv, kv, 0, first, 0.125)


def test_backend_replaces_the_pinned_plan_staging(fake_flashinfer):
    backend = FlashInferAttnBackend(4, 2, 64, "cpu")
    for wrapper in (backend._decode, backend._prefill):
        staging = wrapper._pin_memory_int_workspace_buffer
        assert staging is not None and staging.shape == wrapper._int_workspace_buffer.shape
        assert not staging.is_pinned()


def test_backend_rejects_what_flashinfer_cannot_run(fake_flashinfer):
    with pytest.raises(ValueError, match="head_dim"):
        FlashInferAttnBackend(4, 2, 16, "cpu")  # FA2 prefill needs head_dim >= 64
    with pytest.raises(ValueError, match="query heads per KV head"):
        FlashInferAttnBackend(12, 2, 64, "cpu")
    backend = FlashInferAttnBackend(4, 2, 64, "cpu")
    fb = build_batch(CASES["extend"], 2, 64, 64, torch.Generator().manual_seed(1), torch.float32,
                     torch.device("cpu"), host_lens=True)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        backend.init_forward_metadata(fb)
    fake_flashinfer.__version__ = "0.6.0"
    with pytest.raises(RuntimeError, match="0.5.3"):
        FlashInferAttnBackend(4, 2, 64, "cpu")


def test_needs_cpu_seq_lens_decision_with_flashinfer(fake_flashinfer):
    synced = FlashInferAttnBackend(4, 2, 64, "cpu")
    sync_free = FlashInferAttnBackend(4, 2, 64, "cpu", sync_free=True)
    assert FlashInferAttnBackend.needs_cpu_seq_lens  # class default: plan on host lengths
    assert synced.needs_cpu_seq_lens and not sync_free.needs_cpu_seq_lens
    gpu_only_torch = TorchNativeAttnBackend(needs_cpu_seq_lens=False)
    assert decide_needs_cpu_seq_lens([synced, None]) is True
    assert decide_needs_cpu_seq_lens([gpu_only_torch, synced]) is True  # target or draft
    assert decide_needs_cpu_seq_lens([sync_free, None]) is False
    assert decide_needs_cpu_seq_lens([sync_free, gpu_only_torch]) is False
    assert decide_needs_cpu_seq_lens([sync_free, sync_free], force=True) is True


REGISTRY_ARGS = dict(num_heads=4, num_kv_heads=2, head_dim=64, max_context_len=64,
                     max_batch_size=8)


def test_registry_names_the_extra_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises
    with pytest.raises(ValueError, match=r"pip install specserve\[flashinfer\]"):
        create_attention_backend("flashinfer", torch.device("cpu"), needs_cpu_seq_lens=None,
                                 **REGISTRY_ARGS)


@pytest.mark.parametrize("needs_cpu,sync_free", [(None, False), (True, False), (False, True)])
def test_registry_builds_flashinfer(fake_flashinfer, needs_cpu, sync_free):
    backend = create_attention_backend("flashinfer", torch.device("cpu"),
                                       needs_cpu_seq_lens=needs_cpu, **REGISTRY_ARGS)
    assert isinstance(backend, FlashInferAttnBackend)
    assert backend.sync_free == sync_free and backend.needs_cpu_seq_lens == (not sync_free)


@needs_flashinfer
def test_fake_wrappers_accept_what_flashinfer_accepts():
    """The stand-in's plan() keywords exist in FlashInfer's (no GPU needed)."""
    import inspect

    import flashinfer

    for fake, real in ((_FakeDecodeWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper),
                       (_FakePrefillWrapper, flashinfer.BatchPrefillWithPagedKVCacheWrapper)):
        real_params = list(inspect.signature(real.plan).parameters)
        fake_params = inspect.signature(fake.plan).parameters
        positional = [name for name, p in fake_params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert real_params[:len(positional)] == positional
        assert set(fake_params) <= set(real_params)


# ---------------------------------------------------------------------------------------------
# GPU: the real kernels
# ---------------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
TOLERANCE = {torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
             torch.float16: dict(atol=4e-3, rtol=4e-3)}


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case_name", list(CASES))
def test_gpu_small_shapes_match_torch_native(case_name, path, dtype):
    case, (sync_free, host_lens) = CASES[case_name], PATHS[path]
    gen = torch.Generator().manual_seed(7)
    backend = FlashInferAttnBackend(4, 2, 128, CUDA, sync_free=sync_free)
    fb = build_batch(case, 2, 128, bound=80, gen=gen, dtype=dtype, device=CUDA,
                     host_lens=host_lens)
    out, expected = run_against_native(backend, fb, 4, gen)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case_name", list(REAL_CASES))
def test_gpu_real_shapes_match_torch_native(case_name, path, dtype):
    case, (sync_free, host_lens) = REAL_CASES[case_name], PATHS[path]
    gen = torch.Generator().manual_seed(8)
    backend = FlashInferAttnBackend(32, 8, 128, CUDA, sync_free=sync_free)
    fb = build_batch(case, 8, 128, bound=4104, gen=gen, dtype=dtype, device=CUDA,
                     host_lens=host_lens)
    out, expected = run_against_native(backend, fb, 32, gen)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("case_name", list(REAL_CASES))
def test_gpu_sync_free_path_never_syncs(case_name):
    gen = torch.Generator().manual_seed(9)
    backend = FlashInferAttnBackend(32, 8, 128, CUDA, sync_free=True)
    fb = build_batch(REAL_CASES[case_name], 8, 128, bound=4104, gen=gen, dtype=torch.bfloat16,
                     device=CUDA, host_lens=False)
    q, k, v = [torch.randn(fb.num_tokens, h, 128, generator=gen).to(CUDA, torch.bfloat16)
               for h in (32, 8, 8)]
    for debug_mode in ("default", "error"):  # the first round loads FlashInfer's modules
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(debug_mode)
        try:
            backend.init_forward_metadata(fb)
            backend.forward(q, k, v, LAYER_ID, fb, 128 ** -0.5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not backend._prefill._pin_memory_int_workspace_buffer.is_pinned()


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("sync_free", [False, True], ids=["synced", "sync_free"])
def test_gpu_plans_while_the_gpu_lags(sync_free):
    """Plan and launch forward A, then plan B while A's plan copy still waits behind a busy
    stream (the overlap scheduler's pattern): A must still run with A's plan."""
    gen = torch.Generator().manual_seed(11)
    backend = FlashInferAttnBackend(32, 8, 128, CUDA, sync_free=sync_free)
    batches = [build_batch(REAL_CASES[name], 8, 128, 4104, gen, torch.bfloat16, CUDA,
                           host_lens=True) for name in ("extend", "target_verify", "draft_extend")]
    inputs = [[torch.randn(fb.num_tokens, h, 128, generator=gen).to(CUDA, torch.bfloat16)
               for h in (32, 8, 8)] for fb in batches]
    scale = 128 ** -0.5
    expected = []
    for fb, (q, k, v) in zip(batches, inputs):  # one at a time (this also loads the modules)
        backend.init_forward_metadata(fb)
        expected.append(backend.forward(q, k, v, LAYER_ID, fb, scale))
        torch.cuda.synchronize()
    torch.cuda._sleep(1 << 28)  # keep the stream busy while the host plans ahead
    outs = []
    for fb, (q, k, v) in zip(batches, inputs):
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, LAYER_ID, fb, scale))
    torch.cuda.synchronize()
    for out, ref in zip(outs, expected):
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# GPU: the engine
# ---------------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=4, topk=4, num_draft_tokens=8)
ENGINE = dict(device="cuda", dtype="float16", cuda_graph=False, max_total_tokens=1 << 16)
MARGIN = 0.02  # fp32 top-2 logit gap under which 16-bit engines may legitimately disagree


def make_flashinfer_pair(root: str, *, attn_scale: float = 0.05, seed: int = 0) -> tuple[str, str]:
    """helpers.make_predictable_pair with head_dim 128 (FlashInfer needs >= 64; the shared tiny
    models have 16): drafts are partly accepted."""
    return make_predictable_pair(root, attn_scale=attn_scale, seed=seed, hidden_size=512, intermediate_size=1024)


@pytest.fixture(scope="module")
def flashinfer_pair(tmp_path_factory):
    return make_flashinfer_pair(str(tmp_path_factory.mktemp("fi_pair")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, seed=21, max_len=50)


@pytest.fixture(scope="module")
def reference(flashinfer_pair, prompts):
    """fp32 greedy tokens (transformers, EOS allowed as the engine's ignore_eos does), each
    stopped before its first step whose top-2 logit gap is under MARGIN: 16-bit engines may
    pick either token there (on random weights a few steps are near-ties)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(flashinfer_pair[0], dtype=torch.float32)
    reference = []
    for prompt in prompts:
        ids, tokens = list(prompt), []
        with torch.no_grad():
            while len(tokens) < GREEDY.max_new_tokens:
                top2 = model(torch.tensor([ids])).logits[0, -1].topk(2)
                if top2.values[0] - top2.values[1] < MARGIN:
                    break
                tokens.append(int(top2.indices[0]))
                ids.append(tokens[-1])
        reference.append(tokens)
    # Enough left to compare.
    assert sum(map(len, reference)) >= 0.3 * len(prompts) * GREEDY.max_new_tokens
    return reference


def assert_follows(outputs: list[list[int]], reference: list[list[int]]) -> None:
    assert [out[:len(ref)] for out, ref in zip(outputs, reference)] == reference


def _generate(engine, prompts):
    return [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)]


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("needs_cpu", [True, False], ids=["synced", "sync_free"])
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_engine_greedy_matches_torch_backend(flashinfer_pair, make_engine, prompts, reference,
                                                 needs_cpu, overlap):
    target, _ = flashinfer_pair
    torch_backend = make_engine(target, attention_backend="torch", **ENGINE)
    assert_follows(_generate(torch_backend, prompts), reference)
    engine = make_engine(target, attention_backend="flashinfer", enable_overlap=overlap,
                         needs_cpu_seq_lens=needs_cpu, **ENGINE)
    assert engine.core.needs_cpu_seq_lens == needs_cpu and not engine.core.uses_cuda_graphs
    assert_follows(_generate(engine, prompts), reference)


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("needs_cpu", [True, False], ids=["synced", "sync_free"])
def test_gpu_engine_spec_matches_plain(flashinfer_pair, make_engine, prompts, reference, shape,
                                       needs_cpu):
    target, head = flashinfer_pair
    plain = make_engine(target, attention_backend="flashinfer", needs_cpu_seq_lens=needs_cpu,
                        **ENGINE)
    assert_follows(_generate(plain, prompts), reference)
    engine = make_engine(target, attention_backend="flashinfer", needs_cpu_seq_lens=needs_cpu,
                         spec=SpecConfig(algorithm="eagle", draft_model=head, **shape), **ENGINE)
    assert engine.core.needs_cpu_seq_lens == needs_cpu
    assert_follows(_generate(engine, prompts), reference)
    assert engine.metrics.mean_accept_length > 1.5


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_gpu_engine_sync_free_steady_state_has_no_blocking_sync(flashinfer_pair, make_engine,
                                                                shape):
    target, head = flashinfer_pair
    engine = make_engine(target, attention_backend="flashinfer", needs_cpu_seq_lens=False,
                         spec=SpecConfig(algorithm="eagle", draft_model=head, **shape), **ENGINE)
    steady_state_steps(engine, [5, 6, 7, 8])


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_gpu_engine_cuda_graphs_match_eager(flashinfer_pair, make_engine, prompts, reference, spec):
    """The sync-free plan under CUDA graphs: same tokens as eager FlashInfer (and the fp32
    reference), decode and speculative steps replayed from graphs, no blocking sync."""
    target, head = flashinfer_pair
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    common = dict(ENGINE, attention_backend="flashinfer", needs_cpu_seq_lens=False, spec=spec_cfg,
                  max_running_requests=16)
    eager = _generate(make_engine(target, **common), prompts)
    graphed_engine = make_engine(target, **dict(common, cuda_graph=True))
    assert graphed_engine.core.uses_cuda_graphs
    graphed = _generate(graphed_engine, prompts)
    assert graphed == eager
    assert_follows(graphed, reference)


@needs_flashinfer
@pytest.mark.gpu
def test_gpu_engine_refuses_graphs_with_the_synced_plan(flashinfer_pair, make_engine):
    with pytest.raises(ValueError, match="cuda_graph"):
        make_engine(flashinfer_pair[0], **dict(ENGINE, attention_backend="flashinfer",
                                               needs_cpu_seq_lens=True, cuda_graph=True))
