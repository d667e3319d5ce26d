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

class FailureCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CAUSE_UNSPECIFIED: _ClassVar[FailureCause]
    FAILURE_CAUSE_BAD_REQUEST: _ClassVar[FailureCause]
    FAILURE_CAUSE_OVERLOADED: _ClassVar[FailureCause]
    FAILURE_CAUSE_NO_INSTANCE: _ClassVar[FailureCause]
    FAILURE_CAUSE_INSTANCE_LOST: _ClassVar[FailureCause]
    FAILURE_CAUSE_KV_PUSH_FAILED: _ClassVar[FailureCause]
    FAILURE_CAUSE_MISMATCH: _ClassVar[FailureCause]
    FAILURE_CAUSE_DEADLINE: _ClassVar[FailureCause]
    FAILURE_CAUSE_CANCELLED: _ClassVar[FailureCause]
    FAILURE_CAUSE_INTERNAL: _ClassVar[FailureCause]
    FAILURE_CAUSE_UNKNOWN_MODEL: _ClassVar[FailureCause]
    FAILURE_CAUSE_UNAUTHENTICATED: _ClassVar[FailureCause]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FAILURE_CAUSE_UNSPECIFIED: FailureCause
FAILURE_CAUSE_BAD_REQUEST: FailureCause
FAILURE_CAUSE_OVERLOADED: FailureCause
FAILURE_CAUSE_NO_INSTANCE: FailureCause
FAILURE_CAUSE_INSTANCE_LOST: FailureCause
FAILURE_CAUSE_KV_PUSH_FAILED: FailureCause
FAILURE_CAUSE_MISMATCH: FailureCause
FAILURE_CAUSE_DEADLINE: FailureCause
FAILURE_CAUSE_CANCELLED: FailureCause
FAILURE_CAUSE_INTERNAL: FailureCause
FAILURE_CAUSE_UNKNOWN_MODEL: FailureCause
FAILURE_CAUSE_UNAUTHENTICATED: FailureCause

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "n", "grammar", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    n: int
    grammar: Grammar
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class InstanceStats(_message.Message):
    __slots__ = ("instance_id", "num_pages", "num_free_pages", "num_cached_pages", "num_referenced_pages", "num_active_requests", "num_queued_tokens", "max_batch_size", "num_steps", "integrity_error", "num_prompt_tokens_computed", "num_prompt_tokens_cached", "page_size", "model_fingerprint", "max_requests", "kv_address", "num_experts", "expert_tokens", "step_seconds", "ep_ranks", "ep_rank_tokens", "ep_slots_per_layer", "ep_phy2log", "kv_layout", "kv_tier_medium", "num_tier_blocks", "num_tier_loads", "num_tier_failed_loads", "num_kv_pushes_sent", "num_kv_pushes_pulled", "num_forwards", "forward_seconds", "num_generated_tokens", "cpu_share_wait_seconds", "dtype", "prefill_fit", "push_fit", "decode_fit", "num_context_tokens", "decode_compute_fit", "core_group", "max_forward_tokens")
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
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EP_RANKS_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EP_SLOTS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    EP_PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PUSHES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PUSHES_PULLED_FIELD_NUMBER: _ClassVar[int]
    NUM_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CPU_SHARE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIT_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIT_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIT_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_COMPUTE_FIT_FIELD_NUMBER: _ClassVar[int]
    CORE_GROUP_FIELD_NUMBER: _ClassVar[int]
    MAX_FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
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
    page_size: int
    model_fingerprint: str
    max_requests: int
    kv_address: str
    num_experts: int
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    step_seconds: float
    ep_ranks: int
    ep_rank_tokens: _containers.RepeatedScalarFieldContainer[int]
    ep_slots_per_layer: int
    ep_phy2log: _containers.RepeatedScalarFieldContainer[int]
    kv_layout: str
    kv_tier_medium: str
    num_tier_blocks: int
    num_tier_loads: int
    num_tier_failed_loads: int
    num_kv_pushes_sent: int
    num_kv_pushes_pulled: int
    num_forwards: int
    forward_seconds: float
    num_generated_tokens: int
    cpu_share_wait_seconds: float
    dtype: str
    prefill_fit: _containers.RepeatedScalarFieldContainer[float]
    push_fit: _containers.RepeatedScalarFieldContainer[float]
    decode_fit: _containers.RepeatedScalarFieldContainer[float]
    num_context_tokens: int
    decode_compute_fit: _containers.RepeatedScalarFieldContainer[float]
    core_group: str
    max_forward_tokens: int
    def __init__(self, instance_id: _Optional[str] = ..., num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., num_referenced_pages: _Optional[int] = ..., num_active_requests: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., num_steps: _Optional[int] = ..., integrity_error: _Optional[str] = ..., num_prompt_tokens_computed: _Optional[int] = ..., num_prompt_tokens_cached: _Optional[int] = ..., page_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., max_requests: _Optional[int] = ..., kv_address: _Optional[str] = ..., num_experts: _Optional[int] = ..., expert_tokens: _Optional[_Iterable[int]] = ..., step_seconds: _Optional[float] = ..., ep_ranks: _Optional[int] = ..., ep_rank_tokens: _Optional[_Iterable[int]] = ..., ep_slots_per_layer: _Optional[int] = ..., ep_phy2log: _Optional[_Iterable[int]] = ..., kv_layout: _Optional[str] = ..., kv_tier_medium: _Optional[str] = ..., num_tier_blocks: _Optional[int] = ..., num_tier_loads: _Optional[int] = ..., num_tier_failed_loads: _Optional[int] = ..., num_kv_pushes_sent: _Optional[int] = ..., num_kv_pushes_pulled: _Optional[int] = ..., num_forwards: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., num_generated_tokens: _Optional[int] = ..., cpu_share_wait_seconds: _Optional[float] = ..., dtype: _Optional[str] = ..., prefill_fit: _Optional[_Iterable[float]] = ..., push_fit: _Optional[_Iterable[float]] = ..., decode_fit: _Optional[_Iterable[float]] = ..., num_context_tokens: _Optional[int] = ..., decode_compute_fit: _Optional[_Iterable[float]] = ..., core_group: _Optional[str] = ..., max_forward_tokens: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
