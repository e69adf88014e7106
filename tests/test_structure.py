"""The size limits of issue 38 ("a house with five doors"): no module over 600 lines and no
function over 60 lines in flows/, tasks/ and integrations/.

A module is one concept a reader holds at once, a function one step that reads on one screen;
past the limits they had grown into engines (an 844-line CLI, a 91-line registration) that
cost every change. Split a module into a package with private modules behind its face, a
function into named steps."""

from __future__ import annotations

import ast
import functools

from tests.conftest import REPO_ROOT

MODULE_LINES = 600
FUNCTION_LINES = 60
FOLDERS = ("flows", "tasks", "integrations")


@functools.cache
def _sizes() -> list[tuple[str, int, int]]:
    """(name, lines, limit) of every module and function: ``path`` or ``path:function``."""
    sizes = []
    for folder in FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            name = path.relative_to(REPO_ROOT).as_posix()
            sizes.append((name, len(source.splitlines()), MODULE_LINES))
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    sizes.append((f"{name}:{node.name}", lines, FUNCTION_LINES))
    return sizes


def test_no_module_over_600_lines_and_no_function_over_60() -> None:
    over = {name: f"{lines} lines" for name, lines, limit in _sizes() if lines > limit}
    assert not over, (
        f"over the size limits (a module {MODULE_LINES} lines, a function {FUNCTION_LINES}; "
        f"issue 38: one concept per module, one step per function): {over}. Split the module "
        "into a package with private modules, the function into named steps"
    )


def test_the_walk_sees_every_folder_module_and_method() -> None:
    """An empty walk (a wrong root) would pass the test above: it sees what is there."""
    names = {name for name, _lines, _limit in _sizes()}
    assert {name.split("/")[0] for name in names} == set(FOLDERS)
    assert {"flows/cli/__init__.py", "flows/cli/_flags.py:parse_parameters"} <= names
    assert "integrations/serving/_batch_scoring.py:__call__" in names  # BatchScorer's, a method
