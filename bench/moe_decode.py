"""The decode MoE kernel (engine/layers/moe_decode.py) against the grouped kernel
(fused_moe_triton.py) for decode-sized batches, and the fp32 router's cost, on one GPU.

    python bench/moe_decode.py --out moe_decode.json [--sweep]

Shapes (bf16 experts, random routing; one MoE layer): DeepSeek-V2-Lite (64 experts top-6,
hidden 2048, intermediate 1408) and Qwen3-30B-A3B (128 experts top-8, hidden 2048,
intermediate 768), at M = 1, 4, 16 tokens. Bandwidth = bytes of the distinct experts the M
tokens picked (each read once: gate, up and down rows) / time, against the device-to-device
copy bandwidth measured in this run. Kernels are replayed from CUDA graphs, as the engine runs
them. The router rows time `Router` (deepseek.py) as the models run it (at M <= 16
`moe_router.router_softmax_topk`: the fp32 logits of the bf16 hidden state against its fp32
weight, softmax, top-k, renormalised for Qwen3, in one launch), the unfused form it replaced
(x.float(), cuBLAS's fp32 gemv, then `moe_router.softmax_topk`), and the torch ops before that
(the bf16 weight cast at every call, softmax, top-k, sum, division, scaling), per layer.

`--sweep` adds decode-kernel launch configurations (N/K tiles, warps, stages) to choose the
defaults from: each kernel's (gate/up, down) with the other at its default, at the token
counts of `--sweep-tokens`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from attention_kernels import copy_bandwidth, graph_seconds  # bench/ is this script's folder
from specserve.engine.layers.fused_moe_triton import fused_experts
from specserve.engine.layers.moe_decode import DecodeMoEConfig, decode_fused_experts, default_decode_config
from specserve.engine.layers.moe_router import softmax_topk
from specserve.engine.models.deepseek import Router
from specserve.engine.models.model_config import ModelConfig

# name -> (experts, top-k, hidden, intermediate, config.json fields of the router)
SHAPES = {
    "deepseek-v2-lite": (64, 6, 2048, 1408, dict(
        architectures=["DeepseekV2ForCausalLM"], n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, topk_method="greedy")),
    "qwen3-30b-a3b": (128, 8, 2048, 768, dict(
        architectures=["Qwen3MoeForCausalLM"], num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, head_dim=128)),
}




def router(shape: str, device) -> Router:
    _, _, hidden, _, fields = SHAPES[shape]
    cfg = ModelConfig.from_dict(dict(fields, vocab_size=1000, hidden_size=hidden, intermediate_size=1024,
                                     num_hidden_layers=1, num_attention_heads=16))
    module = Router(cfg).to(device, torch.bfloat16)
    with torch.no_grad():
        module.weight.normal_(0, 0.02)
    return module


def torch_router(x: torch.Tensor, weight: torch.Tensor, moe) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing before moe_router.py: a bf16 weight cast per call, then five torch ops."""
    logits = F.linear(x.float(), weight.float())
    weights, ids = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), k=moe.top_k, dim=-1, sorted=False)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * moe.routed_scaling_factor, ids


def rows_for(shape: str, tokens: list[int], sweep: bool, sweep_tokens: list[int], bandwidth: float,
             device) -> list[dict]:
    num_experts, top_k, hidden, inter, _ = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device,
                      dtype=torch.bfloat16) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device,
                     dtype=torch.bfloat16) * inter ** -0.5
    gate = router(shape, device)
    weight_bf16 = gate.weight.to(torch.bfloat16)
    expert_bytes = 3 * hidden * inter * 2
    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16)
        topk_ids = torch.rand(num_tokens, num_experts, generator=gen, device=device).topk(top_k, 1).indices
        topk_weights = torch.rand(num_tokens, top_k, generator=gen, device=device).softmax(-1)
        touched = int(topk_ids.unique().numel())
        kernels = {"decode": lambda c=None: decode_fused_experts(x, w13, w2, topk_weights, topk_ids, c),
                   "grouped": lambda: fused_experts(x, w13, w2, topk_weights, topk_ids)}
        configs = {"decode": default_decode_config(device), "grouped": None}
        if sweep and num_tokens in sweep_tokens:
            # Each kernel's configs with the other kernel at its default: the differences
            # between rows of one kernel are that kernel's.
            for block_n, block_k, warps, stages in itertools.product((16, 32, 64), (64, 128, 256),
                                                                     (2, 4), (2, 3, 4)):
                config = DecodeMoEConfig(block_n, block_k, warps, stages)
                for part in ("gate_up", "down"):
                    name = f"decode {part} n{block_n} k{block_k} w{warps} st{stages}"
                    pair = (config, None) if part == "gate_up" else (None, config)
                    kernels[name] = lambda p=pair: decode_fused_experts(x, w13, w2, topk_weights, topk_ids, *p)
                    configs[name] = config
        for name, fn in kernels.items():
            try:
                seconds = graph_seconds(fn)
            except Exception as e:  # a sweep config the compiler refuses (shared memory)
                print(f"{name}: {type(e).__name__}: {str(e)[:100]}")
                continue
            read = touched * expert_bytes
            rows.append(dict(shape=shape, kernel=name, tokens=num_tokens, experts_touched=touched,
                             config=None if configs[name] is None else list(configs[name]),
                             us=seconds * 1e6, GBps=read / seconds / 1e9,
                             fraction_of_copy=read / seconds / bandwidth))
            print(json.dumps(rows[-1]), flush=True)
        read = gate.weight.numel() * gate.weight.element_size()
        moe = gate.moe
        for name, fn in (("router", lambda: gate(x)),
                         ("router, gemv then softmax_topk", lambda: softmax_topk(
                             F.linear(x.float(), gate.weight), moe.top_k, moe.norm_topk_prob,
                             moe.routed_scaling_factor)),
                         ("router, torch ops (before)", lambda: torch_router(x, weight_bf16, gate.moe))):
            seconds = graph_seconds(fn)
            rows.append(dict(shape=shape, kernel=name, tokens=num_tokens, experts_touched=None, config=None,
                             us=seconds * 1e6, GBps=read / seconds / 1e9, fraction_of_copy=read / seconds / bandwidth))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--sweep", action="store_true", help="also time decode-kernel launch configs")
    ap.add_argument("--sweep-tokens", default="1", help="the token counts the sweep runs at")
    ap.add_argument("--out", default="bench_moe_decode.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    tokens = [int(t) for t in args.tokens.split(",")]
    with torch.inference_mode():  # as the engine runs the router (no autograd graph)
        rows = [r for shape in args.shapes.split(",")
                for r in rows_for(shape, tokens, args.sweep, [int(t) for t in args.sweep_tokens.split(",")],
                                  bandwidth, device)]
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}  copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'shape':17} {'kernel (one layer)':40} {'M':>3} {'experts':>7} {'us':>8} {'GB/s':>7} {'copy%':>6}")
    best = sorted(rows, key=lambda r: (r["shape"], r["tokens"], r["us"]))
    for r in (r for r in best if not r["kernel"].startswith("decode ")):  # sweep rows: below
        print(f"{r['shape']:17} {r['kernel']:40} {r['tokens']:3} {r['experts_touched'] or '':>7} "
              f"{r['us']:8.1f} {r['GBps']:7.0f} {100 * r['fraction_of_copy']:6.1f}")
    if args.sweep:
        print("\nfastest decode configs:")
        sweep_rows = sorted((r for r in best if r["kernel"].startswith("decode ")),
                            key=lambda r: (r["shape"], r["tokens"], r["kernel"].split()[1], r["us"]))
        for _, group in itertools.groupby(
                sweep_rows, key=lambda r: (r["shape"], r["tokens"], r["kernel"].split()[1])):
            for r in list(group)[:3]:
                shape, m = r["shape"], r["tokens"]
                print(f"{shape:17} M={m:<3} {r['kernel']:40} {r['us']:8.1f} us")


if __name__ == "__main__":
    main()
