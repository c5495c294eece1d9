"""The `gym` config section: where the Gym servers are and how rows are sent to them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nemo_rl_ext.config import StrictModel

SAMPLING_PARAMS = {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_new_tokens"}
"""responses_create_params keys every row gets from policy.generation (key -> GenerationConfig field)."""


def gym_site_packages(gym_venv: str | Path) -> Path | None:
    """The Gym install's site-packages, where its servers ship as top-level packages (None if not found)."""
    found = sorted(Path(gym_venv).glob("lib/python3*/site-packages"))
    return found[-1] if found else None


def resolve_gym_path(path: str | Path, gym_venv: str | Path | None) -> Path:
    """`path` from the CWD; a relative one that is not there, from the Gym install when it is there (as
    Gym's own CLI does); otherwise the CWD's path (absolute, for the error that names it)."""
    path = Path(path)
    if path.is_absolute() or path.exists() or gym_venv is None:
        return path.resolve()
    site = gym_site_packages(gym_venv)
    if site is not None and (site / path).exists():
        return site / path
    return path.resolve()


class GymLaunchConfig(StrictModel):
    """Start NeMo Gym ourselves (`ng_run` from a Gym venv) instead of connecting to a running head server."""

    mode: Literal["direct", "ng_run"] = Field(
        default="direct",
        description="direct: start each server's entrypoint script, as ng_run does (no Ray, loopback only); "
        "ng_run: Gym's own launcher.",
    )
    gym_venv: Path = Field(description="The NeMo Gym venv (scripts/setup_nemo_gym.sh prints it).")
    config_paths: tuple[Path, ...] = Field(
        min_length=1,
        description="Gym server config YAML files; a relative path not found from the CWD is looked up in the "
        "Gym install (e.g. resources_servers/mcqa/configs/mcqa.yaml). The servers they name are found in "
        "NEMO_GYM_EXTRA_ROOTS, the CWD, the project's own servers (resources_servers/arithmetic_grader), then "
        "the Gym install.",
    )
    head_server_port: int = Field(default=11000, ge=1, le=65535, description="Port of Gym's head server.")
    startup_timeout_s: float = Field(default=180.0, gt=0, description="Deadline for every server to be healthy.")
    work_dir: Path | None = Field(
        default=None,
        description="Where env.yaml and the servers' logs go; None: the run's own folder (the eval: "
        "<eval.save_path>/gym, per store; GRPO: <output_dir>/gym), a temp dir for the launcher alone.",
    )
    policy_model: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys merged into the vllm_model server the launcher defines for the model servers the configs "
        "call but do not define (`policy_model`), e.g. {use_completions_api: true} (Gym calls our "
        "/v1/completions), with render_chat_template: true and tokenizer: <the policy's model folder> for "
        "multi-turn rows; a model server the configs define is left as it is.",
    )

    @field_validator("policy_model")
    @classmethod
    def _policy_model_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(value) & {"entrypoint", "base_url", "api_key", "model"})
        if owned:
            raise ValueError(f"{owned} are set by the launcher (our policy server's URL, key and name)")
        if value.get("render_chat_template") and not value.get("tokenizer"):
            raise ValueError(
                "render_chat_template: true needs tokenizer: a tokenizer folder with a chat template (the "
                "policy's model folder); Gym loads it to render the messages"
            )
        return value


class GymConfig(StrictModel):
    """How the NeMo-Gym-backed rollouts reach the agents."""

    head_server_url: str | None = Field(
        default=None, description="A running Gym head server, e.g. http://127.0.0.1:11000."
    )
    agent_urls: dict[str, str] = Field(
        default_factory=dict, description="Agent name -> base URL; bypasses head-server discovery."
    )
    launch: GymLaunchConfig | None = Field(default=None, description="Start Gym servers for the run.")
    serve_policy: bool = Field(
        default=True,
        description="Serve policy_generation over HTTP for the agents (off only when Gym calls another server).",
    )
    policy_host: str = Field(default="127.0.0.1", description="Where our policy server listens for Gym.")
    policy_port: int = Field(default=0, ge=0, le=65535, description="Policy server port; 0 picks a free one.")
    policy_model_name: str = Field(default="policy", description="Model name the policy server answers to.")
    agent_name: str | None = Field(
        default=None,
        min_length=1,
        description="The agent of rows without agent_ref.name (Gym's +agent_name); rows with one keep theirs.",
    )
    responses_create_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Merged into every row's responses_create_params, replacing its top-level keys "
        "(Gym's +responses_create_params); sampling parameters come from policy.generation instead.",
    )
    reward_components: tuple[str, ...] = Field(
        default=(),
        description="Fields of the /verify response (Gym returns them in each /run result) that are named parts of "
        "the reward: each becomes `Completion.reward_components[<field>]` (for grpo.adv_estimator: gdpo, "
        "logged reward/<field>); a field missing or not a number in a result is an error naming the agent's "
        "environment and the field. A name not at the result's top level is looked up in its "
        "`reward_components` mapping (NeMo-RL's multi-reward Gym servers). Empty: the scalar reward only.",
    )
    max_concurrency: int = Field(default=64, ge=1, description="Most /run requests in flight at once.")
    row_timeout_s: float = Field(default=600.0, gt=0, description="Limit for one /run request.")
    max_attempts: int = Field(default=3, ge=1, description="Attempts per row before it becomes an error.")
    retry_backoff_s: float = Field(default=1.0, ge=0, description="First retry delay; doubles each retry.")
    aggregate_timeout_s: float = Field(
        default=30.0, gt=0,
        description="Limit for one /aggregate_metrics call after collection (Gym's own aggregate; the run does "
        "not fail without it, so it must not wait as long as a row).",
    )
    health_check_interval_s: float | None = Field(
        default=1.0, gt=0,
        description="While rows are pending, probe the Gym servers they depend on this often; None: never.",
    )
    health_check_timeout_s: float = Field(default=5.0, gt=0, description="Deadline of one health probe.")
    health_check_failures: int = Field(
        default=3, ge=1,
        description="Consecutive failed probes after which a server is down and the rows that need it fail.",
    )

    @field_validator("responses_create_params")
    @classmethod
    def _no_sampling_overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(value) & set(SAMPLING_PARAMS))
        if owned:
            raise ValueError(
                f"{owned} are set from policy.generation ("
                + ", ".join(f"{k} <- {SAMPLING_PARAMS[k]}" for k in owned)
                + "); set them there"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> GymConfig:
        sources = [bool(self.head_server_url), bool(self.agent_urls), self.launch is not None]
        if sum(sources) != 1:
            raise ValueError(
                "set exactly one of gym.head_server_url, gym.agent_urls or gym.launch "
                f"(got head_server_url={self.head_server_url!r}, agent_urls={self.agent_urls!r}, "
                f"launch={'set' if self.launch else None})"
            )
        if self.serve_policy and self.launch is None and self.policy_port == 0:
            raise ValueError(
                "gym.policy_port must be set when connecting to running Gym servers: their model server "
                "config must point at http://<policy_host>:<policy_port>/v1"
            )
        return self
