from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class InstanceStats(_message.Message):
    __slots__ = ("instance_id", "num_pages", "num_free_pages", "num_cached_pages", "num_referenced_pages", "num_active_requests", "num_queued_tokens", "max_batch_size", "num_steps", "integrity_error", "num_prompt_tokens_computed", "num_prompt_tokens_cached")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_REFERENCED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_pages: int
    num_free_pages: int
    num_cached_pages: int
    num_referenced_pages: int
    num_active_requests: int
    num_queued_tokens: int
    max_batch_size: int
    num_steps: int
    integrity_error: str
    num_prompt_tokens_computed: int
    num_prompt_tokens_cached: int
    def __init__(self, instance_id: _Optional[str] = ..., num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., num_referenced_pages: _Optional[int] = ..., num_active_requests: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., num_steps: _Optional[int] = ..., integrity_error: _Optional[str] = ..., num_prompt_tokens_computed: _Optional[int] = ..., num_prompt_tokens_cached: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
