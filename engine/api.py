"""Engine: the in-process API over one engine (used by tests, the CLI and the engine process).

A thin facade: `builder.build_engine` makes the parts, the scheduler runs the steps, and
with tensor parallelism `tp` spawns the other ranks and carries request changes to them.
"""
from __future__ import annotations

import dataclasses
import itertools
import multiprocessing.connection
import os
import random
import time
from typing import Optional, Sequence, Union

import torch

from specserve.engine.builder import EngineCore, build_engine, check_tp_divides, target_path
from specserve.engine.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.models.checkpoint_dir import read_config
from specserve.engine.models.model_config import ModelConfig
from specserve.engine.outputs import EngineInfo, EngineLoad, GenerateOutput, GrammarHealth, StepOutput
from specserve.engine.runtime.tp_group import Rendezvous
from specserve.engine.tokenizer import Tokenizer
from specserve.engine.spec.adaptive_worker import AdaptiveSpecWorker
from specserve.engine.tp import (AbortRequest, AddRequest, FlushPrefixCache, GrammarNews, ObservedStepCosts,
                                 ObservedStepTimes, RequestChange, TPRankDied, spawn_followers)

# After a failed tp step: how long to wait for a dead rank's exit to show (its sockets close
# first), so that the error names it.
RANK_EXIT_GRACE_S = 1.0


class Engine:
    """Offline engine. `Engine(EngineConfig(model=DIR))`; also a context manager."""

    def __init__(self, config: EngineConfig = EngineConfig(), tp_init_method: Optional[str] = None):
        """tp_init_method: the other tp ranks were started elsewhere (server/cluster: Ray actors,
        possibly on other nodes, each on its own GPU) and meet rank 0 there; None: spawn them
        here."""
        self._followers: list = []   # the other tp ranks' processes, when spawned here
        self._out_of_step = False     # a tp step failed: the ranks are no longer in lock step
        self._rendezvous: Optional[Rendezvous] = None  # held while the tp ranks run
        self._changes: list[RequestChange] = []  # for the other ranks, sent at the next step
        try:
            init_method = tp_init_method or ""
            if config.tp_size > 1:
                check_tp_divides(ModelConfig.from_dict(read_config(target_path(config), "model")),
                                 config.tp_size)
                if tp_init_method is None:
                    self._rendezvous = Rendezvous()
                    init_method = self._rendezvous.init_method
                    self._followers = spawn_followers(config, init_method)
            self.core: Optional[EngineCore] = build_engine(config, 0, init_method,
                                                           local_ranks=tp_init_method is None)
        except BaseException:  # a failed start leaves no follower process behind
            for p in self._followers:
                p.kill()
            raise
        # Every rank's state at shutdown (tensor parallelism; builder.EngineCore.close).
        self.rank_states: Optional[list] = None
        self._seed_rng = random.Random(config.seed)
        self._rid_counter = itertools.count()

    # --- what it serves ----------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        return self.core.tokenizer

    @property
    def max_context_len(self) -> int:
        return self.core.max_context_len

    @property
    def spec_config(self) -> Optional[SpecConfig]:
        return self.core.spec

    @property
    def info(self) -> EngineInfo:
        core, spec = self.core, self.core.spec
        return EngineInfo(
            model=_folder_name(core.model_path), architecture=core.model_config.architecture,
            vocab_size=core.model_config.vocab_size, max_context_len=core.max_context_len,
            dtype=str(core.dtype).replace("torch.", ""), device=str(core.device),
            eos_token_ids=core.eos_token_ids,
            spec=None if spec is None else dataclasses.replace(
                spec, draft_model=spec.draft_model and _folder_name(spec.draft_model)),
            weight_dtype=core.weight_format, kv_cache_dtype=str(core.kv_pool.k_buffer[0].dtype).replace("torch.", ""))

    # --- requests ----------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Queue one request; ValueError naming the field if it cannot be served."""
        core = self.core
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids: must not be empty")
        vocab = core.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= core.max_context_len:
            pool = f" (capped by the {core.allocator.num_slots}-slot KV pool)" \
                if core.context_capped_by_pool else ""
            raise ValueError(f"prompt_token_ids: prompt of {len(ids)} tokens leaves no room to generate "
                             f"within max_context_len={core.max_context_len}{pool}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError("sampling: must be a SamplingParams")
        bad_stop = next((t for t in sampling.stop_token_ids if t >= vocab), None)
        if bad_stop is not None:
            raise ValueError(f"stop_token_ids: token id {bad_stop} is outside the vocabulary [0, {vocab})")
        bad_bias = next((t for t, _ in sampling.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias: token id {bad_bias} is outside the vocabulary [0, {vocab})")
        if sampling.grammar is not None and core.scheduler.grammars is None:
            raise ValueError("structured_output: this model has no tokenizer.json, which grammars need")
        if core.scheduler.has_request(rid):
            raise ValueError(f"rid: request id {rid!r} is already in use")
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(63)
        self._change(AddRequest(rid, ids, sampling, seed))

    def warm_grammar(self, timeout: float = 120.0) -> Optional[bool]:
        """Start the grammar process and compile a small schema in it (at start-up, before
        the first constrained request: that one then pays nothing extra). True once warm; False
        if it did not warm within `timeout` (it goes on starting); None without structured
        outputs (no tokenizer.json)."""
        grammars = self.core.scheduler.grammars
        if grammars is None:
            return None
        grammars.start()
        return grammars.wait_warm(timeout)

    def grammar_health(self) -> Optional[GrammarHealth]:
        """The grammar service's state (None without one), after restarting it if it died and
        nothing constrained is in flight (the server's health service reads this)."""
        scheduler = self.core.scheduler
        if scheduler.grammars is None:
            return None
        scheduler.tend_grammars()
        return scheduler.grammars.health()

    def abort(self, rid: str, index: Optional[int] = None) -> None:
        """Abort a request (all its sequences), or only its sequence `index`."""
        self._change(AbortRequest(rid, index))

    def _change(self, change: RequestChange) -> None:
        """Apply a request change here; with tensor parallelism it also goes to the other
        ranks, which apply it at the start of the next step."""
        if self.core.tp_group is not None:
            self._changes.append(change)
        change.apply(self.core)

    def step(self) -> list[StepOutput]:
        core = self.core
        if core.tp_group is None:
            return self._step()
        self.check_ranks()
        try:
            return self._step()
        except Exception as e:
            # The others may be inside this step's collectives or past it: never in step again.
            self._out_of_step = True
            # A collective with a dead peer fails at once (gloo); its exit may show a moment later.
            if self._followers:
                multiprocessing.connection.wait([p.sentinel for p in self._followers], RANK_EXIT_GRACE_S)
            failure = self.rank_failure()
            if failure is not None:
                raise TPRankDied(failure) from e
            raise

    def _step(self) -> list[StepOutput]:
        core = self.core
        news = core.scheduler.hear_grammars()
        if news is not None:  # every rank takes it before this step's schedule
            self._change(GrammarNews(*news))
        if core.tp_group is not None:
            observed = core.worker.take_step_times() if isinstance(core.worker, AdaptiveSpecWorker) else ()
            if observed:  # rank 0's step times, taken by every rank here
                self._change(ObservedStepTimes(observed))
            costs = core.scheduler.take_step_costs()
            if costs:  # likewise rank 0's priced steps, for the mixed steps' budget
                self._change(ObservedStepCosts(costs))
            changes, self._changes = self._changes, []
            core.tp_group.exchange(changes)
        # Schedule-side device work runs on this engine's schedule stream (entered per call:
        # the current stream is per thread, and several engines may share one).
        with core.ctx.schedule_context():
            return core.scheduler.step()

    def rank_failure(self) -> Optional[str]:
        """Why the engine cannot go on, if a tensor-parallel rank it spawned has died (None
        while they all live). Safe from any thread: it only looks at their processes'
        sentinels. (Ranks started elsewhere, tp_init_method, fail this rank's collectives.)"""
        sentinels = [p.sentinel for p in self._followers]
        dead = multiprocessing.connection.wait(sentinels, timeout=0) if sentinels else []
        if not dead:
            return None
        rank = 1 + sentinels.index(dead[0])
        return f"tp_size: rank {rank} (pid {self._followers[rank - 1].pid}) died; the engine cannot go on"

    def check_ranks(self) -> None:
        """Raise (TPRankDied) if a tensor-parallel rank died, or a failed step left the ranks
        out of step: every later step would wait for the others forever."""
        failure = self.rank_failure()
        if failure is not None:
            self._out_of_step = True
            raise TPRankDied(failure)
        if self._out_of_step:
            raise RuntimeError("tp_size: a step failed and the ranks are out of step; restart the engine")

    def has_unfinished(self) -> bool:
        return self.core.scheduler.has_unfinished()

    def load(self) -> EngineLoad:
        """kv_used_tokens counts the slots requests hold, cached prefixes they pin included;
        cached slots nobody pins are reclaimable and count only in kv_cached_tokens."""
        s, allocator, cache = self.core.scheduler, self.core.allocator, self.core.scheduler.slots.cache
        evictable = cache.evictable_size if cache is not None else 0
        return EngineLoad(num_running=s.num_running, num_waiting=s.num_waiting,
                          kv_used_tokens=allocator.num_slots - allocator.num_free - evictable,
                          kv_total_tokens=allocator.num_slots,
                          mean_accept_length=s.metrics.mean_accept_length,
                          num_retractions=s.metrics.num_retractions,
                          kv_cached_tokens=cache.size if cache is not None else 0,
                          prefix_cache_hit_rate=cache.num_hit / cache.num_queried
                          if cache is not None and cache.num_queried else 0.0)

    def flush_prefix_cache(self) -> None:
        """Free every cached prefix that no running request uses (operators: e.g. to return
        the memory, or before a benchmark that must start cold). Prefixes running requests
        pin stay until they finish, and what requests leave afterwards is cached again; with
        the cache off this does nothing. Applied between steps, on every rank."""
        self._change(FlushPrefixCache())

    @property
    def metrics(self):
        """Steps run, host time blocked on results, accept lengths (SchedulerMetrics)."""
        return self.core.scheduler.metrics

    def record_kv_events(self) -> None:
        """Record the prefix cache's block events (config.kv_events_block_size) for
        `take_kv_events`, starting with the blocks it holds now; the engine process publishes
        them. This rank's cache only: every tp rank's cache makes the same changes."""
        cache = self.core.scheduler.slots.cache
        if cache is None:
            raise ValueError("kv_events_endpoint (--kv-events-endpoint): reports the prefix "
                             "cache, which is disabled (--disable-prefix-cache)")
        cache.record_events(self.config.kv_events_block_size)

    def take_kv_events(self) -> list:
        """The block events (kvcache/block_events.py) since the last call, in order."""
        cache = self.core.scheduler.slots.cache
        return cache.events.take() if cache is not None and cache.events is not None else []

    def take_step_stats(self) -> list:
        """What the steps processed since the last call took (engine/outputs.py StepStat)."""
        return self.core.scheduler.metrics.take_step_stats()

    def occupancy(self, since_busy: float, since_wall: float) -> float:
        """Fraction of wall time the forward stream was busy since (busy, wall) readings
        taken with `busy_and_wall()`; measure across a window of steady-state steps."""
        busy, wall = self.busy_and_wall()
        return (busy - since_busy) / max(wall - since_wall, 1e-9)

    def busy_and_wall(self) -> tuple[float, float]:
        if self.core.device.type == "cuda":
            torch.cuda.synchronize(self.core.device)
        return self.core.ctx.busy_seconds(), time.perf_counter()

    def generate(self, prompt_token_ids: Optional[Sequence[Sequence[int]]] = None,
                 prompts: Optional[Sequence[str]] = None,
                 sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> list[GenerateOutput]:
        """Run prompts to completion: one GenerateOutput per sequence, each prompt's n
        sequences in index order."""
        if (prompt_token_ids is None) == (prompts is None):
            raise ValueError("prompts: give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError("prompts: this model folder has no tokenizer.json")
            prompt_token_ids = [self.tokenizer.encode(p) for p in prompts]
        n = len(prompt_token_ids)
        sampling = sampling or SamplingParams()
        params = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != n:
            raise ValueError(f"sampling: {len(params)} SamplingParams for {n} prompts")
        rids = [f"generate-{next(self._rid_counter)}" for _ in range(n)]  # one per prompt
        for i, (rid, ids, p) in enumerate(zip(rids, prompt_token_ids, params)):
            try:
                self.add_request(rid, ids, p)
            except ValueError:
                for queued in rids[:i]:
                    self.abort(queued)
                self._run_until_idle()
                raise
        # Per sequence (rid, index): a request with n > 1 gives n outputs, in index order.
        keys = [(rid, i) for rid, p in zip(rids, params) for i in range(p.n)]
        finished: dict[tuple[str, int], StepOutput] = {}
        collected: dict[tuple[str, int], list[int]] = {key: [] for key in keys}
        logprobs: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
        top: dict[tuple[str, int], list] = {key: [] for key in keys}
        prompt: dict[tuple[str, int], StepOutput] = {}
        while len(finished) < len(keys):
            for out in self.step():
                key = (out.rid, out.index)
                if key not in collected:
                    continue
                collected[key] += out.new_token_ids
                logprobs[key] += out.new_logprobs or []
                top[key] += out.new_top_logprobs or []
                if out.prompt_logprobs is not None or out.prompt_top_logprobs is not None:
                    prompt[key] = out
                if out.finished:
                    finished[key] = out
        self._run_until_idle()
        results = []
        for key, p in zip(keys, (p for p in params for _ in range(p.n))):
            out = finished[key]
            ids = collected[key]
            scored = prompt.get(key)
            results.append(GenerateOutput(
                token_ids=ids, finish_reason=out.finish_reason,
                text=self.tokenizer.decode(ids) if self.tokenizer is not None else None,
                logprobs=logprobs[key] if p.logprobs else None,
                top_logprobs=top[key] if p.top_logprobs else None,
                prompt_logprobs=None if p.prompt_logprobs is None else
                (scored.prompt_logprobs or [] if scored else []),
                prompt_top_logprobs=scored.prompt_top_logprobs if scored else None,
                matched_stop=out.matched_stop, error=out.error,
                prompt_tokens=out.prompt_tokens, num_verify_steps=out.num_verify_steps,
                num_accepted_drafts=out.num_accepted_drafts, index=key[1],
                cached_tokens=out.cached_tokens))
        return results

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Float32 logits [len, vocab] of one sequence (scoring; e.g. perplexity). Idle engine only."""
        core = self.core
        if core.scheduler.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        if core.tp_group is not None:
            raise RuntimeError("prompt_logits runs on one rank only (tp_size=1)")
        ids = list(token_ids)
        with core.ctx.schedule_context(), core.scheduler.slots.scratch(len(ids)) as (row, slots):
            return core.worker.target.prompt_logits(ids, row, slots)

    def _run_until_idle(self) -> None:
        """Let launched batches finish so every slot of finished requests is free again."""
        while self.core.scheduler.has_unfinished():
            self.step()

    def shutdown(self) -> None:
        """Stop the engine, and its other tp ranks. After a failed step it waits for nothing
        the others would have to answer, and kills them."""
        if self.core is None:
            return
        self.rank_states = self.core.close(in_step=not self._out_of_step)
        self.core = None
        for p in self._followers:
            p.join(timeout=0 if self._out_of_step else 60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _folder_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path))
