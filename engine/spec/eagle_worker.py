"""EAGLE speculative decoding, spec v2: draft -> build tree -> verify -> accept -> publish ->
compact -> draft-extend -> stash.

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

from typing import Any, NamedTuple, Optional

import torch

from specserve.engine.aranges import arange
from specserve.engine.config import SpecConfig
from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows
from specserve.engine.grammar.bitmask import apply_token_bitmask
from specserve.engine.grammar.channel import DeviceChannel
from specserve.engine.grammar.process import ONE, SPEC
from specserve.engine.layers.sampler import (FILTERED, GREEDY, SAMPLED, SamplingInfo, TokenChoice,
                                             graph_sampling_info, load_graph_sampling, sample)
from specserve.engine.runtime.cuda_graph import GraphedStep
from specserve.engine.runtime.future_map import DraftState
from specserve.engine.runtime.model_runner import ModelRunner
from specserve.engine.runtime.captured_extend import (
    ExtendBucket, CapturedExtendInputs, extend_bucket, load_captured_extend, pack_captured_extend)
from specserve.engine.runtime.mixed_step import (DecodeRows, join_verify_result, logit_rows,
                                                 mixed_forward_batch, sample_chunks)
from specserve.engine.runtime.step import (DecodeStep, ExtendStep, Launched, MixedStep, StepResult,
                                           launch_forward)
from specserve.engine.runtime.worker import ForwardInputs, TargetModel, graphs_for
from specserve.engine.spec import tree as tree_ops


# Padded rows of a captured decode step: pool row 0, length 1 (they write nowhere that matters).
GRAPH_PAD = {"rows": 0, "S": 1}


class EagleExtendInputs(NamedTuple):
    target: ForwardInputs
    # Draft rows read (feature of token p, token p + 1): the inputs shifted left by one; the
    # last row of a chunk takes the next prompt token or, at the end, the sampled token.
    shifted_ids: torch.Tensor   # [T]
    samples: torch.Tensor       # [bs] bool: the chunk ends the prefill


class CapturedExtendHalf(NamedTuple):
    """What a captured extend's target half hands its draft half."""

    inputs: CapturedExtendInputs
    tokens: torch.Tensor      # [R] the sampled tokens
    feats: torch.Tensor       # the target features the draft reads


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


class Drafting(NamedTuple):
    """What a part of the drafting hands the next, before draft step `step` (1-based)."""

    inputs: SpecDecodeInputs
    kv: KVRows                        # the snapshot of the batch's rows, by batch index
    bonus: torch.Tensor               # [bs] the tree's root token
    builder: Any                      # tree.DraftChainBuilder or DraftTreeBuilder
    branch_S: torch.Tensor            # S per frontier branch
    step: int
    out_hidden: Optional[torch.Tensor] = None  # the draft forward's output, once it ran


class Drafted(NamedTuple):
    inputs: SpecDecodeInputs
    kv: KVRows
    tree: tree_ops.Tree


class Verifying(NamedTuple):
    """The verify forward's outputs, before the (masked) target tokens are picked."""

    inputs: SpecDecodeInputs
    kv: KVRows
    tree: tree_ops.Tree
    loc: torch.Tensor                 # [bs, D] the verify nodes' KV slots
    logits: torch.Tensor              # [bs * D, V]
    feats: torch.Tensor               # [bs * D, F] the target features the draft reads


class Verified(NamedTuple):
    """What the verify half hands the draft-extend half."""

    inputs: SpecDecodeInputs
    kv: KVRows                        # the snapshot of the batch's rows, by batch index
    chain_pos: torch.Tensor           # [bs, D] S + i: the row positions of the verify nodes' KV
    loc: torch.Tensor                 # [bs, D] the verify nodes' KV slots (at chain_pos)
    accept: tree_ops.Accept
    choice: TokenChoice               # the target's token per node [bs, D] (logprobs, top)
    feats: torch.Tensor               # [bs * D, F] the target features the draft reads


class EagleWorker:
    def __init__(self, target: TargetModel, draft: ModelRunner, spec: SpecConfig):
        self.target = target
        self.draft = draft
        self.spec = spec
        self.future_map = target.future_map
        # EAGLE-3 reads target features from several layers, EAGLE-1 the last hidden state.
        self.aux_layers: tuple[int, ...] = draft.model.aux_layers if draft.model.uses_aux_hidden else ()
        self.tree = tree_ops.TreeShape(spec.topk, spec.num_steps, spec.num_draft_tokens)
        self.graphs = None  # GraphedStep once enable_cuda_graphs() ran
        self.constrained_graphs = None  # GraphedStep of constrained steps (with a grammar process)
        self.sampled_graphs: dict[str, GraphedStep] = {}  # SAMPLED / FILTERED -> GraphedStep
        self.extend_graphs = None  # GraphedStep of extends (runtime/captured_extend.py)
        self.width = 0  # the rows' KV bound, with the graphs
        head = draft.model
        self.future_map.allocate_draft_state(spec.topk, head.config.hidden_size,
                                             next(head.parameters()).dtype)

    def slots_per_request(self) -> int:
        return self.spec.kv_reserve_per_request

    # --- prefill ---------------------------------------------------------------------------
    def launch_extend(self, step: ExtendStep) -> Launched:
        bucket = None if self.extend_graphs is None else extend_bucket(step, self.extend_graphs.buckets)
        if bucket is not None:
            return self._replay_captured_extend(step, bucket)
        inputs = self._extend_inputs(step)
        target = inputs.target
        self.target.plan_grammar(ONE, len(step.rows), step.grammar)
        publish_ready = self.future_map.new_publish_event()

        def body(read_done) -> StepResult:
            sampled = self.target.forward_and_sample(target, read_done, self.aux_layers)
            self.future_map.publish(target.stash_rows, target.prefix_lens + target.extend_lens)
            publish_ready.record()
            self._draft_extend_chunks(inputs, sampled.tokens,
                                      sampled.aux_hidden if self.aux_layers else sampled.hidden,
                                      KVRows(self.target.req_to_token.table, target.rows))
            return sampled.step_result()

        return launch_forward(self.target.ctx, inputs, body)

    def _extend_inputs(self, step: ExtendStep) -> EagleExtendInputs:
        target = self.target.extend_inputs(step)
        shifted = []
        for fill, (start, end), samples in zip(step.fill_ids, step.chunks, step.samples):
            shifted += fill[start + 1:end + 1] + [0] * samples
        return EagleExtendInputs(target, self.target.to_device(shifted),
                                 self.target.to_device(step.samples, torch.bool))

    def _draft_extend_chunks(self, inputs: EagleExtendInputs, tokens: torch.Tensor, feats: torch.Tensor,
                             kv: KVRows) -> None:
        """The draft forward over prefill chunks (`tokens`: what each sampled; `feats`: the
        target's features of their tokens), and each chunk's next draft input stashed."""
        target = inputs.target
        shifted_ids = inputs.shifted_ids.clone()
        shifted_ids[target.sample_rows] = torch.where(inputs.samples, tokens, shifted_ids[target.sample_rows])
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=shifted_ids, positions=target.positions,
            kv_rows=kv, prefix_lens=target.prefix_lens, extend_lens_cpu=target.extend_lens_cpu,
            out_cache_loc=target.out_cache_loc, seq_lens_cpu=target.seq_lens_cpu,
            max_seq_len=target.max_seq_len)
        draft_hidden = self.draft.forward(fb, feats)
        self._stash_draft_state(target.stash_rows, draft_hidden[target.sample_rows])

    # --- mixed: verify rows and prefill chunks in one target forward --------------------------
    def mixed_row_tokens(self) -> int:
        return self.tree.num_draft_tokens if self.target.runner.attn_backend.supports_mixed_forward else 0

    def launch_mixed(self, step: MixedStep) -> Launched:
        """Draft the decode rows, then one target forward over their verify nodes and the
        chunks (runtime/mixed_step.py), then accept and draft-extend each part as its own step
        does. The chunks' table rows are read through a snapshot taken with the decode rows'."""
        D = self.tree.num_draft_tokens
        rows = self.target.to_device(step.decode.rows)
        seq_lens, seq_lens_cpu = self.future_map.resolve_seq_lens(rows)
        chunks = self._extend_inputs(step.extend)
        c = chunks.target
        width = max(max(step.decode.allocated_lens), c.max_seq_len)
        inputs = SpecDecodeInputs(rows, seq_lens, seq_lens_cpu, width, step.decode.sampling)
        publish_ready = self.future_map.new_publish_event()

        def body(read_done) -> StepResult:
            drafting = self._draft_start(inputs)
            chunk_kv = self.target.req_to_token.table[c.rows, :width]
            read_done.record()
            for _ in range(1, self.tree.num_steps):
                drafting = self._draft_grow(self._draft_forward(drafting))
            tree, n = drafting.tree, rows.shape[0] * D
            loc = drafting.kv.table.gather(1, tree.slot_positions)
            verify_rows = DecodeRows(tree.tokens.reshape(-1), tree.positions.reshape(-1), seq_lens,
                                     loc.reshape(-1), D, _plus(seq_lens_cpu, D), tree.mask)
            kv = KVRows.by_batch_index(torch.cat([drafting.kv.table, chunk_kv]))
            hidden, aux = self.target.runner.forward(
                mixed_forward_batch(verify_rows, c, kv, width, self.aux_layers))
            feats = aux if self.aux_layers else hidden
            logits = self.target.model.compute_logits(hidden[logit_rows(n, c)])
            verified = self._verify_accept(Verifying(inputs, drafting.kv, tree, loc, logits[:n], feats[:n]))
            tokens = self.target.model.tp.broadcast(sample_chunks(logits[n:], c))
            self.future_map.stash_tokens(c.stash_rows, tokens)
            self.future_map.publish(c.stash_rows, c.prefix_lens + c.extend_lens)
            publish_ready.record()
            result = self._extend_half(verified)
            self._draft_extend_chunks(chunks, tokens, feats[n:], KVRows.by_batch_index(chunk_kv))
            return join_verify_result(result, tokens)

        return launch_forward(self.target.ctx, (inputs, chunks), body)

    def _replay_captured_extend(self, step: ExtendStep, bucket: ExtendBucket) -> Launched:
        """The eager extend's two halves as two graphs, `publish_ready` recorded between them."""
        captured = self.extend_graphs.captured[bucket]
        packed = pack_captured_extend(step, bucket, next_tokens=True)
        publish_ready = self.future_map.new_publish_event()
        bs = len(step.rows)

        def replay(read_done) -> StepResult:
            load_captured_extend(captured.inputs, packed, step.out_cache_loc)
            self.extend_graphs.replay(captured, 0)
            publish_ready.record()
            tokens = self.extend_graphs.replay(captured, 1)
            read_done.record()  # the draft half reads the request table too
            return StepResult(tokens[:bs])

        return launch_forward(self.target.ctx, (packed, step.out_cache_loc), replay)

    def _captured_extend_target_half(self, s: CapturedExtendInputs) -> CapturedExtendHalf:
        tokens, hidden, aux = self.target.captured_extend(s, self.width, self.aux_layers)
        self.future_map.publish(s.sampled_rows, s.sampled_seq_lens)
        return CapturedExtendHalf(s, tokens, aux if self.aux_layers else hidden)

    def _captured_extend_draft_half(self, half: CapturedExtendHalf) -> torch.Tensor:
        s = half.inputs
        # Sampled entries past the batch point at token T - 1 too: the duplicates write the
        # token sampled from that same row, so any order gives the same ids.
        shifted = s.shifted.index_copy(0, s.last, half.tokens)
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=shifted, positions=s.positions,
            kv_rows=KVRows(self.target.req_to_token.table, s.rows), prefix_lens=s.prefix_lens,
            extend_lens_cpu=[s.max_chunk] * s.rows.shape[0], extend_lens=s.extend_lens,
            out_cache_loc=s.loc, max_seq_len=self.width)
        draft_hidden = self.draft.forward(fb, half.feats)
        self._stash_draft_state(s.sampled_rows, draft_hidden[s.last])
        return half.tokens

    # --- decode ----------------------------------------------------------------------------
    def launch_decode(self, step: DecodeStep) -> Launched:
        """The host does not know the lengths after the in-flight verify: the FutureMap has
        them on the device, and the over-reserved slots cover whatever they turn out to be."""
        rows = self.target.to_device(step.rows)
        seq_lens, seq_lens_cpu = self.future_map.resolve_seq_lens(rows)
        bs = len(step.rows)
        constrained = step.grammar is not None
        inputs = SpecDecodeInputs(rows, seq_lens, seq_lens_cpu, max(step.allocated_lens), step.sampling,
                                  constrained)
        publish_ready = self.future_map.new_publish_event()
        graphs = graphs_for(self, step.sampling, constrained, bs)
        use_graph = graphs is not None
        self.target.plan_grammar(SPEC, graphs.bucket_for(bs) if use_graph else bs, step.grammar)

        def body(read_done) -> StepResult:
            if use_graph:
                captured = graphs.load(rows=rows, S=seq_lens)
                if not step.sampling.all_greedy:
                    load_graph_sampling(captured.inputs.info, step.sampling, bs)
                graphs.replay(captured, 0)
                read_done.record()
                publish_ready.record()
                out = graphs.replay(captured, 1)
                return StepResult(out.token_ids[:bs], None, out.accept_lens[:bs])
            verified = self._verify_half(inputs, read_done)
            publish_ready.record()
            return self._extend_half(verified)

        return launch_forward(self.target.ctx, inputs, body)

    @property
    def _channel(self) -> DeviceChannel:
        return self.target.grammar.device

    def _verify_half(self, s: SpecDecodeInputs, read_done=None) -> Verified:
        """Snapshot the rows, draft, build the tree, verify, accept, publish the new lengths."""
        drafting = self._draft_start(s)
        if read_done is not None:
            read_done.record()
        for _ in range(1, self.tree.num_steps):
            drafting = self._draft_grow(self._draft_forward(drafting))
        return self._verify_accept(self._verify_forward(drafting))

    def _draft_start(self, s: SpecDecodeInputs) -> "Drafting":
        """Snapshot the rows; the first draft level from the stash (rank 0's tree is the tree:
        the draft runs on every rank)."""
        # The whole iteration reads the table through this snapshot, so the schedule side may
        # rewrite it as soon as the snapshot is taken.
        kv = KVRows.by_batch_index(self.target.req_to_token.table[s.rows, :s.width])
        bonus = self.future_map.resolve_input_ids(-s.rows)
        state = self.future_map.gather_draft_state(s.rows)
        k = self.tree.topk
        topk_p, topk_index = state.topk_p, state.topk_index
        if s.constrained:
            # The stashed first level was drafted before the last step's tokens reached the
            # matchers: draft it again from the stashed hidden state, under the committed masks.
            self._channel.signal()
            topk_p, topk_index = self.draft.model.topk(state.hidden, k,
                                                       bitmask=self._channel.masks(s.rows.shape[0]))
        builder = tree_ops.draft_builder(self.tree, topk_p, topk_index, state.hidden)
        branch_S = s.S.repeat_interleave(k) if self.tree.is_tree else s.S
        return self._level_drafted(Drafting(s, kv, bonus, builder, branch_S, 1))

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
        return d._replace(out_hidden=self.draft.forward(fb, parent_hidden))

    def _draft_grow(self, d: "Drafting"):
        """The next level from the forward's top-k (structured outputs: each frontier node
        drafts from the tokens its path allows)."""
        bitmask = self._channel.masks(d.branch_S.shape[0]) if d.inputs.constrained else None
        # A chain needs only each step's argmax, not its probability.
        d.builder.expand(*self.draft.model.topk(d.out_hidden, self.tree.topk, with_probs=self.tree.is_tree,
                                                bitmask=bitmask), d.out_hidden)
        return self._level_drafted(d._replace(step=d.step + 1, out_hidden=None))

    def _level_drafted(self, d: "Drafting"):
        """After a level: the Drafting of the next draft step, or after the last the Drafted
        tree. Constrained, the paths the next masks walk go to the grammar process before the
        forward that the masks wait for (it walks them while the forward runs)."""
        if d.step < self.tree.num_steps:
            if d.inputs.constrained:
                self._channel.signal(*d.builder.candidates())
            return d
        nodes = d.builder.finish()
        tp = self.target.model.tp
        nodes = tree_ops.DraftNodes(tp.broadcast(nodes.tokens.contiguous()),
                                    tp.broadcast(nodes.parents.contiguous()))
        tree = tree_ops.build_tree(nodes, d.bonus, d.inputs.S, self.tree)
        if d.inputs.constrained:  # node i may only become the target's choice allowed after its path
            self._channel.signal(tree.tokens, tree.parents)
        return Drafted(d.inputs, d.kv, tree)

    def _verify_forward(self, d: "Drafted") -> "Verifying":
        """One target forward over the tree's nodes, and their logits."""
        s, tree = d.inputs, d.tree
        bs, D = s.rows.shape[0], self.tree.num_draft_tokens
        loc = d.kv.table.gather(1, tree.slot_positions)
        fb = ForwardBatch(
            mode=ForwardMode.TARGET_VERIFY, input_ids=tree.tokens.reshape(-1),
            positions=tree.positions.reshape(-1), kv_rows=d.kv, prefix_lens=s.S,
            extend_lens_cpu=[D] * bs, out_cache_loc=loc.reshape(-1),
            seq_lens_cpu=_plus(s.seq_lens_cpu, D), max_seq_len=s.width,
            custom_mask=self._verify_mask(tree.mask),
            aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.runner.forward(fb)
        return Verifying(s, d.kv, tree, loc, self.target.model.compute_logits(hidden),
                         aux if self.aux_layers else hidden)

    def _verify_accept(self, v: "Verifying") -> Verified:
        """The target's token at every node (masked: inside the grammar), accept, publish."""
        s, tree, logits = v.inputs, v.tree, v.logits
        if s.constrained:
            logits = apply_token_bitmask(logits, self._channel.masks(logits.shape[0]))
        choice = self._target_tokens(logits, tree, s.rows, s.info)
        target_tokens = self.target.model.tp.broadcast(choice.tokens.contiguous())
        accept = tree_ops.accept(tree, target_tokens, self.spec.bench_force_accept_len, self.tree.num_steps)
        self.future_map.publish(s.rows, s.S + accept.lengths)
        if s.constrained:  # the matchers advance (and fill the next masks) during the draft-extend
            self._channel.signal(accept.tokens, accept.lengths)
        return Verified(s, v.kv, tree.slot_positions, v.loc, accept, choice, v.feats)

    def _extend_half(self, v: Verified) -> StepResult:
        """Compact the accepted path (tree), draft-extend over it, stash the next draft input."""
        s, accept = v.inputs, v.accept
        bs, D = s.rows.shape[0], self.tree.num_draft_tokens
        feats = v.feats
        if self.tree.is_tree:  # move the accepted path to the front of each request's block
            feats = tree_ops.compact_rows(feats.view(bs, D, -1), accept.path).reshape(bs * D, -1)
            self.target.runner.kv_pool.move_kv_cache(*tree_ops.compaction_moves(v.loc, accept))
        path_tokens = accept.tokens  # [bs, D]: tokens emitted along the path, then padding
        # The accepted path now sits at the verify nodes' row positions and slots (compacted).
        fb = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=path_tokens.reshape(-1),
            positions=v.chain_pos.reshape(-1), kv_rows=v.kv, prefix_lens=s.S,
            extend_lens_cpu=[D] * bs, out_cache_loc=v.loc.reshape(-1),
            seq_lens_cpu=_plus(s.seq_lens_cpu, D), max_seq_len=s.width)
        ext_hidden = self.draft.forward(fb, feats).view(bs, D, -1)
        last = accept.lengths - 1
        self._stash_draft_state(s.rows, ext_hidden[arange(bs, s.rows.device), last])
        self.future_map.stash_tokens(s.rows, path_tokens.gather(1, last[:, None]).squeeze(1))
        if s.info.any_penalty:
            for j in range(D):
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

    def _stash_draft_state(self, rows, last_hidden):
        topk_p, topk_index = self.draft.model.topk(last_hidden, self.tree.topk)
        self.future_map.stash_draft_state(rows, DraftState(topk_p, topk_index, last_hidden))

    # --- CUDA graphs -------------------------------------------------------------------------
    def enable_cuda_graphs(self, max_batch_size: int, width: int, constrained: bool = False,
                           sampled: bool = True) -> None:
        """Capture the greedy decode step per bucket; with `sampled` its sampled variants
        (temperature; temperature and top-k/top-p/min-p: the verify samples every node with
        the batch's per-row buffers) in the same memory pool; with `constrained` (the engine
        has a grammar process) the constrained step too, in that pool: the same two halves,
        with the signal and wait kernels inside."""
        device = self.target.ctx.device
        self.graphs = GraphedStep([self._verify_half, self._extend_half], self.graph_inputs(width),
                                  pad=GRAPH_PAD, max_batch_size=max_batch_size, device=device)
        self.graphs.capture_all("greedy speculative decode")
        if sampled:
            for variant in (SAMPLED, FILTERED):
                graphs = GraphedStep([self._verify_half, self._extend_half],
                                     self.graph_inputs(width, variant=variant), pad=GRAPH_PAD,
                                     max_batch_size=max_batch_size, device=device, pool=self.graphs.pool)
                graphs.capture_all(f"{variant} speculative decode")
                self.sampled_graphs[variant] = graphs
        if constrained:
            self.constrained_graphs = GraphedStep([self._verify_half, self._extend_half],
                                                  self.graph_inputs(width, constrained=True),
                                                  pad=GRAPH_PAD, max_batch_size=max_batch_size,
                                                  device=device, pool=self.graphs.pool)
            with self._channel.captured():
                self.constrained_graphs.capture_all("constrained speculative decode")
        self.extend_graphs = self.target.capture_extends(self.captured_extend_parts(width),
                                                               max_batch_size, width, self.graphs.pool)

    def graph_inputs(self, width: int, constrained: bool = False, variant: str = GREEDY):
        """make_inputs(bs) of the captured decode steps (constrained ones talk to the grammar
        process; `variant`: layers/sampler.py graph_sampling_info)."""
        device = self.target.ctx.device
        vocab_size = self.target.model.config.vocab_size

        def make_inputs(bs: int) -> SpecDecodeInputs:
            return SpecDecodeInputs(rows=torch.zeros(bs, dtype=torch.int64, device=device),
                                    S=torch.ones(bs, dtype=torch.int64, device=device),
                                    seq_lens_cpu=None, width=width,
                                    info=graph_sampling_info(bs, vocab_size, device, variant),
                                    constrained=constrained)

        return make_inputs

    def captured_extend_parts(self, width: int) -> list:
        """What a captured extend runs: the target half (then `publish_ready`), the draft half."""
        self.width = width
        return [self._captured_extend_target_half, self._captured_extend_draft_half]


def _plus(seq_lens_cpu: Optional[list[int]], n: int) -> Optional[list[int]]:
    return None if seq_lens_cpu is None else [s + n for s in seq_lens_cpu]
