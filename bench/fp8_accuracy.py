"""Accuracy proxy of FP8 weights: the bundled demo pair's target quantised block-wise (as
DeepSeek-V3 ships, tests/fp8_quantizer.py) against its 16-bit self, on the held-out text.

    python bench/fp8_accuracy.py --device cuda --out fp8_accuracy.json

Rows: perplexity of models/demo-heldout.txt (1024-token windows, every token scored once) and
the chain speculation's acceptance length with the bundled EAGLE-3 head on held-out prompts
(greedy), for the 16-bit target and the FP8 one. Goals ([E22]): perplexity within 1 %, chain
acceptance within 5 %.
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

from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from specserve.engine.builder import demo_models_dir  # noqa: E402

WINDOW = 1024


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
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="fp8_accuracy.json")
    args = ap.parse_args()
    demo = demo_models_dir()
    fp8 = quantize_checkpoint(str(demo / "demo-target"), tempfile.mkdtemp(), "block", (128, 128))
    rows = []
    for label, target in (("16-bit", str(demo / "demo-target")), ("fp8 block 128x128", fp8)):
        base = dict(model=target, device=args.device, dtype=args.dtype)
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
        rows.append(dict(target=label, weights=weights, tokens=len(ids), perplexity=ppl,
                         chain_accept_length=accept, scoring_s=elapsed))
        print(json.dumps(rows[-1]), flush=True)
    base, quant = rows
    result = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  date=time.strftime("%Y-%m-%d"), rows=rows,
                  perplexity_ratio=quant["perplexity"] / base["perplexity"],
                  accept_ratio=quant["chain_accept_length"] / base["chain_accept_length"])
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"\n{result['device']}")
    print(f"{'target':20} {'weights':22} {'ppl':>8} {'chain acc':>10}")
    for r in rows:
        print(f"{r['target']:20} {r['weights']:22} {r['perplexity']:8.4f} {r['chain_accept_length']:10.3f}")
    print(f"perplexity ratio {result['perplexity_ratio']:.4f} (goal <= 1.01); "
          f"acceptance ratio {result['accept_ratio']:.4f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
