"""Command-line flags that fall back to KVMESH_* environment variables."""

from __future__ import annotations

import argparse
import os


def env_flag(parser: argparse.ArgumentParser, flag: str, env: str, default, help: str, type=str) -> None:
    """Add `flag` whose default is $env when set, else `default`.

    The default goes through `type` only when this parser runs, so a bad variable
    (KVMESH_NUM_PAGES=abc) is reported by the command that uses it, as argparse reports
    a bad flag, never by unrelated commands.
    """
    value = os.environ.get(env)
    shown = "none" if default is None else default
    parser.add_argument(
        flag, type=type, default=value if value is not None else default, help=f"{help} (env {env}; default {shown})"
    )
