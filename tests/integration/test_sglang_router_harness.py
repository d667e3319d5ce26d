"""A real sglang-router in front of two stub workers, driven by a 12-request hand-made trace."""

from __future__ import annotations

import hashlib
from collections import defaultdict

import pytest

from kvmesh.bench.sglang_router import block_text, sglang_assignments

A = list(range(1, 9))  # an 8-block conversation prefix
B = [100, 101, 102, 103]  # an unrelated 4-block prefix
C = [200, 201]

# One request a second; each stays in flight for 1,000 output tokens / 25 tok/s = 40 s, so every
# request is still running when the last one arrives (at most 12 in flight: far below the 64
# requests of load difference at which cache_aware stops looking at prefixes).
HASH_IDS = [
    A,  # 0: first sight of A
    B,  # 1: unrelated
    A + [9],  # 2: 8 of its 9 blocks cached with request 0
    A + [9, 10],  # 3: 9 of 10 cached with request 2
    B + [104],  # 4: 4 of 5 cached with request 1
    A + [20],  # 5: 8 of 9 cached with request 0
    C,  # 6: unrelated
    [300],  # 7: unrelated
    A,  # 8: identical to request 0
    C + [202, 203],  # 9: 2 of 4 cached with request 6
    A + [9, 10, 11],  # 10: 10 of 11 cached with request 3
    [400, 401, 402],  # 11: unrelated
]
TRACE = [
    {"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 1000, "hash_ids": ids}
    for i, ids in enumerate(HASH_IDS)
]
# request -> the earlier request it shares most of its prompt with
CACHED_WITH = {2: 0, 3: 2, 4: 1, 5: 0, 8: 0, 9: 6, 10: 3}


def test_block_texts_share_nothing_across_ids():
    # the radix tree must match whole blocks only: different ids differ from the first character
    texts = [block_text(i, 64) for i in (1, 12, 123, 65533, 65534, 71423)]
    assert len({t[0] for t in texts}) == len(texts)
    # block 12's text written out independently: its lead character (Unicode's private-use
    # plane 15 + the id), the id, then 64 words of 4 hex digits from shake_128 of the id
    digits = hashlib.shake_128(b"12").hexdigest(2 * 64)
    expected = "\U000f000c" + "12: " + " ".join(digits[i : i + 4] for i in range(0, 256, 4)) + "\n"
    assert block_text(12, 64) == expected and len(block_text(12, 64).split()) == 65


def test_cache_aware_follows_the_cached_prefix():
    workers = sglang_assignments(TRACE, 2, "cache_aware", timeout_s=120)
    assert len(workers) == len(TRACE) and all(w in (0, 1) for w in workers), workers
    # SGLang's rule at default settings: with loads balanced (difference <= 64), a request whose
    # matched prefix is more than cache_threshold=0.3 of its text goes to the worker holding it.
    for later, earlier in CACHED_WITH.items():
        assert workers[later] == workers[earlier], (later, earlier, workers)
    # Requests that match nothing go to the least-loaded worker, so B lands beside A, not on it:
    # request 0 is in flight when request 1 arrives.
    assert workers[1] != workers[0], workers


@pytest.mark.parametrize("prefix_tokens", [256, 2048])
def test_prefix_hash_groups_requests_by_leading_blocks(prefix_tokens):
    workers = sglang_assignments(TRACE, 2, "prefix_hash", prefix_tokens=prefix_tokens, timeout_s=120)
    assert len(workers) == len(TRACE) and all(w in (0, 1) for w in workers), workers
    # the key covers ceil(prefix_tokens / 512) leading blocks: 1 or 4
    key_blocks = -(-prefix_tokens // 512)
    groups = defaultdict(set)
    for ids, w in zip(HASH_IDS, workers):
        groups[tuple(ids[:key_blocks])].add(w)
    assert all(len(ws) == 1 for ws in groups.values()), dict(groups)
