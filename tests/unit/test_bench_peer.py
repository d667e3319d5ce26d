"""`kvmesh bench-peer`'s own logic: without vLLM it says how to get it; its table gives each
side's medians over rounds, the spread, and kvmesh / vLLM of each figure."""

from __future__ import annotations

import argparse
import statistics

from bench.peer import METRICS, _print_table, add_arguments, run


def test_without_vllm_it_says_how_to_install_it(capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--vllm", str(tmp_path / "no-vllm")])) == 2
    assert "make peer-vllm" in capsys.readouterr().err


def _result(tok_s: float, ttft: float) -> dict:
    out = {m: 1.0 for m, _ in METRICS}
    out.update(output_throughput=tok_s, p99_ttft_ms=ttft)
    return out


def test_the_table_gives_medians_spread_and_ratios(capsys):
    kv = [_result(60.0, 500.0), _result(70.0, 700.0), _result(66.0, 650.0)]
    vl = [_result(30.0, 400.0), _result(28.0, 420.0), _result(31.0, 410.0)]
    _print_table({"kvmesh": {"random c=1": kv}, "vLLM": {"random c=1": vl}})
    lines = capsys.readouterr().out.splitlines()
    kv_row = next(line for line in lines if "| kvmesh |" in line)
    ratio_row = next(line for line in lines if "kvmesh / vLLM" in line)
    kv_tok = statistics.median(r["output_throughput"] for r in kv)
    vl_tok = statistics.median(r["output_throughput"] for r in vl)
    assert f"| {kv_tok:.1f} |" in kv_row and "60.0-70.0" in kv_row
    cells = [c.strip() for c in ratio_row.split("|")]
    assert cells[3] == f"{kv_tok / vl_tok:.2f}x"
    ttft_col = 3 + [m for m, _ in METRICS].index("p99_ttft_ms")
    want = statistics.median(r["p99_ttft_ms"] for r in kv) / statistics.median(r["p99_ttft_ms"] for r in vl)
    assert cells[ttft_col] == f"{want:.2f}x"
