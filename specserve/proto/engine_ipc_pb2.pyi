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
    __slots__ = ("ready", "batch", "rejected", "load", "failed", "grammar")
    READY_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ready: EngineReady
    batch: BatchOutput
    rejected: RequestRejected
    load: LoadReport
    failed: EngineFailed
    grammar: GrammarStatus
    def __init__(self, ready: _Optional[_Union[EngineReady, _Mapping]] = ..., batch: _Optional[_Union[BatchOutput, _Mapping]] = ..., rejected: _Optional[_Union[RequestRejected, _Mapping]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., failed: _Optional[_Union[EngineFailed, _Mapping]] = ..., grammar: _Optional[_Union[GrammarStatus, _Mapping]] = ...) -> None: ...

class EngineReady(_message.Message):
    __slots__ = ("info", "tokenizer_pickle")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PICKLE_FIELD_NUMBER: _ClassVar[int]
    info: _generate_pb2.ModelInfo
    tokenizer_pickle: bytes
    def __init__(self, info: _Optional[_Union[_generate_pb2.ModelInfo, _Mapping]] = ..., tokenizer_pickle: _Optional[bytes] = ...) -> None: ...

class BatchOutput(_message.Message):
    __slots__ = ("rids", "indexes", "num_tokens", "token_ids", "flags", "finish_reasons", "matched_stop", "counters", "logprob_counts", "logprobs", "top_counts", "top_sizes", "top_ids", "top_logprobs", "prompt_logprob_counts", "prompt_logprobs", "prompt_top_counts", "prompt_top_sizes", "prompt_top_ids", "prompt_top_logprobs", "stamp_entries", "stamps", "step_extend", "step_seconds", "step_tokens", "step_others", "errors", "load", "step_draft_depths")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    INDEXES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_SIZES_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_SIZES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STAMP_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STAMPS_FIELD_NUMBER: _ClassVar[int]
    STEP_EXTEND_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_OTHERS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STEP_DRAFT_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[str]
    indexes: bytes
    num_tokens: bytes
    token_ids: bytes
    flags: bytes
    finish_reasons: bytes
    matched_stop: bytes
    counters: bytes
    logprob_counts: bytes
    logprobs: bytes
    top_counts: bytes
    top_sizes: bytes
    top_ids: bytes
    top_logprobs: bytes
    prompt_logprob_counts: bytes
    prompt_logprobs: bytes
    prompt_top_counts: bytes
    prompt_top_sizes: bytes
    prompt_top_ids: bytes
    prompt_top_logprobs: bytes
    stamp_entries: bytes
    stamps: bytes
    step_extend: bytes
    step_seconds: bytes
    step_tokens: bytes
    step_others: bytes
    errors: _containers.RepeatedCompositeFieldContainer[SequenceError]
    load: _generate_pb2.ServerLoad
    step_draft_depths: bytes
    def __init__(self, rids: _Optional[_Iterable[str]] = ..., indexes: _Optional[bytes] = ..., num_tokens: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., flags: _Optional[bytes] = ..., finish_reasons: _Optional[bytes] = ..., matched_stop: _Optional[bytes] = ..., counters: _Optional[bytes] = ..., logprob_counts: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., top_counts: _Optional[bytes] = ..., top_sizes: _Optional[bytes] = ..., top_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., prompt_logprob_counts: _Optional[bytes] = ..., prompt_logprobs: _Optional[bytes] = ..., prompt_top_counts: _Optional[bytes] = ..., prompt_top_sizes: _Optional[bytes] = ..., prompt_top_ids: _Optional[bytes] = ..., prompt_top_logprobs: _Optional[bytes] = ..., stamp_entries: _Optional[bytes] = ..., stamps: _Optional[bytes] = ..., step_extend: _Optional[bytes] = ..., step_seconds: _Optional[bytes] = ..., step_tokens: _Optional[bytes] = ..., step_others: _Optional[bytes] = ..., errors: _Optional[_Iterable[_Union[SequenceError, _Mapping]]] = ..., load: _Optional[_Union[_generate_pb2.ServerLoad, _Mapping]] = ..., step_draft_depths: _Optional[bytes] = ...) -> None: ...

class SequenceError(_message.Message):
    __slots__ = ("entry", "code", "message")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    entry: int
    code: str
    message: str
    def __init__(self, entry: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class GrammarStatus(_message.Message):
    __slots__ = ("serving", "restarts", "detail")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    restarts: int
    detail: str
    def __init__(self, serving: bool = ..., restarts: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

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
