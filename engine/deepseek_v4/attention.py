# T=tokens (new, all sequences), n=new tokens of one sequence, Bd=sequences with one new token
# (decode), H=hidden, Hq=query heads, D=head_dim, qr=q_lora_rank, g=o_groups, olr=o_lora_rank,
# W=sliding window, Ws=keys some new token's window holds, C=compressed entries (Cmax: padded
# to the most), k=index_topk, Hi/Di=indexer heads/head dim, r=compress rate, P=pages, S=page_size
"""DeepSeek-V4's attention over kvmesh's pages and slots, number for number transformers'
`DeepseekV4Attention` (paper §2.3), per `layer_types`:

- sliding window: every layer attends to the last W tokens' K=V (shared-KV MQA), partial
  interleaved RoPE ("main" rope for sliding layers, the YaRN "compress" rope elsewhere), a
  per-head sink, and a grouped low-rank output projection;
- compressed-sparse attention (CSA, rate 4): also to the top-k compressed entries the Lightning
  Indexer selects (kvmesh.engine.deepseek_v4.indexer);
- heavily-compressed attention (HCA, rate 128): also to every compressed entry.

Each new token's K=V is written to its page first, and every sequence's compressors run
(kvmesh.engine.deepseek_v4.compressor) before any query reads entries. The sequences with one
new token (decode) attend together, batched by the forward's plan; the others one at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.deepseek_v4.compressor import Compressors
from kvmesh.engine.deepseek_v4.indexer import indexer_queries, select_for_decode, select_for_sequence
from kvmesh.engine.deepseek_v4.ops import RopeTable, apply_rope, rms_norm
from kvmesh.engine.deepseek_v4.plan import ForwardPlan
from kvmesh.engine.deepseek_v4.state import CSA, SLIDING, V4StateLayout
from kvmesh.kernels.backend import KernelBackend
from kvmesh.kernels.sparse_attention import sparse_sink_attention


def query_and_kv(
    w: dict[str, torch.Tensor], p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention p's (`model.layers.3.self_attn.`) projections of x [T, H]: the query's low-rank
    q_res [T, qr], the rotated queries q [T, Hq, D] and the rotated shared K=V kv [T, D]."""
    T, nh, D, eps = x.shape[0], config.num_attention_heads, config.head_dim, config.rms_norm_eps
    q_res = rms_norm(F.linear(x, w[p + "q_a_proj.weight"]), w[p + "q_a_norm.weight"], eps)
    q = rms_norm(F.linear(q_res, w[p + "q_b_proj.weight"]).view(T, nh, D), None, eps)
    q = apply_rope(q, cos, sin)  # [T, Hq, D]
    kv = rms_norm(F.linear(x, w[p + "kv_proj.weight"]), w[p + "kv_norm.weight"], eps)
    kv = apply_rope(kv.unsqueeze(1), cos, sin).squeeze(1)  # [T, D]
    return q_res, q, kv


def grouped_o_a(w: dict[str, torch.Tensor], p: str, config) -> torch.Tensor:
    """Attention p's o_a_proj as [g, Hq*D/g, olr] for one bmm (`DeepseekV4GroupedLinear`)."""
    g, nh, D = config.o_groups, config.num_attention_heads, config.head_dim
    return w[p + "o_a_proj.weight"].view(g, -1, nh * D // g).transpose(1, 2).contiguous()


def output_projection(
    out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, o_a: torch.Tensor, o_b: torch.Tensor, groups: int
) -> torch.Tensor:
    """The heads' outputs out [T, Hq, D] -> [T, H]: the rope V carried undone, then the grouped
    low-rank projection (o_a from `grouped_o_a`, o_b the o_b_proj weight [H, g*olr])."""
    T = out.shape[0]
    out = apply_rope(out, cos, -sin)  # undo the rope V carried (K=V), at the query's position
    grouped = torch.bmm(out.view(T, groups, -1).transpose(0, 1), o_a).transpose(0, 1)  # [T, g, olr]
    return F.linear(grouped.flatten(1), o_b)  # [T, H]


class V4Attention:
    """Every layer's attention of one model: `attention(i, x, plan, pages, slots)`."""

    def __init__(
        self,
        config,
        layout: V4StateLayout,
        w: dict[str, torch.Tensor],
        rope: dict[str, RopeTable],
        kernels: KernelBackend,
        device: torch.device,
    ) -> None:
        self.config, self.layout, self.w, self.rope, self.kernels = config, layout, w, rope, kernels
        self.device = device
        self.compressors = Compressors(layout, w, rope["compress"], config.rms_norm_eps, device)
        self.o_a = [grouped_o_a(w, f"model.layers.{i}.self_attn.", config) for i in range(config.num_hidden_layers)]

    def __call__(
        self, i: int, x: torch.Tensor, plan: ForwardPlan, pages: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Layer i's attention of every new token: x [T, H] -> [T, H]; writes the tokens' K=V and
        compressed entries into pages [P, page_floats] and their open windows into slots."""
        c, p = self.config, f"model.layers.{i}.self_attn."
        kind = c.layer_types[i]
        cos, sin = self.rope["main" if kind == SLIDING else "compress"](plan.positions)
        q_res, q, kv = query_and_kv(self.w, p, x, cos, sin, c)
        swa = self.layout.page_view(pages, "swa", i)  # [P, S, D]
        swa[plan.write_page, plan.write_slot] = kv
        iq = iw = None
        if kind == CSA:
            iq, iw = indexer_queries(self.w, p, x, q_res, self.rope["compress"], plan.positions, c)
        if kind != SLIDING:  # extend every sequence's windows before anyone reads entries
            self.compressors.extend(i, x, plan, pages, slots)
        out = q.new_empty(q.shape)  # [T, Hq, D]
        if plan.dec:
            rows = plan.dec_rows
            dec_iq, dec_iw = (iq[rows], iw[rows]) if iq is not None and iw is not None else (None, None)
            out[rows] = self._decode(i, q[rows], dec_iq, dec_iw, plan, pages)
        for b, item in enumerate(plan.items):
            if len(item.token_ids) > 1:  # the one-token sequences are done above, batched
                lo, hi = plan.starts[b], plan.starts[b + 1]
                out[lo:hi] = self._sequence(i, b, q[lo:hi], iq, iw, plan, pages)
        return output_projection(out, cos, sin, self.o_a[i], self.w[p + "o_b_proj.weight"], c.o_groups)

    def _decode(
        self, i: int, q: torch.Tensor, iq: torch.Tensor | None, iw: torch.Tensor | None, plan: ForwardPlan, pages
    ) -> torch.Tensor:
        """Every one-new-token sequence at once: q [Bd, Hq, D] -> [Bd, Hq, D]; iq, iw the
        indexer's queries [Bd, Hi, Di] and weights [Bd, Hi] (CSA layers; None elsewhere)."""
        c, lay = self.config, self.layout
        kind, D = c.layer_types[i], c.head_dim
        win_kv = lay.page_view(pages, "swa", i)[plan.win_page, plan.win_slot]  # [Bd, W, D]
        ent_kv: torch.Tensor | None = None
        ent_bias: torch.Tensor | None = None
        if kind != SLIDING and plan.most_entries[lay.rates[i]]:
            pg, row, count = plan.entries[lay.rates[i]]
            ent_kv = lay.page_view(pages, "entries", i)[pg, row]  # [Bd, Cmax, D]
            if kind == CSA:
                assert iq is not None and iw is not None
                ikeys = lay.page_view(pages, "ikeys", i)[pg, row]  # [Bd, Cmax, Di]
                most = plan.most_entries[lay.rates[i]]
                top = select_for_decode(c, iq, ikeys, iw, count, most, plan)  # [Bd, k], -1 = none
                ent_kv = ent_kv.gather(1, top.clamp(min=0)[..., None].expand(-1, -1, D))  # [Bd, k, D]
                ent_bias = torch.zeros(top.shape, device=top.device).masked_fill_(top < 0, float("-inf"))
            else:  # HCA: every closed window
                valid = torch.arange(pg.shape[1], device=pg.device)[None, :] < count[:, None]  # [Bd, Cmax]
                ent_bias = torch.zeros(valid.shape, device=pg.device).masked_fill_(~valid, float("-inf"))
        sinks = self.w[f"model.layers.{i}.self_attn.sinks"]
        return sparse_sink_attention(q, win_kv, plan.win_bias, ent_kv, ent_bias, sinks, D**-0.5)

    def _sequence(
        self,
        i: int,
        b: int,
        q: torch.Tensor,
        iq: torch.Tensor | None,
        iw: torch.Tensor | None,
        plan: ForwardPlan,
        pages,
    ) -> torch.Tensor:
        """Sequence b's n new tokens (a prefill or a verification run): q [n, Hq, D] -> [n, Hq, D]."""
        c, D = self.config, self.config.head_dim
        win_kv, win_bias = self._window(i, b, plan, pages)
        ent_kv: torch.Tensor | None = None
        ent_bias: torch.Tensor | None = None
        if c.layer_types[i] != SLIDING:
            ent_kv, ent_bias = self._sequence_entries(i, b, iq, iw, plan, pages)
        sinks = self.w[f"model.layers.{i}.self_attn.sinks"]
        return sparse_sink_attention(q, win_kv, win_bias, ent_kv, ent_bias, sinks, D**-0.5)

    def _window(self, i: int, b: int, plan: ForwardPlan, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's queries' sliding windows: K=V [n, W, D] and bias [n, W] (0 / -inf)."""
        S, W, dev = self.layout.page_size, self.config.sliding_window, self.device
        lo, hi = plan.starts[b], plan.starts[b + 1]
        nc, n = plan.items[b].num_computed_tokens, hi - lo
        qpos = plan.positions[lo:hi]
        base = max(0, nc - W + 1)
        kpos = torch.arange(base, nc + n, device=dev)  # every key some new token's window holds
        table = plan.tables[b]
        win = self.layout.page_view(pages, "swa", i)[table[kpos // S], kpos % S]  # [Ws, D]
        wpos = qpos[:, None] + torch.arange(-W + 1, 1, device=dev)  # [n, W] window positions, oldest first
        win_kv = win[(wpos - base).clamp(min=0)]  # [n, W, D]
        return win_kv, torch.zeros(n, W, device=dev).masked_fill_(wpos < 0, float("-inf"))

    def _sequence_entries(
        self, i: int, b: int, iq: torch.Tensor | None, iw: torch.Tensor | None, plan: ForwardPlan, pages: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The compressed entries sequence b's queries attend to and their bias [n, k or C]
        (0 / -inf): CSA the indexer's top-k, HCA every closed window; (None, None) before the
        sequence's first window closes."""
        lay, dev = self.layout, self.device
        lo, hi = plan.starts[b], plan.starts[b + 1]
        r, n = lay.rates[i], hi - lo
        count = (plan.items[b].num_computed_tokens + n) // r
        if not count:
            return None, None
        num_valid = (plan.positions[lo:hi] + 1) // r  # [n] entries whose window has closed
        entries = self._entries("entries", i, plan.tables[b], count, pages)  # [C, D]
        if lay.layer_types[i] == CSA:
            assert iq is not None and iw is not None
            ikeys = self._entries("ikeys", i, plan.tables[b], count, pages)  # [C, Di]
            top = select_for_sequence(self.kernels, self.config, iq[lo:hi], ikeys, iw[lo:hi], num_valid, plan)
            return entries[top.clamp(min=0)], torch.zeros(top.shape, device=dev).masked_fill_(top < 0, float("-inf"))
        closed = torch.arange(count, device=dev)[None, :] >= num_valid[:, None]  # HCA: every closed window
        return entries, torch.zeros(n, count, device=dev).masked_fill_(closed, float("-inf"))

    def _entries(self, name: str, i: int, table: torch.Tensor, count: int, pages: torch.Tensor) -> torch.Tensor:
        """The first `count` entries of field `name` of layer i of the sequence whose block table
        is `table`: [count, d]."""
        per_page = self.layout.page_size // self.layout.rates[i]
        idx = torch.arange(count, device=self.device)
        return self.layout.page_view(pages, name, i)[table[idx // per_page], idx % per_page]
