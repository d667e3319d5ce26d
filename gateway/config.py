"""Configuration of the gateway: one `setting` per field declares its flag, variable, default
and help (runtime/settings.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvmesh.gateway.router import check_policy
from kvmesh.gateway.slo import SLO_MISS, Slo
from kvmesh.runtime.service_config import drain_grace_setting, metrics_port_setting, redis_url_setting
from kvmesh.runtime.settings import setting


def port_or_off(text: str) -> int:
    """A port number; "off" (or "none") is 0, nothing served."""
    return 0 if text.strip().lower() in ("off", "none") else int(text)


def _tool_parser(name: str) -> str:
    """A --tool-parser value: a name in kvmesh.gateway.tools.TOOL_PARSERS (ValueError otherwise)."""
    from kvmesh.gateway.tools import TOOL_PARSERS

    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}: one of {', '.join(sorted(TOOL_PARSERS))}")
    return name


def _instance_addresses_setting(role: str) -> Any:
    """The `--prefill` / `--decode` field: instances named on the command line (a list)."""
    return setting(
        (),
        f"--{role}",
        f"a {role} instance's gRPC address, routed to beside those the registry lists "
        "(required unless --redis-url is given with --discover)",
        env=f"KVMESH_{role.upper()}",
        kind="list",
    )


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of a gateway, built once in main() from flags and KVMESH_* variables."""

    prefill_addresses: tuple[str, ...] = _instance_addresses_setting("prefill")
    decode_addresses: tuple[str, ...] = _instance_addresses_setting("decode")
    model: str | None = setting(
        None, "--model", "model name or path whose tokenizer the gateway uses (none: SmolLM2-135M-Instruct)"
    )
    host: str = setting("127.0.0.1", "--host", "address the gRPC server binds to")
    port: int = setting(50051, "--port", "gRPC port clients connect to")
    http_port: int = setting(
        0,
        "--http-port",
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health); "
        "0 or off: none (`kvmesh up` serves it on 8000)",
        type=port_or_off,
    )
    tool_parser: str = setting(
        "json",
        "--tool-parser",
        "how tool calls are found in a free answer (tool_choice auto): json (the answer is a JSON array of "
        "{name, arguments}, what kvmesh's tool prompt asks for) or hermes (<tool_call> blocks)",
        type=_tool_parser,
    )
    api_key_file: str = setting(
        "",
        "--api-key-file",
        "file of API keys, one a line, that callers must send as 'Authorization: Bearer <key>' (HTTP header "
        "or gRPC metadata), each its own prefix-cache tenant unless followed by a namespace it shares "
        "('<key> <namespace>'); KVMESH_API_KEYS adds comma-separated ones; none: the gateway is open",
    )
    tls_cert: str = setting("", "--tls-cert", "PEM certificate (chain) of the gRPC and HTTP ports; with --tls-key")
    tls_key: str = setting("", "--tls-key", "PEM private key of --tls-cert (empty: plain TCP)")
    redis_url: str = redis_url_setting(
        "Redis holding the prefix index and the instance registry (empty: route by load alone, to the listed instances)"
    )
    max_sessions: int = setting(
        100_000,
        "--max-sessions",
        "sessions (x-session-id) whose last turn's instances the gateway remembers, least recently used "
        "dropped first; 0: no session affinity",
        ge=0,
    )
    slo_ttft_ms: float = setting(
        0.0,
        "--slo-ttft-ms",
        "TTFT target (milliseconds) of requests that set none (the gRPC field slo_ttft_ms, the header "
        "x-slo-ttft-ms): routed where the predicted TTFT meets it, most prefix reuse first; 0: none (routing by "
        "prefix and load alone)",
        ge=0,
    )
    slo_itl_ms: float = setting(
        0.0,
        "--slo-itl-ms",
        "inter-token latency target (milliseconds) of requests that set none (slo_itl_ms, x-slo-tpot-ms): decode "
        "is picked among the instances predicted to meet it; 0: none",
        ge=0,
    )
    slo_miss: str = setting(
        "queue",
        "--slo-miss",
        "what a request no instance is predicted to serve within its SLO gets: queue (routed where its predicted "
        "TTFT is least) or shed (refused at once, RESOURCE_EXHAUSTED / HTTP 429, retry-after from the prediction)",
    )
    predictor_log: str = setting(
        "",
        "--predictor-log",
        "append each routed request's TTFT prediction, its inputs, the TTFT measured and the parts of it "
        "prefill measured to this file at the request's end, one JSON object a line "
        "(kvmesh.gateway.prediction_log; rotates at 64 MiB); empty: no log",
    )
    response_ttl_s: float = setting(
        30 * 24 * 3600.0,
        "--response-ttl",
        "seconds a stored response of /v1/responses (store: true) stays retrievable and continuable by "
        "previous_response_id: in --redis-url's Redis when there is one (every gateway shares them), else in "
        "this gateway's memory (the 10,000 most recent)",
        gt=0,
    )
    session_from_user: bool = setting(
        False,
        "--session-from-user",
        "an OpenAI request's `user` field names its session when it sends no x-session-id header",
        kind="flag",
    )
    discover: bool = setting(
        True,
        "--discover",
        "add the prefill and decode instances the registry in --redis-url lists, and stop routing to those "
        "that leave it (drained, or their lease lapsed)",
        kind="flag",
    )
    discovery_interval_s: float = setting(
        1.0,
        "--discovery-interval",
        "seconds between reads of the instance registry: the longest a new instance waits for traffic, "
        "and a drained one's window for a request that is then retried elsewhere",
    )
    page_size: int = setting(
        16, "--page-size", "tokens per block; must equal the services' page size (block hashes depend on it)"
    )
    default_max_tokens: int = setting(256, "--default-max-tokens", "max_tokens when a request leaves it unset")
    max_tokens_limit: int = setting(4096, "--max-tokens-limit", "largest max_tokens a request may ask for")
    cache_threshold: float = setting(
        0.3,
        "--cache-threshold",
        "fraction of the prompt a cached prefix must cover to steer routing (SGLang's cache_threshold)",
    )
    load_weight: float = setting(
        0.02, "--load-weight", "weight of queued prefill tokens against uncached prompt tokens in the routing cost"
    )
    decode_hit_slack: int = setting(
        2,
        "--decode-hit-slack",
        "active requests a decode instance may carry beyond the least loaded one and still be picked for holding "
        "more of the prompt (decode-side prefix reuse: those pages are not pushed again); 0: least load alone",
        ge=0,
    )
    decode_reuse_min_blocks: int = setting(
        4,
        "--decode-reuse-min-blocks",
        "leading prompt blocks the chosen decode instance must hold (as the prefix index says) for the gateway to "
        "send Reserve before Prefill and have prefill skip them: the wait for Reserve's answer costs a round trip "
        "that a shorter hit does not pay back",
        ge=1,
    )
    pull_min_blocks: int = setting(
        4,
        "--pull-min-blocks",
        "leading prompt blocks another prefill instance must hold beyond the chosen one's for the gateway to name "
        "it as the place to pull them from (the chosen instance pulls when its estimate says that beats "
        "computing them); 0: never",
        ge=0,
    )
    tier_hit_weight: float = setting(
        0.5,
        "--tier-hit-weight",
        "what a prompt block in a prefill instance's second KV tier saves in the routing cost, against one in its "
        "page pool (1) and a miss (0)",
        ge=0,
        le=1,
    )
    routing_policy: str = setting(
        "cache_aware",
        "--routing-policy",
        "prefill routing policy: cache_aware, round_robin, random, consistent_hash or least_load",
    )
    rpc_timeout_s: float = setting(
        10.0, "--rpc-timeout", "deadline of the small control RPCs (Reserve, Release, GetStats), seconds"
    )
    prefill_timeout_base_s: float = setting(
        30.0,
        "--prefill-timeout-base",
        "a Prefill call's deadline: this many seconds plus the tokens queued on the instance "
        "(this prompt's included) at --prefill-min-rate",
    )
    prefill_min_tokens_per_s: float = setting(
        20.0,
        "--prefill-min-rate",
        "slowest prefill rate (tokens/s) a live instance is expected to keep (2 busy CPU cores manage ~40; "
        "a frozen instance is found by the channel's pings within seconds, not by this)",
    )
    token_timeout_s: float = setting(
        8.0,
        "--token-timeout",
        "longest wait (seconds) for the next token of a decode stream before the decode instance is taken "
        "for lost and the request fails with UNAVAILABLE naming it",
    )
    max_queued_requests: int = setting(
        4096, "--max-queued-requests", "requests that may wait for a decode slot (more: RESOURCE_EXHAUSTED)"
    )
    max_queued_tokens: int = setting(
        4_000_000, "--max-queued-tokens", "prompt tokens that may wait for a decode slot (more: RESOURCE_EXHAUSTED)"
    )
    max_queue_time_s: float = setting(
        600.0, "--max-queue-time", "seconds a request may wait for a decode slot before RESOURCE_EXHAUSTED"
    )
    max_requests_per_key: int = setting(
        0,
        "--max-requests-per-key",
        "requests one API key may have in flight, queued or running (more: RESOURCE_EXHAUSTED / 429; 0: no bound)",
    )
    max_queued_tokens_per_key: int = setting(
        0,
        "--max-queued-tokens-per-key",
        "prompt tokens one API key may have waiting for prefill (more: RESOURCE_EXHAUSTED / 429; 0: no bound)",
    )
    stats_interval_s: float = setting(0.5, "--stats-interval", "seconds between polls of instances' load and health")
    wait_for_instances_s: float = setting(
        0.0,
        "--wait-for-instances",
        "seconds to wait at start-up for every --prefill and --decode instance to report SERVING before this "
        "gateway does (0: do not wait); `kvmesh up` starts its gateway beside its instances with this set",
    )
    metrics_port: int = metrics_port_setting()
    drain_grace_s: float = drain_grace_setting()

    def __post_init__(self) -> None:
        self._check_instances()
        self._check_routing()
        self._check_durations()
        self._check_queue_bounds()
        self._check_fronts()
        self._check_max_tokens()

    def _check_instances(self) -> None:
        """Instances to route to (listed, or found in the registry), each listed one host:port."""
        if not self.discovers:
            if not self.prefill_addresses:
                raise ValueError(
                    "at least one prefill address is required (--prefill host:port), "
                    "or a --redis-url whose registry lists them (with --discover)"
                )
            if not self.decode_addresses:
                raise ValueError(
                    "at least one decode address is required (--decode host:port), "
                    "or a --redis-url whose registry lists them (with --discover)"
                )
        for flag, addresses in (("--prefill", self.prefill_addresses), ("--decode", self.decode_addresses)):
            for a in addresses:
                host, _, port = a.rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ValueError(f"{flag} needs host:port with a port in [1, 65535], got {a!r}")

    def _check_routing(self) -> None:
        """The page size, the routing policy and its load weight."""
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 token (the same on every service), got {self.page_size}")
        check_policy(self.routing_policy)
        if not (math.isfinite(self.load_weight) and self.load_weight >= 0):
            raise ValueError(f"load_weight must be a finite number >= 0, got {self.load_weight}")
        if self.slo_miss not in SLO_MISS:
            raise ValueError(f"slo_miss must be one of {list(SLO_MISS)}, got {self.slo_miss!r}")

    @property
    def slo(self) -> Slo:
        """The SLO of requests that set none (seconds)."""
        return Slo(self.slo_ttft_ms / 1000, self.slo_itl_ms / 1000)

    def _check_durations(self) -> None:
        """Deadlines, rates and intervals: finite and > 0 (the wait for instances may be 0)."""
        for name in (
            "rpc_timeout_s",
            "prefill_timeout_base_s",
            "prefill_min_tokens_per_s",
            "token_timeout_s",
            "max_queue_time_s",
            "stats_interval_s",
            "discovery_interval_s",
            "drain_grace_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.wait_for_instances_s) and self.wait_for_instances_s >= 0):
            raise ValueError(f"wait_for_instances_s must be a finite number >= 0, got {self.wait_for_instances_s}")

    def _check_queue_bounds(self) -> None:
        """The admission queue's bounds, in total and per key: >= 0 (0 per key: no bound)."""
        bounds = (
            self.max_queued_requests,
            self.max_queued_tokens,
            self.max_requests_per_key,
            self.max_queued_tokens_per_key,
        )
        if min(bounds) < 0:
            raise ValueError(
                f"max_queued_requests, max_queued_tokens, max_requests_per_key and max_queued_tokens_per_key "
                f"must be >= 0, got {self.max_queued_requests}, {self.max_queued_tokens}, "
                f"{self.max_requests_per_key}, {self.max_queued_tokens_per_key}"
            )

    def _check_fronts(self) -> None:
        """The HTTP port (apart from the gRPC one) and TLS (a certificate and its key, or neither)."""
        if not 0 <= self.http_port < 65536 or self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port must be in [0, 65535] and differ from the gRPC port, got {self.http_port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key (or neither)")

    def _check_max_tokens(self) -> None:
        """The largest max_tokens a request may ask for, and the default within it."""
        if self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens must be in [1, {self.max_tokens_limit}], got {self.default_max_tokens}"
            )

    @property
    def discovers(self) -> bool:
        """Whether instances come from the registry too (--discover with a --redis-url)."""
        return self.discover and bool(self.redis_url)
