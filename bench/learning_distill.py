"""On-policy distillation against GRPO, measured: the learning bench's task, a trained SmolLM2 as the teacher
served over HTTP by our policy server, and three students from the untrained model on the same budget.

    python bench/learning_distill.py                                  # trains the teacher first (recipe lora)
    python bench/learning_distill.py --teacher results/learning/lora/run/export   # a bench run's export
    python bench/learning_distill.py --save-every 10 --steps 30       # fewer points on the curves

1. the task generator, as bench/learning.py (the same options: --task, --train-size, --eval-size, --set, ...);
2. the teacher: `--teacher DIR` (an exported folder; when it lies in a bench run's OUT/run/export, that run's
   data must equal this run's, so no held-out problem was in the teacher's training) or GRPO with
   `--teacher-recipe` then its export; its held-out greedy pass@1 is the ceiling the students are read against;
3. eval before (greedy, T 0): the untrained student's held-out pass@1, every curve's 0-sample point;
4. the teacher served by `python -m nemo_rl_ext.serving.policy_server` on a free port of 127.0.0.1;
5. three students from the untrained model with the `opd` recipe (examples/configs/recipes/opd.yaml), each with a
   checkpoint every --save-every steps, exported and evaluated (greedy):
   - `distill`: on-policy distillation alone (reward_weight 0: the reward is logged, never trained on);
   - `grpo`: GRPO from scratch on the reward (the teacher off), the same steps, prompts and samples;
   - `mixed`: both (reward_weight --mixed-reward-weight: distillation advantage + that x GRPO's);
6. the control: `distill` with `optimizer.lr: 0` for --control-steps steps, exported and evaluated.
Training seconds are the sum of the steps' wall-clock (`timing/step_s`: generation, teacher scoring, update), so
loading, saving, exports and evals are not counted. Every phase has OMP_NUM_THREADS=--threads (default 1), the
teacher server too. OUT (default results/learning/distill) holds results.md, results.json,
pass1_vs_budget.png, configs/, logs/ (the teacher server's too), data/, teacher/, distill/, grpo/, mixed/, control/.
Exit status as bench/learning.py.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line  # noqa: E402
from learning import (  # noqa: E402
    REPO,
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
    train_and_export,
)
from learning_distill_report import curve_rows, plot_budget, reached, results_markdown  # noqa: E402
from learning_trl import read_jsonl, run_ours, step_seconds  # noqa: E402

STUDENTS = ("distill", "grpo", "mixed")
"""The three students, in the order they run."""


def parse_args(argv: list[str] | None = None):
    p = build_parser(__doc__)
    p.set_defaults(recipe="opd")
    p.add_argument("--teacher", metavar="DIR", help="an exported model folder to distil from (default: train one "
                   "with --teacher-recipe first)")
    p.add_argument("--teacher-recipe", default="lora", help="the GRPO recipe that trains the teacher when "
                   "--teacher is not given (its --steps: --teacher-steps)")
    p.add_argument("--teacher-steps", type=int, help="grpo.max_num_steps of the teacher's training (default: the "
                   "teacher recipe's)")
    p.add_argument("--save-every", type=int, default=5,
                   help="checkpoint (and evaluate) every student every this many steps; must divide the steps")
    p.add_argument("--mixed-reward-weight", type=float, default=1.0,
                   help="on_policy_distillation.reward_weight of the `mixed` student (default 1.0)")
    p.add_argument("--server-start-s", type=float, default=300.0, help="seconds the teacher server may take to start")
    for action in p._actions:  # greedy pass@1 only: the curves are the point
        if action.dest == "samples":
            action.help = "(not used: every eval here is greedy)"
    args = p.parse_args(argv)
    args.samples = 0
    return args


def check(args, recipe: dict) -> list[int]:
    """The save steps; a ValueError naming every option this bench cannot run with."""
    cfg = grpo_config(recipe, args, Path("train.jsonl"), Path("run"), control=False)
    steps, problems = cfg["grpo"].get("max_num_steps"), []
    if not cfg.get("on_policy_distillation", {}).get("enabled"):
        problems.append(f"--recipe {args.recipe}: on_policy_distillation is not enabled (use the opd recipe)")
    if not isinstance(steps, int) or args.save_every < 1 or steps % args.save_every:
        problems.append(f"--save-every {args.save_every} must be >= 1 and divide the step count ({steps})")
    if args.teacher and not (Path(args.teacher) / "config.json").is_file():
        problems.append(f"--teacher {args.teacher}: not a model folder (no config.json)")
    if args.mixed_reward_weight <= 0:
        problems.append(f"--mixed-reward-weight must be > 0 (0 is the distill student), got {args.mixed_reward_weight}")
    if problems:
        raise ValueError("bench/learning_distill.py cannot run this:\n  " + "\n  ".join(problems))
    return list(range(args.save_every, steps + 1, args.save_every))


def teacher_folder(args, runner: Runner, out: Path) -> tuple[str, str]:
    """The teacher's exported folder and how it was obtained: --teacher (its bench run's data checked when it
    has one) or GRPO with --teacher-recipe, exported."""
    if args.teacher:
        folder = Path(args.teacher).resolve()
        bench_run = folder.parent.parent if folder.parent.name in ("run", "ours") else None
        if bench_run is not None and (bench_run / "data" / "heldout.jsonl").is_file():
            differ = data_differences(bench_run, out)
            if differ:
                raise ValueError(f"--teacher {folder}: its bench run's {' and '.join(differ)} "
                                 f"differ{'s' if len(differ) == 1 else ''} from this run's (the teacher may have "
                                 "trained on these held-out problems)")
            return str(folder), f"`--teacher {folder}` (trained by the bench run in {bench_run}: the same data)"
        return str(folder), f"`--teacher {folder}` (not a bench run's export: its training data are not checked)"
    _, recipe = load_recipe(args.teacher_recipe)
    targs = json.loads(json.dumps(vars(args)))
    targs["steps"] = args.teacher_steps
    cfg = grpo_config(recipe, type(args)(**targs), out / "data" / "train.jsonl", out / "teacher", control=False)
    export = train_and_export(runner, cfg, "teacher")
    return str(export), f"GRPO with the `{args.teacher_recipe}` recipe in this run ({out / 'teacher'})"


@contextlib.contextmanager
def teacher_server(folder: str, runner: Runner, start_s: float, max_model_len: int) -> Iterator[str]:
    """Our policy server over `folder` on a free port of 127.0.0.1, its log in logs/teacher_server.log: yields
    its /v1 URL once it listens, and stops it (SIGTERM, then kill) after the block."""
    log_path = runner.out / "logs" / "teacher_server.log"
    cmd = [sys.executable, "-m", "nemo_rl_ext.serving.policy_server", "--model", folder, "--host", "127.0.0.1",
           "--port", "0", "--dtype", "float32", "--max-model-len", str(max_model_len), "--log-level", "info"]
    print(f"[{time.strftime('%H:%M:%S')}] teacher server: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=runner.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    url: list[str] = []
    listening = threading.Event()

    def drain() -> None:
        with log_path.open("w") as fh:
            for line in proc.stderr:
                fh.write(line)
                fh.flush()
                found = re.search(r"listening on (http://\S+/v1)", line)
                if found:
                    url.append(found.group(1))
                    listening.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not listening.wait(start_s):
            raise PhaseError(f"teacher_server (not listening within {start_s:.0f} s)", 3, log_path)
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def server_requests(url: str) -> dict[str, int]:
    """The teacher server's answered `/v1/completions` requests by status code, from its Prometheus `/metrics`
    (how many scoring requests the students sent; a non-200 status is a request the fault policy retried or
    turned into error completions)."""
    base = url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    pattern = r'^nemo_rl_ext_requests_total\{route="/v1/completions",status="(\d+)"\} ([0-9.e+]+)$'
    return {m.group(1): int(float(m.group(2))) for m in re.finditer(pattern, text, flags=re.M)}


def student_config(base: dict, name: str, url: str, out: Path, args) -> dict:
    """The opd recipe's config for one student: the teacher at `url`; `grpo` with the teacher off, `mixed` with
    the reward's weight."""
    cfg = json.loads(json.dumps(base))
    set_key(cfg, "output_dir", str(out / name))
    set_key(cfg, "on_policy_distillation.default_teacher_alias", url)
    set_key(cfg, "on_policy_distillation.teacher_model_by_agent_name", {})
    if name == "grpo":
        cfg["on_policy_distillation"] = {"enabled": False}
    elif name == "mixed":
        set_key(cfg, "on_policy_distillation.reward_weight", args.mixed_reward_weight)
    else:
        set_key(cfg, "on_policy_distillation.reward_weight", 0.0)
    return cfg


def train_students(args, runner: Runner, base: dict, url: str, saves: list[int], eval_file: Path,
                   expected: list[str]) -> tuple[dict, dict, dict]:
    """Every student trained, exported at each save step and evaluated: (scores, seconds, evals read) per
    student, step 0 being the untrained model (scores filled in by the caller)."""
    scores, seconds, read = {}, {}, {}
    for name in STUDENTS:
        cfg = student_config(base, name, url, runner.out, args)
        exports = run_ours(runner, cfg, saves, tag=name)
        scores[name] = {}
        for step, folder in exports.items():
            tag = f"{name}_step{step}"
            scores[name][step] = evaluate(runner, cfg, args, eval_file, folder, tag, expected)["greedy"]
            read[tag] = {"export": folder, "run_eval_read": eval_read(runner.out / "evals" / f"{tag}_greedy")}
        rows = [r for r in read_jsonl(runner.out / name / "metrics.jsonl") if r.get("step", 0) > 0]
        seconds[name] = {0: 0.0, **step_seconds(rows, "timing/step_s")}
    return scores, seconds, read


def run_control(args, runner: Runner, base: dict, url: str, eval_file: Path, expected: list[str]):
    """The distill student with lr 0 for --control-steps steps, exported and evaluated (None when 0 steps)."""
    if args.control_steps <= 0:
        return None
    cfg = student_config(base, "control", url, runner.out, args)
    set_key(cfg, "optimizer.lr", 0.0)
    set_key(cfg, "grpo.max_num_steps", args.control_steps)
    export = train_and_export(runner, cfg, "control")
    return evaluate(runner, cfg, args, eval_file, str(export), "control", expected)["greedy"]


def run_distill(args) -> dict:
    """Every phase, then the curves; returns results.json's content."""
    machine = machine_line(f"OMP_NUM_THREADS={args.threads}")
    if not args.out:
        args.out = str(REPO / "results" / "learning" / "distill")
    saves = check(args, load_recipe(args.recipe)[1])
    out, recipe, evaluated, train_file, eval_file = prepare(args)
    runner = Runner(out, args.threads, args.phase_timeout)
    base = grpo_config(recipe, args, train_file, out / "run", control=False)
    set_key(base, "keep_last_checkpoints", None)
    expected = [r["answer"] for r in evaluated]
    teacher, teacher_how = teacher_folder(args, runner, out)
    teacher_scores = evaluate(runner, base, args, eval_file, teacher, "teacher", expected)["greedy"]
    before = evaluate(runner, base, args, eval_file, base["policy"]["model_name"], "before", expected)["greedy"]
    with teacher_server(teacher, runner, args.server_start_s, base["policy"].get("max_model_len", 512)) as url:
        scores, seconds, read = train_students(args, runner, base, url, saves, eval_file, expected)
        control = run_control(args, runner, base, url, eval_file, expected)
        requests = server_requests(url)
    samples = base["grpo"]["num_prompts_per_step"] * base["rollouts"]["num_generations_per_prompt"]
    curves = {name: curve_rows({0: before, **scores[name]}, seconds[name], before, teacher_scores, samples,
                               seed=args.seed, resamples=args.resamples) for name in STUDENTS}
    results = {
        "recipe": args.recipe, "task": args.task, "model": base["policy"]["model_name"], "steps": saves[-1],
        "teacher_requests": requests,
        "save_every": args.save_every, "eval_size": len(evaluated), "heldout_size": args.heldout_size,
        "train_size": args.train_size, "seed": args.seed, "resamples": args.resamples, "machine": machine,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "threads": args.threads,
        "prompts_per_step": base["grpo"]["num_prompts_per_step"], "samples_per_step": samples,
        "generations": base["rollouts"]["num_generations_per_prompt"], "lr": base["optimizer"]["lr"],
        "mixed_reward_weight": args.mixed_reward_weight, "kl_type": base["on_policy_distillation"]["kl_type"],
        "teacher": {"folder": teacher, "how": teacher_how,
                    **curve_rows({0: teacher_scores}, {0: 0.0}, before, teacher_scores, samples, seed=args.seed,
                                 resamples=args.resamples)[0]},
        "curves": curves, "reached": reached(curves), "timings_s": runner.timings, "evals_read": read,
        "control": control and curve_rows({0: control}, {0: 0.0}, before, teacher_scores, samples,
                                          seed=args.seed, resamples=args.resamples)[0],
        "control_steps": args.control_steps,
        "reward": {name: [(r["step"], r["rollout/reward/mean"]) for r in read_jsonl(out / name / "metrics.jsonl")
                          if r.get("step", 0) > 0] for name in STUDENTS},
    }
    results["plots"] = plot_budget(results, out / "pass1_vs_budget.png")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(results_markdown(results))
    return results


def main(argv: list[str] | None = None) -> int:
    results = run_reporting(run_distill, parse_args(argv))
    if isinstance(results, int):
        return results
    print("\n" + results_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
