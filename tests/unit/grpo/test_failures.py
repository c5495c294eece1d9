"""The one `error:` line of a GRPO run stopped by a trainer rank (`grpo.failures`): the rank, its pid and node, the
last complete checkpoint and the exact command that resumes; the real run: tests/functional/test_trainer_workers.py."""

from __future__ import annotations

import shlex

from nemo_rl_ext.grpo.failures import infrastructure_error_line, rerun_command
from nemo_rl_ext.training.checkpoint import MARKER_FILE, checkpoint_dir
from nemo_rl_ext.training.distributed_trainer import TrainerWorkerError

DIED = TrainerWorkerError("trainer worker rank 1 (pid 4711) on node abc (10.0.0.2) died: ActorDiedError: The actor "
                          "died.\n\tclass_name: TrainerRank\nSome common causes include: (1) the OOM killer",
                          rank=1, pid=4711, node_id="abc", ip="10.0.0.2", what="died",
                          cause="ActorDiedError: The actor died unexpectedly before finishing this task")


def test_the_line_names_the_rank_the_last_complete_checkpoint_and_the_resume_command(tmp_path):
    root = tmp_path / "out dir" / "checkpoints"
    for step in (1, 2, 3):
        checkpoint_dir(root, step).mkdir(parents=True)
    for step in (1, 2):  # step 3's save never finished: no marker
        (checkpoint_dir(root, step) / MARKER_FILE).write_text("{}")
    line = infrastructure_error_line(DIED, root.parent, "examples/run_grpo.py", "cfg.yaml",
                                     [f"output_dir={root.parent}", "resume=false", "trainer.workers=2"], ["my_plugin"])
    assert "\n" not in line
    assert line == (
        "trainer worker rank 1 (pid 4711) on node abc (10.0.0.2) died: ActorDiedError: The actor died unexpectedly "
        f"before finishing this task; the last complete checkpoint is {checkpoint_dir(root, 2)} (step 2); resume "
        f"with: python examples/run_grpo.py --config cfg.yaml --import my_plugin 'output_dir={root.parent}' "
        "trainer.workers=2 resume=true"
    )
    command = shlex.split(line.split("; resume with: ")[1])  # pastes into a shell as one argument per word
    assert command[-3:] == [f"output_dir={root.parent}", "trainer.workers=2", "resume=true"]


def test_without_a_complete_checkpoint_the_line_says_start_over(tmp_path):
    checkpoint_dir(tmp_path / "checkpoints", 1).mkdir(parents=True)  # unfinished: resume=true would refuse it
    line = infrastructure_error_line(DIED, tmp_path, "examples/run_grpo.py", "c.yaml", ["resume=true"], [])
    assert line.endswith("this task; no complete checkpoint was saved; start over with: python "
                         "examples/run_grpo.py --config c.yaml resume=restart"), line


def test_rerun_command_replaces_any_resume_override():
    assert rerun_command("s.py", "c.yaml", ["a=1", "resume = restart", "b=x y"], [], "true") == \
        "python s.py --config c.yaml a=1 'b=x y' resume=true"


def test_a_failed_rank_is_named_by_its_own_exception_not_rays_wrapper():
    from nemo_rl_ext.training.distributed_trainer import _one_line

    class TaskError(Exception):  # as ray.exceptions.RayTaskError: the task's exception in `cause`
        cause = ValueError("bad batch: 3 rows\nmore detail")

    assert _one_line(TaskError("ray::TrainerRank.train_minibatch() (pid=1, ip=127.0.0.1)\nTraceback ...")) == \
        "ValueError: bad batch: 3 rows"
    assert _one_line(RuntimeError("The actor died unexpectedly.\n\tclass_name: TrainerRank")) == \
        "RuntimeError: The actor died unexpectedly"
