"""engine.bench_prefill restates two helpers of higher layers; they must not drift apart."""

import random

from engine import bench_prefill
from engine.checkpoint import load_tokenizer
from engine.loader import resolve_model
from kvmesh.bench_peers import long_prompt_ids
from prefill_svc.engine import chunk_ends


def test_chunk_schedule_is_the_prefill_services():
    rng = random.Random(1)
    for _ in range(500):
        page = rng.choice([1, 16, 64])
        start = rng.randrange(0, 20) * page
        end, chunk = start + rng.randrange(1, 4000), rng.randrange(0, 1500)
        assert bench_prefill.chunk_ends(start, end, chunk, page) == chunk_ends(start, end, chunk, page)


def test_long_prompt_is_the_peers():
    tok = load_tokenizer(resolve_model())
    assert bench_prefill.long_prompt_ids(tok, 300) == long_prompt_ids(tok, 300)
