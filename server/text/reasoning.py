"""Reasoning output (`--reasoning-parser`): a reasoning model's thinking, written between
<think> and </think>, goes to the chat API's `reasoning_content` and the rest to `content`.

Two parsers, as in SGLang and vLLM: "deepseek-r1", whose chat template opens the <think> block
in the prompt (so the output starts inside it, and a <think> the model writes anyway is
dropped), and "qwen3", whose model writes <think> itself (output that does not start with it
has no reasoning). Text arrives in pieces (stream chunks), so a piece that may be the start of
a tag is held back until the next one settles it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("deepseek-r1", "qwen3")


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


def check_reasoning_parser(name: Optional[str]) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}")


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One choice's text, split into reasoning and content as it arrives."""

    def __init__(self, parser: str):
        check_reasoning_parser(parser)
        # None: not known yet whether the output opens with <think> (qwen3).
        self._in_reasoning: Optional[bool] = True if parser == "deepseek-r1" else None
        self._started = False     # deepseek-r1: a leading <think> was looked for
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        text = self._held + text
        self._held = ""
        reasoning = content = ""
        while text:
            if self._in_reasoning is None or (self._in_reasoning and not self._started):
                stripped = text.lstrip()
                if THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
                    self._held = text   # may still become <think>
                    break
                self._started = True
                if stripped.startswith(THINK_START):
                    self._in_reasoning = True
                    text = stripped[len(THINK_START):]
                    continue
                if self._in_reasoning is None:
                    self._in_reasoning = False
                continue
            if not self._in_reasoning:
                content += text
                break
            end = text.find(THINK_END)
            if end >= 0:
                reasoning += text[:end]
                self._in_reasoning = False
                text = text[end + len(THINK_END):]
                continue
            hold = _held_prefix(text, THINK_END)
            reasoning += text[:len(text) - hold]
            self._held = text[len(text) - hold:]
            break
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        """The text held back at the end of the output."""
        held, self._held = self._held, ""
        if self._in_reasoning is None or not self._in_reasoning:
            return ReasoningDelta("", held)
        return ReasoningDelta(held, "")
