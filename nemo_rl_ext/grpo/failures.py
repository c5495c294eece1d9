"""The one line `run_grpo.py` prints when a run stops on an infrastructure failure (a trainer rank that died or
failed): what failed and where, the last complete checkpoint, and the exact command that resumes from it.

    error: trainer worker rank 1 (pid 4711) on node 83a1... (127.0.0.1) died: ActorDiedError: ...; the last
    complete checkpoint is out/checkpoints/step_1 (step 1); resume with: python examples/run_grpo.py --config
    cfg.yaml output_dir=out resume=true

The run exits 3 after it (an infrastructure failure, as the eval's errors left), not 1.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from nemo_rl_ext.training.checkpoint import latest_checkpoint


def rerun_command(script: str, config: str, overrides: Sequence[str], imports: Sequence[str], resume: str) -> str:
    """The command line that re-runs `script` with the same config, plugins and overrides, `resume=<resume>`
    replacing any `resume=` override given (shell-quoted, ready to paste)."""
    kept = [o for o in overrides if o.split("=", 1)[0].strip() != "resume"]
    plugins = [arg for module in imports for arg in ("--import", module)]
    return shlex.join(["python", script, "--config", config, *plugins, *kept, f"resume={resume}"])


def infrastructure_error_line(failure: BaseException, output_dir: str | Path, script: str, config: str,
                              overrides: Sequence[str], imports: Sequence[str]) -> str:
    """One line (no `error:` prefix): `failure` in one line (its `summary` when it has one), the newest complete
    checkpoint under `output_dir`/checkpoints and the command that resumes from it (or, with none, that starts
    over: `resume=restart`)."""
    what = getattr(failure, "summary", None) or f"{type(failure).__name__}: {failure}".splitlines()[0]
    found = latest_checkpoint(Path(output_dir) / "checkpoints")
    if found is None:
        where = "no complete checkpoint was saved; start over with: "
        return what + "; " + where + rerun_command(script, config, overrides, imports, "restart")
    step = int(found.name.removeprefix("step_"))  # not verified here (hashing GBs): the resume verifies it
    return (f"{what}; the last complete checkpoint is {found} (step {step}); resume with: "
            + rerun_command(script, config, overrides, imports, "true"))


__all__ = ["infrastructure_error_line", "rerun_command"]
