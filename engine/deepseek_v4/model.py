# T=tokens (new, all sequences), n=new tokens of one sequence, B=sequences, H=hidden, N=hc_mult
# streams, V=vocab, Hq=query heads, D=head_dim, rd=rope dims, qr=q_lora_rank, g=o_groups,
# E=routed experts, K=experts per token, Hi/Di=indexer heads/head dim, r=compress rate,
# W=sliding window, C=compressed entries, P=pages, S=page_size
"""DeepSeek-V4 (DeepSeek-AI 2026) over kvmesh's paged state, number for number transformers'
`DeepseekV4ForCausalLM` (modeling_deepseek_v4.py, transformers 5.24).

- attention per `layer_types`: a sliding window of W K=V entries in every layer, plus
  compressed entries in CSA layers (rate 4, two overlapping series, Lightning Indexer top-k,
  paper §2.3.1) and HCA layers (rate 128, all entries, §2.3.2); shared-KV MQA, partial
  interleaved RoPE ("main" rope for sliding layers, the YaRN "compress" rope elsewhere), a
  per-head sink, grouped low-rank output projection;
- MLP per `mlp_layer_types`: hash-MoE (frozen token -> expert table, §2.1) or top-k MoE, plus
  the shared expert, with `swiglu_limit` clamping (kernels/moe);
- manifold-constrained hyper-connections: N residual streams, Sinkhorn-Knopp mixing (§2.2).

State lives in pages and per-request slots (engine/deepseek_v4/state.py). Matmuls run
over every sequence's new tokens at once; the compressors and attention run per sequence.
Token ties in the indexer's top-k go to the lower entry index (kernels/indexer).

Over 300 lines on purpose: it is one model matching transformers' number for number, read side
by side with modeling_deepseek_v4.py; split, a reader would lose that one-to-one view.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.deepseek_v4.state import CSA, SLIDING, V4StateLayout
from kvmesh.engine.deepseek_v4.weights import check_and_take
from kvmesh.engine.forward import ForwardItem
from kvmesh.kernels.backend import KernelBackend, create_kernel_backend
from kvmesh.kernels.indexer import indexer_topk
from kvmesh.kernels.moe import route_hash, route_topk
from kvmesh.kernels.ops import to_device
from kvmesh.kernels.sparse_attention import sparse_sink_attention

logger = logging.getLogger(__name__)


@dataclass
class _Plan:
    """Indices one forward's layers share: where each new token's K=V goes, and for the
    sequences with one new token (decode) their windows and compressed entries, batched."""

    tables: list[torch.Tensor]  # [pages of item b] int64: each item's block table, built once a forward
    write_page: torch.Tensor  # [T] page of each new token
    write_slot: torch.Tensor  # [T] its row in the page
    dec: list[int]  # items with exactly one new token
    dec_rows: torch.Tensor  # [Bd] their token rows
    win_page: torch.Tensor  # [Bd, W] page / row of each window key (clamped where before 0)
    win_slot: torch.Tensor
    win_bias: torch.Tensor  # [Bd, W] 0 / -inf
    entries: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """compress rate -> (page [Bd, Cmax], row [Bd, Cmax], count [Bd]) of each sequence's entries."""
    most_entries: dict[int, int]
    """compress rate -> the most entries a decode sequence has (a host value: no sync to branch on)."""


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 as `DeepseekV4RMSNorm` (weight) / `DeepseekV4UnweightedRMSNorm` (None)."""
    x = x.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else weight * x


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing rd channels: x [T, X, Dh], cos/sin [T, rd/2] -> [T, X, Dh]."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)  # [T, 1, rd]
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)  # rotate_half
    return torch.cat([nope, rope * cos + rotated * sin], dim=-1)


def _boundary_ties(scores: torch.Tensor, num_valid: torch.Tensor, k: int) -> int:
    """Queries whose k-th and (k+1)-th best selectable scores are equal: the tie-break decides
    their top-k set. scores [n, C], num_valid [n]. A test's counter (`count_topk_ties`, off by
    default): its int() is a host sync on a GPU."""
    entry = torch.arange(scores.shape[1], device=scores.device)
    masked = scores.masked_fill(entry[None, :] >= num_valid[:, None], float("-inf"))
    if masked.shape[1] <= k:
        return 0
    best = masked.topk(k + 1, dim=-1).values  # [n, k+1]
    return int(((best[:, k - 1] == best[:, k]) & (num_valid > k)).sum())


class _Rope:
    """cos/sin rows of one rope type at given positions (`DeepseekV4RotaryEmbedding`)."""

    def __init__(self, config, rope_type: str, device: torch.device) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = config.rope_parameters[rope_type]
        rd = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
        kind = params.get("rope_type", "default")
        if kind == "default":
            self.inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
            self.scaling = 1.0
        else:  # the table (e.g. YaRN's) is config arithmetic; transformers' is the reference
            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[kind](config, None, layer_type=rope_type)

        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rd/2]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling


class DeepseekV4Model:
    """DeepSeek-V4 weights and the batched forward over pages and slots; holds no state itself."""

    def __init__(
        self,
        config,
        tensors: dict[str, torch.Tensor],
        layout: V4StateLayout,
        name: str = "deepseek_v4",
        kernels: KernelBackend | None = None,
        routed_experts_here: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        """config: transformers `DeepseekV4Config`; tensors: the checkpoint's (either naming),
        moved to `device` (their dtype kept: the checkpoint's); kernels: the MoE and indexer
        kernels (default: the torch backend on the CPU, the custom ops on a GPU);
        routed_experts_here=False: `tensors` lack the main layers' routed experts, which an
        expert-parallel `routed_experts` hook holds instead (kvmesh.engine.ep.expert_weights).

        Raises ValueError naming a missing, misshapen or unused tensor, or an unknown layer type.
        """
        self.config = c = config
        self.layout = layout
        self.device = dev = torch.device(device)
        self.kernels = kernels or create_kernel_backend("torch", dev)
        self.w = {
            k: t.to(device=dev)
            for k, t in check_and_take(tensors, config, name, routed_experts=routed_experts_here).items()
        }
        self.eps, self.hc_eps = c.rms_norm_eps, c.hc_eps
        self.rope = {"main": _Rope(c, "main", dev), "compress": _Rope(c, "compress", dev)}
        self.count_topk_ties = False
        """When True, count in topk_boundary_ties the indexer queries whose top-k set a tie
        decided (tests turn it on to prove their comparisons tie-free; it costs a top-k a layer)."""
        self.topk_boundary_ties = 0
        self.last_streams = torch.zeros(0, c.hc_mult, c.hidden_size, device=dev)
        """[B, N, H] the hyper-connection streams after each item's last token in the last forward
        (what the head read): speculative decoding's MTP drafter continues from them."""
        self.expert_counts = torch.zeros(c.num_hidden_layers, c.n_routed_experts, dtype=torch.int64, device=dev)
        """Tokens routed to each expert of each MoE layer (top-k and hash-routed alike), since
        load; EPLB's input (kvmesh.engine.ep.eplb). A token with k experts counts once for each."""
        self.routed_experts: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
        self.routed_experts = self.local_experts
        """The routed experts of MoE layer i: (i, x [T, H], weights [T, K] fp32, expert_ids [T, K]
        int64) -> [T, H] in x.dtype. This process's kernels by default; expert-parallel decode
        (kvmesh.engine.ep.dispatch) puts its all-to-all dispatch and combine here."""
        g, nh, D = c.o_groups, c.num_attention_heads, c.head_dim
        # o_a_proj as [g, in_per_group, o_lora_rank] for one bmm (DeepseekV4GroupedLinear)
        self.o_a = [
            self.w[f"model.layers.{i}.self_attn.o_a_proj.weight"].view(g, -1, nh * D // g).transpose(1, 2).contiguous()
            for i in range(c.num_hidden_layers)
        ]

    # -- hyper-connections ------------------------------------------------------------------
    def _hc(self, streams: torch.Tensor, p: str):
        """`DeepseekV4HyperConnection`: streams [T, N, H] -> post [T, N], comb [T, N, N], collapsed [T, H]."""
        N, eps = self.config.hc_mult, self.hc_eps
        flat = _rms(streams.flatten(1), None, self.eps)
        mixes = F.linear(flat, self.w[p + ".fn"])  # [T, (2+N)N]
        pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.w[p + ".base"].split([N, N, N * N])
        s_pre, s_post, s_comb = self.w[p + ".scale"].unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, N, N) * s_comb + comb_b.view(N, N), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.config.hc_sinkhorn_iters - 1):  # Sinkhorn-Knopp
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1)
        return post, comb, collapsed

    @staticmethod
    def _mix(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)

    # -- MLP --------------------------------------------------------------------------------
    def _mlp(self, x: torch.Tensor, ids: torch.Tensor, i: int) -> torch.Tensor:
        out, experts = self.moe(x, ids, f"model.layers.{i}.mlp.", self.config.mlp_layer_types[i] == "hash_moe", layer=i)
        flat = experts.reshape(-1)  # an index_add, not bincount: bincount on a GPU reads its max back
        self.expert_counts[i].index_add_(0, flat, torch.ones_like(flat))
        return out

    def moe(
        self, x: torch.Tensor, ids: torch.Tensor, p: str, hash_routed: bool, layer: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`DeepseekV4MoE` under prefix p (`model.layers.3.mlp.`): x [T, H], ids [T] -> [T, H]
        and the routed experts [T, K]. A main-model layer's routed experts go through
        `routed_experts(layer, ...)` (expert parallelism may place them on other ranks); the MTP
        block's (layer None) run here."""
        c = self.config
        logits = F.linear(x, self.w[p + "gate.weight"])  # [T, E]
        if hash_routed:
            weights, experts = route_hash(
                logits, c.scoring_func, self.w[p + "gate.tid2eid"], ids, c.routed_scaling_factor
            )
        else:
            weights, experts = route_topk(
                logits,
                c.scoring_func,
                c.num_experts_per_tok,
                self.w[p + "gate.e_score_correction_bias"],
                c.routed_scaling_factor,
            )
        routed = (
            self.kernels.moe_experts(
                x, self.w[p + "experts.gate_up_proj"], self.w[p + "experts.down_proj"], weights, experts, c.swiglu_limit
            )
            if layer is None
            else self.routed_experts(layer, x, weights, experts)
        )
        lim = c.swiglu_limit
        gate = F.linear(x, self.w[p + "shared_experts.gate_proj.weight"]).clamp(max=lim)
        up = F.linear(x, self.w[p + "shared_experts.up_proj.weight"]).clamp(min=-lim, max=lim)
        return routed + F.linear(F.silu(gate) * up, self.w[p + "shared_experts.down_proj.weight"]), experts

    def local_experts(self, i: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Layer i's routed experts, all in this process: `kvmesh.kernels.moe.moe_experts`' contract."""
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" not in self.w:
            raise RuntimeError(f"layer {i}'s routed experts live on the expert-parallel ranks, not in this model")
        w_gate_up, w_down = self.w[p + "gate_up_proj"], self.w[p + "down_proj"]
        return self.kernels.moe_experts(x, w_gate_up, w_down, weights, experts, self.config.swiglu_limit)

    def drop_routed_experts(self) -> None:
        """Free the main layers' routed experts (an expert-parallel rank's hook holds its own);
        `local_experts` raises RuntimeError from then on. The MTP block's stay."""
        for i in range(self.config.num_hidden_layers):
            for part in ("gate_up_proj", "down_proj"):
                self.w.pop(f"model.layers.{i}.mlp.experts.{part}", None)

    # -- compressors ------------------------------------------------------------------------
    def _compress(
        self,
        i: int,
        prefix: str,
        kv: torch.Tensor,
        gate: torch.Tensor,
        item: ForwardItem,
        table: torch.Tensor,
        pages: torch.Tensor,
        slots: torch.Tensor,
        overlap: bool,
        names: tuple[str, ...],
    ) -> None:
        """Run one compressor (`DeepseekV4CSACompressor`, `DeepseekV4HCACompressor` or the
        indexer's) over one sequence's new tokens' projections kv, gate [n, Wd] (kv_proj and
        gate_proj of the attention input, computed for the whole batch): extend the open window in the slot,
        emit an entry per closed window into the pages, keep the CSA overlap state.

        table is the item's block table (int64 page ids); names = (entries field, buf_kv,
        buf_gate, ov_kv, ov_gate) in the layout.
        """
        lay, S = self.layout, self.layout.page_size
        r = lay.rates[i]
        ent_name, bk, bg, ok, og = names
        nc, slot = item.num_computed_tokens, item.state_slot
        assert slot is not None, "the runner checked every item's state slot"
        nb, e0 = nc % r, nc // r
        buf_kv, buf_gate = lay.slot_view(slots, slot, bk, i), lay.slot_view(slots, slot, bg, i)
        if item.state_from is not None and item.state_from != slot:
            # a verification row continues the previous row's state in a slot of its own, so
            # the rows after the last accepted one leave the sequence's state as they found it
            for name in (bk, bg, ok, og) if overlap else (bk, bg):
                lay.slot_view(slots, slot, name, i).copy_(lay.slot_view(slots, item.state_from, name, i))
        kv = torch.cat([buf_kv[:nb], kv])
        gate = torch.cat([buf_gate[:nb], gate])
        usable = kv.shape[0] // r * r
        rest = kv.shape[0] - usable
        buf_kv[:rest] = kv[usable:]
        buf_gate[:rest] = gate[usable:]
        n_win = usable // r
        if not n_win:
            return
        ck = kv[:usable].view(n_win, r, -1)
        cg = gate[:usable].view(n_win, r, -1) + self.w[prefix + "position_bias"]
        if overlap:  # CSA: window w pools window w-1's Ca half with its own Cb half
            d = ck.shape[-1] // 2
            new_kv = ck.new_zeros(n_win, 2 * r, d)
            new_gate = cg.new_full((n_win, 2 * r, d), float("-inf"))
            new_kv[:, r:], new_gate[:, r:] = ck[..., d:], cg[..., d:]
            new_kv[1:, :r], new_gate[1:, :r] = ck[:-1, :, :d], cg[:-1, :, :d]
            ov_kv, ov_gate = lay.slot_view(slots, slot, ok, i), lay.slot_view(slots, slot, og, i)
            if e0 > 0:
                new_kv[0, :r], new_gate[0, :r] = ov_kv, ov_gate
            ov_kv.copy_(ck[-1, :, :d])
            ov_gate.copy_(cg[-1, :, :d])
            pooled = (new_kv * new_gate.softmax(dim=1)).sum(dim=1)  # [n_win, d]
        else:
            pooled = (ck * cg.softmax(dim=1)).sum(dim=1)
        pooled = _rms(pooled, self.w[prefix + "kv_norm.weight"], self.eps)
        wins = torch.arange(e0, e0 + n_win, device=self.device)
        cos, sin = self.rope["compress"](wins * r)
        pooled = _rope(pooled.unsqueeze(1), cos, sin).squeeze(1)  # [n_win, d]
        per_page = S // r
        lay.page_view(pages, ent_name, i)[table[wins // per_page], wins % per_page] = pooled
        if overlap:  # windows that end a page leave their Ca half there for prefix-cache hits
            # [k] rows of wins, found on the host (nonzero on a GPU reads its count back)
            ends = torch.tensor([w - e0 for w in range(e0, e0 + n_win) if (w + 1) % per_page == 0], dtype=torch.long)
            ends = to_device(ends, self.device)
            page_ends = table[wins[ends] // per_page]
            lay.page_view(pages, ok, i)[page_ends] = ck[ends, :, :d]
            lay.page_view(pages, og, i)[page_ends] = cg[ends, :, :d]

    def _entries(self, name: str, i: int, table: torch.Tensor, count: int, pages: torch.Tensor) -> torch.Tensor:
        """The first `count` entries of field `name` of layer i of the sequence whose block table
        is `table`: [count, d]."""
        per_page = self.layout.page_size // self.layout.rates[i]
        idx = torch.arange(count, device=self.device)
        return self.layout.page_view(pages, name, i)[table[idx // per_page], idx % per_page]

    # -- attention --------------------------------------------------------------------------
    def _attention(
        self,
        i: int,
        x: torch.Tensor,
        items: Sequence[ForwardItem],
        starts: list[int],
        positions: torch.Tensor,
        pages: torch.Tensor,
        slots: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        c, lay, p = self.config, self.layout, f"model.layers.{i}.self_attn."
        kind = c.layer_types[i]
        T, nh, D, S, W = x.shape[0], c.num_attention_heads, c.head_dim, lay.page_size, c.sliding_window
        cos, sin = self.rope["main" if kind == SLIDING else "compress"](positions)
        q_res = _rms(F.linear(x, self.w[p + "q_a_proj.weight"]), self.w[p + "q_a_norm.weight"], self.eps)
        q = _rms(F.linear(q_res, self.w[p + "q_b_proj.weight"]).view(T, nh, D), None, self.eps)
        q = _rope(q, cos, sin)  # [T, Hq, D]
        kv = _rms(F.linear(x, self.w[p + "kv_proj.weight"]), self.w[p + "kv_norm.weight"], self.eps)
        kv = _rope(kv.unsqueeze(1), cos, sin).squeeze(1)  # [T, D]
        swa = lay.page_view(pages, "swa", i)  # [P, S, D]
        swa[plan.write_page, plan.write_slot] = kv
        if kind == CSA:
            ip = p + "compressor.indexer."
            Hi, Di = c.index_n_heads, c.index_head_dim
            ic, isn = self.rope["compress"](positions)
            iq = _rope(F.linear(q_res, self.w[ip + "q_b_proj.weight"]).view(T, Hi, Di), ic, isn)
            iw = F.linear(x, self.w[ip + "scorer.weights_proj.weight"]) * Hi**-0.5  # [T, Hi]
            i_kv = F.linear(x, self.w[ip + "kv_proj.weight"])  # [T, 2Di]
            i_gate = F.linear(x, self.w[ip + "gate_proj.weight"])
        if kind != SLIDING:
            cp = p + "compressor."
            c_kv = F.linear(x, self.w[cp + "kv_proj.weight"])  # [T, 2D] (CSA) or [T, D] (HCA)
            c_gate = F.linear(x, self.w[cp + "gate_proj.weight"])
        out = q.new_empty(T, nh, D)
        sinks = self.w[p + "sinks"]
        if kind != SLIDING:  # extend every sequence's windows before anyone reads entries
            for b, it in enumerate(items):
                lo, hi = starts[b], starts[b + 1]
                self._compress(
                    i,
                    cp,
                    c_kv[lo:hi],
                    c_gate[lo:hi],
                    it,
                    plan.tables[b],
                    pages,
                    slots,
                    kind == CSA,
                    ("entries", "buf_kv", "buf_gate", "ov_kv", "ov_gate"),
                )
                if kind == CSA:
                    self._compress(
                        i,
                        ip,
                        i_kv[lo:hi],
                        i_gate[lo:hi],
                        it,
                        plan.tables[b],
                        pages,
                        slots,
                        True,
                        ("ikeys", "ibuf_kv", "ibuf_gate", "iov_kv", "iov_gate"),
                    )
        if plan.dec:
            rows = plan.dec_rows
            out[rows] = self._decode_attention(
                i, q[rows], iq[rows] if kind == CSA else None, iw[rows] if kind == CSA else None, plan, pages, sinks
            )
        dev = self.device
        offsets = torch.arange(-W + 1, 1, device=dev)  # [W] a query's window, oldest first
        for b, it in enumerate(items):
            lo, hi = starts[b], starts[b + 1]
            nc, n = it.num_computed_tokens, hi - lo
            if n == 1:
                continue  # done above, batched
            qpos = positions[lo:hi]
            base = max(0, nc - W + 1)
            kpos = torch.arange(base, nc + n, device=dev)  # every key some new token's window holds
            table = plan.tables[b]
            win = swa[table[kpos // S], kpos % S]  # [Ws, D]
            wpos = qpos[:, None] + offsets  # [n, W] window positions of each query
            win_kv = win[(wpos - base).clamp(min=0)]  # [n, W, D]
            win_bias = torch.zeros(n, W, device=dev).masked_fill_(wpos < 0, float("-inf"))
            ent_kv = ent_bias = None
            if kind != SLIDING:
                r = lay.rates[i]
                count = (nc + n) // r
                if count:
                    num_valid = (qpos + 1) // r  # [n] entries whose window has closed
                    entries = self._entries("entries", i, table, count, pages)  # [C, D]
                    if kind == CSA:
                        ikeys = self._entries("ikeys", i, table, count, pages)  # [C, Di]
                        scores = self.kernels.indexer_scores(iq[lo:hi], ikeys, iw[lo:hi], Di**-0.5)  # [n, C]
                        k = min(c.index_topk, count)
                        top = indexer_topk(scores, k, num_valid)  # [n, k], -1 = none
                        if self.count_topk_ties:
                            self.topk_boundary_ties += _boundary_ties(scores, num_valid, k)
                        ent_kv = entries[top.clamp(min=0)]  # [n, k, D]
                        ent_bias = torch.zeros(n, k, device=dev).masked_fill_(top < 0, float("-inf"))
                    else:  # HCA: every closed window
                        ent_kv = entries
                        ent_bias = torch.zeros(n, count, device=dev).masked_fill_(
                            torch.arange(count, device=dev)[None, :] >= num_valid[:, None], float("-inf")
                        )
            out[lo:hi] = sparse_sink_attention(q[lo:hi], win_kv, win_bias, ent_kv, ent_bias, sinks, D**-0.5)
        out = _rope(out, cos, -sin)  # undo the rope V carried (K=V), at the query's position
        g = c.o_groups
        grouped = torch.bmm(out.view(T, g, -1).transpose(0, 1), self.o_a[i]).transpose(0, 1)  # [T, g, olr]
        return F.linear(grouped.flatten(1), self.w[p + "o_b_proj.weight"])  # [T, H]

    def _plan(self, items: Sequence[ForwardItem], starts: list[int], positions: torch.Tensor) -> _Plan:
        """The forward's indices, built on the host from `positions` [T] (a host tensor) and the
        items' block tables, then copied to the model's device (no sync: nothing is read back)."""
        S, W = self.layout.page_size, self.config.sliding_window
        tables = [torch.tensor(list(it.block_ids)) for it in items]
        lengths = torch.tensor(starts[1:]) - torch.tensor(starts[:-1])
        seq_of = torch.repeat_interleave(torch.arange(len(items)), lengths, output_size=starts[-1])
        width = max(len(t) for t in tables)
        padded = torch.stack([torch.cat([t, t[:1].expand(width - len(t))]) for t in tables])  # [B, M]
        write_page = padded[seq_of, positions // S]
        dec = [b for b, it in enumerate(items) if len(it.token_ids) == 1]
        dec_rows = torch.tensor([starts[b] for b in dec], dtype=torch.long)
        qpos = positions[dec_rows]  # [Bd]
        dtab = padded[dec] if dec else padded[:0]  # [Bd, M]
        wpos = qpos[:, None] + torch.arange(-W + 1, 1)  # [Bd, W]
        wc = wpos.clamp(min=0)
        entries, most = {}, {}
        for r in sorted(set(x for x in self.layout.rates if x)):
            count = (qpos + 1) // r  # [Bd] entries after this step's compress
            most[r] = max(((items[b].num_computed_tokens + 1) // r for b in dec), default=0)  # count's max
            cmax = max(most[r], 1)
            e = torch.arange(cmax)[None, :].expand(len(dec), cmax)
            entries[r] = tuple(to_device(t, self.device) for t in (dtab.gather(1, (e * r) // S), e % (S // r), count))
        on = self.device
        return _Plan(
            [to_device(t, on) for t in tables],
            to_device(write_page, on),
            to_device(positions % S, on),
            dec,
            to_device(dec_rows, on),
            to_device(dtab.gather(1, wc // S), on),
            to_device(wc % S, on),
            to_device(torch.zeros(wpos.shape).masked_fill_(wpos < 0, float("-inf")), on),
            entries,  # type: ignore[arg-type]  # tuples of three, as built
            most,
        )

    def _decode_attention(
        self, i: int, q: torch.Tensor, iq, iw, plan: _Plan, pages: torch.Tensor, sinks: torch.Tensor
    ) -> torch.Tensor:
        """Every one-new-token sequence at once: q [Bd, Hq, D] -> [Bd, Hq, D]."""
        c, lay = self.config, self.layout
        kind, D = c.layer_types[i], c.head_dim
        win_kv = lay.page_view(pages, "swa", i)[plan.win_page, plan.win_slot]  # [Bd, W, D]
        ent_kv = ent_bias = None
        if kind != SLIDING:
            pg, row, count = plan.entries[lay.rates[i]]
            valid = torch.arange(pg.shape[1], device=pg.device)[None, :] < count[:, None]  # [Bd, Cmax]
            most = plan.most_entries[lay.rates[i]]
            if most:
                ent_kv = lay.page_view(pages, "entries", i)[pg, row]  # [Bd, Cmax, D]
                ent_bias = torch.zeros(valid.shape, device=pg.device).masked_fill_(~valid, float("-inf"))
                if kind == CSA:
                    Di = c.index_head_dim
                    ikeys = lay.page_view(pages, "ikeys", i)[pg, row]  # [Bd, Cmax, Di]
                    # indexer_scores per query: sum_h w_h * relu(q_h . k) * Di^-0.5
                    scores = (
                        torch.matmul(iq.float(), ikeys.transpose(1, 2).float()).relu()
                        * Di**-0.5
                        * iw.float().unsqueeze(-1)
                    ).sum(dim=1)  # [Bd, Cmax]
                    k = min(c.index_topk, pg.shape[1])
                    top = indexer_topk(scores, k, count)  # [Bd, k], -1 = none
                    if self.count_topk_ties:
                        self.topk_boundary_ties += _boundary_ties(scores, count, min(k, most))
                    safe = top.clamp(min=0)
                    ent_kv = ent_kv.gather(1, safe[..., None].expand(-1, -1, D))  # [Bd, k, D]
                    ent_bias = torch.zeros(top.shape, device=top.device).masked_fill_(top < 0, float("-inf"))
        return sparse_sink_attention(q, win_kv, plan.win_bias, ent_kv, ent_bias, sinks, D**-0.5)

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem], pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One step over a batch of sequences; returns fp32 logits [B, V] after each one's last token.

        pages [P, layout.page_floats] and slots [R, layout.slot_floats] fp32 (the layout
        `kvmesh.engine.kv_layout.DEEPSEEK_V4_PAGE`) are updated in place.
        Raises ValueError for an empty batch or an item without new tokens or with too few pages.
        """
        if not items:
            raise ValueError("forward needs at least one item")
        c, S = self.config, self.layout.page_size
        starts: list[int] = [0]
        ids: list[int] = []
        pos: list[int] = []
        for b, it in enumerate(items):
            n, nc = len(it.token_ids), it.num_computed_tokens
            if n < 1 or len(it.block_ids) * S < nc + n:
                raise ValueError(
                    f"item {b}: needs >= 1 new token and pages for {nc + n} tokens, "
                    f"got {n} new and {len(it.block_ids)} pages of {S}"
                )
            ids.extend(it.token_ids)
            pos.extend(range(nc, nc + n))
            starts.append(starts[-1] + n)
        ids_t, host_positions = to_device(torch.tensor(ids), self.device), torch.tensor(pos)
        plan = self._plan(items, starts, host_positions)
        positions = to_device(host_positions, self.device)
        h = F.embedding(ids_t, self.w["model.embed_tokens.weight"])  # [T, H]
        streams = h.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()  # [T, N, H]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            post, comb, collapsed = self._hc(streams, p + "attn_hc")
            x = _rms(collapsed, self.w[p + "input_layernorm.weight"], self.eps)
            attn = self._attention(i, x, items, starts, positions, pages, slots, plan)
            streams = self._mix(post, comb, attn, streams)
            post, comb, collapsed = self._hc(streams, p + "ffn_hc")
            x = _rms(collapsed, self.w[p + "post_attention_layernorm.weight"], self.eps)
            streams = self._mix(post, comb, self._mlp(x, ids_t, i), streams)
        last = to_device(torch.tensor(starts[1:]) - 1, self.device)
        streams = streams.index_select(0, last)  # [B, N, H]
        self.last_streams = streams
        if self.layout.mtp_hidden is not None:  # what the MTP drafter continues from
            for b, it in enumerate(items):
                assert it.state_slot is not None, "the runner checked every item's state slot"
                self.layout.slot_view(slots, it.state_slot, "hidden", -1).copy_(streams[b])
        return self.head(
            streams, "model.hc_head.hc_fn", "model.hc_head.hc_scale", "model.hc_head.hc_base", "model.norm.weight"
        )

    def head(self, streams: torch.Tensor, fn: str, scale: str, base: str, norm: str) -> torch.Tensor:
        """`DeepseekV4HyperHead` + final norm + lm_head, with the named tensors (the model's, or
        the MTP module's own hc head and norm): streams [B, N, H] -> fp32 logits [B, V]."""
        flat = _rms(streams.flatten(1), None, self.eps)
        pre = torch.sigmoid(F.linear(flat, self.w[fn]) * self.w[scale] + self.w[base]) + self.hc_eps  # [B, N]
        h = _rms((pre.unsqueeze(-1) * streams).sum(dim=1), self.w[norm], self.eps)
        return F.linear(h, self.w["lm_head.weight"]).float()  # [B, V]
