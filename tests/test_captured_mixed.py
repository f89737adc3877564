"""The mixed step's target forward replayed as a CUDA graph (engine/runtime/captured_mixed.py):
decode or chain verify rows and prompt chunks as one captured ragged extend.

On the CPU the graphs' part runs eagerly over the same padded static inputs a graph captures
(tests/helpers.py `eager_graphs`, through the torch backend, which like Triton's reads the
lengths on the device; Triton itself in the interpreter): outputs equal each request run
alone and the eager mixed step, plain and chain, both loops, arrivals mid-decode, a chunked
long prompt, a cached prefix, greedy and seeded sampling; steps no bucket holds (and tree
verify rows) run eagerly beside graphed ones. On a GPU the real graphs equal the eager mixed
step, with no blocking host sync."""
from __future__ import annotations

import functools

import pytest
import torch
from helpers import (assert_no_leaks, drive, graphed_engine, make_eagle3_head, make_predictable_pair,
                     random_prompts, record_steps)

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.runtime import captured_mixed
from specserve.engine.runtime.captured_extend import ExtendBucket
from specserve.engine.runtime.captured_mixed import load_mixed_inputs, make_mixed_inputs, mixed_bucket, mixed_buckets
from specserve.engine.runtime.mixed_step import DecodeRows

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=2, topk=2, num_draft_tokens=4)
BUDGET = 32


@pytest.fixture
def make_engine(make_engine):
    return functools.partial(make_engine, mixed_steps=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def _spec(pair, shape):
    return None if shape is None else SpecConfig(algorithm="eagle", draft_model=pair[1], **shape)


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


def _sampled(max_new: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.9, seed=seed, ignore_eos=True, **kw)


def _arrivals():
    """Two requests decode; the others arrive while they do: a long prompt (chunked over several
    steps), seeded sampling with a filter, n = 2, a prompt that extends d0's (a cached prefix
    with the cache on)."""
    p = random_prompts(5, seed=141, min_len=4, max_len=14)
    long = random_prompts(1, seed=142, min_len=150, max_len=150)[0]
    return [(0, "d0", p[0], _greedy(30)), (0, "d1", p[1], _sampled(30, seed=5)),
            (2, "long", long, _greedy(6)), (3, "s", p[2], _sampled(8, seed=9, top_k=20)),
            (4, "n2", p[3], _sampled(6, seed=11, n=2)), (6, "warm", p[0] + p[4], _greedy(6))]


def _mixed_replays(graphs, worker) -> int:
    return sum(g is worker.mixed_graphs for g, _, _ in graphs.replays)


# --- engines on the CPU (the graphs' stand-in) --------------------------------------------
@pytest.mark.parametrize("overlap,cache", [(False, False), (True, True)], ids=["normal-nocache", "overlap-cache"])
@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_graphed_mixed_steps_equal_eager_ones_and_each_request_alone(pair, make_engine, monkeypatch, shape,
                                                                    overlap, cache):
    spec = _spec(pair, shape)
    alone_engine = make_engine(pair[0], spec=spec, enable_overlap=False, enable_prefix_cache=False,
                               prefill_interleave_tokens=0)
    expected = {}
    for _, rid, prompt, params in _arrivals():
        expected.update(drive(alone_engine, [(0, rid, prompt, params)]))
    eager = make_engine(pair[0], spec=spec, enable_overlap=overlap, enable_prefix_cache=cache,
                        prefill_interleave_tokens=BUDGET)
    assert drive(eager, _arrivals()) == expected
    assert eager.metrics.num_mixed_steps > 0
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=spec, enable_overlap=overlap,
                                    enable_prefix_cache=cache, prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    graphs.replays.clear()
    assert drive(engine, _arrivals()) == expected
    worker = engine.core.worker
    assert _mixed_replays(graphs, worker) == engine.metrics.num_mixed_steps > 0
    # The long prompt was chunked over several graphed mixed steps.
    assert sum(("long", 0) in s.reqs and s.mixed for s in steps) >= 2
    # The prompt share filled the 64-token bucket the steps replay (BUDGET alone is 32; no
    # smaller bucket holds the floor, so the step replays that one whatever the cost model says).
    row_tokens = worker.mixed_row_tokens()
    assert any(s.mixed and s.computed + s.num_decode * row_tokens > BUDGET for s in steps)
    for s in steps:
        if s.mixed:
            assert s.computed <= max(BUDGET, 64 - s.num_decode * row_tokens)
    assert_no_leaks(engine)


@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_steps_no_bucket_holds_run_eagerly_beside_graphed_ones(pair, make_engine, monkeypatch, shape):
    """With only the 64-token buckets captured and a budget of 100 tokens, the steps over 64
    tokens run eagerly, the others replay: the outputs equal each request alone."""
    spec = _spec(pair, shape)
    alone_engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=0)
    expected = {}
    for _, rid, prompt, params in _arrivals():
        expected.update(drive(alone_engine, [(0, rid, prompt, params)]))
    monkeypatch.setattr(captured_mixed, "TOKEN_BUCKETS", (64,))  # the mixed buckets' T
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=spec, prefill_interleave_tokens=100)
    graphs.replays.clear()
    assert drive(engine, _arrivals()) == expected
    assert 0 < _mixed_replays(graphs, engine.core.worker) < engine.metrics.num_mixed_steps


def test_an_eagle3_head_reads_the_features_the_graphs_write(pair, make_engine, monkeypatch, tmp_path):
    """EAGLE-3 drafts from several target layers' features: the graphs write them beside the
    hidden states into the shared outputs, and each part's draft-extend reads its rows."""
    head = make_eagle3_head(str(tmp_path / "head"), target_layers=2)
    spec = SpecConfig(algorithm="eagle3", draft_model=head, **CHAIN)
    arrivals = _arrivals()[:4]
    alone_engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=0)
    expected, expected_accepted = {}, {}
    for _, rid, prompt, params in arrivals:
        expected.update(drive(alone_engine, [(0, rid, prompt, params)], accepted=expected_accepted))
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=spec, prefill_interleave_tokens=BUDGET)
    graphs.replays.clear()
    accepted = {}
    assert drive(engine, arrivals, accepted=accepted) == expected
    assert accepted == expected_accepted  # the drafts too: the same features
    assert _mixed_replays(graphs, engine.core.worker) == engine.metrics.num_mixed_steps > 0


def test_tree_verify_rows_stay_eager(pair, make_engine, monkeypatch):
    spec = _spec(pair, TREE)
    arrivals = _arrivals()[:4]
    alone_engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=0)
    expected = {}
    for _, rid, prompt, params in arrivals:
        expected.update(drive(alone_engine, [(0, rid, prompt, params)]))
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=spec, prefill_interleave_tokens=BUDGET)
    graphs.replays.clear()
    assert drive(engine, arrivals) == expected
    assert engine.metrics.num_mixed_steps > 0 and _mixed_replays(graphs, engine.core.worker) == 0


@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_triton_graphed_mixed_steps_match_torch_native(pair, make_engine, monkeypatch, shape):
    """Through the Triton kernels (the interpreter: small): lengths read from the device, the
    split extend under M = 64 (a 20-token prompt) and the plain extend above (a 100-token one)."""
    pytest.importorskip("triton")
    arrivals = [(0, "d0", random_prompts(1, seed=151, max_len=8)[0], _greedy(40)),
                (2, "a", random_prompts(1, seed=152, min_len=100, max_len=100)[0], _greedy(2)),
                (4, "b", random_prompts(1, seed=153, min_len=20, max_len=20)[0], _greedy(2))]
    kwargs = dict(spec=_spec(pair, shape), prefill_interleave_tokens=100, max_context_len=160,
                  max_running_requests=4)
    expected = drive(make_engine(pair[0], **kwargs), arrivals)
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], attention_backend="triton", **kwargs)
    graphs.replays.clear()
    assert drive(engine, arrivals) == expected
    worker = engine.core.worker
    assert _mixed_replays(graphs, worker) == engine.metrics.num_mixed_steps > 0
    replayed = {bucket.max_chunk for bucket, captured in worker.mixed_graphs.captured.items()
                for g, rows, _ in graphs.replays if g is worker.mixed_graphs and rows is captured.inputs.rows}
    assert min(replayed) == 64 < max(replayed)


# --- units -----------------------------------------------------------------------------------
def test_bucket_choice():
    buckets = mixed_buckets(64, 4096)
    assert buckets == sorted(buckets) and buckets[0] == ExtendBucket(64, 64, 16)
    assert {b.tokens for b in buckets} == {64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048}
    assert {b.requests for b in buckets} == {16, 64}
    # 8 chain rows (4 tokens each) and a 20-token chunk: 52 tokens, 9 entries.
    assert mixed_bucket(4, 8, [20], False, buckets) == ExtendBucket(64, 64, 16)
    # 16 rows and a chunk: 17 entries.
    assert mixed_bucket(1, 16, [40], False, buckets) == ExtendBucket(64, 64, 64)
    # 62 chain rows and 768 prompt tokens (about the 8B shape at 1024): a 700-token chunk.
    assert mixed_bucket(4, 62, [700, 68], False, buckets) == ExtendBucket(1024, 1024, 64)
    assert mixed_bucket(4, 60, [100, 100], False, buckets) == ExtendBucket(512, 256, 64)
    assert mixed_bucket(4, 60, [200, 100], False, buckets) == ExtendBucket(768, 256, 64)
    assert mixed_bucket(1, 4, [65], False, buckets) == ExtendBucket(128, 128, 16)
    # Eager: a tree mask; more tokens than 2048; more entries than the rows.
    assert mixed_bucket(4, 8, [20], True, buckets) is None
    assert mixed_bucket(4, 64, [1900], False, buckets) is None
    assert mixed_bucket(1, 60, [1] * 5, False, buckets) is None
    # The engine's rows cap R (256 rows: the rungs 16, 64, 256; never more than T), the rows'
    # width caps M.
    big = mixed_buckets(256, 4096)
    assert {b.requests for b in big if b.tokens == 128} == {16, 64, 128}
    assert {b.requests for b in big if b.tokens == 2048} == {16, 64, 256}
    assert mixed_bucket(4, 240, [30], False, big) == ExtendBucket(1024, 256, 256)
    assert mixed_bucket(4, 250, [200, 56], False, big) == ExtendBucket(1280, 256, 256)
    assert all(b.max_chunk <= 300 for b in mixed_buckets(8, 300))
    assert mixed_bucket(1, 2, [400], False, mixed_buckets(8, 300)) is None


def test_loading_pads_after_the_rows_and_chunks():
    bucket = ExtendBucket(64, 64, 16)  # 16 entries, then one padding entry of up to 64 tokens
    static = make_mixed_inputs(bucket, torch.device("cpu"))
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    rows = DecodeRows(input_ids=t(7, 8, 9, 10), positions=t(5, 6, 3, 4), prefix_lens=t(5, 3),
                      out_cache_loc=t(21, 22, 31, 32), width=2, seq_lens_cpu=None)
    chunks = type("Chunks", (), dict(input_ids=t(40, 41, 42), positions=t(0, 1, 2), out_cache_loc=t(50, 51, 52),
                                     rows=t(4), prefix_lens=t(0), extend_lens_cpu=[3]))
    static.loc.fill_(99)  # an earlier replay's slots: the padding must write slot 0 again
    assert load_mixed_inputs(static, bucket, rows, t(2, 3), chunks) == 7
    assert static.ids.tolist()[:8] == [7, 8, 9, 10, 40, 41, 42, 0]
    assert static.positions.tolist()[:8] == [5, 6, 3, 4, 0, 1, 2, 0]
    assert static.loc.tolist()[:7] == [21, 22, 31, 32, 50, 51, 52] and not static.loc[7:].any()
    assert static.rows.tolist() == [2, 3, 4] + [0] * 14
    assert static.prefix_lens.tolist() == [5, 3, 0] + [0] * 14
    # The entries: 2 rows of 2, the chunk, the 57 padding tokens in one entry, then empty ones.
    assert static.extend_lens.tolist() == [2, 2, 3, 57] + [0] * 13
    assert static.extend_lens.sum() == bucket.tokens


# --- on a GPU: the captured graphs ------------------------------------------------------------
def _count_replays(engine) -> list:
    """Every replay of the engine's mixed graphs from now on (their part index)."""
    graphs = engine.core.worker.mixed_graphs
    replays, replay = [], graphs.replay
    graphs.replay = lambda captured, part: replays.append(part) or replay(captured, part)
    return replays


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_gpu_graphed_mixed_steps_equal_eager(pair, make_engine, shape):
    """The captured mixed forwards (Triton) give the eager mixed steps' outputs."""
    kwargs = dict(device="cuda", attention_backend="triton", spec=_spec(pair, shape), prefill_interleave_tokens=BUDGET)
    expected = drive(make_engine(pair[0], cuda_graph=False, **kwargs), _arrivals())
    engine = make_engine(pair[0], cuda_graph=True, **kwargs)
    assert engine.core.worker.mixed_graphs is not None and engine.core.scheduler.policy.mixed_graph_tokens
    replays = _count_replays(engine)
    assert drive(engine, _arrivals()) == expected
    assert len(replays) == engine.metrics.num_mixed_steps > 0


@pytest.mark.gpu
def test_gpu_graphed_mixed_steps_have_no_blocking_sync(pair, make_engine):
    """A long request decodes while short prompts arrive and ride in its graphed mixed steps:
    no blocking host sync in them (CUDA's sync debug mode raises on one)."""
    from helpers import blocking_syncs_fail

    engine = make_engine(pair[0], device="cuda", attention_backend="triton", cuda_graph=True,
                         spec=_spec(pair, CHAIN))
    assert not engine.core.needs_cpu_seq_lens
    replays = _count_replays(engine)
    engine.add_request("long", [5, 6, 7, 8], _greedy(200))
    for _ in range(4):
        engine.step()
    with blocking_syncs_fail():
        for i in range(9):
            if i % 3 == 0:
                engine.add_request(f"a{i}", list(range(10, 40)), _greedy(3))
            engine.step()
    assert replays and engine.metrics.num_mixed_steps > 0
    engine.abort("long")
    while engine.has_unfinished():
        engine.step()
