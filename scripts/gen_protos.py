"""Regenerate the Python code for protos/kvmesh/v1/*.proto (committed next to them).

Run: `python scripts/gen_protos.py` (writes) or `python scripts/gen_protos.py --check`
(exits 1 when the committed files are stale). Uses grpcio-tools' bundled protoc.

The .proto files live under `protos/` as their package says (`kvmesh/v1/decode.proto` holds
`package kvmesh.v1`), the layout protoc users of any language expect (`-I protos`). The
Python code installs as `kvmesh.protos.v1` (pyproject's package-dir maps `protos/kvmesh` there),
so the stubs' imports of each other, which protoc writes from the .proto paths
(`from kvmesh.v1 import common_pb2`), are pointed into that package.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "kvmesh" / "v1"
_STUB_IMPORT = re.compile(r"^(from )kvmesh\.v1 import", re.MULTILINE)


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto into out_root/kvmesh/v1 and point the stubs' imports into
    kvmesh.protos.v1; return the outputs."""
    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    outputs = sorted((out_root / "kvmesh" / "v1").glob("*_pb2*.py*"))
    for path in outputs:
        path.write_text(_STUB_IMPORT.sub(r"\1kvmesh.protos.v1 import", path.read_text()))
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    if not args.check:
        with tempfile.TemporaryDirectory() as tmp:
            for path in generate(Path(tmp)):
                (PROTO_DIR / path.name).write_bytes(path.read_bytes())
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            f.name
            for f in fresh
            if not (PROTO_DIR / f.name).exists() or not filecmp.cmp(f, PROTO_DIR / f.name, shallow=False)
        ]
        extra = {p.name for p in PROTO_DIR.glob("*_pb2*.py*")} - {f.name for f in fresh}
    if stale or extra:
        print(f"generated proto code is stale: {sorted(stale) + sorted(extra)}; run python scripts/gen_protos.py")
        return 1
    print("generated proto code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
