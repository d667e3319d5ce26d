"""Configuration of one decode instance: one `setting` per field declares its flag, variable,
default and help (runtime/settings.py); the settings decode shares with prefill are in
runtime/service_config.py."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.ep.link import parse_init_addr
from kvmesh.engine.speculative import SPECULATIVE_METHODS
from kvmesh.runtime.service_config import ModelServiceConfig
from kvmesh.runtime.settings import setting


@dataclass(frozen=True)
class DecodeConfig(ModelServiceConfig):
    """Settings of a decode instance, built once in main() from flags and KVMESH_* variables."""

    kv_port: int = setting(0, "--kv-port", "port of the KV listener prefill pushes to (0: any free port)")
    max_batch_size: int = setting(
        64, "--max-batch-size", "most requests reserved or running at once (more: RESOURCE_EXHAUSTED)", ge=1
    )
    max_admit_per_step: int = setting(
        4,
        "--max-admit-per-step",
        "new KV loads (requests whose pushed KV landed) admitted into the batch per step",
        ge=1,
    )
    reservation_timeout_s: float = setting(
        60.0,
        "--reservation-timeout",
        "seconds a reservation no Generate claims is kept, unless its Reserve set kv_deadline_s (the gateway does)",
        gt=0,
    )
    speculative: str = setting(
        "off",
        "--speculative",
        "speculative decoding: off, ngram (drafts by prompt lookup) or mtp (drafts by a DeepSeek-V4 checkpoint's "
        "multi-token-prediction module), verified by the model in the same batched step; the output is the same "
        "as without it",
    )
    enforce_eager: bool = setting(
        False,
        "--enforce-eager",
        "run every decode step eagerly; without it, on a GPU, Llama's decode steps of up to --max-batch-size "
        "sequences replay CUDA graphs captured at start at batch sizes 1, 2, 4 ... 64 (on the CPU there are none)",
        kind="flag",
    )
    num_draft_tokens: int = setting(
        4, "--num-draft-tokens", "most draft tokens a sequence carries into a step", ge=1, le=16
    )
    draft_row_cost: float = setting(
        0.0,
        "--draft-row-cost",
        "what a speculative verification row costs relative to a plain one-row step (0: measure it at start); "
        "drafting is turned down where the acceptance does not pay for it",
        ge=0,
    )
    max_verify_rows: int = setting(
        32,
        "--max-verify-rows",
        "most rows (tokens) a speculative step runs; drafts are left out past it, so large batches decode plainly",
        ge=1,
    )
    ep: int = setting(
        1,
        "--ep",
        "expert-parallel ranks (processes under torch.distributed: attention data-parallel, routed experts spread "
        "over the ranks, all-to-all dispatch and combine); MoE models only, 1: single-process decode",
        ge=1,
    )
    eplb_placement: str = setting(
        "",
        "--eplb-placement",
        "with --ep: the expert placement `kvmesh eplb plan --ranks N --json` printed (empty: experts in order, one "
        "replica each); read again when the file changes",
    )
    ep_timeout_s: float = setting(
        30.0, "--ep-timeout", "seconds any expert-parallel collective may wait for a rank before the step fails", gt=0
    )
    ep_init_addr: str = setting(
        "",
        "--ep-init-addr",
        "with --ep: HOST:PORT where ranks 1..N-1 on other hosts join (`kvmesh serve ep-rank --ep-init-addr HOST:PORT "
        "--rank R`; the key is KVMESH_EP_SECRET, the same on every rank); empty: spawn the ranks on this host, "
        "sharing its memory",
    )

    @property
    def num_scratch_slots(self) -> int:
        """State slots a model with per-request state (DeepSeek-V4) sets aside for speculative
        verification rows: one a draft row of the largest step (0 without speculation)."""
        if self.speculative == "off":
            return 0
        return min(self.max_verify_rows, self.num_draft_tokens * self.max_batch_size)

    @property
    def num_state_slots(self) -> int:
        """State slots the runner needs: one a request, plus `num_scratch_slots`."""
        return self.max_batch_size + self.num_scratch_slots

    def __post_init__(self) -> None:
        super().__post_init__()  # the bounds of every field (kvmesh.runtime.settings.check_bounds)
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {list(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        if self.eplb_placement and self.ep == 1:
            raise ValueError("eplb_placement needs --ep >= 2")
        if self.ep_init_addr:
            if self.ep == 1:
                raise ValueError("ep_init_addr needs --ep >= 2")
            parse_init_addr(self.ep_init_addr)
