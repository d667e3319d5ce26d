"""`kvmesh soak`'s flags, apart from bench/soak/run.py: building the `kvmesh` command line (every
plugin command's flags) imports this, not the soak's clients, whose openai and anthropic imports
took ~3 CPU-s of every `kvmesh make-tiny-model`, `kvmesh bench` and `kvmesh --help`."""

from __future__ import annotations

import argparse

from kvmesh.bench.soak.faults import FAULT_KINDS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of load and faults (default 3600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the fault schedule (default 0)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    p.add_argument("--fault-gap", default="5:15", help="seconds between faults, LO:HI (default 5:15)")
    p.add_argument("--faults", default="", help=f"fault kinds, comma-separated (default all: {','.join(FAULT_KINDS)})")
    p.add_argument("--json", default="", help="write the verdict to this file too")
    p.add_argument("--plot", default="", help="draw the run over time into this PNG")
    p.add_argument("--table", default="", help="print the fault table of a verdict JSON (markdown) and exit")
    p.add_argument("--workdir", default="", help="keep the services' logs and the outcomes here (default: a temp dir)")
