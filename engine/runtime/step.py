"""What passes between the scheduler and a worker: the schedule decision going in, the launched
forward and its host results coming back; and the one helper that launches a forward.

The scheduler decides on the host (which requests, which chunk, which KV slots) and hands a
worker an `ExtendStep` or a `DecodeStep`; the worker builds its own device inputs from it and
launches. A launch returns at once: the result is read after `copy_done`, and the scheduler
may rewrite the request table after `read_done`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from specserve.engine.layers.sampler import SamplingInfo
from specserve.engine.runtime.device import DeviceContext


class ExtendStep(NamedTuple):
    """Prefill chunks: request b feeds `fill_ids[b][start:end]` for its chunk (start, end)."""

    rows: list[int]                   # request-table row of each request
    fill_ids: list[list[int]]         # each request's tokens to prefill (prompt + outputs so far)
    chunks: list[tuple[int, int]]
    samples: list[bool]               # the chunk ends the request's prefill: sample its next token
    out_cache_loc: torch.Tensor       # KV slots of every chunk's tokens, in order (in the table)
    sampling: SamplingInfo
    prompt_lens: list[int]            # fill_ids[b][prompt_lens[b]:] are generated tokens
    # Prompt tokens [a, b) whose log-probabilities this chunk scores (token i from the row at
    # position i - 1), or None; and how many alternatives each request wants.
    prompt_spans: list[Optional[tuple[int, int]]]
    prompt_top_k: list[int]
    grammar: Optional[tuple] = None   # constrained: per row the request's grammar key (or None)


class DecodeStep(NamedTuple):
    """One decode (or speculative) step over running requests."""

    rows: list[int]
    # Host view of each request's committed KV length; plain decoding commits the token this
    # step feeds when it schedules the step, speculative decoding only when results arrive.
    committed_lens: list[int]
    allocated_lens: list[int]         # slots each request's row holds after this step's reservation
    out_cache_loc: torch.Tensor       # the slots reserved by this step, in order
    sampling: SamplingInfo
    grammar: Optional[tuple] = None   # constrained: per row the request's grammar key (or None)


class MixedStep(NamedTuple):
    """Decode (or speculative verify) rows and prefill chunks that ride in one target forward
    (runtime/mixed_step.py): the decode rows come first in the batch, then the chunks. Each
    part has its own SamplingInfo (the decode part's is the one the plain decode steps reuse)."""

    decode: DecodeStep
    extend: ExtendStep


class StepResult(NamedTuple):
    """A forward's outputs: on the device inside the forward, on the host after `copy_done`."""

    token_ids: torch.Tensor                   # [bs] or, speculative, [bs, num_draft_tokens]
    logprobs: Optional[torch.Tensor] = None   # same shape as token_ids
    accept_lens: Optional[torch.Tensor] = None  # speculative: tokens emitted per request
    top_ids: Optional[torch.Tensor] = None    # token_ids' shape + [K]: the top_logprobs tokens
    top_logprobs: Optional[torch.Tensor] = None
    # Prefill: the scored prompt tokens of ExtendStep.prompt_spans, concatenated in batch order.
    prompt_logprobs: Optional[torch.Tensor] = None   # [P]
    prompt_top_ids: Optional[torch.Tensor] = None    # [P, K]
    prompt_top_logprobs: Optional[torch.Tensor] = None


class PendingResult:
    """The host copy of a StepResult, set once by the forward; read it after `copy_done`."""

    def __init__(self, copy_done):
        self.copy_done = copy_done
        self._host: Optional[StepResult] = None

    def set(self, host: StepResult) -> None:
        self._host = host

    def wait(self) -> StepResult:
        self.copy_done.synchronize()
        return self._host


class Launched(NamedTuple):
    result: PendingResult
    read_done: Any      # event: the forward no longer reads the request table
    inputs: Any         # device tensors the forward reads, held until the result is processed
    draft_depth: int = 0  # draft levels a request that the step verifies (a tree's depth; 0: no drafts)
    # The captured bucket it replays: a decode step's batch size, an extend's or a mixed step's
    # tokens (T); 0: eager (the step log shows it, scheduler/step_log.py).
    graph: int = 0


class Worker(Protocol):
    """What the scheduler and the engine need of a worker (NormalWorker, spec/spec_worker.py SpecWorker)."""

    graphs: Any  # the captured CUDA graphs (GraphedStep), or None
    sampled_graphs: dict  # variant (layers/sampler.py: SAMPLED, FILTERED) -> its graphs; {} without
    constrained_graphs: dict  # those of batches with a grammar, by sampling variant
    extend_graphs: Any  # the captured extends (runtime/captured_extend.py), or None
    mixed_graphs: Any  # the captured mixed forwards (runtime/captured_mixed.py), or None
    target: Any  # its TargetModel (the engine scores prompts through it)

    def slots_per_request(self) -> int:
        """KV slots a decode step needs past a request's committed length."""

    def launch_extend(self, step: ExtendStep) -> Launched: ...

    def launch_decode(self, step: DecodeStep) -> Launched: ...

    def mixed_row_tokens(self) -> int:
        """Tokens a decode row adds to a mixed step's forward (1, or the verify width); 0: the
        worker runs no mixed steps (its attention backend cannot)."""

    def launch_mixed(self, step: MixedStep) -> Launched: ...

    def capture_mixed(self, max_batch_size: int, width: int) -> None:
        """Capture the mixed steps' forwards, after enable_cuda_graphs (workers with
        mixed_row_tokens > 0)."""

    def enable_cuda_graphs(self, max_batch_size: int, width: int, constrained: bool = False) -> None: ...

    def release_graphs(self) -> None: ...


def launch_forward(ctx: DeviceContext, inputs: Any,
                   body: Callable[[Any], StepResult], graph: int = 0) -> Launched:
    """Run `body(read_done)` on the forward stream and copy its StepResult to the host.

    `body` records `read_done` once it no longer reads the request table; `graph`: the bucket
    it replays (Launched.graph)."""
    read_done = ctx.new_event()
    result = PendingResult(ctx.new_event())

    def run():
        out = body(read_done)
        result.set(StepResult(*(None if t is None else ctx.to_host(t) for t in out)))
        result.copy_done.record()

    ctx.launch(run)
    return Launched(result, read_done, inputs, graph=graph)
