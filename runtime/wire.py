"""Conversions between wire messages and internal types, shared by the servicers.

Only servicers import this; the engine, pools and router never see *_pb2 types.
"""

from __future__ import annotations

import math
import re

import grpc

from kvmesh.engine.outcomes import FailureCause, FinishReason
from kvmesh.engine.sampling_params import GrammarSpec, SamplingParams, TokenLogprobs
from kvmesh.protos.v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams, default_seed: int | None = None) -> SamplingParams:
    """The engine's SamplingParams from the wire message (unset top_p means 1, an unset seed
    `default_seed`).

    Raises ValueError (from SamplingParams) when a field is out of range.
    """
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else default_seed,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
        n=pb.n or 1,
        grammar=GrammarSpec(pb.grammar.kind, pb.grammar.spec) if pb.HasField("grammar") else None,
    )


def sampling_to_pb(sampling: SamplingParams) -> common_pb2.SamplingParams:
    """The wire message of `sampling` (the inverse of sampling_from_pb; a None seed stays unset)."""
    pb = common_pb2.SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    if sampling.seed is not None:
        pb.seed = sampling.seed
    if sampling.logprobs is not None:
        pb.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        pb.prompt_logprobs = sampling.prompt_logprobs
    if sampling.n != 1:
        pb.n = sampling.n
    if sampling.grammar is not None:
        pb.grammar.kind, pb.grammar.spec = sampling.grammar.kind, sampling.grammar.spec
    return pb


def logprobs_to_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    """The wire message of one token's logprobs (kvmesh.engine.sampler.TokenLogprobs)."""
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs
    )


# The trailing-metadata key naming a failure's cause (kvmesh.v1.FailureCause without its prefix).
FAILURE_CAUSE_KEY = "kvmesh-failure-cause"
# Trailing-metadata key with the seconds after which an overloaded request may be retried.
RETRY_AFTER_KEY = "retry-after-s"


def status_of(cause: FailureCause) -> grpc.StatusCode:
    """The gRPC status a client gets for a failure cause: UNAVAILABLE only for what a retry
    can fix, FAILED_PRECONDITION for a mesh that is set up wrong."""
    return _STATUS_OF[cause]


_STATUS_OF = {
    FailureCause.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    FailureCause.UNKNOWN_MODEL: grpc.StatusCode.NOT_FOUND,
    FailureCause.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    FailureCause.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureCause.NO_INSTANCE: grpc.StatusCode.UNAVAILABLE,
    FailureCause.INSTANCE_LOST: grpc.StatusCode.UNAVAILABLE,
    FailureCause.KV_PUSH_FAILED: grpc.StatusCode.UNAVAILABLE,
    FailureCause.MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    FailureCause.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureCause.CANCELLED: grpc.StatusCode.CANCELLED,
    FailureCause.INTERNAL: grpc.StatusCode.INTERNAL,
}


def _trailer(error: grpc.aio.AioRpcError, name: str) -> str | None:
    return next((value for key, value in error.trailing_metadata() or () if key == name), None)


def cause_of(error: grpc.aio.AioRpcError) -> FailureCause | None:
    """The cause a kvmesh service put in an error's trailing metadata, if any."""
    try:
        return FailureCause(_trailer(error, FAILURE_CAUSE_KEY))
    except ValueError:  # absent (None) or unknown
        return None


def retry_after_of(error: grpc.aio.AioRpcError) -> float | None:
    """The retry hint (seconds) a kvmesh service put in an error's trailing metadata, if any."""
    value = _trailer(error, RETRY_AFTER_KEY)
    return float(value) if value is not None else None


def page_size_mismatch(instance: str, page_size: int, assumed: int) -> str:
    """'' when a caller's page size (0: it did not say) agrees with this instance's, else the
    message that names both (the status is FAILED_PRECONDITION: FailureCause.MISMATCH)."""
    if not assumed or assumed == page_size:
        return ""
    return (
        f"{instance} has page_size {page_size}, the caller assumes {assumed}: every service and the "
        "gateway need the same --page-size"
    )


def kv_layout_mismatch(instance: str, layout: str, pushed: str) -> str:
    """'' when the layout KV will be pushed in (empty: the caller did not say) is this instance's,
    else the message naming both (FAILED_PRECONDITION: FailureCause.MISMATCH): a CPU prefill in
    fp32 pushing to a GPU decode in bf16, say, would land wrong bytes."""
    if not pushed or pushed == layout:
        return ""
    return (
        f"{instance} keeps KV pages as {layout}, the push would bring {pushed}: prefill and decode need the same "
        "model, --page-size and --dtype (docs/precision.md)"
    )


async def abort(context, cause: FailureCause, message: str, retry_after_s: float | None = None) -> None:
    """End an RPC with the status of `cause`, naming the cause (and a retry hint) in the trailers."""
    trailers = [(FAILURE_CAUSE_KEY, cause.value)]
    if retry_after_s is not None:
        trailers.append((RETRY_AFTER_KEY, f"{retry_after_s:.1f}"))
        # and as HTTP's Retry-After spells it: whole seconds, rounded up
        trailers.append(("retry-after", str(math.ceil(retry_after_s))))
    context.set_trailing_metadata(trailers)
    await context.abort(status_of(cause), message)


FINISH_TO_PB = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]*")


def check_request_id(request_id: str) -> str:
    """A caller's request id, checked: at most 128 characters of letters, digits and . _ : @ / + = -
    (ids are written into logs and status messages; a newline or an escape sequence in one
    could forge log lines). Raises ValueError saying what is allowed."""
    if len(request_id) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID.fullmatch(request_id):
        raise ValueError(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters of letters, digits and "
            f"._:@/+=- (got {len(request_id)} characters, {request_id[:32]!r}...)"
        )
    return request_id
