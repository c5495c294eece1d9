"""Faults injected into real eval runs (tiny model, in-process and through the CLI), counted.

Each test injects infrastructure faults (an environment that raises, a generation that fails), then
counts what the eval did with them:

- injected: faults the fakes raised (and the (prompt, sample) pairs they hit),
- recorded: error lines in completions.jsonl for those pairs (an error is data, never dropped),
- retried: pairs that a re-run rolled out again (exactly the errored ones),
- lost: pairs with neither a result nor a recorded error (must be 0).

The faults go away on the re-run, which must then end with the summary of a clean run. The counts are
printed (`pytest -s`) for the Reliability table (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.environments.registry import register_environment
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import EvalResult, run_eval
from nemo_rl_ext.evals.metrics import PromptSamples, aggregate_eval_metrics
from nemo_rl_ext.evals.profile import untimed_bytes, without_timings
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.native_rollouts import rollout_seed
from nemo_rl_ext.models.generation.interfaces import GenerationInterface
from nemo_rl_ext.testing import RolloutStep, ScriptedEnvironment, ScriptedGeneration, ScriptedRequest

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = REPO / "examples" / "data" / "arithmetic.jsonl"
SEED = 0
ENV_FAULTS_VAR = "NEMO_RL_EXT_TEST_ENV_FAULTS"
"""Set to a file path in a CLI run: the flaky environment raises and logs each fault there."""

# ---- fakes --------------------------------------------------------------------------------------------

_ENV_FAULTS: dict[str, Any] = {"on": False, "raised": []}


def _reply(log: Sequence[Message]) -> str:
    return next(m.content for m in reversed(log) if m.role == "assistant")


def _question(log: Sequence[Message]) -> str:
    return next(m.content for m in log if m.role == "user")


def _flaky_fault(step: RolloutStep) -> RuntimeError | None:
    """While faults are on, a fault for each reply that would score 1 (logged to ENV_FAULTS_VAR's file in a
    CLI run)."""
    log_path = os.environ.get(ENV_FAULTS_VAR)
    if str(len(step.reply) % 3) != "0" or not (_ENV_FAULTS["on"] or log_path):
        return None
    key = (step.question, step.reply)
    _ENV_FAULTS["raised"].append(key)
    if log_path:
        with open(log_path, "a") as f:
            f.write(json.dumps(key) + "\n")
    return RuntimeError("injected env fault")


@register_environment("fault_test_flaky")
class FlakyParityEnv(ScriptedEnvironment):
    """Answer = len(reply) % 3, reward 1 for "0"; while faults are on, it raises for exactly the replies
    that would score 1 (so scoring an error as 0 would change the metrics) and logs each one."""

    def __init__(self) -> None:
        super().__init__(turns=1, observation=Observation("environment", ""), fault=_flaky_fault,
                         answer=lambda s: str(len(s.reply) % 3),
                         reward=lambda s: 1.0 if len(s.reply) % 3 == 0 else 0.0)


@contextmanager
def env_faults() -> Iterator[list[tuple[str, str]]]:
    """Turn the flaky environment's faults on; yields the (question, reply) of every fault it raised."""
    _ENV_FAULTS.update(on=True, raised=[])
    try:
        yield _ENV_FAULTS["raised"]
    finally:
        _ENV_FAULTS["on"] = False


class FailingGeneration(ScriptedGeneration):
    """Wraps a backend; the first turn of chosen (prompt, sample) pairs raises, every time (`persistent`)
    or only on its first call (`transient`, which the fault policy's in-run retry absorbs)."""

    def __init__(
        self,
        inner: GenerationInterface,
        persistent: set[tuple[int, int]],
        transient: set[tuple[int, int]] = frozenset(),
    ) -> None:
        super().__init__(inner.tokenizer, self._fault, backend=inner, max_model_len=inner.max_model_len)
        self.pair_of_seed = {rollout_seed(SEED, p, s, 0): (p, s) for p, s in persistent | transient}
        self.persistent, self.transient = set(persistent), set(transient)
        self.raised: list[tuple[int, int]] = []
        """The pair of every call that raised, in call order."""

    def _fault(self, request: ScriptedRequest) -> RuntimeError | None:
        pair = self.pair_of_seed.get(request.config.seed)
        if pair in self.persistent or (pair in self.transient and pair not in self.raised):
            self.raised.append(pair)
            return RuntimeError(f"injected generation fault for prompt {pair[0]}, sample {pair[1]}")
        return None  # the wrapped backend answers

    def shutdown(self) -> None:
        pass  # the wrapped backend is the module's, shared by every test


# ---- helpers ------------------------------------------------------------------------------------------


def cli_args(tiny_model_dir: Path, save_path: Path) -> list[str]:
    return [
        "--config",
        str(REPO / "examples" / "configs" / "evals" / "eval.yaml"),
        f"policy.model_name={tiny_model_dir}",
        f"eval.save_path={save_path}",
        f"eval.dataset_path={ARITHMETIC}",
        "rollouts.env.name=fault_test_flaky",
        "eval.num_prompts=6",
        "rollouts.max_seq_len=256",
        "policy.max_model_len=512",
        "policy.generation.max_new_tokens=8",
        "policy.generation.temperature=1.0",
        f"policy.generation.seed={SEED}",
    ]


def make_cfg(tiny_model_dir: Path, save_path: Path) -> EvalConfig:
    from nemo_rl_ext.config import load_config

    args = cli_args(tiny_model_dir, save_path)
    return load_config(args[1], args[2:], EvalConfig)


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_lines(path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Each pair's result (its first non-error line), or its latest error line when it has none."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for x in read_lines(path):
        key = (x["prompt_idx"], x["sample_idx"])
        if key not in out or out[key]["stop_reason"] == "error":
            out[key] = x
    return out


def untimed(path: Path) -> bytes:
    """summary.json's bytes without the profile's timings."""
    return untimed_bytes(path.read_bytes(), indent=True)


def pairs(lines: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    return sorted((x["prompt_idx"], x["sample_idx"]) for x in lines)


@pytest.fixture(scope="module")
def clean(tiny_model_dir, generation, tmp_path_factory) -> EvalResult:
    """The same eval with no faults: 6 prompts x 4 samples."""
    result = run_eval(
        make_cfg(tiny_model_dir, tmp_path_factory.mktemp("clean") / "out"),
        generation=generation,
        progress=False,
    )
    assert result.summary["num_errors"] == 0
    rewards = [x["reward"] for x in read_lines(result.paths.completions)]
    assert 0 < sum(rewards) < len(rewards), "want some samples that the flaky env fails"
    return result


def report(name: str, **counts: int) -> None:
    print(f"\n[faults] {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))


# ---- the tests ----------------------------------------------------------------------------------------


def run_with_env_faults(cfg: EvalConfig, generation: GenerationInterface) -> tuple[EvalResult, int, int]:
    """A run whose environment raises for some samples: (result, faults injected, error lines recorded
    for exactly those faults)."""
    with env_faults() as raised:
        result = run_eval(cfg, generation=generation, progress=False)
    errors = [x for x in read_lines(result.paths.completions) if x["stop_reason"] == "error"]
    assert all(x["error"] == "RuntimeError: injected env fault" and x["reward"] == 0.0 for x in errors)
    recorded = [x for x in errors if (_question(_msgs(x)), _reply(_msgs(x))) in set(raised)]
    assert len(raised) > 0 and len(recorded) == len(errors) == len(raised)  # each fault recorded once
    return result, len(raised), len(recorded)


@pytest.mark.timeout(60)
def test_env_faults_are_counted_not_scored(tiny_model_dir, generation, tmp_path) -> None:
    first, injected, _ = run_with_env_faults(make_cfg(tiny_model_dir, tmp_path / "out"), generation)
    lines = read_lines(first.paths.completions)
    assert len(lines) == 24 and first.summary["num_errors"] == injected
    metrics = first.summary["metrics"]
    assert metrics["num_samples"] == 24 - injected  # not 24: an error is not a sample with reward 0
    # metrics over the non-error samples only (the env failed exactly the replies that score 1)
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for x in sorted(lines, key=lambda x: x["sample_idx"]):
        by_prompt.setdefault(x["prompt_idx"], []).append(x)
    expected = aggregate_eval_metrics(
        [
            PromptSamples(
                "fault_test_flaky",
                tuple(x["reward"] for x in g if x["stop_reason"] != "error"),
                tuple(x["answer"] for x in g if x["stop_reason"] != "error"),
                num_errors=sum(x["stop_reason"] == "error" for x in g),
            )
            for _, g in sorted(by_prompt.items())
        ],
        [1, 2, 4],
    )
    assert metrics == pytest.approx(expected)
    assert metrics["num_errors"] == injected and metrics["agent/fault_test_flaky/num_errors"] == injected
    assert metrics["num_prompts_short@4"] == sum(
        any(x["stop_reason"] == "error" for x in g) for g in by_prompt.values()
    )
    errors = [x for x in lines if x["stop_reason"] == "error"]
    summary = first.summary
    assert summary["status"] == "errors_left" and first.errors_left and first.errors_written == injected
    assert (
        summary["error_rate"] == pytest.approx(injected / 24) and summary["stop_reasons"]["error"] == injected
    )
    assert {(e["prompt_idx"], e["sample_idx"]) for e in summary["error_samples"]} == set(pairs(errors))
    report_md = first.paths.report.read_text()
    assert "- status: `errors_left`" in report_md and f"| errors (not scored) | {injected} |" in report_md


@pytest.mark.timeout(60)
def test_env_faults_are_retried_on_resume_to_the_clean_summary(
    tiny_model_dir, generation, clean, tmp_path
) -> None:
    cfg = make_cfg(tiny_model_dir, tmp_path / "out")
    first, injected, recorded = run_with_env_faults(cfg, generation)
    lines = read_lines(first.paths.completions)
    errors = [x for x in lines if x["stop_reason"] == "error"]

    resumed = run_eval(cfg, generation=generation, progress=False)  # the faults are gone
    new_lines = read_lines(resumed.paths.completions)[len(lines) :]
    assert pairs(new_lines) == pairs(errors)  # exactly the errored samples get new lines
    assert untimed(resumed.paths.summary) == untimed(clean.paths.summary)
    assert without_timings(resumed.summary.to_json()) == without_timings(clean.summary.to_json())
    retried = resumed.retried
    assert (
        retried == injected and resumed.errors_written == 0 and resumed.skipped_completions == 24 - injected
    )
    final = final_lines(resumed.paths.completions)
    lost = 24 - sum(x["stop_reason"] != "error" for x in final.values())
    assert lost == 0 and final == final_lines(clean.paths.completions)
    report("env raises", injected=injected, recorded=recorded, retried=retried, lost=lost)


def _msgs(line: dict[str, Any]) -> list[Message]:
    return [Message(m["role"], m["content"], ()) for m in line["message_log"]]


@pytest.mark.timeout(60)
def test_generation_faults_persist_until_they_go_away(tiny_model_dir, generation, clean, tmp_path) -> None:
    cfg = make_cfg(tiny_model_dir, tmp_path / "out")
    broken = {(0, 1), (2, 3), (4, 0), (4, 2)}
    flaky = {(1, 0)}  # fails once: the fault policy's in-run retry absorbs it
    gen = FailingGeneration(generation, persistent=broken, transient=flaky)
    first = run_eval(cfg, generation=gen, progress=False)
    attempts = 1 + FaultPolicy().generation_retries  # the eval's default policy retries in the run
    assert sorted(gen.raised) == sorted([p for p in broken for _ in range(attempts)] + list(flaky))
    errors = [x for x in read_lines(first.paths.completions) if x["stop_reason"] == "error"]
    assert pairs(errors) == sorted(broken) and first.summary["num_errors"] == len(broken)
    assert all("injected generation fault" in x["error"] for x in errors)
    assert first.summary["metrics"]["num_samples"] == 24 - len(broken)
    assert final_lines(first.paths.completions)[(1, 0)] == final_lines(clean.paths.completions)[(1, 0)]

    # a re-run while (0, 1) is still broken: it fails again (recorded again), the others are fixed
    gen2 = FailingGeneration(generation, persistent={(0, 1)})
    second = run_eval(cfg, generation=gen2, progress=False)
    assert second.retried == len(broken) and second.errors_written == 1 and second.completions_written == 4
    assert second.summary["status"] == "errors_left" and second.summary["num_errors"] == 1
    assert second.summary["error_samples"][0]["prompt_idx"] == 0

    third = run_eval(cfg, generation=generation, progress=False)
    assert third.retried == 1 and third.completions_written == 1 and third.errors_written == 0
    assert without_timings(third.summary.to_json()) == without_timings(clean.summary.to_json())
    lines = read_lines(third.paths.completions)
    all_errors = [x for x in lines if x["stop_reason"] == "error"]
    assert len(lines) == 24 + len(broken) + 1 and len(all_errors) == len(broken) + 1  # history kept
    final = final_lines(third.paths.completions)
    lost = 24 - sum(x["stop_reason"] != "error" for x in final.values())
    assert lost == 0 and final == final_lines(clean.paths.completions)
    report(
        "generation raises",
        injected_calls=len(gen.raised) + len(gen2.raised),
        injected_pairs=len(broken) + len(flaky),
        recorded=len(all_errors),
        retried_in_run=len(flaky),
        retried_on_resume=second.retried + third.retried,
        lost=lost,
    )


@pytest.mark.timeout(90)
def test_cli_exits_3_with_errors_left_and_0_once_they_are_retried(
    tiny_model_dir, clean, tmp_path, monkeypatch, capsys
) -> None:
    """The first run is a real CLI process (the flaky env imported before run_eval.py starts); the
    re-runs call the same `main` in-process, to keep the test fast."""
    out = tmp_path / "cli"
    fault_log = tmp_path / "faults.jsonl"
    run = (
        f"import sys, runpy; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_faults; "
        f"sys.argv = ['run_eval.py', *sys.argv[1:]]; "
        f"runpy.run_path({str(REPO / 'examples' / 'run_eval.py')!r}, run_name='__main__')"
    )
    env = {**os.environ, ENV_FAULTS_VAR: str(fault_log)}
    proc = subprocess.run(
        [sys.executable, "-c", run, *cli_args(tiny_model_dir, out), "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
    )
    injected = len(fault_log.read_text().splitlines())
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"error: {injected} error sample(s) left" in proc.stderr and "Traceback" not in proc.stderr
    assert f"{injected} error sample(s) left" in proc.stdout and "injected env fault" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "errors_left" and summary["num_errors"] == injected > 0
    recorded = sum(x["stop_reason"] == "error" for x in read_lines(out / "completions.jsonl"))
    assert recorded == injected

    main = runpy.run_path(str(REPO / "examples" / "run_eval.py"))["main"]
    monkeypatch.setenv(ENV_FAULTS_VAR, str(fault_log))  # the same faults again, but allowed: exit 0
    assert main([*cli_args(tiny_model_dir, out), "eval.max_error_rate=1.0", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "errors_allowed"
    recorded = sum(x["stop_reason"] == "error" for x in read_lines(out / "completions.jsonl"))
    injected = len(fault_log.read_text().splitlines())
    assert recorded == injected

    monkeypatch.delenv(ENV_FAULTS_VAR)  # the faults are gone
    capsys.readouterr()
    assert main([*cli_args(tiny_model_dir, out), "--no-progress"]) == 0
    assert f"{summary['num_errors']} error sample(s) to retry" in capsys.readouterr().out
    assert untimed(out / "summary.json") == untimed(clean.paths.summary)
    final = final_lines(out / "completions.jsonl")
    lost = 24 - sum(x["stop_reason"] != "error" for x in final.values())
    retried = [run["retried"] for run in read_lines(out / "runs.jsonl")]
    assert lost == 0 and retried == [0, summary["num_errors"], summary["num_errors"]]
    report("CLI, env raises", injected=injected, recorded=recorded, retried=sum(retried), lost=lost)
