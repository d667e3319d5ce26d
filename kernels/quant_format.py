# N=output features, K=input features, G=K/32 blocks of a row, NT=N/TN tiles of TN output features
"""GGUF's Q4_1 and Q8_0 blocks as the block kernels read them: the packed weight types and the
tile-major layout `pack_q4_1` / `pack_q8_0` build (numpy only; the kernels are in
`kvmesh.kernels.quant_tiles`, the entry point `kvmesh.kernels.quant.quantized_matmul`).

The weights are the file's exactly: Q4_1 holds w = d*q + m for each block of 32 inputs
(q in 0..15, d and m fp16), Q8_0 holds w = d*q (q in -128..127). Each weight is laid out
tile-major, `[NT, K(/2), TN]`, so a tile's bytes stream in order and the kernels' innermost loop
runs over TN independent outputs. QK and TN are compiled into the cached kernels, so this file
is part of their cache key (`kvmesh.kernels.numba_cache.NUMBA_INLINED`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32
"""Inputs per GGUF block (Q4_1 and Q8_0)."""
TN = 64
"""Output features per tile: a tile's accumulators (64 fp32 a row, 4 AVX-512 registers) stay in
L1, and 64 divides every N of SmolLM2 (576, 960, 3072, 49152); other N are zero-padded."""


@dataclass(frozen=True)
class Q4_1Weight:
    """A Linear's Q4_1 weight in kernel layout: w[n, k] = d[n, k//32] * q[n, k] + m[n, k//32].

    qs [NT, K/2, TN] uint8: q of inputs 2j (low nibble) and 2j+1 (high nibble) of each output;
    d, m [NT, G, TN] fp32 (fp16 values, widened exactly). Rows past `out_features` are zero.
    """

    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray
    out_features: int
    in_features: int


@dataclass(frozen=True)
class Q8_0Weight:
    """A Linear's Q8_0 weight in kernel layout: w[n, k] = d[n, k//32] * q[n, k].

    q [NT, K, TN] int8; d [NT, G, TN] fp32 (fp16 values, widened exactly).
    """

    q: np.ndarray
    d: np.ndarray
    out_features: int
    in_features: int


def _tiles(rows: np.ndarray) -> np.ndarray:
    """[N, X] -> [NT, X, TN], zero-padding N up to a multiple of TN."""
    n = rows.shape[0]
    pad = -n % TN
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, *rows.shape[1:]), rows.dtype)])
    return np.ascontiguousarray(rows.reshape(-1, TN, rows.shape[1]).transpose(0, 2, 1))


def _check_blocks(q: np.ndarray, scales: list[np.ndarray], per_byte: int) -> tuple[int, int]:
    if q.ndim != 2 or any(s.ndim != 2 or s.shape[0] != q.shape[0] for s in scales):
        raise ValueError(
            f"expected 2-D q and scales with one row per output, got {q.shape}, {[s.shape for s in scales]}"
        )
    n, k = q.shape[0], q.shape[1] * per_byte
    if k % QK or any(s.shape[1] != k // QK for s in scales):
        raise ValueError(f"{k} inputs need {k // QK} blocks of {QK} a row, scales have {[s.shape[1] for s in scales]}")
    return n, k


def pack_q4_1(qs: np.ndarray, d: np.ndarray, m: np.ndarray) -> Q4_1Weight:
    """Lay out Q4_1 blocks for `quantized_matmul`.

    qs [N, K/2] uint8 with q[n, 2j] in the low and q[n, 2j+1] in the high nibble of qs[n, j];
    d, m [N, K/32] fp16 or fp32. Raises ValueError when the shapes disagree or K % 32 != 0.
    """
    n, k = _check_blocks(qs, [d, m], 2)
    return Q4_1Weight(_tiles(qs.astype(np.uint8)), _tiles(d.astype(np.float32)), _tiles(m.astype(np.float32)), n, k)


def pack_q8_0(q: np.ndarray, d: np.ndarray) -> Q8_0Weight:
    """Lay out Q8_0 blocks for `quantized_matmul`: q [N, K] int8, d [N, K/32] fp16 or fp32.

    Raises ValueError when the shapes disagree or K % 32 != 0.
    """
    n, k = _check_blocks(q, [d], 1)
    return Q8_0Weight(_tiles(q.astype(np.int8)), _tiles(d.astype(np.float32)), n, k)
