"""Training a policy: the trainer in one process (`trainer`) or as FSDP2 ranks on Ray (`distributed_trainer`,
`fsdp_workers`, `fsdp_wrap`, `fsdp_refit`), LoRA, the weights handed to the engine (`streamed_weights`),
checkpoints in one folder or sharded (`checkpoint`, `sharded_checkpoint`, `state`), and export."""
