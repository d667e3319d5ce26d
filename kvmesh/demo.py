"""`make demo`: start a local mesh on the default model, stream a few answers, stop it all."""

from __future__ import annotations

import asyncio
import sys
import tempfile

from kvmesh.client import GatewayClient, make_request
from kvmesh.launcher import start_mesh
from kvmesh.redis_server import free_port

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the boiling point of water in Celsius?",
]


FOLLOW_UP = "Now one about the mountains."
"""The last turn continues the haiku's conversation: decode still holds that turn's pages."""


async def _answer(client: GatewayClient, request) -> str:
    """Stream one answer to stdout, then its figures; return its text."""
    text = []
    async for msg in client.stream(request):
        if msg.HasField("delta"):
            text.append(msg.delta.text)
            sys.stdout.write(msg.delta.text)
            sys.stdout.flush()
        else:
            f, kv = msg.final, msg.final.kv_transfer
            held = f", {kv.decode_cached_pages} held by decode already" if kv.decode_cached_pages else ""
            print(
                f"\n    [{f.finish_reason}; {f.prompt_tokens} prompt tokens ({f.cached_tokens} cached), "
                f"{f.generated_tokens} generated; TTFT {f.ttft_s * 1000:.0f} ms, "
                f"ITL {f.itl_s * 1000:.1f} ms; KV pushed {kv.nbytes / 1e6:.1f} MB in {kv.num_pages} pages{held}]",
                flush=True,
            )
    return "".join(text)


async def _ask(address: str) -> None:
    async with GatewayClient(address) as client:
        answers = []
        for prompt in PROMPTS:
            print(f"\n>>> {prompt}\n", flush=True)
            answers.append(await _answer(client, make_request(prompt, chat=True, max_tokens=96)))
        print(f"\n>>> (the haiku's conversation goes on) {FOLLOW_UP}\n", flush=True)
        turn = [("user", PROMPTS[2]), ("assistant", answers[2]), ("user", FOLLOW_UP)]
        await _answer(client, make_request(messages=turn, chat=True, max_tokens=96))


def main() -> int:
    print(
        "kvmesh demo: starting Redis, 1 prefill, 1 decode and the gateway on the default model "
        "(the first start converts the GGUF, ~20 s) ...",
        flush=True,
    )
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-demo-", suffix=".log", delete=False) as log:
        try:
            mesh = start_mesh(1, 1, port=free_port(), log=log)
        except Exception as exc:
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
            print(f"demo failed to start: {exc}", file=sys.stderr)
            return 1
        try:
            print(f"mesh is up: gateway {mesh.gateway_address} (service logs: {log.name})", flush=True)
            asyncio.run(_ask(mesh.gateway_address))
        finally:
            print("\nstopping the mesh ...", flush=True)
            mesh.stop()
    print("done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
