# B=sequences of a step, Bb=its bucket (B padded up), L=layers, M=pages a sequence may have,
# S=page_size, V=vocab
"""CUDA graphs of Llama's decode step at a few batch sizes, as vLLM's and SGLang's CUDA graph
runners do: a decode step of B one-token sequences is launch-bound on a GPU (hundreds of small
kernels), so each bucket's step is captured once and replayed, its inputs copied into the
tensors the graph reads.

A step of B sequences runs in the smallest bucket Bb >= B: rows B..Bb-1 are padding sequences
of one token over the runner's scratch page (outside the pool, so no request's page is ever
written). Every input has a fixed shape: page tables padded to the most pages a sequence can
have (M = max_position_embeddings / S), so one graph serves every context length; the paged
decode attention kernel walks each sequence's own pages only (its loop is bounded by the
context length it reads on the device). What a graph reads is copied host-to-device before the
replay; nothing in the step is read back (tests/unit/test_device_resident.py traces the step).

On the CPU nothing is captured (`capture=False`): the same fixed-shape inputs run eagerly,
which is how the padding and the copies are tested here against the plain step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvmesh.engine.forward import ForwardItem
from kvmesh.kernels import AttentionMetadata, build_attention_metadata, to_device

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Buckets a decode step is padded up to (vLLM's capture sizes start the same way)."""


@dataclass
class _Bucket:
    inputs: dict[str, torch.Tensor]
    """The tensors the step reads, on the runner's device: ids [Bb], positions [Bb], write_rows
    [L, 2, Bb], block_table [Bb, M], context_lens [Bb], and on the CPU read_blocks, mask."""
    meta: AttentionMetadata
    output: torch.Tensor | None = None
    """[Bb, V] fp32 logits the graph writes."""
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """The decode step of a `LlamaRunner` (`runner`; untyped here, which kvmesh.engine.llama.runner
    imports) at BATCH_SIZES up to `max_batch`, captured as CUDA
    graphs when `capture` (a GPU), run eagerly over the same fixed-shape inputs otherwise.

    The runner's scratch page (one past its pool) takes the padding rows' K/V.
    Raises ValueError for max_batch < 1.
    """

    def __init__(self, runner: Any, max_batch: int, capture: bool) -> None:
        if max_batch < 1:
            raise ValueError(f"decode graphs need max_batch >= 1, got {max_batch}")
        self.runner, self.capture = runner, capture
        self.batch_sizes = [b for b in BATCH_SIZES if b < max_batch] + [min(max_batch, BATCH_SIZES[-1])]
        self.max_pages = math.ceil(runner.config.max_position_embeddings / runner.page_size)
        self._buckets: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, items: Sequence[ForwardItem]) -> bool:
        """A step these graphs run: every item one new token, at most the largest bucket."""
        return len(items) <= self.batch_sizes[-1] and all(len(it.token_ids) == 1 for it in items)

    def capture_all(self) -> float:
        """Capture (or, on the CPU, build) every bucket now; the seconds it took."""
        start = time.monotonic()
        for size in self.batch_sizes:
            self._bucket(size)
        return time.monotonic() - start

    def run(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """The step for `items` (as `fits`): fp32 logits [B, V], a view of the bucket's output
        (valid until the next step). The runner checked the items."""
        B = len(items)
        size = next(b for b in self.batch_sizes if b >= B)
        bucket = self._bucket(size)
        for name, host in self._host_inputs(items, size).items():
            to_device(host, self.runner.device, out=bucket.inputs[name])
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.output = self._step(bucket)
        assert bucket.output is not None
        return bucket.output[:B]

    def _host_inputs(self, items: Sequence[ForwardItem], size: int) -> dict[str, torch.Tensor]:
        """The fixed-shape inputs of `items` padded to `size` rows, on the host: what
        kernels.build_attention_metadata(..., pad_pages=M) gives, but built with numpy (a
        [64, 512] page table from Python lists every step would cost milliseconds)."""
        r = self.runner
        S, L = r.page_size, r.config.num_layers
        padded = [*items, *[ForwardItem([0], 0, [r.scratch_page])] * (size - len(items))]
        positions = np.array([it.num_computed_tokens for it in padded], dtype=np.int64)  # [Bb]
        table = np.empty((size, self.max_pages), dtype=np.int32)  # [Bb, M], padded with each first page
        for b, it in enumerate(padded):
            table[b, : len(it.block_ids)] = it.block_ids
            table[b, len(it.block_ids) :] = it.block_ids[0]
        pages = table[np.arange(size), positions // S].astype(np.int64)  # [Bb] the page each new token goes to
        slot_rows = pages * (L * 2 * S) + positions % S  # [Bb] its row in layer 0's K plane
        write_rows = (np.arange(2 * L, dtype=np.int64).reshape(L, 2) * S)[:, :, None] + slot_rows  # [L, 2, Bb]
        inputs = {
            "ids": torch.tensor([it.token_ids[0] for it in padded]),
            "positions": torch.from_numpy(positions),
            "write_rows": torch.from_numpy(write_rows),
            "block_table": torch.from_numpy(table),
            "context_lens": torch.from_numpy((positions + 1).astype(np.int32)),
        }
        if r.device.type == "cpu":  # the CPU attention gathers whole pages and masks; a GPU's kernel reads the table
            M = self.max_pages
            lens = torch.from_numpy(positions + 1)
            blocks = torch.from_numpy(table.astype(np.int64)) * (2 * L) + torch.arange(2 * L).view(L, 2, 1, 1)
            inputs.update(
                read_blocks=blocks.flatten(2),  # [L, 2, Bb*M]
                mask=(torch.arange(M * S) < lens[:, None])[:, None, None, :],  # [Bb, 1, 1, M*S]
            )
        return inputs

    def _bucket(self, size: int) -> _Bucket:
        if size in self._buckets:
            return self._buckets[size]
        r = self.runner
        inputs = {k: to_device(v, r.device).clone() for k, v in self._host_inputs([], size).items()}
        host = build_attention_metadata([0], [1], [[r.scratch_page]], r.page_size, r.config.num_layers, r.num_pages + 1)
        assert host.decode is not None
        group = replace(
            host.decode,
            num_seqs=size,
            block_table=inputs["block_table"],
            context_lens=inputs["context_lens"],
            read_blocks=inputs.get("read_blocks", host.decode.read_blocks),
            mask=inputs.get("mask"),
        )
        bucket = _Bucket(inputs, AttentionMetadata(write_rows=inputs["write_rows"], decode=group, prefills=()))
        if self.capture:  # every row a padding row: the warm-up and the capture write the scratch page only
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # Triton compiles, cuBLAS picks its kernels: not inside the capture
                    self._step(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, pool=self._pool):
                bucket.output = self._step(bucket)
        self._buckets[size] = bucket
        return bucket

    @torch.inference_mode()
    def _step(self, bucket: _Bucket) -> torch.Tensor:
        r, inputs = self.runner, bucket.inputs
        cos = r._cos.index_select(0, inputs["positions"]).unsqueeze(1)  # [Bb, 1, D]
        sin_rot = r._sin_rot.index_select(0, inputs["positions"]).unsqueeze(1)
        # every page, the scratch page too (the padding rows write there)
        return r.model.forward(inputs["ids"], cos, sin_rot, bucket.meta, r.memory.pages, None)  # [Bb, V]
