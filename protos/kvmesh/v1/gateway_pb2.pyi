from kvmesh.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "messages", "chat", "sampling", "prompt_token_ids", "tools", "slo_ttft_ms", "slo_itl_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: bytes
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    chat: bool
    sampling: GenerateOptions
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tools: str
    slo_ttft_ms: float
    slo_itl_ms: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[bytes] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., chat: _Optional[bool] = ..., sampling: _Optional[_Union[GenerateOptions, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tools: _Optional[str] = ..., slo_ttft_ms: _Optional[float] = ..., slo_itl_ms: _Optional[float] = ...) -> None: ...

class GenerateOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "ignore_eos", "logprobs", "n", "grammar", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    n: int
    grammar: _common_pb2.Grammar
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    final: Final
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "index", "prompt_logprobs", "prompt_tokens", "cached_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("num_pages", "page_nbytes", "nbytes", "seconds", "prefill_digest", "decode_digest", "exposed_seconds", "decode_cached_pages")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DECODE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    page_nbytes: int
    nbytes: int
    seconds: float
    prefill_digest: str
    decode_digest: str
    exposed_seconds: float
    decode_cached_pages: int
    def __init__(self, num_pages: _Optional[int] = ..., page_nbytes: _Optional[int] = ..., nbytes: _Optional[int] = ..., seconds: _Optional[float] = ..., prefill_digest: _Optional[str] = ..., decode_digest: _Optional[str] = ..., exposed_seconds: _Optional[float] = ..., decode_cached_pages: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s", "e2e_s", "itl_s", "prefill_instance", "decode_instance", "request_id", "kv_transfer", "queue_s", "prefill_s", "finish", "retries", "admission_s", "drafted_tokens", "accepted_tokens", "pulled_tokens", "pull_s", "choice_finish", "choice_generated_tokens", "stop_sequence", "predicted_ttft_s", "predicted_itl_s")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    ITL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_S_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FINISH_FIELD_NUMBER: _ClassVar[int]
    CHOICE_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITL_S_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float
    e2e_s: float
    itl_s: float
    prefill_instance: str
    decode_instance: str
    request_id: str
    kv_transfer: KVTransfer
    queue_s: float
    prefill_s: float
    finish: _common_pb2.FinishReason
    retries: int
    admission_s: float
    drafted_tokens: int
    accepted_tokens: int
    pulled_tokens: int
    pull_s: float
    choice_finish: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    choice_generated_tokens: _containers.RepeatedScalarFieldContainer[int]
    stop_sequence: str
    predicted_ttft_s: float
    predicted_itl_s: float
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., itl_s: _Optional[float] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., request_id: _Optional[str] = ..., kv_transfer: _Optional[_Union[KVTransfer, _Mapping]] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., finish: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., retries: _Optional[int] = ..., admission_s: _Optional[float] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., pulled_tokens: _Optional[int] = ..., pull_s: _Optional[float] = ..., choice_finish: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ..., choice_generated_tokens: _Optional[_Iterable[int]] = ..., stop_sequence: _Optional[str] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_itl_s: _Optional[float] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "max_context_tokens", "max_tokens_limit", "has_chat_template")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    max_context_tokens: int
    max_tokens_limit: int
    has_chat_template: bool
    def __init__(self, models: _Optional[_Iterable[str]] = ..., max_context_tokens: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., has_chat_template: _Optional[bool] = ...) -> None: ...
