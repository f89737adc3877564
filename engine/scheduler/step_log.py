"""The step log: one JSON line per engine step (EngineConfig.step_log, `--step-log PATH`), so
that a serving run's step times can be explained step by step: what each step carried (its
kind, decode rows, verify tokens, the prompt tokens riding and how many requests they belong
to), why (the prompt budget, the term that set it and the backlog: schedule_batch.MixedPlan),
what the step-cost model predicted for it and for its decode rows alone, whether it replayed
a captured graph (the bucket) or ran eagerly, and what it took: the StepStat seconds the
scheduler measures anyway (no device sync is added), the host's time launching it, and the
host's pauses since the step before: garbage collections and Triton compiles (engine/
host_pauses.py). A step many times its prediction with no device wait is one of those, or a
launch that blocked (on an H200 a stack sampler found the eager parts of speculative mixed
steps spinning inside kernel launches for up to a step's time, docs/benchmarks.md's
sixteenth round: most likely CUDA's launch queue full behind the step before).
bench/step_log_report.py reads it.

The scheduler thread pays for a row of host values it already holds when a step launches
and when its result is processed (~4 us a step on a busy 2-core host), and for their JSON every
FLUSH_EVERY steps (and at shutdown); while the log is off the scheduler holds None and pays
nothing (the plan a step carries, Decision.plan, is built either way: the budget's terms).
Under tensor parallelism only rank 0 writes one (every rank makes the same decisions).
"""
from __future__ import annotations

import collections
import json
import logging
from typing import NamedTuple, Optional

from specserve.engine.forward_batch import ForwardMode
from specserve.engine.host_pauses import HostPauses
from specserve.engine.scheduler.schedule_batch import InflightBatch

logger = logging.getLogger("specserve.engine")
# Rows buffered before they are written (at most this many lost if the process dies): about
# 0.8 s of an 8B engine's steps; their JSON (~8 us a row on a busy 2-core host) takes about half
# a millisecond, which the overlap loop spends while the next step runs on the device.
FLUSH_EVERY = 64
KINDS = {ForwardMode.DECODE: "decode", ForwardMode.MIXED: "mixed", ForwardMode.EXTEND: "extend"}


class StepRow(NamedTuple):
    """One step, a JSON object a line (its fields by these names)."""

    step: int                  # launch order, from 0
    t: float                   # its launch, seconds after the first step's (the scheduler's clock)
    kind: str                  # "decode", "mixed" (prompt chunks riding) or "extend" (a separate extend)
    decode_rows: int           # requests it decodes (verifies)
    verify_tokens: int         # their forward tokens: decode_rows x the verify width (1 without drafts)
    prompt_tokens: int         # prefill tokens it computes (a mixed step's chunks, an extend's)
    prompt_reqs: int           # the requests those belong to
    running: int               # requests holding a row when it launched
    waiting: int               # requests queued when it launched
    others: int                # requests holding a row that it did not advance (StepStat.others)
    retracted: int             # requests retracted while it was scheduled
    backlog: Optional[int]     # MixedPlan's (a decode-side step where prompts could ride; else null)
    budget: Optional[int]      # MixedPlan's prompt budget
    bound: Optional[str]       # the term that set it (mixed_batch.PromptBudget.bound, or "chunk")
    predicted_s: Optional[float]     # the step-cost model's time for its forward (null: no model)
    decode_alone_s: Optional[float]  # and for its decode rows alone
    fit_steps: int             # timed steps the model was fitted from (0: the prior's shape, not seconds)
    graph: int                 # Launched.graph: the captured bucket it replayed; 0: eager
    draft_depth: int           # StepStat.draft_depth
    seconds: float             # StepStat.seconds: launch (or the previous result) to its result
    wait_s: float              # of which the host waited for its result
    launch_s: float            # the host's time launching it (Scheduler._launch: its inputs built
                               # and its work enqueued, including any launch the driver held)
    gc_s: float                # garbage collections since the step before (host_pauses.Pauses)
    gc_full: int               # of which of the oldest generation
    compile_s: float           # Triton compiles since the step before
    compiled: tuple[str, ...]  # their kernels
    cpu_s: float               # the scheduler thread's CPU time since the step before
    preempted: int             # and the OS's involuntary switches of it


class _Launch(NamedTuple):
    """What a row holds of the moment its step launched."""

    step: int
    t: float
    running: int
    waiting: int
    retracted: int
    fit_steps: int
    launch_s: float


class StepLog:
    """Rows of the steps a Scheduler launches and processes (both in launch order), written
    to `path` as JSON lines. `verify_width`: tokens a decode row computes (1, or the drafts'
    verify width)."""

    def __init__(self, path: str, verify_width: int, flush_every: int = FLUSH_EVERY):
        try:
            self._file = open(path, "w", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"step_log (--step-log): cannot write {path!r}: {e.strerror}") from e
        self.path = path
        self.verify_width = verify_width
        self.flush_every = flush_every
        self.failed = False  # a write failed (flush)
        self._t0: Optional[float] = None  # the first step's launch
        self._launches: collections.deque[_Launch] = collections.deque()  # launched, not processed
        self._rows: list[StepRow] = []
        self._num_launched = 0
        self._retractions = 0  # the policy's count at the last launch
        self._pauses = HostPauses()

    def launched(self, policy, launched_at: float, launch_s: float) -> None:
        """A step was just launched (policy: the scheduler's AdmissionPolicy, right after it
        scheduled the step), its launch having taken the host `launch_s`."""
        if self._t0 is None:
            self._t0 = launched_at
        retractions = policy.num_retractions
        fit = policy.step_cost
        self._launches.append(_Launch(self._num_launched, launched_at - self._t0, len(policy.running),
                                      len(policy.waiting), retractions - self._retractions,
                                      0 if fit is None else fit.num_samples, launch_s))
        self._retractions = retractions
        self._num_launched += 1

    def processed(self, batch: InflightBatch, seconds: float, wait_s: float) -> None:
        """The oldest launched step's result was processed: `seconds` its StepStat time,
        `wait_s` how long the host waited for it."""
        at = self._launches.popleft()
        decision, plan = batch.decision, batch.decision.plan
        rows = len(decision.decode_reqs)
        verify = rows * self.verify_width
        prompt = sum(end - start for start, end in decision.chunks)
        cost = None if plan is None else plan.cost
        self._rows.append(StepRow(
            at.step, at.t, KINDS[decision.mode], rows, verify, prompt, len(decision.extend_reqs),
            at.running, at.waiting, batch.num_others, at.retracted,
            None if plan is None else plan.backlog, None if plan is None else plan.budget,
            None if plan is None else plan.bound,
            None if cost is None else cost.seconds(verify + prompt), None if cost is None else cost.seconds(verify),
            at.fit_steps, batch.launched.graph, batch.launched.draft_depth, seconds, wait_s,
            at.launch_s, *self._pauses.take()))
        if len(self._rows) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows. A write that fails (a full disk) ends the log, not the
        engine: rows are dropped from then on."""
        if self._rows and not self.failed:
            try:
                self._file.write("".join(json.dumps(row._asdict()) + "\n" for row in self._rows))
                self._file.flush()
            except OSError as e:
                logger.error("step log %s: %s; no more steps are written", self.path, e)
                self.failed = True
        self._rows.clear()

    def close(self) -> None:
        """Write what is buffered and close the file (Scheduler.close_step_log)."""
        self._pauses.close()
        if not self._file.closed:
            self.flush()
            try:
                self._file.close()
            except OSError:  # what a failed write left buffered (flush logged it)
                pass
