"""Extends replayed as CUDA graphs (engine/runtime/captured_extend.py): a batch of requests each
ending its prefill (arrivals' prompts, a cached prompt's tail), packed into a bucket.

On the CPU the graphs' parts run eagerly over the same padded static inputs the graphs
capture (through the torch backend, which like Triton's reads the lengths on the device), so
the packing, the padding entries, EAGLE's publish and draft half are checked against the eager
extend: tokens, KV and FutureMap stashes; on a GPU the real graphs are, through the Triton
backend."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from helpers import make_predictable_pair, random_prompts

from specserve.engine import GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.runtime.captured_extend import (
    MAX_REQUESTS, TOKEN_BUCKETS, ExtendBucket, extend_bucket, extend_buckets, load_captured_extend,
    make_captured_extend_inputs, pack_captured_extend)
from specserve.engine.runtime.step import ExtendStep

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
SPECS = [None, CHAIN, TREE]
SPEC_IDS = ["plain", "chain", "tree"]


class EagerCapturedExtends:
    """GraphedStep's replay surface, running the parts eagerly (the CPU has no graphs)."""

    def __init__(self, parts, buckets, device):
        self.parts = parts
        self.buckets = buckets
        self.captured = {b: SimpleNamespace(bucket=b, inputs=make_captured_extend_inputs(b, device))
                         for b in buckets}
        self.replays = []
        self._out = None

    def replay(self, captured, part):
        self.replays.append((captured.bucket, part))
        self._out = self.parts[part](captured.inputs if part == 0 else self._out)
        return self._out

    def release(self):
        pass


def _eager_graphs(engine):
    worker, table = engine.core.worker, engine.core.req_to_token
    worker.extend_graphs = EagerCapturedExtends(worker.captured_extend_parts(table.row_width),
                                             extend_buckets(table.num_rows, table.row_width),
                                             engine.core.device)
    return worker.extend_graphs


def _spec(pair, spec):
    return None if spec is None else SpecConfig(algorithm="eagle", draft_model=pair[1], **spec)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


# Chunk lengths at and around the buckets' edges (64, 128, 256) and small ones.
EDGE_LENS = [1, 2, 7, 33, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257]


def _random_batch(rng: random.Random, cached: list[list[int]], max_requests: int) -> list[list[int]]:
    """1..max_requests prompts: fresh ones of edge or random lengths, and cached prompts with a
    tail (the prefix cache holds them: only the tail prefills)."""
    batch = []
    for _ in range(rng.randint(1, max_requests)):
        n = rng.choice(EDGE_LENS) if rng.random() < 0.6 else rng.randint(1, 300)
        if cached and rng.random() < 0.4:
            base = rng.choice(cached)
            batch.append(base + [rng.randrange(3, 300) for _ in range(min(n, 64))])
        else:
            batch.append([rng.randrange(3, 300) for _ in range(n)])
    while sum(map(len, batch)) > 1500:  # one prefill batch (chunked_prefill_size 2048)
        batch.pop()
    return batch or [[5, 6, 7]]


def _state(engine):
    """What an extend leaves behind: the KV of every slot but the dummy (target, draft), the
    FutureMap's stashed tokens, published lengths and draft state of every row but row 0."""
    core = engine.core
    fm = core.worker.target.future_map
    pools = [core.runner.kv_pool] + ([core.draft_runner.kv_pool] if core.draft_runner is not None else [])
    state = {"tokens": fm.output_tokens_buf[1:].clone()}
    for i, pool in enumerate(pools):
        for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
            state[f"k{i}.{layer}"], state[f"v{i}.{layer}"] = k[1:].clone(), v[1:].clone()
    if core.spec is not None:
        state["seq_lens"] = fm.new_seq_lens_buf[1:].clone()
        for name, buf in zip(("topk_p", "topk_index", "hidden"), fm.draft_state):
            state[name] = buf[1:].clone()
    return state


ENGINE = dict(max_running_requests=8, enable_overlap=False, max_total_tokens=8192)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_batched_extends_equal_eager_extends(pair, make_engine, spec):
    """Random batches of 1..8 requests (edge lengths, cached tails) prefilled through the
    padded buckets leave the same tokens, KV and stashes as the eager extend."""
    kwargs = dict(ENGINE, spec=_spec(pair, spec))
    eager, graphed = make_engine(pair[0], **kwargs), make_engine(pair[0], **kwargs)
    stub = _eager_graphs(graphed)
    rng = random.Random(7)
    cached = random_prompts(3, seed=3, min_len=40, max_len=150)
    for engine in (eager, graphed):
        engine.generate(prompt_token_ids=cached, sampling=GREEDY)
    buckets = set()
    for _ in range(5):
        batch = _random_batch(rng, cached, 8)
        stub.replays.clear()
        want = [o.token_ids for o in eager.generate(prompt_token_ids=batch, sampling=ONE)]
        got = [o.token_ids for o in graphed.generate(prompt_token_ids=batch, sampling=ONE)]
        assert got == want
        assert stub.replays, "the batch took the eager path"
        buckets |= {b for b, _ in stub.replays}
        want_state, got_state = _state(eager), _state(graphed)
        for name in want_state:
            torch.testing.assert_close(got_state[name], want_state[name], msg=name)
    assert len(buckets) >= 3  # several sizes, not one bucket over and over


@pytest.mark.parametrize("spec", [None, CHAIN], ids=["plain", "chain"])
def test_triton_batched_extends_equal_eager_extends(pair, make_engine, spec):
    """Through the Triton kernels (the interpreter on the CPU: small): the lengths read from
    the device (qo_indptr a device cumsum), the split extend under the 64-token bound and the
    plain extend under a larger one, a cached prefix's tail."""
    pytest.importorskip("triton")
    kwargs = dict(ENGINE, spec=_spec(pair, spec), attention_backend="triton", max_context_len=160)
    eager, graphed = make_engine(pair[0], **kwargs), make_engine(pair[0], **kwargs)
    stub = _eager_graphs(graphed)
    base = random_prompts(1, seed=3, min_len=70, max_len=70)
    for engine in (eager, graphed):
        engine.generate(prompt_token_ids=base, sampling=GREEDY)
    batches = [random_prompts(3, seed=11, min_len=20, max_len=60),   # split extend (T 128)
               [base[0] + [7] * 9, [5] * 100, [6] * 3]]                # a tail; chunks up to 100
    for batch in batches:
        want = [o.token_ids for o in eager.generate(prompt_token_ids=batch, sampling=ONE)]
        got = [o.token_ids for o in graphed.generate(prompt_token_ids=batch, sampling=ONE)]
        assert got == want
        want_state, got_state = _state(eager), _state(graphed)
        for name in want_state:
            torch.testing.assert_close(got_state[name], want_state[name], msg=name)
    assert {b.max_chunk for b, _ in stub.replays} == {64, 128}


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_generate_equal_with_batched_extend_graphs(pair, make_engine, spec):
    """Greedy generation (overlap on) with the buckets and without: arrivals batched, then
    cached prompts' tails (one at a time, and together with fresh prompts)."""
    kwargs = dict(spec=_spec(pair, spec), max_running_requests=6)
    eager, graphed = make_engine(pair[0], **kwargs), make_engine(pair[0], **kwargs)
    stub = _eager_graphs(graphed)
    prompts = random_prompts(5, seed=4, min_len=8, max_len=140)
    outs = []
    for engine in (eager, graphed):
        first = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
        tails = [p + o.token_ids + [9] * (1 + 17 * i) for i, (p, o) in enumerate(zip(prompts, first))]
        singles = [engine.generate(prompt_token_ids=[t], sampling=GREEDY)[0].token_ids for t in tails[:2]]
        mixed = engine.generate(prompt_token_ids=tails[2:] + random_prompts(3, seed=5, max_len=70),
                                sampling=GREEDY)
        outs.append(([o.token_ids for o in first], singles, [o.token_ids for o in mixed]))
    assert outs[1] == outs[0]
    parts = 1 if spec is None else 2
    assert len(stub.replays) >= parts * 4


def test_only_fitting_batches_take_the_graphs(pair, make_engine):
    engine = make_engine(pair[0], max_running_requests=4)
    stub = _eager_graphs(engine)
    greedy1 = SamplingParams(max_new_tokens=1, temperature=0.0)
    engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling=SamplingParams(max_new_tokens=3, temperature=0.8))
    engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                        logprobs=True))
    engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(max_new_tokens=1, temperature=0.0,
                                                                        prompt_logprobs=1))
    engine.generate(prompt_token_ids=[[5, 6, 7]], sampling=SamplingParams(
        max_new_tokens=3, temperature=0.0, grammar=GrammarSpec("regex", "(yes|no)!")))
    # One greedy request beside a sampled one: the batch runs eagerly.
    engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9]],
                    sampling=[greedy1, SamplingParams(max_new_tokens=1, temperature=0.8)])
    assert stub.replays == []
    engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling=greedy1)
    assert stub.replays == [(ExtendBucket(64, 64, 4), 0)]


def _step(chunks, samples=None, **kw):
    """An ExtendStep of chunks (start, end) over made-up prompts (rows 1, 2, ...)."""
    n = len(chunks)
    fill = [list(range(10, 10 + end)) for _, end in chunks]
    sampling = SimpleNamespace(per_token_rules=False)
    return ExtendStep(rows=list(range(1, n + 1)), fill_ids=fill, chunks=chunks,
                      samples=samples or [True] * n, out_cache_loc=torch.arange(1, 1 + sum(e - s for s, e in chunks)),
                      sampling=kw.pop("sampling", sampling), prompt_lens=[e for _, e in chunks],
                      prompt_spans=kw.pop("prompt_spans", [None] * n), prompt_top_k=[0] * n, **kw)


def test_bucket_choice():
    buckets = extend_buckets(64, 4096)
    assert len(buckets) == 12 and buckets[0] == ExtendBucket(64, 64, 1)
    assert extend_bucket(_step([(0, 64)]), buckets) == ExtendBucket(64, 64, 1)
    assert extend_bucket(_step([(4000, 4033)]), buckets) == ExtendBucket(64, 64, 1)  # a cached tail
    assert extend_bucket(_step([(0, 40), (0, 24)]), buckets) == ExtendBucket(64, 64, MAX_REQUESTS)
    assert extend_bucket(_step([(0, 65)]), buckets) == ExtendBucket(128, 128, MAX_REQUESTS)
    assert extend_bucket(_step([(0, 60), (0, 60)]), buckets) == ExtendBucket(128, 64, MAX_REQUESTS)
    assert extend_bucket(_step([(0, 140)] * 10), buckets) == ExtendBucket(2048, 256, MAX_REQUESTS)
    assert extend_bucket(_step([(0, 300), (0, 10)]), buckets) == ExtendBucket(512, 512, MAX_REQUESTS)
    # Eager: too many tokens or requests, a chunk that does not end its prefill, prompt
    # logprobs, per-token sampling rules, a grammar.
    assert extend_bucket(_step([(0, 1500), (0, 600)]), buckets) is None
    assert extend_bucket(_step([(0, 2)] * (MAX_REQUESTS + 1)), buckets) is None
    assert extend_bucket(_step([(0, 8), (0, 8)], samples=[True, False]), buckets) is None
    assert extend_bucket(_step([(0, 8)], prompt_spans=[(1, 8)]), buckets) is None
    assert extend_bucket(_step([(0, 8)], sampling=SimpleNamespace(per_token_rules=True)), buckets) is None
    assert extend_bucket(_step([(0, 8)], grammar=object()), buckets) is None
    # The rows' width bounds the chunk bound; the requests, the engine's rows.
    assert all(b.max_chunk <= 300 and b.requests in (1, 4) for b in extend_buckets(4, 300))
    assert {b.tokens for b in extend_buckets(4, 300)} == set(TOKEN_BUCKETS)


def test_packing_pads_with_entries_of_their_own():
    bucket = ExtendBucket(128, 64, 4)  # 4 requests, then 2 padding entries of up to 64 tokens
    step = _step([(3, 5), (0, 3)])
    static = make_captured_extend_inputs(bucket, torch.device("cpu"))
    load_captured_extend(static, pack_captured_extend(step, bucket, next_tokens=True), step.out_cache_loc)
    assert static.ids.tolist()[:6] == [13, 14, 10, 11, 12, 0] and static.positions.tolist()[:6] == [3, 4, 0, 1, 2, 0]
    assert static.shifted.tolist()[:6] == [14, 0, 11, 12, 0, 0]
    assert static.loc.tolist()[:6] == [1, 2, 3, 4, 5, 0] and not static.loc[5:].any()
    assert static.rows.tolist() == [1, 2, 0, 0, 0, 0]
    assert static.prefix_lens.tolist() == [3, 0, 0, 0, 0, 0]
    # Padding (123 tokens) in entries of at most 64, right after the requests; then nothing.
    assert static.extend_lens.tolist() == [2, 3, 64, 59, 0, 0]
    assert static.last.tolist() == [1, 4, 127, 127]
    assert static.sampled_rows.tolist() == [1, 2, 0, 0] and static.sampled_seq_lens.tolist()[:2] == [5, 3]
    assert static.extend_lens.sum() == bucket.tokens


# --- on a GPU: the captured graphs ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_gpu_batched_extend_graphs_equal_eager(pair, make_engine, spec):
    kwargs = dict(device="cuda", attention_backend="triton", spec=_spec(pair, spec),
                  max_running_requests=8, max_total_tokens=16384)
    cached = random_prompts(3, seed=3, min_len=40, max_len=150)
    outs = []
    for graphs in (False, True):
        engine = make_engine(pair[0], cuda_graph=graphs, **kwargs)
        assert (engine.core.worker.extend_graphs is not None) is graphs
        engine.generate(prompt_token_ids=cached, sampling=GREEDY)
        rng, out = random.Random(7), []
        for _ in range(6):
            batch = _random_batch(rng, cached, 8)
            out.append([o.token_ids for o in engine.generate(prompt_token_ids=batch, sampling=GREEDY)])
            out.append([engine.generate(prompt_token_ids=[p], sampling=GREEDY)[0].token_ids for p in batch[:2]])
        outs.append(out)
    assert outs[0] == outs[1]
