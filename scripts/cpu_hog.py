"""Run a command with every core kept busy beside it: how CI on a loaded machine feels.

    python scripts/cpu_hog.py [--procs N] -- python -m pytest -q tests/integration/test_observability.py

Starts N busy-loop processes (default: one per core), runs the command, stops them (SIGKILL,
by their own pids) and exits with the command's status. Not a test: it proves that tests
wait on state rather than on time (STYLE.md, Tests).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _spin() -> None:
    while True:
        pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1, help="busy-loop processes (default: cores)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(args.procs)]
    for hog in hogs:
        hog.start()
    print(f"cpu_hog: {args.procs} busy loops ({[h.pid for h in hogs]}) beside: {' '.join(command)}", flush=True)
    started = time.monotonic()
    try:
        rc = subprocess.call(command)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()
    print(f"cpu_hog: command exited {rc} after {time.monotonic() - started:.1f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
