from pdserve.protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "num_blocks", "kv_spec", "reservation_secret", "shm")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SPEC_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_SECRET_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_blocks: int
    kv_spec: _common_pb2.KVCacheSpec
    reservation_secret: str
    shm: _common_pb2.KVShmOffer
    def __init__(self, reservation_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., kv_spec: _Optional[_Union[_common_pb2.KVCacheSpec, _Mapping]] = ..., reservation_secret: _Optional[str] = ..., shm: _Optional[_Union[_common_pb2.KVShmOffer, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    def __init__(self, reservation_id: _Optional[str] = ...) -> None: ...

class ColocatedGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "timing", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    timing: _common_pb2.Timing
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "reservation_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class SessionUp(_message.Message):
    __slots__ = ("stream_id", "decode", "generate", "cancel", "timeout_s")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    decode: DecodeRequest
    generate: ColocatedGenerateRequest
    cancel: bool
    timeout_s: float
    def __init__(self, stream_id: _Optional[int] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., generate: _Optional[_Union[ColocatedGenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SessionEntry(_message.Message):
    __slots__ = ("stream_id", "chunk", "end", "status_code", "status_details")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    chunk: TokenChunk
    end: bool
    status_code: int
    status_details: str
    def __init__(self, stream_id: _Optional[int] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., end: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class SessionDown(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SessionEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SessionEntry, _Mapping]]] = ...) -> None: ...
