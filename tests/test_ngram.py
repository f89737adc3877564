"""N-gram (prompt lookup) drafting: the proposer against a reference on token tensors, and the
engine's output exactly plain decoding's (both loops, graphs, grammars, n > 1, retraction)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from helpers import (copying_prompts, graphed_engine, make_predictable_pair, plain_copying_reference, random_prompts,
                     run_aborting, steady_state_steps)

from specserve.engine import GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.spec.ngram import propose

NGRAM = SpecConfig(algorithm="ngram", num_steps=3, num_draft_tokens=4)
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


def _reference(seq: list[int], num: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by hand: for n from max_n down to min_n, the latest earlier occurrence of
    the last n tokens that ends before the last token; drafts continue from it, repeating the
    stretch up to the end. No match: the last token repeated."""
    last = len(seq) - 1
    for n in range(min(max_n, last), min_n - 1, -1):
        suffix = seq[last - n + 1:]
        for j in range(last - 1, n - 2, -1):
            if seq[j - n + 1:j + 1] == suffix:
                stretch = seq[j + 1:]
                return [stretch[t % len(stretch)] for t in range(num)]
    return [seq[last]] * num


def _propose(seqs: list[list[int]], num: int = 3, min_n: int = 1, max_n: int = 4, width: int = 24) -> list:
    tokens = torch.full((len(seqs), width), 7)  # past each length: tokens that must not be read
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = torch.tensor(s)
    return propose(tokens, torch.tensor([len(s) for s in seqs]), num, min_n, max_n).tolist()


def test_copies_what_followed_the_suffix():
    assert _propose([[1, 2, 3, 4, 9, 1, 2, 3]]) == [[4, 9, 1]]


def test_longest_match_wins_then_latest():
    # "6 7 8" occurs at the start (a 3-token match); "7 8" alone later (2 tokens).
    assert _propose([[6, 7, 8, 1, 9, 7, 8, 2, 6, 7, 8]]) == [[1, 9, 7]]
    # "3" twice, equally long: the later one; the stretch after it is repeated past the end.
    assert _propose([[3, 1, 3, 2, 3]], num=4) == [[2, 3, 2, 3]]


def test_long_repeats_draft_their_period():
    assert _propose([[5] * 9]) == [[5, 5, 5]]
    assert _propose([[4, 8, 4, 8, 4, 8, 4]], num=5) == [[8, 4, 8, 4, 8]]


def test_no_match_repeats_the_last_token():
    assert _propose([[1, 2, 3, 4]]) == [[4, 4, 4]]
    # "3" occurs earlier, but a match must be at least min_n = 2 tokens ("2 3" does not recur).
    assert _propose([[3, 1, 3, 2, 3]], min_n=2) == [[3, 3, 3]]
    # The shortest sequence: the bonus token after one prompt token.
    assert _propose([[9, 9]]) == [[9, 9, 9]] and _propose([[9, 6]]) == [[6, 6, 6]]


def test_match_at_the_end_and_past_the_length():
    # The suffix itself is no match; the padding past the length (7s) is never read.
    assert _propose([[7, 1, 7]]) == [[1, 7, 1]]
    assert _propose([[2, 7, 7]], width=3) == [[7, 7, 7]]


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (1, 1), (3, 5)])
def test_batch_matches_the_reference(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        seqs = [[rng.randrange(4) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
        expected = [_reference(s, 5, min_n, max_n) for s in seqs]
        assert _propose(seqs, num=5, min_n=min_n, max_n=max_n, width=32) == expected


# --- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A target whose greedy output soon cycles (its next token mostly follows from the current
    one), so what it generates repeats what it generated: copies get accepted."""
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))[0]


@pytest.fixture(scope="module")
def reference(target):
    return plain_copying_reference(target)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [dict(num_steps=3, num_draft_tokens=4), dict(num_steps=5, num_draft_tokens=6),
                                   dict(num_steps=1, num_draft_tokens=2)], ids=["d4", "d6", "d2"])
def test_greedy_equals_plain_decoding_and_copies_are_accepted(target, reference, make_engine, overlap, shape):
    prompts, params, expected = reference
    engine = make_engine(target, spec=SpecConfig(algorithm="ngram", **shape), enable_overlap=overlap)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == expected
    assert engine.core.draft_runner is None
    # Drafts copied from outputs that cycle are accepted.
    assert sum(o.num_accepted_drafts for o in outs) > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cycle_is_copied_whole(target, reference, make_engine, overlap):
    """A prompt that ends in the cycle the target's greedy output settled into (a prompt and
    its plain decoding): the continuation is in the prompt, so every draft is the target's own
    token and each step emits num_draft_tokens tokens."""
    plain_engine = make_engine(target)
    first = reference[0][0]
    prompt = first + plain_engine.generate(prompt_token_ids=[first], sampling=GREEDY)[0].token_ids
    plain = plain_engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)[0].token_ids
    cycle = prompt[-6:]
    assert cycle[:3] == cycle[3:] and len(set(cycle)) > 1 and plain == (cycle * 7)[:40]
    engine = make_engine(target, spec=NGRAM, enable_overlap=overlap)
    out = engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)[0]
    assert out.token_ids == plain
    # 40 tokens: the prefill's and 39 from ten steps that accept all 3 drafts (the last step's
    # output is cut at max_new_tokens).
    assert out.num_verify_steps == 10 and out.num_accepted_drafts == 3 * 10


def test_captured_steps_equal_eager(target, reference, make_engine, monkeypatch):
    """The CUDA-graph path (the CPU stand-in: each bucket's parts eagerly over padded static
    inputs) drafts from the same table: same outputs, and its steps were replayed."""
    prompts, params, expected = reference
    engine, graphs = graphed_engine(make_engine, monkeypatch, target, spec=NGRAM)
    assert engine.core.worker.extend_graphs is None  # the drafter's extends stay eager
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert any(g is engine.core.worker.graphs for g, _, _ in graphs.replays)


def test_seeded_sampling_and_n_sequences_equal_plain_decoding(target, make_engine):
    prompts = copying_prompts()[:3] + copying_prompts()[-2:]
    params = [SamplingParams(max_new_tokens=30, temperature=t, top_p=p, seed=100 + i, n=n, ignore_eos=True)
              for i, (t, p, n) in enumerate([(0.8, 1.0, 1), (1.0, 0.9, 3), (0.6, 1.0, 2), (0.0, 1.0, 2),
                                             (0.7, 0.95, 1)])]
    plain = make_engine(target).generate(prompt_token_ids=prompts, sampling=params)
    ngram = make_engine(target, spec=NGRAM).generate(prompt_token_ids=prompts, sampling=params)
    assert len(ngram) == sum(p.n for p in params) == 9  # one output per sequence
    assert [(o.index, o.token_ids) for o in ngram] == [(o.index, o.token_ids) for o in plain]


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_and_abort(target, reference, make_engine, overlap):
    """Retracted requests are prefilled again over prompt + outputs: the drafter's table is
    rewritten from them, so drafts and output continue as before."""
    prompts = reference[0][:8]
    expected = [o.token_ids for o in make_engine(target).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    engine = make_engine(target, spec=NGRAM, enable_overlap=overlap, max_total_tokens=260)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    engine.add_request("gone", prompts[0], GREEDY)
    outs, reasons = run_aborting(engine, "gone", abort_at_step=4)
    assert reasons.pop("gone") == "abort"
    assert engine.metrics.num_retractions > 0
    assert {rid: outs[rid] for rid in reasons} == {str(i): expected[i] for i in range(len(prompts))}


@pytest.mark.parametrize("algorithm", ["ngram", "suffix"])
@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_requests_equal_plain_decoding(target, make_engine, overlap, algorithm):
    """The grammar process masks the verify tree (copied drafts are not masked): constrained
    and unconstrained requests in one batch decode as plain decoding does (twice: the second
    time suffix drafting finds the first's outputs in its corpus)."""
    prompts = copying_prompts()[:6]
    params = [SamplingParams(max_new_tokens=24, temperature=0.0,
                             grammar=GrammarSpec("json_object") if i % 2 else
                             GrammarSpec("regex", r"(ab|c){3,12}x") if i % 3 == 0 else None)
              for i in range(len(prompts))]
    expected = [o.token_ids for o in make_engine(target).generate(prompt_token_ids=prompts, sampling=params)]
    engine = make_engine(target, spec=dataclasses.replace(NGRAM, algorithm=algorithm), enable_overlap=overlap)
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected


@pytest.mark.parametrize("kwargs,field", [
    (dict(draft_model="/some/head"), "spec.draft_model"),
    (dict(topk=2, num_steps=3, num_draft_tokens=6), "spec.topk"),
    (dict(ngram_min=0), "spec.ngram_min"),
    (dict(ngram_min=3, ngram_max=2), "spec.ngram_max"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SpecConfig(algorithm="ngram", **kwargs)


def test_cli_takes_ngram_without_a_draft_model():
    from specserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--speculative-algorithm", "ngram",
                                      "--speculative-num-steps", "5", "--speculative-ngram-max", "3"])
    assert engine_config_from_args(args).spec == SpecConfig(algorithm="ngram", num_steps=5, num_draft_tokens=6,
                                                            ngram_max=3)


def test_server_speculates_with_ngram_and_reports_it_by_method(target):
    """`serve --speculative-algorithm ngram`: no draft model, greedy output unchanged, and the
    metrics by method."""
    from server_harness import ServerProcess, assert_spec_method_metrics, free_port
    from specserve.engine import Engine, EngineConfig

    prompt = "abcabcabc def abcabc"
    with Engine(EngineConfig(model=target, device="cpu", dtype="float32", spec=None)) as engine:
        expected = engine.generate(prompts=[prompt], sampling=GREEDY)[0].token_ids
    port = free_port()
    server = ServerProcess(target, "--speculative-algorithm", "ngram", "--metrics-port", str(port), speculative=True)
    try:
        with server.client() as client:
            info = client.model_info()
            assert (info.spec.algorithm, info.spec.num_draft_tokens, info.spec.draft_model) == ("ngram", 4, "")
            out = client.generate(prompt, max_new_tokens=40, temperature=0, ignore_eos=True)
            assert out.token_ids == expected and out.spec.accepted_drafts > 0
        assert_spec_method_metrics(f"http://127.0.0.1:{port}/metrics", "ngram", [out], draft_depth=3)
    finally:
        assert server.stop() == 0


# --- GPU (pytest -m gpu) ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_ngram_matches_plain_without_blocking_sync(target, reference, make_engine, graphs):
    prompts, params, expected = reference
    common = dict(device="cuda", attention_backend="triton", max_running_requests=16)
    engine = make_engine(target, cuda_graph=graphs, spec=NGRAM, **common)
    assert not engine.core.needs_cpu_seq_lens and engine.core.uses_cuda_graphs == graphs
    assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert engine.metrics.mean_accept_length > 1.1
    steady_state_steps(engine, [5, 6, 7, 8])
