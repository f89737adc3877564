"""Engine: the in-process API over the scheduler (used by tests, the CLI and the engine process)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from specserve.engine.attention.base import decide_needs_cpu_seq_lens
from specserve.engine.config import DEFAULT, EngineConfig, SamplingParams, SpecConfig
from specserve.engine.kvcache.pools import ReqToTokenPool, TokenSlotAllocator, TokenToKVPool
from specserve.engine.models.llama import LlamaForCausalLM
from specserve.engine.models.eagle import load_draft_head
from specserve.engine.models.loader import init_dummy_weights, load_llama
from specserve.engine.models.model_config import ModelConfig
from specserve.engine.outputs import EngineLoad, GenerateOutput, StepOutput
from specserve.engine.layers.parallel import SINGLE, TensorParallel, kv_head_range
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.tp_group import TPGroup, free_init_method
from specserve.engine.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.engine.runtime.model_runner import ModelRunner, create_attention_backend, resolve_dtype
from specserve.engine.runtime.worker import NormalWorker, PresenceTable
from specserve.engine.scheduler.future_map import FutureMap
from specserve.engine.scheduler.schedule_batch import Req
from specserve.engine.scheduler.scheduler import Scheduler
from specserve.engine.spec.eagle_worker import EagleWorker
from specserve.engine.tokenizer import Tokenizer

logger = logging.getLogger("specserve.engine")


def demo_models_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_MODELS_DIR", Path(__file__).resolve().parents[1] / "models"))


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was requested but is not available")
    return device


def _eos_ids(path: str, cfg: ModelConfig) -> list[int]:
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return list(cfg.eos_token_ids)


def _check_tp_divides(cfg: ModelConfig, tp_size: int) -> None:
    """Refuse a split before any rank starts (the layers check again, per rank)."""
    tp = TensorParallel(tp_size, 0)
    tp.split(cfg.num_heads, "num_attention_heads")
    tp.split(cfg.intermediate_size, "intermediate_size")
    kv_head_range(cfg.num_kv_heads, tp)


def _spawn_followers(config: EngineConfig, init_method: str) -> list:
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follower_main, args=(config, rank, init_method), daemon=True)
             for rank in range(1, config.tp_size)]
    for p in procs:
        p.start()
    return procs


def _follower_main(config: EngineConfig, rank: int, init_method: str) -> None:
    engine = Engine(config, _rank=rank, _init_method=init_method)
    engine.follow()
    engine.shutdown()


class Engine:
    """Offline engine. `Engine(EngineConfig(model=DIR))`; also a context manager."""

    def __init__(self, config: EngineConfig = EngineConfig(), *, _rank: int = 0, _init_method: str = ""):
        self.ctx = None
        try:
            self._build(config, _rank, _init_method)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """A failed start leaves no process group or follower process behind."""
        for p in getattr(self, "_followers", []):
            p.kill()
        if getattr(self, "tp_group", None) is not None:
            self.tp_group.close()

    def _build(self, config: EngineConfig, _rank: int, _init_method: str) -> None:
        self.config = config
        model_path = config.model or str(demo_models_dir() / "demo-target")
        self.model_path = model_path
        self.device = _resolve_device(config.device)
        self.rank = _rank
        self.tp_group, self._followers, self._control_ops = None, [], []
        self.model_config = cfg = ModelConfig.from_dir(model_path)
        if config.tp_size > 1:
            _check_tp_divides(cfg, config.tp_size)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", _rank)
                torch.cuda.set_device(self.device)
            if _rank == 0:
                _init_method = free_init_method()
                self._followers = _spawn_followers(config, _init_method)
            self.tp_group = TPGroup(config.tp_size, _rank, _init_method, self.device)
        tp = self.tp_group.model if self.tp_group is not None else SINGLE
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.eos_token_ids = _eos_ids(model_path, cfg)
        self.tokenizer = Tokenizer(model_path, self.eos_token_ids) \
            if os.path.exists(os.path.join(model_path, "tokenizer.json")) else None
        self.max_context_len = min(config.max_context_len or cfg.max_position_embeddings,
                                   cfg.max_position_embeddings)
        self.spec_config = self._resolve_spec(config)

        spec = self.spec_config
        # Past max_context_len a row also holds the speculative over-reservation.
        reserve = 0 if spec is None else spec.kv_reserve_per_request
        max_position = self.max_context_len + reserve + 1
        with torch.device(self.device):
            model = LlamaForCausalLM(cfg, max_position, tp).to(self.dtype)
        if config.load_format == "dummy":
            init_dummy_weights(model, config.seed)
        else:
            load_llama(model, model_path)
        model.eval()

        self.ctx = DeviceContext.for_device(self.device)
        num_rows = config.max_running_requests
        # KV slots a decode step reserves past a request's committed length.
        step_slots = 1 if spec is None else spec.kv_reserve_per_request
        num_slots = self._num_kv_slots(cfg, model.layers[0].self_attn.num_kv_heads, num_rows,
                                       spec, step_slots)
        self._fit_context_to_pool(num_slots, step_slots)
        self.req_to_token = ReqToTokenPool(num_rows, max_position, self.device)
        attn_layer = model.layers[0].self_attn  # this rank's heads
        self.kv_pool = TokenToKVPool(num_slots, cfg.num_layers, attn_layer.num_kv_heads, cfg.head_dim,
                                     self.dtype, self.device)
        self.allocator = TokenSlotAllocator(num_slots, self.device)
        self.row_width = max_position
        attn = self._attention_backend(attn_layer.num_heads, attn_layer.num_kv_heads, cfg.head_dim)
        self.runner = ModelRunner(model, self.kv_pool, attn)
        self.draft_runner = None
        if spec is not None:
            head = load_draft_head(spec.draft_model, spec.algorithm, model, max_position, self.dtype,
                                   self.device, dummy=config.load_format == "dummy")
            if head.uses_aux_hidden:
                model.aux_hidden_layers = head.aux_layers
            dcfg = head.config
            draft_pool = TokenToKVPool(num_slots, 1, dcfg.num_kv_heads, dcfg.head_dim, self.dtype, self.device)
            self.draft_runner = ModelRunner(
                head, draft_pool, self._attention_backend(dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim))
        backends = [attn, None if self.draft_runner is None else self.draft_runner.attn_backend]
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens(backends, force=config.needs_cpu_seq_lens)
        self.future_map = FutureMap(num_rows, self.ctx, self.needs_cpu_seq_lens)
        presence = PresenceTable(num_rows, cfg.vocab_size, self.device)
        common = dict(ctx=self.ctx, future_map=self.future_map, req_to_token=self.req_to_token,
                      presence=presence)
        worker = NormalWorker(self.runner, **common) if spec is None else \
            EagleWorker(self.runner, self.draft_runner, spec, **common)
        self.scheduler = Scheduler(
            worker=worker, ctx=self.ctx, req_to_token=self.req_to_token, allocator=self.allocator,
            future_map=self.future_map, vocab_size=cfg.vocab_size,
            max_running_requests=config.max_running_requests,
            chunked_prefill_size=config.chunked_prefill_size, max_context_len=self.max_context_len,
            enable_overlap=config.enable_overlap, eos_ids=self.eos_token_ids,
            needs_cpu_seq_lens=self.needs_cpu_seq_lens, spec=spec)
        self.uses_cuda_graphs = self._wants_cuda_graphs(attn)
        if self.uses_cuda_graphs:
            worker.enable_cuda_graphs(config.max_running_requests, self.row_width)
        self._seed_rng = random.Random(config.seed)
        self._rid_counter = itertools.count()
        if self.device.type == "cuda":  # set-up ran on the default stream; forwards will not
            torch.cuda.synchronize(self.device)

    def _resolve_spec(self, config: EngineConfig) -> Optional[SpecConfig]:
        """DEFAULT: speculate with the demo draft when serving the demo target, else not."""
        demo_draft = str(demo_models_dir() / "demo-draft")
        if config.spec is None:
            return None
        if config.spec == DEFAULT:
            if config.model is None and os.path.exists(demo_draft):
                return SpecConfig(draft_model=demo_draft)
            return None
        spec = config.spec
        if spec.draft_model is None:
            if config.model is not None:
                raise ValueError("spec.draft_model: required unless the target is the bundled demo model")
            spec = dataclasses.replace(spec, draft_model=demo_draft)
        if not os.path.exists(os.path.join(spec.draft_model, "config.json")):
            raise ValueError(f"spec.draft_model: no config.json in {spec.draft_model}")
        return spec

    def _attention_backend(self, num_heads: int, num_kv_heads: int, head_dim: int):
        # Forwards see at most a whole row; tree drafting runs topk sequences per request.
        topk = 1 if self.spec_config is None else self.spec_config.topk
        return create_attention_backend(
            self.config.attention_backend, self.device, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, max_context_len=self.row_width,
            max_batch_size=self.config.max_running_requests * topk,
            needs_cpu_seq_lens=self.config.needs_cpu_seq_lens)

    def _wants_cuda_graphs(self, attn) -> bool:
        """On by default on CUDA with a backend whose metadata a graph can capture (Triton)."""
        if self.config.cuda_graph is False or self.device.type != "cuda":
            if self.config.cuda_graph and self.device.type != "cuda":
                raise ValueError("cuda_graph: needs a CUDA device")
            return False
        if not attn.supports_cuda_graphs:
            if self.config.cuda_graph:
                raise ValueError(f"cuda_graph: the {type(attn).__name__} backend cannot be captured; "
                                 "use attention_backend='triton'")
            return False
        return True

    @staticmethod
    def _peak_slots(context_len: int, step_slots: int) -> int:
        """The most KV slots one request holds: a context of context_len - 1 written tokens
        (the last one is sampled, never fed) plus a decode step's reservation past it."""
        return context_len - 1 + step_slots

    def _fit_context_to_pool(self, num_slots: int, step_slots: int) -> None:
        """Cap max_context_len so that one request alone always fits the pool. Then a request
        that cannot fit is refused at add_request (its prompt is too long) or ends with
        "length", instead of being found out mid-decode with nothing left to retract."""
        fit = num_slots - step_slots + 1  # the largest context with _peak_slots <= num_slots
        if fit < 2:
            raise ValueError(f"max_total_tokens: {num_slots} KV slots cannot hold one request "
                             f"(a decode step reserves {step_slots} slots past its context)")
        self.context_capped_by_pool = fit < self.max_context_len
        if self.context_capped_by_pool:
            logger.warning("max_context_len %d -> %d: one request must fit the %d-slot KV pool "
                           "(a decode step reserves %d slots)", self.max_context_len, fit,
                           num_slots, step_slots)
            self.max_context_len = fit

    def _num_kv_slots(self, cfg: ModelConfig, num_kv_heads: int, num_rows: int, spec,
                      step_slots: int) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        per_slot = TokenToKVPool.bytes_per_slot(cfg.num_layers + (spec is not None), num_kv_heads,
                                                cfg.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.mem_fraction) // per_slot
        # CPU: enough for every row at full context, capped by a fraction of physical memory.
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        full = num_rows * self._peak_slots(self.max_context_len, step_slots)
        return max(16, min(full, int(physical * 0.25) // per_slot))

    # --- public API ------------------------------------------------------------------------
    @property
    def model_info(self) -> dict:
        spec = self.spec_config
        return {
            "model": self.model_path, "architecture": self.model_config.architecture,
            "vocab_size": self.model_config.vocab_size, "max_context_len": self.max_context_len,
            "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
            "eos_token_ids": list(self.eos_token_ids), "tp_size": self.config.tp_size,
            "spec": None if spec is None else {
                "algorithm": spec.algorithm, "draft_model": spec.draft_model, "num_steps": spec.num_steps,
                "topk": spec.topk, "num_draft_tokens": spec.num_draft_tokens},
        }

    def add_request(self, rid: str, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Queue one request; ValueError naming the field if it cannot be served."""
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids: must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_context_len:
            pool = f" (capped by the {self.allocator.num_slots}-slot KV pool)" \
                if self.context_capped_by_pool else ""
            raise ValueError(f"prompt_token_ids: prompt of {len(ids)} tokens leaves no room to generate "
                             f"within max_context_len={self.max_context_len}{pool}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError("sampling: must be a SamplingParams")
        bad_stop = next((t for t in sampling.stop_token_ids if t >= vocab), None)
        if bad_stop is not None:
            raise ValueError(f"stop_token_ids: token id {bad_stop} is outside the vocabulary [0, {vocab})")
        if rid in self.scheduler.reqs:
            raise ValueError(f"rid: request id {rid!r} is already in use")
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(63)
        self._control(("add", rid, ids, sampling, seed))

    def abort(self, rid: str) -> None:
        self._control(("abort", rid))

    def _control(self, op: tuple) -> None:
        """Apply a request change here; with tensor parallelism rank 0 also queues it for
        the other ranks, which apply it at the start of the next step."""
        if self.tp_group is not None:
            self._control_ops.append(op)
        self._apply(op)

    def _apply(self, op: tuple) -> None:
        if op[0] == "abort":
            with self.ctx.schedule_context():  # frees KV: schedule-side device work
                self.scheduler.abort(op[1])
            return
        _, rid, ids, sampling, seed = op
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        self.scheduler.add(Req(rid=rid, prompt_ids=ids, sampling=sampling, seed=seed,
                               stop_ids=frozenset(stop_ids)))

    def step(self) -> list[StepOutput]:
        if self.tp_group is not None:
            ops, self._control_ops = self._control_ops, []
            self.tp_group.exchange(ops)
        # Schedule-side device work runs on this engine's schedule stream (entered per call:
        # the current stream is per thread, and several engines may share one).
        with self.ctx.schedule_context():
            return self.scheduler.step()

    def follow(self) -> None:
        """Ranks > 0: mirror rank 0's steps until it stops."""
        while True:
            ops = self.tp_group.exchange([])
            if ("stop",) in ops:
                return
            for op in ops:
                self._apply(op)
            with self.ctx.schedule_context():
                self.scheduler.step()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(num_running=s.num_running, num_waiting=len(s.waiting),
                          kv_used_tokens=self.allocator.num_slots - self.allocator.num_free,
                          kv_total_tokens=self.allocator.num_slots,
                          mean_accept_length=s.metrics.mean_accept_length,
                          num_retractions=s.metrics.num_retractions)

    @property
    def metrics(self):
        """Steps run, host time blocked on results, accept lengths (SchedulerMetrics)."""
        return self.scheduler.metrics

    def occupancy(self, since_busy: float, since_wall: float) -> float:
        """Fraction of wall time the forward stream was busy since (busy, wall) readings
        taken with `busy_and_wall()`; measure across a window of steady-state steps."""
        busy, wall = self.busy_and_wall()
        return (busy - since_busy) / max(wall - since_wall, 1e-9)

    def busy_and_wall(self) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.ctx.busy_seconds(), time.perf_counter()

    def generate(self, prompt_token_ids: Optional[Sequence[Sequence[int]]] = None,
                 prompts: Optional[Sequence[str]] = None,
                 sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> list[GenerateOutput]:
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
        rids = [f"generate-{next(self._rid_counter)}" for _ in range(n)]
        for i, (rid, ids, p) in enumerate(zip(rids, prompt_token_ids, params)):
            try:
                self.add_request(rid, ids, p)
            except ValueError:
                for queued in rids[:i]:
                    self.abort(queued)
                self._run_until_idle()
                raise
        finished: dict[str, StepOutput] = {}
        collected: dict[str, list[int]] = {rid: [] for rid in rids}
        logprobs: dict[str, list[float]] = {rid: [] for rid in rids}
        while len(finished) < n:
            for out in self.step():
                if out.rid not in collected:
                    continue
                collected[out.rid] += out.new_token_ids
                logprobs[out.rid] += out.new_logprobs or []
                if out.finished:
                    finished[out.rid] = out
        self._run_until_idle()
        results = []
        for rid, p in zip(rids, params):
            out = finished[rid]
            ids = collected[rid]
            results.append(GenerateOutput(
                token_ids=ids, finish_reason=out.finish_reason,
                text=self.tokenizer.decode(ids) if self.tokenizer is not None else None,
                logprobs=logprobs[rid] if p.logprobs else None, matched_stop=out.matched_stop,
                prompt_tokens=out.prompt_tokens, num_verify_steps=out.num_verify_steps,
                num_accepted_drafts=out.num_accepted_drafts))
        return results

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Float32 logits [len, vocab] of one sequence (scoring; e.g. perplexity). Idle engine only."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        if self.tp_group is not None:
            raise RuntimeError("prompt_logits runs on one rank only (tp_size=1)")
        with self.ctx.schedule_context():
            return self._prompt_logits(list(token_ids))

    def _prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        n = len(token_ids)
        row = self.req_to_token.alloc()
        slots = self.allocator.alloc(n)
        self.req_to_token.table[row, :n] = slots
        holder = {}
        done = self.ctx.new_event()

        def run():
            fb = ForwardBatch(
                mode=ForwardMode.EXTEND, input_ids=torch.tensor(token_ids, device=self.device),
                positions=torch.arange(n, device=self.device),
                req_pool_indices=torch.tensor([row], device=self.device),
                prefix_lens=torch.zeros(1, dtype=torch.int64, device=self.device),
                extend_lens_cpu=[n], out_cache_loc=slots, req_to_token=self.req_to_token,
                kv_pool=None, attn_backend=None, seq_lens_cpu=[n], max_seq_len=n)
            hidden, _ = self.runner.forward(fb)
            holder["logits"] = self.runner.model.compute_logits(hidden).cpu()
            done.record()

        self.ctx.launch(run)
        done.synchronize()
        self.allocator.free(slots)
        self.req_to_token.free(row)
        return holder["logits"]

    def _run_until_idle(self) -> None:
        """Let launched batches finish so every slot of finished requests is free again."""
        while self.scheduler.has_unfinished():
            self.step()

    def shutdown(self) -> None:
        if getattr(self, "ctx", None) is not None:
            with self.ctx.schedule_context():
                self.scheduler.drain()
            if self.scheduler.worker.graphs is not None:
                self.scheduler.worker.graphs.release()
            self.ctx.close()
            self.ctx = None
            if self.tp_group is not None:
                if self.rank == 0:
                    self.tp_group.exchange([("stop",)])
                # Every rank tears its communicators down before rank 0 waits for the others:
                # NCCL's teardown can wait for the peers, so joining first would deadlock.
                self.tp_group.close()
                for p in self._followers:
                    p.join(timeout=60)
                    if p.is_alive():
                        p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
