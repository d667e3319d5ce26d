"""API keys of the gateway: who may call Generate, ListModels and the HTTP /v1 routes.

Keys come from a file (one a line; blank lines and lines starting with # are skipped) and
from KVMESH_API_KEYS (comma-separated). A caller presents one as `authorization: Bearer <key>`
(the HTTP header, or gRPC metadata of that name), as OpenAI's API takes them. Health,
metrics and reflection stay open. A key is compared in constant time against every known
key (hmac.compare_digest, no early exit), and it is never logged: logs, errors and the
admission bounds name it by its label, "key-<n>" (its position, from 1).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


class ApiKeys:
    """The known API keys; empty: the gateway is open to anyone."""

    def __init__(self, keys: Iterable[str]) -> None:
        """Raises ValueError for a key with whitespace in it (it could never be sent as given)."""
        self._digests: list[bytes] = []
        for key in keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty and hold no whitespace")
            # compare digests: equal length whatever the caller sends, so compare_digest's
            # time says nothing about a key's length either
            self._digests.append(hashlib.sha256(key.encode()).digest())

    @classmethod
    def load(cls, path: str = "", env_value: str = "") -> ApiKeys:
        """The keys in file `path` (if given) and in `env_value` (comma-separated).

        Raises OSError when the file cannot be read, ValueError for a bad key."""
        keys = [k.strip() for k in env_value.split(",") if k.strip()]
        if path:
            with open(path, encoding="utf-8") as f:
                keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        return cls(keys)

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
