"""GPU checks (run on an H100/H200 with `pytest -m gpu`): parity across backends, graphs and
loops, and no blocking host sync inside steady-state speculative steps on the GPU-only path."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_predictable_pair, random_prompts, steady_state_steps

from specserve.engine import SamplingParams, SpecConfig

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=4, topk=4, num_draft_tokens=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, seed=21, max_len=50)


@pytest.mark.parametrize("backend,graphs", [("torch", False), ("triton", False), ("triton", True)])
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_greedy_matches_transformers(tiny_model, make_engine, prompts, backend, graphs, overlap):
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_new_tokens)
    engine = make_engine(tiny_model, device="cuda", attention_backend=backend, cuda_graph=graphs,
                         enable_overlap=overlap)
    assert engine.core.uses_cuda_graphs == graphs
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected


@pytest.mark.parametrize("shape", [None, CHAIN], ids=["plain", "chain"])
def test_gpu_future_map_kernel_without_debug_checks(pair, make_engine, prompts, shape,
                                                    monkeypatch):
    """Without SPECSERVE_DEBUG_FUTURE_MAP (as served) the sentinels resolve in one Triton
    kernel: the overlap loop gives the tokens of the normal loop."""
    target, head = pair
    plain = make_engine(target, device="cuda", attention_backend="torch", cuda_graph=False,
                        enable_overlap=False)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling=GREEDY)]
    monkeypatch.setenv("SPECSERVE_DEBUG_FUTURE_MAP", "0")
    spec = None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)
    engine = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=True,
                         enable_overlap=True, spec=spec)
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("backend,graphs", [("torch", False), ("triton", False), ("triton", True)])
@pytest.mark.parametrize("needs_cpu", [False, True])
def test_gpu_spec_matches_plain(pair, make_engine, prompts, shape, backend, graphs, needs_cpu):
    target, head = pair
    plain = make_engine(target, device="cuda", attention_backend="torch", cuda_graph=False)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling=GREEDY)]
    engine = make_engine(target, device="cuda", attention_backend=backend, cuda_graph=graphs,
                         needs_cpu_seq_lens=needs_cpu,
                         spec=SpecConfig(algorithm="eagle", draft_model=head, **shape))
    outs = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert engine.metrics.mean_accept_length > 1.5


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_tree_kernels_draft_and_accept_as_the_torch_code(pair, make_engine, prompts, shape, graphs, monkeypatch):
    """The tree's Triton kernels (accept walk, draft step growth) against the torch code they
    replace on CUDA, in the engine: same outputs and the same verify steps per request (a
    kernel that drafted or accepted differently would change the acceptance, not the tokens)."""
    from specserve.engine.spec import tree_kernels

    def run():
        engine = make_engine(pair[0], device="cuda", attention_backend="triton", cuda_graph=graphs,
                             spec=SpecConfig(algorithm="eagle", draft_model=pair[1], **shape))
        outs = engine.generate(prompt_token_ids=prompts, sampling=GREEDY)
        return [(o.token_ids, o.num_verify_steps) for o in outs]

    with_kernels = run()
    monkeypatch.setattr(tree_kernels, "use_kernel", lambda t: False)
    assert with_kernels == run()


@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_only_path_has_no_blocking_sync(pair, make_engine, graphs):
    target, head = pair
    spec = SpecConfig(algorithm="eagle", draft_model=head, **CHAIN)
    engine = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=graphs, spec=spec)
    assert not engine.core.needs_cpu_seq_lens
    steady_state_steps(engine, [5, 6, 7, 8])
    synced = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=graphs, spec=spec,
                         needs_cpu_seq_lens=True)
    with pytest.raises(RuntimeError, match="synchroniz"):
        steady_state_steps(synced, [5, 6, 7, 8])


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_gpu_spec_matches_plain_at_8k(tmp_path_factory, make_engine, shape):
    """8k-token prompts: verify and draft-extend run split over the prefix (16 splits of 512),
    under CUDA graphs, and still emit exactly plain decoding's tokens."""
    target, head = make_predictable_pair(str(tmp_path_factory.mktemp("pair8k")), max_position=8448)
    prompts = random_prompts(2, seed=22, min_len=8000, max_len=8100)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", attention_backend="triton", max_context_len=8300, max_running_requests=4)
    plain = make_engine(target, **common)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling=params)]
    engine = make_engine(target, spec=SpecConfig(algorithm="eagle", draft_model=head, **shape), **common)
    assert engine.core.uses_cuda_graphs
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == expected
    assert engine.metrics.mean_accept_length > 1.5


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_prefix_cache_matches_uncached(pair, make_engine, shape, graphs):
    """Shared prefixes of many lengths, repeats and multi-turn continuations on the Triton
    backend (graphs on and off): the same tokens with the prefix cache as without."""
    target, head = pair
    base = random_prompts(1, seed=31, min_len=300, max_len=300)[0]
    tails = random_prompts(8, seed=32, max_len=20)
    first = [base[:k] + t for k, t in zip([0, 1, 17, 64, 150, 255, 299, 300], tails)]
    spec = None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)
    outs = {}
    for cached in (False, True):
        engine = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=graphs,
                             spec=spec, enable_prefix_cache=cached)
        answers = [o.token_ids for o in engine.generate(prompt_token_ids=first, sampling=GREEDY)]
        second = first[:3] + [p + a + [7] for p, a in zip(first[3:], answers[3:])]
        results = engine.generate(prompt_token_ids=second, sampling=GREEDY)
        outs[cached] = answers + [o.token_ids for o in results]
        if cached:
            assert all(o.cached_tokens >= len(p) - 1 for o, p in zip(results[:3], first[:3]))
    assert outs[True] == outs[False]
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_sampling_fields_match_plain(pair, make_engine, prompts, shape, overlap):
    """E17 on the GPU: penalties, logit_bias, top_logprobs, prompt logprobs and n > 1 under
    speculation (eager steps with per-token rules beside graphed greedy ones) equal plain
    decoding's tokens and log-probabilities."""
    target, head = pair
    params = [SamplingParams(max_new_tokens=30, temperature=0.0, presence_penalty=1.0, ignore_eos=True),
              SamplingParams(max_new_tokens=30, temperature=0.8, seed=3, frequency_penalty=0.7,
                             logit_bias={7: 3.0}, logprobs=True, top_logprobs=5, ignore_eos=True),
              SamplingParams(max_new_tokens=30, temperature=0.7, seed=8, n=3, prompt_logprobs=2,
                             repetition_penalty=1.1, ignore_eos=True),
              GREEDY]
    batch = prompts[:4]
    plain = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=False,
                        enable_overlap=overlap).generate(prompt_token_ids=batch, sampling=params)
    engine = make_engine(target, device="cuda", attention_backend="triton", enable_overlap=overlap,
                         spec=SpecConfig(algorithm="eagle", draft_model=head, **shape))
    assert engine.core.uses_cuda_graphs
    outs = engine.generate(prompt_token_ids=batch, sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for s, p in zip(outs, plain):
        if p.logprobs is not None:
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=2e-3, rtol=2e-3)
        if p.prompt_logprobs is not None:
            torch.testing.assert_close(torch.tensor(s.prompt_logprobs), torch.tensor(p.prompt_logprobs),
                                       atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_gpu_mixed_steps_match_each_request_alone(pair, make_engine, prompts, shape, graphs):
    """Requests arriving while others decode ride in their steps (runtime/mixed_step.py) on the
    Triton backend, between graphed decode steps; outputs equal each request run alone."""
    from helpers import drive

    target, head = pair
    spec = None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)
    arrivals = [(2 * i, f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:6])]
    alone = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=graphs, spec=spec,
                        prefill_interleave_tokens=0)
    expected = {}
    for _, rid, prompt, params in arrivals:
        expected.update(drive(alone, [(0, rid, prompt, params)]))
    engine = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=graphs, spec=spec,
                         prefill_interleave_tokens=64, mixed_steps=True)
    assert drive(engine, arrivals) == expected
    assert engine.metrics.num_mixed_steps > 0


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_gpu_mixed_steps_have_no_blocking_sync(pair, make_engine, shape):
    """A long request decodes while short prompts arrive and ride in its steps: no blocking
    host sync in those steps on the GPU-only path (CUDA's sync debug mode raises on one)."""
    target, head = pair
    spec = SpecConfig(algorithm="eagle", draft_model=head, **shape)
    engine = make_engine(target, device="cuda", attention_backend="triton", cuda_graph=True, spec=spec,
                         mixed_steps=True)
    assert not engine.core.needs_cpu_seq_lens
    engine.add_request("long", [5, 6, 7, 8], SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(12):
            if i % 3 == 0:
                engine.add_request(f"a{i}", list(range(10, 40)),
                                   SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.metrics.num_mixed_steps > 0
    engine.abort("long")
    while engine.has_unfinished():
        engine.step()
