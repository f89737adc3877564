"""Static-batch decode benchmark: specserve vs the bandwidth limit (and peers), on one GPU.

    python bench/one_batch.py --models llama-8b --batch-sizes 1 --modes plain,chain --out out.json

Models are Llama shapes, the DeepSeek-V2-Lite shape (MLA + 64 experts top-6), Qwen3-30B-A3B
(128 experts top-8) or Mixtral-8x7B (8 experts top-2) with random bf16 weights built in memory (`load_format="dummy"`), or the bundled demo pair. Speculative rows on random weights force the accept length with the
bench-only `SpecConfig.bench_force_accept_len` (real acceptance needs real weights).
The draft is an EAGLE-3 head of the target's width, or with `--draft nextn` (DeepSeek shapes)
the target's own V3-style multi-token-prediction layer (MLA + MoE of the target's shape):

    python bench/one_batch.py --models deepseek-v2-lite --batch-sizes 1 --modes plain,chain --draft nextn

The bs=1 limit: bytes of every weight a decode step reads (all but the embedding table; of a
MoE layer's routed experts only the top-k one token picks) / device-to-device copy bandwidth
measured in this run. The step limit adds the KV a plain decode
step reads (every request's context at its mean length over the run): at long contexts the KV,
not the weights, is most of the bytes; with MoE it counts the experts a batch of that size
is expected to touch (uniform routing: E * (1 - (1 - k/E)^bs) distinct experts per layer).
"""
from __future__ import annotations

import argparse
import itertools
import gc
import json
import os
import shutil
import tempfile
import time
import warnings
from typing import NamedTuple, Optional

import torch

from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig
from specserve.engine.builder import demo_models_dir
from specserve.engine.kvcache.pools import MLATokenToKVPool
from specserve.engine.models.deepseek import Experts

SHAPES = {
    # Llama-3.3-70B, Llama-3.1-8B and Llama-3.2-1B shapes (random weights).
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # Llama-3.1-405B with 16 of its 126 layers: one 8-GPU node's model, cut to fit 4 GPUs in FP8
    # ([E33]: the tp code and kernels at its widths; per-rank shards as at tp=4).
    "llama-405b-16l": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=16,
                           num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                           tie_word_embeddings=False),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    # A toy Llama (random weights) whose forwards are fast even on a CPU: serving benchmarks
    # there (bench/serving.py --launch tiny --device cpu) then see the host's and the server's
    # costs at ratios nearer a GPU's than the demo pair's.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=8192, tie_word_embeddings=False),
    # DeepSeek-V2-Lite (random weights): MLA without q LoRA, 64 routed experts top-6, 2 shared.
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        vocab_size=102400, tie_word_embeddings=False, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                                          "beta_slow": 1}),
    # DeepSeek-V3 with its first 4 layers (3 dense + 1 MoE of 256 experts top-8): the layer
    # group that repeats, small enough for one GPU in bf16 (~27 GB) and in FP8.
    "deepseek-v3-4l": dict(
        architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
        topk_method="noaux_tc", n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        scoring_func="sigmoid", vocab_size=129280, tie_word_embeddings=False, max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # Qwen3-30B-A3B (random weights): GQA with per-head q/k norm, 128 routed experts top-8
    # renormalised, every layer MoE.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None),
    # Mixtral-8x7B (random weights): 8 experts top-2 of width 14336. 93 GB of bf16 weights:
    # --tp-sizes 2 on 80 GB cards.
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1000000.0, rope_scaling=None, sliding_window=None),
}
# EAGLE-3 heads of the DeepSeek shapes: a Llama layer of the target's width. Qwen3-MoE's and
# Mixtral's heads take the target's own attention fields and its intermediate_size (Qwen3's
# dense width, 6144; Mixtral's expert width) as they are: no override.
DRAFT_OVERRIDES = {"deepseek-v2-lite": dict(num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
                                            max_position_embeddings=131072, rope_scaling=None),
                   "deepseek-v3-4l": dict(num_attention_heads=56, num_key_value_heads=8, intermediate_size=18432,
                                          max_position_embeddings=131072, rope_scaling=None)}
ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}

class BackendRow(NamedTuple):
    attention_backend: str
    needs_cpu_seq_lens: Optional[bool]  # None: decided by the backends
    cuda_graph: bool


BACKEND_ROWS = {
    "triton": BackendRow("triton", None, True),
    "triton-eager": BackendRow("triton", None, False),
    "flashinfer": BackendRow("flashinfer", True, False),  # host-synced plan (may split the KV)
    "flashinfer-syncfree": BackendRow("flashinfer", False, True),
    "flashinfer-syncfree-eager": BackendRow("flashinfer", False, False),
}
SPEC_MODES = {"chain": dict(num_steps=3, topk=1, num_draft_tokens=4),
              "tree": dict(num_steps=5, topk=4, num_draft_tokens=8)}


def write_shape(root: str, name: str, tokenizer_dir: Optional[str] = None) -> tuple[str, str]:
    """config.json folders for the target shape and an EAGLE-3 head of the same width. With
    `tokenizer_dir` (the demo pair's) the target gets that tokenizer and its vocabulary size,
    so that servers of the shape take and return text."""
    target = os.path.join(root, name)
    os.makedirs(target, exist_ok=True)
    cfg = dict(dict(architectures=["LlamaForCausalLM"], max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_theta=500000.0, rope_scaling=ROPE), **SHAPES[name], bos_token_id=1, eos_token_id=2)
    if tokenizer_dir is not None:
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, file), target)
        vocab = json.load(open(os.path.join(tokenizer_dir, "config.json")))["vocab_size"]
        cfg.update(vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    if "kv_lora_rank" in cfg:  # DeepSeek: a V3-style NextN layer after the last one (--draft nextn)
        cfg["num_nextn_predict_layers"] = 1
    json.dump(cfg, open(os.path.join(target, "config.json"), "w"))
    draft = os.path.join(root, name + "-eagle3")
    os.makedirs(draft, exist_ok=True)
    dcfg = dict(cfg, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                draft_vocab_size=min(32000, cfg["vocab_size"]),
                tie_word_embeddings=False, **DRAFT_OVERRIDES.get(name, {}))
    json.dump(dcfg, open(os.path.join(draft, "config.json"), "w"))
    return target, draft


def weight_bytes(engine: Engine, tokens: int = 1) -> float:
    """Bytes a decode step of `tokens` tokens reads: every parameter but the embedding (a tied
    lm_head counts); of routed experts, those the tokens are expected to pick (top-k for one),
    and the shared experts' slots of the same stacks (every step)."""
    model = engine.core.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    routed = {id(p) for m in experts for p in m.parameters()}
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n != "embed_tokens.weight" and id(p) not in routed)
    if model.config.tie_word_embeddings:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    if experts:
        moe = model.config.moe
        picked = (moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** tokens)
                  + moe.num_shared_experts)
        total += sum(picked * (m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size() for m in experts)
        total += sum(picked * (s[0].numel() * s.element_size()) for m in experts
                     for s in (m.w13_scale, m.w2_scale) if s is not None)
    return total


def kv_bytes_per_token(engine: Engine) -> int:
    """Target KV bytes of one context token (this rank's heads, every layer, K and V; MLA's
    latent || rope once: its V is a view of K)."""
    pool = engine.core.kv_pool
    buffers = pool.k_buffer if isinstance(pool, MLATokenToKVPool) else (*pool.k_buffer, *pool.v_buffer)
    return sum(buf[0].numel() * buf.element_size() for buf in buffers)


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), best of several 1 GiB copies."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * (1 << 30) / best


class DecodeWindow:
    """The decode window of `bs` requests launched together: it opens at the step that carries
    the last request's first token (every request past its prefill: a batch of long prompts
    prefills in several chunks, and steps before its last one are prefill, not decode) and
    closes at the last token; `tokens` counts the new tokens after it opens, `all_tokens`
    every token (for the accept length: a request decoding while others prefill verifies too).
    bench/drafters.py times its batch rows by it too."""

    def __init__(self, bs: int):
        self.bs = bs
        self.prefilled: set[str] = set()
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.tokens = self.all_tokens = 0

    def add(self, outs, now: float) -> bool:
        """One step's outputs at `now`; True at the step that opens the window."""
        new = sum(len(o.new_token_ids) for o in outs)
        self.all_tokens += new
        if self.first is None:
            self.prefilled.update(o.rid for o in outs if o.new_token_ids)
            if len(self.prefilled) < self.bs:
                return False
            self.first = now
            return True
        self.tokens += new
        if new:
            self.last = now
        return False


def run_one(engine: Engine, bs: int, prompt_len: int, steps: int) -> dict:
    """Decode speed of `bs` requests launched together: tokens after every request has its
    first, over the time from then to the last token (prefill excluded: `DecodeWindow`); and
    the prefill: from adding the requests to the step that carries the last first token."""
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(prompt_len)] for i in range(bs)]
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    # Warm-up on other tokens: the timed prompts must not be in the prefix cache, or the
    # "prefill" is a cached tail's.
    engine.generate(prompt_token_ids=[[t + 1000 for t in p] for p in prompts], sampling=params)
    added = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, params)
    window, verify = DecodeWindow(bs), 0
    m = engine.metrics
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while engine.has_unfinished():
            outs = engine.step()
            verify += sum(o.num_verify_steps for o in outs if o.finished)
            if window.add(outs, time.perf_counter()):
                steps0, blocked0 = m.num_steps, m.host_blocked_seconds
                busy0, wall0 = engine.busy_and_wall()
                torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    occupancy = engine.occupancy(busy0, wall0)
    n_steps = max(m.num_steps - steps0, 1)
    decode_time = window.last - window.first
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {
        "decode_tokens_per_s": window.tokens / decode_time,
        "step_ms": 1000 * decode_time / n_steps,
        "accept_length": window.all_tokens / verify if verify else 1.0,
        "occupancy": occupancy,
        "syncs_per_step": syncs / n_steps,
        "host_blocked_ms_per_step": 1000 * (m.host_blocked_seconds - blocked0) / n_steps,
        "prefill_ms": 1000 * (window.first - added),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-8b,llama-1b")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--modes", default="plain,chain,tree")
    ap.add_argument("--backends", default="triton",
                    help="comma list of: " + ", ".join(BACKEND_ROWS) + " (graphs unless -eager; "
                         "flashinfer alone is the host-synced plan, never graphed)")
    ap.add_argument("--tp-sizes", default="1", help="tensor-parallel sizes (GPUs per engine)")
    ap.add_argument("--variants", default="default",
                    help="comma list of: default, no-overlap, sync (needs_cpu_seq_lens=True), no-graph, "
                         "no-skinny-gemm (cuBLAS for every GEMM), nccl (tp > 1: NCCL for every "
                         "all-reduce instead of the custom one)")
    ap.add_argument("--draft", default="eagle3", choices=["eagle3", "nextn"],
                    help="the speculative rows' draft: an EAGLE-3 head, or the target's NextN layer")
    ap.add_argument("--accept-len", type=int, default=3, help="forced accept length on random weights")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-context-len", type=int, default=4096)
    ap.add_argument("--quantizations", default="auto",
                    help="comma list of: auto (the checkpoint's, bf16 for random shapes), fp8 (random "
                         "block-wise FP8 weights; on a 16-bit checkpoint, quantized at load), awq or "
                         "gptq (random group-128 INT4 weights); the draft stays bf16")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="comma list of the target's KV pool dtypes: auto (the model's), fp8_e4m3 "
                         "(1.0 scales on random weights); auto,fp8_e4m3 is an A/B in one run")
    ap.add_argument("--out", default="bench_one_batch.json")
    args = ap.parse_args()

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows = []
    root = tempfile.mkdtemp()
    for model_name in args.models.split(","):
        if model_name == "demo":
            target, draft, load_format = None, str(demo_models_dir() / "demo-draft"), "auto"
        else:
            (target, draft), load_format = write_shape(root, model_name), "dummy"
        for quantization, mode, backend, variant, tp, kv_dtype in itertools.product(
                args.quantizations.split(","), args.modes.split(","), args.backends.split(","),
                args.variants.split(","), [int(t) for t in args.tp_sizes.split(",")],
                args.kv_cache_dtype.split(",")):
            spec = None
            if mode != "plain":
                force = None if model_name == "demo" else args.accept_len
                spec = SpecConfig(algorithm=args.draft, draft_model=draft if args.draft == "eagle3" else None,
                                  bench_force_accept_len=force, **SPEC_MODES[mode])
            max_bs = max(int(b) for b in args.batch_sizes.split(","))
            cfg = EngineConfig(model=target, device="cuda", dtype="bfloat16", load_format=load_format,
                               spec=spec, max_running_requests=max_bs, max_context_len=args.max_context_len,
                               enable_overlap=variant != "no-overlap",
                               attention_backend=BACKEND_ROWS[backend].attention_backend,
                               needs_cpu_seq_lens=(True if variant == "sync" else None)
                               if BACKEND_ROWS[backend].needs_cpu_seq_lens is None
                               else BACKEND_ROWS[backend].needs_cpu_seq_lens,
                               cuda_graph=BACKEND_ROWS[backend].cuda_graph and variant != "no-graph",
                               gpu_memory_utilization=0.6,
                               # one prefill batch, or 8k-token chunks of a long one (a bigger
                               # chunk's reserve for every token's logits would crowd out the KV)
                               chunked_prefill_size=min(max_bs * args.prompt_len, 8192),
                               skinny_gemm=variant != "no-skinny-gemm", tp_size=tp,
                               custom_all_reduce=variant != "nccl",
                               quantization=quantization, kv_cache_dtype=kv_dtype)
            engine = Engine(cfg)
            weights = weight_bytes(engine)
            limit = bandwidth / weights  # per-rank shard: tp GPUs read in parallel
            for bs in (int(b) for b in args.batch_sizes.split(",")):
                r = run_one(engine, bs, args.prompt_len, args.steps)
                kv_read = bs * (args.prompt_len + args.steps / 2) * kv_bytes_per_token(engine)
                step_limit_ms = 1000 * (weight_bytes(engine, bs) + kv_read) / bandwidth
                label = mode if spec is None or args.draft == "eagle3" else f"{mode}-{args.draft}"
                r.update(model=model_name, weights=engine.core.weight_format, mode=label, variant=variant, backend=backend, tp=tp, batch_size=bs,
                         kv_cache_dtype=kv_dtype,
                         prompt_len=args.prompt_len, bs1_limit_tokens_per_s=limit,
                         fraction_of_limit=r["decode_tokens_per_s"] / limit,
                         plain_step_limit_ms=step_limit_ms,
                         fraction_of_step_limit=step_limit_ms / r["step_ms"])
                rows.append(r)
                print(json.dumps(r), flush=True)
            engine.shutdown()
            del engine
            gc.collect()  # the engine holds reference cycles; free its GPU memory now
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows}
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"\n{result['device']}  copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'model':16} {'weights':20} {'mode':12} {'backend':19} {'variant':10} {'kv':8} {'tp':>2} {'bs':>3} {'ctx':>6} {'tok/s':>9} "
          f"{'step ms':>8} {'acc':>5} {'limit%':>7} {'step%':>6} {'occ%':>6} {'sync/st':>7} {'prefill ms':>10}")
    for r in rows:
        print(f"{r['model']:16} {r['weights']:20} {r['mode']:12} {r['backend']:19} {r['variant']:10} {r['kv_cache_dtype']:8} {r['tp']:>2} {r['batch_size']:>3} "
              f"{r['prompt_len']:6} {r['decode_tokens_per_s']:9.1f} "
              f"{r['step_ms']:8.2f} {r['accept_length']:5.2f} {100 * r['fraction_of_limit']:7.1f} "
              f"{100 * r['fraction_of_step_limit']:6.1f} {100 * r['occupancy']:6.1f} {r['syncs_per_step']:7.2f} {r['prefill_ms']:10.1f}")


if __name__ == "__main__":
    main()
