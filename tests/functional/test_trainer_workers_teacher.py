"""A local distillation teacher on two FSDP2 trainer ranks (`trainer.workers: 2`, `distillation/rank_teacher.py`):
its scores equal a local teacher's forward pass over the same ids, frozen and never in the driver; a rank that dies
makes the teacher fail (the fault policy's business), never hang."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from teacher_checks import TIE
from test_trainer_workers import config_file, uneven_items  # noqa: F401  (config_file: the module-scoped fixture)
from tolerances import SAME_MODEL_LOGPROBS

from nemo_rl_ext.config import load_config
from nemo_rl_ext.distillation.local_teacher import LocalTeacher
from nemo_rl_ext.distillation.rank_teacher import RankTeacher
from nemo_rl_ext.distillation.teacher import TeacherError
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer, TrainerWorkerError, rank_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread", "local_ray")


def assert_scores_close(got, want) -> None:
    """The same sequences' scores: logprobs and top-k logprobs to `SAME_MODEL_LOGPROBS` (FSDP all-gathers the whole
    weights: the same math, its sums possibly in another order), the same top-k ids where their logprobs are more
    than `TIE` apart (closer ones may swap between two kernels)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), **SAME_MODEL_LOGPROBS)
        assert (g.topk_ids is None) == (w.topk_ids is None)
        if w.topk_logprobs is None:
            continue
        torch.testing.assert_close(torch.tensor(g.topk_logprobs), torch.tensor(w.topk_logprobs), **SAME_MODEL_LOGPROBS)
        for ids, want_ids, values in zip(g.topk_ids, w.topk_ids, w.topk_logprobs, strict=True):
            if min(a - b for a, b in zip(values, values[1:], strict=False)) > TIE:
                assert ids == want_ids


def sequences() -> list[list[int]]:
    """Seven id sequences of lengths 5, 9, ..., 29 (seeded, in the tiny vocabulary)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 1000, (5 + 4 * i,), generator=g).tolist() for i in range(7)]


@pytest.mark.timeout(400)
def test_two_ranks_score_as_a_local_teacher_and_hold_it_frozen(config_file, tmp_path) -> None:  # noqa: F811
    import ray

    from nemo_rl_ext.models.tiny import build_tiny_model

    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=7, initializer_range=0.05)  # not the policy
    cfg = load_config(config_file, ["trainer.workers=2", "loss.kl_coef=0.0"], GRPOConfig)
    ranks = DistributedTrainer(rank_spec(cfg, cfg.policy.model_name, None, 0), cfg.trainer, cfg.policy.cluster)
    local = LocalTeacher.load(str(teacher_dir), max_batch_tokens=60)
    try:
        # 60 padded tokens a batch: 5 batches, so rank 1 runs a dummy forward in the last round
        teacher = RankTeacher(ranks, str(teacher_dir), max_batch_tokens=60)
        for top_k in (0, 3):
            got = asyncio.run(teacher.score(sequences(), top_k))
            assert [len(g.logprobs) for g in got] == [len(s) - 1 for s in sequences()]
            assert all((g.topk_ids is None) == (top_k == 0) for g in got)
            assert_scores_close(got, asyncio.run(local.score(sequences(), top_k)))
        # scoring while the ranks train (asynchronous GRPO): the calls queue on the ranks in one order, no hang,
        # and the frozen teacher scores as before the policy moved
        items, advantages = uneven_items()
        want = asyncio.run(local.score(sequences(), 3))
        with ThreadPoolExecutor(1) as pool:
            for _ in range(2):
                training = pool.submit(ranks.train_step, items, advantages)
                during = asyncio.run(teacher.score(sequences(), 3))
                assert training.result(timeout=300)["optimizer_steps"] >= 1
                assert_scores_close(during, want)

        def frozen(rank, key):  # runs inside a rank (pickled by value)
            model = rank.teachers[key]
            return ([p.requires_grad for p in model.parameters()], model.training,
                    sum(len(s) for s in rank.optimizer.state.values()), len(rank.optimizer.param_groups[0]["params"]),
                    sum(1 for _ in rank.policy.parameters()))

        for grads, training, _, in_optimizer, policy_params in ray.get(
                [r.__ray_call__.remote(frozen, teacher.key) for r in ranks._ranks]):
            assert grads and not any(grads) and not training
            assert in_optimizer == policy_params  # the optimizer holds the policy's parameters, none of the teacher's
        ray.kill(ranks._ranks[1], no_restart=True)
        with pytest.raises(TeacherError, match="trainer ranks: TrainerWorkerError.*rank 1") as failed:
            asyncio.run(teacher.score(sequences()[:2]))
        # the scorer turns that into error completions; the run's next training call raises the same error
        # (the ranks are gone): the run stops as an infrastructure failure naming the dead rank
        with pytest.raises(TrainerWorkerError) as later:
            ranks.train_step(items, advantages)
        assert later.value is failed.value.__cause__ and later.value.rank == 1 and later.value.what == "died"
        teacher.close()
    finally:
        local.close()
        ranks.close()


@pytest.mark.timeout(600)
def test_grpo_on_two_ranks_scores_with_the_ranks_teacher_sync_and_async(config_file, tmp_path, monkeypatch) -> None:  # noqa: F811
    """GRPO with a local teacher: on two ranks (synchronous, then asynchronous with max_lag 1, where the collector
    scores while the trainer thread trains) the driver loads no teacher, and step 1's rollout-layer reverse KL (the
    same generations: same seed and model) is the one-worker run's, whose teacher is in this process."""
    from nemo_rl_ext.grpo.loop import GRPO
    from nemo_rl_ext.models.tiny import build_tiny_model

    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=7, initializer_range=0.05)
    distill = ["on_policy_distillation.enabled=true", f"on_policy_distillation.default_teacher_alias={teacher_dir}",
               "grpo.max_num_steps=2", "grpo.save_period=0"]
    runs = {}
    for name, extra in (("one", ["trainer.workers=1"]), ("two", ["trainer.workers=2"]),
                        ("async", ["trainer.workers=2", "grpo.async.enabled=true", "grpo.async.max_lag=1"])):
        if name != "one":  # from here on, a teacher loaded in the driver fails the run
            monkeypatch.setattr(LocalTeacher, "load", classmethod(lambda *a, **k: pytest.fail("driver loaded it")))
        cfg = load_config(config_file, [f"output_dir={tmp_path / name}", *distill, *extra], GRPOConfig)
        with GRPO(cfg) as grpo:
            runs[name] = grpo.run()
    for name, history in runs.items():
        assert [m["step"] for m in history] == [1, 2], name
        assert all(m["distill/scored_tokens"] > 0 and "train/distill/reverse_kl" in m for m in history), name
        assert all(m.get("distill/teacher_failures", 0.0) == 0.0 for m in history), name
    for name in ("two", "async"):
        assert runs[name][0]["rollout/reward/mean"] == runs["one"][0]["rollout/reward/mean"]
        assert runs[name][0]["distill/reverse_kl"] == pytest.approx(runs["one"][0]["distill/reverse_kl"], rel=1e-4,
                                                                     abs=1e-7), name
