"""Stub SGLang workers for the sglang-router replay, and the board of requests in flight they share with it.

Each stub answers enough of SGLang's worker API for the router to register it (every GET gets
an empty JSON object; without a model path the router fetches no tokenizer from the hub) and
holds each /generate until the replay (bench/sglang_router.py) releases it, noting on the
Board which worker received it. Stubs bind 127.0.0.1 on ports the OS picks.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Pending:
    """One request in flight: the stub fills `worker`, the replay sets `release`."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.worker = -1
        self.error: str | None = None
        self.arrived = threading.Event()  # a stub has it (or sending failed: see error)
        self.release = threading.Event()  # the stub may answer it
        self.thread: threading.Thread | None = None


class Board:
    """Requests in flight by rid, shared by the replay and the stub workers."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}

    def add(self, rid: str) -> Pending:
        """Put request `rid` on the board before it is sent."""
        with self._lock:
            p = self._pending[rid] = Pending(rid)
        return p

    def arrive(self, rid: str, worker: int) -> Pending | None:
        """A stub received `rid`: note which worker and wake the replay (None: not on the board)."""
        with self._lock:
            p = self._pending.get(rid)
        if p is not None:
            p.worker = worker
            p.arrived.set()
        return p

    def release_all(self) -> None:
        """Let the stubs answer every request they hold (before the router is stopped)."""
        with self._lock:
            for p in self._pending.values():
                p.release.set()


class _StubHandler(BaseHTTPRequestHandler):
    """A fake SGLang worker: enough for the router to register it, and a held 1-token /generate."""

    protocol_version = "HTTP/1.1"  # keep-alive: the router pools its worker connections
    disable_nagle_algorithm = True  # headers and body go out in two writes; don't stall on ACKs
    worker_index = -1
    board: Board

    def do_GET(self) -> None:
        # /health, /server_info, /model_info, /get_load: an empty object is accepted, and without
        # a model_path the router does not try to fetch a tokenizer from the hub.
        self._reply({})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/generate":
            self._reply({})
            return
        rid = json.loads(body).get("rid")
        p = self.board.arrive(rid, self.worker_index)
        if p is not None:
            p.release.wait(max(0.0, self.board.deadline - time.monotonic()))
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 0,
            "completion_tokens": 1,
            "cached_tokens": 0,
        }
        self._reply({"text": "", "meta_info": meta})

    def _reply(self, obj: dict) -> None:
        out = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would drown the test output


class StubWorker:
    """One stub worker on a free loopback port, served from daemon threads."""

    def __init__(self, index: int, board: Board) -> None:
        handler = type(f"_StubHandler{index}", (_StubHandler,), {"worker_index": index, "board": board})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"sglang-stub-{index}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
