"""Does it learn? The whole loop as a user runs it, measured on problems the model has never seen.

    python bench/learning.py                         # the default recipe (lora) on generated arithmetic
    python bench/learning.py --recipe full_ft        # any config of examples/configs/recipes/
    python bench/learning.py --eval-size 500         # the whole held-out split (default: a seeded 200 of it)
    python bench/learning.py --device cuda --prompts-per-step 16 --generations 16   # every phase on the GPU
    python bench/learning.py --task guess_number --steps 8 --prompts-per-step 4 --generations 8  # multi-turn

1. a seeded task generator writes training and held-out problems (no problem in both) into OUT/data/;
2. eval before: `examples/run_eval.py` on the held-out problems, greedy (T 0, 1 answer) and sampled (T 1,
   `--samples` answers);
3. GRPO: `examples/run_grpo.py` with the recipe (examples/configs/recipes/RECIPE.yaml) and the bench's data;
4. `run_grpo.py export` of the run's last checkpoint, then `run_eval.py` again on the exported folder;
5. the control: the same GRPO -> export -> eval with `optimizer.lr: 0` (no update; `--control-steps` steps);
6. per held-out problem, strict (the whole answer is the expected one) and lenient (the grader's reading)
   correctness; the paired difference after - before with a 95% paired-bootstrap interval, overall and per
   operator, for the run and the control.

Every phase is a subprocess of the project's own CLIs, with the config files the bench writes into
OUT/configs/ (the exact files that ran). OUT holds results.md, results.json, reward_curve.png, heldout.png,
timings.json, configs/, logs/ (each phase's output), data/ and the runs' folders. Exit status: 0 done, 2 a
user error (options, recipe, or a phase that exited 2), 3 a phase failed (its log named) or an eval left
error samples (infrastructure failures, never scored as answers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line  # noqa: E402
from learning_report import compare, markdown_table, plot_heldout, plot_rewards, read_rewards  # noqa: E402
from learning_stats import ErrorSamplesLeft, read_scores, turn_profile  # noqa: E402
from learning_task import TaskSpec, make_task, parse_pair, parse_ranges, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "examples" / "configs" / "recipes"
SYSTEM_PROMPT = "Answer the arithmetic question with just the final number."

ANIMALS = {"Woof.": "dog", "Meow.": "cat"}
"""The signal_word task's signals: the environment's reply -> the answer it asks for."""

TASK_ENVS = {
    "arithmetic": {"train": {"name": "math", "system_prompt": SYSTEM_PROMPT},
                   "eval": {"name": "math", "system_prompt": SYSTEM_PROMPT}, "stop_strings": None},
    "say_yes": {"train": {"name": "string_match", "kwargs": {"mode": "similarity"}},
                "eval": {"name": "string_match", "kwargs": {"mode": "exact"}}, "stop_strings": ["yes"]},
    # multi-turn: training pays a right guess discount ** (guesses - 1), the held-out reading is "solved
    # within the guesses" (discount 1); rollouts.max_rollout_turns is the guess count
    "guess_number": {"train": {"name": "guess_number", "kwargs": {"max_guesses": 4, "discount": 0.8}},
                     "eval": {"name": "guess_number", "kwargs": {"max_guesses": 4}}, "stop_strings": None,
                     "turns": 4},
    "guess_123": {"train": {"name": "guess_number", "kwargs": {"max_guesses": 2, "discount": 1.0},
                            "system_prompt": "Guess."},
                  "eval": {"name": "guess_number", "kwargs": {"max_guesses": 2}, "system_prompt": "Guess."},
                  "stop_strings": list("0123456789"), "turns": 2},
    # multi-turn: the answer is in the environment's reply only; training pays the answer's similarity (dense,
    # for a random model), the held-out reading is the exact answer
    # (dog and cat: whole tokens of the tiny model's vocabulary that are no other token's part, unlike "no" in "now")
    "signal_word": {"train": {"name": "signal_word", "kwargs": {"signals": ANIMALS, "mode": "similarity"},
                              "system_prompt": "Animal."},
                    "eval": {"name": "signal_word", "kwargs": {"signals": ANIMALS, "mode": "exact"},
                             "system_prompt": "Animal."},
                    "stop_strings": ["dog", "cat"], "turns": 2},
}
"""Per task: the training environment (its reward), the held-out grader (the lenient reading), stop strings and
(multi-turn tasks) the turn cap."""


class PhaseError(Exception):
    """A phase's subprocess failed: its exit status and log."""

    def __init__(self, phase: str, rc: int, log: Path) -> None:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.is_file() else ""
        super().__init__(f"phase {phase} failed with exit status {rc}; its log: {log}\n{tail}")
        self.rc = rc


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The bench's options (bench/learning_trl.py adds its own to them)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="lora", help="a recipe name (examples/configs/recipes/NAME.yaml) or a file")
    p.add_argument("--task", default="arithmetic", choices=sorted(TASK_ENVS))
    p.add_argument("--model", help="policy.model_name for every phase (default: the recipe's)")
    p.add_argument("--out", help="output folder (default results/learning/RECIPE); must not exist or be empty")
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--heldout-size", type=int, default=500)
    p.add_argument("--eval-size", type=int, default=200,
                   help="held-out problems evaluated: a seeded subset of the held-out split (default 200 of 500)")
    p.add_argument("--ops", nargs="+", default=["+", "-", "*"], help="arithmetic operators")
    p.add_argument("--range", nargs="*", default=[], dest="ranges", metavar="OP:LOW:HIGH",
                   help="operand range of an operator (defaults +:10:99 -:10:99 *:1:9)")
    p.add_argument("--guess-lows", default="1:60", metavar="LOW:HIGH",
                   help="guess_number: range of a game's lowest number (default 1:60)")
    p.add_argument("--guess-widths", default="3:10", metavar="LOW:HIGH",
                   help="guess_number: range of a game's count of numbers (default 3:10)")
    p.add_argument("--samples", type=int, default=4, help="answers per problem of the sampled (T 1) eval; 0: none")
    p.add_argument("--steps", type=int, help="grpo.max_num_steps (default: the recipe's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="policy.device of every phase (GRPO, its engine, the evals); default cpu")
    p.add_argument("--prompts-per-step", type=int, help="grpo.num_prompts_per_step (default: the recipe's)")
    p.add_argument("--generations", type=int,
                   help="rollouts.num_generations_per_prompt, the group size (default: the recipe's)")
    p.add_argument("--control-steps", type=int, default=3,
                   help="steps of the lr-0 control (its weights never change, so 3 steps give the same model as "
                   "30; pass the run's count for an identical schedule); 0: no control (make grpo-demo)")
    p.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="overrides of the GRPO config (e.g. optimizer.lr=3e-3), the control's too")
    p.add_argument("--seed", type=int, default=0, help="seed of the task generator and the bootstrap")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every phase (default 1)")
    p.add_argument("--phase-timeout", type=float, default=3600.0, help="seconds one phase may take")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def set_key(cfg: dict, dotted: str, value: Any) -> None:
    """Set cfg["a"]["b"] = value for "a.b", creating sections."""
    *path, last = dotted.split(".")
    for key in path:
        cfg = cfg.setdefault(key, {})
    cfg[last] = value


def load_recipe(recipe: str) -> tuple[Path, dict]:
    path = Path(recipe) if recipe.endswith((".yaml", ".yml")) else RECIPES / f"{recipe}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise ValueError(f"recipe {recipe!r}: no file {path}; the recipes are {names}")
    return path, yaml.safe_load(path.read_text())


def gym_rows(rows: list[dict]) -> list[dict]:
    """The training rows in NeMo Gym's format (a developer message with the system prompt, the question, and
    the expected answer that the project's arithmetic_grader server compares), alternating the two agents."""
    return [{"responses_create_params": {"input": [{"role": "developer", "content": SYSTEM_PROMPT},
                                                   {"role": "user", "content": r["question"]}]},
             "agent_ref": {"name": ("agent_alpha", "agent_beta")[i % 2]}, "id": r["id"],
             "question": r["question"], "expected_answer": r["answer"]} for i, r in enumerate(rows)]


def grpo_config(recipe: dict, args: argparse.Namespace, train: Path, out: Path, *, control: bool) -> dict:
    """The recipe with the bench's data, output folder, model, steps and environment (and lr 0 for the control)."""
    cfg = json.loads(json.dumps(recipe))
    set_key(cfg, "data.train_path", str(train))
    set_key(cfg, "output_dir", str(out))
    if args.model:
        set_key(cfg, "policy.model_name", args.model)
    if cfg.get("rollouts", {}).get("mode", "native") == "native":
        set_key(cfg, "rollouts.env", TASK_ENVS[args.task]["train"])
    if TASK_ENVS[args.task]["stop_strings"]:
        set_key(cfg, "policy.generation.stop_strings", TASK_ENVS[args.task]["stop_strings"])
    if "turns" in TASK_ENVS[args.task]:
        set_key(cfg, "rollouts.max_rollout_turns", TASK_ENVS[args.task]["turns"])
    set_key(cfg, "policy.device", args.device)
    if args.steps:
        set_key(cfg, "grpo.max_num_steps", args.steps)
    if args.prompts_per_step:
        set_key(cfg, "grpo.num_prompts_per_step", args.prompts_per_step)
    if args.generations:
        set_key(cfg, "rollouts.num_generations_per_prompt", args.generations)
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: write KEY=VALUE")
        set_key(cfg, key, yaml.safe_load(value))
    if control:
        set_key(cfg, "optimizer.lr", 0.0)
        set_key(cfg, "grpo.max_num_steps", args.control_steps)
    return cfg


def eval_config(grpo_cfg: dict, args: argparse.Namespace, data: Path, model: str, save: Path, *,
                sampled: bool) -> dict:
    """A held-out eval of `model`: greedy (T 0, one answer) or sampled (T 1, --samples answers), graded by the
    task's grader, with the training run's token limit and prompt."""
    policy = grpo_cfg.get("policy", {})
    gen = policy.get("generation", {})
    n = args.samples if sampled else 1
    generation = {"max_new_tokens": gen.get("max_new_tokens", 16), "temperature": 1.0 if sampled else 0.0,
                  "seed": 0}
    if gen.get("stop_strings"):
        generation["stop_strings"] = gen["stop_strings"]
    return {
        "eval": {"dataset_path": str(data), "ks": sorted({1, n}), "reward_threshold": 1.0, "save_path": str(save)},
        "rollouts": {"mode": "native", "num_generations_per_prompt": n,
                     "max_rollout_turns": TASK_ENVS[args.task].get("turns", 1),
                     "max_seq_len": grpo_cfg.get("rollouts", {}).get("max_seq_len", 512),
                     "env": TASK_ENVS[args.task]["eval"]},
        "policy": {"model_name": model, "backend": "hf", "device": args.device, "dtype": policy.get("dtype", "float32"),
                   "max_model_len": policy.get("max_model_len", 512), "generation": generation},
    }


class Runner:
    """Runs the phases as subprocesses of the project's CLIs, logging each and timing it."""

    def __init__(self, out: Path, threads: int, timeout: float) -> None:
        self.out, self.timeout = out, timeout
        self.timings: dict[str, float] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "configs").mkdir(parents=True, exist_ok=True)

    def config(self, name: str, cfg: dict) -> Path:
        path = self.out / "configs" / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def run(self, phase: str, script: str, *argv: str) -> None:
        log = self.out / "logs" / f"{phase}.log"
        cmd = [sys.executable, str(REPO / "examples" / script), *argv]
        print(f"[{time.strftime('%H:%M:%S')}] {phase}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        with log.open("w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=REPO, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=self.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        self.timings[phase] = round(time.perf_counter() - start, 1)
        print(f"    {phase}: {self.timings[phase]:.1f} s (exit {rc})", flush=True)
        if rc != 0:
            raise PhaseError(phase, rc, log)


def evaluate(runner: Runner, grpo_cfg: dict, args: argparse.Namespace, data: Path, model: str,
             tag: str, expected: list[str]) -> dict:
    """The greedy (and sampled) held-out evals of `model`: per-prompt scores per mode."""
    scores = {}
    for mode in ("greedy", "sampled") if args.samples > 0 else ("greedy",):
        save = runner.out / "evals" / f"{tag}_{mode}"
        cfg = runner.config(f"eval_{tag}_{mode}", eval_config(grpo_cfg, args, data, model, save,
                                                              sampled=mode == "sampled"))
        runner.run(f"eval_{tag}_{mode}", "run_eval.py", "--config", str(cfg), "--no-progress")
        scores[mode] = read_scores(save / "completions.jsonl", expected)
    return scores


def train_and_export(runner: Runner, cfg: dict, tag: str) -> Path:
    """GRPO with `cfg`, then `run_grpo.py export` of its last checkpoint into <output_dir>/export."""
    path = runner.config(f"grpo_{tag}", cfg)
    runner.run(f"grpo_{tag}", "run_grpo.py", "--config", str(path))
    export = Path(cfg["output_dir"]) / "export"
    runner.run(f"export_{tag}", "run_grpo.py", "export", cfg["output_dir"], "--out", str(export))
    return export


def data_differences(earlier: Path, out: Path) -> list[str]:
    """The data files (`data/train.jsonl`, `data/heldout.jsonl`) of an earlier bench run's folder `earlier` that
    are not byte for byte those of this run's folder `out`: [] when it trained and held out the same problems."""
    names = ("train.jsonl", "heldout.jsonl")
    return [f"data/{n}" for n in names if (earlier / "data" / n).read_bytes() != (out / "data" / n).read_bytes()]


def eval_read(save: Path) -> str:
    """The model folder an eval actually loaded, from the config.yaml it wrote."""
    return str(yaml.safe_load((save / "config.yaml").read_text())["policy"]["model_name"])


def device_info(device: str) -> dict[str, str]:
    """The device the phases run on, and on CUDA the GPU's name (a ValueError when torch sees no CUDA device)."""
    if device != "cuda":
        return {"device": device}
    import torch  # only here: on the CPU the bench process itself needs no torch

    if not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device (--device cpu runs on the CPU)")
    return {"device": "cuda", "gpu": torch.cuda.get_device_name(0), "cuda": str(torch.version.cuda)}


def write_plots(curves: dict, run_cmp: dict, control_cmp: dict, out: Path) -> list[str]:
    """reward_curve.png and heldout.png; none without matplotlib (not on the lent GPU image): the names written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("    matplotlib is not installed: no plots (results.md and results.json have the numbers)")
        return []
    plot_rewards(curves, out / "reward_curve.png")
    plot_heldout(run_cmp, control_cmp, out / "heldout.png")
    return ["reward_curve.png", "heldout.png"]


def prepare(args: argparse.Namespace) -> tuple[Path, dict, list[dict], Path, Path]:
    """Check the options, write the data: (output folder, recipe, held-out rows evaluated, train file, eval file)."""
    _, recipe = load_recipe(args.recipe)
    name = Path(args.recipe).stem
    out = Path(args.out or REPO / "results" / "learning" / name).resolve()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty: pass a new folder (the phases' folders would resume)")
    if not 1 <= args.eval_size <= args.heldout_size:
        raise ValueError(f"--eval-size must be in [1, --heldout-size={args.heldout_size}], got {args.eval_size}")
    if args.control_steps < 0:
        raise ValueError(f"--control-steps must be >= 0 (0: no control), got {args.control_steps}")
    spec = TaskSpec(name=args.task, train_size=args.train_size, heldout_size=args.heldout_size, seed=args.seed,
                    ops=tuple(args.ops), ranges=parse_ranges(args.ranges),
                    guess_lows=parse_pair(args.guess_lows, "--guess-lows"),
                    guess_widths=parse_pair(args.guess_widths, "--guess-widths"))
    train, heldout = make_task(spec)
    write_jsonl(out / "data" / "heldout.jsonl", heldout)
    evaluated = heldout[:args.eval_size]  # the held-out rows are in seeded random order: a seeded subset
    eval_file = write_jsonl(out / "data" / "heldout_eval.jsonl", evaluated)
    gym = recipe.get("rollouts", {}).get("mode") == "nemo_gym"
    train_file = write_jsonl(out / "data" / ("train_gym.jsonl" if gym else "train.jsonl"),
                             gym_rows(train) if gym else train)
    (out / "data" / "task.json").write_text(json.dumps({**spec.__dict__, "train_rows": len(train),
                                                        "heldout_rows": len(heldout)}, indent=1))
    return out, recipe, evaluated, train_file, eval_file


def run_bench(args: argparse.Namespace) -> dict:
    """Every phase, then the comparison; returns results.json's content."""
    machine = machine_line(f"OMP_NUM_THREADS={args.threads}")  # before the phases: the load they start in
    device = device_info(args.device)
    out, recipe, evaluated, train_file, eval_file = prepare(args)
    runner = Runner(out, args.threads, args.phase_timeout)
    cfg = grpo_config(recipe, args, train_file, out / "run", control=False)
    expected = [r["answer"] for r in evaluated]
    ops = [r["op"] for r in evaluated]
    base = cfg["policy"]["model_name"]
    before = evaluate(runner, cfg, args, eval_file, base, "before", expected)
    export = train_and_export(runner, cfg, "run")
    after = evaluate(runner, cfg, args, eval_file, str(export), "after", expected)
    run_cmp = compare(before, after, ops, seed=args.seed, resamples=args.resamples)
    curves = {"GRPO": read_rewards(out / "run" / "metrics.jsonl")}
    exports = {"run": str(export), "run_eval_read": eval_read(out / "evals" / "after_greedy")}
    control_cmp = None
    if args.control_steps > 0:
        control_cfg = grpo_config(recipe, args, train_file, out / "control", control=True)
        control_export = train_and_export(runner, control_cfg, "control")
        control_after = evaluate(runner, control_cfg, args, eval_file, str(control_export), "control", expected)
        control_cmp = compare(before, control_after, ops, seed=args.seed, resamples=args.resamples)
        curves["lr-0 control"] = read_rewards(out / "control" / "metrics.jsonl")
        exports.update(control=str(control_export), control_eval_read=eval_read(out / "evals" / "control_greedy"))
    results = {
        "recipe": args.recipe, "task": args.task, "model": base, "steps": cfg["grpo"].get("max_num_steps"),
        "control_steps": args.control_steps, "eval_size": len(evaluated), "heldout_size": args.heldout_size,
        "train_size": args.train_size, "samples": args.samples, "seed": args.seed, "resamples": args.resamples,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine, **device, "prompts_per_step": cfg["grpo"].get("num_prompts_per_step"),
        "generations": cfg.get("rollouts", {}).get("num_generations_per_prompt"),
        "run": run_cmp, "control": control_cmp, "reward_curve": curves, "timings_s": runner.timings,
        "export": exports,
    }
    if "turns" in TASK_ENVS[args.task]:
        tags = ["before", "after"] + (["control"] if control_cmp else [])
        results["turns"] = {t: turn_profile(out / "evals" / f"{t}_greedy" / "completions.jsonl") for t in tags}
    (out / "timings.json").write_text(json.dumps(runner.timings, indent=1))
    results["plots"] = write_plots(curves, run_cmp, control_cmp, out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(results_markdown(results))
    return results


def results_markdown(results: dict) -> str:
    """results.md: what ran, the table, the timings."""
    timings = ", ".join(f"{k} {v:.0f} s" for k, v in results["timings_s"].items())
    return (f"# Does it learn? recipe `{results['recipe']}`, task `{results['task']}`\n\n"
            f"{results['date']}; {results['machine']}\n\n"
            f"Device: {device_line(results)}\n\n"
            f"Model `{results['model']}`, {results['steps']} GRPO steps of {results.get('prompts_per_step')} prompts x "
            f"{results.get('generations')} samples ({control_words(results)}); "
            f"{results['eval_size']} of {results['heldout_size']} held-out problems "
            f"({results['train_size']} training problems, none in both); sampled eval: {results['samples']} "
            f"answers at T 1. Intervals: 95% paired bootstrap over problems ({results['resamples']} resamples, "
            f"seed {results['seed']}).\n\n{markdown_table(results['run'], results['control'])}\n\n"
            f"{turns_markdown(results)}Wall-clock per phase: {timings}.\n")


def _top(counts: dict[str, int], k: int) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda mc: (-mc[1], mc[0]))[:k]


def turns_markdown(results: dict) -> str:
    """Multi-turn tasks: per greedy eval, the problems solved on the first guess and on a later one, and what the
    model did after each environment reply (empty for single-turn tasks)."""
    if not results.get("turns"):
        return ""
    lines = ["| greedy eval | solved on turn 1 | solved on a later turn | mean turns | next move after each reply |",
             "|---|---|---|---|---|"]
    for tag, p in results["turns"].items():
        moves = "; ".join(f"{reply!r}: " + ", ".join(f"{m!r} x{c}" for m, c in _top(counts, 4))
                          for reply, counts in sorted(p["next_move_after_reply"].items()))
        lines.append(f"| {tag} | {p['solved_first_turn']:.3f} | {p['solved_later_turn']:.3f} | "
                     f"{p['mean_turns']:.2f} | {moves or '-'} |")
    return "\n".join(lines) + "\n\n"


def control_words(results: dict) -> str:
    return f"control: lr 0, {results['control_steps']} steps" if results.get("control") else "no control run"


def device_line(results: dict) -> str:
    """"cpu", or "cuda (NVIDIA H100 80GB HBM3, CUDA 12.8)": which device produced these numbers."""
    if results.get("gpu"):
        return f"{results['device']} ({results['gpu']}, CUDA {results.get('cuda')})"
    return str(results.get("device", "cpu"))


def run_reporting(run: Callable[[argparse.Namespace], dict], args: argparse.Namespace) -> dict | int:
    """`run(args)`'s results, or the exit status of its failure after one `error:` line: 2 a user error (an
    option, a recipe, a phase that exited 2), 3 an infrastructure failure (a phase, or an eval's error samples,
    never scored as the model's answer)."""
    try:
        return run(args)
    except ErrorSamplesLeft as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except PhaseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if err.rc == 2 else 3


def main(argv: list[str] | None = None) -> int:
    results = run_reporting(run_bench, parse_args(argv))
    if isinstance(results, int):
        return results
    print("\n" + results_markdown(results))
    print(headline(results))
    return 0


def headline(results: dict) -> str:
    """The one line a user reads: held-out greedy pass@1 before -> after, the gain and its interval (and the
    control's), the GRPO phase's wall-clock."""
    g = results["run"]["greedy"]["lenient"]["overall"]
    line = (f"held-out greedy pass@1: {g['before']:.3f} -> {g['after']:.3f}, gain {g['diff']:+.3f} "
            f"[{g['low']:+.3f}, {g['high']:+.3f}] (95% paired bootstrap, {results['eval_size']} problems)")
    if results.get("control"):
        c = results["control"]["greedy"]["lenient"]["overall"]
        line += f"; lr-0 control gain {c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"
    return line + f"; GRPO {results['timings_s'].get('grpo_run', 0):.0f} s"


if __name__ == "__main__":
    sys.exit(main())
