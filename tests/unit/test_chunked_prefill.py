"""Chunked prefill: chunk boundaries, and the same KV and first token as one forward, on real
tiny Llama and DeepSeek-V4 checkpoints (the pages pushed while later chunks compute must be
final when reported)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from kvmesh.bench.tiny_models import make_tiny_model
from kvmesh.engine.checkpoint import ModelFiles
from kvmesh.engine.forward import chunk_ends
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.request import Request
from kvmesh.engine.runners import create_runner
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.prefill_svc.engine import PrefillEngine
from kvmesh.runtime import cpu_share
from kvmesh.runtime.cpu_share import CpuShare
from tests.unit.tiny_llama import tiny_llama


def test_chunk_ends_by_hand():
    assert chunk_ends(0, 2048, 512, 16) == [512, 1024, 1536, 1920, 2048]  # the last chunk 128 = 6%
    assert chunk_ends(32, 600, 256, 16) == [288, 528, 600]  # after a cached prefix of 2 pages
    assert chunk_ends(0, 512, 512, 16) == [512]  # one chunk: nothing to overlap
    assert chunk_ends(0, 2048, 0, 16) == [2048]  # off
    assert chunk_ends(0, 100, 40, 16) == [32, 64, 80, 100]  # a chunk rounds down to whole pages; the last >= a page


def _random_ranges(seed: int, n: int = 2000):
    """n seeded (page size, page-aligned start, end, chunk tokens) cases."""
    rng = random.Random(seed)
    for _ in range(n):
        page = rng.choice([1, 4, 16, 64])
        start = rng.randrange(0, 50) * page
        yield page, start, start + rng.randrange(1, 5000), rng.randrange(1, 1500)


def test_chunk_ends_properties():
    for page, start, end, chunk in _random_ranges(0):
        ends = chunk_ends(start, end, chunk, page)
        assert ends[-1] == end and ends == sorted(set(ends)) and ends[0] > start
        assert all(e % page == 0 for e in ends[:-1]), (start, end, chunk, page, ends)
        bounds = [start, *ends]
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        whole = max(page, chunk // page * page)
        assert all(size <= whole for size in sizes[:-1])
        if len(ends) > 1:  # the last chunk is short: its push is the only one left in TTFT
            assert sizes[-1] < max(page, whole // 4 // page * page) + page


def test_without_the_short_last_chunk_a_prompt_takes_one_forward_fewer():
    assert chunk_ends(0, 2048, 512, 16, short_last=False) == [512, 1024, 1536, 2048]
    assert chunk_ends(0, 270, 256, 16, short_last=False) == [256, 270]  # the short one: [192, 270]
    assert chunk_ends(32, 600, 256, 16, short_last=False) == [288, 544, 600]
    assert chunk_ends(0, 512, 512, 16, short_last=False) == [512]
    for page, start, end, chunk in _random_ranges(1):
        whole = max(page, chunk // page * page)
        ends = chunk_ends(start, end, chunk, page, short_last=False)
        bounds = [start, *ends]
        assert ends[-1] == end and all(e % page == 0 for e in ends[:-1])
        assert all(0 < b - a <= max(whole, chunk) for a, b in zip(bounds, bounds[1:]))
        assert len(ends) == (1 if end - start <= chunk else -(-(end - start) // whole))
        if whole >= 4 * page:  # (under 4 pages the short chunk is a page, and may end past it)
            assert len(ends) <= len(chunk_ends(start, end, chunk, page))


def test_the_short_last_chunk_is_kept_only_where_the_push_it_hides_costs_more_than_a_forward():
    from kvmesh.prefill_svc.chunked import short_last_chunk_pays

    forward = (0.05, 0.001, 0.0002, 0.0)  # 50 ms a forward: the Intel Xeon's 2 cores, bf16
    # 256-token chunks of 16-token pages: the short chunk leaves 4 pages to push after the
    # compute instead of 16, 12 pages' push saved
    assert not short_last_chunk_pays((0.001, 50e-6), forward, 256, 16)  # one host: 0.6 ms saved
    assert short_last_chunk_pays((0.001, 0.01), forward, 256, 16)  # a slow link: 120 ms saved
    assert short_last_chunk_pays(None, forward, 256, 16) and short_last_chunk_pays((0.001, 50e-6), None, 256, 16)
    assert short_last_chunk_pays((0.001, 50e-6), forward, 0, 16)  # no chunks


def _llama(tmp_path) -> ModelFiles:
    return tiny_llama(tmp_path, max_positions=256)[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "llama": (_llama(tmp_path_factory.mktemp("llama")), 4, 150, 97),
        "deepseek_v4": (
            resolve_model(str(make_tiny_model("deepseek_v4", tmp_path_factory.mktemp("v4")))),
            16,
            300,
            49152,
        ),
    }


def _prefill(files: ModelFiles, page_size: int, tokens: list[int], chunk: int):
    """Prefill `tokens` once on a fresh runner; (first token, pages as bytes, the reports of ready pages)."""
    runner = create_runner(files, num_pages=64, page_size=page_size, num_state_slots=2)
    engine = PrefillEngine(runner, page_size, 64, enable_prefix_caching=False, chunked_prefill_size=chunk)
    ready: list[int] = []
    snapshots: list[list[np.ndarray]] = []

    def on_pages_ready(block_ids, n):  # on the worker thread, between chunks: copy what is final now
        ready.append(n)
        snapshots.append([runner.page_buffer(b).copy() for b in block_ids[:n]])

    try:
        job = Request("r", tokens, SamplingParams(seed=0), on_pages_ready=on_pages_ready)
        result = engine.submit(job).result(timeout=120)
        pages = [runner.page_buffer(b).copy() for b in result.block_ids]
        state = [b.copy() for b in runner.state_buffers(result.state_slot)]
        for snapshot in snapshots:  # a page reported final is never written again
            for early, last in zip(snapshot, pages):
                assert np.array_equal(early, last)
        return result.first_token, pages, state, ready
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v4"])
def test_chunked_prefill_gives_the_kv_and_first_token_of_one_forward(checkpoints, arch):
    files, page_size, length, vocab = checkpoints[arch]
    tokens = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    first, pages, state, ready = _prefill(files, page_size, tokens, chunk=0)
    assert ready == []  # one chunk: nothing is final before the compute ends
    chunk = 4 * page_size
    c_first, c_pages, c_state, c_ready = _prefill(files, page_size, tokens, chunk)
    ends = chunk_ends(0, length, chunk, page_size)
    assert len(ends) >= 4
    assert c_ready == [e // page_size for e in ends[:-1]]  # after each chunk but the last
    assert c_first == first
    for a, b in zip(pages, c_pages):
        np.testing.assert_allclose(a.view(np.float32), b.view(np.float32), rtol=1e-4, atol=1e-5)
    for a, b in zip(state, c_state):
        np.testing.assert_allclose(a.view(np.float32), b.view(np.float32), rtol=1e-4, atol=1e-5)


def test_a_forward_budget_splits_a_batch_and_keeps_its_kv_and_first_tokens(checkpoints, tmp_path):
    """--cpu-share-forward-tokens: while decode on the same cores steps, two prompts computed
    together take at most `budget` tokens a forward in all (replanned before each), and still get
    the KV and first tokens they get in one forward each."""
    files, page_size, length, vocab = checkpoints["llama"]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab, (length - 10 * k,), generator=gen).tolist() for k in range(2)]
    alone = [_prefill(files, page_size, tokens, chunk=0) for tokens in prompts]
    budget = 4 * page_size
    share = CpuShare(str(tmp_path / "cpu-share"))
    share._write(cpu_share._DECODE_DONE, time.monotonic_ns() + 10**12)  # decode stepping all along
    runner = create_runner(files, num_pages=128, page_size=page_size, num_state_slots=2)
    sizes: list[int] = []
    forward = runner.forward

    def counted(items):
        sizes.append(sum(len(it.token_ids) for it in items))
        return forward(items)

    runner.forward = counted
    engine = PrefillEngine(
        runner, page_size, 128, enable_prefix_caching=False, cpu_share=share, forward_tokens_beside_decode=budget
    )
    try:
        gate = threading.Event()
        engine.call(gate.wait, 30)  # the worker holds until both are queued: one batch
        jobs = [engine.submit(Request(f"r{k}", p, SamplingParams(seed=0))) for k, p in enumerate(prompts)]
        gate.set()
        results = [job.result(timeout=60) for job in jobs]
        assert max(sizes) <= budget and sum(sizes) == sum(map(len, prompts))
        assert sizes[0] == budget  # both prompts in one forward: half the budget each
        for (first, pages, _state, _ready), result in zip(alone, results):
            assert result.first_token == first
            for a, b in zip(pages, result.block_ids):
                np.testing.assert_allclose(
                    a.view(np.float32), runner.page_buffer(b).view(np.float32), rtol=1e-4, atol=1e-5
                )
    finally:
        engine.shutdown()
        share.close()


def test_an_engine_whose_profiles_say_so_computes_a_prompt_without_the_short_last_chunk(checkpoints):
    # the push_fit and compute_fit an engine measures on one host's cores (a page's push in
    # ~50 us, a forward's fixed cost ~50 ms): a 160-token prompt in chunks of 16 tokens takes
    # 160 / 16 = 10 forwards, not the 11 of chunk_ends' short last chunk (..., 144, 156, 160)
    files, page_size, _, vocab = checkpoints["llama"]
    length = 160
    tokens = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = create_runner(files, num_pages=64, page_size=page_size, num_state_slots=2)
    engine = PrefillEngine(runner, page_size, 64, enable_prefix_caching=False, chunked_prefill_size=16)
    for pages in range(1, 9):
        engine.push_fit.add((1, pages), 0.001 + 50e-6 * pages)
        for forwards in (1, 2, 3):
            engine.compute_fit.add((forwards, 1, 40 * pages, 0), 0.05 * forwards + 0.0002 * 40 * pages)
    reports: list[int] = []
    try:
        job = Request("r", tokens, SamplingParams(seed=0), on_pages_ready=lambda ids, n: reports.append(n))
        result = engine.submit(job).result(timeout=120)
        pages = [runner.page_buffer(b).copy() for b in result.block_ids]
    finally:
        engine.shutdown()
    first, one_forward_pages, _, _ = _prefill(files, page_size, tokens, chunk=0)
    assert result.first_token == first
    for a, b in zip(one_forward_pages, pages):
        np.testing.assert_allclose(a.view(np.float32), b.view(np.float32), rtol=1e-4, atol=1e-5)
    assert len(chunk_ends(0, length, 16, page_size)) == 11
    assert len(reports) + 1 == len(chunk_ends(0, length, 16, page_size, short_last=False)) == 10
