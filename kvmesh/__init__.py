"""kvmesh: a gRPC mesh serving LLMs with disaggregated prefill and decode."""

__version__ = "0.1.0"
