"""The constrained rows of one launched step, as the grammar process (process.py) masks them.

Rows without a grammar (unconstrained requests, padding of a captured bucket) get all-allowed
rows. The masks of one request are memoised by path until its matcher moves (RequestGrammar.memo):
the verify tree's nodes are paths the draft steps masked already, and the next step's committed
mask is filled right after the accepted tokens arrive, while the device runs the draft-extend.

Node layout of `path_masks`: per request, candidates 0..C-1 with a token each and a parent
candidate (-1: the root, i.e. the committed tokens); a mask is asked for candidate c (the state
after the tokens on its path, itself included) or for -1 (the committed state).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specserve.engine.grammar.request_grammar import ALL_ALLOWED, RequestGrammar


class GrammarBatch:
    def __init__(self, grammars: Sequence[Optional[RequestGrammar]]):
        self.grammars = [g if g is not None and g.usable else None for g in grammars]

    def next_token_masks(self, out: torch.Tensor) -> None:
        """out [rows, W]: each request's allowed next tokens (rows past the batch allow all)."""
        out.fill_(ALL_ALLOWED)
        for b, g in enumerate(self.grammars):
            if g is not None:
                g.fill_tree_masks(out, {-1: b}, (), ())

    def path_masks(self, out: torch.Tensor, tokens: list, parents: list, which: list) -> None:
        """out [rows * M, W]: for each request b and each of its M asked candidates which[b][m],
        the tokens allowed after that candidate's path (row b * M + m)."""
        out.fill_(ALL_ALLOWED)
        M = len(which[0]) if which else 0
        for b, g in enumerate(self.grammars):
            if g is not None:
                g.fill_tree_masks(out, {node: b * M + m for m, node in enumerate(which[b])},
                                  tokens[b], parents[b])

    @staticmethod
    def tree_paths(tree_tokens: list, tree_parents: list) -> tuple[list, list, list]:
        """A verify tree per request (node 0 the root, the last committed token; node i masked
        with the state after its draft ancestors and itself) as path_masks' (tokens, parents,
        which): node i > 0 is candidate i - 1, its parent node p candidate p - 1."""
        D = len(tree_tokens[0]) if tree_tokens else 0
        return ([t[1:] for t in tree_tokens], [[p - 1 for p in ps[1:]] for ps in tree_parents],
                [list(range(-1, D - 1))] * len(tree_tokens))
