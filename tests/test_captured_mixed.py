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
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import (assert_no_leaks, drive, graphed_engine, make_eagle3_head, make_predictable_pair,
                     random_prompts, record_steps)

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.runtime import captured_mixed
from specserve.engine.runtime.captured_extend import ExtendBucket
from specserve.engine.runtime.captured_mixed import (load_mixed_draft, load_mixed_inputs, make_mixed_inputs,
                                                    mixed_bucket, mixed_buckets)
from specserve.engine.runtime.mixed_step import DecodeRows
from specserve.engine.spec import spec_worker

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


def _mixed_replays(graphs, worker, part: int = 0) -> int:
    """Replays of the mixed graphs' `part` (0: the target forward; 1: the draft-extend)."""
    return sum(g is worker.mixed_graphs and p == part for g, _, p in graphs.replays)


def _wrap_replays(graphs, worker) -> int:
    """Replays of the speculative wrap's graphs (draft, accept, draft-extend: 3 a step)."""
    wraps = list(worker.mixed_wrap_graphs.values())
    return sum(any(g is w for w in wraps) for g, _, _ in graphs.replays)


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
    # Chain: the draft, the accept and the outputs around every mixed forward replayed too
    # (greedy, seeded and filtered decode rows: each its variant), and both parts' draft-extend
    # after it; plain samples eagerly.
    assert _wrap_replays(graphs, worker) == (3 * engine.metrics.num_mixed_steps if shape else 0)
    assert _mixed_replays(graphs, worker, part=1) == (engine.metrics.num_mixed_steps if shape else 0)
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


@pytest.mark.parametrize("shape,own_pool", [(None, False), (CHAIN, True), (TREE, False)],
                         ids=["plain", "chain", "tree"])
def test_mixed_forwards_beside_a_wrap_are_captured_in_a_pool_of_their_own(pair, make_engine, monkeypatch,
                                                                           shape, own_pool):
    """Graphs sharing a pool may reuse each other's freed transients only if they replay in
    capture order; a chain mixed step replays the wrap's draft, the mixed forward, the wrap's
    accept and outputs, then the forward's draft-extend, so its forwards take a pool of their
    own (None: `capture_all` makes one). Without a wrap they share the decode graphs'. (The
    stand-in has no pools: on a GPU one pool gave garbage tokens.)"""
    from helpers import eager_graphs

    engine = make_engine(pair[0], spec=_spec(pair, shape))
    eager_graphs(monkeypatch)
    worker = engine.core.worker
    width = engine.core.req_to_token.row_width
    worker.enable_cuda_graphs(engine.core.config.max_running_requests, width)
    worker.graphs.pool = decode_pool = object()
    pools = []
    capture = worker.target.capture_mixed

    def recorded(max_entries, width, layers, pool, *args):
        pools.append(pool)
        return capture(max_entries, width, layers, pool, *args)

    monkeypatch.setattr(worker.target, "capture_mixed", recorded)
    worker.capture_mixed(engine.core.config.max_running_requests, width)
    assert pools == [None if own_pool else decode_pool]
    assert bool(worker.mixed_wrap_graphs) == own_pool


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


def test_chunk_logits_past_the_wraps_rows_are_computed_after_it(pair, make_engine, monkeypatch):
    """The wrap's accept takes the logits of up to CHUNK_LOGIT_ROWS chunks (1 here) with the
    verify rows'; a step of more chunks computes theirs after it: both give each request's
    own tokens (greedy and seeded)."""
    prompts = random_prompts(5, seed=171, min_len=5, max_len=8)
    arrivals = [(0, "d0", prompts[0], _greedy(24)), (0, "d1", prompts[1], _sampled(24, seed=3)),
                (2, "a", prompts[2], _greedy(4)), (2, "b", prompts[3], _sampled(4, seed=4)),
                (8, "c", prompts[4], _greedy(4))]
    spec = _spec(pair, CHAIN)
    alone_engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=0)
    expected = {}
    for _, rid, prompt, params in arrivals:
        expected.update(drive(alone_engine, [(0, rid, prompt, params)]))
    monkeypatch.setattr(spec_worker, "CHUNK_LOGIT_ROWS", 1)
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=spec, prefill_interleave_tokens=BUDGET)
    steps = record_steps(engine)
    graphs.replays.clear()
    assert drive(engine, arrivals) == expected
    assert {len(s.chunks) for s in steps if s.mixed} >= {1, 2}
    assert _wrap_replays(graphs, engine.core.worker) == 3 * engine.metrics.num_mixed_steps


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


def _graphed_equals_alone(pair, make_engine, monkeypatch, spec: SpecConfig):
    """A graphed engine (the stand-in) that served the first four arrivals as each alone;
    (engine, its graphs with the replays of that run)."""
    arrivals = _arrivals()[:4]
    alone_engine = make_engine(pair[0], spec=spec, prefill_interleave_tokens=0)
    expected = {}
    for _, rid, prompt, params in arrivals:
        expected.update(drive(alone_engine, [(0, rid, prompt, params)]))
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=spec, prefill_interleave_tokens=BUDGET)
    graphs.replays.clear()
    assert drive(engine, arrivals) == expected
    return engine, graphs


def test_an_ngram_drafter_replays_the_wrap_and_extends_its_table_eagerly(pair, make_engine, monkeypatch):
    """A drafter without a draft model has no draft-extend in the mixed graphs: the wrap's last
    graph is the decode step's second half (its token table written), the chunks' after_prefill
    runs after the graphs; the outputs equal each request alone."""
    engine, graphs = _graphed_equals_alone(pair, make_engine, monkeypatch, SpecConfig(algorithm="ngram", **CHAIN))
    worker, n = engine.core.worker, engine.metrics.num_mixed_steps
    assert _mixed_replays(graphs, worker) == n > 0 and _wrap_replays(graphs, worker) == 3 * n
    assert _mixed_replays(graphs, worker, part=1) == 0
    assert_no_leaks(engine)


def test_tree_verify_rows_stay_eager(pair, make_engine, monkeypatch):
    engine, graphs = _graphed_equals_alone(pair, make_engine, monkeypatch, _spec(pair, TREE))
    worker = engine.core.worker
    assert engine.metrics.num_mixed_steps > 0 and _mixed_replays(graphs, worker) == 0
    assert not worker.mixed_wrap_graphs and _wrap_replays(graphs, worker) == 0


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


class _HostWork(TorchDispatchMode):
    """The ops the host dispatches, and the model forwards it runs, outside graph replays (the
    CPU stand-in runs a replay's parts eagerly: on a GPU a replay is one launch)."""

    in_replay = False

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.forwards = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not _HostWork.in_replay
        return func(*args, **(kwargs or {}))


def _count_host_work(engine, graphs, monkeypatch) -> list:
    """Run every launched forward inline under a _HostWork, appended to the list returned."""
    counted, replay, core = [], graphs.replay, engine.core

    def replay_uncounted(self, captured, part):
        _HostWork.in_replay = True
        try:
            return replay(self, captured, part)
        finally:
            _HostWork.in_replay = False

    def launch(fn):
        with _HostWork() as work:
            counted.append(work)
            core.ctx._run(fn, (0.0, 0.0))

    for runner in (core.runner, core.draft_runner):
        def forward(*args, forward=runner.forward, **kwargs):
            counted[-1].forwards += not _HostWork.in_replay
            return forward(*args, **kwargs)

        monkeypatch.setattr(runner, "forward", forward)
    monkeypatch.setattr(graphs, "replay", replay_uncounted)
    monkeypatch.setattr(core.ctx, "launch", launch)
    return counted


def test_a_graphed_chain_mixed_step_runs_no_model_outside_its_replays(pair, make_engine, monkeypatch):
    """The draft, the accept and the draft-extends of a chain mixed step replay graphs around its
    forward's: no target or draft forward runs outside a replay, and the host dispatches a
    quarter of the ops it does with the wrap eager (85 and 536 ops here; a graphed decode
    step 10)."""
    engine, graphs = graphed_engine(make_engine, monkeypatch, pair[0], spec=_spec(pair, CHAIN),
                                    enable_overlap=False, prefill_interleave_tokens=BUDGET)
    for i, prompt in enumerate(random_prompts(3, seed=161, min_len=5, max_len=10)):
        engine.add_request(f"d{i}", prompt, _greedy(60))
    for _ in range(6):
        engine.step()
    counted = _count_host_work(engine, graphs, monkeypatch)

    def mixed_step(rid: str):
        mixed = engine.metrics.num_mixed_steps
        engine.add_request(rid, random_prompts(1, seed=162, min_len=20, max_len=20)[0], _greedy(1))
        counted.clear()
        engine.step()
        assert engine.metrics.num_mixed_steps == mixed + 1 and len(counted) == 1
        return counted[0]

    graphed = mixed_step("graphed")
    monkeypatch.setattr(engine.core.worker, "mixed_wrap_graphs", {})  # the wrap eager (as before)
    eager = mixed_step("eager")
    assert graphed.forwards == 0 < eager.forwards
    assert 4 * graphed.ops < eager.ops
    engine.abort("d0"), engine.abort("d1"), engine.abort("d2")
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


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
    # The draft-extend's inputs: the rows' emitted tokens, then the chunk's shifted ids; each
    # row's state from its last accepted node, the chunk's (it samples nothing: row 0) from its
    # last token; the other entries stash into row 0 from token T - 1, over an earlier replay's.
    static.draft_ids.fill_(99), static.stash_rows.fill_(99), static.stash_index.fill_(99)
    load_mixed_draft(static, [t(11, 12, 13, 14), t(41, 42, 43)], t(2, 3, 0), t(1, 2, 6))
    assert static.draft_ids.tolist()[:8] == [11, 12, 13, 14, 41, 42, 43, 0] and not static.draft_ids[7:].any()
    assert static.stash_rows.tolist() == [2, 3, 0] + [0] * 13
    assert static.stash_index.tolist() == [1, 2, 6] + [63] * 13


# --- on a GPU: the captured graphs ------------------------------------------------------------
def _count_replays(engine) -> list:
    """Every replay of the engine's mixed graphs ("mixed") and their speculative wrap's
    ("wrap") from now on, with the part replayed."""
    worker, replays = engine.core.worker, []
    for kind, graphs in (("mixed", worker.mixed_graphs), *(("wrap", g) for g in worker.mixed_wrap_graphs.values())):
        def counted(captured, part, kind=kind, replay=graphs.replay):
            replays.append((kind, part))
            return replay(captured, part)

        graphs.replay = counted
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
    n = engine.metrics.num_mixed_steps
    assert replays.count(("mixed", 0)) == n > 0
    # Chain: the draft-extend part, and the wrap's three graphs, every mixed step.
    assert replays.count(("mixed", 1)) == (n if shape else 0)
    assert sum(kind == "wrap" for kind, _ in replays) == (3 * n if shape else 0)


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
    assert ("wrap", 2) in replays and ("mixed", 1) in replays and engine.metrics.num_mixed_steps > 0
    engine.abort("long")
    while engine.has_unfinished():
        engine.step()
