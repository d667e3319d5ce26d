"""Generate kvmesh's Grafana dashboard (deploy/grafana/kvmesh.json) from code, with grafanalib, and
the Prometheus Operator's copy of the rules (deploy/k8s/components/monitoring/prometheusrule.yaml,
a PrometheusRule around deploy/prometheus/rules.yml).

Run: `python scripts/gen_dashboards.py` (writes) or `python scripts/gen_dashboards.py --check`
(exits 1 when a committed file is stale, as scripts/gen_protos.py does for the stubs).
`PANELS` is the one list of what an operator sees, each panel's PromQL over the metrics the
services export (docs/operations.md lists them); tests/unit/test_dashboards.py checks every
query with promtool, and the alert and recording rules in deploy/prometheus/rules.yml.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard, GridPos, RowPanel, Target, Templating, TimeSeries

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana" / "kvmesh.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULE_OUT = ROOT / "deploy" / "k8s" / "components" / "monitoring" / "prometheusrule.yaml"
DATASOURCE = "${datasource}"


def _q(quantile: float, metric: str) -> str:
    return f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket[5m])))"


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"p{int(q * 100)}", _q(q, metric)) for q in (0.5, 0.9, 0.99)]


PANELS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]]]]]] = [
    (
        "Requests and latency",
        [
            ("Requests by status", "reqps", "", [("{{status}}", "sum by (status) (rate(kvmesh_requests_total[1m]))")]),
            (
                "Errors by status",
                "reqps",
                "",
                [("{{status}}", 'sum by (status) (rate(kvmesh_requests_total{status!="OK"}[5m]))')],
            ),
            ("TTFT", "s", "", _quantiles("kvmesh_request_ttft_seconds")),
            ("ITL", "s", "", _quantiles("kvmesh_request_itl_seconds")),
            ("End to end", "s", "", _quantiles("kvmesh_request_e2e_seconds")),
            (
                "SLO attainment",
                "percentunit",
                "Requests with an SLO that met it (TTFT and ITL), and those shed at routing",
                [
                    (
                        "met",
                        'sum(rate(kvmesh_gateway_slo_requests_total{outcome="met"}[5m])) '
                        "/ sum(rate(kvmesh_gateway_slo_requests_total[5m]))",
                    ),
                    (
                        "shed",
                        'sum(rate(kvmesh_gateway_slo_requests_total{outcome="shed"}[5m])) '
                        "/ sum(rate(kvmesh_gateway_slo_requests_total[5m]))",
                    ),
                ],
            ),
            (
                "TTFT prediction",
                "percentunit",
                "Requests whose predicted TTFT was within 25% of the measured one",
                [
                    (
                        "within 25%",
                        '(sum(rate(kvmesh_gateway_ttft_prediction_ratio_bucket{le="1.25"}[5m])) '
                        '- sum(rate(kvmesh_gateway_ttft_prediction_ratio_bucket{le="0.75"}[5m]))) '
                        "/ sum(rate(kvmesh_gateway_ttft_prediction_ratio_count[5m]))",
                    )
                ],
            ),
        ],
    ),
    (
        "Tokens and the prefix cache",
        [
            (
                "Tokens per second",
                "short",
                "Prompt tokens in (computed and cached) and tokens out",
                [
                    (
                        "in",
                        "sum(rate(kvmesh_prefill_computed_tokens_total[1m])) "
                        "+ sum(rate(kvmesh_prefix_cache_hit_tokens_total[1m]))",
                    ),
                    ("out", "sum(rate(kvmesh_decode_generated_tokens_total[1m]))"),
                ],
            ),
            (
                "Prefix hit ratio",
                "percentunit",
                "Prompt tokens prefill reused over all it served: in all, loaded from the second tier, "
                "pulled from a peer",
                [
                    (
                        source,
                        f"sum(rate({metric}[5m])) / (sum(rate(kvmesh_prefix_cache_hit_tokens_total[5m])) "
                        "+ sum(rate(kvmesh_prefill_computed_tokens_total[5m])))",
                    )
                    for source, metric in (
                        ("hit", "kvmesh_prefix_cache_hit_tokens_total"),
                        ("from the tier", "kvmesh_prefill_tier_hit_tokens_total"),
                        ("pulled", "kvmesh_prefill_pulled_tokens_total"),
                    )
                ],
            ),
            (
                "Prefill queue",
                "short",
                "Requests and prompt tokens queued or computing, per prefill instance",
                [
                    ("requests {{instance}}", "kvmesh_prefill_queue_depth"),
                    ("tokens {{instance}}", "kvmesh_prefill_queued_tokens"),
                ],
            ),
        ],
    ),
    (
        "KV pages and transfer",
        [
            (
                "KV pages",
                "short",
                "Pages referenced by requests and pages holding cached blocks, per instance",
                [("used {{instance}}", "kvmesh_kv_pages_used"), ("cached {{instance}}", "kvmesh_kv_pages_cached")],
            ),
            ("KV push bytes", "Bps", "", [("pushed", "sum(rate(kvmesh_kv_transfer_bytes_total[1m]))")]),
            ("KV push latency", "s", "", _quantiles("kvmesh_kv_transfer_seconds")),
        ],
    ),
    (
        "Decode",
        [
            ("Running batch", "short", "", [("{{instance}}", "kvmesh_decode_running_batch_size")]),
            (
                "Expert balancedness",
                "percentunit",
                "Mean over max tokens per expert, the worst MoE layer per instance (MoE models)",
                [("{{instance}}", "min by (instance) (kvmesh_moe_expert_balancedness)")],
            ),
            (
                "Speculative acceptance",
                "short",
                "Draft tokens kept per verification (--speculative)",
                [
                    (
                        "{{instance}}",
                        "sum by (instance) (rate(kvmesh_decode_accepted_draft_tokens_sum[5m])) "
                        "/ sum by (instance) (rate(kvmesh_decode_accepted_draft_tokens_count[5m]))",
                    )
                ],
            ),
        ],
    ),
    (
        "Planner",
        [
            (
                "Instances and the advice",
                "short",
                "Routable instances of each role and how many the load needs against the SLO "
                "(kvmesh.gateway.scale_advice: what kvmesh up --autoscale and KEDA scale to)",
                [
                    ("{{role}} routable", "max by (role) (kvmesh_gateway_instances)"),
                    ("{{role}} advised", "max by (role) (kvmesh_gateway_desired_instances)"),
                ],
            ),
        ],
    ),
]
"""(row, [(panel title, unit, description, [(legend, PromQL)])]) in the order they are laid out."""


def queries() -> list[str]:
    """Every panel's every query."""
    return [expr for _, panels in PANELS for _, _, _, targets in panels for _, expr in targets]


def dashboard() -> Dashboard:
    """The dashboard: a row per group, two panels a line, a data source chosen at import."""
    panels: list = []
    y = 0
    for row, group in PANELS:
        panels.append(RowPanel(title=row, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for i, (title, unit, description, targets) in enumerate(group):
            panels.append(
                TimeSeries(
                    title=title,
                    description=description,
                    dataSource=DATASOURCE,
                    unit=unit,
                    targets=[
                        Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + k), datasource=DATASOURCE)
                        for k, (legend, expr) in enumerate(targets)
                    ],
                    gridPos=GridPos(h=8, w=12, x=12 * (i % 2), y=y + 8 * (i // 2)),
                )
            )
        y += 8 * ((len(group) + 1) // 2)
    datasource = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
    return Dashboard(
        title="kvmesh",
        uid="kvmesh-overview",
        description="Requests, latency and SLOs, tokens and the prefix cache, KV pages and transfer, decode",
        tags=["kvmesh"],
        timezone="browser",
        refresh="10s",
        panels=panels,
        templating=Templating(list=[datasource]),
    ).auto_panel_ids()


def render() -> str:
    return json.dumps(dashboard().to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def prometheus_rule() -> str:
    """deploy/prometheus/rules.yml as a PrometheusRule (its `groups` are the spec's)."""
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvmesh"},
        "spec": yaml.safe_load(RULES.read_text()),
    }
    header = "# Generated from deploy/prometheus/rules.yml by scripts/gen_dashboards.py: edit that file, then run it.\n"
    return header + yaml.safe_dump(rule, sort_keys=False, width=200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = parser.parse_args()
    outputs = {OUT: render(), RULE_OUT: prometheus_rule()}
    if args.check:
        stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale; run python scripts/gen_dashboards.py")
        if not stale:
            print("the Grafana dashboard and the PrometheusRule are up to date")
        return 1 if stale else 0
    for path, text in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
