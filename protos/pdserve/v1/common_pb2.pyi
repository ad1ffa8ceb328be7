from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "stop_token_ids", "ignore_eos", "min_tokens", "output_offset")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    output_offset: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., output_offset: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "transfer_s", "decode_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    transfer_s: float
    decode_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., decode_s: _Optional[float] = ...) -> None: ...

class PrefillTiming(_message.Message):
    __slots__ = ("queue_s", "compute_s", "transfer_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    compute_s: float
    transfer_s: float
    def __init__(self, queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class KVCacheSpec(_message.Message):
    __slots__ = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVShmOffer(_message.Message):
    __slots__ = ("host_id", "segment", "size")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    segment: str
    size: int
    def __init__(self, host_id: _Optional[str] = ..., segment: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "free_blocks", "total_blocks", "tokens_per_s", "queue_depth", "cached_block_hashes")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    tokens_per_s: float
    queue_depth: int
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., queue_depth: _Optional[int] = ..., cached_block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("worker_id", "model", "load", "kv_spec")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_SPEC_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    load: WorkerLoad
    kv_spec: KVCacheSpec
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., kv_spec: _Optional[_Union[KVCacheSpec, _Mapping]] = ...) -> None: ...
