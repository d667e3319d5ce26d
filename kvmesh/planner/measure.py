"""Measuring a profile (kvmesh.planner.profile) on a running mesh of one prefill and one decode,
from the client, through the gateway: every hop the mesh adds is in the numbers.

Prefill: prompts of several lengths, each alone (the mesh otherwise idle), answers of one token:
TTFT against [1, forwards, tokens, tokens x (cached + tokens / 2)], the forwards at the mesh's
chunk size; each prompt is sent again with new tokens after it, so a cached prefix is measured too.
The sweep runs twice, on a mesh at the planned chunk size and on one at a quarter of it
(`measure`): at one chunk size most prompts take one forward and the others' forwards grow with
their tokens, so a forward's fixed cost and a request's (first_token_s) are near-collinear, and
which of the two took the cost changed from one measurement to the next (docs/planning.md,
2026-12-07), and with it the chunk the planner picked. A prompt that takes 4x the forwards at the
small chunk for the same tokens tells them apart (simulated with 5% noise on each TTFT: the
per-forward cost's 10th-90th percentile range 7x narrower than from one chunk size).
Decode: batches of several sizes (and two of long contexts), all streaming at once; a step is a
request's tokens over the window in which every request of the batch has its first token (no
prefill runs then), against [1, rows, context tokens].
Both fits are non-negative least squares (kvmesh.runtime.latency_fit.nonnegative_fit); the
prefill one of the relative error (each row weighed by 1 / its TTFT), as the instances fit their
own prefill profile (LinearFit, relative), so the long prompts do not decide a short one's cost.
"""

from __future__ import annotations

import asyncio
import math
import platform
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvmesh.client import GatewayClient, make_request
from kvmesh.planner.profile import Profile
from kvmesh.runtime.latency_fit import nonnegative_fit

if TYPE_CHECKING:
    from kvmesh.launcher import Mesh

PROMPT_LENGTHS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
BATCHES = ((1, 64), (2, 64), (4, 64), (8, 64), (16, 64), (32, 64), (2, 1024), (4, 1536))
"""(rows, prompt tokens each) of the decode sweep."""
DECODE_TOKENS = 40
TOKEN_RANGE = (1000, 40000)
"""Token ids the measuring prompts are drawn from (inside every kvmesh model's vocabulary)."""
SMALL_CHUNK_DIVISOR = 4
"""The second sweep's chunk is the planned one over this (at least MIN_CHUNK_TOKENS)."""
MIN_CHUNK_TOKENS = 16


class PrefillSample(NamedTuple):
    """One prompt sent alone: its tokens, those its prefix hit, the chunk size of the mesh that
    computed it (tokens) and its TTFT (seconds)."""

    tokens: int
    cached: int
    chunk_tokens: int
    ttft_s: float


def chunk_env(chunk_tokens: int) -> dict[str, str]:
    """The environment that starts a mesh whose prefill forwards are `chunk_tokens` long."""
    return {"KVMESH_CHUNKED_PREFILL_SIZE": str(chunk_tokens), "KVMESH_MAX_BATCH_TOKENS": str(chunk_tokens)}


def measure(
    start: Callable[[dict[str, str]], Mesh], chunk_tokens: int, seed: int = 0, about: dict | None = None
) -> Profile:
    """The profile of the meshes `start(env)` starts (one prefill, one decode; `env` sets the chunk
    size, `chunk_env`): first the prefill sweep on one at chunk_tokens / SMALL_CHUNK_DIVISOR, then
    the whole profile on one at `chunk_tokens`, the prefill fitted on both sweeps. Each mesh is
    stopped before the next starts (one model in memory at a time).

    Raises what `start` and `measure_profile` raise."""
    small = max(chunk_tokens // SMALL_CHUNK_DIVISOR, MIN_CHUNK_TOKENS)
    mesh = start(chunk_env(small))
    try:
        samples = asyncio.run(_prefill_sweep_at(mesh.gateway_address, small, seed + 1))
    finally:
        mesh.stop()
    mesh = start(chunk_env(chunk_tokens))
    try:
        return asyncio.run(measure_profile(mesh.gateway_address, chunk_tokens, seed, about, samples))
    finally:
        mesh.stop()


async def measure_profile(
    gateway: str,
    chunk_tokens: int,
    seed: int = 0,
    about: dict | None = None,
    more_samples: Sequence[PrefillSample] = (),
) -> Profile:
    """The profile of the mesh behind `gateway`, whose prefill forwards are `chunk_tokens` long;
    the prefill fitted on its sweep and `more_samples` (another chunk size's: `measure`).

    Raises grpc.aio.AioRpcError when the mesh fails a request, ValueError when its model's
    context is under 256 tokens."""
    rng = random.Random(seed)
    async with GatewayClient(gateway) as client:
        context = await _context_tokens(client)
        samples = await _prefill_sweep(client, chunk_tokens, rng, context)
        first, per_forward, per_token, per_attention = fit_prefill([*samples, *more_samples])
        steps, step_s = [], []
        for batch, length in BATCHES:
            if length + DECODE_TOKENS > context:
                continue
            prompts = [_prompt(rng, length) for _ in range(batch)]
            seconds, tokens = await _decode_batch(client, prompts)
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


def fit_prefill(samples: Sequence[PrefillSample]) -> list[float]:
    """[first_token_s, per_forward_s, per_token_s, per_attention_s] (kvmesh.planner.profile) fitted
    to prompts sent alone, at the least relative error with every coefficient >= 0. Raises
    ValueError for no samples."""
    if not samples:
        raise ValueError("no prefill samples to fit")
    rows = []
    for s in samples:
        computed = s.tokens - s.cached
        rows.append((1, math.ceil(computed / s.chunk_tokens), computed, computed * (s.cached + computed / 2)))
    return nonnegative_fit(np.array(rows, float), np.array([s.ttft_s for s in samples], float), relative=True)


async def _context_tokens(client: GatewayClient) -> int:
    """The served model's context (tokens); ValueError when it is too short to profile."""
    context = (await client.list_models()).max_context_tokens
    if context < 256:
        raise ValueError(f"the model's context of {context} tokens is too short to profile")
    return context


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


async def _prefill_sweep_at(gateway: str, chunk_tokens: int, seed: int) -> list[PrefillSample]:
    async with GatewayClient(gateway) as client:
        return await _prefill_sweep(client, chunk_tokens, random.Random(seed), await _context_tokens(client))


async def _prefill_sweep(
    client: GatewayClient, chunk_tokens: int, rng: random.Random, context: int
) -> list[PrefillSample]:
    """Each of PROMPT_LENGTHS (up to half the context) twice, fresh and again with 32 new tokens
    after it (its prefix cached), alone, answered with one token."""
    await _prefill_one(client, _prompt(rng, 64))  # warm: the first request pays for lazy set-up
    samples = []
    for n in [n for n in PROMPT_LENGTHS if n <= context // 2]:
        for _ in range(2):
            head = _prompt(rng, n)
            for ids in (head, head + _prompt(rng, 32)):
                ttft, cached = await _prefill_one(client, ids)
                samples.append(PrefillSample(len(ids), cached, chunk_tokens, ttft))
    return samples


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
