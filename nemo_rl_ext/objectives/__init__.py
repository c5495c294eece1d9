"""The policy-update math: group advantages, the clipped policy-gradient loss and its settings, the trainer's logprobs,
and the staleness rule of asynchronous rollouts. Pure functions on tensors and records, no I/O; the trainer
(`training`) and the GRPO loop (`grpo`) call them."""
