"""The radix prefix cache: the tree itself, exact outputs and KV with it (plain, chain, tree;
both loops; both host-length paths), eviction under a tiny pool with retraction and aborts,
admission order, flush and the switch, and two tensor-parallel ranks."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import VOCAB, assert_slot_accounting, cached_prefix_slots, make_predictable_pair

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.kvcache.pools import TokenSlotAllocator
from specserve.engine.kvcache.radix_cache import RadixCache

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
MODES = {"plain": None, "chain": CHAIN, "tree": TREE}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


# --- the tree alone -------------------------------------------------------------------------
def _cache(num_slots: int = 64, pair_keys: bool = False):
    allocator = TokenSlotAllocator(num_slots, torch.device("cpu"))
    return allocator, RadixCache(allocator, pair_keys=pair_keys)


def test_match_splits_pins_and_releases():
    allocator, cache = _cache()
    slots = allocator.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], slots) == (0, 6)
    assert cache.size == cache.evictable_size == 6
    assert cache.peek([1, 2, 3, 9]) == (3, 3)          # 3 cached, all unpinned
    match = cache.acquire([1, 2, 3, 9])
    assert match.length == 3 and torch.equal(match.slots, slots[:3])
    assert cache.evictable_size == 3 and cache.peek([1, 2, 3]) == (3, 0)  # pinned now: free to share
    # A branch at the split keeps the tree's slots for the shared part.
    branch = torch.cat([slots[:3], allocator.alloc(3)])
    assert cache.insert([1, 2, 3, 9, 8, 7], branch) == (3, 6)
    assert cache.size == 9 and cache.evictable_size == 6
    cache.release(match)
    assert cache.evictable_size == cache.size == 9
    assert all(ref == 0 for ref in cache.refs().values())
    assert cache.peek([7]) == (0, 0) and cache.acquire([7]).length == 0


def test_eviction_takes_least_recently_used_unpinned_leaves_first():
    allocator, cache = _cache(num_slots=20)
    a, b, c = (allocator.alloc(4) for _ in range(3))
    cache.insert([1, 1, 1, 1], a)
    cache.insert([2, 2, 2, 2], b)
    cache.insert([3, 3, 3, 3], c)
    pinned = cache.acquire([1, 1, 1, 1])   # oldest, but pinned
    cache.release(cache.acquire([2, 2, 2, 2]))  # touches b: c is now the least recently used
    free_before = allocator.num_free
    assert cache.evict(1) == 4             # whole leaves
    assert cache.peek([3, 3, 3, 3]).length == 0 and cache.peek([2, 2, 2, 2]).length == 4
    assert allocator.num_free == free_before + 4
    # A node split by a match keeps its tail's old use time: the untouched tail goes first.
    cache.release(cache.acquire([2, 2]))
    assert cache.evict(1) == 2 and cache.peek([2, 2, 2, 2]).length == 2
    assert cache.evict(100) == 2           # a stays: it is pinned
    assert cache.peek([1, 1, 1, 1]).length == 4 and cache.size == 4 and cache.evictable_size == 0
    cache.release(pinned)
    assert cache.flush() == 4 and cache.size == 0 and cache.num_evicted == 12
    assert allocator.num_free == 20


def test_pair_keys_cover_a_position_only_with_its_next_token():
    _, cache = _cache(pair_keys=True)
    assert cache.keys([5, 6, 7], 3) == [(5 << 32) | 6, (6 << 32) | 7]  # the last has no next
    assert cache.keys([5, 6, 7], 1) == [(5 << 32) | 6]
    _, plain = _cache()
    assert plain.keys([5, 6, 7], 2) == [5, 6]


def test_grow_pins_a_running_requests_prompt_unless_another_cached_it_first():
    allocator, cache = _cache()
    match = cache.acquire([1, 2, 3])                     # nothing cached: an empty prefix
    own = allocator.alloc(5)
    grown = cache.grow(match, [1, 2, 3, 4, 5], own)
    assert grown.length == 5 and torch.equal(grown.slots, own) and cache.evictable_size == 0
    assert cache.grow(grown, [1, 2, 3], own) is grown  # nothing new
    # Another request, admitted on the 5 cached keys, computed 3 more; meanwhile a third
    # cached a longer path with its own slots: growing would mix slots, so nothing changes.
    other = cache.acquire([1, 2, 3, 4, 5, 6])
    tail = allocator.alloc(3)
    cache.insert([1, 2, 3, 4, 5, 6, 7], torch.cat([own, allocator.alloc(2)]))
    assert cache.grow(other, [1, 2, 3, 4, 5, 6, 7, 8], torch.cat([own, tail])) is other
    cache.release(other)
    cache.release(grown)
    assert all(ref == 0 for ref in cache.refs().values()) and cache.evictable_size == cache.size == 7


def test_reference_counts_never_go_negative():
    allocator, cache = _cache()
    cache.insert([1, 2], allocator.alloc(2))
    match = cache.acquire([1, 2])
    cache.release(match)
    with pytest.raises(AssertionError, match="below zero"):
        cache.release(match)


# --- engines --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def plain_reference(pair):
    """Greedy outputs of plain decoding without the cache, memoised per prompt."""
    from specserve.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=pair[0], device="cpu", dtype="float32", spec=None,
                                 enable_prefix_cache=False, enable_overlap=False))
    memo = {}

    def outputs(prompts, params):
        todo = [(p, s) for p, s in zip(prompts, params) if (tuple(p), s) not in memo]
        if todo:
            for (p, s), out in zip(todo, engine.generate(prompt_token_ids=[p for p, _ in todo],
                                                         sampling=[s for _, s in todo])):
                memo[(tuple(p), s)] = out.token_ids
        return [memo[(tuple(p), s)] for p, s in zip(prompts, params)]

    yield outputs
    engine.shutdown()


def _spec(pair, shape):
    return None if shape is None else SpecConfig(algorithm="eagle", draft_model=pair[1], **shape)


def _run(engine, prompts, params, *, seed=0, aborts=(), check_every_step=True):
    """Requests arrive over the first steps; `aborts` are (step, index). Returns
    {index: StepOutput-like (tokens, finish_reason, cached_tokens)}."""
    rng = random.Random(seed)
    arrivals = sorted((rng.randrange(0, 5), i) for i in range(len(prompts)))
    tokens, results, step = {}, {}, 0
    while len(results) < len(prompts):
        for arrive, i in arrivals:
            if arrive == step:
                engine.add_request(f"r{i}", prompts[i], params[i])
        for at, i in aborts:
            if at == step and i not in results:
                engine.abort(f"r{i}")
        for out in engine.step():
            i = int(out.rid[1:])
            tokens.setdefault(i, []).extend(out.new_token_ids)
            if out.finished:
                results[i] = (tokens[i], out.finish_reason, out.cached_tokens)
        if check_every_step:
            assert_slot_accounting(engine)
        step += 1
    return results


def _shared_prefix_prompts(seed: int, base_len: int = 40) -> list[list[int]]:
    """Prompts that share a common base up to many lengths (0 to all of it), each with a
    short tail of its own."""
    g = random.Random(seed)
    base = [g.randrange(3, VOCAB) for _ in range(base_len)]
    cuts = [0, 1, 2, 3, 5, 8, 13, 21, 34, base_len - 1, base_len]
    return [base[:k] + [g.randrange(3, VOCAB) for _ in range(g.randrange(1, 5))] for k in cuts]


@pytest.mark.parametrize("needs_cpu", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_outputs_with_the_cache_equal_those_without(pair, plain_reference, make_engine, mode,
                                                           overlap, needs_cpu):
    first = _shared_prefix_prompts(seed=1)
    first_params = [greedy([1, 4, 9][i % 3]) for i in range(len(first))]
    first_out = plain_reference(first, first_params)
    # Second wave: exact repeats (the whole prompt is cached), multi-turn continuations (prompt +
    # answer + a new turn), and new prompts sharing the base.
    second = first[:4] + [p + o + [7, 8, 9][:1 + i % 3] for i, (p, o) in enumerate(zip(first[4:8], first_out[4:8]))] \
        + _shared_prefix_prompts(seed=1)[8:] + _shared_prefix_prompts(seed=2)[:3]
    second_params = [greedy([6, 2, 5][i % 3]) for i in range(len(second))]
    expected = plain_reference(second, second_params)

    engine = make_engine(pair[0], spec=_spec(pair, MODES[mode]), enable_overlap=overlap,
                         needs_cpu_seq_lens=needs_cpu)
    got_first = _run(engine, first, first_params)
    assert [got_first[i][0] for i in range(len(first))] == first_out
    got = _run(engine, second, second_params, seed=1)
    assert [got[i][0] for i in range(len(second))] == expected
    for i in range(4):  # exact repeats: all but the last prompt token come from the cache
        assert got[i][2] == len(second[i]) - 1, (i, got[i][2])
    for i in range(4, 8):  # continuations reuse at least the earlier prompt
        assert got[i][2] >= len(first[i]), (i, got[i][2], len(first[i]))
    cache = engine.core.scheduler.slots.cache
    assert cache.num_hit > 0 and engine.load().prefix_cache_hit_rate > 0
    if MODES[mode] is not None:
        assert engine.metrics.mean_accept_length > 1.3  # really speculating


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_kv_of_a_cache_hit_equals_a_fresh_prefill(pair, make_engine, mode, chunk):
    """Target and draft KV of every cached position (some written by decode steps: verify and
    draft-extend) equal a fresh engine's prefill of the same tokens."""
    g = random.Random(7)
    prompt = [g.randrange(3, VOCAB) for _ in range(20)]
    spec = _spec(pair, MODES[mode])
    warm = make_engine(pair[0], spec=spec, chunked_prefill_size=chunk)
    answer = warm.generate(prompt_token_ids=[prompt], sampling=greedy(12))[0].token_ids
    follow_up = prompt + answer + [5, 6, 7]
    hit = warm.generate(prompt_token_ids=[follow_up], sampling=greedy(1))[0]
    assert hit.cached_tokens >= len(prompt) + len(answer) - 2
    fresh = make_engine(pair[0], spec=spec, chunked_prefill_size=chunk)
    assert fresh.generate(prompt_token_ids=[follow_up], sampling=greedy(1))[0].cached_tokens == 0

    pools = []
    for engine in (warm, fresh):
        slots = cached_prefix_slots(engine, follow_up)
        runners = [engine.core.runner] + ([engine.core.draft_runner] if spec else [])
        pools.append([(r.kv_pool.k_all[:, slots], r.kv_pool.v_all[:, slots]) for r in runners])
    for (k_hit, v_hit), (k_new, v_new) in zip(*pools):
        torch.testing.assert_close(k_hit, k_new, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v_hit, v_new, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_eviction_under_a_tiny_pool_with_retraction_and_aborts(pair, plain_reference, make_engine, mode,
                                                               overlap):
    prompts = _shared_prefix_prompts(seed=3, base_len=30) + _shared_prefix_prompts(seed=4, base_len=30)[5:]
    params = [greedy([14, 3, 20, 8][i % 4]) for i in range(len(prompts))]
    expected = plain_reference(prompts, params)
    engine = make_engine(pair[0], spec=_spec(pair, MODES[mode]), enable_overlap=overlap,
                         max_total_tokens=120, chunked_prefill_size=16)
    aborts = [(6, 2), (11, 9), (15, 12)]
    got = _run(engine, prompts, params, aborts=aborts)
    for i, (tokens, reason, _) in got.items():
        if reason == "abort":
            assert tokens == expected[i][:len(tokens)]
        else:
            assert tokens == expected[i], i
    assert any(reason == "abort" for _, reason, _ in got.values())
    # A second round over the same prompts hits what survived.
    again = _run(engine, prompts[:6], params[:6], seed=5)
    assert [again[i][0] for i in range(6)] == expected[:6]
    cache = engine.core.scheduler.slots.cache
    assert cache.num_evicted > 0 and engine.metrics.num_retractions > 0
    assert cache.num_hit > 0


def test_longest_cached_prefix_is_admitted_first_without_starving_others(pair, make_engine, monkeypatch):
    from specserve.engine.scheduler import policy

    g = random.Random(11)
    shared = [g.randrange(3, VOCAB) for _ in range(30)]
    engine = make_engine(pair[0], max_running_requests=1, enable_overlap=False)
    engine.generate(prompt_token_ids=[shared], sampling=greedy(1))

    def finish_order(prompts):
        for i, p in enumerate(prompts):
            engine.add_request(f"q{i}", p, greedy(2))
        order = []
        while engine.has_unfinished():
            order += [out.rid for out in engine.step() if out.finished]
        return order

    other = [g.randrange(3, VOCAB) for _ in range(12)]
    hits = [shared[:25] + [3 + i] for i in range(2)]
    assert finish_order([other] + hits) == ["q1", "q2", "q0"]
    monkeypatch.setattr(policy, "MAX_BYPASS", 1)
    assert finish_order([other] + [shared[:24] + [9 + i] for i in range(2)]) == ["q1", "q0", "q2"]


@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_a_running_requests_prompt_is_shared_before_it_finishes(pair, plain_reference, make_engine, mode):
    g = random.Random(13)
    prompt = [g.randrange(3, VOCAB) for _ in range(30)]
    engine = make_engine(pair[0], spec=_spec(pair, MODES[mode]))
    engine.add_request("long", prompt, greedy(40))
    outs = {}
    while not outs:
        for out in engine.step():
            outs.setdefault(out.rid, []).extend(out.new_token_ids)
    later = prompt[:20] + [5, 6]
    engine.add_request("later", later, greedy(5))
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.rid == "later" and out.finished:
                assert out.cached_tokens == 20 - (MODES[mode] is not None)  # pair keys: 19
                assert ("long", 0) in engine.core.scheduler.reqs  # still running
        assert_slot_accounting(engine)
    assert [outs["long"], outs["later"]] == plain_reference([prompt, later], [greedy(40), greedy(5)])


def test_flush_frees_what_no_running_request_pins(pair, make_engine):
    g = random.Random(5)
    prompt = [g.randrange(3, VOCAB) for _ in range(24)]
    engine = make_engine(pair[0], enable_overlap=True)
    engine.generate(prompt_token_ids=[prompt, prompt[:10] + [4, 4]], sampling=greedy(5))
    cache, allocator = engine.core.scheduler.slots.cache, engine.core.allocator
    assert engine.load().kv_cached_tokens == cache.size > 0 and engine.load().kv_used_tokens == 0
    engine.flush_prefix_cache()
    assert cache.size == 0 and allocator.num_free == allocator.num_slots
    assert engine.generate(prompt_token_ids=[prompt], sampling=greedy(1))[0].cached_tokens == 0
    # While a request runs on a cached prefix, a flush keeps exactly that prefix.
    engine.add_request("runner", prompt + [9], greedy(20))
    while not engine.core.scheduler.policy.running or engine.core.scheduler.policy.running[0].is_prefilling:
        engine.step()
    pinned = engine.core.scheduler.policy.running[0].cached_len
    assert pinned == len(prompt)
    engine.flush_prefix_cache()
    assert cache.size == pinned and cache.evictable_size == 0
    assert_slot_accounting(engine)
    while engine.has_unfinished():
        engine.step()


def test_the_cache_can_be_switched_off(pair, plain_reference, make_engine):
    from specserve.engine import EngineConfig

    prompts = _shared_prefix_prompts(seed=6)
    params = [greedy(3)] * len(prompts)
    engine = make_engine(pair[0], enable_prefix_cache=False)
    assert engine.core.scheduler.slots.cache is None
    outs = engine.generate(prompt_token_ids=prompts + prompts, sampling=params + params)
    assert [o.token_ids for o in outs] == plain_reference(prompts, params) * 2
    assert all(o.cached_tokens == 0 for o in outs)
    load = engine.load()
    assert load.kv_cached_tokens == 0 and load.prefix_cache_hit_rate == 0.0
    engine.flush_prefix_cache()  # nothing to flush: no error
    with pytest.raises(ValueError, match="^enable_prefix_cache: must be True or False"):
        EngineConfig(enable_prefix_cache="no")


@pytest.mark.parametrize("spec,overlap", [(None, True), (CHAIN, False)], ids=["plain-overlap", "chain-normal"])
def test_tp2_makes_the_same_cache_decisions(pair, make_engine, spec, overlap):
    prompts = _shared_prefix_prompts(seed=8, base_len=24)
    params = [greedy(6)] * len(prompts)
    runs = []
    for tp in (1, 2):
        engine = make_engine(pair[0], tp_size=tp, spec=_spec(pair, spec), enable_overlap=overlap,
                             max_total_tokens=90)
        first = engine.generate(prompt_token_ids=prompts, sampling=params)
        second = engine.generate(prompt_token_ids=prompts[::-1], sampling=params)
        engine.flush_prefix_cache()
        third = engine.generate(prompt_token_ids=prompts[:3], sampling=params[:3])
        runs.append([(o.token_ids, o.cached_tokens) for o in first + second + third])
    assert runs[0] == runs[1]
    assert sum(cached for _, cached in runs[1]) > 0


def test_triton_backend_reads_cached_prefixes(pair, plain_reference, make_engine):
    """The Triton kernels (in the interpreter on the CPU: small) over rows that start with
    cached slots, target and draft."""
    pytest.importorskip("triton")
    first = _shared_prefix_prompts(seed=9, base_len=12)[6:8]
    params = [greedy(3)] * len(first)
    engine = make_engine(pair[0], spec=_spec(pair, CHAIN), attention_backend="triton", max_context_len=48)
    answers = [o.token_ids for o in engine.generate(prompt_token_ids=first, sampling=params)]
    second = [p + a + [9] for p, a in zip(first, answers)]
    outs = engine.generate(prompt_token_ids=second, sampling=params)
    assert answers == plain_reference(first, params)
    assert [o.token_ids for o in outs] == plain_reference(second, params)
    assert all(o.cached_tokens >= len(p) for o, p in zip(outs, first))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_n_sequences_share_the_prompt_through_the_cache(pair, make_engine, mode, overlap):
    """n > 1: the first sequence prefills the prompt and caches it; the others map it from the
    cache (one copy, pinned by all) and prefill only the last prompt token."""
    g = random.Random(17)
    prompt = [g.randrange(3, VOCAB) for _ in range(30)]
    engine = make_engine(pair[0], spec=_spec(pair, MODES[mode]), enable_overlap=overlap)
    params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=5, n=4, ignore_eos=True)
    engine.add_request("r", prompt, params)
    seen = set()
    while len(seen) < 4:
        seen |= {out.index for out in engine.step()}
        assert_slot_accounting(engine)
    reqs = [engine.core.scheduler.reqs[("r", i)] for i in range(4)]
    shared = reqs[0].shared
    assert shared.cached and shared.creator is None
    assert all(r.cached_len >= shared.length for r in reqs)
    table = engine.core.req_to_token.table
    assert all(torch.equal(table[r.row, :shared.length], table[reqs[0].row, :shared.length]) for r in reqs)
    cache = engine.core.scheduler.slots.cache
    own = sum(r.kv_allocated_len - r.cached_len for r in reqs)
    held = engine.core.allocator.num_slots - engine.core.allocator.num_free
    assert held == cache.size + own and cache.size < 2 * len(prompt)
    engine.abort("r")
    while engine.has_unfinished():
        engine.step()


def test_prompt_logprobs_are_scored_over_a_cached_prompt(pair, make_engine):
    """A request that scores its prompt computes every prompt row itself, cache or not."""
    g = random.Random(19)
    prompt = [g.randrange(3, VOCAB) for _ in range(16)]
    engine = make_engine(pair[0])
    plain = engine.generate(prompt_token_ids=[prompt], sampling=greedy(3))[0]
    scored = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    first, again = (engine.generate(prompt_token_ids=[prompt], sampling=scored)[0] for _ in range(2))
    assert plain.cached_tokens == 0 and first.cached_tokens == again.cached_tokens == 0
    assert len(first.prompt_logprobs) == len(prompt) - 1
    assert first.prompt_logprobs == again.prompt_logprobs and first.token_ids == plain.token_ids
