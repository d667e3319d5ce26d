"""DeepSeek-V4 MoE kernels against kernels/moe/ref.py and transformers' own modules.

Routers against `DeepseekV4TopKRouter` / `DeepseekV4HashRouter`, the PyTorch experts against
`DeepseekV4Experts` on the same weights, the Triton experts under the interpreter on CPU
(KVMESH_TEST_DEVICE=cuda, as `python -m kvmesh.bench.kernels_gpu` sets it, runs them on a GPU).
"""

import os
import subprocess
import sys

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Experts,
    DeepseekV4HashRouter,
    DeepseekV4TopKRouter,
)

from kvmesh.kernels.moe import moe_experts, moe_experts_triton, route_hash, route_topk
from kvmesh.kernels.moe.ref import moe_experts_ref, route_hash_ref, route_topk_ref
from kvmesh.kernels.moe.triton_moe import BlockSizes, align_block_size

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _config(**overrides) -> DeepseekV4Config:
    args = dict(
        hidden_size=32,
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=3,
        vocab_size=50,
        num_hidden_layers=2,
        routed_scaling_factor=2.5,
        swiglu_limit=10.0,
        experts_implementation="eager",
    )  # DeepseekV4Experts' own per-expert loop
    args.update(overrides)
    return DeepseekV4Config(**args)


def _by_expert_id(weights, ids):
    """Sort each token's K picks by expert id: transformers' topk(sorted=False) order is free."""
    ids_sorted, perm = ids.sort(dim=-1)
    return weights.gather(1, perm), ids_sorted


# --- routing -----------------------------------------------------------------------------


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_topk_matches_reference(scoring_func):
    logits = torch.randn(11, 16) * 3
    bias = torch.randn(16) * 0.1
    weights, ids = route_topk(logits, scoring_func, 6, bias, 1.5)
    ref_weights, ref_ids = route_topk_ref(logits, scoring_func, 6, bias, 1.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)  # same experts, same order
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(weights.sum(-1), torch.full((11,), 1.5))  # normalised, scaled


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])  # transformers' ACT2FN
def test_route_topk_matches_transformers_router(scoring_func):
    cfg = _config(scoring_func=scoring_func, n_routed_experts=16, num_experts_per_tok=6)
    router = DeepseekV4TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32))
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.5)  # large: it changes picks
    hidden = torch.randn(2, 5, 32)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = route_topk(logits, scoring_func, 6, router.e_score_correction_bias, 2.5)
    hf_weights, hf_ids = _by_expert_id(hf_weights, hf_ids)
    weights, ids = _by_expert_id(weights, ids)
    torch.testing.assert_close(ids, hf_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, hf_weights)


def test_route_topk_equal_scores_go_to_the_lower_expert_id():
    # token 0: experts 1, 2 and 4 tie for first; token 1: all eight tie
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0, 0.0, 0.0, 0.0], [0.5] * 8])
    _, ids = route_topk(logits, "sigmoid", 2, torch.zeros(8), 1.0)
    assert ids.tolist() == [[1, 2], [0, 1]]
    _, ids = route_topk(torch.zeros(1, 8), "sqrtsoftplus", 5, None, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3, 4]]
    # ties made by the bias, exact in fp32: sigmoid(0) = 0.5, sigmoid(40) = 1.0, so
    # score + bias = [1.0, 1.0, 1.0, 0.5]: expert 0 beats the higher-scoring expert 1
    weights, ids = route_topk(
        torch.tensor([[0.0, 40.0, 0.0, 0.0]]), "sigmoid", 2, torch.tensor([0.5, 0.0, 0.5, 0.0]), 3.0
    )
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0]]))  # [0.5, 1.0] / 1.5 * 3


def test_route_topk_weights_ignore_the_bias():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])  # picks expert 0 first, but never weights it
    weights, ids = route_topk(logits, "sigmoid", 2, bias, 1.0)
    s = torch.sigmoid(logits[0])
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights[0], torch.stack([s[0], s[3]]) / (s[0] + s[3]))


def test_route_topk_rejects_bad_arguments():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="scoring_func must be one of"):
        route_topk(logits, "relu", 2, None, 1.0)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\].*got 0"):
        route_topk(logits, "sigmoid", 0, None, 1.0)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\].*got 9"):
        route_topk(logits, "sigmoid", 9, None, 1.0)
    with pytest.raises(ValueError, match="correction_bias"):
        route_topk(logits, "sigmoid", 2, torch.zeros(7), 1.0)


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
def test_route_hash_matches_transformers_router_and_reference(scoring_func):
    cfg = _config(scoring_func=scoring_func)
    router = DeepseekV4HashRouter(cfg)
    tid2eid = torch.stack([torch.randperm(8)[:3] for _ in range(50)])  # [V, K] distinct experts
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32))
        router.tid2eid.copy_(tid2eid)
    hidden, input_ids = torch.randn(2, 5, 32), torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden, input_ids)
    weights, ids = route_hash(logits, scoring_func, tid2eid, input_ids, 2.5)
    # the table's order is kept: no sorting needed to compare
    torch.testing.assert_close(ids, hf_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, hf_weights)
    ref_weights, ref_ids = route_hash_ref(logits, scoring_func, tid2eid, input_ids, 2.5)
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights)


def test_route_hash_rejects_token_ids_outside_the_table():
    tid2eid = torch.zeros(50, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\).*\[3, 50\]"):
        route_hash(torch.randn(2, 8), "sigmoid", tid2eid, torch.tensor([3, 50]), 1.0)
    with pytest.raises(ValueError, match=r"\[-1, 3\]"):
        route_hash(torch.randn(2, 8), "sigmoid", tid2eid, torch.tensor([-1, 3]), 1.0)
    with pytest.raises(ValueError, match="input_ids has 3 tokens"):
        route_hash(torch.randn(2, 8), "sigmoid", tid2eid, torch.tensor([1, 2, 3]), 1.0)


# --- experts, PyTorch path ---------------------------------------------------------------


def _moe_inputs(T, H, I, E, K, scale=1.0, dtype=torch.float32):
    x = torch.randn(T, H) * scale
    w_gate_up = torch.randn(E, 2 * I, H) / H**0.5
    w_down = torch.randn(E, H, I) / I**0.5
    weights, ids = route_topk(torch.randn(T, E), "sqrtsoftplus", K, None, 1.5)
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights, ids


def _transformers_experts(w_gate_up, w_down, limit):
    E, I2, H = w_gate_up.shape
    cfg = _config(
        hidden_size=H,
        moe_intermediate_size=I2 // 2,
        n_routed_experts=E,
        swiglu_limit=float("inf") if limit is None else limit,
    )
    experts = DeepseekV4Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w_gate_up)
        experts.down_proj.copy_(w_down)
    return experts


@pytest.mark.parametrize(
    "T,E,K,limit,scale,idle",
    [
        (1, 8, 1, 10.0, 1.0, True),  # one decode token, one expert
        (7, 8, 3, 10.0, 1.0, True),  # K>1, some experts get no tokens
        (33, 16, 6, 0.5, 4.0, False),  # the clamp is active: large inputs, small limit
        (20, 4, 4, None, 4.0, False),  # no clamp; every token on every expert
    ],
)
def test_moe_experts_matches_transformers_experts(T, E, K, limit, scale, idle):
    H, I = 32, 24
    x, w_gate_up, w_down, weights, ids = _moe_inputs(T, H, I, E, K, scale)
    assert (ids.unique().numel() < E) == idle  # the case is what its comment says
    experts = _transformers_experts(w_gate_up, w_down, limit)
    with torch.no_grad():
        hf = experts(x, ids, weights)
    out = moe_experts(x, w_gate_up, w_down, weights, ids, limit)
    torch.testing.assert_close(out, hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, moe_experts_ref(x, w_gate_up, w_down, weights, ids, limit), atol=1e-5, rtol=1e-5)
    if limit is not None and limit < 1:  # guard the case: the clamp really changed values
        unclamped = moe_experts(x, w_gate_up, w_down, weights, ids, None)
        assert (unclamped - out).abs().max() > 0.1


def test_moe_experts_never_reads_experts_without_tokens():
    x, w_gate_up, w_down, _, _ = _moe_inputs(5, 32, 24, 8, 2)
    ids = torch.tensor([[1, 6], [6, 1], [1, 6], [6, 1], [1, 6]])  # only experts 1 and 6
    weights = torch.rand(5, 2)
    unused = [0, 2, 3, 4, 5, 7]
    w_gate_up[unused] = float("nan")  # a read would poison the output
    w_down[unused] = float("nan")
    out = moe_experts(x, w_gate_up, w_down, weights, ids, 10.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, moe_experts_ref(x, w_gate_up, w_down, weights, ids, 10.0), atol=1e-5, rtol=1e-5)


def test_moe_experts_bf16_close_to_fp32_reference():
    x, w_gate_up, w_down, weights, ids = _moe_inputs(9, 64, 32, 8, 3, dtype=torch.bfloat16)
    out = moe_experts(x, w_gate_up, w_down, weights, ids, 10.0)
    assert out.dtype == torch.bfloat16
    ref = moe_experts_ref(x, w_gate_up, w_down, weights, ids, 10.0)  # fp32 math, same inputs
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_moe_experts_rejects_bad_arguments():
    x, w_gate_up, w_down, weights, ids = _moe_inputs(3, 32, 24, 8, 2)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\), got \[0, 8\]"):
        moe_experts(x, w_gate_up, w_down, weights, torch.tensor([[0, 8]] * 3), None)
    with pytest.raises(ValueError, match="w_down"):
        moe_experts(x, w_gate_up, w_down[:, :, :5], weights, ids, None)
    with pytest.raises(ValueError, match=r"weights and expert_ids \[3, K\]"):
        moe_experts(x, w_gate_up, w_down, weights[:2], ids[:2], None)
    with pytest.raises(ValueError, match="share a dtype"):
        moe_experts(x.double(), w_gate_up, w_down, weights, ids, None)


def test_moe_experts_no_tokens():
    x, w_gate_up, w_down, weights, ids = _moe_inputs(3, 32, 24, 8, 2)
    out = moe_experts(x[:0], w_gate_up, w_down, weights[:0], ids[:0], None)
    assert out.shape == (0, 32)


# --- experts, Triton path ----------------------------------------------------------------


def test_align_block_size_pads_each_expert_group_to_the_block():
    # tokens' experts: t0 -> 2, 0; t1 -> 2, 1; t2 -> 0, 2. Assignment a = t*K + k, sentinel 6.
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    al = align_block_size(ids, num_experts=4, block_m=4)
    pad = 6
    assert al.sorted_ids.tolist()[:12] == [
        1,
        4,
        pad,
        pad,  # expert 0: (t0,k1), (t2,k0)
        3,
        pad,
        pad,
        pad,  # expert 1: (t1,k1)
        0,
        2,
        5,
        pad,
    ]  # expert 2: (t0,k0), (t1,k0), (t2,k1)
    assert set(al.sorted_ids.tolist()[12:]) <= {pad}
    assert al.num_padded.tolist() == [12]
    assert al.block_expert.tolist()[:3] == [0, 1, 2]  # blocks past row 12 exit unread


@pytest.mark.parametrize(
    "T,E,K,H,I,limit,blocks",
    [
        (5, 6, 2, 72, 40, 10.0, None),  # default blocks: partial K and N tiles
        (1, 8, 3, 40, 24, 10.0, None),  # decode: one token
        (9, 4, 3, 40, 24, 0.5, BlockSizes(16, 16, 16)),  # clamp active, several K and N tiles
        (40, 3, 2, 24, 20, None, BlockSizes(16, 16, 16)),  # groups larger than a row block
    ],
)
def test_moe_experts_triton_matches_reference(triton_device, T, E, K, H, I, limit, blocks):
    x, w_gate_up, w_down, weights, ids = _moe_inputs(T, H, I, E, K, scale=4.0)
    dev = triton_device
    out = moe_experts_triton(
        x.to(dev), w_gate_up.to(dev), w_down.to(dev), weights.to(dev), ids.to(dev), limit, block_sizes=blocks
    )
    ref = moe_experts_ref(x, w_gate_up, w_down, weights, ids, limit)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_moe_experts_triton_never_reads_experts_without_tokens(triton_device):
    x, w_gate_up, w_down, _, _ = _moe_inputs(4, 40, 24, 6, 2)
    ids = torch.tensor([[4, 1], [1, 4], [4, 1], [1, 4]])
    weights = torch.rand(4, 2)
    unused = [0, 2, 3, 5]
    w_gate_up[unused] = float("nan")
    w_down[unused] = float("nan")
    dev = triton_device
    out = moe_experts_triton(x.to(dev), w_gate_up.to(dev), w_down.to(dev), weights.to(dev), ids.to(dev), 10.0).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, moe_experts_ref(x, w_gate_up, w_down, weights, ids, 10.0), atol=1e-5, rtol=1e-5)


def test_moe_experts_triton_bf16_close_to_fp32_reference(triton_device):
    x, w_gate_up, w_down, weights, ids = _moe_inputs(6, 40, 24, 5, 2, dtype=torch.bfloat16)
    dev = triton_device
    out = moe_experts_triton(x.to(dev), w_gate_up.to(dev), w_down.to(dev), weights.to(dev), ids.to(dev), 10.0).cpu()
    assert out.dtype == torch.bfloat16
    ref = moe_experts_ref(x, w_gate_up, w_down, weights, ids, 10.0)  # fp32 math
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# --- the GPU benchmark without a GPU -----------------------------------------------------


def test_bench_gpu_without_a_gpu_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.bench.kernels_gpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU: nothing to benchmark" in proc.stdout
