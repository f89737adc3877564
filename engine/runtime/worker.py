"""The target model's forward-and-sample, and the plain (non-speculative) worker built on it.

A worker turns the scheduler's `ExtendStep` / `DecodeStep` into device inputs (on the schedule
side) and launches the forward (on the forward stream). `TargetModel` is the part both workers
share: one target forward that samples a token per request; the EAGLE worker composes it
with a draft model.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from specserve.engine.forward_batch import ForwardBatch, ForwardMode, KVRows
from specserve.engine.kvcache.pools import ReqToTokenPool
from specserve.engine.layers.sampler import SamplingInfo, sample
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.future_map import FutureMap
from specserve.engine.runtime.model_runner import ModelRunner
from specserve.engine.runtime.step import DecodeStep, ExtendStep, Launched, StepResult, launch_forward


class PresenceInit(NamedTuple):
    """Prefill: rows to clear in the penalty table, then (row, token) of every prompt token."""

    rows: torch.Tensor
    token_rows: torch.Tensor
    tokens: torch.Tensor


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
    presence_init: Optional[PresenceInit] = None


class Sampled(NamedTuple):
    tokens: torch.Tensor                  # [bs]
    logprobs: Optional[torch.Tensor]      # [bs] or None
    hidden: torch.Tensor                  # [T, H] the target's last hidden states
    aux_hidden: Optional[torch.Tensor]    # the outputs of aux_hidden_layers, when asked for


class GraphedDecodeInputs(NamedTuple):
    """The static inputs a captured plain decode step reads."""

    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    loc: torch.Tensor


class PresenceTable:
    """Tokens already in each request's sequence (for the repetition penalty), per pool row."""

    def __init__(self, num_rows: int, vocab_size: int, device):
        self.table = torch.zeros((num_rows + 1, vocab_size), dtype=torch.bool, device=device)

    def reset_and_mark(self, init: PresenceInit):
        self.table[init.rows] = False
        self.table[init.token_rows, init.tokens] = True

    def mark(self, rows: torch.Tensor, tokens: torch.Tensor):
        self.table[rows, tokens] = True


class TargetModel:
    """The target model with its request table, FutureMap and penalty table."""

    def __init__(self, runner: ModelRunner, ctx: DeviceContext, future_map: FutureMap,
                 req_to_token: ReqToTokenPool, presence: PresenceTable):
        self.runner = runner
        self.ctx = ctx
        self.future_map = future_map
        self.req_to_token = req_to_token
        self.presence = presence

    @property
    def model(self):
        return self.runner.model

    def to_device(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.ctx.device, non_blocking=True)

    def host_lens(self, lens: list[int]) -> Optional[list[int]]:
        """Host lengths only when some backend reads them (the FutureMap holds the decision)."""
        return lens if self.future_map.needs_cpu_seq_lens else None

    # --- schedule side: device inputs --------------------------------------------------------
    def extend_inputs(self, step: ExtendStep) -> ForwardInputs:
        ids, positions, sample_rows, prompt_rows, prompt_tokens = [], [], [], [], []
        for row, fill, (start, end), samples in zip(step.rows, step.fill_ids, step.chunks, step.samples):
            ids += fill[start:end]
            positions += range(start, end)
            sample_rows.append(len(ids) - 1)
            if samples:
                prompt_rows += [row] * len(fill)
                prompt_tokens += fill
        lens = [end - start for start, end in step.chunks]
        seq_lens = [end for _, end in step.chunks]
        rows = self.to_device(step.rows)
        presence_init = PresenceInit(rows, self.to_device(prompt_rows), self.to_device(prompt_tokens)) \
            if step.sampling.any_penalty else None
        return ForwardInputs(
            mode=ForwardMode.EXTEND, input_ids=self.to_device(ids), positions=self.to_device(positions),
            rows=rows, prefix_lens=self.to_device([start for start, _ in step.chunks]),
            extend_lens_cpu=lens, extend_lens=self.to_device(lens), out_cache_loc=step.out_cache_loc,
            seq_lens_cpu=self.host_lens(seq_lens), max_seq_len=max(seq_lens),
            sample_rows=self.to_device(sample_rows), sampling_info=step.sampling,
            stash_rows=self.to_device([r if s else 0 for r, s in zip(step.rows, step.samples)]),
            presence_init=presence_init)

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
            sampling_info=step.sampling, stash_rows=rows)

    # --- forward side -------------------------------------------------------------------------
    def forward_and_sample(self, inputs: ForwardInputs, read_done,
                           aux_hidden_layers: tuple[int, ...] = ()) -> Sampled:
        """Target forward over `inputs`, one token sampled per request."""
        info = inputs.sampling_info
        fb = ForwardBatch(
            mode=inputs.mode, input_ids=self.future_map.resolve_input_ids(inputs.input_ids),
            positions=inputs.positions, kv_rows=KVRows(self.req_to_token.table, inputs.rows),
            prefix_lens=inputs.prefix_lens, extend_lens_cpu=inputs.extend_lens_cpu,
            out_cache_loc=inputs.out_cache_loc, seq_lens_cpu=inputs.seq_lens_cpu,
            max_seq_len=inputs.max_seq_len, aux_hidden_layers=aux_hidden_layers)
        hidden, aux = self.runner.forward(fb, read_done=read_done)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        batch_index = torch.arange(len(inputs.extend_lens_cpu), device=logits.device)
        presence = None
        if info.any_penalty:
            if inputs.presence_init is not None:
                self.presence.reset_and_mark(inputs.presence_init)
            presence = self.presence.table[inputs.rows]
        tokens, logprobs = sample(logits, info, batch_index, inputs.positions[inputs.sample_rows] + 1,
                                  presence)
        tokens = self.model.tp.broadcast(tokens)
        if info.any_penalty:
            self.presence.mark(inputs.rows, tokens)
        self.future_map.stash_tokens(inputs.stash_rows, tokens)
        return Sampled(tokens, logprobs, hidden, aux)

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

    def slots_per_request(self) -> int:
        """KV slots a decode step needs past the committed length."""
        return 1

    def launch_extend(self, step: ExtendStep) -> Launched:
        inputs = self.target.extend_inputs(step)
        return launch_forward(self.target.ctx, inputs, lambda read_done: self._sample(inputs, read_done))

    def launch_decode(self, step: DecodeStep) -> Launched:
        inputs = self.target.decode_inputs(step)
        bs = len(step.rows)
        if not (self.graphs is not None and graphable(self.graphs, inputs.sampling_info, bs)):
            return launch_forward(self.target.ctx, inputs, lambda read_done: self._sample(inputs, read_done))

        def replay(read_done) -> StepResult:
            captured = self.graphs.load(ids=inputs.input_ids, positions=inputs.positions,
                                        rows=inputs.rows, loc=inputs.out_cache_loc)
            tokens = self.graphs.replay(captured, 0)
            read_done.record()
            return StepResult(tokens[:bs])

        return launch_forward(self.target.ctx, inputs, replay)

    def _sample(self, inputs: ForwardInputs, read_done) -> StepResult:
        sampled = self.target.forward_and_sample(inputs, read_done)
        return StepResult(sampled.tokens, sampled.logprobs)

    def enable_cuda_graphs(self, max_batch_size: int, width: int) -> None:
        from specserve.engine.runtime.cuda_graph import GraphedStep

        target = self.target
        device = target.ctx.device

        def make_inputs(bs: int) -> GraphedDecodeInputs:
            return GraphedDecodeInputs(*(torch.zeros(bs, dtype=torch.int64, device=device)
                                         for _ in GraphedDecodeInputs._fields))

        def decode_step(s: GraphedDecodeInputs) -> torch.Tensor:
            bs = s.rows.shape[0]
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=target.future_map.resolve_input_ids(s.ids),
                positions=s.positions, kv_rows=KVRows(target.req_to_token.table, s.rows),
                prefix_lens=s.positions, extend_lens_cpu=[1] * bs, out_cache_loc=s.loc,
                max_seq_len=width)
            hidden, _ = target.runner.forward(fb)
            tokens = target.model.tp.broadcast(target.model.compute_logits(hidden).argmax(-1))
            target.future_map.stash_tokens(s.rows, tokens)
            return tokens

        self.graphs = GraphedStep([decode_step], make_inputs, pad={}, max_batch_size=max_batch_size,
                                  device=device)
        self.graphs.capture_all()


def graphable(graphs, info: SamplingInfo, bs: int) -> bool:
    """Graphs cover greedy steps without per-token rules; the rest runs eagerly."""
    return (info.all_greedy and not (info.any_penalty or info.any_min_new or info.any_logprobs)
            and graphs.bucket_for(bs) is not None)


def greedy_sampling_info(bs: int, vocab_size: int, device) -> SamplingInfo:
    """The sampling info of an all-greedy batch (what CUDA graphs are captured with)."""
    from specserve.engine.config import SamplingParams

    return SamplingInfo.build([SamplingParams(temperature=0.0)] * bs, [0] * bs, [0] * bs, [], vocab_size, device)
