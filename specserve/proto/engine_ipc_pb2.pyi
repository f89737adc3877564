from . import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServerToEngine(_message.Message):
    __slots__ = ("add", "abort", "load_query", "shutdown")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    LOAD_QUERY_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    add: AddRequest
    abort: AbortRequest
    load_query: LoadQuery
    shutdown: Shutdown
    def __init__(self, add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., load_query: _Optional[_Union[LoadQuery, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("rid", "prompt_token_ids", "sampling", "structured_output", "grammar_after_token_id")
    RID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_AFTER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    structured_output: _generate_pb2.StructuredOutput
    grammar_after_token_id: int
    def __init__(self, rid: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ..., grammar_after_token_id: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid", "index")
    RID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    rid: str
    index: int
    def __init__(self, rid: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class LoadQuery(_message.Message):
    __slots__ = ("query_id", "flush_prefix_cache")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    FLUSH_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    flush_prefix_cache: bool
    def __init__(self, query_id: _Optional[int] = ..., flush_prefix_cache: bool = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineToServer(_message.Message):
    __slots__ = ("ready", "batch", "rejected", "load", "failed")
    READY_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ready: EngineReady
    batch: BatchOutput
    rejected: RequestRejected
    load: LoadReport
    failed: EngineFailed
    def __init__(self, ready: _Optional[_Union[EngineReady, _Mapping]] = ..., batch: _Optional[_Union[BatchOutput, _Mapping]] = ..., rejected: _Optional[_Union[RequestRejected, _Mapping]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., failed: _Optional[_Union[EngineFailed, _Mapping]] = ...) -> None: ...

class EngineReady(_message.Message):
    __slots__ = ("info", "tokenizer_pickle")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PICKLE_FIELD_NUMBER: _ClassVar[int]
    info: _generate_pb2.ModelInfo
    tokenizer_pickle: bytes
    def __init__(self, info: _Optional[_Union[_generate_pb2.ModelInfo, _Mapping]] = ..., tokenizer_pickle: _Optional[bytes] = ...) -> None: ...

class BatchOutput(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("rid", "index", "new_token_ids", "new_logprobs", "finished", "finish_reason", "matched_stop_token_id", "prompt_tokens", "completion_tokens", "spec", "new_top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "cached_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NEW_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    index: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: str
    matched_stop_token_id: int
    prompt_tokens: int
    completion_tokens: int
    spec: SpecInfo
    new_top_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TopLogprobs]
    cached_tokens: int
    def __init__(self, rid: _Optional[str] = ..., index: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[float]] = ..., finished: bool = ..., finish_reason: _Optional[str] = ..., matched_stop_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., spec: _Optional[_Union[SpecInfo, _Mapping]] = ..., new_top_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TopLogprobs, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SpecInfo(_message.Message):
    __slots__ = ("num_verify_steps", "num_accepted_drafts")
    NUM_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    num_verify_steps: int
    num_accepted_drafts: int
    def __init__(self, num_verify_steps: _Optional[int] = ..., num_accepted_drafts: _Optional[int] = ...) -> None: ...

class RequestRejected(_message.Message):
    __slots__ = ("rid", "message")
    RID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    rid: str
    message: str
    def __init__(self, rid: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("query_id", "load")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    load: _generate_pb2.ServerLoad
    def __init__(self, query_id: _Optional[int] = ..., load: _Optional[_Union[_generate_pb2.ServerLoad, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("loop_iterations",)
    LOOP_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    loop_iterations: int
    def __init__(self, loop_iterations: _Optional[int] = ...) -> None: ...

class EngineFailed(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...
