"""Log-probabilities as the API returns them: token ids with their text, decoded one by one."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from specserve.engine.outputs import TopLogprobs
from specserve.proto import generate_pb2 as pb


class TokenTexts:
    """Each token decoded on its own ("" without a tokenizer), cached: top_logprobs name up to
    20 tokens per generated position, mostly the same few."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) if self._tokenizer is not None else ""
            self._cache[token_id] = text
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        """A whole sequence's text ("" without a tokenizer)."""
        return self._tokenizer.decode(list(token_ids)) if self._tokenizer is not None else ""

    def token(self, token_id: int, logprob: float) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=token_id, logprob=logprob, text=self(token_id))

    def top(self, candidates: TopLogprobs) -> pb.TopLogprobs:
        return pb.TopLogprobs(candidates=[self.token(t, lp) for t, lp in candidates])

    def prompt(self, prompt_ids: Sequence[int], logprobs: Sequence[float],
               tops: Optional[Sequence[TopLogprobs]]) -> list[pb.PromptTokenLogprob]:
        """Every prompt token: the first alone, then with its log-probability (and the
        alternatives, when asked for); `logprobs` and `tops` are of tokens 1.. ."""
        out = [pb.PromptTokenLogprob(token_id=prompt_ids[0], text=self(prompt_ids[0]))]
        for i, (token_id, logprob) in enumerate(zip(prompt_ids[1:], logprobs)):
            out.append(pb.PromptTokenLogprob(
                token_id=token_id, text=self(token_id), logprob=logprob,
                top=[self.token(t, lp) for t, lp in tops[i]] if tops else []))
        return out
