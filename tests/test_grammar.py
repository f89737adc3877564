"""Structured outputs in the engine: masks, rollback, and exact parity with plain decoding
under chain and tree speculation (both loops), greedy and seeded; outputs that stop are valid."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from helpers import (graphed_engine, make_eagle3_head, make_predictable_pair, make_tiny_checkpoint,
                     random_prompts)

from specserve.engine import GrammarSpec, SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
EOS = 2  # helpers.save_byte_tokenizer


def _schema(rng: random.Random) -> dict:
    """A random object schema whose instances are short (bounded strings, enums, small ints)."""
    kinds = [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"},
             {"type": "string", "maxLength": 3}, {"enum": ["red", "green", 7, None]},
             {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}]
    names = rng.sample(["a", "bb", "id", "ok", "x_y", "name"], rng.randint(1, 3))
    props = {n: rng.choice(kinds) for n in names}
    return {"type": "object", "properties": props, "required": names, "additionalProperties": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def compiler(pair):
    from specserve.engine.grammar.compiler import GrammarCompiler

    c = GrammarCompiler(f"{pair[0]}/tokenizer.json", 320, [EOS])
    yield c
    c.close()


def _spec(head, **shape):
    return SpecConfig(algorithm="eagle", draft_model=head, **(shape or CHAIN))


def _matcher_mask(compiled, path: list[int]) -> torch.Tensor:
    """The reference: a fresh matcher walked along the path, then its mask."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS])
    mask = torch.full((1, 10), -1, dtype=torch.int32)
    if all(m.accept_token(t) for t in path) and not m.is_terminated():
        m.fill_next_token_bitmask(mask, 0)
    return mask[0]


def _allowed(compiled, path: list[int], rng: random.Random) -> int:
    mask = _matcher_mask(compiled, path)
    ids = [t for t in range(320) if (int(mask[t // 32]) >> (t % 32)) & 1]
    return rng.choice(ids)


def test_tree_masks_equal_the_matcher_walked_node_by_node(compiler):
    from specserve.engine.grammar.batch import GrammarBatch
    from specserve.engine.grammar.request_grammar import RequestGrammar

    spec = GrammarSpec("json_schema", json.dumps(_schema(random.Random(1))))
    compiled = compiler.compile(spec).result()
    rng = random.Random(0)
    committed = []
    for _ in range(3):
        committed.append(_allowed(compiled, committed, rng))
    g = RequestGrammar(compiler.compile(spec), [EOS], None)
    g.advance(committed)
    # A hand-built tree: root (the last committed token) with two children, grandchildren on
    # both, one branch through a token the grammar refuses.
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tokens = [committed[-1]]
    for i in range(1, len(parents)):
        path = [tokens[j] for j in _ancestors(parents, i)]
        tokens.append(_allowed(compiled, committed + path, rng) if i != 4 else ord("Z"))
    D = len(parents)
    masks = torch.zeros((2 * D, 10), dtype=torch.int32)
    GrammarBatch([g, None]).path_masks(masks, *GrammarBatch.tree_paths([tokens, tokens], [parents, parents]))
    for i in range(D):
        path = [tokens[j] for j in _ancestors(parents, i)] + ([tokens[i]] if i else [])
        assert torch.equal(masks[i], _matcher_mask(compiled, committed + path)), i
        assert torch.equal(masks[D + i], torch.full((10,), -1, dtype=torch.int32))  # unconstrained row
    # Walking the tree left the matcher where the committed tokens put it.
    after = torch.zeros((1, 10), dtype=torch.int32)
    GrammarBatch([g]).next_token_masks(after)
    assert torch.equal(after[0], _matcher_mask(compiled, committed))


def _ancestors(parents: list[int], i: int) -> list[int]:
    """Draft ancestors of node i, root excluded, top first."""
    out = []
    p = parents[i]
    while p > 0:
        out.append(p)
        p = parents[p]
    return out[::-1]


def test_partial_acceptance_leaves_the_matcher_where_plain_decoding_would(compiler):
    from specserve.engine.grammar.batch import GrammarBatch
    from specserve.engine.grammar.request_grammar import RequestGrammar

    spec = GrammarSpec("regex", r"[a-c]{2,6}x")
    compiled = compiler.compile(spec).result()
    rng = random.Random(3)
    chain = []
    for _ in range(4):
        chain.append(_allowed(compiled, chain, rng))
    g = RequestGrammar(compiler.compile(spec), [EOS], None)
    batch = GrammarBatch([g])
    # A chain draft of 4 over root chain[0]: masks walked, then 2 accepted (+ the bonus).
    batch.path_masks(torch.zeros((5, 10), dtype=torch.int32),
                     *GrammarBatch.tree_paths([[chain[0]] + chain[1:] + [ord("a")]], [[-1, 0, 1, 2, 3]]))
    g.advance(chain[:3])
    mask = torch.zeros((1, 10), dtype=torch.int32)
    GrammarBatch([g]).next_token_masks(mask)
    assert torch.equal(mask[0], _matcher_mask(compiled, chain[:3]))


@pytest.fixture(scope="module")
def constrained_reference(pair):
    """Plain decoding of constrained and unconstrained requests in one batch."""
    from specserve.engine import Engine, EngineConfig

    prompts = random_prompts(6, seed=11, max_len=12)
    schema = json.dumps(_schema(random.Random(5)))
    # Request 4 also has a penalty (its draft nodes see their own ancestors, masks or not).
    params = [SamplingParams(max_new_tokens=28, temperature=0.0, presence_penalty=0.5 if i == 4 else 0.0,
                             grammar=GrammarSpec("json_schema", schema) if i % 3 else None)
              for i in range(6)]
    with Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    return prompts, params, [o.token_ids for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_constrained_parity_with_plain_decoding(pair, constrained_reference, make_engine,
                                                       overlap, shape):
    prompts, params, expected = constrained_reference
    engine = make_engine(pair[0], spec=_spec(pair[1], **shape), enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == expected
    constrained = [o for o, p in zip(outs, params) if p.grammar is not None]
    # Masked drafts keep acceptance up (the predictable pair accepts ~3 of 3 unconstrained).
    assert sum(o.num_accepted_drafts for o in constrained) / sum(o.num_verify_steps for o in constrained) > 1.0


def test_constrained_requests_survive_retraction(pair, constrained_reference, make_engine):
    """A retracted request is prefilled again over prompt + outputs; its matcher stays where its
    outputs put it, so the output is unchanged."""
    prompts, params, expected = constrained_reference
    engine = make_engine(pair[0], spec=_spec(pair[1]), max_total_tokens=140)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert engine.metrics.num_retractions > 0
    assert [o.token_ids for o in outs] == expected


def test_plain_decoding_overlap_and_normal_agree(pair, constrained_reference, make_engine):
    prompts, params, expected = constrained_reference
    engine = make_engine(pair[0], enable_overlap=True)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_seeded_constrained_sampling_parity(pair, make_engine, shape):
    prompts = random_prompts(3, seed=12, max_len=10)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, top_p=0.95,
                            grammar=GrammarSpec("json_object"))
    plain = make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=params)
    spec = make_engine(pair[0], spec=_spec(pair[1], **shape)).generate(prompt_token_ids=prompts,
                                                                       sampling=params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_eagle3_draft_vocabulary_parity(tmp_path, make_engine):
    """An EAGLE-3 head drafts over a subset of the vocabulary (hot tokens): its masks are the
    grammar's mapped onto that subset."""
    target = make_tiny_checkpoint(str(tmp_path / "target"), "llama", num_layers=3, seed=5)
    head = make_eagle3_head(str(tmp_path / "head"), target_layers=3)
    prompts = random_prompts(3, seed=14, max_len=10)
    params = SamplingParams(max_new_tokens=20, temperature=0.0,
                            grammar=GrammarSpec("json_schema", json.dumps(_schema(random.Random(9)))))
    plain = make_engine(target).generate(prompt_token_ids=prompts, sampling=params)
    for shape in (CHAIN, TREE):
        spec = make_engine(target, spec=SpecConfig(algorithm="eagle3", draft_model=head, **shape))
        assert [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling=params)] == \
            [o.token_ids for o in plain]


def test_random_schemas_stop_only_on_valid_output(pair, make_engine):
    """Every output that ends with "stop" parses and validates; "length" is the only other end."""
    engine = make_engine(pair[0], spec=_spec(pair[1]))
    rng = random.Random(0)
    schemas = [_schema(rng) for _ in range(24)]
    prompts = random_prompts(len(schemas), seed=13, max_len=8)
    params = [SamplingParams(max_new_tokens=48, temperature=0.0 if i % 2 else 1.0, seed=i,
                             grammar=GrammarSpec("json_schema", json.dumps(s)))
              for i, s in enumerate(schemas)]
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    stopped = 0
    for out, schema in zip(outs, schemas):
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            stopped += 1
            assert out.token_ids[-1] == EOS
            jsonschema.validate(json.loads(out.text), schema)
    assert stopped >= len(schemas) // 2


def test_grammar_that_cannot_finish_ends_with_length(pair, make_engine):
    engine = make_engine(pair[0], spec=_spec(pair[1]))
    out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(
        max_new_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", "a{10}")))[0]
    assert out.finish_reason == "length" and out.text == "a" * 6


def test_regex_and_ebnf(pair, make_engine):
    engine = make_engine(pair[0], spec=_spec(pair[1], **TREE))
    outs = engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling=[
        SamplingParams(max_new_tokens=20, temperature=0.0, grammar=GrammarSpec("regex", "(yes|no)!")),
        SamplingParams(max_new_tokens=20, temperature=0.0,
                       grammar=GrammarSpec("ebnf", 'root ::= "(" [0-9]+ ")"'))])
    assert outs[0].text in ("yes!", "no!") and outs[0].finish_reason == "stop"
    assert outs[1].finish_reason == "stop" and outs[1].text[0] == "(" and outs[1].text[-1] == ")"


def test_grammar_applies_after_the_reasoning_ends(pair, make_engine):
    """With after_token_id, tokens up to the end-of-thinking token are free; then the grammar."""
    engine = make_engine(pair[0], spec=_spec(pair[1]))
    prompt = [[5, 6, 7]]
    free = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    end = free[3]  # the "end of thinking" comes at the 4th token unconstrained
    out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(
        max_new_tokens=12, temperature=0.0,
        grammar=GrammarSpec("regex", "(yes|no)", after_token_id=end)))[0]
    cut = free.index(end) + 1
    assert out.token_ids[:cut] == free[:cut]
    assert engine.tokenizer.decode(out.token_ids[cut:]) in ("yes", "no")


def test_bad_grammars_are_refused_by_name():
    from specserve.engine.grammar.compiler import parse_grammar

    for spec, field in [(GrammarSpec("json_schema", "{"), "structured_output.json_schema"),
                        (GrammarSpec("json_schema", '{"type": "objectx"}'), "structured_output.json_schema"),
                        (GrammarSpec("regex", "a(b"), "structured_output.regex"),
                        (GrammarSpec("ebnf", "root ::= foo"), "structured_output.ebnf")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            parse_grammar(spec)
    with pytest.raises(ValueError, match="^ignore_eos:"):
        SamplingParams(ignore_eos=True, grammar=GrammarSpec("json_object"))
    with pytest.raises(ValueError, match="^min_new_tokens:"):
        SamplingParams(min_new_tokens=2, grammar=GrammarSpec("json_object"))


def test_a_grammar_failing_in_the_engine_fails_only_its_request(pair, make_engine):
    """A grammar that does not parse fails its request with INVALID_ARGUMENT naming the
    field (the server parses nothing: the grammar process does); the others go on."""
    engine = make_engine(pair[0], spec=_spec(pair[1]))
    outs = engine.generate(prompt_token_ids=[[5, 6], [7, 8]], sampling=[
        SamplingParams(max_new_tokens=4, grammar=GrammarSpec("regex", "a(b")),
        SamplingParams(max_new_tokens=4, temperature=0.0)])
    assert outs[0].finish_reason == "error" and outs[1].finish_reason == "length"
    assert outs[0].error.code == "INVALID_ARGUMENT" and outs[0].token_ids == []
    assert outs[0].error.message.startswith("structured_output.regex: ")


def test_draft_vocabulary_without_an_allowed_token_stays_unmasked():
    from specserve.engine.grammar.bitmask import apply_token_bitmask

    logits = torch.zeros(2, 4)
    bitmask = torch.zeros(2, 1, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5          # row 0 allows token 5, row 1 only token 9
    bitmask[1, 0] = 1 << 9
    hot = torch.tensor([2, 5, 7, 8])  # a draft vocabulary: columns -> token ids
    out = apply_token_bitmask(logits, bitmask, hot)
    assert out[0].tolist() == [float("-inf"), 0.0, float("-inf"), float("-inf")]
    assert out[1].tolist() == [0.0] * 4


# --- CUDA graphs of constrained steps ---------------------------------------------------------
# On the CPU the captured parts run eagerly on the padded static inputs (GraphedStep's loading
# and buckets, the padded rows in the grammar channel); on a GPU the real graphs do.
TREE3 = dict(num_steps=4, topk=3, num_draft_tokens=8)


def _mixed(n: int = 6, tokens: int = 24):
    """Greedy requests, two of three constrained (the others keep graphs in a mixed batch)."""
    schema = json.dumps(_schema(random.Random(5)))
    return random_prompts(n, seed=11, max_len=12), [
        SamplingParams(max_new_tokens=tokens, temperature=0.0,
                       grammar=GrammarSpec("json_schema", schema) if i % 3 else None)
        for i in range(n)]


@pytest.mark.parametrize("shape", [None, CHAIN, TREE, TREE3], ids=["plain", "chain", "tree", "tree3"])
def test_graphed_constrained_steps_equal_eager_ones(pair, make_engine, monkeypatch, shape):
    """6 requests run in the bucket of 8, then smaller ones as they finish: the padded rows
    and the unconstrained ones allow every token, the outputs are the eager constrained ones."""
    prompts, params = _mixed()
    spec = None if shape is None else _spec(pair[1], **shape)
    eager = make_engine(pair[0], spec=spec).generate(prompt_token_ids=prompts, sampling=params)
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], constrained=True, spec=spec)
    worker = engine.core.worker
    greedy_constrained = worker.constrained_graphs["greedy"]
    constrained_steps = []
    launch = worker.launch_decode
    monkeypatch.setattr(worker, "launch_decode",
                        lambda step: constrained_steps.append(step.grammar is not None) or launch(step))
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    starts = [(g, rows.shape[0]) for g, rows, part in graphs.replays if part == 0 and rows is not None]
    # Every decode step replayed: constrained ones the constrained graphs, the others the plain.
    assert sum(g is greedy_constrained for g, _ in starts) == sum(constrained_steps) > 0
    assert sum(g is worker.graphs for g, _ in starts) == len(constrained_steps) - sum(constrained_steps)
    assert {bs for g, bs in starts if g is greedy_constrained} >= {8}
    # One graph a step (two halves speculating), as unconstrained: no host work between parts.
    parts = len(greedy_constrained.parts)
    assert parts == len(worker.graphs.parts) == (1 if shape is None else 2)
    assert all(p < parts for g, _, p in graphs.replays if g is greedy_constrained)


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
@pytest.mark.parametrize("variant,extra", [("sampled", {}), ("filtered", dict(top_p=0.9, top_k=20))],
                         ids=["sampled", "filtered"])
def test_sampled_constrained_batches_replay_their_graphs(pair, make_engine, monkeypatch, shape, variant, extra):
    """temperature > 0 with a grammar (the common JSON case) replays the constrained graphs of
    its sampling variant, seeded draws equal to the eager constrained step's."""
    prompts = random_prompts(3, seed=12, max_len=10)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, grammar=GrammarSpec("json_object"), **extra)
    spec = None if shape is None else _spec(pair[1], **shape)
    eager = make_engine(pair[0], spec=spec).generate(prompt_token_ids=prompts, sampling=params)
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], constrained=True, spec=spec)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    replayed = {g for g, rows, _ in graphs.replays if rows is not None}
    assert engine.core.worker.constrained_graphs[variant] in replayed


def test_padded_mask_rows_allow_every_token(compiler):
    from specserve.engine.grammar.batch import GrammarBatch
    from specserve.engine.grammar.request_grammar import RequestGrammar

    compiler.compile(GrammarSpec("json_object")).result()  # a plan comes only once it compiled
    g = RequestGrammar(compiler.compile(GrammarSpec("json_object")), [EOS], None)
    masks = torch.zeros((8, 10), dtype=torch.int32)  # what an earlier, larger batch left
    # A padded bucket of 4 rows, the request in row 1.
    batch = GrammarBatch([None, g, None, None])
    batch.next_token_masks(masks[:4])
    assert torch.equal(masks[1], _matcher_mask(compiler.compile(GrammarSpec("json_object")).result(), []))
    for row in (0, 2, 3):
        assert torch.equal(masks[row], torch.full((10,), -1, dtype=torch.int32))
    # Verify trees of 2 nodes each.
    masks.zero_()
    batch.path_masks(masks, *GrammarBatch.tree_paths([[ord("{")] * 2] * 4, [[-1, 0]] * 4))
    assert all(torch.equal(masks[r], torch.full((10,), -1, dtype=torch.int32)) for r in (0, 1, 4, 5, 6, 7))
    assert torch.equal(masks[3], _matcher_mask(compiler.compile(GrammarSpec("json_object")).result(), [ord("{")]))


# --- on a GPU: the captured graphs ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [None, CHAIN, TREE, dict(num_steps=5, topk=4, num_draft_tokens=8)],
                         ids=["plain", "chain", "tree", "tree-5-4-8"])
def test_gpu_graphed_constrained_steps_equal_eager(make_engine, shape):
    """The demo pair: constrained greedy steps replay their graphs, token for token the eager
    ones (mixed with unconstrained requests, padded buckets)."""
    from specserve.engine import SpecConfig as Spec

    prompts, params = _mixed(n=6, tokens=48)
    kwargs = dict(device="cuda", attention_backend="triton", max_running_requests=8,
                  spec=None if shape is None else Spec(**shape))
    outs, replays = [], []
    for graphs in (False, True):
        engine = make_engine(None, cuda_graph=graphs, **kwargs)
        worker = engine.core.worker
        if graphs:
            greedy_constrained = worker.constrained_graphs["greedy"]
            replay = greedy_constrained.replay
            greedy_constrained.replay = lambda c, p: replays.append(p) or replay(c, p)
        outs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)])
    assert outs[1] == outs[0]
    assert replays.count(0) > 0
