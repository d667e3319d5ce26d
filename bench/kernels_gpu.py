# T=tokens (queries), H=hidden, I=expert intermediate size, E=routed experts, K=experts per
# token, Hi=indexer heads, Di=indexer head_dim, N=compressed indexer entries
"""Check and time the Triton MoE and Lightning Indexer kernels on a GPU, next to the PyTorch path.

    python -m kvmesh.bench.kernels_gpu [--no-tests] [--no-bench]

Without a CUDA GPU it prints "no CUDA GPU: nothing to benchmark" and exits 0. With one:
1. runs tests/unit/test_moe_kernels.py, test_indexer_kernels.py and
   test_paged_decode_kernel.py with KVMESH_TEST_DEVICE=cuda, so their Triton tests run compiled on the GPU, not interpreted;
2. at DeepSeek-V4 shapes (H=4096, I=2048, E=256, K=6; indexer Hi=64, Di=128, N=4096; bf16)
   checks each Triton result against the PyTorch path and prints milliseconds, TFLOP/s and
   GB/s of both. Bytes count what must move at least once: the experts the batch touches
   plus activations in and out; q, k, head weights and the fp32 scores for the indexer.
Exits 1 if the tests or a check fail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILES = [
    "tests/unit/test_moe_kernels.py",
    "tests/unit/test_indexer_kernels.py",
    "tests/unit/test_paged_decode_kernel.py",
]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, over finite entries (the indexer masks with -inf)."""
    got, want = got.float(), want.float()
    keep = torch.isfinite(want)
    return float((got[keep] - want[keep]).norm() / want[keep].norm().clamp_min(1e-30))


def _row(name: str, path: str, ms: float, flops: float, nbytes: float, err: str = "") -> None:
    print(f"{name:<44} {path:<7} {ms:9.3f} ms {flops / ms / 1e9:9.2f} TFLOP/s {nbytes / ms / 1e6:9.1f} GB/s  {err}")


def bench_moe(tokens: tuple[int, ...], H: int = 4096, I: int = 2048, E: int = 256, K: int = 6) -> bool:
    """Routed experts at DeepSeek-V4 shapes, bf16: Triton against the PyTorch path."""
    from triton.testing import do_bench

    from kvmesh.kernels.moe import moe_experts, moe_experts_triton, route_topk

    dev, dt = "cuda", torch.bfloat16
    w_gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt).mul_(H**-0.5)  # [E, 2I, H]
    w_down = torch.randn(E, H, I, device=dev, dtype=dt).mul_(I**-0.5)  # [E, H, I]
    ok = True
    for T in tokens:
        x = torch.randn(T, H, device=dev, dtype=dt)
        weights, ids = route_topk(torch.randn(T, E, device=dev), "sqrtsoftplus", K, None, 1.5)
        want = moe_experts(x, w_gate_up, w_down, weights, ids, 10.0)
        got = moe_experts_triton(x, w_gate_up, w_down, weights, ids, 10.0)
        err = _rel_err(got, want)
        ok &= err < 2e-2
        flops = 6.0 * T * K * H * I  # gate_up (2*2I*H) and down (2*H*I) per assignment
        touched = int(ids.unique().numel())
        nbytes = touched * 3 * I * H * 2 + 2 * T * H * 2
        name = f"moe_experts T={T} H={H} I={I} E={E} K={K}"
        _row(
            name,
            "triton",
            do_bench(lambda: moe_experts_triton(x, w_gate_up, w_down, weights, ids, 10.0)),
            flops,
            nbytes,
            f"rel err vs torch {err:.1e}" + ("" if err < 2e-2 else "  FAIL"),
        )
        _row(name, "torch", do_bench(lambda: moe_experts(x, w_gate_up, w_down, weights, ids, 10.0)), flops, nbytes)
    return ok


def bench_indexer(tokens: tuple[int, ...], Hi: int = 64, Di: int = 128, N: int = 4096, top_k: int = 512) -> bool:
    """Lightning Indexer scores at DeepSeek-V4 shapes, bf16 q/k: Triton against PyTorch."""
    from triton.testing import do_bench

    from kvmesh.kernels.indexer import indexer_scores, indexer_scores_triton, indexer_topk

    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(N, Di, device=dev, dtype=dt)  # [N, Di]
    ok = True
    for T in tokens:
        q = torch.randn(T, Hi, Di, device=dev, dtype=dt)  # [T, Hi, Di]
        w = torch.randn(T, Hi, device=dev) * Hi**-0.5  # [T, Hi]
        num_valid = torch.randint(1, N + 1, (T,), device=dev)
        scale = Di**-0.5
        want = indexer_scores(q, k, w, scale)
        got = indexer_scores_triton(q, k, w, scale)
        err = _rel_err(got, want)
        ok &= err < 1e-4
        # the fused mask is exactly the unmasked scores with -inf past num_valid
        masked = indexer_scores_triton(q, k, w, scale, num_valid)
        selectable = torch.arange(N, device=dev)[None, :] < num_valid[:, None]  # [T, N]
        same_mask = torch.equal(masked, got.masked_fill(~selectable, float("-inf")))
        ok &= same_mask
        flops = 2.0 * T * Hi * N * Di
        nbytes = T * Hi * Di * 2 + N * Di * 2 + T * Hi * 4 + T * N * 4
        name = f"indexer_scores T={T} Hi={Hi} Di={Di} N={N}"
        _row(
            name,
            "triton",
            do_bench(lambda: indexer_scores_triton(q, k, w, scale)),
            flops,
            nbytes,
            f"rel err vs torch {err:.1e}, mask exact: {same_mask}" + ("" if err < 1e-4 and same_mask else "  FAIL"),
        )
        _row(name, "torch", do_bench(lambda: indexer_scores(q, k, w, scale)), flops, nbytes)
        ms = do_bench(lambda: indexer_topk(want, top_k, num_valid))
        print(f"{f'indexer_topk T={T} N={N} k={top_k}':<44} {'torch':<7} {ms:9.3f} ms")
    return ok


def run_tests() -> bool:
    """The two kernel test files with their Triton tests on the GPU; True if they pass."""
    env = dict(os.environ, KVMESH_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", *TEST_FILES], cwd=REPO, env=env)
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest run on CUDA")
    parser.add_argument("--no-bench", action="store_true", help="skip the microbenchmarks")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    ok = True
    if not args.no_tests:
        ok &= run_tests()
    if not args.no_bench:
        torch.manual_seed(0)
        ok &= bench_moe((1, 16, 256))
        ok &= bench_indexer((1, 16, 256))
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
