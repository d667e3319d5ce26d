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


async def _ask(address: str) -> None:
    async with GatewayClient(address) as client:
        for prompt in PROMPTS:
            print(f"\n>>> {prompt}\n", flush=True)
            async for msg in client.stream(make_request(prompt, chat=True, max_tokens=96)):
                if msg.HasField("delta"):
                    sys.stdout.write(msg.delta.text)
                    sys.stdout.flush()
                else:
                    f = msg.final
                    print(
                        f"\n    [{f.finish_reason}; {f.prompt_tokens} prompt tokens ({f.cached_tokens} cached), "
                        f"{f.generated_tokens} generated; TTFT {f.ttft_s * 1000:.0f} ms, "
                        f"ITL {f.itl_s * 1000:.1f} ms; KV pushed {f.kv_transfer.nbytes / 1e6:.1f} MB "
                        f"in {f.kv_transfer.num_pages} pages]",
                        flush=True,
                    )


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
