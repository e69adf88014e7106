"""One name per file: the checkout imports its modules as ``prefect_ml.*`` only.

The folders flows/, tasks/ and integrations/ sit at the top of the repository (DESIGN.md) and
``prefect_ml/`` links to them, so from the checkout's root ``import tasks.params`` would also
work and load a second copy of ``prefect_ml.tasks.params``: two module objects, two sets of
globals, classes that are not each other. Ruff refuses such an import where it is written
(``flake8-tidy-imports.banned-api`` in pyproject.toml); this test catches the ones no linter
sees: a name built at run time (``import_module``, a plug-in, a pickled reference).
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT

# Every module of the package, the tests' helpers and the examples, in a fresh interpreter whose
# path starts at the checkout's root (where the second names would resolve).
PROBE = """
import importlib, pkgutil, sys
import prefect_ml, examples
names = [
    module.name
    for package in (prefect_ml, examples)
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
]
for name in [*names, "tests.helpers", "tests.conftest"]:
    importlib.import_module(name)
print(len(names))
second = [n for n in sys.modules if n.partition(".")[0] in ("flows", "tasks", "integrations")]
print(" ".join(sorted(second)))
"""


def test_the_checkout_imports_each_module_under_its_prefect_ml_name_only() -> None:
    run = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    count, second_names = run.stdout.splitlines()[-2:]
    assert int(count) > 100, "every module of the package was imported"
    assert not second_names, f"imported under a second name: {second_names}"
