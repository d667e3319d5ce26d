# T=tokens (new, all sequences), B=sequences, L=layers, P=pages, S=page_size, M=pages of one
# sequence (padded to the batch's most), Q=query heads, K=kv heads, R=Q/K, D=head_dim,
# n=new tokens of one prefill, N=its context (prefix + new), b=queries of one block
"""Paged attention on the CPU PyTorch path.

The KV cache is page-major, `[P, L, 2, S, K, D]` (the layout `kvmesh.engine.kv_layout.LLAMA_PAGE`
defines and allocates), so one page is one contiguous buffer for the KV transfer. Writes address it by token row, `kv_cache.view(P*L*2*S, K, D)`: the K (kv=0) or
V (kv=1) of slot s of page p in layer l is row `((p*L + l)*2 + kv)*S + s`. Reads gather whole
page blocks, `kv_cache.view(P*L*2, S, K, D)`, block `(p*L + l)*2 + kv`: one memcpy of S tokens
each instead of S small ones.

`build_attention_metadata` turns a batch's page tables into those indices once per forward;
every layer reuses them (`paged_attention`). Sequences with one new token (decode) run as one
batched SDPA over their gathered K/V, padded to whole pages and masked; each sequence with
several new tokens (prefill, possibly after a cached prefix) runs causal attention in query
blocks (`_causal_blocks`). The reference is `ref.paged_attention_ref` (vLLM's paged attention
semantics, transformers' Llama attention numerics).

Decode reads the unused slots of a sequence's last page and masks them, so they must hold
finite values: a NaN there leaks through the mask as 0 * NaN (prefill reads only its N tokens). ModelRunner zero-fills its cache and only K/V ever lands
in it, which keeps that true.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvmesh.kernels.ops import to_device

QUERY_BLOCK = 2048
"""Queries per block of `_causal_blocks`, so a chunk of up to 2048 tokens is one block: its
own keys causally, the cached prefix's in full, merged. Smaller blocks skip more of the causal
waste (256: about 8% less attention time on an idle 2-core machine, SmolLM2-135M) but make
~8x the kernel calls, each a parallel region that waits for every thread; on shared cores
(prefill and decode instances share them by default) that measured 25-50% slower."""

# PyTorch's CPU flash attention kernel (the one SDPA dispatches to here), called directly
# because it also returns each query row's log-sum-exp, which merging two parts needs
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences with exactly one new token, attended together."""

    token_index: torch.Tensor | None
    """[B] int64 rows of the batch's tokens that are these queries; None when they are all rows."""
    read_blocks: torch.Tensor
    """[L, 2, B*M] int64 page blocks of each sequence's context, padded to the most pages (M)."""
    mask: torch.Tensor | None
    """[B, 1, 1, M*S] bool, True where a key is real; None when every slot is."""
    num_seqs: int
    block_table: torch.Tensor
    """[B, M] int32 each sequence's page ids, padded with its first page (the paged decode op's)."""
    context_lens: torch.Tensor
    """[B] int32 each sequence's context in tokens, the new one included."""


@dataclass(frozen=True)
class PrefillGroup:
    """One sequence with several new tokens: rows [start, end) of the batch's tokens."""

    start: int
    end: int
    num_computed: int
    """Tokens of the cached prefix: new token i sits at position num_computed + i."""
    read_blocks: torch.Tensor | None
    """[L, 2, M] int64 page blocks of prefix + new tokens; None without a prefix (new K/V as is)."""


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one forward's tokens write and read K/V, shared by all layers."""

    write_rows: torch.Tensor
    """[L, 2, T] int64 rows of kv_cache.view(-1, K, D) receiving each new token's K and V."""
    decode: DecodeGroup | None
    prefills: tuple[PrefillGroup, ...]


def build_attention_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    page_size: int,
    num_layers: int,
    num_pages: int,
    device: torch.device | None = None,
    pad_pages: int = 0,
) -> AttentionMetadata:
    """Plan a forward: K/V write rows for the new tokens and read blocks for each group.

    num_computed[b] tokens of sequence b are already in its pages, num_new[b] >= 1 follow
    (positions num_computed[b] ...); block_ids[b] lists its page ids in order, covering all
    num_computed[b] + num_new[b] tokens. The plan is built on the host and its tensors copied
    to `device` (None: the CPU) without waiting. pad_pages > 0: the decode group's tables are
    padded to that many pages and its mask is always there (fixed shapes, what a CUDA graph
    replays into). Raises ValueError when a page list is too short or names a page outside
    [0, num_pages).
    """
    if not len(num_computed) == len(num_new) == len(block_ids):
        raise ValueError(
            f"need one num_computed, num_new and block_ids entry per sequence, got "
            f"{len(num_computed)}, {len(num_new)} and {len(block_ids)}"
        )
    S, L = page_size, num_layers
    rows_per_page = L * 2 * S
    writes: list[int] = []
    decode_b: list[int] = []
    prefills: list[PrefillGroup] = []
    start = 0
    for b, (nc, n, pages) in enumerate(zip(num_computed, num_new, block_ids)):
        total = nc + n
        if n < 1 or nc < 0:
            raise ValueError(f"sequence {b}: need num_computed >= 0 and >= 1 new token, got {nc} and {n}")
        if len(pages) * S < total:
            raise ValueError(f"sequence {b}: {len(pages)} pages of {S} tokens cannot hold {total} tokens")
        if min(pages) < 0 or max(pages) >= num_pages:
            raise ValueError(f"sequence {b}: page ids must be in [0, {num_pages}), got {list(pages)}")
        writes.extend(pages[p // S] * rows_per_page + p % S for p in range(nc, total))
        if n == 1:
            decode_b.append(b)
        else:
            prefills.append(_prefill_group(start, nc, n, pages, S, L))
        start += n
    layer_kv_rows = torch.arange(2 * L).view(L, 2) * S  # [L, 2] row of (layer, kv) in a page
    write_rows = layer_kv_rows[:, :, None] + torch.tensor(writes)  # [L, 2, T]
    decode = None
    if decode_b:
        all_decode = len(decode_b) == len(num_new)
        decode = _decode_group(
            decode_b,
            num_computed,
            block_ids,
            S,
            L,
            token_index=None if all_decode else _token_rows(decode_b, num_new),
            pad_pages=pad_pages,
        )
    meta = AttentionMetadata(write_rows=write_rows, decode=decode, prefills=tuple(prefills))
    return meta if device is None or device.type == "cpu" else _moved(meta, device)


def _moved(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """`meta` with every tensor copied to `device` (host to device, queued: no sync)."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else to_device(t, device)

    g, fields = meta.decode, ("token_index", "read_blocks", "mask", "block_table", "context_lens")
    decode = None if g is None else replace(g, **{f: move(getattr(g, f)) for f in fields})
    prefills = tuple(replace(p, read_blocks=move(p.read_blocks)) for p in meta.prefills)
    return AttentionMetadata(write_rows=to_device(meta.write_rows, device), decode=decode, prefills=prefills)


def _token_rows(seqs: list[int], num_new: Sequence[int]) -> torch.Tensor:
    offsets = [0]
    for n in num_new:
        offsets.append(offsets[-1] + n)
    return torch.tensor([offsets[b] for b in seqs])  # [B]


def _read_blocks(table: torch.Tensor, L: int) -> torch.Tensor:
    """Page ids [...] -> their (layer, kv) blocks in kv_cache.view(P*L*2, S, K, D): [L, 2, ...]."""
    layer_kv = torch.arange(2 * L).view(L, 2, *([1] * table.dim()))
    return table * (2 * L) + layer_kv


def _decode_group(
    seqs: list[int],
    num_computed: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    S: int,
    L: int,
    token_index: torch.Tensor | None,
    pad_pages: int = 0,
) -> DecodeGroup:
    lens = [num_computed[b] + 1 for b in seqs]
    M = max((max(lens) + S - 1) // S, pad_pages)
    # pad short page tables with their own first page: real memory, masked out below
    table = torch.tensor(
        [list(block_ids[b][:M]) + [block_ids[b][0]] * max(0, M - len(block_ids[b])) for b in seqs]
    )  # [B, M]
    mask = None
    if pad_pages or any(n != M * S for n in lens):
        mask = (torch.arange(M * S) < torch.tensor(lens)[:, None])[:, None, None, :]  # [B,1,1,M*S]
    return DecodeGroup(
        token_index=token_index,
        read_blocks=_read_blocks(table, L).flatten(2),
        mask=mask,
        num_seqs=len(seqs),
        block_table=table.to(torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
    )


def _prefill_group(start: int, nc: int, n: int, pages: Sequence[int], S: int, L: int) -> PrefillGroup:
    if nc == 0:
        return PrefillGroup(start=start, end=start + n, num_computed=0, read_blocks=None)
    M = (nc + n + S - 1) // S
    return PrefillGroup(
        start=start, end=start + n, num_computed=nc, read_blocks=_read_blocks(torch.tensor(list(pages[:M])), L)
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata
) -> torch.Tensor:
    """Write the new tokens' K/V into their pages, then attend each query to its context.

    q [T, Q, D], k and v [T, K, D] (strided views are fine); kv_cache [P, L, 2, S, K, D],
    contiguous, written in place; layer in [0, L). Returns [T, Q*D], same dtype as q.
    Scale 1/sqrt(D), causal, GQA with query head h reading kv head h // R (transformers'
    `repeat_kv`). Reference: `ref.paged_attention_ref`.
    """
    T, Q, D = q.shape
    P, _, _, S, K, _ = kv_cache.shape
    kv_rows = kv_cache.view(-1, K, D)  # [P*L*2*S, K, D]
    kv_blocks = kv_cache.view(-1, S, K, D)  # [P*L*2, S, K, D]
    rows = meta.write_rows[layer]  # [2, T]
    kv_rows.index_copy_(0, rows[0], k)
    kv_rows.index_copy_(0, rows[1], v)
    g = meta.decode
    if g is not None and g.token_index is None and not meta.prefills:
        return _decode(q, kv_cache, layer, g).reshape(T, Q * D)  # all-decode: no scatter
    if g is None and len(meta.prefills) == 1 and meta.prefills[0].end - meta.prefills[0].start == T:
        return _prefill(q, k, v, kv_blocks, layer, meta.prefills[0])  # one prefill: no scatter either
    out = q.new_empty(T, Q * D)
    if g is not None:
        qd = q.index_select(0, g.token_index)  # [B, Q, D]
        out.index_copy_(0, g.token_index, _decode(qd, kv_cache, layer, g).reshape(-1, Q * D))
    for p in meta.prefills:
        out[p.start : p.end] = _prefill(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end], kv_blocks, layer, p)
    return out


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, g: DecodeGroup) -> torch.Tensor:
    """q [B, Q, D] -> [B, K, R, D] (CPU) or [B, Q, D] (a GPU: the paged decode op), same memory order."""
    if q.device.type != "cpu":  # the Triton kernel (kvmesh.kernels.custom_ops): pages read in place
        import kvmesh.kernels.custom_ops  # noqa: F401  # on first use: registers torch.ops.kvmesh.*, imports triton

        return torch.ops.kvmesh.paged_decode_attention(q, kv_cache, layer, g.block_table, g.context_lens)
    B, (*_, S, K, D) = g.num_seqs, kv_cache.shape
    kv_blocks = kv_cache.view(-1, S, K, D)  # [P*L*2, S, K, D]
    kv = kv_blocks.index_select(0, g.read_blocks[layer].view(-1)).view(2, B, -1, K, D)  # N = M*S
    # the R query heads sharing a kv head act as R query rows against it: no K/V repeat
    qg = q.reshape(B, K, -1, D)  # [B, K, R, D]
    return F.scaled_dot_product_attention(
        qg, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=g.mask
    )  # [B, K, R, D]


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_blocks: torch.Tensor, layer: int, p: PrefillGroup
) -> torch.Tensor:
    n, Q, D = q.shape
    nc = p.num_computed
    if p.read_blocks is None:
        keys, values = k, v  # [n, K, D]: no prefix, the new tokens are the whole context
    else:
        kv = kv_blocks.index_select(0, p.read_blocks[layer].view(-1))  # [2*M, S, K, D]
        keys, values = kv.view(2, -1, *kv.shape[2:])[:, : nc + n].unbind(0)  # [N, K, D] each, N = nc+n
    qh, kh, vh = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if q.device.type == "cpu":
        o = _causal_blocks(qh, kh, vh, nc, QUERY_BLOCK)  # [1, Q, n, D]
    else:  # SDPA's GPU kernels (flash / memory-efficient) take GQA and a bottom-right causal mask
        mask = None if nc == 0 else torch.ones(n, nc + n, dtype=torch.bool, device=q.device).tril(nc)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=nc == 0, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, Q * D)


def _causal_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nc: int, block: int) -> torch.Tensor:
    """Causal attention of n queries at positions nc.. over keys 0 .. nc+n-1, a block at a time.

    q [1, Q, n, D], k and v [1, K, nc+n, D] (strided views are fine; GQA as SDPA's enable_gqa).
    Returns [1, Q, n, D] laid out as [1, n, Q, D] in memory.

    SDPA's causal flag aligns the mask top-left, which is wrong after a prefix, and an explicit
    [n, nc+n] mask makes its kernel build, add and exponentiate every masked score too. Here
    queries [s, e) see the keys before the block, [0, nc+s), in full (no mask at all) and the
    diagonal keys [nc+s, nc+e) causally (a square, where top-left is right); the two partial
    softmaxes merge by their log-sum-exps as in flash attention (Dao et al. 2022):
    out = lerp(o_diag, o_before, w), w = Z_before / (Z_before + Z_diag) = sigmoid(lse_b - lse_d).
    Reference: `ref.paged_attention_ref`; within 2e-5 of it (fp32), not bit-identical to SDPA.
    """
    _, Q, n, D = q.shape
    if nc == 0 and n <= block:
        return _flash(q, k, v, 0.0, True)[0]  # one causal square: SDPA's own call, no copy
    out = q.new_empty(1, n, Q, D).transpose(1, 2)  # [1, Q, n, D], rows of [n, Q*D] in memory
    for s in range(0, n, block):
        e = min(n, s + block)
        a = nc + s  # keys before this block
        qb = q[:, :, s:e]
        o, lse = _flash(qb, k[:, :, a : nc + e], v[:, :, a : nc + e], 0.0, True)  # [1, Q, b, D], [1, Q, b]
        if a:
            o_before, lse_before = _flash(qb, k[:, :, :a], v[:, :, :a], 0.0, False)
            w = (lse_before - lse).sigmoid_().to(o.dtype)[..., None]  # [1, Q, b, 1]
            torch.lerp(o, o_before, w, out=out[:, :, s:e])  # one pass, straight into the output rows
        else:
            out[:, :, s:e] = o
    return out
