"""DeepSeek's GPU kernels alone: MLA attention and the fused MoE, against the copy bandwidth.

    python bench/mla_moe_kernels.py --out mla_moe.json [--sweep]
    python bench/mla_moe_kernels.py --skip-mla --skip-moe --out align.json [--sweep]

MLA (absorbed form, bf16): one KV head whose key is the 512-dim latent plus the 64-dim rope
key and whose value is the latent (a view of the key buffer), 128 query heads (V2/V3) and 16
(V2-Lite), over a pool holding every request's context in scattered slots. Rows: decode and
an 8-token tree verify per context length and batch size; bandwidth = latent+rope bytes read
once / time. The torch peer gathers the keys and runs two matmuls and a softmax.

MoE (V2-Lite shape: 64 experts top-6, hidden 2048, intermediate 1408, bf16, random routing):
`fused_experts` at several token counts; bandwidth = bytes of the experts the batch touches /
time. The torch peer loops over the touched experts.

MoE alignment (the expert sort before the grouped GEMMs, alone): `align_entries_by_expert`
at T*k = T x 8 entries, E = 66 (6 routed of 64 and V2-Lite's 2 shared slots) and 64 (8 of
64), block_m as `default_moe_config` picks it. (The single-program kernel it replaced was timed
beside it with this script at commit 13f304a: docs/benchmarks.md, fourth round.)

`--sweep` adds launch configurations (MLA decode tiles at the longest context, MoE tiles,
alignment plans) to choose the defaults from.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton.testing

from attention_kernels import copy_bandwidth, graph_seconds  # bench/ is this script's folder
from specserve.engine.attention.triton.kernels import (
    DecodeConfig, decode_attention, default_decode_config, fill_kv_indices, short_extend_attention,
    short_extend_tiling)
from specserve.engine.layers.fused_moe_triton import (
    MoEConfig, align_entries_by_expert, align_plan, default_moe_config, fused_experts)

LATENT, ROPE = 512, 64
KEY_DIM = LATENT + ROPE
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTER = 64, 6, 2048, 1408


def bench(fn, graph: bool = True) -> float:
    """Seconds per call. Replayed from a CUDA graph, as the engine runs these kernels, so that
    the host's launch cost (tens of microseconds for a few small launches) is not timed;
    `graph=False` for a peer that syncs with the host."""
    if graph:
        return graph_seconds(fn)
    return triton.testing.do_bench(fn, rep=200) / 1000


class MLAScene:
    """A pool of `bs` requests of `context` cached tokens (plus `extend` new ones each)."""

    def __init__(self, bs: int, context: int, extend: int, heads: int, device):
        num_slots = bs * (context + extend) + 1
        self.k_buffer = torch.randn(num_slots, 1, KEY_DIM, device=device, dtype=torch.bfloat16)
        self.v_buffer = self.k_buffer[..., :LATENT]  # the MLA pool's view
        table = (torch.randperm(num_slots - 1, device=device) + 1).view(bs, context + extend)
        self.table = table
        self.bs, self.context, self.extend, self.heads = bs, context, extend, heads
        rows = torch.arange(bs, device=device)
        prefix = torch.full((bs,), context, device=device)
        self.kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=device)
        self.kv_indices = torch.empty(bs * (context + 1), dtype=torch.int32, device=device)
        fill_kv_indices(table, rows, prefix, self.kv_indptr, self.kv_indices,
                        decode_token_slots=table[:, context] if extend == 1 else None)
        self.q = torch.randn(bs * extend, heads, KEY_DIM, device=device, dtype=torch.bfloat16)
        self.out = torch.empty(bs * extend, heads, LATENT, device=device, dtype=torch.bfloat16)
        self.scale = 0.1

    def decode(self, config: DecodeConfig, max_kv_splits: int):
        po = torch.empty(self.bs, self.heads, max_kv_splits, LATENT, device=self.q.device)
        pl = torch.empty(self.bs, self.heads, max_kv_splits, device=self.q.device)
        # A counter per (request, slice of heads): at most one slice a head.
        arrivals = torch.zeros(self.bs * self.heads, dtype=torch.int32, device=self.q.device)
        return lambda: decode_attention(self.q, self.k_buffer, self.v_buffer, self.out,
                                        self.kv_indptr, self.kv_indices, po, pl, arrivals,
                                        self.scale, config)

    def tree_verify(self, config: DecodeConfig, max_kv_splits: int):
        device, n = self.q.device, self.bs * self.extend
        po = torch.empty(n, self.heads, max_kv_splits, LATENT, device=device)
        pl = torch.empty(n, self.heads, max_kv_splits, device=device)
        _, head_blocks = short_extend_tiling(self.heads, self.extend, config)
        arrivals = torch.zeros(self.bs * head_blocks, dtype=torch.int32, device=device)
        qo_indptr = torch.arange(0, (self.bs + 1) * self.extend, self.extend, device=device)
        new_slots = self.table[:, self.context:].reshape(-1)
        mask = torch.ones(self.bs, self.extend, self.extend, dtype=torch.bool,
                          device=device).tril()
        return lambda: short_extend_attention(
            self.q, self.k_buffer, self.v_buffer, self.out, qo_indptr, self.kv_indptr,
            self.kv_indices, new_slots, self.extend, self.scale, po, pl, arrivals,
            custom_mask=mask, config=config)

    def torch_decode(self):
        slots = self.table[:, :self.context + 1]

        def run():
            keys = self.k_buffer[slots, 0]                            # [bs, L, 576]
            scores = torch.einsum("bhd,bld->bhl", self.q, keys).float() * self.scale
            probs = scores.softmax(-1).to(keys.dtype)
            return torch.einsum("bhl,bld->bhd", probs, keys[..., :LATENT])
        return run


def mla_rows(args, bandwidth, device):
    rows = []
    contexts = [int(c) for c in args.contexts.split(",")]
    for heads, context, bs in itertools.product(
            (int(h) for h in args.mla_heads.split(",")), contexts,
            (int(b) for b in args.batch_sizes.split(","))):
        decode_scene = MLAScene(bs, context, 1, heads, device)
        verify_scene = MLAScene(bs, context, 8, heads, device)
        default = default_decode_config(KEY_DIM, device, LATENT)
        kernels = {"mla decode": decode_scene.decode(default, args.max_kv_splits),
                   "mla verify-tree-8": verify_scene.tree_verify(default, args.max_kv_splits),
                   "mla decode (torch)": decode_scene.torch_decode()}
        if args.sweep and context in (min(contexts), max(contexts)):  # the ends: it is slow
            # More splits matter most for V2-Lite's 16 heads (one program a split at bs 1);
            # the shortest context shows the split length's trade (parallel tiles against
            # the last split's merge of 16 x 512 fp32 partials a split).
            for block_h, block_n, stages, warps, splits, split_len in itertools.product(
                    (16, 32), (16, 32, 64), (1, 2), (4, 8), (16, 64), (32, 64, 256)):
                if split_len < block_n:
                    continue
                config = DecodeConfig(block_n=block_n, min_kv_split_len=split_len,
                                      num_warps=warps, num_stages=stages, block_h=block_h)
                kernels[f"mla decode h{block_h} n{block_n} st{stages} w{warps} "
                        f"splits{splits} len{split_len}"] = decode_scene.decode(config, splits)
        for name, fn in kernels.items():
            try:
                seconds = bench(fn)
            except Exception as e:  # a sweep config the compiler refuses (shared memory)
                print(f"{name}: {type(e).__name__}: {str(e)[:100]}")
                continue
            read = bs * context * KEY_DIM * 2
            rows.append(dict(kernel=name, heads=heads, context=context, batch_size=bs,
                             us=seconds * 1e6, GBps=read / seconds / 1e9,
                             fraction_of_copy=read / seconds / bandwidth))
            print(json.dumps(rows[-1]), flush=True)
        del decode_scene, verify_scene
        torch.cuda.empty_cache()
    return rows


def torch_experts(x, w13, w2, topk_weights, topk_ids):
    """The peer: one gather, two matmuls and an index_add per touched expert (host-synced)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[expert].t()
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (topk_weights[tokens, slot, None]
                                   * (hidden @ w2[expert].t()).float()))
    return out.to(x.dtype)


def moe_rows(args, bandwidth, device):
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, generator=gen, device=device,
                      dtype=torch.bfloat16) * MOE_HIDDEN ** -0.5
    w2 = torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, generator=gen, device=device,
                     dtype=torch.bfloat16) * MOE_INTER ** -0.5
    expert_bytes = 3 * MOE_HIDDEN * MOE_INTER * 2
    rows = []
    for num_tokens in (int(t) for t in args.moe_tokens.split(",")):
        x = torch.randn(num_tokens, MOE_HIDDEN, generator=gen, device=device,
                        dtype=torch.bfloat16)
        topk_ids = torch.rand(num_tokens, MOE_EXPERTS, generator=gen,
                              device=device).topk(MOE_TOP_K, 1).indices
        topk_weights = torch.rand(num_tokens, MOE_TOP_K, generator=gen, device=device).softmax(-1)
        touched = int(topk_ids.unique().numel())
        kernels = {"moe fused": (None, None),
                   "moe torch loop": (None, lambda: torch_experts(x, w13, w2, topk_weights,
                                                                  topk_ids))}
        if args.sweep:
            for block_m, block_n, block_k, warps, stages in itertools.product(
                    (16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
                kernels[f"moe m{block_m} n{block_n} k{block_k} w{warps} st{stages}"] = (
                    MoEConfig(block_m, block_n, block_k, warps, stages), None)
        for name, (config, fn) in kernels.items():
            fn = fn or (lambda c=config: fused_experts(x, w13, w2, topk_weights, topk_ids, c))
            try:
                seconds = bench(fn, graph=name != "moe torch loop")
            except Exception as e:  # a sweep config the compiler refuses (shared memory)
                print(f"{name}: {type(e).__name__}: {str(e)[:100]}")
                continue
            read = touched * expert_bytes
            rows.append(dict(kernel=name, tokens=num_tokens, experts_touched=touched,
                             config=list(config or default_moe_config(
                                 num_tokens, MOE_TOP_K, MOE_EXPERTS, device)),
                             us=seconds * 1e6, GBps=read / seconds / 1e9,
                             fraction_of_copy=read / seconds / bandwidth))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def align_routing(num_tokens: int, num_experts: int, top_k: int, gen, device) -> torch.Tensor:
    """[T, top_k] ids: distinct routed experts a token; past 64 experts the last E - 64 are
    shared slots every token holds (V2-Lite: 6 of 64 routed, then slots 64 and 65)."""
    routed = min(num_experts, 64)
    shared = num_experts - routed
    ids = torch.rand(num_tokens, routed, generator=gen, device=device).topk(
        top_k - shared, 1).indices
    slots = torch.arange(routed, num_experts, device=device).expand(num_tokens, shared)
    return torch.cat([ids, slots], 1).contiguous()


def align_rows(args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for num_experts, num_tokens in itertools.product(
            (int(e) for e in args.align_experts.split(",")),
            (int(t) for t in args.align_tokens.split(","))):
        top_k = args.align_top_k
        topk_ids = align_routing(num_tokens, num_experts, top_k, gen, device)
        num_entries = topk_ids.numel()
        block_m = default_moe_config(num_tokens, top_k, num_experts, device).block_m
        new = align_entries_by_expert(topk_ids, num_experts, block_m)
        default = align_plan(num_entries, num_experts)
        plans = {"align": default}
        if args.sweep:
            for block_t, max_programs, single in itertools.product(
                    (32, 64, 128), (32, 64, 128, 256), (1, 4, 8)):
                plan = align_plan(num_entries, num_experts, block_t, max_programs, single)
                for warps in sorted({plan.num_warps, 2, 4, 8}):
                    plan = plan._replace(num_warps=warps)
                    plans.setdefault(f"align t{plan.block_t} x{plan.tiles} p{plan.num_programs} "
                                     f"w{warps}", plan)
        for name, plan in plans.items():
            def fn(p=plan):
                return align_entries_by_expert(topk_ids, num_experts, block_m, p)
            if plan != default:  # every plan gives the default's rows
                alt = fn()
                assert torch.equal(alt.sorted_entries, new.sorted_entries), plan
                assert torch.equal(alt.block_experts, new.block_experts), plan
            try:
                seconds = bench(fn)
            except Exception as e:  # a sweep plan the compiler refuses
                print(f"{name}: {type(e).__name__}: {str(e)[:100]}")
                continue
            rows.append(dict(kernel=name, tokens=num_tokens, top_k=top_k, entries=num_entries,
                             experts=num_experts, block_m=block_m,
                             plan=list(plan), us=seconds * 1e6))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,1024,8192,32768")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--mla-heads", default="128,16")
    ap.add_argument("--max-kv-splits", type=int, default=16)
    ap.add_argument("--moe-tokens", default="1,16,64")
    ap.add_argument("--align-tokens", default="16,256,4096", help="T (T x top-k entries)")
    ap.add_argument("--align-experts", default="66,64")
    ap.add_argument("--align-top-k", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="also time launch configs")
    ap.add_argument("--skip-mla", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-align", action="store_true")
    ap.add_argument("--out", default="bench_mla_moe_kernels.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    mla = [] if args.skip_mla else mla_rows(args, bandwidth, device)
    moe = [] if args.skip_moe else moe_rows(args, bandwidth, device)
    align = [] if args.skip_align else align_rows(args, device)
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "date": time.strftime("%Y-%m-%d"), "mla": mla, "moe": moe, "align": align}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}  copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'MLA kernel (one layer)':44} {'heads':>5} {'ctx':>6} {'bs':>3} {'us':>9} "
          f"{'GB/s':>7} {'copy%':>6}")
    for r in sorted(mla, key=lambda r: (r["heads"], r["context"], r["batch_size"], r["us"])):
        print(f"{r['kernel']:44} {r['heads']:5} {r['context']:6} {r['batch_size']:3} "
              f"{r['us']:9.1f} {r['GBps']:7.0f} {100 * r['fraction_of_copy']:6.1f}")
    print(f"\n{'MoE (V2-Lite shape, one layer)':44} {'T':>5} {'experts':>7} {'us':>9} "
          f"{'GB/s':>7} {'copy%':>6}")
    for r in sorted(moe, key=lambda r: (r["tokens"], r["us"])):
        print(f"{r['kernel']:44} {r['tokens']:5} {r['experts_touched']:7} {r['us']:9.1f} "
              f"{r['GBps']:7.0f} {100 * r['fraction_of_copy']:6.1f}")
    print(f"\n{'MoE alignment (one call)':44} {'E':>3} {'T':>5} {'entries':>7} {'bm':>3} "
          f"{'us':>9}")
    for r in sorted(align, key=lambda r: (r["experts"], r["tokens"], r["us"])):
        print(f"{r['kernel']:44} {r['experts']:3} {r['tokens']:5} {r['entries']:7} "
              f"{r['block_m']:3} {r['us']:9.1f}")


if __name__ == "__main__":
    main()
