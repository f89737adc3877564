"""Adaptive speculation (`SpecConfig.adaptive`, chain or tree drafting): each decode step's
draft shape chosen by spec/adaptive.py's `ShapePolicy` from the batch size and the measured
acceptance.

One `SpecWorker` per shape (`adaptive_shapes`: plain, and at depths 1, about half num_steps
and num_steps the chain of that depth and, with a tree config of width k, the tree of width
k) over the same target, the same drafter state (`Drafter.at_shape` shares it) and the
deepest widest's KV reservation, with CUDA graphs for every shape in one memory pool. PLAIN
is a plain step through the verify path (one node: the bonus token); a draft model's drafter
then only stores the row's draft KV (spec/drafter.py `refreshes_state`: its attention, MLP and
LM head cost a plain step 5-7 % at the 8B shape), and the first deeper step of those rows
refreshes their drafter state first (one draft forward of the kept rows, a CUDA graph per
bucket), so every shape drafts from the state a full draft extend would have left. The choice
never changes a request's tokens: every shape's verifier accepts the target's own.
Constrained batches run at the configured tree (the grammar process walks a fixed draft
shape); prefills run on the deepest widest worker (their drafter bookkeeping does not depend
on the shape).

With tensor parallelism every rank must choose the same shape (the ranks run the same graphs
in step): acceptance is the same on every rank (the tokens are), but wall times are not, so
rank 0's start-up table is every rank's (`measure_step_times`' `agree`) and its step times
reach the tables as a control message at the start of the next step, applied there on every
rank alike (engine/tp.py ObservedStepTimes), never in between.

Acceptance reaches the policy, per request row and per draft width (a chain and a tree accept
differently), when the scheduler reads a step's result (the host has it then: no sync added);
a row starts from each width's pooled rate when a prefill ends into it, and a drafting step
relaxes the other widths' rates toward their priors (spec/adaptive.py observe_acceptance: a
width no longer chosen is tried again). So does the step's wall time (host clocks only: from
its launch, or the previous result read if later, to its read), which refines the start-up
table (spec/adaptive.py ShapePolicy). The step times are measured once, after the graphs are
captured (`measure_step_times`): each shape's step replayed on its static inputs per
batch-size bucket (eagerly, off CUDA, at the smallest and largest bucket).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from specserve.engine.config import SpecConfig
from specserve.engine.runtime.step import DecodeStep, ExtendStep, Launched, PendingResult, StepResult
from specserve.engine.runtime.worker import TargetModel
from specserve.engine.spec.adaptive import (PLAIN, AcceptanceEstimate, DraftShape, ShapePolicy, StepTimes,
                                             level_prior, observe_acceptance)
from specserve.engine.spec.drafter import Drafter
from specserve.engine.spec.spec_worker import SpecWorker

MEASURE_REPEATS = 3
DRAFT_PRIOR = 0.5  # a draft's acceptance before any was measured (a chain's per-level prior)


def adaptive_shapes(spec: SpecConfig) -> tuple[DraftShape, ...]:
    """The draft shapes adaptive speculation chooses among (each has its graphs), cheapest
    first: plain, and at each depth d of 1, about half num_steps and num_steps the chain of d
    drafts (where its d + 1 nodes fit num_draft_tokens: the verify's workspace is sized for
    those) and, with a tree config (topk k > 1), the tree of width k."""
    shapes = {PLAIN}
    for depth in {1, (spec.num_steps + 1) // 2, spec.num_steps}:
        if depth + 1 <= spec.num_draft_tokens:
            shapes.add(DraftShape(depth, 1))
        if spec.topk > 1:
            shapes.add(DraftShape(depth, spec.topk))
    return tuple(sorted(shapes))


class ObservedResult:
    """A step's PendingResult whose host read is also reported: `on_read(result, read_at)`
    (perf_counter seconds)."""

    def __init__(self, pending: PendingResult, on_read: Callable[[StepResult, float], None]):
        self.pending = pending
        self.on_read = on_read

    @property
    def copy_done(self):
        return self.pending.copy_done

    def wait(self) -> StepResult:
        result = self.pending.wait()
        self.on_read(result, time.perf_counter())
        return result


class StepObservation(NamedTuple):
    """A chosen step's wall time (ShapePolicy.observe's arguments)."""

    batch_size: int
    shape: DraftShape
    seconds: float


class AdaptiveSpecWorker:
    def __init__(self, target: TargetModel, drafter: Drafter, spec: SpecConfig):
        self.target = target
        self.drafter = drafter
        self.spec = spec
        self.workers = {shape: SpecWorker(target, drafter.at_shape(*shape), spec)
                        for shape in adaptive_shapes(spec)}
        self.configured = DraftShape(spec.num_steps, spec.topk)
        self.deepest = self.workers[self.configured]  # the deepest, widest
        # Per width: a never-tried tree starts at its `level_prior`.
        self.estimates = {width: AcceptanceEstimate(target.req_to_token.num_rows,
                                                    prior=level_prior(DRAFT_PRIOR, width))
                          for width in sorted({shape.width for shape in self.workers})}
        self.policy: Optional[ShapePolicy] = None  # once measure_step_times ran
        self.shape_steps: collections.Counter[DraftShape] = collections.Counter()  # decode steps run per shape
        self._last_read = 0.0  # perf_counter of the last step result read
        # tp > 1: rank 0's step times, for the next step's control message (the others' unused).
        tp = target.model.tp
        self._share_times = tp.size > 1
        self._record_times = tp.rank == 0
        self._observed: list[StepObservation] = []
        # Rows whose last decode step was plain, while the drafter `refreshes_state`: a deeper
        # step refreshes their drafter state first.
        self._stale_rows: set[int] = set()

    # What the engine reads of a worker: the deepest's (it runs prefills and constrained steps).
    @property
    def graphs(self):
        return self.deepest.graphs

    @property
    def sampled_graphs(self) -> dict:
        return self.deepest.sampled_graphs

    @property
    def constrained_graphs(self):
        return self.deepest.constrained_graphs

    @property
    def extend_graphs(self):
        return self.deepest.extend_graphs

    mixed_graphs = None  # no mixed steps (mixed_row_tokens)

    def slots_per_request(self) -> int:
        return self.deepest.slots_per_request()

    def launch_extend(self, step: ExtendStep) -> Launched:
        prefilled = [row for row, samples in zip(step.rows, step.samples) if samples]
        for estimate in self.estimates.values():
            estimate.reset(prefilled)
        self._stale_rows.difference_update(step.rows)  # a prefill stashes a whole state
        launched = self.deepest.launch_extend(step)
        return launched._replace(result=ObservedResult(launched.result, self._read_extend))

    def _read_extend(self, result: StepResult, read_at: float) -> None:
        self._last_read = read_at

    def mixed_row_tokens(self) -> int:
        """No mixed steps: prompts get extends of their own (each shape's step times are
        measured for decode batches alone, which a riding prompt would skew)."""
        return 0

    def launch_decode(self, step: DecodeStep) -> Launched:
        policy = None if step.grammar is not None else self.policy  # the policy's own choice
        shape = self.configured if policy is None else policy.choose(step.rows)
        self.shape_steps[shape] += 1
        refresh = []
        if self.drafter.refreshes_state:
            if shape.depth == 0:
                self._stale_rows.update(step.rows)
            elif self._stale_rows:  # (a run of deeper steps finds none: no per-row work)
                refresh = [i for i, row in enumerate(step.rows) if row in self._stale_rows]
                self._stale_rows.difference_update(step.rows)
        launched_at = time.perf_counter()
        launched = self.workers[shape].launch_decode(step, refresh)

        def read(result: StepResult, read_at: float) -> None:
            observe_acceptance(self.estimates, shape, step.rows, result.accept_lens.tolist())
            if policy is not None:
                seen = StepObservation(len(step.rows), shape, read_at - max(launched_at, self._last_read))
                if not self._share_times:
                    policy.observe(*seen)
                elif self._record_times:
                    self._observed.append(seen)
            self._last_read = read_at

        return launched._replace(result=ObservedResult(launched.result, read))

    def enable_cuda_graphs(self, max_batch_size: int, width: int, constrained: bool = False,
                           sampled: bool = True) -> None:
        """Every shape's graphs, in the deepest's memory pool; extends once (the deepest's)."""
        self.deepest.enable_cuda_graphs(max_batch_size, width, constrained, sampled)
        for worker in self.workers.values():
            if worker is not self.deepest:  # constrained batches run at the configured tree only
                worker.enable_cuda_graphs(max_batch_size, width, False, sampled,
                                          pool=self.deepest.graphs.pool, extends=False)
        if self.drafter.refreshes_state:
            self.drafter.capture_refresh(max_batch_size, width, self.deepest.graphs.pool)

    def release_graphs(self) -> None:
        for worker in self.workers.values():
            worker.release_graphs()
        if self.drafter.refreshes_state:
            self.drafter.release_refresh_graphs()

    def take_step_times(self) -> list[StepObservation]:
        """Rank 0's step times since the last call (tp > 1), for every rank's policy."""
        observed, self._observed = self._observed, []
        return observed

    def observe_step_times(self, observed: Sequence[StepObservation]) -> None:
        for seen in observed:
            self.policy.observe(*seen)

    def measure_step_times(self, max_batch_size: int, width: int,
                           agree: Callable[[Any], Any] = lambda seconds: seconds) -> StepTimes:
        """Time every shape's greedy step per bucket on its static inputs (padded rows: they
        write only the padding row and slot 0), and choose by them from now on. `agree`: rank
        0's table on every rank (tp > 1; the shapes are pickled with it)."""
        graphed = self.deepest.graphs is not None
        buckets = self.deepest.graphs.buckets if graphed else sorted({1, max_batch_size})
        seconds = {bs: {shape: _time(_static_step(worker, bs, width), self.target.ctx.device)
                        for shape, worker in self.workers.items()} for bs in buckets}
        self.policy = ShapePolicy(StepTimes(agree(seconds)), self.estimates)
        return self.policy.times


def _static_step(worker: SpecWorker, bs: int, width: int):
    """One greedy decode step of `worker` on its bucket's static inputs: the graphs' replay,
    or the parts run eagerly."""
    if worker.graphs is not None:
        captured = worker.graphs.captured[bs]
        return lambda: [worker.graphs.replay(captured, part) for part in range(len(worker.graphs.parts))]
    inputs = worker.graph_inputs(width)(bs)

    def run():
        x = inputs
        for part in worker.decode_parts():
            x = part(x)

    return run


def _time(run, device: torch.device) -> float:
    """Seconds one call of `run` takes (the best of MEASURE_REPEATS after a warm-up)."""
    best = float("inf")
    with torch.inference_mode():
        for i in range(MEASURE_REPEATS + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                best = min(best, time.perf_counter() - start)
    return best
