"""Peer baseline on the same GPU: Hugging Face `generate` at batch size 1 on the same random
Llama shapes (dynamic cache, static cache, and assisted generation with the 1B shape as the
assistant of the 8B one).

    python bench/peers_hf.py --models llama-8b,llama-1b --out peers.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import transformers as tf

from one_batch import ROPE, SHAPES


def build(name: str, device) -> tf.PreTrainedModel:
    cfg = tf.LlamaConfig(**SHAPES[name], max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=ROPE, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def tokens_per_s(model, steps: int, prompt_len: int, **kwargs) -> float:
    ids = torch.arange(3, 3 + prompt_len, device=model.device).unsqueeze(0)
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **kwargs)
    # Warm up at full length: a static cache compiles for its shapes on first use.
    model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **common)
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **common)
    torch.cuda.synchronize()
    return (out.shape[1] - prompt_len - 1) / (time.perf_counter() - t0 - prefill)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-8b,llama-1b")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out", default="peers_hf.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    models = {name: build(name, device) for name in args.models.split(",")}
    for name, model in models.items():
        for mode, kwargs in (("hf-dynamic", {}), ("hf-static", {"cache_implementation": "static"})):
            tps = tokens_per_s(model, args.steps, args.prompt_len, **kwargs)
            rows.append({"model": name, "mode": mode, "batch_size": 1, "decode_tokens_per_s": tps})
            print(json.dumps(rows[-1]), flush=True)
    if "llama-8b" in models and "llama-1b" in models:
        tps = tokens_per_s(models["llama-8b"], args.steps, args.prompt_len, assistant_model=models["llama-1b"])
        rows.append({"model": "llama-8b", "mode": "hf-assisted(1b)", "batch_size": 1, "decode_tokens_per_s": tps})
        print(json.dumps(rows[-1]), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "transformers": tf.__version__, "rows": rows},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
