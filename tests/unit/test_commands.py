"""`kvmesh` finds the lab's subcommands through entry points (kvmesh/commands.py): every one
pyproject declares loads and builds its flags, a found one parses and runs, and a broken one is
skipped without breaking `kvmesh up`. Fake entry points stand in for the installed metadata."""

from __future__ import annotations

import argparse
import logging
import tomllib
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import kvmesh.commands
from kvmesh.cli import build_parser
from kvmesh.commands import GROUP, Command, add_plugin_commands

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> list[EntryPoint]:
    """The entry points pyproject.toml declares in the `kvmesh.commands` group."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        group = tomllib.load(f)["project"]["entry-points"][GROUP]
    return [EntryPoint(name, value, GROUP) for name, value in group.items()]


@dataclass
class FakeEntryPoint:
    """What `add_plugin_commands` reads of an entry point: its name, value and `load()`."""

    name: str
    obj: object = None
    error: Exception | None = None
    value: str = "fake:OBJ"

    def load(self) -> object:
        if self.error is not None:
            raise self.error
        return self.obj


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return parser._subparsers._group_actions[0].choices


def _hello_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--times", type=int, default=1)


HELLO = Command("say hello", _hello_arguments, lambda args: 40 + args.times)


def test_every_declared_command_loads_and_builds_its_flags():
    declared = _declared()
    # the lab's commands, with the names they had when kvmesh/cli.py declared them itself
    assert sorted(ep.name for ep in declared) == [
        "bench",
        "bench-peer",
        "bench-transfer",
        "bench-v4",
        "fuzz",
        "make-tiny-model",
        "routesim",
        "soak",
    ]
    for ep in declared:
        command = ep.load()
        assert isinstance(command, Command), ep
        command.add_arguments(argparse.ArgumentParser())
    parser = argparse.ArgumentParser(prog="kvmesh")
    assert add_plugin_commands(parser.add_subparsers(dest="command"), declared) == sorted(ep.name for ep in declared)
    # the flags each had before the move
    args = parser.parse_args(["bench", "--speculative", "--num-draft-tokens", "3", "--trace", "t.jsonl", "--plot", "d"])
    assert (args.speculative, args.num_draft_tokens, args.trace, args.plot) == (True, 3, "t.jsonl", "d")
    assert args.func is next(ep for ep in declared if ep.name == "bench").load().run
    assert parser.parse_args(["routesim", "trace.jsonl", "--instances", "2"]).instances == 2
    assert parser.parse_args(["fuzz", "--requests", "5", "--json"]).requests == 5


def test_the_command_line_builds_without_the_soak_s_http_clients():
    """Every plugin command's flags are built for any `kvmesh` command but the product's own
    (`kvmesh make-tiny-model`, `kvmesh bench`, `kvmesh --help`): building them imported the
    soak's openai and anthropic clients, ~3 CPU-s of each such command (AMD EPYC Zen 3)."""
    import subprocess
    import sys

    code = (
        "import sys; from kvmesh.cli import build_parser; build_parser(with_plugins=True); "
        "print(sorted(m for m in ('openai', 'anthropic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_found_command_parses_and_runs(monkeypatch):
    monkeypatch.setattr(kvmesh.commands, "entry_points", lambda group: [FakeEntryPoint("hello", HELLO)])
    args = build_parser().parse_args(["hello", "--times", "2"])
    assert args.func(args) == 42


def test_a_broken_command_is_logged_and_skipped(monkeypatch, caplog):
    def failing_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ok")
        raise RuntimeError("flags broke")

    found = [
        FakeEntryPoint("missing", error=ModuleNotFoundError("No module named 'bench'")),
        FakeEntryPoint("not-a-command", obj=object()),
        FakeEntryPoint("half-built", obj=Command("x", failing_arguments, lambda args: 0)),
        FakeEntryPoint("up", obj=HELLO),  # may not replace the product's own
        FakeEntryPoint("hello", obj=HELLO),
    ]
    monkeypatch.setattr(kvmesh.commands, "entry_points", lambda group: found)
    with caplog.at_level(logging.WARNING, logger="kvmesh.commands"):
        parser = build_parser()
    names = set(_subcommands(parser))
    assert "hello" in names and not names & {"missing", "not-a-command", "half-built"}
    skipped = sorted(r.getMessage().split("`")[1] for r in caplog.records)
    assert skipped == ["kvmesh half-built", "kvmesh missing", "kvmesh not-a-command", "kvmesh up"]
    # `kvmesh up` is the product's, flags and all
    args = parser.parse_args(["up", "--prefill", "2"])
    assert args.prefill == 2 and args.func.__name__ == "_cmd_up"


def test_no_entry_points_leaves_the_product_commands(monkeypatch):
    monkeypatch.setattr(kvmesh.commands, "entry_points", lambda group: [])
    names = set(_subcommands(build_parser()))
    assert names == {"up", "generate", "serve", "warm", "eplb", "plan"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench"])


def test_own_commands_list_is_what_the_parser_adds_itself():
    # `kvmesh serve ...` skips the plugin scan because its command is in OWN_COMMANDS: the list
    # must name exactly the commands build_parser adds without plugins
    import argparse

    from kvmesh import cli

    parser = cli.build_parser(with_plugins=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(cli.OWN_COMMANDS)
    with_plugins = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "bench" in with_plugins.choices and "bench" not in sub.choices
