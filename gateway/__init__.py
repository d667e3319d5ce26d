"""The client-facing gateway: tokenizer, prefix-aware router, decode picker, streaming."""
