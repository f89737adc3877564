"""Every conversion between the engine's types and the wire messages of `specserve.proto`.

The gRPC server and the engine process talk in the public messages (generate.proto) where
both sides share a meaning (sampling parameters, what the model is, the load) and in the IPC
messages (engine_ipc.proto) for the rest; this module is the one place that maps them onto
SamplingParams, EngineInfo, StepOutput and EngineLoad, in both directions. A step's outputs go
as one columnar BatchOutput (encode_batch / decode_batch).
"""
from __future__ import annotations

from typing import Optional, Sequence

import dataclasses

import numpy as np

from specserve.engine.config import GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.outputs import (EngineInfo, EngineLoad, FinishError, GrammarHealth,
                                      StepOutput, StepStat, TopLogprobs)
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.proto import generate_pb2 as pb

# SamplingParams fields that the API carries as `optional` scalars of the same name: an unset
# one keeps the SamplingParams default, which is what generate.proto documents.
_SCALAR_SAMPLING_FIELDS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k",
                           "min_p", "repetition_penalty", "seed", "ignore_eos", "logprobs",
                           "presence_penalty", "frequency_penalty", "top_logprobs", "prompt_logprobs", "n")
_SPEC_FIELDS = ("algorithm", "draft_model", "num_steps", "topk", "num_draft_tokens")


# --- sampling ------------------------------------------------------------------------------------
def sampling_from_proto(msg: pb.SamplingParams,
                        default_max_new_tokens: int = SamplingParams.max_new_tokens) -> SamplingParams:
    """Unset fields take their defaults; ValueError naming the field for a bad value."""
    kwargs = {name: getattr(msg, name) for name in _SCALAR_SAMPLING_FIELDS if msg.HasField(name)}
    kwargs.setdefault("max_new_tokens", default_max_new_tokens)
    return SamplingParams(stop_token_ids=tuple(msg.stop_token_ids), logit_bias=dict(msg.logit_bias),
                          **kwargs)


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field set (but `seed` and `prompt_logprobs` when off), so the receiver needs no
    defaults."""
    values = {name: getattr(params, name) for name in _SCALAR_SAMPLING_FIELDS}
    for name in ("seed", "prompt_logprobs"):
        if values[name] is None:
            del values[name]
    return pb.SamplingParams(stop_token_ids=params.stop_token_ids, logit_bias=dict(params.logit_bias),
                             **values)


# --- structured outputs and requests ------------------------------------------------------------
def grammar_from_proto(msg: pb.StructuredOutput,
                       after_token_id: Optional[int] = None) -> Optional[GrammarSpec]:
    """None when no grammar is set; ValueError naming the field for a bad one (sizes and
    emptiness here; the source itself is parsed by engine.grammar.compiler.parse_grammar)."""
    kind = msg.WhichOneof("grammar")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise ValueError("structured_output.json_object: set it to true (or leave "
                             "structured_output unset)")
        return GrammarSpec(kind, after_token_id=after_token_id)
    return GrammarSpec(kind, getattr(msg, kind), after_token_id)


def grammar_to_proto(spec: GrammarSpec) -> pb.StructuredOutput:
    if spec.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{spec.kind: spec.source})


def add_request_to_proto(rid: str, prompt_token_ids, sampling: SamplingParams) -> ipc.AddRequest:
    msg = ipc.AddRequest(rid=rid, prompt_token_ids=prompt_token_ids,
                         sampling=sampling_to_proto(sampling))
    if sampling.grammar is not None:
        msg.structured_output.CopyFrom(grammar_to_proto(sampling.grammar))
        if sampling.grammar.after_token_id is not None:
            msg.grammar_after_token_id = sampling.grammar.after_token_id
    return msg


def sampling_from_add_request(msg: ipc.AddRequest) -> SamplingParams:
    """The request's SamplingParams with its grammar; ValueError naming the field."""
    sampling = sampling_from_proto(msg.sampling)
    after = msg.grammar_after_token_id if msg.HasField("grammar_after_token_id") else None
    grammar = grammar_from_proto(msg.structured_output, after)
    return sampling if grammar is None else dataclasses.replace(sampling, grammar=grammar)


# --- what the engine serves ------------------------------------------------------------------------
def info_to_proto(info: EngineInfo) -> pb.ModelInfo:
    msg = pb.ModelInfo(model=info.model, architecture=info.architecture,
                       vocab_size=info.vocab_size, max_context_len=info.max_context_len,
                       dtype=info.dtype, device=info.device, eos_token_ids=info.eos_token_ids,
                       weight_dtype=info.weight_dtype, kv_cache_dtype=info.kv_cache_dtype)
    if info.spec is not None:
        msg.spec.CopyFrom(pb.SpecConfig(**{name: getattr(info.spec, name) for name in _SPEC_FIELDS}))
    return msg


def info_from_proto(msg: pb.ModelInfo) -> EngineInfo:
    # An unset draft_model (ngram has none) arrives as "".
    spec = SpecConfig(**{name: getattr(msg.spec, name) or None if name == "draft_model" else getattr(msg.spec, name)
                         for name in _SPEC_FIELDS}) if msg.HasField("spec") else None
    return EngineInfo(model=msg.model, architecture=msg.architecture, vocab_size=msg.vocab_size,
                      max_context_len=msg.max_context_len, dtype=msg.dtype, device=msg.device,
                      eos_token_ids=tuple(msg.eos_token_ids), spec=spec, weight_dtype=msg.weight_dtype,
                      kv_cache_dtype=msg.kv_cache_dtype)


# --- per-step outputs -------------------------------------------------------------------------------
FLAG_FINISHED = 1
FLAG_MATCHED_STOP = 2
_FINISH_CODES = {"stop": 1, "length": 2, "abort": 3, "error": 4}
_FINISH_NAMES = (None, "stop", "length", "abort", "error")
_U32, _F32, _U8 = np.dtype("<u4"), np.dtype("<f4"), np.dtype("u1")
_F64 = np.dtype("<f8")


def _ragged_lists(lists: Sequence[Optional[Sequence]]) -> tuple[list[int], list]:
    """Counts (0 for None) and the values of optional lists, for one column pair."""
    counts, values = [], []
    for values_of in lists:
        if values_of:
            counts.append(len(values_of))
            values += values_of
        else:
            counts.append(0)
    return counts, values


def _ragged_tops(tops: Sequence[Optional[list[TopLogprobs]]]):
    """Counts per entry (positions), sizes per position, candidate ids and log-probabilities."""
    counts, sizes, ids, logprobs = [], [], [], []
    for top in tops:
        if not top:
            counts.append(0)
            continue
        counts.append(len(top))
        for candidates in top:
            sizes.append(len(candidates))
            for token_id, logprob in candidates:
                ids.append(token_id)
                logprobs.append(logprob)
    return counts, sizes, ids, logprobs


def _bytes(values, dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes() if len(values) else b""


def encode_batch(outputs: Sequence[StepOutput], steps: Sequence[StepStat] = (),
                 load: Optional[EngineLoad] = None) -> ipc.BatchOutput:
    """One scheduler step's outputs, the steps processed since the previous message and the
    engine's load after them, as one columnar BatchOutput (decode_batch, decode_step_stats and
    decode_load reverse it)."""
    flags, reasons, matched, counters = [], [], [], []
    for out in outputs:
        flags.append((FLAG_FINISHED if out.finished else 0)
                     | (FLAG_MATCHED_STOP if out.matched_stop is not None else 0))
        reasons.append(_FINISH_CODES[out.finish_reason] if out.finish_reason else 0)  # KeyError: a new reason
        matched.append(out.matched_stop or 0)
        counters += (out.prompt_tokens, out.completion_tokens, out.num_verify_steps,
                     out.num_accepted_drafts, out.cached_tokens)
    num_tokens, token_ids = _ragged_lists([out.new_token_ids for out in outputs])
    lp_counts, lps = _ragged_lists([out.new_logprobs for out in outputs])
    plp_counts, plps = _ragged_lists([out.prompt_logprobs for out in outputs])
    top = _ragged_tops([out.new_top_logprobs for out in outputs])
    ptop = _ragged_tops([out.prompt_top_logprobs for out in outputs])
    msg = ipc.BatchOutput(
        rids=[out.rid for out in outputs], indexes=_bytes([out.index for out in outputs], _U32),
        num_tokens=_bytes(num_tokens, _U32), token_ids=_bytes(token_ids, _U32),
        flags=_bytes(flags, _U8), finish_reasons=_bytes(reasons, _U8),
        matched_stop=_bytes(matched, _U32), counters=_bytes(counters, _U32))
    if lps:
        msg.logprob_counts, msg.logprobs = _bytes(lp_counts, _U32), _bytes(lps, _F32)
    if plps:
        msg.prompt_logprob_counts = _bytes(plp_counts, _U32)
        msg.prompt_logprobs = _bytes(plps, _F32)
    if any(top[0]):
        (msg.top_counts, msg.top_sizes, msg.top_ids, msg.top_logprobs) = (
            _bytes(top[0], _U32), _bytes(top[1], _U32), _bytes(top[2], _U32),
            _bytes(top[3], _F32))
    if any(ptop[0]):
        (msg.prompt_top_counts, msg.prompt_top_sizes, msg.prompt_top_ids,
         msg.prompt_top_logprobs) = (_bytes(ptop[0], _U32), _bytes(ptop[1], _U32),
                                     _bytes(ptop[2], _U32), _bytes(ptop[3], _F32))
    stamped = [i for i, out in enumerate(outputs) if out.stamps is not None]
    if stamped:
        msg.stamp_entries = _bytes(stamped, _U32)
        msg.stamps = _bytes([t for i in stamped for t in outputs[i].stamps], _F64)
    msg.errors.extend(ipc.SequenceError(entry=i, code=out.error.code, message=out.error.message)
                      for i, out in enumerate(outputs) if out.error is not None)
    if steps:
        msg.step_extend = _bytes([s.extend for s in steps], _U8)
        msg.step_seconds = _bytes([s.seconds for s in steps], _F64)
        msg.step_tokens = _bytes([s.tokens for s in steps], _U32)
        msg.step_others = _bytes([s.others for s in steps], _U32)
        msg.step_draft_depths = _bytes([s.draft_depth for s in steps], _U8)
    if load is not None:
        msg.load.CopyFrom(load_to_proto(load))
    return msg


def decode_step_stats(msg: ipc.BatchOutput) -> list[StepStat]:
    """The StepStats of a BatchOutput (encode_batch's `steps`)."""
    return [StepStat(bool(e), s, t, o, d) for e, s, t, o, d in zip(
        _column(msg.step_extend, _U8), _column(msg.step_seconds, _F64),
        _column(msg.step_tokens, _U32), _column(msg.step_others, _U32),
        _column(msg.step_draft_depths, _U8))]


def decode_load(msg: ipc.BatchOutput) -> Optional[EngineLoad]:
    """The engine's load a BatchOutput carries (encode_batch's `load`), if any."""
    return load_from_proto(msg.load) if msg.HasField("load") else None


def _column(data: bytes, dtype: np.dtype) -> list:
    return np.frombuffer(data, dtype=dtype).tolist() if data else []


def _split(counts: list[int], values: list) -> list[Optional[list]]:
    """The optional lists of _ragged_lists back (None for a count of 0)."""
    out, at = [], 0
    for count in counts:
        if count:
            out.append(values[at:at + count])
            at += count
        else:
            out.append(None)
    return out


def _split_tops(n: int, counts: bytes, sizes: bytes, ids: bytes,
                logprobs: bytes) -> list[Optional[list[TopLogprobs]]]:
    if not counts:
        return [None] * n
    pairs = list(zip(_column(ids, _U32), _column(logprobs, _F32)))
    per_position = _split(_column(sizes, _U32), pairs)
    return [[p or [] for p in group] if group is not None else None
            for group in _split(_column(counts, _U32), per_position)]


def decode_batch(msg: ipc.BatchOutput) -> list[StepOutput]:
    """The StepOutputs of a BatchOutput: a few array conversions for the step, then one
    StepOutput per entry, made of slices."""
    rids = list(msg.rids)
    n = len(rids)
    indexes = _column(msg.indexes, _U32)
    tokens = _split(_column(msg.num_tokens, _U32), _column(msg.token_ids, _U32))
    flags = _column(msg.flags, _U8)
    reasons = _column(msg.finish_reasons, _U8)
    matched = _column(msg.matched_stop, _U32)
    counters = _column(msg.counters, _U32)
    logprobs = (_split(_column(msg.logprob_counts, _U32), _column(msg.logprobs, _F32))
                if msg.logprob_counts else [None] * n)
    prompt_logprobs = (_split(_column(msg.prompt_logprob_counts, _U32),
                              _column(msg.prompt_logprobs, _F32))
                       if msg.prompt_logprob_counts else [None] * n)
    tops = _split_tops(n, msg.top_counts, msg.top_sizes, msg.top_ids, msg.top_logprobs)
    prompt_tops = _split_tops(n, msg.prompt_top_counts, msg.prompt_top_sizes,
                              msg.prompt_top_ids, msg.prompt_top_logprobs)
    outputs = []
    for i in range(n):
        c = 5 * i
        outputs.append(StepOutput(
            rid=rids[i], index=indexes[i], new_token_ids=tokens[i] or [],
            new_logprobs=logprobs[i], new_top_logprobs=tops[i],
            prompt_logprobs=prompt_logprobs[i], prompt_top_logprobs=prompt_tops[i],
            finished=bool(flags[i] & FLAG_FINISHED), finish_reason=_FINISH_NAMES[reasons[i]],
            matched_stop=matched[i] if flags[i] & FLAG_MATCHED_STOP else None,
            prompt_tokens=counters[c], completion_tokens=counters[c + 1],
            num_verify_steps=counters[c + 2], num_accepted_drafts=counters[c + 3],
            cached_tokens=counters[c + 4]))
    if msg.stamp_entries:
        stamps = _column(msg.stamps, _F64)
        for k, i in enumerate(_column(msg.stamp_entries, _U32)):
            outputs[i].stamps = tuple(stamps[3 * k:3 * k + 3])
    for error in msg.errors:
        outputs[error.entry].error = FinishError(error.code, error.message)
    return outputs


# --- load -----------------------------------------------------------------------------------------
def load_to_proto(load: EngineLoad) -> pb.ServerLoad:
    """The engine's part of a ServerLoad (the server adds its stream counts)."""
    return pb.ServerLoad(**load._asdict())


def load_from_proto(msg: pb.ServerLoad) -> EngineLoad:
    return EngineLoad(**{name: getattr(msg, name) for name in EngineLoad._fields})


# --- the grammar service ----------------------------------------------------------------------------
def grammar_health_to_proto(health: GrammarHealth) -> ipc.GrammarStatus:
    return ipc.GrammarStatus(serving=health.serving, restarts=health.restarts, detail=health.detail)


def grammar_health_from_proto(msg: ipc.GrammarStatus) -> GrammarHealth:
    return GrammarHealth(msg.serving, msg.restarts, msg.detail)
