# T=tokens of this rank, K=experts per token, A=T*K (token, expert) assignments, H=hidden,
# I=expert intermediate size, E=logical (routed) experts, P=physical expert slots, R=ranks,
# S=slots per rank (P / R), L=MoE layers, n=rows one rank's experts compute
"""Expert-parallel MoE: a rank's routed experts are those its EPLB placement gives it, and each
MoE layer sends every token to the ranks that hold its experts and brings the results back.

The dispatch / combine follows DeepSeek-V3's EP design (DeepSeek-V3 technical report,
arXiv:2412.19437, §3.4: attention data-parallel, routed experts spread over the EP ranks with
redundant replicas of the hot ones, a token's hidden state sent to each rank that holds one of
its experts and the weighted outputs summed back at home), in the collective form of DeepEP's
"normal" kernels and SGLang's `DeepEPMoE` / vLLM's all-to-all backends, written here with plain
`torch.distributed` collectives:

1. route (the model did it): each token's K logical experts and weights;
2. pick a replica: logical expert e of layer i has replicas[i, e] physical slots (kvmesh.engine.ep.eplb);
   a token with global index g takes replica g mod replicas[i, e], so the split over replicas is
   even and a function of the batch alone (reproducible; EPLB's balancedness assumes exactly
   this even split);
3. exchange split sizes: every rank all-gathers its rows per destination rank [R] and its tokens
   per logical expert [E] (so each rank knows what it receives, and rank 0 can measure every
   rank's load and the global expert counts);
4. dispatch: `all_to_all_single` of the assignment rows [A, H] (sorted by destination rank) and
   their local slot ids [A];
5. compute: the rank's experts run its n received rows through the kernel backend's
   `moe_experts` (K = 1, weight 1: the raw expert output, in x.dtype), so `--kernel-backend
   triton` runs them as Triton kernels;
6. combine: `all_to_all_single` back with the splits reversed, then each token sums its K
   weighted outputs in fp32 in ascending expert order: `kvmesh.kernels.moe.moe_experts`' own order, so
   EP gives the single-process numbers (up to the matmuls' batch-shape rounding).

A rank sends one row per (token, expert) assignment; DeepEP sends a token once per destination
rank and combines there, which saves bandwidth when a token's experts share a rank (not done).
Every rank must run every MoE layer's exchange in the same order, also when it has no tokens
(`idle_forward`): that is what keeps the ranks in lockstep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.engine.ep.eplb import Placement, mean_over_max

logger = logging.getLogger(__name__)


def split_by_requests(num_items: int, num_ranks: int) -> list[range]:
    """Attention data-parallel split of a batch of `num_items` sequences over `num_ranks` ranks,
    balanced by request count: contiguous ranges, the first num_items % R ranks one longer."""
    if num_ranks < 1 or num_items < 0:
        raise ValueError(f"need num_ranks >= 1 and num_items >= 0, got {num_ranks} and {num_items}")
    base, extra = divmod(num_items, num_ranks)
    bounds = [0]
    for r in range(num_ranks):
        bounds.append(bounds[-1] + base + (r < extra))
    return [range(bounds[r], bounds[r + 1]) for r in range(num_ranks)]


def check_placement(placement: Placement, num_layers: int, num_experts: int, num_ranks: int) -> None:
    """Raise ValueError unless `placement` places every one of `num_experts` experts of every
    one of `num_layers` layers on `num_ranks` ranks with the same slots per rank."""
    phy2log, replicas = np.asarray(placement.phy2log), np.asarray(placement.replicas)
    if placement.num_ranks != num_ranks:
        raise ValueError(f"the placement is for {placement.num_ranks} ranks, the EP world has {num_ranks}")
    if phy2log.ndim != 2 or phy2log.shape[0] != num_layers or phy2log.shape[1] % num_ranks:
        raise ValueError(
            f"phy2log must be [{num_layers} layers, slots divisible by {num_ranks} ranks], got {list(phy2log.shape)}"
        )
    if replicas.shape != (num_layers, num_experts):
        raise ValueError(f"replicas must be [{num_layers}, {num_experts}], got {list(replicas.shape)}")
    if phy2log.min() < 0 or phy2log.max() >= num_experts:
        raise ValueError(f"phy2log names experts outside [0, {num_experts})")
    counted = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
    if (counted != replicas).any() or (replicas < 1).any():
        raise ValueError("every expert needs >= 1 replica and replicas must count phy2log's slots")


@dataclass
class EPLoads:
    """What the exchanges measured since start (every rank sees every rank's split sizes).

    rank_tokens [L, R] int64: rows each rank's experts computed, per layer;
    expert_tokens [L, E] int64: tokens routed to each logical expert, over all ranks.
    """

    rank_tokens: np.ndarray
    expert_tokens: np.ndarray

    def balancedness(self) -> np.ndarray:
        """[L] measured mean over max rank load (1.0 for a layer with no tokens)."""
        return mean_over_max(self.rank_tokens)


@dataclass
class EPTimes:
    """Rank 0's wall seconds in each part of expert-parallel steps since start: what wide-EP
    operators watch, since a late rank stalls every rank in these waits.

    sync_s: each MoE layer's all-gather of split sizes (the DP sync before dispatch);
    dispatch_s / combine_s: the all-to-alls of token rows out to the experts and back;
    gather_s: the logits (and streams) gathered to rank 0; pages_s: pages and state slots sent
    to and taken back from ranks on other hosts; step_s: whole steps; steps: how many.
    """

    sync_s: float = 0.0
    dispatch_s: float = 0.0
    combine_s: float = 0.0
    gather_s: float = 0.0
    pages_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the seconds the block takes to `part` (e.g. "pages_s"); a block that raises adds
        nothing (the step failed, the world is down)."""
        started = time.perf_counter()
        yield
        setattr(self, part, getattr(self, part) + time.perf_counter() - started)

    def per_step_ms(self) -> dict[str, float]:
        """Each part's mean milliseconds per step (zeros before the first step)."""
        n = max(self.steps, 1)
        return {
            name: round(getattr(self, name) * 1e3 / n, 3)
            for name in ("sync_s", "dispatch_s", "combine_s", "gather_s", "pages_s", "step_s")
        }


class ExpertParallelMoE:
    """One rank's side of the dispatch / combine, installed as a DeepseekV4Model's
    `routed_experts`. Holds the rank's expert weights (its slots under the placement, and no
    other expert's) and what its exchanges measured.

    model: the rank's `DeepseekV4Model` (its own routed experts may be dropped: this object
    holds what the rank computes); experts: where slot weights are read from when a placement is
    loaded, `take(layer, expert_ids) -> (gate_up [n, 2I, H], down [n, H, I])`
    (`kvmesh.engine.ep.expert_weights.CheckpointExperts`); group: the EP process group (None: the
    default one); device: where the collectives' buffers live (cpu for gloo, the rank's GPU for
    NCCL); times: where the exchanges' seconds add up (a fresh EPTimes when None).
    """

    def __init__(
        self,
        model,
        rank: int,
        num_ranks: int,
        placement: Placement,
        experts,
        group=None,
        device="cpu",
        times: EPTimes | None = None,
    ) -> None:
        self.times = times if times is not None else EPTimes()
        c = model.config
        self.model, self.rank, self.num_ranks, self.group = model, rank, num_ranks, group
        self.experts = experts
        self.gate_up: list[torch.Tensor] = []  # per layer [S, 2I, H]
        self.down: list[torch.Tensor] = []  # per layer [S, H, I]
        self.mine = torch.zeros(0, dtype=torch.int64)  # [L, S] logical expert of each local slot
        self.device = torch.device(device)
        self.num_layers, self.num_experts = c.num_hidden_layers, c.n_routed_experts
        self.token_offset = 0
        """Global index of this rank's first token in the step (set before each forward)."""
        self.loads = EPLoads(
            np.zeros((self.num_layers, num_ranks), np.int64), np.zeros((self.num_layers, self.num_experts), np.int64)
        )
        self.load_placement(placement)

    def load_placement(self, placement: Placement) -> None:
        """Take `placement` from the next MoE layer on: this rank's slot weights [S, 2I, H] /
        [S, H, I] per layer (experts it already holds are kept, the others read from `experts`)
        and the replica tables. Call it between steps only, on every rank with the same
        placement. Raises ValueError for a placement of the wrong shape (check_placement)."""
        check_placement(placement, self.num_layers, self.num_experts, self.num_ranks)
        phy2log = torch.as_tensor(np.asarray(placement.phy2log), dtype=torch.int64)  # [L, P]
        replicas = torch.as_tensor(np.asarray(placement.replicas), dtype=torch.int64)  # [L, E]
        S = phy2log.shape[1] // self.num_ranks
        mine = phy2log[:, self.rank * S : (self.rank + 1) * S]  # [L, S] logical expert of each local slot
        self.slots_per_rank = S
        self.replicas = replicas
        # replica_slots[i, e, j]: physical slot of e's j-th replica (in slot order), -1 past the last
        self.replica_slots = torch.full((self.num_layers, self.num_experts, int(replicas.max())), -1, dtype=torch.int64)
        for i in range(self.num_layers):
            seen = [0] * self.num_experts
            for slot, e in enumerate(phy2log[i].tolist()):
                self.replica_slots[i, e, seen[e]] = slot
                seen[e] += 1
        gate_up, down = [], []
        for i in range(self.num_layers):
            # experts this rank already holds for layer i are kept; only the others are read
            have = (
                {e: (self.gate_up[i][s], self.down[i][s]) for s, e in enumerate(self.mine[i].tolist())}
                if len(self.mine)
                else {}
            )
            wanted = mine[i].tolist()
            missing = sorted(set(wanted) - set(have))
            if missing:
                g, d = self.experts.take(i, missing)  # [n, 2I, H], [n, H, I]
                have.update({e: (g[j], d[j]) for j, e in enumerate(missing)})
            gate_up.append(torch.stack([have[e][0] for e in wanted]))
            down.append(torch.stack([have[e][1] for e in wanted]))
        self.gate_up, self.down, self.mine = gate_up, down, mine.clone()
        self.placement = placement

    def expert_nbytes(self) -> int:
        """Bytes of routed-expert weights this rank holds: its slots' and no others'."""
        return sum(t.nbytes for t in (*self.gate_up, *self.down))

    def __call__(self, i: int, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Layer i's routed experts over the EP world: x [T, H], weights [T, K] fp32, expert_ids
        [T, K] int64 -> [T, H] in x.dtype (T may be 0). A collective: every rank calls it for
        every MoE layer in the same order. Raises RuntimeError when a peer is gone or the
        group's timeout passes."""
        T, H = x.shape
        K = expert_ids.shape[1]
        R, E = self.num_ranks, self.num_experts
        flat_ids = expert_ids.reshape(-1)  # [A]
        token_of = torch.arange(T).repeat_interleave(K)  # [A]
        reps = self.replicas[i][flat_ids]  # [A]
        which = (self.token_offset + token_of) % reps  # [A] replica by global token index
        slot = self.replica_slots[i][flat_ids, which]  # [A]
        dest = slot // self.slots_per_rank  # [A]
        order = torch.argsort(dest, stable=True)  # [A] rows grouped by destination rank
        send_counts = torch.bincount(dest, minlength=R)  # [R]
        meta = torch.cat([send_counts, torch.bincount(flat_ids, minlength=E)]).to(self.device)  # [R + E]
        gathered = [torch.empty_like(meta) for _ in range(R)]
        timer = time.perf_counter()
        torch.distributed.all_gather(gathered, meta, group=self.group)
        self.times.sync_s += time.perf_counter() - timer
        table = torch.stack(gathered).cpu()  # [R senders, R + E]
        self.loads.rank_tokens[i] += table[:, :R].sum(dim=0).numpy()
        self.loads.expert_tokens[i] += table[:, R:].sum(dim=0).numpy()
        send = send_counts.tolist()
        recv = table[:, self.rank].tolist()
        timer = time.perf_counter()
        rows = self._exchange(x[token_of[order]], recv, send)  # [n, H]
        local = self._exchange((slot[order] % self.slots_per_rank).contiguous(), recv, send)  # [n]
        self.times.dispatch_s += time.perf_counter() - timer
        ones = torch.ones(len(local), 1, dtype=torch.float32)
        y = self.model.kernels.moe_experts(
            rows, self.gate_up[i], self.down[i], ones, local[:, None], self.model.config.swiglu_limit
        )  # [n, H]: each row's raw expert output
        back = torch.empty(len(flat_ids), H, dtype=x.dtype)  # [A, H] in assignment order
        timer = time.perf_counter()
        back[order] = self._exchange(y, send, recv)
        self.times.combine_s += time.perf_counter() - timer
        # combine as moe_experts does: fp32, each token's experts in ascending id order
        by_expert = torch.argsort(flat_ids, stable=True)
        weight_of = weights.reshape(-1).float()[by_expert]
        out = torch.zeros(T, H, dtype=torch.float32)
        out.index_add_(0, token_of[by_expert], back[by_expert].float() * weight_of[:, None])
        return out.to(x.dtype)

    def _exchange(self, t: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        """all_to_all_single of t's rows [sum(send), ...] -> [sum(recv), ...] (on self.device,
        returned on the CPU)."""
        out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=self.device)
        torch.distributed.all_to_all_single(out, t.to(self.device), recv, send, group=self.group)
        return out.cpu()

    def idle_forward(self) -> None:
        """A rank without sequences this step still joins every MoE layer's exchange."""
        c = self.model.config
        x = torch.empty(0, c.hidden_size, dtype=self.model.w["model.embed_tokens.weight"].dtype)
        for i in range(self.num_layers):
            self(i, x, torch.empty(0, c.num_experts_per_tok), torch.empty(0, c.num_experts_per_tok, dtype=torch.int64))
