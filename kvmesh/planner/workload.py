"""A workload to plan for: requests with arrival times, prompt and answer lengths, and the prompt's
block ids (requests sharing leading ids share that prefix).

Two sources: a Mooncake-format trace (JSONL rows `{"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [block ids]}`, one block = `TRACE_BLOCK_TOKENS` tokens;
../shared/traces/README.md), or `synthetic`: Poisson arrivals at a rate, prompt and answer lengths
drawn from given (length, weight) choices, a share of prompts opening with one of a few shared
system prompts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512
"""Tokens per block id in a Mooncake trace."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: arrival (seconds from the workload's start), prompt and answer tokens, the
    prompt's block ids (each `block_tokens` tokens of the workload)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Workload:
    requests: tuple[WorkloadRequest, ...]
    block_tokens: int
    """Tokens each hash id stands for."""

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Requests per second over the workload (0 for fewer than two requests)."""
        return (len(self.requests) - 1) / self.duration_s if self.duration_s > 0 else 0.0


def load_trace(path: str, default_output_tokens: int = 0) -> list[WorkloadRequest]:
    """Read a Mooncake-format JSONL trace (rows without output_length get default_output_tokens).

    Raises ValueError naming the first bad line: a timestamp that is not a finite number of ms
    >= 0, an input or output length that is not an integer >= 1 (output >= 0), hash ids outside
    [0, 2**63)."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_row(json.loads(line), default_output_tokens))
            except (ValueError, KeyError, TypeError, OverflowError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace row ({exc})") from exc
    return out


def _row(row: dict, default_output_tokens: int) -> WorkloadRequest:
    arrival, tokens, ids = float(row["timestamp"]) / 1000.0, row["input_length"], row["hash_ids"]
    output = row.get("output_length", default_output_tokens)
    if not (math.isfinite(arrival) and arrival >= 0):
        raise ValueError(f"timestamp must be a finite number of ms >= 0, got {row['timestamp']}")
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"input_length must be an integer >= 1, got {tokens!r}")
    if not isinstance(output, int) or output < 0:
        raise ValueError(f"output_length must be an integer >= 0, got {output!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and 0 <= h < 2**63 for h in ids):
        raise ValueError("hash_ids must be a list of integers in [0, 2**63)")
    return WorkloadRequest(arrival, tokens, output, tuple(ids))


def trace_workload(path: str, limit: int = 0, speedup: float = 1.0, scale_tokens: int = 0) -> Workload:
    """A trace as a workload: its first `limit` requests by arrival (0: all), arrivals divided by
    `speedup`, and with scale_tokens > 0 each block standing for that many tokens instead of 512
    (lengths scaled alike: a trace made for a large model, planned for a small one).

    Raises ValueError for a speedup <= 0, a negative limit or scale, or an empty trace."""
    if not (math.isfinite(speedup) and speedup > 0) or limit < 0 or scale_tokens < 0:
        raise ValueError(f"need speedup > 0, limit >= 0, scale tokens >= 0; got {speedup}, {limit}, {scale_tokens}")
    rows = sorted(load_trace(path), key=lambda r: r.arrival_s)  # a trace's rows may come out of order
    if not rows:
        raise ValueError(f"{path} has no requests")
    rows = rows[:limit] if limit else rows
    block = scale_tokens or TRACE_BLOCK_TOKENS
    scale = block / TRACE_BLOCK_TOKENS

    def scaled(n: int) -> int:
        return max(1, round(n * scale)) if n else 0

    t0 = rows[0].arrival_s if rows else 0.0
    return Workload(
        tuple(
            WorkloadRequest((r.arrival_s - t0) / speedup, scaled(r.input_tokens), scaled(r.output_tokens), r.hash_ids)
            for r in rows
        ),
        block,
    )


def parse_lengths(spec: str) -> tuple[tuple[int, float], ...]:
    """ "64:0.35,256:0.3,768" -> ((64, 0.35), (256, 0.3), (768, 1.0)): lengths in tokens (>= 1)
    with relative weights (> 0; default 1). Raises ValueError naming the bad part."""
    out = []
    for part in spec.split(","):
        length, _, weight = part.strip().partition(":")
        try:
            n, w = int(length), float(weight or 1.0)
        except ValueError:
            raise ValueError(f"bad length choice {part!r}: want TOKENS[:WEIGHT]") from None
        if n < 1 or not (math.isfinite(w) and w > 0):
            raise ValueError(f"bad length choice {part!r}: tokens >= 1 and weight > 0")
        out.append((n, w))
    return tuple(out)


def synthetic(
    rate: float,
    num_requests: int,
    input_lengths: Sequence[tuple[int, float]],
    output_lengths: Sequence[tuple[int, float]],
    shared_prefix_tokens: int = 0,
    shared_share: float = 0.0,
    num_prefixes: int = 4,
    block_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """`num_requests` Poisson arrivals at `rate` requests/s; each prompt's and answer's length
    drawn from (length, weight) choices; a `shared_share` of the prompts longer than
    `shared_prefix_tokens` open with one of `num_prefixes` shared prefixes of that many tokens.

    Raises ValueError for a rate <= 0 or fewer than one request."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need a rate > 0 and at least one request, got {rate} and {num_requests}")
    rng = random.Random(seed)
    ins, in_w = zip(*input_lengths)
    outs, out_w = zip(*output_lengths)
    shared_blocks = shared_prefix_tokens // block_tokens
    next_id, t, out = num_prefixes * shared_blocks, 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        length = rng.choices(ins, in_w)[0]
        ids: list[int] = []
        if shared_blocks and length > shared_prefix_tokens and rng.random() < shared_share:
            p = rng.randrange(num_prefixes)
            ids = list(range(p * shared_blocks, (p + 1) * shared_blocks))
        own = math.ceil(length / block_tokens) - len(ids)
        ids += range(next_id, next_id + own)
        next_id += own
        out.append(WorkloadRequest(t, length, rng.choices(outs, out_w)[0], tuple(ids)))
    return Workload(tuple(out), block_tokens)
