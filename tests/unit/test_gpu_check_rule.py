"""bench/gpu_check.py's kvmesh greedy loop keeps the logits row each token was sampled from (the
rows the parity part judges by the acceptance rule, kvmesh.bench.precision_rule), copied out of a
CUDA graph's output buffer before the next step overwrites it."""

from __future__ import annotations

import torch

from kvmesh.bench.gpu_check import _greedy_kvmesh

V = 11


class GraphLikeRunner:
    """A runner whose logits are a view of one buffer every step rewrites, as a CUDA graph's
    output is: row b peaks at (last token * 3 + position) % V."""

    page_size, num_state_slots = 4, 0

    def __init__(self) -> None:
        self.out = torch.zeros(8, V)  # [max B, V] fp32

    def forward(self, items):
        self.out.zero_()
        for b, it in enumerate(items):
            self.out[b, (it.token_ids[-1] * 3 + it.num_computed_tokens + len(it.token_ids)) % V] = 1.0
        return self.out[: len(items)]


def test_greedy_kvmesh_keeps_each_tokens_own_logits_row():
    prompts, n = [[1, 2, 3], [4, 5]], 5
    tokens, logits, _ = _greedy_kvmesh(GraphLikeRunner(), prompts, n, keep_logits=True)
    assert [x.shape for x in logits] == [(n, V)] * 2
    assert [x.argmax(-1).tolist() for x in logits] == tokens  # row i is the one token i was sampled from
    same, none, _ = _greedy_kvmesh(GraphLikeRunner(), prompts, n)
    assert same == tokens and none == []  # decode_speed's loop keeps none
