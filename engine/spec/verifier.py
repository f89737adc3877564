"""The verifier: one target forward over a request's drafted nodes, acceptance, and the step's
outputs. Every drafter (spec/drafter.py) hands it the same thing, draft nodes under the bonus
token, so what makes speculation exact lives here once.

Per request the device state between iterations is: `seq_len` S (tokens whose target KV is
final) and the bonus token at index S (FutureMap `output_tokens_buf`). One iteration
(D = num_draft_tokens nodes per request, node 0 is the bonus):
  snapshot: the batch's request-table rows and the bonus tokens
  draft:    the drafter's D - 1 nodes (drafter.draft)
  verify:   one target forward over the D nodes at positions S + depth, tree mask
  accept:   the target's own token at every node (greedy argmax, or a sample keyed by
            (seed, position)); walk from the root accepting the child equal to it
  publish:  new_seq_lens = S + accepted + 1, for the next schedule step
  compact:  (tree) the accepted path's KV moved to row positions S .. S + len - 1
  drafter:  its own bookkeeping over the accepted path (drafter.after_verify)
  outputs:  the next bonus token stashed, penalties' history, the emitted tokens.
Because accept compares drafts with the token the target itself would produce at that
position, the output is exactly plain decoding's, for greedy and for seeded sampling alike,
whatever the drafts were.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows
from specserve.engine.grammar.bitmask import apply_token_bitmask
from specserve.engine.grammar.channel import DeviceChannel
from specserve.engine.layers.sampler import SamplingInfo, TokenChoice, sample
from specserve.engine.aranges import arange
from specserve.engine.runtime.step import StepResult
from specserve.engine.runtime.worker import TargetModel
from specserve.engine.spec import tree as tree_ops


class SpecDecodeInputs(NamedTuple):
    """One iteration's inputs (also the static inputs of its CUDA graphs)."""

    rows: torch.Tensor                # [bs] request-table rows
    S: torch.Tensor                   # [bs] committed length per request (from the FutureMap)
    seq_lens_cpu: Optional[list[int]]  # the same on the host, when a backend reads it
    width: int                        # host bound on every row's KV length (its allocated slots)
    info: SamplingInfo
    # A constrained batch: the step signals the grammar process and waits for its masks
    # (grammar/channel.py) at each draft step and before the accept.
    constrained: bool = False


class Snapshot(NamedTuple):
    """What an iteration reads of the schedule side's tables, taken at its start."""

    kv: KVRows                        # the batch's request-table rows, by batch index
    bonus: torch.Tensor               # [bs] the tree's root token


class Verifying(NamedTuple):
    """The verify forward's outputs, before the (masked) target tokens are picked."""

    inputs: SpecDecodeInputs
    kv: KVRows
    tree: tree_ops.Tree
    loc: torch.Tensor                 # [bs, D] the verify nodes' KV slots
    logits: torch.Tensor              # [bs * D, V]
    feats: torch.Tensor               # [bs * D, F] the target features a draft model reads


class Verified(NamedTuple):
    """What the verify half hands the rest of the step."""

    inputs: SpecDecodeInputs
    kv: KVRows                        # the snapshot of the batch's rows, by batch index
    chain_pos: torch.Tensor           # [bs, D] S + i: the row positions of the verify nodes' KV
    loc: torch.Tensor                 # [bs, D] the verify nodes' KV slots (at chain_pos)
    accept: tree_ops.Accept
    last: torch.Tensor                # [bs] accept.lengths - 1: the path's last node
    choice: TokenChoice               # the target's token per node [bs, D] (logprobs, top)
    feats: torch.Tensor               # [bs * D, F] per node (after `compact`: path first)


class Verifier:
    def __init__(self, target: TargetModel, shape: tree_ops.TreeShape, feature_layers: tuple[int, ...],
                 force_accept_len: Optional[int] = None):
        """`feature_layers`: the target layers whose outputs the drafter reads (EAGLE-3), ()
        for the last hidden state. `force_accept_len`: benchmarks only (tree.accept)."""
        self.target = target
        self.shape = shape
        self.feature_layers = feature_layers
        self.force_accept_len = force_accept_len
        self.future_map = target.future_map

    @property
    def _channel(self) -> DeviceChannel:
        return self.target.grammar.device

    def snapshot(self, s: SpecDecodeInputs, out: Optional[torch.Tensor] = None) -> Snapshot:
        """The whole iteration reads the table through this snapshot, so the schedule side may
        rewrite it as soon as the snapshot is taken. `out`: a buffer of at least bs rows of
        `s.width` slots to take it into (the mixed step's graphs share one, so that no bucket
        keeps a snapshot of its own: spec/spec_worker.py)."""
        table = self.target.req_to_token.table[:, :s.width]
        rows = table[s.rows] if out is None else torch.index_select(table, 0, s.rows, out=out[:s.rows.shape[0]])
        return Snapshot(KVRows.by_batch_index(rows), self.future_map.resolve_input_ids(-s.rows))

    def verify(self, s: SpecDecodeInputs, snap: Snapshot, nodes: tree_ops.DraftNodes) -> Verified:
        """Tree of the drafted nodes, verify forward, accept, publish."""
        return self.accept(self._verify_forward(s, snap.kv, self.tree_of(s, snap, nodes)))

    def tree_of(self, s: SpecDecodeInputs, snap: Snapshot, nodes: tree_ops.DraftNodes) -> tree_ops.Tree:
        """The verify layout (rank 0's drafts are the drafts: the drafter runs on every rank).
        Constrained, node i may only become the target's choice allowed after its path."""
        tp = self.target.model.tp
        nodes = tree_ops.DraftNodes(tp.broadcast(nodes.tokens.contiguous()),
                                    tp.broadcast(nodes.parents.contiguous()))
        tree = tree_ops.build_tree(nodes, snap.bonus, s.S, self.shape)
        if s.constrained:
            self._channel.signal(tree.tokens, tree.parents)
        return tree

    def _verify_forward(self, s: SpecDecodeInputs, kv: KVRows, tree: tree_ops.Tree) -> Verifying:
        """One target forward over the tree's nodes, and their logits."""
        bs, D = s.rows.shape[0], self.shape.num_draft_tokens
        loc = kv.table.gather(1, tree.slot_positions)
        fb = ForwardBatch(
            mode=ForwardMode.TARGET_VERIFY, input_ids=tree.tokens.reshape(-1),
            positions=tree.positions.reshape(-1), kv_rows=kv, prefix_lens=s.S,
            extend_lens_cpu=[D] * bs, out_cache_loc=loc.reshape(-1),
            seq_lens_cpu=plus(s.seq_lens_cpu, D), max_seq_len=s.width,
            custom_mask=self._verify_mask(tree.mask),
            aux_hidden_layers=self.feature_layers)
        hidden, aux = self.target.runner.forward(fb)
        return Verifying(s, kv, tree, loc, self.target.model.compute_logits(hidden),
                         aux if self.feature_layers else hidden)

    def accept(self, v: Verifying) -> Verified:
        """The target's token at every node (masked: inside the grammar), accept, publish."""
        s, tree, logits = v.inputs, v.tree, v.logits
        if s.constrained:
            logits = apply_token_bitmask(logits, self._channel.masks(logits.shape[0]))
        choice = self._target_tokens(logits, tree, s.rows, s.info)
        target_tokens = self.target.model.tp.broadcast(choice.tokens.contiguous())
        accept = tree_ops.accept(tree, target_tokens, self.force_accept_len, self.shape.num_steps)
        self.future_map.publish(s.rows, s.S + accept.lengths)
        if s.constrained:  # the matchers advance (and fill the next masks) during the rest
            self._channel.signal(accept.tokens, accept.lengths)
        return Verified(s, v.kv, tree.slot_positions, v.loc, accept, accept.lengths - 1, choice, v.feats)

    def compact(self, v: Verified) -> Verified:
        """Tree: move the accepted path to the front of each request's block (its target KV,
        and the features a draft-extend reads). A chain's path is already there."""
        if not self.shape.is_tree:
            return v
        bs, D = v.inputs.rows.shape[0], self.shape.num_draft_tokens
        feats = tree_ops.compact_rows(v.feats.view(bs, D, -1), v.accept.path).reshape(bs * D, -1)
        self.target.runner.kv_pool.move_kv_cache(*tree_ops.compaction_moves(v.loc, v.accept))
        return v._replace(feats=feats)

    def outputs(self, v: Verified) -> StepResult:
        """Stash the next bonus token, record the emitted tokens for penalties, and the step's
        result: tokens (and logprobs) along the accepted path."""
        s, accept = v.inputs, v.accept
        path_tokens = accept.tokens  # [bs, D]: tokens emitted along the path, then padding
        self.future_map.stash_tokens(s.rows, path_tokens.gather(1, v.last[:, None]).squeeze(1))
        if s.info.any_penalty:
            for j in range(self.shape.num_draft_tokens):
                self.target.history.mark(s.rows, path_tokens[:, j], j < accept.lengths)
        c = v.choice
        per_path = [None if t is None else accept.gather_path(t) for t in (c.logprobs, c.top_ids, c.top_logprobs)]
        return StepResult(path_tokens, per_path[0], accept.lengths, *per_path[1:])

    def _verify_mask(self, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The tree mask, copied into the target backend's preallocated verify buffer when it
        has one (the MLA backends: same address every iteration, no host lengths)."""
        buf = self.target.runner.attn_backend.get_verify_buffers_to_fill_after_draft()[0]
        if mask is None or buf is None:
            return mask
        filled = buf[:mask.shape[0]]
        filled.copy_(mask)
        return filled

    def _target_tokens(self, logits, tree, rows, info: SamplingInfo) -> TokenChoice:
        """The token the target itself picks at every node (greedy or seeded sample), with
        its logprobs; per node [bs, D] (top alternatives [bs, D, K])."""
        bs, D = tree.tokens.shape
        node_req = positions = history = None  # read by per-token rules only
        if info.per_token_rules:
            node_req = arange(bs, logits.device).repeat_interleave(D)
            positions = tree.positions.reshape(-1) + 1
        if info.any_penalty:
            history = tree_ops.node_history(self.target.history.of_rows(rows), tree)
        choice = sample(logits, info, node_req, positions, history)
        return TokenChoice(*(None if t is None else t.view(bs, D, *t.shape[1:]) for t in choice))


def plus(seq_lens_cpu: Optional[list[int]], n: int) -> Optional[list[int]]:
    return None if seq_lens_cpu is None else [s + n for s in seq_lens_cpu]
