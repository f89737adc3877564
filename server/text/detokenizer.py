"""Incremental detokenization that never ends a text delta inside a UTF-8 character, and its
batched form: one engine step's streams decoded in one call."""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional, Sequence

logger = logging.getLogger("specserve.server.detokenizer")

# What a byte-level decoder yields for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class DecodedWindows(NamedTuple):
    """The full windows that adding some tokens one at a time is expected to decode (one per
    token), decoded beforehand: the window of token j is token_ids[starts[j]:end_j], end_j
    being the length once token j is appended."""

    starts: list[int]
    texts: list[str]


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas whose concatenation is decode(all ids).

    Only a short window is decoded per call: `prefix_offset` marks tokens kept as left context
    (some decoders drop a leading space when a token is decoded alone), `read_offset` the tokens
    whose text was already emitted. Text ending in U+FFFD may be the first bytes of a character
    that the next token completes, so it is held back until then (or until `flush`).
    """

    def __init__(self, tokenizer, token_text: Optional[Callable[[int], str]] = None):
        self.tokenizer = tokenizer
        self._decode = tokenizer.decode  # bound once: this runs for every streamed token
        # decode([id]), best cached and shared by the streams (TokenTexts): the prefix window
        # is mostly one token, the one before the new token.
        self._token_text = token_text or (lambda token_id: tokenizer.decode([token_id]))
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly "")."""
        self.token_ids.extend(token_ids)
        return self._delta(False, None)

    def add_each(self, token_ids: Sequence[int],
                 decoded: Optional[DecodedWindows] = None) -> list[str]:
        """`[add([t]) for t in token_ids]`, taking a token's full window from `decoded` (see
        `likely_windows`) where it is the window that token decodes."""
        deltas = []
        for j, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            text = (decoded.texts[j]
                    if decoded is not None and decoded.starts[j] == self.prefix_offset else None)
            deltas.append(self._delta(False, text))
        return deltas

    def flush(self) -> str:
        """The text still held back, for the end of the stream."""
        return self._delta(True, None)

    def likely_windows(self, new_token_ids: Sequence[int]) -> tuple[list[int], list[list[int]]]:
        """The full windows (their starts and ids) that `add_each(new_token_ids)` decodes if
        each of those tokens completes text, the usual case. A token that holds its text back
        leaves the next window's start where it was; `add_each` then sees the start differ
        and decodes that window itself."""
        new = list(new_token_ids)
        if not new:  # an output without tokens (a finish, prompt logprobs)
            return [], []
        start, read, end = self.prefix_offset, self.read_offset, len(self.token_ids)
        # Token 0 decodes from prefix_offset, token 1 (once token 0 completed text) from
        # read_offset, and every later one from the token before it.
        first = self.token_ids[start:]
        first.append(new[0])
        if len(new) == 1:
            return [start], [first]
        second = self.token_ids[read:]
        second += new[:2]
        return ([start, read, *range(end + 1, end + len(new) - 1)],
                [first, second, *(new[j - 1:j + 1] for j in range(2, len(new)))])

    def _delta(self, final: bool, text: Optional[str]) -> str:
        """`text`: decode(token_ids[prefix_offset:]) when the caller has it."""
        start, read, end = self.prefix_offset, self.read_offset, len(self.token_ids)
        if read - start == 1:
            prefix_text = self._token_text(self.token_ids[start])
        else:
            prefix_text = self._decode(self.token_ids[start:read]) if read > start else ""
        if text is None:
            text = self._decode(self.token_ids[start:])
        if len(text) <= len(prefix_text) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset, self.read_offset = read, end
        return text[len(prefix_text):]


class PendingTokens(NamedTuple):
    """Tokens about to be added to a detokenizer (`add_each`)."""

    detokenizer: IncrementalDetokenizer
    token_ids: Sequence[int]


def decode_windows(pending: Sequence[PendingTokens]) -> list[Optional[DecodedWindows]]:
    """The likely windows of every detokenizer (one engine step's streams), decoded in one
    `decode_batch` of the Rust tokenizer (which runs without the GIL) instead of a Python call
    per window. None for a detokenizer of another tokenizer than the first one's (the streams
    of one engine share one), and for all where the batch fails (an id that is no token id):
    those then decode, and fail, on their own."""
    if not pending:
        return []
    tokenizer = pending[0].detokenizer.tokenizer
    plans: list[Optional[list[int]]] = []
    sequences: list[list[int]] = []
    for detokenizer, token_ids in pending:
        if detokenizer.tokenizer is not tokenizer:
            plans.append(None)
            continue
        starts, windows = detokenizer.likely_windows(token_ids)
        plans.append(starts)
        sequences += windows
    try:
        texts = tokenizer.decode_batch(sequences)
    except Exception:  # noqa: BLE001 - a bad id fails the request that has it, on its own
        logger.debug("decode_batch failed; the streams decode on their own", exc_info=True)
        return [None] * len(pending)
    decoded: list[Optional[DecodedWindows]] = []
    at = 0
    for starts in plans:
        if starts is None:
            decoded.append(None)
            continue
        decoded.append(DecodedWindows(starts, texts[at:at + len(starts)]))
        at += len(starts)
    return decoded
