"""One source per setting: flags, variables, defaults, --help and docs/settings.md come
from the config dataclasses' `setting(...)` declarations (runtime/settings.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvmesh import settings_doc
from kvmesh.cli import build_parser
from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.gateway.config import GatewayConfig
from kvmesh.prefill_svc.config import PrefillConfig
from kvmesh.runtime.settings import add_arguments, from_args, settings_of

CONFIGS = (GatewayConfig, PrefillConfig, DecodeConfig)
GATEWAY_ADDRS = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]


def _parse(cls, argv, monkeypatch=None, env=None):
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, cls)
    return from_args(cls, parser.parse_args(argv))


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_config_field_is_a_declared_setting(cls):
    declared = {f.name for f, _ in settings_of(cls)}
    assert declared == {f.name for f in dataclasses.fields(cls)}
    flags = [s.flag for _, s in settings_of(cls)]
    envs = [s.env for _, s in settings_of(cls)]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)


@pytest.mark.parametrize("cls", CONFIGS)
def test_no_flags_give_the_declared_defaults(cls, monkeypatch):
    for _, s in settings_of(cls):
        monkeypatch.delenv(s.env, raising=False)
    argv = GATEWAY_ADDRS if cls is GatewayConfig else []
    config = _parse(cls, argv)
    extra = (
        {"prefill_addresses": ("127.0.0.1:1",), "decode_addresses": ("127.0.0.1:2",)} if cls is GatewayConfig else {}
    )
    assert config == cls(**extra)


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    monkeypatch.delenv("KVMESH_NUM_PAGES", raising=False)
    assert _parse(DecodeConfig, []).num_pages == 1024
    assert _parse(DecodeConfig, [], monkeypatch, {"KVMESH_NUM_PAGES": "7"}).num_pages == 7
    assert _parse(DecodeConfig, ["--num-pages", "9"], monkeypatch, {"KVMESH_NUM_PAGES": "7"}).num_pages == 9
    assert _parse(GatewayConfig, GATEWAY_ADDRS + ["--max-queue-time", "5"]).max_queue_time_s == 5.0


def test_a_bad_variable_is_reported_by_the_command_that_reads_it(monkeypatch):
    monkeypatch.setenv("KVMESH_NUM_PAGES", "abc")
    with pytest.raises(argparse.ArgumentError, match="abc"):
        _parse(DecodeConfig, [])
    monkeypatch.delenv("KVMESH_NUM_PAGES")
    monkeypatch.setenv("KVMESH_PREFIX_CACHING", "maybe")
    with pytest.raises(ValueError, match="KVMESH_PREFIX_CACHING"):
        _parse(PrefillConfig, [])


def test_boolean_and_list_settings(monkeypatch):
    monkeypatch.delenv("KVMESH_PREFIX_CACHING", raising=False)
    assert _parse(PrefillConfig, []).enable_prefix_caching is True
    assert _parse(PrefillConfig, ["--no-prefix-caching"]).enable_prefix_caching is False
    assert _parse(PrefillConfig, [], monkeypatch, {"KVMESH_PREFIX_CACHING": "0"}).enable_prefix_caching is False
    assert _parse(
        PrefillConfig, ["--prefix-caching"], monkeypatch, {"KVMESH_PREFIX_CACHING": "0"}
    ).enable_prefix_caching
    assert _parse(DecodeConfig, [], monkeypatch, {"KVMESH_KV_DIGEST": "1"}).kv_digest is True
    argv = ["--prefill", "a:1, b:2", "--prefill", "c:3", "--decode", "d:4"]
    assert _parse(GatewayConfig, argv).prefill_addresses == ("a:1", "b:2", "c:3")
    config = _parse(GatewayConfig, [], monkeypatch, {"KVMESH_PREFILL": "e:5,f:6", "KVMESH_DECODE": "g:7"})
    assert config.prefill_addresses == ("e:5", "f:6") and config.decode_addresses == ("g:7",)
    with pytest.raises(ValueError, match="at least one prefill address"):
        _parse(GatewayConfig, [], monkeypatch, {"KVMESH_PREFILL": "", "KVMESH_DECODE": "g:7"})


def test_registries_validate_their_names():
    with pytest.raises(ValueError, match=r"routing policy must be one of \['cache_aware'"):
        _parse(GatewayConfig, GATEWAY_ADDRS + ["--routing-policy", "nearest"])
    with pytest.raises(ValueError, match=r"kernel backend must be one of \['torch', 'triton'\]"):
        _parse(DecodeConfig, ["--kernel-backend", "cuda"])
    with pytest.raises(ValueError, match=r"KV transport must be one of \['ucx'\]"):
        _parse(PrefillConfig, ["--kv-transport", "tcp"])


def test_serve_help_lists_every_setting_with_its_variable():
    parser = build_parser()
    for name, cls in (("gateway", GatewayConfig), ("prefill", PrefillConfig), ("decode", DecodeConfig)):
        sub = parser._subparsers._group_actions[0].choices["serve"]._subparsers._group_actions[0].choices[name]
        text = sub.format_help()
        for _, s in settings_of(cls):
            assert s.flag in text and s.env in text, (name, s.flag)


def test_docs_settings_tables_are_the_generated_ones():
    text = settings_doc.SETTINGS_DOC.read_text()
    assert settings_doc.replace_block(text, settings_doc.render()) == text, (
        "docs/settings.md's tables are stale: run `python -m kvmesh.settings_doc --write`"
    )
