"""Streamed text: incremental detokenization and stop-string matching (no server needed)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import VOCAB
from specserve.server.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from specserve.server.text.stop_strings import StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from specserve.engine.tokenizer import Tokenizer

    return Tokenizer(tiny_model, [2])


def _split(items, cuts):
    bounds = sorted({0, len(items), *(c % (len(items) + 1) for c in cuts)})
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_deltas_concatenate_to_the_full_decode(tokenizer, ids, cuts):
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(piece) for piece in _split(ids, cuts)]
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas)
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(ids)


@pytest.mark.parametrize("text", ["✓日本語", "ü€𝄞", "a✓b"])
def test_a_multibyte_character_is_never_split(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The case under test: some tokens hold only part of a character's bytes.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([t]) for t in ids] + [detokenizer.flush()]
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc✓", max_size=30),
       stops=st.lists(st.text(alphabet="abc✓", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_strings_cut_before_the_first_completed_match(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    released, matched = "", None
    for piece in _split(text, cuts):
        out, matched = matcher.feed(piece)
        released += out
        if matched is not None:
            break
    if matched is None:
        released += matcher.flush()
        assert released == text
        assert not any(stop in text for stop in stops)
    else:
        assert matched in stops
        assert text.startswith(released + matched)
    assert not any(stop in released for stop in stops)


def test_text_that_may_start_a_stop_string_is_held_back():
    matcher = StopStringMatcher(["\n\n", "END"])
    assert matcher.feed("hello E") == ("hello ", None)
    assert matcher.feed("N") == ("", None)
    assert matcher.feed("x\n") == ("ENx", None)
    assert matcher.feed("\nmore") == ("", "\n\n")


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.lists(st.text(alphabet="ab✓\n", max_size=4), max_size=4), max_size=8),
       stops=st.lists(st.text(alphabet="ab✓\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_feeding_a_step_at_once_releases_what_feeding_each_piece_does(pieces, stops):
    """feed_all (one engine step's deltas) against feed of each delta: the same text released
    and held while no stop string completes; None and nothing fed when one does."""
    together, one_by_one = StopStringMatcher(stops), StopStringMatcher(stops)
    for step in pieces:
        held = together.held
        released = together.feed_all(step)
        outs = [one_by_one.feed(piece) for piece in step]
        matched = [m for _, m in outs if m is not None]
        if released is None:
            assert matched  # a stop string does complete in this step
            assert together.held == held  # nothing was fed
            return
        assert not matched
        assert released == "".join(text for text, _ in outs)
        assert together.held == one_by_one.held
