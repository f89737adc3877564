"""Accuracy proxy of quantized weights: the bundled demo pair's target quantised against its
16-bit self, on the held-out text.

    python bench/fp8_accuracy.py --device cuda --out quant_accuracy.json
    python bench/fp8_accuracy.py --formats fp8-block,int4-awq --out quick.json

Formats (`--formats`, each a row beside the 16-bit target):
- fp8-block   block-wise 128x128 FP8, as DeepSeek-V3 ships (tests/fp8_quantizer.py)
- fp8-online  `--quantization fp8` on the 16-bit checkpoint (per-channel, at load)
- int4-awq    AWQ GEMM layout, group 128, asymmetric (tests/int4_quantizer.py: round to nearest,
              no calibration, so a pessimistic stand-in for AutoAWQ's)
- int4-gptq   GPTQ layout, group 128, symmetric (the same quantiser, without GPTQ's updates)

Rows: perplexity of models/demo-heldout.txt (1024-token windows, every token scored once) and
the chain speculation's acceptance length with the bundled EAGLE-3 head on held-out prompts
(greedy). Goals ([E22], [E31]): perplexity within 1 % (FP8) or 5 % (INT4), chain acceptance
within 5 %.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the quantiser the tests use (the published tools' recipe)

from fp8_quantizer import quantize_checkpoint  # noqa: E402
from int4_quantizer import quantize_checkpoint as quantize_int4  # noqa: E402

from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from specserve.engine.builder import demo_models_dir  # noqa: E402

WINDOW = 1024
# format -> (the checkpoint to serve from the 16-bit one, in a scratch folder; engine options;
# perplexity ratio goal)
FORMATS = {
    "fp8-block": (lambda src, tmp: quantize_checkpoint(src, tmp, "block", (128, 128)), {}, 1.01),
    "fp8-online": (lambda src, tmp: src, {"quantization": "fp8"}, 1.01),
    "int4-awq": (lambda src, tmp: quantize_int4(src, tmp, "awq", 128), {}, 1.05),
    "int4-gptq": (lambda src, tmp: quantize_int4(src, tmp, "gptq", 128, sym=True), {}, 1.05),
}
ACCEPT_GOAL = 0.95


def perplexity(engine: Engine, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW - 1):
        window = ids[start:start + WINDOW]
        if len(window) < 2:
            break
        logits = engine.prompt_logits(window)
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        target = torch.tensor(window[1:], device=logp.device)
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += len(window) - 1
    return math.exp(nll / count)


def acceptance(engine: Engine, prompts: list[list[int]], max_new: int) -> float:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    engine.generate(prompt_token_ids=prompts, sampling=params)
    return engine.metrics.mean_accept_length


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma list of: " + ", ".join(FORMATS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="quant_accuracy.json")
    args = ap.parse_args()
    demo = demo_models_dir()
    source = str(demo / "demo-target")
    variants = [("16-bit", source, {}, None)]
    for name in args.formats.split(","):
        make, options, goal = FORMATS[name]
        variants.append((name, make(source, tempfile.mkdtemp()), options, goal))
    rows = []
    for label, target, options, goal in variants:
        base = dict(model=target, device=args.device, dtype=args.dtype, **options)
        with Engine(EngineConfig(**base, spec=None)) as engine:
            tokenizer = engine.core.tokenizer
            ids = tokenizer.encode((ROOT / "models" / "demo-heldout.txt").read_text())
            t0 = time.perf_counter()
            ppl = perplexity(engine, ids)
            weights = engine.core.weight_format
            elapsed = time.perf_counter() - t0
        step = len(ids) // args.prompts
        prompts = [ids[i * step:i * step + 64] for i in range(args.prompts)]
        spec = SpecConfig(algorithm="eagle3", draft_model=str(demo / "demo-draft"), num_steps=3, topk=1,
                          num_draft_tokens=4)
        with Engine(EngineConfig(**base, spec=spec)) as engine:
            accept = acceptance(engine, prompts, args.max_new_tokens)
        row = dict(target=label, weights=weights, tokens=len(ids), perplexity=ppl,
                   chain_accept_length=accept, scoring_s=elapsed)
        if rows:
            row.update(perplexity_ratio=ppl / rows[0]["perplexity"], perplexity_goal=goal,
                       accept_ratio=accept / rows[0]["chain_accept_length"], accept_goal=ACCEPT_GOAL)
            row["meets_goals"] = row["perplexity_ratio"] <= goal and row["accept_ratio"] >= ACCEPT_GOAL
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  dtype=args.dtype, date=time.strftime("%Y-%m-%d"), rows=rows)
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"\n{result['device']}")
    print(f"{'target':12} {'weights':40} {'ppl':>8} {'ratio':>7} {'chain acc':>10} {'ratio':>7}  goals")
    for r in rows:
        ratios = (f"{r['perplexity_ratio']:7.4f}", f"{r['accept_ratio']:7.4f}",
                  f"ppl <= {r['perplexity_goal']}, acc >= {ACCEPT_GOAL}: "
                  f"{'met' if r['meets_goals'] else 'MISSED'}") if "perplexity_ratio" in r else ("", "", "")
        print(f"{r['target']:12} {r['weights']:40} {r['perplexity']:8.4f} {ratios[0]:>7} "
              f"{r['chain_accept_length']:10.3f} {ratios[1]:>7}  {ratios[2]}")


if __name__ == "__main__":
    main()
