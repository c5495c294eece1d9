"""YAML configs: loaded with OmegaConf, overridden from the command line, validated into typed models.

    cfg = load_config("examples/configs/evals/eval.yaml", ["rollouts.num_generations_per_prompt=4"], EvalConfig)

Every problem is reported in one `ConfigError`, each line naming the key path and the offending value.
`ConfigError` is also the base of every other user error (a missing input file, a resume that would mix
two runs, a damaged checkpoint): the CLIs print its message alone, without a traceback, and exit 2.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

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
        base_data: Any = OmegaConf.to_container(base, resolve=True)
        override_data: Any = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"{path or 'config'} with overrides {list(overrides)}: {exc}") from None
    context: dict[str, Any] = {}
    if issubclass(schema, CheckedConfig):  # the file and the overrides each to the canonical spelling, so an
        # override in an older spelling replaces the file's setting however the file spells it
        # without a file the overrides are the whole config; with one, the file (as written) is their base
        file_data = base_data
        base_data, renames, problems = schema.canonical(base_data, whole=True)
        override_data, more_renames, more_problems = schema.canonical(
            override_data, whole=path is None, base=file_data if path is not None else None
        )
        renames = {new: old for new, old in renames.items() if not _has_path(override_data, new)}  # overridden
        context = {"renames": {**renames, **more_renames}, "problems": problems + more_problems}
    try:
        merged = OmegaConf.merge(OmegaConf.create(base_data), OmegaConf.create(override_data))
        data = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"{path or 'config'} with overrides {list(overrides)}: {exc}") from None
    try:
        return schema.model_validate(data, context=context or None)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path or "config"))) from None


def _has_path(data: Any, path: Sequence[str]) -> bool:
    """True when the nested dict `data` holds the key path `path`."""
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def config_changes(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    may_change: Iterable[str],
    spell: Callable[[str], str] | None = None,
) -> list[str]:
    """The leaf keys (dotted) whose values differ between two configs, as `key: old -> new` lines, sorted.

    A key is exempt when it equals an entry of `may_change` or lies under one (`logger` exempts `logger.*`).
    `spell` names each key as the user wrote it (`CheckedConfig.key_as_written`).
    """
    exempt = tuple(may_change)
    before, after = _flatten(old), _flatten(new)
    changed = sorted(
        k
        for k in before.keys() | after.keys()
        if before.get(k) != after.get(k) and not any(k == e or k.startswith(f"{e}.") for e in exempt)
    )
    spell = spell or (lambda key: key)
    return sorted(f"{spell(k)}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed)


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


Renames = dict[tuple[str, ...], tuple[str, ...]]
"""Where a legacy spelling moved each key: new key path -> the path the user wrote."""


def _written_as(loc: tuple[Any, ...], renames: Renames) -> tuple[Any, ...]:
    """An error location in the user's spelling: the longest renamed prefix replaced by what they wrote."""
    for n in range(len(loc), 0, -1):
        written = renames.get(tuple(str(p) for p in loc[:n]))
        if written is not None:
            return (*written, *loc[n:])
    return loc


def _in_written_names(message: str, renames: Renames) -> str:
    """A rule's message with each renamed key's name as the user wrote it (`num_generations_per_prompt=4`
    reads `num_tests_per_prompt=4` in a config of the eval's spelling)."""
    for new, old in renames.items():
        if new[-1] != old[-1] and "_" in new[-1]:  # key names, not words like "mode"
            message = re.sub(rf"\b{re.escape(new[-1])}\b", old[-1], message)
    return message


class CheckedConfig(StrictModel):
    """A whole config: field errors and broken cross-field rules (`rule_problems`) are raised together.

    The rules read the raw data (through `raw_field`), so they run even when other fields are invalid, and
    one run of a CLI lists everything that is wrong. `legacy_spellings` first rewrites keys written in an
    accepted older spelling to the canonical one (the spellings live in `nemo_rl_ext.compat`); errors still
    name the key as the user wrote it.
    """

    _renames: Renames = PrivateAttr(default_factory=dict)

    def __eq__(self, other: object) -> bool:  # equal settings are equal configs, however they were spelled
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    def key_as_written(self, key: str) -> str:
        """`key` (dotted, canonical) as the config spelled it: `rollouts.num_generations_per_prompt` is
        `eval.num_tests_per_prompt` in a config written in the eval's spelling."""
        path = tuple(key.split("."))
        return ".".join(str(p) for p in _written_as(path, self._renames))

    @classmethod
    def legacy_spellings(
        cls, data: dict[str, Any], *, whole: bool = True, base: Mapping[str, Any] | None = None
    ) -> tuple[Renames, list[RuleProblem]]:
        """Rewrite accepted older spellings in `data` (a deep copy, changed in place) to the canonical keys;
        returns where each moved key came from and any conflicts (both spellings given). `whole`: `data` is a
        whole config, so defaults of the older spelling apply; else it overrides `base` (the file as written)."""
        return {}, []

    @classmethod
    def canonical(
        cls, data: Any, *, whole: bool, base: Mapping[str, Any] | None = None
    ) -> tuple[Any, Renames, list[RuleProblem]]:
        """`data` in the canonical spelling (a copy), where each moved key came from, and conflicts."""
        if not isinstance(data, Mapping):
            return data, {}, []
        data = copy.deepcopy(dict(data))
        renames, problems = cls.legacy_spellings(data, whole=whole, base=base)
        return data, renames, problems

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[RuleProblem]:
        """Every broken cross-field rule of the raw `data`; fields that don't validate on their own are
        skipped (their own error reports them)."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def _every_problem(cls, data: Any, handler: Any, info: ValidationInfo) -> Any:
        context = info.context if isinstance(info.context, Mapping) else {}
        renames: Renames = dict(context.get("renames", {}))
        conflicts: list[RuleProblem] = list(context.get("problems", []))
        if isinstance(data, Mapping) and not isinstance(data, BaseModel):
            data, more_renames, more_conflicts = cls.canonical(data, whole=True)
            renames.update(more_renames)
            conflicts += more_conflicts
        field_error: ValidationError | None = None
        model = None
        try:
            model = handler(data)
        except ValidationError as err:
            field_error = err
        raw = data.model_dump() if isinstance(data, BaseModel) else data
        problems = cls.rule_problems(raw if isinstance(raw, Mapping) else {})
        if not problems and not conflicts and (field_error is None or not renames):
            if field_error is not None:
                raise field_error
            if renames:
                model._renames = renames
            return model
        details: list[InitErrorDetails] = []
        unique = {(tuple(loc), message, repr(value)): (tuple(loc), message, value) for loc, message, value in conflicts}
        conflicts = list(unique.values())  # an override's conflict is found again in the merged config: once
        for loc, message, value in conflicts:
            details.append(InitErrorDetails(type=PydanticCustomError("rule", message), loc=loc, input=value))
        conflicted = {loc for loc, _, _ in conflicts}
        if field_error is not None:
            for e in field_error.errors():
                if e["type"] == "extra_forbidden" and tuple(e["loc"]) in conflicted:
                    continue  # the older spelling left beside the new one: its conflict says why, once
                error_type = PydanticCustomError(e["type"], e["msg"])
                details.append(InitErrorDetails(type=error_type, loc=_written_as(e["loc"], renames), input=e["input"]))
        for loc, message, value in problems:
            message = _in_written_names(message, renames)
            details.append(
                InitErrorDetails(type=PydanticCustomError("rule", message), loc=_written_as(loc, renames), input=value)
            )
        raise ValidationError.from_exception_data(cls.__name__, details)
