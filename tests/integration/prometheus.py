"""A real Prometheus (Debian's `prometheus`) scraping a test's mesh: its start, its HTTP API, and
waits on its scrapes, for the tests that ask it every dashboard query."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

NEEDS_A_FEATURE = {
    "kvmesh_moe_expert_balancedness": "an MoE model (the observed mesh serves the dense default)",
    "kvmesh_decode_accepted_draft_tokens": "speculative decoding (--speculative)",
}
"""Dashboard queries the observed mesh cannot give data to, by a part of the query, and why."""


@contextlib.contextmanager
def prometheus(targets: list[str], tmp_path) -> Iterator[str]:
    """Debian's prometheus scraping `targets` ("host:port") every second; yields its HTTP API's URL."""
    from kvmesh.redis_server import free_port

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "kvmesh", "static_configs": [{"targets": targets}]}],
            }
        )
    )
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def api(url: str, path: str, **params) -> dict:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]


def scrapes(url: str, targets: list[str], at_least: int, timeout_s: float = 60) -> None:
    """Wait until Prometheus has scraped each of `targets` `at_least` more times than now, all up."""

    def counts() -> dict[str, float]:
        result = api(url, "/api/v1/query", query="count_over_time(up[10m])")["result"]
        return {r["metric"]["instance"]: float(r["value"][1]) for r in result}

    def all_up() -> bool:
        return all(t["health"] == "up" for t in api(url, "/api/v1/targets")["activeTargets"])

    deadline = time.monotonic() + timeout_s
    start: dict[str, float] | None = None
    while True:
        try:
            now = counts()
            start = now if start is None else start
            if all(now.get(t, 0) - start.get(t, 0) >= at_least for t in targets) and all_up():
                return
        except OSError:  # not listening yet
            pass
        assert time.monotonic() < deadline, f"prometheus did not scrape every target {at_least} more times"
        time.sleep(0.2)


def values(url: str, expr: str) -> list[float]:
    """The query's finite values now."""
    result = api(url, "/api/v1/query", query=expr, time=f"{time.time():.3f}")["result"]
    return [v for v in (float(r["value"][1]) for r in result) if math.isfinite(v)]


def has_data(url: str, expr: str) -> bool:
    """The query answers at least one finite value now."""
    return bool(values(url, expr))
