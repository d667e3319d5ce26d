"""Expert parallelism: EPLB placements (`eplb`), the MoE dispatch / combine over ranks
(`dispatch`), a rank's routed experts read from disk (`expert_weights`), and the decode ranks
themselves: the world every rank joins (`world`), rank 0's runner (`runner`) over its hold on
the world (`rank0`), each step's plan (`plan`) and the pages and slots that move with it
(`mirrors`, `transfer`), the other ranks (`worker`, `ranks`) and their control link (`link`)."""
