from pdserve.protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "reservation_id", "reserved_blocks", "decode_kv_spec", "reservation_secret", "decode_shm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_SPEC_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_SECRET_FIELD_NUMBER: _ClassVar[int]
    DECODE_SHM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    decode_address: str
    reservation_id: str
    reserved_blocks: int
    decode_kv_spec: _common_pb2.KVCacheSpec
    reservation_secret: str
    decode_shm: _common_pb2.KVShmOffer
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., reserved_blocks: _Optional[int] = ..., decode_kv_spec: _Optional[_Union[_common_pb2.KVCacheSpec, _Mapping]] = ..., reservation_secret: _Optional[str] = ..., decode_shm: _Optional[_Union[_common_pb2.KVShmOffer, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprobs", "timing", "num_prompt_tokens", "num_cached_tokens", "transfer_bytes")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprobs: _common_pb2.TokenLogprobs
    timing: _common_pb2.PrefillTiming
    num_prompt_tokens: int
    num_cached_tokens: int
    transfer_bytes: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.PrefillTiming, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ...) -> None: ...
