"""Write docs/reference/configuration.md from the config models: every key, its type, default and description.

    python scripts/gen_config_reference.py          # (re)write the page
    python scripts/gen_config_reference.py --check  # exit 1 if the committed page is stale

The page is generated from the pydantic models' `Field` descriptions and class docstrings (a setting is
documented where it is declared); `tests/unit/test_config_reference.py` regenerates it in memory and fails
when the committed page differs, or when a key has no description.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "configuration.md"
REGENERATE = "python scripts/gen_config_reference.py"


@dataclass(frozen=True)
class Root:
    """One whole config: the page's top-level section for it."""

    anchor: str
    """The section's id on the page (`#eval-config`)."""
    title: str
    """The section's heading."""
    model: type[BaseModel]
    """The config model that validates the whole file."""
    command: str
    """How a user runs with such a config."""


def roots() -> tuple[Root, ...]:
    """The configs the CLIs load (imported here, so the page lists whatever they register at import)."""
    from nemo_rl_ext.evals.config import EvalConfig
    from nemo_rl_ext.grpo.config import GRPOConfig

    return (
        Root(
            "eval-config",
            "Eval config",
            EvalConfig,
            "python examples/run_eval.py --config FILE [key.sub=value ...]",
        ),
        Root(
            "grpo-config",
            "GRPO config",
            GRPOConfig,
            "python examples/run_grpo.py --config FILE [key.sub=value ...]",
        ),
    )


@dataclass(frozen=True)
class Row:
    """One key of a section's table."""

    key: str
    type: str
    default: str
    description: str


def _doc(cls: type) -> str:
    """A class's docstring as one paragraph (its own, never a base class's)."""
    doc = cls.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation admits (`GymConfig | None` -> [GymConfig])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _type_name(annotation: Any) -> str:
    """A reader's name for a field's type, in YAML terms (`int or null`, `list[str]`, `"a" or "b"`)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list[{_type_name(args[0])}]"
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def _constraints(info: FieldInfo) -> str:
    """The field's bounds (`>= 1, <= 65535`, `at least 1 item`), or ""."""
    parts = []
    for item in info.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(item, kind):
                parts.append(f"{sign} {getattr(item, attr)}")
        if isinstance(item, annotated_types.MinLen):
            parts.append(f"at least {item.min_length} item{'s' if item.min_length != 1 else ''}")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    """The default as YAML would spell it (a code span), "required", or "its defaults" for a section."""
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its defaults"
    return f"`{_cell(json.dumps(_plain(value), ensure_ascii=False))}`"


def _plain(value: Any) -> Any:
    """`value` as JSON-able data (paths as strings, tuples as lists)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _registered_sections(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Sections a model takes from a registry rather than from its fields: `policy.<backend>`, each validated
    by the settings model its backend registered (`hf`, `vllm`, and any backend registered at import)."""
    from nemo_rl_ext.models.backend_registry import backend_settings_models
    from nemo_rl_ext.models.config import PolicyConfig

    if not issubclass(model, PolicyConfig):
        return {}
    return {name: m for name, m in backend_settings_models().items() if name not in model.model_fields}


def _sections(model: type[BaseModel], path: str) -> Iterator[tuple[str, type[BaseModel], list[Row]]]:
    """(key path, model, rows) for `model` and then, depth first, every section nested in it."""
    rows, nested = [], []
    for name, info in model.model_fields.items():
        key = f"{path}.{info.alias or name}" if path else (info.alias or name)
        inner = _models_in(info.annotation)
        description = info.description or (_doc(inner[0]) if inner else "")
        type_name = _type_name(info.annotation)
        bounds = _constraints(info)
        rows.append(Row(key, f"{type_name} ({bounds})" if bounds else type_name, _default(info), description))
        nested += [(key, m) for m in inner]
    for name, settings in _registered_sections(model).items():
        key = f"{path}.{name}" if path else name
        rows.append(Row(key, "section", "its defaults", _doc(settings)))
        nested.append((key, settings))
    yield path, model, rows
    for key, inner_model in nested:
        yield from _sections(inner_model, key)


def _anchor(root: Root, path: str) -> str:
    """The id of a section's heading (`eval-config-rollouts-gym`; the top-level keys: `eval-config-top`)."""
    return f"{root.anchor}-{path.replace('.', '-') if path else 'top'}"


def missing_descriptions() -> list[str]:
    """Every key (`EvalConfig: eval.ks`) whose field has no description and no model docstring to stand in."""
    return [
        f"{root.model.__name__}: {row.key}"
        for root in roots()
        for _, _, rows in _sections(root.model, "")
        for row in rows
        if not row.description
    ]


def render() -> str:
    """The whole page. A section whose model was already shown (`policy` in both configs) links to it."""
    out = [
        "# Configuration reference",
        "",
        f"Generated by `{REGENERATE}` from the config models' field descriptions: edit the",
        "models, not this page (`tests/unit/test_config_reference.py` fails when it is stale). Every key can be",
        "set in the YAML file or overridden on the command line as `key.sub=value`; unknown keys are errors.",
        "",
    ]
    shown: dict[type[BaseModel], str] = {}  # model -> a link to where it was shown first
    for root in roots():
        out += [
            f"## {root.title} {{#{root.anchor}}}",
            "",
            f"`{root.command}`, validated by "
            f"`{root.model.__module__}.{root.model.__name__}`. {_doc(root.model)}",
            "",
        ]
        skip: tuple[str, ...] = ()
        sections = list(_sections(root.model, ""))
        paths = {path for path, _, _ in sections}
        for path, model, rows in sections:
            if skip and any(path == s or path.startswith(s + ".") for s in skip):
                continue
            title = f"`{path}`" if path else "Top-level keys"
            out += [f"### {title} {{#{_anchor(root, path)}}}", ""]
            if model in shown and path:
                out += [f"The same keys as {shown[model]}.", ""]
                skip += (path,)
                continue
            shown.setdefault(
                model, f"the {root.title[0].lower()}{root.title[1:]}'s [`{path}`](#{_anchor(root, path)})"
            )
            if path and _doc(model):
                out += [_doc(model), ""]
            out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            for r in rows:
                key = f"[`{r.key}`](#{_anchor(root, r.key)})" if r.key in paths else f"`{r.key}`"
                out.append(f"| {key} | {_cell(r.type)} | {r.default} | {_cell(r.description)} |")
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # document this checkout's models, whatever the venv has installed
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
