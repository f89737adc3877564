"""The batched detokenisation of an engine step (decode_windows: every stream's windows in one
decode_batch) gives exactly the chunks of the per-stream, per-token path, on a byte-level
tokenizer and on a Llama-style one with byte-fallback tokens (both split UTF-8 characters
across tokens) and skipped special tokens, with stop strings and min_new_tokens."""
from __future__ import annotations

import json
import os
import random

import pytest

from helpers import VOCAB
from specserve.engine.config import SamplingParams
from specserve.engine.outputs import StepOutput
from specserve.engine.tokenizer import Tokenizer
from specserve.server.text.detokenizer import IncrementalDetokenizer, PendingTokens, decode_windows
from specserve.server.text.logprobs import TokenTexts
from specserve.server.text.output_stream import OutputStream
from specserve.server.text.validation import ValidatedRequest

WORDS = ["▁hello", "▁world", "▁the", "ing", "▁a", "b", "▁", "▁日本", "語", "✓", "é"]


def _save_byte_fallback_tokenizer(path: str) -> None:
    """A sentencepiece-like BPE (Llama 2's decoder chain): the 256 <0xNN> byte tokens, some
    pieces with ▁ for spaces, and special <s> </s> (skipped when decoding)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({word: 259 + i for i, word in enumerate(WORDS)})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tokenizer_and_vocab(request, tiny_model, tmp_path_factory):
    if request.param == "byte_level":
        return Tokenizer(tiny_model, [2]), VOCAB
    path = str(tmp_path_factory.mktemp("byte_fallback"))
    _save_byte_fallback_tokenizer(path)
    return Tokenizer(path, [2]), 259 + len(WORDS)


class _CountingTokenizer:
    """The tokenizer, counting the windows decoded one Python call at a time."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.single_decodes = 0

    def decode(self, ids):
        self.single_decodes += 1
        return self.tokenizer.decode(ids)

    def decode_batch(self, sequences):
        return self.tokenizer.decode_batch(sequences)


def _random_ids(rng: random.Random, vocab: int) -> list[int]:
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    for _ in range(rng.randrange(3)):  # runs of byte tokens: split multi-byte characters
        at = rng.randrange(len(ids) + 1)
        ids[at:at] = [rng.randrange(vocab) for _ in range(rng.randint(2, 4))]
    return ids


def _engine_steps(rng: random.Random, ids: list[int]) -> list[StepOutput]:
    steps, start = [], 0
    while not (steps and steps[-1].finished):
        # Speculative steps emit several tokens; an output may have none (a finish only).
        size = rng.choice([0, 1, 1, 2, 3, 4])
        piece, start = ids[start:start + size], start + size
        steps.append(StepOutput("r", piece, new_logprobs=[-0.5] * len(piece),
                                finished=start >= len(ids),
                                finish_reason="length" if start >= len(ids) else None,
                                completion_tokens=min(start, len(ids))))
    return steps


def _check_batched_deltas(tokenizer, streams: list[list[int]], rng: random.Random,
                          counting: _CountingTokenizer) -> int:
    """Feed the streams in random engine steps through both paths; the tokens fed."""
    token_texts = TokenTexts(counting)  # shared by the streams, as the server's is
    reference = [IncrementalDetokenizer(tokenizer) for _ in streams]
    batched = [IncrementalDetokenizer(counting, token_texts) for _ in streams]
    at, tokens = [0] * len(streams), 0
    while any(a < len(ids) for a, ids in zip(at, streams)):
        step = {}  # stream -> its tokens of this engine step
        for s, ids in enumerate(streams):
            if at[s] < len(ids) and rng.random() < 0.8:
                step[s] = ids[at[s]:at[s] + rng.randint(0, 4)]  # (0: an output without tokens)
                at[s] += len(step[s])
        decoded = decode_windows([PendingTokens(batched[s], new) for s, new in step.items()])
        for (s, new), windows in zip(step.items(), decoded):
            expected = [reference[s].add([t]) for t in new]
            assert batched[s].add_each(new, windows) == expected, (streams[s], new)
            tokens += len(new)
    for ref, got in zip(reference, batched):
        assert got.flush() == ref.flush()
        assert (got.prefix_offset, got.read_offset) == (ref.prefix_offset, ref.read_offset)
    return tokens


def test_batched_windows_give_the_per_token_deltas(tokenizer_and_vocab):
    """Random ids: many split characters (held-back text moves the windows) and special
    tokens."""
    tokenizer, vocab = tokenizer_and_vocab
    rng = random.Random(1)
    for _ in range(40):
        streams = [_random_ids(rng, vocab) for _ in range(rng.randint(1, 8))]
        _check_batched_deltas(tokenizer, streams, rng, _CountingTokenizer(tokenizer))


def test_text_is_decoded_by_the_batch(tokenizer_and_vocab):
    """On text (the usual case) the batch decodes the windows: a window is decoded on its own
    only after a token that held its text back (a split character: text in a script of
    multi-byte characters is not the usual case), and one-token prefix windows come from the
    shared cache."""
    tokenizer, _ = tokenizer_and_vocab
    rng = random.Random(3)
    lines = ["def add(a, b):", "    return a + b", "hello world", "the ing a b", "import os"]
    streams = [tokenizer.encode(" ".join(rng.choice(lines) for _ in range(6)) + " héllo ✓",
                                add_special_tokens=False) for _ in range(16)]
    counting = _CountingTokenizer(tokenizer)
    tokens = _check_batched_deltas(tokenizer, streams, rng, counting)
    # The per-token path decodes two windows per token.
    assert counting.single_decodes < tokens / 4, (counting.single_decodes, tokens)


def test_batched_steps_stream_the_same_chunks(tokenizer_and_vocab):
    """Whole OutputStreams (stop strings, min_new_tokens, finish) through both paths."""
    tokenizer, vocab = tokenizer_and_vocab
    rng = random.Random(2)
    stopped = 0
    for _ in range(60):
        cases = []
        for _ in range(rng.randint(1, 6)):
            ids = _random_ids(rng, vocab)
            text = tokenizer.decode(ids)
            stops = [text[a:a + rng.randint(1, 3)] for a in
                     (rng.randrange(len(text)) for _ in range(rng.randint(0, 2)))] if text else []
            request = ValidatedRequest([5], SamplingParams(max_new_tokens=len(ids),
                                                           min_new_tokens=rng.randrange(4),
                                                           logprobs=True), tuple(stops))
            cases.append((_engine_steps(rng, ids), OutputStream(tokenizer, request, False),
                          OutputStream(tokenizer, request, False), request))
        for step in range(max(len(case[0]) for case in cases)):
            live = [(steps[step], ref, got) for steps, ref, got, _ in cases
                    if step < len(steps) and not got.finished]
            decoded = decode_windows([PendingTokens(got.detokenizer, out.new_token_ids)
                                      for out, _, got in live])
            for (out, ref, got), windows in zip(live, decoded):
                expected, chunk = ref.on_output(out), got.on_output(out, windows)
                assert (chunk.SerializeToString() if chunk else None) == \
                    (expected.SerializeToString() if expected else None)
                assert got.finished == ref.finished
                stopped += bool(chunk is not None and chunk.finish.matched_stop_str)
        # And the stream's whole output is the one-token-at-a-time stream's (stop strings
        # matched per token, not per step).
        for steps, _, _, request in cases:
            assert _whole(_replay(tokenizer, request, _one_token_steps(steps))) == \
                _whole(_replay(tokenizer, request, steps))
    assert stopped > 20  # stop strings did end streams inside batched steps


def _one_token_steps(steps: list[StepOutput]) -> list[StepOutput]:
    """The same outputs, one token per output (the last keeps the finish)."""
    out, done = [], 0
    for step in steps:
        if not step.new_token_ids:
            out.append(step)
            continue
        for i, token_id in enumerate(step.new_token_ids):
            done += 1
            last = i == len(step.new_token_ids) - 1
            out.append(StepOutput("r", [token_id], new_logprobs=[step.new_logprobs[i]],
                                  finished=step.finished and last,
                                  finish_reason=step.finish_reason if last else None,
                                  completion_tokens=done))
    return out


def _replay(tokenizer, request: ValidatedRequest, steps: list[StepOutput]) -> list:
    stream = OutputStream(tokenizer, request, False)
    return [c for c in (stream.on_output(s) for s in steps if not stream.finished) if c]


def _whole(chunks) -> tuple:
    return ("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
            [x for c in chunks for x in c.logprobs], chunks[-1].finish.SerializeToString())


def test_a_failed_batch_leaves_each_stream_to_decode_on_its_own(tokenizer_and_vocab):
    """An id that is no token id (over 32 bits) fails decode_batch; the good stream still gets
    its text, the bad one fails on its own (as it did before batching)."""
    tokenizer, _ = tokenizer_and_vocab
    good, bad = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
    ids = list(range(3, 9))
    decoded = decode_windows([PendingTokens(good, ids), PendingTokens(bad, [2**40])])
    assert decoded == [None, None]
    assert "".join(good.add_each(ids, decoded[0])) + good.flush() == tokenizer.decode(ids)
    with pytest.raises(OverflowError):
        bad.add_each([2**40], decoded[1])


def test_a_stream_of_another_tokenizer_decodes_on_its_own(tokenizer_and_vocab, tiny_model):
    tokenizer, _ = tokenizer_and_vocab
    other = Tokenizer(tiny_model, [2])  # an equal tokenizer, but another object
    first, second = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(other)
    ids = list(range(3, 9))
    decoded = decode_windows([PendingTokens(first, ids), PendingTokens(second, ids)])
    assert decoded[0] is not None and decoded[1] is None
    assert "".join(first.add_each(ids, decoded[0])) + first.flush() == tokenizer.decode(ids)
    assert "".join(second.add_each(ids, decoded[1])) + second.flush() == other.decode(ids)
