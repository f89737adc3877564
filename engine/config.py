"""Frozen, validated configuration: EngineConfig, SpecConfig, SamplingParams.

Validation errors are ValueError and name the offending field, so that the server can map
them to INVALID_ARGUMENT without parsing messages.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

DEFAULT = "default"  # sentinel: "use the bundled demo model / draft"

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32
# (1e-45 turned every logit into inf and the softmax into NaN, which argmax reads as token 0).
GREEDY_TEMPERATURE = 1e-5
# A penalty divides (or multiplies) logits; outside this range it overflows them or wipes out
# every repeated token, and no sampling setting in use comes near either end.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
# OpenAI's ranges: presence/frequency penalties subtract from logits, a bias adds to them.
PRESENCE_FREQUENCY_PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 300
# Most alternatives returned per token (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20
# Most sequences one request may ask for (n).
MAX_N = 64
# EngineConfig.kv_cache_dtype: "auto" (the model's dtype) or an FP8 format
# (engine/kvcache/fp8.py maps the names to torch dtypes; this module stays free of torch).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {message}")


_TCP_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def check_zmq_endpoint(field_name: str, endpoint: str) -> None:
    """Raise ValueError naming the field (and its flag) unless `endpoint` is tcp://HOST:PORT or
    ipc://PATH."""
    match = _TCP_ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if isinstance(endpoint, str) and endpoint.startswith("ipc://") and len(endpoint) > 6:
        return
    flag = "--" + field_name.replace("_", "-")
    _require(match is not None and 1 <= int(match.group(2)) <= 65535, f"{field_name} ({flag})",
             f"must be tcp://HOST:PORT (a host of * binds every interface) or ipc://PATH, "
             f"got {endpoint!r}")


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
# Longest grammar source (a JSON schema, regex or EBNF text) a request may carry.
MAX_GRAMMAR_CHARS = 64 * 1024


QUANTIZATION_FLAGS = ("auto", "fp8", "awq", "gptq")  # quantization/config.py: what each serves


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (structured outputs): any JSON object, a JSON schema,
    a regex or an EBNF grammar (xgrammar's dialect), as `source` text. With
    `after_token_id` set (a reasoning model's end-of-thinking token), the grammar applies only
    to the tokens after the first such token the request generates. The source is checked when
    it is compiled (engine/grammar); the server parses it first to refuse a bad one by name."""

    kind: str
    source: str = ""
    after_token_id: Optional[int] = None

    def __post_init__(self):
        _require(self.kind in GRAMMAR_KINDS, "structured_output",
                 f"must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        _require(isinstance(self.source, str) and len(self.source) <= MAX_GRAMMAR_CHARS,
                 f"structured_output.{self.kind}",
                 f"must be text of at most {MAX_GRAMMAR_CHARS} characters")
        _require(self.kind == "json_object" or bool(self.source), f"structured_output.{self.kind}",
                 "must not be empty")
        _require(self.after_token_id is None or (isinstance(self.after_token_id, int)
                                                 and self.after_token_id >= 0),
                 "structured_output.after_token_id", "must be a token id")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules (the same defaults as the gRPC API documents)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0        # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0                  # 0 (or -1) means no top-k filter
    top_p: float = 1.0              # in (0, 1]
    min_p: float = 0.0              # in [0, 1)
    repetition_penalty: float = 1.0  # in REPETITION_PENALTY_RANGE; 1 means off (HF semantics)
    seed: Optional[int] = None      # same seed -> same output, whatever the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False          # return the log-probability of each chosen token
    # The k most likely tokens and their log-probabilities at every generated position (needs
    # logprobs); from the same distribution as `logprobs` (see the sampler).
    top_logprobs: int = 0
    # OpenAI semantics over generated tokens (not the prompt): logit -= frequency_penalty *
    # count + presence_penalty * (count > 0); in PRESENCE_FREQUENCY_PENALTY_RANGE, 0 is off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs added to the logits, sorted by id; a dict is accepted and sorted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: off. k >= 0: the log-probability of every prompt token after the first (from the
    # prefill's logits), with the k most likely alternatives at each position.
    prompt_logprobs: Optional[int] = None
    # Sequences generated from the prompt, each with its own seed (sequence_seed); the prompt
    # is prefilled once and its KV shared.
    n: int = 1
    # Structured outputs: the grammar every generated token must keep the output inside of.
    grammar: Optional[GrammarSpec] = None

    def __post_init__(self):
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._normalise_logit_bias()
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
                 "max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        _require(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens,
                 "min_new_tokens", f"must be an integer >= 0, got {self.min_new_tokens!r}")
        _require(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 f"must not exceed max_new_tokens ({self.min_new_tokens} > {self.max_new_tokens})")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool)
                     and math.isfinite(value), name, f"must be a finite number, got {value!r}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
                 f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(0.0 <= self.min_p < 1.0, "min_p", f"must be in [0, 1), got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        _require(low <= self.repetition_penalty <= high, "repetition_penalty",
                 f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        low, high = PRESENCE_FREQUENCY_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            _require(low <= getattr(self, name) <= high, name,
                     f"must be in [{low:g}, {high:g}], got {getattr(self, name)}")
        _require(isinstance(self.logprobs, bool), "logprobs", f"must be a bool, got {self.logprobs!r}")
        _require(isinstance(self.top_logprobs, int) and not isinstance(self.top_logprobs, bool)
                 and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
                 f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        _require(self.top_logprobs == 0 or self.logprobs, "top_logprobs",
                 "needs logprobs (the chosen tokens' log-probabilities) to be set")
        _require(self.prompt_logprobs is None or (
            isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
            and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS), "prompt_logprobs",
            f"must be unset or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        _require(isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= MAX_N,
                 "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        _require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
                 "seed", f"must be a non-negative 63-bit integer, got {self.seed!r}")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", "must be non-negative integers")
        _require(self.grammar is None or isinstance(self.grammar, GrammarSpec), "structured_output",
                 f"must be a GrammarSpec, got {self.grammar!r}")
        if self.grammar is not None:
            # A grammar ends on a stop token: with none it could never end, and banning them
            # for min_new_tokens could leave a finished grammar nothing to generate.
            _require(not self.ignore_eos or bool(self.stop_token_ids), "ignore_eos",
                     "a structured output ends on EOS or a stop token; with ignore_eos set, "
                     "give stop_token_ids")
            _require(self.min_new_tokens == 0, "min_new_tokens",
                     "is not supported with a structured output (the grammar decides the end)")

    def _normalise_logit_bias(self) -> None:
        bias = self.logit_bias
        items = list(bias.items()) if isinstance(bias, dict) else list(bias)
        _require(len(items) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                 f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(items)}")
        low, high = LOGIT_BIAS_RANGE
        for item in items:
            _require(isinstance(item, tuple) and len(item) == 2, "logit_bias",
                     f"must map token ids to numbers, got {item!r}")
            token, value = item
            _require(isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                     "logit_bias", f"token id {token!r} must be a non-negative integer")
            _require(isinstance(value, (int, float)) and not isinstance(value, bool)
                     and math.isfinite(value) and low <= value <= high, "logit_bias",
                     f"bias {value!r} of token {token} must be a number in [{low:g}, {high:g}]")
        ids = [token for token, _ in items]
        _require(len(set(ids)) == len(ids), "logit_bias", "token ids must not repeat")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in items)))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalises_repeats(self) -> bool:
        """Whether a token's earlier occurrences change its logit."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def sequence_seed(seed: int, index: int) -> int:
    """The seed sequence `index` of an n > 1 request samples with: the request's seed + index
    (mod 2^63), so sequence i equals a request of n = 1 with that seed."""
    return (seed + index) % (1 << 63)


# Suffix drafting's corpus (spec/suffix.py): tokens of recent outputs it looks drafts up in.
SUFFIX_CORPUS_TOKENS = 32768


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE speculative decoding. Chain drafting is topk == 1 (num_draft_tokens = num_steps + 1).

    "nextn" drafts with DeepSeek-V3's multi-token-prediction module the EAGLE-1 way; its
    draft_model defaults to the target checkpoint, which stores the module. "ngram" copies
    drafts from the request's own tokens (prompt lookup: the longest earlier occurrence of its
    last ngram_max..ngram_min tokens); "suffix" also looks them up in a corpus of recent requests'
    outputs (spec/suffix.py). Both have no draft model and draft a chain."""

    algorithm: str = "eagle3"       # "eagle3" | "eagle" | "nextn" | "ngram" | "suffix"
    # None: the bundled demo draft (only with the demo target); with nextn, the target itself
    draft_model: Optional[str] = None
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    # Bench-only: accept exactly this many draft tokens per verify (random weights). Refused by
    # the server; see bench/one_batch.py.
    bench_force_accept_len: Optional[int] = None
    ngram_max: int = 4              # ngram, suffix: the longest suffix looked up
    ngram_min: int = 1              # ngram, suffix: the shortest suffix a match may have
    suffix_corpus_tokens: int = SUFFIX_CORPUS_TOKENS  # suffix: the ring of remembered outputs
    # Each step's draft shape (plain, chains of 1 .. num_steps drafts, with topk > 1 the trees of
    # that width too) chosen from the batch size and the measured acceptance, by step times
    # measured at start-up (spec/adaptive.py).
    adaptive: bool = False

    def __post_init__(self):
        _require(self.algorithm in ("eagle", "eagle3", "nextn", "ngram", "suffix"), "spec.algorithm",
                 f"must be 'eagle', 'eagle3', 'nextn', 'ngram' or 'suffix', got {self.algorithm!r}")
        if not self.has_draft_model:
            _require(self.draft_model is None, "spec.draft_model",
                     f"{self.algorithm} copies drafts from earlier tokens: no draft model")
            _require(self.topk == 1, "spec.topk", f"{self.algorithm} drafts a chain: must be 1, got {self.topk!r}")
        _require(isinstance(self.adaptive, bool), "spec.adaptive", f"must be True or False, got {self.adaptive!r}")
        _require(isinstance(self.ngram_min, int) and self.ngram_min >= 1, "spec.ngram_min",
                 f"must be >= 1, got {self.ngram_min!r}")
        _require(isinstance(self.ngram_max, int) and self.ngram_max >= self.ngram_min, "spec.ngram_max",
                 f"must be >= ngram_min ({self.ngram_min!r}), got {self.ngram_max!r}")
        _require(isinstance(self.num_steps, int) and self.num_steps >= 1, "spec.num_steps",
                 f"must be >= 1, got {self.num_steps!r}")
        _require(isinstance(self.topk, int) and self.topk >= 1, "spec.topk",
                 f"must be >= 1, got {self.topk!r}")
        if self.topk == 1:
            _require(self.num_draft_tokens == self.num_steps + 1, "spec.num_draft_tokens",
                     f"chain drafting (topk=1) needs num_draft_tokens == num_steps + 1 = "
                     f"{self.num_steps + 1}, got {self.num_draft_tokens}")
        else:
            max_nodes = self.topk + (self.num_steps - 1) * self.topk ** 2
            _require(2 <= self.num_draft_tokens <= max_nodes + 1, "spec.num_draft_tokens",
                     f"must be in [2, {max_nodes + 1}] for topk={self.topk}, "
                     f"num_steps={self.num_steps}; got {self.num_draft_tokens}")
        if self.algorithm == "suffix":
            least = self.ngram_max + self.num_draft_tokens  # a whole match and its drafts
            _require(isinstance(self.suffix_corpus_tokens, int) and self.suffix_corpus_tokens >= least,
                     "spec.suffix_corpus_tokens",
                     f"must be >= ngram_max + num_draft_tokens ({least}), got {self.suffix_corpus_tokens!r}")
        else:
            _require(self.suffix_corpus_tokens == SUFFIX_CORPUS_TOKENS, "spec.suffix_corpus_tokens",
                     f"only suffix drafting has a corpus (algorithm {self.algorithm!r})")

    @property
    def has_draft_model(self) -> bool:
        """ngram and suffix copy their drafts from earlier tokens."""
        return self.algorithm not in ("ngram", "suffix")

    @property
    def kv_reserve_per_request(self) -> int:
        """KV slots a decode step keeps reserved past the committed length: the draft region
        and the verify block overlap, and x2 absorbs the overlap loop's one-iteration lag."""
        return 2 * max(self.topk * self.num_steps, self.num_draft_tokens)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. `model=None` selects the bundled demo model."""

    model: Optional[str] = None
    device: str = "auto"            # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"             # "auto" (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    max_running_requests: int = 64
    max_total_tokens: Optional[int] = None  # KV pool slots; None: sized by gpu_memory_utilization
    # The fraction of the device's total memory this engine may take in all (weights, KV pool,
    # CUDA graphs, activations): the KV pool gets what the rest leaves (kvcache/sizing.py).
    # vLLM's --gpu-memory-utilization; two engines of 0.45 share one GPU. CUDA only.
    gpu_memory_utilization: float = 0.9
    chunked_prefill_size: int = 2048  # token budget of one prefill batch; 0 or less disables
    # Decode fairness: while some request decodes, at most this many prompt tokens are
    # computed between two decode steps: riding in the decode step (mixed_steps; the cap of
    # the adaptive budget below) or in an extend of their own followed by a decode step
    # (docs/architecture.md "The mixed step"). Long prompts are chunked; cached prefixes are
    # free. With nobody decoding, an extend is bounded by chunked_prefill_size only. 0 turns
    # it off (prefill first: extends back to back while prompts wait).
    prefill_interleave_tokens: int = 1024
    # Prompt chunks ride in decode steps (docs/architecture.md "The mixed step"); False: the
    # separate bounded extends above (what a FlashInfer target always runs). Off by default:
    # eager mixed steps lost 18-28 % of served throughput on an H100 (benchmarks.md); their
    # CUDA graphs (runtime/captured_mixed.py) are not measured yet.
    mixed_steps: bool = False
    # A mixed step carries the most prompt tokens whose predicted step time stays within this
    # many times the decode step alone's (a cost model fitted from the steps' times,
    # engine/scheduler/step_cost.py), at least an eighth of prefill_interleave_tokens; 1.5
    # keeps the inter-token p99 within 2x its p50 with margin. 0: no cost model, a mixed step
    # carries up to prefill_interleave_tokens.
    mixed_step_time_ratio: float = 1.5
    max_context_len: Optional[int] = None  # None: the model's max_position_embeddings
    enable_overlap: bool = True
    spec: Union[SpecConfig, None, str] = DEFAULT  # DEFAULT: on with the demo pair, else off
    attention_backend: str = "auto"  # "auto" (triton on CUDA, torch on CPU) | "torch" | "triton"
    cuda_graph: Optional[bool] = None  # None: on with CUDA
    # With CUDA graphs, also capture sampled decode steps (temperature / top-k / top-p / min-p;
    # two variants per bucket, in the greedy graphs' memory pool): about 3x the capture time.
    cuda_graph_sampled: bool = True
    needs_cpu_seq_lens: Optional[bool] = None  # None: decided by the backends; True forces host lengths
    seed: int = 0
    load_format: str = "auto"       # "auto": safetensors; "dummy": random weights (benchmarks)
    tp_size: int = 1
    # With tp_size > 1 on GPUs: small all-reduces over symmetric memory (engine/layers/
    # all_reduce.py), NCCL for the rest (8B bs=1 on H100s: tp=2 1.08x, tp=4 1.14x NCCL's
    # tokens/s); False: NCCL for every all-reduce.
    custom_all_reduce: bool = True
    # Radix prefix cache: requests reuse the KV of cached prompt prefixes (and, with a draft
    # model, the draft's KV too); False prefills every prompt from scratch.
    enable_prefix_cache: bool = True
    # Decode-sized GEMMs (<= 16 rows) on CUDA in the Triton skinny GEMM where its per-shape
    # rule picks it (engine/layers/skinny_gemm.py); False keeps cuBLAS everywhere (an A/B).
    skinny_gemm: bool = True
    # The target's KV pool: "auto" stores the model's dtype; "fp8_e4m3" stores float8_e4m3fn
    # with per-layer K and V scales from the checkpoint (else 1.0), half the bytes per token
    # (engine/kvcache/fp8.py). The draft's one-layer pool keeps the model's dtype.
    kv_cache_dtype: str = "auto"
    # Weight format: "auto" serves the checkpoint as it is stored (its quantization_config);
    # "fp8" serves FP8 weights, quantizing a 16-bit checkpoint at load (per channel; with
    # load_format="dummy": random block-wise FP8); "awq" / "gptq" require such a checkpoint.
    quantization: str = "auto"
    # With quantization "fp8" on a 16-bit checkpoint: the (untied) LM head in FP8 too.
    quantize_lm_head: bool = False
    # Structured outputs: a grammar must compile within this many seconds (in the grammar
    # process); past it the request fails with INVALID_ARGUMENT naming the field.
    grammar_compile_seconds: float = 10.0
    # KV-cache events for gateways (engine/kv_events.py; docs/deployment.md "KV events"): the
    # prefix cache's stored and evicted blocks of kv_events_block_size tokens, published as
    # vLLM does on a ZeroMQ PUB socket at this endpoint; None: off (no socket). The replay
    # endpoint (a ROUTER, bound) answers requests for the batches from a sequence number on.
    kv_events_endpoint: Optional[str] = None
    kv_events_replay_endpoint: Optional[str] = None
    kv_events_topic: str = ""
    kv_events_block_size: int = 16
    # A JSON line per engine step written to this file (rank 0; engine/scheduler/step_log.py:
    # what each step carried, why, what it was predicted to take and took); None: off.
    step_log: Optional[str] = None

    def __post_init__(self):
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.max_running_requests >= 1, "max_running_requests", "must be >= 1")
        _require(self.max_total_tokens is None or self.max_total_tokens >= 16,
                 "max_total_tokens", "must be >= 16")
        _require(isinstance(self.gpu_memory_utilization, (int, float))
                 and not isinstance(self.gpu_memory_utilization, bool)
                 and 0.0 < self.gpu_memory_utilization <= 1.0,
                 "gpu_memory_utilization (--gpu-memory-utilization)",
                 f"must be a fraction in (0, 1], got {self.gpu_memory_utilization!r}")
        _require(isinstance(self.prefill_interleave_tokens, int) and self.prefill_interleave_tokens >= 0,
                 "prefill_interleave_tokens",
                 f"must be an integer >= 0 (0 turns it off), got {self.prefill_interleave_tokens!r}")
        ratio = self.mixed_step_time_ratio
        _require(isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                 and (ratio == 0 or 1.0 <= ratio < float("inf")),
                 "mixed_step_time_ratio (--mixed-step-time-ratio)",
                 f"must be a number >= 1 (0: no cost model), got {self.mixed_step_time_ratio!r}")
        _require(self.grammar_compile_seconds > 0, "grammar_compile_seconds", "must be > 0")
        _require(self.max_context_len is None or self.max_context_len >= 2,
                 "max_context_len", "must be >= 2")
        _require(self.attention_backend in ("auto", "torch", "triton", "flashinfer"),
                 "attention_backend", f"unknown backend {self.attention_backend!r}")
        _require(self.load_format in ("auto", "dummy"), "load_format",
                 f"must be 'auto' or 'dummy', got {self.load_format!r}")
        _require(isinstance(self.tp_size, int) and self.tp_size >= 1, "tp_size", "must be >= 1")
        _require(isinstance(self.enable_prefix_cache, bool), "enable_prefix_cache",
                 f"must be True or False, got {self.enable_prefix_cache!r}")
        _require(isinstance(self.skinny_gemm, bool), "skinny_gemm",
                 f"must be True or False, got {self.skinny_gemm!r}")
        _require(isinstance(self.custom_all_reduce, bool), "custom_all_reduce",
                 f"must be True or False, got {self.custom_all_reduce!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        # FlashInfer's kernels are not given the pool's scales here; the Triton and torch
        # backends dequantise.
        _require(self.kv_cache_dtype == "auto" or self.attention_backend != "flashinfer",
                 "kv_cache_dtype", f"{self.kv_cache_dtype} is not supported by the flashinfer "
                 "attention backend; use attention_backend 'triton' (or 'auto', 'torch')")
        _require(self.quantization in QUANTIZATION_FLAGS, "quantization",
                 f"must be one of {', '.join(QUANTIZATION_FLAGS)}, got {self.quantization!r}")
        _require(not self.quantize_lm_head or self.quantization == "fp8", "quantize_lm_head",
                 "quantizes the LM head at load: it needs quantization 'fp8'")
        _require(self.spec is None or self.spec == DEFAULT or isinstance(self.spec, SpecConfig),
                 "spec", "must be a SpecConfig, None or 'default'")
        self._check_kv_events()
        _require(self.step_log is None or (isinstance(self.step_log, str) and self.step_log.strip() != ""
                                           and not os.path.isdir(self.step_log)
                                           and os.path.isdir(os.path.dirname(os.path.abspath(self.step_log)))),
                 "step_log (--step-log)", f"must be a file path in an existing directory, got {self.step_log!r}")

    def _check_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, name) is not None:
                check_zmq_endpoint(name, getattr(self, name))
        _require(self.kv_events_replay_endpoint is None or self.kv_events_endpoint is not None,
                 "kv_events_replay_endpoint (--kv-events-replay-endpoint)",
                 "replays the events of --kv-events-endpoint; give that too")
        _require(self.kv_events_endpoint is None or self.enable_prefix_cache,
                 "kv_events_endpoint (--kv-events-endpoint)",
                 "reports the prefix cache, which is disabled (--disable-prefix-cache)")
        _require(isinstance(self.kv_events_topic, str), "kv_events_topic",
                 f"must be text, got {self.kv_events_topic!r}")
        _require(isinstance(self.kv_events_block_size, int)
                 and not isinstance(self.kv_events_block_size, bool)
                 and self.kv_events_block_size >= 1, "kv_events_block_size (--kv-events-block-size)",
                 f"must be an integer >= 1, got {self.kv_events_block_size!r}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
