"""Environments by name: a class decorator registers them with the defaults of their rows, `create_environment`
builds them.

    @register_environment("my_env", system_prompt="Answer in one word.", row_adapter=my_rows)
    class MyEnvironment(EnvironmentInterface): ...

`system_prompt` is what prompts get when the config leaves `rollouts.env.system_prompt` null; `row_adapter`
turns a dataset row into the prompt's user turn and the environment's `extra_env_info` (default: the
question/answer rows of `data.datasets.qa_row`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from nemo_rl_ext.data.datasets import RowAdapter, qa_row
from nemo_rl_ext.environments.interfaces import EnvironmentInterface

_EnvironmentClass = TypeVar("_EnvironmentClass", bound=type[EnvironmentInterface])


@dataclass(frozen=True)
class EnvironmentEntry:
    """A registered environment."""

    cls: type[EnvironmentInterface]
    """The class `create_environment` builds."""
    system_prompt: str | None
    """The system message of its prompts when the config gives none (None: no system message)."""
    row_adapter: RowAdapter
    """Dataset row -> the prompt and what the environment reads (`data.datasets.RowAdapter`)."""


_ENVIRONMENTS: dict[str, EnvironmentEntry] = {}


def register_environment(
    name: str, *, system_prompt: str | None = None, row_adapter: RowAdapter = qa_row
) -> Callable[[_EnvironmentClass], _EnvironmentClass]:
    """Class decorator: make an `EnvironmentInterface` subclass available as `name`, with the default system
    prompt and row adapter of its datasets."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"environment name must be a non-empty string, got {name!r}")

    def decorate(cls: _EnvironmentClass) -> _EnvironmentClass:
        if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
            raise TypeError(
                f"@register_environment({name!r}) needs an EnvironmentInterface subclass, got {cls!r}"
            )
        known = _ENVIRONMENTS.get(name)
        if known is not None and _qualified_name(known.cls) != _qualified_name(cls):
            raise ValueError(
                f"environment {name!r} is already registered to {_qualified_name(known.cls)}; "
                f"cannot register {_qualified_name(cls)}"
            )
        _ENVIRONMENTS[name] = EnvironmentEntry(cls, system_prompt, row_adapter)
        return cls

    return decorate


def environment_entry(name: str) -> EnvironmentEntry:
    """The registration of `name`; an unknown name lists the known ones (ValueError)."""
    entry = _ENVIRONMENTS.get(name)
    if entry is None:
        known = ", ".join(available_environments()) or "(none)"
        raise ValueError(f"unknown environment {name!r}; known environments: {known}")
    return entry


def create_environment(name: str, **kwargs: Any) -> EnvironmentInterface:
    """Build the environment registered as `name` with `kwargs`; an unknown name lists the known ones."""
    return environment_entry(name).cls(**kwargs)


def available_environments() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_ENVIRONMENTS))


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
