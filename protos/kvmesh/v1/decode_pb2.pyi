from kvmesh.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "page_size", "kv_deadline_s", "transfer_id", "kv_layout", "block_hashes", "reuse_cached", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REUSE_CACHED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    page_size: int
    kv_deadline_s: float
    transfer_id: int
    kv_layout: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    reuse_cached: bool
    n: int
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_deadline_s: _Optional[float] = ..., transfer_id: _Optional[int] = ..., kv_layout: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., reuse_cached: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("kv_address", "transfer_id", "num_pages", "page_nbytes", "instance_id", "num_cached_pages")
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    kv_address: str
    transfer_id: int
    num_pages: int
    page_nbytes: int
    instance_id: str
    num_cached_pages: int
    def __init__(self, kv_address: _Optional[str] = ..., transfer_id: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_nbytes: _Optional[int] = ..., instance_id: _Optional[str] = ..., num_cached_pages: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prompt_token_ids", "first_token", "sampling", "kv_timeout_s", "ignore_eos", "choice_first_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: _common_pb2.SamplingParams
    kv_timeout_s: float
    ignore_eos: bool
    choice_first_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_timeout_s: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., choice_first_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "kv_digest", "finish_reason", "num_drafted", "num_accepted", "logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_digest: str
    finish_reason: _common_pb2.FinishReason
    num_drafted: int
    num_accepted: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., kv_digest: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
