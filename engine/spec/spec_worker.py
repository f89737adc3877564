"""The speculative worker, spec v2: a drafter (spec/drafter.py) beside one verifier
(spec/verifier.py), in the overlap loop's two halves.

Decode iteration: snapshot -> draft -> verify -> accept -> publish (`publish_ready`) ->
compact -> the drafter's after-verify -> outputs. The first half ends with the new lengths
published, so the host's next schedule overlaps the second. Prefill: the target's forward and
sample, publish, then the drafter's after-prefill. The host never waits inside either.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch

from specserve.engine.config import SpecConfig
from specserve.engine.forward_batch import KVRows
from specserve.engine.grammar.process import ONE, SPEC
from specserve.engine.layers.sampler import GREEDY, SAMPLED, FILTERED, graph_sampling_info, load_graph_sampling
from specserve.engine.runtime.cuda_graph import GraphedStep
from specserve.engine.runtime.captured_extend import (
    ExtendBucket, CapturedExtendInputs, extend_bucket, load_captured_extend, pack_captured_extend)
from specserve.engine.runtime.captured_mixed import mixed_bucket, replay_mixed
from specserve.engine.runtime.mixed_step import (DecodeRows, join_verify_result, logit_rows,
                                                 mixed_forward_batch, sample_chunks)
from specserve.engine.runtime.step import (DecodeStep, ExtendStep, Launched, MixedStep, StepResult,
                                           launch_forward)
from specserve.engine.runtime.worker import ForwardInputs, TargetModel, graphs_for, release_graphs
from specserve.engine.spec.drafter import CapturedExtendHalf, Drafter
from specserve.engine.spec.verifier import SpecDecodeInputs, Verified, Verifier, Verifying, plus


# Padded rows of a captured decode step: pool row 0, length 1 (they write nowhere that matters).
GRAPH_PAD = {"rows": 0, "S": 1}


class SpecExtendInputs(NamedTuple):
    target: ForwardInputs
    drafter: object             # the drafter's prefill_inputs


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
        graph replay, which reads the table itself: `read_done` follows it."""
        D = self.drafter.shape.num_draft_tokens
        rows = self.target.to_device(step.decode.rows)
        seq_lens, seq_lens_cpu = self.future_map.resolve_seq_lens(rows)
        c = self.target.extend_inputs(step.extend)
        bucket = None if self.mixed_graphs is None else mixed_bucket(
            D, len(step.decode.rows), c.extend_lens_cpu, self.drafter.shape.is_tree, self.mixed_graphs.buckets)
        chunks = SpecExtendInputs(c, self.drafter.prefill_inputs(step.extend))
        width = max(max(step.decode.allocated_lens), c.max_seq_len)
        inputs = SpecDecodeInputs(rows, seq_lens, seq_lens_cpu, width, step.decode.sampling)
        layers = self.drafter.feature_layers or ()
        publish_ready = self.future_map.new_publish_event()

        def body(read_done) -> StepResult:
            snap = self.verifier.snapshot(inputs)
            chunk_kv = self.target.req_to_token.table[c.rows, :width]
            if bucket is None:
                read_done.record()
            tree = self.verifier.tree_of(inputs, snap, self.drafter.draft(inputs, snap))
            n = rows.shape[0] * D
            loc = snap.kv.table.gather(1, tree.slot_positions)
            verify_rows = DecodeRows(tree.tokens.reshape(-1), tree.positions.reshape(-1), seq_lens,
                                     loc.reshape(-1), D, plus(seq_lens_cpu, D), tree.mask)
            if bucket is not None:
                hidden, aux = replay_mixed(self.mixed_graphs, bucket, verify_rows, rows, c)
                read_done.record()
            else:
                kv = KVRows.by_batch_index(torch.cat([snap.kv.table, chunk_kv]))
                hidden, aux = self.target.runner.forward(mixed_forward_batch(verify_rows, c, kv, width, layers))
            feats = aux if layers else hidden
            logits = self.target.model.compute_logits(hidden[logit_rows(n, c)])
            verified = self.verifier.accept(Verifying(inputs, snap.kv, tree, loc, logits[:n], feats[:n]))
            tokens = self.target.model.tp.broadcast(sample_chunks(logits[n:], c))
            self.future_map.stash_tokens(c.stash_rows, tokens)
            self.future_map.publish(c.stash_rows, c.prefix_lens + c.extend_lens)
            publish_ready.record()
            result = self._extend_half(verified)
            self.drafter.after_prefill(chunks.drafter, c, tokens, feats[n:], KVRows.by_batch_index(chunk_kv))
            return join_verify_result(result, tokens)

        return launch_forward(self.target.ctx, (inputs, chunks), body,
                              graph=0 if bucket is None else bucket.tokens)._replace(
            draft_depth=self.drafter.shape.num_steps)

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
        features the drafter reads, in the decode graphs' pool (after enable_cuda_graphs)."""
        self.mixed_graphs = self.target.capture_mixed(max_batch_size, width, self.drafter.feature_layers or (),
                                                      self.graphs.pool)

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
