"""The drafter interface: what a draft method gives the speculative worker (spec/spec_worker.py).

A drafter proposes D - 1 draft nodes per request under the bonus token (spec/tree.py
`DraftNodes`: tokens, and the parent of each); the verifier (spec/verifier.py) checks them
with one target forward and accepts the target's own tokens, so a drafter cannot change what
a request outputs, only how many tokens a step emits. A new draft method is one module that
implements this Protocol:

* `eagle_drafter.ModelDrafter`: a draft model (EAGLE-1, EAGLE-3 heads; DeepSeek-V3's NextN
  module) that reads the target's features; chain or tree.
* `ngram.NgramDrafter`: prompt lookup, copies from the request's own tokens; chain, no model.
* `suffix.SuffixDrafter`: the same, and copies from recent requests' outputs too.

Every method runs on the forward stream (inside the step's CUDA graphs where the worker
captured them) except `prefill_inputs`, which runs on the schedule side.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from specserve.engine.forward_batch import KVRows
from specserve.engine.runtime.captured_extend import CapturedExtendInputs
from specserve.engine.runtime.captured_mixed import MixedForwardOut
from specserve.engine.runtime.step import ExtendStep
from specserve.engine.runtime.worker import ForwardInputs
from specserve.engine.spec.tree import DraftNodes, TreeShape
from specserve.engine.spec.verifier import Snapshot, SpecDecodeInputs, Verified


class CapturedExtendHalf(NamedTuple):
    """What a captured extend's target half hands the drafter's part."""

    inputs: CapturedExtendInputs
    tokens: torch.Tensor      # [R] the sampled tokens
    feats: torch.Tensor       # the target features the draft reads


class MixedDraftExtend(NamedTuple):
    """A drafter's draft-extend of a captured mixed step (runtime/captured_mixed.py): the
    verify rows' accepted paths and the prompt chunks in one draft forward over the mixed
    forward's layout, as the mixed graphs' second part."""

    part: Callable[[MixedForwardOut], None]  # reads the static inputs' draft ids and stash entries
    # The chunks' draft ids: (prefill_inputs, the chunks' ForwardInputs, their sampled tokens).
    chunk_ids: Callable[[Any, ForwardInputs, torch.Tensor], torch.Tensor]


class Drafter(Protocol):
    shape: TreeShape                    # the tree its nodes fill (chain: topk 1)
    # The draft levels a constrained step masks (the grammar process walks them, then the
    # verify tree): `shape` for a model drafter; none (num_steps 1) for copied drafts.
    grammar_shape: TreeShape
    # The target features the drafter reads after each forward: None, none; () the last
    # hidden state; else these layers' outputs (EAGLE-3).
    feature_layers: Optional[tuple[int, ...]]

    # True: a depth-0 (plain) step keeps only the drafter's KV whole and leaves the state
    # the next step drafts from to `refresh`, which the worker calls for those rows before
    # a deeper step (a draft model's upkeep is most of a plain step's extra cost otherwise).
    refreshes_state: bool

    def at_shape(self, depth: int, width: int) -> "Drafter":
        """The same drafter (its state shared) drafting `depth` levels of `width` candidates
        (width 1: a chain), depth 0 included (a plain step; width 1), for adaptive speculation
        (spec/adaptive_worker.py). The state any copy stashes serves every other copy's next
        draft. A width the method cannot draft is refused (ValueError naming `width`)."""

    def prefill_inputs(self, step: ExtendStep) -> Any:
        """Schedule side: the device inputs `after_prefill` needs beyond the target's."""

    def after_prefill(self, step_inputs: Any, target: ForwardInputs, tokens: torch.Tensor,
                      feats: torch.Tensor, kv: KVRows) -> None:
        """After a prefill's target forward (its new lengths published): the drafter's state
        for the prefilled requests' first decode. `tokens`: what each chunk sampled; `feats`:
        the target's features (`feature_layers`' outputs, else its last hidden states) of the
        chunks' tokens; `kv`: the chunks' request-table rows (a mixed step's snapshot)."""

    def draft(self, s: SpecDecodeInputs, snap: Snapshot) -> DraftNodes:
        """The D - 1 draft nodes of every request of the batch (a constrained batch: the grammar
        process's committed masks first, then each of `grammar_shape`'s levels)."""

    def after_verify(self, v: Verified) -> None:
        """After acceptance (and compaction): the drafter's state for the next iteration."""

    def refresh(self, rows: torch.Tensor, seq_lens_cpu: Optional[list[int]], width: int) -> None:
        """(`refreshes_state` drafters.) The next-step state of `rows`, whose last decode step
        was plain; `seq_lens_cpu`: their lengths where a backend needs them; `width`: a bound
        of their KV rows."""

    def captured_extend_part(self, width: int) -> Optional[Callable[[CapturedExtendHalf], torch.Tensor]]:
        """The second part of a captured extend (runtime/captured_extend.py) over rows of KV
        bound `width`: reads what the target half returns, returns its sampled tokens; None:
        extends stay eager."""

    def captured_mixed_part(self, width: int) -> Optional[MixedDraftExtend]:
        """The draft-extend of a captured mixed step over rows of KV bound `width`, in place of
        `after_verify` and `after_prefill`; None: both run after the graphs."""
