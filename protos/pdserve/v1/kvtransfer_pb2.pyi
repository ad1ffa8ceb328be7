from pdserve.protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVChunk(_message.Message):
    __slots__ = ("reservation_id", "layer", "block_indices", "dtype", "shape", "seq", "crc32c", "payload", "shm", "num_layers")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    layer: int
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    crc32c: int
    payload: bytes
    shm: KVShmPayload
    num_layers: int
    def __init__(self, reservation_id: _Optional[str] = ..., layer: _Optional[int] = ..., block_indices: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., crc32c: _Optional[int] = ..., payload: _Optional[bytes] = ..., shm: _Optional[_Union[KVShmPayload, _Mapping]] = ..., num_layers: _Optional[int] = ...) -> None: ...

class KVShmPayload(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("reservation_id", "num_chunks", "num_prompt_tokens", "num_cached_tokens", "first_token_id", "first_token_logprobs", "timing")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_chunks: int
    num_prompt_tokens: int
    num_cached_tokens: int
    first_token_id: int
    first_token_logprobs: _common_pb2.TokenLogprobs
    timing: _common_pb2.PrefillTiming
    def __init__(self, reservation_id: _Optional[str] = ..., num_chunks: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.PrefillTiming, _Mapping]] = ...) -> None: ...

class KVAbort(_message.Message):
    __slots__ = ("reservation_id", "reason")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    reason: str
    def __init__(self, reservation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KVMessage(_message.Message):
    __slots__ = ("chunk", "commit", "abort")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    chunk: KVChunk
    commit: KVCommit
    abort: KVAbort
    def __init__(self, chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., commit: _Optional[_Union[KVCommit, _Mapping]] = ..., abort: _Optional[_Union[KVAbort, _Mapping]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("reservation_id", "num_chunks", "num_bytes")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_chunks: int
    num_bytes: int
    def __init__(self, reservation_id: _Optional[str] = ..., num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...
