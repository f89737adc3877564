"""The speculative worker, spec v2: a drafter (spec/drafter.py) beside one verifier
(spec/verifier.py), in the overlap loop's two halves.

Decode iteration: snapshot -> draft -> verify -> accept -> publish (`publish_ready`) ->
compact -> the drafter's after-verify -> outputs. The first half ends with the new lengths
published, so the host's next schedule overlaps the second. Prefill: the target's forward and
sample, publish, then the drafter's after-prefill. The host never waits inside either.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch

from specserve.engine.aranges import arange
from specserve.engine.config import SpecConfig
from specserve.engine.forward_batch import KVRows
from specserve.engine.grammar.process import ONE, SPEC
from specserve.engine.layers.sampler import (GREEDY, SAMPLED, FILTERED, graph_sampling_info, graph_variant,
                                             load_graph_sampling)
from specserve.engine.runtime.cuda_graph import GraphedStep
from specserve.engine.runtime.captured_extend import (
    ExtendBucket, CapturedExtendInputs, extend_bucket, load_captured_extend, pack_captured_extend)
from specserve.engine.runtime.captured_mixed import (SharedOutputs, load_mixed_draft, mixed_bucket, mixed_outputs,
                                                    replay_mixed)
from specserve.engine.runtime.mixed_step import (DecodeRows, join_verify_result, logit_rows,
                                                 mixed_forward_batch, sample_chunks)
from specserve.engine.runtime.step import (DecodeStep, ExtendStep, Launched, MixedStep, StepResult,
                                           launch_forward)
from specserve.engine.runtime.worker import ForwardInputs, TargetModel, graphs_for, release_graphs
from specserve.engine.spec.drafter import CapturedExtendHalf, Drafter, MixedDraftExtend
from specserve.engine.spec.tree import Tree
from specserve.engine.spec.verifier import Snapshot, SpecDecodeInputs, Verified, Verifier, Verifying, plus


# Padded rows of a captured decode step: pool row 0, length 1 (they write nowhere that matters).
GRAPH_PAD = {"rows": 0, "S": 1}
# Chunks whose logits a mixed wrap's accept computes in the verify rows' GEMM (one read of the
# LM head, ~0.3 ms at 8B, not two); a step of more computes its chunks' logits after it.
CHUNK_LOGIT_ROWS = 16


class SpecExtendInputs(NamedTuple):
    target: ForwardInputs
    drafter: object             # the drafter's prefill_inputs


class MixedDraft(NamedTuple):
    """A mixed step's decode rows drafted (the output of the mixed wrap's first graph)."""

    inputs: SpecDecodeInputs
    kv: KVRows                  # the snapshot of the decode rows, by batch index
    tree: Tree
    loc: torch.Tensor           # [bs, D] the verify nodes' KV slots

    def verify_rows(self, bs: int, S: torch.Tensor, seq_lens_cpu: Optional[list[int]]) -> DecodeRows:
        """The first `bs` rows (a graph's bucket pads past them) as the mixed forward's rows."""
        tree = self.tree
        return DecodeRows(tree.tokens[:bs].reshape(-1), tree.positions[:bs].reshape(-1), S,
                          self.loc[:bs].reshape(-1), tree.tokens.shape[1], seq_lens_cpu,
                          None if tree.mask is None else tree.mask[:bs])


class SpecWorker:
    def __init__(self, target: TargetModel, drafter: Drafter, spec: SpecConfig):
        self.target = target
        self.drafter = drafter
        self.spec = spec
        self.future_map = target.future_map
        self.verifier = Verifier(target, drafter.shape, drafter.feature_layers or (),
                                 spec.bench_force_accept_len)
        self.graphs = None  # GraphedStep once enable_cuda_graphs() ran
        # GREEDY / SAMPLED / FILTERED -> GraphedStep of constrained steps (with a grammar process)
        self.constrained_graphs: dict[str, GraphedStep] = {}
        self.sampled_graphs: dict[str, GraphedStep] = {}  # SAMPLED / FILTERED -> GraphedStep
        self.extend_graphs = None  # GraphedStep of extends (runtime/captured_extend.py)
        self.mixed_graphs = None  # GraphedStep of mixed forwards (runtime/captured_mixed.py)
        # (GREEDY / SAMPLED / FILTERED, constrained) -> GraphedStep of the mixed steps' draft,
        # accept and outputs, per decode-batch bucket (`capture_mixed`; `mixed_wrap_parts`)
        self.mixed_wrap_graphs: dict[tuple[str, bool], GraphedStep] = {}
        self.mixed_outputs: Optional[SharedOutputs] = None  # what the mixed forwards write
        self.mixed_snapshot: Optional[torch.Tensor] = None  # [rows, width]: the wrap's snapshot
        # The drafter's draft-extend inside the mixed graphs, where it has one (chain)
        self.mixed_draft_extend: Optional[MixedDraftExtend] = None
        # [CHUNK_LOGIT_ROWS] the chunks' last tokens the wrap's accept takes logits of, and the
        # buffer it writes them to
        self.mixed_chunk_rows: Optional[torch.Tensor] = None
        self.mixed_chunk_logits: Optional[SharedOutputs] = None

    def slots_per_request(self) -> int:
        return self.spec.kv_reserve_per_request

    # --- prefill ---------------------------------------------------------------------------
    def launch_extend(self, step: ExtendStep) -> Launched:
        bucket = None if self.extend_graphs is None else extend_bucket(step, self.extend_graphs.buckets)
        if bucket is not None:
            return self._replay_captured_extend(step, bucket)
        target = self.target.extend_inputs(step)
        inputs = SpecExtendInputs(target, self.drafter.prefill_inputs(step))
        self.target.plan_grammar(ONE, len(step.rows), step.grammar)
        publish_ready = self.future_map.new_publish_event()
        layers = self.drafter.feature_layers or ()

        def body(read_done) -> StepResult:
            sampled = self.target.forward_and_sample(target, read_done, layers)
            self.future_map.publish(target.stash_rows, target.prefix_lens + target.extend_lens)
            publish_ready.record()
            self.drafter.after_prefill(inputs.drafter, target, sampled.tokens,
                                       sampled.aux_hidden if layers else sampled.hidden,
                                       KVRows(self.target.req_to_token.table, target.rows))
            return sampled.step_result()

        return launch_forward(self.target.ctx, inputs, body)

    # --- mixed: verify rows and prefill chunks in one target forward --------------------------
    def mixed_row_tokens(self) -> int:
        return (self.drafter.shape.num_draft_tokens
                if self.target.runner.attn_backend.supports_mixed_forward else 0)

    def launch_mixed(self, step: MixedStep) -> Launched:
        """Draft the decode rows, then one target forward over their verify nodes and the
        chunks (runtime/mixed_step.py), then accept and finish each part as its own step does.
        The chunks' table rows are read through a snapshot taken with the decode rows'. Where
        a bucket holds the step (chain; runtime/captured_mixed.py) the target forward is a
        graph replay, which reads the table itself: `read_done` follows it. Around it, where
        the decode rows' sampling has a captured variant, the draft, the accept and the
        outputs replay the mixed wrap's graphs (`capture_mixed`), and a draft model's
        draft-extend of both parts the mixed graphs' second part; the chunks' sampling runs
        eagerly between them (their logits come from the accept's GEMM). Decode rows with a
        grammar make the verify rows a constrained decode step's for the grammar process (SPEC
        over the decode rows, or the wrap's bucket: the draft, the tree and the accept signal
        and wait as in `launch_decode`), in the wrap's constrained variants where the engine
        serves grammars."""
        D = self.drafter.shape.num_draft_tokens
        bs = len(step.decode.rows)
        rows = self.target.to_device(step.decode.rows)
        seq_lens, seq_lens_cpu = self.future_map.resolve_seq_lens(rows)
        c = self.target.extend_inputs(step.extend)
        constrained = step.decode.grammar is not None
        bucket = None if self.mixed_graphs is None else mixed_bucket(
            D, bs, c.extend_lens_cpu, self.drafter.shape.is_tree, self.mixed_graphs.buckets)
        wrap = None if bucket is None else self.mixed_wrap_graphs.get((graph_variant(step.decode.sampling),
                                                                      constrained))
        self.target.plan_grammar(SPEC, bs if wrap is None else wrap.bucket_for(bs), step.decode.grammar)
        # Both parts' draft-extends as the mixed graphs' second part (it reads the table: then
        # `read_done` follows it).
        fused = wrap is not None and self.mixed_draft_extend is not None
        chunks = SpecExtendInputs(c, self.drafter.prefill_inputs(step.extend))
        width = max(max(step.decode.allocated_lens), c.max_seq_len)
        inputs = SpecDecodeInputs(rows, seq_lens, seq_lens_cpu, width, step.decode.sampling, constrained)
        layers = self.drafter.feature_layers or ()
        publish_ready = self.future_map.new_publish_event()
        n = bs * D

        def body(read_done) -> StepResult:
            chunk_kv = None if fused else self.target.req_to_token.table[c.rows, :width]
            if wrap is not None:
                captured = wrap.load(rows=rows, S=seq_lens)
                if not step.decode.sampling.all_greedy:
                    load_graph_sampling(captured.inputs.info, step.decode.sampling, bs)
                drafted = wrap.replay(captured, 0)
            else:
                snap = self.verifier.snapshot(inputs)
                if bucket is None:
                    read_done.record()
                drafted = self._mixed_draft(inputs, snap)
            verify_rows = drafted.verify_rows(bs, seq_lens, plus(seq_lens_cpu, D))
            if bucket is not None:
                hidden, aux = replay_mixed(self.mixed_graphs, bucket, verify_rows, rows, c)
                if not fused:
                    read_done.record()
            else:
                kv = KVRows.by_batch_index(torch.cat([drafted.kv.table, chunk_kv]))
                hidden, aux = self.target.runner.forward(mixed_forward_batch(verify_rows, c, kv, width, layers))
            feats = aux if layers else hidden
            if wrap is not None:
                k = c.sample_rows.shape[0]
                if k <= CHUNK_LOGIT_ROWS:
                    self._load_chunk_logit_rows(c.sample_rows + n)
                verified = wrap.replay(captured, 1)
                chunk_logits = self.mixed_chunk_logits.read(k)[0] if k <= CHUNK_LOGIT_ROWS else \
                    self.target.model.compute_logits(hidden[c.sample_rows + n])
            else:
                logits = self.target.model.compute_logits(hidden[logit_rows(n, c)])
                verified = self._mixed_accept(drafted, logits[:n], feats[:n])
                chunk_logits = logits[n:]
            tokens = self.target.model.tp.broadcast(sample_chunks(chunk_logits, c))
            self.future_map.stash_tokens(c.stash_rows, tokens)
            self.future_map.publish(c.stash_rows, c.prefix_lens + c.extend_lens)
            publish_ready.record()
            if wrap is None:
                result = self._extend_half(verified)
            else:
                out = wrap.replay(captured, 2)
                result = StepResult(out.token_ids[:bs], None, out.accept_lens[:bs])
            if fused:
                self._replay_mixed_draft_extend(bucket, verified, rows, chunks, tokens)
                read_done.record()
            else:
                self.drafter.after_prefill(chunks.drafter, c, tokens, feats[n:], KVRows.by_batch_index(chunk_kv))
            return join_verify_result(result, tokens)

        return launch_forward(self.target.ctx, (inputs, chunks), body,
                              graph=0 if bucket is None else bucket.tokens)._replace(
            draft_depth=self.drafter.shape.num_steps)

    def _load_chunk_logit_rows(self, rows: torch.Tensor) -> None:
        """The chunks' last tokens (indices into the mixed forward's outputs) whose logits the
        wrap's accept computes with the verify rows'; the rest of the rows: token 0."""
        k = rows.shape[0]
        self.mixed_chunk_rows[:k].copy_(rows)
        self.mixed_chunk_rows[k:].zero_()

    def _replay_mixed_draft_extend(self, bucket: ExtendBucket, v: Verified, rows: torch.Tensor,
                                   chunks: SpecExtendInputs, tokens: torch.Tensor) -> None:
        """The mixed graphs' second part: the draft-extend of the verify rows' emitted tokens
        (each row's draft state read at its last accepted node) and of the chunks (at their
        last token, which carries the sampled one where the prefill ends) in one forward."""
        bs, D = rows.shape[0], self.drafter.shape.num_draft_tokens
        c = chunks.target
        captured = self.mixed_graphs.captured[bucket]
        chunk_ids = self.mixed_draft_extend.chunk_ids(chunks.drafter, c, tokens)
        load_mixed_draft(captured.inputs, [v.accept.tokens[:bs].reshape(-1), chunk_ids],
                         torch.cat([rows, c.stash_rows]),
                         torch.cat([arange(bs, rows.device) * D + v.last[:bs], c.sample_rows + bs * D]))
        self.mixed_graphs.replay(captured, 1)

    def _mixed_draft(self, s: SpecDecodeInputs, snap: Snapshot) -> MixedDraft:
        """A mixed step's decode rows drafted: the verify tree and its nodes' KV slots."""
        tree = self.verifier.tree_of(s, snap, self.drafter.draft(s, snap))
        return MixedDraft(s, snap.kv, tree, snap.kv.table.gather(1, tree.slot_positions))

    def _mixed_accept(self, d: MixedDraft, logits: torch.Tensor, feats: torch.Tensor) -> Verified:
        """Accept and publish the verify rows from the mixed forward's logits and features."""
        return self.verifier.accept(Verifying(d.inputs, d.kv, d.tree, d.loc, logits, feats))

    def mixed_wrap_parts(self) -> list:
        """The mixed wrap's three graphs (`capture_mixed`): the draft (its snapshot into the
        one buffer they share), the accept from the shared outputs of the mixed forward's
        replay, which puts the verify nodes first (their features too), with the logits of
        the chunks' last tokens (`mixed_chunk_rows`) in the same GEMM, and the outputs
        (without a draft-extend in the mixed graphs: the decode step's own second half)."""
        layers = self.drafter.feature_layers or ()

        def draft(s: SpecDecodeInputs) -> MixedDraft:
            return self._mixed_draft(s, self.verifier.snapshot(s, self.mixed_snapshot))

        def accept(d: MixedDraft) -> Verified:
            n = d.loc.numel()
            hidden, aux = self.mixed_outputs.read(self.mixed_outputs.max_tokens)
            logits = self.target.model.compute_logits(
                hidden[torch.cat([arange(n, hidden.device), self.mixed_chunk_rows])])
            self.mixed_chunk_logits.write(logits[n:], None)
            return self._mixed_accept(d, logits[:n], (aux if layers else hidden)[:n])

        # The verify rows' draft-extend runs in the mixed graphs' second part where the drafter
        # has one (`_replay_mixed_draft_extend`): then the last part only stashes and outputs
        # (a chain's compaction is nothing).
        return [draft, accept, self._extend_half if self.mixed_draft_extend is None else self.verifier.outputs]

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

        return launch_forward(self.target.ctx, (packed, step.out_cache_loc), replay, graph=bucket.tokens)

    def _captured_extend_target_half(self, width: int, s: CapturedExtendInputs) -> CapturedExtendHalf:
        layers = self.drafter.feature_layers or ()
        tokens, hidden, aux = self.target.captured_extend(s, width, layers)
        self.future_map.publish(s.sampled_rows, s.sampled_seq_lens)
        return CapturedExtendHalf(s, tokens, aux if layers else hidden)

    # --- decode ----------------------------------------------------------------------------
    def launch_decode(self, step: DecodeStep, refresh: Sequence[int] = ()) -> Launched:
        """The host does not know the lengths after the in-flight verify: the FutureMap has
        them on the device, and the over-reserved slots cover whatever they turn out to be.
        `refresh`: the batch indices whose last step was plain and left the drafter's state to
        refresh first (adaptive speculation; spec/drafter.py `refreshes_state`)."""
        rows = self.target.to_device(step.rows)
        seq_lens, seq_lens_cpu = self.future_map.resolve_seq_lens(rows)
        bs = len(step.rows)
        refresh_rows = self.target.to_device([step.rows[i] for i in refresh]) if refresh else None
        refresh_lens = None if seq_lens_cpu is None else [seq_lens_cpu[i] for i in refresh]
        constrained = step.grammar is not None
        inputs = SpecDecodeInputs(rows, seq_lens, seq_lens_cpu, max(step.allocated_lens), step.sampling,
                                  constrained)
        publish_ready = self.future_map.new_publish_event()
        graphs = graphs_for(self, step.sampling, constrained, bs)
        use_graph = graphs is not None
        bucket = graphs.bucket_for(bs) if use_graph else 0  # 0: eager (Launched.graph)
        self.target.plan_grammar(SPEC, bucket or bs, step.grammar)

        def body(read_done) -> StepResult:
            if refresh_rows is not None:
                self.drafter.refresh(refresh_rows, refresh_lens, inputs.width)
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

        return launch_forward(self.target.ctx, inputs, body,
                              graph=bucket)._replace(
            draft_depth=self.drafter.shape.num_steps)

    def _verify_half(self, s: SpecDecodeInputs, read_done=None) -> Verified:
        """Snapshot the rows, draft, verify, accept, publish the new lengths."""
        snap = self.verifier.snapshot(s)
        if read_done is not None:
            read_done.record()
        return self.verifier.verify(s, snap, self.drafter.draft(s, snap))

    def _extend_half(self, v: Verified) -> StepResult:
        """Compact the accepted path (tree), the drafter's state for the next step, outputs."""
        v = self.verifier.compact(v)
        self.drafter.after_verify(v)
        return self.verifier.outputs(v)

    # --- CUDA graphs -------------------------------------------------------------------------
    def enable_cuda_graphs(self, max_batch_size: int, width: int, constrained: bool = False,
                           sampled: bool = True, pool=None, extends: bool = True) -> None:
        """Capture the greedy decode step per bucket; with `sampled` its sampled variants
        (temperature; temperature and top-k/top-p/min-p: the verify samples every node with
        the batch's per-row buffers) in the same memory pool; with `constrained` (the engine
        has a grammar process) the constrained step too, in that pool: the same two halves,
        with the signal and wait kernels inside. `pool`: another worker's graphs' (adaptive
        speculation: one step replays at a time); `extends`: capture extends too."""
        device = self.target.ctx.device
        self.graphs = GraphedStep(self.decode_parts(), self.graph_inputs(width),
                                  pad=GRAPH_PAD, max_batch_size=max_batch_size, device=device, pool=pool)
        self.graphs.capture_all("greedy speculative decode")
        if sampled:
            for variant in (SAMPLED, FILTERED):
                graphs = GraphedStep(self.decode_parts(), self.graph_inputs(width, variant=variant), pad=GRAPH_PAD,
                                     max_batch_size=max_batch_size, device=device, pool=self.graphs.pool)
                graphs.capture_all(f"{variant} speculative decode")
                self.sampled_graphs[variant] = graphs
        if constrained:
            with self.target.grammar.device.captured():
                for variant in (GREEDY, *self.sampled_graphs):
                    graphs = GraphedStep(self.decode_parts(),
                                         self.graph_inputs(width, constrained=True, variant=variant),
                                         pad=GRAPH_PAD, max_batch_size=max_batch_size, device=device,
                                         pool=self.graphs.pool)
                    graphs.capture_all(f"constrained {variant} speculative decode")
                    self.constrained_graphs[variant] = graphs
        parts = self.captured_extend_parts(width) if extends else None
        if parts is not None:
            self.extend_graphs = self.target.capture_extends(parts, max_batch_size, width, self.graphs.pool)

    def capture_mixed(self, max_batch_size: int, width: int) -> None:
        """Capture the mixed steps' target forwards (runtime/captured_mixed.py), with the
        features the drafter reads (after enable_cuda_graphs); then their wrap per
        decode-batch bucket, as the decode graphs are (greedy and the sampled variants the
        decode graphs have, and their constrained ones where the engine serves grammars; chain
        drafting: tree verify rows run their mixed steps eagerly), and a draft model's
        draft-extend of both parts as the mixed graphs' second part. Eagerly these were ~400
        host launches a step (draft steps, accept, draft-extends), which on an H200 at 64
        streams held the scheduler thread inside a launch for up to a step's time. Every wrap
        bucket snapshots into one buffer, and reads the forward's outputs from the buffer the
        mixed forwards share.

        With a wrap the mixed forwards take a memory pool of their own. Graphs that share a
        pool may reuse each other's transients only if they replay in the order they were
        captured, one finished before the next starts; a mixed step replays the wrap's draft,
        then the mixed forward, then the wrap's accept and outputs, then the mixed draft-extend,
        so in one pool the forwards (captured first) overwrote the draft's and the accept's
        outputs placed in their freed transients: garbage tokens and lost KV slots on an H100,
        where the tests' eager stand-in, which has no pool, passed."""
        device = self.target.ctx.device
        D = self.drafter.shape.num_draft_tokens
        chain = not self.drafter.shape.is_tree
        draft = self.drafter.captured_mixed_part(width) if chain else None
        self.mixed_outputs = mixed_outputs(max_batch_size * D)
        self.mixed_graphs = self.target.capture_mixed(max_batch_size, width, self.drafter.feature_layers or (),
                                                      None if chain else self.graphs.pool, self.mixed_outputs,
                                                      None if draft is None else draft.part)
        if self.mixed_graphs is None or not chain:
            return
        self.mixed_draft_extend = draft
        self.mixed_snapshot = self.target.req_to_token.table.new_zeros((max_batch_size, width))
        self.mixed_chunk_rows = torch.zeros(CHUNK_LOGIT_ROWS, dtype=torch.int64, device=device)
        self.mixed_chunk_logits = SharedOutputs(CHUNK_LOGIT_ROWS)

        def capture(variant: str, constrained: bool) -> None:
            graphs = GraphedStep(self.mixed_wrap_parts(), self.graph_inputs(width, constrained, variant),
                                 pad=GRAPH_PAD, max_batch_size=max_batch_size, device=device, pool=self.graphs.pool)
            graphs.capture_all(f"{'constrained ' if constrained else ''}{variant} mixed step draft and accept")
            self.mixed_wrap_graphs[variant, constrained] = graphs

        for variant in (GREEDY, *self.sampled_graphs):
            capture(variant, False)
        if self.constrained_graphs:  # the engine serves grammars: decode rows with one ride too
            with self.target.grammar.device.captured():
                for variant in self.constrained_graphs:
                    capture(variant, True)

    def decode_parts(self) -> list:
        """A decode step's two halves (each a CUDA graph when captured)."""
        return [self._verify_half, self._extend_half]

    def release_graphs(self) -> None:
        release_graphs(self)

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

    def captured_extend_parts(self, width: int):
        """What a captured extend runs: the target half (then `publish_ready`), the drafter's
        part; None when the drafter has none (its extends stay eager)."""
        part = self.drafter.captured_extend_part(width)
        if part is None:
            return None
        return [functools.partial(self._captured_extend_target_half, width), part]
