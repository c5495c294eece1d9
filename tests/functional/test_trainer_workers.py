"""`trainer.workers: 2` (FSDP2 ranks as Ray actors, gloo on the CPU) against the in-process trainer on the say-"yes"
task: the same metrics and weights, no trainer model in the driver, a killed rank named within seconds, and
impossible resources refused before any model loads; sharded checkpoints (`torch.distributed.checkpoint`) that
resume on 1 or 2 ranks, skip a save a rank died in, and export. The ranks run on the session's one local Ray
(2 CPUs).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from child_env import one_thread_env
from safetensors.torch import load_file
from test_export import chat_items, reload_logprobs
from tolerances import SAME_MODEL_LOGPROBS, AdamRecord, assert_trained_weights_close
from transformers import PreTrainedModel

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.objectives.loss import CompletionTensors
from nemo_rl_ext.training.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer, TrainerWorkerError
from nemo_rl_ext.training.export import export_checkpoint
from nemo_rl_ext.training.export_weights import trained_weights
from nemo_rl_ext.training.sharded_checkpoint import SHARDS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread", "local_ray")
WORDS = ("apple", "river", "blue", "seven", "cat", "hello", "tree", "water")


def uneven_items() -> tuple[list[CompletionTensors], torch.Tensor]:
    """11 completions of lengths 6, 8, ..., 26 (seeded) and their advantages: in micro-batches of 4 on 2 ranks,
    rank 1 runs a dummy third one; sample 4 trains no token."""
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(11):
        ids = torch.randint(0, 1000, (6 + 2 * i,), generator=g)
        mask = torch.zeros(ids.numel())
        mask[5:] = 0.0 if i == 4 else 1.0
        items.append(CompletionTensors(ids, mask, -torch.rand(ids.numel(), generator=g) * mask))
    return items, torch.randn(11, generator=g)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The say-"yes" GRPO config on the soft tiny Qwen2, with a KL term (so the reference model is sharded too)
    and two minibatches per step (so the old-logprob pass runs on the ranks too)."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("workers_cfg")
    model = build_tiny_model(folder / "model", seed=0, initializer_range=0.05)
    data = folder / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n" for w in WORDS))
    cfg = {
        "policy": {
            "model_name": str(model),
            "max_model_len": 256,
            "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]},
            "hf": {"scheduler": "static"},
        },
        "rollouts": {"num_generations_per_prompt": 8, "max_seq_len": 128,
                     "env": {"name": "string_match", "kwargs": {"mode": "similarity"}}},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 4, "max_num_steps": 3, "seed": 42, "save_period": 1},
        # share_prompt_prefix off: the in-process trainer then runs the forward the ranks run (its prompt-sharing
        # path differs by float rounding, which Adam's first steps amplify to ~1e-4 on weights whose gradient is
        # near 0); micro_batch_size 8: each rank one micro-batch of a 16-sample minibatch
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 8, "max_grad_norm": 1.0, "minibatches_per_step": 2,
                      "share_prompt_prefix": False},
        # truncated importance sampling as in test_grpo.py (with it off, is_weight/truncated_fraction counts the
        # tokens whose trainer/engine ratio is above 1: float rounding flips those that sit at 1)
        "loss": {"kl_coef": 0.01, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "trainer": {"worker": {"num_cpus": 1}},
        "keep_last_checkpoints": None,
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
    }
    path = folder / "grpo_workers.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class _CausalLMs:
    """Records every causal LM built in this process while active (weak references), to count those alive.
    Not `gc.get_objects()`: it takes a reference to every object, tuples that another thread is still building
    included, and a grading pool's manager thread then died with "SystemError: bad argument to internal
    function" (seen in this test's xdist worker)."""

    def __init__(self) -> None:
        self.built: list[weakref.ref] = []

    def __enter__(self) -> _CausalLMs:
        original = self.original = PreTrainedModel.__init__

        def init(model, *args, **kwargs):
            original(model, *args, **kwargs)
            if type(model).__name__.endswith("ForCausalLM"):  # their inner decoders are PreTrainedModels too
                self.built.append(weakref.ref(model))

        PreTrainedModel.__init__ = init
        return self

    def __exit__(self, *exc) -> None:
        PreTrainedModel.__init__ = self.original

    def alive(self) -> int:
        gc.collect()
        return sum(1 for ref in self.built if ref() is not None)


def checkpoint_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The trained weights of a run's checkpoint: its Hugging Face folder (one process), or its shards consolidated."""
    return trained_weights(load_checkpoint(checkpoint_dir(run_dir / "checkpoints", step)))


def _run(config_file: Path, out: Path, workers: int, *overrides: str) -> tuple[list[dict], int, AdamRecord | None]:
    """Train 3 steps; returns the step metrics, the number of models this process held, and (one worker, the
    reference path) its optimizer's `AdamRecord`."""
    cfg = load_config(config_file, [f"output_dir={out}", f"trainer.workers={workers}", *overrides], GRPOConfig)
    with _CausalLMs() as lms, GRPO(cfg) as grpo:
        models = lms.alive()
        record = None
        if workers == 1:
            trained = {k: p for k, p in grpo.trainer.model.named_parameters() if p.requires_grad}
            record = AdamRecord(grpo.trainer.optimizer, trained)
        grpo.run()
    return read_metrics(out / "metrics.jsonl"), models, record


@pytest.fixture(scope="module")
def runs(config_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple]:
    """3 steps with 1 worker and with 2: {workers: (output_dir, step metrics, causal LMs in this process, the one
    worker's `AdamRecord` or None)}. The 2 ranks checkpoint their decoder layers' activations
    (`trainer.activation_checkpointing`): recomputing a layer in the backward runs the same kernels on the same
    inputs, so the update is the plain ranks' (measured: the same differences from one worker as without it), and
    one run checks both (suite time)."""
    out = {}
    for workers in (1, 2):
        folder = tmp_path_factory.mktemp(f"workers_{workers}")
        overrides = ("trainer.activation_checkpointing=true",) if workers == 2 else ()
        out[workers] = (folder, *_run(config_file, folder, workers, *overrides))
    return out


@pytest.mark.timeout(600)
def test_two_fsdp2_ranks_train_as_one_process_does(runs: dict, tmp_path: Path) -> None:
    """2 ranks (with activation checkpointing, see `runs`) against 1 in-process worker."""
    (dir_one, one, models_one, record), (dir_two, two, models_two, _) = runs[1], runs[2]
    # the driver of 2 ranks holds the engine's model only; the in-process run holds policy, reference and engine
    assert (models_one, models_two) == (3, 1)
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        keys = [k for k in a if k.startswith("train/")]
        assert keys and set(keys) <= set(b)
        # float32 sums in another order (the gradient summed over ranks, the global norm from shard norms):
        # measured differences of 1e-7 relative (grad_norm 4e-6); 1e-4 relative holds that and nothing coarser
        off = {k: (a[k], b[k]) for k in keys if b[k] != pytest.approx(a[k], rel=1e-4, abs=1e-7)}
        assert not off, off
        # the rollouts sampled from the refitted engine are the same tokens (the weights agree closely enough)
        assert a["rollout/reward/mean"] == b["rollout/reward/mean"]
        assert b["refit/bytes"] == a["refit/bytes"] > 0  # the same tensors handed to the engine
        assert b["refit/gathered_bytes"] > 0 and b["timing/refit/gather_seconds"] > 0 and b["refit/buckets"] == 1
        assert "refit/gathered_bytes" not in a
    for step in (1, 2, 3):
        assert not load_checkpoint(checkpoint_dir(dir_one / "checkpoints", step)).sharded  # one process: an HF folder
        assert load_checkpoint(checkpoint_dir(dir_two / "checkpoints", step)).sharded  # ranks: their shards
        w1, w2 = checkpoint_weights(dir_one, step), checkpoint_weights(dir_two, step)
        # the shards hold the tied LM head under both its names (the Hugging Face folder under the embedding's)
        assert w2.keys() == {*w1, "lm_head.weight"} and torch.equal(w2["lm_head.weight"], w2["model.embed_tokens.weight"])
        initial = load_file(Path(load_config(dir_one / "config.yaml", [], GRPOConfig).policy.model_name)
                            / "model.safetensors")
        moved = [k for k in w1 if not torch.equal(w1[k], initial[k])]
        assert len(moved) > len(w1) // 2  # trained: the comparison below compares updates
        # two optimizer steps a GRPO step (minibatches_per_step 2): Adam's rule for two paths' weights
        # (tests/tolerances.py): elements whose gradient is rounding noise (all of k_proj.bias, whose true gradient
        # is 0; any weight whose gradient cancels to near 0) may be up to 2 lr a step apart, the others agree to
        # noise / gradient of lr a step; lr 3e-3: a wrong update is ~1e-3 off
        power = assert_trained_weights_close(w1, w2, initial=initial, record=record.at(2 * step), lr=3.0e-3)
        assert power > 0, power  # some elements are held to 1% of a step (1.7% at step 1 here), all to 2 lr


def assert_resumed_step(resumed: dict, expected: dict, exact: bool) -> None:
    """A resumed step against the uninterrupted run's: the same rollouts (what the sampled tokens decide), and the
    train/ metrics as close as 1 and 2 workers always are, or (`exact`) to the bit."""
    for key, value in expected.items():
        if key.startswith("train/"):
            assert resumed[key] == (value if exact else pytest.approx(value, rel=1e-4, abs=1e-7)), key
        elif key.startswith("rollout/") and "time_s" not in key:
            assert resumed[key] == value, key


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved_by, resumed_by", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_onto_another_worker_count(runs: dict, saved_by: int, resumed_by: int,
                                                        tmp_path: Path) -> None:
    """Step 3's save never finished (`unfinish`), so resume=true continues from step 2's checkpoint, onto the other
    worker count (2 ranks' shards resharded onto one process; one process's Hugging Face folder sharded onto 2
    ranks): its step 3 is the uninterrupted runs' step 3 (the same rollouts; train/ metrics as close as 1 and 2
    workers always are). The same count (2 onto 2, to the bit): `test_two_ranks_resume_exactly_...`."""
    out = unfinish(runs[saved_by][0], tmp_path / "resumed")
    cfg = load_config(out / "config.yaml", [f"output_dir={out}", "resume=true", f"trainer.workers={resumed_by}"],
                      GRPOConfig)
    with GRPO(cfg) as grpo:
        assert grpo.step == 2
        grpo.run()
    (resumed,) = [m for m in read_metrics(out / "metrics.jsonl") if m["step"] == 3]
    for workers in (1, 2):
        (expected,) = [m for m in runs[workers][1] if m["step"] == 3]
        assert_resumed_step(resumed, expected, exact=False)


def unfinish(source: Path, out: Path) -> Path:
    """A copy of a 3-step run whose step-3 save never finished: no marker, and a file missing (of shards, rank 1's:
    a rank died while it wrote, then the driver)."""
    shutil.copytree(source, out)
    unfinished = checkpoint_dir(out / "checkpoints", 3)
    (unfinished / "complete.json").unlink()
    (unfinished / (f"{SHARDS}/__1_0.distcp" if (unfinished / SHARDS).is_dir() else "optimizer.pt")).unlink()
    return out


def _record_rank_lrs(trainer: DistributedTrainer, into: list) -> None:
    """After each `train_step`, append every rank's optimizer lrs (one per parameter group), asked of the ranks."""
    import ray

    train_step = trainer.train_step

    def group_lrs(rank) -> list[float]:  # runs inside a rank
        return [group["lr"] for group in rank.optimizer.param_groups]

    def recorded(items, advantages):
        metrics = train_step(items, advantages)
        into.append(ray.get([r.__ray_call__.remote(group_lrs) for r in trainer._ranks]))
        return metrics

    trainer.train_step = recorded


@pytest.mark.timeout(300)
def test_async_grpo_on_two_ranks_trains_as_one_process_does(config_file: Path, tmp_path: Path) -> None:
    """`grpo.async` (max_lag 1): the trainer thread drives the ranks; the steps match one worker's. The 2 ranks are
    replicated (`sharding: none`, all-reduced gradients), which the driver does not see: this run also checks that
    replicated ranks compute one process's update (suite time). Both train on an `optimizer.scheduler` (warm-up,
    linear decay): every rank's optimizer holds each step's scheduled lr, in every parameter group."""
    # lr 3e-3, W = 2, T = 3: step 1 at 3e-3 x 1/2, step 2 at lr, step 3 (the horizon) at min_lr
    schedule = ["optimizer.scheduler.type=linear", "optimizer.scheduler.warmup_steps=2",
                "optimizer.scheduler.min_lr=3.0e-4"]
    expected_lr = [1.5e-3, 3e-3, 3e-4]
    history, rank_lrs = {}, []
    for workers in (1, 2):
        replicated = ["trainer.sharding=none"] if workers == 2 else []
        cfg = load_config(config_file, [f"output_dir={tmp_path / str(workers)}", f"trainer.workers={workers}",
                                        "grpo.async.enabled=true", "grpo.async.max_lag=1", "grpo.save_period=0",
                                        *replicated, *schedule], GRPOConfig)
        with GRPO(cfg) as grpo:
            if workers == 2:
                _record_rank_lrs(grpo.trainer, rank_lrs)
            history[workers] = grpo.run()
    assert [m["step"] for m in history[2]] == [1, 2, 3]
    for workers in (1, 2):
        assert [m["train/lr"] for m in history[workers]] == pytest.approx(expected_lr, rel=1e-12), workers
    # each rank's optimizer, each group: the very float the driver computed (rank 0's is the logged train/lr)
    assert len(rank_lrs) == 3 and all(len(ranks) == 2 and all(ranks) for ranks in rank_lrs), rank_lrs
    assert [{lr for groups in ranks for lr in groups} for ranks in rank_lrs] == [{m["train/lr"]} for m in history[2]]
    for a, b in zip(history[1], history[2], strict=True):
        assert b["train/optimizer_steps"] == 2 and b["refit/gathered_bytes"] > 0
        assert a["rollout/reward/mean"] == b["rollout/reward/mean"]
        off = {k: (a[k], b[k]) for k in a if k.startswith("train/") and b[k] != pytest.approx(a[k], rel=1e-4, abs=1e-7)}
        assert not off, off


@pytest.mark.timeout(300)
def test_two_ranks_resume_exactly_export_and_a_rank_killed_mid_step_stops_the_run_naming_it(
    runs: dict, tmp_path: Path
) -> None:
    """One run proves three points. The 2-rank run's step-3 save never finished, so resume=true on 2 ranks
    continues from step 2's shards: its step 3 equals the uninterrupted step 3 to the bit (the same shards loaded,
    the same kernels on the same shapes). The export of its new step-3 checkpoint (the shards consolidated) is the
    ranks' weights to the bit, and transformers gives the trainer's logprobs from it. Then SIGKILL to rank 1
    during step 4 stops the run within seconds, naming it."""
    out = unfinish(runs[2][0], tmp_path / "run")
    cfg = load_config(out / "config.yaml", [f"output_dir={out}", "resume=true", "grpo.max_num_steps=20"], GRPOConfig)
    killed: dict[str, float] = {}
    with GRPO(cfg) as grpo:
        assert grpo.step == 2
        trainer = grpo.trainer
        assert isinstance(trainer, DistributedTrainer)
        victim = trainer.workers[1]
        train_step = trainer.train_step
        items = chat_items(grpo.tokenizer)
        after_step_3: dict[str, object] = {}

        def kill_during(batch, advantages):  # step 4: SIGKILL rank 1 while this step's passes run on the ranks
            if grpo.step < 3:
                return train_step(batch, advantages)
            after_step_3.update(logprobs=trainer.logprobs(items), weights=trainer.state_dict())

            def kill() -> None:
                time.sleep(0.2)
                killed["at"] = time.monotonic()
                os.kill(victim["pid"], signal.SIGKILL)

            threading.Thread(target=kill, daemon=True).start()
            return train_step(batch, advantages)

        trainer.train_step = kill_during
        with pytest.raises(TrainerWorkerError) as err:
            grpo.run()
        raised = time.monotonic()
    assert raised - killed["at"] < 30
    message = str(err.value)
    assert "rank 1" in message and str(victim["pid"]) in message and victim["node_id"] in message
    assert "died" in message, message

    (resumed,) = [m for m in read_metrics(out / "metrics.jsonl") if m["step"] == 3]
    assert_resumed_step(resumed, runs[2][1][2], exact=True)
    exported = export_checkpoint(out, out=tmp_path / "hf")
    assert exported.step == 3 and load_checkpoint(checkpoint_dir(out / "checkpoints", 3)).sharded
    got, state = reload_logprobs(exported.out, items, temperature=1.0)
    weights = after_step_3["weights"]
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], v) for k, v in weights.items())  # consolidated shards: a copy of the weights
    for mine, theirs in zip(got, after_step_3["logprobs"], strict=True):
        torch.testing.assert_close(mine, theirs, **SAME_MODEL_LOGPROBS)  # the same weights, other shapes


def test_more_ranks_than_the_cluster_has_cpus_is_refused_before_any_model_loads(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nemo_rl_ext.grpo.build as grpo_setup

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo_setup, "load_model_and_tokenizer", no_model)
    cfg = load_config(config_file, [f"output_dir={tmp_path}", "trainer.workers=3"], GRPOConfig)
    with pytest.raises(ConfigError, match=r"trainer.workers=3 x trainer.worker.num_cpus=1 needs 3 CPUs, the Ray "
                                          r"cluster has 2"):
        GRPO(cfg)


@pytest.mark.timeout(300)
def test_uneven_micro_batches_logprobs_and_optimizer_state_match_the_in_process_trainer(config_file: Path,
                                                                                      tmp_path: Path) -> None:
    """11 completions in micro-batches of 4: 3 micro-batches, so rank 1 runs a dummy one in its second slot; a
    sequence without trained tokens and a completion shorter than its peers ride along. Then the ranks' sharded
    checkpoint loads into the in-process trainer (the ranks' weights and optimizer state, to the bit), and a rank
    killed while the ranks write the next one fails that save, which leaves no step folder."""
    import ray

    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.training.distributed_trainer import rank_spec
    from nemo_rl_ext.training.trainer import PolicyTrainer

    cfg = load_config(config_file, ["trainer.workers=2", "optimizer.micro_batch_size=4",
                                    "optimizer.minibatches_per_step=1"], GRPOConfig)
    path = cfg.policy.model_name
    items, advantages = uneven_items()
    model, _ = load_model_and_tokenizer(path)
    reference, _ = load_model_and_tokenizer(path)
    local = PolicyTrainer(model, optimizer=cfg.optimizer, loss=cfg.loss.to_loss_config(), temperature=1.0,
                          pad_token_id=0, reference_model=reference)
    record = AdamRecord(local.optimizer, {k: p for k, p in local.model.named_parameters() if p.requires_grad})
    ranks = DistributedTrainer(rank_spec(cfg, path, path, 0), cfg.trainer, cfg.policy.cluster)
    try:
        # the ranks run this process's CPU kernels: Ray's workers inherit its environment, so the numerics check's
        # ATEN_CPU_CAPABILITY reaches them (torch reads it at import) and the comparisons below hold under it
        capability = torch.backends.cpu.get_cpu_capability()
        def rank_capability(_rank) -> str:  # runs inside a rank (imports there: no module of this file pickled)
            return __import__("torch").backends.cpu.get_cpu_capability()

        seen = ray.get([r.__ray_call__.remote(rank_capability) for r in ranks._ranks])
        assert seen == [capability] * 2, (capability, seen, os.environ.get("ATEN_CPU_CAPABILITY"))
        # the train/ metrics of steps 1 and 2: step 2 runs from weights whose noise elements (gradient ~ rounding)
        # went up to 2 lr apart (tests/tolerances.py), which moves the loss by gradient x move, i.e. noise x lr:
        # the metrics stay within float rounding (1e-4 relative holds it and nothing coarser)
        for _ in range(2):
            expected, got = local.train_step(items, advantages), ranks.train_step(items, advantages)
            assert got.keys() == expected.keys()
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-7)
        # the ranks' logprobs before the gather: with a forward after a gather, ranks.optimizer.state_dict() below
        # lacked the root unit's parameters (entries 0 and 25: the embedding and the final norm; seen, not fixed)
        ranks_logprobs = ranks.logprobs(items)
        weights = local.state_dict()
        gathered = ranks.state_dict()
        assert gathered.keys() == weights.keys()
        # 2 optimizer steps: Adam's rule for two paths (tests/tolerances.py)
        assert_trained_weights_close({k: weights[k] for k in record.initial}, gathered, initial=record.initial,
                                     record=record.at(2), lr=cfg.optimizer.lr)
        # the ranks' forward against one process's on the ranks' own weights (the trained weights may differ by
        # up to 2 lr where a gradient is noise, and a token's logprob need not be flat there): two code paths,
        # the same weights
        trained_here = {k: v.clone() for k, v in local.model.state_dict().items()}
        local.model.load_state_dict(gathered)
        for a, b in zip(local.logprobs(items), ranks_logprobs, strict=True):
            torch.testing.assert_close(b, a, **SAME_MODEL_LOGPROBS)  # logprobs down to -10
        local.model.load_state_dict(trained_here)
        assert gathered["lm_head.weight"] is gathered["model.embed_tokens.weight"]  # tied: gathered once
        state = ranks.optimizer.state_dict()
        local_state = local.optimizer.state_dict()  # torch's layout: the same on one process and on ranks
        assert state["state"].keys() == local_state["state"].keys()
        assert state["param_groups"] == local_state["param_groups"]
        for i, entry in state["state"].items():
            assert entry.keys() == local_state["state"][i].keys()
            assert torch.equal(entry["step"], local_state["state"][i]["step"])
        local.optimizer.load_state_dict(state)  # what a resume from 2 workers onto 1 does
        ranks.train_step(items, advantages)  # moves the optimizer state on; loading puts it back
        ranks.optimizer.load_state_dict(state)
        again = ranks.optimizer.state_dict()
        for name, entry in state["state"].items():
            for key, value in entry.items():
                assert torch.equal(again["state"][name][key], value), (name, key)
        _sharded_save_then_a_rank_dies_in_the_next(ranks, local, tmp_path / "checkpoints")
    finally:
        ranks.close()


def _sharded_save_then_a_rank_dies_in_the_next(ranks: DistributedTrainer, local, root: Path) -> None:
    from nemo_rl_ext.models.loading import load_tokenizer
    from nemo_rl_ext.training.checkpoint import list_checkpoints, save_checkpoint
    from nemo_rl_ext.training.sharded_checkpoint import load_trained_state

    tokenizer = load_tokenizer(ranks.spec.model_path)
    save_checkpoint(root, 1, tokenizer=tokenizer, data_state={}, write_state=ranks.save_sharded)
    weights, state = ranks.state_dict(), ranks.optimizer.state_dict()
    load_trained_state(checkpoint_dir(root, 1), local.model, local.optimizer)  # 2 ranks' shards onto one process
    assert all(torch.equal(local.model.state_dict()[k], v) for k, v in weights.items())
    for i, entry in local.optimizer.state_dict()["state"].items():
        assert all(torch.equal(value, state["state"][i][key]) for key, value in entry.items()), i

    victim = ranks.workers[1]

    def kill_mid_save(folder: Path) -> None:  # SIGKILL rank 1 once the ranks have begun writing the shards
        def kill() -> None:
            deadline = time.monotonic() + 30
            while not (folder / SHARDS).exists() and time.monotonic() < deadline:
                time.sleep(0.0005)
            os.kill(victim["pid"], signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        ranks.save_sharded(folder)

    with pytest.raises(TrainerWorkerError, match=f"rank 1 \\(pid {victim['pid']}\\)"):
        save_checkpoint(root, 2, tokenizer=tokenizer, data_state={}, write_state=kill_mid_save)
    assert list_checkpoints(root) == [checkpoint_dir(root, 1)] and sorted(p.name for p in root.iterdir()) == [
        checkpoint_dir(root, 1).name]  # no step_2 folder, no temporary folder


def _grpo_cli(*args: str) -> subprocess.Popen:
    """examples/run_grpo.py ARGS (its own local Ray of every core), stdout and stderr apart."""
    return subprocess.Popen([sys.executable, str(REPO / "examples" / "run_grpo.py"), *args], cwd=REPO,
                            env=one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, done, what: str, within_s: float = 180) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {what} after {within_s} s"
        time.sleep(0.05)


def _trainer_ranks(psutil, pid: int) -> list[int]:
    return [p for p in descendants_of(pid) if "TrainerRank" in " ".join(_cmdline(psutil, p))]


def descendants_of(pid: int) -> list[int]:
    from gym_processes import descendants

    return descendants(pid)


@pytest.mark.timeout(420)
def test_a_killed_rank_is_one_error_line_and_its_resume_command_continues_until_sigterm(
        config_file: Path, tmp_path: Path) -> None:
    """examples/run_grpo.py with 2 ranks (2 cores here). (1) SIGKILL of a rank once step 1 is checkpointed: exit 3
    (an infrastructure failure), no traceback, and the last stderr line is the one `error:` line naming the rank's
    pid and node, the last complete checkpoint and the resume command. (2) That command, run as printed, continues
    from the checkpoint; SIGTERM after its first step exits 143 with a resumable checkpoint, and every rank process
    (and the rest of that Ray) is gone."""
    import psutil
    from gym_processes import wait_until_gone

    proc = _grpo_cli("--config", str(config_file), f"output_dir={tmp_path}", "trainer.workers=2",
                     "grpo.max_num_steps=100", "grpo.save_period=1")
    root = tmp_path / "checkpoints"
    try:
        _wait_for(proc, lambda: latest_checkpoint(root) is not None, "checkpoint")
        ranks = _trainer_ranks(psutil, proc.pid)
        everything = descendants_of(proc.pid)
        assert len(ranks) == 2, [(pid, _cmdline(psutil, pid)) for pid in everything]
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, (out + err)[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
    line = err.rstrip().splitlines()[-1]
    assert [x for x in err.splitlines() if "error:" in x.lower()] == [line], err[-3000:]
    saved = latest_checkpoint(root)  # a later step may have been saved between the kill and the rank's death
    assert line.startswith("error: trainer worker rank ") and f"(pid {ranks[1]}) on node " in line, line
    assert " died: ActorDiedError: " in line, line
    assert f"; the last complete checkpoint is {saved} (step {load_checkpoint(saved).step}); resume with: " \
        f"python examples/run_grpo.py --config {config_file} output_dir={tmp_path} trainer.workers=2 " \
        "grpo.max_num_steps=100 grpo.save_period=1 resume=true" in line, line
    assert wait_until_gone(everything, [], within_s=20) < 20

    command = shlex.split(line.split("; resume with: ", 1)[1])
    assert command[:2] == ["python", "examples/run_grpo.py"]
    resumed = _grpo_cli(*command[2:])
    first = load_checkpoint(saved).step
    try:
        _wait_for(resumed, lambda: any(m.get("step", 0) > first for m in read_metrics(tmp_path / "metrics.jsonl")),
                  f"step {first + 1}")
        ranks = _trainer_ranks(psutil, resumed.pid)
        everything = descendants_of(resumed.pid)
        assert len(ranks) == 2, [(pid, _cmdline(psutil, pid)) for pid in everything]
        resumed.send_signal(signal.SIGTERM)
        out, err = resumed.communicate(timeout=120)
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.wait()
    assert resumed.returncode == 128 + signal.SIGTERM, (out + err)[-3000:]
    steps = [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl") if "step" in m]
    assert steps.count(1) == 1 and steps.count(first + 1) == 1, steps  # continued from `saved`, not from step 0
    assert wait_until_gone(ranks, [], within_s=10) < 10, [pid for pid in ranks if psutil.pid_exists(pid)]
    assert wait_until_gone(everything, [], within_s=20) < 20
    assert load_checkpoint(latest_checkpoint(root)).step > first


def _cmdline(psutil, pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


# ---- the memory savers on ranks: activation checkpointing, LoRA, bf16, replicated ranks -------------------------

BF16_REL = 3e-2
"""Step 1's train/ metrics, bf16 on 1 worker against 2 ranks: measured 7.7e-3 relative at most (train/kl/mean; loss
3.4e-3, grad_norm 1.0e-3), i.e. about 2 bf16 ulps (2^-8 = 3.9e-3); 3e-2 is 4x that, while a rank's missing or
doubled gradient would move grad_norm by tens of percent."""
LORA = ("trainer.lora.r=8", "trainer.lora.alpha=16", "trainer.lora.target_modules=[q_proj,v_proj,gate_proj]")


def _run_saver(config_file: Path, out: Path, workers: int, *overrides: str) -> dict[str, Any]:
    """Train with `overrides`: the step metrics, the causal LMs this process held, and what rank 0 loaded."""
    cfg = load_config(config_file, [f"output_dir={out}", f"trainer.workers={workers}", *overrides], GRPOConfig)
    with _CausalLMs() as lms, GRPO(cfg) as grpo:
        models = lms.alive()
        loaded = getattr(grpo.trainer, "loaded", None)
        record = None
        if workers == 1:  # the reference path's gradients, for Adam's rule on the trained tensors
            trained = {k: p for k, p in grpo.trainer.model.named_parameters() if p.requires_grad}
            record = AdamRecord(grpo.trainer.optimizer, trained)
        grpo.run()
        refit = sorted(grpo.trainer.refit_weights()) if grpo.trainer.refit_partial else None
    return {"dir": out, "metrics": read_metrics(out / "metrics.jsonl"), "models": models, "loaded": loaded,
            "refit_names": refit, "record": record}


@pytest.fixture(scope="module")
def saver_runs(config_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """LoRA on 1 worker and 2, 3 steps each (every step's checkpoint is compared; the resume test continues from
    step 2). bf16 on 1 and 2 (the 2 ranks replicated, `sharding: none`: one run checks both settings), one step each
    and no checkpoint: its test compares step 1 alone (see there), so steps 2-3 and their saves proved nothing
    (suite time). Activation checkpointing rides along in `runs`."""
    one_step = ("grpo.max_num_steps=1", "grpo.save_period=0")
    plans = {
        "lora1": (1, *LORA),
        "lora2": (2, *LORA),
        "bf16_1": (1, "trainer.mixed_precision=bf16", *one_step),
        "bf16_2": (2, "trainer.mixed_precision=bf16", "trainer.sharding=none", *one_step),
    }
    return {name: _run_saver(config_file, tmp_path_factory.mktemp(name), workers, *overrides)
            for name, (workers, *overrides) in plans.items()}


def _assert_same_train_metrics(one: list[dict], two: list[dict]) -> None:
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        keys = [k for k in a if k.startswith("train/")]
        assert keys and set(keys) <= set(b)
        off = {k: (a[k], b[k]) for k in keys if b[k] != pytest.approx(a[k], rel=1e-4, abs=1e-7)}
        assert not off, off
        assert a["rollout/reward/mean"] == b["rollout/reward/mean"]


@pytest.mark.timeout(600)
def test_lora_on_two_ranks_trains_as_one_process_does_and_refits_its_targets_alone(runs: dict,
                                                                                   saver_runs: dict) -> None:
    one, two = saver_runs["lora1"], saver_runs["lora2"]
    _assert_same_train_metrics(one["metrics"], two["metrics"])
    # kl_coef 0.01: the reference is the policy with its adapters off; no reference model on any rank
    assert two["loaded"]["reference_loaded"] is False and two["models"] == 1
    assert two["loaded"]["trained"] < two["loaded"]["parameters"] / 10
    assert two["metrics"][-1]["train/kl/mean"] > 1e-6  # the reference stayed the base model
    for step in (1, 2, 3):  # the checkpoints hold the adapters alone, the same on 1 rank and 2
        a1 = checkpoint_weights(one["dir"], step)
        a2 = checkpoint_weights(two["dir"], step)
        assert a1.keys() == a2.keys() and all(".lora_A." in k or ".lora_B." in k for k in a1)
        # Adam's rule for two paths (tests/tolerances.py), 2 optimizer steps a GRPO step; B starts at 0 (A's
        # gradient is 0 at step 1, so A is held to the noise box) and A at peft's seeded init, the same on both
        record = one["record"].renamed(lambda name: re.sub(r"\.default(?=\.|$)", "", name))  # peft's file names
        assert record.initial.keys() == a1.keys()
        assert_trained_weights_close(a1, a2, initial=record.initial, record=record.at(2 * step), lr=3.0e-3)
    # the refit: the merged target modules alone (2 layers x q_proj, v_proj, gate_proj), nothing else
    initial = load_file(Path(load_config(one["dir"] / "config.yaml", [], GRPOConfig).policy.model_name)
                        / "model.safetensors")
    targets = [k for k in initial if k.endswith(("q_proj.weight", "v_proj.weight", "gate_proj.weight"))]
    assert len(targets) == 6 and one["refit_names"] == two["refit_names"] == sorted(targets)
    target_bytes = sum(initial[k].numel() * initial[k].element_size() for k in targets)
    full_bytes = runs[1][1][0]["refit/bytes"]
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert a["refit/bytes"] == b["refit/bytes"] == target_bytes < full_bytes / 3
        assert b["refit/gathered_bytes"] == target_bytes and b["refit/buckets"] == 1
        # the engine serves the merged adapters: the trainer's logprobs of what it sampled equal its own
        assert abs(a["train/gen_kl/mean"]) < 1e-6 and abs(b["train/gen_kl/mean"]) < 1e-6


@pytest.mark.timeout(600)
def test_bf16_on_two_replicated_ranks_trains_as_one_process_with_bf16_does(runs: dict, saver_runs: dict) -> None:
    """bf16 at 1 worker is autocast (matmuls in bf16, their inputs rounded), at 2 ranks FSDP2's MixedPrecisionPolicy
    (every weight cast to bf16, elementwise ops in bf16 too); both keep float32 weights, gradients and Adam state.
    Step 1 samples from the same fp32 weights, so its rollouts are equal to the bit and its train/ metrics differ by
    bf16 rounding alone (`BF16_REL`). The weights are not compared: Adam's first update is about lr * sign(g), so a
    weight whose gradient is near 0 moves by +-lr depending on rounding; a tolerance of lr would prove nothing."""
    one, two = saver_runs["bf16_1"]["metrics"], saver_runs["bf16_2"]["metrics"]
    rollout_keys = [k for k in one[0] if k.startswith(("rollout/", "batch/")) and "time_s" not in k]
    assert rollout_keys and {k: (one[0][k], two[0][k]) for k in rollout_keys if one[0][k] != two[0][k]} == {}
    for key in ("train/loss", "train/loss/pg", "train/grad_norm", "train/kl/mean", "train/importance_ratio/mean"):
        assert two[0][key] == pytest.approx(one[0][key], rel=BF16_REL), key
    # and the ranks did compute in bf16: float32 ranks agree with one float32 worker to 1e-7 (see above)
    fp32 = runs[1][1][0]
    assert max(abs(two[0][k] - fp32[k]) / abs(fp32[k]) for k in ("train/loss", "train/kl/mean")) > 1e-4
    assert [m["train/optimizer_steps"] for m in two] == [2.0]  # the one step ran both minibatches on the ranks


@pytest.mark.timeout(300)
def test_a_lora_run_on_two_ranks_resumes_from_its_checkpoint(saver_runs: dict, tmp_path: Path) -> None:
    """Step 2's checkpoint of the 2-rank LoRA run (the adapters and their AdamW state), resumed on 2 ranks: its
    step 3 is the uninterrupted runs' (the same rollouts, train/ metrics as close as 1 and 2 workers are)."""
    source = saver_runs["lora2"]["dir"]
    out = tmp_path / "resumed"
    shutil.copytree(source, out)
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    cfg = load_config(out / "config.yaml", [f"output_dir={out}", "resume=true"], GRPOConfig)
    with GRPO(cfg) as grpo:
        assert grpo.step == 2 and grpo.trainer.lora
        grpo.run()
    (resumed,) = [m for m in read_metrics(out / "metrics.jsonl") if m["step"] == 3]
    for name in ("lora1", "lora2"):
        (expected,) = [m for m in saver_runs[name]["metrics"] if m["step"] == 3]
        for key, value in expected.items():
            if key.startswith("train/"):
                assert resumed[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (name, key)
            elif key.startswith("rollout/") and "time_s" not in key:
                assert resumed[key] == value, (name, key)
