# T=tokens (new, all sequences), B=sequences, L=layers, P=pages, S=page_size, K=kv heads,
# D=head_dim, V=vocab
"""The model step prefill and decode share: a batch of sequences' new tokens in, logits out.

`LlamaRunner` owns the weights (engine/llama/model.py) and the page-major KV cache; callers own
page allocation (kvstore) and scheduling, and describe each sequence of a step as a
`ForwardItem`: its new tokens, how many tokens its pages already hold, and its page ids.
A step may mix prefill items (many new tokens, maybe after a cached prefix) and decode items
(one new token), as in vLLM's unified scheduler.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvmesh.engine.checkpoint import ModelFiles, load_checkpoint_tensors
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.cuda_graphs import DecodeGraphs
from kvmesh.engine.device import weight_dtype
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.gguf_blocks import load_blocks
from kvmesh.engine.kv_layout import llama_layout
from kvmesh.engine.llama.model import LlamaModel
from kvmesh.engine.loader import load_config
from kvmesh.kernels import build_attention_metadata, rope_table, to_device
from kvmesh.kernels.quant import kernel_threads

logger = logging.getLogger(__name__)


class LlamaRunner:
    """Weights plus a paged KV cache laid out as `kvmesh.engine.kv_layout.LLAMA_PAGE` ([P, L, 2, S, K, D],
    page-major: the KV transfer sends and receives whole pages through `page_buffer`), and the
    batched forward step. Pages hold garbage until a forward writes them.
    """

    def __init__(
        self,
        files: ModelFiles,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype | None = None,
        gguf_blocks: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        """Load `files` (config.json, *.safetensors) and allocate `num_pages` pages of KV, weights
        and pages on `device` in `dtype` (None: `kvmesh.engine.device.weight_dtype`, fp32 on the CPU,
        bf16 on a GPU; a GGUF file's weights are dequantized at load).

        With gguf_blocks, CPU decode steps (up to `QUANTIZED_MAX_BATCH` sequences) compute from
        the GGUF blocks the loader kept beside a converted GGUF file (`kvmesh.engine.gguf_blocks`);
        False, or another device, serves every step from the dense weights.

        Raises ValueError for a non-Llama checkpoint, num_pages < 1, page_size < 1, or a
        dtype that is not floating point.
        """
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.device = torch.device(device)
        dtype = dtype or weight_dtype(self.device)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
        start = time.monotonic()
        self.config: ModelConfig = load_config(files)
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        weights = load_checkpoint_tensors(files.checkpoint_dir)
        blocks = load_blocks(files.checkpoint_dir) if gguf_blocks and self.device.type == "cpu" else None
        self.model = LlamaModel(self.config, weights, dtype, blocks, self.device)
        del weights
        c = self.config
        self.page_layout = llama_layout(c.num_layers, page_size, c.num_kv_heads, c.head_dim, dtype, str(self.device))
        # one page more than the pool's: the scratch page the padding rows of a CUDA graph's
        # bucket write (kvmesh.engine.cuda_graphs), never handed to a request
        self.memory = self.page_layout.allocate(num_pages + 1)
        self.kv_cache = self.memory.pages[:num_pages]  # [P, L, 2, S, K, D]: kvmesh.engine.kv_layout.LLAMA_PAGE
        self.scratch_page = num_pages
        self.decode_graphs: DecodeGraphs | None = None
        """CUDA graphs of the decode step (`enable_decode_graphs`); None: every step eager."""
        self.page_nbytes = self.page_layout.page_nbytes
        cos, sin_rot = rope_table(c.max_position_embeddings, c.head_dim, c.rope_theta, dtype)  # [max_pos, D] each
        self._cos, self._sin_rot = cos.to(self.device), sin_rot.to(self.device)
        logger.info(
            "loaded %s in %.1f s on %s: %d pages x %d tokens, %d bytes a page, dtype %s",
            c.name,
            time.monotonic() - start,
            self.device,
            num_pages,
            page_size,
            self.page_nbytes,
            dtype,
        )

    num_state_slots = 0
    """Llama keeps all of a request's state in its pages: no slots."""

    def state_buffers(self, slot: int | None) -> list[np.ndarray | torch.Tensor]:
        """Buffers a KV push sends after the pages: none for Llama."""
        return []

    def resume_state_slot(self, slot: int, last_cached_page: int) -> None:
        """Nothing to resume: pages hold everything."""

    def copy_state_slot(self, src: int, dst: int) -> None:
        """Llama has no state slots (ValueError): speculation needs no rollback beyond its pages."""
        raise ValueError("Llama keeps no state slots to copy")

    def expert_token_counts(self) -> None:
        """Llama is dense: no experts to count."""
        return None

    def page_buffer(self, page_id: int) -> np.ndarray | torch.Tensor:
        """Zero-copy, writable 1-D uint8 view of page `page_id` (page_nbytes bytes): numpy on
        the CPU, a device tensor on a GPU (kvmesh.engine.kv_layout.KVMemory.page_buffer).

        Only write whole pages of K/V bytes from another LlamaRunner of the same model, page
        size and dtype: attention reads unused slots too (then masks them), so they must stay
        finite. Raises ValueError when page_id is not in [0, num_pages).
        """
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"page_id must be in [0, {self.num_pages}), got {page_id}")
        return self.memory.page_buffer(page_id)

    def use_int8_activations(self) -> None:
        """The layers' matmuls take int8 activations (`LlamaModel.use_int8_activations`; ValueError
        where they cannot)."""
        self.model.use_int8_activations()

    def enable_decode_graphs(self, max_batch: int) -> None:
        """Serve decode steps of up to max_batch sequences from CUDA graphs captured now, one a
        bucket (kvmesh.engine.cuda_graphs); on the CPU the same fixed-shape steps run eagerly (tests)."""
        self.decode_graphs = DecodeGraphs(self, max_batch, capture=self.device.type == "cuda")
        seconds = self.decode_graphs.capture_all()
        logger.info(
            "decode steps of up to %d sequences %s at batch sizes %s in %.1f s",
            max_batch,
            "captured as CUDA graphs" if self.decode_graphs.capture else "set up with fixed shapes (no capture on CPU)",
            self.decode_graphs.batch_sizes,
            seconds,
        )

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """One model step over a batch of sequences; returns fp32 logits [len(items), V].

        Row b holds the logits after the last new token of items[b]. K/V of every new token are
        written into the item's pages at positions num_computed_tokens... Raises ValueError for
        an empty batch, an item without new tokens, a token id outside the vocabulary, too few
        pages, a page id out of range, or a position beyond max_position_embeddings.
        """
        return self._forward(items, all_positions=False)

    def forward_all(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """`forward`, returning the logits after every new token: fp32 [T, V], T the items' new
        tokens in order (a prompt's logprobs need each position's). Through the same dense path
        as a prefill's last rows (never the quantized decode kernels). Raises as `forward`."""
        return self._forward(items, all_positions=True)

    def _forward(self, items: Sequence[ForwardItem], all_positions: bool) -> torch.Tensor:
        if not items:
            raise ValueError("forward needs at least one ForwardItem")
        max_pos = self.config.max_position_embeddings
        ids: list[int] = []
        positions: list[int] = []
        num_new: list[int] = []
        for b, it in enumerate(items):
            n, nc = len(it.token_ids), it.num_computed_tokens
            if nc + n > max_pos:
                raise ValueError(
                    f"item {b}: {nc + n} tokens exceed max_position_embeddings ({max_pos}) of {self.config.name}"
                )
            ids.extend(it.token_ids)
            positions.extend(range(nc, nc + n))
            num_new.append(n)
        if min(ids, default=0) < 0 or max(ids, default=0) >= self.config.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.config.vocab_size)
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size}) of {self.config.name}"
            )
        if self.decode_graphs is not None and not all_positions and self.decode_graphs.fits(items):
            for b, it in enumerate(items):
                if not it.block_ids or min(it.block_ids) < 0 or max(it.block_ids) >= self.num_pages:
                    raise ValueError(f"item {b}: page ids must be in [0, {self.num_pages}), got {list(it.block_ids)}")
                if len(it.block_ids) * self.page_size < it.num_computed_tokens + 1:
                    raise ValueError(
                        f"item {b}: {len(it.block_ids)} pages cannot hold {it.num_computed_tokens + 1} tokens"
                    )
            return self.decode_graphs.run(items)
        meta = build_attention_metadata(
            [it.num_computed_tokens for it in items],
            num_new,
            [it.block_ids for it in items],
            self.page_size,
            self.config.num_layers,
            self.num_pages,
            self.device,
        )
        # the step's host-built indices go to the device (host to device only: no sync)
        pos = to_device(torch.tensor(positions), self.device)  # [T]
        cos = self._cos.index_select(0, pos).unsqueeze(1)  # [T, 1, D]
        sin_rot = self._sin_rot.index_select(0, pos).unsqueeze(1)  # [T, 1, D]
        logits_index = None
        if all_positions:  # every row, by index: the dense path, as a prefill's last rows take
            logits_index = to_device(torch.arange(len(ids)), self.device)  # [T]
        elif len(ids) != len(items):  # some item has several new tokens: pick each one's last
            logits_index = to_device(torch.tensor([n - 1 for n in itertools.accumulate(num_new)]), self.device)  # [B]
        input_ids = to_device(torch.tensor(ids), self.device)  # [T]
        return self.model.forward(input_ids, cos, sin_rot, meta, self.kv_cache, logits_index)

    def warmup(self) -> None:
        """Run a tiny prefill and decode on page 0 so the first request pays no one-time costs.

        Leaves garbage in page 0, which callers treat as garbage until they write it anyway.
        """
        start = time.monotonic()
        tok = self.config.bos_token_id or 0
        span = min(2, self.page_size)
        self.forward([ForwardItem([tok] * span, 0, [0])])
        if span < self.page_size:
            self.forward([ForwardItem([tok], span, [0])])
        logger.info("warmup took %.2f s", time.monotonic() - start)
        if self.model.q_lm_head is not None:  # the decode step above ran the block kernels
            layer, threads = kernel_threads()
            logger.info("GGUF block kernels run on numba's %s threading layer, %d threads", layer, threads)
            if layer == "workqueue":
                logger.warning(
                    "numba found no OpenMP or TBB runtime: batch-1 decode runs ~3x slower; "
                    "install Debian's libgomp1 (or pip's tbb)"
                )
