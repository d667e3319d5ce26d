"""The kernels as PyTorch custom ops (kernels/custom_ops.py): each op equals its reference on
CPU (PyTorch path) and through the Triton kernel in the interpreter, passes torch.library's
opcheck, and traces on fake CUDA tensors (FakeTensorMode) without running a kernel."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import kvmesh.kernels.custom_ops  # noqa: F401 (registers the ops)
from kvmesh.kernels.indexer.ref import indexer_scores_ref
from kvmesh.kernels.moe import route_topk
from kvmesh.kernels.moe.ref import moe_experts_ref
from kvmesh.kernels.ref import paged_decode_attention_ref
from tests.unit.paged_cases import decode_case

ops = torch.ops.kvmesh


def _moe(T=5, H=32, I=16, E=6, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * 4
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w_down = torch.randn(E, H, I, generator=g) / I**0.5
    weights, ids = route_topk(torch.randn(T, E, generator=g), "sqrtsoftplus", K, None, 1.5)
    return x, w_gate_up, w_down, weights, ids


def _indexer(T=4, Hi=3, Di=16, N=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, Hi, Di, generator=g), torch.randn(N, Di, generator=g), torch.rand(T, Hi, generator=g)


def _attention(lens=(1, 6, 13)):
    """paged_cases.decode_case's cache with R = 3 and pages of 4, the table and lengths as int32
    tensors too."""
    q, kv, table = decode_case(3, 6, 2, 16, 4, lens, P=12)
    return q, kv, torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), table, list(lens)


def _check_all_ops(device):
    x, w_gate_up, w_down, weights, ids = _moe()
    got = ops.moe_experts(*(t.to(device) for t in (x, w_gate_up, w_down, weights, ids)), 10.0).cpu()
    torch.testing.assert_close(got, moe_experts_ref(x, w_gate_up, w_down, weights, ids, 10.0), atol=1e-5, rtol=1e-5)
    q, k, w = _indexer()
    got = ops.indexer_scores(q.to(device), k.to(device), w.to(device), 0.25).cpu()
    torch.testing.assert_close(got, indexer_scores_ref(q, k, w, 0.25), atol=1e-5, rtol=1e-5)
    q, kv, table, lens, table_list, lens_list = _attention()
    got = ops.paged_decode_attention(q.to(device), kv.to(device), 1, table.to(device), lens.to(device)).cpu()
    torch.testing.assert_close(got, paged_decode_attention_ref(q, kv, 1, table_list, lens_list), atol=1e-5, rtol=1e-5)


def test_ops_on_cpu_equal_the_references():
    _check_all_ops("cpu")  # the PyTorch paths


def test_ops_through_the_triton_kernels_equal_the_references(triton_device):
    _check_all_ops(triton_device)  # the interpreter on CPU (compiled Triton on a GPU run)


def test_opcheck_schema_and_fake_implementations():
    # torch.library.opcheck: the schema matches what each op does to its inputs, and the fake
    # implementation gives the real one's shapes, dtypes and devices
    x, w_gate_up, w_down, weights, ids = _moe()
    q, k, w = _indexer()
    aq, kv, table, lens, _, _ = _attention()
    for op, args in [
        (ops.moe_experts.default, (x, w_gate_up, w_down, weights, ids, 10.0)),
        (ops.indexer_scores.default, (q, k, w, 0.25)),
        (ops.paged_decode_attention.default, (aq, kv, 1, table, lens)),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_ops_trace_on_fake_cuda_tensors_without_running_a_kernel():
    # FakeTensorMode makes `cuda` tensors on this CPU-only torch: each op's fake implementation
    # gives the output's shape, dtype and device (a kernel, Triton or PyTorch, would fail on
    # tensors that hold no data, or give no fake tensor back)
    with FakeTensorMode(allow_non_fake_inputs=False):
        cuda = torch.device("cuda")
        x = torch.empty(5, 32, device=cuda, dtype=torch.bfloat16)
        out = ops.moe_experts(
            x,
            torch.empty(6, 32, 32, device=cuda, dtype=torch.bfloat16),
            torch.empty(6, 32, 16, device=cuda, dtype=torch.bfloat16),
            torch.empty(5, 2, device=cuda),
            torch.empty(5, 2, device=cuda, dtype=torch.int64),
            10.0,
        )
        assert (out.shape, out.dtype, out.device.type) == ((5, 32), torch.bfloat16, "cuda")
        scores = ops.indexer_scores(
            torch.empty(4, 3, 16, device=cuda, dtype=torch.bfloat16),
            torch.empty(37, 16, device=cuda, dtype=torch.bfloat16),
            torch.empty(4, 3, device=cuda),
            0.25,
        )
        assert (scores.shape, scores.dtype, scores.device.type) == ((4, 37), torch.float32, "cuda")
        attn = ops.paged_decode_attention(
            torch.empty(3, 9, 64, device=cuda, dtype=torch.bfloat16),
            torch.empty(100, 30, 2, 16, 3, 64, device=cuda, dtype=torch.bfloat16),
            7,
            torch.empty(3, 8, device=cuda, dtype=torch.int32),
            torch.empty(3, device=cuda, dtype=torch.int32),
        )
        assert (attn.shape, attn.dtype, attn.device.type) == ((3, 9, 64), torch.bfloat16, "cuda")
        assert all(isinstance(t, FakeTensor) for t in (out, scores, attn))


def test_the_cpu_path_of_paged_decode_attention_rejects_shapes_that_disagree():
    q, kv, table, lens, _, _ = _attention()
    with pytest.raises(ValueError, match="layer"):
        ops.paged_decode_attention(q, kv, 5, table, lens)
