"""The GRPO loop: its config, the set-up of a run (`build`), the synchronous loop (`loop.GRPO`), the asynchronous
loop and its collector, the prompt stream, per-step seeds, the stop at a safe point, and metrics to the trackers."""
