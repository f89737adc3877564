"""The target model's forward-and-sample, and the plain (non-speculative) worker built on it.

A worker turns the scheduler's `ExtendStep` / `DecodeStep` into device inputs (on the schedule
side) and launches the forward (on the forward stream). `TargetModel` is the part both workers
share: one target forward that samples a token per request; the EAGLE worker composes it
with a draft model.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows
from specserve.engine.grammar.bitmask import apply_token_bitmask
from specserve.engine.grammar.process import ONE, GrammarService
from specserve.engine.host_copy import to_device
from specserve.engine.kvcache.pools import ReqToTokenPool
from specserve.engine.layers.argmax import argmax_last_dim
from specserve.engine.layers.sampler import (FILTERED, GREEDY, SAMPLED, SamplingInfo, TokenChoice,
                                             TokenHistory, graph_sampling_info, graph_variant,
                                             load_graph_sampling, sample, scored_logprobs)
from specserve.engine.runtime.cuda_graph import GraphedStep
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.future_map import FutureMap
from specserve.engine.runtime.model_runner import ModelRunner
from specserve.engine.runtime.captured_extend import (
    ExtendBucket, CapturedExtendInputs, extend_bucket, extend_buckets, load_captured_extend,
    make_captured_extend_inputs, pack_captured_extend)
from specserve.engine.runtime.captured_mixed import (
    MixedForwardOut, SharedOutputs, make_mixed_inputs, mixed_bucket, mixed_buckets, mixed_outputs, replay_mixed)
from specserve.engine.runtime.mixed_step import (DecodeRows, join_decode_result, logit_rows, mixed_forward_batch,
                                                 sample_chunks)
from specserve.engine.runtime.step import (DecodeStep, ExtendStep, Launched, MixedStep, StepResult,
                                           launch_forward)


class HistoryInit(NamedTuple):
    """Prefill: rows to clear in the history table, then (row, token) of every prefilled token
    and (row, token) of the generated ones among them (a prefill after a retraction)."""

    rows: torch.Tensor
    token_rows: torch.Tensor
    tokens: torch.Tensor
    output_rows: torch.Tensor
    output_tokens: torch.Tensor


class PromptScore(NamedTuple):
    """Prompt tokens a prefill scores: the row (into T) before each, and the token itself."""

    rows: torch.Tensor      # [P]
    targets: torch.Tensor   # [P]
    top_k: int              # the batch's largest prompt_logprobs


class ForwardInputs(NamedTuple):
    """Device inputs of one target forward that samples a token per request."""

    mode: ForwardMode
    input_ids: torch.Tensor        # [T]; negative entries are FutureMap sentinels
    positions: torch.Tensor        # [T]
    rows: torch.Tensor             # [bs] request-table rows
    prefix_lens: torch.Tensor      # [bs]
    extend_lens_cpu: list[int]
    extend_lens: torch.Tensor      # [bs] the same on the device
    out_cache_loc: torch.Tensor    # [T]
    seq_lens_cpu: Optional[list[int]]
    max_seq_len: int
    sample_rows: torch.Tensor      # [bs] index (into T) of each request's last token
    sampling_info: SamplingInfo
    stash_rows: torch.Tensor       # [bs] rows whose sampled token goes to the FutureMap
    history_init: Optional[HistoryInit] = None
    prompt_score: Optional[PromptScore] = None
    # Structured outputs: the request (key) of each row with a grammar (grammar/process.py).
    grammar: Optional[tuple] = None


class Sampled(NamedTuple):
    choice: TokenChoice                   # [bs] tokens, their logprobs and top alternatives
    hidden: torch.Tensor                  # [T, H] the target's last hidden states
    aux_hidden: Optional[torch.Tensor]    # the outputs of aux_hidden_layers, when asked for
    prompt: tuple                         # (logprobs, top ids, top logprobs), or three Nones

    @property
    def tokens(self) -> torch.Tensor:
        return self.choice.tokens

    def step_result(self) -> StepResult:
        c = self.choice
        return StepResult(c.tokens, c.logprobs, None, c.top_ids, c.top_logprobs, *self.prompt)


class GraphedDecodeInputs(NamedTuple):
    """The static inputs a captured plain decode step reads."""

    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    loc: torch.Tensor


class SampledDecodeInputs(NamedTuple):
    """The static inputs a captured sampled decode step reads: GraphedDecodeInputs' and the
    per-row sampling buffers (layers/sampler.py graph_sampling_info)."""

    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    loc: torch.Tensor
    info: SamplingInfo


class HistoryTable:
    """Per pool row, what the penalties read (TokenHistory): the tokens in the request's
    sequence and how often each was generated. Kept only while a batch has a penalty."""

    def __init__(self, num_rows: int, vocab_size: int, device):
        self.in_sequence = torch.zeros((num_rows + 1, vocab_size), dtype=torch.bool, device=device)
        self.output_counts = torch.zeros((num_rows + 1, vocab_size), dtype=torch.int32, device=device)

    def reset_and_mark(self, init: HistoryInit):
        self.in_sequence[init.rows] = False
        self.output_counts[init.rows] = 0
        self.in_sequence[init.token_rows, init.tokens] = True
        self.output_counts.index_put_((init.output_rows, init.output_tokens),
                                      torch.ones_like(init.output_tokens, dtype=torch.int32),
                                      accumulate=True)

    def of_rows(self, rows: torch.Tensor) -> TokenHistory:
        return TokenHistory(self.in_sequence[rows], self.output_counts[rows])

    def mark(self, rows: torch.Tensor, tokens: torch.Tensor, keep: Optional[torch.Tensor] = None):
        """Record a generated token per row (where `keep`, when given)."""
        keep = torch.ones_like(tokens, dtype=torch.bool) if keep is None else keep
        self.in_sequence[rows, tokens] |= keep
        self.output_counts.index_put_((rows, tokens), keep.to(torch.int32), accumulate=True)


class TargetModel:
    """The target model with its request table, FutureMap and penalty table."""

    def __init__(self, runner: ModelRunner, ctx: DeviceContext, future_map: FutureMap,
                 req_to_token: ReqToTokenPool, history: HistoryTable):
        self.runner = runner
        self.ctx = ctx
        self.future_map = future_map
        self.req_to_token = req_to_token
        self.history = history
        self.grammar: Optional[GrammarService] = None  # the engine's grammar process, if any

    def plan_grammar(self, kind: str, rows: int, keys: Optional[tuple]) -> None:
        """Tell the grammar process what a constrained step being launched holds (nothing for
        an unconstrained one)."""
        if keys is not None:
            self.grammar.plan(kind, rows, keys)

    @property
    def model(self):
        return self.runner.model

    def to_device(self, values, dtype=torch.int64) -> torch.Tensor:
        """Host values on the device, copied asynchronously (engine/host_copy.py)."""
        return to_device(values, dtype, self.ctx.device)

    def host_lens(self, lens: list[int]) -> Optional[list[int]]:
        """Host lengths only when some backend reads them (the FutureMap holds the decision)."""
        return lens if self.future_map.needs_cpu_seq_lens else None

    # --- schedule side: device inputs --------------------------------------------------------
    def extend_inputs(self, step: ExtendStep) -> ForwardInputs:
        ids, positions, sample_rows, fill_rows, fill_tokens, out_rows, out_tokens = ([] for _ in range(7))
        score_rows, score_targets = [], []
        for row, fill, (start, end), samples, prompt_len, span in zip(
                step.rows, step.fill_ids, step.chunks, step.samples, step.prompt_lens, step.prompt_spans):
            if span is not None:  # token i is scored from the row at position i - 1
                score_rows += range(len(ids) + span[0] - 1 - start, len(ids) + span[1] - 1 - start)
                score_targets += fill[span[0]:span[1]]
            ids += fill[start:end]
            positions += range(start, end)
            sample_rows.append(len(ids) - 1)
            if samples:
                fill_rows += [row] * len(fill)
                fill_tokens += fill
                out_rows += [row] * (len(fill) - prompt_len)
                out_tokens += fill[prompt_len:]
        lens = [end - start for start, end in step.chunks]
        seq_lens = [end for _, end in step.chunks]
        rows = self.to_device(step.rows)
        history_init = HistoryInit(rows, self.to_device(fill_rows), self.to_device(fill_tokens),
                                   self.to_device(out_rows), self.to_device(out_tokens)) \
            if step.sampling.any_penalty else None
        prompt_score = PromptScore(self.to_device(score_rows), self.to_device(score_targets),
                                   max(step.prompt_top_k)) if score_rows else None
        return ForwardInputs(
            mode=ForwardMode.EXTEND, input_ids=self.to_device(ids), positions=self.to_device(positions),
            rows=rows, prefix_lens=self.to_device([start for start, _ in step.chunks]),
            extend_lens_cpu=lens, extend_lens=self.to_device(lens), out_cache_loc=step.out_cache_loc,
            seq_lens_cpu=self.host_lens(seq_lens), max_seq_len=max(seq_lens),
            sample_rows=self.to_device(sample_rows), sampling_info=step.sampling,
            stash_rows=self.to_device([r if s else 0 for r, s in zip(step.rows, step.samples)]),
            history_init=history_init, prompt_score=prompt_score,
            grammar=step.grammar)

    def decode_inputs(self, step: DecodeStep) -> ForwardInputs:
        """The fed token sits at index committed_len - 1 (the host committed it at schedule
        time); its id is the FutureMap sentinel -row, its KV goes to the reserved slot."""
        positions = [n - 1 for n in step.committed_lens]
        rows = self.to_device(step.rows)
        return ForwardInputs(
            mode=ForwardMode.DECODE, input_ids=-rows, positions=self.to_device(positions),
            rows=rows, prefix_lens=self.to_device(positions), extend_lens_cpu=[1] * len(step.rows),
            extend_lens=torch.ones_like(rows), out_cache_loc=step.out_cache_loc,
            seq_lens_cpu=self.host_lens(step.committed_lens), max_seq_len=max(step.committed_lens),
            sample_rows=torch.arange(len(step.rows), device=self.ctx.device),
            sampling_info=step.sampling, stash_rows=rows,
            grammar=step.grammar)

    # --- forward side -------------------------------------------------------------------------
    def forward_and_sample(self, inputs: ForwardInputs, read_done,
                           aux_hidden_layers: tuple[int, ...] = ()) -> Sampled:
        """Target forward over `inputs`, one token sampled per request."""
        info = inputs.sampling_info
        channel = None if inputs.grammar is None else self.grammar.device
        if channel is not None:  # the grammar process fills the committed masks during the forward
            channel.signal()
        fb = ForwardBatch(
            mode=inputs.mode, input_ids=self.future_map.resolve_input_ids(inputs.input_ids),
            positions=inputs.positions, kv_rows=KVRows(self.req_to_token.table, inputs.rows),
            prefix_lens=inputs.prefix_lens, extend_lens_cpu=inputs.extend_lens_cpu,
            out_cache_loc=inputs.out_cache_loc, seq_lens_cpu=inputs.seq_lens_cpu,
            max_seq_len=inputs.max_seq_len, aux_hidden_layers=aux_hidden_layers)
        hidden, aux = self.runner.forward(fb, read_done=read_done)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        choice = self.choose(logits, info, inputs.rows, inputs.positions[inputs.sample_rows] + 1, channel,
                             inputs.history_init)
        choice = choice._replace(tokens=self.model.tp.broadcast(choice.tokens))
        self.chosen(choice.tokens, inputs.stash_rows, info, channel)
        prompt = (None, None, None)
        if inputs.prompt_score is not None:
            score = inputs.prompt_score
            prompt = scored_logprobs(self.model.compute_logits(hidden[score.rows]), score.targets,
                                     score.top_k)
        return Sampled(choice, hidden, aux, prompt)

    def choose(self, logits: torch.Tensor, info: SamplingInfo, rows: torch.Tensor, positions: torch.Tensor,
               channel=None, history_init=None) -> TokenChoice:
        """One token per logits row (request-table `rows`, the sampled tokens' `positions`),
        before the ranks agree on it: within the grammar's masks (`channel`: a constrained
        step's, waited for here), penalised by the history table (its rows reset from
        `history_init` first), by the sampling rules."""
        if channel is not None:
            logits = apply_token_bitmask(logits, channel.masks(logits.shape[0]))
        history = None
        if info.any_penalty:
            if history_init is not None:
                self.history.reset_and_mark(history_init)
            history = self.history.of_rows(rows)
        return sample(logits, info, torch.arange(logits.shape[0], device=logits.device), positions, history)

    def chosen(self, tokens: torch.Tensor, stash_rows: torch.Tensor, info: SamplingInfo, channel=None) -> None:
        """The rows' tokens, as the ranks agreed on them: marked for the penalties (a prefill
        chunk that samples nothing marks row 0), stashed for the next step, told to the
        grammar process (its matchers advance)."""
        if info.any_penalty:
            self.history.mark(stash_rows, tokens)
        self.future_map.stash_tokens(stash_rows, tokens)
        if channel is not None:
            channel.signal(tokens)

    def captured_forward(self, s, width: int, aux_hidden_layers: tuple[int, ...] = (),
                         mode: ForwardMode = ForwardMode.EXTEND):
        """The target forward over a captured bucket's static inputs (CapturedExtendInputs or
        MixedGraphInputs): its entries, lengths on the device, `max_chunk` the host bound of
        each and `width` of every row. Returns (hidden, aux hidden)."""
        fb = ForwardBatch(
            mode=mode, input_ids=s.ids, positions=s.positions,
            kv_rows=KVRows(self.req_to_token.table, s.rows), prefix_lens=s.prefix_lens,
            extend_lens_cpu=[s.max_chunk] * s.rows.shape[0], extend_lens=s.extend_lens,
            out_cache_loc=s.loc, max_seq_len=width, aux_hidden_layers=aux_hidden_layers)
        return self.runner.forward(fb)

    def captured_extend(self, s: CapturedExtendInputs, width: int, aux_hidden_layers: tuple[int, ...] = ()):
        """A captured extend (runtime/captured_extend.py): the greedy token of each sampled
        request's last token, stashed. Returns (tokens [R], hidden, aux hidden)."""
        hidden, aux = self.captured_forward(s, width, aux_hidden_layers)
        tokens = self.model.tp.broadcast(argmax_last_dim(self.model.compute_logits(hidden[s.last])))
        self.future_map.stash_tokens(s.sampled_rows, tokens)
        return tokens, hidden, aux

    def capture_extends(self, parts, max_requests: int, width: int, pool) -> Optional[GraphedStep]:
        """GraphedStep of `parts` over the extend buckets, where the attention reads device
        extend lengths (the draft's backend is of the target's kind: builder.py). In the decode
        graphs' `pool`: one step replays at a time, and each consumes its outputs within it."""
        buckets = extend_buckets(max_requests, width)
        if not (buckets and self.runner.attn_backend.supports_device_extend_lens):
            return None
        device = self.ctx.device
        graphs = GraphedStep(parts, lambda bucket: make_captured_extend_inputs(bucket, device), pad={},
                             max_batch_size=None, device=device, buckets=buckets, pool=pool)
        graphs.capture_all("extends")
        return graphs

    def capture_mixed(self, max_entries: int, width: int, aux_hidden_layers: tuple[int, ...],
                      pool, outputs: SharedOutputs, draft_part=None) -> Optional[GraphedStep]:
        """GraphedStep of the mixed steps' target forward over the mixed buckets
        (runtime/captured_mixed.py), writing (hidden, aux) into `outputs` (the buffer they
        share), and with `draft_part` (a drafter's, reading the MixedForwardOut) a second
        graph; None where the attention cannot run it from device lengths. In `pool` (the
        decode graphs'), or None: a pool of their own."""
        backend = self.runner.attn_backend
        if not (backend.supports_mixed_forward and backend.supports_device_extend_lens):
            return None
        buckets = mixed_buckets(max_entries, width)

        def forward(s):
            return MixedForwardOut(s, *outputs.write(*self.captured_forward(s, width, aux_hidden_layers,
                                                                            ForwardMode.MIXED)))

        device = self.ctx.device
        parts = [forward] if draft_part is None else [forward, draft_part]
        graphs = GraphedStep(parts, lambda bucket: make_mixed_inputs(bucket, device), pad={},
                             max_batch_size=None, device=device, buckets=buckets, pool=pool)
        graphs.capture_all("mixed steps")
        return graphs

    def prompt_logits(self, token_ids: list[int], row: int, slots: torch.Tensor) -> torch.Tensor:
        """Float32 logits [len, vocab] of one sequence prefilled into `row` / `slots`."""
        n = len(token_ids)
        holder = []
        done = self.ctx.new_event()

        def run():
            fb = ForwardBatch(
                mode=ForwardMode.EXTEND, input_ids=self.to_device(token_ids),
                positions=torch.arange(n, device=self.ctx.device),
                kv_rows=KVRows(self.req_to_token.table, self.to_device([row])),
                prefix_lens=torch.zeros(1, dtype=torch.int64, device=self.ctx.device),
                extend_lens_cpu=[n], out_cache_loc=slots, seq_lens_cpu=[n], max_seq_len=n)
            hidden, _ = self.runner.forward(fb)
            holder.append(self.model.compute_logits(hidden).cpu())
            done.record()

        self.ctx.launch(run)
        done.synchronize()
        return holder[0]


class NormalWorker:
    """Plain decoding: one target forward per step."""

    def __init__(self, target: TargetModel):
        self.target = target
        self.graphs = None  # GraphedStep once enable_cuda_graphs() ran
        self.sampled_graphs: dict[str, GraphedStep] = {}  # SAMPLED / FILTERED -> GraphedStep
        # GREEDY / SAMPLED / FILTERED -> GraphedStep of constrained decodes (with a grammar process)
        self.constrained_graphs: dict[str, GraphedStep] = {}
        self.extend_graphs = None  # GraphedStep of extends (runtime/captured_extend.py)
        self.mixed_graphs = None  # GraphedStep of mixed forwards (runtime/captured_mixed.py)
        self.mixed_wrap_graphs: dict[tuple[str, bool], GraphedStep] = {}  # none: a plain mixed step samples eagerly

    def slots_per_request(self) -> int:
        """KV slots a decode step needs past the committed length."""
        return 1

    def launch_extend(self, step: ExtendStep) -> Launched:
        bucket = None if self.extend_graphs is None else extend_bucket(step, self.extend_graphs.buckets)
        if bucket is not None:
            return self._replay_captured_extend(step, bucket)
        inputs = self.target.extend_inputs(step)
        self.target.plan_grammar(ONE, len(step.rows), step.grammar)
        return launch_forward(self.target.ctx, inputs, lambda read_done: self._sample(inputs, read_done))

    def _replay_captured_extend(self, step: ExtendStep, bucket: ExtendBucket) -> Launched:
        captured = self.extend_graphs.captured[bucket]
        packed = pack_captured_extend(step, bucket, next_tokens=False)
        bs = len(step.rows)

        def replay(read_done) -> StepResult:
            load_captured_extend(captured.inputs, packed, step.out_cache_loc)
            tokens = self.extend_graphs.replay(captured, 0)
            read_done.record()
            return StepResult(tokens[:bs])

        return launch_forward(self.target.ctx, (packed, step.out_cache_loc), replay, graph=bucket.tokens)

    def mixed_row_tokens(self) -> int:
        return 1 if self.target.runner.attn_backend.supports_mixed_forward else 0

    def launch_mixed(self, step: MixedStep) -> Launched:
        """One decode token per decode row and the prefill chunks in one forward
        (runtime/mixed_step.py). The decode rows sample as a decode step's: with a grammar,
        a constrained decode step's for the grammar process (ONE over the decode rows:
        signal, their masks, their tokens), with penalties from the history table, with
        logprobs where asked (the chunks' rows padded); the chunks sample plainly."""
        target = self.target
        decode, chunks = target.decode_inputs(step.decode), target.extend_inputs(step.extend)
        bs = len(step.decode.rows)
        bucket = None if self.mixed_graphs is None else \
            mixed_bucket(1, bs, chunks.extend_lens_cpu, False, self.mixed_graphs.buckets)
        target.plan_grammar(ONE, bs, step.decode.grammar)
        channel = None if step.decode.grammar is None else target.grammar.device
        info = decode.sampling_info

        def body(read_done) -> StepResult:
            if channel is not None:  # the grammar process fills the masks during the forward
                channel.signal()
            rows = DecodeRows(target.future_map.resolve_input_ids(decode.input_ids), decode.positions,
                              decode.prefix_lens, decode.out_cache_loc, 1, decode.seq_lens_cpu)
            if bucket is not None:
                hidden, _ = replay_mixed(self.mixed_graphs, bucket, rows, decode.rows, chunks)
                read_done.record()
            else:
                kv = KVRows(target.req_to_token.table, torch.cat([decode.rows, chunks.rows]))
                fb = mixed_forward_batch(rows, chunks, kv, max(decode.max_seq_len, chunks.max_seq_len))
                hidden, _ = target.runner.forward(fb, read_done=read_done)
            logits = target.model.compute_logits(hidden[logit_rows(bs, chunks)])
            decoded = target.choose(logits[:bs], info, decode.rows, decode.positions + 1, channel)
            # One broadcast for both parts' tokens (the ranks agree on them at once).
            tokens = target.model.tp.broadcast(torch.cat([decoded.tokens, sample_chunks(logits[bs:], chunks)]))
            target.chosen(tokens[:bs], decode.stash_rows, info, channel)
            target.future_map.stash_tokens(chunks.stash_rows, tokens[bs:])
            decoded = StepResult(tokens[:bs], decoded.logprobs, None, decoded.top_ids, decoded.top_logprobs)
            return join_decode_result(decoded, tokens[bs:])

        return launch_forward(target.ctx, (decode, chunks), body, graph=0 if bucket is None else bucket.tokens)

    def launch_decode(self, step: DecodeStep) -> Launched:
        inputs = self.target.decode_inputs(step)
        bs = len(step.rows)
        info = inputs.sampling_info
        graphs = graphs_for(self, info, step.grammar is not None, bs)
        if graphs is None:
            self.target.plan_grammar(ONE, bs, step.grammar)
            return launch_forward(self.target.ctx, inputs, lambda read_done: self._sample(inputs, read_done))
        bucket = graphs.bucket_for(bs)
        self.target.plan_grammar(ONE, bucket, step.grammar)

        def replay(read_done) -> StepResult:
            captured = graphs.load(ids=inputs.input_ids, positions=inputs.positions,
                                   rows=inputs.rows, loc=inputs.out_cache_loc)
            if not info.all_greedy:
                load_graph_sampling(captured.inputs.info, info, bs)
            tokens = graphs.replay(captured, 0)
            read_done.record()
            return StepResult(tokens[:bs])

        return launch_forward(self.target.ctx, inputs, replay, graph=bucket)

    def _sample(self, inputs: ForwardInputs, read_done) -> StepResult:
        return self.target.forward_and_sample(inputs, read_done).step_result()

    def enable_cuda_graphs(self, max_batch_size: int, width: int, constrained: bool = False,
                           sampled: bool = True) -> None:
        """Capture the greedy decode per bucket; with `sampled` the sampled variants
        (temperature; temperature and top-k/top-p/min-p) in the same memory pool; with
        `constrained` (the engine has a grammar process) a constrained variant of each in that
        pool too, whose signal and wait kernels talk to the grammar process: the unconstrained
        graphs apply no mask."""
        device = self.target.ctx.device
        forward, pick, constrained_step = self.decode_parts(width)
        # variant -> (its last op, make_inputs(bs) of its static inputs)
        variants = {GREEDY: (pick, graph_decode_inputs(device))}
        if sampled:
            vocab_size = self.target.model.config.vocab_size
            pick_sampled = self.sampled_pick()
            for variant in (SAMPLED, FILTERED):
                def make_inputs(bs, make=graph_decode_inputs(device), variant=variant):
                    return SampledDecodeInputs(*make(bs), graph_sampling_info(bs, vocab_size, device, variant))

                variants[variant] = (pick_sampled, make_inputs)
        for variant, (pick_tokens, make_inputs) in variants.items():
            graphs = GraphedStep([lambda s, pick_tokens=pick_tokens: pick_tokens(forward(s))], make_inputs,
                                 pad={}, max_batch_size=max_batch_size, device=device,
                                 pool=None if self.graphs is None else self.graphs.pool)
            graphs.capture_all(f"{variant} decode")
            if variant == GREEDY:
                self.graphs = graphs
            else:
                self.sampled_graphs[variant] = graphs
        if constrained:
            with self.target.grammar.device.captured():
                for variant, (pick_tokens, make_inputs) in variants.items():
                    graphs = GraphedStep([functools.partial(constrained_step, pick_tokens=pick_tokens)],
                                         make_inputs, pad={}, max_batch_size=max_batch_size, device=device,
                                         pool=self.graphs.pool)
                    graphs.capture_all(f"constrained {variant} decode")
                    self.constrained_graphs[variant] = graphs
        self.extend_graphs = self.target.capture_extends(self.captured_extend_parts(width),
                                                               max_batch_size, width, self.graphs.pool)

    def capture_mixed(self, max_batch_size: int, width: int) -> None:
        """Capture the mixed steps' forwards (runtime/captured_mixed.py), in the decode graphs'
        pool (after enable_cuda_graphs)."""
        self.mixed_graphs = self.target.capture_mixed(max_batch_size, width, (), self.graphs.pool,
                                                      mixed_outputs(max_batch_size))

    def release_graphs(self) -> None:
        release_graphs(self)

    def decode_parts(self, width: int):
        """(forward, pick, constrained_step) of a captured greedy decode: the forward's logits,
        the argmax token (stashed in the FutureMap), and a whole constrained step: signal the
        grammar process, forward, wait for the committed masks, masked pick (`pick_tokens`:
        argmax, or a sampled variant's), signal its tokens."""
        target = self.target

        def forward(s: GraphedDecodeInputs) -> tuple[GraphedDecodeInputs, torch.Tensor]:
            bs = s.rows.shape[0]
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=target.future_map.resolve_input_ids(s.ids),
                positions=s.positions, kv_rows=KVRows(target.req_to_token.table, s.rows),
                prefix_lens=s.positions, extend_lens_cpu=[1] * bs, out_cache_loc=s.loc,
                max_seq_len=width)
            hidden, _ = target.runner.forward(fb)
            return s, target.model.compute_logits(hidden)

        def pick(x: tuple[GraphedDecodeInputs, torch.Tensor]) -> torch.Tensor:
            s, logits = x
            tokens = target.model.tp.broadcast(argmax_last_dim(logits))
            target.future_map.stash_tokens(s.rows, tokens)
            return tokens

        def constrained_step(s: GraphedDecodeInputs, pick_tokens=pick) -> torch.Tensor:
            channel = target.grammar.device
            channel.signal()
            s, logits = forward(s)
            tokens = pick_tokens((s, apply_token_bitmask(logits, channel.masks(logits.shape[0]))))
            channel.signal(tokens)
            return tokens

        return forward, pick, constrained_step

    def sampled_pick(self):
        """The sampled variants' last op: sample() as the eager decode calls it (no history,
        no logprobs: those batches stay eager), the tokens stashed in the FutureMap."""
        target = self.target

        def pick(x: tuple[SampledDecodeInputs, torch.Tensor]) -> torch.Tensor:
            s, logits = x
            batch_index = torch.arange(logits.shape[0], device=logits.device)
            choice = sample(logits, s.info, batch_index, s.positions + 1)
            tokens = target.model.tp.broadcast(choice.tokens)
            target.future_map.stash_tokens(s.rows, tokens)
            return tokens

        return pick

    def captured_extend_parts(self, width: int) -> list:
        """What a captured extend runs: the target forward and its greedy tokens."""
        return [lambda s: self.target.captured_extend(s, width)[0]]


def graph_decode_inputs(device):
    """make_inputs(bs) of the captured plain decodes."""
    return lambda bs: GraphedDecodeInputs(*(torch.zeros(bs, dtype=torch.int64, device=device)
                                            for _ in GraphedDecodeInputs._fields))


def release_graphs(worker) -> None:
    """Free a worker's captured graphs (engine shutdown)."""
    for graphs in (worker.graphs, *worker.sampled_graphs.values(), *worker.constrained_graphs.values(),
                   worker.extend_graphs, worker.mixed_graphs, *worker.mixed_wrap_graphs.values()):
        if graphs is not None:
            graphs.release()


def graphs_for(worker, info: SamplingInfo, constrained: bool, bs: int) -> Optional[GraphedStep]:
    """The captured variant (worker.graphs, .sampled_graphs[...], .constrained_graphs[...]) that
    runs exactly the sampling ops the eager step would for this batch, or None: eager.
    Penalties, logit_bias, min_new_tokens and logprobs stay eager (layers/sampler.py
    graph_variant)."""
    variant = graph_variant(info)
    if variant is None:
        return None
    if constrained:
        graphs = worker.constrained_graphs.get(variant)
    else:
        graphs = worker.graphs if variant == GREEDY else worker.sampled_graphs.get(variant)
    return graphs if graphs is not None and graphs.bucket_for(bs) is not None else None
