"""Measuring a profile (kvmesh.planner.profile) on a running mesh of one prefill and one decode,
from the client, through the gateway: every hop the mesh adds is in the numbers.

Prefill: prompts of several lengths, each alone (the mesh otherwise idle), answers of one token:
TTFT against [1, forwards, tokens, tokens x (cached + tokens / 2)], the forwards at the mesh's
chunk size; each prompt is sent again with new tokens after it, so a cached prefix is measured too.
Decode: batches of several sizes (and two of long contexts), all streaming at once; a step is a
request's tokens over the window in which every request of the batch has its first token (no
prefill runs then), against [1, rows, context tokens].
Both fits are non-negative least squares (kvmesh.runtime.latency_fit.nonnegative_fit).
"""

from __future__ import annotations

import asyncio
import math
import platform
import random
import time

import numpy as np

from kvmesh.client import GatewayClient, make_request
from kvmesh.planner.profile import Profile
from kvmesh.runtime.latency_fit import nonnegative_fit

PROMPT_LENGTHS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
BATCHES = ((1, 64), (2, 64), (4, 64), (8, 64), (16, 64), (32, 64), (2, 1024), (4, 1536))
"""(rows, prompt tokens each) of the decode sweep."""
DECODE_TOKENS = 40
TOKEN_RANGE = (1000, 40000)
"""Token ids the measuring prompts are drawn from (inside every kvmesh model's vocabulary)."""


async def measure_profile(gateway: str, chunk_tokens: int, seed: int = 0, about: dict | None = None) -> Profile:
    """The profile of the mesh behind `gateway`, whose prefill forwards are `chunk_tokens` long.

    Raises grpc.aio.AioRpcError when the mesh fails a request, ValueError when its model's
    context is under 256 tokens."""
    rng = random.Random(seed)
    async with GatewayClient(gateway) as client:
        models = await client.list_models()
        context = models.max_context_tokens
        if context < 256:
            raise ValueError(f"the model's context of {context} tokens is too short to profile")

        def prompt(n: int) -> list[int]:
            return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

        await _prefill_one(client, prompt(64))  # warm: the first request pays for lazy set-up
        rows, ttfts = [], []
        for n in [n for n in PROMPT_LENGTHS if n <= context // 2]:
            for _ in range(2):
                head = prompt(n)
                for ids in (head, head + prompt(32)):  # fresh, then with its prefix cached
                    ttft, cached = await _prefill_one(client, ids)
                    computed = len(ids) - cached
                    rows.append((1, math.ceil(computed / chunk_tokens), computed, computed * (cached + computed / 2)))
                    ttfts.append(ttft)
        first, per_forward, per_token, per_attention = nonnegative_fit(np.array(rows, float), np.array(ttfts))
        steps, step_s = [], []
        for batch, length in BATCHES:
            if length + DECODE_TOKENS > context:
                continue
            seconds, tokens = await _decode_batch(client, [prompt(length) for _ in range(batch)])
            steps.append((1, batch, batch * (length + tokens)))
            step_s.append(seconds)
        step, per_row, per_context = nonnegative_fit(np.array(steps, float), np.array(step_s))
    return Profile(
        per_forward,
        per_token,
        per_attention,
        first,
        step,
        per_row,
        per_context,
        chunk_tokens,
        context,
        True,
        {
            "machine": platform.processor() or platform.machine(),
            "measured": time.strftime("%Y-%m-%d %H:%M"),
            **(about or {}),
        },
    )


async def _prefill_one(client: GatewayClient, ids: list[int]) -> tuple[float, int]:
    """(TTFT seconds, cached tokens) of one prompt answered with one token."""
    done = await client.complete(make_request(prompt_token_ids=ids, max_tokens=1, ignore_eos=True), timeout_s=300)
    return done.final.ttft_s, done.final.cached_tokens


async def _decode_batch(client: GatewayClient, prompts: list[list[int]]) -> tuple[float, float]:
    """(a decode step's seconds, the mean answer tokens in the window) while all `prompts` stream:
    each request's tokens after the last first token of the batch, over that window's length."""
    times: list[list[tuple[float, int]]] = [[] for _ in prompts]

    async def one(i: int, ids: list[int]) -> None:
        request = make_request(prompt_token_ids=ids, max_tokens=DECODE_TOKENS, ignore_eos=True)
        async for msg in client.stream(request, timeout_s=300):
            if msg.HasField("delta") and msg.delta.token_ids:
                times[i].append((time.perf_counter(), len(msg.delta.token_ids)))

    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    start = max(t[0][0] for t in times)
    end = min(t[-1][0] for t in times)
    per_token, mid_tokens = [], []
    for t in times:
        window = [n for when, n in t if start < when <= end]
        if sum(window):
            per_token.append((end - start) / sum(window))
            mid_tokens.append(sum(n for when, n in t if when <= (start + end) / 2))
    if not per_token:  # the batch's answers did not overlap: one request's own steps
        t = times[0]
        return (t[-1][0] - t[0][0]) / max(sum(n for _, n in t[1:]), 1), DECODE_TOKENS / 2
    return float(np.median(per_token)), float(np.mean(mid_tokens))
