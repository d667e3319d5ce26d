"""An instance's health and load as its GetStats answers say: its id, the load and capacity
it reports, its KV address, and whether it answers at all.

A poll that fails, or two in a row that time out, mark the instance unreachable (a busy
instance still answers: prefill reads its counters when its worker is busy); the next
answer brings it back. Whether an answering instance agrees with the gateway (page size,
model) is the caller's `mismatch` rule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.protos.v1 import common_pb2

logger = logging.getLogger(__name__)


async def poll_instance(
    stub, inst: InstanceLoad, timeout_s: float, mismatch: Callable[[InstanceLoad, common_pb2.InstanceStats], str]
) -> None:
    """GetStats on `inst` through `stub` (a prefill or decode stub) within `timeout_s` seconds,
    and what it answers (or that it did not) onto `inst`. `mismatch(inst, stats)` says why the
    instance cannot serve with this gateway ('' when it can). Never raises for a failed call."""
    sent = time.monotonic()
    try:
        stats = await stub.GetStats(common_pb2.StatsRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        inst.failed_polls += 1
        # refused or reset: down now; slow: down at the second poll in a row (a busy
        # 2-core machine may miss one; a stopped instance misses every one)
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or inst.failed_polls >= 2:
            if inst.reachable:
                logger.warning("%s stopped answering (%s); not routing to it", inst.address, exc.code().name)
            inst.reachable = False
        return
    if not inst.reachable:
        logger.info("%s answers again" if inst.failed_polls else "%s answers; routing to it", inst.address)
    inst.failed_polls = 0
    inst.reachable = True
    inst.instance_id = stats.instance_id
    inst.reported_queued_tokens = stats.num_queued_tokens
    inst.polled_at = sent
    inst.reported_active_requests = stats.num_active_requests
    inst.max_requests = stats.max_requests
    inst.kv_address = stats.kv_address
    inst.kv_layout = stats.kv_layout
    inst.kv_tier_medium = stats.kv_tier_medium
    inst.dtype = stats.dtype
    inst.prefill_fit, inst.push_fit = tuple(stats.prefill_fit), tuple(stats.push_fit)
    inst.decode_fit, inst.context_tokens = tuple(stats.decode_fit), stats.num_context_tokens
    inst.decode_compute_fit = tuple(stats.decode_compute_fit)
    inst.core_group, inst.max_forward_tokens = stats.core_group, stats.max_forward_tokens
    why = mismatch(inst, stats)
    if why and why != inst.mismatch:
        logger.error("%s; not routing to it", why)
    inst.mismatch = why
