"""DeepSeek-V3 multi-token prediction (NextN) as the speculative draft: loading from the target
checkpoint or a folder of its own, exact parity with plain decoding (chain and tree, both loops,
both host-length paths, seeded sampling), retraction and abort, the acceptance a module that
predicts the target reaches, and clear errors for checkpoints without the module."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from helpers import (TP_PLACEMENTS, VOCAB, cached_prefix_slots, make_tiny_checkpoint, random_prompts,
                     run_aborting, steady_state_steps, tp_placement)

from specserve.engine import SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
NUM_LAYERS = 2  # the NextN module is checkpoint layer 2


def make_deepseek_v3_with_nextn(path: str, *, seed: int = 0, predicts: bool = False, attn_scale: float = 1.0,
                                module_scale: float = 0.0, trunk_copies: bool = False) -> str:
    """A tiny random DeepSeek-V3 (2 layers, the second MoE; tests/helpers.py's shapes) whose
    checkpoint carries a NextN module at `model.layers.2.*`, the layout DeepSeek-V3 ships.

    The module's decoder layer is layer 2 of a 3-layer transformers model (so an MLA + MoE
    block in the checkpoint's per-expert format); enorm, hnorm, eh_proj and shared_head.norm
    are added. `attn_scale` scales the target's attention and MLP outputs down, so that its
    next token mostly depends on the current one. `predicts`: the module passes
    enorm(embed(token)) straight through (eh_proj = [I | 0], a decoder layer whose outputs
    are scaled by `module_scale`, zero by default) into the target's LM head, i.e. it predicts
    what such a target predicts next.
    `trunk_copies`: the module stores copies of the trunk's embedding and head (as V3 does).
    """
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(path, "deepseek_v3", num_layers=NUM_LAYERS + 1, seed=seed, q_lora_rank=16,
                         with_tokenizer=False)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    nextn = f"model.layers.{NUM_LAYERS}."
    for name in list(weights):
        if not name.startswith(nextn) and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * attn_scale
    h = weights["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    weights.update({nextn + name: 1 + 0.3 * torch.randn(h, generator=g)
                    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    weights[nextn + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    if predicts:
        weights[nextn + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            weights[nextn + name] = torch.ones(h)
        for name in list(weights):
            if name.startswith(nextn) and name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = weights[name] * module_scale
    if trunk_copies:
        weights[nextn + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[nextn + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, file, metadata={"format": "pt"})
    _edit_config(path, num_hidden_layers=NUM_LAYERS, num_nextn_predict_layers=1)
    return path


def export_nextn_folder(target: str, path: str) -> str:
    """The module alone, as SGLang's export writes it: model.layers.0.*, num_hidden_layers 1,
    architecture DeepseekV3ForCausalLMNextN."""
    from safetensors.torch import load_file, save_file

    os.makedirs(path, exist_ok=True)
    weights = load_file(os.path.join(target, "model.safetensors"))
    nextn = f"model.layers.{NUM_LAYERS}."
    save_file({"model.layers.0." + k[len(nextn):]: v for k, v in weights.items() if k.startswith(nextn)},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, architectures=["DeepseekV3ForCausalLMNextN"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


def _nextn(**shape) -> SpecConfig:
    return SpecConfig(algorithm="nextn", **(shape or CHAIN))


@pytest.fixture(scope="module")
def predictable(tmp_path_factory) -> str:
    """A target whose NextN module predicts it: real, partial acceptance."""
    return make_deepseek_v3_with_nextn(str(tmp_path_factory.mktemp("ds-pred")), predicts=True, attn_scale=0.3)


@pytest.fixture(scope="module")
def reference(predictable):
    """Plain decoding of the predictable target (computed once)."""
    from specserve.engine import Engine, EngineConfig

    prompts = random_prompts(12, seed=3, max_len=20)
    params = [SamplingParams(max_new_tokens=[1, 3, 20][i % 3], temperature=0.0, ignore_eos=True)
              for i in range(12)]
    with Engine(EngineConfig(model=predictable, device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    return prompts, params, [o.token_ids for o in outs]


def _staggered(engine, prompts, params, seed=0):
    """Requests arrive over the first steps; returns each one's tokens, in prompt order."""
    rng = random.Random(seed)
    arrivals = sorted((rng.randrange(0, 5), i) for i in range(len(prompts)))
    done, outs, step = set(), {}, 0
    while len(done) < len(prompts):
        for arrive, i in arrivals:
            if arrive == step:
                engine.add_request(str(i), prompts[i], params[i])
        for out in engine.step():
            outs.setdefault(int(out.rid), []).extend(out.new_token_ids)
            if out.finished:
                done.add(int(out.rid))
        step += 1
    return [outs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("needs_cpu", [True, False])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_parity_with_plain_decoding(predictable, reference, make_engine, shape, overlap, needs_cpu):
    prompts, params, expected = reference
    engine = make_engine(predictable, spec=_nextn(**shape), enable_overlap=overlap, needs_cpu_seq_lens=needs_cpu,
                         mixed_steps=True)
    assert engine.core.needs_cpu_seq_lens is needs_cpu
    assert _staggered(engine, prompts, params) == expected
    assert engine.metrics.mean_accept_length > 1.5  # really speculating
    assert engine.metrics.num_mixed_steps > 0  # arrivals rode with the verify rows (MLA target)


def test_graphed_mixed_steps_over_an_mla_target(predictable, reference, make_engine, monkeypatch):
    """The mixed steps' captured forwards (runtime/captured_mixed.py; the CPU stand-in) over an
    MLA target, its verify rows and the arrivals' chunks in one replay: plain decoding's tokens."""
    from helpers import graphed_engine

    prompts, params, expected = reference
    engine, graphs = graphed_engine(make_engine, monkeypatch, predictable, spec=_nextn(**CHAIN), mixed_steps=True)
    graphs.replays.clear()
    assert _staggered(engine, prompts, params) == expected
    replays = [part for g, _, part in graphs.replays if g is engine.core.worker.mixed_graphs]
    # The forward, then the NextN module's draft-extend of the verify rows and the chunks.
    assert replays.count(0) == replays.count(1) == engine.metrics.num_mixed_steps > 0


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_overlap_under_random_forward_delays(predictable, reference, make_engine, monkeypatch, shape):
    """Seeded sleeps around every forward reorder host and device progress in the overlap loop."""
    prompts, params, expected = reference
    monkeypatch.setenv("SPECSERVE_FORWARD_DELAY", "5:3")
    engine = make_engine(predictable, spec=_nextn(**shape), enable_overlap=True)
    assert _staggered(engine, prompts, params, seed=2) == expected


def test_draft_runs_through_the_module(tmp_path, predictable, reference, make_engine):
    """The module that predicts the target is accepted most of the time; the same target with
    a random module (given as a folder of its own) is not, and both stay exact."""
    prompts, _, expected = reference
    long = [i for i in range(len(prompts)) if len(expected[i]) == 20]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    good = make_engine(predictable, spec=_nextn())
    assert [o.token_ids for o in good.generate(prompt_token_ids=[prompts[i] for i in long], sampling=params)] \
        == [expected[i] for i in long]
    random_module = export_nextn_folder(
        make_deepseek_v3_with_nextn(str(tmp_path / "other"), seed=7), str(tmp_path / "random-nextn"))
    bad = make_engine(predictable, spec=SpecConfig(algorithm="nextn", draft_model=random_module, **CHAIN))
    assert [o.token_ids for o in bad.generate(prompt_token_ids=[prompts[i] for i in long], sampling=params)] \
        == [expected[i] for i in long]
    assert good.metrics.mean_accept_length > 2.5
    assert bad.metrics.mean_accept_length < 1.5


def _hf_module_as_model(target: str, path: str):
    """transformers' reference for the module: a one-layer DeepSeek-V3 whose layer is the
    NextN decoder block (MoE), final norm shared_head.norm and head the target's, fed
    inputs_embeds = eh_proj(cat(enorm(embed(t)), hnorm(feature)))."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    os.makedirs(path, exist_ok=True)
    weights = load_file(os.path.join(target, "model.safetensors"))
    nextn = f"model.layers.{NUM_LAYERS}."
    own = {k[len(nextn):]: v for k, v in weights.items() if k.startswith(nextn)}
    module = {"model.layers.0." + k: v for k, v in own.items()
              if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    module.update({"model.norm.weight": own["shared_head.norm.weight"],
                   "model.embed_tokens.weight": weights["model.embed_tokens.weight"],
                   "lm_head.weight": weights["lm_head.weight"]})
    save_file(module, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, first_k_dense_replace=0)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def norm(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]))

    def run(features: torch.Tensor, next_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Row p reads (feature p, token p + 1): (next-token probabilities [T, vocab], the
        module's normed output [T, hidden], which is also the next draft step's feature)."""
        e = weights["model.embed_tokens.weight"][torch.tensor(next_tokens)]
        x = torch.cat([norm(own["enorm.weight"], e), norm(own["hnorm.weight"], features)], dim=-1)
        x = x @ own["eh_proj.weight"].T
        with torch.no_grad():
            out = model.model(inputs_embeds=x[None]).last_hidden_state[0]
            return torch.softmax(model.lm_head(out).float(), dim=-1), out

    return run


@pytest.mark.parametrize("module", ["random", "accepted"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_draft_matches_transformers_reference(tmp_path, make_engine, shape, module):
    """The draft equals transformers' MLA + MoE block run as the module over the whole
    sequence: its stashed next-token distribution (after the prefill's draft-extend, and after
    each iteration's draft-extend over the accepted path) and, in chain mode, the chain it
    drafts from there (decode steps that read the module's own output as their feature).
    A random module checks every weight; one that is accepted (with live attention and
    experts) checks the draft KV left by multi-token paths and tree compaction."""
    import transformers as tf

    accepted = dict(predicts=True, attn_scale=0.3, module_scale=0.3) if module == "accepted" else {}
    path = make_deepseek_v3_with_nextn(str(tmp_path / "m"), seed=3, **accepted)
    reference = _hf_module_as_model(path, str(tmp_path / "ref"))
    hf_target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path, spec=_nextn(**shape), enable_overlap=False)
    worker = engine.core.worker
    drafted = []  # the trees the verifier checks
    tree_of = worker.verifier.tree_of

    def record(*args):
        drafted.append(tree_of(*args))
        return drafted[-1]

    worker.verifier.tree_of = record
    prompt = random_prompts(1, seed=12, min_len=9, max_len=9)[0]
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    produced = []
    for _ in range(6):
        for out in engine.step():
            produced += out.new_token_ids
        req = engine.core.scheduler.reqs[("r", 0)]
        tokens = prompt + produced
        S = req.kv_committed_len  # the bonus token tokens[S] is the next input
        assert len(tokens) == S + 1
        with torch.no_grad():
            features = hf_target.model(torch.tensor([tokens[:S]])).last_hidden_state[0]
        next_tokens = tokens[1:S + 1]
        probs, out = reference(features, next_tokens)
        state = worker.future_map.gather_draft_state(torch.tensor([req.row]))
        want_p, want_ids = probs[-1].topk(shape["topk"])
        assert state.topk_index[0].tolist() == want_ids.tolist()
        torch.testing.assert_close(state.topk_p[0], want_p, atol=1e-4, rtol=1e-4)
        if shape["topk"] > 1:
            continue
        chain = [int(want_ids[0])]
        for _ in range(shape["num_steps"] - 1):
            features, next_tokens = torch.cat([features, out[-1:]]), next_tokens + chain[-1:]
            probs, out = reference(features, next_tokens)
            chain.append(int(probs[-1].argmax()))
        n = len(drafted)
        for out_ in engine.step():
            produced += out_.new_token_ids
        assert len(drafted) == n + 1 and drafted[-1].tokens[0, 1:].tolist() == chain
    if module == "accepted":
        assert len(produced) > 12  # several iterations accepted more than one token
    engine.abort("r")
    engine.step()


def test_separate_folder_loads_the_same_module(tmp_path, predictable, make_engine):
    """SGLang's standalone export (model.layers.0, num_hidden_layers 1) drafts exactly as the
    module inside the target checkpoint does."""
    folder = export_nextn_folder(predictable, str(tmp_path / "nextn"))
    inside = make_engine(predictable, spec=_nextn())
    alone = make_engine(predictable, spec=SpecConfig(algorithm="nextn", draft_model=folder, **CHAIN))
    for name, p in inside.core.draft_runner.model.named_parameters():
        torch.testing.assert_close(dict(alone.core.draft_runner.model.named_parameters())[name], p, msg=name)
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    a = inside.generate(prompt_token_ids=prompts, sampling=params)
    b = alone.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.num_verify_steps for o in a] == [o.num_verify_steps for o in b]


def test_trunk_copies_are_shared_with_the_target(tmp_path, make_engine):
    """DeepSeek-V3 stores copies of the embedding and LM head in the module: equal copies are
    dropped for the target's; a head of its own is used."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = make_deepseek_v3_with_nextn(str(tmp_path / "copies"), trunk_copies=True)
    engine = make_engine(path, spec=_nextn())
    head, target = engine.core.draft_runner.model, engine.core.runner.model
    assert head.embed_tokens is target.embed_tokens and head.shared_head.head is target.lm_head

    path = shutil.copytree(path, str(tmp_path / "own-head"))
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights[f"model.layers.{NUM_LAYERS}.shared_head.head.weight"] = torch.randn(VOCAB, 64)
    save_file(weights, file, metadata={"format": "pt"})
    engine = make_engine(path, spec=_nextn())
    head, target = engine.core.draft_runner.model, engine.core.runner.model
    assert head.embed_tokens is target.embed_tokens and head.shared_head.head is not target.lm_head
    torch.testing.assert_close(head.shared_head.head.weight,
                               weights[f"model.layers.{NUM_LAYERS}.shared_head.head.weight"])


def test_seeded_sampling_matches_plain_decoding(predictable, make_engine):
    prompts = random_prompts(4, seed=4, max_len=20)
    params = [SamplingParams(max_new_tokens=16, temperature=t, top_p=p, seed=100 + i, ignore_eos=True)
              for i, (t, p) in enumerate([(0.8, 1.0), (1.0, 0.9)] * 2)]
    plain = make_engine(predictable).generate(prompt_token_ids=prompts, sampling=params)
    for shape in (CHAIN, TREE):
        spec = make_engine(predictable, spec=_nextn(**shape)).generate(prompt_token_ids=prompts, sampling=params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_retraction_and_abort_mid_speculation(predictable, reference, make_engine, overlap, shape):
    prompts, params, expected = reference
    engine = make_engine(predictable, spec=_nextn(**shape), enable_overlap=overlap, max_total_tokens=110)
    long_ids = [i for i in range(len(prompts)) if params[i].max_new_tokens == 20]
    for i in long_ids:
        engine.add_request(str(i), prompts[i], params[i])
    engine.add_request("gone", prompts[0], params[2])
    outs, reasons = run_aborting(engine, "gone", abort_at_step=3)
    assert reasons.pop("gone") == "abort"
    assert engine.metrics.num_retractions > 0
    assert {rid: outs[rid] for rid in reasons} == {str(i): expected[i] for i in long_ids}


@pytest.mark.parametrize("placement", TP_PLACEMENTS)
@pytest.mark.parametrize("shape,overlap", [(CHAIN, True), (TREE, False)], ids=["chain-overlap", "tree-normal"])
def test_tp_matches_tp1(predictable, reference, make_engine, shape, overlap, placement):
    """Two (or on GPUs four) ranks: the module's heads and experts are split like the target's;
    the output is plain decoding's at tp=1 on the same device."""
    size, device = tp_placement(placement)
    prompts, params, expected = reference
    if device:  # the GPU's own plain tp=1 output (the module's reference is the CPU's)
        expected = [o.token_ids for o in make_engine(predictable, **device).generate(
            prompt_token_ids=prompts[:6], sampling=params[:6])]
    engine = make_engine(predictable, tp_size=size, spec=_nextn(**shape), enable_overlap=overlap, **device)
    assert engine.core.draft_runner.model.attention.num_heads == 4 // size
    outs = engine.generate(prompt_token_ids=prompts[:6], sampling=params[:6])
    assert [o.token_ids for o in outs] == expected[:6]
    assert engine.metrics.mean_accept_length > 1.5


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_prefix_cache_hit_keeps_exact_draft_latents(predictable, make_engine, shape):
    """The prefix cache's pair keys cover the module's KV as an EAGLE head's (its row p reads
    the feature of token p and token p + 1): a follow-up that hits the cache gives the
    uncached output, and the target and draft latents of every cached position (some written
    by verify and draft-extend) equal a fresh engine's prefill of the same tokens."""
    prompt = random_prompts(1, seed=21, min_len=20, max_len=20)[0]
    greedy = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 6, 1)]
    warm = make_engine(predictable, spec=_nextn(**shape))
    answer = warm.generate(prompt_token_ids=[prompt], sampling=greedy[0])[0].token_ids
    follow_up = prompt + answer + [5, 6, 7]
    hit = warm.generate(prompt_token_ids=[follow_up], sampling=greedy[1])[0]
    assert hit.cached_tokens >= len(prompt) + len(answer) - 2
    uncached = make_engine(predictable, spec=_nextn(**shape), enable_prefix_cache=False)
    assert hit.token_ids == uncached.generate(prompt_token_ids=[follow_up], sampling=greedy[1])[0].token_ids
    fresh = make_engine(predictable, spec=_nextn(**shape))
    assert fresh.generate(prompt_token_ids=[follow_up], sampling=greedy[2])[0].cached_tokens == 0
    latents = []
    for engine in (warm, fresh):
        slots = cached_prefix_slots(engine, follow_up)
        latents.append([r.kv_pool.kv_all[:, slots] for r in (engine.core.runner, engine.core.draft_runner)])
    for ours, fresh_prefill in zip(*latents):
        torch.testing.assert_close(ours, fresh_prefill, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_triton_mla_draft_matches_plain_decoding(predictable, reference, make_engine, shape):
    """The module's MLA through the Triton kernels (the interpreter on the CPU), as the target's."""
    pytest.importorskip("triton")
    prompts, params, expected = reference
    engine = make_engine(predictable, attention_backend="triton", spec=_nextn(**shape), max_context_len=64)
    assert type(engine.core.draft_runner.attn_backend).__name__ == "TritonAttnBackend"
    outs = engine.generate(prompt_token_ids=prompts[2:3], sampling=params[2:3])
    assert [o.token_ids for o in outs] == expected[2:3]
    assert engine.metrics.mean_accept_length > 1.5


def test_draft_pool_is_one_latent_layer_on_the_target_slots(predictable, make_engine):
    engine = make_engine(predictable, spec=_nextn(**TREE))
    from specserve.engine.kvcache.pools import MLATokenToKVPool

    pool, target_pool = engine.core.draft_runner.kv_pool, engine.core.kv_pool
    assert isinstance(pool, MLATokenToKVPool) and pool.num_layers == 1
    assert pool.kv_all.shape[1:] == target_pool.kv_all.shape[1:]  # same slots, same latent || rope width


def test_random_weights_with_forced_acceptance(tmp_path, make_engine):
    """The benchmark's set-up (bench/one_batch.py --draft nextn): a DeepSeek-V2 config.json
    with a NextN layer and no weights, random weights, forced accept length 3."""
    path = make_tiny_checkpoint(str(tmp_path / "v2"), "deepseek_v2", with_tokenizer=False)
    os.remove(os.path.join(path, "model.safetensors"))
    _edit_config(path, num_nextn_predict_layers=1)
    engine = make_engine(path, load_format="dummy", spec=SpecConfig(algorithm="nextn", bench_force_accept_len=3, **CHAIN))
    assert engine.core.draft_runner.model.embed_tokens is engine.core.runner.model.embed_tokens
    out = engine.generate(prompt_token_ids=[[5, 6]], sampling=SamplingParams(max_new_tokens=31, temperature=0.0,
                                                                              ignore_eos=True))[0]
    assert out.num_verify_steps == 10 and out.accept_length == pytest.approx(3.1)


@pytest.mark.parametrize("change,message", [
    (dict(num_nextn_predict_layers=0), "num_nextn_predict_layers is 0"),
    (dict(num_nextn_predict_layers=None), "num_nextn_predict_layers is None"),
])
def test_checkpoint_without_nextn_config_is_refused(tmp_path, predictable, change, message):
    import shutil

    from specserve.engine import Engine, EngineConfig

    path = shutil.copytree(predictable, str(tmp_path / "m"))
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=f"^spec.draft_model: .*{message}"):
        Engine(EngineConfig(model=path, device="cpu", spec=_nextn()))


def test_checkpoint_without_nextn_weights_is_refused(tmp_path):
    """transformers saves num_nextn_predict_layers=1 without the weights."""
    from specserve.engine import Engine, EngineConfig

    path = make_tiny_checkpoint(str(tmp_path / "plain"), "deepseek_v3", num_layers=NUM_LAYERS, with_tokenizer=False)
    with pytest.raises(ValueError, match=r"^spec.draft_model: .* has no NextN weights \(no model.layers.2.eh_proj"):
        Engine(EngineConfig(model=path, device="cpu", spec=_nextn()))


def test_separate_folder_with_a_bad_config_names_the_field(tmp_path, predictable):
    from specserve.engine import Engine, EngineConfig

    folder = export_nextn_folder(predictable, str(tmp_path / "nextn"))
    _edit_config(folder, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"^spec.draft_model: .*hidden_act 'gelu'"):
        Engine(EngineConfig(model=predictable, device="cpu", spec=SpecConfig(algorithm="nextn", draft_model=folder,
                                                                             **CHAIN)))
    _edit_config(folder, hidden_act="silu", hidden_size=32)
    with pytest.raises(ValueError, match=r"^spec.draft_model: NextN hidden_size 32 != target hidden_size 64"):
        Engine(EngineConfig(model=predictable, device="cpu", spec=SpecConfig(algorithm="nextn", draft_model=folder,
                                                                             **CHAIN)))


def test_non_deepseek_target_is_refused(tiny_model):
    from specserve.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match=r"^spec.draft_model: NextN drafting reads DeepSeek-V3-format"):
        Engine(EngineConfig(model=tiny_model, device="cpu", spec=_nextn()))


def test_cli_accepts_nextn_without_a_draft_model():
    from specserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x",
                                      "--speculative-algorithm", "nextn", "--speculative-num-steps", "2"])
    spec = engine_config_from_args(args).spec
    assert spec == SpecConfig(algorithm="nextn", draft_model=None, num_steps=2, topk=1, num_draft_tokens=3)


# --- GPU (pytest -m gpu) ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("needs_cpu", [False, True])
def test_gpu_nextn_matches_plain(predictable, make_engine, shape, graphs, needs_cpu):
    """Triton MLA for the target and the module, the fused MoE, CUDA graphs of both halves."""
    prompts = random_prompts(6, seed=17, max_len=40)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", attention_backend="triton", max_total_tokens=4096, max_running_requests=8)
    plain = make_engine(predictable, cuda_graph=False, **common)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling=params)]
    engine = make_engine(predictable, cuda_graph=graphs, needs_cpu_seq_lens=needs_cpu, spec=_nextn(**shape),
                         **common)
    assert engine.core.uses_cuda_graphs == graphs and engine.core.needs_cpu_seq_lens is needs_cpu
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert engine.metrics.mean_accept_length > 1.5


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_nextn_steady_state_has_no_blocking_sync(predictable, make_engine, graphs):
    engine = make_engine(predictable, device="cuda", attention_backend="triton", cuda_graph=graphs,
                         spec=_nextn(), max_total_tokens=4096, max_running_requests=4)
    assert not engine.core.needs_cpu_seq_lens
    steady_state_steps(engine, [5, 6, 7, 8])
