"""What one prefill and one decode instance cost on this hardware, with this model: the planner's
input, measured by `kvmesh plan` (kvmesh.planner.measure) or read from a file it saved.

Prefill, one forward of n prompt tokens (requests packed up to the chunk size), each computing
n_i tokens after d_i tokens already in its KV (cached or computed by an earlier chunk):

    forward_s = per_forward_s + per_token_s * n + per_attention_s * sum(n_i * (d_i + n_i / 2))

and a request's TTFT adds `first_token_s` after its last forward: the push of its pages, the
hops through the gateway and the first token's trip to the client (time no core is busy for).

Decode, one step of a batch of `rows` requests holding `context` tokens in all:

    step_s = step_s + per_row_s * rows + per_context_s * context

Measured from the client (`GenerateRequest` through the gateway), so every hop is in it, with
both roles on the same cores taking turns when `shared_cores` (a `kvmesh up` on one machine).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Profile:
    per_forward_s: float
    per_token_s: float
    per_attention_s: float
    first_token_s: float
    step_s: float
    per_row_s: float
    per_context_s: float
    chunk_tokens: int
    """The prefill chunk size the profile was measured with (tokens)."""
    max_context_tokens: int
    """The model's context (prompt + answer, tokens): the planner refuses a workload past it."""
    shared_cores: bool = True
    """Measured with prefill and decode on one host's cores (they take turns)."""
    about: dict[str, str] = field(default_factory=dict)
    """Model, dtype, CPU or GPU, when: what the numbers hold for."""

    def __post_init__(self) -> None:
        costs = (self.per_forward_s, self.per_token_s, self.per_attention_s, self.first_token_s)
        costs += (self.step_s, self.per_row_s, self.per_context_s)
        if not all(math.isfinite(c) and c >= 0 for c in costs) or self.chunk_tokens < 1 or self.max_context_tokens < 2:
            raise ValueError(f"a profile's costs must be >= 0 and its sizes >= 1: {self}")

    def forward_s(self, tokens: int, attention: float) -> float:
        """One prefill forward of `tokens` tokens whose attention term is `attention` (seconds)."""
        return self.per_forward_s + self.per_token_s * tokens + self.per_attention_s * attention

    def decode_step_s(self, rows: int, context: int) -> float:
        """One decode step of `rows` requests holding `context` tokens (seconds)."""
        return self.step_s + self.per_row_s * rows + self.per_context_s * context

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)
            f.write("\n")


def load_profile(path: str) -> Profile:
    """A profile `Profile.save` wrote. Raises ValueError for a file that is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
        return Profile(**data)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a kvmesh plan profile: {exc}") from exc
