"""The tiny paged-attention layout and the kernel-vs-reference run that test_kernels.py and
test_prefill_attention.py share, and the decode cases of test_paged_decode_kernel.py and
test_custom_ops.py (`decode_case`)."""

import random

import torch

from kvmesh.kernels import build_attention_metadata, paged_attention
from kvmesh.kernels.ref import paged_attention_ref

# 6 query heads over 2 kv heads, pages of 4 token slots
P, L, S, Q, K, D = 24, 3, 4, 6, 2, 8


def run_both(num_computed, num_new, layer):
    """Random prefix K/V in scattered pages; run kernel and reference on copies of one cache."""
    pages = list(range(P))
    random.shuffle(pages)
    block_ids = []
    for nc, n in zip(num_computed, num_new):
        need = (nc + n + S - 1) // S
        block_ids.append([pages.pop() for _ in range(need)])
    # garbage everywhere (finite, large): a read of an unwritten or padded slot would show
    cache = torch.randn(P, L, 2, S, K, D) * 1e3
    for nc, pages_b in zip(num_computed, block_ids):  # plausible prefix K/V
        for p in range(nc):
            cache[pages_b[p // S], :, :, p % S] = torch.randn(L, 2, K, D)
    T = sum(num_new)
    q, k, v = torch.randn(T, Q, D), torch.randn(T, K, D), torch.randn(T, K, D)
    cache_ref = cache.clone()
    meta = build_attention_metadata(num_computed, num_new, block_ids, S, L, P)
    out = paged_attention(q, k, v, cache, layer, meta)
    ref = paged_attention_ref(q, k, v, cache_ref, layer, num_computed, num_new, block_ids)
    return out, ref, cache, cache_ref


def decode_case(B, Q, K, D, S, lens, P=24, L=2, dtype=torch.float32, seed=0):
    """One decode query a sequence over a cache of random K/V [P, L, 2, S, K, D]: (q [B, Q, D],
    the cache, each sequence's pages drawn at random (not in order) as lists, padded past its
    pages with page 0)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(P, L, 2, S, K, D, generator=g).to(dtype)
    q = torch.randn(B, Q, D, generator=g).to(dtype)
    most = max(-(-n // S) for n in lens)
    perm = torch.randperm(P, generator=g).tolist()
    table, i = [], 0
    for n in lens:
        pages = perm[i : i + -(-n // S)]
        i += len(pages)
        table.append(pages + [0] * (most - len(pages)))
    return q, kv, table
