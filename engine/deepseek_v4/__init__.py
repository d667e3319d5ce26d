"""DeepSeek-V4 as transformers defines it (`DeepseekV4Config`): the model (`model`) and its parts
(`attention`, `compressor`, `indexer`, `moe`, `hyper_connections`, `ops`, and `plan`, the
indices a forward's layers share), its weight names and shapes (`weights`, `shapes`), its
per-request compressed-attention state (`state`), the MTP draft head (`mtp`) and its runner
(`runner`)."""
