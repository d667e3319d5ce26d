"""Llama-family decoders (SmolLM2 and other Llama-architecture checkpoints): the model
(`model`) and its weights as it takes them (`weights`), its batched paged decode step (`step`,
with its attention in `step_attention`) and its runner (`runner`)."""
