"""DeepSeek-V4 as transformers defines it (`DeepseekV4Config`): the model (`model`), its weight
names and shapes (`weights`, `shapes`), its per-request compressed-attention state (`state`),
the MTP draft head (`mtp`) and its runner (`runner`)."""
