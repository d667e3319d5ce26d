"""Logging for kvmesh services: one format for people, one for machines (`--log-format json`).

Every line logged while a request is being served carries its request id and trace id:
servicers set `request_context` (a contextvar, so each RPC's task has its own) and a filter
adds both to the record. Text lines end with ` request=<id> trace=<id>`; JSON lines are one
object each with time, service, level, logger, message, request_id and trace_id.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os

request_context: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("kvmesh_request", default=("", ""))
"""(request id, trace id) of the request the current task serves."""


class _RequestFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rid, tid = request_context.get()
        request_id, trace_id = getattr(record, "request_id", rid), getattr(record, "trace_id", tid)
        record.request_id, record.trace_id = request_id, trace_id
        record.request_suffix = "".join(f" {k}={v}" for k, v in (("request", request_id), ("trace", trace_id)) if v)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record),
            "service": self.service,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", ""),
            "trace_id": getattr(record, "trace_id", ""),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(service: str, fmt: str | None = None) -> None:
    """Configure root logging once per process: level from KVMESH_LOG_LEVEL (default INFO),
    format `fmt` or KVMESH_LOG_FORMAT ("text", the default, or "json")."""
    fmt = fmt or os.environ.get("KVMESH_LOG_FORMAT", "text")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(_RequestFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s%(request_suffix)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("KVMESH_LOG_LEVEL", "INFO").upper())
