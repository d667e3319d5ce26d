"""How a request ends: finish reasons and failure causes, as Python enums (torch-free, so the
gateway uses them without loading the model stack).

They mirror `kvmesh.v1.FinishReason` and `kvmesh.v1.FailureCause` in protos/kvmesh/v1/common.proto;
`kvmesh.runtime.wire` converts between the two and maps each cause to the gRPC status a client gets.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """Why an answer ended normally; the value is the name OpenAI clients know (and, as a
    StrEnum, compares equal to it)."""

    STOP = "stop"
    """An end-of-sequence token or a stop string."""
    LENGTH = "length"
    """max_tokens reached."""


class FailureCause(enum.Enum):
    """Why a request failed. The status follows from the cause (kvmesh.runtime.wire.STATUS_OF):
    only causes a retry can fix map to UNAVAILABLE."""

    BAD_REQUEST = "BAD_REQUEST"
    UNKNOWN_MODEL = "UNKNOWN_MODEL"
    """The request names a model this gateway does not serve (NOT_FOUND)."""
    UNAUTHENTICATED = "UNAUTHENTICATED"
    """No API key, or one the gateway does not know (UNAUTHENTICATED)."""
    OVERLOADED = "OVERLOADED"
    NO_INSTANCE = "NO_INSTANCE"
    INSTANCE_LOST = "INSTANCE_LOST"
    KV_PUSH_FAILED = "KV_PUSH_FAILED"
    MISMATCH = "MISMATCH"
    DEADLINE = "DEADLINE"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"

    @property
    def retryable(self) -> bool:
        """A retry on another instance may succeed (the fault lies with one instance)."""
        return self in (FailureCause.INSTANCE_LOST, FailureCause.KV_PUSH_FAILED, FailureCause.NO_INSTANCE)
