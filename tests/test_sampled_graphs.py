"""CUDA graphs of sampled decode steps (temperature / top-k / top-p / min-p): the captured
variants (layers/sampler.py graph_variant) give the eager step's seeded tokens exactly.

On the CPU each bucket's captured parts run eagerly on its padded static inputs (GraphedStep's
loading and buckets, the per-row sampling buffers and their padding); on a GPU the real graphs
do (the gpu-marked test)."""
from __future__ import annotations

import pytest
import torch
from helpers import graphed_engine, make_predictable_pair, random_prompts

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.layers.sampler import (FILTERED, GRAPH_SAMPLING_PAD, GREEDY, SAMPLED, SamplingInfo,
                                             graph_sampling_info, graph_variant, load_graph_sampling)

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
SHAPES, SHAPE_IDS = [None, CHAIN, TREE], ["plain", "chain", "tree"]
VOCAB = 320


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def _spec(head, shape):
    return None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)


def _params(n: int, filtered: bool, extra: dict | None = None) -> list[SamplingParams]:
    """Every third request greedy, the others seeded samples (with top-k / top-p / min-p
    when `filtered`, one rule per request); lengths differ so the batch shrinks through
    non-bucket sizes; the last runs alone at the end."""
    rules = [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=20, top_p=0.9)]
    out = []
    for i in range(n):
        kw = dict(max_new_tokens=8 + 3 * i + (16 if i == n - 1 else 0), ignore_eos=True, seed=1000 + i)
        if i % 3 == 0:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=1.6)
            if filtered:
                kw.update(rules[i % len(rules)])
        if extra and i == 1:
            kw.update(extra)
        out.append(SamplingParams(**kw))
    return out


def _decode_replays(graphs, worker):
    """(variant, bucket) of each replayed decode step (its first part)."""
    by_graphs = {id(worker.graphs): GREEDY, **{id(g): v for v, g in worker.sampled_graphs.items()}}
    return [(by_graphs[id(g)], rows.shape[0]) for g, rows, part in graphs.replays
            if part == 0 and id(g) in by_graphs]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("filtered", [False, True], ids=["temperature", "filters"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_sampled_graphs_equal_eager(pair, make_engine, monkeypatch, shape, filtered, overlap):
    """7 requests (3 greedy, 4 seeded samples) in the bucket of 8, then smaller batches as they
    finish: every decode step replays a captured variant, token for token the eager outputs."""
    prompts, params = random_prompts(7, seed=21, max_len=12), _params(7, filtered)
    kwargs = dict(spec=_spec(pair[1], shape), enable_overlap=overlap, max_running_requests=8)
    eager = make_engine(pair[0], **kwargs).generate(prompt_token_ids=prompts, sampling=params)
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], **kwargs)
    worker = engine.core.worker
    decodes = []
    launch = worker.launch_decode
    monkeypatch.setattr(worker, "launch_decode", lambda step: decodes.append(len(step.rows)) or launch(step))
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    replays = _decode_replays(graphs, worker)
    assert len(replays) == len(decodes) > 0  # no decode step ran eagerly
    sampled = FILTERED if filtered else SAMPLED
    # Greedy steps come once the sampled rows are done (plain decoding: the last request is
    # greedy; speculating, greedy rows accept more and may finish first).
    assert sampled in {v for v, _ in replays} <= {sampled, GREEDY}
    assert shape is not None or (GREEDY, 1) in replays
    assert (sampled, 8) in replays  # 7 rows in the bucket of 8: padded rows
    assert any(bs not in (1, 2, 4, 8) for bs in decodes)


def test_sampled_rows_do_sample(pair, make_engine):
    """The parameters above sample (else the equality checks nothing): seeded rows differ from
    greedy ones, and a seed is reproduced by itself."""
    prompts = random_prompts(6, seed=21, max_len=12)
    sampled = make_engine(pair[0]).generate(prompt_token_ids=prompts, sampling=_params(6, True))
    greedy = make_engine(pair[0]).generate(
        prompt_token_ids=prompts, sampling=[p.__class__(**{**p.__dict__, "temperature": 0.0})
                                            for p in _params(6, True)])
    differ = [a.token_ids != b.token_ids for a, b in zip(sampled, greedy)]
    assert not any(differ[0::3]) and all(d for i, d in enumerate(differ) if i % 3)


@pytest.mark.parametrize("rule", [dict(repetition_penalty=1.3), dict(presence_penalty=0.5),
                                  dict(logprobs=True), dict(logit_bias=((7, 3.0),)),
                                  dict(min_new_tokens=4)],
                         ids=["repetition", "presence", "logprobs", "logit_bias", "min_new_tokens"])
@pytest.mark.parametrize("shape", [None, TREE], ids=["plain", "tree"])
def test_batches_with_eager_rules_stay_eager(pair, make_engine, monkeypatch, shape, rule):
    """One request with a penalty / logprobs / logit_bias / min_new_tokens keeps its batch eager
    (no decode graph replays while it runs), with the eager outputs."""
    prompts, params = random_prompts(3, seed=22, max_len=10), _params(3, True, extra=rule)
    kwargs = dict(spec=_spec(pair[1], shape), max_running_requests=8)
    eager = make_engine(pair[0], **kwargs).generate(prompt_token_ids=prompts, sampling=params)
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], **kwargs)
    worker = engine.core.worker
    rule_steps = []  # per decode step: whether request 1 (the rule) is in it
    launch = worker.launch_decode

    def watch(step):
        info = step.sampling
        rule_steps.append(info.any_penalty or info.any_logprobs or info.logit_bias is not None
                          or info.any_min_new)
        return launch(step)

    monkeypatch.setattr(worker, "launch_decode", watch)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    # The steps with request 1 ran eagerly, every other one replayed (replays run on the
    # forward thread: counted at the end).
    assert any(rule_steps) and len(_decode_replays(graphs, worker)) == rule_steps.count(False) > 0
    # Once request 1 finishes, request 2 (sampled) replays the sampled graphs.
    assert (FILTERED, 1) in _decode_replays(graphs, worker)


def test_graph_variant_and_buffers():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=0.7, top_k=4, seed=5)]

    def info(ps):
        return SamplingInfo.build(ps, [s.seed or 0 for s in ps], [0] * len(ps), [2], VOCAB, "cpu")

    assert graph_variant(info(params[:1])) == GREEDY
    assert graph_variant(info(params[:2])) == SAMPLED
    assert graph_variant(info(params)) == FILTERED
    for eager_rule in (dict(repetition_penalty=1.2), dict(frequency_penalty=0.1), dict(logprobs=True),
                       dict(logit_bias=((3, 1.0),)), dict(min_new_tokens=1)):
        assert graph_variant(info([*params[:2], SamplingParams(temperature=0.0, **eager_rule)])) is None
    static = graph_sampling_info(4, VOCAB, "cpu", FILTERED)
    assert not static.all_greedy and static.any_filter and graph_variant(static) == FILTERED
    for name in GRAPH_SAMPLING_PAD:  # stale rows from an earlier, larger batch
        getattr(static, name).fill_(7)
    live = info(params)
    load_graph_sampling(static, live, 3)
    for name, pad in GRAPH_SAMPLING_PAD.items():
        assert torch.equal(getattr(static, name)[:3], getattr(live, name))
        assert getattr(static, name)[3].item() == pad


# --- on a GPU: the captured graphs ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("filtered", [False, True], ids=["temperature", "filters"])
@pytest.mark.parametrize("shape", [None, dict(num_steps=3, topk=1, num_draft_tokens=4),
                                   dict(num_steps=5, topk=4, num_draft_tokens=8)],
                         ids=["plain", "chain", "tree-5-4-8"])
def test_gpu_sampled_graphs_equal_eager(make_engine, shape, filtered):
    """The demo pair on CUDA: seeded sampled (and greedy) rows replay the sampled graphs, token
    for token the eager steps (padded buckets, mixed greedy rows)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts, params = random_prompts(6, seed=21, max_len=12), _params(6, filtered)
    params = [p.__class__(**{**p.__dict__, "max_new_tokens": 3 * p.max_new_tokens}) for p in params]
    kwargs = dict(device="cuda", attention_backend="triton", max_running_requests=8,
                  spec=None if shape is None else SpecConfig(**shape))
    outs, replays = [], []
    for graphs in (False, True):
        engine = make_engine(None, cuda_graph=graphs, **kwargs)
        worker = engine.core.worker
        if graphs:
            variant = worker.sampled_graphs[FILTERED if filtered else SAMPLED]
            replay = variant.replay
            variant.replay = lambda c, p, replay=replay: replays.append(p) or replay(c, p)
        outs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)])
    assert outs[1] == outs[0]
    assert replays.count(0) > 0
