"""N-gram (prompt lookup) drafting against plain decoding at bs=1, on a workload whose answers
copy their prompt.

    python bench/ngram_copy.py --out ngram_copy.json

Workload (the demo pair, real weights): windows of the demo's held-out code
(`models/demo-heldout.txt`), each prompt a window, a separator line and the window's first
lines again; greedy decoding then copies the rest of the window (a code-edit or summarising
request repeats its context the same way). One request at a time; rows per mode: decode
tokens/s from each request's first token to its last, tokens per verify step, and whether the
output equals plain decoding's token for token. Modes: plain, ngram at two draft depths, and
the bundled EAGLE-3 head (chain) for reference.

`--shape llama-8b` adds rows on random weights (bench/one_batch.py's shapes) at a forced accept
length (`SpecConfig.bench_force_accept_len`): the step cost of the chain verify with copied
drafts and no draft model, against plain and EAGLE-3 chain steps.
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig
from specserve.engine.builder import demo_models_dir

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "demo-heldout.txt"
SEPARATOR = "\n\n# The same code again, unchanged:\n"
MODES = {"plain": None,
         "ngram-4": dict(algorithm="ngram", num_steps=3, num_draft_tokens=4),
         "ngram-8": dict(algorithm="ngram", num_steps=7, num_draft_tokens=8),
         "eagle3-chain": dict(algorithm="eagle3", num_steps=3, num_draft_tokens=4)}


def copy_prompts(tokenizer, n: int, window: int, head: int) -> list[list[int]]:
    """`n` prompts: a `window`-token stretch of held-out code, the separator, and the stretch's
    first `head` tokens (the answer continues the copy)."""
    ids = tokenizer.encode(HELDOUT.read_text())
    sep = tokenizer.encode(SEPARATOR, add_special_tokens=False)
    step = max(window, (len(ids) - window) // n)
    return [ids[i:i + window] + sep + ids[i:i + head] for i in range(0, step * n, step)]


def decode_speed(engine: Engine, prompts: list[list[int]], max_new_tokens: int):
    """(token ids per prompt, decode tokens/s over all requests, tokens per verify step), one
    request at a time."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    outputs, decode_tokens, decode_seconds, verify = [], 0, 0.0, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        tokens, first, last = [], None, None
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter()
                if out.new_token_ids:
                    first = now if first is None else first
                    last = now
                tokens += out.new_token_ids
                verify += out.num_verify_steps if out.finished else 0
        outputs.append(tokens)
        decode_tokens += len(tokens) - 1
        decode_seconds += last - first
    return outputs, decode_tokens / decode_seconds, (sum(map(len, outputs)) / verify if verify else 1.0)


def demo_rows(args) -> list[dict]:
    rows, plain = [], None
    draft = str(demo_models_dir() / "demo-draft")
    for mode, shape in MODES.items():
        spec = None if shape is None else SpecConfig(
            draft_model=draft if shape["algorithm"] == "eagle3" else None, **shape)
        with Engine(EngineConfig(device=args.device, spec=spec, max_running_requests=4)) as engine:
            prompts = copy_prompts(engine.core.tokenizer, args.num_prompts, args.window, args.head)
            decode_speed(engine, prompts[:1], 16)  # warm-up (first graph replays, allocations)
            outputs, tps, accept = decode_speed(engine, prompts, args.max_new_tokens)
        plain = outputs if mode == "plain" else plain
        rows.append(dict(model="demo", mode=mode, batch_size=1, decode_tokens_per_s=tps, accept_length=accept,
                         exact=outputs == plain, speedup=tps / rows[0]["decode_tokens_per_s"] if rows else 1.0))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()
    return rows


def forced_rows(args) -> list[dict]:
    """Random weights at a forced accept length: each mode's step cost (bench/one_batch.py)."""
    from one_batch import run_one, write_shape

    target, draft = write_shape(tempfile.mkdtemp(), args.shape)
    rows = []
    for mode, shape in MODES.items():
        spec = None if shape is None else SpecConfig(
            draft_model=draft if shape["algorithm"] == "eagle3" else None,
            bench_force_accept_len=min(args.accept_len, shape["num_draft_tokens"] - 1), **shape)
        engine = Engine(EngineConfig(model=target, device=args.device, dtype="bfloat16", load_format="dummy",
                                     spec=spec, max_running_requests=4, max_context_len=4096, mem_fraction=0.5))
        r = run_one(engine, 1, 128, 64)
        engine.shutdown()
        rows.append(dict(model=args.shape, mode=mode, batch_size=1, decode_tokens_per_s=r["decode_tokens_per_s"],
                         step_ms=r["step_ms"], accept_length=r["accept_length"], syncs_per_step=r["syncs_per_step"],
                         speedup=r["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"] if rows else 1.0))
        print(json.dumps(rows[-1]), flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--window", type=int, default=320, help="held-out tokens a prompt copies from")
    ap.add_argument("--head", type=int, default=24, help="of them, repeated after the separator")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--shape", default="llama-8b", help="forced-accept rows on this random-weight shape; "
                                                        "none: skip them")
    ap.add_argument("--accept-len", type=int, default=3)
    ap.add_argument("--out", default="bench_ngram_copy.json")
    args = ap.parse_args()
    rows = demo_rows(args) + (forced_rows(args) if args.shape != "none" else [])
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    json.dump({"device": device, "date": time.strftime("%Y-%m-%d"), "rows": rows}, open(args.out, "w"), indent=1)
    print(f"\n{device}")
    print(f"{'model':10} {'mode':14} {'bs':>3} {'tok/s':>9} {'acc':>5} {'x plain':>8} {'exact':>6}")
    for r in rows:
        print(f"{r['model']:10} {r['mode']:14} {r['batch_size']:>3} {r['decode_tokens_per_s']:9.1f} "
              f"{r['accept_length']:5.2f} {r['speedup']:8.2f} {str(r.get('exact', '-')):>6}")


if __name__ == "__main__":
    main()
