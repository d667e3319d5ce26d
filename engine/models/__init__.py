"""Model definitions the engine runs: `llama.LlamaModel` (Llama-family decoders)."""
