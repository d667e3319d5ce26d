"""DeepSeek-V4 sink attention: the dense form against transformers' eager attention, and the
sparse form (gathered window + gathered or shared compressed entries) against the dense form."""

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

from kvmesh.kernels.sparse_attention import sink_attention, sparse_sink_attention, window_bias


def test_dense_sink_attention_is_transformers_eager():
    g = torch.Generator().manual_seed(0)
    n, Hq, D, M = 5, 4, 16, 11
    q, kv = torch.randn(n, Hq, D, generator=g), torch.randn(M, D, generator=g)
    sinks = torch.randn(Hq, generator=g)
    bias = torch.zeros(n, M).masked_fill_(torch.rand(n, M, generator=g) < 0.4, float("-inf"))
    bias[:, 0] = 0.0  # every query sees at least one key
    module = nn.Module()
    module.num_key_value_groups, module.sinks, module.training = Hq, sinks, False
    ref, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], kv[None, None], kv[None, None], bias[None, None], scaling=D**-0.5
    )
    torch.testing.assert_close(sink_attention(q, kv, bias, sinks, D**-0.5), ref[0], atol=1e-6, rtol=1e-5)


def test_sparse_equals_dense_over_the_same_visible_keys():
    # 9 queries at positions 3..11 over a window of 4 plus 6 compressed entries of which each
    # query sees a chosen few (CSA) or a causal prefix (HCA)
    g = torch.Generator().manual_seed(1)
    n, Hq, D, W, C = 9, 2, 8, 4, 6
    qpos = torch.arange(3, 3 + n)
    keys = torch.randn(3 + n, D, generator=g)  # K=V of positions 0..11
    ent = torch.randn(C, D, generator=g)
    q, sinks = torch.randn(n, Hq, D, generator=g), torch.randn(Hq, generator=g)
    wpos = qpos[:, None] + torch.arange(-W + 1, 1)
    win_kv, win_bias = keys[wpos.clamp(min=0)], torch.zeros(n, W).masked_fill_(wpos < 0, float("-inf"))
    top = torch.randint(-1, C, (n, 3), generator=g)  # -1: no entry
    top[:, 0] = torch.arange(n) % C
    top[:, 1] = torch.where(top[:, 1] == top[:, 0], -1, top[:, 1])
    top[:, 2] = torch.where((top[:, 2] == top[:, 0]) | (top[:, 2] == top[:, 1]), -1, top[:, 2])
    chosen = torch.zeros(n, C, dtype=torch.bool)
    for t in range(n):
        chosen[t, top[t][top[t] >= 0]] = True
    dense_kv = torch.cat([keys, ent])
    win_dense = window_bias(qpos, torch.arange(3 + n), W)
    csa_dense = torch.cat([win_dense, torch.zeros(n, C).masked_fill_(~chosen, float("-inf"))], dim=1)
    sparse = sparse_sink_attention(
        q,
        win_kv,
        win_bias,
        ent[top.clamp(min=0)],
        torch.zeros(n, 3).masked_fill_(top < 0, float("-inf")),
        sinks,
        D**-0.5,
    )
    torch.testing.assert_close(sparse, sink_attention(q, dense_kv, csa_dense, sinks, D**-0.5), atol=1e-6, rtol=1e-5)
    hca_bias = torch.zeros(n, C).masked_fill_(torch.arange(C)[None] >= ((qpos + 1) // 2)[:, None], float("-inf"))
    sparse = sparse_sink_attention(q, win_kv, win_bias, ent, hca_bias, sinks, D**-0.5)
    torch.testing.assert_close(
        sparse, sink_attention(q, dense_kv, torch.cat([win_dense, hca_bias], 1), sinks, D**-0.5), atol=1e-6, rtol=1e-5
    )
    sparse = sparse_sink_attention(q, win_kv, win_bias, None, None, sinks, D**-0.5)
    torch.testing.assert_close(sparse, sink_attention(q, keys, win_dense, sinks, D**-0.5), atol=1e-6, rtol=1e-5)
