"""Llama-family decoders (SmolLM2 and other Llama-architecture checkpoints): the model
(`model`), its batched paged decode step (`step`) and its runner (`runner`)."""
