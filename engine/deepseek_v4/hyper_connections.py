# T=tokens (or B=sequences), N=hc_mult streams, H=hidden
"""Manifold-constrained hyper-connections (DeepSeek-V4 paper §2.2): the residual stream is N
streams; before each sublayer `hc_pre` collapses them into the sublayer's input and derives the
mixing (Sinkhorn-Knopp, so the stream mix stays doubly stochastic), after it `hc_post` writes the
output back into the mixed streams; `hc_head` collapses them before the final norm.

Number for number transformers' `DeepseekV4HyperConnection` and `DeepseekV4HyperHead`, with the
weights under prefix p (`model.layers.3.attn_hc`: `.fn`, `.base`, `.scale`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.deepseek_v4.ops import rms_norm


def hc_pre(
    streams: torch.Tensor, w: dict[str, torch.Tensor], p: str, config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`DeepseekV4HyperConnection`: streams [T, N, H] -> post [T, N], comb [T, N, N], collapsed [T, H]."""
    N, eps = config.hc_mult, config.hc_eps
    flat = rms_norm(streams.flatten(1), None, config.rms_norm_eps)
    mixes = F.linear(flat, w[p + ".fn"])  # [T, (2+N)N]
    pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = w[p + ".base"].split([N, N, N * N])
    s_pre, s_post, s_comb = w[p + ".scale"].unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(-1, N, N) * s_comb + comb_b.view(N, N), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):  # Sinkhorn-Knopp
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1)
    return post, comb, collapsed


def hc_post(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The sublayer's output out [T, H] written into the mixed streams [T, N, H] -> [T, N, H]."""
    return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, config) -> torch.Tensor:
    """`DeepseekV4HyperHead`'s collapse: streams [B, N, H] -> [B, H] (before the final norm)."""
    flat = rms_norm(streams.flatten(1), None, config.rms_norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + config.hc_eps  # [B, N]
    return (pre.unsqueeze(-1) * streams).sum(dim=1)
