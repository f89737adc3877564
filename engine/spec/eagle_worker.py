"""EAGLE speculative decoding, spec v2: draft -> verify -> publish -> draft-extend -> stash.

Per request the device state between iterations is: `seq_len` S (tokens whose target KV is
final), the bonus token at index S (FutureMap `output_tokens_buf`), and the draft's view of
its next token (`topk_p`, `topk_index`) with its pre-norm hidden state. Draft row at
position p reads (feature of token p, token p+1), so the draft KV of a request covers
positions < S after every iteration.

One decode iteration (D = num_draft_tokens nodes per request, node 0 is the bonus):
  draft:   num_steps - 1 draft forwards extend the first level (from the stash) into a tree
  verify:  one target forward over the D nodes at positions S + depth, tree mask
  accept:  the target's own token at every node (greedy argmax, or a sample keyed by
           (seed, position)); walk from the root accepting the child equal to it
  publish: new_seq_lens = S + accepted + 1, for the next schedule step
  extend:  one draft forward over the D nodes (compacted to the accepted path first in tree
           mode) with the target's features; the row of the last accepted node gives the
           next draft input, which is stashed.
Because accept compares drafts with the token the target itself would produce at that
position, the output is exactly plain decoding's, for greedy and for seeded sampling alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specserve.engine.config import SpecConfig
from specserve.engine.layers.sampler import SamplingInfo, sample
from specserve.engine.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.engine.runtime.model_runner import ModelRunner
from specserve.engine.runtime.worker import ForwardInputs, NormalWorker, greedy_sampling_info
from specserve.engine.scheduler.schedule_batch import BatchResult
from specserve.engine.spec import tree as tree_ops


@dataclass
class SpecDecodeInputs:
    req_pool_indices: torch.Tensor   # [bs]
    seq_lens: torch.Tensor           # [bs] device: S per request (from the FutureMap)
    seq_lens_cpu: Optional[list[int]]
    max_seq_len: int                 # host bound: max kv_allocated_len >= S + D
    sampling_info: SamplingInfo


class _TableView:
    """A snapshot of the batch's req_to_token rows, addressed by batch index."""

    def __init__(self, table: torch.Tensor):
        self.table = table


class EagleWorker(NormalWorker):
    def __init__(self, target: ModelRunner, draft: ModelRunner, spec: SpecConfig, **kwargs):
        super().__init__(target, **kwargs)
        self.draft = draft
        self.spec = spec
        self.num_draft_tokens = spec.num_draft_tokens
        self.capture_aux = draft.model.uses_aux_hidden
        self.tree = tree_ops.TreeShape(spec.topk, spec.num_steps, spec.num_draft_tokens)
        head = draft.model
        self.future_map.allocate("topk_p", (spec.topk,), torch.float32)
        self.future_map.allocate("topk_index", (spec.topk,), torch.int64)
        self.future_map.allocate("hidden", (head.config.hidden_size,), next(head.parameters()).dtype)

    def slots_per_request(self) -> int:
        return self.spec.kv_reserve_per_request

    # --- prefill ---------------------------------------------------------------------------
    def launch(self, inputs):
        if isinstance(inputs, SpecDecodeInputs):
            return self._launch_decode(inputs)
        return self._launch_prefill(inputs)

    def _launch_prefill(self, inputs: ForwardInputs):
        read_done = self.ctx.new_event()
        result = BatchResult(copy_done=self.ctx.new_event(), token_ids=None)
        publish_ready = self.future_map.new_publish_event()

        def run():
            tokens, logprobs, hidden, aux = self.forward_and_sample(inputs, read_done, self.capture_aux)
            # Draft rows read (feature of token p, token p + 1): the inputs shifted left by one;
            # the last row of a chunk takes the next prompt token or, at the end, the sample.
            shifted = inputs.extras["shifted_ids"].clone()
            shifted[inputs.sample_rows] = torch.where(inputs.extras["samples"], tokens,
                                                      shifted[inputs.sample_rows])
            seq_lens = inputs.prefix_lens + inputs.extend_lens
            self.future_map.publish(inputs.stash_rows, seq_lens)
            publish_ready.record()
            fb = self._fb(ForwardMode.DRAFT_EXTEND, shifted, inputs.positions, inputs.req_pool_indices,
                          self.req_to_token, inputs.prefix_lens, inputs.extend_lens_cpu,
                          inputs.out_cache_loc, inputs.seq_lens_cpu, inputs.max_seq_len)
            draft_hidden = self.draft.forward(fb, aux if self.capture_aux else hidden)
            self._stash_draft_state(inputs.stash_rows, draft_hidden[inputs.sample_rows])
            self.finish(result, tokens, logprobs)

        self.ctx.launch(run)
        return result, read_done

    # --- decode ----------------------------------------------------------------------------
    def _launch_decode(self, inputs: SpecDecodeInputs):
        read_done = self.ctx.new_event()
        result = BatchResult(copy_done=self.ctx.new_event(), token_ids=None)
        publish_ready = self.future_map.new_publish_event()
        bs = inputs.req_pool_indices.shape[0]
        use_graph = self.graphs is not None and self.graphable(inputs.sampling_info, bs)

        def run():
            if use_graph:
                captured = self.graphs.load({"rows": inputs.req_pool_indices, "S": inputs.seq_lens})
                self.graphs.replay(captured, 0)
                read_done.record()
                publish_ready.record()
                out = self.graphs.replay(captured, 1)
                self.finish(result, out["tokens"][:bs], None, out["lengths"][:bs])
                return
            st = self._verify_part(dict(rows=inputs.req_pool_indices, S=inputs.seq_lens,
                                        seq_lens_cpu=inputs.seq_lens_cpu, width=inputs.max_seq_len,
                                        info=inputs.sampling_info), read_done)
            publish_ready.record()
            out = self._extend_part(st)
            self.finish(result, out["tokens"], out["logprobs"], out["lengths"])

        self.ctx.launch(run)
        return result, read_done

    def _verify_part(self, st: dict, read_done=None) -> dict:
        """Snapshot the rows, draft, verify, accept, and write the new lengths for `publish`."""
        rows, S, width = st["rows"], st["S"], st["width"]
        bs, D = rows.shape[0], self.num_draft_tokens
        # The whole iteration reads the table through this snapshot, so the schedule side may
        # rewrite it as soon as the snapshot is taken.
        snapshot = _TableView(self.req_to_token.table[rows, :width])
        if read_done is not None:
            read_done.record()
        bonus = self.future_map.resolve_input_ids(-rows)
        topk_p = self.future_map.gather("topk_p", rows)
        topk_index = self.future_map.gather("topk_index", rows)
        draft_hidden = self.future_map.gather("hidden", rows)

        tp = self.runner.model.tp  # the draft runs on every rank; rank 0's tree is the tree
        nodes = self._draft(snapshot, S, topk_p, topk_index, draft_hidden)
        nodes = tree_ops.DraftNodes(tp.broadcast(nodes.tokens.contiguous()), tp.broadcast(nodes.parents.contiguous()))
        tree = tree_ops.build_tree(nodes, bonus, S, self.tree)
        loc = snapshot.table.gather(1, tree.slot_positions)  # [bs, D] verify slots
        batch_rows = torch.arange(bs, device=rows.device)
        fb = self._fb(ForwardMode.TARGET_VERIFY, tree.tokens.reshape(-1), tree.positions.reshape(-1),
                      batch_rows, snapshot, S, [D] * bs, loc.reshape(-1),
                      self._plus(st.get("seq_lens_cpu"), D), width, tree.mask)
        fb.capture_aux_hidden = self.capture_aux
        hidden, aux = self.runner.forward(fb)
        logits = self.runner.model.compute_logits(hidden)
        target_tokens, logprobs = self._target_tokens(logits, tree, rows, st["info"])
        target_tokens = tp.broadcast(target_tokens.contiguous())
        accept = tree_ops.accept(tree, target_tokens, self.spec.bench_force_accept_len)
        self.future_map.publish(rows, S + accept.lengths)
        return dict(st, snapshot=snapshot, loc=loc, accept=accept, logprobs=logprobs,
                    feats=aux if self.capture_aux else hidden)

    def _extend_part(self, st: dict) -> dict:
        """Compact the accepted path (tree), draft-extend over it, stash the next draft input."""
        rows, S, accept, loc = st["rows"], st["S"], st["accept"], st["loc"]
        bs, D = rows.shape[0], self.num_draft_tokens
        feats = st["feats"]
        if self.tree.is_tree:  # move the accepted path to the front of each request's block
            feats = tree_ops.compact_rows(feats.view(bs, D, -1), accept.path).reshape(bs * D, -1)
            self.runner.kv_pool.move_kv_cache(*tree_ops.compaction_moves(loc, accept))
        path_tokens = accept.tokens  # [bs, D]: tokens emitted along the path, then padding
        chain_pos = S[:, None] + torch.arange(D, device=rows.device)
        snapshot = st["snapshot"]
        fb = self._fb(ForwardMode.DRAFT_EXTEND, path_tokens.reshape(-1), chain_pos.reshape(-1),
                      torch.arange(bs, device=rows.device), snapshot, S, [D] * bs,
                      snapshot.table.gather(1, chain_pos).reshape(-1),
                      self._plus(st.get("seq_lens_cpu"), D), st["width"])
        ext_hidden = self.draft.forward(fb, feats).view(bs, D, -1)
        last = accept.lengths - 1
        self._stash_draft_state(rows, ext_hidden[torch.arange(bs, device=rows.device), last])
        self.future_map.stash_tokens(rows, path_tokens.gather(1, last[:, None]).squeeze(1))
        if st["info"].any_penalty:
            self._mark_presence(rows, path_tokens, accept.lengths)
        logprobs = None if st["logprobs"] is None else accept.gather_path(st["logprobs"])
        return {"tokens": path_tokens, "lengths": accept.lengths, "logprobs": logprobs}

    # --- CUDA graphs -------------------------------------------------------------------------
    def enable_cuda_graphs(self, max_batch_size: int, width: int) -> None:
        from specserve.engine.runtime.cuda_graph import GraphedStep

        device = self.req_to_token.table.device

        def make_inputs(bs):
            return dict(rows=torch.zeros(bs, dtype=torch.int64, device=device),
                        S=torch.ones(bs, dtype=torch.int64, device=device), width=width,
                        info=greedy_sampling_info(bs, self.runner.model.config.vocab_size, device))

        self.graphs = GraphedStep([self._verify_part, self._extend_part], make_inputs,
                                  pad={"rows": 0, "S": 1}, max_batch_size=max_batch_size, device=device)
        self.graphs.capture_all()

    def _draft(self, snapshot, S, topk_p, topk_index, hidden):
        """num_steps - 1 draft forwards growing the first level (from the stash) into a tree."""
        builder = tree_ops.DraftTreeBuilder(self.tree, topk_p, topk_index, hidden)
        bs = S.shape[0]
        branches = bs * self.tree.topk
        batch_of_branch = torch.arange(bs, device=S.device).repeat_interleave(self.tree.topk)
        for step in range(1, self.tree.num_steps):
            tokens, parent_hidden = builder.frontier()
            positions = S[batch_of_branch] + step - 1
            kv, kv_lens, loc = tree_ops.draft_step_kv(snapshot.table, S, step, self.tree, builder)
            fb = self._fb(ForwardMode.DECODE, tokens, positions, torch.arange(branches, device=S.device),
                          None, kv_lens - 1, [1] * branches, loc, None, kv.shape[1])
            fb.kv_indices_override = kv
            out_hidden = self.draft.forward(fb, parent_hidden)
            builder.expand(*self.draft.model.topk(out_hidden, self.tree.topk), out_hidden)
        return builder.finish()

    def _target_tokens(self, logits, tree, rows, info: SamplingInfo):
        """The token the target itself picks at every node (greedy or seeded sample)."""
        bs, D = tree.tokens.shape
        node_req = torch.arange(bs, device=logits.device).repeat_interleave(D)
        presence = tree_ops.node_presence(self.presence.table[rows], tree) if info.any_penalty else None
        tokens, logprobs = sample(logits, info, node_req, tree.positions.reshape(-1) + 1, presence)
        return tokens.view(bs, D), None if logprobs is None else logprobs.view(bs, D)

    def _mark_presence(self, rows, path_tokens, lengths):
        table = self.presence.table
        for j in range(path_tokens.shape[1]):
            tok = path_tokens[:, j]
            table[rows, tok] = table[rows, tok] | (j < lengths)

    def _stash_draft_state(self, rows, last_hidden):
        topk_p, topk_index = self.draft.model.topk(last_hidden, self.tree.topk)
        self.future_map.stash(rows, topk_p=topk_p, topk_index=topk_index, hidden=last_hidden)

    @staticmethod
    def _plus(seq_lens_cpu, n):
        return None if seq_lens_cpu is None else [s + n for s in seq_lens_cpu]

    def _fb(self, mode, ids, positions, req_pool_indices, req_to_token, prefix_lens, extend_lens,
            loc, seq_lens_cpu, max_seq_len, mask=None) -> ForwardBatch:
        return ForwardBatch(mode=mode, input_ids=ids, positions=positions, req_pool_indices=req_pool_indices,
                            prefix_lens=prefix_lens, extend_lens_cpu=extend_lens, out_cache_loc=loc,
                            req_to_token=req_to_token, kv_pool=None, attn_backend=None,
                            seq_lens_cpu=seq_lens_cpu, max_seq_len=max_seq_len, custom_mask=mask)
