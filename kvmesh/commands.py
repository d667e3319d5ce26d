"""Subcommands other packages add to `kvmesh` (the lab's `kvmesh bench`, `routesim`, `fuzz`).

A package declares each one as an entry point of the group ``kvmesh.commands`` in its
pyproject.toml; the entry point's name is the subcommand, its object a `Command`:

    [project.entry-points."kvmesh.commands"]
    bench = "kvmesh.bench.cli:BENCH"

`kvmesh.cli` adds every one it finds after its own commands, so the product names none of
them and never imports the package that provides them. A command that fails to load or to add
its flags is logged and skipped: a broken benchmark must not stop `kvmesh up`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

logger = logging.getLogger(__name__)

GROUP = "kvmesh.commands"


@dataclass(frozen=True)
class Command:
    """One `kvmesh NAME ...` subcommand provided by another package."""

    help: str
    """The one line `kvmesh --help` shows beside the name."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the command's flags to its (empty) parser; imports nothing heavy (no torch), since
    every `kvmesh` invocation, `kvmesh up` included, builds every parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs the command on the parsed flags; returns the process exit status."""

    def main(self, prog: str, argv: list[str] | None = None) -> int:
        """Parse `argv` (default: sys.argv[1:]) as `prog` and run: a module's `python -m` entry."""
        parser = argparse.ArgumentParser(prog=prog, description=self.help)
        self.add_arguments(parser)
        return self.run(parser.parse_args(argv))


def add_plugin_commands(sub: Any, found: Iterable[EntryPoint] | None = None) -> list[str]:
    """Add each entry point of `GROUP` (default: those of the installed distributions) as a
    subcommand of `sub` (the `argparse` subparsers action), in name order; returns the names
    added. One that does not load, is not a `Command`, takes a name already taken, or raises
    while adding its flags is logged (a warning) and skipped, leaving `sub` as it was."""
    if found is None:
        found = entry_points(group=GROUP)
    added = []
    for ep in sorted(found, key=lambda ep: ep.name):
        try:
            if ep.name in sub.choices:
                raise ValueError(f"`kvmesh {ep.name}` already exists")
            command = ep.load()
            if not isinstance(command, Command):
                raise TypeError(f"{ep.value} is a {type(command).__name__}, not a kvmesh.commands.Command")
            # the flags go on a parser of their own first, so a failure adds no half-built command
            flags = argparse.ArgumentParser(add_help=False)
            command.add_arguments(flags)
        except Exception as exc:
            logger.warning("skipping the command `kvmesh %s` (%s): %s: %s", ep.name, ep.value, type(exc).__name__, exc)
            continue
        parser = sub.add_parser(ep.name, help=command.help, parents=[flags])
        parser.set_defaults(func=command.run)
        added.append(ep.name)
    return added
