"""The HTTP front's bounds, probed beside `kvmesh fuzz --http`'s cases (bench/fuzz_http.py):

- a body declared past the size bound gets 413 before it is sent (gateway/http/body.py);
- a body that trickles in is cut with 408 after BODY_READ_S;
- one key with its bound of requests in flight (`--max-requests-per-key`) open as long streams
  gets 429 with Retry-After on the next request, and the bound frees once the streams are left.

Each probe returns "ok" or what came instead.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import httpx

STREAM_TOKENS = 1024
"""Tokens each of the open-streams probe's streams asks for."""


async def _raw_post(base_url: str, declared: int | None, first: bytes, trickle_s: float | None, within_s: float) -> str:
    """POST /v1/completions over a plain socket: the headers (Content-Length `declared`, or chunked
    when None), then `first`, then one more byte every trickle_s seconds (None: nothing more);
    the status line's code once one comes within within_s seconds, else what happened."""
    url = httpx.URL(base_url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        length = f"content-length: {declared}" if declared is not None else "transfer-encoding: chunked"
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {url.host}\r\ncontent-type: application/json\r\n{length}\r\n\r\n"
        )
        chunk = (lambda b: b) if declared is not None else (lambda b: f"{len(b):x}\r\n".encode() + b + b"\r\n")
        writer.write(head.encode() + chunk(first))
        await writer.drain()

        async def keep_trickling() -> None:
            while trickle_s is not None:
                await asyncio.sleep(trickle_s)
                writer.write(chunk(b"x"))
                await writer.drain()

        trickling = asyncio.ensure_future(keep_trickling())
        try:
            line = await asyncio.wait_for(reader.readline(), within_s)
        except TimeoutError:
            return f"no answer within {within_s:.0f} s"
        finally:
            trickling.cancel()
        parts = line.decode("latin-1").split()
        return parts[1] if len(parts) > 1 else f"bad status line {line!r}"
    except OSError as exc:
        return f"connection: {exc!r}"
    finally:
        writer.close()


async def probe_bounds(base_url: str, max_body_bytes: int, read_s: float) -> dict[str, str]:
    """The two bound probes: a body declared past the bound (413 at once, before it is sent) and
    one that trickles in a byte a second (408 within read_s + 10 s). Each: "ok" or what came."""
    declared = await _raw_post(base_url, max_body_bytes + 1, b'{"prompt": "', None, 10.0)
    slow = await _raw_post(base_url, None, b'{"prompt": "', 1.0, read_s + 10.0)
    return {
        "declared_past_the_bound": "ok" if declared == "413" else declared,
        "trickled_body": "ok" if slow == "408" else slow,
    }


def probe_pages(limit: int, page_size: int = 16) -> int:
    """KV pages a decode needs to hold the open-streams probe's `limit` streams at once (each its
    STREAM_TOKENS and a short prompt), at `page_size` tokens a page."""
    return limit * (-(-STREAM_TOKENS // page_size) + 2)


async def probe_open_streams(
    base_url: str,
    model: str,
    limit: int,
    within_s: float = 60.0,
    headers: dict[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
) -> str:
    """Open `limit` long streams (the bound of requests in flight on one key: on an open gateway
    every caller is one key) and wait until each has started (200); then one small request more:
    "ok" when it is a 429 that names the bound and carries Retry-After, and once the streams are
    left a request is answered again (200) within within_s; else what came. headers: sent with
    every request (a key's authorization); verify: httpx's TLS verification. The decode must hold
    `limit` streams at once (`probe_pages`; a stream waiting for a slot has not started)."""
    small = {"model": model, "prompt": "Hi", "max_tokens": 1}
    limits = httpx.Limits(max_connections=limit + 2, max_keepalive_connections=2)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=within_s, limits=limits, headers=headers, verify=verify
    ) as client:
        started: asyncio.Queue[str] = asyncio.Queue()
        streams = [asyncio.ensure_future(_hold_stream(client, model, started)) for _ in range(limit)]
        try:
            over = await _one_past_the_bound(client, small, streams, started, within_s)
        finally:
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        if isinstance(over, str):
            return over
        if over.status_code != 429 or "in flight" not in over.text or "retry-after" not in over.headers:
            return f"with {limit} streams open: {over.status_code} {over.text[:200]} {dict(over.headers)}"
        return await _answered_again(client, small, within_s)


async def _hold_stream(client: httpx.AsyncClient, model: str, started: asyncio.Queue[str]) -> None:
    """One stream of STREAM_TOKENS, read until it ends or is cancelled; puts on `started` "" once
    it has started (200), else what came instead."""
    # long enough to outlive the probe while the streams start (it cancels them)
    body = {"model": model, "prompt": "Count from one to one thousand:", "max_tokens": STREAM_TOKENS}
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "ignore_eos": True, "stream": True}) as r:
            started.put_nowait("" if r.status_code == 200 else f"{r.status_code} {(await r.aread())[:200]!r}")
            async for _ in r.aiter_bytes():
                pass
    except httpx.HTTPError as exc:
        started.put_nowait(repr(exc)[:200])


async def _one_past_the_bound(
    client: httpx.AsyncClient, small: dict, streams: list[asyncio.Future], started: asyncio.Queue[str], within_s: float
) -> httpx.Response | str:
    """Once every stream has started (within within_s), the answer to one small request more,
    sent while all of them are still open; else a str saying what came."""
    limit = len(streams)
    try:
        async with asyncio.timeout(within_s):
            heads = [await started.get() for _ in streams]
        refused = [h for h in heads if h]
        if refused:
            return f"{len(refused)} of the {limit} streams were refused: {refused[0]}"
        over = await client.post("/v1/completions", json=small)
    except TimeoutError:
        return f"the {limit} streams did not all start within {within_s:.0f} s"
    except httpx.HTTPError as exc:
        return f"with {limit} streams open: {exc!r}"[:300]
    ended = sum(t.done() for t in streams)
    if ended:  # the bound was not full when the request came: no verdict on it
        return f"{ended} of the {limit} streams ended before the probe's request ({over.status_code})"
    return over


async def _answered_again(client: httpx.AsyncClient, body: dict, within_s: float) -> str:
    """ "ok" once a POST of body to /v1/completions is answered 200 within within_s (the key's
    streams were left: the bound frees as the gateway sees them go), else what came last."""
    last = "nothing"
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 200:
                return "ok"
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)[:200]
        await asyncio.sleep(0.05)  # a poll of the gateway's state, not a wait for time to pass
    return f"the bound did not free within {within_s:.0f} s of the streams being left (last: {last})"
