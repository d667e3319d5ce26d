"""API keys of the gateway: who may call Generate, ListModels and the HTTP /v1 routes.

Keys come from a file (one a line, optionally followed by a cache namespace it shares with
other keys, by its admission class and by its latency targets: `<key> [<namespace>] [priority=<int>]
[weight=<number>] [slo_ttft_ms=<ms>] [slo_itl_ms=<ms>]`;
blank lines and lines starting with # are skipped) and from KVMESH_API_KEYS (comma-separated,
priority 0, weight 1). The admission queue serves higher priority bands first and shares a
band between its keys by weight (kvmesh.gateway.admission); a key's SLO is the one its requests
carry when they set none (kvmesh.gateway.slo; before the gateway's --slo-ttft-ms / --slo-itl-ms).
All come from the operator's file, never from a request. A caller presents one as `authorization: Bearer <key>`
(the HTTP header, or gRPC metadata of that name), as OpenAI's API takes them. Health,
metrics and reflection stay open. A key is compared in constant time against every known
key (hmac.compare_digest, no early exit), and it is never logged: logs, errors and the
admission bounds name it by its label, "key-<n>" (its position, from 1).

Each key is a tenant of the prefix cache (`tenant_of`): its requests' block hashes are salted
with it (kvmesh.kvstore.block_hash.tenant_root), so one tenant's requests never hit, or time, another's
cached blocks (the prefix-cache timing side channel, CVE-2025-46570; vLLM's, SGLang's and
Dynamo's `cache_salt`). Keys that name the same namespace share their cache (a team's keys).
The tenant comes from the authenticated key, never from the request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable

_NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class ApiKeys:
    """The known API keys; empty: the gateway is open to anyone."""

    def __init__(
        self,
        keys: Iterable[str],
        namespaces: dict[str, str] | None = None,
        classes: dict[str, tuple[int, float]] | None = None,
        slos: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        """keys; namespaces: key -> the cache namespace it shares with other keys (a key without
        one is a namespace of its own); classes: key -> (priority, weight) in the admission
        queue (default (0, 1.0)); slos: key -> (TTFT, ITL) targets in ms of its requests (0: unset).
        Raises ValueError for a key with whitespace in it (it could
        never be sent as given) or a namespace outside [A-Za-z0-9._-]{1,64}."""
        self._digests: list[bytes] = []
        self._tenants: list[str] = []
        self._classes: list[tuple[int, float]] = []
        self._slos: list[tuple[float, float]] = []
        namespaces = namespaces or {}
        classes = classes or {}
        slos = slos or {}
        for key in keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty and hold no whitespace")
            # compare digests: equal length whatever the caller sends, so compare_digest's
            # time says nothing about a key's length either
            digest = hashlib.sha256(key.encode()).digest()
            self._digests.append(digest)
            shared = namespaces.get(key, "")
            if shared and not _NAMESPACE.fullmatch(shared):
                raise ValueError(f"a cache namespace must match [A-Za-z0-9._-]{{1,64}}, got {shared!r}")
            # a key's own tenant is named by its digest: stable whatever the file's order,
            # and nothing another tenant could name
            self._tenants.append(f"ns:{shared}" if shared else f"key:{digest.hex()}")
            self._classes.append(classes.get(key, (0, 1.0)))
            self._slos.append(slos.get(key, (0.0, 0.0)))

    @classmethod
    def load(cls, path: str = "", env_value: str = "") -> ApiKeys:
        """The keys in file `path` (if given) and in `env_value` (comma-separated).

        Raises OSError when the file cannot be read, ValueError for a bad key, a line of more
        than a key, a namespace and priority=/weight=, a priority that is not an integer in
        [-1000, 1000] or a weight that is not a number in (0, 1000]."""
        keys = [k.strip() for k in env_value.split(",") if k.strip()]
        namespaces: dict[str, str] = {}
        classes: dict[str, tuple[int, float]] = {}
        slos: dict[str, tuple[float, float]] = {}
        if path:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, start=1):
                    fields = line.split()
                    if not fields or fields[0].startswith("#"):
                        continue
                    key, rest = fields[0], fields[1:]
                    options = dict(r.split("=", 1) for r in rest if "=" in r)
                    plain = [r for r in rest if "=" not in r]
                    if len(plain) > 1 or set(options) - {"priority", "weight", "slo_ttft_ms", "slo_itl_ms"}:
                        raise ValueError(
                            f"{path} line {n}: expected '<key> [<namespace>] [priority=<int>] [weight=<number>] "
                            "[slo_ttft_ms=<ms>] [slo_itl_ms=<ms>]'"
                        )
                    keys.append(key)
                    if plain:
                        namespaces[key] = plain[0]
                    try:
                        priority = int(options.get("priority", "0"))
                        weight = float(options.get("weight", "1"))
                    except ValueError:
                        raise ValueError(f"{path} line {n}: priority must be an integer, weight a number") from None
                    if not -1000 <= priority <= 1000 or not 0 < weight <= 1000:
                        raise ValueError(f"{path} line {n}: priority must be in [-1000, 1000], weight in (0, 1000]")
                    classes[key] = (priority, weight)
                    slos[key] = _slo_options(options, f"{path} line {n}")
        return cls(keys, namespaces, classes, slos)

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, authorization: str | None) -> str:
        """The label ("key-1", ...) of the key in an `authorization` value ("Bearer <key>");
        "" when the gateway has no keys.

        Raises PermissionError, saying what to send, when keys are set and the value holds
        none of them."""
        if not self._digests:
            return ""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise PermissionError("this gateway needs an API key: send the header 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = 0
        for i, known in enumerate(self._digests, start=1):
            if hmac.compare_digest(digest, known) and not found:  # every key compared, no early exit
                found = i
        if not found:
            raise PermissionError("the API key is not valid for this gateway")
        return f"key-{found}"

    def class_of(self, label: str) -> tuple[int, float]:
        """(priority, weight) of the key labelled `label` in the admission queue; (0, 1.0) for
        the open gateway's label ""."""
        if not label:
            return 0, 1.0
        return self._classes[int(label.removeprefix("key-")) - 1]

    def slo_ms_of(self, label: str) -> tuple[float, float]:
        """The (TTFT, ITL) targets in ms the key labelled `label` gives its requests (0: unset)."""
        if not label:
            return 0.0, 0.0
        return self._slos[int(label.removeprefix("key-")) - 1]

    def tenant_of(self, label: str) -> str:
        """The prefix-cache tenant of the key labelled `label` (as `identify` names it): its
        shared namespace ("ns:<name>") or its own ("key:<sha256 of the key>"); "" for the open
        gateway's label "" (one shared cache, as without keys)."""
        if not label:
            return ""
        return self._tenants[int(label.removeprefix("key-")) - 1]

    def owner_of(self, label: str) -> str:
        """Who owns what the key labelled `label` stores (the Responses API's stored responses):
        the key itself, named by its digest (hex), whatever namespace it shares its cache with;
        "" for the open gateway's label ""."""
        if not label:
            return ""
        return self._digests[int(label.removeprefix("key-")) - 1].hex()


def _slo_options(options: dict[str, str], where: str) -> tuple[float, float]:
    """(slo_ttft_ms, slo_itl_ms) of a key line's options (0: unset). Raises ValueError for one
    that is not a number in [0, 3,600,000] ms."""
    out = []
    for name in ("slo_ttft_ms", "slo_itl_ms"):
        try:
            value = float(options.get(name, "0"))
        except ValueError:
            value = -1.0
        if not 0 <= value <= 3_600_000:
            raise ValueError(f"{where}: {name} must be a number of milliseconds in [0, 3600000]")
        out.append(value)
    return out[0], out[1]
