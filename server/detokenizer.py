"""Incremental detokenization that never ends a text delta inside a UTF-8 character."""
from __future__ import annotations

# What a byte-level decoder yields for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas whose concatenation is decode(all ids).

    Only a short window is decoded per call: `prefix_offset` marks tokens kept as left context
    (some decoders drop a leading space when a token is decoded alone), `read_offset` the tokens
    whose text was already emitted. Text ending in U+FFFD may be the first bytes of a character
    that the next token completes, so it is held back until then (or until `flush`).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = tokenizer.decode  # bound once: this runs twice per streamed token
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly "")."""
        self.token_ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """The text still held back, for the end of the stream."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(prefix_text) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return text[len(prefix_text):]
