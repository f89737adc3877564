"""Optional peer on the same GPU: gpt-fast's `torch.compile` decode at batch size 1 on the same
random Llama shapes as `one_batch.py`.

gpt-fast's code is not part of this project: point `--gpt-fast-path` at a checkout of
https://github.com/pytorch-labs/gpt-fast (its `model.py` is imported from there); without one
the script prints why and writes no rows.

    python bench/peers_gptfast.py --gpt-fast-path ~/gpt-fast --models llama-8b,llama-1b --out peers.json

The decode step is compiled the way gpt-fast's `generate.py` compiles it (`mode="reduce-overhead"`,
`fullgraph=True`, with its inductor flags); `--no-tuning` drops coordinate-descent tuning to cut
compile time, at some cost to the peer's speed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

from one_batch import SHAPES

# gpt-fast's names for our shape fields; its head_dim is dim // n_head, which every shape here obeys.
ARGS_OF_SHAPE = dict(hidden_size="dim", intermediate_size="intermediate_size", num_hidden_layers="n_layer",
                     num_attention_heads="n_head", num_key_value_heads="n_local_heads", vocab_size="vocab_size")
LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def import_gptfast_model(path: str):
    spec = importlib.util.spec_from_file_location("gptfast_model", os.path.join(path, "model.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gptfast_model"] = module
    spec.loader.exec_module(module)
    return module


def build(gf, name: str, max_seq: int, device):
    shape = SHAPES[name]
    args = gf.ModelArgs(block_size=max_seq, rope_base=500000.0, rope_scaling=LLAMA31_ROPE,
                        **{ours: shape[theirs] for theirs, ours in ARGS_OF_SHAPE.items()})
    assert args.head_dim * args.n_head == shape["hidden_size"], name
    torch.manual_seed(0)
    with torch.device(device):
        model = gf.Transformer(args).to(torch.bfloat16)
        for p in model.parameters():
            p.data.normal_(0, 0.02)
        model.setup_caches(max_batch_size=1, max_seq_length=max_seq)
    return model.eval()


def greedy_step(model, token, input_pos):
    return model(token, input_pos).argmax(-1)


def decode_tokens_per_s(model, prompt_len: int, steps: int, tuning: bool) -> float:
    """As gpt-fast's `generate.py` decodes: its inductor flags, the step compiled with the model
    as an argument, one position tensor advanced in place, attention in the math kernel that
    inductor generates code for."""
    import torch._inductor.config as inductor
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inductor.coordinate_descent_tuning = tuning
    inductor.triton.unique_kernel_names = True
    inductor.fx_graph_cache = True
    compiled = torch.compile(greedy_step, mode="reduce-overhead", fullgraph=True)
    device = next(model.parameters()).device
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        prompt = torch.arange(3, 3 + prompt_len, device=device).unsqueeze(0)
        token = model(prompt, torch.arange(prompt_len, device=device)).argmax(-1)[:, -1:]
        input_pos = torch.tensor([prompt_len], device=device, dtype=torch.int)
        for _ in range(4):  # compile, record the graph, replay
            token = compiled(model, token, input_pos).clone()
            input_pos += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            token = compiled(model, token, input_pos).clone()
            input_pos += 1
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt-fast-path", default=os.environ.get("GPT_FAST_PATH", ""))
    ap.add_argument("--models", default="llama-8b,llama-1b")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--no-tuning", action="store_true")
    ap.add_argument("--out", default="peers_gptfast.json")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.gpt_fast_path, "model.py")):
        print(f"gpt-fast: no model.py under --gpt-fast-path {args.gpt_fast_path!r}; skipping the peer")
        return
    gf = import_gptfast_model(args.gpt_fast_path)
    device = torch.device("cuda")
    rows = []
    for name in args.models.split(","):
        model = build(gf, name, args.prompt_len + args.steps + 16, device)
        tps = decode_tokens_per_s(model, args.prompt_len, args.steps, tuning=not args.no_tuning)
        rows.append({"model": name, "mode": "gpt-fast", "batch_size": 1, "prompt_len": args.prompt_len,
                     "decode_tokens_per_s": tps, "step_ms": 1000 / tps})
        print(json.dumps(rows[-1]), flush=True)
        del model
        torch.cuda.empty_cache()
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
