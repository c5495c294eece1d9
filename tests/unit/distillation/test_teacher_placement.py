"""Where a local teacher in the rollout process lives: on the student's device (`policy.device`) in the student's
precision, built from GRPO's config (`trainer.workers: 1`: its KL reference model's dtype, float32 computed in bf16
under `trainer.mixed_precision: bf16`) and from the eval's (each process that rolls out: the run, a shard job, a Ray
worker); a device torch does not have here is one config error naming `policy.device`.

The teachers are really loaded: on the `meta` device (a device that is not the CPU, which every torch has) their
weights are where the config says without any memory or compute; on the CPU they score, and a hook on the output
layer sees the precision its forward ran in (autocast is per thread: the scoring thread's is what counts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.distillation.local_teacher import LocalTeacher
from nemo_rl_ext.distillation.teachers import Placement, build_teacher, placement
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.store_setup import build_rollout_setup
from nemo_rl_ext.grpo.build import teacher_scorer
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.models.loading import device_problem
from nemo_rl_ext.testing import ScriptedGeneration

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "examples" / "data" / "arithmetic.jsonl"


def grpo_config(teacher: Path, device: str, dtype: str = "float32", mixed_precision: str | None = None,
                workers: int = 1) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "policy": {"model_name": "tiny", "device": device, "dtype": dtype}, "data": {"train_path": str(DATA)},
        "trainer": {"workers": workers, "mixed_precision": mixed_precision},
        "on_policy_distillation": {"enabled": True, "default_teacher_alias": str(teacher)},
    })


def eval_config(teacher: Path, tmp_path: Path, *overrides: str) -> EvalConfig:
    return load_config(None, [f"eval.dataset_path={DATA}", f"eval.save_path={tmp_path / 'eval'}", "eval.num_prompts=2",
                              "policy.model_name=tiny", "on_policy_distillation.enabled=true",
                              f"on_policy_distillation.default_teacher_alias={teacher}", *overrides], EvalConfig)


def weights(teacher: LocalTeacher) -> set[tuple[str, torch.dtype]]:
    """The device types and dtypes of the teacher's parameters."""
    return {(p.device.type, p.dtype) for p in teacher.model.parameters()}


@pytest.mark.parametrize(("dtype", "mixed_precision", "want_dtype", "want_autocast"), [
    ("float32", None, torch.float32, None),
    ("bfloat16", None, torch.bfloat16, None),
    ("float32", "bf16", torch.float32, torch.bfloat16),  # the trainer's reference: fp32 weights, bf16 compute
])
def test_grpo_puts_its_local_teacher_on_the_policy_device_in_the_reference_precision(
        tiny_model_dir, dtype, mixed_precision, want_dtype, want_autocast):
    scorer = teacher_scorer(grpo_config(tiny_model_dir, "meta", dtype, mixed_precision), trainer=None)
    teacher = scorer.teacher_for("any agent")
    try:
        assert isinstance(teacher, LocalTeacher)
        assert weights(teacher) == {("meta", want_dtype)} and teacher.autocast == want_autocast
    finally:
        scorer.close()


async def test_the_eval_puts_its_local_teacher_on_the_policy_device_in_the_policy_dtype(tiny_model_dir, tmp_path):
    cfg = eval_config(tiny_model_dir, tmp_path, "policy.device=meta", "policy.dtype=bfloat16")
    tok = LocalTeacher.load(str(tiny_model_dir), device="meta").tokenizer
    _, manager = build_rollout_setup(cfg, ScriptedGeneration(tok, ()))  # as the run, a shard job and a Ray worker
    try:
        teacher = manager.teachers.teacher_for("math")
        assert isinstance(teacher, LocalTeacher)
        assert weights(teacher) == {("meta", torch.bfloat16)} and teacher.autocast is None
    finally:
        await manager.shutdown()


def test_on_the_cpu_a_teacher_scores_with_one_torch_thread_elsewhere_with_torch_s_own(tiny_model_dir, monkeypatch):
    made: list[int | None] = []
    real_init = LocalTeacher.__init__

    def spy(self, model, name, **kwargs):
        made.append(kwargs.get("torch_threads"))
        real_init(self, model, name, **kwargs)

    monkeypatch.setattr(LocalTeacher, "__init__", spy)
    for device in ("cpu", "meta"):
        build_teacher(str(tiny_model_dir), grpo_config(tiny_model_dir, device).on_policy_distillation,
                      Placement(device)).close()
    assert made == [1, None]


@pytest.mark.parametrize(("autocast", "want"), [(None, torch.float32), ("bfloat16", torch.bfloat16)])
async def test_the_forward_runs_in_the_placement_s_precision_in_the_scoring_thread(tiny_model_dir, autocast, want):
    teacher = LocalTeacher.load(str(tiny_model_dir), device="cpu", autocast=autocast)
    seen: list[torch.dtype] = []
    teacher.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    try:
        [scores] = await teacher.score([[1, 2, 3, 4]])
    finally:
        teacher.close()
    assert seen == [want]
    assert len(scores.logprobs) == 3 and all(type(x) is float and x < 0 for x in scores.logprobs)  # floats, on CPU


def test_placement_follows_the_trainer_s_reference_model():
    assert placement("cuda", "bfloat16") == Placement("cuda", "bfloat16", None)
    assert placement("cuda", "float32", "bf16") == Placement("cuda", "float32", "bfloat16")


def test_a_device_torch_does_not_have_is_named(monkeypatch):
    assert device_problem("policy.device", "cpu") is None and device_problem("policy.device", "meta") is None
    assert device_problem("policy.device", "gpu").startswith("policy.device='gpu' is not a torch device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_problem("policy.device", "cuda").startswith("policy.device='cuda' but torch ")
    assert "sees no cuda device" in device_problem("policy.device", "cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("policy.device", "cuda:1") is None and device_problem("policy.device", "cuda") is None
    assert device_problem("policy.device", "cuda:2") == (
        "policy.device='cuda:2' but torch sees 2 cuda device(s) here (indices 0 to 1)")


def test_grpo_refuses_a_device_torch_does_not_have_where_it_loads_the_teacher(tiny_model_dir, monkeypatch):
    from nemo_rl_ext.grpo.build import check_inputs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a machine with a GPU too
    with pytest.raises(ConfigError) as err:
        check_inputs(grpo_config(tiny_model_dir, "cuda"), None, None)
    assert "policy.device='cuda' but torch" in str(err.value)
    # with trainer ranks the policy and a local teacher load there, not in this process: nothing to check here
    check_inputs(grpo_config(tiny_model_dir, "cuda", workers=2), None, None)


def test_the_eval_refuses_a_device_torch_does_not_have_unless_its_ray_workers_load(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    from nemo_rl_ext.evals.config import check_inputs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        check_inputs(eval_config(tiny_model_dir, tmp_path, "policy.device=cuda"))
    assert str(err.value).startswith("policy.device='cuda' but torch ")  # the one problem (every other check passed)
    check_inputs(eval_config(tiny_model_dir, tmp_path, "policy.device=cuda", "policy.cluster.num_replicas=2"))
