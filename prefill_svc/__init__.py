"""The Prefill service: computes the uncached part of a prompt and pushes its KV to decode."""
