"""The operators' dashboard and rules: the committed Grafana JSON is what scripts/gen_dashboards.py
generates, every panel's query is PromQL that promtool accepts and names only metrics the
services export, and deploy/prometheus/rules.yml passes promtool's check."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_dashboards", ROOT / "scripts" / "gen_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_dashboard_is_the_generated_one():
    gen = _generator()
    assert (ROOT / "deploy" / "grafana" / "kvmesh.json").read_text() == gen.render()
    assert len(gen.queries()) >= 20


def test_every_panel_query_is_promql_promtool_accepts(tmp_path):
    queries = _generator().queries()
    lines = ["groups:", "  - name: panels", "    rules:"]
    for i, expr in enumerate(queries):
        lines += [f"      - record: kvmesh:panel_{i}", f"        expr: '{expr.replace(chr(39), chr(39) * 2)}'"]
    rules = tmp_path / "panels.yml"
    rules.write_text("\n".join(lines) + "\n")
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(queries)} rules found" in checked.stdout


def test_the_alert_and_recording_rules_pass_promtool():
    checked = subprocess.run(
        ["promtool", "check", "rules", str(ROOT / "deploy" / "prometheus" / "rules.yml")],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_metric_a_query_or_rule_names_is_one_the_services_export():
    source = "\n".join(
        p.read_text()
        for folder in ("gateway", "prefill_svc", "decode_svc", "runtime")
        for p in (ROOT / folder).rglob("*.py")
    )
    exported = set(re.findall(r'"(kvmesh_[a-z0-9_]+)"', source))
    texts = [*_generator().queries(), (ROOT / "deploy" / "prometheus" / "rules.yml").read_text()]
    named = {m for text in texts for m in re.findall(r"\b(kvmesh_[a-z0-9_]+)", text)}
    for metric in named:
        base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
        assert base in exported or metric in exported, f"{metric} is not a metric any service exports"
