"""The committed generated code matches protos/kvmesh/v1/*.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_proto_code_is_up_to_date():
    # regenerates into a temporary folder and compares byte for byte
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_servicers_do_not_leak_wire_types_into_the_core():
    # STYLE.md: the engine, the pools and the router never import *_pb2
    for folder in ("engine", "kvstore", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            assert "_pb2" not in path.read_text(), path
    assert "_pb2" not in (ROOT / "gateway" / "router.py").read_text()
