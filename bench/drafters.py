"""Drafters against plain decoding: n-gram (prompt lookup) at bs=1 on a workload whose answers
copy their prompt, suffix drafting on one whose answers repeat an earlier request's, and
adaptive speculation's draft shape choice at forced acceptance.

    python bench/drafters.py --out drafters.json

Copy workload (the demo pair, real weights): windows of the demo's held-out code
(`models/demo-heldout.txt`), each prompt a window, a separator line and the window's first
lines again; greedy decoding then copies the rest of the window (a code-edit or summarising
request repeats its context the same way). One request at a time; rows per mode: decode
tokens/s from each request's first token to its last, tokens per verify step, and whether the
output equals plain decoding's token for token. Modes: plain, ngram at two draft depths and
adaptive, suffix, and the bundled EAGLE-3 head (chain, tree, each fixed and adaptive) for
reference.

Repeat workload (suffix drafting across requests): each prompt a window's first `head` tokens
of held-out code, sent twice in a row (a retried or regenerated request; an agent re-running
the same step); the second answer repeats the first, which suffix drafting finds in its corpus
of finished outputs and n-gram drafting cannot see. Same columns, over both requests of a pair.

`--shape llama-8b` adds rows on random weights (bench/one_batch.py's shapes) at a forced accept
length (`SpecConfig.bench_force_accept_len`) per batch size (`--batch-sizes`): the step cost of
the chain verify with copied drafts and no draft model, and whether adaptive speculation keeps
up with the best of plain and the fixed chain (issue E32: >= 0.97x it, never below plain).
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from one_batch import DecodeWindow  # bench/ is this script's folder
from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig
from specserve.engine.builder import demo_models_dir

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "demo-heldout.txt"
SEPARATOR = "\n\n# The same code again, unchanged:\n"
MODES = {"plain": None,
         "ngram-4": dict(algorithm="ngram", num_steps=3, num_draft_tokens=4),
         "ngram-8": dict(algorithm="ngram", num_steps=7, num_draft_tokens=8),
         "ngram-8-adaptive": dict(algorithm="ngram", num_steps=7, num_draft_tokens=8, adaptive=True),
         "suffix-4": dict(algorithm="suffix", num_steps=3, num_draft_tokens=4),
         "eagle3-chain": dict(algorithm="eagle3", num_steps=3, num_draft_tokens=4),
         "eagle3-adaptive": dict(algorithm="eagle3", num_steps=3, num_draft_tokens=4, adaptive=True),
         "eagle3-tree": dict(algorithm="eagle3", num_steps=5, topk=4, num_draft_tokens=8),
         "eagle3-tree-adaptive": dict(algorithm="eagle3", num_steps=5, topk=4, num_draft_tokens=8, adaptive=True)}


# The repeat workload's modes: n-gram drafting beside suffix drafting, which sees the first answer.
REPEAT_MODES = {"plain": None, "ngram-4": MODES["ngram-4"], "suffix-4": MODES["suffix-4"],
                "suffix-8": dict(algorithm="suffix", num_steps=7, num_draft_tokens=8)}
# The warm-up's prompt: text of neither workload (a suffix drafter remembers its answer).
WARM_UP = "import os\n\n\ndef main():\n"


def copy_prompts(tokenizer, n: int, window: int, head: int) -> list[list[int]]:
    """`n` prompts: a `window`-token stretch of held-out code, the separator, and the stretch's
    first `head` tokens (the answer continues the copy)."""
    ids = tokenizer.encode(HELDOUT.read_text())
    sep = tokenizer.encode(SEPARATOR, add_special_tokens=False)
    step = max(window, (len(ids) - window) // n)
    return [ids[i:i + window] + sep + ids[i:i + head] for i in range(0, step * n, step)]


def repeat_prompts(tokenizer, n: int, window: int, head: int) -> list[list[int]]:
    """`n` pairs of the same prompt: the first `head` tokens of a `window`-token stretch of
    held-out code."""
    ids = tokenizer.encode(HELDOUT.read_text())
    step = max(window, (len(ids) - window) // n)
    return [ids[i:i + head] for i in range(0, step * n, step) for _ in range(2)]


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


def batch_speed(engine: Engine, prompts: list[list[int]], max_new_tokens: int):
    """decode_speed's columns with every prompt decoding at once: decode tokens/s from the
    step that gave the last request its first token to the end."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    tokens = {f"b{i}": [] for i in range(len(prompts))}
    window, verify = DecodeWindow(len(prompts)), 0
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            tokens[out.rid] += out.new_token_ids
            verify += out.num_verify_steps if out.finished else 0
        window.add(outs, time.perf_counter())
    return list(tokens.values()), window.tokens / (window.last - window.first), \
        (window.all_tokens / verify if verify else 1.0)


def steps_by_shape(worker) -> dict:
    """An adaptive engine's decode steps run per shape (keys as StepTimes.milliseconds'),
    cheapest first."""
    return {str(shape): n for shape, n in sorted(worker.shape_steps.items())}


def demo_rows(args) -> list[dict]:
    copy = [(mode, shape, copy_prompts) for mode, shape in MODES.items() if mode in args.modes]
    repeat = [(mode, shape, repeat_prompts) for mode, shape in REPEAT_MODES.items() if mode in args.modes]
    return workload_rows(args, "copy", copy) + workload_rows(args, "repeat", repeat) + \
        workload_rows(args, "copy", copy, batch_size=args.demo_batch_size)


def workload_rows(args, workload: str, modes: list, batch_size: int = 1) -> list[dict]:
    """A row per (mode, its SpecConfig shape, the workload's prompts), plain first; at
    batch_size > 1, that many prompts decode together (`batch_speed`)."""
    rows, plain = [], None
    draft = str(demo_models_dir() / "demo-draft")
    for mode, shape, make_prompts in modes:
        spec = None if shape is None else SpecConfig(
            draft_model=draft if shape["algorithm"] == "eagle3" else None, **shape)
        # Half the device: the demo pair needs little KV, and what an engine before it in this
        # process left cached must not make the next one's share exceed what is free.
        with Engine(EngineConfig(device=args.device, spec=spec, max_running_requests=max(4, batch_size),
                                 gpu_memory_utilization=0.5)) as engine:
            prompts = make_prompts(engine.core.tokenizer, max(args.num_prompts, batch_size), args.window, args.head)
            decode_speed(engine, [engine.core.tokenizer.encode(WARM_UP)], 16)  # first graph replays, allocations
            worker = engine.core.worker
            adaptive = getattr(worker, "policy", None) is not None
            if adaptive:
                worker.shape_steps.clear()
                start_up = worker.policy.times.milliseconds()
            outputs, tps, accept = decode_speed(engine, prompts, args.max_new_tokens) if batch_size == 1 \
                else batch_speed(engine, prompts[:batch_size], args.max_new_tokens)
            # An adaptive engine: the shapes it ran, its step-time table at start-up and after
            # the steps' wall times refined it.
            choice = dict(shape_steps=steps_by_shape(worker), step_ms_start_up=start_up,
                          step_ms_observed=worker.policy.times.milliseconds()) if adaptive else {}
            del worker  # it holds the model and KV pool: the next engine sizes itself by what is free
        plain = outputs if mode == "plain" else plain
        rows.append(dict(model="demo", workload=workload, mode=mode, batch_size=batch_size, decode_tokens_per_s=tps,
                         accept_length=accept, exact=outputs == plain,
                         speedup=tps / rows[0]["decode_tokens_per_s"] if rows else 1.0, **choice))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes itself by what is free
    return rows


def forced_rows(args) -> list[dict]:
    """Random weights at a forced accept length: each mode's decode speed per batch size
    (bench/one_batch.py's run_one), and what its CUDA graphs hold (`graph_mib`: an adaptive
    engine's graphs of every shape)."""
    from one_batch import run_one, write_shape

    target, draft = write_shape(tempfile.mkdtemp(), args.shape)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for mode, shape in MODES.items():
        if mode not in args.modes:
            continue
        spec = None if shape is None else SpecConfig(
            draft_model=draft if shape["algorithm"] == "eagle3" else None,
            bench_force_accept_len=min(args.accept_len, shape["num_draft_tokens"] - 1), **shape)
        engine = Engine(EngineConfig(model=target, device=args.device, dtype="bfloat16", load_format="dummy",
                                     spec=spec, max_running_requests=max(batch_sizes), max_context_len=4096,
                                     gpu_memory_utilization=0.9, chunked_prefill_size=min(max(batch_sizes) * 128, 8192)))
        adaptive = getattr(engine.core.worker, "policy", None) is not None
        for bs in batch_sizes:
            if adaptive:
                engine.core.worker.shape_steps.clear()
            r = run_one(engine, bs, 128, 64)
            plain = next((p for p in rows if p["mode"] == "plain" and p["batch_size"] == bs), None)
            rows.append(dict(model=args.shape, mode=mode, batch_size=bs, decode_tokens_per_s=r["decode_tokens_per_s"],
                             step_ms=r["step_ms"], accept_length=r["accept_length"],
                             syncs_per_step=r["syncs_per_step"],
                             speedup=r["decode_tokens_per_s"] / plain["decode_tokens_per_s"] if plain else 1.0,
                             graph_mib=round(engine.core.graph_memory_bytes / 2 ** 20, 1)))
            if adaptive:
                rows[-1].update(shape_steps=steps_by_shape(engine.core.worker),
                                step_ms_observed=engine.core.worker.policy.times.milliseconds())
            print(json.dumps(rows[-1]), flush=True)
        engine.shutdown()
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
    ap.add_argument("--demo-batch-size", type=int, default=64,
                    help="the copy workload's rows again with this many prompts at once")
    ap.add_argument("--no-demo", action="store_true", help="the forced-accept rows only")
    ap.add_argument("--accept-len", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,16,64", help="of the forced-accept rows")
    ap.add_argument("--modes", default=",".join({**MODES, **REPEAT_MODES}),
                    help="the modes to run, comma-separated (plain among them: the others' baseline)")
    ap.add_argument("--out", default="bench_drafters.json")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    unknown = set(args.modes) - {*MODES, *REPEAT_MODES}
    if unknown or "plain" not in args.modes:
        ap.error(f"--modes: plain and any of {sorted({*MODES, *REPEAT_MODES} - {'plain'})}; got {args.modes}")
    rows = ([] if args.no_demo else demo_rows(args)) + (forced_rows(args) if args.shape != "none" else [])
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    json.dump({"device": device, "date": time.strftime("%Y-%m-%d"), "rows": rows}, open(args.out, "w"), indent=1)
    print(f"\n{device}")
    print(f"{'model':10} {'workload':8} {'mode':20} {'bs':>3} {'tok/s':>9} {'acc':>5} {'x plain':>8} {'exact':>6}")
    for r in rows:
        print(f"{r['model']:10} {r.get('workload', 'forced'):8} {r['mode']:20} {r['batch_size']:>3} "
              f"{r['decode_tokens_per_s']:9.1f} "
              f"{r['accept_length']:5.2f} {r['speedup']:8.2f} {str(r.get('exact', '-')):>6}")


if __name__ == "__main__":
    main()
