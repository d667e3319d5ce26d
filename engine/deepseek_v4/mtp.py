# R=MTP rows (one token each, all sequences), N=hc_mult streams, H=hidden, V=vocab, Hq=query
# heads, D=head_dim, W=sliding window, P=pages, S=page_size, g=o_groups
"""DeepSeek-V4's multi-token-prediction (MTP) module as a drafter for speculative decoding.

The module follows DeepSeek-V4's inference/model.py (`MTPBlock`, the same composition as
DeepSeek-V3's MTP module, paper arXiv:2412.19437 §2.2 "Multi-Token Prediction"): for the pair
(h_i, t_{i+1}) of the target's hyper-connection streams after token i and the next token,

    e = enorm(embed(t_{i+1}))                      [H]      embed: the target's, shared
    x = e_proj(e)[None] + h_proj(hnorm(h_i))       [N, H]   hnorm per stream
    x = Block(x)                                   [N, H]   one block of the model's own kind
    logits = head(x; hc_head_fn/base/scale, norm)  [V]      lm_head: the target's, shared

which predicts t_{i+2}. V3 writes the projection as eh_proj over the concatenation
[enorm(e); hnorm(h)] ([H, 2H]); V4 splits it into e_proj and h_proj ([H, H] each, summed), the
same map; V4's tensors are named `mtp.0.enorm.weight`, `mtp.0.e_proj.weight`, ...,
`mtp.0.hc_head_fn`, and its block's as a layer's (`mtp.0.attn.wq_a.weight`,
`mtp.0.ffn.experts.3.w1.weight`, `mtp.0.hc_attn_fn`). The block's attention is sliding-window
only (the MTP layer's compress ratio is 0 in the released configs; transformers' config drops
that entry) and its MoE is top-k routed (the MTP layer id is past the hash-routed layers).

Drafting k tokens runs the module k times, autoregressively, as SGLang and vLLM do with one MTP
layer: the first pass takes the target's streams, each later one the module's own output
streams and the draft it just made. The module's sliding-window K=V lives in decode-only pages
`[P, S, D]` indexed like the target's (the sequence's block table, by position). Its window for
a sequence starts where decode started drafting for it (`DraftItem.window_start`): the prompt's
positions have no MTP K=V (prefill runs no MTP), so drafts right after the prompt see less
context than DeepSeek's, which changes only how often they are accepted, never the output.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvmesh.engine.deepseek_v4.attention import grouped_o_a, output_projection, query_and_kv
from kvmesh.engine.deepseek_v4.hyper_connections import hc_post, hc_pre
from kvmesh.engine.deepseek_v4.model import DeepseekV4Model
from kvmesh.engine.deepseek_v4.ops import rms_norm
from kvmesh.engine.deepseek_v4.shapes import MTP_PREFIX
from kvmesh.engine.forward import DraftItem
from kvmesh.kernels.ops import to_device
from kvmesh.kernels.sparse_attention import sparse_sink_attention


class DeepseekV4MTP:
    """The MTP module over the target model's weights (`model.w` holds the `mtp.0.*` tensors)."""

    def __init__(self, model: DeepseekV4Model, num_pages: int) -> None:
        """Raises ValueError when the model was loaded without MTP tensors."""
        c = model.config
        if MTP_PREFIX + "e_proj.weight" not in model.w:
            raise ValueError("the checkpoint has no multi-token-prediction module (mtp.0.* tensors)")
        self.model, self.config = model, c
        self.o_a = grouped_o_a(model.w, MTP_PREFIX + "self_attn.", c)
        # [P, S, D] the module's K=V
        self.kv = torch.zeros(num_pages, model.layout.page_size, c.head_dim, device=model.device)

    @torch.inference_mode()
    def forward(
        self,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        tables: Sequence[torch.Tensor],
        window_start: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over R rows: row r is the pair (hidden[r], tokens[r]) at positions[r] of the
        sequence whose block table is tables[r] (int64 page ids), its window starting at
        window_start[r]. Rows of one sequence at consecutive positions attend to each other (every
        row's K=V is written before any row attends). Returns fp32 logits [R, V] (each row's
        prediction of the token after tokens[r]) and the output streams [R, N, H]."""
        m, w, eps = self.model, self.model.w, self.model.eps
        p = MTP_PREFIX
        e = rms_norm(F.embedding(tokens, w["model.embed_tokens.weight"]), w[p + "enorm.weight"], eps)  # [R, H]
        x = rms_norm(hidden, w[p + "hnorm.weight"], eps)  # [R, N, H]
        streams = F.linear(e, w[p + "e_proj.weight"]).unsqueeze(1) + F.linear(x, w[p + "h_proj.weight"])
        post, comb, collapsed = hc_pre(streams, w, p + "attn_hc", self.config)
        a = self._attention(rms_norm(collapsed, w[p + "input_layernorm.weight"], eps), positions, tables, window_start)
        streams = hc_post(post, comb, a, streams)
        post, comb, collapsed = hc_pre(streams, w, p + "ffn_hc", self.config)
        f, _ = m.moe(rms_norm(collapsed, w[p + "post_attention_layernorm.weight"], eps), tokens, p + "mlp.", False)
        streams = hc_post(post, comb, f, streams)  # [R, N, H]
        logits = m.head(streams, p + "hc_head_fn", p + "hc_head_scale", p + "hc_head_base", p + "norm.weight")
        return logits, streams

    def _attention(
        self, x: torch.Tensor, positions: torch.Tensor, tables: Sequence[torch.Tensor], window_start: torch.Tensor
    ) -> torch.Tensor:
        """The block's sliding-window attention (`DeepseekV4Attention`, compress ratio 0): x [R, H] -> [R, H]."""
        c, w = self.config, self.model.w
        p = MTP_PREFIX + "self_attn."
        R, W, S = x.shape[0], c.sliding_window, self.kv.shape[1]
        cos, sin = self.model.rope["main"](positions)
        _, q, kv = query_and_kv(w, p, x, cos, sin, c)  # q [R, Hq, D], kv [R, D]
        width = max(len(t) for t in tables)
        padded = torch.stack([torch.cat([t, t[:1].expand(width - len(t))]) for t in tables])  # [R, M]
        self.kv[padded[torch.arange(R, device=kv.device), positions // S], positions % S] = kv
        wpos = positions[:, None] + torch.arange(-W + 1, 1, device=kv.device)  # [R, W] window positions, oldest first
        wc = wpos.clamp(min=0)
        win_kv = self.kv[padded.gather(1, wc // S), wc % S]  # [R, W, D]
        bias = torch.zeros(R, W, device=kv.device).masked_fill_(
            wpos < window_start[:, None].clamp(min=0), float("-inf")
        )
        out = sparse_sink_attention(q, win_kv, bias, None, None, w[p + "sinks"], c.head_dim**-0.5)
        return output_projection(out, cos, sin, self.o_a, w[p + "o_b_proj.weight"], c.o_groups)  # [R, H]

    def propose(self, items: Sequence[DraftItem]) -> list[list[int]]:
        """Up to items[b].k greedy drafts per sequence (the module's argmax, first index on ties).

        The first pass runs every pending pair of every sequence (the positions the target
        computed since its last pass, with the target's streams, so the module's K=V there is
        what a run over the final sequence holds); each later pass one row per sequence still
        drafting, at the next position, from the previous pass's streams and draft. Raises
        ValueError for an item with no pending pair or k < 1.
        """
        for b, it in enumerate(items):
            if len(it.tokens) < 1 or it.hidden.shape[0] != len(it.tokens) or it.k < 1:
                raise ValueError(
                    f"draft item {b}: needs k >= 1 and one hidden state a pending token, "
                    f"got k={it.k}, {len(it.tokens)} tokens, hidden {tuple(it.hidden.shape)}"
                )
        dev = self.model.device

        def on(values: list[int]) -> torch.Tensor:  # host ints to the device, no sync
            return to_device(torch.tensor(values), dev)

        tables = [on(list(it.block_ids)) for it in items]
        rows = [(b, it.first_position + j, t) for b, it in enumerate(items) for j, t in enumerate(it.tokens)]
        logits, streams = self.forward(
            on([r[1] for r in rows]),
            on([r[2] for r in rows]),
            torch.cat([it.hidden for it in items]),
            [tables[r[0]] for r in rows],
            on([items[r[0]].window_start for r in rows]),
        )
        last = on(list(itertools.accumulate(len(it.tokens) for it in items))) - 1  # [B] each item's last row
        # each pass's drafts cross to the host: what speculation needs (the next pass's input ids)
        drafts: list[list[int]] = [[t] for t in logits[last].argmax(dim=-1).cpu().tolist()]
        prev = streams[last]  # [B, N, H]
        live = list(range(len(items)))
        for j in range(1, max(it.k for it in items)):
            keep = [i for i, b in enumerate(live) if items[b].k > j]
            if not keep:
                break
            live, prev = [live[i] for i in keep], prev[on(keep)]
            logits, prev = self.forward(
                on([items[b].first_position + len(items[b].tokens) - 1 + j for b in live]),
                on([drafts[b][-1] for b in live]),
                prev,
                [tables[b] for b in live],
                on([items[b].window_start for b in live]),
            )
            for b, t in zip(live, logits.argmax(dim=-1).cpu().tolist()):
                drafts[b].append(t)
        return drafts
