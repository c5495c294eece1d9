"""bench/learning_trl.py's TRL side, one process: TRL's `GRPOTrainer` (LoRA through peft) on the bench's training
problems, a checkpoint every K steps, then each checkpoint merged into the base model as a Hugging Face folder
that `examples/run_eval.py` reads (as `run_grpo.py export` does for ours).

    python bench/learning_trl_worker.py SPEC.json

SPEC.json (written by bench/learning_trl.py): model folder, training file, system prompt, the environment that
grades (the bench's training environment, the same class and kwargs as our run's `rollouts.env`), stop strings,
TRL's GRPOConfig arguments, the save period, output folder. Writes OUT/steps.jsonl (per step: training seconds
from `on_step_begin` to `on_step_end`, so checkpoint saving is not counted; reward mean), OUT/export/step_K/
and OUT/worker.json (totals). The reward is the environment's own `step` on the completion as the assistant
message, so the grader is the one our run uses (for arithmetic the `math` environment: math-verify in its
worker pool with its per-answer deadline).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


def reward_function(env_spec: dict, stop_strings: list[str] | None):
    """A TRL reward function grading each completion with the environment of `env_spec` ({"name", "kwargs"})."""
    import nemo_rl_ext.environments  # noqa: F401  (registers the environments)
    from nemo_rl_ext.data.records import Message
    from nemo_rl_ext.environments.registry import create_environment

    env = create_environment(env_spec["name"], **env_spec.get("kwargs", {}))

    def cut(text: str) -> str:
        # our engine stops at a stop string (kept in the text); TRL's generate cannot (no tokenizer passed), so
        # the text after the first one is dropped before grading
        for stop in stop_strings or ():
            if stop in text:
                text = text[: text.index(stop) + len(stop)]
        return text

    def reward(completions: list, answer: list[str], **_: Any) -> list[float]:
        logs = [[Message(role="assistant", content=cut(c[0]["content"]), token_ids=())] for c in completions]
        result = asyncio.run(env.step(logs, [{"ground_truth": a} for a in answer]))
        return [float(r) for r in result.rewards]

    reward.__name__ = f"{env_spec['name']}_reward"
    return reward


def train(spec: dict, out: Path) -> dict:
    """Run TRL's GRPOTrainer as the spec says; returns the worker's totals."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(spec["model"], dtype=torch.float32)
    model.train()
    rows = [json.loads(line) for line in Path(spec["train_path"]).read_text().splitlines() if line.strip()]
    system = [{"role": "system", "content": spec["system_prompt"]}] if spec.get("system_prompt") else []
    dataset = Dataset.from_list([{"prompt": [*system, {"role": "user", "content": r["question"]}],
                                  "answer": r["answer"]} for r in rows])
    args = GRPOConfig(output_dir=str(out / "trl"), save_strategy="steps", save_steps=spec["save_every"],
                      save_only_model=True, report_to="none", logging_steps=1, disable_tqdm=True, use_cpu=True,
                      bf16=False, fp16=False, dataloader_num_workers=0, **spec["trl_args"])
    steps_file = (out / "steps.jsonl").open("w")

    class Timer(TrainerCallback):
        """Training seconds of each optimizer step (generation, reward, loss, update; not the saving)."""

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            self.seconds = time.perf_counter() - self.begin

        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "reward" in logs:
                row = {"step": state.global_step, "train_s": self.seconds, "reward": logs["reward"]}
                steps_file.write(json.dumps(row) + "\n")
                steps_file.flush()

    lora = spec["lora"]
    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora.get("dropout", 0.0),
                             target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_function(spec["env"], spec.get("stop_strings")),
                          args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                          callbacks=[Timer()])
    setup_s = time.perf_counter() - start
    trainer.train()
    steps_file.close()
    train_phase_s = time.perf_counter() - start
    exports = export_checkpoints(spec["model"], out)
    return {"setup_s": setup_s, "process_train_s": train_phase_s, "exports": exports,
            "export_s": time.perf_counter() - start - train_phase_s, "threads": torch.get_num_threads()}


def export_checkpoints(base: str, out: Path) -> dict[int, str]:
    """Each TRL checkpoint (a peft adapter) merged into a fresh copy of the base model: OUT/export/step_K."""
    import torch
    from peft import PeftModel

    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    exports = {}
    for ckpt in sorted((out / "trl").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(ckpt.name.split("-")[1])
        model, tokenizer = load_model_and_tokenizer(base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()
        folder = out / "export" / f"step_{step}"
        merged.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        exports[step] = str(folder)
    return exports


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    totals = train(spec, out)
    (out / "worker.json").write_text(json.dumps(totals, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
