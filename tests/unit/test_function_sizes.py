"""Size limits (docs/architecture.md, "Size limits"): no function in nemo_rl_ext/ over 60 lines and no module
over 500, except the ones ALLOWED names, each with its reason.

A function's size counts from its first decorator (or its `def`) to its last line, docstring included; a
nested function counts on its own and inside its parent. A module's size is its number of lines. An entry of
ALLOWED that is within the limit again (or gone) fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nemo_rl_ext

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
PACKAGE = Path(nemo_rl_ext.__file__).resolve().parent

ALLOWED: dict[str, str] = {
    # "path under nemo_rl_ext/" (a module) or "path:Qualified.name" (a function) -> why it may be long for now
}


def _functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in a module, nested ones included."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([d.lineno for d in child.decorator_list] + [child.lineno])
                assert child.end_lineno is not None
                found.append((prefix + child.name, child.end_lineno - first + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def oversized(package: Path) -> dict[str, int]:
    """Every module over MAX_MODULE_LINES and function over MAX_FUNCTION_LINES under `package`: its lines."""
    out: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        module = path.relative_to(package).as_posix()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES:
            out[module] = n
        for name, lines in _functions(ast.parse(source, filename=str(path))):
            if lines > MAX_FUNCTION_LINES:
                out[f"{module}:{name}"] = lines
    return out


def test_no_function_or_module_over_the_limit_unless_allowed() -> None:
    found = oversized(PACKAGE)
    over = [f"{name} ({lines} lines)" for name, lines in found.items() if name not in ALLOWED]
    assert not over, (
        f"over the size limit (functions {MAX_FUNCTION_LINES}, modules {MAX_MODULE_LINES} lines): "
        + ", ".join(over)
        + "; split them into named steps (or, with a reason, add them to ALLOWED)"
    )
    stale = [name for name in ALLOWED if name not in found]
    assert not stale, f"within the size limit now, remove from ALLOWED: {', '.join(stale)}"


def test_the_check_counts_decorators_docstrings_nested_functions_and_modules(tmp_path: Path) -> None:
    def lines(indent: str, n: int) -> list[str]:
        return [f"{indent}x{i} = {i}" for i in range(n)]

    small = ["def ok():", '    """Doc."""', *lines("    ", 57), "    return x0"]  # 60 lines: within
    big = ["class A:", "    @staticmethod", "    def f():", '        """Doc."""', *lines("        ", 56)]
    big += ["        def inner():", "            pass"]  # f: 61 lines from its decorator, inner: 2
    big += [""] * (MAX_MODULE_LINES + 1 - len(big))
    (tmp_path / "small.py").write_text("\n".join(small) + "\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("\n".join(big) + "\n")
    expected = {"pkg/big.py": MAX_MODULE_LINES + 1, "pkg/big.py:A.f": MAX_FUNCTION_LINES + 1}
    assert oversized(tmp_path) == expected
