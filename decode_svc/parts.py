"""What every RPC on one decode instance uses: the engine (its table of requests and its batch
loop), the transfers (each reservation's landing and expiry), the KV receiver and the model
served. kvmesh.decode_svc.reserve_call and kvmesh.decode_svc.generate_call run the calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.decode_svc.engine import DecodeEngine
from kvmesh.decode_svc.transfers import Transfers
from kvmesh.kvstore.transport import KVPushReceiver
from kvmesh.runtime.served_model import ServedModel


@dataclass(frozen=True)
class DecodeParts:
    """One decode instance's parts, as its Reserve and Generate calls use them."""

    engine: DecodeEngine
    transfers: Transfers
    """Reservations and their pushes over the engine's table (call from the event loop only)."""
    receiver: KVPushReceiver
    """The UCX listener the KV pushes land through; its address is what Reserve answers."""
    model: ServedModel
    """The model served: its instance id, context, vocabulary, EOS ids and grammars."""
