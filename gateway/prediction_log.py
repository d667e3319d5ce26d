"""The TTFT predictor's log (--predictor-log PATH): one JSON object a line for each routed request
at its end, with the prediction's inputs and parts, the TTFT then measured and the parts of it
prefill measured, so that an operator can see which part the predictor misses and refit it
offline (llm-d trains its latency predictor on such records; the gateway's own calibration,
kvmesh.gateway.predictor, learns online from the same TTFTs, at each first token).

A line (seconds unless named otherwise; `at` and `routed_at` are Unix time):

    {"at": 1765090004.221, "request_id": "...", "routed_at": 1765090000.123,
     "prefill": "10.0.0.5:50051", "core_group": "", "prompt_tokens": 1536, "cached_tokens": 256,
     "decode_cached_pages": 0, "jobs_ahead": 1, "prefills_busy": 2,
     "queue_s": 0.84, "compute_s": 1.92, "push_s": 0.03, "raw_s": 2.79, "predicted_s": 2.95,
     "share": 0.5, "rows": 6, "measured_s": 3.10,
     "measured_queue_s": 0.71, "measured_compute_s": 2.30, "measured_push_s": 0.02,
     "pull_s": 0.0, "measured_cached_tokens": 256}

jobs_ahead counts the routed requests at that prefill not yet computed in the predictor's model
(kvmesh.gateway.prefill_queues), prefills_busy the instances of its core group with work there;
share and rows are the prediction's (kvmesh.gateway.predictor.TtftPrediction).

predicted_s and measured_s both count from the request's routing (not its arrival: its wait in
the admission queue is not the predictor's). The measured_* parts are prefill's
(kvmesh.gateway.slo_watch.measured_parts): its wait from the request's arrival there to its
compute (a pull's seconds, pull_s, included), the compute's wall time, the push after it. The
predicted compute_s is the compute's own seconds, and the turns it waits on shared cores are in
the predicted queue_s, so the parts compare as sums: queue_s + compute_s against
measured_queue_s + measured_compute_s, push_s against measured_push_s. A request that fails
after its first token has no line. The file rotates at MAX_BYTES (one old file kept, PATH.1),
so the log never fills a disk. Strings are JSON-escaped: a request id from a client stays data
on one line.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from typing import Any

MAX_BYTES = 64 * 1024 * 1024
"""Bytes the log grows to before it rotates (PATH -> PATH.1; the older one is dropped)."""


class PredictionLog:
    """Appends prediction records to `path` (OSError when it cannot be opened)."""

    def __init__(self, path: str) -> None:
        self._logger = logging.getLogger(f"kvmesh.gateway.predictions.{id(self)}")
        self._logger.propagate = False  # records go to the file only, never to the service log
        self._logger.setLevel(logging.INFO)
        self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=1)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)

    def write(self, record: dict[str, Any]) -> None:
        """One record (JSON-serialisable values) as a line, stamped with `at` (Unix seconds)."""
        self._logger.info(json.dumps({"at": round(time.time(), 3), **record}, separators=(",", ":")))

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()
