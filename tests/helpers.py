"""Test helpers: tiny random Hugging Face checkpoints built on the fly, and engine checks."""
from __future__ import annotations

import contextlib
import os
from typing import Callable, NamedTuple, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
VOCAB = 320


def make_tiny_checkpoint(path: str, arch: str = "llama", *, seed: int = 0, num_layers: int = 2,
                         tie: bool = False, sharded: bool = False, vocab_size: int = VOCAB,
                         max_position: int = 512, with_tokenizer: bool = True, num_kv_heads: int = 2,
                         hidden_size: int = 64, intermediate_size: int = 128, **moe) -> str:
    """Save a random tiny model of `arch` with `save_pretrained`, plus a byte-level tokenizer.
    `moe`: options of `deepseek_config` for the deepseek_v2/v3 archs, of `moe_family_config`
    for qwen3_moe and mixtral."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=tie)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
        model_cls = tf.LlamaForCausalLM
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        model_cls = tf.LlamaForCausalLM
    elif arch == "llama-yarn":
        cfg = tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
        model_cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
        model_cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        model_cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)
        model_cls = tf.Qwen3ForCausalLM
    elif arch in DEEPSEEK_ARCHS:
        cfg = deepseek_config(arch, **moe, **common)
        model_cls = tf.DeepseekV3ForCausalLM if arch == "deepseek_v3" else tf.DeepseekV2ForCausalLM
    elif arch in MOE_FAMILY_ARCHS:
        cfg = moe_family_config(arch, **moe, **common)
        model_cls = tf.Qwen3MoeForCausalLM if arch == "qwen3_moe" else tf.MixtralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    if arch in DEEPSEEK_ARCHS + MOE_FAMILY_ARCHS:
        _spread_routing(model)
    # Spread the logits so greedy argmax has clear margins (no fp32 near-ties).
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    kwargs = {"max_shard_size": "100KB"} if sharded else {}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        save_byte_tokenizer(path, vocab_size)
    return path


DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")


def deepseek_config(arch: str, *, q_lora_rank=None, yarn: bool = False, num_experts: int = 8,
                    num_groups: int = 4, topk_groups: int = 2, first_k_dense: int = 1,
                    shared_experts: int = 1, group_limited: bool = True, rope_interleave: bool = True,
                    **common):
    """A tiny DeepSeek config: MLA (kv_lora 32, rope 8, nope 16, v 16), 8 experts top-2 in 4
    groups (2 kept), one dense first layer, a shared expert; V3 scores by sigmoid with the
    correction bias. `common` as make_tiny_checkpoint's (num_key_value_heads is ignored)."""
    import transformers as tf

    common = dict(common, num_key_value_heads=common["num_attention_heads"],
                  moe_intermediate_size=32, n_routed_experts=num_experts, n_shared_experts=shared_experts,
                  num_experts_per_tok=2, first_k_dense_replace=first_k_dense, kv_lora_rank=32,
                  q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  n_group=num_groups, topk_group=topk_groups)
    if yarn:  # positions past 64 are where YaRN (and its mscale) change the result
        common["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                  "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(**common, routed_scaling_factor=2.5, rope_interleave=rope_interleave)
    return tf.DeepseekV2Config(**common, routed_scaling_factor=1.5,
                               topk_method="group_limited_greedy" if group_limited else "greedy")


MOE_FAMILY_ARCHS = ("qwen3_moe", "mixtral")


def moe_family_config(arch: str, *, num_experts: int = 8, top_k: int = 2, norm_topk_prob: bool = True,
                      sparse_step: int = 1, mlp_only_layers=(), **common):
    """A tiny Qwen3-MoE (head_dim 32, per-head q/k norm) or Mixtral (experts as wide as
    intermediate_size) config: `num_experts` top-`top_k`; Qwen3-MoE's experts are 32 wide, its
    dense layers (mlp_only_layers, sparse_step) intermediate_size. `common` as
    make_tiny_checkpoint's."""
    import transformers as tf

    if arch == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=num_experts, num_experts_per_tok=top_k)
    return tf.Qwen3MoeConfig(**common, head_dim=32, num_experts=num_experts, num_experts_per_tok=top_k,
                             moe_intermediate_size=32, norm_topk_prob=norm_topk_prob,
                             decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only_layers))


def _spread_routing(model) -> None:
    """Router logits (and V3's correction bias) far apart: no near-ties in the expert choice."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):  # the routers (dense MLPs name theirs gate_proj)
                param.normal_(0.0, 0.5)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.3)


def save_byte_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on a few lines, with <bos>=1 and <eos>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["def add(a, b):\n    return a + b\n", "class Stack:\n    pass\n",
              "import os\nprint('hello world')\n", "héllo wörld ✓ 日本語"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))


def cached_checkpoints(tmp_path_factory, configs: dict) -> Callable[[str], str]:
    """name -> a 3-layer tiny checkpoint of configs[name] = (arch, options, ...), made once."""
    made = {}

    def get(name: str) -> str:
        if name not in made:
            arch, opts = configs[name][:2]
            made[name] = make_tiny_checkpoint(str(tmp_path_factory.mktemp(name)), arch, num_layers=3,
                                              seed=7, **opts)
        return made[name]

    return get


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len, vocab] of one sequence."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding effects), fp32."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


def random_prompts(n: int, *, seed: int, min_len: int = 1, max_len: int = 40,
                   vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def copying_prompts() -> list[list[int]]:
    """Prompts for copying drafters (n-gram, suffix): random ones, and ones that repeat
    themselves."""
    plain = random_prompts(6, seed=3, max_len=24)
    return plain + [p + p[: len(p) // 2] + p for p in random_prompts(4, seed=8, min_len=4, max_len=12)]


def plain_copying_reference(target: str) -> tuple[list, list, list]:
    """(prompts, params, plain greedy decoding's tokens) over `copying_prompts`, of mixed
    lengths: requests finish while others still decode."""
    from specserve.engine import Engine, EngineConfig, SamplingParams

    prompts = copying_prompts()
    params = [SamplingParams(max_new_tokens=[1, 2, 17, 40][i % 4], temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    with Engine(EngineConfig(model=target, device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    return prompts, params, [o.token_ids for o in outs]


def assert_slot_accounting(engine) -> None:
    """Every KV slot is exactly one of: free, held by the prefix cache, owned by a running
    request (its row past its cached or shared prefix), or by the shared prompt prefix of an
    n > 1 request (without the cache); every cache node is referenced by exactly the running
    requests whose cached prefix passes through it."""
    core = engine.core
    alloc, slots = core.allocator, core.scheduler.slots
    cache = slots.cache
    alloc._merge_pending()
    parts = [alloc._free.cpu()]
    if cache is not None:
        parts += [s.cpu() for s in cache.cached_slots()]
        assert sum(p.numel() for p in parts[1:]) == cache.size, "cache size counter is off"
    table = core.req_to_token.table.cpu()
    running = core.scheduler.policy.running
    shares = {}
    for req in running:
        own_from = req.cached_len
        if req.owns_share:
            own_from = req.shared.length
            shares[id(req.shared)] = req.shared
            assert torch.equal(table[req.row, :own_from], req.shared.slots.cpu()), \
                "a row's shared prefix differs from the share's slots"
        parts.append(table[req.row, own_from:req.kv_allocated_len])
        if req.prefix is not None and req.cached_len:
            assert torch.equal(table[req.row, :req.cached_len], req.prefix.slots.cpu()), \
                "a row's cached prefix differs from the cache's slots"
    parts += [share.slots.cpu() for share in shares.values()]
    held = torch.sort(torch.cat(parts)).values
    assert torch.equal(held, torch.arange(1, alloc.num_slots + 1)), \
        f"KV slots lost or held twice: {held.numel()} accounted of {alloc.num_slots}"
    if cache is not None:
        expected = {serial: 0 for serial in cache.refs()}
        for req in running:
            node = req.prefix.node if req.prefix is not None else None
            while node is not None and node is not cache.root:
                expected[node.serial] += 1
                node = node.parent
        assert cache.refs() == expected, "prefix cache reference counts are off"
        unpinned = sum(len(n.key) for n in cache._nodes() if n.ref == 0)
        assert cache.evictable_size == unpinned, "evictable size counter is off"


def assert_no_leaks(engine) -> None:
    """Every request row is free again, no request is left, and every KV slot is free or held
    by the prefix cache (unpinned, so reclaimable), each exactly once."""
    core = engine.core
    core.scheduler.drain()
    assert core.req_to_token.num_free == core.req_to_token.num_rows, "request-row leak"
    scheduler = core.scheduler
    assert not scheduler.reqs and not scheduler.num_running and not scheduler.num_waiting
    assert_slot_accounting(engine)
    cache = scheduler.slots.cache
    held = core.allocator.num_slots - core.allocator.num_free
    if cache is not None:
        assert all(ref == 0 for ref in cache.refs().values()), "a finished request still pins the cache"
        assert cache.evictable_size == cache.size == held, f"KV leak: {held - cache.size} slots held"
    else:
        assert held == 0, f"KV leak: {held} slots held"


def cached_prefix_slots(engine, tokens: list[int]) -> torch.Tensor:
    """The KV slots the engine's prefix cache holds for the whole of `tokens` (asserted),
    looked up without keeping a reference."""
    cache = engine.core.scheduler.slots.cache
    keys = cache.keys(tokens, len(tokens))
    match = cache.acquire(keys)
    cache.release(match)
    assert match.length == len(keys)
    return match.slots


@contextlib.contextmanager
def blocking_syncs_fail():
    """Within: any blocking host sync of CUDA raises (after the work before it has finished)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def steady_state_steps(engine, prompt, n_steps=12):
    """Steps of one long request past its start, with any blocking host sync an error (CUDA)."""
    from specserve.engine import SamplingParams

    engine.add_request("r", prompt, SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefill and the first iterations (allocation, first graph use)
        engine.step()
    try:
        with blocking_syncs_fail():
            for _ in range(n_steps):
                engine.step()
    finally:
        engine.abort("r")
        engine.step()


def _random_head(path: str, seed: int):
    """Folder and a seeded random-weight maker for a head checkpoint."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g) * 0.05


def make_eagle3_head(path: str, *, hidden_size: int = 64, vocab_size: int = VOCAB, draft_vocab: int = 200,
                     target_layers: int = 2, seed: int = 0, with_embed: bool = False) -> str:
    """A random EAGLE-3 head in the public layout (midlayer.*, fc, norm, lm_head, d2t, t2d)."""
    import json

    from safetensors.torch import save_file

    w = _random_head(path, seed)
    g = torch.Generator().manual_seed(seed + 1)
    h, inter, heads, kv_heads = hidden_size, 128, 4, 2
    hd = h // heads

    hot = torch.sort(torch.randperm(vocab_size, generator=g)[:draft_vocab]).values
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": torch.ones(h),
        "lm_head.weight": w(draft_vocab, h) * 20,
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, hot, True),
    }
    if with_embed:
        tensors["embed_tokens.weight"] = w(vocab_size, h)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
              "draft_vocab_size": draft_vocab, "max_position_embeddings": 512, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, target_layers - 1, 0]}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def make_eagle1_head(path: str, *, hidden_size: int = 64, vocab_size: int = VOCAB, seed: int = 0,
                     intermediate_size: int = 128) -> str:
    """A random EAGLE-1 head: fc over cat(embed, feature), layers.0 without input norm."""
    import json

    from safetensors.torch import save_file

    w = _random_head(path, seed)
    h, inter, heads, kv_heads = hidden_size, intermediate_size, 4, 2
    hd = h // heads

    tensors = {
        "embed_tokens.weight": w(vocab_size, h), "fc.weight": w(h, 2 * h), "fc.bias": w(h),
        "layers.0.self_attn.q_proj.weight": w(heads * hd, h),
        "layers.0.self_attn.k_proj.weight": w(kv_heads * hd, h),
        "layers.0.self_attn.v_proj.weight": w(kv_heads * hd, h),
        "layers.0.self_attn.o_proj.weight": w(h, heads * hd),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "layers.0.mlp.gate_proj.weight": w(inter, h), "layers.0.mlp.up_proj.weight": w(inter, h),
        "layers.0.mlp.down_proj.weight": w(h, inter),
    }
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
              "max_position_embeddings": 512, "bias": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def make_predictable_pair(root: str, *, attn_scale: float = 0.3, seed: int = 0, num_layers: int = 2,
                          vocab_size: int = VOCAB, hidden_size: int = 64,
                          intermediate_size: int = 128, max_position: int = 512,
                          arch: str = "llama", **moe) -> tuple[str, str]:
    """A target whose next token mostly depends on the current one, and an EAGLE-1 head that
    knows that dependency: real, partial acceptance on random weights.

    The target's attention and MLP outputs are scaled down by `attn_scale`, so its logits are
    close to lm_head(norm(embed(token))). The head passes embed(token) straight through
    (fc = [I | 0], zero attention and MLP outputs), and EAGLE-1 reads logits through the
    target's lm_head; the final norm only rescales a row, so the argmax is the same.
    """
    from safetensors.torch import load_file, save_file

    target = make_tiny_checkpoint(os.path.join(root, "target"), arch, seed=seed, num_layers=num_layers,
                                  vocab_size=vocab_size, hidden_size=hidden_size,
                                  intermediate_size=intermediate_size, max_position=max_position,
                                  **moe)
    file = os.path.join(target, "model.safetensors")
    weights = load_file(file)
    for name in list(weights):
        # o_proj, and the dense MLPs' and experts' down projections (Mixtral's are w2)
        if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
            weights[name] = weights[name] * attn_scale
    save_file(weights, file, metadata={"format": "pt"})
    head = make_eagle1_head(os.path.join(root, "head"), vocab_size=vocab_size, seed=seed + 1,
                            hidden_size=hidden_size, intermediate_size=intermediate_size)
    head_file = os.path.join(head, "model.safetensors")
    h = load_file(head_file)
    dim = h["fc.bias"].shape[0]
    h["embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    h["fc.weight"] = torch.cat([torch.eye(dim), torch.zeros(dim, dim)], dim=1)
    h["fc.bias"] = torch.zeros(dim)
    h["layers.0.self_attn.o_proj.weight"] = torch.zeros_like(h["layers.0.self_attn.o_proj.weight"])
    h["layers.0.mlp.down_proj.weight"] = torch.zeros_like(h["layers.0.mlp.down_proj.weight"])
    save_file(h, head_file, metadata={"format": "pt"})
    return target, head


def pair_chisquare_pvalue(dist, prompt: list[int], outs, vocab: int) -> float:
    """Chi-square p-value of the (2nd, 3rd) generated tokens of `outs` against the exact joint
    distribution `dist(ids) -> probs of the next token` gives (mixed over the first token);
    pairs expected fewer than 5 times are pooled into one bin."""
    from scipy.stats import chisquare

    p1 = dist(prompt)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a in range(vocab):
        pa = dist(prompt + [a])
        for b in range(vocab):
            joint[b] += p1[a] * pa[b] * dist(prompt + [a, b])
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    p, c = joint.flatten() * len(outs), counts.flatten()
    keep = p >= 5
    observed = torch.cat([c[keep], c[~keep].sum(0, keepdim=True)])
    expected = torch.cat([p[keep], p[~keep].sum(0, keepdim=True)])
    return chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy()).pvalue


def run_aborting(engine, abort_rid: str, abort_at_step: int, max_steps: int = 500):
    """Step the engine until it is idle, aborting `abort_rid` at step `abort_at_step`; returns
    (generated ids by rid, finish reason by rid)."""
    outs, reasons = {}, {}
    for step in range(max_steps):
        if step == abort_at_step:
            engine.abort(abort_rid)
        for out in engine.step():
            outs.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.rid] = out.finish_reason
        if not engine.has_unfinished():
            break
    return outs, reasons


class _NewStorages(TorchDispatchMode):
    """The storages an op under it allocates (outputs that alias none of its inputs: what a
    captured graph would place in its pool)."""

    def __init__(self):
        super().__init__()
        self.ptrs: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        for result, returned in zip(results, func._schema.returns):
            if isinstance(result, torch.Tensor) and returned.alias_info is None:
                self.ptrs.add(result.untyped_storage().data_ptr())
        return out


def _tensors(value):
    """The tensors inside a part's outputs (tuples, NamedTuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _overwrite(t: torch.Tensor) -> None:
    """What a later replay leaves where a tensor was: values no step computes."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class StandInPool:
    """A CUDA graph pool's reuse of memory, as the stand-in models it. Graphs captured into one
    pool may place their tensors in the freed transients of those captured before them, so
    replaying a graph overwrites the outputs of every graph captured after it in the pool,
    where those graphs allocated them (not views of buffers made outside). Replayed in capture
    order, one finished before the next, that is harmless; interleaved, a later graph's
    outputs are gone before they are read. The stand-in overwrites them at every replay. A
    graph's first replay stands for its warm-up, which runs outside the pool: what it makes
    (a lazily built cache such as engine/aranges.py's) outlives it."""

    def __init__(self):
        self.order: list[tuple] = []  # (graphs, bucket, part) in capture order
        self.outputs: dict[tuple, tuple] = {}  # the same key -> (its last outputs, their new storages)

    def replaying(self, key: tuple) -> None:
        later = self.order[self.order.index(key) + 1:]
        for other in later:
            outputs, storages = self.outputs.get(other, ((), ()))
            for t in _tensors(outputs):
                if t.untyped_storage().data_ptr() in storages:
                    _overwrite(t)


def eager_graphs(monkeypatch):
    """GraphedStep with each bucket's parts run eagerly on its static inputs (the CPU stand-in
    for CUDA graphs: bucket loading and padding run as on a GPU); replays recorded as
    (graphs, the static rows tensor or None, part). Graphs without a pool get one of their own
    (`StandInPool`: a replay overwrites what graphs captured after it in its pool allocated)."""
    from specserve.engine.runtime import cuda_graph, worker
    from specserve.engine.spec import eagle_drafter, spec_worker

    class EagerGraphs(cuda_graph.GraphedStep):
        replays: list = []

        def capture_all(self, what: str) -> None:
            if self.pool is None:
                self.pool = StandInPool()
            super().capture_all(what)

        def _capture(self, bs):
            self.captured[bs] = cuda_graph._Captured([], self.make_inputs(bs), [])
            if isinstance(self.pool, StandInPool):
                self.pool.order += [(self, bs, part) for part in range(len(self.parts))]

        def replay(self, captured, part):
            EagerGraphs.replays.append((self, getattr(captured.inputs, "rows", None), part))
            if part == 0:
                captured.outputs.clear()
            key = (self, next(b for b, c in self.captured.items() if c is captured), part)
            pooled = isinstance(self.pool, StandInPool)
            if pooled:
                self.pool.replaying(key)
            with _NewStorages() as new:
                captured.outputs.append(self.parts[part](captured.outputs[-1] if part else captured.inputs))
            if pooled:  # a key's first replay stands for the capture's warm-up, outside the pool
                first = key not in self.pool.outputs
                self.pool.outputs[key] = (captured.outputs[-1], set() if first else new.ptrs)
            return captured.outputs[-1]

    for module in (worker, spec_worker, eagle_drafter):
        monkeypatch.setattr(module, "GraphedStep", EagerGraphs)
    return EagerGraphs


def graphed_engine(make_engine, monkeypatch, model, constrained: bool = False, **kwargs):
    """A CPU engine whose worker captured `eager_graphs` (with `constrained`: the constrained
    steps' too; with mixed steps on, the mixed forwards'); (engine, the EagerGraphs class and
    its replays)."""
    engine = make_engine(model, **kwargs)
    return engine, capture_eager_graphs(engine, monkeypatch, constrained)


def capture_eager_graphs(engine, monkeypatch, constrained: bool = False):
    """Capture `engine`'s graphs through `eager_graphs` (graphed_engine's capture); the
    EagerGraphs class and its replays."""
    from specserve.engine.runtime.captured_mixed import mixed_graph_tokens

    graphs = eager_graphs(monkeypatch)
    core = engine.core
    core.worker.enable_cuda_graphs(core.config.max_running_requests, core.req_to_token.row_width,
                                   constrained=constrained)
    policy = core.scheduler.policy
    if policy.mixed_row_tokens:  # as the builder does with mixed steps on
        core.worker.capture_mixed(core.config.max_running_requests, core.req_to_token.row_width)
        policy.mixed_graph_tokens = mixed_graph_tokens(core.worker)
    return graphs


def process_exited(pid: int) -> bool:
    """The process is gone, or exited and waits for its parent to reap it (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# Where a tensor-parallel test runs: two gloo ranks on the CPU, and 2 or 4 GPUs of one host
# (NCCL, the Triton kernels; the tests' dtype stays fp32, so tp=1 and tp>1 must agree exactly).
TP_PLACEMENTS = [pytest.param(("cpu", 2), id="cpu-tp2"),
                 pytest.param(("cuda", 2), marks=pytest.mark.gpu, id="cuda-tp2"),
                 pytest.param(("cuda", 4), marks=pytest.mark.gpu, id="cuda-tp4")]


def tp_placement(placement: tuple[str, int]) -> tuple[int, dict]:
    """(tp size, the engine arguments of the placement's device); skips a GPU placement that
    needs more GPUs than the host has."""
    device, tp = placement
    if device == "cpu":
        return tp, {}
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    return tp, dict(device="cuda", attention_backend="triton")


def drive(engine, arrivals, max_steps: int = 3000, accepted: Optional[dict] = None):
    """Add (step, rid, prompt, params) arrivals at their steps and run to the end; returns
    {(rid, index): (tokens, finish_reason)}; `accepted` gets each sequence's accepted drafts."""
    tokens, results = {}, {}
    expected = sum(params.n for *_, params in arrivals)
    for step in range(max_steps):
        for at, rid, prompt, params in arrivals:
            if at == step:
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            key = (out.rid, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                results[key] = (tokens[key], out.finish_reason)
                if accepted is not None:
                    accepted[key] = out.num_accepted_drafts
        if len(results) == expected and not engine.has_unfinished():
            break
    assert len(results) == expected, "not every request finished"
    return results


class Step(NamedTuple):
    """One launched decision (record_steps). `extend`: a separate extend; `mixed`: a decode step
    with prompt chunks riding along (ForwardMode.MIXED)."""

    extend: bool
    computed: int        # prompt tokens its chunks compute (cached prefixes excluded)
    decoding: bool       # some running request could take a decode step when it was scheduled
    reqs: tuple          # the requests whose chunks it runs (extend, mixed), or that decode
    chunks: tuple
    mixed: bool = False
    num_decode: int = 0  # decode rows of a decode or mixed step
    priced: bool = False  # its time refines the mixed steps' cost model (Decision.priced)


def could_decode(req) -> bool:
    from specserve.engine.scheduler.schedule_batch import ReqStatus

    return (req.status is ReqStatus.RUNNING and not req.is_prefilling
            and len(req.output_ids) + req.num_inflight_tokens < req.sampling.max_new_tokens)


def record_steps(engine, old_order: bool = False) -> list[Step]:
    """Every decision the engine launches from now on, in launch order. old_order: schedule as
    the policy did before decode fairness (prefill first, then decode)."""
    from specserve.engine.forward_batch import ForwardMode

    policy = engine.core.scheduler.policy
    steps: list[Step] = []
    if old_order:
        schedule = lambda nothing_in_flight: (policy._prefill(policy.chunk_budget)  # noqa: E731
                                              or policy._decode(nothing_in_flight))
    else:
        schedule = policy.schedule

    def recording(nothing_in_flight: bool):
        decoding = any(could_decode(r) for r in policy.running)
        decision = schedule(nothing_in_flight)
        if decision is not None:
            chunked = decision.extend_reqs
            steps.append(Step(decision.mode is ForwardMode.EXTEND,
                              sum(end - start for start, end in decision.chunks) if chunked else 0,
                              decoding, tuple(r.key for r in (chunked or decision.reqs)),
                              tuple(decision.chunks), decision.mode is ForwardMode.MIXED,
                              len(decision.decode_reqs), decision.priced))
        return decision

    policy.schedule = recording
    return steps


class _TimedResult:
    """A PendingResult whose wait() first moves a fake clock on by its step's seconds (a
    device that took that long)."""

    def __init__(self, pending, clock: "FakeClock", seconds: float):
        self.pending, self.clock, self.seconds = pending, clock, seconds

    @property
    def copy_done(self):
        return self.pending.copy_done

    def wait(self):
        self.clock.now += self.seconds
        return self.pending.wait()


class FakeClock:
    """The scheduler's clock (Scheduler.clock) in tests: it moves only when a launched step's
    result is waited for, by what `step_seconds(decision)` says that step took, so that every
    step the scheduler times takes exactly that long, in both loops."""

    def __init__(self):
        self.now = 1.0

    def __call__(self) -> float:
        return self.now

    def drive(self, engine, step_seconds: Callable) -> None:
        """Engine `engine`'s scheduler runs on this clock from now on."""
        scheduler = engine.core.scheduler
        launch = scheduler._launch

        def timed(decision):
            launched = launch(decision)
            return launched._replace(result=_TimedResult(launched.result, self, step_seconds(decision)))

        scheduler.clock = self
        scheduler._launch = timed


def step_seconds(fixed: float, per_token: float, knee: int, policy, extend: float = 0.0) -> Callable:
    """A FakeClock's step times: a decode or mixed step's by the forward tokens it computes
    (policy.forward_tokens), `fixed + per_token * max(0, tokens - knee)`; an extend `extend`."""
    from specserve.engine.forward_batch import ForwardMode

    def seconds(decision) -> float:
        if decision.mode is ForwardMode.EXTEND:
            return extend
        return fixed + per_token * max(0, policy.forward_tokens(decision) - knee)

    return seconds
