"""Every conversion between the engine's types and the wire messages of `specserve.proto`.

The gRPC server and the engine process talk in the public messages (generate.proto) where
both sides share a meaning (sampling parameters, what the model is, the load) and in the IPC
messages (engine_ipc.proto) for the rest; this module is the one place that maps them onto
SamplingParams, EngineInfo, StepOutput and EngineLoad, in both directions.
"""
from __future__ import annotations

from typing import Optional

import dataclasses

from specserve.engine.config import GrammarSpec, SamplingParams, SpecConfig
from specserve.engine.outputs import EngineInfo, EngineLoad, StepOutput, TopLogprobs
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
    spec = SpecConfig(**{name: getattr(msg.spec, name) for name in _SPEC_FIELDS}) \
        if msg.HasField("spec") else None
    return EngineInfo(model=msg.model, architecture=msg.architecture, vocab_size=msg.vocab_size,
                      max_context_len=msg.max_context_len, dtype=msg.dtype, device=msg.device,
                      eos_token_ids=tuple(msg.eos_token_ids), spec=spec, weight_dtype=msg.weight_dtype,
                      kv_cache_dtype=msg.kv_cache_dtype)


# --- per-step outputs -------------------------------------------------------------------------------
def _top_to_proto(tops: Optional[list[TopLogprobs]]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(candidates=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top])
            for top in tops or []]


def _top_from_proto(msgs) -> Optional[list[TopLogprobs]]:
    return [[(c.token_id, c.logprob) for c in m.candidates] for m in msgs] or None


def output_to_proto(out: StepOutput) -> ipc.RequestOutput:
    msg = ipc.RequestOutput(
        rid=out.rid, index=out.index, new_token_ids=out.new_token_ids, new_logprobs=out.new_logprobs or [],
        new_top_logprobs=_top_to_proto(out.new_top_logprobs),
        prompt_logprobs=out.prompt_logprobs or [],
        prompt_top_logprobs=_top_to_proto(out.prompt_top_logprobs),
        finished=out.finished, finish_reason=out.finish_reason or "",
        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
        spec=ipc.SpecInfo(num_verify_steps=out.num_verify_steps,
                          num_accepted_drafts=out.num_accepted_drafts),
        cached_tokens=out.cached_tokens)
    if out.matched_stop is not None:
        msg.matched_stop_token_id = out.matched_stop
    return msg


def output_from_proto(msg: ipc.RequestOutput) -> StepOutput:
    # Runs for every stream of every engine step, and each field read from the message costs:
    # the repeated fields, mostly absent, are converted only when present.
    spec = msg.spec
    return StepOutput(
        rid=msg.rid, index=msg.index, new_token_ids=list(msg.new_token_ids),
        new_logprobs=list(msg.new_logprobs) if msg.new_logprobs else None,
        new_top_logprobs=_top_from_proto(msg.new_top_logprobs) if msg.new_top_logprobs else None,
        prompt_logprobs=list(msg.prompt_logprobs) if msg.prompt_logprobs else None,
        prompt_top_logprobs=(_top_from_proto(msg.prompt_top_logprobs)
                             if msg.prompt_top_logprobs else None),
        finished=msg.finished, finish_reason=msg.finish_reason or None,
        matched_stop=msg.matched_stop_token_id if msg.HasField("matched_stop_token_id") else None,
        prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens,
        num_verify_steps=spec.num_verify_steps, num_accepted_drafts=spec.num_accepted_drafts,
        cached_tokens=msg.cached_tokens)


# --- load -----------------------------------------------------------------------------------------
def load_to_proto(load: EngineLoad) -> pb.ServerLoad:
    """The engine's part of a ServerLoad (the server adds its stream counts)."""
    return pb.ServerLoad(**load._asdict())


def load_from_proto(msg: pb.ServerLoad) -> EngineLoad:
    return EngineLoad(**{name: getattr(msg, name) for name in EngineLoad._fields})

