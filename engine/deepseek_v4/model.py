# T=tokens (new, all sequences), B=sequences, H=hidden, N=hc_mult streams, V=vocab,
# E=routed experts, K=experts per token, W=sliding window, P=pages, R=state slots
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

The model's parts sit beside it as transformers' classes do in modeling_deepseek_v4.py:
`attention` (DeepseekV4Attention), `compressor` (the CSA / HCA compressors), `indexer` (the
Lightning Indexer's use), `moe` (DeepseekV4MoE's router and shared expert), `hyper_connections`
(DeepseekV4HyperConnection, DeepseekV4HyperHead), `ops` (RMSNorm, RoPE) and `plan` (the indices
one forward's layers share).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvmesh.engine.deepseek_v4.attention import V4Attention
from kvmesh.engine.deepseek_v4.hyper_connections import hc_head, hc_post, hc_pre
from kvmesh.engine.deepseek_v4.moe import route, shared_expert
from kvmesh.engine.deepseek_v4.ops import RopeTable, rms_norm
from kvmesh.engine.deepseek_v4.plan import ForwardPlan, plan_forward
from kvmesh.engine.deepseek_v4.state import V4StateLayout
from kvmesh.engine.deepseek_v4.weights import check_and_take
from kvmesh.engine.forward import ForwardItem
from kvmesh.kernels.backend import KernelBackend, create_kernel_backend
from kvmesh.kernels.ops import to_device

logger = logging.getLogger(__name__)


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
        self.rope = {"main": RopeTable(c, "main", dev), "compress": RopeTable(c, "compress", dev)}
        self.attention = V4Attention(c, layout, self.w, self.rope, self.kernels, dev)
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
        weights, experts = route(x, ids, self.w, p, c, hash_routed)
        routed = (
            self.kernels.moe_experts(
                x, self.w[p + "experts.gate_up_proj"], self.w[p + "experts.down_proj"], weights, experts, c.swiglu_limit
            )
            if layer is None
            else self.routed_experts(layer, x, weights, experts)
        )
        return routed + shared_expert(x, self.w, p, c.swiglu_limit), experts

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

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem], pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One step over a batch of sequences; returns fp32 logits [B, V] after each one's last token.

        pages [P, layout.page_floats] and slots [R, layout.slot_floats] fp32 (the layout
        `kvmesh.engine.kv_layout.DEEPSEEK_V4_PAGE`) are updated in place.
        Raises ValueError for an empty batch or an item without new tokens or with too few pages.
        """
        ids, positions, starts = self._rows(items)
        ids_t = to_device(torch.tensor(ids), self.device)
        plan = plan_forward(
            items,
            starts,
            torch.tensor(positions),
            self.layout,
            self.config.sliding_window,
            self.device,
            self.count_topk_ties,
        )
        h = F.embedding(ids_t, self.w["model.embed_tokens.weight"])  # [T, H]
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, N, H]
        for i in range(self.config.num_hidden_layers):
            streams = self._layer(i, streams, ids_t, plan, pages, slots)
        self.topk_boundary_ties += plan.ties
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

    def _rows(self, items: Sequence[ForwardItem]) -> tuple[list[int], list[int], list[int]]:
        """The batch as rows of new tokens: (token ids [T], positions [T], starts [B + 1], item b's
        rows being starts[b] .. starts[b+1]-1). Raises ValueError as `forward`."""
        if not items:
            raise ValueError("forward needs at least one item")
        S = self.layout.page_size
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
        return ids, pos, starts

    def _layer(
        self,
        i: int,
        streams: torch.Tensor,
        ids: torch.Tensor,
        plan: ForwardPlan,
        pages: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder layer i: the attention, then the MoE, each between hyper-connections:
        streams [T, N, H] -> [T, N, H]."""
        p = f"model.layers.{i}."
        post, comb, collapsed = hc_pre(streams, self.w, p + "attn_hc", self.config)
        x = rms_norm(collapsed, self.w[p + "input_layernorm.weight"], self.eps)
        streams = hc_post(post, comb, self.attention(i, x, plan, pages, slots), streams)
        post, comb, collapsed = hc_pre(streams, self.w, p + "ffn_hc", self.config)
        x = rms_norm(collapsed, self.w[p + "post_attention_layernorm.weight"], self.eps)
        return hc_post(post, comb, self._mlp(x, ids, i), streams)

    def head(self, streams: torch.Tensor, fn: str, scale: str, base: str, norm: str) -> torch.Tensor:
        """`DeepseekV4HyperHead` + final norm + lm_head, with the named tensors (the model's, or
        the MTP module's own hc head and norm): streams [B, N, H] -> fp32 logits [B, V]."""
        collapsed = hc_head(streams, self.w[fn], self.w[scale], self.w[base], self.config)
        h = rms_norm(collapsed, self.w[norm], self.eps)
        return F.linear(h, self.w["lm_head.weight"]).float()  # [B, V]
