# T=tokens (new, all sequences), B=sequences, H=hidden, I=intermediate, V=vocab, Q=query heads,
# K=kv heads, D=head_dim, L=layers, P=pages, S=page_size
"""Llama decoder (Touvron et al. 2023) over a paged KV cache, number for number transformers'
`LlamaForCausalLM` (modeling_llama.py), laid out for speed on CPU:

- q/k/v fused into one weight and gate/up into another at load, so a layer is 4 matmuls;
- weights stored input-major ([in, out], `x @ w`): measured on 2 cores, a decode step is
  13% faster at B=4 and 5-8% at B=16 than transformers' [out, in] with `F.linear` (B=1
  unchanged). The rounding differs: the worst prefill logit gap to transformers grows from
  2.6e-5 to 4.3e-5, still inside the 1e-4 parity bound the tests hold it to (the tied
  lm_head keeps the embedding's [V, H] layout: a transposed copy would cost 113 MB);
- every sequence's tokens go through each matmul as one [T, H] batch;
- prefill's fp32 matmuls run through oneDNN (`kvmesh.kernels.dense`) on CPUs not made by Intel:
  PyTorch's MKL takes a generic path there (oneDNN's AVX-512 code ran 1.6-2x faster on prefill's
  shapes on an AMD EPYC); on Intel's they stay on MKL, the faster of the two there; bf16 ones,
  where the CPU only emulates bf16, run as fp32 GEMMs on the same values, rounded to bf16
  (`kvmesh.kernels.dense.prefill_copy`: torch's emulated bf16 GEMM ran 90x slower);
- logits only for the rows asked for (the last new token of each sequence);
- a decode step (one new token a sequence) of up to `QUANTIZED_MAX_BATCH` sequences (in bf16
  with AMX tiles, `AMX_BF16_MAX_BATCH`) multiplies straight from the GGUF file's Q4_1 / Q8_0
  blocks when the checkpoint has them (`kvmesh.kernels.quant`), reading 5x fewer weight bytes
  than fp32. Prefill keeps the fp32 weights:
  a prompt's first positions carry residuals near 2e4, where the kernels' per-block sums
  round up to 1.5e-4 away from transformers' logits, past the 1e-4 the parity tests hold
  (`--quantization int8` runs every forward's layer matmuls from the blocks, W4A8: a choice judged
  by docs/precision.md's rule, not by parity);
- a decode step of up to `QUANTIZED_MAX_BATCH` sequences runs as one numba call,
  `kvmesh.engine.llama.step.decode_step`: every layer and the lm_head from the blocks, with
  RMSNorm, RoPE, the K/V write, attention over each sequence's own pages and SiLU*up in the same
  call, so no torch op runs per layer. Measured on 2 busy-shared cores (`kvmesh.bench.profile_decode`):
  as torch ops around the block kernels a batch-1 step spent 6.3 ms a token outside the matmuls
  (RMSNorm alone 2.0 ms, ~16 us a torch op on a [1, H] tensor), fused 1.5 ms; a 16-sequence step
  spent ~40 ms outside them. Its matmuls are the block kernels' tiles (`kvmesh.kernels.quant.q4_1_tile`),
  bit for bit; the rest rounds within an ulp or two of the torch ops (sums in another order), well
  inside the parity bound, and a sequence gets the same bits alone or in any batch.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.gguf_blocks import GGUFBlocks
from kvmesh.engine.llama.step import StepBatch, StepWeights, decode_step
from kvmesh.engine.llama.weights import TensorTaker, pack_blocks, take_layer
from kvmesh.kernels import AttentionMetadata, apply_rotary, paged_attention, rms_norm, silu_and_mul
from kvmesh.kernels.attention import DecodeGroup
from kvmesh.kernels.dense import dense_matmul
from kvmesh.kernels.quant import TN, Q4_1Weight, Q8_0Weight, quantized_matmul

logger = logging.getLogger(__name__)


QUANTIZED_MAX_BATCH = 64
"""Decode steps of up to this many sequences use the block kernels. Measured on 2 cores of an Intel
Xeon (`python -m kvmesh.bench.quant --rows 16 32 64 128 256`): Q4_1 layers 2.3x the speed of
torch's fp32 GEMM (MKL) at 16 rows, 1.4x at 32, 1.0x at 64, 0.73x at 128; the Q8_0 lm_head 1.7-2.1x
at 16, 1.1x at 64. (AMD EPYC, before the register-blocked rows: 2.8x at 16, 1.6x at 64.)"""
AMX_BF16_MAX_BATCH = 24
"""In bf16 on a CPU whose bf16 GEMMs torch runs on AMX tiles (Intel Xeon from Sapphire Rapids on:
`amx_bf16`), decode steps of more than this many sequences run the dense bf16 GEMMs instead.
Measured on 2 cores of such a Xeon (`python -P -m kvmesh.bench.decode_paths`, 2026-12-07): the
dense steps 0.73x the block kernels' speed at 16 sequences, 0.94x at 24, 1.09x at 32, 1.33x at
48, 1.53x at 64 (0.16x at 1). With `--quantization int8` the layers run from the blocks
whatever the rows, so there the bound stays QUANTIZED_MAX_BATCH."""


def block_rows_bound(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The most sequences a decode step in `dtype` on `device` computes from the GGUF blocks:
    AMX_BF16_MAX_BATCH in bf16 on a CPU with AMX tiles, else QUANTIZED_MAX_BATCH."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and _amx_tiles():
        return AMX_BF16_MAX_BATCH
    return QUANTIZED_MAX_BATCH


def _amx_tiles() -> bool:
    """Whether torch runs matmuls on AMX tiles on this CPU (its own check: CPU flags and the OS's leave)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def _mm(
    x: torch.Tensor, w: torch.Tensor, q: Q4_1Weight | Q8_0Weight | None, dnn: torch.Tensor | None, a8: bool = False
) -> torch.Tensor:
    """x [T, in] @ w [in, out], from the blocks q [out, in] when given (x's rows as int8 blocks
    when a8), else through the copy dnn when given (`kvmesh.kernels.dense.dense_matmul`)."""
    if q is None:
        return dense_matmul(x, w, dnn)
    return quantized_matmul(x.float(), q, a8).to(x.dtype)  # the block kernels compute in fp32


def _numba_view(pages: torch.Tensor) -> np.ndarray:
    """The pages as numba reads them: fp32 as they are, bf16 as their bits (uint16; no copy)."""
    return pages.view(torch.uint16).numpy() if pages.dtype == torch.bfloat16 else pages.numpy()


def _lm_head(h: torch.Tensor, w: torch.Tensor, q: Q4_1Weight | Q8_0Weight | None) -> torch.Tensor:
    """Logits [B, V] fp32 of h [B, H]: h @ w.T for w [V, H], from the blocks q [V, H] when given."""
    return F.linear(h, w).float() if q is None else quantized_matmul(h, q)


class LlamaModel:
    """Llama weights plus the forward pass; holds no KV, which `LlamaRunner` (engine/llama/runner.py) owns."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        blocks: dict[str, GGUFBlocks] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Take transformers-named tensors (`model.layers.{i}.self_attn.q_proj.weight`, ...),
        converted to `dtype` on `device` as they are taken.

        `blocks` are GGUF blocks of some of those weights (`kvmesh.engine.gguf_blocks.load_blocks`),
        used for CPU decode steps (ignored on another device): in bf16 too, where a step computes
        in fp32 from the file's 4- and 8-bit blocks and reads and writes bf16 pages. Raises
        ValueError when a tensor is missing, has the wrong shape, or is left over (e.g. a bias
        this model does not have).
        """
        device = torch.device(device)
        blocks = blocks if device.type == "cpu" else None
        self.config = c = config
        self.dtype = dtype
        self.max_block_rows = block_rows_bound(dtype, device)
        """Decode steps of up to this many sequences compute from the blocks (`block_rows_bound`)."""
        take = TensorTaker(c.name, weights, dtype, device)
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))  # [V, H]
        self.layers = [take_layer(take, c, f"model.layers.{i}.", blocks) for i in range(c.num_layers)]
        self.norm = take("model.norm.weight", (c.hidden_size,))
        self._take_lm_head(take, blocks)
        take.check_all_taken()
        self.step_cycles = np.zeros(0, np.int64)
        """A profiling hook: set it to zeros(len(llama_step.STEP_PARTS)) and each fused decode step adds its
        parts' cycles (`llama_step.read_cycles`) to it; empty (the default), nothing is counted."""
        self._step = self._stack_for_step()

    def _take_lm_head(self, take: TensorTaker, blocks: dict[str, GGUFBlocks] | None) -> None:
        """The lm_head [V, H]: the embedding itself when tied, and its GGUF blocks if any."""
        c = self.config
        if c.tie_word_embeddings:
            take.drop("lm_head.weight")  # some exports store the tied copy too
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))  # [V, H]
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self.q_lm_head = pack_blocks(blocks, [head]) if blocks else None

    def _stack_for_step(self) -> StepWeights | None:
        """`decode_step`'s weights, the same from step to step: the norms, and the layers' Q4_1
        blocks stacked [L, ...] (the layers keep views of them: nothing is stored twice); None
        unless every layer has Q4_1 blocks and the lm_head Q8_0 ones."""
        names = ("q_qkv", "q_o", "q_gate_up", "q_down")
        if (
            self.config.intermediate_size % TN
            or not isinstance(self.q_lm_head, Q8_0Weight)
            or not all(isinstance(getattr(w, n), Q4_1Weight) for w in self.layers for n in names)
        ):
            return None
        stacked = {
            n: tuple(np.stack([getattr(getattr(w, n), a) for w in self.layers]) for a in ("qs", "d", "m"))
            for n in names
        }
        self.layers = [
            replace(
                w,
                **{
                    n: replace(getattr(w, n), qs=stacked[n][0][i], d=stacked[n][1][i], m=stacked[n][2][i])
                    for n in names
                },
            )
            for i, w in enumerate(self.layers)
        ]
        norms = [torch.stack([w.input_norm, w.post_norm]) for w in self.layers] + [torch.stack([self.norm, self.norm])]
        norms = [n.float() for n in norms]  # a bf16 model's are exact in fp32
        c = self.config
        return StepWeights(
            norms=torch.stack(norms).numpy(),  # [L + 1, 2, H]
            eps=c.rms_norm_eps,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            intermediate=c.intermediate_size,
            qkv=stacked["q_qkv"],
            o=stacked["q_o"],
            gate_up=stacked["q_gate_up"],
            down=stacked["q_down"],
            head=(self.q_lm_head.q, self.q_lm_head.d),
            int8_activations=False,
        )

    def use_int8_activations(self) -> None:
        """Let every forward (prefill, decode steps, verification, prompt logprobs) take the layers'
        matmul inputs as int8 blocks against the Q4_1 weights (W4A8, `kvmesh.kernels.quant_a8`:
        `--quantization int8`); the lm_head, attention and the rest keep their precision. Raises
        ValueError where the layers have no Q4_1 blocks (another device, or no GGUF file)."""
        if self._step is None:
            raise ValueError(
                "--quantization int8 needs the layers' Q4_1 blocks from a GGUF file on the CPU; this model has none here"
            )
        self._step = self._step._replace(int8_activations=True)

    @property
    def int8_activations(self) -> bool:
        """`use_int8_activations` was called: the layers' matmuls take int8 activations."""
        return self._step is not None and self._step.int8_activations

    def _decode_fused(
        self, input_ids: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor, g: DecodeGroup, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """A decode step of B sequences as one numba call (`llama_step.decode_step`): logits [B, V] fp32."""
        assert self._step is not None
        _, L, _, S, K, D = kv_cache.shape
        B = input_ids.shape[0]
        M = g.read_blocks.shape[-1] // B  # pages of the longest context
        # each context's length: the keys its mask lets through (all M*S of them without a mask)
        lens = torch.full((B,), M * S) if g.mask is None else g.mask.view(B, M * S).sum(1)  # [B] int64
        logits = torch.empty(B, self._step.head[0].shape[0] * TN)  # [B, V padded to tiles]
        batch = StepBatch(
            h=self.embed.index_select(0, input_ids).float().numpy(),  # [B, H] fp32, the residual stream (a copy)
            lens=lens.numpy(),
            cos=cos.view(B, D).float().numpy(),  # a bf16 model's rows, exact in fp32
            sin_rot=sin_rot.view(B, D).float().numpy(),
            blocks=g.read_blocks.view(L, 2, B, M).numpy(),
            kv=_numba_view(kv_cache).reshape(-1, S, K, D),
            logits=logits.numpy(),
            cycles=self.step_cycles,
        )
        decode_step(batch, self._step)
        return logits[:, : self.config.vocab_size]

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin_rot: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run all layers over a flat batch of new tokens; return fp32 logits of chosen rows.

        input_ids [T] int64; cos, sin_rot [T, 1, D] RoPE rows at each token's position
        (`kernels.rope_table`); meta from `kernels.build_attention_metadata`; kv_cache
        [P, L, 2, S, K, D], `kvmesh.engine.kv_layout.LLAMA_PAGE` (written in place); logits_index [B] int64 rows of T to
        compute logits for, or None for all rows. Returns [B, V] fp32.
        """
        c = self.config
        T = input_ids.shape[0]
        # a decode step: every sequence brings one token, so no logits_index picks rows
        a8 = self.int8_activations  # every row through the W4A8 tiles, prefill's too
        use_blocks = logits_index is None and T <= (QUANTIZED_MAX_BATCH if a8 else self.max_block_rows)
        layer_blocks = use_blocks or a8
        g = meta.decode
        if use_blocks and self._step is not None and g is not None and g.token_index is None:
            # every sequence brings one token: the whole step in one numba call, no torch op per layer
            return self._decode_fused(input_ids, cos, sin_rot, g, kv_cache)
        nq, nk, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qk_width = (nq + nk) * D
        h = F.embedding(input_ids, self.embed)  # [T, H], the residual stream
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, eps)  # [T, H]
            qkv = _mm(x, w.w_qkv, w.q_qkv if layer_blocks else None, w.dnn[0], a8)  # [T, (Q + 2K) * D]
            qk = apply_rotary(qkv[:, :qk_width].view(T, nq + nk, D), cos, sin_rot)  # [T, Q+K, D]
            v = qkv[:, qk_width:].view(T, nk, D)  # [T, K, D]
            attn = paged_attention(qk[:, :nq], qk[:, nq:], v, kv_cache, i, meta)  # [T, Q*D]
            # a separate add, not addmm: with residual values near 2e4 in some rows, fusing
            # the add into the GEMM changes rounding enough to break parity with transformers
            h = h + _mm(attn, w.w_o, w.q_o if layer_blocks else None, w.dnn[1], a8)
            x = rms_norm(h, w.post_norm, eps)
            gate_up = _mm(x, w.w_gate_up, w.q_gate_up if layer_blocks else None, w.dnn[2], a8)  # [T, 2I]
            h = h + _mm(silu_and_mul(gate_up), w.w_down, w.q_down if layer_blocks else None, w.dnn[3], a8)
        if logits_index is not None:
            h = h.index_select(0, logits_index)  # [B, H]
        h = rms_norm(h, self.norm, eps)
        return _lm_head(h, self.lm_head, self.q_lm_head if use_blocks else None)  # [B, V] fp32
