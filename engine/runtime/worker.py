"""The plain (non-speculative) worker: one target forward, sample, hand results back.

Everything inside `launch_*`'s closure runs on the forward stream; the scheduler only sees
the returned BatchResult, whose host tensors are valid after `copy_done`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from specserve.engine.layers.sampler import SamplingInfo, sample
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.engine.runtime.model_runner import ModelRunner
from specserve.engine.scheduler.future_map import FutureMap
from specserve.engine.scheduler.schedule_batch import BatchResult


@dataclass
class ForwardInputs:
    """Device tensors the scheduler prepared for one forward (allocation already done)."""

    mode: ForwardMode
    input_ids: torch.Tensor        # [T]; negative entries are FutureMap sentinels
    positions: torch.Tensor        # [T]
    req_pool_indices: torch.Tensor  # [bs]
    prefix_lens: torch.Tensor      # [bs]
    extend_lens_cpu: list[int]
    extend_lens: torch.Tensor      # [bs] the same on the device
    out_cache_loc: torch.Tensor    # [T]
    seq_lens_cpu: Optional[list[int]]
    max_seq_len: int
    sample_rows: torch.Tensor      # [bs] index (into T) of each request's last token
    sampling_info: SamplingInfo
    stash_rows: torch.Tensor       # [bs] rows whose sampled token goes to the FutureMap
    # Prefill: (rows to clear, then row and token id of every prompt token) for the penalty table
    presence_init: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    extras: dict = field(default_factory=dict)  # worker-specific inputs (EAGLE: shifted ids)


class PresenceTable:
    """Tokens already in each request's sequence (for the repetition penalty), per pool row."""

    def __init__(self, num_rows: int, vocab_size: int, device):
        self.table = torch.zeros((num_rows + 1, vocab_size), dtype=torch.bool, device=device)

    def reset_and_mark(self, rows: torch.Tensor, tokens_rows: torch.Tensor, tokens: torch.Tensor):
        self.table[rows] = False
        self.table[tokens_rows, tokens] = True

    def mark(self, rows: torch.Tensor, tokens: torch.Tensor):
        self.table[rows, tokens] = True


class NormalWorker:
    def __init__(self, runner: ModelRunner, ctx: DeviceContext, future_map: FutureMap,
                 req_to_token, presence: PresenceTable):
        self.runner = runner
        self.ctx = ctx
        self.future_map = future_map
        self.req_to_token = req_to_token
        self.presence = presence
        self.graphs = None  # GraphedStep once enable_cuda_graphs() ran

    def slots_per_request(self) -> int:
        """KV slots a decode step needs past the committed length."""
        return 1

    def launch(self, inputs: ForwardInputs) -> tuple[BatchResult, object]:
        """Returns (result, read_done event)."""
        read_done = self.ctx.new_event()
        result = BatchResult(copy_done=self.ctx.new_event(), token_ids=None)
        bs = len(inputs.extend_lens_cpu)
        use_graph = (self.graphs is not None and inputs.mode is ForwardMode.DECODE
                     and self.graphable(inputs.sampling_info, bs))

        def run():
            if use_graph:
                captured = self.graphs.load(dict(
                    ids=inputs.input_ids, positions=inputs.positions, rows=inputs.req_pool_indices,
                    loc=inputs.out_cache_loc))
                out = self.graphs.replay(captured, 0)
                read_done.record()
                self.finish(result, out["tokens"][:bs], None)
                return
            tokens, logprobs, _, _ = self.forward_and_sample(inputs, read_done)
            self.finish(result, tokens, logprobs)

        self.ctx.launch(run)
        return result, read_done

    def graphable(self, info: SamplingInfo, bs: int) -> bool:
        """Graphs cover greedy steps without per-token rules; the rest runs eagerly."""
        return (info.all_greedy and not (info.any_penalty or info.any_min_new or info.any_logprobs)
                and self.graphs.bucket_for(bs) is not None)

    def enable_cuda_graphs(self, max_batch_size: int, width: int) -> None:
        from specserve.engine.runtime.cuda_graph import GraphedStep

        device = self.req_to_token.table.device

        def make_inputs(bs):
            zeros = lambda: torch.zeros(bs, dtype=torch.int64, device=device)  # noqa: E731
            return dict(ids=zeros(), positions=zeros(), rows=zeros(), loc=zeros())

        def decode_step(s):
            bs = s["rows"].shape[0]
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=self.future_map.resolve_input_ids(s["ids"]),
                positions=s["positions"], req_pool_indices=s["rows"], prefix_lens=s["positions"],
                extend_lens_cpu=[1] * bs, out_cache_loc=s["loc"], req_to_token=self.req_to_token,
                kv_pool=None, attn_backend=None, max_seq_len=width)
            hidden, _ = self.runner.forward(fb)
            tokens = self.runner.model.tp.broadcast(self.runner.model.compute_logits(hidden).argmax(-1))
            self.future_map.stash_tokens(s["rows"], tokens)
            return {"tokens": tokens}

        self.graphs = GraphedStep([decode_step], make_inputs, pad={}, max_batch_size=max_batch_size,
                                  device=device)
        self.graphs.capture_all()

    def forward_and_sample(self, inputs: ForwardInputs, read_done, capture_aux: bool = False):
        """Target forward over `inputs`, one token sampled per request (forward stream).

        Returns (tokens [bs], logprobs [bs] or None, hidden [T, H], aux hidden or None)."""
        info = inputs.sampling_info
        input_ids = self.future_map.resolve_input_ids(inputs.input_ids)
        fb = ForwardBatch(
            mode=inputs.mode, input_ids=input_ids, positions=inputs.positions,
            req_pool_indices=inputs.req_pool_indices, prefix_lens=inputs.prefix_lens,
            extend_lens_cpu=inputs.extend_lens_cpu, out_cache_loc=inputs.out_cache_loc,
            req_to_token=self.req_to_token, kv_pool=None, attn_backend=None,
            seq_lens_cpu=inputs.seq_lens_cpu, max_seq_len=inputs.max_seq_len,
            capture_aux_hidden=capture_aux)
        hidden, aux = self.runner.forward(fb, read_done=read_done)
        logits = self.runner.model.compute_logits(hidden[inputs.sample_rows])
        rows = torch.arange(len(inputs.extend_lens_cpu), device=logits.device)
        presence = None
        if info.any_penalty:
            if inputs.presence_init is not None:
                self.presence.reset_and_mark(*inputs.presence_init)
            presence = self.presence.table[inputs.req_pool_indices]
        tokens, logprobs = sample(logits, info, rows, inputs.positions[inputs.sample_rows] + 1, presence)
        tokens = self.runner.model.tp.broadcast(tokens)
        if info.any_penalty:
            self.presence.mark(inputs.req_pool_indices, tokens)
        self.future_map.stash_tokens(inputs.stash_rows, tokens)
        return tokens, logprobs, hidden, aux

    def finish(self, result: BatchResult, tokens, logprobs, accept_lens=None) -> None:
        """Start the result copies to the host and mark them (forward stream)."""
        result.token_ids = self.ctx.to_host(tokens)
        result.logprobs = None if logprobs is None else self.ctx.to_host(logprobs)
        result.accept_lens = None if accept_lens is None else self.ctx.to_host(accept_lens)
        result.copy_done.record()


def greedy_sampling_info(bs: int, vocab_size: int, device) -> SamplingInfo:
    """The sampling info of an all-greedy batch (what CUDA graphs are captured with)."""
    from specserve.engine.config import SamplingParams

    return SamplingInfo.build([SamplingParams(temperature=0.0)] * bs, [0] * bs, [0] * bs, [], vocab_size, device)
