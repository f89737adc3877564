"""Where a decode step's time goes: the GPU kernels of steady-state steps (CUDA-graph replays
included), per kernel name, per step.

    python bench/step_profile.py --model llama-8b --mode plain --batch-size 1 --out profile.json
    python bench/step_profile.py --model llama-8b --tp 4 --nccl-all-reduce   # rank 0's kernels
    python bench/step_profile.py --model llama-8b --mode chain --batch-size 64 \
        --arrival-prompt-len 256 --mixed-steps                # every profiled step a mixed step

Prints kernels per step, kernel time per step against the step's wall time (the difference is
gaps between kernels and host time the GPU waits for), and the kernels that take the most time.
With --step-log PATH the engine logs every step (bench/step_log_report.py reads it: predicted
against measured step times without a server).
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from one_batch import SPEC_MODES, run_one, write_shape
from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig
from specserve.engine.config import QUANTIZATION_FLAGS

# Coarse kernel families, first match wins (names differ between cuBLAS/cuDNN/Triton versions).
FAMILIES = [("gemm", r"gemm|gemv|cutlass|sm90_|ampere_|splitKreduce|nvjet"),
            ("attention", r"_decode_|_extend|attention|flash"),
            ("all-reduce", r"nccl|all_reduce|allreduce|one_shot|symm"), ("norm", r"rms|norm"), ("rope+kv store", r"rope|rotary"),
            ("activation", r"silu|act_and_mul|gelu"), ("sampling/accept", r"argmax|sample|accept|topk|sort"),
            ("copy/index", r"copy|index|gather|scatter|cat|fill|elementwise")]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def arrival_prompt(index: int, length: int) -> list[int]:
    """A prompt no earlier one shares a prefix with (the radix cache would shorten it)."""
    return [(11 * index + 5 * j) % 997 + 2000 for j in range(length)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--mode", default="plain", choices=["plain", *SPEC_MODES])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--draft", default="eagle3", choices=["eagle3", "nextn"],
                    help="a speculative mode's draft: an EAGLE-3 head, or the target's NextN layer")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (rank 0 is profiled)")
    ap.add_argument("--nccl-all-reduce", action="store_true", help="tp > 1: NCCL for every all-reduce")
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATION_FLAGS,
                    help="fp8: random block-wise FP8 weights, as bench/one_batch.py's rows")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8_e4m3 (the KV pool's)")
    ap.add_argument("--arrival-prompt-len", type=int, default=0,
                    help="a new request of this many prompt tokens (one output token) arrives "
                         "before each profiled step: with --mixed-steps its prompt rides in "
                         "the decode step, else it gets an extend of its own")
    ap.add_argument("--mixed-steps", action="store_true", help="EngineConfig.mixed_steps")
    ap.add_argument("--step-log", default=None, metavar="PATH",
                    help="the engine writes a JSON line per step to PATH (warm-up included; "
                         "bench/step_log_report.py reads it)")
    ap.add_argument("--eager-mixed-wrap", action="store_true",
                    help="with --mixed-steps: the speculative wrap around the mixed forward's graph "
                         "(draft, accept, draft-extends) eager, as before its graphs (a baseline)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="step_profile.json")
    args = ap.parse_args()

    target, draft = write_shape(tempfile.mkdtemp(), args.model)
    spec = None if args.mode == "plain" else SpecConfig(
        algorithm=args.draft, draft_model=draft if args.draft == "eagle3" else None,
        bench_force_accept_len=3, **SPEC_MODES[args.mode])
    engine = Engine(EngineConfig(model=target, device="cuda", dtype="bfloat16", load_format="dummy", spec=spec,
                                 # (and room for each arrival, which ends after its prefill)
                                 max_running_requests=max(args.batch_size, 1) + (args.arrival_prompt_len > 0),
                                 max_context_len=max(4096, args.prompt_len + args.steps + 64),
                                 kv_cache_dtype=args.kv_cache_dtype, mixed_steps=args.mixed_steps,
                                 cuda_graph=True, gpu_memory_utilization=0.6, tp_size=args.tp,
                                 custom_all_reduce=not args.nccl_all_reduce, quantization=args.quantization,
                                 step_log=args.step_log))
    if args.eager_mixed_wrap:
        engine.core.worker.mixed_wrap_graphs.clear()
    run_one(engine, args.batch_size, args.prompt_len, args.steps)  # warm-up (graphs captured)
    params = SamplingParams(max_new_tokens=args.steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(args.batch_size):
        engine.add_request(f"profile-{i}", [(7 * i + j) % 1000 + 3 for j in range(args.prompt_len)], params)
    while not any(o.new_token_ids for o in engine.step()):  # prefill, outside the window
        pass
    for _ in range(4):  # settle into the steady state
        engine.step()
    steps0 = engine.metrics.num_steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step in range(args.steps):
            if args.arrival_prompt_len:
                engine.add_request(f"arrival-{step}", arrival_prompt(step, args.arrival_prompt_len),
                                   SamplingParams(max_new_tokens=1, temperature=0.0))
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    num_steps = engine.metrics.num_steps - steps0
    timing = {"step_ms": 1000 * wall / num_steps}
    while engine.has_unfinished():
        engine.step()
    kernels = defaultdict(lambda: [0, 0.0])  # name -> [calls, device microseconds]
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[event.name]
            k[0] += 1
            k[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    total_calls = sum(c for c, _ in kernels.values())
    total_us = sum(t for _, t in kernels.values())
    by_family = defaultdict(lambda: [0, 0.0])
    for name, (calls, us) in kernels.items():
        f = by_family[family(name)]
        f[0] += calls
        f[1] += us
    result = {"model": args.model, "mode": args.mode, "batch_size": args.batch_size, "tp": args.tp,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "prompt_len": args.prompt_len, "arrival_prompt_len": args.arrival_prompt_len,
              "mixed_steps": args.mixed_steps, "eager_mixed_wrap": args.eager_mixed_wrap,
              "custom_all_reduce": not args.nccl_all_reduce, "steps": num_steps,
              "step_ms": timing["step_ms"], "kernels_per_step": total_calls / num_steps,
              "kernel_ms_per_step": total_us / num_steps / 1000,
              "families": {f: {"calls_per_step": c / num_steps, "us_per_step": t / num_steps}
                           for f, (c, t) in sorted(by_family.items(), key=lambda kv: -kv[1][1])},
              "kernels": [{"name": n, "calls_per_step": c / num_steps, "us_per_step": t / num_steps}
                          for n, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]}
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"{args.model} {args.mode} tp={args.tp}{' nccl' if args.nccl_all_reduce else ''} "
          f"bs={args.batch_size}: {num_steps} steps, step {timing['step_ms']:.3f} ms, "
          f"{result['kernels_per_step']:.0f} kernels/step, {result['kernel_ms_per_step']:.3f} ms of kernels/step")
    print(f"{'family':16} {'calls/step':>10} {'us/step':>9}")
    for f, v in result["families"].items():
        print(f"{f:16} {v['calls_per_step']:10.1f} {v['us_per_step']:9.1f}")
    print(f"{'kernel':70} {'calls/step':>10} {'us/step':>9}")
    for k in result["kernels"][:args.top]:
        print(f"{k['name'][:70]:70} {k['calls_per_step']:10.1f} {k['us_per_step']:9.1f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
