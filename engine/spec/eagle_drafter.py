"""Drafting with a draft model: EAGLE-1 and EAGLE-3 heads, and DeepSeek-V3's NextN module
(models/eagle.py, models/nextn.py), chain or tree (spec/tree.py).

The drafter's device state per request between iterations is the draft's view of its next
token (`topk_p`, `topk_index`) with its pre-norm hidden state (FutureMap `draft_state`). Draft
row at position p reads (feature of token p, token p+1), so the draft KV of a request covers
positions < S after every iteration.

  draft:   num_steps - 1 draft forwards extend the first level (from the stash) into a tree
  (the verifier checks it: spec/verifier.py)
  extend:  one draft forward over the D nodes (compacted to the accepted path first in tree
           mode) with the target's features; the row of the last accepted node gives the
           next draft input, which is stashed.
A prefill runs the same draft-extend over the prompt (`after_prefill`).
"""
from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple, Optional

import torch

from specserve.engine.aranges import arange
from specserve.engine.config import SpecConfig
from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows
from specserve.engine.grammar.channel import DeviceChannel
from specserve.engine.runtime.captured_mixed import MixedForwardOut
from specserve.engine.runtime.cuda_graph import GraphedStep
from specserve.engine.runtime.future_map import DraftInput, DraftState
from specserve.engine.runtime.model_runner import ModelRunner
from specserve.engine.runtime.step import ExtendStep
from specserve.engine.runtime.worker import ForwardInputs, TargetModel
from specserve.engine.spec import tree as tree_ops
from specserve.engine.spec.drafter import CapturedExtendHalf, MixedDraftExtend
from specserve.engine.spec.verifier import Snapshot, SpecDecodeInputs, Verified, plus


class EagleExtendInputs(NamedTuple):
    # Draft rows read (feature of token p, token p + 1): the inputs shifted left by one; the
    # last row of a chunk takes the next prompt token or, at the end, the sampled token.
    shifted_ids: torch.Tensor   # [T]
    samples: torch.Tensor       # [bs] bool: the chunk ends the prefill


class RefreshInputs(NamedTuple):
    """`ModelDrafter.refresh`'s rows (the captured graphs' static input)."""

    rows: torch.Tensor
    seq_lens_cpu: Optional[list[int]]
    width: int


class Drafting(NamedTuple):
    """What a part of the drafting hands the next, before draft step `step` (1-based)."""

    inputs: SpecDecodeInputs
    kv: KVRows                        # the snapshot of the batch's rows, by batch index
    builder: Any                      # tree.DraftChainBuilder or DraftTreeBuilder
    branch_S: torch.Tensor            # S per frontier branch
    step: int
    out_hidden: Optional[torch.Tensor] = None  # the draft forward's output, once it ran


class ModelDrafter:
    """A draft model's drafter (spec/drafter.py Drafter)."""

    def __init__(self, target: TargetModel, draft: ModelRunner, spec: SpecConfig):
        self.target = target
        self.draft_runner = draft
        self.future_map = target.future_map
        # The configured tree: `at_shape` copies draft other shapes within it.
        self.configured = self.shape = self.grammar_shape = tree_ops.TreeShape(
            spec.topk, spec.num_steps, spec.num_draft_tokens)
        # EAGLE-3 reads target features from several layers, EAGLE-1 the last hidden state.
        self.feature_layers: tuple[int, ...] = draft.model.aux_layers if draft.model.uses_aux_hidden else ()
        head = draft.model
        dtype = next(head.parameters()).dtype
        # Every step stashes the first level of the next draft topk wide, whichever shape ran
        # it (adaptive speculation): a tree of width topk drafts from all of it, a chain its top 1.
        self.future_map.allocate_draft_state(spec.topk, head.config.hidden_size, dtype)
        # A head that can store its KV alone (EAGLE; not NextN's MLA) does only that at depth
        # 0: the attention, MLP and LM head of the row wait for `refresh`.
        self.refreshes_state = hasattr(head, "store_kv")
        if self.refreshes_state:
            self.future_map.allocate_draft_input(head.feature_size, dtype)
        # The refresh's CUDA graphs (`capture_refresh`), shared with the at_shape copies: a
        # list, so that the copies made before the capture see it.
        self._refresh_graphs: list[GraphedStep] = []

    def at_shape(self, depth: int, width: int) -> "ModelDrafter":
        """This drafter drafting `depth` levels of `width` candidates (adaptive speculation; the
        state is shared: it lives in the FutureMap). Width w > 1, a tree: `depth` levels hold
        w + (depth - 1) w^2 candidates, of which up to num_draft_tokens - 1 are verified; width
        1, a chain of `depth` drafts (its depth + 1 nodes within num_draft_tokens); depth 0
        (width 1) verifies the root alone. Any width up to the configured topk: each drafts from
        the top `width` of the stashed first level, which every copy stashes topk wide, for
        whichever shape comes next."""
        configured = self.configured
        if not 1 <= width <= configured.topk or (depth == 0 and width != 1):
            raise ValueError(f"width: 1 to the drafter's topk ({configured.topk}), 1 at depth 0; "
                             f"got {width!r} at depth {depth!r}")
        if not 0 <= depth <= configured.num_steps or (width == 1 and depth + 1 > configured.num_draft_tokens):
            raise ValueError(f"depth: 0 to num_steps ({configured.num_steps}), a chain's depth + 1 nodes "
                             f"within num_draft_tokens ({configured.num_draft_tokens}); got {depth!r}")
        drafter = copy.copy(self)
        nodes = 1 if depth == 0 else min(configured.num_draft_tokens, 1 + width + (depth - 1) * width * width)
        drafter.shape = drafter.grammar_shape = tree_ops.TreeShape(width, depth, nodes)
        return drafter

    @property
    def _channel(self) -> DeviceChannel:
        return self.target.grammar.device

    # --- prefill ---------------------------------------------------------------------------
    def prefill_inputs(self, step: ExtendStep) -> EagleExtendInputs:
        shifted = []
        for fill, (start, end), samples in zip(step.fill_ids, step.chunks, step.samples):
            shifted += fill[start + 1:end + 1] + [0] * samples
        return EagleExtendInputs(self.target.to_device(shifted), self.target.to_device(step.samples, torch.bool))

    def after_prefill(self, inputs: EagleExtendInputs, target: ForwardInputs, tokens: torch.Tensor,
                      feats: torch.Tensor, kv: KVRows) -> None:
        """Draft-extend over the prompt chunk with the target's features; stash the next draft input."""
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=self._chunk_ids(inputs, target, tokens),
            positions=target.positions, kv_rows=kv,
            prefix_lens=target.prefix_lens, extend_lens_cpu=target.extend_lens_cpu,
            out_cache_loc=target.out_cache_loc, seq_lens_cpu=target.seq_lens_cpu,
            max_seq_len=target.max_seq_len)
        draft_hidden = self.draft_runner.forward(fb, feats)
        self._stash_draft_state(target.stash_rows, draft_hidden[target.sample_rows])

    @staticmethod
    def _chunk_ids(inputs: EagleExtendInputs, target: ForwardInputs, tokens: torch.Tensor) -> torch.Tensor:
        """The chunks' draft ids: the inputs shifted by one, a chunk's last row the token it
        sampled where it ends its prefill (else the next prompt token)."""
        shifted_ids = inputs.shifted_ids.clone()
        shifted_ids[target.sample_rows] = torch.where(inputs.samples, tokens, shifted_ids[target.sample_rows])
        return shifted_ids

    def captured_mixed_part(self, width: int) -> Optional[MixedDraftExtend]:
        if self.refreshes_state and self.shape.num_steps == 0:
            return None  # a plain step stores the rows' draft KV alone (after_verify)
        return MixedDraftExtend(functools.partial(self._captured_mixed_draft_half, width), self._chunk_ids)

    def _captured_mixed_draft_half(self, width: int, out: MixedForwardOut) -> None:
        """after_verify's draft-extend of the verify rows (a chain's accepted path is in place)
        and after_prefill's of the chunks as one draft forward over the mixed layout, with
        the target features the mixed forward wrote; each real entry's draft state stashed."""
        s = out.inputs
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=s.draft_ids, positions=s.positions,
            kv_rows=KVRows(self.target.req_to_token.table, s.rows), prefix_lens=s.prefix_lens,
            extend_lens_cpu=[s.max_chunk] * s.rows.shape[0], extend_lens=s.extend_lens,
            out_cache_loc=s.loc, max_seq_len=width)
        draft_hidden = self.draft_runner.forward(fb, out.aux if self.feature_layers else out.hidden)
        self._stash_draft_state(s.stash_rows, draft_hidden[s.stash_index])

    def captured_extend_part(self, width: int):
        return functools.partial(self._captured_extend_draft_half, width)

    def _captured_extend_draft_half(self, width: int, half: CapturedExtendHalf) -> torch.Tensor:
        s = half.inputs
        # Sampled entries past the batch point at token T - 1 too: the duplicates write the
        # token sampled from that same row, so any order gives the same ids.
        shifted = s.shifted.index_copy(0, s.last, half.tokens)
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=shifted, positions=s.positions,
            kv_rows=KVRows(self.target.req_to_token.table, s.rows), prefix_lens=s.prefix_lens,
            extend_lens_cpu=[s.max_chunk] * s.rows.shape[0], extend_lens=s.extend_lens,
            out_cache_loc=s.loc, max_seq_len=width)
        draft_hidden = self.draft_runner.forward(fb, half.feats)
        self._stash_draft_state(s.sampled_rows, draft_hidden[s.last])
        return half.tokens

    # --- decode ----------------------------------------------------------------------------
    def draft(self, s: SpecDecodeInputs, snap: Snapshot) -> tree_ops.DraftNodes:
        if self.shape.num_steps == 0:  # a plain step (the draft-extend still follows it)
            none = s.rows.new_zeros((s.rows.shape[0], 0))
            return tree_ops.DraftNodes(none, none)
        drafting = self._draft_start(s, snap.kv)
        for _ in range(1, self.shape.num_steps):
            drafting = self._draft_grow(self._draft_forward(drafting))
        return drafting

    def _draft_start(self, s: SpecDecodeInputs, kv: KVRows) -> "Drafting":
        """The first draft level from the stash (rank 0's tree is the tree: the draft runs on
        every rank)."""
        state = self.future_map.gather_draft_state(s.rows)
        k = self.shape.topk
        # The top k of the stash (sorted, most likely first; topk wide): a chain's, the argmax.
        topk_p, topk_index = state.topk_p[:, :k], state.topk_index[:, :k]
        if s.constrained:
            # The stashed first level was drafted before the last step's tokens reached the
            # matchers: draft it again from the stashed hidden state, under the committed masks.
            self._channel.signal()
            topk_p, topk_index = self.draft_runner.model.topk(state.hidden, k,
                                                              bitmask=self._channel.masks(s.rows.shape[0]))
        builder = tree_ops.draft_builder(self.shape, topk_p, topk_index, state.hidden)
        branch_S = s.S.repeat_interleave(k) if self.shape.is_tree else s.S
        return self._level_drafted(Drafting(s, kv, builder, branch_S, 1))

    def _draft_forward(self, d: "Drafting") -> "Drafting":
        """Draft step d.step's forward over the frontier."""
        tokens, parent_hidden = d.builder.frontier()
        branch_kv, loc = d.builder.step_kv(d.kv.table, d.inputs.S, d.branch_S, d.step)
        positions = d.branch_S + (d.step - 1)  # also the KV length before this token
        branches = d.branch_S.shape[0]
        fb = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=tokens, positions=positions,
            kv_rows=KVRows.by_batch_index(branch_kv), prefix_lens=positions,
            extend_lens_cpu=[1] * branches, out_cache_loc=loc, max_seq_len=branch_kv.shape[1])
        return d._replace(out_hidden=self.draft_runner.forward(fb, parent_hidden))

    def _draft_grow(self, d: "Drafting"):
        """The next level from the forward's top-k (structured outputs: each frontier node
        drafts from the tokens its path allows)."""
        bitmask = self._channel.masks(d.branch_S.shape[0]) if d.inputs.constrained else None
        # A chain needs only each step's argmax, not its probability.
        d.builder.expand(*self.draft_runner.model.topk(d.out_hidden, self.shape.topk, with_probs=self.shape.is_tree,
                                                       bitmask=bitmask), d.out_hidden)
        return self._level_drafted(d._replace(step=d.step + 1, out_hidden=None))

    def _level_drafted(self, d: "Drafting"):
        """After a level: the Drafting of the next draft step, or after the last the drafted
        nodes. Constrained, the paths the next masks walk go to the grammar process before the
        forward that the masks wait for (it walks them while the forward runs)."""
        if d.step < self.shape.num_steps:
            if d.inputs.constrained:
                self._channel.signal(*d.builder.candidates())
            return d
        return d.builder.finish()

    def after_verify(self, v: Verified) -> None:
        """Draft-extend over the (compacted) accepted path, stash the next draft input. A plain
        step (depth 0) of a `refreshes_state` drafter only stores its row's draft KV and keeps
        the row's input for `refresh`."""
        s, accept = v.inputs, v.accept
        bs, D = s.rows.shape[0], self.shape.num_draft_tokens
        # The accepted path now sits at the verify nodes' row positions and slots (compacted).
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=accept.tokens.reshape(-1),
            positions=v.chain_pos.reshape(-1), kv_rows=v.kv, prefix_lens=s.S,
            extend_lens_cpu=[D] * bs, out_cache_loc=v.loc.reshape(-1),
            seq_lens_cpu=plus(s.seq_lens_cpu, D), max_seq_len=s.width)
        if self.refreshes_state and self.shape.num_steps == 0:
            self.draft_runner.store_kv(fb, v.feats)
            self.future_map.keep_draft_input(s.rows, DraftInput(fb.input_ids, fb.positions, fb.out_cache_loc,
                                                                v.feats))
            return
        ext_hidden = self.draft_runner.forward(fb, v.feats).view(bs, D, -1)
        self._stash_draft_state(s.rows, ext_hidden[arange(bs, s.rows.device), v.last])

    def refresh(self, rows: torch.Tensor, seq_lens_cpu: Optional[list[int]], width: int) -> None:
        """The draft forward of the kept rows of the rows' last (plain) steps, over the draft
        KV those steps stored (rewritten here with the same values): the state a full draft
        extend would have stashed then. A captured graph where one fits the rows (its host
        work would otherwise delay the step's launch and the previous step's read)."""
        graphs = self._refresh_graphs[0] if self._refresh_graphs else None
        if graphs is not None and graphs.bucket_for(rows.shape[0]) is not None:
            graphs.replay(graphs.load(rows=rows), 0)
        else:
            self._refresh(RefreshInputs(rows, seq_lens_cpu, width))

    def _refresh(self, r: "RefreshInputs") -> None:
        kept = self.future_map.gather_draft_input(r.rows)
        fb = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=kept.tokens, positions=kept.positions,
            kv_rows=KVRows(self.target.req_to_token.table, r.rows), prefix_lens=kept.positions,
            extend_lens_cpu=[1] * r.rows.shape[0], out_cache_loc=kept.loc, seq_lens_cpu=r.seq_lens_cpu,
            max_seq_len=r.width)
        self._stash_draft_state(r.rows, self.draft_runner.forward(fb, kept.feats))

    def capture_refresh(self, max_batch_size: int, width: int, pool) -> None:
        """Capture `refresh` per batch-size bucket over rows of KV bound `width`, in `pool`
        (padded rows: pool row 0, whose state and kept input nothing reads)."""
        device = self.target.ctx.device
        graphs = GraphedStep([self._refresh], lambda bs: RefreshInputs(
            torch.zeros(bs, dtype=torch.int64, device=device), None, width),
            pad={"rows": 0}, max_batch_size=max_batch_size, device=device, pool=pool)
        graphs.capture_all("drafter state refresh")
        self._refresh_graphs[:] = [graphs]

    def release_refresh_graphs(self) -> None:
        for graphs in self._refresh_graphs:
            graphs.release()
        self._refresh_graphs.clear()

    def _stash_draft_state(self, rows, last_hidden):
        topk_p, topk_index = self.draft_runner.model.topk(last_hidden, self.configured.topk)
        self.future_map.stash_draft_state(rows, DraftState(topk_p, topk_index, last_hidden))
