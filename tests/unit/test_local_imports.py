"""Every import inside a function in nemo_rl_ext/ says why it is there (issue 27): a `#` comment on its line,
on its last line (a multi-line import), or on the line just above it or above the run of consecutive imports it
ends (one comment line can explain a group). The usual reasons: a heavy import deferred
until used (so importing the module, validating a config or `--help` stays fast), an optional dependency, an
import that would otherwise break the layer contract or close a cycle, or Ray actor code that imports inside
the worker process. Imports under `if TYPE_CHECKING:` at module level are not inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nemo_rl_ext

PACKAGE = Path(nemo_rl_ext.__file__).resolve().parent


def _local_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement inside a function or method (at any depth) of a module."""
    found: list[ast.Import | ast.ImportFrom] = []
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            for stmt in func.body:
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Import | ast.ImportFrom) and node not in found:
                        found.append(node)
    return sorted(found, key=lambda node: node.lineno)


def _has_comment(line: str) -> bool:
    """Whether a source line carries a `#` comment (tokens are not parsed: a `#` in an import line is one)."""
    return "#" in line


def unexplained(package: Path) -> list[str]:
    """`path:line` of every function-local import under `package` with no comment on or just above it."""
    out: list[str] = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = ["", *source.splitlines()]  # 1-based
        imports = _local_imports(ast.parse(source, filename=str(path)))
        spans = {n.lineno: n.end_lineno or n.lineno for n in imports}
        for node in imports:
            nearby = list(range(node.lineno, spans[node.lineno] + 1))
            above = node.lineno - 1
            while above >= 1:  # up through the run of imports this one ends, to the line above the run
                nearby.append(above)
                start = next((s for s, e in spans.items() if e == above), None)
                if start is None:
                    break
                nearby.extend(range(start, above))
                above = start - 1
            if not any(_has_comment(lines[i]) for i in nearby):
                out.append(f"{path.relative_to(package).as_posix()}:{node.lineno}")
    return out


def test_every_function_local_import_says_why() -> None:
    missing = unexplained(PACKAGE)
    assert not missing, (
        f"{len(missing)} function-local imports without a comment saying why (deferred heavy import, optional "
        "dependency, layer or cycle, Ray worker): " + ", ".join(missing)
    )


def test_the_check_sees_nested_and_multiline_imports_and_accepts_comments(tmp_path: Path) -> None:
    source = [
        "import os",  # module level: not checked
        "def f():",
        "    import json",  # 3: no comment
        "    import ray  # deferred: heavy",
        "    # optional dependency",
        "    import vllm",
        "    import peft",  # a group under the comment above
        "    from a import (",  # multi-line, commented on its last line
        "        b,",
        "    )  # cycle with a",
        "    x = 1",
        "    import safetensors",  # 12: the line above is no import and has no comment
        "    def g():",
        "        from x import y",  # 14: nested, no comment
        "class C:",
        "    async def m(self):",
        "        if True:",
        "            import torch",  # 18: inside a block, no comment
    ]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("\n".join(source) + "\n")
    assert unexplained(tmp_path) == ["pkg/m.py:3", "pkg/m.py:12", "pkg/m.py:14", "pkg/m.py:18"]
