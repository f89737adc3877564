"""Suffix drafting across requests: the corpus lookup against a reference on token tensors (an
empty corpus, a match only there, the ring's wrap, record ends, longest then own then latest),
drafts copied from an earlier request's output, and the engine's output exactly plain
decoding's (both loops, graphs, grammars, seeded sampling, n > 1, retraction, abort)."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import (blocking_syncs_fail, copying_prompts, graphed_engine, make_tiny_checkpoint,
                     plain_copying_reference, random_prompts, run_aborting)

from specserve.engine import SamplingParams, SpecConfig
from specserve.engine.runtime.device import CpuDeviceContext
from specserve.engine.spec.ngram import propose
from specserve.engine.spec.suffix import SENTINEL, SuffixCorpus, propose_across

SUFFIX = SpecConfig(algorithm="suffix", num_steps=3, num_draft_tokens=4)
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


# --- the lookup ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx():
    ctx = CpuDeviceContext(torch.device("cpu"))
    yield ctx
    ctx.close()


def _settled(ctx) -> None:
    """Wait for what was launched on the forward stream (the corpus's copies among it)."""
    done = ctx.new_event()
    ctx.launch(done.record)
    done.synchronize()


def _corpus(ctx, records: list[list[int]], size: int = 64, max_n: int = 4) -> SuffixCorpus:
    """A corpus holding `records`, appended in order."""
    corpus = SuffixCorpus(size, max_n, ctx)
    for record in records:
        corpus.append(record)
    _settled(ctx)
    return corpus


def _propose(seqs: list[list[int]], corpus: SuffixCorpus, num: int = 3, min_n: int = 1, max_n: int = 4,
             width: int = 24) -> list:
    tokens = torch.full((len(seqs), width), 7)  # past each length: tokens that must not be read
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = torch.tensor(s)
    return propose_across(tokens, torch.tensor([len(s) for s in seqs]), corpus, num, min_n, max_n).tolist()


def _reference(seq: list[int], records: list[list[int]], num: int, min_n: int, max_n: int) -> list[int]:
    """By hand, for records that fit the ring without wrapping: the longest match in the
    request's own tokens (test_ngram's reference) and the longest in the records laid end to
    end with a sentinel after each (the latest among the longest, and only where a token, not
    a sentinel, follows); the corpus's only if strictly longer. Drafts after a record's end:
    the last token."""
    last = len(seq) - 1
    own_n, drafts = 0, [seq[last]] * num
    for n in range(min(max_n, last), min_n - 1, -1):
        j = next((j for j in range(last - 1, n - 2, -1) if seq[j - n + 1:j + 1] == seq[last - n + 1:]), None)
        if j is not None:
            stretch = seq[j + 1:]
            own_n, drafts = n, [stretch[t % len(stretch)] for t in range(num)]
            break
    flat = [t for r in records for t in r + [SENTINEL]]
    for n in range(min(max_n, last + 1), max(min_n, own_n + 1) - 1, -1):
        ends = [e for e in range(n - 1, len(flat) - 1)
                if flat[e - n + 1:e + 1] == seq[last - n + 1:] and flat[e + 1] != SENTINEL]
        if ends:
            after = (flat + [SENTINEL] * num)[ends[-1] + 1:ends[-1] + 1 + num]
            cut = after.index(SENTINEL) if SENTINEL in after else num
            return after[:cut] + [seq[last]] * (num - cut)
    return drafts


def test_an_empty_corpus_drafts_as_ngram(ctx):
    corpus = _corpus(ctx, [])
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(2, 24))] for _ in range(8)]
    tokens = torch.tensor([s + [7] * (24 - len(s)) for s in seqs])
    lengths = torch.tensor([len(s) for s in seqs])
    assert (propose_across(tokens, lengths, corpus, 3, 1, 4) == propose(tokens, lengths, 3, 1, 4)).all()


def test_a_match_only_in_the_corpus_is_copied(ctx):
    corpus = _corpus(ctx, [[9, 1, 2, 3, 4, 5, 6, 8]])
    assert _propose([[1, 2, 3]], corpus) == [[4, 5, 6]]
    # The first two known tokens (the prompt's one and the bonus) match too.
    assert _propose([[5, 6]], corpus, num=4) == [[8, 6, 6, 6]]  # the record ends after 8


def test_the_longest_wins_a_tie_goes_to_the_own_tokens_then_the_latest(ctx):
    corpus = _corpus(ctx, [[1, 2, 3, 40, 41, 42], [7, 3, 50, 51, 52]])
    # Own: "2 3" (2 tokens) -> 8; corpus: "1 2 3" (3 tokens) -> 40.
    assert _propose([[2, 3, 8, 1, 2, 3]], corpus) == [[40, 41, 42]]
    # Own: "5 2 3" (3 tokens) beats the corpus's "2 3"; a tie ("2 3" in both) goes to the own.
    assert _propose([[5, 2, 3, 6, 5, 2, 3]], corpus) == [[6, 5, 2]]
    assert _propose([[2, 3, 6, 9, 2, 3]], corpus, min_n=2) == [[6, 9, 2]]
    # In the corpus, "3" alone: the later record's.
    assert _propose([[8, 3]], corpus) == [[50, 51, 52]]


def test_a_record_end_is_neither_matched_across_nor_drafted(ctx):
    corpus = _corpus(ctx, [[4, 5, 6], [7, 8, 9]])
    # "6 7" only exists across the sentinel between the records: "7" alone matches.
    assert _propose([[6, 7]], corpus) == [[8, 9, 7]]
    # A match with nothing after it ("8 9", the record's last tokens) is not taken: the own
    # shorter one ("9") is.
    assert _propose([[9, 3, 8, 9]], corpus) == [[3, 8, 9]]
    # Unwritten space (sentinels) never matches, however short the sequence.
    assert _propose([[3, 3]], _corpus(ctx, [])) == [[3, 3, 3]]


def test_a_match_across_the_rings_wrap(ctx):
    # Ring of 12: the first record takes 0..8 (with its sentinel); the second 9, 10, 11, then
    # 0..3, overwriting the first's start.
    corpus = _corpus(ctx, [[20, 21, 22, 23, 24, 25, 26, 27], [1, 2, 3, 4, 5, 6]], size=12)
    assert corpus.tokens.tolist() == [4, 5, 6, SENTINEL, 24, 25, 26, 27, SENTINEL, 1, 2, 3]
    assert int(corpus.head) == 4
    assert _propose([[9, 2, 3]], corpus) == [[4, 5, 6]]       # the copy wraps
    assert _propose([[9, 3, 4]], corpus) == [[5, 6, 4]]       # the match wraps; then the record ends
    assert _propose([[9, 20, 21]], corpus) == [[21, 21, 21]]  # overwritten: no match
    assert _propose([[9, 24, 25]], corpus) == [[26, 27, 25]]  # the first record's surviving tail
    # A record longer than the ring keeps its last size - 1 tokens.
    long = _corpus(ctx, [list(range(100, 120))], size=12)
    assert long.tokens.tolist() == list(range(109, 120)) + [SENTINEL] and int(long.head) == 0


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (1, 1)])
def test_batch_matches_the_reference(ctx, min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(12):
        records = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(rng.randrange(0, 5))]
        corpus = _corpus(ctx, records, max_n=max_n)
        seqs = [[rng.randrange(5) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
        expected = [_reference(s, records, 5, min_n, max_n) for s in seqs]
        assert _propose(seqs, corpus, num=5, min_n=min_n, max_n=max_n, width=24) == expected


# --- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Random weights: greedy outputs that rarely repeat themselves, so what gets accepted is
    mostly what the corpus supplies."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("target")), seed=3)


@pytest.fixture(scope="module")
def reference(target):
    return plain_copying_reference(target)


def _answer_without_repeats() -> list[int]:
    """A prompt whose greedy answer (40 tokens) falls into no cycle: its own tokens give few
    accepted drafts."""
    return random_prompts(3, seed=5, min_len=8, max_len=16)[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_repeated_request_drafts_from_the_earlier_output(target, make_engine, overlap):
    """The first request drafts from its own tokens only; once it finished, its prompt's tail
    and output are in the corpus, and a second request with the same prompt (the same greedy
    answer) gets every draft accepted: D tokens a verify step."""
    prompt = _answer_without_repeats()
    engine = make_engine(target, spec=SUFFIX, enable_overlap=overlap)
    first = engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)[0]
    assert first.num_accepted_drafts < first.num_verify_steps  # its own tokens rarely repeat
    corpus = engine.core.worker.drafter.corpus
    _settled(engine.core.ctx)
    record = prompt[-3:] + first.token_ids + [SENTINEL]
    assert corpus.tokens[:len(record)].tolist() == record and int(corpus.head) == len(record)
    second = engine.generate(prompt_token_ids=[prompt], sampling=GREEDY)[0]
    assert second.token_ids == first.token_ids
    # 40 tokens: the prefill's and 39 from ten steps that accept all 3 drafts (the last
    # step's output is cut at max_new_tokens).
    assert (second.num_verify_steps, second.num_accepted_drafts) == (10, 30)


def _assert_exact_and_drafting_from_the_first_pass(engine, prompts, params, expected) -> None:
    """The batch twice on one engine: plain decoding's tokens both times, and more drafts
    accepted the second time (the first pass's outputs are in the corpus)."""
    accepted = []
    for _ in range(2):
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
        assert [o.token_ids for o in outs] == expected
        accepted.append(sum(o.num_accepted_drafts for o in outs))
    assert accepted[1] > accepted[0]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [dict(num_steps=3, num_draft_tokens=4), dict(num_steps=1, num_draft_tokens=2)],
                         ids=["d4", "d2"])
def test_greedy_equals_plain_decoding_as_the_corpus_fills(target, reference, make_engine, overlap, shape):
    """The batch twice on one engine: the first time the corpus fills while requests decode,
    the second time it holds every answer."""
    prompts, params, expected = reference
    engine = make_engine(target, spec=SpecConfig(algorithm="suffix", **shape), enable_overlap=overlap)
    assert engine.core.draft_runner is None
    _assert_exact_and_drafting_from_the_first_pass(engine, prompts, params, expected)


def test_overlap_under_random_forward_delays(target, reference, make_engine, monkeypatch):
    """Seeded sleeps around every launch on the forward stream (forwards and the corpus's
    copies) reorder host and device progress in the overlap loop: outputs unchanged, and the
    second pass still drafts from the first's outputs."""
    prompts, params, expected = reference
    monkeypatch.setenv("SPECSERVE_FORWARD_DELAY", "5:3")
    engine = make_engine(target, spec=SUFFIX, enable_overlap=True)
    _assert_exact_and_drafting_from_the_first_pass(engine, prompts, params, expected)


def test_captured_steps_equal_eager(target, reference, make_engine, monkeypatch):
    """The CUDA-graph path (the CPU stand-in: each bucket's parts eagerly over padded static
    inputs) reads the same ring: same outputs, and its steps were replayed."""
    prompts, params, expected = reference
    engine, graphs = graphed_engine(make_engine, monkeypatch, target, spec=SUFFIX)
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling=params)] == expected
    assert any(g is engine.core.worker.graphs for g, _, _ in graphs.replays)


def test_seeded_sampling_and_n_sequences_equal_plain_decoding(target, make_engine):
    prompts = copying_prompts()[:3] + copying_prompts()[-2:]
    params = [SamplingParams(max_new_tokens=[30, 12][i % 2], temperature=t, top_p=p, seed=100 + i, n=n,
                             ignore_eos=True)
              for i, (t, p, n) in enumerate([(0.8, 1.0, 1), (1.0, 0.9, 3), (0.6, 1.0, 2), (0.0, 1.0, 2),
                                             (0.7, 0.95, 1)])]
    plain = [(o.index, o.token_ids) for o in make_engine(target).generate(prompt_token_ids=prompts, sampling=params)]
    engine = make_engine(target, spec=SUFFIX)
    for _ in range(2):  # the second time with every sequence's output in the corpus
        outs = engine.generate(prompt_token_ids=prompts, sampling=params)
        assert len(outs) == sum(p.n for p in params) == 9  # one output per sequence
        assert [(o.index, o.token_ids) for o in outs] == plain


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_and_abort(target, reference, make_engine, overlap):
    """Retracted requests are prefilled again (their table rows rewritten); an aborted one
    hands the corpus what it generated: outputs unchanged, every slot free."""
    prompts = reference[0][:8]
    expected = [o.token_ids for o in make_engine(target).generate(prompt_token_ids=prompts, sampling=GREEDY)]
    engine = make_engine(target, spec=SUFFIX, enable_overlap=overlap, max_total_tokens=260)
    engine.add_request("gone", prompts[0], GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    outs, reasons = run_aborting(engine, "gone", abort_at_step=4)
    assert reasons.pop("gone") == "abort"
    assert engine.metrics.num_retractions > 0
    assert {rid: outs[rid] for rid in reasons} == {str(i): expected[i] for i in range(len(prompts))}
    _settled(engine.core.ctx)
    prompt_of = {"gone": prompts[0], **{str(i): p for i, p in enumerate(prompts)}}
    records = [min(3, len(prompt_of[rid])) + len(out) + 1 for rid, out in outs.items() if out]
    assert int(engine.core.worker.drafter.corpus.head) == sum(records)  # the aborted one's too


# --- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    (dict(draft_model="/some/head"), "spec.draft_model"),
    (dict(topk=2, num_steps=3, num_draft_tokens=6), "spec.topk"),
    (dict(suffix_corpus_tokens=7), "spec.suffix_corpus_tokens"),     # < ngram_max + num_draft_tokens
    (dict(suffix_corpus_tokens="big"), "spec.suffix_corpus_tokens"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SpecConfig(algorithm="suffix", **kwargs)


def test_a_corpus_size_without_suffix_drafting_is_refused():
    with pytest.raises(ValueError, match=r"^spec.suffix_corpus_tokens: only suffix drafting"):
        SpecConfig(algorithm="ngram", suffix_corpus_tokens=1024)


def _cli_spec(*flags: str):
    from specserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *flags])
    return engine_config_from_args(args).spec


def test_cli_takes_suffix_without_a_draft_model():
    assert _cli_spec("--speculative-algorithm", "suffix", "--speculative-num-steps", "5",
                     "--speculative-suffix-corpus-tokens", "4096") == SpecConfig(
        algorithm="suffix", num_steps=5, num_draft_tokens=6, suffix_corpus_tokens=4096)


@pytest.mark.parametrize("flags,flag", [
    (["--speculative-suffix-corpus-tokens", "7"], "--speculative-suffix-corpus-tokens"),
    (["--speculative-suffix-corpus-tokens", "-1"], "--speculative-suffix-corpus-tokens"),
    (["--draft-model", "/some/head"], "--draft-model"),
])
def test_cli_errors_name_the_flag(flags, flag):
    with pytest.raises(ValueError, match=rf"^{flag} \(spec\.\w+\): "):
        _cli_spec("--speculative-algorithm", "suffix", *flags)
    with pytest.raises(ValueError, match=r"^--speculative-suffix-corpus-tokens \(spec.suffix_corpus_tokens\): only"):
        _cli_spec("--speculative-algorithm", "ngram", "--speculative-suffix-corpus-tokens", "4096")


def test_server_speculates_with_suffix_and_reports_it_by_method(target):
    """`serve --speculative-algorithm suffix`: no draft model; a repeated request's greedy
    output is unchanged and drafted from the first's; the metrics by method."""
    from server_harness import ServerProcess, assert_spec_method_metrics, free_port

    prompt = _answer_without_repeats()
    port = free_port()
    server = ServerProcess(target, "--speculative-algorithm", "suffix", "--speculative-suffix-corpus-tokens", "1024",
                           "--metrics-port", str(port), speculative=True)
    try:
        with server.client() as client:
            info = client.model_info()
            assert (info.spec.algorithm, info.spec.num_draft_tokens, info.spec.draft_model) == ("suffix", 4, "")
            outs = [client.generate(prompt_token_ids=prompt, max_new_tokens=40, temperature=0, ignore_eos=True)
                    for _ in range(2)]
            assert outs[1].token_ids == outs[0].token_ids
            assert outs[1].spec.accepted_drafts == 30 > outs[0].spec.accepted_drafts
        assert_spec_method_metrics(f"http://127.0.0.1:{port}/metrics", "suffix", outs, draft_depth=3)
    finally:
        assert server.stop() == 0


# --- GPU (pytest -m gpu) ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_suffix_matches_plain_without_blocking_sync(target, reference, make_engine, graphs):
    """Exact against plain decoding with the corpus filling and then full, on the device (and
    inside CUDA graphs), the corpus's drafts accepted, and steady-state steps (one ending and
    entering the corpus meanwhile) without a blocking host sync."""
    prompts, params, expected = reference
    common = dict(device="cuda", attention_backend="triton", max_running_requests=16)
    engine = make_engine(target, cuda_graph=graphs, spec=SUFFIX, **common)
    assert not engine.core.needs_cpu_seq_lens and engine.core.uses_cuda_graphs == graphs
    _assert_exact_and_drafting_from_the_first_pass(engine, prompts, params, expected)
    _no_blocking_sync_while_a_request_ends(engine, prompts[0])


def _no_blocking_sync_while_a_request_ends(engine, prompt: list[int]) -> None:
    """Steps past the start (helpers.steady_state_steps) with a blocking host sync an error,
    during which a request ends, its output copied into the ring, and a few steps after."""
    engine.add_request("long", prompt, SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True))
    engine.add_request("ends", random_prompts(1, seed=11, min_len=8, max_len=8)[0],
                       SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefills and the first iterations (allocation, first graph use)
        engine.step()
    ended = False
    try:
        with blocking_syncs_fail():
            for _ in range(60):
                ended = any(out.rid == "ends" and out.finished for out in engine.step())
                if ended:
                    break
            for _ in range(3):
                engine.step()
    finally:
        engine.abort("long")
        engine.step()
    assert ended
