"""Tensor-parallel ranks: spawning the followers, the control messages rank 0 sends them at
the start of each step, and the loop a follower runs (runtime/tp_group.py has the design).
Followers are local processes here; server/cluster starts them as Ray actors instead (other
nodes included) and points rank 0 at them with `Engine(config, tp_init_method=...)`."""
from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple, Optional, Union

import torch

from specserve.engine.builder import EngineCore, build_engine
from specserve.engine.config import EngineConfig, SamplingParams, sequence_seed
from specserve.engine.host_pauses import freeze_startup_heap
from specserve.engine.runtime.tp_group import Stop
from specserve.engine.scheduler.schedule_batch import PromptScores, Req, SharedPrefix

ORPHAN_CHECK_SECONDS = 1.0  # how often a local follower looks for rank 0's process


class AddRequest(NamedTuple):
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int

    def apply(self, core: EngineCore) -> None:
        """Queue the request's sampling.n sequences: sequence i samples with sequence_seed(i);
        with n > 1 they share the KV of the prompt but its last token (each prefills that one
        itself, to sample its own first token), and the prompt's scores."""
        stop_ids = set(self.sampling.stop_token_ids)
        if not self.sampling.ignore_eos:
            stop_ids.update(core.eos_token_ids)
        n = self.sampling.n
        shared = SharedPrefix(len(self.prompt_ids) - 1) if n > 1 and len(self.prompt_ids) > 1 else None
        scores = PromptScores()
        for i in range(n):
            core.scheduler.add(Req(rid=self.rid, prompt_ids=self.prompt_ids, sampling=self.sampling,
                                   seed=sequence_seed(self.seed, i), stop_ids=frozenset(stop_ids),
                                   index=i, shared=shared, prompt_scores=scores))


class AbortRequest(NamedTuple):
    rid: str
    index: Optional[int] = None   # one sequence of the request; None: all of them

    def apply(self, core: EngineCore) -> None:
        with core.ctx.schedule_context():  # frees KV: schedule-side device work
            core.scheduler.abort(self.rid, self.index)


class FlushPrefixCache(NamedTuple):
    """Free the prefix cache's unpinned slots (every rank at the same step: same decisions)."""

    def apply(self, core: EngineCore) -> None:
        cache = core.scheduler.slots.cache
        if cache is not None:
            cache.flush()


class GrammarNews(NamedTuple):
    """What rank 0's grammar service said before this step (Scheduler.hear_grammars): every
    rank's scheduler takes it at the same point, so all admit, fail and end the same requests."""
    messages: list
    dead: bool

    def apply(self, core: EngineCore) -> None:
        with core.ctx.schedule_context():  # ending a request frees KV
            core.scheduler.take_grammar_news(self.messages, self.dead)


class ObservedStepTimes(NamedTuple):
    """Rank 0's step wall times since the last step (adaptive speculation; StepObservations,
    their DraftShapes pickled with them): every rank's shape policy takes them at the same
    point, so all choose the same shapes."""
    observed: list

    def apply(self, core: EngineCore) -> None:
        core.worker.observe_step_times(self.observed)


class ObservedStepCosts(NamedTuple):
    """Rank 0's priced step times since the last step (Scheduler.take_step_costs:
    StepCostSamples): every rank's mixed-step budget takes them at the same point, so all
    choose the same prompt chunks."""
    samples: list

    def apply(self, core: EngineCore) -> None:
        core.scheduler.policy.observe_step_costs(self.samples)


RequestChange = Union[AddRequest, AbortRequest, FlushPrefixCache, GrammarNews, ObservedStepTimes,
                      ObservedStepCosts]


class TPRankDied(RuntimeError):
    """A tensor-parallel rank's process died: the others cannot go on (every step needs it)."""


def spawn_followers(config: EngineConfig, init_method: str) -> list:
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run_follower, args=(config, rank, init_method), daemon=True)
             for rank in range(1, config.tp_size)]
    for p in procs:
        p.start()
    return procs


def run_follower(config: EngineConfig, rank: int, init_method: str,
                 local_ranks: bool = True) -> None:
    """Ranks > 0: mirror rank 0's steps until it stops. local_ranks: as for build_engine (False
    for a rank that a cluster scheduler placed, e.g. a Ray actor on another node). A local
    follower exits once rank 0's process is gone: a collective that waits for a dead peer may
    never return (NCCL), and an orphan would hold its GPU."""
    if local_ranks:
        threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True,
                         name="specserve-tp-parent-watch").start()
    core = build_engine(config, rank, init_method, local_ranks)
    freeze_startup_heap()  # the weights' and graphs' objects out of the collector's walks
    while True:
        changes = core.tp_group.exchange([])
        if any(isinstance(change, Stop) for change in changes):
            break
        for change in changes:
            change.apply(core)
        with core.ctx.schedule_context():
            core.scheduler.step()
    core.close()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_SECONDS)
    os._exit(1)
