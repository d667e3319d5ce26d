# T=tokens (new, all sequences), B=sequences, L=layers, P=pages, S=page_size, M=pages of one
# sequence (padded to the batch's most), K=kv heads, D=head_dim
"""The plan of one forward's paged attention: where each new token's K/V is written and which
page blocks each group of sequences reads (`build_attention_metadata`), built once on the host
and reused by every layer (`kvmesh.kernels.attention.paged_attention`).

The KV cache is page-major, `[P, L, 2, S, K, D]` (`kvmesh.engine.kv_layout.LLAMA_PAGE`). Writes
address it by token row, `kv_cache.view(P*L*2*S, K, D)`: the K (kv=0) or V (kv=1) of slot s of
page p in layer l is row `((p*L + l)*2 + kv)*S + s`. Reads gather whole page blocks,
`kv_cache.view(P*L*2, S, K, D)`, block `(p*L + l)*2 + kv`. Sequences with one new token form the
decode group; each sequence with several forms a prefill group of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvmesh.kernels.ops import to_device


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
    writes, decode_b, prefills = _plan_sequences(num_computed, num_new, block_ids, S, L, num_pages)
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


def _plan_sequences(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    S: int,
    L: int,
    num_pages: int,
) -> tuple[list[int], list[int], list[PrefillGroup]]:
    """Walk the batch's sequences in order: (each new token's layer-0 K row in
    kv_cache.view(P*L*2*S, K, D), the sequences with one new token, a PrefillGroup for each with
    several). Raises ValueError as `build_attention_metadata` says."""
    rows_per_page = L * 2 * S
    writes: list[int] = []
    decode_b: list[int] = []
    prefills: list[PrefillGroup] = []
    start = 0
    for b, (nc, n, pages) in enumerate(zip(num_computed, num_new, block_ids)):
        _check_sequence(b, nc, n, pages, S, num_pages)
        writes.extend(pages[p // S] * rows_per_page + p % S for p in range(nc, nc + n))
        if n == 1:
            decode_b.append(b)
        else:
            prefills.append(_prefill_group(start, nc, n, pages, S, L))
        start += n
    return writes, decode_b, prefills


def _check_sequence(b: int, nc: int, n: int, pages: Sequence[int], S: int, num_pages: int) -> None:
    """Raise ValueError unless sequence b's nc + n tokens fit its pages, all of them in [0, num_pages)."""
    total = nc + n
    if n < 1 or nc < 0:
        raise ValueError(f"sequence {b}: need num_computed >= 0 and >= 1 new token, got {nc} and {n}")
    if len(pages) * S < total:
        raise ValueError(f"sequence {b}: {len(pages)} pages of {S} tokens cannot hold {total} tokens")
    if min(pages) < 0 or max(pages) >= num_pages:
        raise ValueError(f"sequence {b}: page ids must be in [0, {num_pages}), got {list(pages)}")


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
