"""Building an engine: model, draft head, KV pools, attention backends, worker, scheduler, graphs.

`build_engine(config, rank, init_method)` returns the parts as an `EngineCore`; the `Engine`
facade (api.py) and tensor-parallel followers (tp.py) both start from it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from specserve.engine.attention.base import AttentionBackend, decide_needs_cpu_seq_lens
from specserve.engine.attention.factory import create_attention_backend
from specserve.engine.config import DEFAULT, EngineConfig, SpecConfig
from specserve.engine.grammar.bitmask import bitmask_workspace_bytes
from specserve.engine.grammar.channel import ChannelLayout
from specserve.engine.grammar.process import GrammarService
from specserve.engine.grammar.ranks import BroadcastMasks, FollowerGrammars
from specserve.engine.kvcache.fp8 import KVScales, is_fp8, kv_cache_dtype, resolve_kv_scales
from specserve.engine.kvcache.pools import (
    MLATokenToKVPool, ReqToTokenPool, TokenSlotAllocator, TokenToKVPool)
from specserve.engine.kvcache.radix_cache import RadixCache
from specserve.engine.kvcache.sizing import (GiB, MiB, NON_TORCH_BYTES, SLOT_INDEX_BYTES,
                                             TABLES_BYTES, MemoryShare, forward_workspace_bytes,
                                             kv_pool_slots)
from specserve.engine.layers.moe import experts_capturable
from specserve.engine.layers.parallel import SINGLE, TensorParallel, kv_head_range, set_skinny_gemm
from specserve.engine.layers.sampler import draw_workspace_bytes
from specserve.engine.models.checkpoint_dir import check_checkpoint_dir, read_config
from specserve.engine.models.deepseek import DeepseekForCausalLM
from specserve.engine.models.eagle import load_draft_head
from specserve.engine.models.llama import LlamaForCausalLM
from specserve.engine.models.loader import (CheckpointReader, init_dummy_weights, load_llama,
                                             use_fp8_everywhere, use_int4_everywhere)
from specserve.engine.models.model_config import ModelConfig
from specserve.engine.models.moe_families import MOE_FAMILY_CLASSES
from specserve.engine.models.nextn import load_nextn_head, read_nextn_layout
from specserve.engine.runtime.captured_extend import MAX_REQUESTS, TOKEN_BUCKETS
from specserve.engine.runtime.captured_mixed import TOKEN_BUCKETS as MIXED_TOKEN_BUCKETS, mixed_graph_tokens
from specserve.engine.quantization.config import Int4Config, resolve_quantization
from specserve.engine.runtime.device import DeviceContext
from specserve.engine.runtime.future_map import FutureMap
from specserve.engine.runtime.model_runner import ModelRunner
from specserve.engine.runtime.step import Worker
from specserve.engine.runtime.tp_group import RankState, Stop, TPGroup
from specserve.engine.runtime.worker import NormalWorker, HistoryTable, TargetModel
from specserve.engine.scheduler.output_processor import OutputProcessor
from specserve.engine.scheduler.policy import AdmissionPolicy
from specserve.engine.scheduler.request_slots import RequestSlots
from specserve.engine.scheduler.scheduler import Scheduler
from specserve.engine.scheduler.step_log import StepLog
from specserve.engine.spec.adaptive_worker import AdaptiveSpecWorker
from specserve.engine.spec.eagle_drafter import ModelDrafter
from specserve.engine.spec.ngram import NgramDrafter
from specserve.engine.spec.spec_worker import CHUNK_LOGIT_ROWS, SpecWorker
from specserve.engine.spec.suffix import SuffixDrafter
from specserve.engine.tokenizer import Tokenizer

logger = logging.getLogger("specserve.engine")


DUMMY_FP8_BLOCK = (128, 128)  # random FP8 weights are block-wise, as DeepSeek-V3 ships them


def demo_models_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_MODELS_DIR", Path(__file__).resolve().parents[1] / "models"))


def target_path(config: EngineConfig) -> str:
    return config.model or str(demo_models_dir() / "demo-target")


@dataclass(frozen=True)
class EngineCore:
    """Everything one rank of a running engine is made of."""

    config: EngineConfig
    rank: int
    device: torch.device
    dtype: torch.dtype
    model_path: str
    model_config: ModelConfig
    tokenizer: Optional[Tokenizer]
    eos_token_ids: tuple[int, ...]
    max_context_len: int
    context_capped_by_pool: bool  # the pool, not the model, set max_context_len
    spec: Optional[SpecConfig]
    ctx: DeviceContext
    req_to_token: ReqToTokenPool
    allocator: TokenSlotAllocator
    runner: ModelRunner
    draft_runner: Optional[ModelRunner]
    worker: Worker                # NormalWorker, SpecWorker or AdaptiveSpecWorker
    scheduler: Scheduler
    needs_cpu_seq_lens: bool
    uses_cuda_graphs: bool
    tp_group: Optional[TPGroup]
    weight_format: str            # the linear weights: the dtype's name, or the FP8 format
    graph_memory_bytes: int = 0   # what the CUDA graphs hold (their pool and static inputs)

    @property
    def kv_pool(self) -> TokenToKVPool | MLATokenToKVPool:
        return self.runner.kv_pool

    def rank_state(self) -> RankState:
        """What this rank's scheduler holds (close() compares the ranks')."""
        cache = self.scheduler.slots.cache
        evictable = cache.evictable_size if cache is not None else 0
        return RankState(len(self.scheduler.reqs), self.req_to_token.num_free,
                         self.allocator.num_slots - self.allocator.num_free - evictable)

    def close(self, in_step: bool = True) -> Optional[list[RankState]]:
        """Tell the followers to stop (rank 0), process what is in flight, release graphs and
        streams, tear down the TP groups. With tensor parallelism, rank 0 returns every rank's
        state after the drain (and logs an error if a rank's differs from its own). in_step
        False: a step failed and the ranks are out of step (or one is dead), so nothing is sent
        to the others and nothing in flight is waited for."""
        if not in_step:
            self._release()
            if self.tp_group is not None:
                self.tp_group.close()
            return None
        if self.tp_group is not None and self.rank == 0:
            # First: every rank then drains the same batches (the scheduler may take rank 0's
            # value of something while it processes one; scheduler.py).
            self.tp_group.exchange([Stop()])
        with self.ctx.schedule_context():
            self.scheduler.drain()
        self._release()
        states = None
        if self.tp_group is not None:
            states = self.tp_group.gather(self.rank_state())
            if states is not None and any(state != states[0] for state in states):
                logger.error("the tp ranks diverged: their states at shutdown are %s", states)
            # Every rank tears its communicators down before rank 0 waits for the others:
            # NCCL's teardown can wait for the peers, so joining first would deadlock.
            self.tp_group.close()
        return states

    def _release(self) -> None:
        """Graphs, streams and the grammar service (after the last forward that talks to it);
        the step log's last rows."""
        self.scheduler.close_step_log()
        self.worker.release_graphs()
        self.ctx.close()
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.close()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters made in the serving dtype: made in fp32 and cast after, a 30B model would
    need twice its size on the device for a moment (buffers that must be exact, such as RoPE's
    tables, ask for fp32 explicitly)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_engine(config: EngineConfig, rank: int = 0, init_method: str = "",
                 local_ranks: bool = True) -> EngineCore:
    """One rank's engine. With tp_size > 1 every rank calls this (rank 0 after spawning the
    others); a failure leaves no process group behind. local_ranks: every rank runs on this
    host and sees all its GPUs (rank r takes cuda:r); False: each rank was placed on its own
    GPU by a cluster scheduler (Ray sets CUDA_VISIBLE_DEVICES per actor), which is its cuda:0."""
    model_path = target_path(config)
    device = resolve_device(config.device)
    # Random weights (load_format "dummy") need the folder's config.json only.
    check = read_config if config.load_format == "dummy" else check_checkpoint_dir
    cfg = ModelConfig.from_dict(check(model_path, "model"))
    # The weight format served: the checkpoint's, or FP8 quantized at load (--quantization).
    cfg = dataclasses.replace(cfg, quantization=resolve_quantization(
        config.quantization, cfg.quantization, model_path, mla=cfg.mla is not None,
        dummy=config.load_format == "dummy", lm_head=config.quantize_lm_head))
    tp_group = None
    if config.tp_size > 1:  # rank 0 checked that the model splits before spawning the others
        if device.type == "cuda":
            device = torch.device("cuda", rank if local_ranks else 0)
            torch.cuda.set_device(device)
        tp_group = TPGroup(config.tp_size, rank, init_method, device, local_ranks,
                           config.custom_all_reduce)
    try:
        return _build(config, rank, model_path, device, cfg, tp_group)
    except BaseException:
        if tp_group is not None:
            tp_group.close()
        raise


def _build(config: EngineConfig, rank: int, model_path: str, device: torch.device, cfg: ModelConfig,
           tp_group: Optional[TPGroup]) -> EngineCore:
    dtype = resolve_dtype(config.dtype, device)
    # What this engine allocates is counted from here (another engine may share the process).
    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    eos_token_ids = tuple(_eos_ids(model_path, cfg))
    tokenizer = Tokenizer(model_path, list(eos_token_ids)) \
        if os.path.exists(os.path.join(model_path, "tokenizer.json")) else None
    model_context = min(config.max_context_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    spec = resolve_spec(config)
    # KV slots a decode step reserves past a request's committed length; past max_context_len
    # a row also holds the speculative over-reservation.
    step_slots = 1 if spec is None else spec.kv_reserve_per_request
    row_width = model_context + (0 if spec is None else spec.kv_reserve_per_request) + 1

    model_class = MOE_FAMILY_CLASSES.get(cfg.architecture) or \
        (DeepseekForCausalLM if cfg.mla is not None else LlamaForCausalLM)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(cfg, row_width, tp_group.model if tp_group is not None else SINGLE).to(dtype)
    logger.info("loading %s: %s, %d layers, %s on %s%s", "random weights" if config.load_format == "dummy"
                else model_path, cfg.architecture, cfg.num_layers, str(dtype).replace("torch.", ""),
                device, "" if cfg.quantization is None else f", {cfg.quantization.name} weights")
    dummy_fp8_block = None  # random FP8 weights: the checkpoint's blocks, else 128x128
    if config.load_format == "dummy" and cfg.quantization is not None \
            and not isinstance(cfg.quantization, Int4Config):
        dummy_fp8_block = getattr(cfg.quantization, "weight_block", None) or DUMMY_FP8_BLOCK
    weight_format = cfg.quantization.name if cfg.quantization is not None else \
        str(dtype).replace("torch.", "")
    if config.load_format == "dummy":
        if isinstance(cfg.quantization, Int4Config):
            use_int4_everywhere(model, cfg.quantization)
        elif dummy_fp8_block is not None:
            use_fp8_everywhere(model, dummy_fp8_block)
            weight_format = f"fp8 (block {dummy_fp8_block[0]}x{dummy_fp8_block[1]})"
        init_dummy_weights(model, config.seed)
    else:
        load_llama(model, model_path)
    model.eval()
    set_skinny_gemm(model, config.skinny_gemm)

    ctx = DeviceContext.for_device(device)
    num_rows = config.max_running_requests
    attn_layer = model.layers[0].self_attn  # this rank's heads
    # The target's pool may be FP8 (with the checkpoint's scales); drafts keep the model dtype.
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
    kv_scales = _kv_scales(config, model_path, cfg.num_layers) if is_fp8(kv_dtype) else None
    # The draft's weights and the request table before the pool is sized: it gets what they leave.
    head = None
    if spec is not None and spec.algorithm == "nextn":
        head = load_nextn_head(spec.draft_model, model, row_width, dtype, device,
                               dummy=config.load_format == "dummy", fp8_block=dummy_fp8_block)
    elif spec is not None and spec.has_draft_model:  # n-gram and suffix drafting have none
        head = load_draft_head(spec.draft_model, spec.algorithm, model, row_width, dtype, device,
                               dummy=config.load_format == "dummy")
    req_to_token = ReqToTokenPool(num_rows, row_width, device)
    # With a tokenizer the engine serves grammars (below): constrained steps mask their logits.
    constrained = tokenizer is not None
    num_slots = _num_kv_slots(config, cfg, attn_layer, dtype, kv_dtype, device, num_rows, spec,
                              model_context, step_slots, allocated_before, constrained=constrained)
    max_context_len = fit_context_to_pool(model_context, num_slots, step_slots)
    allocator = TokenSlotAllocator(num_slots, device)

    def attention_backend(num_heads: int, num_kv_heads: int, head_dim: int,
                          v_head_dim: Optional[int] = None,
                          pool_dtype: Optional[torch.dtype] = None) -> AttentionBackend:
        # Forwards see at most a whole row; tree drafting runs topk sequences per request.
        return create_attention_backend(
            config.attention_backend, device, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, max_context_len=row_width,
            max_batch_size=num_rows * (1 if spec is None else spec.topk),
            needs_cpu_seq_lens=config.needs_cpu_seq_lens,
            max_query_len=1 if spec is None else spec.num_draft_tokens, v_head_dim=v_head_dim,
            kv_dtype=pool_dtype)

    if cfg.mla is not None:  # MQA over one latent || rope head; V is the latent
        kv_pool = MLATokenToKVPool(num_slots, cfg.num_layers, cfg.mla.kv_lora_rank,
                                   cfg.mla.qk_rope_head_dim, kv_dtype, device, kv_scales)
        attn = attention_backend(attn_layer.num_heads, 1, attn_layer.kv_head_dim,
                                 cfg.mla.kv_lora_rank, kv_dtype)
    else:
        kv_pool = TokenToKVPool(num_slots, cfg.num_layers, attn_layer.num_kv_heads, cfg.head_dim,
                                kv_dtype, device, kv_scales)
        attn = attention_backend(attn_layer.num_heads, attn_layer.num_kv_heads, cfg.head_dim,
                                 pool_dtype=kv_dtype)
    runner = ModelRunner(model, kv_pool, attn)
    draft_runner = None
    if spec is not None and spec.algorithm == "nextn":
        # Its own one-layer latent pool, addressed by the target's slots like any draft's.
        mla = head.config.mla
        draft_pool = MLATokenToKVPool(num_slots, 1, mla.kv_lora_rank, mla.qk_rope_head_dim, dtype, device)
        draft_runner = ModelRunner(head, draft_pool, attention_backend(
            head.attention.num_heads, 1, head.attention.kv_head_dim, mla.kv_lora_rank))
    elif spec is not None and spec.has_draft_model:
        dcfg = head.config
        draft_pool = TokenToKVPool(num_slots, 1, dcfg.num_kv_heads, dcfg.head_dim, dtype, device)
        draft_runner = ModelRunner(head, draft_pool,
                                   attention_backend(dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim))
    if draft_runner is not None:
        set_skinny_gemm(draft_runner.model, config.skinny_gemm)
    backends = [attn, None if draft_runner is None else draft_runner.attn_backend]
    needs_cpu_seq_lens = decide_needs_cpu_seq_lens(backends, force=config.needs_cpu_seq_lens)
    target = TargetModel(runner, ctx, FutureMap(num_rows, ctx, needs_cpu_seq_lens), req_to_token,
                         HistoryTable(num_rows, cfg.vocab_size, device))
    drafter = None
    if spec is None:
        worker = NormalWorker(target)
    else:
        drafter = (NgramDrafter(target, spec) if spec.algorithm == "ngram" else SuffixDrafter(target, spec)
                   if spec.algorithm == "suffix" else ModelDrafter(target, draft_runner, spec))
        worker = (AdaptiveSpecWorker if spec.adaptive else SpecWorker)(target, drafter, spec)
    # Structured outputs need the tokenizer's vocabulary: the grammar process (started by the
    # first constrained request, or Engine.warm_grammar) loads it; the channel is sized for the
    # largest batch now.
    # With tensor parallelism only rank 0 runs it, and broadcasts its masks (grammar/ranks.py).
    if tokenizer is not None:
        tree = None if spec is None else worker.drafter.grammar_shape
        if rank == 0:
            target.grammar = GrammarService(os.path.join(model_path, "tokenizer.json"), cfg.vocab_size,
                                            eos_token_ids, num_rows, tree, device,
                                            compile_seconds=config.grammar_compile_seconds)
        if tp_group is not None:
            layout = ChannelLayout.of(num_rows, cfg.vocab_size, tree)
            if rank == 0:
                target.grammar.device = BroadcastMasks(tp_group.model, target.grammar.device, layout, device)
            else:
                target.grammar = FollowerGrammars(BroadcastMasks(tp_group.model, None, layout, device))
    # With a draft model a position's key is (its token, the next one): its draft KV reads both.
    cache = RadixCache(allocator, pair_keys=draft_runner is not None) if config.enable_prefix_cache else None
    slots = RequestSlots(req_to_token, allocator, ctx, worker.slots_per_request(), cache)
    scheduler = Scheduler(
        worker=worker, slots=slots,
        policy=AdmissionPolicy(slots, max_running_requests=num_rows,
                               chunked_prefill_size=config.chunked_prefill_size,
                               prefill_interleave_tokens=config.prefill_interleave_tokens,
                               mixed_row_tokens=worker.mixed_row_tokens() if config.mixed_steps else 0,
                               mixed_step_time_ratio=config.mixed_step_time_ratio,
                               max_context_len=max_context_len),
        outputs=OutputProcessor(max_context_len), vocab_size=cfg.vocab_size, eos_ids=eos_token_ids,
        enable_overlap=config.enable_overlap, speculative=spec is not None,
        grammars=target.grammar, rank0_value=None if tp_group is None else tp_group.exchange,
        finished=drafter.remember if isinstance(drafter, SuffixDrafter) else None,
        tp_rank=None if tp_group is None else rank,
        step_log=None if config.step_log is None or rank != 0 else
        StepLog(config.step_log, verify_width=1 if spec is None else spec.num_draft_tokens))
    logger.info("KV pool: %d slots of %s; max_context_len %d; %s attention; prefix cache %s; %s",
                num_slots, str(kv_dtype).replace("torch.", ""), max_context_len,
                type(attn).__name__, "on" if cache is not None else "off",
                "plain decoding" if spec is None else
                f"{spec.algorithm} {spec.num_steps}/{spec.topk}/{spec.num_draft_tokens}")
    uses_cuda_graphs = _wants_cuda_graphs(config, device, attn, cfg)
    graph_memory_bytes = 0
    if uses_cuda_graphs:
        logger.info("capturing CUDA graphs for batch sizes up to %d", num_rows)
        # Constrained steps get graphs of their own only where requests may carry a grammar.
        graph_memory_bytes = _capture_graphs(worker, device, num_rows, row_width,
                                             constrained=scheduler.grammars is not None,
                                             sampled=config.cuda_graph_sampled,
                                             mixed=scheduler.policy.mixed_row_tokens > 0,
                                             estimate=_graph_reserve_bytes(
                                                 config, cfg, dtype, num_rows, spec, constrained, row_width))
        # A mixed step's prompt budget fills the token bucket its graph replays anyway.
        scheduler.policy.mixed_graph_tokens = mixed_graph_tokens(worker)
    if spec is not None and spec.adaptive:
        times = worker.measure_step_times(num_rows, row_width,
                                          **({} if tp_group is None else dict(agree=tp_group.exchange)))
        logger.info("adaptive speculation: step ms by batch size and draft shape (depth, or depth x width) %s",
                    times.milliseconds())
    if device.type == "cuda":  # set-up ran on the default stream; forwards will not
        torch.cuda.synchronize(device)
    return EngineCore(
        config=config, rank=rank, device=device, dtype=dtype, model_path=model_path,
        model_config=cfg, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
        max_context_len=max_context_len, context_capped_by_pool=max_context_len < model_context,
        spec=spec, ctx=ctx, req_to_token=req_to_token, allocator=allocator, runner=runner,
        draft_runner=draft_runner, worker=worker, scheduler=scheduler,
        needs_cpu_seq_lens=needs_cpu_seq_lens, uses_cuda_graphs=uses_cuda_graphs, tp_group=tp_group,
        weight_format=weight_format, graph_memory_bytes=graph_memory_bytes)


def _capture_graphs(worker: Worker, device: torch.device, num_rows: int, row_width: int,
                    constrained: bool, sampled: bool, mixed: bool, estimate: int) -> int:
    """Capture the worker's CUDA graphs (every step kind and batch size in one memory pool;
    `mixed`: the mixed steps' forwards too, beside a speculative wrap in a pool of their own);
    the bytes they hold, logged (the pools and the static inputs) beside the `estimate` that
    sizing by share reserved for them."""
    gc.collect()  # an earlier engine's graphs freed now, not between the two counts
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = _graph_pool_bytes(device)
    worker.enable_cuda_graphs(num_rows, row_width, constrained=constrained, sampled=sampled)
    if mixed:
        worker.capture_mixed(num_rows, row_width)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the warm-up forwards' cached blocks; the graphs keep their pool
    graph_bytes = _graph_pool_bytes(device) - before + _static_input_bytes(worker)
    logger.info("CUDA graphs: %d captured, holding %.1f MiB (their pools and static inputs; %.1f MiB "
                "estimated)", sum(len(graphs.captured) for graphs in _graph_sets(worker)),
                graph_bytes / MiB, estimate / MiB)
    return graph_bytes


def _graph_pool_bytes(device: torch.device) -> int:
    """What the process's CUDA graph pools hold on the device: the segments of every pool but
    the default one. Counted by pool rather than as reserved memory before and after, which
    moves with whatever else the process frees meanwhile (another engine collected while this
    one captures: the difference came out negative)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if segment.get("device", index) == index and tuple(segment["segment_pool_id"]) != (0, 0))


def _static_input_bytes(worker: Worker) -> int:
    """The captured steps' static input buffers (allocated outside the graphs' pool), and the
    mixed wrap's shared snapshot and chunk logits (spec/spec_worker.py `capture_mixed`)."""
    tensors = {t.data_ptr(): t.nbytes for graphs in _graph_sets(worker) for captured in graphs.captured.values()
               for t in captured.inputs if isinstance(t, torch.Tensor)}
    wrap = [getattr(worker, "mixed_snapshot", None)]
    chunk_logits = getattr(worker, "mixed_chunk_logits", None)
    if chunk_logits is not None and chunk_logits.buffers is not None:
        wrap += chunk_logits.buffers
    return sum(tensors.values()) + sum(t.nbytes for t in wrap if t is not None)


def _graph_sets(worker: Worker) -> list:
    """The worker's captured GraphedSteps (decode variants, extends and mixed forwards;
    adaptive speculation's of every draft shape, where the worker's own attributes are the
    configured shape's alone; not its drafter-state refresh's, whose pool bytes the pool count
    has)."""
    workers = worker.workers.values() if isinstance(worker, AdaptiveSpecWorker) else (worker,)
    return [graphs for w in workers
            for graphs in (w.graphs, *w.sampled_graphs.values(), *w.constrained_graphs.values(),
                           w.extend_graphs, w.mixed_graphs, *w.mixed_wrap_graphs.values())
            if graphs is not None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was requested but is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_spec(config: EngineConfig) -> Optional[SpecConfig]:
    """DEFAULT: speculate with the demo draft when serving the demo target, else not."""
    demo_draft = str(demo_models_dir() / "demo-draft")
    if config.spec is None:
        return None
    if config.spec == DEFAULT:
        if config.model is None and os.path.exists(demo_draft):
            return SpecConfig(draft_model=demo_draft)
        return None
    spec = config.spec
    if not spec.has_draft_model:  # drafts copied from earlier tokens
        return spec
    if spec.draft_model is None:
        if spec.algorithm == "nextn":  # the module ships inside the target checkpoint
            spec = dataclasses.replace(spec, draft_model=target_path(config))
        elif config.model is not None:
            raise ValueError("spec.draft_model: required unless the target is the bundled demo model")
        else:
            spec = dataclasses.replace(spec, draft_model=demo_draft)
    if not os.path.exists(os.path.join(spec.draft_model, "config.json")):
        raise ValueError(f"spec.draft_model: no config.json in {spec.draft_model}")
    if spec.algorithm == "nextn":  # refuse a checkpoint without the module before loading the target
        read_nextn_layout(spec.draft_model, dummy=config.load_format == "dummy")
    return spec


def check_tp_divides(cfg: ModelConfig, tp_size: int) -> None:
    """Refuse a split before any rank starts (the layers check again, per rank)."""
    tp = TensorParallel(tp_size, 0)
    tp.split(cfg.num_heads, "num_attention_heads")
    tp.split(cfg.intermediate_size, "intermediate_size")
    if cfg.moe is not None:
        tp.split(cfg.moe.moe_intermediate_size, "moe_intermediate_size")
    if cfg.mla is None:  # MLA keeps one latent KV head on every rank
        kv_head_range(cfg.num_kv_heads, tp)


def peak_slots(context_len: int, step_slots: int) -> int:
    """The most KV slots one request holds: a context of context_len - 1 written tokens (the
    last one is sampled, never fed) plus a decode step's reservation past it."""
    return context_len - 1 + step_slots


def fit_context_to_pool(context_len: int, num_slots: int, step_slots: int) -> int:
    """The largest context up to context_len whose peak fits the pool. One request alone then
    always fits: a request that cannot is refused at add_request (its prompt is too long) or
    ends with "length", instead of being found out mid-decode with nothing left to retract."""
    fit = num_slots - step_slots + 1  # the largest context with peak_slots <= num_slots
    if fit < 2:
        raise ValueError(f"max_total_tokens: {num_slots} KV slots cannot hold one request "
                         f"(a decode step reserves {step_slots} slots past its context)")
    if fit < context_len:
        logger.warning("max_context_len %d -> %d: one request must fit the %d-slot KV pool "
                       "(a decode step reserves %d slots)", context_len, fit, num_slots, step_slots)
        return fit
    return context_len


def _kv_scales(config: EngineConfig, model_path: str, num_layers: int) -> KVScales:
    """An FP8 pool's scales: the checkpoint's, else 1.0 (random weights have no checkpoint)."""
    reader = None if config.load_format == "dummy" else CheckpointReader(model_path)
    return resolve_kv_scales(reader, num_layers)


def _num_kv_slots(config: EngineConfig, cfg: ModelConfig, attn_layer, dtype: torch.dtype,
                  kv_dtype: torch.dtype, device: torch.device, num_rows: int,
                  spec: Optional[SpecConfig], context_len: int, step_slots: int,
                  allocated_before: int, *, constrained: bool) -> int:
    """Slots of the memory budget, at the target pool's bytes (`kv_dtype`: FP8 counts one byte
    an element) plus the draft's one layer (the model's `dtype`). On CUDA the budget is the
    engine's share of the device (kvcache/sizing.py): what it allocated since
    `allocated_before` (weights, the request table) and its reserve are taken off."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if cfg.mla is not None:
        per_slot = MLATokenToKVPool.bytes_per_slot(cfg.num_layers, cfg.mla.kv_lora_rank,
                                                   cfg.mla.qk_rope_head_dim, kv_dtype)
        if spec is not None and spec.algorithm == "nextn":  # one latent layer of its own
            per_slot += MLATokenToKVPool.bytes_per_slot(1, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, dtype)
        elif spec is not None and spec.has_draft_model:  # an EAGLE head's one layer: at most full MHA
            per_slot += TokenToKVPool.bytes_per_slot(1, 1, cfg.hidden_size, dtype)
    else:
        per_slot = TokenToKVPool.bytes_per_slot(cfg.num_layers, attn_layer.num_kv_heads,
                                                cfg.head_dim, kv_dtype)
        if spec is not None and spec.has_draft_model:  # an EAGLE head's one layer of the target's KV shape
            per_slot += TokenToKVPool.bytes_per_slot(1, attn_layer.num_kv_heads, cfg.head_dim,
                                                     dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the loader's freed buffers: not this engine's to keep
        free, total = torch.cuda.mem_get_info(device)
        share = MemoryShare(
            total=total, free=free, fraction=config.gpu_memory_utilization,
            held=torch.cuda.memory_allocated(device) - allocated_before + NON_TORCH_BYTES,
            reserve=_reserve_bytes(config, cfg, dtype, num_rows, spec, context_len, constrained))
        slots = kv_pool_slots(share, per_slot + SLOT_INDEX_BYTES, min_slots=step_slots + 1)
        logger.info("memory: %s; the KV pool takes %.2f GiB (%d slots)", share.describe(),
                    slots * per_slot / GiB, slots)
        return slots
    # CPU: enough for every row at full context, capped by a fraction of physical memory.
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    full = num_rows * peak_slots(context_len, step_slots)
    return max(16, min(full, int(physical * 0.25) // per_slot))


def _reserve_bytes(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, num_rows: int,
                   spec: Optional[SpecConfig], context_len: int, constrained: bool) -> int:
    """What the engine allocates besides the KV pool once it is sized (kvcache/sizing.py):
    the largest eager forward's transients (a prefill chunk, whose prompt logprobs may take
    logits of every token, or a full decode step, and choosing their tokens), the CUDA graphs'
    one shared pool (about the largest captured step's: a decode step of every row, or a
    2048-token captured extend) and the tables. The eager share also holds a capture's warm-up
    (an eager run of the step, runtime/cuda_graph.py), whose blocks the allocator keeps cached
    outside the graphs' pool while the capture allocates inside it."""
    chunk = config.chunked_prefill_size if config.chunked_prefill_size > 0 else context_len
    decode_tokens = _decode_tokens(num_rows, spec)
    tokens = max(chunk, decode_tokens)
    # Tokens are chosen for a decode step's rows at most (a prefill chooses one per request).
    eager = _workspace(config, cfg, dtype, tokens, tokens) + \
        _pick_bytes(cfg, decode_tokens, sampled=True, constrained=constrained)
    graphs = 0 if config.cuda_graph is False else \
        _graph_reserve_bytes(config, cfg, dtype, num_rows, spec, constrained, context_len)
    return eager + graphs + TABLES_BYTES


def _graph_reserve_bytes(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, num_rows: int,
                         spec: Optional[SpecConfig], constrained: bool, row_width: int) -> int:
    """The graphs' pool, estimated: the largest captured step's transients. Every variant is
    captured into the one pool, largest bucket first, so it holds about the largest's: a decode
    step of every row that draws its tokens (the sampled variants) under a grammar's mask (the
    constrained ones, where the engine serves grammars); with mixed steps also the buffer their
    graphs share (runtime/captured_mixed.py): the largest bucket's hidden states (or a verify
    of every row's) and, at most, three EAGLE-3 feature layers; and with chain speculation the
    one request-table snapshot of every row (`row_width` slots) their wrap's graphs share, and
    the float32 logits of the chunks their accept takes with the verify rows', and the mixed
    forwards' transients, which take a pool of their own beside such a wrap
    (spec/spec_worker.py `capture_mixed`)."""
    decode_tokens = _decode_tokens(num_rows, spec)
    mixed = 0
    if config.mixed_steps:
        mixed = max(MIXED_TOKEN_BUCKETS[-1], decode_tokens) * 4 * cfg.hidden_size * dtype.itemsize
        if spec is not None and spec.topk == 1:
            mixed += num_rows * row_width * 8 + CHUNK_LOGIT_ROWS * cfg.vocab_size * 4 + \
                _workspace(config, cfg, dtype, MIXED_TOKEN_BUCKETS[-1], 0)
    return _workspace(config, cfg, dtype, max(decode_tokens, TOKEN_BUCKETS[-1]),
                      decode_tokens + MAX_REQUESTS) + mixed + \
        _pick_bytes(cfg, decode_tokens, sampled=config.cuda_graph_sampled, constrained=constrained)


def _pick_bytes(cfg: ModelConfig, logit_rows: int, sampled: bool, constrained: bool) -> int:
    """What choosing the tokens of `logit_rows` rows allocates besides their logits: the seeded
    draw of sampled rows (layers/sampler.py) and a grammar's mask (grammar/bitmask.py)."""
    return (draw_workspace_bytes(logit_rows, cfg.vocab_size) if sampled else 0) + \
        (bitmask_workspace_bytes(logit_rows, cfg.vocab_size) if constrained else 0)


def _decode_tokens(num_rows: int, spec: Optional[SpecConfig]) -> int:
    """Tokens of a decode step of every row (a verify block, or a tree level's branches)."""
    return num_rows * (1 if spec is None else max(spec.num_draft_tokens, spec.topk))


def _workspace(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, tokens: int,
               logit_rows: int) -> int:
    return forward_workspace_bytes(tokens, logit_rows, cfg.hidden_size,
                                   cfg.intermediate_size // config.tp_size, cfg.vocab_size,
                                   dtype.itemsize)


def _wants_cuda_graphs(config: EngineConfig, device: torch.device, attn: AttentionBackend,
                       cfg: ModelConfig) -> bool:
    """On by default on CUDA with backends whose metadata a graph can capture (Triton, and
    FlashInfer's sync-free plan; the draft's backend is the same kind as the target's), and
    routed experts the Triton MoE kernel runs without host reads."""
    if config.cuda_graph is False or device.type != "cuda":
        if config.cuda_graph and device.type != "cuda":
            raise ValueError("cuda_graph: needs a CUDA device")
        return False
    if not attn.supports_cuda_graphs:
        if config.cuda_graph:
            raise ValueError(f"cuda_graph: the {type(attn).__name__} backend cannot be captured "
                             "with host-synced plans; use attention_backend='triton', or "
                             "needs_cpu_seq_lens=False for FlashInfer's sync-free plan")
        return False
    if cfg.moe is not None and not experts_capturable():
        if config.cuda_graph:
            raise ValueError("cuda_graph: the routed experts need the Triton fused-MoE kernel "
                             "to be captured (engine/layers/fused_moe_triton.py)")
        return False
    return True


def _eos_ids(path: str, cfg: ModelConfig) -> list[int]:
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return list(cfg.eos_token_ids)
