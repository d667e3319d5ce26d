"""Prefix reuse across two prefill instances, the Redis index, and the load guard."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import grpc
import pytest

from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.loader import resolve_model
from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader, RedisKVIndex
from kvmesh.protos.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.conftest import instance_stats
from tests.integration.meshutil import (
    complete,
    complete_many,
    gateway_args,
    reap,
    running_mesh,
    serving,
    spawn_service,
    terminate,
    wait_idle,
    wait_indexed,
)

PAGE = 16
# 48 pages per prefill instance, so a few long prompts force LRU eviction
PREFILL_PAGES = 48

DOC = ("The history of the river town begins with a mill, a bridge and a market square. " * 12).strip()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # the gateway polls its instances' stats once, at start-up (all idle), and not again while
    # the module runs: routing then follows the gateway's own in-flight accounting alone, which
    # is exact. Polled every 0.5 s, a report taken while the previous request was still queued
    # makes an idle instance look busy until the next poll, and on a busy machine that poll can
    # come many requests later (the routing test saw [A, B, A, A]). No test here needs a poll.
    # each prefill keeps what its pool evicts in a second tier of files (--kv-tier-dir)
    tier_dir = tmp_path_factory.mktemp("kv-tier")
    prefill_args = ["--num-pages", str(PREFILL_PAGES), "--kv-tier-blocks", "512", "--kv-tier-dir", str(tier_dir)]
    with running_mesh(2, 1, prefill_args=prefill_args, gateway_args=["--stats-interval", "3600"]) as m:
        m.tier_dir = tier_dir
        yield m


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def _by_id(mesh) -> dict[str, str]:
    return {instance_stats(a, "prefill").instance_id: a for a in mesh.prefill_addresses}


def _prefill_only(address: str, token_ids: list[int]) -> prefill_pb2.PrefillResponse:
    async def call():
        async with grpc.aio.insecure_channel(address) as ch:
            return await prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="evict", token_ids=token_ids, sampling=common_pb2.SamplingParams()
                ),
                timeout=120,
            )

    return asyncio.run(call())


def test_shared_first_block_does_not_pile_onto_one_instance(mesh):
    # every chat prompt shares the template's system block. A burst of short questions
    # must spread over both instances: the gateway counts its own in-flight prefill
    # tokens, so the holder of the shared block soon costs more than the other one.
    # runs first in this module, while the gateway has routed nothing yet.
    # One after another, prompts whose shared part is under the cache threshold (30% of
    # the prompt) cost the same everywhere; ties go to the instance sent fewer tokens,
    # so they alternate instead of all going to the shared block's holder. In the burst
    # each in-flight request adds its tokens plus a fixed 256 to its instance's queue.
    used = [
        complete(
            mesh,
            f"{i}: please describe, in two or three sentences, the main idea behind this "
            f"number and why someone curious might care about it at all.",
            chat=True,
            max_tokens=2,
        ).final.prefill_instance
        for i in range(4)
    ]
    # they alternate rather than pile onto the holder: the second goes to the instance sent
    # nothing yet; the third to either (sent as much), the fourth to the other one
    assert used[0] != used[1] and used[2] != used[3] and sorted(Counter(used).values()) == [2, 2], used
    burst = complete_many(
        mesh, [dict(prompt=f"Question {i}: name a color.", chat=True, max_tokens=2) for i in range(8)]
    )
    counts = Counter(c.final.prefill_instance for c in burst)
    assert len(counts) == 2 and min(counts.values()) >= 2, counts
    # on one host decode copies each push's pages from prefill's shared pool itself (across
    # hosts they come over UCX: tests/multihost)
    d = instance_stats(mesh.decode_addresses[0], "decode")
    assert d.num_kv_pushes_pulled >= 12 and d.num_kv_pushes_sent == 0, d
    wait_idle(mesh)


def test_shared_prefix_goes_to_holder_and_computes_only_the_rest(mesh, tokenizer):
    first = DOC + " Question: who built the mill?"
    second = DOC + " Question: when was the bridge repaired?"
    a = complete(mesh, first, max_tokens=8)
    ids_a = tokenizer.encode(first, add_special_tokens=False)
    ids_b = tokenizer.encode(second, add_special_tokens=False)
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    expected_cached = min(common, len(ids_a)) // PAGE * PAGE
    assert expected_cached >= 0.5 * len(ids_b)  # long enough to steer routing

    holder = _by_id(mesh)[a.final.prefill_instance]
    before = instance_stats(holder, "prefill").num_prompt_tokens_computed
    b = complete(mesh, second, max_tokens=2)
    assert b.final.prefill_instance == a.final.prefill_instance
    assert b.final.cached_tokens == expected_cached
    after = instance_stats(holder, "prefill").num_prompt_tokens_computed
    assert after - before == len(ids_b) - expected_cached  # only the uncached suffix was computed

    # the index lists every full block of the first prompt under the holder
    index = RedisKVIndex(mesh.redis_url, model=resolve_model(None).name)
    hashes = hash_blocks(ids_a, PAGE)
    assert all(index.longest_prefix([h], [a.final.prefill_instance])[a.final.prefill_instance] == 1 for h in hashes)
    assert index.longest_prefix(hashes, [a.final.prefill_instance])[a.final.prefill_instance] == len(hashes)

    # fill the holder's cache with other prompts: LRU evicts the first prompt's blocks,
    # and the KV events take them out of the index
    for i in range(6):
        filler = tokenizer.encode(f"Unrelated filler text number {i}. " * 30, add_special_tokens=False)
        _prefill_only(holder, filler)
    assert not any(index.longest_prefix([h], [a.final.prefill_instance])[a.final.prefill_instance] for h in hashes)
    index.close()

    # ...into the holder's second tier, whose KV events (medium disk) put them in the index's
    # tier sets: the tiered lookup finds the whole prompt there, none of it in the pool
    async def tiered():
        reader = AsyncRedisKVIndexReader(mesh.redis_url, model=resolve_model(None).name)
        try:
            return await reader.longest_prefix_tiered(hashes, [a.final.prefill_instance])
        finally:
            await reader.close()

    assert asyncio.run(tiered()) == {a.final.prefill_instance: (0, len(hashes))}
    stats = instance_stats(holder, "prefill")
    assert stats.kv_tier_medium == "disk" and stats.num_tier_blocks >= len(hashes)
    # the first prompt again: routed to the holder (its tier beats a miss elsewhere), its blocks
    # copied back from the tier instead of computed, and the same answer
    before = instance_stats(holder, "prefill")
    again = complete(mesh, first, max_tokens=8)
    after = instance_stats(holder, "prefill")
    assert again.final.prefill_instance == a.final.prefill_instance
    reusable = min(len(hashes), (len(ids_a) - 1) // PAGE)
    assert again.final.cached_tokens == reusable * PAGE
    assert after.num_tier_loads - before.num_tier_loads == reusable and after.num_tier_failed_loads == 0
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == len(ids_a) - reusable * PAGE
    assert again.token_ids == a.token_ids
    # evicted again, and the tier's files deleted under the running service: the tier misses,
    # drops them (the index hears it), and the prompt is computed whole, with the same answer
    for i in range(6):
        _prefill_only(holder, tokenizer.encode(f"More filler, part {i}. " * 30, add_special_tokens=False))
    for path in mesh.tier_dir.glob("*/*.kv"):
        path.unlink()
    before = instance_stats(holder, "prefill")
    cold = complete(mesh, first, max_tokens=8)
    after = instance_stats(holder, "prefill")
    assert cold.final.prefill_instance == a.final.prefill_instance and cold.final.cached_tokens == 0
    assert after.num_tier_failed_loads - before.num_tier_failed_loads == 1  # the first miss ends the run
    assert cold.token_ids == a.token_ids
    wait_idle(mesh)


def test_trace_replay_records_and_plots(mesh, tmp_path):
    # `kvmesh bench --trace`'s replay on this mesh: eight requests of four 16-token blocks,
    # pairs sharing their first three blocks (ids no other test uses), one at a time
    from kvmesh.bench.routing_sim import TraceRequest
    from kvmesh.bench.trace import measured_prefill_rate, replay, scale_trace
    from kvmesh.bench.trace_plots import PLOT_FILES, write_plots

    trace = [TraceRequest(0.0, 0, (7_000 + i // 2, 7_100 + i // 2, 7_200 + i // 2, 7_300 + i)) for i in range(8)]
    prompts, _ = scale_trace(trace, PAGE)
    measured, wall = asyncio.run(
        replay(mesh.gateway_address, trace, prompts, speedup=1.0, concurrency=1, max_tokens=2, quiet=True)
    )
    assert [m.prompt_tokens for m in measured] == [4 * PAGE] * 8 and wall > 0
    assert {m.prefill_instance for m in measured} <= set(_by_id(mesh))
    # the second of each pair goes where its first three blocks are and reuses them
    for first, second in zip(measured[::2], measured[1::2]):
        assert first.cached_tokens == 0
        assert second.prefill_instance == first.prefill_instance
        assert second.cached_tokens == 3 * PAGE
    assert all(m.ttft_s > 0 and m.itl_s > 0 and m.prefill_s > 0 for m in measured)
    assert measured_prefill_rate(measured) > 0
    paths = write_plots(tmp_path, measured, [])
    assert [p.name for p in paths] == list(PLOT_FILES) and all(p.stat().st_size > 5_000 for p in paths)
    wait_idle(mesh)


def _prefill_on(
    address: str, token_ids: list[int], request_id: str, **fields
) -> tuple[prefill_pb2.PrefillResponse, float]:
    """A prefill-only call (no decode) and its wall seconds."""

    async def call():
        async with grpc.aio.insecure_channel(address) as ch:
            return await prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=request_id, token_ids=token_ids, sampling=common_pb2.SamplingParams(), **fields
                ),
                timeout=120,
            )

    started = time.monotonic()
    response = asyncio.run(call())
    return response, time.monotonic() - started


PULL_DOC = ("A pull test: the orchard behind the old school grows pears, plums and quinces. " * 10).strip()
"""Text no other test in this module sends: only the instance a test gives it holds its blocks."""


def _wait_held(mesh, address: str, token_ids: list[int], blocks: int) -> None:
    """Wait until the index says the prefill at `address` holds `blocks` leading blocks of token_ids
    (its KV events are published off its model thread)."""
    wait_indexed(mesh, address, "prefill", token_ids[: blocks * PAGE], resolve_model(None).name)


def _held_by(mesh, address: str, token_ids: list[int]) -> int:
    """Leading full blocks of token_ids the index says the prefill at `address` holds in its pool."""
    instance_id = instance_stats(address, "prefill").instance_id
    index = RedisKVIndex(mesh.redis_url, model=resolve_model(None).name)
    try:
        return index.longest_prefix(hash_blocks(token_ids, PAGE), [instance_id])[instance_id]
    finally:
        index.close()


def test_a_prefix_one_prefill_holds_is_pulled_by_the_other_instead_of_computed(mesh, tokenizer):
    """Pull, don't recompute: B is asked (as the gateway asks it) to prefill a prompt only A
    holds, names A as the peer, and copies A's pages (digest-checked: KVMESH_KV_DIGEST=1)
    instead of computing them; the first token is the cold one, and B computed only the rest."""
    a, b = mesh.prefill_addresses
    ids = tokenizer.encode(PULL_DOC + " Which fruit ripens first?", add_special_tokens=False)
    cold, _ = _prefill_on(a, ids, "pull-cold")  # A computes it all and keeps its blocks
    assert cold.num_cached_tokens == 0
    held = len(ids) // PAGE
    _wait_held(mesh, a, ids, held)
    assert _held_by(mesh, b, ids) == 0
    before = instance_stats(b, "prefill")
    pulled, _ = _prefill_on(b, ids, "pull-warm", pull_from=a, pull_blocks=held)
    after = instance_stats(b, "prefill")
    reusable = min(held, (len(ids) - 1) // PAGE)
    assert pulled.num_pulled_tokens == pulled.num_cached_tokens == reusable * PAGE and pulled.pull_s > 0
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == len(ids) - reusable * PAGE
    assert pulled.first_token == cold.first_token
    # the pulled blocks joined B's own cache, and its KV events put them in the index
    _wait_held(mesh, b, ids, reusable)
    wait_idle(mesh)


def test_a_pull_from_a_peer_that_lacks_the_blocks_or_is_frozen_falls_back_to_computing(mesh, tokenizer):
    """A peer that holds fewer blocks than named (evicted since) answers so and B computes; a peer
    frozen mid-way (SIGSTOP) makes the pull give up within its bound and B computes: the client
    gets its answer, the same first token, and no page is left held anywhere."""
    a, b = mesh.prefill_addresses
    proc_a = next(p for n, p in mesh.procs if n == "prefill-0")
    assert instance_stats(a, "prefill").instance_id  # prefill-0 serves the first address
    ids = tokenizer.encode(PULL_DOC.replace("pears", "apples") + " How old is the school?", add_special_tokens=False)
    # A holds none of it: it answers with 0 blocks, B computes the whole prompt
    lacking, _ = _prefill_on(b, ids, "pull-lacking", pull_from=a, pull_blocks=8)
    assert lacking.num_pulled_tokens == 0 and lacking.num_cached_tokens == 0
    # now A holds it (B does too, from that run: a fresh prompt for the frozen case)
    frozen_ids = tokenizer.encode(PULL_DOC.replace("plums", "figs") + " Who planted it?", add_special_tokens=False)
    cold, _ = _prefill_on(a, frozen_ids, "pull-cold-2")
    held = len(frozen_ids) // PAGE
    _wait_held(mesh, a, frozen_ids, held)
    proc_a.send_signal(signal.SIGSTOP)
    try:
        fallback, seconds = _prefill_on(b, frozen_ids, "pull-frozen", pull_from=a, pull_blocks=held)
    finally:
        proc_a.send_signal(signal.SIGCONT)
    assert fallback.num_pulled_tokens == 0 and fallback.num_cached_tokens == 0
    assert fallback.pull_s >= 0.9  # it waited for the peer its bound (1 s), no longer
    assert seconds < 30, seconds  # then computed: never a hang
    assert fallback.first_token == cold.first_token
    wait_idle(mesh)


def test_a_gateway_that_routes_a_held_prompt_to_the_other_prefill_makes_it_pull(mesh, tokenizer):
    """Through a gateway: one that routes round robin (so it sends a prompt away from the prefill
    holding it, as load spill does) names the holder, the other prefill pulls, computes only the
    last block, and answers what the holder answers from its own cache."""
    a, b = mesh.prefill_addresses
    by_id = {v: k for k, v in _by_id(mesh).items()}
    ids = tokenizer.encode(PULL_DOC.replace("quinces", "cherries") + " Which tree is oldest?", add_special_tokens=False)
    cold, _ = _prefill_on(a, ids, "rr-cold")  # A holds the prompt; B none of it
    held = len(ids) // PAGE
    _wait_held(mesh, a, ids, held)
    proc, address = spawn_service("gateway", gateway_args(mesh, "--routing-policy", "round_robin"), mesh.log_path)
    try:
        serving([(proc, address)])
        # the gateway learns the instances' ids from its first stats poll; two requests in a row go
        # to A and B in some order
        answers = [
            complete(mesh, b"", prompt_token_ids=ids, max_tokens=8, ignore_eos=True, address=address) for _ in range(2)
        ]
    finally:
        terminate([proc])
        reap([proc])
    on = {by_id[o.final.prefill_instance]: o for o in answers}
    assert set(on) == {a, b}, [o.final.prefill_instance for o in answers]
    reusable = min(held, (len(ids) - 1) // PAGE) * PAGE
    # B reused what it held of the document's start (earlier tests) and pulled the rest of the prefix
    assert on[b].final.cached_tokens == reusable and on[b].final.pulled_tokens >= reusable - 2 * PAGE
    assert on[b].final.pull_s > 0
    assert on[a].final.pulled_tokens == 0 and on[a].final.cached_tokens == reusable  # its own cache
    assert on[a].token_ids == on[b].token_ids and on[a].token_ids[0] == cold.first_token
    wait_idle(mesh)
