"""The constrained rows of one launched batch, and the bitmasks its forward applies.

Built by the scheduler only for a batch with a constrained request (`GrammarBatch.of` is None
otherwise, and nothing below runs). Rows without a grammar get all-ones rows. Masks are made on
the host from the matchers and copied to the device; reading draft tokens for them is a host
sync, which is why a constrained batch runs without overlap (scheduler.py).

Node layout of `path_masks`: per request, candidates 0..C-1 with a token each and a parent
candidate (-1: the root, i.e. the committed tokens); a mask is asked for candidate c (the state
after the tokens on its path, itself included) or for -1 (the committed state).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specserve.engine.grammar.bitmask import bitmask_width
from specserve.engine.grammar.request_grammar import ALL_ALLOWED, RequestGrammar


class GrammarBatch:
    def __init__(self, grammars: Sequence[Optional[RequestGrammar]], vocab_size: int, device):
        self.grammars = list(grammars)
        self.width = bitmask_width(vocab_size)
        self.device = torch.device(device)
        # Per request, the masks made during this step by path (drafts, then the verify).
        self._memos: list[dict] = [{} for _ in self.grammars]

    @staticmethod
    def of(grammars: Sequence[Optional[RequestGrammar]], vocab_size: int,
           device) -> Optional["GrammarBatch"]:
        return GrammarBatch(grammars, vocab_size, device) if any(g is not None for g in grammars) else None

    def _host(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.width), ALL_ALLOWED, dtype=torch.int32)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def next_token_masks(self) -> torch.Tensor:
        """[bs, W] on the device: each request's allowed next tokens (schedule side)."""
        host = self._host(len(self.grammars))
        for b, g in enumerate(self.grammars):
            if g is not None:
                g.fill_tree_masks(host, {-1: b}, (), (), self._memos[b])
        return self._to_device(host)

    def path_masks(self, tokens: torch.Tensor, parents: torch.Tensor,
                   which: torch.Tensor) -> torch.Tensor:
        """[bs * M, W] on the device: for each request b and each of its M asked candidates
        which[b, m], the tokens allowed after that candidate's path. Reads the (device) tree on
        the host."""
        tokens, parents, which = tokens.tolist(), parents.tolist(), which.tolist()
        M = len(which[0]) if which else 0
        host = self._host(len(self.grammars) * M)
        for b, g in enumerate(self.grammars):
            if g is not None:
                g.fill_tree_masks(host, {node: b * M + m for m, node in enumerate(which[b])},
                                  tokens[b], parents[b], self._memos[b])
        return self._to_device(host)

    def tree_masks(self, tree_tokens: torch.Tensor, tree_parents: torch.Tensor) -> torch.Tensor:
        """[bs * D, W]: the verify masks of a draft tree (node 0 the root, the last committed
        token; node i the state after its draft ancestors and itself)."""
        bs, D = tree_tokens.shape
        which = torch.arange(-1, D - 1).expand(bs, D)
        # Node i > 0 is candidate i - 1; its parent node p is candidate p - 1 (-1: the root).
        return self.path_masks(tree_tokens[:, 1:], tree_parents[:, 1:] - 1, which)

