"""bench/learning.py on a multi-turn task: the tiny random model learns the scripted `guess_123` game of the
`guess_number` environment (secret 1, 2 or 3; two guesses; after a wrong guess the environment says "Higher." or
"Lower."), through the bench's whole pipeline (eval before, GRPO, export, eval after, the lr-0 control), every
eval a `multi_turn` run of `run_eval.py`.

What it shows beyond a gain: problems solved on the *second* guess, after the environment's reply (a single
guess can solve at most the share of the most common secret). What it does not show: that the second guess
depends on the reply. Runs learned "2" then "3" after "Higher." and "2" after "Lower." (twice), or "3" then "2"
after "Lower." (the first guess 3 never hears "Higher."); both score 2/3, what the best policy that ignores the
reply also scores (docs/learning.md#multi-turn). Measured on 2 shared cores: 3.7 to 9.4 minutes (GRPO 150 steps
73 to 311 s) at load 7 to 11; held-out greedy pass@1 0.000 -> 0.667 in each of three runs, control +0.000.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from child_env import one_thread_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_the_tiny_model_learns_to_use_the_environments_feedback(tmp_path: Path) -> None:
    from nemo_rl_ext.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "soft_tiny", seed=0, initializer_range=0.05)
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "bench" / "learning.py"), "--recipe", "full_ft", "--task", "guess_123",
           "--model", str(model), "--train-size", "32", "--heldout-size", "36", "--eval-size", "36",
           "--samples", "0", "--steps", "150", "--control-steps", "2", "--resamples", "2000", "--out", str(out),
           "--set", "optimizer.lr=1e-3", "rollouts.num_generations_per_prompt=16", "grpo.num_prompts_per_step=4",
           "optimizer.micro_batch_size=16", "policy.max_model_len=256", "rollouts.max_seq_len=256",
           "policy.generation.max_new_tokens=8"]
    proc = subprocess.run(cmd, cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=890)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())

    gain = results["run"]["greedy"]["lenient"]["overall"]
    control = results["control"]["greedy"]["lenient"]["overall"]
    assert gain["low"] > 0.0, gain
    assert control["low"] <= 0.0 <= control["high"], control

    # every eval and both trainings ran multi-turn with the guess_number environment
    for name in ("grpo_run", "grpo_control", "eval_before_greedy", "eval_after_greedy", "eval_control_greedy"):
        rollouts = yaml.safe_load((out / "configs" / f"{name}.yaml").read_text())["rollouts"]
        assert rollouts["max_rollout_turns"] == 2 and rollouts["env"]["name"] == "guess_number", name
    summary = json.loads((out / "evals" / "after_greedy" / "summary.json").read_text())
    assert summary["rollout_mode"] == "multi_turn"

    # the gain needs the second turn, i.e. a move after the environment's reply: more solved than any single
    # first guess can solve (the share of the most common secret), the surplus solved on turn 2
    secrets = Counter(json.loads(line)["answer"] for line in (out / "data" / "heldout_eval.jsonl").open())
    after = results["turns"]["after"]
    assert gain["after"] > max(secrets.values()) / sum(secrets.values()), (gain, secrets)
    assert after["solved_later_turn"] > 0.0, after
    # the second moves answered the environment's feedback (the trained model replies with a number)
    moves = after["next_move_after_reply"]
    assert moves and set(moves) <= {"Higher.", "Lower."}, moves
    assert all(move in {"1", "2", "3"} for counts in moves.values() for move in counts), moves
    assert results["turns"]["before"]["solved_later_turn"] == 0.0
