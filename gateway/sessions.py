"""Session affinity: a conversation's next turn goes back to the instances that hold its pages.

A client names its conversation (the `x-session-id` header or gRPC metadata; OpenAI's `user`
field when the operator turns `--session-from-user` on). After each turn the gateway remembers,
per session, the prefill and decode instances it used and how far the turn's prompt reached
(its number of full blocks and the hash of the last one). The next turn whose prompt starts
with that prefix (its block hash at that position is the same) counts those blocks as held by
those instances, on top of what the prefix index says: the KV events of the last turn may not
have reached the index yet (an agent's next call comes within milliseconds), and the routing
policy's own load weighing (kvmesh.gateway.router) and decode's slack still decide, so affinity never
overrides the load guard. A turn that does not extend the remembered prefix (another
conversation under the same id) is routed as any request.

Session ids are user text: they are hashed with the caller's tenant (so two tenants' ids never
meet) and never logged or stored as sent. The table is an LRU of at most `max_sessions` entries.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

MAX_SESSION_ID_CHARS = 256
"""Longest session id a request may send (a longer one is refused: INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class _Turn:
    prefill_id: str
    decode_id: str
    num_blocks: int
    last_hash: bytes


class SessionTable:
    """Which instances served each session's last turn, and how far its prompt reached."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions}")
        self.max_sessions = max_sessions
        self._turns: OrderedDict[bytes, _Turn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._turns)

    @staticmethod
    def key(tenant: str, session_id: str) -> bytes:
        """The table's key for a session id of a tenant (ValueError for an id over
        MAX_SESSION_ID_CHARS characters)."""
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise ValueError(f"the session id is {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS}")
        return hashlib.sha256(f"{tenant}\0{session_id}".encode("utf-8", "surrogatepass")).digest()

    def add_held(
        self,
        key: bytes,
        block_hashes: Sequence[bytes],
        cached_blocks: dict[str, int],
        tiered_blocks: dict[str, int] | None = None,
    ) -> None:
        """Count the session's last turn's blocks as held by its instances in `cached_blocks`
        and `tiered_blocks` (instance_id -> leading blocks; an empty tiered map means no
        instance has a second tier and stays empty), when this prompt extends that turn's
        prompt; a no-op otherwise."""
        turn = self._turns.get(key)
        if turn is None or not turn.num_blocks or len(block_hashes) < turn.num_blocks:
            return
        if block_hashes[turn.num_blocks - 1] != turn.last_hash:
            return  # another conversation under this id: nothing is known about it
        self._turns.move_to_end(key)
        for held in (cached_blocks, tiered_blocks) if tiered_blocks else (cached_blocks,):
            for instance_id in (turn.prefill_id, turn.decode_id):
                if instance_id:
                    held[instance_id] = max(held.get(instance_id, 0), turn.num_blocks)

    def remember(self, key: bytes, prefill_id: str, decode_id: str, block_hashes: Sequence[bytes]) -> None:
        """The session's turn went to these instances with this prompt (its full blocks' hashes)."""
        if not self.max_sessions:
            return
        last = block_hashes[-1] if block_hashes else b""
        self._turns[key] = _Turn(prefill_id, decode_id, len(block_hashes), last)
        self._turns.move_to_end(key)
        while len(self._turns) > self.max_sessions:
            self._turns.popitem(last=False)
