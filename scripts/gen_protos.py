"""Regenerate the Python code for protos/kvmesh/v1/*.proto (committed next to them).

Run: `python scripts/gen_protos.py` (writes) or `python scripts/gen_protos.py --check`
(exits 1 when the committed files are stale). Uses grpcio-tools' bundled protoc.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "kvmesh" / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto into out_root (same relative layout); return the outputs."""
    protos = sorted(p.relative_to(ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "protos" / "kvmesh" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
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
