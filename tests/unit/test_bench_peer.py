"""`kvmesh bench-peer`'s own logic: without vLLM it says how to get it; its table gives each
side's medians over rounds, the spread, and kvmesh / vLLM of each figure; `--where` finds the
mesh's instances in `kvmesh up`'s output and splits a run's wall time from their counters."""

from __future__ import annotations

import argparse
import statistics

import pytest

from kvmesh.bench.peer import (
    METRICS,
    WHERE_FIELDS,
    WORKLOADS,
    _mesh_addresses,
    _print_table,
    add_arguments,
    kvmesh_server,
    run,
    where,
)


def test_without_vllm_it_says_how_to_install_it(capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--vllm", str(tmp_path / "no-vllm")])) == 2
    assert "make peer-vllm" in capsys.readouterr().err


def test_kvmesh_up_gets_the_extra_arguments_and_long_prompts_are_asked_for_by_name():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plain = parser.parse_args([])
    assert plain.workloads == ["random", "shared-prefix"]  # 2,048-token prompts only when named
    assert kvmesh_server(plain).argv[-2:] == ["--http-port", "8100"]
    args = parser.parse_args(["--kvmesh-args", "--decode-threads 1 --model 'a b'", "--workloads", "long"])
    assert kvmesh_server(args).argv[-4:] == ["--decode-threads", "1", "--model", "a b"]
    assert WORKLOADS[args.workloads[0]][:2] == ["--random-input-len", "2048"]


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


def test_it_finds_the_addresses_kvmesh_up_printed():
    log = (
        "starting kvmesh: 2 prefill, 1 decode ...\n"
        "kvmesh is up: gateway 127.0.0.1:50551, OpenAI HTTP http://127.0.0.1:8100/v1 (prefill 127.0.0.1:4001, "
        "127.0.0.1:4002; decode 127.0.0.1:4003; redis redis://127.0.0.1:6400/0)\n"
    )
    assert _mesh_addresses(log) == (["127.0.0.1:4001", "127.0.0.1:4002"], ["127.0.0.1:4003"])
    with pytest.raises(ValueError):
        _mesh_addresses("starting kvmesh: 1 prefill, 1 decode ...\n")


def test_where_splits_the_wall_time_between_decode_prefill_and_the_rest():
    before = {f"{role}.{f}": 0.0 for role, fields in WHERE_FIELDS.items() for f in fields}
    after = dict(before)
    after.update(
        {
            "decode.num_steps": 400,
            "decode.step_seconds": 20.0,
            "decode.num_generated_tokens": 4000,
            "decode.cpu_share_wait_seconds": 5.0,
            "prefill.num_forwards": 50,
            "prefill.forward_seconds": 25.0,
            "prefill.num_prompt_tokens_computed": 10000,
            "prefill.cpu_share_wait_seconds": 1.0,
        }
    )
    line = where(before, after, wall_s=50.0)
    assert "decode 400 steps 20.0 s (40%), batch 10.0, step 50.0 ms, waited 5.0 s" in line
    assert "prefill 50 forwards 25.0 s (50%), 200 tokens a forward, 400 tok/s, waited 1.0 s" in line
    assert "rest 5.0 s (10%) of 50.0 s" in line
