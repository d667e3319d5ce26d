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
- logits only for the rows asked for (the last new token of each sequence);
- a decode step (one new token a sequence) of up to `QUANTIZED_MAX_BATCH` sequences
  multiplies straight from the GGUF file's Q4_1 / Q8_0 blocks when the checkpoint has them
  (`kernels.quant`), reading 5x fewer weight bytes than fp32. Prefill keeps the fp32 weights:
  a prompt's first positions carry residuals near 2e4, where the kernels' per-block sums
  round up to 1.5e-4 away from transformers' logits, past the 1e-4 the parity tests hold;
- a decode step of one sequence (batch-1 decode, single-stream serving) runs as one numba call,
  `_decode_step`: every layer and the lm_head from the blocks, with RMSNorm, RoPE, the K/V
  write, attention and SiLU*up in the same call, so no torch op runs per layer. Measured on 2
  busy-shared cores (`engine.profile_decode`): as torch ops around the block kernels the step
  spent 6.3 ms a token outside the matmuls (RMSNorm alone 2.0 ms, ~16 us a torch op on a
  [1, H] tensor); fused, 1.5 ms. Its matmuls are the block kernels' tiles
  (`kernels.quant.q4_1_tile`), bit for bit; the rest rounds within an ulp or two of the torch
  ops (sums in another order), well inside the parity bound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numba
import numpy as np
import torch
import torch.nn.functional as F
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from engine.config import ModelConfig
from engine.gguf_blocks import GGUFBlocks
from kernels import AttentionMetadata, apply_rotary, paged_attention, rms_norm, silu_and_mul
from kernels.quant import (
    TN,
    Q4_1Weight,
    Q8_0Weight,
    block_sums,
    pack_q4_1,
    pack_q8_0,
    q4_1_tile,
    q8_0_tile,
    quantized_matmul,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [H, (Q + 2K) * D], input-major
    w_o: torch.Tensor  # [Q * D, H]
    post_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [H, 2I]
    w_down: torch.Tensor  # [I, H]
    # the same weights as GGUF blocks, output-major like the file ([N, K]); None: fp32 only
    q_qkv: Q4_1Weight | Q8_0Weight | None = None
    q_o: Q4_1Weight | Q8_0Weight | None = None
    q_gate_up: Q4_1Weight | Q8_0Weight | None = None
    q_down: Q4_1Weight | Q8_0Weight | None = None


QUANTIZED_MAX_BATCH = 64
"""Decode steps of up to this many sequences use the block kernels. Measured on 2 cores (`python -m
kernels.bench_quant --rows 16 32 64 128 256`): Q4_1 layers 2.8x the fp32 GEMM's speed at 16
rows, 1.6x at 64, 1.3x at 128, 0.94x at 256; the Q8_0 lm_head 1.35x at 16, 1.1x at 64, 0.77x
at 128."""


def _pack(blocks: dict[str, GGUFBlocks], names: list[str]) -> Q4_1Weight | Q8_0Weight | None:
    """The named weights' blocks stacked along the output rows and packed; None unless all
    of them have blocks of one kind."""
    parts = [blocks[n] for n in names if n in blocks]
    if len(parts) != len(names) or len({p.kind for p in parts}) != 1:
        return None
    arrays = [np.concatenate(a) for a in zip(*(p.arrays for p in parts))]
    return pack_q4_1(*arrays) if parts[0].kind == "q4_1" else pack_q8_0(*arrays)


def _mm(x: torch.Tensor, w: torch.Tensor, q: Q4_1Weight | Q8_0Weight | None) -> torch.Tensor:
    """x [T, in] @ w [in, out], from the blocks q [out, in] when given."""
    return x @ w if q is None else quantized_matmul(x, q)


def _lm_head(h: torch.Tensor, w: torch.Tensor, q: Q4_1Weight | Q8_0Weight | None) -> torch.Tensor:
    """Logits [B, V] fp32 of h [B, H]: h @ w.T for w [V, H], from the blocks q [V, H] when given."""
    return F.linear(h, w).float() if q is None else quantized_matmul(h, q)


class LlamaModel:
    """Llama weights plus the forward pass; holds no KV, which `LlamaRunner` (engine/llama_runner.py) owns."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        blocks: dict[str, GGUFBlocks] | None = None,
    ) -> None:
        """Take transformers-named tensors (`model.layers.{i}.self_attn.q_proj.weight`, ...).

        `blocks` are GGUF blocks of some of those weights (`engine.gguf_blocks.load_blocks`),
        used for decode steps when dtype is fp32. Raises ValueError when a tensor is missing, has
        the wrong shape, or is left over (e.g. a bias this model does not have).
        """
        blocks = blocks if dtype == torch.float32 else None
        self.config = c = config
        self.dtype = dtype
        left = dict(weights)

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in left:
                raise ValueError(f"checkpoint of {c.name!r} lacks tensor {name!r}")
            t = left.pop(name)
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            return t.to(dtype)

        H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
        q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, H))  # [V, H]
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    input_norm=take(p + "input_layernorm.weight", (H,)),
                    w_qkv=torch.cat(
                        [
                            take(p + "self_attn.q_proj.weight", (q_out, H)),
                            take(p + "self_attn.k_proj.weight", (kv_out, H)),
                            take(p + "self_attn.v_proj.weight", (kv_out, H)),
                        ]
                    )
                    .t()
                    .contiguous(),
                    w_o=take(p + "self_attn.o_proj.weight", (H, q_out)).t().contiguous(),
                    post_norm=take(p + "post_attention_layernorm.weight", (H,)),
                    w_gate_up=torch.cat(
                        [take(p + "mlp.gate_proj.weight", (I, H)), take(p + "mlp.up_proj.weight", (I, H))]
                    )
                    .t()
                    .contiguous(),
                    w_down=take(p + "mlp.down_proj.weight", (H, I)).t().contiguous(),
                    **(
                        {}
                        if not blocks
                        else {
                            "q_qkv": _pack(blocks, [p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                            "q_o": _pack(blocks, [p + "self_attn.o_proj.weight"]),
                            "q_gate_up": _pack(blocks, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                            "q_down": _pack(blocks, [p + "mlp.down_proj.weight"]),
                        }
                    ),
                )
            )
        self.norm = take("model.norm.weight", (H,))
        if c.tie_word_embeddings:
            left.pop("lm_head.weight", None)  # some exports store the tied copy too
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", (c.vocab_size, H))  # [V, H]
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self.q_lm_head = _pack(blocks, [head]) if blocks else None
        unused = [n for n in left if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            raise ValueError(f"checkpoint of {c.name!r} has tensors this Llama does not use, e.g. {sorted(unused)[:3]}")
        self.step_cycles = np.zeros(0, np.int64)
        """A profiling hook: set it to zeros(len(STEP_PARTS)) and each fused decode step adds its
        parts' cycles (`read_cycles`) to it; empty (the default), nothing is counted."""
        self._step = self._stack_for_step()

    def _stack_for_step(self) -> tuple | None:
        """Arguments of `_decode_step` that stay the same from step to step: the norms, and the
        layers' Q4_1 blocks stacked [L, ...] (the layers keep views of them: nothing is stored
        twice); None unless every layer has Q4_1 blocks and the lm_head Q8_0 ones."""
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
        c = self.config
        return (
            torch.stack(norms).numpy(),  # [L + 1, 2, H]
            c.rms_norm_eps,
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
            *(stacked[n] for n in names),
            (self.q_lm_head.q, self.q_lm_head.d),
        )

    def _decode_one(
        self,
        token: int,
        cos: torch.Tensor,
        sin_rot: torch.Tensor,
        read_blocks: torch.Tensor,
        write_row: int,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """A batch-1 decode step as one numba call (`_decode_step`): logits [1, V] fp32."""
        assert self._step is not None
        _, _, _, S, K, D = kv_cache.shape
        pos = (read_blocks.shape[-1] - 1) * S + write_row % S  # one sequence: its last page is the token's
        h = self.embed[token].numpy().copy()  # [H], the residual stream
        logits = torch.empty(1, self._step[-1][0].shape[0] * TN)  # [1, V padded to tiles]
        _decode_step(  # type: ignore[call-arg]  # a numba dispatcher: mypy sees no signature
            h,
            pos,
            cos.view(-1).numpy(),
            sin_rot.view(-1).numpy(),
            read_blocks.numpy(),
            kv_cache.view(-1, S, K, D).numpy(),
            *self._step,
            logits.numpy()[0],
            self.step_cycles,
        )
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
        [P, L, 2, S, K, D] (written in place); logits_index [B] int64 rows of T to
        compute logits for, or None for all rows. Returns [B, V] fp32.
        """
        c = self.config
        T = input_ids.shape[0]
        # a decode step: every sequence brings one token, so no logits_index picks rows
        use_blocks = logits_index is None and T <= QUANTIZED_MAX_BATCH
        g = meta.decode
        if use_blocks and T == 1 and self._step is not None and g is not None and g.token_index is None:
            # one sequence, one token: the whole step in one numba call, no torch op per layer
            return self._decode_one(
                int(input_ids[0]), cos, sin_rot, g.read_blocks, int(meta.write_rows[0, 0, 0]), kv_cache
            )
        nq, nk, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qk_width = (nq + nk) * D
        h = F.embedding(input_ids, self.embed)  # [T, H], the residual stream
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, eps)  # [T, H]
            qkv = _mm(x, w.w_qkv, w.q_qkv if use_blocks else None)  # [T, (Q + 2K) * D]
            qk = apply_rotary(qkv[:, :qk_width].view(T, nq + nk, D), cos, sin_rot)  # [T, Q+K, D]
            v = qkv[:, qk_width:].view(T, nk, D)  # [T, K, D]
            attn = paged_attention(qk[:, :nq], qk[:, nq:], v, kv_cache, i, meta)  # [T, Q*D]
            # a separate add, not addmm: with residual values near 2e4 in some rows, fusing
            # the add into the GEMM changes rounding enough to break parity with transformers
            h = h + _mm(attn, w.w_o, w.q_o if use_blocks else None)
            x = rms_norm(h, w.post_norm, eps)
            gate_up = _mm(x, w.w_gate_up, w.q_gate_up if use_blocks else None)  # [T, 2I]
            h = h + _mm(silu_and_mul(gate_up), w.w_down, w.q_down if use_blocks else None)
        if logits_index is not None:
            h = h.index_select(0, logits_index)  # [B, H]
        h = rms_norm(h, self.norm, eps)
        return _lm_head(h, self.lm_head, self.q_lm_head if use_blocks else None)  # [B, V] fp32


# --- the fused batch-1 decode step -------------------------------------------------------------

STEP_PARTS = (
    "RMSNorm",
    "matmul q/k/v",
    "RoPE",
    "attention over pages",
    "matmul o",
    "matmul MLP gate/up",
    "matmul MLP down",
    "matmul lm_head",
)
"""The parts `_decode_step` counts cycles of, in the order of `LlamaModel.step_cycles`. The K/V
write counts with attention, each residual add with the matmul before it, and SiLU*up with
gate/up: each thread applies it to the gate and up tiles it just computed."""


@intrinsic
def _rdtsc(typingctx):
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter"
        )
        return builder.call(fn, [])

    return nbtypes.int64(), codegen


@numba.njit(nogil=True, cache=True)
def read_cycles() -> int:
    """The CPU's time-stamp counter (cycles), which the step's profiling counts in."""
    return _rdtsc()  # type: ignore[call-arg]  # an intrinsic: numba supplies typingctx


@numba.njit(nogil=True, cache=True, inline="always")
def _lap(cycles, part, start):  # add the cycles since start to cycles[part] when profiling
    if cycles.shape[0] == 0:
        return start
    now = _rdtsc()
    cycles[part] += now - start
    return now


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _rms_norm_into(h, w, eps, out):  # h, w, out [H]
    # transformers: fp32 squares, their mean (summed here in fp64), rsqrt, then w * (h * r)
    ss = 0.0
    for i in range(h.shape[0]):
        ss += np.float32(h[i] * h[i])
    r = np.float32(1) / np.sqrt(np.float32(np.float32(ss / h.shape[0]) + eps))
    for i in range(h.shape[0]):
        out[i] = w[i] * (h[i] * r)


# reassociation lets LLVM vectorize the dot products (a sequential sum is add-latency bound:
# 0.93 ms of a 7.8 ms step went to attention); the rounding stays within SDPA's own
@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _attend(q, kv, k_blocks, v_blocks, n_ctx, kh, scale, out):  # q [D], kv [P*L*2, S, K, D], out [D]
    # one query head over its kv head's n_ctx keys: softmax(q.k * scale) @ v, as SDPA
    S, D = kv.shape[1], q.shape[0]
    scores = np.empty(n_ctx, np.float32)
    top = np.float32(-np.inf)
    for p in range(n_ctx):
        key = kv[k_blocks[p // S], p % S, kh]
        s = np.float32(0)
        for i in range(D):
            s += q[i] * key[i]
        scores[p] = s * scale
        top = max(top, scores[p])
    acc = np.zeros(D, np.float32)
    total = np.float32(0)
    for p in range(n_ctx):
        e = np.exp(scores[p] - top)
        total += e
        val = kv[v_blocks[p // S], p % S, kh]
        for i in range(D):
            acc[i] += e * val[i]
    for i in range(D):
        out[i] = acc[i] / total


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _decode_step(
    h, pos, cos, sin_rot, blocks, kv, norms, eps, nq, nk, inter, qkv, o, gate_up, down, head, logits, cycles
):
    """One token through every layer and the lm_head, in place: the batch-1 decode step.

        h [H] the token's embedding row (becomes the last residual); pos its position; cos, sin_rot
        [D] its RoPE row; blocks [L, 2, M] its pages' K and V blocks in kv [P*L*2, S, K, D]
        (written at pos); norms [L + 1, 2, H] (input and post-attention norms, then the final norm
        twice); qkv, o, gate_up, down: (qs, d, m) of the layers' Q4_1 weights stacked [L, NT, ...]
    (gate_up's gate rows first, inter of them, a multiple of TN);
        head (q, d) of the Q8_0 lm_head; logits [NT*TN] out; cycles [len(STEP_PARTS)] int64
        accumulates each part's cycles, or is empty.
    """
    L, H, S, D = norms.shape[0] - 1, h.shape[0], kv.shape[1], kv.shape[3]
    x = np.empty(H, np.float32)
    y_qkv = np.empty(qkv[0].shape[1] * TN, np.float32)
    rot = np.empty((nq + nk, D), np.float32)
    attn = np.empty(nq * D, np.float32)
    y_o = np.empty(o[0].shape[1] * TN, np.float32)
    y_gu = np.empty(gate_up[0].shape[1] * TN, np.float32)
    act = np.empty(inter, np.float32)
    y_down = np.empty(down[0].shape[1] * TN, np.float32)
    page, slot, half, group = pos // S, pos % S, D // 2, nq // nk
    scale = np.float32(1 / np.sqrt(D))
    t = _rdtsc() if cycles.shape[0] else 0
    for li in range(L):
        _rms_norm_into(h, norms[li, 0], eps, x)
        t = _lap(cycles, 0, t)
        xs = block_sums(x)
        for tile in numba.prange(qkv[0].shape[1]):
            q4_1_tile(x, xs, qkv[0][li], qkv[1][li], qkv[2][li], tile, y_qkv)
        t = _lap(cycles, 1, t)
        for hd in range(nq + nk):  # x * cos + swap_halves(x) * sin_rot, as `apply_rotary`
            for i in range(D):
                rot[hd, i] = y_qkv[hd * D + i] * cos[i] + y_qkv[hd * D + (i + half) % D] * sin_rot[i]
        t = _lap(cycles, 2, t)
        kb, vb = blocks[li, 0, page], blocks[li, 1, page]
        for kh in range(nk):
            for i in range(D):
                kv[kb, slot, kh, i] = rot[nq + kh, i]
                kv[vb, slot, kh, i] = y_qkv[(nq + nk + kh) * D + i]
        for hq in numba.prange(nq):
            _attend(rot[hq], kv, blocks[li, 0], blocks[li, 1], pos + 1, hq // group, scale, attn[hq * D : (hq + 1) * D])
        t = _lap(cycles, 3, t)
        xs = block_sums(attn)
        for tile in numba.prange(o[0].shape[1]):
            q4_1_tile(attn, xs, o[0][li], o[1][li], o[2][li], tile, y_o)
        for i in range(H):
            h[i] = h[i] + y_o[i]
        t = _lap(cycles, 4, t)
        _rms_norm_into(h, norms[li, 1], eps, x)
        t = _lap(cycles, 0, t)
        xs = block_sums(x)
        for tile in numba.prange(inter // TN):  # a gate tile, its up tile, then silu(gate) * up
            q4_1_tile(x, xs, gate_up[0][li], gate_up[1][li], gate_up[2][li], tile, y_gu)
            q4_1_tile(x, xs, gate_up[0][li], gate_up[1][li], gate_up[2][li], tile + inter // TN, y_gu)
            for i in range(tile * TN, (tile + 1) * TN):  # as `silu_and_mul`
                g = y_gu[i]
                act[i] = g / (np.float32(1) + np.exp(-g)) * y_gu[inter + i]
        t = _lap(cycles, 5, t)
        xs = block_sums(act)
        for tile in numba.prange(down[0].shape[1]):
            q4_1_tile(act, xs, down[0][li], down[1][li], down[2][li], tile, y_down)
        for i in range(H):
            h[i] = h[i] + y_down[i]
        t = _lap(cycles, 6, t)
    _rms_norm_into(h, norms[L, 0], eps, x)
    t = _lap(cycles, 0, t)
    for tile in numba.prange(head[0].shape[0]):
        q8_0_tile(x, head[0], head[1], tile, logits)
    _lap(cycles, 7, t)
