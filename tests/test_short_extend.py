"""Short extends (one request's last prefill chunk of <= 32 tokens: a cached prompt's tail, a
short prompt) replayed as CUDA graphs (engine/runtime/short_extend.py).

On the CPU the graphs' parts run eagerly over the same padded static inputs the graphs
capture (through the torch backend, which like Triton's needs no host lengths), so the padding,
the packed host buffer, EAGLE's publish and draft half are checked against the eager extend;
on a GPU the real graphs are, through the Triton backend."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import make_predictable_pair, random_prompts

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.runtime.short_extend import (
    MAX_SHORT_EXTEND, SHORT_EXTEND_BUCKETS, load_short_extend, make_short_extend_inputs)

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


class EagerShortExtends:
    """GraphedStep's replay surface, running the parts eagerly (the CPU has no graphs)."""

    def __init__(self, parts, device):
        self.parts = parts
        self.inputs = {b: make_short_extend_inputs(b, device) for b in SHORT_EXTEND_BUCKETS}
        self.replays = []
        self._out = None

    def static_for(self, size):
        bucket = next(b for b in SHORT_EXTEND_BUCKETS if b >= size)
        return SimpleNamespace(inputs=self.inputs[bucket])

    def replay(self, captured, part):
        self.replays.append((captured.inputs.ids.shape[0], part))
        self._out = self.parts[part](captured.inputs if part == 0 else self._out)
        return self._out

    def release(self):
        pass


def _eager_graphs(engine):
    worker = engine.core.worker
    width = engine.core.req_to_token.row_width
    worker.extend_graphs = EagerShortExtends(worker.short_extend_parts(width), engine.core.device)
    return worker.extend_graphs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def _follow_ups(engine, prompts):
    """Prompts whose prefix the cache holds (a tail of 1..35 tokens), then fresh short ones."""
    first = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
    tails = [[7], [9] * 20, [11] * (MAX_SHORT_EXTEND + 3)][:len(prompts)]  # buckets 8, 32; eager
    return [p + o.token_ids + t for p, o, t in zip(prompts, first, tails)] + \
        random_prompts(2, seed=5, min_len=2, max_len=14)


@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_padded_short_extends_equal_eager_extends(pair, make_engine, spec):
    target, head = pair
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    kwargs = dict(spec=spec_cfg, max_running_requests=4)
    prompts = random_prompts(3, seed=3, min_len=8, max_len=20)
    eager, graphed = make_engine(target, **kwargs), make_engine(target, **kwargs)
    stub = _eager_graphs(graphed)
    follow_ups = _follow_ups(eager, prompts)
    assert _follow_ups(graphed, prompts) == follow_ups
    stub.replays.clear()
    # One at a time: a batch of one request is what the graphs take.
    want = [eager.generate(prompt_token_ids=[p], sampling=GREEDY)[0].token_ids for p in follow_ups]
    got = [graphed.generate(prompt_token_ids=[p], sampling=GREEDY)[0].token_ids for p in follow_ups]
    assert got == want
    parts = 1 if spec is None else 2
    assert len(stub.replays) == parts * (len(follow_ups) - 1)  # all but the 35-token tail
    assert {b for b, _ in stub.replays} <= set(SHORT_EXTEND_BUCKETS)


def test_only_greedy_single_short_final_chunks_take_the_graphs(pair, make_engine):
    engine = make_engine(pair[0])
    stub = _eager_graphs(engine)
    long_prompt = random_prompts(1, seed=6, min_len=MAX_SHORT_EXTEND + 1, max_len=MAX_SHORT_EXTEND + 20)[0]
    engine.generate(prompt_token_ids=[long_prompt], sampling=GREEDY)  # too long: eager
    engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(max_new_tokens=3, temperature=0.8))
    engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                        logprobs=True))
    engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling=GREEDY)  # two requests: eager
    assert stub.replays == []
    engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=GREEDY)
    assert stub.replays == [(8, 0)]


def test_loading_pads_slots_with_the_dummy_slot():
    static = make_short_extend_inputs(8, torch.device("cpu"))
    packed = torch.arange(3 * 8 + 4)
    load_short_extend(static, packed, torch.tensor([11, 12, 13]))
    assert static.loc.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert static.meta.tolist() == [24, 25, 26, 27] and static.ids.tolist() == list(range(8))


# --- on a GPU: the captured graphs ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_gpu_short_extend_graphs_equal_eager(pair, make_engine, spec):
    target, head = pair
    spec_cfg = None if spec is None else SpecConfig(algorithm="eagle", draft_model=head, **spec)
    kwargs = dict(device="cuda", attention_backend="triton", spec=spec_cfg, max_running_requests=4,
                  max_total_tokens=4096)
    prompts = random_prompts(4, seed=3, min_len=8, max_len=40)
    outs = []
    for graphs in (False, True):
        engine = make_engine(target, cuda_graph=graphs, **kwargs)
        assert (engine.core.worker.extend_graphs is not None) is graphs
        follow_ups = _follow_ups(engine, prompts)
        outs.append([engine.generate(prompt_token_ids=[p], sampling=GREEDY)[0].token_ids for p in follow_ups])
    assert outs[0] == outs[1]
