"""Side by side with TRL: the learning bench's task through our GRPO and through TRL's `GRPOTrainer`, one after the
other, both evaluated on the same held-out problems by our `examples/run_eval.py` at the same steps.

    python bench/learning_trl.py                       # recipe lora, 30 steps, checkpoints at 10, 20, 30
    python bench/learning_trl.py --save-every 5        # more points on the curves (each a held-out eval more)
    python bench/learning_trl.py --trl-set loss_type=grpo scale_rewards=none   # TRL with other settings

1. the task generator, as bench/learning.py (the same options: --task, --train-size, --eval-size, --set, ...);
2. eval before (greedy, T 0): the base model's held-out pass@1, the 0-second point of both curves;
3. ours: `examples/run_grpo.py` with the recipe (LoRA) and a checkpoint every --save-every steps, then
   `run_grpo.py export --step K` of each;
4. TRL: bench/learning_trl_worker.py (TRL's GRPOTrainer with the same model, problems, system prompt, prompts x
   generations, max new tokens, temperature, LoRA, lr, steps, KL 0, clip range, AdamW settings), an adapter
   checkpoint every --save-every steps, each merged into the base model;
5. `run_eval.py` (greedy) on every export of both.
The x axis is training seconds: the sum of the steps' wall-clock (ours: `timing/step_s`; TRL: `on_step_begin`
to `on_step_end`), so checkpoint saving, exports, model loading and evals are not counted. Every phase runs
alone, with OMP_NUM_THREADS=--threads (default 1) for both. OUT (default results/learning/trl_RECIPE) holds
results.md, results.json, pass1_vs_time.png, configs/, logs/, data/, ours/, trl/. Exit status as bench/learning.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line  # noqa: E402
from learning import (  # noqa: E402
    TASK_ENVS,
    PhaseError,
    Runner,
    build_parser,
    data_differences,
    eval_read,
    evaluate,
    grpo_config,
    load_recipe,
    prepare,
    run_reporting,
    set_key,
)
from learning_trl_report import curve_points, goal, plot_curves, results_markdown, trl_differences  # noqa: E402

TRL_VERSION = "1.16.0"
"""The TRL version the bench extra pins (pyproject's `bench`)."""


def parse_args(argv: list[str] | None = None):
    p = build_parser(__doc__)
    p.add_argument("--save-every", type=int, default=10,
                   help="checkpoint (and evaluate) both runs every this many steps; must divide the step count")
    p.add_argument("--ours-steps", type=int, default=None,
                   help="our GRPO steps (default: the recipe's, as TRL's): the same wall-clock budget may hold more "
                   "of our steps than of TRL's; a multiple of --save-every")
    p.add_argument("--trl-from", default=None, metavar="DIR",
                   help="reuse the TRL training of an earlier run of this bench in DIR (its spec and data must be "
                   "identical: checked); TRL's checkpoints are evaluated again in this run")
    p.add_argument("--trl-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="TRL GRPOConfig arguments over the ones derived from the recipe (e.g. loss_type=grpo)")
    for action in p._actions:  # greedy pass@1 only and no control here: the comparison is the point
        if action.dest in ("samples", "control_steps"):
            action.help = argparse.SUPPRESS
    args = p.parse_args(argv)
    args.samples, args.control_steps = 0, 0
    return args


def check(args, cfg: dict) -> tuple[list[int], list[int]]:
    """The save steps of ours and of TRL; a ValueError naming every setting this comparison cannot run with."""
    problems = []
    steps = cfg["grpo"].get("max_num_steps")
    ours_steps = args.ours_steps or steps
    if not cfg.get("trainer", {}).get("lora"):
        problems.append("the recipe has no trainer.lora: the TRL side trains LoRA adapters (use a LoRA recipe)")
    if cfg.get("rollouts", {}).get("mode", "native") != "native" or cfg["grpo"].get("async", {}).get("enabled"):
        problems.append("rollouts.mode must be native and grpo.async off (TRL runs synchronous native rollouts)")
    if cfg.get("optimizer", {}).get("scheduler"):
        problems.append("optimizer.scheduler: the TRL side runs a constant lr; leave the schedule out here")
    if not isinstance(steps, int) or args.save_every < 1 or steps % args.save_every:
        problems.append(f"--save-every {args.save_every} must be >= 1 and divide grpo.max_num_steps ({steps})")
    elif ours_steps < 1 or ours_steps % args.save_every:
        problems.append(f"--ours-steps {ours_steps} must be >= 1 and a multiple of --save-every {args.save_every}")
    if args.trl_from and not (Path(args.trl_from) / "trl" / "worker.json").is_file():
        problems.append(f"--trl-from {args.trl_from}: no finished TRL run there (trl/worker.json is missing)")
    if problems:
        raise ValueError("bench/learning_trl.py cannot compare this run:\n  " + "\n  ".join(problems))
    return (list(range(args.save_every, ours_steps + 1, args.save_every)),
            list(range(args.save_every, steps + 1, args.save_every)))


def trl_args(cfg: dict, overrides: list[str]) -> dict:
    """TRL GRPOConfig arguments with our recipe's settings where TRL has them (the differences that remain:
    learning_trl_report.trl_differences)."""
    import yaml

    opt, loss, gen = cfg.get("optimizer", {}), cfg.get("loss", {}), cfg["policy"].get("generation", {})
    prompts, group = cfg["grpo"]["num_prompts_per_step"], cfg["rollouts"]["num_generations_per_prompt"]
    betas = opt.get("betas", (0.9, 0.999))
    out = {
        # one group per micro-batch and one optimizer step per generation batch of prompts x group samples
        "per_device_train_batch_size": group, "gradient_accumulation_steps": prompts, "num_generations": group,
        "max_completion_length": gen.get("max_new_tokens", 16), "temperature": float(gen.get("temperature", 1.0)),
        "learning_rate": float(opt.get("lr", 1e-6)), "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": float(opt.get("weight_decay", 0.0)), "max_grad_norm": float(opt.get("max_grad_norm", 1.0)),
        "adam_beta1": float(betas[0]), "adam_beta2": float(betas[1]), "adam_epsilon": float(opt.get("eps", 1e-8)),
        "beta": float(loss.get("kl_coef", 0.01)), "epsilon": float(loss.get("clip_low", 0.2)),
        "epsilon_high": float(loss.get("clip_high", 0.2)), "max_steps": cfg["grpo"]["max_num_steps"],
        "seed": cfg["grpo"].get("seed", 42),
        "gradient_checkpointing": bool(cfg.get("trainer", {}).get("activation_checkpointing", False)),
    }
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--trl-set {item!r}: write KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def model_folder(name: str) -> str:
    """The folder our loaders read for policy.model_name `name` ("smollm2", "tiny" or a folder)."""
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.policy import resolve_model_path

    return str(resolve_model_path(PolicyConfig(model_name=name)))


def run_ours(runner: Runner, cfg: dict, saves: list[int], tag: str = "ours") -> dict[int, str]:
    """GRPO with a checkpoint at every save step, then each exported: {step: export folder} (phases named after
    `tag`: grpo_TAG, export_TAG_STEP)."""
    set_key(cfg, "grpo.save_period", saves[0])
    set_key(cfg, "keep_last_checkpoints", None)
    runner.run(f"grpo_{tag}", "run_grpo.py", "--config", str(runner.config(f"grpo_{tag}", cfg)))
    exports = {}
    for step in saves:
        folder = Path(cfg["output_dir"]) / "export" / f"step_{step}"
        runner.run(f"export_{tag}_{step}", "run_grpo.py", "export", cfg["output_dir"], "--step", str(step),
                   "--out", str(folder))
        exports[step] = str(folder)
    return exports


def run_trl(runner: Runner, cfg: dict, args, train_file: Path, saves: list[int]) -> tuple[dict[int, str], dict, Path]:
    """TRL's GRPOTrainer in its own process (bench/learning_trl_worker.py), or an earlier run's (--trl-from):
    {step: export folder}, its totals, its folder."""
    out = runner.out / "trl"
    spec = {"model": model_folder(cfg["policy"]["model_name"]), "train_path": str(train_file),
            "system_prompt": TASK_ENVS[args.task]["train"].get("system_prompt"), "env": TASK_ENVS[args.task]["train"],
            "stop_strings": TASK_ENVS[args.task]["stop_strings"], "lora": cfg["trainer"]["lora"],
            "save_every": args.save_every, "out": str(out), "trl_args": trl_args(cfg, args.trl_set)}
    path = runner.out / "configs" / "trl_spec.json"
    path.write_text(json.dumps(spec, indent=1))
    if args.trl_from:
        out = reuse_trl(Path(args.trl_from), spec, runner.out)
    else:
        runner.run("grpo_trl", "../bench/learning_trl_worker.py", str(path))
    totals = json.loads((out / "worker.json").read_text())
    exports = {int(k): v for k, v in totals["exports"].items()}
    if sorted(exports) != saves:
        raise PhaseError(f"grpo_trl (checkpoints at steps {sorted(exports)}, expected {saves})", 3,
                         runner.out / "logs" / "grpo_trl.log")
    return exports, totals, out


def reuse_trl(earlier: Path, spec: dict, out: Path) -> Path:
    """The TRL folder of an earlier run whose spec and data equal this run's (paths aside): what TRL trained on,
    with which settings, is then the same; a ValueError naming what differs otherwise."""
    old = json.loads((earlier / "configs" / "trl_spec.json").read_text())
    differ = sorted(k for k in set(old) | set(spec) if k not in ("out", "train_path") and old.get(k) != spec.get(k))
    differ += data_differences(earlier, out)
    if differ:
        raise ValueError(f"--trl-from {earlier}: its TRL run differs from this one in {', '.join(differ)}")
    (out / "trl_from.txt").write_text(f"TRL training reused from {earlier.resolve()}\n")
    return earlier / "trl"


def step_seconds(rows: list[dict], key: str) -> dict[int, float]:
    """{step: training seconds up to the end of that step} from per-step rows with `key` seconds."""
    total, out = 0.0, {}
    for row in sorted(rows, key=lambda r: r["step"]):
        total += row[key]
        out[row["step"]] = total
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_trl_version() -> str:
    """The installed TRL version; a ValueError saying how to install it when it is missing."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError("trl is not installed: pip install -e '.[bench]'") from None
    if version != TRL_VERSION:
        print(f"note: TRL {version} installed; the bench extra pins {TRL_VERSION}")
    return version


def run_compare(args) -> dict:
    """Every phase, then the curves and the goal; returns results.json's content."""
    version = check_trl_version()
    machine = machine_line(f"OMP_NUM_THREADS={args.threads}; TRL {version}")
    if not args.out:
        args.out = str(Path(__file__).resolve().parents[1] / "results" / "learning" / f"trl_{Path(args.recipe).stem}")
    # the settings are checked before anything is written
    saves, trl_saves = check(args, grpo_config(load_recipe(args.recipe)[1], args, Path("train.jsonl"), Path("ours"),
                                               control=False))
    out, recipe, evaluated, train_file, eval_file = prepare(args)
    runner = Runner(out, args.threads, args.phase_timeout)
    cfg = grpo_config(recipe, args, train_file, out / "ours", control=False)
    expected = [r["answer"] for r in evaluated]
    before = evaluate(runner, cfg, args, eval_file, cfg["policy"]["model_name"], "before", expected)["greedy"]
    ours_cfg = json.loads(json.dumps(cfg))
    set_key(ours_cfg, "grpo.max_num_steps", saves[-1])
    ours_exports = run_ours(runner, ours_cfg, saves)
    trl_exports, totals, trl_dir = run_trl(runner, cfg, args, train_file, trl_saves)
    scores, read = {"ours": {0: before}, "trl": {0: before}}, {}
    for side, exports in (("ours", ours_exports), ("trl", trl_exports)):
        for step, folder in exports.items():
            tag = f"{side}_step{step}"
            scores[side][step] = evaluate(runner, cfg, args, eval_file, folder, tag, expected)["greedy"]
            read[tag] = {"export": folder, "run_eval_read": eval_read(out / "evals" / f"{tag}_greedy")}
    ours_rows, trl_rows = read_jsonl(out / "ours" / "metrics.jsonl"), read_jsonl(trl_dir / "steps.jsonl")
    seconds = {"ours": {0: 0.0, **step_seconds([r for r in ours_rows if r.get("step", 0) > 0], "timing/step_s")},
               "trl": {0: 0.0, **step_seconds(trl_rows, "train_s")}}
    curves = {side: curve_points(scores[side], seconds[side], seed=args.seed, resamples=args.resamples)
              for side in scores}
    results = {
        "recipe": args.recipe, "task": args.task, "model": cfg["policy"]["model_name"], "steps": trl_saves[-1],
        "ours_steps": saves[-1], "trl_from": args.trl_from and str(Path(args.trl_from).resolve()),
        "save_every": args.save_every, "eval_size": len(evaluated), "heldout_size": args.heldout_size,
        "train_size": args.train_size, "seed": args.seed, "resamples": args.resamples, "trl_version": version,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine,
        "threads": args.threads, "prompts_per_step": cfg["grpo"]["num_prompts_per_step"],
        "generations": cfg["rollouts"]["num_generations_per_prompt"], "curves": curves,
        "goal": goal(curves, scores, seed=args.seed, resamples=args.resamples), "timings_s": runner.timings,
        "trl_worker": totals, "trl_args": trl_args(cfg, args.trl_set), "differences": trl_differences(),
        "evals_read": read,
        "reward": {"ours": [(r["step"], r["rollout/reward/mean"]) for r in ours_rows if r.get("step", 0) > 0],
                   "trl": [(r["step"], r["reward"]) for r in trl_rows]},
    }
    results["plots"] = plot_curves(curves, results["goal"], out / "pass1_vs_time.png")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(results_markdown(results))
    return results


def main(argv: list[str] | None = None) -> int:
    results = run_reporting(run_compare, parse_args(argv))
    if isinstance(results, int):
        return results
    print("\n" + results_markdown(results))
    print(results["goal"]["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
