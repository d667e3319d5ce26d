# M=rows of activations (tokens), K=input features, N=output features
"""8-bit GEMM paths on CPU against the ones kvmesh runs today (issue 42 item 4), one layer's matmuls.

    python -P -m kvmesh.bench.int8 [--rows 1 4 16 64 2048] [--repeats-seconds 0.2] [--json PATH]

Shapes: SmolLM2-135M's four matmuls of a layer, [M, K] @ [K, N]: q/k/v 576->960, o 576->576,
gate/up 576->3072, down 1536->576, with layer 0's real weights (the bundled GGUF's Q4_1 blocks and
their fp32 dequantization); activations random normal (std 1, seeded). Paths:
- fp32 x@w (MKL); fp32 oneDNN: `kvmesh.kernels.dense.dense_matmul`, prefill's path today on
  non-Intel CPUs (M >= its MIN_ROWS only); bf16 x@w (oneDNN), x and w in bf16;
- Q4_1 blocks: `kvmesh.kernels.quant.quantized_matmul`, fp32 activations, decode's path today (M <= 64);
- int8 dyn <engine>: `torch.ops.quantized.linear_dynamic`, per-channel qint8 weights, activations
  quantized per call to uint8 (per tensor), int8 x int8 products (VNNI): llama.cpp's Q8 activations;
- _int_mm w[K,N] / w[N,K]^T: `torch._int_mm` int8 x int8 -> int32 (oneDNN on x86) alone, quantize and
  rescale excluded, the weight in either layout; "+quant": with per-row symmetric activation
  quantization and the int32 -> fp32 rescale included (what a model would pay);
- w8 <dtype> act: `torch.ops.aten._weight_int8pack_mm`, int8 per-channel weights, bf16 or fp32
  activations; the fp32 one only at M <= 64 (at 2048 rows it took seconds a layer in a trial run).
Tables, one per M: median microseconds of each matmul (median of as many calls as take
--repeats-seconds, after warm-up), their sum over the layer, GFLOP/s of the sum (2*M*K*N summed over
the four / time) and "vs today" = today's path sum / this path's sum (Q4_1 blocks for M <= 64, fp32
oneDNN above; > 1 means faster than today). "-" marks a path not run at that M.
Accuracy at M=16: ||y - y_ref|| / ||y_ref|| of each matmul against fp32 x@w on the same weights.
Caveat: one layer's weights (14 MB fp32) stay in L3 between calls; a real decode step streams 30
layers from DRAM, which favors the formats with fewer bytes a weight (Q4_1 0.75, int8 1, bf16 2, fp32 4).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from kvmesh.kernels.dense import MIN_ROWS, dense_matmul
from kvmesh.kernels.quant import kernel_threads, quantized_matmul

SHAPES = ["q/k/v", "o", "gate/up", "down"]
QUANT_MAX_ROWS = 64  # kvmesh.engine.llama.model.QUANTIZED_MAX_BATCH: decode's blocks up to here
ENGINES = [e for e in ("fbgemm", "x86", "onednn") if e in torch.backends.quantized.supported_engines]
ACCURACY_ROWS = 16


def _load_layer() -> list[dict]:
    """Layer 0's four matmuls: each a dict of the weight in every form a path takes."""
    from kvmesh.engine.llama.runner import LlamaRunner
    from kvmesh.engine.loader import resolve_model

    layer = LlamaRunner(resolve_model(None), num_pages=2).model.layers[0]
    out = []
    for i, name in enumerate(("qkv", "o", "gate_up", "down")):
        w = getattr(layer, f"w_{name}").float().contiguous()  # [K, N]
        scale = w.abs().amax(0).clamp_min(1e-12) / 127  # [N], symmetric per output channel
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)  # [K, N]
        spec = {"w": w, "dnn": layer.dnn[i], "bf16": w.bfloat16(), "q4_1": getattr(layer, f"q_{name}")}
        spec.update(scale=scale, scale_bf16=scale.bfloat16(), q_kn=q.contiguous(), q_nk=q.t().contiguous(), packed={})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors' deprecation notice
            wq = torch.quantize_per_channel(
                w.t().contiguous(), scale.double(), torch.zeros_like(scale).long(), 0, torch.qint8
            )
            for engine in ENGINES:
                torch.backends.quantized.engine = engine
                spec["packed"][engine] = torch.ops.quantized.linear_prepack(wq, None)
        out.append(spec)
    return out


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (int8 [M, K], scale [M, 1]): symmetric per row, as llama.cpp's Q8 rows."""
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x / s).to(torch.int8), s


def _int_mm_quant(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    a, s = _quant_rows(x)
    return torch._int_mm(a, q).float().mul_(s).mul_(scale)


def _dynamic(engine: str) -> Callable:
    def fn(x: torch.Tensor, spec: dict) -> torch.Tensor:
        torch.backends.quantized.engine = engine
        return torch.ops.quantized.linear_dynamic(x, spec["packed"][engine], False)

    return fn


def _every(rows: int) -> bool:
    return True


def _decode(rows: int) -> bool:
    return rows <= QUANT_MAX_ROWS


def _paths() -> dict[str, tuple[Callable, Callable[[int], bool]]]:
    """name -> (fn(x, spec) -> y, runs at M?); x as `_input` casts it, outside the timing."""
    paths = {
        "fp32 x@w (MKL)": (lambda x, s: x @ s["w"], _every),
        "fp32 oneDNN (dense_matmul)": (lambda x, s: dense_matmul(x, s["w"], s["dnn"]), lambda m: m >= MIN_ROWS),
        "bf16 x@w": (lambda x, s: x @ s["bf16"], _every),
        "Q4_1 blocks (quantized_matmul)": (lambda x, s: quantized_matmul(x, s["q4_1"]), _decode),
    }
    for engine in ENGINES:
        paths[f"int8 dyn {engine} (linear_dynamic)"] = (_dynamic(engine), _every)
    if hasattr(torch, "_int_mm"):
        paths["_int_mm w[K,N] alone"] = (lambda a, s: torch._int_mm(a, s["q_kn"]), _every)
        paths["_int_mm w[N,K]^T alone"] = (lambda a, s: torch._int_mm(a, s["q_nk"].t()), _every)
        paths["_int_mm w[K,N] +quant"] = (lambda x, s: _int_mm_quant(x, s["q_kn"], s["scale"]), _every)
        paths["_int_mm w[N,K]^T +quant"] = (lambda x, s: _int_mm_quant(x, s["q_nk"].t(), s["scale"]), _every)
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        w8 = torch.ops.aten._weight_int8pack_mm
        paths["w8 bf16 act (_weight_int8pack_mm)"] = (lambda x, s: w8(x, s["q_nk"], s["scale_bf16"]), _every)
        paths["w8 fp32 act (_weight_int8pack_mm)"] = (lambda x, s: w8(x, s["q_nk"], s["scale"]), _decode)
    return paths


def _input(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation as the path takes it: bf16 for the bf16 paths, int8 rows for _int_mm alone."""
    if name.startswith(("bf16", "w8 bf16")):
        return x.bfloat16()
    if name.endswith("alone"):
        return _quant_rows(x)[0]
    return x


def _median_us(fn: Callable[[], object], seconds: float) -> float:
    """Median microseconds of one call, over as many calls as take `seconds` (at least 3), after two warm-up calls."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    times = []
    for _ in range(max(3, int(seconds / once))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _check_paths(paths: dict, layer: list[dict]) -> dict:
    """Drops (with a note) the paths that fail on this torch/CPU, e.g. an op missing for the CPU."""
    kept = {}
    for name, (fn, runs) in paths.items():
        try:
            for rows in (r for r in (1, 4, 16, 2048) if runs(r)):
                fn(_input(name, torch.randn(rows, layer[0]["w"].shape[0])), layer[0])
            kept[name] = (fn, runs)
        except (RuntimeError, NotImplementedError) as e:
            print(f"skipped {name}: {str(e).splitlines()[0][:160]}")
    return kept


def _time_rows(rows: int, paths: dict, layer: list[dict], seconds: float) -> dict[str, list[float] | None]:
    gen = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, s["w"].shape[0], generator=gen) for s in layer]
    out: dict[str, list[float] | None] = {}
    for name, (fn, runs) in paths.items():
        if not runs(rows):
            out[name] = None
            continue
        out[name] = [_median_us(functools.partial(fn, _input(name, x), s), seconds) for x, s in zip(xs, layer)]
    return out


def _accuracy(paths: dict, layer: list[dict]) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(ACCURACY_ROWS)
    xs = [torch.randn(ACCURACY_ROWS, s["w"].shape[0], generator=gen) for s in layer]
    refs = [x @ s["w"] for x, s in zip(xs, layer)]
    out = {}
    for name, (fn, runs) in paths.items():
        if name.endswith("alone") or not runs(ACCURACY_ROWS):
            continue  # _int_mm alone returns int32 before the rescale: its error is its "+quant" row's
        ys = [fn(_input(name, x), s).float() for x, s in zip(xs, layer)]
        out[name] = [float((y - r).norm() / r.norm()) for y, r in zip(ys, refs)]
    return out


def _print_rows(rows: int, times: dict, layer: list[dict]) -> None:
    today = "Q4_1 blocks (quantized_matmul)" if rows <= QUANT_MAX_ROWS else "fp32 oneDNN (dense_matmul)"
    base = sum(times[today]) if times.get(today) else None
    flops = sum(2 * rows * s["w"].shape[0] * s["w"].shape[1] for s in layer)
    width = max(len(n) for n in times)
    print(f"\nM={rows}  (microseconds a matmul; today = {today})")
    print(f"{'path':<{width}}" + "".join(f"{h:>10}" for h in [*SHAPES, "sum", "GFLOP/s", "vs today"]))
    for name, us in times.items():
        if us is None:
            print(f"{name:<{width}}" + f"{'-':>10}" * 7)
            continue
        total = sum(us)
        vs = f"{base / total:.2f}x" if base else "-"
        cells = [f"{u:.1f}" for u in us] + [f"{total:.1f}", f"{flops / total / 1e3:.1f}", vs]
        print(f"{name:<{width}}" + "".join(f"{c:>10}" for c in cells))


def _print_accuracy(acc: dict[str, list[float]]) -> None:
    width = max(len(n) for n in acc)
    print(f"\naccuracy at M={ACCURACY_ROWS}: ||y - y_ref|| / ||y_ref|| against fp32 x@w")
    print(f"{'path':<{width}}" + "".join(f"{h:>10}" for h in [*SHAPES, "max"]))
    for name, errs in acc.items():
        print(f"{name:<{width}}" + "".join(f"{e:>10.2e}" for e in [*errs, max(errs)]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 2048], help="values of M")
    ap.add_argument("--repeats-seconds", type=float, default=0.2, help="time spent on each median")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    layer = _load_layer()
    paths = _check_paths(_paths(), layer)
    quantized_matmul(torch.randn(1, 576), layer[0]["q4_1"])
    layer_name, numba_threads = kernel_threads()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, quantized engines {ENGINES}; "
        f"numba {layer_name} x{numba_threads}; K->N: "
        + ", ".join(f"{n} {s['w'].shape[0]}->{s['w'].shape[1]}" for n, s in zip(SHAPES, layer))
    )
    results = {}
    for rows in args.rows:
        results[rows] = _time_rows(rows, paths, layer, args.repeats_seconds)
        _print_rows(rows, results[rows], layer)
    acc = _accuracy(paths, layer)
    _print_accuracy(acc)
    if args.json:
        doc = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "shapes": {n: list(s["w"].shape) for n, s in zip(SHAPES, layer)},
            "microseconds": {str(m): t for m, t in results.items()},
            "accuracy_rel_err_m16": acc,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
