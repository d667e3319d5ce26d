"""One source per setting: each field of a service's config dataclass declares its flag, its
environment variable, its default and its help once, and the command line, the config and the
settings tables of docs/settings.md are all made from that declaration.

    @dataclass(frozen=True)
    class DecodeConfig:
        num_pages: int = setting(1024, "--num-pages", "KV pages in the pool")

    add_arguments(parser, DecodeConfig)      # --num-pages N (env KVMESH_NUM_PAGES; default 1024)
    config = from_args(DecodeConfig, args)   # DecodeConfig(num_pages=N, ...), validated
    markdown_table(DecodeConfig)             # docs/settings.md's rows for it

A flag falls back to its environment variable, then to the default. The variable is read when
the parser is built but converted only when that parser runs, so a bad variable
(KVMESH_NUM_PAGES=abc) is reported by the command that uses it, as argparse reports a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

_KEY = "kvmesh.setting"


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one config field is set from outside: `flag` on the command line, `env` in the
    environment, `help` in both and in docs/settings.md."""

    flag: str
    """e.g. "--num-pages"."""
    env: str
    """e.g. "KVMESH_NUM_PAGES"."""
    help: str
    """One line, no trailing period: what the value means and its unit."""
    kind: str = "value"
    """value: one value converted by `type`; flag: a boolean with --x / --no-x; list: repeatable,
    comma-separated host:port style values collected into a tuple."""
    type: Callable[[str], Any] | None = None
    """Converter of the flag's text; None takes the field's default's type (int, float, str)."""
    metavar: str | None = None
    ge: float | None = None
    """Smallest value allowed (checked by `check_bounds`); None: no lower bound of this kind."""
    gt: float | None = None
    """The value must be above this (checked by `check_bounds`)."""
    le: float | None = None
    """Largest value allowed (checked by `check_bounds`)."""


def setting(
    default: Any,
    flag: str,
    help: str,
    *,
    env: str | None = None,
    kind: str = "value",
    type: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field with its `Setting`; env defaults to KVMESH_ + the flag in capitals
    (--num-pages -> KVMESH_NUM_PAGES). `ge`, `gt`, `le` bound a number (see `check_bounds`).
    Raises ValueError for an unknown kind or a flag without a leading "--"."""
    if kind not in ("value", "flag", "list"):
        raise ValueError(f"kind must be value, flag or list, got {kind!r}")
    if not flag.startswith("--"):
        raise ValueError(f"flag must start with '--', got {flag!r}")
    env = env or "KVMESH_" + flag[2:].upper().replace("-", "_")
    meta = {_KEY: Setting(flag, env, help, kind, type, metavar, ge, gt, le)}
    if kind == "list":
        return dataclasses.field(default=tuple(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def settings_of(config_cls: type) -> list[tuple[dataclasses.Field, Setting]]:
    """The fields of `config_cls` that carry a Setting, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(config_cls) if _KEY in f.metadata]


def check_bounds(config: Any) -> None:
    """Check every bounded Setting field of the dataclass instance `config`, in declaration order.

    Raises ValueError naming the first field out of bounds and its value ("num_pages must be
    >= 1, got 0"; "num_draft_tokens must be in [1, 16], got 17"); NaN fails every bound.
    """
    for field, s in settings_of(type(config)):
        value = getattr(config, field.name)
        if s.ge is not None and s.le is not None:
            if not s.ge <= value <= s.le:
                raise ValueError(f"{field.name} must be in [{s.ge}, {s.le}], got {value}")
        elif s.ge is not None and not value >= s.ge:
            raise ValueError(f"{field.name} must be >= {s.ge}, got {value}")
        elif s.le is not None and not value <= s.le:
            raise ValueError(f"{field.name} must be <= {s.le}, got {value}")
        if s.gt is not None and not value > s.gt:
            raise ValueError(f"{field.name} must be > {s.gt}, got {value}")


def parse_bool(text: str) -> bool:
    """1/true/yes/on -> True, 0/false/no/off -> False (any case); ValueError otherwise."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def env_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    default: Any,
    help: str,
    type: Callable[[str], Any] = str,
    metavar: str | None = None,
    dest: str | None = None,
) -> None:
    """Add `flag` (stored as `dest`, by default the flag's own name) whose default is $env when
    set, else `default` (converted by `type` only when this parser runs)."""
    value = os.environ.get(env)
    shown = "none" if default is None or default == "" else default
    parser.add_argument(
        flag,
        dest=dest or flag[2:].replace("-", "_"),
        type=type,
        metavar=metavar or flag[2:].upper().replace("-", "_"),
        default=value if value is not None else default,
        help=f"{help} (env {env}; default {shown})",
    )


def add_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one flag per Setting field of `config_cls` (see the module docstring)."""
    for field, s in settings_of(config_cls):
        if s.kind == "flag":
            raw = os.environ.get(s.env)
            parser.add_argument(
                s.flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=raw if raw is not None else field.default,
                help=f"{s.help} (env {s.env}=1|0; default {'on' if field.default else 'off'})",
            )
        elif s.kind == "list":
            parser.add_argument(
                s.flag,
                dest=field.name,
                action="append",
                default=None,
                metavar=s.metavar or "HOST:PORT",
                help=f"{s.help} (repeat or comma-separate; env {s.env})",
            )
        else:
            kind = s.type or (type(field.default) if field.default is not None else str)
            env_flag(parser, s.flag, s.env, field.default, s.help, kind, s.metavar, dest=field.name)


def from_args(config_cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """The config built from parsed `args` (and `extra` for fields without a Setting).

    Raises ValueError from the config's own validation, or naming the variable when a boolean
    environment variable holds something else.
    """
    values: dict[str, Any] = dict(extra)
    for field, s in settings_of(config_cls):
        value = getattr(args, field.name)
        if s.kind == "flag" and isinstance(value, str):  # came from the environment
            try:
                value = parse_bool(value)
            except ValueError as exc:
                raise ValueError(f"{s.env}: {exc}") from exc
        elif s.kind == "list":
            given = value or [os.environ.get(s.env, "")]
            value = tuple(a.strip() for v in given for a in v.split(",") if a.strip())
        values[field.name] = value
    return config_cls(**values)


def markdown_table(config_cls: type) -> str:
    """docs/settings.md's table of `config_cls`'s settings: flag, variable, default, meaning."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for field, s in settings_of(config_cls):
        if s.kind == "flag":
            default = "on" if field.default else "off"
            flag = f"`{s.flag}` / `--no-{s.flag[2:]}`"
        else:
            if s.kind == "list":
                default = "(required)" if not field.default else f"`{','.join(field.default)}`"  # type: ignore[arg-type]
            elif field.default is None or field.default == "":
                default = "none"
            else:
                default = f"`{field.default}`"
            flag = f"`{s.flag}`"
        rows.append(f"| {flag} | `{s.env}` | {default} | {s.help.replace('|', '/')} |")
    return "\n".join(rows)
