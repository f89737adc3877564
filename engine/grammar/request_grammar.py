"""One sequence's grammar state: an xgrammar matcher at the tokens the sequence has committed,
and the masks for tokens it may generate next, at the current state or after a draft path.

Paths are walked on the matcher and rolled back, so its state only ever moves by committed
tokens (`advance`): a speculative step's rejected drafts never touch it. With a reasoning gate
(`GrammarSpec.after_token_id`) the grammar starts after the first end-of-thinking token; the
gate is part of the state a path walks through."""
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

    # --- compilation ----------------------------------------------------------------------
    @property
    def future(self) -> Future:
        return self._compiled

    @property
    def ready(self) -> bool:
        """Compiled (or failed to): the request may be scheduled."""
        return self._compiled.done()

    @property
    def error(self) -> Optional[BaseException]:
        return self._compiled.exception() if self._compiled.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result(),
                                               override_stop_tokens=self._stop_ids)
        return self._matcher

    # --- committed state ---------------------------------------------------------------------
    def advance(self, tokens: Sequence[int]) -> None:
        """Commit generated tokens. A token the grammar refuses means a mask was not applied:
        an engine bug, never a model's choice, so it raises."""
        for token in tokens:
            if not self._gate_open:
                self._gate_open = token == self._after
            elif not self.matcher.accept_token(token):
                raise RuntimeError(f"structured output: token {token} is outside the grammar "
                                   f"(the mask was not applied)")

    @property
    def is_terminated(self) -> bool:
        return self._gate_open and self.matcher.is_terminated()

    # --- masks -------------------------------------------------------------------------------
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of a host int32 bitmask: the tokens allowed next."""
        if self._gate_open and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = ALL_ALLOWED

    def fill_path_mask(self, bitmask: torch.Tensor, row: int, path: Sequence[int]) -> None:
        """Row `row`: the tokens allowed after the committed tokens and then `path` (a draft
        path). A path the grammar refuses is never accepted (its first refused token is not the
        target's choice, which the mask keeps inside the grammar), so its row allows every
        token: any mask would do, and an empty one would make the sampler's softmax NaN."""
        gate, walked, ok = self._gate_open, 0, True
        for token in path:
            if not gate:
                gate = token == self._after
                continue
            # A terminated matcher (past a stop token) takes nothing more.
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                ok = False
                break
            walked += 1
        if not ok or not gate or self.matcher.is_terminated():
            bitmask[row] = ALL_ALLOWED
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        if walked:
            self.matcher.rollback(walked)
