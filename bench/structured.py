"""Structured outputs: what a constrained request costs, on the demo pair (EAGLE-3, chain).

    python bench/structured.py acceptance            # CPU is fine: acceptance on held-out text
    python bench/structured.py steps --device cuda   # GPU: step times and blocking syncs
    python bench/structured.py steps --device cuda --shape llama-8b
    python bench/structured.py masks                 # host cost of a step's masks (CPU)

acceptance: mean accept length (tokens per verify) of JSON-schema requests vs the same prompts
unconstrained, greedy, over prompts cut from models/demo-heldout.txt (text the pair never saw).

steps: steady-state decode step time (wall, per engine.step) of a batch of constrained requests
(inside an endless JSON string: the costliest state to mask, and no request leaves the batch)
vs an unconstrained (greedy) batch, at bs=1 and 16, of a mixed batch (half constrained) and of
sampled unconstrained batches (temperature 1, and with top_p 0.9: sampled CUDA graphs); then, over
steps of their own, the implicit host syncs per step (CUDA's sync debug mode counts `.item()`
and `.tolist()` of device tensors, not waits on CUDA events). Constrained batches keep the
overlap loop: the grammar process (engine/grammar/process.py) makes the masks and the device
waits for them itself, so their syncs per step are the unconstrained ones. `--shape llama-8b`
runs a launched shape (random weights, the demo tokenizer) instead of the demo pair.

masks: the grammar process's time for a constrained chain step's mask work (num_steps 3), per
batch size: the committed masks (first draft level), two draft steps' frontier masks and the
verify masks of the 4-node chain, on the demo tokenizer with a JSON schema, inside a free-text
string (the costliest state to mask); memos cleared each step (in the engine the committed mask
is filled during the previous step's draft-extend).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch

from specserve.engine import Engine, EngineConfig, GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.builder import demo_models_dir

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["function", "arguments", "summary"],
          "properties": {"function": {"type": "string", "maxLength": 40},
                         "arguments": {"type": "array", "maxItems": 4,
                                       "items": {"type": "string", "maxLength": 24}},
                         "summary": {"type": "string", "maxLength": 160}}}
CHAIN = SpecConfig(algorithm="eagle3", num_steps=3, topk=1, num_draft_tokens=4)


# Both runs get the same prompts: held-out code, then a line asking for what the schema holds.
JSON_HINT = "\n\n# The code above, summarised as JSON:\n"


def heldout_prompts(tokenizer, n: int, length: int, hint: str = JSON_HINT) -> list[list[int]]:
    with open(os.path.join(demo_models_dir(), "demo-heldout.txt")) as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    stride = max(length, (len(ids) - length) // n)
    tail = tokenizer.encode(hint, add_special_tokens=False) if hint else []
    return [[0] + ids[i * stride:i * stride + length] + tail for i in range(n)]


def _accept_length(outs) -> float:
    verify = sum(o.num_verify_steps for o in outs)
    return (verify + sum(o.num_accepted_drafts for o in outs)) / max(verify, 1)


def acceptance(args) -> dict:
    engine = Engine(EngineConfig(device=args.device, spec=CHAIN))
    prompts = heldout_prompts(engine.tokenizer, args.prompts, args.prompt_len, args.hint)
    free = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0,
                                 grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    results = {}
    for name, params in (("unconstrained", free), ("json_schema", constrained)):
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
        results[name] = {"accept_length": round(_accept_length(outs), 3),
                         "tokens": sum(len(o.token_ids) for o in outs),
                         "finish": {r: sum(o.finish_reason == r for o in outs) for r in ("stop", "length")}}
        if name == "json_schema":
            results[name]["valid_json"] = sum(_parses(o.text) for o in outs if o.finish_reason == "stop")
    engine.shutdown()
    ratio = results["json_schema"]["accept_length"] / results["unconstrained"]["accept_length"]
    results["ratio"] = round(ratio, 3)
    results["within_15_percent"] = abs(1 - ratio) <= 0.15
    return results


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _steady_steps(engine: Engine, prompts, params, warmup: int, steps: int):
    """(mean seconds per step, blocking syncs per step) once every request decodes. The syncs
    are counted over steps of their own: CUDA's sync debug mode writes a warning per sync,
    which would slow the timed steps."""
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, s)
    decoding = 0
    while decoding < warmup:  # a constrained request waits for its grammar's compilation
        decoding += any(o.new_token_ids for o in engine.step())
    cuda = engine.core.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    syncs = 0
    if cuda:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    for i in range(len(prompts)):
        engine.abort(str(i))
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps, syncs / steps


def _steps_engine(args) -> Engine:
    """The demo pair, or a launched shape (random weights, the demo tokenizer) with an EAGLE-3
    head of its width, as bench/one_batch.py writes them."""
    if args.shape is None:
        return Engine(EngineConfig(device=args.device, spec=CHAIN))
    import tempfile

    from one_batch import write_shape

    target, draft = write_shape(tempfile.mkdtemp(), args.shape,
                                tokenizer_dir=os.path.join(demo_models_dir(), "demo-target"))
    spec = SpecConfig(algorithm="eagle3", draft_model=draft, num_steps=3, topk=1, num_draft_tokens=4)
    return Engine(EngineConfig(model=target, device=args.device, dtype="bfloat16", load_format="dummy",
                               spec=spec, max_running_requests=max(args.batch_sizes), max_context_len=4096,
                               cuda_graph=True, gpu_memory_utilization=0.7))


# The costliest state to mask, for as long as the run lasts: inside a JSON string that never
# ends (a schema's string would let a request finish and leave the batch). xgrammar's mask
# there costs what a schema's free-text string costs (see `masks`).
ENDLESS_JSON_STRING = r'''root ::= "{\"text\": \"" body
body ::= [^"\\\0-\x1f] body'''


def steps(args) -> dict:
    engine = _steps_engine(args)
    long = dict(max_new_tokens=4 * (args.warmup + 2 * args.steps) + 64, temperature=0.0)
    free = SamplingParams(ignore_eos=True, **long)
    constrained = SamplingParams(grammar=GrammarSpec("ebnf", ENDLESS_JSON_STRING), **long)
    results = {"shape": args.shape or "demo pair"}
    # Warm-up (allocations, first kernels, the grammar's compilation), not reported.
    _steady_steps(engine, heldout_prompts(engine.tokenizer, 2, args.prompt_len), [free, constrained],
                  args.warmup, args.warmup)
    for bs in args.batch_sizes:
        prompts = heldout_prompts(engine.tokenizer, bs, args.prompt_len)
        # "sampled": unconstrained, seeded, temperature 1; "sampled_top_p": and top_p 0.9. Both
        # replay the sampled CUDA graphs (EngineConfig.cuda_graph_sampled, on by default; the
        # second the top-k/top-p/min-p variant), the greedy rows' graphs being "unconstrained".
        sampled = SamplingParams(ignore_eos=True, seed=0, **dict(long, temperature=1.0))
        top_p = SamplingParams(ignore_eos=True, seed=0, top_p=0.9, **dict(long, temperature=1.0))
        # "sampled_json_string": the common JSON case, a grammar under temperature sampling
        # (the constrained sampled graphs), set against "sampled" in `sampled_ratio`.
        sampled_json = SamplingParams(grammar=GrammarSpec("ebnf", ENDLESS_JSON_STRING), seed=0,
                                      **dict(long, temperature=1.0))
        for name, params in (("unconstrained", [free] * bs), ("json_string", [constrained] * bs),
                             ("mixed", [constrained if i % 2 else free for i in range(bs)]),
                             ("sampled", [sampled] * bs), ("sampled_top_p", [top_p] * bs),
                             ("sampled_json_string", [sampled_json] * bs)):
            if name == "mixed" and bs == 1:
                continue
            t, syncs = _steady_steps(engine, prompts, params, args.warmup, args.steps)
            results[f"bs{bs}/{name}"] = {"step_ms": round(t * 1e3, 3), "syncs_per_step": round(syncs, 2)}
        results[f"bs{bs}/ratio"] = round(results[f"bs{bs}/json_string"]["step_ms"]
                                         / results[f"bs{bs}/unconstrained"]["step_ms"], 3)
        results[f"bs{bs}/sampled_ratio"] = round(results[f"bs{bs}/sampled_json_string"]["step_ms"]
                                                 / results[f"bs{bs}/sampled"]["step_ms"], 3)
    engine.shutdown()
    return results


def masks(args) -> dict:
    from specserve.engine.grammar.batch import GrammarBatch
    from specserve.engine.grammar.compiler import GrammarCompiler
    from specserve.engine.grammar.request_grammar import RequestGrammar
    from specserve.engine.tokenizer import Tokenizer

    target = os.path.join(demo_models_dir(), "demo-target")
    compiler = GrammarCompiler(os.path.join(target, "tokenizer.json"), 8192, [1])
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    tok = Tokenizer(target, [1])
    prefix = tok.encode('{"function": "parse", "arguments": [], "summary": "Reads', add_special_tokens=False)
    words = tok.encode(" the file and", add_special_tokens=False)[:3]
    results = {}
    for bs in args.batch_sizes:
        grammars = [RequestGrammar(compiler.compile(spec), [1], None) for _ in range(bs)]
        for g in grammars:
            g.advance(prefix)
        out = torch.empty((bs * 4, (8192 + 31) // 32), dtype=torch.int32)
        tree = GrammarBatch.tree_paths([[prefix[-1]] + words] * bs, [[-1, 0, 1, 2]] * bs)
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            # One chain step (3 draft steps): the first level under the committed masks, two
            # draft steps' frontier masks, then the verify's 4 nodes (3 of them known by then).
            for g in grammars:
                g.memo.clear()
            batch = GrammarBatch(grammars)
            batch.next_token_masks(out[:bs])
            for step in (1, 2):
                batch.path_masks(out[:bs], [words[:step]] * bs, [list(range(-1, step - 1))] * bs,
                                 [[step - 1]] * bs)
            batch.path_masks(out, *tree)
        t1 = time.perf_counter()
        results[f"bs{bs}"] = {"host_ms_per_chain_step": round((t1 - t0) / reps * 1e3, 3)}
    compiler.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["acceptance", "steps", "masks"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hint", default=JSON_HINT, help="text after each held-out prompt ('' for none)")
    parser.add_argument("--shape", default=None, help="steps: a bench/one_batch.py shape (llama-8b) "
                        "with random weights instead of the demo pair")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {"acceptance": acceptance, "steps": steps, "masks": masks}[args.what](args)
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
