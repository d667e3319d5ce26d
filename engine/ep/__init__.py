"""Expert parallelism: EPLB placements (`eplb`), the MoE dispatch / combine over ranks
(`dispatch`), a rank's routed experts read from disk (`expert_weights`), and the decode ranks
themselves: rank 0's runner (`runner`), the other ranks (`worker`, `ranks`) and their control
link (`link`)."""
