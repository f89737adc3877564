"""One sequence's grammar state: an xgrammar matcher at the tokens the sequence has committed,
and the masks for tokens it may generate next, at the current state or after a draft path.

Draft trees are walked on the matcher and rolled back, so its state only ever moves by committed
tokens (`advance`): a speculative step's rejected drafts never touch it. With a reasoning gate
(`GrammarSpec.after_token_id`) the grammar starts after the first end-of-thinking token; the
gate is part of the state a path walks through.

Lives in the grammar process (process.py): the engine's scheduler never touches a matcher.
A matcher error (a committed token the grammar refuses) fails the request: `failed` holds why,
and its rows allow every token from then on (the engine ends the request)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Optional, Sequence

import torch

ALL_ALLOWED = -1  # an int32 word with every bit set


class RequestGrammar:
    def __init__(self, compiled: Future, stop_ids: Sequence[int], after_token_id: Optional[int]):
        self._compiled = compiled
        self._stop_ids = sorted(stop_ids)
        self._after = after_token_id
        self._gate_open = after_token_id is None   # the grammar applies (reasoning ended)
        self._matcher = None
        self.failed: Optional[str] = None
        # Masks by path from the committed state (path () is the committed mask), until the
        # matcher moves: a step's verify reuses its draft steps', the next step its committed one.
        self.memo: dict = {}

    # --- compilation ----------------------------------------------------------------------
    @property
    def future(self) -> Future:
        return self._compiled

    @property
    def usable(self) -> bool:
        """Compiled, and no matcher error: its masks apply."""
        return self._compiled.done() and self._compiled.exception() is None and self.failed is None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result(),
                                               override_stop_tokens=self._stop_ids)
        return self._matcher

    # --- committed state ---------------------------------------------------------------------
    def advance(self, tokens: Sequence[int]) -> None:
        """Commit generated tokens. Tokens after the grammar ended (its stop token) are ignored:
        the engine stops the request there. A token the grammar refuses means a mask was not
        applied: an engine bug, never a model's choice, so it raises."""
        if tokens:
            self.memo.clear()
        for token in tokens:
            if self._gate_open and self.matcher.is_terminated():
                return
            if not self._gate_open:
                self._gate_open = token == self._after
            elif not self.matcher.accept_token(token):
                raise RuntimeError(f"structured output: token {token} is outside the grammar "
                                   f"(the mask was not applied)")

    # --- masks -------------------------------------------------------------------------------
    def fill_tree_masks(self, bitmask: torch.Tensor, rows: dict[int, int], tokens: Sequence[int],
                        parents: Sequence[int]) -> None:
        """Masks of several nodes of one draft tree: row rows[c] of `bitmask` gets the tokens
        allowed after candidate c's path (c = -1: the committed state). Candidates are walked
        depth first, each token accepted once on the way down and rolled back on the way up, so
        a path shared by several nodes is walked once (the same masks as walking each path on
        its own). Masks are memoised by path (`memo`): a fill costs more than a walk."""
        memo = self.memo
        children: dict[int, list[int]] = {}
        for c, p in enumerate(parents):
            children.setdefault(p, []).append(c)
        if -1 in rows:
            self._fill_memo(bitmask, rows[-1], (), self._gate_open, memo)
        # (candidate, gate open before it). A candidate the grammar refuses ends its subtree,
        # whose rows stay all-allowed (the caller's default): such a path is never accepted (its
        # first refused token is not the target's choice, which the mask keeps inside the
        # grammar), so any mask would do, and an empty one would make the softmax NaN.
        stack = [(c, self._gate_open) for c in reversed(children.get(-1, ()))]
        path: list[int] = []      # the tokens of the current path
        walked: list[bool] = []   # per token of it: did the matcher take it (not the reasoning)
        depth_of = {-1: 0}
        while stack:
            c, gate = stack.pop()
            depth = depth_of[parents[c]] + 1
            while len(walked) >= depth:   # climb back to c's parent
                path.pop()
                if walked.pop():
                    self.matcher.rollback(1)
            token = tokens[c]
            if not gate:
                walked.append(False)
                gate = token == self._after
            elif self.matcher.is_terminated() or not self.matcher.accept_token(token):
                continue
            else:
                walked.append(True)
            path.append(token)
            depth_of[c] = depth
            if c in rows:
                self._fill_memo(bitmask, rows[c], tuple(path), gate, memo)
            stack.extend((child, gate) for child in reversed(children.get(c, ())))
        rolled = sum(walked)
        if rolled:
            self.matcher.rollback(rolled)

    def _fill_memo(self, bitmask: torch.Tensor, row: int, path: tuple, gate: bool, memo: dict) -> None:
        """Row `row`: the mask at the matcher's current state (reached by `path`)."""
        known = memo.get(path)
        if known is not None:
            bitmask[row] = known
        elif gate and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
            memo[path] = bitmask[row].clone()
        else:
            bitmask[row] = ALL_ALLOWED
