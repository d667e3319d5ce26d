from kvmesh.protos.v1 import common_pb2 as _common_pb2
from kvmesh.protos.v1 import gateway_pb2 as _gateway_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "decode_kv_address", "transfer_id", "page_size", "block_hashes", "decode_cached_pages", "pull_from", "pull_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    PULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    decode_kv_address: str
    transfer_id: int
    page_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    decode_cached_pages: int
    pull_from: str
    pull_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_kv_address: _Optional[str] = ..., transfer_id: _Optional[int] = ..., page_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., decode_cached_pages: _Optional[int] = ..., pull_from: _Optional[str] = ..., pull_blocks: _Optional[int] = ...) -> None: ...

class PushBlocksRequest(_message.Message):
    __slots__ = ("request_id", "block_hashes", "kv_address", "transfer_id", "page_size", "kv_layout")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    kv_address: str
    transfer_id: int
    page_size: int
    kv_layout: str
    def __init__(self, request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., kv_address: _Optional[str] = ..., transfer_id: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class PushBlocksResponse(_message.Message):
    __slots__ = ("num_blocks", "nbytes", "seconds", "kv_digest")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_DIGEST_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    nbytes: int
    seconds: float
    kv_digest: str
    def __init__(self, num_blocks: _Optional[int] = ..., nbytes: _Optional[int] = ..., seconds: _Optional[float] = ..., kv_digest: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "num_cached_tokens", "num_computed_tokens", "queue_s", "compute_s", "instance_id", "traceparent", "num_pulled_tokens", "pull_s", "first_logprobs", "choice_first_tokens", "choice_first_logprobs", "prompt_logprobs", "kv_transfer")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_cached_tokens: int
    num_computed_tokens: int
    queue_s: float
    compute_s: float
    instance_id: str
    traceparent: str
    num_pulled_tokens: int
    pull_s: float
    first_logprobs: _common_pb2.TokenLogprobs
    choice_first_tokens: _containers.RepeatedScalarFieldContainer[int]
    choice_first_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    kv_transfer: _gateway_pb2.KVTransfer
    def __init__(self, first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., instance_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., num_pulled_tokens: _Optional[int] = ..., pull_s: _Optional[float] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., choice_first_tokens: _Optional[_Iterable[int]] = ..., choice_first_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., kv_transfer: _Optional[_Union[_gateway_pb2.KVTransfer, _Mapping]] = ...) -> None: ...
