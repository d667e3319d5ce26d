"""Conversions between wire messages and internal types, shared by the servicers.

Only servicers import this; the engine, pools and router never see *_pb2 types.
"""

from __future__ import annotations

from engine.sampler import SamplingParams
from protos.kvmesh.v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams from the wire message (unset top_p means 1).

    Raises ValueError (from SamplingParams) when a field is out of range.
    """
    return SamplingParams(temperature=pb.temperature, top_p=pb.top_p if pb.HasField("top_p") else 1.0, top_k=pb.top_k,
                          seed=pb.seed if pb.HasField("seed") else None)
