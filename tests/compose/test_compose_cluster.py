"""The compose cluster for real (issue 46): compose.yaml brought up with podman-compose on the
images `make image` builds here (deploy/compose/local-images.yaml: a Debian base, Debian's Redis,
an OTLP receiver in Jaeger's place), every model service in float32 (tests/compose/fp32.yaml),
and checked from the host through the published ports: the gateway's OpenAI API (8000) and gRPC
(50051). One cluster for the module; the last test takes it down and up again.

podman 4.3 runs a container's health check only when asked (no systemd to time it, and podman-
compose cannot wait on `condition: service_healthy` with it), so the tests ask
(`podman healthcheck run`) until each service is healthy.

Runs in `make test-compose` (.ci/run, after the soak; root). A machine without podman: the
Makefile's `image` step installs it, and a failure to build or start is a failure, not a skip.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmesh.client import GatewayClient, make_request
from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.loader import resolve_model

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kvmesh-test"
FILES = ["compose.yaml", "deploy/compose/local-images.yaml", "tests/compose/fp32.yaml"]
MODEL_SERVICES = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
CHECKED = ["redis", *MODEL_SERVICES, "gateway"]
"""The services with a health check, in start order."""
HTTP = "http://127.0.0.1:8000/v1"
GRPC = "127.0.0.1:50051"
QUESTION = "What is the capital of France?"
NEW_TOKENS = 12
HEALTHY_WITHIN_S = 600.0


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(ROOT / "deploy/podman/containers.conf")),
        "KVMESH_BASE_IMAGE": "localhost/kvmesh-base:bookworm",
    }


def compose(*args: str, timeout_s: float = 600.0) -> str:
    """podman-compose (the venv's) on the project's files; its output. Raises AssertionError
    with the output when it fails."""
    files = [a for f in FILES for a in ("-f", f)]
    cmd = [str(Path(sys.executable).parent / "podman-compose"), "-p", PROJECT, *files, *args]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, f"{' '.join(args)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], env=_env(), capture_output=True, text=True, timeout=120)
    assert not check or r.returncode == 0, f"podman {' '.join(args)}: {r.stderr[-2000:]}"
    return r


def name(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def logs(service: str) -> str:
    """The service's log, as `compose logs SERVICE` shows it (a restarted container's earlier
    lives too)."""
    return compose("logs", service, timeout_s=60)


def wait_healthy(services: list[str], within_s: float = HEALTHY_WITHIN_S) -> None:
    """Run each service's health check until it passes; fail, with the service's log, when one
    exits or is not healthy within within_s seconds."""
    deadline = time.monotonic() + within_s
    pending = list(services)
    while pending:
        for service in list(pending):
            state = podman("inspect", "--format", "{{.State.Status}}", name(service), check=False).stdout.strip()
            assert state == "running", f"{service} is {state or 'gone'}:\n{logs(service)[-3000:]}"
            if podman("healthcheck", "run", name(service), check=False).returncode == 0:
                pending.remove(service)
        if pending:
            assert time.monotonic() < deadline, f"not healthy within {within_s:.0f} s: {pending}\n" + "\n".join(
                f"== {s}\n{logs(s)[-1500:]}" for s in pending
            )
            time.sleep(2)  # a poll of the containers' state


def leftovers() -> list[str]:
    """What the project left: containers, pods, networks, volumes."""
    label = f"label=io.podman.compose.project={PROJECT}"
    found = podman("ps", "-a", "--filter", label, "--format", "container {{.Names}}").stdout.split("\n")
    found += [f"pod {p}" for p in podman("pod", "ps", "--format", "{{.Name}}").stdout.split() if PROJECT in p]
    found += [f"network {n}" for n in podman("network", "ls", "--format", "{{.Name}}").stdout.split() if PROJECT in n]
    found += podman("volume", "ls", "--filter", label, "--format", "volume {{.Name}}").stdout.split("\n")
    return [f for f in found if f.strip()]


def chat(client: openai.OpenAI, **kw) -> str:
    r = client.chat.completions.create(
        model=resolve_model(None).name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        **kw,
    )
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def cluster():
    compose("down")  # what an earlier, interrupted run left
    compose("up", "-d")
    try:
        wait_healthy(CHECKED)
        yield
    finally:
        compose("down")


@pytest.fixture(scope="module")
def openai_client():
    with openai.OpenAI(base_url=HTTP, api_key="none", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def want_ids() -> list[int]:
    """transformers' greedy answer to QUESTION in float32 on the same checkpoint."""
    files = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    ids = load_tokenizer(files).apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def test_every_container_runs_as_a_user_not_root(cluster):
    for service in ["redis", "jaeger", *MODEL_SERVICES, "gateway"]:
        uid = podman("exec", name(service), "id", "-u").stdout.strip()
        assert uid.isdigit() and uid != "0", f"{service} runs as uid {uid!r}"


def test_grpc_and_the_openai_client_answer_transformers_greedy_streamed_or_whole(cluster, openai_client, want_ids):
    async def over_grpc():
        async with GatewayClient(GRPC) as client:
            return await client.complete(make_request(messages=[("user", QUESTION)], max_tokens=NEW_TOKENS), 120)

    answer = asyncio.run(over_grpc())
    assert answer.token_ids == want_ids
    assert chat(openai_client) == answer.text
    stream = openai_client.chat.completions.create(
        model=resolve_model(None).name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer.text
    # and `kvmesh generate`, the command line's client, over the published gRPC port
    cli = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "kvmesh.cli",
            "generate",
            "--gateway",
            GRPC,
            "--chat",
            "--max-tokens",
            str(NEW_TOKENS),
            QUESTION,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and cli.stdout.strip() == answer.text.strip(), cli.stdout + cli.stderr


def test_a_conversation_s_second_turn_reports_cached_tokens(cluster, openai_client):
    session = {"x-session-id": "compose-test-conversation"}
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    first = openai_client.chat.completions.create(
        model=resolve_model(None).name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, extra_headers=session
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And three more?"},
    ]
    second = openai_client.chat.completions.create(
        model=resolve_model(None).name, messages=messages, max_tokens=NEW_TOKENS, temperature=0, extra_headers=session
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens, second.usage


def test_a_request_s_trace_reaches_the_otlp_receiver_from_every_role(cluster, openai_client):
    chat(openai_client)
    deadline = time.monotonic() + 60  # the services export spans in batches, every 5 s
    while True:
        by_trace: dict[str, set[str]] = {}
        for service, trace in re.findall(r"span service=(\S+) name=\S+ trace=(\w+)", logs("jaeger")):
            by_trace.setdefault(trace, set()).add(service.rsplit("-", 1)[0] if service[-1].isdigit() else service)
        if any({"kvmesh-gateway", "kvmesh-prefill", "kvmesh-decode"} <= roles for roles in by_trace.values()):
            return
        assert time.monotonic() < deadline, f"no trace with all three roles: {by_trace}\n{logs('jaeger')[-2000:]}"
        time.sleep(1)  # a poll of the receiver's log


def _status(client: httpx.Client) -> int:
    body = {
        "model": resolve_model(None).name,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 4,
    }
    return client.post("/chat/completions", json=body).status_code


def test_a_killed_decode_is_routed_around_and_serves_again_once_started(cluster):
    compose("kill", "decode-0")
    # podman shows a killed container "stopped" until its clean-up is done, then "exited"
    deadline = time.monotonic() + 30
    while (state := podman("inspect", "--format", "{{.State.Status}}", name("decode-0")).stdout.strip()) not in (
        "exited",
        "stopped",
    ):
        assert time.monotonic() < deadline, f"decode-0 is {state!r} 30 s after the kill"
        time.sleep(0.2)  # a poll of podman's state
    with httpx.Client(base_url=HTTP, timeout=120) as client:
        # answered by decode-1, or refused with a clear status while the gateway learns decode-0 is gone
        seen = []
        deadline = time.monotonic() + 120
        while not seen or seen[-1] != 200:
            seen.append(_status(client))
            assert set(seen) <= {200, 503}, seen
            assert time.monotonic() < deadline, f"no answer within 120 s of the kill: {seen}"
        for _ in range(4):
            assert _status(client) == 200  # decode-1 serves on
        compose("start", "decode-0")
        wait_healthy(["decode-0"])
        served_before = logs("decode-0").count("decode finished")
        deadline = time.monotonic() + 180
        while logs("decode-0").count("decode finished") == served_before:
            assert _status(client) == 200
            assert time.monotonic() < deadline, (
                f"decode-0 served nothing after its restart:\n{logs('decode-0')[-2000:]}"
            )


def test_down_leaves_nothing_and_a_second_up_serves(cluster, openai_client, want_ids):
    compose("down")
    assert leftovers() == []
    compose("up", "-d")
    wait_healthy(CHECKED)
    assert chat(openai_client) != ""
