"""The gateway's wire messages, each conversion written once: the client's request into a
GenerateInput (checked), and a GenerateInput into the calls to prefill and decode (whose
servicers read them back: prefill_svc/servicer.py, decode_svc/servicer.py). Sampling
settings cross in kvmesh.runtime.wire (sampling_to_pb / sampling_from_pb); the answer's messages
are built in gateway/answer.py.

max_tokens travels once a hop: in the client's GenerateOptions, then in Reserve (decode
sizes the reservation and ends the answer by it); prefill does not need it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

from kvmesh.gateway.requests import GenerateInput, PromptBuilder
from kvmesh.gateway.tools import parse_tools
from kvmesh.protos.v1 import decode_pb2, gateway_pb2, prefill_pb2
from kvmesh.runtime.wire import check_request_id, sampling_to_pb


def generate_input(builder: PromptBuilder, request: gateway_pb2.GenerateRequest) -> GenerateInput:
    """The client's request, tokenized and checked (a request id made when it has none).

    Raises UnknownModelError (NOT_FOUND) or ValueError (INVALID_ARGUMENT) saying what to change."""
    check_request_id(request.request_id)
    builder.check_model(request.model)
    s = request.sampling
    tools = None
    if request.tools:
        try:
            tools = parse_tools({"tools": json.loads(request.tools)})
        except ValueError as exc:  # ToolError too
            raise ValueError(f"tools: {exc}") from None
    ids = builder.tokenize(
        request.prompt, [(m.role, m.content) for m in request.messages], request.chat, request.prompt_token_ids, tools
    )
    return builder.build(
        request.request_id or uuid.uuid4().hex,
        ids,
        s.temperature,
        s.top_p if s.HasField("top_p") else None,
        s.top_k,
        s.max_tokens if s.HasField("max_tokens") else None,
        s.seed if s.HasField("seed") else None,
        list(s.stop),
        s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        n=s.n or 1,
        grammar=(s.grammar.kind, s.grammar.spec) if s.HasField("grammar") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
    )


def models_response(builder: PromptBuilder) -> gateway_pb2.ListModelsResponse:
    """What this gateway serves and its limits."""
    return gateway_pb2.ListModelsResponse(
        models=[builder.model_name],
        max_context_tokens=builder.max_context,
        max_tokens_limit=builder.max_tokens_limit,
        has_chat_template=bool(builder.tokenizer.chat_template),
    )


def reserve_request(
    inp: GenerateInput,
    transfer_id: int,
    kv_deadline_s: float,
    page_size: int,
    kv_layout: str = "",
    block_hashes: Sequence[bytes] = (),
    reuse_cached: bool = False,
) -> decode_pb2.ReserveRequest:
    """Reserve pages on decode for the prompt and max_tokens, under the gateway's `transfer_id`;
    the KV must land within kv_deadline_s seconds, pushed in `kv_layout` (the prefill's, '' when
    not known yet: decode does not check it then). block_hashes: the prompt's full blocks' hashes
    (decode caches the finished request's blocks under them); reuse_cached: decode references
    the leading ones it holds instead of receiving them (the caller tells Prefill to skip them)."""
    return decode_pb2.ReserveRequest(
        request_id=inp.request_id,
        num_prompt_tokens=len(inp.prompt_token_ids),
        max_tokens=inp.max_tokens,
        page_size=page_size,
        kv_deadline_s=kv_deadline_s,
        transfer_id=transfer_id,
        kv_layout=kv_layout,
        block_hashes=block_hashes,
        reuse_cached=reuse_cached,
        n=inp.sampling.n,
    )


def prefill_request(
    inp: GenerateInput,
    block_hashes: Sequence[bytes],
    kv_address: str,
    transfer_id: int,
    page_size: int,
    decode_cached_pages: int = 0,
    pull: tuple[str, int] = ("", 0),
) -> prefill_pb2.PrefillRequest:
    """Prefill the prompt and push its KV to decode's `kv_address` under `transfer_id`, all but
    the `decode_cached_pages` leading pages decode holds already; `pull`: (a peer prefill's
    address, the leading blocks it holds) that prefill may pull instead of computing."""
    return prefill_pb2.PrefillRequest(
        request_id=inp.request_id,
        token_ids=inp.prompt_token_ids,
        sampling=sampling_to_pb(inp.sampling),
        decode_kv_address=kv_address,
        transfer_id=transfer_id,
        page_size=page_size,
        block_hashes=block_hashes,  # hashed once, at the gateway: prefill reuses them
        decode_cached_pages=decode_cached_pages,
        pull_from=pull[0],
        pull_blocks=pull[1],
    )


def decode_request(inp: GenerateInput, transfer_id: int, prefill: prefill_pb2.PrefillResponse, kv_timeout_s: float):
    """Decode the tokens after prefill's first token (each choice's, n > 1) from the KV pushed
    under `transfer_id`."""
    return decode_pb2.DecodeRequest(
        request_id=inp.request_id,
        transfer_id=transfer_id,
        prompt_token_ids=inp.prompt_token_ids,
        first_token=prefill.first_token,
        choice_first_tokens=prefill.choice_first_tokens,
        sampling=sampling_to_pb(inp.sampling),
        kv_timeout_s=kv_timeout_s,
        ignore_eos=inp.ignore_eos,
    )
