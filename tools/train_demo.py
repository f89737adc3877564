#!/usr/bin/env python3
"""Train the bundled demo pair: a small Llama target and its EAGLE-3 draft head.

    python tools/train_demo.py --out models                  # what `make demo-model` runs
    python tools/train_demo.py --pack-corpus corpus.tar.xz   # snapshot the corpus, then stop
    python tools/train_demo.py --corpus corpus.tar.xz ...    # train from a snapshot (reproducible)

Pipeline: corpus (Python source files) -> byte-level BPE tokenizer -> Llama target (bf16 autocast)
-> EAGLE-3 head trained on the target's hidden states with the training-time-test recipe
(eagle-formats.md §3.2-3.3) -> held-out perplexity, measured chain acceptance -> export:

    OUT/demo-target/   HF LlamaForCausalLM (bf16 safetensors), tokenizer, generation config
    OUT/demo-draft/    EAGLE-3 head, public layout (tools/eagle3_ref.py), tokenizer
    OUT/demo-heldout.txt, OUT/demo-report.json, OUT/README.md

Deterministic given --seed and the corpus: the file order, the held-out split, initialisation and
batch order are all seeded. GPU kernels may still differ in the last bits between runs.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import platform
import sys
import sysconfig
import tarfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eagle3_ref  # noqa: E402  (sibling module; tools/ is not a package)

BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 0, 1
DEMO_PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n")
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ============================================================================ corpus
@dataclass(frozen=True)
class Doc:
    name: str   # "stdlib/json/decoder.py", "site/numpy/...", or a path relative to --corpus
    text: str


def _acceptable(raw: bytes, min_bytes: int = 500, max_bytes: int = 256_000):
    """UTF-8 source of a sane size, without the long lines of generated tables."""
    if not min_bytes <= len(raw) <= max_bytes:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = text.splitlines() or [""]
    if max(map(len, lines)) > 1000 or len(text) / len(lines) > 100:
        return None
    return text.replace("\r\n", "\n")


def _hash(s: str) -> str:
    return hashlib.sha1(s.encode()).hexdigest()


def interpreter_corpus(max_mb_per_package: float) -> list[Doc]:
    """The running interpreter's standard library and site-packages `.py` files.

    Per top-level package (json, email, numpy, torch, ...) at most `max_mb_per_package` MB, taken
    in sha1(name) order so that big packages are sampled, not truncated alphabetically. Exact
    duplicates are dropped. The result is sorted by name.
    """
    paths = sysconfig.get_paths()
    roots = {"stdlib": paths["stdlib"], "site": paths["purelib"]}
    groups: dict[str, list[Doc]] = {}
    seen: set[str] = set()
    for label, root in roots.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "site-packages"))
            for fname in sorted(filenames):
                if not fname.endswith(".py"):
                    continue
                path = os.path.join(dirpath, fname)
                with open(path, "rb") as f:
                    raw = f.read()
                text = _acceptable(raw)
                digest = hashlib.sha256(raw).hexdigest()
                if text is None or digest in seen:
                    continue
                seen.add(digest)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                name = f"{label}/{rel}"
                groups.setdefault(f"{label}/{rel.split('/')[0]}", []).append(Doc(name, text))
    cap = max_mb_per_package * 1e6
    docs = []
    for group in groups.values():
        total = 0
        for doc in sorted(group, key=lambda d: _hash(d.name)):
            if total + len(doc.text) > cap and total > 0:
                continue
            total += len(doc.text)
            docs.append(doc)
    return sorted(docs, key=lambda d: d.name)


def read_corpus(path: str) -> list[Doc]:
    """A folder of text files or a .tar.xz snapshot written by --pack-corpus; sorted by name."""
    docs = []
    if os.path.isdir(path):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for fname in sorted(filenames):
                full = os.path.join(dirpath, fname)
                with open(full, "rb") as f:
                    text = _acceptable(f.read(), min_bytes=1)
                if text is not None:
                    docs.append(Doc(os.path.relpath(full, path).replace(os.sep, "/"), text))
    else:
        with tarfile.open(path, "r:*") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    text = _acceptable(tar.extractfile(member).read(), min_bytes=1)
                    if text is not None:
                        docs.append(Doc(member.name, text))
    return sorted(docs, key=lambda d: d.name)


def pack_corpus(docs: list[Doc], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tarfile.open(path, "w:xz", preset=9) as tar:
        for doc in docs:
            raw = doc.text.encode()
            info = tarfile.TarInfo(doc.name)
            info.size, info.mtime, info.mode = len(raw), 0, 0o644
            tar.addfile(info, io.BytesIO(raw))


def split_heldout(docs: list[Doc], num_heldout: int) -> tuple[list[Doc], list[Doc]]:
    """Held-out files: standard-library modules (not tests) of 4-40 KB, lowest sha1(name) first.

    Independent of the seed, so every run evaluates on the same files. Falls back to any file
    when the corpus has no stdlib/ part (a plain folder).
    """
    def eligible(d: Doc, stdlib_only: bool) -> bool:
        ok = 4000 <= len(d.text) <= 40000
        if stdlib_only:
            ok = ok and d.name.startswith("stdlib/") and not d.name.startswith(
                ("stdlib/test/", "stdlib/idlelib/", "stdlib/lib2to3/tests/"))
        return ok

    stdlib_only = any(d.name.startswith("stdlib/") for d in docs)
    pool = sorted((d for d in docs if eligible(d, stdlib_only)), key=lambda d: _hash("heldout:" + d.name))
    heldout_names = {d.name for d in pool[:num_heldout]}
    return ([d for d in docs if d.name not in heldout_names],
            [d for d in docs if d.name in heldout_names])


# ============================================================================ tokenizer
def train_tokenizer(docs: list[Doc], vocab_size: int, sample_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts, total = [], 0
    for doc in sorted(docs, key=lambda d: _hash("tok:" + d.name)):   # a sample across packages
        if total >= sample_bytes:
            break
        texts.append(doc.text)
        total += len(doc.text)
    tok.train_from_iterator(texts, trainer=trainer)
    # encode(text) prepends BOS, like Llama tokenizers; documents end with EOS in training
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID), (EOS, EOS_ID)])
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    return tok


# A plain "role: content" chat template (the demo model was trained on code, not conversations;
# the template lets chat clients talk to it). It writes the BOS itself, as HF templates do.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
                 "{{ message['content'] }}\n\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def encode_docs(tok, docs: list[Doc]) -> list[np.ndarray]:
    """Each document as BOS + tokens + EOS."""
    encs = tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    return [np.array([BOS_ID] + e.ids + [EOS_ID], dtype=np.int32) for e in encs]


# ============================================================================ target
@dataclass
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    ctx: int
    vocab: int
    max_corpus_mb_per_package: float
    tok_sample_mb: float
    target_steps: int
    target_batch: int
    target_lr: float
    draft_steps: int
    draft_batch: int
    draft_lr: float
    ttt_steps: int
    draft_vocab: int
    num_heldout: int
    eval_prompts_per_doc: int
    eval_new_tokens: int


PRESETS = {
    "demo": Preset(hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024, ctx=1024,
                   vocab=8192, max_corpus_mb_per_package=16.0, tok_sample_mb=40.0,
                   target_steps=3500, target_batch=64, target_lr=2e-3,
                   draft_steps=2800, draft_batch=16, draft_lr=1.5e-3, ttt_steps=4,
                   draft_vocab=7168, num_heldout=12, eval_prompts_per_doc=3, eval_new_tokens=128),
    # a CPU smoke test of the whole pipeline (minutes, useless weights)
    "tiny": Preset(hidden=64, layers=8, heads=4, kv_heads=2, intermediate=128, ctx=128,
                   vocab=1024, max_corpus_mb_per_package=0.05, tok_sample_mb=1.0,
                   target_steps=30, target_batch=8, target_lr=3e-3,
                   draft_steps=20, draft_batch=4, draft_lr=3e-3, ttt_steps=3,
                   draft_vocab=768, num_heldout=3, eval_prompts_per_doc=1, eval_new_tokens=24),
}


def build_target(p: Preset):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
        num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
        head_dim=p.hidden // p.heads, max_position_embeddings=p.ctx, rms_norm_eps=1e-5,
        rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
        attention_bias=False, mlp_bias=False, initializer_range=0.02, use_cache=False)
    return LlamaForCausalLM(cfg)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Batcher:
    """Random windows of `length` tokens from one packed stream; seeded."""

    def __init__(self, stream: torch.Tensor, length: int, seed: int):
        self.stream, self.length = stream, length
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(length, device=stream.device)

    def __call__(self, batch: int) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.length, (batch,), generator=self.gen)
        return self.stream[starts.to(self.stream.device)[:, None] + self.offsets]


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_target(model, stream, p: Preset, args, device, heldout_ids) -> dict:
    model.to(device).train()
    decay = [w for n, w in model.named_parameters() if w.dim() >= 2]
    no_decay = [w for n, w in model.named_parameters() if w.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=p.target_lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    fwd = torch.compile(model) if args.compile else model
    batcher = Batcher(stream, p.ctx + 1, args.seed + 1)
    warmup = max(1, min(100, p.target_steps // 20))
    losses, heldout_curve, t_start, tokens = [], [], time.time(), 0
    for step in range(p.target_steps):
        lr = lr_at(step, p.target_steps, p.target_lr, warmup, 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batcher(p.target_batch)
        with autocast(device):
            logits = fwd(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += batch[:, 1:].numel()
        if step % 50 == 0 or step == p.target_steps - 1:
            value = loss.item()
            losses.append((step, value))
            log(f"target step {step:5d}/{p.target_steps} loss {value:.4f} lr {lr:.2e} "
                f"{tokens / (time.time() - t_start):,.0f} tok/s")
        if (step + 1) % max(1, p.target_steps // 4) == 0:
            model.eval()
            with autocast(device):
                nll = heldout_loss(lambda ids: model(input_ids=ids.to(device)).logits, heldout_ids, p.ctx)
            heldout_curve.append((step + 1, round(nll, 4)))
            log(f"target step {step + 1}: held-out loss {nll:.4f} (bf16 autocast)")
            model.train()
    elapsed = time.time() - t_start
    return {"steps": p.target_steps, "batch_tokens": p.target_batch * p.ctx, "tokens": tokens,
            "seconds": round(elapsed, 1), "final_loss": losses[-1][1],
            "loss_curve": [(s, round(v, 4)) for s, v in losses], "heldout_loss_curve": heldout_curve}


def heldout_loss(logits_fn, heldout_ids: list[np.ndarray], ctx: int) -> float:
    nll, cnt = 0.0, 0
    for ids in heldout_ids:
        s, c = windowed_nll(logits_fn, ids, ctx)
        nll, cnt = nll + s, cnt + c
    return nll / cnt


@torch.no_grad()
def windowed_nll(logits_fn, ids: np.ndarray, ctx: int) -> tuple[float, int]:
    """Sum of next-token NLL over `ids` in independent windows of `ctx` inputs; (sum, count).

    Window w reads ids[w*ctx : (w+1)*ctx] and predicts the following token of each; every token
    but the first is predicted exactly once. tests/test_demo_models.py does the same.
    """
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, ctx):
        chunk = torch.as_tensor(ids[start:start + ctx + 1], dtype=torch.long)[None]
        logits = logits_fn(chunk[:, :-1]).float()
        total += F.cross_entropy(logits[0], chunk[0, 1:].to(logits.device), reduction="sum").item()
        count += chunk.shape[1] - 1
    return total, count


# ============================================================================ draft
def choose_draft_vocab(stream: np.ndarray, vocab: int, draft_vocab: int) -> tuple[np.ndarray, float]:
    """The `draft_vocab` most frequent target ids (ties: lower id), EOS always in; sorted ids
    and the share of training tokens they cover."""
    counts = np.bincount(stream, minlength=vocab).astype(np.float64)
    rank = counts.copy()
    rank[EOS_ID] = np.inf
    used = np.sort(np.lexsort((np.arange(vocab), -rank))[:draft_vocab])
    coverage = counts[used].sum() / counts.sum()
    return used, float(coverage)


def train_draft(head, target, stream, p: Preset, args, device) -> dict:
    """EAGLE-3 training-time test (eagle-formats.md §3.2): online target features, `ttt_steps`
    unrolled steps, soft cross-entropy against the target distribution restricted to the draft
    vocab, step weight 0.8^k, rows whose target argmax is outside the draft vocab masked."""
    head.to(device).train()
    target.eval()
    for w in target.parameters():
        w.requires_grad_(False)
    embed = target.get_input_embeddings()
    aux_ids = head.cfg.aux_layer_ids
    used = head.target_vocab_ids()                                       # [Vd] target ids
    in_draft = head.t2d
    opt = torch.optim.AdamW(head.parameters(), lr=p.draft_lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device.type == "cuda")
    k_steps = p.ttt_steps
    t = p.ctx - k_steps - 1      # rows per window: the target reads t + k_steps + 1 <= ctx tokens
    batcher = Batcher(stream, t + k_steps + 1, args.seed + 2)
    warmup = max(1, p.draft_steps // 50)
    positions = torch.arange(t, device=device)[None].expand(p.draft_batch, t)
    curve, t_start, done = [], time.time(), 0
    for step in range(p.draft_steps):
        if step > 0 and args.deadline is not None and time.time() - T0 > args.deadline:
            log(f"draft training stopped at step {step} by --deadline {args.deadline}")
            break
        done = step + 1
        lr = lr_at(step, p.draft_steps, p.draft_lr, warmup, 0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batcher(p.draft_batch)                                    # [B, T+K+1]
        with torch.no_grad(), autocast(device):
            out = eagle3_ref.target_forward(target, batch, aux_ids)
        aux = out.aux[:, :t]
        with autocast(device):
            step_embeds = [embed(batch[:, 1 + k:1 + k + t]) for k in range(k_steps)]
            step_logits = head.ttt_forward(aux, step_embeds, positions)
        total = 0.0
        stats = []
        for k, logits in enumerate(step_logits):
            # row i at step k predicts token i+2+k: the target's distribution at position i+1+k
            tgt = out.logits[:, 1 + k:1 + k + t].float()
            tgt_argmax = tgt.argmax(-1)
            mask = in_draft[tgt_argmax].float()
            p_target = tgt[..., used].softmax(-1)
            logq = logits.float().log_softmax(-1)
            loss_k = -((p_target * logq).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
            total = total + (0.8 ** k) * loss_k
            acc = ((used[logits.argmax(-1)] == tgt_argmax).float() * mask).sum() / mask.sum()
            stats.append((loss_k, acc))
        total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == p.draft_steps - 1 or (
                args.deadline is not None and time.time() - T0 > args.deadline):
            row = {"step": step, "loss": round(total.item(), 4),
                   "step_loss": [round(l.item(), 4) for l, _ in stats],
                   "step_acc": [round(a.item(), 4) for _, a in stats]}
            curve.append(row)
            log(f"draft step {step:5d}/{p.draft_steps} loss {row['loss']:.4f} lr {lr:.2e} "
                f"acc@k {row['step_acc']} "
                f"{(step + 1) * p.draft_batch * t / (time.time() - t_start):,.0f} tok/s")
    elapsed = time.time() - t_start
    return {"steps": done, "batch_tokens": p.draft_batch * t, "ttt_steps": k_steps,
            "seconds": round(elapsed, 1), "final": curve[-1], "curve": curve}


# ============================================================================ evaluation
def eval_prompts(heldout_ids: list[np.ndarray], per_doc: int, max_prompt: int) -> list[list[int]]:
    """Cut each held-out document after a newline at 1/(k+1)... k/(k+1) of its length."""
    prompts = []
    for ids in heldout_ids:
        for j in range(1, per_doc + 1):
            cut = len(ids) * j // (per_doc + 1)
            prompts.append(ids[max(0, cut - max_prompt):cut].tolist())
    return prompts


def measure_acceptance(runner, head, embed, prompts, new_tokens, num_steps) -> dict:
    lengths, per_prompt = [], []
    for prompt in prompts:
        res = eagle3_ref.chain_speculative_greedy(runner, head, embed, prompt, new_tokens,
                                                  num_steps, EOS_ID)
        lengths += res.accept_lengths
        per_prompt.append(sum(res.accept_lengths) / max(1, len(res.accept_lengths)))
    return {"mean_accept_length": round(sum(lengths) / max(1, len(lengths)), 4),
            "verifies": len(lengths), "prompts": len(prompts),
            "histogram": [lengths.count(i) for i in range(1, num_steps + 2)],
            "per_prompt_min": round(min(per_prompt), 3), "per_prompt_max": round(max(per_prompt), 3)}


# ============================================================================ export
def write_readme(path: str, report: dict) -> None:
    r = report
    t, d, m, a = r["target"], r["draft"], r["models"], r["acceptance"]
    demo_rows = "\n".join(f"| `{json.dumps(k)[1:-1]}` | {v['accept_length']} | `{json.dumps(v['text'][:70])[1:-1]}` |"
                          for k, v in a["demo_prompts"].items())
    text = f"""# Demo models (embedded default of specserve)

Generated by `tools/train_demo.py` (`make demo-model`); every number below comes from
`demo-report.json`, written by the same run.

| | |
|---|---|
| command | `{r['command']}` |
| device | {r['device']} (torch {r['torch']}, transformers {r['transformers']}) |
| total time | {r['seconds_total']} s (target {t['train']['seconds']} s, draft {d['train']['seconds']} s) |
| seed | {r['seed']} |

## Data
Python source files: {r['corpus']['description']}. {r['corpus']['train_docs']} training files
({r['corpus']['train_mb']} MB, {r['corpus']['train_tokens']:,} tokens), {r['corpus']['heldout_docs']} held-out
standard-library modules (not trained on; listed in `demo-report.json`). Every document is
`<|bos|>` + text + `<|eos|>`, packed into one stream.
`demo-heldout.txt` ({r['heldout_sample']['bytes']} bytes, Python standard library, PSF licence) is a sample of
the held-out files that the tests score.

## Tokenizer
Byte-level BPE (`tokenizers`), vocab {r['tokenizer']['vocab_size']}, trained on
{r['tokenizer']['sample_mb']} MB of the training files. Special tokens `<|bos|>` = {BOS_ID},
`<|eos|>` = {EOS_ID}; `encode(text)` prepends `<|bos|>` (template post-processor); no pad token of
its own (`tokenizer_config.json` names `<|eos|>` as pad).

## demo-target: `LlamaForCausalLM`
{t['params']:,} parameters; hidden {t['config']['hidden_size']}, {t['config']['num_hidden_layers']} layers,
{t['config']['num_attention_heads']} heads / {t['config']['num_key_value_heads']} KV heads (head_dim {t['config']['head_dim']}),
MLP {t['config']['intermediate_size']}, untied lm_head, RoPE theta 10000 (`rope_parameters`),
max_position_embeddings {t['config']['max_position_embeddings']}, rms_norm_eps 1e-5.
Stored in bfloat16 ({m['demo-target_mb']} MB). Trained {t['train']['steps']} steps x {t['train']['batch_tokens']:,} tokens
({t['train']['tokens']:,} tokens), AdamW lr {t['lr']} cosine, bf16 autocast; final train loss {t['train']['final_loss']:.4f},
held-out loss during training (bf16) {t['train']['heldout_loss_curve']}.

| held-out | tokens | loss | perplexity |
|---|---|---|---|
| all held-out files | {t['heldout']['tokens']:,} | {t['heldout']['loss']} | **{t['heldout']['ppl']}** |
| `demo-heldout.txt` (tests) | {r['heldout_sample']['tokens']:,} | {r['heldout_sample']['loss']} | **{r['heldout_sample']['ppl']}** |

(The bf16-rounded weights that ship were scored, in fp32.)

## demo-draft: EAGLE-3 head (`LlamaForCausalLMEagle3`)
{d['params']:,} parameters, bfloat16 ({m['demo-draft_mb']} MB). Public SafeAILab/SpecForge layout, 15 tensors:
`fc.weight` [{d['config']['hidden_size']}, {3 * d['config']['hidden_size']}], `midlayer.{{input_layernorm,hidden_norm,post_attention_layernorm}}.weight`,
`midlayer.self_attn.{{q,k,v}}_proj.weight` (input 2H = {2 * d['config']['hidden_size']}), `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{{gate,up,down}}_proj.weight`, `norm.weight`, `lm_head.weight` [{d['config']['draft_vocab_size']}, {d['config']['hidden_size']}],
`d2t` int64 [{d['config']['draft_vocab_size']}], `t2d` bool [{d['config']['vocab_size']}]. **No `embed_tokens`**: the target's embedding is shared
(H == target H, so the config has no `target_hidden_size`).

* Aux hidden states: `eagle_config.eagle_aux_hidden_state_layer_ids = {d['config']['eagle_config']['eagle_aux_hidden_state_layer_ids']}` =
  the **outputs of target decoder layers {d['aux_layers']} (0-based)**, residual stream before the final norm,
  concatenated low|mid|high. In Hugging Face `output_hidden_states` numbering (0 = embeddings) these are
  `hidden_states[{[i + 1 for i in d['aux_layers']]}]`; in the vLLM capture-before convention `{[i + 1 for i in d['aux_layers']]}`.
* Draft vocab {d['config']['draft_vocab_size']} of {d['config']['vocab_size']} (covers {d['draft_vocab_coverage']:.2%} of training tokens); `target_id = draft_id + d2t[draft_id]`.
* Forward (eagle-formats.md §2.6, `tools/eagle3_ref.py`): `x = cat(input_layernorm(embed(tok)), hidden_norm(h))`,
  residual = un-normed `h`, `norm` only before `lm_head`; the pre-norm output is fed back at the next step.
  RoPE theta {d['config']['rope_theta']}, positions: row p pairs (feature of p, token p+1) at position p.
* Training: {d['train']['steps']} steps x {d['train']['batch_tokens']:,} tokens, training-time test with {d['train']['ttt_steps']} unrolled steps
  (weights 0.8^k), soft cross-entropy against the target distribution over the draft vocab, AdamW lr {d['lr']}
  cosine, grad clip 0.5, target frozen (online features, bf16 autocast).
  Final loss {d['train']['final']['loss']}; top-1 agreement with the target per step {d['train']['final']['step_acc']}.

## Measured acceptance (chain drafting, 3 steps, greedy verify)
Plain-torch simulation (`tools/eagle3_ref.py::chain_speculative_greedy`, fp32) on {a['heldout']['prompts']} prompts cut
from the held-out files, {r['eval_new_tokens']} new tokens each: **mean accept length {a['heldout']['mean_accept_length']}** tokens per
verify (accepted drafts + the bonus token; max 4) over {a['heldout']['verifies']} verifies; histogram of
1/2/3/4 = {a['heldout']['histogram']}. Greedy parity with plain decoding: {a['greedy_parity']}.
Tree drafting is measured later by the engine.

| prompt | accept length | greedy continuation (start) |
|---|---|---|
{demo_rows}

## Notes for loaders (engine)
* Target: a plain HF Llama; RoPE theta is under `rope_parameters.rope_theta` (transformers 5 layout,
  no top-level `rope_theta`); untied `lm_head.weight`; weights bfloat16; `pad_token_id` null.
* Draft: choose the EAGLE-3 class from the method/arch `LlamaForCausalLMEagle3`; `midlayer.*` names;
  no `fc.bias`, no q/k/v biases; `head_dim` given; RoPE theta in top-level `rope_theta`; none of the
  variant flags of eagle-formats.md §2.9 (`norm_before_residual` is false: the residual is the
  un-normed `h`).
* Embedding: `embed_tokens` is not in the draft checkpoint; use the target's `model.embed_tokens`. Tokens
  fed to the draft are target ids (map drafted ids through d2t before embedding them).
* Hidden states: capture the residual stream after target decoder layers {d['aux_layers']} (0-based), before the
  final norm, and concatenate them in that order (3 x {d['config']['hidden_size']} = {3 * d['config']['hidden_size']} wide) for `fc`.
* Later draft steps feed back `h_prenorm` (before `norm`), skip `fc`, and advance the position by one.

## Reproduce
```
python tools/train_demo.py --pack-corpus tools/.corpus_cache/pycode.tar.xz   # snapshot (not committed)
{r['command']}
```
The snapshot holds the development machine's Python 3.11 stdlib and project-venv site-packages `.py` files (at most
16 MB per top-level package, sampled in sha1(path) order). `make demo-model` runs the same pipeline
on the running interpreter's own files (a GPU is strongly advised; `DEMO_ARGS` passes flags).
"""
    with open(path, "w") as f:
        f.write(text)


def dir_mb(path: str) -> float:
    return round(sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e6, 2)


# ============================================================================ main
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="models", help="output folder (demo-target/, demo-draft/, ...)")
    ap.add_argument("--corpus", default=None,
                    help="folder of text files or --pack-corpus archive; default: this "
                         "interpreter's stdlib + site-packages .py files")
    ap.add_argument("--pack-corpus", default=None, metavar="PATH",
                    help="write the default corpus to PATH (.tar.xz) and exit")
    ap.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target for training")
    ap.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                    help="stop draft training early once the run has taken this long (a guard for "
                         "time-limited machines; the report records the steps actually done)")
    for field in ("target_steps", "target_batch", "draft_steps", "draft_batch", "ttt_steps",
                  "draft_vocab", "num_heldout", "eval_prompts_per_doc", "eval_new_tokens"):
        ap.add_argument("--" + field.replace("_", "-"), type=int, default=None)
    for field in ("target_lr", "draft_lr", "max_corpus_mb_per_package"):
        ap.add_argument("--" + field.replace("_", "-"), type=float, default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    for field in p.__dataclass_fields__:
        if getattr(args, field, None) is not None:
            setattr(p, field, getattr(args, field))

    if args.pack_corpus:
        docs = interpreter_corpus(p.max_corpus_mb_per_package)
        pack_corpus(docs, args.pack_corpus)
        log(f"packed {len(docs)} files, {sum(len(d.text) for d in docs) / 1e6:.1f} MB -> "
            f"{args.pack_corpus} ({os.path.getsize(args.pack_corpus) / 1e6:.1f} MB)")
        return

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import transformers

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(f"device {device} ({device_name}), torch {torch.__version__}, transformers {transformers.__version__}")

    # ---- corpus
    if args.corpus:
        docs = read_corpus(args.corpus)
        description = f"snapshot `{os.path.basename(args.corpus)}` (made with --pack-corpus)"
    else:
        docs = interpreter_corpus(p.max_corpus_mb_per_package)
        description = (f"this interpreter's standard library and site-packages (Python "
                       f"{platform.python_version()}), at most {p.max_corpus_mb_per_package} MB per package")
    train_docs, heldout_docs = split_heldout(docs, p.num_heldout)
    train_mb = sum(len(d.text) for d in train_docs) / 1e6
    log(f"corpus: {len(train_docs)} train files ({train_mb:.1f} MB), {len(heldout_docs)} held out: "
        f"{[d.name for d in heldout_docs]}")

    # ---- tokenizer
    tok = train_tokenizer(train_docs, p.vocab, int(p.tok_sample_mb * 1e6))
    assert tok.get_vocab_size() == p.vocab, tok.get_vocab_size()
    log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}")
    train_stream = np.concatenate(encode_docs(tok, train_docs))
    heldout_ids = encode_docs(tok, heldout_docs)
    log(f"train tokens {len(train_stream):,} ({train_mb * 1e6 / len(train_stream):.2f} chars/token)")

    # ---- target
    target = build_target(p)
    n_target = sum(w.numel() for w in target.parameters())
    log(f"target: {n_target / 1e6:.2f}M params")
    stream_dev = torch.as_tensor(train_stream.astype(np.int64), device=device)
    target_train = train_target(target, stream_dev, p, args, device, heldout_ids)
    # round to the stored dtype, so that everything below sees exactly the shipped weights
    target.to(torch.bfloat16).to(torch.float32).eval()
    logits_fn = lambda ids: target(input_ids=ids.to(device)).logits  # noqa: E731
    with torch.no_grad():
        loss = heldout_loss(logits_fn, heldout_ids, p.ctx)
        cnt = sum(len(ids) - 1 for ids in heldout_ids)
        sample_text, budget = "", 100_000
        for d in heldout_docs:
            if len(sample_text) + len(d.text) > budget and sample_text:
                break
            sample_text += d.text if not sample_text else "\n\n" + d.text
        sample_ids = np.array(tok.encode(sample_text).ids)
        s_nll, s_cnt = windowed_nll(logits_fn, sample_ids, p.ctx)
    heldout = {"tokens": cnt, "loss": round(loss, 4), "ppl": round(math.exp(loss), 3)}
    sample = {"bytes": len(sample_text.encode()), "tokens": s_cnt, "loss": round(s_nll / s_cnt, 4),
              "ppl": round(math.exp(s_nll / s_cnt), 3)}
    log(f"target held-out: loss {heldout['loss']} ppl {heldout['ppl']} over {cnt:,} tokens; "
        f"sample ppl {sample['ppl']}")

    # ---- draft
    aux_layers = eagle3_ref.default_aux_layers(p.layers)
    used, coverage = choose_draft_vocab(train_stream, p.vocab, p.draft_vocab)
    dcfg = eagle3_ref.Eagle3Config(
        hidden_size=p.hidden, intermediate_size=p.intermediate, num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads, head_dim=p.hidden // p.heads, vocab_size=p.vocab,
        draft_vocab_size=p.draft_vocab, aux_layer_ids=aux_layers, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=p.ctx, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    head = eagle3_ref.Eagle3Head(dcfg)
    for name, w in head.named_parameters():
        if w.dim() == 2:
            torch.nn.init.normal_(w, std=0.02)
    head.set_draft_vocab(torch.as_tensor(used))
    with torch.no_grad():   # start from the target's own output head, restricted to the draft vocab
        head.lm_head.weight.copy_(target.lm_head.weight[torch.as_tensor(used).to(device)].cpu())
        head.norm.weight.copy_(target.model.norm.weight.cpu())
    n_draft = sum(w.numel() for w in head.parameters())
    log(f"draft: {n_draft / 1e6:.2f}M params, aux layers {aux_layers}, draft vocab {p.draft_vocab} "
        f"covers {coverage:.4f} of training tokens")
    draft_train = train_draft(head, target, stream_dev, p, args, device)
    del stream_dev
    # the head ships in bf16: evaluate the rounded weights
    head.to(torch.bfloat16).to(torch.float32).eval()

    # ---- acceptance (fp32, exact argmax)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runner = eagle3_ref.TargetRunner(target, aux_layers)
    embed = target.get_input_embeddings()
    prompts = eval_prompts(heldout_ids, p.eval_prompts_per_doc, 256)
    acc_heldout = measure_acceptance(runner, head, embed, prompts, p.eval_new_tokens, 3)
    log(f"acceptance (chain, 3 steps) on {len(prompts)} held-out prompts: {acc_heldout}")
    demo, parity = {}, True
    for text in DEMO_PROMPTS:
        ids = tok.encode(text).ids
        res = eagle3_ref.chain_speculative_greedy(runner, head, embed, ids, p.eval_new_tokens, 3, EOS_ID)
        plain = eagle3_ref.greedy_generate(runner, ids, p.eval_new_tokens, EOS_ID)
        parity = parity and plain == res.tokens
        demo[text] = {"accept_length": round(sum(res.accept_lengths) / len(res.accept_lengths), 3),
                      "text": tok.decode(res.tokens), "matches_plain_greedy": plain == res.tokens}
        log(f"prompt {text!r}: accept {demo[text]['accept_length']} parity {plain == res.tokens}\n"
            f"{text}{demo[text]['text']}\n{'-' * 60}")

    # ---- export
    from transformers import GenerationConfig

    out = os.path.abspath(args.out)
    tgt_dir, dft_dir = os.path.join(out, "demo-target"), os.path.join(out, "demo-draft")
    os.makedirs(out, exist_ok=True)
    target.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                                pad_token_id=EOS_ID, do_sample=False)
    target.config.use_cache = True
    target.to(torch.bfloat16).save_pretrained(tgt_dir)
    eagle3_ref.save_head(head, dft_dir, torch.bfloat16)
    target.generation_config.save_pretrained(dft_dir)
    for folder in (tgt_dir, dft_dir):
        tok.save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config(p.ctx), f, indent=2)
            f.write("\n")
    with open(os.path.join(out, "demo-heldout.txt"), "w") as f:
        f.write(sample_text)

    report = {
        "command": "python tools/train_demo.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
        "seed": args.seed, "preset": args.preset, "eval_new_tokens": p.eval_new_tokens,
        "corpus": {"description": description, "train_docs": len(train_docs),
                   "train_mb": round(train_mb, 1), "train_tokens": int(len(train_stream)),
                   "heldout_docs": len(heldout_docs), "heldout_names": [d.name for d in heldout_docs]},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "sample_mb": p.tok_sample_mb,
                      "bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
        "target": {"params": n_target, "config": json.loads(target.config.to_json_string()),
                   "lr": p.target_lr, "train": target_train, "heldout": heldout},
        "heldout_sample": sample,
        "draft": {"params": n_draft, "config": dcfg.to_hf_dict("bfloat16"), "aux_layers": list(aux_layers),
                  "draft_vocab_coverage": coverage, "lr": p.draft_lr, "train": draft_train},
        "acceptance": {"num_steps": 3, "heldout": acc_heldout, "demo_prompts": demo,
                       "greedy_parity": parity},
        "models": {"demo-target_mb": dir_mb(tgt_dir), "demo-draft_mb": dir_mb(dft_dir)},
        "seconds_total": round(time.time() - T0, 1),
    }
    with open(os.path.join(out, "demo-report.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    write_readme(os.path.join(out, "README.md"), report)
    log(f"SUMMARY target ppl {heldout['ppl']} (sample {sample['ppl']}), draft loss "
        f"{draft_train['final']['loss']}, accept length {acc_heldout['mean_accept_length']} "
        f"(held-out), parity {parity}, models {report['models']}, total {report['seconds_total']} s")


if __name__ == "__main__":
    main()
